"""Exact top-k (Top-k S-SGD; Shi et al. 2019 use it as the local step of
gTop-k).  ``gtopk`` is the same selector with the butterfly merge."""
from gtopk_plugin import kernels
from gtopk_plugin.compress.compressor import Selector
from gtopk_plugin.registry import register


@register("topk")
class TopKSelector(Selector):
    """Exact top-k per segment, sparse allgather (Top-k S-SGD).

    Exactly ``k_s`` largest-magnitude entries per segment, ties to the
    smaller index (docs/design.md §2)."""

    aggregation = "allgather"
    merges = ("allgather", "butterfly")

    def select(self, acc, offsets, k, ctx):
        return kernels.select_topk(acc, offsets, k, kernels=ctx.kernels)


@register("gtopk")
class GTopKSelector(TopKSelector):
    """Local exact top-k, merged by the gTop-k butterfly in log2 P rounds (Shi et al. 2019)."""

    aggregation = "butterfly"
