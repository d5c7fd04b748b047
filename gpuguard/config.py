"""gpuguard configuration: one TOML file, read with :mod:`tomllib`, every key defaulted.

Size: over 500 lines because most of it is :data:`SCHEMA`, one entry per config key with
its default, type and documented source — the single table the README reference and the
example config are generated from; splitting it would split that table.

Where the file is looked for, first match wins:

1. ``--config PATH`` on the command line;
2. ``$GPUGUARD_CONFIG``;
3. ``gpuguard.toml`` next to ``$SLURM_CONF`` (Slurm passes ``SLURM_CONF`` to the Prolog
   and Epilog although their environment is otherwise empty: SLURM-FACTS.md §3-4), so a
   site can keep gpuguard's config beside slurm.conf;
4. ``gpuguard.toml`` next to the slurm.conf named by ``-f`` on the command line of the
   Slurm daemon that started us (read from ``/proc``; EpilogSlurmctld and PrologSlurmctld
   get no ``SLURM_CONF``, but their parent slurmscriptd keeps slurmctld's command line);
5. ``/etc/gpuguard/gpuguard.toml``;
6. ``gpuguard.toml`` next to slurm.conf in Slurm's standard places
   (:data:`SLURM_CONF_LOCATIONS`: ``/etc/slurm``, ``/usr/local/etc``, ``/etc/slurm-llnl``,
   ``/run/slurm/conf``);
7. none: the shipped defaults alone — for the CLI; the hooks treat it as one logged
   error (``load(require=True)``), as they do a dangling symlink.

A path given explicitly (1, 2) must exist; so must a found one (a dangling symlink at
3-6 is an error, never a silent fall-back to the defaults). Errors are :class:`ConfigError` with one line
naming the file, the key and what was expected; the CLI exits 2 on them.

``{node}`` in a path value is replaced by the node name (``[node] name``, else
``$SLURMD_NODENAME``, else the short host name), so several slurmd on one host keep
separate stores.
"""

from __future__ import annotations

import json
import os
import re
import socket
import tomllib
from dataclasses import dataclass, field
from typing import Any

DEFAULT_PATH = "/etc/gpuguard/gpuguard.toml"

ACTIONS = ("record", "alert", "drain", "fail-job")

#: Lower bounds of a number key, the optional 4th element of its SCHEMA entry. Every
#: number is at least :data:`AT_LEAST_ZERO` (a negative count, size, time or rate is a
#: mistake); :data:`ABOVE_ZERO` is for a width the verdict divides by
#: (``floor(t / short_window_s)``), an interval that would spin at 0 (the collector
#: sampling in a busy loop on every node) and a timeout or budget that would never let
#: its work run. A key whose 0 has a meaning of its own says so in its doc and declares
#: AT_LEAST_ZERO (``[nccl] interval_s``: 0 = probe at every health run).
AT_LEAST_ZERO = ">= 0"
ABOVE_ZERO = "> 0"

# section -> key -> (default, type(s), one-line doc[, lower bound]). The single source of
# truth for keys, defaults, bounds and the configuration reference in the README.
SCHEMA: dict[str, dict[str, tuple[Any, ...]]] = {
    "node": {
        "name": ("", str, "node name; empty = $SLURMD_NODENAME, else the short host name"),
        "gpu_count": (0, int, "GPUs this node must show; 0 = take the count from gres (SLURM_JOB_GPUS) only"),
    },
    "paths": {
        "store": ("/var/lib/gpuguard/node.db", str, "node store (SQLite); {node} is replaced by the node name"),
        "cluster_store": ("", str, "cluster store; empty = same file as the node store (single host)"),
        "state_dir": ("/var/lib/gpuguard", str, "pid files, collector state; {node} allowed"),
        "run_dir": ("/run/gpuguard/{node}", str, "second copy of the kernel-log cursor and pending drains on a tmpfs, so a read-only or full state_dir never loses or repeats a drain; empty = off"),
        "job_dir_root": ("/var/spool/gpuguard/jobs", str, "parent of per-job directories for training records, under its own root apart from the store (users write there; best its own filesystem); {node} allowed"),
        "job_dir_max_mib": (64.0, (int, float), "per-job cap of a job directory's bytes on disk, checked by the collector every liveness period after it stored the new records and released their blocks (punch-hole); files beyond it are cut (our choice: twice what the epilog ingests, 32 MiB)"),
        "spool_dir": ("", str, "shared directory (owned by SlurmUser) where node Epilogs leave each job's per-node part for the job judge on the controller; empty = single host: the node Epilog judges its own job"),
        "log_file": ("/var/log/gpuguard/gpuguard.log", str, "log file for hooks; empty = stderr only"),
    },
    "gpu": {
        "source": ("nvml", str, "GPU source: nvml | replay"),
        "replay_path": ("", str, "snapshot JSON or nvidia-smi -q / -q -x dump for the replay source; {node} allowed"),
        "call_timeout_s": (5.0, (int, float), "timeout of one NVML call (a hung driver is a finding, not a hung prolog)", ABOVE_ZERO),
    },
    "xid": {
        "kernel_log": ("auto", str, "auto | kmsg | journalctl | dmesg | a file path; {node} allowed"),
        "first_scan_lookback": ("boot", str, "on the first scan ever: 'boot' reads the current boot (a text file from the boot's first kernel line, 'Linux version', found from its end; the whole file when it has none), 'all' the whole buffer or file, 'none' starts at the end (our choice: an XID of an earlier boot was dealt with by the reboot; kmsg, journalctl -k and dmesg hold the current boot only)"),
        "kernel_log_kernel_only": (False, bool, "the text file named by kernel_log holds kernel messages only (e.g. rsyslog's kern.* file); only then may its XIDs drain: a syslog file of all facilities can hold any user's `logger -t kernel` line (our choice: refuse what users can fake)"),
    },
    "checks": {
        "disabled": ([], list, "check names to switch off (see `gpuguard check --list`)"),
        "pcie_require_max_link": (False, bool, "warn when an idle GPU's PCIe link is below max gen/width (idle GPUs downshift, so off by default)"),
        "temp_margin_c": (10.0, (int, float), "warn when idle temperature is within this many degrees of the slowdown threshold"),
        "idle_util_pct": (5.0, (int, float), "a GPU under this utilisation counts as idle for the throttle checks, the idle baseline and the health NCCL probe; an unknown utilisation (N/A, no CSV column, MIG) is never idle: those are not judged"),
        "nvlink_expected_links": (0, int, "NVLinks each GPU must have up; 0 = learn: a link counts once it was seen up on this GPU or is up on every other GPU of the same model here (links inactive by design, azurehpc-health-checks #162)"),
        "nvlink_crc_rate_per_s": (100.0, (int, float), "nvlink.errors_rising when CRC flit/data errors grow at least this fast per link (DCGM dcgm_hardware_limits.h DCGM_LIMIT_MAX_LWLINK_CRC_ERROR: 'CRC errors only matter at rates of 100+ per second')"),
        "nvlink_replay_recovery_max": (1, int, "nvlink.errors_rising when replay or recovery errors of a link grow by at least this many since the last reading (DCGM_LIMIT_MAX_LWLINK_ERROR = 1)"),
        "fabric_registration_grace_s": (900.0, (int, float), "a GPU's NVLink fabric registration Not Started / In Progress within this long after boot is fabric.registration_pending (warning), later fabric.not_registered (drain) (our choice: 15 min; Fabric Manager trains the NVSwitch links and registers the GPUs within minutes of driver load, and a node whose registration never completes, NVSentinel #889, still drains)"),
        "fabric_not_started_is_fault": (True, bool, "judge a GPU whose NVLink fabric registration is Not Started like one In Progress (DCGM health watch fails on Not Started); false where GPUs report Not Started without a fabric to join (aws eks-node-monitoring-agent #145 skips it on some GB200/GB300 instances): it is then never a finding"),
    },
    "prolog": {
        "time_budget_s": (20.0, (int, float), "hard limit for the whole prolog; keep it below Slurm's PrologEpilogTimeout", ABOVE_ZERO),
        "start_collector": (True, bool, "start the per-job collector"),
        "fail_job_escalate_count": (3, int, "drain the node instead once the Prolog failed this many jobs in a row for the same fail-job finding code within fail_job_escalate_window_s (a run without that code resets it); 0 = never (our choice: one or two cancelled jobs can be a transient fault, a third in a row means the node is eating the queue)"),
        "fail_job_escalate_window_s": (3600.0, (int, float), "the window of fail_job_escalate_count (our choice: 1 h; failures further apart are counted afresh)", ABOVE_ZERO),
    },
    "collector": {
        "interval_s": (10.0, (int, float), "sampling interval; 1 s works", ABOVE_ZERO),
        "flush_s": (10.0, (int, float), "write batched samples at least this often"),
    },
    "store": {
        "raw_days": (14.0, (int, float), "keep raw GPU/host samples (and a summarised job's training records) this many days, then fold GPU samples into per-minute min/mean/max (our choice: two weeks covers re-judging recent jobs; about 21 MB per 8-GPU node-day at 1 s)"),
        "minutes_days": (400.0, (int, float), "keep per-minute GPU aggregates this many days (our choice: a year and a month, for year-on-year comparisons; < 1 B per GPU-second)"),
        "prune_budget_s": (2.0, (int, float), "the epilog prunes at most this long after its summary and verdict, if its own budget has that much left; 0 = only `gpuguard store prune`"),
    },
    "epilog": {
        "time_budget_s": (20.0, (int, float), "hard limit for the whole epilog", ABOVE_ZERO),
        "slurmctld_wait_s": (30.0, (int, float), "EpilogSlurmctld worker: how long to wait for every node's part in the spool before judging what arrived"),
    },
    "baseline": {
        "runs": (20, int, "N: a template's baseline is the median/MAD of its last N healthy, completed runs (our choice: 20 runs give a median/MAD stable to a few outliers while a template re-learns within days)"),
        "min_runs": (3, int, "below this many baseline runs a template is 'learning' and nothing is judged (our choice: 3 is the fewest runs with a meaningful median and MAD)"),
        "relearn_runs": (5, int, "a template's baseline re-learns from its last this-many runs when all were judged job-changed (no machine-side cause), agree with each other within [verdict] min_rel_change and completed; 0 = never (our choice: a working week of daily runs; fewer would let a regression of a few days become the normal; must be >= min_runs)"),
        "relearn_forgets": ("all-models", str, "what a re-learn on one GPU model forgets: 'all-models' (the runs on every model before the re-learned runs: the job changed, on every model it runs on) or 'gpu-model' (that model's runs only: the others keep their baselines and re-learn on their own runs)"),
        "idle_readings": (20, int, "a GPU's idle baseline: median/MAD of its last this-many prolog idle readings (same N as templates)"),
        "idle_min_readings": (5, int, "idle readings a GPU needs before its idle temperature/power is judged (our choice: a week of daily jobs)"),
        "idle_temp_rise_c": (10.0, (int, float), "baseline.idle_temp_up when a GPU idles this many degC above its own median (our choice: 10 degC is about a third of the idle-to-slowdown margin of H100/A100 at 30 degC idle, 87 degC slowdown)"),
        "idle_power_rise_frac": (0.30, (int, float), "baseline.idle_power_up when idle power is this fraction above its own median (our choice: idle power of one GPU varies a few watts out of 60-90 W)"),
    },
    "verdict": {
        "warmup_s": (300.0, (int, float), "start of the job left out of the comparison: CUDA/NCCL init, autotuning, compilation, first data loads (our choice: 5 min)"),
        "long_window_s": (600.0, (int, float), "a deviation must show over a window this long to count (our choice: 10 min outlasts checkpoint and evaluation pauses); shorter jobs: their whole span after warm-up", ABOVE_ZERO),
        "short_window_s": (60.0, (int, float), "display window and the step by which long windows slide", ABOVE_ZERO),
        "z_threshold": (3.5, (int, float), "|robust z| = |x - median| / (1.4826 MAD) at or above this flags a metric (Iglewicz & Hoaglin 1993, modified z-score outlier cut-off 3.5)"),
        "mad_floor_frac": (0.02, (int, float), "MAD is at least this fraction of the median, so a tiny spread does not flag noise (our choice: about the run-to-run jitter of step time on dedicated nodes; checked with bench/verdict_accuracy.py)"),
        "min_rel_change": (0.10, (int, float), "and |x - median| / median must be at least this (our choice: 10 %, below it a change is not worth a human's look; bench/verdict_accuracy.py)"),
        "share_min_abs_change": (0.05, (int, float), "data-wait and communication shares must also move by at least this much in absolute terms (5 points of step time), so near-zero shares do not flag"),
        "peer_min_rel_change": (0.10, (int, float), "straggler GPU/node: at least this far from the median of its peers in the same job (our choice: GPUs of one model under one load differ by a few % in clock and power)"),
        "throttle_active_share": (0.5, (int, float), "gpu-throttling needs slowdown reasons active in at least this share of GPU samples"),
        "leak_min_rise_frac": (0.03, (int, float), "memory-leak: steady rise after warm-up of at least this fraction of capacity (GPU) or of the starting level (host) (our choice: 3 %, 2.4 GiB of an 80 GB GPU; a caching allocator's one-off chunk of that size is told apart by the steady-rise tests, bench/verdict_accuracy.py)"),
        "escalate_codes": (["verdict.straggler_gpu", "verdict.straggler_node"], list, "verdict findings that escalate to drain when they repeat on the same GPU (node)"),
        "escalate_count": (3, int, "escalate after this many jobs with the finding on the same GPU/node (DESIGN.md: 3 jobs within 24 h -> drain)"),
        "escalate_window_s": (86400.0, (int, float), "... within this window (DESIGN.md: 24 h)", AT_LEAST_ZERO),
    },
    "cluster": {
        "admin_comment": (True, bool, "the job judge writes the verdict into the job's AdminComment (sacctmgr modify job, one call per judgment)"),
        "ingest_grace_s": (60.0, (int, float), "cluster ingest leaves a job alone until this long after the EpilogSlurmctld worker's wait (slurmctld_wait_s) has passed since its newest spool file (our choice: the worker's budget is wait + 30 s)"),
        "spool_keep_days": (7.0, (int, float), "spool directories of jobs still missing a node's part are removed after this many days (our choice: a week covers a node down over a weekend)"),
    },
    "nccl": {
        "binary": ("/usr/local/bin/all_reduce_perf", str, "nccl-tests all_reduce_perf used by the default probe command (hooks have no PATH)"),
        "command": ([], list, "probe argument list replacing the default (e.g. [\"/opt/nccl-tests/all_reduce_perf\", \"-b\", \"1G\", \"-e\", \"1G\", \"-g\", \"{gpus}\"]); {gpus} = GPUs of the node; never a shell string"),
        "gpus": (0, int, "GPUs the probe spans (-g); 0 = [node] gpu_count, else the /dev/nvidiaN files"),
        "min_bytes": (67108864, int, "smallest message of the default probe (-b; our choice: 64 MiB, below it all-reduce is latency-bound and busbw is noise)"),
        "max_bytes": (1073741824, int, "largest message of the default probe (-e; our choice: 1 GiB, where intra-node busbw has plateaued on A100/H100)"),
        "iters": (20, int, "timed iterations per size (-n; nccl-tests default 20)"),
        "warmup_iters": (5, int, "warm-up iterations per size (-w; nccl-tests default 5)"),
        "timeout_s": (120.0, (int, float), "hard limit of one probe run, also capped by the caller's remaining budget; a hang is nccl.probe_failed", ABOVE_ZERO),
        "judge_min_bytes": (67108864, int, "only sizes at least this large are judged against the baseline (our choice: as min_bytes)"),
        "interval_s": (21600.0, (int, float), "gpuguard health probes an idle node at most this often; 0 = at every health run (our choice: 6 h; a probe takes the GPUs for tens of seconds)", AT_LEAST_ZERO),
        "prolog": ("never", str, "when the Prolog probes: never | multi-node (jobs on more than one node) | always; never past the Prolog budget"),
        "health": (True, bool, "gpuguard health probes idle nodes (at most every interval_s) when the probe is installed: a missing default binary switches it off, a configured command that is missing is nccl.probe_failed"),
        "baseline_probes": (10, int, "a node's NCCL baseline: median/MAD of its last this-many healthy probes per message size (our choice)"),
        "min_probes": (3, int, "healthy probes a node needs before its readings are judged against its own baseline (same as baseline.min_runs)"),
        "low_frac": (0.20, (int, float), "nccl.busbw_low when busbw is this fraction below the node's median (and robust z <= -3.5) (our choice: Azure's per-SKU pass marks, e.g. 460 GB/s for H100 against ~480 GB/s typical, leave ~5 %; a node-local baseline is tighter but a probe between jobs sees clock noise)"),
        "fleet_low_frac": (0.25, (int, float), "nccl.busbw_low against the fleet: busbw this fraction below the fleet median for the same GPU model and probe (our choice: wider than low_frac, nodes differ in topology and firmware)"),
        "fleet_min_nodes": (3, int, "nodes with healthy probes a fleet median needs (our choice: a median of fewer says little)"),
        "consecutive_low": (3, int, "drain after this many consecutive low probes, each already re-measured (azurehpc-health-checks #628/#690: users asked for retries because single low NCCL readings drained healthy nodes)"),
        "remeasure": (True, bool, "re-run a low probe once before it counts (when the budget allows)"),
    },
    "fabric": {
        "sysfs_root": ("/sys/class/infiniband", str, "InfiniBand/RoCE sysfs root (tests point it at recorded trees)"),
        "ports": ([], list, "ports to check as \"mlx5_0/1\", each judged down whenever it is not ACTIVE; empty = every port found, where a port never used (no link partner, never seen ACTIVE, no traffic counted) is only recorded (ib.port_unused)"),
        "expected_rate_gbps": (0.0, (int, float), "rate every ACTIVE port must run at, Gb/s (e.g. 400 for NDR); 0 = learn: the port's own best and the node's other ports of the same HCA type"),
        "ignore_link_layers": ([], list, "link layers to skip, e.g. [\"Ethernet\"] on nodes whose RoCE ports are not for jobs"),
    },
    "slurm": {
        "bin_dir": ("/usr/bin", str, "where scontrol, sacct, sinfo, sacctmgr live (hooks have no PATH)"),
        "drain": (True, bool, "actually drain nodes; false = log the drain decision only (dry run: the Prolog then exits 0 and the job runs, as a non-zero exit would make Slurm drain the node)"),
    },
    "reports": {
        "gpu_hour_rate": (0.0, (int, float), "price of one GPU-hour where no gpu_hour_rates key matches (0 = costs not priced)"),
        "gpu_hour_rates": ({}, dict, "price per GPU-hour by GPU type and/or partition: keys \"TYPE\", \"@PARTITION\", \"TYPE@PARTITION\" (most specific wins; a MIG slice type such as a100_3g.20gb is its own type)"),
        "cpu_hour_rate": (0.0, (int, float), "price of one allocated CPU-hour, added to the GPU cost"),
        "currency": ("", str, "label printed beside costs (e.g. EUR); no conversion"),
        "idle_util_pct": (5.0, (int, float), "efficiency report: a job whose mean GPU utilisation is under this counts all its GPU-hours as idle"),
        "timezone": ("", str, "IANA zone of wall-clock times in imported sacct -P files (sync --from-file); empty = $TZ, else the system zone; also the zone of report windows and output"),
        "cluster": ("", str, "cluster name for imported sacct -P rows without a Cluster field"),
        "first_sync_days": (30, int, "first `gpuguard report sync` without --since pulls this many days of sacct history"),
        "sync_overlap_s": (300.0, (int, float), "each incremental sync starts this long before the previous one, so no job slips between syncs"),
        "sacct_timeout_s": (300.0, (int, float), "timeout of the sacct command of one sync", ABOVE_ZERO),
    },
    "health": {
        "time_budget_s": (40.0, (int, float), "hard limit of one `gpuguard health` run (our choice: below the 60 s slurmd waits for its HealthCheckProgram, slurmd.c run_script_health_check max_wait)", ABOVE_ZERO),
        "resume": (True, bool, "resume a node gpuguard drained once its fault has cleared (only faults whose recovery kind is 'auto'; never an admin's drain)"),
        "resume_after_clean_runs": (3, int, "consecutive clean health runs before such a resume (our choice: an intermittent fault must stay away for 3 HealthCheckIntervals; NHC resumes at the first pass)"),
        "disabled_steps": ([], list, "registered health steps to switch off (see `gpuguard health --list`)"),
        "send_alerts": (True, bool, "each health run ends with `gpuguard alert send` within what is left of its budget"),
        "write_metrics": (True, bool, "each health run rewrites the Prometheus textfile when [metrics] textfile_dir is set"),
    },
    "alerts": {
        "spool_file": ("", str, "where hooks queue alerts (JSON lines); empty = {state_dir}/alerts.spool; {node} allowed"),
        "spool_max_bytes": (1048576, int, "hooks stop queueing past this spool size, so a flood cannot fill the disk (our choice: 1 MiB, several thousand alerts)"),
        "dedup_window_s": (3600.0, (int, float), "same code, node and GPU within this window = one alert with a count; more repeats are sent once when the window closes (our choice: 1 h, Alertmanager's repeat cadence order)", AT_LEAST_ZERO),
        "group_wait_s": (0.0, (int, float), "an alert waits this long after its first occurrence before it is sent, gathering repeats (Alertmanager group_wait; 0: the sender runs at the end of the producing health run anyway)"),
        "rate_limit_per_hour": (60, int, "at most this many messages per sink per hour; the rest wait (our choice: a human reads about one a minute)"),
        "max_attempts": (8, int, "delivery attempts per message before it is given up (logged)"),
        "retry_base_s": (30.0, (int, float), "first retry delay; doubles each attempt (exponential back-off)"),
        "retry_max_s": (3600.0, (int, float), "longest retry delay"),
        "syslog_min_severity": ("warning", str, "syslog/journald sink: lowest severity sent (info | warning | critical; empty = off)"),
        "syslog_address": ("/dev/log", str, "syslog socket (journald listens on /dev/log) or host:port for UDP"),
        "syslog_facility": ("daemon", str, "syslog facility name (logging.handlers.SysLogHandler.facility_names)"),
        "webhook_url": ("", str, "JSON webhook (Slack, Mattermost, Teams incoming webhook: the body's \"text\" is the message); empty = off"),
        "webhook_min_severity": ("warning", str, "webhook sink: lowest severity sent"),
        "webhook_timeout_s": (5.0, (int, float), "timeout of one webhook request", ABOVE_ZERO),
        "mail_to": ([], list, "mail recipients; empty = mail off"),
        "mail_min_severity": ("critical", str, "mail sink: lowest severity sent"),
        "mail_program": ("", str, "mail program: a sendmail binary (`sendmail -oi -- RCPT`, headers on stdin) or a mail(1)-style one (`PROG -s SUBJECT RCPT`, as Slurm's MailProg is called); empty = Slurm's MailProg from `scontrol show config`"),
    },
    "metrics": {
        "textfile_dir": ("", str, "node_exporter textfile-collector directory (--collector.textfile.directory); empty = no Prometheus file"),
        "dcgm_job_map_dir": ("", str, "dcgm-exporter HPC job-mapping directory (--hpc-job-mapping-dir): one file per GPU index with the job ids; empty = off"),
        "gpustat_dir": ("", str, "Princeton jobstats GPU ownership directory (usually /run/gpustat): one file per GPU index with 'JOBID UID'; empty = off"),
    },
    "maintenance": {
        "windows": ([], list, "maintenance windows: [{nodes = \"gpu[01-04]\", start = \"2026-12-01T08:00:00Z\", end = \"...\", reason = \"...\"}]; inside one a node records findings but sends no alert and is neither drained nor resumed"),
        "slurm_reservations": (True, bool, "also treat nodes in a Slurm reservation with the MAINT flag (`scontrol show reservation`) as in maintenance"),
    },
    "job_page": {
        "advice_file": ("", str, "TOML file of per-cause advice for `gpuguard job show` and end-of-job mail (keys who, check, docs per cause); merged over the shipped gpuguard/data/advice.toml; empty = shipped advice only"),
        "idle_gpu_pct": (5.0, (int, float), "a GPU whose mean utilisation is under this is flagged idle on the job page (same default as [reports] idle_util_pct)"),
    },
    "mail": {
        "mailer": ("/usr/bin/mail", str, "real mail program the MailProg wrapper (gpuguard-mail) runs with Slurm's arguments (Slurm's default MailProg)"),
        "store": ("", str, "store the MailProg wrapper reads job summaries from; empty = [paths] cluster_store, else [paths] store"),
    },
    "display": {
        "timezone": ("", str, "IANA zone of every time printed by gpuguard commands (text and JSON, ISO 8601 with offset); empty = [reports] timezone, else $TZ, else the system zone"),
    },
    "policy": {},  # finding code -> action; validated separately
}

# Sections whose keys are free-form (validated by value, not by name).
_FREE_SECTIONS = {"policy"}


#: A single Slurm node name as slurmd sets ``SLURMD_NODENAME`` (our choice: host-name
#: characters; slurm.conf(5) NodeName is a host name, a list or range is not one node).
_NODE_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")


class ConfigError(Exception):
    """A configuration problem; ``str()`` is one line naming file, key and expectation."""


@dataclass
class Config:
    """The effective configuration.

    ``values[section][key]`` holds every key of :data:`SCHEMA`; ``origin[(section, key)]``
    says where it came from ("default" or the file path). ``policy`` maps finding codes to
    actions and ``xid_policy`` maps XID numbers to actions (both overrides only; shipped
    defaults live in :mod:`gpuguard.policy` and :mod:`gpuguard.xid.catalog`).
    """

    path: str | None
    values: dict[str, dict[str, Any]]
    origin: dict[tuple[str, str], str]
    policy: dict[str, str] = field(default_factory=dict)
    xid_policy: dict[int, str] = field(default_factory=dict)

    def get(self, section: str, key: str) -> Any:
        """Value of ``section.key`` with ``{node}`` expanded in string values."""
        v = self.values[section][key]
        if isinstance(v, str) and "{node}" in v:
            v = v.replace("{node}", self.node_name)
        return v

    @property
    def node_name(self) -> str:
        """``[node] name``, else ``$SLURMD_NODENAME`` when it is a plausible node name,
        else the short host name. The name goes into paths (``{node}``) and into
        ``scontrol ... nodename=``: a value with ``/``, ``,``, brackets, whitespace or a
        leading ``.``/``-`` (a path escape, a node list, an option) is never used."""
        n = self.values["node"]["name"]
        env = os.environ.get("SLURMD_NODENAME") or ""
        if not n and _NODE_NAME_RE.fullmatch(env):
            n = env
        return n or socket.gethostname().split(".")[0]

    @property
    def store_path(self) -> str:
        return self.get("paths", "store")

    @property
    def cluster_store_path(self) -> str:
        return self.get("paths", "cluster_store") or self.store_path


def _type_name(t: type | tuple[type, ...]) -> str:
    if isinstance(t, tuple):
        return " or ".join(x.__name__ for x in t)
    return t.__name__


def _check_type(v: Any, t: type | tuple[type, ...]) -> bool:
    types = t if isinstance(t, tuple) else (t,)
    if isinstance(v, bool) and bool not in types:
        return False  # TOML true is not a number
    return isinstance(v, types)


#: Where Slurm itself looks for slurm.conf when nothing names it, in our order: the
#: Debian/Ubuntu (since Slurm 20.11), RHEL/OpenHPC packages and SchedMD's RPMs
#: (``/etc/slurm``); a source build with the default prefix (``/usr/local/etc``); Debian
#: before 20.11 (``/etc/slurm-llnl``); slurmd's configless cache (Slurm >= 21.08,
#: ``/run/slurm/conf``).
SLURM_CONF_LOCATIONS = ("/etc/slurm/slurm.conf", "/usr/local/etc/slurm.conf", "/etc/slurm-llnl/slurm.conf",
                        "/run/slurm/conf/slurm.conf")
#: Slurm daemons whose ``-f FILE`` names the slurm.conf a hook runs under (EpilogSlurmctld's
#: parent is slurmscriptd, a fork of slurmctld that keeps its command line).
_SLURM_DAEMONS = ("slurmctld", "slurmd", "slurmscriptd", "slurmstepd")


def _daemon_slurm_conf(pid: int | None = None, depth: int = 3) -> str | None:
    """The ``-f FILE`` (or ``SLURM_CONF`` in the environment) of the nearest Slurm daemon
    among our ancestors, read from ``/proc``; None when there is none (a login shell) or
    ``/proc`` says nothing. EpilogSlurmctld gets no ``SLURM_CONF`` (SLURM-FACTS.md §4), so
    this is how it learns the slurm.conf slurmctld was started with."""
    pid = os.getppid() if pid is None else pid
    for _ in range(depth):
        if pid <= 1:
            return None
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                argv = [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
            with open(f"/proc/{pid}/stat", "rb") as fh:
                ppid = int(fh.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None
        if argv and os.path.basename(argv[0]).split(":")[0] in _SLURM_DAEMONS:
            for i, a in enumerate(argv[1:], 1):
                if a == "-f" and i + 1 < len(argv):
                    return os.path.abspath(argv[i + 1]) if os.path.isabs(argv[i + 1]) else None
                if a.startswith("-f") and len(a) > 2 and os.path.isabs(a[2:]):
                    return a[2:]
            try:
                with open(f"/proc/{pid}/environ", "rb") as fh:
                    for kv in fh.read().split(b"\0"):
                        if kv.startswith(b"SLURM_CONF="):
                            v = kv[len(b"SLURM_CONF="):].decode(errors="replace")
                            return v if os.path.isabs(v) else None
            except OSError:
                pass  # another user's daemon: its environment is private
            return None
        pid = ppid
    return None


def slurm_conf_path() -> tuple[str | None, str]:
    """``(path, how found)`` of the slurm.conf in effect for this process: ``$SLURM_CONF``,
    else the ``-f`` of the Slurm daemon that started us, else the first of
    :data:`SLURM_CONF_LOCATIONS` that exists; ``(None, "")`` when there is none."""
    env = os.environ.get("SLURM_CONF")
    if env:
        return env, "$SLURM_CONF"
    daemon = _daemon_slurm_conf()
    if daemon and os.path.exists(daemon):
        return daemon, "the Slurm daemon's -f"
    for p in SLURM_CONF_LOCATIONS:
        if os.path.exists(p):
            return p, "a standard location"
    return None, ""


def export_slurm_conf() -> str | None:
    """Set ``SLURM_CONF`` for the Slurm commands we run (scontrol, sacctmgr) when it is
    unset and :func:`slurm_conf_path` found one elsewhere (EpilogSlurmctld); returns it."""
    path, how = slurm_conf_path()
    if path and how != "$SLURM_CONF" and how != "a standard location":
        os.environ["SLURM_CONF"] = path
    return path


def config_candidates() -> list[str]:
    """Every place :func:`find_config_path` looks after ``--config`` and
    ``$GPUGUARD_CONFIG``, in order (module docstring)."""
    out: list[str] = []
    env = os.environ.get("SLURM_CONF")
    if env:
        out.append(os.path.join(os.path.dirname(env), "gpuguard.toml"))
    daemon = _daemon_slurm_conf()
    if daemon:
        out.append(os.path.join(os.path.dirname(daemon), "gpuguard.toml"))
    out.append(DEFAULT_PATH)
    out += [os.path.join(os.path.dirname(p), "gpuguard.toml") for p in SLURM_CONF_LOCATIONS]
    seen: set[str] = set()
    return [p for p in out if not (p in seen or seen.add(p))]


def find_config_path(explicit: str | None = None) -> tuple[str | None, bool]:
    """Return ``(path, required)``: the file to read and whether it must exist. A
    candidate that is a dangling symlink is returned (required) so that :func:`load`
    reports it instead of falling back to the defaults in silence."""
    if explicit:
        return explicit, True
    env = os.environ.get("GPUGUARD_CONFIG")
    if env:
        return env, True
    for cand in config_candidates():
        if os.path.lexists(cand):
            return cand, True
    return None, False


def load(explicit: str | None = None, *, require: bool = False) -> Config:
    """Load the effective configuration (see the module docstring for the search order).

    Raises :class:`ConfigError` for an unreadable file, a dangling symlink, bad TOML, an
    unknown section or key, a wrong type, or an unknown policy action, and, run as root,
    for a file another user could have written (:func:`_check_owner`); with ``require``
    (the hooks) also when no file is found at all, naming every place looked at.
    """
    return parse(*read(explicit, require=require))


def read(explicit: str | None = None, *, require: bool = False) -> tuple[str | None, bytes]:
    """The file part of :func:`load`, every step that touches a filesystem: ``(path or
    None, its bytes)``. Raises :class:`ConfigError` as :func:`load` does for the file."""
    path, _required = find_config_path(explicit)
    if path is None and require:
        raise ConfigError("no gpuguard config found; looked at $GPUGUARD_CONFIG and "
                          + ", ".join(config_candidates()))
    if path is None:
        return None, b""
    if os.path.islink(path) and not os.path.exists(path):
        raise ConfigError(f"{path}: dangling symlink to {os.readlink(path)}")
    try:
        return path, _read_config_file(path)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except PermissionError:
        raise ConfigError(f"{path}: config file not readable (permission denied)") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, expected a TOML file") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config: {e.strerror or e}") from None


def parse(path: str | None, data: bytes) -> Config:
    """The :class:`Config` of config file ``path``'s bytes ``data`` (no file: the
    defaults). Raises :class:`ConfigError` as :func:`load` does for the contents."""
    try:
        doc = tomllib.loads(data.decode("utf-8")) if path is not None else {}
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except RecursionError:  # tomllib recurses per nesting level: `a = [[[[...`
        raise ConfigError(f"{path}: invalid TOML: arrays or tables nested too deep") from None
    return from_dict(doc, path)


#: Largest config file read (bytes; our choice: the full example is about 20 KiB).
MAX_CONFIG_BYTES = 1 << 20


def _read_config_file(path: str) -> bytes:
    """The bytes of config file ``path``: a regular file (or /dev/null), opened without
    blocking on a FIFO, owner-checked (:func:`_check_owner`), at most
    :data:`MAX_CONFIG_BYTES`. Raises :class:`ConfigError` or ``OSError``."""
    import stat

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) and not (stat.S_ISCHR(st.st_mode) and os.path.samefile(path, os.devnull)):
            what = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode) else "not a file"
            raise ConfigError(f"{path}: not a regular file ({what}), expected a TOML file")
        _check_owner(path, st)
        data = fh.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: more than {MAX_CONFIG_BYTES} bytes, not a gpuguard config")
    return data


def _check_owner(path: str, st: os.stat_result) -> None:
    """Run as root, refuse a config that another user could have written: it names
    programs root runs (``[nccl] binary``/``command``, ``[alerts] mail_program``), files
    root writes and the drain policy. It must belong to root (or to us) and be writable by
    no group but root's and not by others (sudo's rule for sudoers; OpenSSH's
    ``StrictModes``). Raises :class:`ConfigError`."""
    import stat

    if os.geteuid() != 0 or stat.S_ISCHR(st.st_mode):  # --config /dev/null: nothing to read
        return
    if st.st_uid not in (0, os.geteuid()):
        raise ConfigError(f"{path}: belongs to uid {st.st_uid}, not root: not read by a hook running as root "
                          "(chown root)")
    if st.st_mode & stat.S_IWOTH or (st.st_mode & stat.S_IWGRP and st.st_gid != 0):
        raise ConfigError(f"{path}: writable by {'others' if st.st_mode & stat.S_IWOTH else f'group {st.st_gid}'} "
                          f"(mode {stat.S_IMODE(st.st_mode):04o}): not read by a hook running as root (chmod go-w)")


def from_dict(data: dict[str, Any], path: str | None = None) -> Config:
    """Validate a parsed TOML document against :data:`SCHEMA` (see :func:`load`)."""
    where = path or "<config>"
    values = {s: {k: spec[0] for k, spec in keys.items()} for s, keys in SCHEMA.items()}
    origin = {(s, k): "default" for s, keys in SCHEMA.items() for k in keys}
    policy: dict[str, str] = {}
    xid_policy: dict[int, str] = {}
    for section, body in data.items():
        if section not in SCHEMA:
            raise ConfigError(f"{where}: unknown section [{section}]; known: {', '.join(SCHEMA)}")
        if not isinstance(body, dict):
            raise ConfigError(f"{where}: [{section}] must be a table")
        if section in _FREE_SECTIONS:
            policy, xid_policy = _policy_from(body, where)
            continue
        for key, v in body.items():
            spec = SCHEMA[section].get(key)
            if spec is None:
                raise ConfigError(f"{where}: unknown key {section}.{key}; known: {', '.join(SCHEMA[section])}")
            if not _check_type(v, spec[1]):
                raise ConfigError(
                    f"{where}: {section}.{key} must be {_type_name(spec[1])}, got {type(v).__name__} {v!r}"
                )
            if isinstance(spec[0], float) and isinstance(v, int):
                v = float(v)
            values[section][key] = v
            origin[(section, key)] = where
    src = values["gpu"]["source"]
    if src not in ("nvml", "replay"):
        raise ConfigError(f"{where}: gpu.source must be 'nvml' or 'replay', got {src!r}")
    if src == "replay" and not values["gpu"]["replay_path"]:
        raise ConfigError(f"{where}: gpu.replay_path is required when gpu.source = 'replay'")
    if values["checks"]["disabled"]:
        from gpuguard.checks import load_all

        known = load_all()
        bad = [n for n in values["checks"]["disabled"] if n not in known]
        if bad:
            raise ConfigError(f"{where}: checks.disabled: unknown check(s) {', '.join(map(str, bad))}; "
                              f"known: {', '.join(sorted(known))}")
    if values["nccl"]["prolog"] not in ("never", "multi-node", "always"):
        raise ConfigError(f"{where}: nccl.prolog must be 'never', 'multi-node' or 'always'")
    if not all(isinstance(a, str) for a in values["nccl"]["command"]):
        raise ConfigError(f"{where}: nccl.command must be a list of strings (an argument list)")
    if values["xid"]["first_scan_lookback"] not in ("boot", "all", "none"):
        raise ConfigError(f"{where}: xid.first_scan_lookback must be 'boot', 'all' or 'none'")
    _check_numbers(values, where)
    for key in ("time_budget_s",):
        for sec in ("prolog", "epilog"):
            if values[sec][key] <= 0:
                raise ConfigError(f"{where}: {sec}.{key} must be > 0")
    _check_ops(values, where)
    return Config(path=path, values=values, origin=origin, policy=policy, xid_policy=xid_policy)


def _check_numbers(values: dict[str, dict[str, Any]], where: str) -> None:
    """Every number of the schema is a count, a size, a time, a rate or a fraction: a
    negative one, or TOML's ``nan``/``inf`` (a budget that never ends, a threshold no value
    ever crosses), is a mistake to name, not a value to run on."""
    import math

    for sec, keys in SCHEMA.items():
        for key in keys:
            v = values.get(sec, {}).get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"{where}: {sec}.{key} must be a finite number >= 0, got {v}")
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            # TOML integers are 64-bit signed ("if an integer cannot be represented
            # losslessly, an error must be thrown", toml.io v1.0.0); tomllib reads any size,
            # and SQLite (a LIMIT, a stored count) overflows past 2**63 - 1
            if isinstance(v, int) and v > 2**63 - 1:
                raise ConfigError(f"{where}: {sec}.{key} is above the TOML integer range (2**63 - 1), got {v}")
            # a percentage above 100 makes every GPU "idle" (the idle checks then judge
            # GPUs under load); a share is a fraction; the lower bound is the key's own
            if key.endswith("_pct") and v > 100:
                raise ConfigError(f"{where}: {sec}.{key} is a percentage: 0 to 100, got {v}")
            if key.endswith("_share") and not 0 < v <= 1:
                raise ConfigError(f"{where}: {sec}.{key} is a share: above 0, at most 1, got {v}")
            if lower_bound(sec, key) == ABOVE_ZERO and v == 0:
                raise ConfigError(f"{where}: {sec}.{key} must be > 0")


def lower_bound(section: str, key: str) -> str:
    """The declared lower bound of ``section.key``: :data:`ABOVE_ZERO` or
    :data:`AT_LEAST_ZERO` (the default when its SCHEMA entry has no 4th element).
    Raises ``KeyError`` for a key not in :data:`SCHEMA`."""
    spec = SCHEMA[section][key]
    return spec[3] if len(spec) > 3 else AT_LEAST_ZERO


def _check_ops(values: dict[str, dict[str, Any]], where: str) -> None:
    """Values of the [health], [alerts] and [maintenance] sections that a type cannot check."""
    from gpuguard.ops.maintenance import MaintenanceError, parse_windows

    for key in ("syslog_min_severity", "webhook_min_severity", "mail_min_severity"):
        if values["alerts"][key] not in ("", "info", "warning", "critical"):
            raise ConfigError(f"{where}: alerts.{key} must be info, warning, critical or empty")
    if values["health"]["resume_after_clean_runs"] < 1:
        raise ConfigError(f"{where}: health.resume_after_clean_runs must be >= 1")
    name = values["node"]["name"]
    if name and not _NODE_NAME_RE.fullmatch(name):
        # {node} is put into paths root writes (run_dir /run/gpuguard/{node}): '../../etc' is /etc
        raise ConfigError(f"{where}: node.name must be one host name (letters, digits, _ . -, "
                          f"not starting with . or -), got {name!r}")
    try:
        parse_windows(values["maintenance"]["windows"])
    except MaintenanceError as e:
        raise ConfigError(f"{where}: maintenance.windows: {e}") from None


def _policy_from(body: dict[str, Any], where: str) -> tuple[dict[str, str], dict[int, str]]:
    policy: dict[str, str] = {}
    xid_policy: dict[int, str] = {}
    for code, action in body.items():
        if code == "xid":
            if not isinstance(action, dict):
                raise ConfigError(f"{where}: [policy.xid] must be a table of XID = action")
            for x, a in action.items():
                if not str(x).isdigit():
                    raise ConfigError(f"{where}: policy.xid.{x}: XID must be a number")
                _check_action(a, f"policy.xid.{x}", where)
                xid_policy[int(x)] = a
            continue
        _check_action(action, f"policy.{code}", where)
        policy[code] = action
    if policy:
        from gpuguard.policy import is_known_code, known_codes

        unknown = sorted(c for c in policy if not is_known_code(c))
        if unknown:
            fams = sorted({c.split(".", 1)[0] for c in known_codes()})
            near = sorted(c for c in known_codes() if c.split(".", 1)[0] == unknown[0].split(".", 1)[0])
            raise ConfigError(f"{where}: policy.{unknown[0]}: unknown finding code; "
                              + (f"known in {unknown[0].split('.', 1)[0]}: {', '.join(near)}" if near else
                                 f"families: {', '.join(fams)}, xid.N, sxid.N")
                              )
    return policy, xid_policy


def _check_action(a: Any, key: str, where: str) -> None:
    if a not in ACTIONS:
        raise ConfigError(f"{where}: {key} must be one of {', '.join(ACTIONS)}, got {a!r}")


def describe(cfg: Config) -> list[tuple[str, Any, str]]:
    """Rows ``(section.key, value, origin)`` of the effective configuration, for
    ``gpuguard config show``."""
    rows = []
    for s, keys in SCHEMA.items():
        for k in keys:
            rows.append((f"{s}.{k}", cfg.get(s, k), cfg.origin[(s, k)]))
    for code, a in sorted(cfg.policy.items()):
        rows.append((f"policy.{code}", a, cfg.path or "<config>"))
    for x, a in sorted(cfg.xid_policy.items()):
        rows.append((f"policy.xid.{x}", a, cfg.path or "<config>"))
    return rows


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(json.dumps(x) for x in v) + "]"
    return repr(v)


def example_toml() -> str:
    """A complete gpuguard.toml with every key at its default, commented out, each with
    its doc line (``gpuguard config example``; ``slurm-conf-examples/gpuguard.toml``)."""
    out = [
        "# gpuguard.toml — every key with its default, commented out.",
        "# Install as /etc/gpuguard/gpuguard.toml, or as gpuguard.toml next to slurm.conf (the hooks",
        "# find it through $SLURM_CONF). `gpuguard config show` prints the effective values.",
        "# {node} in a path is replaced by the node name ($SLURMD_NODENAME or the short host name).",
        "",
    ]
    for section, keys in SCHEMA.items():
        if not keys:
            continue
        out.append(f"[{section}]")
        for key, (default, _t, doc, *_bound) in keys.items():
            out += [f"# {doc}", f"# {key} = {_toml_value(default)}"]
        out.append("")
    out += [
        "# Policy overrides: finding code -> record | alert | drain | fail-job.",
        "# Shipped defaults and their sources: each family's CODES (gpuguard/checks/*.py) and the XID",
        "# catalog gpuguard/xid/catalog.py. Disputed XIDs (63, 68, 92, 109) are where sites differ.",
        "[policy]",
        '# "pcie.width_degraded" = "drain"',
        '# "config.persistence_off" = "record"',
        "",
        "[policy.xid]",
        '# 63 = "drain"    # row remap pending: drain at once instead of alerting',
        '# 92 = "record"',
    ]
    return "\n".join(out) + "\n"


def reference_markdown() -> str:
    """The README's configuration reference tables, generated from :data:`SCHEMA`."""
    out = []
    for section, keys in SCHEMA.items():
        if not keys:
            continue
        out += ["", f"**[{section}]**", "", "| key | default | meaning |", "|---|---|---|"]
        out += [f"| `{k}` | `{json.dumps(d)}` | {doc} |" for k, (d, _t, doc, *_bound) in keys.items()]
    return "\n".join(out) + "\n"
