"""Slurm hook entry point (stub; filled in by the stage's issue)."""

import sys


def main() -> int:
    """Run the hook. Exit 0: gpuguard's own errors never fail a Slurm hook."""
    return 0


if __name__ == "__main__":
    sys.exit(main())
