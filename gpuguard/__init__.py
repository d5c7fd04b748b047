"""gpuguard: Slurm Prolog/Epilog suite for GPU training clusters.

Stages (each installed under this one import name): ``gpuguard.prolog`` (pre-job
health checks), ``gpuguard.collector`` (per-job sampler and training API),
``gpuguard.epilog`` (job summary, verdict, drain), ``gpuguard.reports`` (sacct-linked
reports). The shared core lives here: config, store, GPU sources, XID scanner,
health checks, policy, Slurm access and the CLI.
"""

__version__ = "0.1.0"
