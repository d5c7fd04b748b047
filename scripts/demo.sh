#!/usr/bin/env bash
# The main job on the embedded default (README): gpuguard around real Slurm jobs on the
# single-host testbed, after a look at real nvidia-smi dumps and a real kernel log.
set -u
cd "$(dirname "$0")/.."
G=.venv/bin/gpuguard
echo "== gpuguard check --from-nvidia-smi tests/data/nvsmi-q-h100x8-535.183.01-full.txt (a real 8x H100 dump)"
$G --config /dev/null check --from-nvidia-smi tests/data/nvsmi-q-h100x8-535.183.01-full.txt
echo "(exit $?: 0 healthy, 1 warnings, 2 critical)"
echo
echo "== gpuguard xid scan tests/data/xid-79-sxid-20034-nvswitch.txt (a real kernel log)"
$G xid scan tests/data/xid-79-sxid-20034-nvswitch.txt
echo
exec .venv/bin/python scripts/demo_slurm.py
