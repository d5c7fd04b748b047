"""Per-job sampler, training-record ingest and the training API."""

# The "collector" store migration set (gpuguard.collector.schema) is registered by the
# collector process and by the epilog's set, not here: the training API
# (gpuguard.collector.train) and the TaskProlog import this package and must stay
# standard-library only.
