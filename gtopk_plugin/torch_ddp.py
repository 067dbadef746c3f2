"""``import gtopk_plugin.torch_ddp`` / ``gtopk_plugin.torch_ddp``: the PyTorch
DDP communication hook (see :mod:`gtopk_plugin.frameworks.ddp.ddp_hook`)."""
from gtopk_plugin.frameworks.ddp.ddp_hook import SparseState, sparse_hook  # noqa: F401

__all__ = ["SparseState", "sparse_hook"]
