"""User-written text (job names, comments, file names) printed to an admin's terminal
shows control characters as escapes: an ESC/OSC sequence or a bidi override in a job
name never drives the terminal of the admin who runs `gpuguard job show` or a report."""

from __future__ import annotations

from gpuguard.output import emit, printable, table
from gpuguard.store import open_store
from test_job_page import big, show  # noqa: F401  (big: the fixture)

EVIL = "train\x1b]0;owned\x07\x1b[2J\u202eexe.txt\x9b31m"
SHOWN = "train\\x1b]0;owned\\x07\\x1b[2J\\u202eexe.txt\\x9b31m"


def test_printable_escapes_every_terminal_control_and_keeps_newlines_and_tabs():
    assert printable(EVIL) == SHOWN
    assert printable("a\nb\tc\x00d\x7fe\u2066f") == "a\nb\tc\\x00d\\x7fe\\u2066f"
    assert printable("a\nb", keep="") == "a\\x0ab"
    assert printable("GPU-ü 80 GB ✓") == "GPU-ü 80 GB ✓"


def test_table_cells_and_text_output_carry_no_control_character(capsys):
    assert table([[EVIL, 1]], ["NAME", "N"], width=None).splitlines()[2] == SHOWN + "  1"
    emit("text", {}, text=lambda: f"job {EVIL}\nnext")
    assert capsys.readouterr().out == f"job {SHOWN}\nnext\n"


def test_job_show_prints_a_hostile_job_name_escaped(big):  # noqa: F811
    s = open_store(big)
    s.db.execute("UPDATE sacct_jobs SET job_name = ?", [EVIL])
    s.db.conn.commit()
    s.close()
    r = show("4242", "--store", big)
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[0].startswith(f'Job 4242 "{SHOWN}"')
    assert "\x1b" not in r.output and "\u202e" not in r.output and "\x9b" not in r.output


def test_drain_reasons_carry_no_control_character():
    from gpuguard.model import Finding
    from gpuguard.policy import format_reason

    f = Finding("xid.13", "critical", "XID 13 Graphics Engine Exception pid=42, name=ev\x1b[2Jil\x9b31m\u202eexe\x00")
    assert format_reason([f]) == "gpuguard: xid.13 XID 13 Graphics Engine Exception pid=42, name=ev [2Jil 31m exe"
