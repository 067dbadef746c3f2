"""The ``Compression`` namespace of the Horovod layers, one definition for
PyTorch (:mod:`gtopk_plugin.horovod`) and TensorFlow
(:mod:`gtopk_plugin.tensorflow`), so a job switches framework without
renaming anything.

Horovod's own ``Compression`` has ``none`` and ``fp16``; ours adds the sparse
methods of the core (DESIGN.md §3): ``topk`` (Top-k S-SGD, sparse
allgather), ``gtopk`` (the gTop-k butterfly, Shi et al. 2019), ``rtopk``
(k random of the top r·k, Barnes et al. 2020), ``randomk`` and
``threshold``.  Each framework subclasses :class:`CompressionNames` and sets
``none``/``fp16`` (Horovod's compressors), ``_sparse`` (its sparse
compression class, called as ``_sparse(method, density, **kwargs)``) and
``_public_name``.
Framework-neutral: imports nothing.
"""
from typing import Optional

SPARSE_METHODS = ("topk", "gtopk", "rtopk", "randomk", "threshold")


class _CompressionMeta(type):
    # A typo (Compression.gtop) names every choice instead of a bare AttributeError.
    def __getattr__(cls, name):
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(
            f"unknown compression {name!r}: {cls._public_name} has none, fp16, "
            "topk(density), gtopk(density), rtopk(density, r_factor=4), randomk(density), "
            "threshold(density)")


class CompressionNames(metaclass=_CompressionMeta):
    """``none``/``fp16`` (Horovod's dense compressors) and the sparse methods,
    each taking the density (fraction of entries sent per tensor) and the
    keywords of the framework's ``SparseCompression``."""

    none = None
    fp16 = None
    _sparse = None  # the framework's SparseCompression class
    _public_name = "Compression"  # as users import it, for error messages

    @classmethod
    def topk(cls, density: float, **kwargs):
        """Exact top-k per tensor, sparse allgather (Top-k S-SGD)."""
        return cls._sparse("topk", density, **kwargs)

    @classmethod
    def gtopk(cls, density: float, **kwargs):
        """Exact top-k, merged by the gTop-k butterfly in log2 P rounds."""
        return cls._sparse("gtopk", density, **kwargs)

    @classmethod
    def rtopk(cls, density: float, r_factor: float = 4.0, **kwargs):
        """k random entries of each rank's top r·k, sparse allgather."""
        return cls._sparse("rtopk", density, r_factor=r_factor, **kwargs)

    @classmethod
    def randomk(cls, density: float, **kwargs):
        """k random indices shared by all ranks; values allreduced."""
        return cls._sparse("randomk", density, **kwargs)

    @classmethod
    def threshold(cls, density: float, **kwargs):
        """DGC-style sampled threshold (count within ±10% of k), allgather."""
        return cls._sparse("threshold", density, **kwargs)

    @classmethod
    def from_name(cls, name: str, density: Optional[float] = None, **kwargs):
        """``"none"``, ``"fp16"`` or a sparse method name (then ``density`` is
        required); ``ValueError`` for anything else (command-line helpers)."""
        if name in ("none", "fp16"):
            return getattr(cls, name)
        if name not in SPARSE_METHODS:
            raise ValueError(f"unknown compression {name!r}; choose one of none, fp16, "
                             f"{', '.join(SPARSE_METHODS)}")
        if density is None:
            raise ValueError(f"compression {name!r} needs a density, e.g. 0.01")
        return getattr(cls, name)(density, **kwargs)
