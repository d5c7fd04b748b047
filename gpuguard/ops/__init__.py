"""Operations around the hooks: ``gpuguard health`` (Slurm's HealthCheckProgram) and
resume, ``gpuguard node``, alert sinks, Prometheus output, maintenance windows."""

from gpuguard.ops import schema  # noqa: F401  (registers the "ops" store migration set)
