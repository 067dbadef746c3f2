"""Parameter naming, groups and buckets: the framework-neutral part of how
the Horovod optimizer and the DDP hook cut a model into reductions.

Names matter because they are the only identity a gradient has on every
rank and after a restart: error-feedback residuals and momentum velocities
are keyed by them, and Horovod pairs collective ops by name.  Buckets
matter because each one is one ``GradientReducer.reduce`` call (one
consistency check, one butterfly schedule, docs/design.md §2); granularity
"global" selects per bucket.

* :func:`named_pairs` validates ``model.named_parameters()``-style input
  (both layers);
* :func:`name_parameters` applies Horovod's naming rules to an optimizer's
  parameter groups;
* :func:`resolve_groups` / :func:`make_buckets` give the fixed bucket
  layout of the Horovod sparse path (DDP brings its own buckets);
* :func:`bucket_scope` names a bucket's op scope.

Framework-neutral: imports torch only.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Sequence, Tuple

import torch

__all__ = ["named_pairs", "name_parameters", "resolve_groups", "make_buckets", "bucket_scope",
           "bucket_names"]

Tensor = torch.Tensor


def named_pairs(named_parameters) -> List[Tuple[str, Tensor]]:
    """``named_parameters`` as a list of ``(str, Tensor)`` pairs with unique
    names; ``ValueError`` naming the keyword otherwise.  Tied parameters
    (one tensor under several names) are allowed: each caller decides which
    name such a tensor keeps."""
    try:
        items = list(named_parameters)
    except TypeError:
        raise ValueError("named_parameters must be an iterable of (name, parameter) pairs, "
                         f"e.g. model.named_parameters(); got {type(named_parameters).__name__}") from None
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise ValueError("named_parameters must yield (str, torch.Tensor) pairs, e.g. "
                             f"model.named_parameters(); got {item!r:.80}")
    seen, dups = set(), []
    for name, _ in items:
        if name in seen and name not in dups:
            dups.append(name)
        seen.add(name)
    if dups:
        raise ValueError(f"named_parameters names {', '.join(map(repr, dups))} twice; names must be "
                         "unique")
    return items


def name_parameters(named_parameters, param_groups) -> Dict[Tensor, str]:
    """param -> name for every parameter of an optimizer's ``param_groups``,
    by Horovod's rules: without ``named_parameters`` the names are
    ``allreduce.noname.{group}.{index}``; with it every optimizer parameter
    must be named (the error says which is missing).  A tied parameter keeps
    the last of its names, as Horovod's own optimizer does."""
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}.{j}" for i, g in enumerate(param_groups)
                for j, p in enumerate(g["params"])}
    by_id = {id(p): n for n, p in named_pairs(named_parameters)}
    missing = [f"param_groups[{i}]['params'][{j}] (shape {tuple(p.shape)})"
               for i, g in enumerate(param_groups) for j, p in enumerate(g["params"]) if id(p) not in by_id]
    if missing:
        raise ValueError(f"named_parameters was specified, but {len(missing)} optimizer parameter(s) are "
                         f"not named in it: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}. "
                         "Pass the named_parameters() of the model whose parameters the optimizer updates.")
    return {p: by_id[id(p)] for g in param_groups for p in g["params"]}


def resolve_groups(groups, params: Sequence[Tensor]) -> List[Tuple[Tensor, ...]]:
    """Horovod's ``groups``: an int n (split ``params`` into n consecutive
    groups of near-equal count) or a list of lists of tensors (each list a
    group; tensors not in ``params`` are dropped).  ``None``/0: no groups."""
    if groups is None or groups == 0:
        return []
    if isinstance(groups, bool) or not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
        raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
    if isinstance(groups, int):
        n = min(groups, len(params))
        base, extra = divmod(len(params), n) if n else (0, 0)
        out, pos = [], 0
        for i in range(n):
            size = base + (1 if i < extra else 0)
            out.append(tuple(params[pos:pos + size]))
            pos += size
        return [g for g in out if g]
    member = {id(p) for p in params}
    seen = set()
    out = []
    for grp in groups:
        for p in grp:
            if not isinstance(p, torch.Tensor):
                raise ValueError("groups must consist of torch.Tensor.")
            if id(p) in seen:
                raise ValueError("A parameter can only appear once in groups.")
            seen.add(id(p))
        g = tuple(p for p in grp if id(p) in member)
        if g:
            out.append(g)
    return out


def make_buckets(params: Sequence[Tensor], groups: Iterable[Sequence[Tensor]],
                 threshold: int) -> List[List[Tensor]]:
    """Fixed buckets: explicit groups first, then the other parameters in
    reverse registration order (roughly the order backward produces their
    gradients, so the first bucket is ready first) cut at ``threshold``
    bytes.  The layout depends only on the model, so it is the same on
    every rank and every step."""
    groups = [list(g) for g in groups]
    grouped = {id(p) for g in groups for p in g}
    buckets = groups
    cur, cur_bytes = [], 0
    for p in reversed(params):
        if id(p) in grouped:
            continue
        nb = p.numel() * p.element_size()
        if cur and cur_bytes + nb > threshold:
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur.append(p)
        cur_bytes += nb
    if cur:
        buckets.append(cur)
    return buckets


def bucket_scope(index: int) -> str:
    """Op-name scope of bucket ``index``: the same on every rank and every
    step, so Horovod pairs a bucket's ops by name (and its response cache
    recognises them)."""
    return f"b{index}"


def bucket_names(buckets: Iterable[Sequence[Tensor]], names: Dict[Tensor, str]) -> List[List[str]]:
    """Parameter names per bucket, in reduction order."""
    return [[names[p] for p in b] for b in buckets]
