"""Method registry (the BytePS compressor-registry pattern), kept at this
import path for compatibility: it lives in :mod:`gtopk_plugin.registry` (a
leaf module, so ``config.py`` can validate against it without importing
``compress/`` upward).  A new method is one new file in this folder whose
class is decorated with :func:`register`."""
from ..registry import (HyperParam, available, describe, doc_line, find_hyperparam, get, register,  # noqa: F401
                        resolve, table, unregister)

__all__ = ["HyperParam", "available", "describe", "get", "register", "unregister", "resolve", "table",
           "find_hyperparam", "doc_line"]
