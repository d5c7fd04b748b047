"""Per-job sampler, training-record ingest and the training API."""
