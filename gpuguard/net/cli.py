"""``gpuguard nccl`` commands: run the probe once, show a node's NCCL baseline.

Parsing saved outputs is ``gpuguard check --from-file`` (one way to triage a paste).
"""

from __future__ import annotations

import sys
from typing import Any

import click

from gpuguard.clitypes import POSITIVE_SECONDS
from gpuguard.output import display_tz, emit, iso_time, isoify, output_options


def _store(cfg: Any, create: bool) -> Any:
    from gpuguard.store import StoreError, open_store

    try:
        return open_store(cfg.store_path, create=create)
    except StoreError as e:
        if create:
            raise click.ClickException(str(e)) from None
        return None


@click.group("nccl")
def nccl() -> None:
    """NCCL bandwidth probe and the node's NCCL baseline."""


@nccl.command("probe")
@click.option("--record/--no-record", default=True, show_default=True,
              help="store the reading (part of the baseline when healthy) like gpuguard health does")
@click.option("--timeout", "timeout_s", type=POSITIVE_SECONDS, help="seconds (default: [nccl] timeout_s)")
@output_options()
@click.pass_obj
def probe(obj: Any, record: bool, timeout_s: float | None, fmt: str) -> None:
    """Run the configured probe (default ``all_reduce_perf``) once, judge it against the
    node's baseline and the fleet, print the findings (csv: busbw per message size).

    Exit status: 0 healthy, 1 warning (a low reading not yet confirmed N times, a tool
    fault), 2 critical (``nccl.busbw_low``, ``nccl.errors``). Drains nothing: the
    decision is ``gpuguard health``'s or the Prolog's.
    """
    from gpuguard.net.nccl_check import probe_node
    from gpuguard.policy import decide

    cfg = obj.cfg
    store = _store(cfg, record)
    out = probe_node(cfg, store, hook="cli", budget_left_s=None if timeout_s is None else timeout_s + 2.0,
                     record=record)
    d = decide(out.findings, cfg.policy, cfg.xid_policy)
    rows = [{"size_b": size, "busbw_gbs": bw} for size, bw in sorted(out.reading.items())]

    def text() -> str:
        lines = [f"state: {out.state}" + (f" ({out.gpu_model})" if out.gpu_model else "")]
        lines += [f"  {r['size_b']:>12} B  busbw {r['busbw_gbs']:8.2f} GB/s" for r in rows]
        if out.judgement and out.judgement.ratio:
            lines.append("vs baseline: " + ", ".join(f"{k} {v:.0%}" for k, v in out.judgement.ratio.items()))
        lines += [f"{f.severity:8} {a:6} {f.code}  {f.message}" for f, a in d.actions]
        return "\n".join(lines)

    emit(fmt, {"state": out.state, "gpu_model": out.gpu_model, "consecutive_low": out.consecutive,
               "busbw_gbs_by_size": {str(r["size_b"]): r["busbw_gbs"] for r in rows},
               "judgement": out.judgement.__dict__ if out.judgement else None,
               "findings": [dict(f.to_dict(), action=a) for f, a in d.actions], "tool_errors": out.tool_errors},
         rows=rows, headers=["size_b", "busbw_gbs"], text=text)
    if fmt != "json":
        for e in out.tool_errors:
            click.echo(f"tool error: {e}", err=True)
    if store is not None:
        store.close()
    sev = {f.severity for f in out.findings}
    sys.exit(2 if "critical" in sev else 1 if "warning" in sev or out.state == "failed" else 0)


@nccl.command("baseline")
@click.option("--node", "node_name", help="node (default: this node)")
@output_options()
@click.pass_obj
def baseline(obj: Any, node_name: str | None, fmt: str) -> None:
    """Show a node's NCCL baseline (median/MAD busbw per message size over its last
    healthy probes) and its last probes (csv: the baseline rows)."""
    from gpuguard.net.nccl_baseline import node_reference
    from gpuguard.store import StoreError, open_readonly

    cfg = obj.cfg
    try:
        store = open_readonly(cfg.store_path)  # a reader: never migrates or writes the store
    except StoreError:
        raise click.ClickException(f"no store at {cfg.store_path}") from None
    node = node_name or cfg.node_name
    try:
        last = store.query("select at, hook, state, ratio, config_key, gpu_model from nccl_probes where node = ? "
                           "order by at desc, id desc limit 10", [node])
        ref = node_reference(store, node, last[0]["config_key"], cfg.get("nccl", "baseline_probes")) if last else None
    except StoreError:  # no probe has created the table yet: nothing recorded
        last, ref = [], None
    finally:
        store.close()
    rows = [{"size_b": s, "median_gbs": m, "mad_gbs": d, "probes": n}
            for s, (m, d, n) in sorted(ref.by_size.items())] if ref else []
    tz = display_tz(cfg)

    def text() -> str:
        if not last:
            return f"{node}: no NCCL probes recorded"
        lines = [f"{node}: {last[0]['gpu_model'] or 'GPU model unknown'}"]
        lines += [f"  {r['size_b']:>12} B  median {r['median_gbs']:8.3f} GB/s  MAD {r['mad_gbs']:6.3f}  "
                  f"({r['probes']} probes)" for r in rows]
        lines.append("last probes:")
        for r in last:
            ratio = "" if r["ratio"] is None else f"  {r['ratio']:.0%} of baseline"
            when = iso_time(r["at"], tz)
            lines.append(f"  {when}  {r['hook']:8} {r['state']}{ratio}")
        return "\n".join(lines)

    emit(fmt, {"node": node, "baseline": rows, "last_probes": isoify(last, tz)}, rows=rows,
         headers=["size_b", "median_gbs", "mad_gbs", "probes"], text=text)
