"""Parameter naming of the DDP hook's state (out of torch_ddp.py): the
name under which each parameter's gradient is reduced, so residuals and
checkpoints are keyed by name, not by DDP's bucket layout (which DDP
rebuilds after the first iteration)."""
from typing import Dict, Iterable, List, Tuple

import torch

from gtopk_plugin.pipeline.param_buckets import named_pairs


class ParameterNaming:
    """Mixin of :class:`~gtopk_plugin.frameworks.ddp.ddp_hook.SparseState`:
    ``_given`` (id -> (param, name) as the user named them), ``_seen`` (id ->
    (param, name) in the order the hook first saw them in this process),
    ``_order`` ((name, shape) in first-appearance order: survives pickling and
    ``state_dict()``) and ``_named``.  Every parameter it names is also
    watched by the state's usage tracker (``_usage``, :mod:`.ddp_usage`):
    from the start when given by name, else from the step the hook first
    sees it in."""

    def _init_naming(self, named_parameters) -> None:
        # id(param) -> name as given by the user (holds the parameter too, so
        # that its id cannot be reused by another object while we map it).
        self._given: Dict[int, Tuple[torch.Tensor, str]] = {}
        self._named = named_parameters is not None
        if self._named:
            self.set_named_parameters(named_parameters)
        self._seen: Dict[int, Tuple[torch.Tensor, str]] = {}
        self._order: List[Tuple[str, Tuple[int, ...]]] = []

    @property
    def param_names(self) -> List[str]:
        """Parameter names in the order the hook first saw them."""
        return [n for n, _ in self._order]

    def name_of(self, param: torch.Tensor) -> str:
        """The name under which ``param``'s gradient is reduced (assigns the
        next name the first time a parameter is seen)."""
        hit = self._seen.get(id(param))
        if hit is not None:
            return hit[1]
        shape = tuple(param.shape)
        n = len(self._seen)
        if self._given:
            g = self._given.get(id(param))
            if g is None:
                raise ValueError(
                    f"DDP bucket holds a parameter of shape {shape} that is not in the "
                    "named_parameters given to SparseState; pass the named_parameters() of the "
                    "module wrapped by this DistributedDataParallel")
            name = g[1]
            recorded = dict(self._order).get(name)
            if recorded is None:
                self._order.append((name, shape))
            elif recorded != shape:
                raise RuntimeError(f"parameter {name!r} has shape {shape} but the loaded state "
                                   f"recorded {recorded}: the model changed")
        elif n < len(self._order):
            # Restored state: the n-th parameter seen gets the n-th recorded
            # name (DDP's first iteration uses the initial bucket layout, so
            # first-appearance order is the same as before the restart).
            name, recorded = self._order[n]
            if recorded != shape:
                raise RuntimeError(
                    f"the parameter seen {n}-th by the hook has shape {shape}, but the restored "
                    f"state recorded {recorded} for {name!r}: the model or its bucket layout "
                    "changed (register a restored state on a freshly built DDP model, or pass "
                    "named_parameters / call set_named_parameters)")
        elif self._named:
            raise RuntimeError(
                "this SparseState was unpickled and sees more parameters than it recorded; "
                "call state.set_named_parameters(model.named_parameters()) before training")
        else:
            name = f"param{n}"
            self._order.append((name, shape))
        self._seen[id(param)] = (param, name)
        # first seen inside a backward pass: this pass was not observed
        self._usage.watch([param], fresh=True)
        return name

    def set_named_parameters(self, named_parameters: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """(Re)bind names to parameters, e.g. after unpickling a state into a
        process whose model is not fresh."""
        given: Dict[int, Tuple[torch.Tensor, str]] = {}
        for name, p in named_pairs(named_parameters):  # ValueError on bad or repeated names
            # A tied parameter listed under several names keeps its first name,
            # as nn.Module.named_parameters() does.
            given.setdefault(id(p), (p, name))
        if not given:
            raise ValueError("named_parameters is empty; pass model.named_parameters()")
        self._given = given
        self._named = True
        # rebinding: the old parameters' hooks go, the new ones are watched
        # from now on (before the next backward pass)
        self._usage.remove()
        self._usage.watch([p for p, _ in given.values()], fresh=False)
        self._seen = {}
