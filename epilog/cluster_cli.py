"""``gpuguard cluster ingest``: judge the jobs the EpilogSlurmctld worker could not.

Run on the controller by a systemd timer as SlurmUser
(``slurm-conf-examples/gpuguard-cluster-ingest.{service,timer}``): one pass over
``[paths] spool_dir`` (:func:`gpuguard.epilog.cluster.ingest`). Registered in
:mod:`gpuguard.cli`.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from gpuguard.output import emit, output_options


def _fail(msg: str) -> None:
    click.echo(f"Error: {msg}", err=True)
    sys.exit(2)


def _ingest_lock(store_path: str) -> int | None:
    """An exclusive ``flock`` on ``{store_path}.ingest.lock`` (held until exit), or None
    when another ``cluster ingest`` holds it. Two passes at once (the timer's and one run
    by hand) would both find a job unjudged and judge it twice: two sacctmgr calls, and
    both could pass the once-per-(job, node) drain check before either records its drain.
    A lock file that cannot be opened is no
    reason not to ingest (the store's own checks follow): the pass runs unlocked."""
    import fcntl

    try:
        fd = os.open(f"{store_path}.ingest.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError:
        return fd
    return fd


@click.group("cluster")
def cluster() -> None:
    """Cluster mode: the job judge on the controller."""


@cluster.command("ingest")
@click.option("--max-jobs", type=click.IntRange(min=0), default=0, show_default=True,
              help="judge at most this many jobs in this pass (0 = all)")
@output_options(formats=("text", "json"))
@click.pass_obj
def ingest_cmd(obj: Any, max_jobs: int, fmt: str) -> None:
    """Judge every job in the spool whose parts came late or whose EpilogSlurmctld
    worker died, once the worker's wait is over; idempotent (a job whose parts did not
    change is left alone). First carries the NCCL probes the nodes left in the spool
    into the cluster store (:mod:`gpuguard.net.nccl_spool`: the fleet median).

    Must run as the owner of the cluster store, or of its directory before it exists
    (SlurmUser): a root-owned store or WAL file would lock the worker out. One pass at a
    time (a lock beside the store): a second exits 0 at once. Exit 0; 2 for
    a bad config, a missing spool_dir, the wrong user or a store that cannot be
    written; 1 when a job could not be judged or a probe file not read."""
    cfg = obj.cfg
    spool = cfg.get("paths", "spool_dir")
    if not spool:
        _fail("[paths] spool_dir is not set: cluster ingest has nothing to read")
    path = cfg.cluster_store_path
    # not there yet: whoever owns its directory (SlurmUser) is meant to create it
    probe = path if os.path.exists(path) else os.path.dirname(os.path.abspath(path))
    try:
        owner = os.stat(probe).st_uid
    except FileNotFoundError:
        owner = os.geteuid()
    except OSError as e:
        _fail(f"cluster store {path}: {e.strerror or e}")
    if owner != os.geteuid():
        import pwd

        try:
            name = pwd.getpwuid(owner).pw_name
        except KeyError:
            name = str(owner)
        _fail(f"cluster store {path} belongs to {name}: run cluster ingest as that user "
              f"(e.g. runuser -u {name} -- gpuguard cluster ingest)")
    from gpuguard import log as log_mod

    log = log_mod.setup(cfg.get("paths", "log_file"), "cluster-ingest")
    lock = _ingest_lock(path)
    if lock is None:
        click.echo(f"another cluster ingest holds {path}.ingest.lock: nothing done", err=True)
        sys.exit(0)
    try:
        _ingest_pass(cfg, path, spool, log, max_jobs, fmt)
    finally:
        if lock >= 0:
            os.close(lock)  # released here, not only at exit: a caller may run twice in one process


def _ingest_pass(cfg: Any, path: str, spool: str, log: Any, max_jobs: int, fmt: str) -> None:
    """One ingest pass under the lock (:func:`ingest_cmd`); exits like it."""
    from gpuguard.epilog.cluster import ingest
    from gpuguard.slurm import SlurmCli
    from gpuguard.store import StoreError, open_store

    try:
        store = open_store(path)
    except StoreError as e:
        _fail(str(e))
    from gpuguard.net.nccl_spool import ingest_probes

    try:
        # the nodes' NCCL probes first: the fleet median is the nodes' next reference
        probes = ingest_probes(store, spool, log=log)
        res = ingest(cfg, store, log=log, slurm=SlurmCli(cfg.get("slurm", "bin_dir")), max_jobs=max_jobs)
    except StoreError as e:
        _fail(str(e))
    finally:
        store.close()
    errors = probes.errors + res.errors

    def line() -> str:
        return f"{res.line()}; {probes.carried} NCCL probe(s) carried to the cluster store"
    log.info("cluster ingest: %s", line())
    emit(fmt, {"judged": res.judged, "unchanged": res.unchanged, "waiting": res.waiting, "removed": res.removed,
               "nccl_probes_carried": probes.carried, "errors": errors}, text=line)
    for e in errors:
        click.echo(f"  {e}", err=True)
    sys.exit(1 if errors else 0)
