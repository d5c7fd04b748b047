"""sacct sync and the cost, queue-wait, failure and efficiency reports."""

from gpuguard.reports import schema  # noqa: F401  (registers the "reports" store migration set)
