"""Method registry (the BytePS compressor-registry pattern): a method name maps
to its selector class; the class says how its results are aggregated.  A new
method is one new file that calls :func:`register`."""
from __future__ import annotations

from typing import Dict, Type

from .base import Selector

_REGISTRY: Dict[str, Type[Selector]] = {}


def register(name: str):
    """Class decorator: ``@register("topk")``."""

    def deco(cls: Type[Selector]) -> Type[Selector]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"method {name!r} is already registered to {_REGISTRY[name].__name__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def get(name: str) -> Type[Selector]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; pass one of {', '.join(available())}") from None


def available():
    return tuple(_REGISTRY)
