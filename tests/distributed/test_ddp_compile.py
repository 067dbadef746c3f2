"""The DDP hook (gtopk_plugin.torch_ddp) with ``torch.compile``, on a real
gloo group at P = 2, every configuration in one spawn
(tests/support/compile_workers.py).

- ``DDP(torch.compile(model))`` and ``torch.compile(DDP(model))`` train bit
  for bit like eager DDP with the hook (gradients applied, parameters and
  residuals after every step) with backend "aot_eager" (Dynamo's graph
  split at DDP's buckets, or one graph), and with Inductor (the default
  backend) on a ReLU network, where Inductor keeps ATen's bits.
- With tanh, Inductor's kernel differs from ATen's in the last bits, so
  those runs are checked on the gradients the compiled model fed: the
  update is the single-process Oracle's (gtopk_plugin.testing), bit for bit,
  residuals too, mass conserved, every rank identical (as every run is).
- Every run: the hook saw each parameter once per step, in several buckets,
  the last one last; the state's step and traffic count the whole model.
  (Gradients left unsynchronised would show as ranks that differ.)
- Compiled autograd: refused with a clear error on every rank before any
  exchange (PyTorch's own with DDP's C++ reducer, the hook's with DDP's
  Python reducer; gtopk_plugin/frameworks/ddp/ddp_compile.py).
"""
import pytest
import torch

from compile_workers import STEPS, Net, worker
from dist_utils import run_workers

P = 2
# (the network's activation, what is compiled: the model inside DDP or the
# DDP module, backend, Dynamo's optimize_ddp: True = graph split at DDP's
# buckets, its default)
COMPILED = [("tanh", "model", "aot_eager", True), ("tanh", "ddp", "aot_eager", True),
            ("tanh", "model", "aot_eager", False), ("tanh", "model", "inductor", True),
            ("tanh", "ddp", "inductor", True), ("relu", "model", "inductor", True),
            ("relu", "ddp", "inductor", True)]
BIT_IDENTICAL = [c for c in COMPILED if c[2] == "aot_eager" or c[0] == "relu"]
REFUSED = ["compiled_autograd", "python_reducer"]
NUMEL = sum(p.numel() for p in Net().parameters())


@pytest.fixture(scope="module")
def reports():
    # a first Inductor compile on a machine (empty cache) takes about a minute
    return run_workers(P, worker, COMPILED, REFUSED, timeout=400)


def _runs(reports):
    for r, rep in enumerate(reports):
        for act, run in rep["eager"].items():
            yield f"rank {r} eager {act}", run
        for cfg, run in zip(COMPILED, rep["compiled"]):
            yield f"rank {r} {cfg}", run


@pytest.mark.timeout(460)
def test_every_run_reduces_every_bucket_like_the_oracle(reports):
    for what, run in _runs(reports):
        assert run["moved"], what
        assert run["state_step"] == list(range(1, STEPS + 1)), f"{what}: {run['state_step']}"
        assert run["numel"] == [NUMEL] * STEPS, f"{what}: {run['numel']}"
        assert run["covered"] == [True] * STEPS, f"{what}: a parameter missed or reduced twice"
        assert max(run["buckets"]) > 1, f"{what}: the test needs steps with several buckets"
        assert run["ranks_equal"] == [True] * STEPS, f"{what}: ranks differ"
        assert run["oracle_diff"] == [0.0] * STEPS, f"{what}: update vs Oracle {run['oracle_diff']}"
        assert run["residual_diff"] == 0.0, f"{what}: residuals vs Oracle {run['residual_diff']}"
        assert run["mass_rel_err"] <= 1e-6, f"{what}: mass not conserved ({run['mass_rel_err']:.3g})"
    # the buckets are DDP's (first step one bucket, then the rebuilt ones)
    # and Dynamo split the graph at them where optimize_ddp asks for it
    for cfg, run in zip(COMPILED, reports[0]["compiled"]):
        assert run["buckets"] == reports[0]["eager"][cfg[0]]["buckets"], cfg
        assert (len(run["graph_splits"]) > 0 and min(run["graph_splits"]) > 1) == cfg[3], \
            f"{cfg}: DDPOptimizer splits {run['graph_splits']}"


@pytest.mark.timeout(460)
def test_compiled_trains_bit_identically_to_eager(reports):
    for rep in reports:
        for cfg, run in zip(COMPILED, rep["compiled"]):
            if cfg not in BIT_IDENTICAL:
                continue
            same = run["same_as_eager"]
            assert same["applied"] == [True] * STEPS, f"{cfg}: applied gradients {same['applied']}"
            assert same["params"] == [True] * STEPS, f"{cfg}: parameters {same['params']}"
            assert same["residuals"], f"{cfg}: residuals differ from eager"


@pytest.mark.timeout(460)
def test_inductor_with_tanh_stays_close_to_eager(reports):
    # not the eager bits; the reduction itself is checked above
    for cfg, run in zip(COMPILED, reports[0]["compiled"]):
        if cfg not in BIT_IDENTICAL:
            assert run["max_diff_vs_eager"] <= 1e-5, f"{cfg}: {run['max_diff_vs_eager']}"


@pytest.mark.timeout(460)
def test_compiled_autograd_with_the_cpp_reducer_fails_before_the_hook(reports):
    for r, rep in enumerate(reports):
        run = rep["refused"][REFUSED.index("compiled_autograd")]
        assert run["error"] is not None, f"rank {r}: compiled autograd trained ({run})"
        kind, msg = run["error"]
        assert kind == "RuntimeError" and "ompiled autograd" in msg and "DDP" in msg, (kind, msg)
        assert run["hook_calls"] == 0 and run["state_step"] == 0, run


@pytest.mark.timeout(460)
def test_python_reducer_is_refused_clearly(reports):
    for r, rep in enumerate(reports):
        run = rep["refused"][REFUSED.index("python_reducer")]
        assert run["error"] is not None, f"rank {r}: DDP's Python reducer trained ({run})"
        kind, msg = run["error"]
        assert kind == "RuntimeError" and "sparse_hook needs DDP's C++ reducer" in msg, (kind, msg)
        assert run["state_step"] == 0, run
        # ... and, when the state is built after Dynamo is set so, right there
        kind, msg = rep["mode_refused"]
        assert kind == "RuntimeError" and "python_reducer" in msg, (kind, msg)


def test_checks_in_process():
    from gtopk_plugin.frameworks.ddp.ddp_compile import check_bucket, check_ddp_mode

    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(RuntimeError, match="instead of a GradBucket"):
        check_bucket((torch.zeros(2), p))
    check_ddp_mode()  # Dynamo at its defaults
