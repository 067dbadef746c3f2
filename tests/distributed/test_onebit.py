"""The 1-bit codec (compress/onebit.py: 1-bit SGD / EF-signSGD) and a codec
registered from user code, on real gloo process groups, P = 1, 3, 4.

Checked against a numpy oracle of the encode and decode: every rank's
payload (sign bits packed 8 per byte, little-endian; one mean-|acc| scale
per segment) is what numpy computes from its accumulator; the result is,
bit for bit on every rank, the rank-order float32 sum of the numpy decodes
of all payloads; each residual is exactly acc − its own decode; mass is
conserved over the run (Σ_ranks Σ_steps grad = Σ_steps result(op=sum) +
Σ_ranks residual); the bytes are the allgather's (P−1)·payload each way.

The two-phase variant (``merge="reduce_scatter_payloads"``, P = 2, 3, 4:
uneven shards at 3) against a numpy oracle written from its spec: results
and every owner's server residual bit for bit, exact bytes of both phases,
mass conserved with the server residuals, bit-exact resume.
"""
import math

import numpy as np
import pytest
import torch

import gtopk_plugin as gp
from gtopk_plugin.compress import Codec, register
from gtopk_plugin.compress.compressor import SelectionContext
from dist_utils import run_workers

SHAPES = {"w": (37, 11), "b": (13,), "c": (5, 3, 2)}  # segments not multiples of 8
NUMEL = sum(math.prod(s) for s in SHAPES.values())
STEPS = 12
WORLD_SIZES = [1, 3, 4]


class HalfCodec(Codec):
    """User codec (registered from this test file, in the workers only, so
    the rest of the session does not see it): the accumulator as float16."""

    def encode(self, acc, offsets, ctx):
        return [acc.to(torch.float16)]

    def decode(self, payload, offsets, numel, dtype):
        return payload[0].to(dtype)


def _grads(rank, step, scale=1.0):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {n: torch.randn(*s, generator=g) * scale for n, s in SHAPES.items()}


def _flat(d):
    return torch.cat([d[n].reshape(-1) for n in sorted(d)])


def _worker(rank, P, method, granularity):
    if method == "half_user":
        register("half_user", HalfCodec)
    red = gp.GradientReducer(method=method, granularity=granularity, op="sum")
    names = sorted(SHAPES)
    sizes = [math.prod(SHAPES[n]) for n in names]
    offsets = torch.tensor([0] + list(np.cumsum(sizes)), dtype=torch.int64)
    if granularity == "global":
        offsets = torch.tensor([0, NUMEL], dtype=torch.int64)
    steps = []
    for t in range(STEPS):
        grads = _grads(rank, t)
        res = red.state_dict()["residuals"]
        before = torch.zeros(NUMEL) if not res else _flat(res)
        acc = _flat(grads) + before
        # the payload this rank's reducer sends (encode is deterministic)
        payload = red.compressor.encode(acc, offsets, SelectionContext(t, names, 0, rank))
        out = red.reduce(grads)
        steps.append(dict(grad=_flat(grads), acc=acc, payload=[p.clone() for p in payload],
                          out=_flat(out).clone(), res=_flat(red.state_dict()["residuals"]),
                          sent=red.last_stats.payload_bytes_sent, recv=red.last_stats.payload_bytes_received,
                          headers=red.last_stats.header_bytes_sent, dense=red.last_stats.dense_bytes))
    return dict(steps=steps, offsets=offsets)


def _np_encode(acc, offsets):
    a = acc.numpy()
    bits = np.packbits(a >= 0, bitorder="little")
    o = offsets.tolist()
    scales = np.array([np.abs(a[o[i]:o[i + 1]].astype(np.float64)).mean() for i in range(len(o) - 1)])
    return bits, scales


def _np_decode(bits, scales, offsets, n):
    signs = np.unpackbits(bits, bitorder="little")[:n].astype(np.float32) * 2 - 1
    o = offsets.tolist()
    out = np.empty(n, dtype=np.float32)
    for i in range(len(o) - 1):
        out[o[i]:o[i + 1]] = signs[o[i]:o[i + 1]] * np.float32(scales[i])
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("granularity", ["layer", "global"])
@pytest.mark.parametrize("P", WORLD_SIZES)
def test_onebit_matches_numpy_oracle_and_conserves_mass(P, granularity):
    results = run_workers(P, _worker, "onebit", granularity, timeout=280)
    offsets = results[0]["offsets"]
    nseg = offsets.numel() - 1
    payload_bytes = math.ceil(NUMEL / 8) + 4 * nseg
    total_grad = np.zeros(NUMEL)
    total_out = np.zeros(NUMEL)
    for t in range(STEPS):
        decodes = []
        for r in range(P):
            s = results[r]["steps"][t]
            bits, scales = _np_encode(s["acc"], offsets)
            wbits, wscales = (p.numpy() for p in s["payload"])
            assert np.array_equal(bits, wbits), f"rank {r} step {t}: sign bits differ from numpy"
            np.testing.assert_allclose(wscales, scales, rtol=2e-6, atol=0)
            d = _np_decode(wbits, wscales, offsets, NUMEL)
            decodes.append(d)
            # error feedback: the residual is acc less this rank's own decode, exactly
            assert np.array_equal(s["res"].numpy(), s["acc"].numpy() - d), f"rank {r} step {t}: residual"
            total_grad += s["grad"].numpy()
        expect = np.zeros(NUMEL, dtype=np.float32)
        for d in decodes:  # rank order, float32: the same bits on every rank
            expect = expect + d
        for r in range(P):
            s = results[r]["steps"][t]
            assert np.array_equal(s["out"].numpy(), expect), f"rank {r} step {t}: result differs"
            assert s["sent"] == s["recv"] == (P - 1) * payload_bytes and s["headers"] == 0
        total_out += expect
    residuals = sum(results[r]["steps"][-1]["res"].double().numpy() for r in range(P))
    np.testing.assert_allclose(total_grad, total_out + residuals, rtol=0, atol=2e-4)
    # against a float32 ring allreduce of the same gradients (2·(P−1)/P·4N):
    # the sign bits are 1/32 of the float32 bytes, times P/2 for the allgather
    assert results[0]["steps"][0]["dense"] == 2 * (P - 1) * NUMEL * 4 // P


@pytest.mark.timeout(300)
@pytest.mark.parametrize("P", [3])
def test_user_registered_codec_runs_in_gloo(P):
    results = run_workers(P, _worker, "half_user", "layer", timeout=280)
    for t in range(STEPS):
        expect = torch.zeros(NUMEL)
        for r in range(P):  # rank order
            expect = expect + results[r]["steps"][t]["acc"].half().float()
        for r in range(P):
            s = results[r]["steps"][t]
            assert torch.equal(s["out"], expect)
            assert torch.equal(s["res"], s["acc"] - s["acc"].half().float())
            assert s["sent"] == (P - 1) * NUMEL * 2


# ------------------------------------------- two-phase (reduce-scatter) variant
RS = "reduce_scatter_payloads"
RS_STEPS, RS_RESUME = 6, 3


def _rs_worker(rank, P):
    names = sorted(SHAPES)
    offsets = torch.tensor([0] + list(np.cumsum([math.prod(SHAPES[n]) for n in names])), dtype=torch.int64)

    def make():
        return gp.GradientReducer(method="onebit", merge=RS, op="sum")

    red, steps, saved = make(), [], None
    for t in range(RS_STEPS):
        if t == RS_RESUME:
            saved = red.state_dict()
        grads = _grads(rank, t)
        res = red.state_dict()["residuals"]
        acc = _flat(grads) + (_flat(res) if res else 0)
        payload = red.compressor.encode(acc, offsets, SelectionContext(t, names, 0, rank))
        out = red.reduce(grads)
        st = red.last_stats
        server = red.compressor.state_dict()["server"]
        steps.append(dict(grad=_flat(grads), acc=acc, payload=[p.clone() for p in payload], out=_flat(out).clone(),
                          res=_flat(red.state_dict()["residuals"]), server=list(server.values())[0].clone(),
                          sent=st.payload_bytes_sent, recv=st.payload_bytes_received,
                          headers=st.header_bytes_sent + st.header_bytes_received, agg=st.aggregation))
    again = make()  # resume from the step-RS_RESUME checkpoint: the same bits
    again.load_state_dict(saved)
    resumed = [_flat(again.reduce(_grads(rank, t))) for t in range(RS_RESUME, RS_STEPS)]
    return dict(steps=steps, offsets=offsets, resumed=resumed)


def _np_two_phase(decodes, offsets, server):
    """The two-phase scheme from its spec (numpy, float32): shard j = sign
    bytes [⌊j·B/P⌋, ⌊(j+1)·B/P⌋) of B = ⌈N/8⌉; its owner sums the P decodes
    in rank order, adds its server residual, re-compresses with one scale per
    (segment ∩ shard), ‖t‖₁/n summed in float64 and rounded to float32, and
    keeps t − that; everyone gets the re-compressed shards.  Also returns the
    per-shard message bytes (sign bytes + 4 per overlapped segment)."""
    P, N = len(decodes), decodes[0].size
    o = list(offsets)
    B = -(-N // 8)
    out, new_server, msg = np.empty(N, np.float32), [], []
    for j in range(P):
        lo, hi = 8 * (j * B // P), min(N, 8 * ((j + 1) * B // P))
        t = np.zeros(hi - lo, np.float32)
        for d in decodes:
            t = t + d[lo:hi]
        t = t + server[j]
        c = np.empty_like(t)
        segs = [s for s in range(len(o) - 1) if o[s] < hi and o[s + 1] > lo]
        for s in segs:
            a, b = max(o[s], lo) - lo, min(o[s + 1], hi) - lo
            scale = np.float32(np.abs(t[a:b].astype(np.float64)).sum() / (b - a))
            c[a:b] = np.where(t[a:b] >= 0, scale, -scale)
        out[lo:hi] = c
        new_server.append(t - c)
        msg.append(((j + 1) * B // P - j * B // P) + 4 * len(segs))
    return out, new_server, msg


@pytest.mark.timeout(240)
@pytest.mark.parametrize("P", [2, 3, 4])
def test_onebit_two_phase_matches_numpy_oracle_conserves_mass_and_resumes(P):
    from gtopk_plugin.pipeline import traffic

    results = run_workers(P, _rs_worker, timeout=220)
    offsets = results[0]["offsets"].tolist()
    server = [None] * P
    total_grad, total_out = np.zeros(NUMEL), np.zeros(NUMEL)
    for t in range(RS_STEPS):
        decodes = []
        for r in range(P):
            s = results[r]["steps"][t]
            bits, scales = _np_encode(s["acc"], results[r]["offsets"])
            wbits, wscales = (p.numpy() for p in s["payload"])
            assert np.array_equal(bits, wbits)
            np.testing.assert_allclose(wscales, scales, rtol=2e-6, atol=0)
            d = _np_decode(wbits, wscales, results[r]["offsets"], NUMEL)
            decodes.append(d)
            assert np.array_equal(s["res"].numpy(), s["acc"].numpy() - d), "worker residual: acc − own decode"
            total_grad += s["grad"].numpy()
        if server[0] is None:
            B = -(-NUMEL // 8)
            server = [np.zeros(min(NUMEL, 8 * ((j + 1) * B // P)) - 8 * (j * B // P), np.float32)
                      for j in range(P)]
        expect, server, msg = _np_two_phase(decodes, offsets, server)
        total = sum(msg)
        for r in range(P):
            s = results[r]["steps"][t]
            assert s["agg"] == RS
            assert np.array_equal(s["out"].numpy(), expect), f"rank {r} step {t}: result"
            assert np.array_equal(s["server"].numpy(), server[r]), f"rank {r} step {t}: server residual"
            # phase 1: every other shard once out, P−1 of its own in; phase 2: ring allgather
            want = ((total - msg[r]) + (total - msg[(r + 1) % P]), (P - 1) * msg[r] + total - msg[r])
            assert (s["sent"], s["recv"]) == want == traffic.onebit_reduce_scatter_bytes(offsets, P, r)
            assert s["headers"] == 0
        total_out += expect
    # fewer bytes than the allgather's (P−1)·payload each way from P = 3 on
    if P >= 3:
        assert results[0]["steps"][0]["sent"] < (P - 1) * traffic.onebit_payload_bytes(offsets)
    # mass conservation with the server residuals counted
    held = sum(results[r]["steps"][-1]["res"].double().numpy() for r in range(P))
    held = held + np.concatenate([results[r]["steps"][-1]["server"].double().numpy() for r in range(P)])
    np.testing.assert_allclose(total_grad, total_out + held, rtol=0, atol=2e-4)
    for r in range(P):  # resumed from the checkpoint: bit for bit
        for t, out in zip(range(RS_RESUME, RS_STEPS), results[r]["resumed"]):
            assert torch.equal(out, results[r]["steps"][t]["out"])


def _ddp_rs_worker(rank, P):
    """The DDP hook with the two-phase onebit: server residuals in the hook's
    state, a resumed hook takes the same next step."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    from gtopk_plugin.torch_ddp import SparseState, sparse_hook

    def build(state_dict=None):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.ReLU(), torch.nn.Linear(30, 5))
        ddp = DDP(m)
        st = SparseState(method="onebit", merge=RS, named_parameters=m.named_parameters())
        if state_dict is not None:
            st.load_state_dict(state_dict)
        ddp.register_comm_hook(st, sparse_hook)
        return m, ddp, st

    def step(ddp, t):
        ddp.zero_grad()
        x = torch.randn(8, 20, generator=torch.Generator().manual_seed(100 * rank + t))
        ddp(x).pow(2).sum().backward()
        return torch.cat([p.grad.reshape(-1) for p in ddp.module.parameters()])

    m, ddp, st = build()
    for t in range(3):
        step(ddp, t)
    sd = copy.deepcopy(st.state_dict())
    nxt = step(ddp, 3)
    _, ddp2, st2 = build(sd)
    return dict(server=len(sd["reducer"]["compressor"]["server"]), agg=st.reducer.last_stats.aggregation,
                nxt=nxt, resumed=step(ddp2, 3))


@pytest.mark.timeout(200)
def test_onebit_two_phase_through_the_ddp_hook():
    results = run_workers(3, _ddp_rs_worker, timeout=180)
    for r in results:
        assert r["agg"] == RS and r["server"] >= 1
        assert torch.equal(r["nxt"], results[0]["nxt"])  # every rank the same update
        assert torch.equal(r["resumed"], r["nxt"])  # resumed from the hook's state: bit for bit


# ------------------------------------------------- per-chunk scales (chunk=)
CHUNK = 16


def _chunk_run(P, merge):
    """P reducers on threads (collectives/threads.py: bit-exact to gloo),
    onebit with one scale per 16 entries; what each rank saw per step."""
    from gtopk_plugin.collectives.threads import ThreadGroup

    names = sorted(SHAPES)
    offsets = torch.tensor([0] + list(np.cumsum([math.prod(SHAPES[n]) for n in names])), dtype=torch.int64)
    with ThreadGroup(P) as group:
        reds = [gp.GradientReducer(transport=group.transports[r], method="onebit", chunk=CHUNK, merge=merge,
                                   op="sum") for r in range(P)]

        def one(r, t):
            red = reds[r]
            grads = _grads(r, t)
            res = red.state_dict()["residuals"]
            acc = _flat(grads) + (_flat(res) if res else 0)
            payload = red.compressor.encode(acc, offsets, SelectionContext(t, names, 0, r))
            out = red.reduce(grads)
            st = red.last_stats
            server = red.compressor.state_dict().get("server", {})
            return dict(grad=_flat(grads), acc=acc, payload=[p.clone() for p in payload], out=_flat(out).clone(),
                        res=_flat(red.state_dict()["residuals"]), sent=st.payload_bytes_sent,
                        recv=st.payload_bytes_received, agg=st.aggregation,
                        server=list(server.values())[0].clone() if server else None)

        return offsets, [group.map(lambda r: one(r, t)) for t in range(RS_STEPS)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("merge", ["allgather_payloads", RS])
def test_onebit_chunked_scales_match_numpy_oracle_agree_and_conserve_mass(merge):
    from gtopk_plugin.pipeline import traffic

    P = 3
    offsets, steps = _chunk_run(P, merge)
    o = offsets.tolist()
    # the chunk grid restarts at every segment: the oracles below take its
    # boundaries where they took the segments'
    bounds = torch.tensor(traffic.onebit_scales(o, CHUNK))
    assert bounds.numel() - 1 == sum(-(-(o[s + 1] - o[s]) // CHUNK) for s in range(len(o) - 1))
    whole = traffic.onebit_payload_bytes(o, CHUNK)
    assert whole == -(-NUMEL // 8) + 4 * (bounds.numel() - 1)
    server = [np.zeros(1, np.float32)] * P
    total_grad, total_out = np.zeros(NUMEL), np.zeros(NUMEL)
    for t, ranks in enumerate(steps):
        decodes = []
        for r, s in enumerate(ranks):
            bits, scales = _np_encode(s["acc"], bounds)
            wbits, wscales = (p.numpy() for p in s["payload"])
            assert np.array_equal(bits, wbits) and wscales.size == bounds.numel() - 1
            np.testing.assert_allclose(wscales, scales, rtol=2e-6, atol=0)
            decodes.append(_np_decode(wbits, wscales, bounds, NUMEL))
            assert np.array_equal(s["res"].numpy(), s["acc"].numpy() - decodes[-1]), "residual: acc − own decode"
            total_grad += s["grad"].numpy()
        if merge == RS:
            if t == 0:
                B = -(-NUMEL // 8)
                server = [np.zeros(min(NUMEL, 8 * ((j + 1) * B // P)) - 8 * (j * B // P), np.float32)
                          for j in range(P)]
            expect, server, _ = _np_two_phase(decodes, bounds.tolist(), server)
        else:
            expect = np.zeros(NUMEL, dtype=np.float32)
            for d in decodes:  # rank order
                expect = expect + d
        for r, s in enumerate(ranks):
            assert s["agg"] == merge
            assert np.array_equal(s["out"].numpy(), expect), f"rank {r} step {t}: result"
            want = traffic.onebit_reduce_scatter_bytes(o, P, r, CHUNK) if merge == RS else ((P - 1) * whole,) * 2
            assert (s["sent"], s["recv"]) == want
            if merge == RS:
                assert np.array_equal(s["server"].numpy(), server[r]), f"rank {r} step {t}: server residual"
        total_out += expect
    held = sum(steps[-1][r]["res"].double().numpy() for r in range(P))
    if merge == RS:
        held = held + np.concatenate([steps[-1][r]["server"].double().numpy() for r in range(P)])
    np.testing.assert_allclose(total_grad, total_out + held, rtol=0, atol=2e-4)
