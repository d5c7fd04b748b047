"""gpuguard command line (click). Thin layer: parse, call the library, format."""

import click


@click.group()
def main() -> None:
    """gpuguard: GPU node health, per-job metrics and sacct reports for Slurm."""


if __name__ == "__main__":
    main()
