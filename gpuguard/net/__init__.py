"""Interconnect health: NCCL bandwidth probes and their baseline, NVLink per-link state,
InfiniBand/RoCE ports and counters, and parsers for the text those tools print.

Modules: :mod:`nccl_parse` (nccl-tests output), :mod:`nccl_probe` (run the probe under a
budget), :mod:`nccl_baseline` (per-node median/MAD, fleet median, findings),
:mod:`ib_sysfs` (``/sys/class/infiniband`` reader), :mod:`ib_judge` (port findings),
:mod:`ib_text` (``ibstat`` / ``ibv_devinfo -v`` / ``perfquery -x``), :mod:`nvlink_text`
(``nvidia-smi nvlink -s`` / ``-e``, ``dcgmi nvlink --link-status``, ``nvidia-smi topo -m``),
:mod:`triage` (offline ``gpuguard check --from-file``), :mod:`schema` (store tables: the ``net``
migration set, registered on import like every stage's).
"""

from gpuguard.net import schema  # noqa: F401  (registers the "net" store migration set)
