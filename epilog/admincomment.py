"""The job's AdminComment: gpuguard's verdict where ``sacct`` can show it to anyone Slurm lets see the job.

Written once per judgment by the job judge on the controller through
``sacctmgr -i modify job where jobid=N set AdminComment=...`` (``scontrol`` refuses a
finished job: SLURM-FACTS.md §6c). Format ``v2``::

    gpuguard:v2z:<unpadded lower-case base32 of zlib(JSON)>

``sacctmgr`` lower-cases values and turns ``"`` into backticks (seen on the testbed), so
the text must survive both: base32 is case-insensitive and needs no padding. The JSON,
compact keys on purpose (slurmdbd keeps at most 65,535 bytes; typical jobs stay under
1 kB: ``bench/cluster_judge.py`` prints the sizes for 1, 8 and 64 nodes)::

    {"v": 2, "j": "42", "c": cause, "s": "judged"|"learning", "t": template,
     "m": one-line summary (<= 160 chars), "b": baseline runs,
     "g"?: the run's GPU model (the baseline's runs ran on it; absent when not known),
     "e": headline evidence {"node"?, "gpus"?: [[node, gpu, metric, rel]], "reasons"?,
          "flag"?: [[metric, value, baseline median, rel]], "text"?},
     "n": {node: [gpus, util_mean_pct, power_mean_w, sm_clock_mean_mhz, temp_max_c,
                  mem_peak_mib, step_p50_s, [per-GPU util_mean_pct, ...]]},
     "x": [nodes whose part never arrived]}

:data:`NODE_FIELDS` names the positions of ``n``. Decode with ``gpuguard job show`` or::

    sacct -n -P -X -o AdminComment -j JOBID | python3 -c 'import sys,base64,zlib;\\
    s=sys.stdin.read().strip().split(":",2)[2].upper();\\
    print(zlib.decompress(base64.b32decode(s+"="*(-len(s)%8))).decode())'

The ``v1``/``v1z`` texts of earlier versions (whole node summaries) still decode.
"""

from __future__ import annotations

import base64
import functools
import json
import zlib
from collections.abc import Mapping
from typing import Any

PREFIX_V2 = "gpuguard:v2z:"
PREFIX_V1 = "gpuguard:v1:"
PREFIX_V1Z = "gpuguard:v1z:"
#: slurmdbd stores AdminComment in a TEXT column: 65,535 bytes (SLURM-FACTS §6c).
ADMIN_COMMENT_MAX = 65535
#: Positions of the per-node list ``n[node]``.
NODE_FIELDS = ("gpus", "gpu_util_mean_pct", "power_mean_w", "sm_clock_mean_mhz", "temp_max_c",
               "mem_used_peak_mib", "step_time_p50_s", "gpu_util_pct_per_gpu")
SUMMARY_MAX = 160


def _num(v: Any, nd: int = 1) -> Any:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return round(float(v), nd) if v == v and abs(v) < 1e300 else None


def headline(verdict: Mapping[str, Any]) -> dict[str, Any]:
    """The few numbers that explain the cause (the verdict's full evidence stays in the
    cluster store): the named node, up to 4 straggling GPUs, active slowdown reasons, up
    to 4 flagged metrics and the evidence's one-line text."""
    ev = verdict.get("evidence") or {}
    out: dict[str, Any] = {}
    if isinstance(ev.get("node"), str):
        out["node"] = ev["node"]
    gpus = [[g.get("node"), g.get("gpu_index"), g.get("metric"), _num(g.get("rel_change"), 3)]
            for g in (ev.get("gpus") or [])[:4] if isinstance(g, dict)]
    if gpus:
        out["gpus"] = gpus
    if isinstance(ev.get("reasons"), dict):
        out["reasons"] = {k: _num(v, 2) for k, v in list(ev["reasons"].items())[:4]}
    flag = [[c.get("metric"), _num(c.get("value"), 4), _num(c.get("median"), 4), _num(c.get("rel_change"), 3)]
            for c in verdict.get("comparisons") or [] if isinstance(c, dict) and c.get("flagged")][:4]
    if flag:
        out["flag"] = flag
    if isinstance(ev.get("text"), str):
        out["text"] = ev["text"][:200]
    return out


def node_figures(summary: Mapping[str, Any] | None) -> list[Any]:
    """:data:`NODE_FIELDS` of one node's summary (``JobSummary.to_dict()``)."""
    s = summary or {}
    gpus = [g for g in s.get("gpus") or [] if isinstance(g, dict)]
    per_gpu = [None if _num(g.get("gpu_util_mean_pct")) is None else round(g["gpu_util_mean_pct"]) for g in gpus]
    return [len(gpus), _num(s.get("gpu_util_mean_pct")), _num(s.get("power_mean_w")),
            _num(s.get("sm_clock_mean_mhz"), 0), _num(s.get("temp_max_c")), _num(s.get("mem_used_peak_mib"), 0),
            _num(s.get("step_time_p50_s"), 4), per_gpu]


def build(job_id: str, verdict: Mapping[str, Any] | None, summaries: Mapping[str, Mapping[str, Any] | None],
          missing: list[str]) -> dict[str, Any]:
    """The v2 document (module docstring) for a judged job."""
    v = verdict or {}
    doc: dict[str, Any] = {"v": 2, "j": str(job_id)}
    if v:
        doc.update({"c": v.get("cause"), "s": v.get("state"), "t": v.get("template"),
                    "m": (v.get("summary") or "")[:SUMMARY_MAX], "b": v.get("baseline_runs"), "e": headline(v)})
        if v.get("gpu_model"):
            doc["g"] = str(v["gpu_model"])[:200]
    doc["n"] = {n: node_figures(s) for n, s in sorted(summaries.items())}
    if missing:
        doc["x"] = sorted(missing)
    return doc


def encode(doc: Mapping[str, Any]) -> str:
    """``gpuguard:v2z:`` text of ``doc``. When it would pass :data:`ADMIN_COMMENT_MAX`
    (thousands of nodes), per-GPU utilisation is dropped, then the per-node figures."""
    d = dict(doc)
    for step in range(3):
        raw = json.dumps(d, separators=(",", ":"), sort_keys=True, allow_nan=False).encode()
        text = PREFIX_V2 + base64.b32encode(zlib.compress(raw, 9)).decode().rstrip("=").lower()
        if len(text) <= ADMIN_COMMENT_MAX:
            return text
        if step == 0:
            d["n"] = {n: f[:-1] for n, f in d.get("n", {}).items()}
        else:
            d["n"] = {}
            d["trimmed"] = True
    return text


_B32 = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
#: RFC 4648 base32 letters (either case) -> the digits of ``int(text, 32)``
_B32_AS_DIGITS = str.maketrans(_B32 + _B32.lower(), "0123456789abcdefghijklmnopqrstuv" * 2)
_B32_CHARS = frozenset(_B32 + _B32.lower())


def _b32decode(body: str) -> bytes:
    """RFC 4648 base32 without padding (``encode``'s form, either case) -> bytes, as
    ``base64.b32decode`` of the padded upper-case text gives them, through ``int(.., 32)``
    (C speed: ``base64.b32decode`` is pure Python, ~36 us for a 200-character comment,
    which ``gpuguard report sync`` pays per judged job). Raises ValueError on a character
    outside the alphabet or a length base32 cannot have."""
    n = len(body)
    if n % 8 in (1, 3, 6) or not _B32_CHARS.issuperset(body):
        raise ValueError("not base32")
    nbytes, spare = divmod(n * 5, 8)
    if not n:
        return b""
    # the spare low bits are dropped unread, as base64.b32decode drops them
    return (int(body.translate(_B32_AS_DIGITS), 32) >> spare).to_bytes(nbytes, "big")


def decode(text: str | None) -> dict[str, Any] | None:
    """The document of a gpuguard AdminComment (v2, or the v1/v1z of earlier versions),
    or None when ``text`` is not ours or is damaged."""
    if not text:
        return None
    text = text.strip()
    try:
        for prefix in (PREFIX_V2, PREFIX_V1Z):
            if text.startswith(prefix):
                body = text[len(prefix):]
                if "=" in body:  # padded by hand (encode never pads): the library's rules
                    body = body.upper() + "=" * (-len(body) % 8)
                    raw = base64.b32decode(body)
                else:
                    raw = _b32decode(body)
                doc = json.loads(zlib.decompress(raw))
                return doc if isinstance(doc, dict) else None
        if text.startswith(PREFIX_V1):
            doc = json.loads(text[len(PREFIX_V1):])
            return doc if isinstance(doc, dict) else None
    except (ValueError, zlib.error):
        return None
    return None


@functools.lru_cache(maxsize=4)
def decode_shared(text: str) -> dict[str, Any] | None:
    """:func:`decode` remembered for the last few texts, for readers that only read the
    document (never change it): ``report sync`` reads a judged job's AdminComment twice in
    a row (its template while the row is parsed, its node summaries right after), and one
    decode is about 40 us (base32, zlib, JSON)."""
    return decode(text)


def template_in(text: str | None) -> str | None:
    """The template a judged job's AdminComment names (key ``t``; :func:`build`), sanitised
    again (:func:`gpuguard.epilog.template.sanitize`: an AdminComment is operator-writable),
    or None: not ours (a cheap prefix test first: report sync calls this per job), damaged,
    or no verdict. About 40 us for a judged 4-node job's text (base32, zlib, JSON)."""
    if not text or not text.startswith("gpuguard:v"):
        return None
    from gpuguard.epilog.template import sanitize

    t = (decode_shared(text) or {}).get("t")
    return sanitize(t) if isinstance(t, str) else None


def node_summaries(doc: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``node -> summary-shaped dict`` (``gpu_util_mean_pct``, ``gpus: [{gpu_index,
    gpu_util_mean_pct}]``, ...) from a decoded AdminComment of any version, for
    ``gpuguard report sync``: the efficiency report reads these fields."""
    out: dict[str, dict[str, Any]] = {}
    if doc.get("v") == 2:
        for node, f in (doc.get("n") or {}).items():
            if not isinstance(f, list):
                continue
            f = (f + [None] * len(NODE_FIELDS))[:len(NODE_FIELDS)]
            s = dict(zip(NODE_FIELDS[1:-1], f[1:-1], strict=True))
            per = f[-1] if isinstance(f[-1], list) else []
            s["gpus"] = [{"gpu_index": i, "gpu_util_mean_pct": u} for i, u in enumerate(per)]
            out[str(node)] = s
        return out
    for node, s in (doc.get("nodes") or {}).items():  # v1: whole node summaries
        if isinstance(s, dict):
            out[str(node)] = s
    return out
