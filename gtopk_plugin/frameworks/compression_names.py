"""The ``Compression`` namespace of the Horovod layers, one definition for
PyTorch (:mod:`gtopk_plugin.horovod`) and TensorFlow
(:mod:`gtopk_plugin.tensorflow`), so a job switches framework without
renaming anything.

Besides Horovod's ``none`` and ``fp16`` it offers every compressor of the
registry (:mod:`gtopk_plugin.registry`), built-in or user-registered,
generated on attribute access::

    Compression.<name>(density, **kwargs)   # a method that selects k entries
    Compression.<name>(**kwargs)            # one that ignores the density (codecs, dense)

``kwargs``: the method's hyper-parameters (``describe(name)``) and the
framework's sparse-compression keywords.  Each framework subclasses
:class:`CompressionNames`, setting ``none``/``fp16``, ``_sparse`` (called as
``_sparse(method, density, **kwargs)``; :func:`split_hyper` separates the
method's hyper-parameters) and ``_public_name``.  Imports only the registry.
"""
from typing import Optional

from gtopk_plugin import registry

# Density handed to ``_sparse`` for methods that ignore it (a valid value).
_NO_DENSITY = 1.0


class _LiveMethods:
    """The registered method names, read at every use (a user may register
    one after this module was imported): ``name in SPARSE_METHODS``, iteration."""

    def __contains__(self, name) -> bool:
        return isinstance(name, str) and name in registry.available()

    def __iter__(self):
        return iter(registry.available())

    def __len__(self) -> int:
        return len(registry.available())

    def __repr__(self) -> str:
        return repr(registry.available())


SPARSE_METHODS = _LiveMethods()


def split_hyper(method: str, kwargs: dict):
    """``(hyper, rest)``: the keywords ``method`` declares as its own
    hyper-parameters, and everything else (the reducer's keywords)."""
    declared = {p.name for p in registry.get(method).hyperparams}
    hyper = {k: v for k, v in kwargs.items() if k in declared}
    rest = {k: v for k, v in kwargs.items() if k not in declared}
    return hyper, rest


def signature(name: str) -> str:
    """``"rtopk(density, r_factor=4.0)"``: how to call ``Compression.<name>``."""
    d = registry.describe(name)
    args = (["density"] if d["uses_density"] else []) + \
        [f"{p['name']}={p['default']!r}" for p in d["hyperparams"]]
    return f"{name}({', '.join(args)})"


def _factory(cls, name: str):
    c = registry.get(name)

    def make(*args, **kwargs):
        if c.uses_density:
            if len(args) > 1 or (not args and "density" not in kwargs):
                raise TypeError(f"{cls._public_name}.{signature(name)} takes the density, e.g. "
                                f"{cls._public_name}.{name}(0.01)")
            density = args[0] if args else kwargs.pop("density")
        else:
            if args:
                raise TypeError(f"{cls._public_name}.{signature(name)} takes no density (it does not "
                                "select entries); pass keywords only")
            density = kwargs.pop("density", _NO_DENSITY)
        hyper, _ = split_hyper(name, kwargs)
        registry.resolve(name, hyper)  # ValueError naming the valid range, before any framework call
        return cls._sparse(name, density, **kwargs)

    make.__name__ = name
    make.__qualname__ = f"{cls._public_name}.{name}"
    make.__doc__ = f"{signature(name)}: {registry.doc_line(c)}"
    return make


class _CompressionMeta(type):
    # Every registered compressor is an attribute, made on access; a typo
    # (Compression.gtop) names every choice instead of a bare AttributeError.
    def __getattr__(cls, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in registry.available():
            return _factory(cls, name)
        choices = ", ".join(["none", "fp16"] + [signature(n) for n in registry.available()])
        raise AttributeError(f"unknown compression {name!r}: {cls._public_name} has {choices}")

    def __dir__(cls):
        return sorted(set(super().__dir__()) | set(registry.available()))


class CompressionNames(metaclass=_CompressionMeta):
    """``none``/``fp16`` (Horovod's dense compressors) and every registered
    compressor (see the module docstring)."""

    none = None
    fp16 = None
    _sparse = None  # the framework's SparseCompression class
    _public_name = "Compression"  # as users import it, for error messages

    @classmethod
    def from_name(cls, name: str, density: Optional[float] = None, **kwargs):
        """``"none"``, ``"fp16"`` or a registered method name (then ``density``
        is required for methods that select entries); ``ValueError`` for
        anything else (command-line helpers)."""
        if name in ("none", "fp16"):
            return getattr(cls, name)
        if name not in registry.available():
            raise ValueError(f"unknown compression {name!r}; choose one of none, fp16, "
                             f"{', '.join(registry.available())}")
        if registry.get(name).uses_density:
            if density is None:
                raise ValueError(f"compression {name!r} needs a density, e.g. 0.01")
            return getattr(cls, name)(density, **kwargs)
        return getattr(cls, name)(**kwargs)

    @classmethod
    def names(cls):
        """Every name ``from_name`` accepts (CLI ``choices=``)."""
        return ("none", "fp16") + registry.available()
