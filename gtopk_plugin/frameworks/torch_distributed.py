"""Compatibility path: :class:`TorchDistributedTransport` lives in the core
(:mod:`gtopk_plugin.collectives.torch_distributed`): torch.distributed ships
with torch, and the reducer's default transport must not import a framework
layer (issue #16)."""
from ..collectives.torch_distributed import TorchDistributedTransport

__all__ = ["TorchDistributedTransport"]
