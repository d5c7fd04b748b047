"""Operations around the hooks: ``gpuguard health`` (Slurm's HealthCheckProgram) and
resume, ``gpuguard node``, alert sinks, Prometheus output, maintenance windows."""
