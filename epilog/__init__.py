"""Job summary, baseline comparison, verdict and post-job drain (Slurm Epilog)."""

from gpuguard.epilog import schema  # noqa: F401  (registers the "epilog" store migration set)
from gpuguard.epilog import finding_codes  # noqa: F401  (declares the verdict.* finding codes)
