"""Selectors and error feedback.  Pure torch; never communicates."""
from . import dense, randomk, rtopk, threshold, topk  # noqa: F401  (register methods)
from .base import SelectionContext, Selector
from .error_feedback import ErrorFeedback
from .registry import available, get, register

__all__ = ["Selector", "SelectionContext", "ErrorFeedback", "available", "get", "register"]
