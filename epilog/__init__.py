"""Job summary, baseline comparison, verdict and post-job drain (Slurm Epilog)."""
