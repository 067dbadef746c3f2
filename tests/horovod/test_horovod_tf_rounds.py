"""PowerSGD (a rounds codec: two allreduces per step, Vogels et al. 2019;
issue #17) on the TensorFlow layer under real ``horovodrun -np 3 --gloo``
(tests/jobs/hvd_tf_rounds_job.py), eagerly and inside ``tf.function``,
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
"""
import os
import pickle

import numpy as np
import pytest

from hvd_launch import job_results, ok  # noqa: E402

try:
    import horovod.tensorflow  # noqa: F401
except Exception as e:  # noqa: BLE001
    pytest.skip(f"HOROVOD-TENSORFLOW TESTS SKIPPED: horovod.tensorflow cannot be imported "
                f"({type(e).__name__}: {e}); run `GTOPK_HOROVOD_TF=1 bash scripts/install_horovod.sh`",
                allow_module_level=True)

P = 3
RUNS = ["rank2_sum", "rank1_average_graph", "rank4_cold_graph"]
_RES = []


def _load_pickle(d, r):
    with open(os.path.join(d, f"rank{r}.pkl"), "rb") as f:
        return pickle.load(f)


def results():
    if not _RES:
        _RES.extend(job_results(P, "hvd_tf_rounds_job.py", _load_pickle, timeout=400, gloo_timeout=90))
    return _RES


@pytest.mark.timeout(500)
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


@pytest.mark.timeout(500)
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


@pytest.mark.timeout(500)
def test_powersgd_without_the_side_channel_raises_a_clear_error():
    for res in results():
        status, msg = res["horovod_exchange"]
        assert status == "ValueError" and "exchange='gloo'" in msg, (status, msg)
