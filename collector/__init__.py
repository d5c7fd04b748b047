"""Per-job sampler, training-record ingest and the training API."""

from gpuguard.collector import schema  # noqa: F401  (registers the "collector" store migration set)
