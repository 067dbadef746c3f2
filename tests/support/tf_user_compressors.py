"""Compressors registered from user code, for the TensorFlow layer's
registry test (tests/horovod/test_horovod_tf_registry.py and its job
tests/jobs/hvd_tf_registry_job.py import this module, so the job and the
parent's oracle run the same classes)."""
import torch

from gtopk_plugin.compress import Codec, Selector, register


class FirstKSelector(Selector):
    """User selector: the first k_s entries of every segment (a fixed
    pattern, so the oracle's bits are easy to predict); any merge."""

    aggregation = "allgather"
    merges = ("allgather", "butterfly")

    def select(self, acc, offsets, k, ctx):
        idx = torch.cat([torch.arange(int(offsets[s]), int(offsets[s]) + int(k[s]))
                         for s in range(len(k))])
        return idx, acc[idx]


class HalfCodec(Codec):
    """User codec: the accumulator as float16 (allgathered, decoded, summed
    in rank order)."""

    def encode(self, acc, offsets, ctx):
        return [acc.to(torch.float16)]

    def decode(self, payload, offsets, numel, dtype):
        return payload[0].to(dtype)


register("firstk_user", FirstKSelector)
register("half_tf_user", HalfCodec)
