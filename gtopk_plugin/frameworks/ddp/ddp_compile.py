"""The DDP hook under ``torch.compile``: which DDP reducer it runs on.

:func:`~gtopk_plugin.frameworks.ddp.ddp_hook.sparse_hook` reduces what DDP's
C++ reducer hands it: one ``dist.GradBucket`` per bucket, the step's last
one marked.  That reducer (and so the hook) stays in eager mode when the
model or the DDP module is compiled: Dynamo only splits the forward graph
at bucket boundaries (``optimize_ddp`` "ddp_optimizer", the default, or
"no_optimization"), so the hook sees every bucket of every step.

Compiled autograd refuses the C++ reducer (PyTorch's own error) and needs
DDP's Python reducer (``torch._dynamo.config.optimize_ddp =
"python_reducer"``), which calls a comm hook once per parameter with
``(grad, param)`` and traces it into the backward graph: no bucket, no end
of step, no place for a gloo exchange.  The hook refuses that mode with the
error below, on every rank, before anything is sent (docs/ddp.md).
"""
import sys

import torch.distributed as dist

__all__ = ["check_bucket", "check_ddp_mode"]

_UNSUPPORTED = (
    "gtopk_plugin's sparse_hook needs DDP's C++ reducer (one GradBucket per bucket), but this DDP "
    "{what}.  DDP's Python reducer (torch._dynamo.config.optimize_ddp = 'python_reducer', used "
    "for compiled autograd) calls comm hooks once per parameter and is not supported: leave "
    "optimize_ddp at its default and compiled autograd off (torch._dynamo.config."
    "compiled_autograd = False).  torch.compile of the model or of the DDP module works with "
    "the hook as it is (docs/ddp.md, 'torch.compile').")


def check_bucket(bucket) -> None:
    """Raise ``RuntimeError`` unless the hook was handed a ``dist.GradBucket``
    (DDP's Python reducer passes ``(grad, param)`` tuples instead)."""
    if not isinstance(bucket, dist.GradBucket):
        raise RuntimeError(_UNSUPPORTED.format(
            what=f"called it with a {type(bucket).__name__} instead of a GradBucket"))


def check_ddp_mode() -> None:
    """Raise ``RuntimeError`` if Dynamo is already set to build DDP modules
    with the Python reducer (checked when the hook's state is built, so the
    error comes before any model is compiled)."""
    # Dynamo is only imported here if the program imported it already: a
    # program that never did cannot have changed its settings.
    dynamo = sys.modules.get("torch._dynamo")
    config = getattr(dynamo, "config", None)
    if getattr(config, "optimize_ddp", None) == "python_reducer":
        raise RuntimeError(_UNSUPPORTED.format(
            what="is built with torch._dynamo.config.optimize_ddp = 'python_reducer'"))
