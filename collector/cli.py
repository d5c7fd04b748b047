"""The collector's command line: ``python -m gpuguard.collector.run --job-id N ...`` (the
options, the config, the sources and the signal handling around
:class:`gpuguard.collector.run.Collector`; the module docstring of
:mod:`gpuguard.collector.run` says what it does).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Any

from gpuguard.durations import argparse_type

#: Hard cap on a collector's lifetime (s; our choice: 30 days, beyond Slurm's usual MaxTime).
DEFAULT_MAX_RUNTIME_S = 30 * 86400.0


def build_parser() -> argparse.ArgumentParser:
    """The collector's options."""
    p = argparse.ArgumentParser(prog="python -m gpuguard.collector.run",
                                description="The per-job collector: samples the job's GPUs and cgroup into the store.")
    p.add_argument("--job-id", required=True, help="Slurm job id")
    p.add_argument("--gpus", default="", help="job GPUs: indices or GPU- UUIDs, comma-separated")
    p.add_argument("--uid", type=int, default=None, help="job user's uid (for the /proc fallback)")
    p.add_argument("--node", default=None, help="node name (default: from the config)")
    p.add_argument("--config", default=None, help="gpuguard.toml (default: the usual search)")
    positive_s, seconds = argparse_type("seconds", positive=True), argparse_type("seconds")  # finite, in range
    p.add_argument("--interval-s", type=positive_s, default=None, help="override [collector] interval_s")
    p.add_argument("--flush-s", type=positive_s, default=None, help="override [collector] flush_s")
    p.add_argument("--liveness-s", type=positive_s, default=15.0, help="seconds between job-liveness checks")
    p.add_argument("--startup-grace-s", type=seconds, default=120.0,
                   help="how long no job process/cgroup is tolerated at the start")
    p.add_argument("--scontrol-every-s", type=seconds, default=30.0, help="at most one scontrol call per this")
    p.add_argument("--no-scontrol", action="store_true", help="never ask scontrol")
    p.add_argument("--no-evidence-s", type=positive_s, default=600.0,
                   help="exit when no probe has shown the job alive for this long")
    p.add_argument("--max-runtime-s", type=positive_s, default=DEFAULT_MAX_RUNTIME_S, help="hard cap on the lifetime")
    p.add_argument("--cgroup-root", default="/sys/fs/cgroup", help="cgroup mount root")
    p.add_argument("--job-cgroup", action="append", default=None,
                   help="the job's cgroup directory (repeatable; skips discovery)")
    return p


def _stop_on_signals() -> tuple[threading.Event, list[str]]:
    """Install SIGTERM/SIGINT handlers that set the returned event and record why in the
    returned list (SIGHUP is ignored: the collector outlives the Prolog's session)."""
    stop = threading.Event()
    why: list[str] = []

    def on_signal(signum: int, _frame: Any) -> None:
        why.append(f"stopped by {signal.Signals(signum).name}")
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    return stop, why


def main(argv: list[str] | None = None) -> int:
    """Run the collector for ``argv`` (default ``sys.argv[1:]``); exit status 0, 2 for bad
    arguments or config (module docstring of :mod:`gpuguard.collector.run`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--supervise" in argv:  # the prolog starts the collector under its supervisor
        from gpuguard.collector.supervise import supervise

        argv.remove("--supervise")
        return supervise(argv)
    # Handlers first: a SIGTERM from a quick epilog during start-up still ends in a clean
    # exit 0 (before this line nothing has been sampled, so the default action loses nothing).
    stop, why = _stop_on_signals()
    args = build_parser().parse_args(argv)
    from gpuguard.collector.host import HostSampler
    from gpuguard.collector.liveness import JobLiveness
    from gpuguard.collector.run import Collector
    from gpuguard.collector.ingest_tail import record_ingest_tick
    from gpuguard.collector.jobdir_cap import job_dir_cap_check
    from gpuguard import config as config_mod
    from gpuguard import log as log_mod

    if not (args.job_id.isascii() and args.job_id.isdigit()) or len(args.job_id) > 20:
        print(f"gpuguard collector: bad --job-id {args.job_id!r}", file=sys.stderr)
        return 2
    try:
        cfg = config_mod.load(args.config)
    except config_mod.ConfigError as e:
        print(f"gpuguard collector: {e}", file=sys.stderr)
        return 2
    log = log_mod.setup(cfg.get("paths", "log_file"), "collector", args.job_id)
    node = args.node or cfg.node_name
    from gpuguard.collector import schema  # noqa: F401  (registers the "collector" store migration set)
    from gpuguard.gpu import open_source
    from gpuguard.store import open_store

    kind = cfg.get("gpu", "source")

    def make_source() -> Any:
        return open_source(kind, replay_path=cfg.get("gpu", "replay_path"),
                           call_timeout_s=cfg.get("gpu", "call_timeout_s"),
                           total_budget_s=max(1.0, cfg.get("collector", "interval_s")))

    try:
        source = make_source()
    except Exception as e:  # bad replay file: keep host sampling
        log.error("tool error: GPU source: %s", e)
        source = None
    host = HostSampler(args.job_id, node, uid=args.uid, cgroup_root=args.cgroup_root, dirs=args.job_cgroup)
    scontrol = None
    if not args.no_scontrol:
        cand = os.path.join(cfg.get("slurm", "bin_dir"), "scontrol")
        scontrol = cand if os.access(cand, os.X_OK) else None
    liveness = JobLiveness(host, job_id=args.job_id, scontrol=scontrol, startup_grace_s=args.startup_grace_s,
                           scontrol_every_s=args.scontrol_every_s, no_evidence_s=args.no_evidence_s)
    gpus = args.gpus if source is not None else ""
    coll = Collector(
        job_id=args.job_id, node=node, source=source, gpus=gpus, host=host, liveness=liveness,
        open_store=lambda: open_store(cfg.store_path),
        interval_s=args.interval_s or cfg.get("collector", "interval_s"),
        flush_s=args.flush_s or cfg.get("collector", "flush_s"),
        liveness_s=args.liveness_s, max_runtime_s=args.max_runtime_s,
        xid_source_factory=make_source if kind == "nvml" else None, log=log,
        job_dir_check=job_dir_cap_check(cfg, args.job_id, log),
        spill_path=os.path.join(cfg.get("paths", "state_dir"), f"collector.{args.job_id}.spill.jsonl"),
        record_ingest=record_ingest_tick(cfg, args.job_id, node, args.uid, log),
    )

    coll.stop_event = stop
    coll.exit_reason_fn = lambda: why[0] if why else ""
    try:
        return coll.run()
    finally:
        if source is not None:
            source.close()


