"""FSDP2 / HSDP replica reduction (gtopk_plugin.torch_fsdp) on real gloo
meshes (replicate x shard) of 2x2, 2x3 and 3x2 ranks.

One spawn per mesh shape runs every check (tests/support/fsdp_workers.py)
and returns plain data; the tests compare it with references that do not
use the layer: stock HSDP, the single-process oracle of the reducer on each
shard across the replicas, mass conservation, an uninterrupted run.  The
2x2 spawn writes a checkpoint that the 2x3 spawn reshards and the 3x2 spawn
must refuse.
"""
import pytest
import torch

from dist_utils import run_workers
from fsdp_workers import CLIP, SPARSE, STEPS, WD, mesh_checks
from gtopk_plugin.testing import Oracle

SHAPES = [(2, 2), (2, 3), (3, 2)]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """(R, S) -> per-rank reports, spawned on first use, in SHAPES order."""
    ckdir = str(tmp_path_factory.mktemp("fsdp_ckpt"))
    cache = {}

    def get(R, S):
        for shape in SHAPES[:SHAPES.index((R, S)) + 1]:
            if shape not in cache:
                cache[shape] = run_workers(shape[0] * shape[1], mesh_checks, *shape, ckdir, timeout=300)
        return cache[(R, S)]

    return get


def _by_coords(reps):
    return {tuple(r["coords"]): r for r in reps}


def _same(got, want, exact, where):
    if exact:
        assert torch.equal(got, want), where
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=str(where))


def _check_against_oracle(reps, R, S, runs, oracle_kw):
    """Every shard's updates and residuals equal the oracle of its replicas,
    the same on every replica; and mass is conserved.  Bit for bit, but
    for allreduce-based methods at R = 3, whose sums are in gloo's order
    (allclose, docs/design.md §8)."""
    exact = oracle_kw["method"] != "randomk" or R == 2
    by = _by_coords(reps)
    for s in range(S):
        logs = [runs(by[(j, s)])["log"] for j in range(R)]
        assert all(len(log) == STEPS for log in logs)
        # FSDP's own all-reduce is off: the replicas hand in different shards
        assert any(not torch.equal(logs[0][0][0][n], logs[1][0][0][n]) for n in logs[0][0][0])
        oracle = Oracle(R, **oracle_kw)
        for t in range(STEPS):
            want = oracle.step([logs[j][t][0] for j in range(R)])
            for j in range(R):
                got = logs[j][t][1]
                assert set(got) == set(want)
                for n in want:
                    _same(got[n], want[n], exact, (s, t, j, n))
        for j in range(R):
            res = runs(by[(j, s)])["residuals"]
            for n, r in res.items():
                _same(r.reshape(-1), oracle.residuals[j][n].reshape(-1), exact, (s, j, n))
    if "momentum_correction" not in oracle_kw:  # with it, the increments are conserved (design §5)
        _check_conservation(reps, R, S, runs)


def _check_conservation(reps, R, S, runs):
    """Per entry of every shard: the gradients summed over replicas and
    steps equal the updates times R (op='average') plus the residuals, and
    every replica applied the same updates."""
    by = _by_coords(reps)
    for s in range(S):
        logs = [runs(by[(j, s)])["log"] for j in range(R)]
        for t in range(STEPS):
            for j in range(1, R):
                assert all(torch.equal(logs[j][t][1][n], logs[0][t][1][n]) for n in logs[0][t][1])
        for n in logs[0][0][0]:
            grads = sum(logs[j][t][0][n].double() for j in range(R) for t in range(STEPS))
            applied = sum(logs[0][t][1][n].double() for t in range(STEPS)) * R
            left = sum(runs(by[(j, s)])["residuals"][n].double().reshape(grads.shape) for j in range(R))
            torch.testing.assert_close(grads, applied + left, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("R,S", SHAPES)
def test_dense_equals_stock_hsdp(reports, R, S):
    for rep in reports(R, S):
        for n, (stock, ours) in rep["dense"].items():
            if R & (R - 1) == 0:  # the same sums: bit for bit
                assert torch.equal(stock, ours), n
            else:  # gloo's average against a sum divided after
                torch.testing.assert_close(ours, stock, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("R,S", SHAPES)
@pytest.mark.parametrize("name", list(SPARSE))
def test_sparse_shards_equal_the_oracle(reports, R, S, name):
    kw = SPARSE[name]
    _check_against_oracle(reports(R, S), R, S, lambda rep: rep["sparse"][name], kw)


@pytest.mark.parametrize("R,S", SHAPES)
def test_codec_conserves_mass(reports, R, S):
    _check_conservation(reports(R, S), R, S, lambda rep: rep["codec"])


def test_bf16_mixed_precision_keeps_float32_state(reports):
    reps = reports(2, 2)
    for rep in reps:
        run = rep["bf16"]
        inp, out = run["log"][0]
        assert all(g.dtype == torch.float32 for g in inp.values())  # FSDP's cast of the bf16 shard
        assert all(r.dtype == torch.float32 for r in run["residuals"].values())
        k = run["traffic"]["k"]
        assert run["traffic"]["payload_bytes_sent"] == 6 * k  # int32 index + bf16 value, one round
    _check_against_oracle(reps, 2, 2, lambda rep: rep["bf16"], dict(SPARSE["gtopk"], value_dtype=torch.bfloat16))


def test_dcp_resume_is_bit_exact(reports):
    for rep in reports(2, 2):
        d = rep["dcp"]
        assert d["steps"] == (4, 4)
        for a, b in (d["params"], d["residuals"]):
            for n in a:
                assert a[n][0] == b[n][0] and torch.equal(a[n][1], b[n][1]), n


def _assemble(reps, key, R):
    """Per replica, name -> full tensor of its residual shards."""
    by = {}
    for rep in reps:
        j = rep["coords"][0]
        for n, (off, t) in key(rep).items():
            rows = by.setdefault(j, {}).setdefault(n, {})
            rows[off[0]] = t
    return {j: {n: torch.cat([rows[o] for o in sorted(rows)]) for n, rows in d.items()} for j, d in by.items()}


def test_resharding_to_more_shards_is_exact(reports):
    saved = _assemble(reports(2, 2), lambda rep: rep["dcp"]["saved"], 2)
    reps = reports(2, 3)
    assert all("error" not in rep["reshard"] for rep in reps), reps[0]["reshard"]
    loaded = _assemble(reps, lambda rep: rep["reshard"]["residuals"], 2)
    assert set(saved) == set(loaded) == {0, 1}
    for j in saved:
        for n in saved[j]:
            assert torch.equal(saved[j][n], loaded[j][n]), (j, n)
    assert all(rep["reshard"]["step"] == 2 for rep in reps)


def test_another_replica_count_is_refused_on_every_rank(reports):
    for rep in reports(3, 2):
        err = rep["replicas changed"].get("error")
        assert err is not None
        assert "replica" in err


def test_one_d_shard_mesh_with_replicas_outside(reports):
    """fully_shard on mesh['shard'] with the replicas from the 2-D mesh:
    the same updates as the 2-D model."""
    for rep in reports(2, 3):
        one_d, two_d = rep["one_d"], rep["sparse"]["gtopk"]
        for (ia, oa), (ib, ob) in zip(one_d["log"], two_d["log"]):
            for n in oa:
                assert torch.equal(ia[n], ib[n]) and torch.equal(oa[n], ob[n]), n


def test_bad_input_raises_a_clear_error_on_every_rank(reports):
    errs = [rep["errors"] for rep in reports(2, 2)]
    assert all(e == errs[0] for e in errs)
    e = errs[0]
    assert "not sharded with torch.distributed.fsdp.fully_shard" in e["not sharded"]
    assert "without a replicate dimension" in e["1-D mesh"]
    assert "'denisty'" in e["keyword"]
    assert "do not pass replicate_group" in e["replicate_group on 2-D"]


def test_gradient_accumulation_equals_stock_hsdp(reports):
    for rep in reports(2, 2):
        stock, ours = rep["accumulation"]
        for n in stock:
            assert torch.equal(stock[n], ours[n]), n


def test_remove_gives_stock_hsdp_back(reports):
    assert all(rep["removed"] for rep in reports(2, 2))


def test_nonfinite_gradient_on_one_shard_is_handled_on_every_rank(reports):
    reps = reports(2, 2)
    for rep in reps:
        assert "NonFiniteGradientError" in rep["nonfinite"]["raise"]
        assert rep["nonfinite"]["skip"] == {"zero": True, "step": 1}
    # every rank names the shard and the mesh rank that holds the NaN
    culprit = f"(on global rank {len(reps) - 1})"
    for rep in reps:
        assert culprit in rep["nonfinite"]["raise"], rep["nonfinite"]["raise"]


def test_a_fault_on_one_shard_reaches_every_rank_of_the_mesh(reports):
    """Invalid input on the last rank: it raises its own error, its shard
    peer names it, the replicas raise too.  A NaN where the other shard holds
    no entries at all: that rank raises (or skips) with the others."""
    reps = reports(2, 2)
    for key in ("bad", "bad clipped"):  # clipped: the replica's norm is taken first
        errs = [rep["joined"][key] for rep in reps]
        assert all(e is not None for e in errs), (key, errs)
        assert errs[3].startswith("ValueError") and "int32" in errs[3]
        for e in errs[:3]:  # its shard peer, and the other replica's ranks through theirs
            assert e.startswith("PeerInputError") and "global rank 3: " in e and "int32" in e, e
    entries = [rep["joined"]["skip", 0]["entries"] for rep in reps]
    assert sorted(entries) == [0, 0, 1, 1]  # two ranks hold the one entry, two hold none
    for rep in reps:
        j = rep["joined"]
        assert "NonFiniteGradientError" in j["raise", 0] and "(on global rank 2)" in j["raise", 0], j["raise", 0]
        for policy in ("skip", "skip clipped"):  # clipped: one more agreement per call, mirrored
            assert j[policy, 0]["step"] == 1 and j[policy, 0]["zero"], (policy, j[policy, 0])
            assert j[policy, 1]["step"] == 2, (policy, j[policy, 1])
            assert not j[policy, 1]["zero"] or j[policy, 1]["entries"] == 0


def test_momentum_correction_from_the_optimizer(reports):
    """momentum_correction=True reads SGD's momentum (the same as the
    momentum given), and its weight decay reads each rank's local shard:
    the oracle on gradient + wd * shard."""
    reps = reports(2, 2)
    for rep in reps:
        bound, explicit, _ = rep["momentum"]
        for n in bound:
            assert torch.equal(bound[n][1], explicit[n][1]), n
    by = _by_coords(reps)
    for s in range(2):
        logs = [by[(j, s)]["momentum"][2]["log"] for j in range(2)]
        oracle = Oracle(2, method="gtopk", density=0.2, momentum_correction=0.9)
        for t in range(STEPS):
            want = oracle.step([{n: g.add(logs[j][t][2][n], alpha=WD) for n, g in logs[j][t][0].items()}
                                for j in range(2)])
            for n in want:
                assert torch.equal(logs[0][t][1][n], want[n]), (s, t, n)


def test_clipping_uses_each_replicas_norm_over_all_its_shards(reports):
    """DGC clipping of a replica's whole gradient (all its shards) to
    clip_norm/sqrt(R): the oracle without clipping on inputs scaled by the
    factor computed here from every shard's input."""
    import math

    R, S = 2, 2
    by = _by_coords(reports(R, S))
    thr = CLIP / math.sqrt(R)

    def scale(j, t):
        sq = sum(float(g.double().pow(2).sum()) for s in range(S) for g in by[(j, s)]["clip"]["log"][t][0].values())
        norm = math.sqrt(sq)
        assert norm > thr  # the test clips
        return thr / (norm + 1e-6 * thr)

    for s in range(S):
        logs = [by[(j, s)]["clip"]["log"] for j in range(R)]
        oracle = Oracle(R, **SPARSE["gtopk"])
        for t in range(STEPS):
            want = oracle.step([{n: g * scale(j, t) for n, g in logs[j][t][0].items()} for j in range(R)])
            for n in want:
                torch.testing.assert_close(logs[0][t][1][n], want[n], rtol=1e-5, atol=1e-7)


def test_compiled_model_trains_as_eager(reports):
    """torch.compile after fully_shard, or per block before it: the same
    parameters as eager, bit for bit, and one reduction per step; compiled
    autograd (under which FSDP2's hooks do not run) is refused on every rank."""
    for rep in reports(3, 2):
        eager = rep["sparse"]["gtopk"]["params"]
        for where in ("after", "before"):
            got = rep["compiled"][where]
            assert got["steps"] == STEPS
            for n in eager:
                assert torch.equal(got["params"][n][1], eager[n][1]), (where, n)
        assert "compiled autograd is on" in rep["compiled"]["compiled autograd"]


@pytest.mark.timeout(200)
def test_docs_example_runs_on_a_2x2_mesh(tmp_path):
    """docs/fsdp.md's opening script, as printed, on 4 torchrun workers
    (2 replicas of 2 shards): it trains, checkpoints, and sends fewer
    bytes than HSDP's dense all-reduce of the shard."""
    import os
    import subprocess
    import sys

    from test_docs_examples import ROOT, check_output, first_block

    script = tmp_path / "fsdp_example.py"
    script.write_text(first_block("fsdp.md"))
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1",
               TMPDIR=str(tmp_path))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
           "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", str(script)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    check_output("fsdp.md", p.returncode, p.stdout + p.stderr)
    assert (tmp_path / "fsdp_example" / ".metadata").exists()  # the DCP checkpoint
