"""The metric table drives every stage: a GPU metric added as one :class:`Metric` row and
one :class:`Compared` row, with no other code, is read from NVML, stored, summarised,
compared by the verdict and shown by ``job show``; one NVML gives only as a field value
(``NVML_FI_*``) is read every tick from its field id alone.

The rows are added before any other gpuguard module is imported, in a fresh interpreter
(the table is read when the modules load), exactly as if they were written in
``gpuguard/metrics.py``. The metrics are the memory clock (``nvmlDeviceGetClockInfo
(NVML_CLOCK_MEM)``) and the HBM temperature (``NVML_FI_DEV_MEMORY_TEMP``), which the
table does not carry today."""

from __future__ import annotations

import json
import os
import subprocess
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))

SCRIPT = r"""
import json, sys
from gpuguard import metrics as M

row = M.Metric("mem_clock_mhz", "MHz", "gpu", "nvmlDeviceGetClockInfo(NVML_CLOCK_MEM)", 1, ("mean",), ".0f",
               "memory clock", nvml=M.Nvml("nvmlDeviceGetClockInfo", args=("NVML_CLOCK_MEM",)), label="MEMCLK")
# and one NVML gives only as a field value: HBM temperature
hbm = M.Metric("mem_temp_c", "°C", "gpu", "NVML_FI_DEV_MEMORY_TEMP", 1, ("max",), ".0f", "HBM temperature",
               nvml=M.Nvml(field_id="NVML_FI_DEV_MEMORY_TEMP"), label="HBM_TEMP")
M.METRICS = (*M.METRICS, row, hbm)
M.BY_NAME[row.name], M.BY_NAME[hbm.name] = row, hbm
M.GPU_SAMPLED = (*M.GPU_SAMPLED, row, hbm)
M.COMPARED = (*M.COMPARED, M.Compared("mem_clock_mhz", "MHz", "mem_clock_mhz", "p50", -1, True,
                                      "memory clock, median"))

import fake_pynvml as fp
from click.testing import CliRunner
from gpuguard.cli import main
from gpuguard.collector.rows import gpu_row
from gpuguard.epilog import summary_shape
from gpuguard.epilog.jobdata import load_job
from gpuguard.epilog.metrics import METRICS as VERDICT_METRICS, job_metrics
from gpuguard.epilog.summary import save_summary, summarize_job
from gpuguard.gpu.nvml import NvmlSource
from gpuguard.store import open_store

db = sys.argv[1]
devs = fp.h100_node()[:2]
devs[0]["mem_temp"], devs[1]["mem_temp"] = 48, 52
fake = fp.FakeNvml(devs)
src = NvmlSource(pynvml_module=fake.module)
store = open_store(db)
out = {"steps": [r["name"] for r in store.query("select name from _sqlite_migrations where migration_set = 'collector'")]}
for k in range(20):  # 20 ticks of 1 s; GPU 0's memory clock drops to 1593 MHz from t = 1010
    if k == 10:
        fake.devices[0]["clock_mem"] = 1593
        fake.devices[1]["mem_temp"] = 71
    snap = src.telemetry([0, 1], [], slow=k == 0)
    store.insert_many("samples", [gpu_row(g, "9", "n1", 1000.0 + k) for g in snap.gpus])
src.close()
s = summarize_job(store, "9", "n1", exit_status_raw=0, collector_status="ok", ended_at=1100.0)
save_summary(store, s)
out["summary"] = [s.mem_clock_mean_mhz, [g.mem_clock_mean_mhz for g in s.gpus]]
out["hbm"] = [s.mem_temp_max_c, [g.mem_temp_max_c for g in s.gpus]]
out["field_calls"] = sum(1 for f, _g in fake.calls if f == "nvmlDeviceGetFieldValues")
out["published"] = summary_shape.PUBLISHED["gpu.mem_clock_mean_mhz"].path
out["verdict_metric"] = VERDICT_METRICS["mem_clock_mhz"]
data = load_job(store, "9")
out["series"] = [g.mem_clock_mhz for g in data.gpus]  # series attribute: the name
out["compared"] = job_metrics(data, 5.0)["mem_clock_mhz"]
store.close()
r = CliRunner().invoke(main, ["job", "show", "9", "--full", "--store", db])
out["show"] = r.output
print(json.dumps(out))
"""


def test_a_new_compared_gpu_metric_needs_only_its_table_rows(tmp_path):
    cfg = tmp_path / "noslurm.toml"
    cfg.write_text(f'[slurm]\nbin_dir = "{tmp_path}/no-slurm-here"\n')
    env = dict(os.environ, PYTHONPATH=TESTS, GPUGUARD_CONFIG=str(cfg), COLUMNS="400")
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "node.db")], env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.splitlines()[-1])
    assert "metric_mem_clock_mhz" in out["steps"]  # its store column came with a named collector step
    # GPU 0: 10 samples at 2619 MHz then 10 at 1593 -> 2106; GPU 1: 2619 throughout
    assert out["summary"] == [2362.5, [2106.0, 2619.0]]
    # the field-value metric: read every tick (20 ticks x 2 GPUs; the slow counters' own
    # field call adds one per GPU on the first tick), max 48 on GPU 0, 71 on GPU 1 from t = 1010
    assert out["hbm"] == [71.0, [48.0, 71.0]]
    assert out["field_calls"] == 20 * 2 + 2
    assert out["published"] == "$.mem_clock_mean_mhz"
    assert out["verdict_metric"] == ["MHz", True, "memory clock, median"]
    assert out["series"] == [[2619.0] * 10 + [1593.0] * 10, [2619.0] * 20]
    # after a 5 s warm-up: 5 + 10 samples of GPU 0 at 2619/1593 and 15 of GPU 1 at 2619 -> median 2619
    assert out["compared"] == 2619.0
    lines = out["show"].splitlines()
    assert [x.split()[1:] for x in lines if x.startswith("mem_clock_mean_mhz")] == [["2362", "MHz"]]  # rounded for people
    i = lines.index("Per GPU (n1)")
    col = lines[i + 1].split().index("MEMCLK_MEAN_MHZ")
    assert [lines[i + 3].split()[col], lines[i + 4].split()[col]] == ["2106", "2619"]
