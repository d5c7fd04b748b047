"""Real single-host Slurm testbed for gpuguard integration tests (see README.md)."""
