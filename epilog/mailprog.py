"""``gpuguard-mail``: Slurm ``MailProg`` wrapper that adds the job page to end-of-job mail.

Slurm runs ``MailProg -s SUBJECT RECIPIENT`` with the (often empty) body on stdin
(slurm.conf man page, MailProg; the convention Princeton jobstats' mail script follows),
on the controller, as SlurmUser. Subjects look like ``Slurm Job_id=1234 Name=train
Ended, Run time 00:10:02, COMPLETED, ExitCode 0`` (``Began``, ``Ended``, ``Failed``,
``Requeued``, ``Reached time limit``...). For ``Ended`` and ``Failed`` mail the wrapper
appends the job's one-screen page (:mod:`gpuguard.epilog.jobpage`: verdict and what to
check) read from ``[mail] store`` (default: the cluster store), then runs the real mailer
(``[mail] mailer``, default ``/usr/bin/mail``, Slurm's own default) with Slurm's
arguments unchanged, as an argument list, and exits with its status.

Fail open: whatever goes wrong with gpuguard (no config, no store, job unknown) the mail
still goes out with Slurm's body; the problem is one line on stderr (slurmctld's log).

Fail closed on one thing: a recipient that starts with ``-``. Slurm 22.05 stores
``sbatch --mail-user=-Ssendmail=/path`` as it is and passes it as the recipient argument,
where ``mail`` would read it as an option (s-nail's ``-S sendmail=`` runs a program of the
user's choosing as SlurmUser). No address starts with ``-``, so such a mail is not sent
(one line on stderr, exit 2).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Sequence

#: ``Job_id=1234`` (or ``Array_task_id``-suffixed ``Job_id=1234_5 (1240)``): the raw id is
#: the number in parentheses when there is one.
_JOB_RE = re.compile(r"\bJob_id=(\d+)(?:_\S+\s+\((\d+)\))?", re.ASCII)
#: Subject words of end-of-job mail (Slurm src/slurmctld/agent.c, _mail_type_str).
END_WORDS = ("Ended", "Failed")
#: Largest body read from Slurm (it sends a few lines at most; our choice: 1 MiB).
MAX_BODY = 1 << 20


def parse_args(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """``-s SUBJECT RECIPIENT...`` -> ``(subject, recipients)``; other options are kept by
    the caller as they are."""
    subject = None
    for i, a in enumerate(argv[:-1]):
        if a == "-s" and (i == 0 or argv[i - 1] != "-s"):
            subject = argv[i + 1]
    return subject, [a for a in _without_subject(argv) if not a.startswith("-")]


def _without_subject(argv: Sequence[str]) -> list[str]:
    """``argv`` less the ``-s SUBJECT`` pair(s): what Slurm passes as recipients."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "-s" and i + 1 < len(argv):
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def end_of_job_id(subject: str | None) -> str | None:
    """The job id of an end-of-job subject (``Ended``/``Failed``), else None."""
    if not subject or not any(f" {w}" in subject for w in END_WORDS):
        return None
    m = _JOB_RE.search(subject)
    if not m:
        return None
    return m.group(2) or m.group(1)


def job_page_text(job_id: str) -> str:
    """The one-screen job page for ``job_id`` from the configured store. Raises on any
    problem (the caller fails open)."""
    from gpuguard import config as config_mod
    from gpuguard.epilog.advice import load_advice
    from gpuguard.epilog.cli import job_report
    from gpuguard.epilog.jobpage import format_page, job_header
    from gpuguard.output import display_tz
    from gpuguard.store import open_readonly

    cfg = config_mod.load()
    path = cfg.get("mail", "store") or cfg.cluster_store_path
    store = open_readonly(path)  # a reader: never migrates or writes the store
    try:
        tz = display_tz(cfg)
        rep = job_report(store, job_id, tz)
        rep.setdefault("job", job_header(store, rep))
    finally:
        store.close()
    return format_page(rep, tz=tz, advice=load_advice(cfg.get("job_page", "advice_file")),
                       idle_gpu_pct=cfg.get("job_page", "idle_gpu_pct"))


def _mailer() -> str:
    try:
        from gpuguard import config as config_mod

        return config_mod.load().get("mail", "mailer")
    except Exception:  # a broken config must not stop the mail
        return "/usr/bin/mail"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (``gpuguard-mail``): see the module docstring. Returns the mailer's exit
    status (127 when it cannot be run)."""
    args = list(sys.argv[1:] if argv is None else argv)
    # bytes, decoded with surrogateescape: a body that is not UTF-8 goes out unchanged
    body = sys.stdin.buffer.read(MAX_BODY).decode("utf-8", "surrogateescape") if not sys.stdin.isatty() else ""
    subject, _to = parse_args(args)
    options = [a for a in _without_subject(args) if a.startswith("-")]
    if options:
        print(f"gpuguard-mail: not sent: recipient {options[0][:80]!r} starts with '-' (it would be read as a "
              "mailer option)", file=sys.stderr)
        return 2
    jid = end_of_job_id(subject)
    if jid is not None:
        try:
            page = job_page_text(jid)
            body = (body.rstrip("\n") + "\n\n" if body.strip() else "") + page + "\n"
        except Exception as e:  # fail open: Slurm's mail goes out as it was
            print(f"gpuguard-mail: job {jid}: no job page added: {e}", file=sys.stderr)
    mailer = _mailer()
    try:
        # surrogateescape: Slurm's body bytes go out as they came, UTF-8 or not
        return subprocess.run([mailer, *args], input=body, text=True, encoding="utf-8", errors="surrogateescape",
                              check=False).returncode
    except OSError as e:
        print(f"gpuguard-mail: cannot run {mailer}: {e.strerror or e}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
