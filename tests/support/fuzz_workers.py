"""Workers of tests/distributed/test_fuzz.py: run a list of random case
specs (plain dicts drawn by the parent) one after the other on one gloo
group, and return per rank, per step, compact float64 records that the
parent checks against the invariants.  Nothing here decides whether the
library was right; it only records, independently of the reducer's own
bookkeeping, what this rank fed in, what it was handed back and what state
it holds.

A case spec (keys; see ``test_fuzz.case_specs`` for the ranges):

- ``tensors``: ``[[name, shape, dtype name, scale, style], ...]``;
- ``reducer``: the GradientReducer keywords every rank uses (dtypes by name);
- ``mismatch``: None or ``{"rank": r, "kw": {...}, "drop": [...]}``: rank
  r's overrides (and keywords it leaves out);
- ``kernels``: one back end per rank (None = automatic, or "reference":
  bit-identical results are promised, so ranks may differ);
- ``steps``, ``grad_seed``, ``out``: None, "fresh" or "inplace";
- ``inject``: None or ``{"step", "rank", "tensor", "value", "count"}``: a
  NaN/±Inf written into that rank's gradient at that step;
- ``huge``: None or ``{"step", "rank", "tensor", "steps"}``: finite float32
  gradients of ±max/2 on one rank for a few consecutive steps (the
  accumulator overflows when they meet a residual of the same sign);
- ``ops``: ``[[step, op], ...]``, checkpoint operations run before that
  step: "roundtrip" (state_dict through torch.save into a fresh reducer),
  "job" (gp.save_job / gp.load_job), "foreign" (load another rank's
  state), "corrupt:<kind>" (a damaged state), "resize:<ranks>" (the job
  saved at P and loaded with gp.load_job by the subgroup ``ranks``, which
  goes on alone);
- ``bad``: None or ``{"step", "rank", "kind"}``: invalid input on that
  rank at that step ("int_grad", "zero_dim", "empty" or "out_shape");
- ``kind: "ddp"``: a DDP case instead (:class:`DdpCase`: ``dims``,
  ``branches``, ``usage`` per step, branch and rank, ``mode``,
  ``bucket_cap_mb``; ``reducer`` holds SparseState's keywords).

Per step record: the outcome ("ok", "skip" or "error" with type and
message), the reducer's step counter, a digest of the update's bytes,
finiteness of gradients, update and state, whether a raising or skipped
step left the state as it was, and the float64 vectors (flat, names
sorted): ``fed`` (Σ_steps of what this rank put in: the gradient, or with
DGC momentum the increment m·u + (1 − d)·g computed here from the velocity
before the step), ``applied`` (Σ_steps divisor · update), ``held`` (the
residual), ``server`` (this rank's shard of onebit's two-phase server
residual, or None) and ``mag`` (Σ of the magnitudes of everything added,
for the tolerance).
"""
from __future__ import annotations

import copy
import gc
import hashlib
import io
import math
import os
import traceback

import torch
import torch.distributed as dist

import gtopk_plugin as gp
from gtopk_plugin import checkpoint

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64, "int8": torch.int8}
TIMEOUT = 30.0  # seconds: the transports' collective timeout (a hang fails the case, not CI)


# ------------------------------------------------------------------ inputs
def reducer_kwargs(kw):
    """A spec's reducer keywords with dtype names turned into dtypes."""
    kw = dict(kw)
    if kw.get("value_dtype") is not None:
        kw["value_dtype"] = DTYPES[kw["value_dtype"]]
    return kw


def names_of(spec):
    return sorted(t[0] for t in spec["tensors"])


def grads_for(spec, rank, step):
    """This rank's gradients at ``step`` (a function of the spec only)."""
    out = {}
    for i, (name, shape, dt, scale, style) in enumerate(spec["tensors"]):
        g = torch.Generator().manual_seed((spec["grad_seed"] * 1000003 + step * 7919 + rank * 104729 + i)
                                          % (2 ** 63))
        n = math.prod(shape)
        if style == "normal":
            x = torch.randn(n, generator=g, dtype=torch.float64)
        elif style == "ties":  # few distinct magnitudes: the selectors' tie-breaking
            x = torch.randint(-3, 4, (n,), generator=g).double()
        elif style == "sparse":  # mostly exact zeros
            x = torch.randn(n, generator=g, dtype=torch.float64) * (torch.rand(n, generator=g) < 0.1)
        else:  # "const": one value everywhere
            x = torch.full((n,), float(torch.randn(1, generator=g)), dtype=torch.float64)
        out[name] = (x * scale).to(DTYPES[dt]).reshape(shape)
    hg = spec.get("huge")
    if hg and hg["rank"] == rank and hg["step"] <= step < hg["step"] + hg["steps"]:
        name, shape = spec["tensors"][hg["tensor"]][:2]
        s = torch.Generator().manual_seed(spec["grad_seed"])  # the same signs at every step
        sign = torch.randint(0, 2, (math.prod(shape),), generator=s).float() * 2 - 1
        out[name] = (sign * (torch.finfo(torch.float32).max / 2)).to(out[name].dtype).reshape(shape)
    inj = spec.get("inject")
    if inj and inj["step"] == step and inj["rank"] == rank:
        name = spec["tensors"][inj["tensor"]][0]
        flat = out[name].view(-1)
        v = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[inj["value"]]
        for j in range(inj["count"]):
            flat[(j * 7919 + inj["step"]) % flat.numel()] = v
    return out


# ------------------------------------------------------------------ state
def _flat(d, names, sizes):
    """name -> tensor (any shape/dtype) as one float64 vector (zeros where absent)."""
    return torch.cat([d[n].detach().reshape(-1).double() if n in d else torch.zeros(s, dtype=torch.float64)
                      for n, s in zip(names, sizes)])


def velocities_of(sd):
    v = dict(sd.get("velocities") or {})
    v.update((sd.get("small") or {}).get("velocities") or {})
    return v


def server_shard(sd):
    """This rank's shard of onebit's two-phase server residuals (float64; the
    shards of ranks 0..P-1 concatenate to the method part's flat layout)."""
    server = (sd.get("compressor") or {}).get("server") or {}
    if not server:
        return None
    if len(server) != 1:
        raise AssertionError(f"expected one server residual layout, got {list(server)}")
    return next(iter(server.values())).detach().reshape(-1).double().clone()


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bytes(t):
    """The bytes of ``t``'s values (any strides: numpy copies them out)."""
    t = t.detach().reshape(-1)
    return t.view(_INT_OF_SIZE[t.element_size()]).numpy().tobytes() if t.numel() else b""


def same_state(a, b, ignore_step=False):
    """Equality of two state dicts: tensors of the same dtype and shape
    with equal values (NaN equal to NaN; -0.0 equal to 0.0: a residual's
    sign of zero depends on whether it was added to a zero or copied, and
    never changes what is sent)."""
    if isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape):
            return False
        eq = a == b
        if a.is_floating_point():
            eq |= torch.isnan(a) & torch.isnan(b)
        return bool(eq.all())
    if isinstance(a, dict):
        keys = set(a) | set(b) if isinstance(b, dict) else None
        if keys is None:
            return False
        if ignore_step:
            keys.discard("step")
        return all(k in a and k in b and same_state(a[k], b[k], ignore_step) for k in keys)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(
            same_state(x, y, ignore_step) for x, y in zip(a, b))
    return a == b


def state_diff(a, b, path=""):
    """Where two state dicts differ (paths), for the failure message."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}/{k}: only in one" for k in sorted(set(a) ^ set(b), key=str)]
        for k in sorted(set(a) & set(b), key=str):
            out += state_diff(a[k], b[k], f"{path}/{k}")
        return out
    if same_state(a, b):
        return []
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and a.numel():
        x, y = a.reshape(-1).double(), b.reshape(-1).double()
        i = int(((x != y) & ~(torch.isnan(x) & torch.isnan(y))).int().argmax())
        return [f"{path}[{i}]: {float(x[i])!r} vs {float(y[i])!r} ({a.dtype}/{b.dtype})"]
    return [path or "/"]


def state_finite(sd):
    ok = True
    for d in (sd.get("residuals") or {}, velocities_of(sd)):
        ok &= all(bool(torch.isfinite(t).all()) for t in d.values())
    srv = server_shard(sd)
    return ok and (srv is None or bool(torch.isfinite(srv).all()))


def digest(out, names):
    h = hashlib.sha1()
    for n in names:
        h.update(str(out[n].dtype).encode())
        h.update(_bytes(out[n]))
    return h.hexdigest()


# ------------------------------------------------------------------ one case
class Case:
    """One spec on this rank: the reducer, the float64 running sums."""

    def __init__(self, spec, rank, P, groups, tmpdir):
        self.spec, self.rank, self.groups, self.tmpdir = spec, rank, groups, tmpdir
        self.names = names_of(spec)
        shapes = {t[0]: tuple(t[1]) for t in spec["tensors"]}
        self.shapes = [shapes[n] for n in self.names]
        self.sizes = [math.prod(s) for s in self.shapes]
        self.N = sum(self.sizes)
        kw = reducer_kwargs(spec["reducer"])
        mm = spec.get("mismatch")
        if mm and mm["rank"] == rank:
            kw.update(reducer_kwargs(mm["kw"]))
            for k in mm["drop"]:
                kw.pop(k, None)
        if spec["kernels"][rank] is not None:
            kw["kernels"] = spec["kernels"][rank]
        self.kw = kw
        self.group = None  # None: the default group
        self.red = self.make()
        z = torch.zeros(self.N, dtype=torch.float64)
        self.fed, self.applied, self.mag = z.clone(), z.clone(), z.clone()
        self.left_at = None
        self.bad_out = None
        self.records, self.ops = [], []

    # the pieces of a record
    def make(self):
        return gp.GradientReducer(transport=gp.TorchDistributedTransport(group=self.group, timeout=TIMEOUT),
                                  **self.kw)

    @property
    def P(self):
        return self.red.transport.size

    def divisor(self):
        return self.P if self.kw.get("op", "average") == "average" else 1

    def held(self, sd):
        h = _flat(sd["residuals"], self.names, self.sizes)
        return h, server_shard(sd)

    def vectors(self, sd):
        held, srv = self.held(sd)
        return {"fed": self.fed.clone(), "applied": self.applied.clone(), "held": held, "server": srv,
                "mag": self.mag + held.abs(), "P": self.P,
                "method_names": [n for n, s in zip(self.names, self.sizes)
                                 if s >= self.kw.get("dense_below", 0)]}

    def increment(self, grads, sd_before):
        """What this step puts into the residual, in float64, from this
        rank's gradient and (DGC momentum) its velocity before the step;
        None for invalid input (a step that must be refused)."""
        if sorted(grads) != self.names or [grads[n].numel() for n in self.names] != self.sizes \
                or any(t.dim() == 0 for t in grads.values()):
            return None
        g = _flat(grads, self.names, self.sizes)
        m = self.kw.get("momentum_correction")
        if m is None:
            return g
        u = _flat(velocities_of(sd_before), self.names, self.sizes)
        if self.kw.get("nesterov"):
            return m * (u + g) + g
        return m * u + (1.0 - self.kw.get("dampening", 0.0)) * g

    # one step
    def call(self, red, grads):
        mode = self.spec.get("out")
        if self.bad_out is not None:  # one out= tensor of the wrong size, on this rank only
            out = {n: torch.empty_like(t) for n, t in grads.items()}
            out[self.bad_out] = torch.empty(grads[self.bad_out].numel() + 1, dtype=grads[self.bad_out].dtype)
            return red.reduce(grads, out=out)
        if mode == "fresh":
            return red.reduce(grads, out={n: torch.empty_like(t) for n, t in grads.items()})
        if mode == "inplace":  # the gradients themselves receive the update
            return red.reduce(grads, out=grads)
        return red.reduce(grads)

    def step(self, s, shadow=None):
        grads = grads_for(self.spec, self.rank, s)
        bad = self.spec.get("bad")
        self.bad_out = None
        if bad and bad["step"] == s and bad["rank"] == self.rank:  # invalid input on this rank only
            n0 = self.names[0]
            if bad["kind"] == "int_grad":
                grads[n0] = grads[n0].to(torch.int32)
            elif bad["kind"] == "zero_dim":
                grads[n0] = grads[n0].reshape(-1)[0]
            elif bad["kind"] == "empty":
                grads = {}
            else:  # "out_shape"
                self.bad_out = n0
        rec = {"s": s, "grads_finite": all(bool(torch.isfinite(g).all()) for g in grads.values())}
        before = self.red.state_dict()
        inc = self.increment(grads, before)
        if shadow is not None:  # the reducer before a checkpoint round trip: the same step, the same bits
            rec["shadow"] = self.outcome(shadow, {n: g.clone() for n, g in grads.items()})[0]
        res_before, srv_before = self.held(before)
        step_before = self.red.step
        got, out = self.outcome(self.red, grads)
        rec.update(got)
        after = self.red.state_dict()
        rec["red_step"] = self.red.step
        rec["step_before"] = step_before
        if got["outcome"] != "ok":
            rec["unchanged"] = same_state(before, after, ignore_step=got["outcome"] == "skip")
        if got["outcome"] == "ok":
            if inc is None:
                raise AssertionError(f"step {s}: invalid input on this rank was reduced, not refused")
            upd = _flat(out, self.names, self.sizes) * self.divisor()
            self.fed += inc
            self.applied += upd
            res_after, srv_after = self.held(after)
            sent = inc + res_before - res_after  # this rank's contribution, as its residual says
            self.mag += inc.abs() + sent.abs() + upd.abs()
            rec["state_finite"] = state_finite(after)
        if shadow is not None:
            rec["shadow_state_diff"] = state_diff(shadow.state_dict(), after)
        if got["outcome"] in ("ok", "skip"):
            rec.update(self.vectors(after))
        return rec

    def outcome(self, red, grads):
        try:
            out = self.call(red, grads)
        except (gp.NonFiniteGradientError, gp.NonFiniteStateError, gp.LayoutMismatchError,
                gp.PeerInputError, ValueError) as e:
            return {"outcome": "error", "err": (type(e).__name__, str(e))}, None
        st = red.last_stats
        out = {n: t.clone() for n, t in out.items()}
        kind = "ok"
        if st is not None and st.skipped:
            kind = "skip"
        # digest: the bits (rank agreement); vdigest: the values, -0.0 as 0.0
        # (a restored reducer's residual of +0.0 where the original's was
        # -0.0 gives the same values, not always the same bits)
        rec = {"outcome": kind, "digest": digest(out, self.names),
               "vdigest": digest({n: t + 0.0 for n, t in out.items()}, self.names),
               "upd_finite": all(bool(torch.isfinite(t).all()) for t in out.values())}
        if kind == "skip":
            vals = {float(v) for t in out.values() for v in t.reshape(-1).double().unique().tolist()}
            rec["skip_fill"] = sorted(vals, key=str)
        return rec, out

    # checkpoint operations
    def op(self, s, op):
        """Run ``op`` before step ``s``; returns the reducer to shadow (the
        one replaced by a restore) or None."""
        rec = {"s": s, "op": op}
        self.ops.append(rec)
        red = self.red
        if op == "roundtrip":
            buf = io.BytesIO()
            torch.save(red.state_dict(), buf)
            buf.seek(0)
            fresh = self.make()
            fresh.load_state_dict(torch.load(buf, weights_only=True),
                                  named_parameters=dict(zip(self.names, self.shapes)))
            self.red = fresh
            rec["result"] = "ok"
            return red
        if op == "job":
            path = os.path.join(self.tmpdir, f"case{self.spec['id']}-s{s}")
            gp.save_job(red, path)
            fresh = self.make()
            gp.load_job(fresh, path, named_parameters=dict(zip(self.names, self.shapes)))
            self.red = fresh
            rec["result"] = "ok"
            return red
        if op == "foreign":  # every rank tries its successor's state: refused, nothing changed
            states = [None] * self.P
            dist.all_gather_object(states, red.state_dict(), group=self.group)
            rec.update(self.refused(lambda: red.load_state_dict(states[(self.rank_in() + 1) % self.P])))
            return None
        if op.startswith("corrupt:"):
            sd = red.state_dict()
            bad = corrupt(sd, op.split(":", 1)[1], self.names)
            if bad is None:
                rec["result"] = "n/a"
                return None
            rec.update(self.refused(lambda: red.load_state_dict(
                bad, named_parameters=dict(zip(self.names, self.shapes)))))
            return None
        if op.startswith("resize:"):
            self.resize(s, op, rec)
            return None
        raise AssertionError(f"unknown op {op!r}")

    def rank_in(self):
        return self.red.transport.rank

    def refused(self, load):
        """Run a load that must be refused; whether it was, and whether the
        reducer was left exactly as it was."""
        before = self.red.state_dict()
        try:
            load()
            res = {"result": "loaded"}
        except Exception as e:  # noqa: BLE001 - the parent reads the type
            res = {"result": "error", "err": (type(e).__name__, str(e))}
        res["unchanged"] = same_state(before, self.red.state_dict())
        return res

    def resize(self, s, op, rec):
        members = [int(x) for x in op.split(":", 1)[1].split(",")]
        path = os.path.join(self.tmpdir, f"case{self.spec['id']}-resize")
        gp.save_job(self.red, path)
        rec["before"] = self.vectors(self.red.state_dict())
        if self.rank not in members:
            self.left_at = s
            rec["result"] = "left"
            return
        self.group = self.groups[tuple(members)]
        fresh = self.make()
        # the naive way: this rank's own old file into the smaller job
        own = torch.load(checkpoint.rank_file(path, self.rank), weights_only=True)["state"]
        naive = self.refused_on(fresh, lambda: fresh.load_state_dict(own))
        rec["naive"] = naive
        try:
            gp.load_job(fresh, path, named_parameters=dict(zip(self.names, self.shapes)))
            rec["result"] = "ok"
        except gp.CheckpointError as e:
            rec["result"] = "error"
            rec["err"] = (type(e).__name__, str(e))
            self.left_at = s
            return
        self.red = fresh
        rec["after"] = self.vectors(self.red.state_dict())
        rec["P_new"] = self.P

    @staticmethod
    def refused_on(red, load):
        try:
            load()
            return {"result": "loaded"}
        except Exception as e:  # noqa: BLE001
            return {"result": "error", "err": (type(e).__name__, str(e))}

    def run(self):
        ops = {}
        for s, op in self.spec.get("ops", []):
            ops.setdefault(s, []).append(op)
        for s in range(self.spec["steps"]):
            shadow = None
            for op in ops.get(s, []):
                replaced = self.op(s, op)
                if self.left_at is not None:
                    return
                if op.startswith("resize:"):
                    shadow = None  # the old reducer's group is not this job's any more
                elif replaced is not None:
                    shadow = replaced
            rec = self.step(s, shadow)
            self.records.append(rec)
            if rec["outcome"] == "error" and rec["err"][0] in ("LayoutMismatchError", "NonFiniteStateError"):
                return  # every later call would raise the same, or the state is no longer trusted


def corrupt(sd, kind, names):
    """A damaged copy of ``sd`` that load_state_dict must refuse (None where
    this state has nothing to damage that way)."""
    sd = copy.deepcopy(sd)
    if kind in ("nan_residual", "inf_residual"):
        if not sd["residuals"]:
            return None
        n = sorted(sd["residuals"])[0]
        sd["residuals"][n].view(-1)[0] = math.nan if kind == "nan_residual" else -math.inf
    elif kind == "nan_velocity":
        if not sd["velocities"]:
            return None
        n = sorted(sd["velocities"])[0]
        sd["velocities"][n].view(-1)[-1] = math.nan
    elif kind == "negative_step":
        sd["step"] = -5
    elif kind == "float_step":
        sd["step"] = 1.5
    elif kind == "missing_key":
        del sd["residuals"]
    elif kind == "foreign_name":  # a residual of a tensor this model does not have
        t = torch.zeros(3, dtype=torch.float32)
        sd["residuals"]["zz.not_a_parameter"] = t
        sd["layout"]["residuals"]["zz.not_a_parameter"] = {"shape": [3], "dtype": "torch.float32"}
    elif kind == "bad_shape":
        if not sd["residuals"]:
            return None
        n = sorted(sd["residuals"])[0]
        sd["residuals"][n] = torch.zeros(sd["residuals"][n].numel() + 1, dtype=sd["residuals"][n].dtype)
    elif kind == "not_a_dict":
        return [("step", 3)]
    elif kind == "other_seed":
        sd["seed"] = int(sd["seed"]) + 1
    else:
        raise AssertionError(f"unknown corruption {kind!r}")
    return sd


# ------------------------------------------------------------------ DDP cases
class _Net(torch.nn.Module):
    """A trunk and head every rank uses, and branches the case's schedule
    uses on some ranks, all, or none (DDP's unused parameters)."""

    def __init__(self, d_in, d_h, d_out, n_branches):
        super().__init__()
        self.head = torch.nn.Linear(d_h, d_out)
        self.branches = torch.nn.ModuleList(torch.nn.Linear(d_in, d_out) for _ in range(n_branches))
        self.trunk = torch.nn.Linear(d_in, d_h)

    def forward(self, x, use):
        y = self.head(torch.tanh(self.trunk(x)))
        for b, u in zip(self.branches, use):
            if u:
                y = y + b(x)
        return y


def _same_or_zero(a, b):
    """Equal state tensors, an absent one standing for zeros."""
    if a is None and b is None:
        return True
    if a is None or b is None:
        return not bool((a if a is not None else b).any())
    return same_state(a, b)


class DdpCase:
    """A DDP case: the gloo DDP model with the sparse hook
    (``find_unused_parameters=True`` or ``static_graph=True``) and a plain
    copy that gives, independently of the hook, what each rank fed in."""

    def __init__(self, spec, rank, P):
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.spec, self.rank, self.P = spec, rank, P
        torch.manual_seed(spec["grad_seed"])
        self.model = _Net(*spec["dims"], spec["branches"])
        self.ref = copy.deepcopy(self.model)
        self.names = sorted(n for n, _ in self.model.named_parameters())
        self.params = dict(self.model.named_parameters())
        self.sizes = [self.params[n].numel() for n in self.names]
        kw = reducer_kwargs(spec["reducer"])
        self.kw = kw
        # named: the hook's residuals are keyed by the model's names
        self.state = gp.torch_ddp.SparseState(named_parameters=self.model.named_parameters(), timeout=TIMEOUT, **kw)
        mode = {"static_graph": True} if spec["mode"] == "static" else {"find_unused_parameters": True}
        self.ddp = DDP(self.model, bucket_cap_mb=spec["bucket_cap_mb"], **mode)
        self.ddp.register_comm_hook(self.state, gp.torch_ddp.sparse_hook)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        z = torch.zeros(sum(self.sizes), dtype=torch.float64)
        self.fed, self.applied, self.mag = z.clone(), z.clone(), z.clone()
        self.records, self.ops, self.left_at = [], [], None

    def _state(self):
        """name (the model's) -> residual / velocity, float64 flat."""
        sd = self.state.reducer.state_dict()
        return dict(sd["residuals"]), dict(sd["velocities"])

    def _loss(self, model, s, use):
        g = torch.Generator().manual_seed(self.spec["grad_seed"] * 7919 + s * 101 + self.rank)
        x = torch.randn(5, self.spec["dims"][0], generator=g)
        y = torch.randn(5, self.spec["dims"][2], generator=g)
        return ((model(x, use) - y) ** 2).mean()

    def run(self):
        m = self.kw.get("momentum_correction")
        for s in range(self.spec["steps"]):
            use = [u[self.rank] for u in self.spec["usage"][s]]
            self.ref.load_state_dict(self.model.state_dict())
            self.ref.zero_grad(set_to_none=True)
            self._loss(self.ref, s, use).backward()
            g = _flat({n: p.grad for n, p in self.ref.named_parameters() if p.grad is not None},
                      self.names, self.sizes)
            res0, vel0 = self._state()
            # the step's increment: the gradient (DGC momentum: m·u + g),
            # nothing for parameters no rank used (DDP applies nothing to them)
            inc = g if m is None else m * _flat(vel0, self.names, self.sizes) + g
            gone = {n for b in range(self.spec["branches"]) if not any(self.spec["usage"][s][b])
                    for n in (f"branches.{b}.weight", f"branches.{b}.bias")}
            pos = 0
            for n, sz in zip(self.names, self.sizes):
                if n in gone:
                    inc[pos:pos + sz] = 0
                pos += sz
            self.opt.zero_grad(set_to_none=True)
            rec = {"s": s, "grads_finite": True, "step_before": self.state.reducer.step}
            try:
                self._loss(self.ddp, s, use).backward()
            except (gp.NonFiniteGradientError, gp.NonFiniteStateError, gp.LayoutMismatchError,
                    gp.PeerInputError) as e:
                rec.update(outcome="error", err=(type(e).__name__, str(e)))
                self.records.append(rec)
                return
            upd = _flat({n: p.grad for n, p in self.params.items() if p.grad is not None}, self.names, self.sizes)
            res1, vel1 = self._state()
            touched = sorted(n for n in self.names if not _same_or_zero(res0.get(n), res1.get(n))
                             or not _same_or_zero(vel0.get(n), vel1.get(n)))
            rec.update(outcome="ok", red_step=self.state.reducer.step, touched=touched,
                       digest=hashlib.sha1(upd.numpy().tobytes()).hexdigest(),
                       upd_finite=bool(torch.isfinite(upd).all()),
                       state_finite=all(bool(torch.isfinite(t).all()) for t in [*res1.values(), *vel1.values()]),
                       grad_none=sorted(n for n in self.names if self.params[n].grad is None))
            self.fed += inc
            self.applied += upd * self.P
            held = _flat(res1, self.names, self.sizes)
            sent = inc + _flat(res0, self.names, self.sizes) - held
            self.mag += inc.abs() + sent.abs() + (upd * self.P).abs()
            rec.update({"fed": self.fed.clone(), "applied": self.applied.clone(), "held": held, "server": None,
                        "mag": self.mag + held.abs(), "P": self.P, "method_names": self.names})
            self.records.append(rec)
            self.opt.step()


# ------------------------------------------------------------------ the job
def run_cases(rank, P, specs, subsets, tmpdir):
    """Every spec in turn on this rank's gloo group; the per-case records.

    ``subsets``: the member lists of every resize, created here up front
    (``new_group`` is collective over the default group).  A case that
    fails in an unexpected way (an exception that is not one of the
    library's clear errors) stops the job: its peers may be waiting in a
    collective; they fail at the transport's timeout and stop too."""
    torch.set_num_threads(1)
    groups = {tuple(m): dist.new_group(list(m)) for m in subsets}
    out = []
    for spec in specs:
        # where this rank is, for the parent's report should the process die
        with open(os.path.join(tmpdir, f"rank{rank}.case"), "w") as f:
            f.write(str(spec["id"]))
        rec = {"id": spec["id"], "steps": [], "ops": [], "fatal": None, "left_at": None}
        try:
            case = DdpCase(spec, rank, P) if spec.get("kind") == "ddp" else Case(spec, rank, P, groups, tmpdir)
            rec["steps"], rec["ops"] = case.records, case.ops
            case.run()
        except Exception as e:  # noqa: BLE001 - reported with the case's spec by the parent
            rec["fatal"] = (type(e).__name__, str(e), traceback.format_exc())
        else:
            rec["left_at"] = case.left_at
            # a departed rank's totals stay part of the job's
            rec["final"] = {"fed": case.fed, "mag": case.mag}
        out.append(rec)
        if rec["fatal"]:
            break
    # DDP objects sit in reference cycles; free them (and their hold on the
    # group) before the process group is destroyed at exit
    case = None
    gc.collect()
    return out
