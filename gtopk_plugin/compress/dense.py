"""Dense: no selection; the whole accumulator is summed by allreduce (the
S-SGD baseline)."""
from .base import Selector
from .registry import register


@register("dense")
class DenseSelector(Selector):
    aggregation = "dense"

    def select(self, acc, offsets, k, ctx):
        # ``None`` indices: "everything", so no N-element index vector is built.
        return None, acc
