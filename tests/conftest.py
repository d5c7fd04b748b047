"""Shared fixtures: configs in tmp dirs, GPU snapshots built field by field."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

import gpuguard.reports  # noqa: F401  (registers every stage's store migration set, as the CLI does)
from gpuguard.gpu.replay import dump_snapshot
from gpuguard.model import GpuState, NodeSnapshot, NvLinkState

DATA = pathlib.Path(__file__).parent / "data"


def healthy_gpu(index: int, **over) -> GpuState:
    """An idle, healthy H100-like GPU with every field set."""
    base = dict(
        index=index, uuid=f"GPU-00000000-0000-0000-0000-00000000000{index}", serial=f"165432100000{index}",
        name="NVIDIA H100 80GB HBM3", pci_bus_id=f"0000:{0x18 + 0x11 * index:02x}:00.0",
        driver_version="535.183.01", cuda_version="12.2", vbios_version="96.00.99.00.01",
        inforom_version="G520.0200.00.05", temp_c=31.0, temp_slowdown_c=87.0, temp_shutdown_c=92.0,
        power_w=70.0, power_limit_w=700.0, sm_clock_mhz=345.0, sm_clock_max_mhz=1980.0,
        mem_clock_mhz=2619.0, mem_clock_max_mhz=2619.0, clock_event_reasons=["gpu_idle"],
        gpu_util_pct=0.0, mem_util_pct=0.0, mem_used_mib=0.0, mem_total_mib=81559.0, ecc_enabled=True,
        ecc_volatile_corrected=0, ecc_volatile_uncorrected=0, ecc_aggregate_corrected=0,
        ecc_aggregate_uncorrected=0, retired_pages_sbe=None, retired_pages_dbe=None,
        retired_pages_pending=None, remapped_rows_correctable=0, remapped_rows_uncorrectable=0,
        remapped_rows_pending=False, remapped_rows_failure=False, pcie_gen_current=5, pcie_gen_max=5,
        pcie_width_current=16, pcie_width_max=16, pcie_replay_count=0,
        nvlinks=[NvLinkState(link=i, active=True, replay_errors=0, recovery_errors=0, crc_flit_errors=0,
                             crc_data_errors=0) for i in range(4)],
        persistence_mode=True, mig_mode=False,
    )
    base.update(over)
    return GpuState(**base)


def node_snapshot(n: int = 4, **per_gpu) -> NodeSnapshot:
    """``n`` healthy GPUs; ``per_gpu={"gpu2": {...}}`` overrides fields of GPU 2."""
    gpus = [healthy_gpu(i, **per_gpu.get(f"gpu{i}", {})) for i in range(n)]
    return NodeSnapshot(taken_at=1764460800.0, source="replay", gpus=gpus, hostname="n1",
                        driver_version="535.183.01", cuda_version="12.2")


@pytest.fixture(autouse=True)
def _no_host_config(monkeypatch, tmp_path_factory):
    """Keep the host's /etc/gpuguard, /etc/slurm and the parent Slurm daemon out of config
    discovery: tests name their config (GPUGUARD_CONFIG) or test discovery explicitly."""
    from gpuguard import config as config_mod

    none = str(tmp_path_factory.mktemp("noconf") / "gpuguard.toml")
    monkeypatch.setattr(config_mod, "DEFAULT_PATH", none)
    monkeypatch.setattr(config_mod, "SLURM_CONF_LOCATIONS", ())
    monkeypatch.setattr(config_mod, "_daemon_slurm_conf", lambda *a, **k: None)


@pytest.fixture
def utc(monkeypatch):
    """Pin the local time zone to UTC: nvidia-smi and ``dmesg -T`` stamps are local time,
    so expected epochs are exact only in a known zone."""
    import time

    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.fixture
def write_replay(tmp_path):
    """Write a replay snapshot file; returns its path."""
    def make(snap: NodeSnapshot, steps=None, t0=None, name="gpus.json") -> str:
        p = tmp_path / name
        p.write_text(dump_snapshot(snap, steps, t0))
        return str(p)
    return make


@pytest.fixture
def make_config(tmp_path, monkeypatch):
    """Write a gpuguard.toml under tmp_path, point GPUGUARD_CONFIG at it and return
    ``(path, Config)``. Paths default into tmp_path; the replay source is used."""
    from gpuguard import config as config_mod

    def make(text: str = "", *, replay: str | None = None, kernel_log: str | None = None) -> tuple[str, object]:
        kl = kernel_log or str(tmp_path / "kern.log")
        if not os.path.exists(kl):
            pathlib.Path(kl).write_text("")
        head = f"""
[node]
name = "n1"
[paths]
store = "{tmp_path}/node.db"
state_dir = "{tmp_path}/state"
run_dir = "{tmp_path}/run"
job_dir_root = "{tmp_path}/jobs"
log_file = "{tmp_path}/gpuguard.log"
[xid]
kernel_log = "{kl}"
kernel_log_kernel_only = true
[slurm]
bin_dir = "{tmp_path}/bin"
"""
        if replay:
            head += f'[gpu]\nsource = "replay"\nreplay_path = "{replay}"\n'
        p = tmp_path / "gpuguard.toml"
        p.write_text(head + text)
        monkeypatch.setenv("GPUGUARD_CONFIG", str(p))
        return str(p), config_mod.load(str(p))
    return make


@pytest.fixture
def fake_slurm_bin(tmp_path):
    """A bin dir whose scontrol/sinfo/sacctmgr/sacct/scancel log their argv (JSON, one line per
    call) to ``calls.jsonl`` and exit 0; returns ``calls()``. ``scontrol`` keeps node state
    like slurmctld does: ``update nodename=N state=drain reason=R`` sets N's reason (in
    ``nodes.json``), ``state=resume`` clears it, and ``show node N -o`` prints it
    (``Reason=R [root@...]``), so a drain can be confirmed."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    log = tmp_path / "calls.jsonl"
    state = tmp_path / "nodes.json"
    for tool in ("scontrol", "sinfo", "sacctmgr", "sacct", "scancel"):
        f = bindir / tool
        body = (
            "#!/usr/bin/env python3\nimport json, os, sys\n"
            f"open({str(log)!r}, 'a').write(json.dumps(sys.argv) + '\\n')\n"
        )
        if tool == "scontrol":
            body += f"""
st = {str(state)!r}
nodes = json.load(open(st)) if os.path.exists(st) else {{}}
a = sys.argv[1:]
kv = dict(x.split("=", 1) for x in a if "=" in x)
if a[:1] == ["update"] and "nodename" in kv:
    if kv.get("state") == "drain":
        nodes[kv["nodename"]] = kv.get("reason", "")
    elif kv.get("state") == "resume":
        nodes.pop(kv["nodename"], None)
    json.dump(nodes, open(st, "w"))
elif a[:2] == ["show", "node"] and len(a) > 2:
    r = nodes.get(a[2])
    print(f"NodeName={{a[2]}} State=IDLE{{'+DRAIN' if r else ''}} " + (f"Reason={{r}} [root@2026-01-01T00:00:00]" if r else ""))
"""
        f.write_text(body)
        f.chmod(0o755)

    def calls(include_reads: bool = False) -> list[list[str]]:
        """The recorded calls; read-only ``scontrol show ...`` queries are left out unless
        ``include_reads`` (tests assert what gpuguard *changed* in Slurm)."""
        if not log.exists():
            return []
        out = [[os.path.basename(a[0]), *a[1:]] for a in map(json.loads, log.read_text().splitlines())]
        return out if include_reads else [c for c in out if c[:2] != ["scontrol", "show"]]
    calls.bindir = str(bindir)
    return calls


# Real-Slurm testbed fixtures (tests/testbed): `slurm_testbed` (session) and `slurm`.
from testbed.fixtures import slurm, slurm_testbed  # noqa: E402, F401


def cli_runner():
    """A click ``CliRunner`` whose result keeps stderr apart from stdout (click < 8.2 needs
    ``mix_stderr=False``; 8.2 always keeps them apart and has no such argument)."""
    from click.testing import CliRunner

    try:
        return CliRunner(mix_stderr=False)
    except TypeError:
        return CliRunner()
