"""Worker script run under ``horovodrun`` by tests/horovod/test_horovod_faults.py:
steps that raise, are skipped or are abandoned with their optimizer, then
the job keeps using Horovod (barriers, broadcasts, allreduces, new
optimizers, more steps).

    horovodrun -np N -H localhost:N --gloo python tests/jobs/hvd_torch_faults.py CHECK[,CHECK...] OUTDIR

Every rank saves ``OUTDIR/rank{r}.pt``: per check, ``("ok", value)`` or the
exception it raised.  A check's value holds ``events``, a list of
``(label, what, outcome[, parameters])`` that must be the same on every
rank (the same errors at the same steps, bit-identical parameters after
every step); the parent compares the ranks.  Progress lines go to stderr
with the seconds since the rank started, so the output of a job killed by
the parent's timeout says where each rank was.
"""
import gc
import os
import sys
import threading
import time
import traceback

import torch

import horovod.torch as hvd

torch.set_num_threads(1)
hvd.init()

from gtopk_plugin import NonFiniteGradientError  # noqa: E402
from gtopk_plugin.horovod import Compression, DistributedOptimizer  # noqa: E402

R, P = hvd.rank(), hvd.size()
T0 = time.monotonic()


def progress(msg):
    print(f"{time.monotonic() - T0:7.1f} s rank {R} {msg}", file=sys.stderr, flush=True)


def make_model(seed, prefix=None):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))
    if prefix is not None:  # parameter names of its own (Horovod op names of stock Horovod)
        m = torch.nn.ModuleDict({prefix: m})
    return m


def loss_of(model, step, poison=False):
    g = torch.Generator().manual_seed(1000 * step + R)
    x, y = torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)
    out = model(x) if isinstance(model, torch.nn.Sequential) else next(iter(model.values()))(x)
    loss = torch.nn.functional.cross_entropy(out, y)
    # inf on the last rank only, made inside backward (a bucket may be on its
    # way before backward returns)
    return loss * float("inf") if poison and R == P - 1 else loss


def params_of(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


# One optimizer per torch optimizer class, hyper-parameters different on
# every rank (hvd.broadcast_optimizer_state makes them rank 0's); none
# changes the structure of the optimizer's state (stock Horovod would hang).
OPTIMIZERS = {
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.01 * (R + 1), momentum=0.5 + 0.1 * R, weight_decay=1e-4 * R),
    "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-3 * (R + 1), betas=(0.9 - 0.01 * R, 0.999)),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3 * (R + 1), weight_decay=0.01 * (R + 1)),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.01 * (R + 1), lr_decay=1e-3 * R),
    "Adadelta": lambda ps: torch.optim.Adadelta(ps, lr=1.0 - 0.1 * R, rho=0.9 - 0.01 * R),
    "Adamax": lambda ps: torch.optim.Adamax(ps, lr=2e-3 * (R + 1)),
    "ASGD": lambda ps: torch.optim.ASGD(ps, lr=0.01 * (R + 1), t0=100.0 + R),
    "NAdam": lambda ps: torch.optim.NAdam(ps, lr=2e-3 * (R + 1), momentum_decay=4e-3 * (R + 1)),
    "RAdam": lambda ps: torch.optim.RAdam(ps, lr=1e-3 * (R + 1), eps=1e-8 * (R + 1)),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3 * (R + 1), alpha=0.99 - 0.01 * R, momentum=0.5),
    "Rprop": lambda ps: torch.optim.Rprop(ps, lr=0.01 * (R + 1), etas=(0.5, 1.2 + 0.1 * R)),
}
# Every class at P = 2; at P = 3 (a world size that is not a power of two,
# 2x oversubscribed on a 2-core runner) four whose states differ in kind:
# a momentum buffer, Adam's moments and step, Adadelta's two averages,
# Rprop's step sizes and signs.
CLASSES = list(OPTIMIZERS) if P <= 2 else ["SGD", "Adam", "Adadelta", "Rprop"]


def build(kind, name, model, **comp):
    """(optimizer, seconds its DistributedOptimizer(...) call took)."""
    base = OPTIMIZERS[name](model.parameters())
    if kind == "stock":
        t0 = time.perf_counter()
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    else:
        compression = Compression.gtopk(0.1, **comp)
        t0 = time.perf_counter()
        opt = DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=compression)
    return opt, time.perf_counter() - t0


def train_step(opt, model, step, poison=False):
    """One step; "ok" or the name of the (expected) exception it raised."""
    opt.zero_grad()
    loss_of(model, step, poison).backward()
    try:
        opt.step()
    except NonFiniteGradientError:
        return "NonFiniteGradientError"
    return "ok"


def sync_state(opt, model):
    # the optimizer's state first: on a fresh optimizer Horovod initialises
    # it with a local step, which moves the parameters (weight decay)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)


def per_class(kind="ours", shared_model=False):
    """The reported job: one optimizer per torch optimizer class (CLASSES), rank-
    dependent hyper-parameters, each stepped twice with
    ``hvd.broadcast_optimizer_state`` between; then, for each, a step whose
    gradient is non-finite on one rank (ours: NonFiniteGradientError on
    every rank), ``hvd.barrier()``, a broadcast and a normal step.
    ``shared_model``: every optimizer over one model, each dropped for the
    next (the earlier ones' gradient hooks must not start steps of theirs).
    Returns the events and the DistributedOptimizer(...) call times."""
    events, build_s, opts = [], {}, []
    shared = make_model(seed=R)
    for name in CLASSES:
        model = shared if shared_model else make_model(seed=R)  # differs per rank: broadcast below
        opt, build_s[name] = build(kind, name, model)
        events.append((name, "first", train_step(opt, model, 0)))  # rank-dependent settings: params differ
        sync_state(opt, model)
        events.append((name, "second", train_step(opt, model, 1), params_of(model)))
        if not shared_model:
            opts.append((name, opt, model))
        del opt, model
        progress(f"{kind} {name}: built in {1e3 * build_s[name]:.1f} ms, stepped twice")

    def faulty_then_normal(name, opt, model):
        events.append((name, "nonfinite", train_step(opt, model, 2, poison=True), params_of(model)))
        hvd.barrier()
        sync_state(opt, model)
        events.append((name, "after", train_step(opt, model, 3), params_of(model)))
        progress(f"{kind} {name}: non-finite step, barrier, broadcast, step")

    if shared_model:  # a fresh optimizer per class again, over the same model
        for name in CLASSES:
            opt, _ = build(kind, name, shared)
            sync_state(opt, shared)
            faulty_then_normal(name, opt, shared)
            del opt
    for name, opt, model in opts:
        faulty_then_normal(name, opt, model)
    return {"events": events, "build_s": build_s}


def keep_using_horovod(events, label, opt, model, steps=2):
    """After a faulty step: Horovod's own barrier, broadcasts, an allreduce
    and a few sparse steps, on every rank."""
    hvd.barrier()
    sync_state(opt, model)
    s = hvd.allreduce(torch.tensor([float(R)]), op=hvd.Sum, name=f"faults.{label}")
    events.append((label, "allreduce", float(s[0])))
    for k in range(steps):
        events.append((label, f"after{k}", train_step(opt, model, 10 + k), params_of(model)))
    progress(f"{label}: Horovod still works")


def mid_step():
    """Steps that end badly on every rank, each followed by
    :func:`keep_using_horovod`:

    * ``raise``: a non-finite gradient (NonFiniteGradientError);
    * ``skip``: the same under ``nonfinite="skip"`` (zero update);
    * ``abandon``: user code raises between backward and step (the hooks
      had started the step); the optimizer is dropped and a new one trains
      the same model;
    * ``reload``: a raised step, then ``load_state_dict`` (what elastic
      restores do) and more steps with the same optimizer;
    * ``retired``: an optimizer kept while a new one is built over its
      parameters: its step raises, the new one trains."""
    events = []
    model = make_model(seed=0)
    opt, _ = build("ours", "SGD", model)
    sync_state(opt, model)
    events.append(("raise", "nonfinite", train_step(opt, model, 0, poison=True), params_of(model)))
    keep_using_horovod(events, "raise", opt, model)

    opt, _ = build("ours", "Adam", model, nonfinite="skip")
    sync_state(opt, model)
    events.append(("skip", "nonfinite", train_step(opt, model, 1, poison=True), params_of(model)))
    keep_using_horovod(events, "skip", opt, model)

    try:
        opt.zero_grad()
        loss_of(model, 2).backward()
        raise KeyError("user code failed between backward and step")
    except KeyError:
        events.append(("abandon", "user code", "KeyError"))
    del opt
    opt, _ = build("ours", "RMSprop", model)
    keep_using_horovod(events, "abandon", opt, model)

    sd = opt.state_dict()
    events.append(("reload", "nonfinite", train_step(opt, model, 3, poison=True), params_of(model)))
    opt.load_state_dict(sd)
    keep_using_horovod(events, "reload", opt, model)

    old = opt
    opt, _ = build("ours", "SGD", model)
    sync_state(opt, model)
    old.zero_grad()
    loss_of(model, 4).backward()  # the new optimizer's hooks start its step
    try:
        old.step()
        events.append(("retired", "old step", "no error"))
    except RuntimeError as e:
        events.append(("retired", "old step", "RuntimeError" if "retired" in str(e) else str(e)))
    opt.step()
    events.append(("retired", "new step", "ok", params_of(model)))
    keep_using_horovod(events, "retired", opt, model)
    return {"events": events}


def abandon_late(kind="ours"):
    """An optimizer abandoned after backward while the other ranks are
    still on their way to that backward (they arrive 1 s later): rank 0
    builds the next optimizer (another model, names of its own) and steps
    it at once, before any other Horovod op.  Same settings on every rank
    (no broadcast needed, none to act as a barrier)."""
    events = []

    def sgd(model):
        base = torch.optim.SGD(model.parameters(), lr=0.05)
        if kind == "stock":
            return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
        return DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                    compression=Compression.gtopk(0.1))

    model = make_model(seed=0, prefix="first")
    opt = sgd(model)
    events.append(("abandon_late", "step", train_step(opt, model, 0), params_of(model)))
    if R != 0:
        time.sleep(1.0)
    opt.zero_grad()
    loss_of(model, 1).backward()  # the hooks start the step; then it is dropped
    del opt
    gc.collect()
    model = make_model(seed=0, prefix="second")
    opt = sgd(model)
    for k in range(3):
        events.append(("abandon_late", f"new{k}", train_step(opt, model, 2 + k), params_of(model)))
    keep_using_horovod(events, f"abandon_late_{kind}", opt, model)
    return {"events": events}


def dense_abandon():
    """Our own dense path (``groups=``): a step abandoned through
    ``load_state_dict`` while the other ranks are 1 s behind, then the next
    step at once under the same op names."""
    events = []
    model = make_model(seed=0)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                               named_parameters=model.named_parameters(), groups=2)
    events.append(("dense_abandon", "step", train_step(opt, model, 0), params_of(model)))
    sd = opt.state_dict()
    if R != 0:
        time.sleep(1.0)
    opt.zero_grad()
    loss_of(model, 1).backward()  # the hooks start the group allreduces
    opt.load_state_dict(sd)  # abandons the step
    for k in range(2):
        events.append(("dense_abandon", f"next{k}", train_step(opt, model, 2 + k), params_of(model)))
    keep_using_horovod(events, "dense_abandon", opt, model)
    return {"events": events}


def interleaved(kind="ours", steps=3):
    """Two models, two optimizers, the backward passes of both before either
    steps (a GAN-like loop): both must reduce, every step, on every rank."""
    events = []
    a, b = make_model(seed=R, prefix="a"), make_model(seed=R + 7, prefix="b")
    oa, _ = build(kind, "SGD", a)
    ob, _ = build(kind, "Adam", b)
    sync_state(oa, a)
    sync_state(ob, b)
    for s in range(steps):
        oa.zero_grad()
        ob.zero_grad()
        loss_of(a, s).backward()
        loss_of(b, s).backward()
        oa.step()
        ob.step()
        events.append(("interleaved", f"step{s}", "ok", torch.cat([params_of(a), params_of(b)])))
    keep_using_horovod(events, f"interleaved_{kind}", oa, a)
    return {"events": events}


def check(res, key, fn, *args, **kwargs):
    t0 = time.perf_counter()
    progress(f"check {key} starts")
    try:
        res[key] = ("ok", fn(*args, **kwargs))
    except BaseException as e:  # noqa: BLE001 - recorded for the parent
        res[key] = ("error", (type(e).__name__, str(e), traceback.format_exc()))
    res.setdefault("seconds", {})[key] = time.perf_counter() - t0
    progress(f"check {key} {res[key][0]} {time.perf_counter() - t0:.1f} s "
             f"({threading.active_count()} Python threads)")


CHECKS = {
    "per_class": lambda res: check(res, "per_class", per_class),
    "per_class_stock": lambda res: check(res, "per_class_stock", per_class, "stock"),
    "shared_model": lambda res: check(res, "shared_model", per_class, shared_model=True),
    "mid_step": lambda res: check(res, "mid_step", mid_step),
    "abandon_late": lambda res: check(res, "abandon_late", abandon_late),
    "abandon_late_stock": lambda res: check(res, "abandon_late_stock", abandon_late, "stock"),
    "dense_abandon": lambda res: check(res, "dense_abandon", dense_abandon),
    "interleaved": lambda res: check(res, "interleaved", interleaved),
    "interleaved_stock": lambda res: check(res, "interleaved_stock", interleaved, "stock"),
}


def main():
    checks, outdir = sys.argv[1].split(","), sys.argv[2]
    res = {"rank": R, "size": P}
    for c in checks:
        CHECKS[c](res)
    torch.save(res, os.path.join(outdir, f"rank{R}.pt"))
    progress("saved")
    hvd.barrier()  # Horovod's own: the job must still be able to run it
    progress("barrier passed")
    hvd.shutdown()


if __name__ == "__main__":
    main()
