"""Operations around the hooks: ``gpuguard health`` (Slurm's HealthCheckProgram) and
resume, ``gpuguard node``, alert sinks, Prometheus output, maintenance windows.

The "ops" store migration set (:mod:`gpuguard.ops.schema`) is registered by the modules
that read or write its tables, not here: the config imports
:mod:`gpuguard.ops.maintenance`, and the TaskProlog and training API must stay free of
sqlite imports."""
