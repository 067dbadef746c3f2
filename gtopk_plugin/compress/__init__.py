"""Compressors (selectors and codecs) and error feedback.  Pure torch; never
communicates.

Every module of this folder is imported here, so a compressor registers
itself by existing: adding one is one file with a class decorated by
``@register("name")`` (docs/compressors.md).  The registry
(:func:`available`, :func:`describe`, :func:`get`, :func:`register`) is the
one list of methods every layer reads.
"""
import importlib as _importlib
import pkgutil as _pkgutil

from gtopk_plugin.compress.compressor import Codec, Compressor, HyperParam, SelectionContext, Selector
from gtopk_plugin.compress.error_feedback import ErrorFeedback
from gtopk_plugin.registry import available, describe, get, register, table, unregister

# the built-in compressors, in a fixed order (the registry's order: docs
# tables, CLI choices), then any other module of this folder (a new one)
_FIRST = ("dense", "topk", "rtopk", "randomk", "threshold")
for _name in _FIRST + tuple(sorted(m.name for m in _pkgutil.iter_modules(__path__)
                                   if not m.name.startswith("_") and m.name not in _FIRST)):
    _importlib.import_module(f".{_name}", __name__)

__all__ = ["Compressor", "Selector", "Codec", "HyperParam", "SelectionContext", "ErrorFeedback",
           "available", "describe", "get", "register", "unregister", "table"]
