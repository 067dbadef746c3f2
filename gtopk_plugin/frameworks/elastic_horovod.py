"""Kept for old import paths: the Horovod back end of the elastic scheduler
now lives in :mod:`gtopk_plugin.frameworks.horovod.elastic`."""
from .horovod.elastic import HorovodDenseReduction  # noqa: F401

__all__ = ["HorovodDenseReduction"]
