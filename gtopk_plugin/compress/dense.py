"""Dense: no selection; the whole accumulator is summed by allreduce (the
S-SGD baseline)."""
from .base import Selector
from .registry import register


@register("dense")
class DenseSelector(Selector):
    """Every entry, summed by a dense allreduce (S-SGD)."""

    aggregation = "dense"
    merges = ()
    uses_density = False

    def select(self, acc, offsets, k, ctx):
        # ``None`` indices: "everything", so no N-element index vector is built.
        return None, acc
