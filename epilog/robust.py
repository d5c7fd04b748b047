"""Moved to :mod:`gpuguard.robust` (the core: the Prolog's idle-baseline check uses it
too); this name stays so that stage code importing ``gpuguard.epilog.robust`` works."""

from gpuguard.robust import (  # noqa: F401
    MAD_TO_SIGMA, clean, mad, mean, median, quantile, rel_change, robust_z, theil_sen,
)
