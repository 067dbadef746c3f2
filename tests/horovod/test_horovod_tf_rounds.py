"""PowerSGD (a rounds codec: two allreduces per step, Vogels et al. 2019)
on the TensorFlow layer under real ``horovodrun -np 3 --gloo``
(tests/jobs/hvd_tf_rounds_job.py, a part of the P = 3 job that runs
test_horovod_tf.py's checks too), eagerly and inside ``tf.function``,
against the torch ``GradientReducer`` on the same gradients in the same job
(a torch.distributed gloo group): ranks 1, 2, 4, warm start on and off,
op sum and average, four steps (warm start and error feedback carried).

Bit for bit: both layers run the same codec object code (the generator of
compress/powersgd.py) on the same float32 accumulators, and each message is
summed by the same ``ProcessGroupGloo`` allreduce algorithm for the same
size and P, so the sums -- and everything after them -- have the same bits;
averaging divides by P on both sides.  Also: every rank gets the same
update; bytes as the PyTorch side counts them; without the side channel
(``exchange='horovod'``) a clear ``ValueError`` on every rank.

``dense_below=`` (frameworks/horovod_tf/tf_step.py) in the same
job against ``GradientReducer(dense_below=...)``: updates bit for bit (the
small part is summed by the same gloo allreduce), residuals of the large
tensors and none for the small ones, DGC velocities, and the bytes exactly
(the TF layer sends one consistency check where the reducer's dense part
sends a second, redundant one).  Checkpoint resume: a fresh
compression restored from ``tf.train.Checkpoint`` after two steps continues
bit for bit as the uninterrupted run -- PowerSGD's warm-start Q is in the
checkpoint (dropping it after the restore changes the updates), qsgd's
rounding is keyed by the restored step.
"""
import sys

import numpy as np
import pytest

from hvd_launch import JOBS, ok  # noqa: E402

sys.path.insert(0, JOBS)
import hvd_tf_shared as shared  # noqa: E402

try:
    import horovod.tensorflow  # noqa: F401
except Exception as e:  # noqa: BLE001
    pytest.skip(f"HOROVOD-TENSORFLOW TESTS SKIPPED: horovod.tensorflow cannot be imported "
                f"({type(e).__name__}: {e}); run `GTOPK_HOROVOD_TF=1 bash scripts/install_horovod.sh`",
                allow_module_level=True)

P = 3
RUNS = ["rank2_sum", "rank1_average_graph", "rank4_cold_graph"]
# the rounds part of the P = 3 Horovod-TF job, which runs test_horovod_tf.py's
# checks too (tests/jobs/hvd_tf_shared.py)
shared.want(P, "rounds")


def results():
    return shared.results(P, "rounds")


@pytest.mark.timeout(900)  # the first test runs the shared job
@pytest.mark.parametrize("name", RUNS)
def test_powersgd_equals_the_torch_reducer_bit_for_bit(name):
    runs = [ok(res, name) for res in results()]
    for r, run in enumerate(runs):
        for s, (got, want) in enumerate(zip(run["tf"], run["torch"])):
            for i, (a, b) in enumerate(zip(got, want)):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert a.tobytes() == b.tobytes(), (
                    f"rank {r} step {s} tensor {i}: TF differs from the torch reducer "
                    f"(max |diff| {np.abs(a.astype(np.float64) - b).max():.3g})")
            for a, b in zip(got, runs[0]["tf"][s]):
                assert a.tobytes() == b.tobytes(), f"rank {r} step {s}: ranks disagree"


@pytest.mark.timeout(900)  # the first test runs the shared job
@pytest.mark.parametrize("name", RUNS)
def test_powersgd_bytes_match_the_pytorch_side(name):
    for res in results():
        run = ok(res, name)
        t, ts = run["traffic"], run["torch_stats"]
        assert {"bytes_sent", "bytes_received"} <= set(ts), ts
        assert t["sent_entries"] == t["numel"] == sum(int(np.prod(s)) for s in [(24, 16), (16,), (16, 8), (8,)])
        for key in ("bytes_sent", "bytes_received", "rounds"):
            if key in ts:
                assert t[key] == ts[key], (key, t[key], ts[key])
        assert t["rounds"] == 2 * 2 * (P - 1)  # two allreduces, ring model


@pytest.mark.timeout(900)  # the first test runs the shared job
def test_powersgd_without_the_side_channel_raises_a_clear_error():
    for res in results():
        status, msg = res["horovod_exchange"]
        assert status == "ValueError" and "exchange='gloo'" in msg, (status, msg)


DENSE_BELOW = ["gtopk_dense_below", "topk_global_dense_below_graph", "mc_gtopk_dense_below_graph",
               "all_small_dense_below", "gtopk_int8_stochastic_dense_below_graph"]


@pytest.mark.timeout(900)  # the first test runs the shared job
@pytest.mark.parametrize("name", DENSE_BELOW)
def test_dense_below_equals_the_torch_reducer_bit_for_bit(name):
    runs = [ok(res, name) for res in results()]
    threshold = 1000 if name.startswith("all_small") else 20
    assert f"dense_below={threshold}" in runs[0]["repr"]
    small = [i for i, a in enumerate(runs[0]["raw"][0]) if a.size < threshold]
    assert small, "the case must have small tensors"
    for r, run in enumerate(runs):
        for s, (got, want) in enumerate(zip(run["tf"], run["torch"])):
            for i, (a, b) in enumerate(zip(got, want)):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert a.tobytes() == b.tobytes(), (
                    f"rank {r} step {s} tensor {i}: TF differs from the torch reducer "
                    f"(max |diff| {np.abs(a.astype(np.float64) - b).max():.3g})")
                assert a.tobytes() == runs[0]["tf"][s][i].tobytes(), f"rank {r} step {s}: ranks disagree"
        # residuals: the large tensors' as the reducer's, none for the small ones
        assert sorted(run["residuals"]) == [f"r{i:04d}" for i in range(len(run["raw"][0])) if i not in small]
        for key, a in run["residuals"].items():
            assert a.tobytes() == run["torch_residuals"]["t" + key[1:]].tobytes(), f"rank {r} residual {key}"
        for key, a in run["velocities"].items():  # DGC momentum: both parts
            assert a.tobytes() == run["torch_velocities"]["t" + key[1:]].tobytes(), f"rank {r} velocity {key}"
        if name.startswith("mc_"):
            assert len(run["velocities"]) == len(run["raw"][0])
        t, ts = run["traffic"], run["torch_stats"]
        for key in ("payload_bytes_sent", "payload_bytes_received", "header_bytes_sent",
                    "header_bytes_received", "messages_sent", "numel", "k", "rounds", "dense_bytes"):
            assert t[key] == ts[key], (key, t[key], ts[key])
        # (sent_entries: the TF layer counts the entries this rank put on the
        # wire, the reducer those that reached the result; both add the small part)
        assert t["sent_entries"] >= ts["sent_entries"] >= sum(run["raw"][0][i].size for i in small)
        # one check here; the reducer's dense part adds a second (redundant)
        # one; with DGC momentum the torch reducer also agrees that its
        # accumulator stayed finite (8 bytes: docs/design.md §6), a check the
        # TF layer does not make
        acc_check = 8 if name.startswith("mc_") else 0
        assert t["control_bytes"] == ts["control_bytes"] - run["torch_dense_control"] - acc_check == 32
    if name == "gtopk_dense_below":  # op sum: the small tensors' updates are the plain sums
        for s in range(len(runs[0]["tf"])):
            for i in small:
                want = sum(run["raw"][s][i].astype(np.float64) for run in runs)
                assert np.allclose(runs[0]["tf"][s][i], want, rtol=1e-6, atol=1e-6)


@pytest.mark.timeout(900)  # the first test runs the shared job
@pytest.mark.parametrize("name", ["powersgd_resume_graph", "qsgd_resume", "gtopk_int8_stochastic_resume"])
def test_checkpoint_resume_continues_bit_for_bit(name):
    for r, res in enumerate(results()):
        run = ok(res, name)
        assert run["restored"]["step"] == 2
        for s, (a_list, b_list) in enumerate(zip(run["first"], run["whole"][:2])):
            assert all(a.tobytes() == b.tobytes() for a, b in zip(a_list, b_list)), f"rank {r} step {s}"
        for s, (got, want) in enumerate(zip(run["restored"]["updates"], run["whole"][2:])):
            for i, (a, b) in enumerate(zip(got, want)):
                assert a.tobytes() == b.tobytes(), (
                    f"rank {r}: step {s + 2} tensor {i} after the restore differs from the uninterrupted run")
        if name.startswith("powersgd"):
            assert run["stateful"] and run["saved_state_keys"] == ["t0000", "t0002"], run["saved_state_keys"]
            dropped = run["state_dropped"]["updates"]
            assert any(a.tobytes() != b.tobytes() for got, want in zip(dropped, run["whole"][2:])
                       for a, b in zip(got, want)), "dropping the warm-start Q changed nothing: the test has no teeth"
        else:
            assert not run["stateful"]
