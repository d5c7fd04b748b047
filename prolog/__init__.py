"""Pre-job node health checks, node baseline and collector launch (Slurm Prolog)."""
