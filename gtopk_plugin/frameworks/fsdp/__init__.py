"""FSDP2 (``torch.distributed.fsdp.fully_shard``) layer: the cross-replica
reduction of HSDP's gradient shards through any registered compressor
(:mod:`.fsdp_replica`; docs/fsdp.md)."""
