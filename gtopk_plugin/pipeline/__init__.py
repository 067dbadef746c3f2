"""The reduction pipeline of :class:`gtopk_plugin.GradientReducer`: the call's layout and
input check, the dense and small-tensor paths, the update buffers, the state
and the per-call statistics (docs/design.md §2)."""
