"""The compressor registry: the one source of truth for method names, their
hyper-parameters and how their payloads aggregate.

A compressor class (:class:`gtopk_plugin.compress.Compressor`) is registered
under a name with :func:`register` -- the built-in ones in
``gtopk_plugin/compress/<name>.py``, a user's from user code -- and every
layer asks this module instead of keeping its own list:
``GradientReducer(method=...)`` and ``ReducerConfig`` validate the method and
its hyper-parameters here; ``Compression.<name>(...)`` of the Horovod layers
is generated from it; the DDP hook, demo and benchmarks take their command
line choices from :func:`available` and their docs tables from
:func:`describe` / :func:`table`.

This module is a leaf: it imports nothing from the package, so that
``config.py`` (the bottom layer) can validate against it without importing
``compress/`` upward.  It reads only class attributes (duck typing):
``kind``, ``aggregation``, ``merges``, ``hyperparams``, ``uses_density`` and
the docstring.  The registry is filled when ``gtopk_plugin.compress`` is
imported, which ``import gtopk_plugin`` always does first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

KINDS = ("selector", "codec")

_REGISTRY: Dict[str, type] = {}


@dataclass(frozen=True)
class HyperParam:
    """One hyper-parameter a compressor declares: name, default, type and
    valid range, and a one-line doc.  ``validate`` converts a value to the
    type or raises ``ValueError`` naming the valid range and an example.

    ``type``: ``float``, ``int``, ``bool`` or ``str``.  Numeric bounds are
    inclusive unless ``low_open``/``high_open``; ``choices`` lists the
    allowed values of a ``str`` (or any) parameter."""

    name: str
    default: Any
    doc: str
    type: type = float
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    choices: Optional[Tuple[Any, ...]] = None

    def range_text(self) -> str:
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        if self.type is bool:
            return "True or False"
        what = {float: "a finite number", int: "an integer"}.get(self.type, f"a {self.type.__name__}")
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {self.low:g}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {self.high:g}")
        return what + (" " + " and ".join(parts) if parts else "")

    def validate(self, value):
        bad = ValueError(f"{self.name} must be {self.range_text()} ({self.doc}), e.g. "
                         f"{self.default!r}; got {value!r}")
        if self.choices is not None:
            if value not in self.choices:
                raise bad
            return value
        if self.type is bool:
            if not isinstance(value, bool):
                raise bad
            return value
        if self.type in (int, float):
            if isinstance(value, bool):
                raise bad
            try:
                v = self.type(value)
            except (TypeError, ValueError, OverflowError):
                raise bad from None
            if self.type is int and v != value:
                raise bad
            if isinstance(v, float) and not math.isfinite(v):
                raise bad
            if self.low is not None and (v < self.low or (self.low_open and v == self.low)):
                raise bad
            if self.high is not None and (v > self.high or (self.high_open and v == self.high)):
                raise bad
            return v
        if not isinstance(value, self.type):
            raise bad
        return value


def register(name: str, cls: Optional[type] = None):
    """Register a compressor class under ``name``; usable as a decorator
    (``@register("onebit")``) or called (``register("mine", Mine)``), from
    the package or from user code.  Re-registering the same class is a
    no-op; another class under a taken name is a ``ValueError``."""

    def deco(c: type) -> type:
        if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
            raise ValueError(f"compressor name must be a Python identifier without a leading "
                             f"underscore (it becomes Compression.{name}); got {name!r}")
        if name in ("none", "fp16", "from_name"):
            raise ValueError(f"compressor name {name!r} is reserved by the Compression namespace")
        old = _REGISTRY.get(name)
        if old is not None and old is not c:
            raise ValueError(f"method {name!r} is already registered to {old.__name__}")
        kind = getattr(c, "kind", None)
        if kind not in KINDS:
            raise ValueError(f"{c.__name__}.kind must be one of {', '.join(KINDS)}; got {kind!r}")
        names = [p.name for p in getattr(c, "hyperparams", ())]
        if len(set(names)) != len(names):
            raise ValueError(f"{c.__name__} declares a hyper-parameter twice: {names}")
        c.name = name
        _REGISTRY[name] = c
        return c

    return deco if cls is None else deco(cls)


def unregister(name: str) -> None:
    """Remove a (user-registered) compressor; for tests and interactive use."""
    _REGISTRY.pop(name, None)


def get(name: str) -> type:
    """The class registered under ``name``; ``ValueError`` naming every
    registered method otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown method {name!r}; pass one of {', '.join(available())}") from None


def available(kind: Optional[str] = None, builtin: bool = False) -> Tuple[str, ...]:
    """Registered names in registration order (``kind``: only "selector" or
    only "codec").  For command-line ``choices=`` and docs.  ``builtin=True``:
    only the package's own compressors -- what a freshly started worker
    process knows without importing user code (benchmarks that hand method
    names to new processes, and tests that run after other modules
    registered compressors into the same process, use it)."""
    return tuple(n for n, c in _REGISTRY.items() if (kind is None or c.kind == kind)
                 and (not builtin or c.__module__.split(".")[0] == __name__.split(".")[0]))


def doc_line(cls: type) -> str:
    doc = (cls.__doc__ or "").strip()
    return doc.splitlines()[0].strip() if doc else ""


def describe(name: str) -> dict:
    """Metadata of one method, as plain data: ``name``, ``kind``,
    ``aggregation`` (its default), ``merges`` (the aggregations ``merge=``
    may choose instead), ``uses_density``, ``doc`` (first docstring line) and
    ``hyperparams`` (a list of dicts: name, default, type, range, doc)."""
    c = get(name)
    return {
        "name": name, "kind": c.kind, "aggregation": c.aggregation, "merges": tuple(c.merges),
        "uses_density": bool(c.uses_density), "doc": doc_line(c),
        "hyperparams": [{"name": p.name, "default": p.default, "type": p.type.__name__,
                         "range": p.range_text(), "doc": p.doc} for p in c.hyperparams],
    }


def table() -> str:
    """A markdown table of every registered method (docs, ``--help``)."""
    rows = ["| method | kind | aggregation | merge= | hyper-parameters | what it does |",
            "|---|---|---|---|---|---|"]
    for n in available():
        d = describe(n)
        hp = ", ".join(f"`{p['name']}={p['default']!r}`" for p in d["hyperparams"]) or "—"
        doc = d["doc"].replace("|", "\\|")  # a "|" in the text would end the cell
        rows.append(f"| `{n}` | {d['kind']} | {d['aggregation']} | {', '.join(d['merges']) or '—'} | "
                    f"{hp} | {doc} |")
    return "\n".join(rows)


def find_hyperparam(pname: str) -> Optional[HyperParam]:
    """The first declaration of hyper-parameter ``pname`` by any registered
    method (validates ``ReducerConfig.r_factor`` whatever the method)."""
    for c in _REGISTRY.values():
        for p in c.hyperparams:
            if p.name == pname:
                return p
    return None


def resolve(name: str, hyper: Dict[str, Any], legacy: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The validated hyper-parameters of method ``name``: every declared one,
    from ``hyper`` if given, else from ``legacy`` (keywords that predate
    per-method hyper-parameters, e.g. ``r_factor``), else its default.  A key
    of ``hyper`` the method does not declare is a ``ValueError``."""
    c = get(name)
    declared = {p.name: p for p in c.hyperparams}
    for key in hyper:
        if key not in declared:
            have = ", ".join(declared) or "none"
            raise ValueError(f"method {name!r} has no hyper-parameter {key!r} (its hyper-parameters: "
                             f"{have})")
    legacy = legacy or {}
    out = {}
    for pname, p in declared.items():
        v = hyper.get(pname, legacy.get(pname, p.default))
        out[pname] = p.validate(v)
    return out
