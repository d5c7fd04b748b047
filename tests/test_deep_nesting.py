"""Inputs nested deeper than Python's parsers recurse (``a = [[[[...`` in TOML,
``[[[[...`` in JSON, a few thousand levels): tomllib and json raise ``RecursionError``,
which no ``except ValueError`` catches, so such a file gave a traceback (exit 1) or
stopped a spool reader instead of its one-line error. Each reader now refuses it like
any other malformed input."""

from __future__ import annotations

import gzip
import json

import pytest
from click.testing import CliRunner

DEPTH = 100_000


def _deep(key: str) -> str:
    return '{"' + key + '":' + "[" * DEPTH + "]" * DEPTH + "}"


def test_json_loads_refuses_deep_nesting_as_a_decode_error():
    from gpuguard.inputs import TOO_DEEP, json_loads

    with pytest.raises(json.JSONDecodeError) as e:
        json_loads("[" * DEPTH + "]" * DEPTH)
    assert (e.value.msg, e.value.lineno, e.value.colno) == (TOO_DEEP, 1, 1)
    assert json_loads(b'{"a": [[1]]}') == {"a": [[1]]}


def test_a_deeply_nested_config_is_a_one_line_config_error(tmp_path):
    from gpuguard.cli import main

    p = tmp_path / "gpuguard.toml"
    p.write_text("a = " + "[" * DEPTH + "]" * DEPTH + "\n")
    res = CliRunner().invoke(main, ["--config", str(p), "config", "show"])
    assert res.exit_code == 2
    assert res.output == f"Error: {p}: invalid TOML: arrays or tables nested too deep\n"


def test_a_deep_journal_export_line_is_not_an_entry(tmp_path):
    from gpuguard.xid.cli import xid

    p = tmp_path / "export.json"
    real = {"MESSAGE": "NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=a, GPU has fallen off the bus.",
            "_TRANSPORT": "kernel", "__MONOTONIC_TIMESTAMP": "5000000", "__CURSOR": "s=1"}
    p.write_text(json.dumps(real) + "\n" + _deep("MESSAGE") + "\n")
    res = CliRunner().invoke(xid, ["scan", "--json", str(p)])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert [(e["xid"], e["pci_bus_id"], e["monotonic_s"]) for e in doc] == [(79, "0000:18:00", 5.0)]


def test_deep_dcgm_diag_json_is_a_format_error():
    from gpuguard.net.dcgm_diag import DiagFormatError, parse_json

    with pytest.raises(DiagFormatError) as e:
        parse_json(_deep("DCGM GPU Diagnostic"))
    assert str(e.value) == "not valid JSON (arrays/objects nested too deep: line 1 column 1 (char 0))"


def test_deep_nccl_json_report_is_not_read_as_one():
    from gpuguard.net.nccl_parse import parse

    log = parse(_deep("results"))
    assert log.tables == []
    assert log.failures == []


def test_a_long_line_without_white_space_is_read_in_linear_time():
    """A 200 KB word (a minified JSON report cut short, binary junk) in an nccl-tests
    log: the ``host: Test NCCL failure`` pattern was searched with ``\\S+?`` from every
    position of the word, quadratic in its length (old code: past pytest's timeout; see
    bench/long_lines.py for the figures). The failure line after it is still read."""
    from gpuguard.net.nccl_parse import parse

    log = parse("x" * 200_000 + "\nnode01: Test NCCL failure common.cu:345 'unhandled system error'\n")
    assert log.failures == ["node01: NCCL failure common.cu:345 'unhandled system error'"]


def test_deep_replay_snapshot_is_a_replay_error(tmp_path):
    from gpuguard.gpu.replay import ReplayError, ReplaySource

    p = tmp_path / "snap.json"
    p.write_text(_deep("format"))
    with pytest.raises(ReplayError) as e:
        ReplaySource(str(p)).snapshot()
    assert str(e.value) == f"{p}: invalid JSON: arrays/objects nested too deep: line 1 column 1 (char 0)"


def test_deep_sacct_json_is_a_parse_error(tmp_path):
    from gpuguard.reports.sacct_fields import SacctParseError
    from gpuguard.reports.sync import import_file, import_text
    from gpuguard.store import open_store

    p = tmp_path / "sacct.json"
    p.write_text(_deep("jobs"))
    store = open_store(str(tmp_path / "c.db"))
    try:
        with pytest.raises(SacctParseError) as e:
            import_file(store, str(p))
        assert str(e.value) == f"{p}:1: invalid JSON: arrays/objects nested too deep"
        with pytest.raises(SacctParseError) as e:
            import_text(store, _deep("jobs"), source="paste")
        assert str(e.value) == "paste:1: invalid JSON: arrays/objects nested too deep"
    finally:
        store.close()


def test_deep_spool_files_are_refused_not_raised(tmp_path):
    from gpuguard.epilog.cluster import MANIFEST, read_manifest
    from gpuguard.epilog.part import job_dir
    from gpuguard.epilog.part_codec import decode
    from gpuguard.epilog.spool import SpoolError
    from gpuguard.net.nccl_spool import ProbeFileError, parse_probe_file

    with pytest.raises(ProbeFileError) as e:
        parse_probe_file(_deep("format").encode())
    assert str(e.value) == "not JSON: arrays/objects nested too deep: line 1 column 1 (char 0)"
    with pytest.raises(SpoolError) as e:
        decode(gzip.compress(_deep("format").encode()))
    assert str(e.value) == "not a gzip JSON part: arrays/objects nested too deep: line 1 column 1 (char 0)"
    d = job_dir(str(tmp_path), "42")
    import os

    os.makedirs(d)
    with open(os.path.join(d, MANIFEST), "w") as fh:
        fh.write(_deep("job_id"))
    assert read_manifest(str(tmp_path), "42") is None
