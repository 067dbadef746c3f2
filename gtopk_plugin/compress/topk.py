"""Exact top-k (Top-k S-SGD; Shi et al. 2019 use it as the local step of
gTop-k).  ``gtopk`` is the same selector with the butterfly merge."""
from .. import kernels
from .base import Selector
from .registry import register


@register("topk")
class TopKSelector(Selector):
    """Exactly ``k_s`` largest-magnitude entries per segment, ties to the
    smaller index (DESIGN.md §3)."""

    aggregation = "allgather"

    def select(self, acc, offsets, k, ctx):
        return kernels.select_topk(acc, offsets, k, kernels=ctx.kernels)


@register("gtopk")
class GTopKSelector(TopKSelector):
    """Local exact top-k, merged by the gTopKAllReduce butterfly."""

    aggregation = "gtopk"
