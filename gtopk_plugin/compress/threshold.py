"""Threshold selection (DGC, Lin et al. 2018): estimate the magnitude
threshold of the top-k from a sample, select everything above it, correct the
threshold adaptively so that the count lands near ``k``.  The count varies,
so messages carry a size header; nothing selected is ever dropped silently
(what the aggregation does not use stays in the residual)."""
from gtopk_plugin import kernels
from gtopk_plugin.compress.compressor import Selector
from gtopk_plugin.registry import register


@register("threshold")
class ThresholdSelector(Selector):
    """DGC-style sampled threshold (count within ±10% of k), sparse allgather."""

    exact_count = False
    aggregation = "allgather"
    merges = ("allgather", "butterfly")

    def select(self, acc, offsets, k, ctx):
        return kernels.select_threshold(acc, offsets, k, kernels=ctx.kernels)
