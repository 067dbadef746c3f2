"""Bad input and faults across real gloo ranks: every rank raises a clear
error, nothing hangs (pytest-timeout guards each test), state stays intact."""
import pytest
import torch

from dist_utils import run_workers
from workers import dies_mid_run, grads_for, layout_faults, nonfinite_skip


@pytest.mark.timeout(240)
def test_mismatches_and_bad_input_raise_on_every_rank():
    P = 3
    res = run_workers(P, layout_faults, timeout=200)
    for r in range(P):
        out = res[r]
        exc, msg = out["name"]
        assert exc == "LayoutMismatchError" and "'b'" in msg and "'b2'" in msg and "rank 1" in msg
        exc, msg = out["shape"]
        assert exc == "LayoutMismatchError" and "(4, 2)" in msg and "(2, 4)" in msg
        exc, msg = out["dtype"]
        assert exc == "LayoutMismatchError" and "float64" in msg
        exc, msg = out["bad_input"]
        if r == 1:
            assert exc == "ValueError" and "0-d" in msg
        else:
            assert exc == "PeerInputError" and "rank 1" in msg and "0-d" in msg
        exc, msg = out["nonfinite"]
        assert exc == "NonFiniteGradientError" and "rank 2" in msg and "b" in msg
        exc, msg = out["settings"]
        assert exc == "LayoutMismatchError"
        for case in ("name", "shape", "dtype", "bad_input", "nonfinite"):
            assert out[case + "_state_kept"], case
        # the reducer keeps working after the errors, identically on all ranks
        assert torch.equal(out["after"]["a"], res[0]["after"]["a"])


@pytest.mark.timeout(240)
def test_nonfinite_skip_is_consistent_and_conserves_mass():
    P, steps = 3, 12
    res = run_workers(P, nonfinite_skip, steps, timeout=200)
    skipped = res[0][1]
    assert skipped == [s % 4 == 1 for s in range(steps)]
    for r in range(P):
        assert res[r][1] == skipped
    total_grad = 0
    total_out = 0
    for s in range(steps):
        if skipped[s]:
            assert all(torch.count_nonzero(t) == 0 for t in res[0][0][s].values())
            continue  # the whole step is dropped on every rank
        for r in range(P):
            total_grad = total_grad + torch.cat([t.flatten() for _, t in sorted(grads_for(r, s).items())])
        total_out = total_out + torch.cat([t.flatten() for _, t in sorted(res[0][0][s].items())])
    total_res = sum(torch.cat([t for _, t in sorted(res[r][2]["residuals"].items())]) for r in range(P))
    torch.testing.assert_close(total_grad, total_out + total_res, atol=1e-4, rtol=1e-5)


@pytest.mark.timeout(180)
def test_killed_worker_makes_survivors_raise_within_timeout():
    P, victim, timeout = 3, 2, 5.0
    res = run_workers(P, dies_mid_run, victim, timeout, timeout=150, pg_timeout=10,
                      raise_errors=False)
    assert res[victim][0] == "error" and res[victim][1][0] == "Died"
    for r in range(P):
        if r == victim:
            continue
        status, (exc, msg, _) = res[r]
        assert status == "error" and exc == "RuntimeError", (exc, msg)
        assert "gtopk_plugin" in msg and "failed" in msg
