"""pytest fixtures for the Slurm testbed.

Wire them into tests/conftest.py with::

    from testbed.fixtures import slurm_testbed, slurm  # noqa: F401

``slurm_testbed`` (session): runs ``testbed.sh up`` once and yields a ``slurmtb.Testbed``.
  - runs when GPUGUARD_SLURM=1 (``make test``) or CI is set; skipped with the reason
    otherwise, and always when GPUGUARD_SKIP_SLURM=1;
  - FAILS the tests that use it when ``up`` fails (output of testbed.sh in the message);
  - at session end it runs ``testbed.sh down`` only if the testbed was not already up when
    the session started (GPUGUARD_KEEP_TESTBED=1 keeps it up anyway).
``slurm`` (function): the same object after ``Testbed.reset()``: no jobs left in the queue,
  every node resumed and idle.

Mark tests with ``@pytest.mark.slurm`` (the marker is declared in setup.cfg).
"""

from __future__ import annotations

import os

import pytest

try:
    from . import slurmtb
except ImportError:  # imported as a top-level module (tests/testbed on sys.path)
    import slurmtb  # type: ignore[no-redef]

UP_TIMEOUT_S = 600


@pytest.fixture(scope="session")
def slurm_testbed():
    if os.environ.get("GPUGUARD_SKIP_SLURM") == "1":
        pytest.skip("GPUGUARD_SKIP_SLURM=1: Slurm testbed integration tests disabled")
    if os.environ.get("GPUGUARD_SLURM") != "1" and not os.environ.get("CI"):
        # Opt-in outside CI: bringing up Slurm installs packages and starts daemons as root.
        # `make test` and .ci/run set GPUGUARD_SLURM=1.
        pytest.skip("Slurm testbed tests need GPUGUARD_SLURM=1 (set by `make test` and CI)")
    tb = slurmtb.Testbed()
    was_up = tb.testbed_sh("status", timeout=60).returncode == 0
    try:
        cp = tb.testbed_sh("up", timeout=UP_TIMEOUT_S)
    except Exception as exc:  # timeout, bash missing, ...
        pytest.fail(f"testbed.sh up did not finish: {exc!r}", pytrace=False)
    if cp.returncode != 0:
        pytest.fail(
            f"testbed.sh up failed (rc={cp.returncode}); TESTBED={tb.root}\n"
            f"--- stdout ---\n{cp.stdout}\n--- stderr ---\n{cp.stderr}",
            pytrace=False,
        )
    yield tb
    if not was_up and os.environ.get("GPUGUARD_KEEP_TESTBED") != "1":
        tb.testbed_sh("down", timeout=120)


@pytest.fixture
def slurm(slurm_testbed):
    slurm_testbed.reset()
    return slurm_testbed
