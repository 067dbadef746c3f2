"""The :class:`~gtopk_plugin.GradientReducer` keywords a torch.distributed
layer (the DDP hook's ``SparseState``, the FSDP replica reduction) passes
through, and their check, one definition for both.

Such a layer builds its own transport on its process group and takes
momentum correction, the optimizer and the parameter names itself; every
other ``GradientReducer`` keyword and the method's own hyper-parameters
(:func:`gtopk_plugin.registry.describe`) pass through.  Imports only the
core (docs/design.md §1).
"""
import inspect
from typing import Mapping, Sequence

from gtopk_plugin import registry
from gtopk_plugin.reducer import GradientReducer

__all__ = ["REDUCER_KWARGS", "check_reducer_kwargs"]

# ``transport``: the layer builds its own on its group (for DDP, so that
# pickling can drop and rebind the group); the other three it handles itself
_LAYER_OWN = ("self", "transport", "momentum_correction", "optimizer", "named_parameters")
REDUCER_KWARGS = tuple(n for n, p in inspect.signature(GradientReducer.__init__).parameters.items()
                       if n not in _LAYER_OWN and p.kind is not p.VAR_KEYWORD)


def check_reducer_kwargs(entry: str, method: str, reducer_kwargs: Mapping, own: Sequence[str],
                         transport_on: str, instead: str) -> None:
    """``ValueError`` naming ``entry`` (the call the user made) when
    ``reducer_kwargs`` holds ``transport`` ("<entry> builds its own transport
    on <transport_on>; <instead>") or a name that is neither in
    :data:`REDUCER_KWARGS` nor one of ``method``'s hyper-parameters.  The
    unknown-keyword error lists what is accepted: ``own`` (the entry point's
    own keywords) first, then the rest of :data:`REDUCER_KWARGS`, then the
    method's hyper-parameters."""
    if "transport" in reducer_kwargs:
        raise ValueError(f"{entry} builds its own transport on {transport_on}; {instead}")
    hyper = [h["name"] for h in registry.describe(method)["hyperparams"]]
    unknown = sorted(set(reducer_kwargs) - set(REDUCER_KWARGS) - set(hyper))
    if unknown:
        accepted = list(own) + [n for n in REDUCER_KWARGS if n not in own]
        raise ValueError(f"unknown {entry} keyword(s) {', '.join(map(repr, unknown))}; "
                         f"accepted: {', '.join(accepted)}"
                         + (f"; {method!r} also takes {', '.join(hyper)}" if hyper else ""))
