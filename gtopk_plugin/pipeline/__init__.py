"""The reduction pipeline of :class:`gtopk_plugin.GradientReducer` (docs/design.md §2):
a call's context and the stages it passes through (reduce_call, check_stages,
exchange_stages, and the dense and small-tensor paths dense_direct and
small_tensors), the layout and input check, the update buffers, the state
between calls and the per-call statistics."""
