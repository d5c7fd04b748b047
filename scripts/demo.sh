#!/usr/bin/env bash
# The main job on the embedded default: judge real nvidia-smi dumps and a real kernel log
# from the corpus (tests/data) exactly as the prolog would, and print the findings.
set -u
cd "$(dirname "$0")/.."
G=.venv/bin/gpuguard
export GPUGUARD_CONFIG=/dev/null   # shipped defaults only
for dump in nvsmi-q-h100x8-535.183.01-full.txt nvsmi-q-a100-510.73.08-row-remap-pending-partial.txt; do
  echo "== gpuguard check --from-nvidia-smi tests/data/$dump"
  $G check --from-nvidia-smi "tests/data/$dump"
  echo "(exit $?: 0 healthy, 1 warnings, 2 critical)"
  echo
done
echo "== gpuguard xid scan tests/data/xid-79-sxid-20034-nvswitch.txt"
$G xid scan tests/data/xid-79-sxid-20034-nvswitch.txt
exit 0
