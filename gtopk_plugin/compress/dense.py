"""Dense: no selection; the whole accumulator is summed by allreduce (the
S-SGD baseline)."""
from gtopk_plugin.compress.compressor import Selector
from gtopk_plugin.registry import register


@register("dense")
class DenseSelector(Selector):
    """Every entry, summed by a dense allreduce (S-SGD)."""

    aggregation = "dense"
    merges = ()
    uses_density = False

    def select(self, acc, offsets, k, ctx):
        # ``None`` indices: "everything", so no N-element index vector is built.
        return None, acc
