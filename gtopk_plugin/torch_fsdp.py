"""``import gtopk_plugin.torch_fsdp``: FSDP2 / HSDP -- the cross-replica
reduction of each gradient shard through any registered compressor (see
:mod:`gtopk_plugin.frameworks.fsdp.fsdp_replica` and docs/fsdp.md)."""
from gtopk_plugin.frameworks.fsdp.fsdp_replica import SparseReplicaState, sparse_replica_reduction  # noqa: F401

__all__ = ["SparseReplicaState", "sparse_replica_reduction"]
