"""DDP communication hook (gtopk_plugin.torch_ddp) on real gloo process groups.

Each spawn costs seconds on a small machine, so one worker per world size runs
every distributed check and returns a report that the tests assert on.
"""
import copy
import os
import pickle
import re
import subprocess
import sys

import pytest
import torch

import gtopk_plugin as gp
from dist_utils import run_workers
from gtopk_plugin.testing import Oracle

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DENSITY = 0.1
STEPS = 4


# ---------------------------------------------------------------- helpers
def _net():
    import torch.nn as nn

    class Net(nn.Module):
        # Registration order differs from use order, so DDP's rebuilt bucket
        # layout (gradient-ready order, after iteration 1) differs from the
        # initial one (registration order).
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(16, 4)
            self.inp = nn.Linear(8, 32)
            self.mid = nn.Linear(32, 16)

        def forward(self, x):
            return self.head(torch.tanh(self.mid(torch.tanh(self.inp(x)))))

    torch.manual_seed(0)
    return Net()


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _loss(model, step, rank):
    x, y = _batch(step, rank)
    return ((model(x) - y) ** 2).mean()


def _ddp(model, state, log=None, bucket_cap_mb=0.0015):
    from torch.nn.parallel import DistributedDataParallel as DDP

    # Default ~1.5 KB buckets: several buckets once DDP rebuilds them after
    # iteration 1 (iteration 0 runs on one bucket: DDP's first bucket holds 1 MiB).
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    names = {id(p): n for n, p in model.named_parameters()}

    def hook(st, bucket):
        if log is not None:
            log.append((bucket.index(), tuple(names[id(p)] for p in bucket.parameters())))
        return gp.torch_ddp.sparse_hook(st, bucket)

    ddp.register_comm_hook(state, hook if log is not None else gp.torch_ddp.sparse_hook)
    return ddp


def _opt(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _local_grads(model, step, rank, key):
    model.zero_grad()
    _loss(model, step, rank).backward()
    return {key[n]: p.grad.detach().clone() for n, p in model.named_parameters()}


def _max_diff(a, b):
    return max(float((a[n].double() - b[n].double()).abs().max()) for n in a)


def _equivalence(rank, world, kwargs, named):
    """DDP + hook vs GradientReducer.reduce on the same local gradients vs the
    Oracle, over STEPS optimizer steps (bucket rebuild after the first)."""
    model = _net()
    ref = copy.deepcopy(model)
    state = gp.torch_ddp.SparseState(named_parameters=model.named_parameters() if named else None,
                                     **kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k != "coalesce_buckets"}  # the hook's own
    layouts = []
    ddp = _ddp(model, state, layouts)
    reducer = gp.GradientReducer(**kwargs)
    oracle = Oracle(world, **kwargs)
    opt_ddp, opt_ref = _opt(ddp.parameters()), _opt(ref.parameters())
    rep = {"exact": [], "oracle_diff": [], "params_equal": [], "layouts": [], "grads": []}
    for step in range(STEPS):
        del layouts[:]
        opt_ddp.zero_grad()
        control = state.reducer.transport.counters.control_bytes
        _loss(ddp, step, rank).backward()
        # one consistency check (4 int64) per reduce() call
        rep.setdefault("checks", []).append((state.reducer.transport.counters.control_bytes - control) // 32)
        rep["layouts"].append(list(layouts))
        # The hook's names for the model's parameters (automatic: "paramN").
        key = {n: state.name_of(p) for n, p in model.named_parameters()}
        got = {key[n]: p.grad.detach().clone() for n, p in model.named_parameters()}
        local = [_local_grads(ref, step, r, key) for r in range(world)]
        direct = reducer.reduce(local[rank])
        expect = oracle.step(local)
        rep["exact"].append(all(torch.equal(got[n], direct[n]) for n in direct) and set(got) == set(direct))
        rep["oracle_diff"].append(_max_diff(got, expect))
        rep["grads"].append(got)
        for n, p in ref.named_parameters():
            p.grad = direct[key[n]].clone()
        opt_ddp.step()
        opt_ref.step()
        rep["params_equal"].append(all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters())))
    rep["state_step"] = state.step
    rep["reducer_step"] = reducer.step
    rep["names"] = state.param_names
    rep["traffic"] = state.last_step_traffic
    return rep


def _train(ddp, opt, steps, rank):
    out = []
    for step in steps:
        opt.zero_grad()
        _loss(ddp, step, rank).backward()
        out.append({n: p.grad.detach().clone() for n, p in ddp.module.named_parameters()})
        opt.step()
    return out


def _resume(rank, world, kwargs, named, bucket_cap_mb):
    """Checkpoint after 3 steps (model, optimizer, hook state by pickle and by
    state_dict), continue; a restored job must reproduce the next steps bit
    for bit.  The hook state runs on a non-default group, which pickling must
    drop."""
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    model = _net()
    state = gp.torch_ddp.SparseState(process_group=group, **kwargs,
                                     named_parameters=model.named_parameters() if named else None)
    ddp = _ddp(model, state, bucket_cap_mb=bucket_cap_mb)
    opt = _opt(ddp.parameters())
    _train(ddp, opt, range(3), rank)
    model_sd, opt_sd = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    blob = pickle.dumps(state)
    sd = copy.deepcopy(state.state_dict())
    after = _train(ddp, opt, range(3, 6), rank)

    rep = {"pg_in_pickle": b"ProcessGroup" in blob}
    for how in ("pickle", "state_dict"):
        m2 = _net()
        m2.load_state_dict(model_sd)
        if how == "pickle":
            st2 = pickle.loads(blob)
            rep["unpickled_group"] = st2.process_group
        else:
            st2 = gp.torch_ddp.SparseState(**kwargs, named_parameters=m2.named_parameters() if named else None)
            st2.load_state_dict(sd)
        ddp2 = _ddp(m2, st2, bucket_cap_mb=bucket_cap_mb)
        opt2 = _opt(ddp2.parameters())
        opt2.load_state_dict(copy.deepcopy(opt_sd))
        again = _train(ddp2, opt2, range(3, 6), rank)
        rep[how] = all(torch.equal(a[n], b[n]) for a, b in zip(after, again) for n in a)
        rep[how + "_step"] = st2.step
    # the run after the checkpoint must actually have moved (else the check is void)
    rep["moved"] = any(float(g.abs().sum()) > 0 for g in after[-1].values())
    return rep


def _worker(rank, world, equivalence_cfgs, resume_cfgs):
    torch.set_num_threads(1)
    rep = {"equivalence": [_equivalence(rank, world, kw, named) for kw, named in equivalence_cfgs]}
    rep["resume"] = [_resume(rank, world, *cfg) for cfg in resume_cfgs]
    return rep


EQUIVALENCE = [
    # gtopk with a density warm-up: the step counter must advance once per
    # training step (not per bucket) for the hook to match the direct path.
    (dict(method="gtopk", density=DENSITY, warmup=[0.5, 0.25]), True),
    (dict(method="gtopk", density=DENSITY), False),
    (dict(method="topk", density=DENSITY), True),
    (dict(method="topk", density=DENSITY, warmup=[0.3]), False),
    # rTop-k's per-rank draws are keyed by (seed, step, name, rank), so the
    # bucket layout does not change them.
    (dict(method="rtopk", density=DENSITY, merge="butterfly", seed=4), True),
    # each bucket reduced on its own (coalesce_buckets=False): granularity
    # "layer" still gives the one-call result
    (dict(method="gtopk", density=DENSITY, warmup=[0.5, 0.25], coalesce_buckets=False), True),
    # coalesced (the default): even granularity "global" selects over the
    # whole step, as one reduce() over all parameters does
    (dict(method="gtopk", density=DENSITY, granularity="global"), False),
]
RESUME = [
    # (reducer kwargs, named parameters, DDP bucket_cap_mb)
    # gTop-k with a warm-up on several (rebuilt) buckets: residuals by name,
    # step counter, first-appearance names after a restart.
    (dict(method="gtopk", density=DENSITY, warmup=[0.5, 0.3, 0.3, 0.2]), False, 0.0015),
    (dict(method="gtopk", density=DENSITY), True, 0.0015),
    # rTop-k on the butterfly over several buckets: its draws are keyed by
    # step and name, so a restart on the initial layout resumes bit-exactly.
    (dict(method="rtopk", density=DENSITY, merge="butterfly", warmup=[0.5, 0.3, 0.3, 0.2]), False, 0.0015),
]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda p: f"P{p}")
def reports(request):
    P = request.param
    resume = RESUME if P == 2 else []
    return P, run_workers(P, _worker, EQUIVALENCE, resume, timeout=90)


# ------------------------------------------------------------------ tests
@pytest.mark.timeout(120)
def test_hook_matches_reducer_and_oracle(reports):
    P, reps = reports
    for cfg_i, (kw, named) in enumerate(EQUIVALENCE):
        for r, rep in enumerate(reps):
            e = rep["equivalence"][cfg_i]
            what = f"P={P} rank {r} {kw} named={named}"
            assert e["exact"] == [True] * STEPS, f"{what}: hook != GradientReducer.reduce: {e['exact']}"
            assert max(e["oracle_diff"]) <= 1e-6, f"{what}: hook vs Oracle {e['oracle_diff']}"
            assert e["params_equal"] == [True] * STEPS, what
            assert e["state_step"] == e["reducer_step"] == STEPS, what
            # coalesced: ONE reduce() (one cross-rank check) per step whatever
            # the bucket count; otherwise one per bucket
            per_step = [len(lay) for lay in e["layouts"]]
            assert max(per_step) > 1, f"{what}: the test needs steps with several buckets"
            expect = per_step if kw.get("coalesce_buckets") is False else [1] * STEPS
            assert e["checks"] == expect, f"{what}: checks per step {e['checks']} != {expect}"
            if named:
                assert set(e["names"]) == {"head.weight", "head.bias", "inp.weight", "inp.bias",
                                           "mid.weight", "mid.bias"}
            else:
                assert e["names"] == [f"param{i}" for i in range(6)]
            assert e["traffic"]["numel"] == sum(p.numel() for p in _net().parameters())
        # all ranks end with the same (global) gradients
        for step in range(STEPS):
            g0 = reps[0]["equivalence"][cfg_i]["grads"][step]
            for rep in reps[1:]:
                g = rep["equivalence"][cfg_i]["grads"][step]
                assert all(torch.equal(g0[n], g[n]) for n in g0)
        # the sparse update is sparse: about density * numel nonzeros per tensor
        g = reps[0]["equivalence"][cfg_i]["grads"][-1]
        assert sum(int(torch.count_nonzero(t)) for t in g.values()) < 0.5 * sum(t.numel() for t in g.values())


@pytest.mark.timeout(120)
def test_bucket_rebuild_happened(reports):
    # Guards the multi-step check above: iteration 0 runs on the initial
    # bucket layout, later iterations on DDP's rebuilt one, with several
    # buckets per step (so advance_step=bucket.is_last() matters).
    P, reps = reports
    layouts = reps[0]["equivalence"][0]["layouts"]
    assert layouts[0] != layouts[1]
    assert len(layouts[1]) > 1
    assert layouts[1] == layouts[2] == layouts[3]


@pytest.mark.timeout(120)
def test_checkpoint_resume_bit_exact(reports):
    P, reps = reports
    if P != 2:
        pytest.skip("resume is checked at P=2")
    for (kw, named, _), *per_rank in zip(RESUME, *(rep["resume"] for rep in reps)):
        for r, res in enumerate(per_rank):
            what = f"rank {r} {kw} named={named}"
            assert res["moved"], what
            assert not res["pg_in_pickle"], what
            assert res["unpickled_group"] is None, what
            assert res["pickle"], f"{what}: pickled state did not resume bit-exactly"
            assert res["state_dict"], f"{what}: state_dict did not resume bit-exactly"
            assert res["pickle_step"] == res["state_dict_step"] == 6, what


@pytest.mark.timeout(30)
def test_state_pickle_and_state_dict_in_process():
    st = gp.torch_ddp.SparseState(method="rtopk", density=0.2, seed=3, warmup=[0.5])
    st2 = pickle.loads(pickle.dumps(st))
    assert st2.process_group is None and st2.step == 0
    assert st2.reducer.config == st.reducer.config
    sd = st.state_dict()
    st3 = gp.torch_ddp.SparseState(method="rtopk", density=0.2, seed=3, warmup=[0.5])
    st3.load_state_dict(sd)
    with pytest.raises(ValueError):
        gp.torch_ddp.SparseState(method="gtopk").load_state_dict(sd)  # method differs
    with pytest.raises(ValueError):
        st3.load_state_dict({"version": 99})
    # automatic names in a state loaded into a state with named parameters
    lin = torch.nn.Linear(2, 2)
    auto = {"version": 1, "named": False, "params": [["param0", [2, 2]]],
            "reducer": {"version": 1, "method": "gtopk", "step": 1,
                        "residuals": {"param0": torch.zeros(4)}, "generator": None}}
    with pytest.raises(ValueError, match="param0"):
        gp.torch_ddp.SparseState(named_parameters=lin.named_parameters()).load_state_dict(auto)
    assert "SparseState(" in repr(st) and st.last_stats is None


def test_public_imports():
    import gtopk_plugin.torch_ddp as td

    assert gp.torch_ddp.SparseState is td.SparseState
    assert gp.torch_ddp.sparse_hook is td.sparse_hook
    from gtopk_plugin.frameworks.ddp.ddp_hook import SparseState

    assert SparseState is td.SparseState


@pytest.mark.parametrize("kwargs, match", [
    (dict(method="nope"), "unknown method"),
    (dict(density=0), "density"),
    (dict(density=1.5), "density"),
    (dict(density="x"), "density"),
    (dict(op="mean"), "op"),
    (dict(granularity="bucket"), "granularity"),
    (dict(coalesce_buckets=-1), "coalesce_buckets"),
    (dict(coalesce_buckets="yes"), "coalesce_buckets"),
    (dict(overlap=1), "overlap"),
    (dict(r_factor=0.5), "r_factor"),
    (dict(value_dtype=torch.int32), "value_dtype"),
    (dict(nonfinite="ignore"), "nonfinite"),
    (dict(timeout=-1), "timeout"),
    (dict(bogus=1), "bogus"),
    (dict(transport=object()), "process_group"),
    (dict(process_group="world"), "process_group"),
    (dict(named_parameters=5), "named_parameters"),
    (dict(named_parameters=[("a", 1)]), "named_parameters"),
    (dict(named_parameters=[]), "empty"),
    (dict(named_parameters=[("a", torch.zeros(1)), ("a", torch.zeros(2))]), "twice"),
])
def test_bad_kwargs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gp.torch_ddp.SparseState(**kwargs)


@pytest.mark.timeout(120)
def test_example_runs_under_torchrun():
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0",
           os.path.join(ROOT, "examples", "ddp_train.py"),
           "--method", "gtopk", "--density", "0.05", "--epochs", "2"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    m = re.search(r"final test accuracy ([0-9.]+)", out)
    assert m, out[-4000:]
    assert float(m.group(1)) > 0.3, out[-4000:]
    assert re.search(r"epoch 2/2 .*test accuracy [0-9.]+ .*sent per step per worker", out), out[-4000:]
