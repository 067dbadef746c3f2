"""Worker script run under ``horovodrun`` by tests/horovod/test_horovod.py.

    horovodrun -np N -H localhost:N --gloo python tests/jobs/hvd_torch_jobs.py JOB OUTDIR

Every rank runs every check of JOB and saves ``OUTDIR/rank{r}.pt`` (a dict of
results); the parent test compares ranks with each other and with the
single-process oracle.  One job batches many checks because starting a
horovodrun job costs seconds.  A check that raises is recorded as an error
(type, message) and the job goes on, so that one failure does not hide the
others; anything that would hang is bounded by the parent's timeout.
"""
import os
import sys
import time
import traceback
import warnings

import torch

import horovod.torch as hvd

torch.set_num_threads(1)
# With 3 or more ranks the job also reduces over a process set of ranks 0
# and 1 only (process sets are declared at init; horovodrun sets HOROVOD_SIZE).
PROCSET = hvd.ProcessSet([0, 1]) if int(os.environ.get("HOROVOD_SIZE", "1")) >= 3 else None
hvd.init(process_sets=[PROCSET] if PROCSET is not None else None)

from gtopk_plugin.frameworks.horovod.waiting import barrier  # noqa: E402
from gtopk_plugin.horovod import Compression, DistributedOptimizer  # noqa: E402

R, P = hvd.rank(), hvd.size()
STEPS = 4
T0 = time.monotonic()


def progress(msg):
    # on stderr, with the seconds since this rank started: when a job dies
    # (a gloo timeout, a hang killed by the parent), the tail of its output
    # says which check each rank was in and since when
    print(f"{time.monotonic() - T0:7.1f} s {msg}", file=sys.stderr, flush=True)


class CountingOps:
    """Counts the Horovod ops the sparse layer issues: wraps the ``mpi_ops``
    module that its transport and step modules call (the test
    asserts the number per step)."""

    def __init__(self):
        from gtopk_plugin.frameworks.horovod import hvd_sparse as sparse
        from gtopk_plugin.frameworks.horovod import hvd_transport as transport

        self.n, self._real = 0, transport._ops
        transport._ops = sparse._ops = self

    def __getattr__(self, name):
        f = getattr(self._real, name)
        if not name.endswith(("_async", "_async_")):
            return f

        def counted(*a, **k):
            self.n += 1
            return f(*a, **k)
        return counted


HVD_OPS = CountingOps()


def make_model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.ReLU(), torch.nn.Linear(10, 6),
                            torch.nn.ReLU(), torch.nn.Linear(6, 3))
    return m.to(dtype)


def batch(step, rank=None, n=8):
    g = torch.Generator().manual_seed(1000 * step + (R if rank is None else rank))
    return torch.randn(n, 12, generator=g), torch.randint(0, 3, (n,), generator=g)


def loss_of(model, step):
    x, y = batch(step)
    return torch.nn.functional.cross_entropy(model(x.to(next(model.parameters()).dtype)), y)


def flat_params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class RawGrads:
    """Records each parameter's local gradient before reduction (a hook
    registered after the optimizer's runs after it; the optimizer only reads
    p.grad until synchronize())."""

    def __init__(self, model):
        self.names = {p: n for n, p in model.named_parameters()}
        self.cur = {}
        for p in self.names:
            p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p):
        self.cur[self.names[p]] = p.grad.detach().clone()

    def take(self):
        out, self.cur = self.cur, {}
        return out


def run_sparse(comp, op=hvd.Sum, steps=STEPS, bpps=1, lr=0.05, skip_sync=False):
    """Train a few steps; return raw local grads, reduced grads, params,
    residual state and per-step traffic."""
    model = make_model()
    raw = RawGrads(model)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                               named_parameters=model.named_parameters(), compression=comp, op=op,
                               backward_passes_per_step=bpps)
    raws, outs, traffic, stats, launched, ops = [], [], [], [], [], []
    for s in range(steps):
        ops0 = (HVD_OPS.n, opt._transport.collectives)
        opt.zero_grad()
        acc = {}
        for k in range(bpps):
            loss_of(model, s * bpps + k).backward()
            for n, g in raw.take().items():
                acc[n] = g  # p.grad accumulates: the last pass holds the sum
        # buckets whose reduction the hooks started during backward
        launched.append(sum(f is not None for f in opt._futures))
        raws.append(acc)
        if skip_sync:
            opt.synchronize()
            outs.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no "step() after synchronize()" warning
                with opt.skip_synchronize():
                    opt.step()
        else:
            opt.step()
            # SGD without momentum: the applied grad is still in p.grad
            outs.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        traffic.append(dict(opt.last_step_traffic))
        stats.append(opt.last_stats.as_dict())
        # (Horovod ops, all ops of the transport incl. the gloo side channel)
        ops.append((HVD_OPS.n - ops0[0], opt._transport.collectives - ops0[1]))
    return {"raw": raws, "out": outs, "params": flat_params(model),
            "state": opt.state_dict()["gtopk_plugin"], "traffic": traffic, "stats": stats,
            "buckets": opt.buckets, "launched_in_backward": launched, "ops": ops}


def run_dense(make_opt, steps=STEPS, bpps=1, momentum=0.9):
    model = make_model()
    opt = make_opt(torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum), model)
    for s in range(steps):
        opt.zero_grad()
        for k in range(bpps):
            loss_of(model, s * bpps + k).backward()
        opt.step()
    return flat_params(model), getattr(opt, "last_step_traffic", None)


def check(results, key, fn, *args, **kwargs):
    t0 = time.perf_counter()
    progress(f"check {key} rank {R} starts")
    try:
        results[key] = ("ok", fn(*args, **kwargs))
    except BaseException as e:  # noqa: BLE001 - recorded for the parent
        results[key] = ("error", (type(e).__name__, str(e), traceback.format_exc()))
    results.setdefault("seconds", {})[key] = time.perf_counter() - t0
    progress(f"check {key} rank {R} {results[key][0]} {time.perf_counter() - t0:.1f} s")


# ---------------------------------------------------------------------------
def job_dense(res):
    """Compression.none / fp16 through our optimizer == stock Horovod."""
    for cname in ("none", "fp16"):
        for bpps in (1, 2):
            ours = lambda o, m: DistributedOptimizer(o, named_parameters=m.named_parameters(),  # noqa: E731
                                                     compression=getattr(Compression, cname),
                                                     backward_passes_per_step=bpps)
            stock = lambda o, m: hvd.DistributedOptimizer(o, named_parameters=m.named_parameters(),  # noqa: E731
                                                          compression=getattr(hvd.Compression, cname),
                                                          backward_passes_per_step=bpps)
            check(res, f"dense/{cname}/bpps{bpps}/ours", run_dense, ours, bpps=bpps)
            check(res, f"dense/{cname}/bpps{bpps}/stock", run_dense, stock, bpps=bpps)
    # groups (Horovod grouped allreduce) and a predivide factor
    ours = lambda o, m: DistributedOptimizer(o, named_parameters=m.named_parameters(), groups=2,  # noqa: E731
                                             gradient_predivide_factor=2.0)
    stock = lambda o, m: hvd.DistributedOptimizer(o, named_parameters=m.named_parameters(), groups=2,  # noqa: E731
                                                  gradient_predivide_factor=2.0)
    check(res, "dense/groups/ours", run_dense, ours)
    check(res, "dense/groups/stock", run_dense, stock)


def quiet_wait(late_s=0.5):
    """Steps wait without Horovod's spinning ``synchronize``: rank 1 starts
    each backward ``late_s`` late, and every handle must reach Horovod's
    ``synchronize`` already complete on every rank (ours: Horovod's own
    optimizer under Compression.none, our dense path with groups, and the
    sparse path, whose first step makes the side channel).
    Stock Horovod runs the same steps as the control: on rank 0 its handles
    are still in flight at ``synchronize``.  Returns, per run, the poll
    results seen at each ``synchronize`` call and the final parameters."""
    import horovod.torch.optimizer as hopt
    from horovod.torch import mpi_ops

    seen = []
    real_module, real_ops = hopt.synchronize, mpi_ops.synchronize

    def recording(real):
        def sync(handle):
            seen.append(bool(mpi_ops.poll(handle)))
            return real(handle)
        return sync

    runs = {"ours_none": lambda o, m: DistributedOptimizer(o, named_parameters=m.named_parameters()),
            "ours_groups": lambda o, m: DistributedOptimizer(o, named_parameters=m.named_parameters(), groups=2),
            # the first step makes the gloo side channel (a Horovod broadcast)
            "ours_gtopk": lambda o, m: DistributedOptimizer(o, named_parameters=m.named_parameters(),
                                                            compression=Compression.gtopk(0.1)),
            "stock": lambda o, m: hvd.DistributedOptimizer(o, named_parameters=m.named_parameters())}
    out = {}
    hopt.synchronize, mpi_ops.synchronize = recording(real_module), recording(real_ops)
    try:
        for label, make in runs.items():
            model = make_model()
            opt = make(torch.optim.SGD(model.parameters(), lr=0.05), model)
            for s in range(2):
                opt.zero_grad()
                if R == 1:
                    time.sleep(late_s)
                loss_of(model, s).backward()
                opt.step()
            out[label] = (list(seen), flat_params(model))
            seen.clear()
    finally:
        hopt.synchronize, mpi_ops.synchronize = real_module, real_ops
    return out


SPARSE_CONFIGS = {
    "gtopk": lambda: Compression.gtopk(0.1),
    "topk": lambda: Compression.topk(0.1),
    "rtopk": lambda: Compression.rtopk(0.1, r_factor=3, seed=5),
    "randomk": lambda: Compression.randomk(0.1, seed=3),
    "threshold": lambda: Compression.threshold(0.1),
    # several buckets (one per ~100 bytes), reduced while backward runs
    "gtopk_buckets": lambda: Compression.gtopk(0.1, fusion_threshold=100),
    # every exchange step a Horovod collective (no gloo side channel)
    "gtopk_hvd_exchange": lambda: Compression.gtopk(0.1, fusion_threshold=100, exchange="horovod"),
    "gtopk_fp16wire": lambda: Compression.gtopk(0.1, value_dtype=torch.float16),
    # int8 values + one exponent byte per message, stochastic rounding
    "gtopk_int8wire": lambda: Compression.gtopk(0.1, value_dtype=torch.int8, wire_rounding="stochastic", seed=4),
    "topk_warmup": lambda: Compression.topk(0.05, warmup=[0.5, 0.2], fusion_threshold=200),
    # variable-size sets through alltoall (sizes not known to receivers)
    "threshold_butterfly": lambda: Compression.threshold(0.1, merge="butterfly", fusion_threshold=300),
}


def job_sparse(res):
    for name, make in SPARSE_CONFIGS.items():
        check(res, f"sparse/{name}", run_sparse, make())
    check(res, "sparse/gtopk_average", run_sparse, Compression.gtopk(0.1), op=hvd.Average)
    check(res, "sparse/gtopk_bpps2", run_sparse, Compression.gtopk(0.1, fusion_threshold=150), bpps=2)
    check(res, "sparse/gtopk_skipsync", run_sparse, Compression.gtopk(0.1), skip_sync=True)


def warn_after_synchronize():
    """step() after synchronize() without skip_synchronize warns (Horovod)."""
    model = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(), compression=Compression.gtopk(0.2))
    loss_of(model, 0).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        opt.step()
    return {"warned": any("skip_synchronize" in str(x.message) for x in w), "step": opt.reducer.step}


def broadcast_state():
    """hvd.broadcast_parameters + broadcast_optimizer_state on a sparse
    optimizer: state equal everywhere, no reduction run by the broadcast,
    then training keeps parameters identical."""
    model = make_model(seed=R)  # different on every rank on purpose
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1 * (R + 1), momentum=0.9),
                               named_parameters=model.named_parameters(), compression=Compression.gtopk(0.2))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    step_after_bcast = opt.reducer.step
    lr = opt.param_groups[0]["lr"]
    mom = {n: opt.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters()
           if "momentum_buffer" in opt.state[p] and opt.state[p]["momentum_buffer"] is not None}
    for s in range(3):
        opt.zero_grad()
        loss_of(model, s).backward()
        opt.step()
    return {"step_after_bcast": step_after_bcast, "lr": lr, "momentum": mom, "params": flat_params(model),
            "step": opt.reducer.step}


def elastic_round_trip():
    """TorchState commit -> more steps -> restore brings back residuals and
    step counter; replaying the same steps gives the same bits."""
    model = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               named_parameters=model.named_parameters(), compression=Compression.gtopk(0.1))
    state = hvd.elastic.TorchState(model=model, optimizer=opt, batch=0)
    handler = type(state._handlers["optimizer"]).__name__
    state.sync()

    def train(first, n):
        outs = []
        for s in range(first, first + n):
            opt.zero_grad()
            loss_of(model, s).backward()
            opt.step()
            outs.append(flat_params(model))
        return outs

    train(0, 3)
    state.batch = 3
    state.commit()
    committed = opt.state_dict()["gtopk_plugin"]
    first = train(3, 2)
    moved = opt.state_dict()["gtopk_plugin"]
    state.restore()
    restored = opt.state_dict()["gtopk_plugin"]
    state.sync()  # our handler: broadcast optimizer state, then rank 0's step counter
    second = train(3, 2)
    return {"handler": handler, "committed": committed, "moved": moved, "restored": restored,
            "first": first, "second": second, "batch": state.batch}


def bad_inputs():
    out = {}
    model = make_model()  # never trained here: optimizers that fail to build register no hooks

    def expect(key, fn):
        progress(f"check bad/{key} rank {R} starts")
        try:
            fn()
            out[key] = ("no error", "")
        except Exception as e:  # noqa: BLE001
            out[key] = (type(e).__name__, str(e))

    sgd = lambda: torch.optim.SGD(model.parameters(), lr=0.1)  # noqa: E731
    expect("unknown_string", lambda: DistributedOptimizer(sgd(), model.named_parameters(), compression="gtopk"))
    expect("unknown_attr", lambda: Compression.gtop(0.1))
    expect("from_name", lambda: Compression.from_name("bogus", 0.1))
    expect("density_high", lambda: Compression.gtopk(1.5))
    expect("density_zero", lambda: Compression.topk(0.0))
    expect("r_factor", lambda: Compression.rtopk(0.1, r_factor=0.5))
    expect("exchange", lambda: Compression.gtopk(0.1, exchange="mpi"))
    expect("missing_param", lambda: DistributedOptimizer(sgd(), list(model.named_parameters())[:-1],
                                                          compression=Compression.gtopk(0.1)))
    expect("adasum_sparse", lambda: DistributedOptimizer(sgd(), model.named_parameters(),
                                                          compression=Compression.gtopk(0.1), op=hvd.Adasum))
    expect("stock_with_sparse", lambda: _stock_with_sparse(make_model()))

    # One rank configured differently: every rank raises a clear error at the
    # first step instead of hanging in mismatched exchanges.
    def mismatch():
        model = make_model()  # a fresh model per optimizer: hooks are never removed (as in Horovod)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   compression=Compression.gtopk(0.2 if R == 1 else 0.1))
        opt.zero_grad()
        loss_of(model, 0).backward()
        opt.step()
    expect("rank_mismatch", mismatch)

    # Non-finite gradient on one rank.
    def nonfinite(policy):
        model = make_model()
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   compression=Compression.gtopk(0.2, nonfinite=policy))
        opt.zero_grad()
        # inf on the last rank only, produced inside backward (the bucket may
        # already be in flight when backward returns)
        (loss_of(model, 0) * (float("inf") if R == P - 1 else 1.0)).backward()
        opt.synchronize()
        return {n: p.grad.clone() for n, p in model.named_parameters()}, opt.state_dict()["gtopk_plugin"]
    expect("nonfinite_raise", lambda: nonfinite("raise"))
    progress(f"check bad/nonfinite_propagate rank {R} starts")
    try:
        out["nonfinite_propagate"] = ("ok", nonfinite("propagate"))
    except Exception as e:  # noqa: BLE001
        out["nonfinite_propagate"] = (type(e).__name__, str(e))
    # still usable after all that
    progress(f"check bad/after rank {R} starts")
    out["after"] = run_sparse(Compression.gtopk(0.1), steps=1)["out"][0]
    return out


def _stock_with_sparse(model):
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=Compression.gtopk(0.1))
    opt.zero_grad()
    loss_of(model, 0).backward()
    opt.step()


def mixed_precision():
    """fp16 / bf16 gradients set by hand (every parameter goes through the
    'no hook fired' path of synchronize)."""
    out = {}
    for dtype in (torch.float16, torch.bfloat16):
        for cname, comp in (("gtopk", Compression.gtopk(0.2)), ("topk", Compression.topk(0.2)),
                            ("none", Compression.none)):
            model = make_model(dtype=dtype)
            opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                       compression=comp, op=hvd.Sum)
            raws, outs = [], []
            for s in range(2):
                g = torch.Generator().manual_seed(77 * s + R)
                raw = {}
                for n, p in model.named_parameters():
                    p.grad = ((torch.randn(p.shape, generator=g) * 4).round() / 4).to(dtype)
                    raw[n] = p.grad.clone()
                raws.append(raw)
                opt.synchronize()
                outs.append({n: p.grad.clone() for n, p in model.named_parameters()})
                with opt.skip_synchronize():
                    opt.step()
            out[f"{dtype}/{cname}"] = {"raw": raws, "out": outs}
    return out


def grad_scaler():
    """torch.amp GradScaler with Horovod's pattern and nonfinite="propagate":
    an overflow on one rank makes every rank skip the step and halve the
    scale; later steps apply normally."""
    model = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                               compression=Compression.gtopk(0.2, nonfinite="propagate"))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    init = flat_params(model)
    scales, params = [], []
    for s in range(3):
        opt.zero_grad()
        loss = loss_of(model, s)
        if s == 0 and R == P - 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        params.append(flat_params(model))
    return {"init": init, "scales": scales, "params": params, "step": opt.reducer.step}


def process_set_run():
    """Sparse and dense reduction over the process set {0, 1}; rank 2 is not
    in it and must not block (its optimizer does not communicate)."""
    out = {"included": PROCSET.included()}
    for cname, comp in (("gtopk", Compression.gtopk(0.1)), ("topk", Compression.topk(0.1)),
                        ("none", Compression.none)):
        model = make_model()
        raw = RawGrads(model)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
                                   compression=comp, op=hvd.Sum, process_set=PROCSET)
        raws, outs = [], []
        for s in range(3):
            opt.zero_grad()
            loss_of(model, s).backward()
            raws.append(raw.take())
            opt.step()
            outs.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        out[cname] = {"raw": raws, "out": outs}
    return out


def momentum_run(nesterov=False, weight_decay=0.0, clip_norm=None, scaler_growth=False, steps=STEPS):
    """SGD(momentum=0.9) under Compression.gtopk(momentum_correction=True)
    with several buckets: local gradients and weights per step (for the
    parent's numpy oracle), the optimizer's settings afterwards, velocities."""
    model = make_model()
    raw = RawGrads(model)
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=nesterov,
                           weight_decay=weight_decay)
    comp = Compression.gtopk(0.2, momentum_correction=True, clip_norm=clip_norm, fusion_threshold=256,
                             nonfinite="propagate" if scaler_growth else "raise")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4, growth_interval=1) if scaler_growth else None
    opt = DistributedOptimizer(base, model.named_parameters(), compression=comp, grad_scaler=scaler)
    raws, before, scales = [], [], []
    for s in range(steps):
        before.append(flat_params(model))
        opt.zero_grad()
        loss = loss_of(model, s)
        if scaler is None:
            loss.backward()
            raws.append(raw.take())
            opt.step()
        else:
            scales.append(scaler.get_scale())
            scaler.scale(loss).backward()
            raws.append(raw.take())
            opt.synchronize()
            scaler.unscale_(opt)
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update()
    sd = opt.state_dict()
    return {"raw": raws, "before": before, "params": flat_params(model), "buckets": len(opt.buckets),
            "momentum": opt.param_groups[0]["momentum"], "wd": opt.param_groups[0]["weight_decay"],
            "velocities": sd["gtopk_plugin"]["velocities"], "scales": scales,
            "buffers": [k for st in sd["state"].values() for k in st]}


def momentum_warning():
    model = make_model()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                             model.named_parameters(), compression=Compression.gtopk(0.1))
    return [str(x.message) for x in w]


def join_uneven(method):
    """Uneven data: rank 0 runs out after 2 steps and calls hvd.join(); the
    others' next sparse step must raise JoinedRankError on every one of them
    (no hang), leave their residuals as they were, and let them join too."""
    model = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
                               compression=Compression.from_name(method, 0.2))
    steps = 2 if R == 0 else 4
    err, done, before = None, 0, None
    for s in range(steps):
        opt.zero_grad()
        loss_of(model, s).backward()
        before = {n: r.clone() for n, r in opt.reducer.state_dict()["residuals"].items()}
        try:
            opt.step()
        except Exception as e:  # noqa: BLE001 - reported to the parent
            err = (type(e).__name__, str(e))
            break
        done += 1
    hvd.join()
    after = opt.reducer.state_dict()["residuals"]
    kept = before is not None and all(torch.equal(after[n], before[n]) for n in before)
    return {"error": err, "done": done, "residuals_kept": kept}


def job_momentum(res):
    check(res, "mc_plain", momentum_run)
    check(res, "mc_nesterov_wd", momentum_run, nesterov=True, weight_decay=1e-2)
    check(res, "mc_clip", momentum_run, clip_norm=0.05)
    check(res, "mc_clip_scaler", momentum_run, clip_norm=0.05, scaler_growth=True)
    check(res, "mc_warning", momentum_warning)
    check(res, "join_gtopk", join_uneven, "gtopk")
    check(res, "join_topk", join_uneven, "topk")
    check(res, "mc_adam", lambda: DistributedOptimizer(
        torch.optim.Adam(make_model().parameters()), compression=Compression.gtopk(0.1, momentum_correction=True)))


def barrier_waits_for_the_last_rank(late_s=0.5):
    """waiting.barrier (the jobs' own exit barrier): the last rank, late,
    leaves a file before its barrier; every rank must see it after its own."""
    marker = os.path.join(sys.argv[2], "last_rank_reached_its_barrier")
    if R == P - 1:
        time.sleep(late_s)
        open(marker, "w").close()
    barrier()
    return os.path.exists(marker)


JOBS = {
    "main": lambda res: (job_dense(res), job_sparse(res),
                         check(res, "barrier", barrier_waits_for_the_last_rank),
                         check(res, "warn", warn_after_synchronize),
                         check(res, "broadcast", broadcast_state),
                         check(res, "elastic", elastic_round_trip),
                         check(res, "bad", bad_inputs),
                         check(res, "mixed", mixed_precision),
                         check(res, "grad_scaler", grad_scaler),
                         check(res, "quiet_wait", quiet_wait),
                         check(res, "procset", process_set_run) if PROCSET is not None else None),
    # the checks that depend on P's butterfly shape (test_horovod.py runs
    # "main" at P = 2, 3 and this at P = 4)
    "core": lambda res: (job_dense(res), job_sparse(res), check(res, "bad", bad_inputs)),
    "sparse": lambda res: job_sparse(res),
    "momentum": job_momentum,
}


def main():
    job, outdir = sys.argv[1], sys.argv[2]
    res = {"rank": R, "size": P}
    JOBS[job](res)
    torch.save(res, os.path.join(outdir, f"rank{R}.pt"))
    progress(f"check saved rank {R}")
    # A rank that shuts Horovod down ends it for everyone (rank 2 of the
    # procset job finishes first): leave together.
    barrier()  # Horovod's own barrier spins: see waiting.barrier
    progress(f"check barrier rank {R}")
    hvd.shutdown()
    progress(f"check shutdown rank {R}")


if __name__ == "__main__":
    main()
