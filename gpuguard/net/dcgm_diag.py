"""Saved ``dcgmi diag`` results (text table or ``-j`` JSON) -> :class:`DiagReport`.

Format facts, with their sources:

* The text table is printed by ``dcgmi/Diag.cpp`` (NVIDIA/DCGM, same stencils from 2.2.6
  to 4.6.0): a ``+---+---+`` header with ``| Diagnostic | Result |``, section rules
  ``|-----  Metadata  ---+---|``, ``Deployment``, ``+-----  Hardware  ---+---+``,
  ``Integration``, ``Stress``, one ``| name | result |`` row per test, and a closing
  ``+---+---+`` footer. The table is read by that structure (rules, ``|`` cells, section
  labels), never by test names, so unknown tests and sections of other versions read
  the same.
* Results (``HelperDisplayDiagResult``): ``Pass``, ``Fail``, ``Warn``, ``Skip``,
  ``Not Run``. DCGM 2.x/3.x print per-GPU results as ``Pass - All``, ``Fail - GPU: 0``,
  ``Pass - GPUs: 1, 2`` (more than one row per test when GPUs differ); DCGM 4.x prints
  the test's overall result, then one sub-row per entity ``GPU0: Pass`` (also ``CPU0:``,
  ``GPU_I1:``, ``Switch0:``: ``DcgmFieldsGetEntityGroupString``).
  4.x entity rows print a *Warn* as ``Fail`` (``HelperDisplayDiagResult`` default
  ``DDR_NO_DISPLAY_WARN``), so a ``Fail`` sub-row under a ``Warn`` test is read as Warn.
* ``Warning`` / ``Info`` rows (4.x: ``Warning: GPU0``) carry DCGM's message, cut every
  45 characters (``DATA_INFO_TAG_LEN``) mid-word onto following rows whose name cell is
  empty; the cut is undone exactly (a piece is re-padded to the cut width, so a space
  that fell at a cut is kept). The width is taken from the table's rule when one is
  present. DCGM 2.4 prints some NvLink messages with the GPU prefix twice
  (``GPU 0GPU 0's NvLink link 0 is currently down``, NVIDIA/DCGM#49): read once.
* Metadata (3.3+, NVIDIA/go-dcgm#52, NVIDIA/DCGM#198, #253): ``DCGM Version``,
  ``Driver Version Detected``, ``GPU Device IDs Detected`` (``2321,2321`` in 3.3.7,
  ``26b9, 26b9`` in 4.2.3); older tables have none (NVIDIA/DCGM#55).
* Pastes are often partial (corpus INDEX.md section 5): a head without the footer, a
  fragment starting mid-message, a last wrapped row without its closing ``|``, a
  ``...`` elision. Each is reported in :attr:`DiagReport.problems`; text before the
  first test is kept in :attr:`DiagReport.orphans`. A run that failed prints dcgmi's
  ``Error: ...`` line instead of a table (``HelperDisplayFailureMessage``): kept as the
  reason.
* JSON (``dcgmi diag -j``; keys from ``nvvs/include/NvvsJsonStrings.h`` and
  ``testing/python3/dcgm_diag_schema.json``): 2.x/3.x ``{"DCGM GPU Diagnostic":
  {"test_categories": [{"category", "tests": [{"name", "results": [{"gpu_id": "0",
  "status", "warnings": [{"warning", "error_id", ...}], "info"}]}]}]}, "version",
  "Driver Version Detected", "GPU Device IDs"}``; 4.x ``{"DCGM Diagnostic": {...
  "results": [{"entity_group": "GPU", "entity_id": 0, "status", "warnings", "info":
  [...]}], "test_summary": {"status"}}, "metadata": {"version", "Driver Version
  Detected"}, "entity_groups": [{"entity_group": "GPU", "entities": [{"entity_id",
  "device_id"}]}]}``; ``-i N`` runs wrap them in ``{"iterations": [...]}``; a run that
  could not start is ``{"DCGM ...": {"runtime_error": "..."}}``. 3.x Deployment entries
  name the message key ``warnings`` instead of ``warning`` (``HelperJsonAddBasicTests``):
  both are read.
* ``-j`` prints a *Warn* result as ``Fail`` (3.x ``HelperDisplayDiagResult`` returns Fail
  for all but Pass/Skip; 4.x JSON uses its default ``DDR_NO_DISPLAY_WARN``, the table the
  ``DDR_DISPLAY_WARN`` test row): a ``Fail`` whose warnings all carry a workable
  ``error_severity`` (``dcgm_errors.h``: 1 monitor, 5 config) is read as Warn. The 4.x
  ``test_summary`` repeats the test's warnings and holds those of no entity: read too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from gpuguard.inputs import json_loads

#: Result words, as ``HelperDisplayDiagResult`` prints them.
RESULTS = ("Pass", "Fail", "Warn", "Skip", "Not Run")
#: Characters of a message per table row (``DATA_INFO_TAG_LEN`` in ``dcgmi/Diag.cpp``).
WRAP_CHARS = 45

_RESULT_CELL = re.compile(r"^(Pass|Fail|Warn|Skip|Not Run)(?:\s*-\s*(?:(All)|GPUs?\s*:\s*([\d,\s]+?)))?\s*$")
_ENTITY_CELL = re.compile(r"^([A-Za-z][A-Za-z_]*)\s?(\d+)\s*:\s*(Pass|Fail|Warn|Skip|Not Run)\s*$")
_SECTION = re.compile(r"^[+|]-{2,}\s+([A-Za-z][A-Za-z ]*?)\s+-*\+-*[+|]?$")
_RULE = re.compile(r"^\+[-=]+(\+[-=]+)*\+?$")
_MESSAGE_NAME = re.compile(r"^(Warning|Info)(?:\s*:\s*([A-Za-z][A-Za-z_]*)\s?(\d+))?$")
_DUP_PREFIX = re.compile(r"\bGPU (\d+)GPU \1(?=\D|$)")
_GPU_IN_TEXT = re.compile(r"\bGPU\s?(\d+)\b")
#: the top-level key of a ``-j`` document (NvvsJsonStrings.h ``NVVS_NAME``, 2.x-3.x / 4.x)
_JSON_KEY = re.compile(r'"DCGM (?:GPU )?Diagnostic"\s*:')


class DiagFormatError(ValueError):
    """Input that is not ``dcgmi diag`` output at all (``str()``: one line)."""


@dataclass
class DiagMessage:
    """One Warning/Info message, rejoined. ``gpu``: the GPU it names (4.x name cell
    ``Warning: GPU0``, else the first ``GPU N`` in the text), or None. ``truncated``:
    the paste ends (or is elided) inside it."""

    kind: str
    text: str
    gpu: int | None = None
    truncated: bool = False


@dataclass
class DiagTest:
    """One test (plugin). ``status``: the overall result word (one of :data:`RESULTS`,
    or ``"?"`` when the cell could not be read); ``per_gpu``: GPU index -> result;
    ``all_gpus``: the result of a ``- All`` cell; ``entities``: non-GPU entity results
    (4.x ``CPU0: Pass``); ``cells``: the result cells as printed."""

    name: str
    category: str | None
    status: str
    per_gpu: dict[int, str] = field(default_factory=dict)
    all_gpus: str | None = None
    entities: dict[str, str] = field(default_factory=dict)
    messages: list[DiagMessage] = field(default_factory=list)
    cells: list[str] = field(default_factory=list)


@dataclass
class DiagReport:
    """A parsed ``dcgmi diag`` run. ``metadata``: the Metadata block as printed
    (JSON keys renamed to the table's); ``complete``: the closing rule (text) or a
    whole document (JSON) was read; ``problems``: one line each, what could not be read."""

    metadata: dict[str, str] = field(default_factory=dict)
    tests: list[DiagTest] = field(default_factory=list)
    orphans: list[DiagMessage] = field(default_factory=list)
    complete: bool = False
    problems: list[str] = field(default_factory=list)
    fmt: str = "text"

    @property
    def device_ids(self) -> list[str]:
        """``GPU Device IDs Detected`` split (``2321,2321`` and ``26b9, 26b9`` alike)."""
        raw = self.metadata.get("GPU Device IDs Detected", "")
        return [x.strip() for x in raw.split(",") if x.strip()]


def parse(text: str) -> DiagReport:
    """Parse ``dcgmi diag`` text or ``-j`` JSON. Raises :class:`DiagFormatError` for
    JSON that is not a diag document; a table that is only partly readable is returned
    with :attr:`DiagReport.problems` filled."""
    if text.lstrip().startswith("{") or _JSON_KEY.search(text[:8192]):
        return parse_json(text)
    return parse_text(text)


# --- text table ------------------------------------------------------------------------
@dataclass
class _State:
    rep: DiagReport
    wrap: int = WRAP_CHARS
    section: str | None = None
    test: DiagTest | None = None
    msg: list[str] | None = None  # pieces of the message being read
    msg_head: tuple[str, int | None] | None = None
    in_table: bool = False


def parse_text(text: str) -> DiagReport:
    """Read the text table (see the module docstring)."""
    st = _State(DiagReport())
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if _SECTION.match(line):
            _end_message(st)
            st.section, st.test, st.in_table = _SECTION.match(line).group(1).strip(), None, True
            _take_width(st, line)
            continue
        if _RULE.match(line):
            _end_message(st)
            _take_width(st, line)
            if st.in_table and (st.rep.tests or st.rep.metadata) and "=" not in line:
                # the footer: what follows (a shell prompt, the next iteration's banner) is not the table
                st.rep.complete, st.in_table, st.section, st.test = True, False, None, None
            else:
                st.in_table = True
            continue
        if line.startswith("|") and "|" in line[1:]:
            st.in_table = True
            _row(st, line, n)
            continue
        _other(st, line, n)
    # a paste that stops (no footer) on a full-width piece was cut inside the message
    cut = not st.rep.complete and st.msg is not None and len(st.msg[-1].rstrip()) >= st.wrap - 1
    _end_message(st, truncated=cut)
    if st.rep.orphans and st.rep.orphans[0].kind == "?":
        st.rep.problems.append(f"the paste starts inside a message ({st.rep.orphans[0].text[:40]!r}...): "
                               "the test it belongs to is not in it")
    if not st.rep.tests:
        st.rep.problems.append("no dcgmi diag result row could be read")
    elif not st.rep.complete:
        st.rep.problems.append("the table ends early (no closing +---+ rule): tests after the last row were not seen")
    return st.rep


def _take_width(st: _State, line: str) -> None:
    # +---27---+---48---+ : the value cell is one space, the 46-wide field, one space;
    # DCGM cuts messages one short of the field (45 of 46).
    cols = re.split(r"[+|]", line.strip("+|"))
    if len(cols) >= 2 and len(cols[-1]) > 4:
        st.wrap = len(cols[-1]) - 3


def _other(st: _State, line: str, n: int) -> None:
    if line.startswith("Successfully ran diagnostic"):
        return
    if line.startswith(("Error:", "Aborting")):  # dcgmi's own failure lines (Diag.cpp)
        st.rep.problems.append(f"line {n}: dcgmi: {line[:200]}")
        return
    if set(line) <= {".", " ", "…"}:
        if st.msg is not None:
            _end_message(st, truncated=True)
        st.rep.problems.append(f"line {n}: elision '{line}': rows left out of the paste")
        return
    if st.in_table:
        _end_message(st)
        st.rep.problems.append(f"line {n}: not a table row: {line[:80]!r}")


def _row(st: _State, line: str, n: int) -> None:
    name, value = _cells(line)
    if st.section and st.section.lower() == "metadata" and name:
        _end_message(st)
        st.rep.metadata[name] = value.strip()
        return
    if name == "Diagnostic" and value.strip() == "Result":
        st.rep.complete = False  # a new table (dcgmi diag --iterations prints one per run)
        return
    m = _MESSAGE_NAME.match(name)
    if m:
        _end_message(st)
        gpu = int(m.group(3)) if m.group(2) and m.group(2).upper() == "GPU" else None
        st.msg, st.msg_head = [value], (m.group(1), gpu)
        return
    if not name:
        _continuation(st, value, n)
        return
    _end_message(st)
    st.test = DiagTest(name=name, category=st.section, status="?")
    st.rep.tests.append(st.test)
    _result_cell(st, value.strip(), n)


def _cells(line: str) -> tuple[str, str]:
    """``(name, value)`` of a row; the value keeps its spacing (one leading space and the
    closing ``|``, when present, removed) so wrapped messages rejoin exactly."""
    body = line[1:]
    name, _, value = body.partition("|")
    if value.endswith("|"):
        value = value[:-1]
    if value.startswith(" "):
        value = value[1:]
    return name.strip(), value


def _continuation(st: _State, value: str, n: int) -> None:
    cell = value.strip()
    # Inside a message only a 4.x entity row (``GPU1: Pass``) ends it: DCGM prints result
    # rows before the messages of a test, and a 45-character piece is rarely that shape.
    if _ENTITY_CELL.match(cell) or (st.msg is None and _RESULT_CELL.match(cell)):
        _end_message(st)
        if st.test is None:
            st.rep.problems.append(f"line {n}: result {cell!r} with no test before it")
        else:
            _result_cell(st, cell, n)
        return
    if st.msg is not None:
        st.msg.append(value)
    elif st.test is None:  # a fragment that starts inside a message
        st.msg, st.msg_head = [value], ("?", None)
    else:  # e.g. 3.x ``  Code: (000000000000)`` under a Warn Diagnostic row
        st.test.cells.append(cell)


def _end_message(st: _State, truncated: bool = False) -> None:
    if st.msg is None or st.msg_head is None:
        return
    pieces = [p.rstrip() for p in st.msg]
    # every piece but the last is exactly `wrap` characters; padding hid trailing spaces
    text = "".join(p.ljust(st.wrap) for p in pieces[:-1]) + pieces[-1]
    kind, gpu = st.msg_head
    msg = make_message(kind, text, gpu, truncated)
    (st.test.messages if st.test is not None else st.rep.orphans).append(msg)
    st.msg = st.msg_head = None


def make_message(kind: str, text: str, gpu: int | None = None, truncated: bool = False) -> DiagMessage:
    """A :class:`DiagMessage` with DCGM 2.4's doubled ``GPU NGPU N`` prefix undone and the
    GPU taken from the text when the row did not name it."""
    text = _DUP_PREFIX.sub(r"GPU \1", text.strip())
    if gpu is None:
        m = _GPU_IN_TEXT.search(text)
        gpu = int(m.group(1)) if m else None
    return DiagMessage(kind, text, gpu, truncated)


def _result_cell(st: _State, cell: str, n: int) -> None:
    t = st.test
    assert t is not None
    t.cells.append(cell)
    m = _ENTITY_CELL.match(cell)
    if m:
        kind, idx, word = m.group(1), int(m.group(2)), m.group(3)
        if word == "Fail" and t.status == "Warn":
            word = "Warn"  # 4.x prints an entity's Warn as Fail (see the module docstring)
        if kind.upper() == "GPU":
            t.per_gpu[idx] = word
        else:
            t.entities[f"{kind}{idx}"] = word
        return
    m = _RESULT_CELL.match(cell)
    if not m:
        t.status = "?"
        st.rep.problems.append(f"line {n}: {t.name}: result {cell[:60]!r} not understood")
        return
    word, every, gpus = m.groups()
    if every:
        t.all_gpus = word
    elif gpus:
        for g in re.findall(r"\d+", gpus):
            t.per_gpu[int(g)] = word
    if t.status == "?" or rank(word) > rank(t.status):
        t.status = word


def rank(word: str) -> int:
    """Badness of a result word: Fail 3, Warn 2, Pass/Skip/Not Run 0 (unknown 1)."""
    return {"Fail": 3, "Warn": 2, "Pass": 0, "Skip": 0, "Not Run": 0}.get(word, 1)


# --- JSON (dcgmi diag -j) --------------------------------------------------------------
def parse_json(text: str) -> DiagReport:
    """Read ``dcgmi diag -j`` output (see the module docstring for the schema)."""
    # a paste may carry the command line before the document and a prompt after it
    start, end = text.find("{"), text.rfind("}")
    try:
        doc = json_loads(text[start:end + 1] if 0 <= start < end else text)
    except ValueError as e:
        raise DiagFormatError(f"not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise DiagFormatError("JSON document is not an object")
    rep = DiagReport(fmt="json", complete=True)
    runs = doc.get("iterations") if isinstance(doc.get("iterations"), list) else [doc]
    for i, run in enumerate(runs):
        if not isinstance(run, dict):
            rep.problems.append(f"iteration {i}: not an object")
            continue
        _json_run(run, rep, f"iteration {i + 1}: " if len(runs) > 1 else "")
    if isinstance(doc.get("Overall Result"), str) and doc.get("Overall Result") != "Pass":
        rep.problems.append(f"iterations: Overall Result {doc['Overall Result']}: {doc.get('warning', '')}".strip())
    if not rep.tests and not rep.problems:
        rep.problems.append("no test results in the JSON document")
    return rep


def _json_run(run: dict[str, Any], rep: DiagReport, where: str) -> None:
    body = run.get("DCGM Diagnostic", run.get("DCGM GPU Diagnostic"))
    if not isinstance(body, dict):
        raise DiagFormatError("no 'DCGM Diagnostic' / 'DCGM GPU Diagnostic' object: not dcgmi diag -j output")
    if body.get("runtime_error"):
        rep.problems.append(f"{where}dcgmi diag did not run: {body['runtime_error']}")
    _json_metadata(run, rep)
    for cat in body.get("test_categories") or []:
        if not isinstance(cat, dict):
            continue
        for t in cat.get("tests") or []:
            if isinstance(t, dict) and t.get("name"):
                rep.tests.append(_json_test(t, str(cat.get("category") or "") or None, rep, where))


def _json_metadata(run: dict[str, Any], rep: DiagReport) -> None:
    meta = run.get("metadata") if isinstance(run.get("metadata"), dict) else run
    if meta.get("version"):
        rep.metadata["DCGM Version"] = str(meta["version"])
    if meta.get("Driver Version Detected"):
        rep.metadata["Driver Version Detected"] = str(meta["Driver Version Detected"])
    ids = run.get("GPU Device IDs")
    if not isinstance(ids, list):
        ids = [e.get("device_id") for g in run.get("entity_groups") or [] if isinstance(g, dict)
               and g.get("entity_group") == "GPU" for e in g.get("entities") or [] if isinstance(e, dict)]
    if ids:
        rep.metadata["GPU Device IDs Detected"] = ", ".join(str(x) for x in ids)


#: ``dcgmErrorSeverity_t`` values (``dcgmlib/dcgm_errors.h``) that mean the GPU can go on
#: working: 1 DCGM_ERROR_MONITOR ("Can perform workload, but needs to be monitored"),
#: 5 DCGM_ERROR_CONFIG ("This error can be configured").
_SOFT_SEVERITIES = (1, 5)


def _json_word(word: str, warnings: list[Any]) -> str:
    """The result a JSON ``status`` stands for. dcgmi prints a *Warn* result as ``Fail``
    in ``-j`` output (``HelperDisplayDiagResult``: 3.x returns Fail for all but Pass/Skip;
    4.x ``HelperJsonAddResult`` and the test summary use the default
    ``DDR_NO_DISPLAY_WARN``, and DCGM's dcgmi/tests/DiagTests.cpp asserts that a WARN test's
    summary reads "Fail"), where the text table says ``Warn``. A ``Fail`` whose every
    warning carries an ``error_severity`` DCGM calls workable (:data:`_SOFT_SEVERITIES`:
    persistence mode off, a CUDA env variable, clock events) is read as ``Warn``; one
    with any isolate / reset / triage / unknown severity, or without severities, stays
    ``Fail``."""
    if word != "Fail" or not warnings:
        return word
    sev = [w.get("error_severity") if isinstance(w, dict) else None for w in warnings]
    if all(isinstance(v, int) and not isinstance(v, bool) and v in _SOFT_SEVERITIES for v in sev):
        return "Warn"
    return word


def _warning_text(w: Any) -> str:
    if isinstance(w, dict):
        w = w.get("warning", w.get("warnings", ""))
    return str(w)


def _json_test(t: dict[str, Any], category: str | None, rep: DiagReport, where: str) -> DiagTest:
    summary = t.get("test_summary") if isinstance(t.get("test_summary"), dict) else {}
    summary_warnings = summary.get("warnings") if isinstance(summary.get("warnings"), list) else []
    status = _json_word(str(summary.get("status") or "?"), summary_warnings) if summary.get("status") else "?"
    out = DiagTest(name=str(t["name"]), category=category, status=status)
    for r in t.get("results") or []:
        if not isinstance(r, dict):
            continue
        warnings = r.get("warnings") if isinstance(r.get("warnings"), list) else []
        word = _json_word(str(r.get("status", "?")), warnings)
        gpu = _json_gpu(r)
        out.cells.append(str(r.get("status", "?")))
        if word not in RESULTS:
            rep.problems.append(f"{where}{out.name}: result {word[:60]!r} not understood")
        if gpu is not None:
            out.per_gpu[gpu] = word
        elif r.get("entity_group"):
            out.entities[f"{r['entity_group']}{r.get('entity_id', '')}"] = word
        if not summary.get("status") and (out.status == "?" or rank(word) > rank(out.status)):
            out.status = word
        for w in warnings:
            out.messages.append(make_message("Warning", _warning_text(w), gpu))
        infos = r.get("info") or []
        for info in [infos] if isinstance(infos, str) else infos:
            out.messages.append(make_message("Info", str(info), gpu))
    # 4.x: the summary repeats every warning of the test and adds those of no entity
    # (printed as the test's own Warning rows in the table), and the info of no entity
    seen = {m.text for m in out.messages}
    for w in summary_warnings:
        m = make_message("Warning", _warning_text(w))
        if m.text not in seen:
            seen.add(m.text)
            out.messages.append(m)
    infos = summary.get("info") or []
    for info in [infos] if isinstance(infos, str) else infos:
        m = make_message("Info", str(info))
        if m.text not in seen:
            seen.add(m.text)
            out.messages.append(m)
    if out.status not in RESULTS:
        rep.problems.append(f"{where}{out.name}: no result")
    return out


def _json_gpu(r: dict[str, Any]) -> int | None:
    if "gpu_id" in r:
        try:
            return int(r["gpu_id"])
        except (TypeError, ValueError):
            return None
    if r.get("entity_group") == "GPU" and isinstance(r.get("entity_id"), int):
        return r["entity_id"]
    return None
