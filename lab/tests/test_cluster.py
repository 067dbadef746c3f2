"""The emulated-cluster benchmark (lab/cluster): namespace
set-up and tear-down, model shape lists, the α-β fit, and a short smoke run
of the three measurements.  No test asserts on a timing."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from lab.cluster import cli, harness, model as abm, netns  # noqa: E402
from lab.cluster import shapes as S  # noqa: E402

from netns_marks import NETNS_OK, needs_netns  # noqa: E402


# ---------------------------------------------------------------------------
# shapes
# ---------------------------------------------------------------------------
def test_known_parameter_counts():
    assert S.numel("resnet50") == 25_557_032
    assert S.numel("vgg16") == 138_357_544
    for m, n in S.KNOWN_TOTALS.items():
        assert S.numel(m) == n, m
        names = [name for name, _ in S.shapes(m)]
        assert len(names) == len(set(names)), f"{m}: duplicate tensor names"


def test_shapes_match_torch_modules():
    """Independent construction with torch.nn on the meta device (no memory)."""
    nn = torch.nn
    with torch.device("meta"):
        lstm = nn.LSTM(1500, 1500, 2)
        layers, cin = [], 3
        for v in [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(cin, v, 3, padding=1), nn.ReLU()]
                cin = v
        vgg = nn.ModuleDict({"features": nn.Sequential(*layers), "classifier": nn.Sequential(
            nn.Linear(25088, 4096), nn.ReLU(), nn.Dropout(), nn.Linear(4096, 4096), nn.ReLU(), nn.Dropout(),
            nn.Linear(4096, 1000))})
    got = dict(S.lstm_ptb())
    for n, p in lstm.named_parameters():
        assert got[f"lstm.{n}"] == tuple(p.shape)
    assert [(n, tuple(p.shape)) for n, p in vgg.named_parameters()] == S.vgg16()


def test_paper_data_consistent():
    # the breakdown (gTop-k, P=32) reproduces the paper's gTop-k throughput at P=32
    for m, (comp, compr, comm) in S.PAPER_BREAKDOWN.items():
        thr = S.PAPER_BATCH[m] / (comp + compr + comm)
        assert thr == pytest.approx(S.PAPER_THROUGHPUT[m]["gtopk"][-1], rel=0.07), m
        # compression time is linear in the model size (6.0-6.3 ns per parameter)
        assert compr / S.numel(m) * 1e9 == pytest.approx(S.PAPER_SELECT_NS_PER_ELEMENT, rel=0.05), m


# ---------------------------------------------------------------------------
# α-β model
# ---------------------------------------------------------------------------
def test_traffic_formulas():
    assert abm.traffic("dense", 8, 1000, None)["bytes"] == 2 * 7 * 4000 // 8
    assert abm.traffic("topk", 8, 1000, 10)["bytes"] == 7 * 80
    assert abm.traffic("gtopk", 8, 1000, 10) == {"messages": 3, "bytes": 240, "work": 30, "work_load": 30.0,
                                                 "numel": 1000}
    # P workers sharing cores stretch the in-exchange work, not the traffic
    shared = abm.traffic("gtopk", 8, 1000, 10, load=abm.load_factor(8, 2))
    assert shared["work_load"] == 120.0 and shared["bytes"] == 240
    assert abm.load_factor(8, None) == 1.0 and abm.load_factor(2, 4) == 1.0
    assert abm.traffic("gtopk", 6, 1000, 10)["messages"] == 4  # 2 rounds + fold in/out
    assert abm.traffic("gtopk", 1, 1000, 10)["bytes"] == 0


@pytest.mark.parametrize("method,alpha,beta", [("dense", 2e-4, 8.5e-9), ("topk", 5e-4, 9e-9),
                                               ("gtopk", 1e-3, 2e-8)])
def test_alpha_beta_fit_recovers_known_parameters(method, alpha, beta):
    g = torch.Generator().manual_seed(0)
    pts = []
    for P in (2, 4, 8):
        for N in (10_000, 1_000_000, 25_000_000):
            for d in (0.001, 0.01):
                f = abm.traffic(method, P, N, math.ceil(d * N))
                noise = 1 + 0.02 * (2 * torch.rand(1, generator=g).item() - 1)
                pts.append(dict(f, time_s=(alpha * f["messages"] + beta * f["bytes"]) * noise))
    fit = abm.fit(pts, "torch", method, ("messages", "bytes"))
    assert fit.alpha == pytest.approx(alpha, rel=0.1)
    assert fit.beta == pytest.approx(beta, rel=0.05)
    assert max(abs(e) for e in fit.errors()) < 0.05
    # exact data: exact recovery
    exact = [dict(p, time_s=alpha * p["messages"] + beta * p["bytes"]) for p in pts]
    f2 = abm.fit(exact, "torch", method, ("messages", "bytes"))
    assert f2.alpha == pytest.approx(alpha, rel=1e-6) and f2.beta == pytest.approx(beta, rel=1e-6)


def test_nnls_keeps_coefficients_non_negative():
    # y depends on x0 only; x1 anti-correlated noise would want a negative coef
    X = [[1.0, 2.0], [2.0, 1.0], [3.0, 0.5]]
    y = [1.0, 2.0, 3.0]
    c = abm.nnls(X, y)
    assert all(v >= 0 for v in c)
    assert c[0] == pytest.approx(1.0, abs=0.05)


def test_parse_rate():
    assert harness.parse_rate("1gbit") == 1e9
    assert harness.parse_rate("100mbit") == 1e8
    assert harness.parse_rate("125mbps") == 1e9
    with pytest.raises(ValueError):
        harness.parse_rate("fast")


# ---------------------------------------------------------------------------
# namespaces
# ---------------------------------------------------------------------------
def _ours():
    return set(netns.list_namespaces())


@needs_netns
def test_netns_up_and_down_leaves_nothing_behind():
    before = _ours()
    net = netns.NetCluster(3, rate="100mbit", burst="64kb")
    with net:
        assert set(net.worker_ns + [net.bridge_ns]) <= _ours()
        for r in range(3):
            addr = subprocess.run(["ip", "-n", net.worker_ns[r], "-4", "-o", "addr", "show", "eth0"],
                                  capture_output=True, text=True).stdout
            assert f"{net.addr(r)}/24" in addr
            q = subprocess.run(["tc", "-n", net.worker_ns[r], "qdisc", "show", "dev", "eth0"],
                               capture_output=True, text=True).stdout
            assert "tbf" in q and "100Mbit" in q
            q = subprocess.run(["tc", "-n", net.bridge_ns, "qdisc", "show", "dev", f"p{r}"],
                               capture_output=True, text=True).stdout
            assert "tbf" in q and "100Mbit" in q  # incast side shaped too
            assert os.path.exists(f"/etc/netns/{net.worker_ns[r]}/hosts")
        # a process inside a worker namespace is ended by the tear-down
        p = subprocess.Popen(net.prefix(0) + ["sleep", "60"])
    assert p.wait(10) != 0
    assert _ours() == before
    for ns in net.worker_ns + [net.bridge_ns]:
        assert not os.path.exists(f"/etc/netns/{ns}")


@needs_netns
def test_netns_error_during_setup_removes_partial_state():
    before = _ours()
    with pytest.raises(netns.NetnsError):
        netns.NetCluster(2, rate="not-a-rate").up()
    assert _ours() == before


@needs_netns
def test_cleanup_removes_only_dead_runs():
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"{netns.PREFIX}-{dead.pid}-abcdef-w0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    os.makedirs(f"/etc/netns/{name}", exist_ok=True)
    try:
        with netns.NetCluster(1) as live:
            removed = netns.cleanup()
            assert name in removed
            assert set(live.worker_ns) <= _ours()  # a live run is left alone
        assert name not in _ours() and not os.path.exists(f"/etc/netns/{name}")
    finally:
        netns.delete_namespace(name)


# ---------------------------------------------------------------------------
# smoke run: the three measurements, tiny
# ---------------------------------------------------------------------------
def test_smoke_run(tmp_path, monkeypatch):
    """P=2, small N, a few steps: measurement 1 (torch, and when Horovod
    imports both of its exchange paths: ``horovod`` on the transport's gloo
    side channel, which across namespaces needs the workers' own host
    names, and ``horovod-ops``), a ResNet-20 replay, the α-β model and the
    summary.  Shaped when namespaces work, else on loopback labelled
    'unshaped'."""
    monkeypatch.setenv("GTOPK_KERNELS", "reference")  # the harness, not the kernels, is under test
    before = _ours() if NETNS_OK else set()
    comm_json, rep_json = str(tmp_path / "comm.json"), str(tmp_path / "replay.json")
    hvd_ok, _ = harness.horovod_status()
    engines = "torch,horovod,horovod-ops" if hvd_ok else "torch"
    assert cli.main(["comm", "--workers", "2", "--numel", "20000", "--density", "0.01", "--dtypes", "fp32,fp16",
                     "--steps", "2", "--warmup", "1", "--engines", engines, "--horovod-dtypes", "fp32",
                     "--link-mb", "2", "--quiet",
                     "--json", comm_json, "--timeout", "120"]) == 0
    comm = json.load(open(comm_json))
    shaped = comm["meta"]["network"]["shaped"]
    assert shaped == NETNS_OK
    assert {r["label"] for r in comm["rows"]} == {"shaped" if shaped else "unshaped"}
    # torch: fp32 and fp16; each Horovod engine: fp32 only (--horovod-dtypes)
    assert len(comm["rows"]) == 2 * 3 + (2 * 3 if hvd_ok else 0)
    hvd_rows = [r for r in comm["rows"] if r["engine"] != "torch"]
    assert {r["engine"] for r in hvd_rows} == ({"horovod", "horovod-ops"} if hvd_ok else set())
    assert {r["dtype"] for r in hvd_rows} <= {"fp32"}
    for r in hvd_rows:
        assert r["ops_per_step"] >= 1, r  # the transport's ops, counted on either path
        twin = [t for t in comm["rows"] if t["engine"] == "torch" and t["dtype"] == "fp32"
                and t["method"] == r["method"]]
        assert [t["bytes_sent"] for t in twin] == [r["bytes_sent"]]  # same bytes on every engine
    for r in comm["rows"]:
        eb, sb = (6, 2) if r["dtype"] == "fp16" else (8, 4)
        want = abm.traffic(r["method"], 2, 20000, r["k"], eb, sb)
        assert r["bytes_sent"] == want["bytes"], r  # real counters = the model's formulas
        assert len(r["times"]) == 2 and r["time_s"] > 0
    assert comm["link"] and comm["link"][0]["min_gbit_s"] > 0
    assert os.path.exists(os.path.splitext(comm_json)[0] + ".png")

    assert cli.main(["replay", "--workers", "2", "--models", "resnet20", "--selection", "none", "--steps", "1",
                     "--warmup", "0", "--quiet", "--json", rep_json, "--timeout", "120"]) == 0
    rep = json.load(open(rep_json))
    assert {r["method"] for r in rep["rows"]} == {"dense", "topk", "gtopk"}
    for r in rep["rows"]:
        assert r["time_s"] >= r["compute_s"] and 0 < r["efficiency"] <= 1

    assert cli.main(["model", "--comm", comm_json, "--replay", rep_json, "--json", str(tmp_path / "m.json"),
                     "--summary", str(tmp_path / "s.md")]) == 0
    m = json.load(open(tmp_path / "m.json"))
    assert {f["method"] for f in m["fits"]} == {"dense", "topk", "gtopk"}
    assert len(m["replay_check"]) == 3 and m["extrapolation"]
    assert "α-β" in open(tmp_path / "s.md").read()
    if NETNS_OK:
        assert _ours() == before  # every namespace removed


# ---------------------------------------------------------------------------
# codec rows and nodes
# ---------------------------------------------------------------------------
def test_codec_rows_bytes(tmp_path, monkeypatch):
    """onebit, qsgd and powersgd rows beside dense in one job (P = 2, tiny
    N), each with the bytes its packing and aggregation imply."""
    from gtopk_plugin.bench.bytes_per_step import layer_shapes
    from lab.cluster import codecs

    monkeypatch.setenv("GTOPK_KERNELS", "reference")
    out = str(tmp_path / "c.json")
    assert cli.main(["comm", "--workers", "2", "--numel", "20000", "--dtypes", "fp32", "--methods",
                     "dense,onebit,qsgd,powersgd", "--steps", "2", "--warmup", "1", "--engines", "torch",
                     "--link-mb", "0", "--quiet", "--json", out, "--timeout", "120"]) == 0
    res = json.load(open(out))
    rows = {r["method"]: r for r in res["rows"]}
    assert set(rows) == {"dense", "onebit", "qsgd", "powersgd"}
    assert all(r["density"] is None and len(r["times"]) == 2 for r in rows.values())
    sizes = [math.prod(s) for s in layer_shapes(20000).values()]
    assert rows["onebit"]["bytes_sent"] == sum(math.ceil(n / 8) for n in [20000]) + 4 * len(sizes)
    assert rows["powersgd"]["hyper"]["rank"] == 4
    # one near-square matrix (100 x 100) at rank 4: P (+ the dense vectors) then Q, ring model at P = 2
    mats = [codecs.matrix_shape(n) for n in sizes]
    p_msg = sum(a * 4 if len(s) == 2 else n for n, s in zip(sizes, mats) for a in [s[0]])
    q_msg = sum(s[1] * 4 for s in mats if len(s) == 2)
    assert rows["powersgd"]["bytes_sent"] == 4 * (p_msg + q_msg)
    assert 0 < rows["qsgd"]["bytes_sent"] < rows["dense"]["bytes_sent"]
    assert codecs.families_table(res)  # the side-by-side table renders


@needs_netns
def test_node_cluster_shapes_only_the_uplinks():
    from lab.cluster.nodes import NodeCluster

    before = _ours()
    with NodeCluster(2, 2, rate="100mbit", burst="64kb") as net:
        b = net.bridge_ns

        def qdisc(ns, dev):
            return subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True,
                                  text=True).stdout
        for j in range(2):
            assert "tbf" in qdisc(b, f"u{j}") and "100Mbit" in qdisc(b, f"c{j}")
        for r in range(4):
            assert "tbf" not in qdisc(b, f"p{r}") and "tbf" not in qdisc(net.worker_ns[r], "eth0")
            master = subprocess.run(["ip", "-n", b, "-o", "link", "show", f"p{r}"], capture_output=True,
                                    text=True).stdout
            assert f"master n{net.node_of(r)} " in master
        assert net.describe()["node_of_rank"] == [0, 0, 1, 1]
    assert _ours() == before


def test_nodes_smoke(tmp_path, monkeypatch):
    """``comm --nodes 2 --local 2`` (tiny N, one step): the flat rows and,
    once gtopk_plugin.two_level.hierarchical_reducer exists, the hierarchical ones; per node,
    the bytes its workers sent split into intra + inter and add up to the
    reducers' accounting; gTop-k's inter-node bytes are the expected
    formulas.  Shaped namespaces where possible, else loopback."""
    from lab.cluster import hier

    monkeypatch.setenv("GTOPK_KERNELS", "reference")
    before = _ours() if NETNS_OK else set()
    out = str(tmp_path / "n.json")
    assert cli.main(["comm", "--nodes", "2", "--local", "2", "--numel", "20000", "--density", "0.01",
                     "--methods", "gtopk,topk", "--steps", "1", "--warmup", "0", "--quiet", "--json", out,
                     "--timeout", "120"]) == 0
    res = json.load(open(out))
    assert res["meta"]["network"]["shaped"] == NETNS_OK
    layouts = {"flat", "hier", "hier-gloo"} if hier.hier_available()[0] else {"flat"}
    assert {(r["method"], r["layout"]) for r in res["rows"]} == {(m, lay) for m in ("gtopk", "topk")
                                                                  for lay in layouts}
    for r in res["rows"]:
        tally = [a + b for a, b in zip(r["peer_intra_sent_per_node"], r["peer_inter_sent_per_node"])]
        if r["layout"] == "flat":  # every byte a worker's accounting counts went to some node
            acc = [sum(st["bytes_sent"] for q, st in enumerate(r["per_rank_stats"]) if q // 2 == j)
                   for j in range(2)]
        elif r["layout"] == "hier":  # the node's dense data through shared memory: none on a network
            assert r["peer_intra_sent_per_node"] == [0, 0]
            assert all(st["fabric"] == "shared_memory" for st in r["per_rank_stats"])
            assert min(r["stats_intra_sent_per_node"]) >= 20000 * 4  # (L - 1)·N·4 at least, in memory
            acc = tally = r["stats_inter_sent_per_node"]
        else:  # the reducer's own split, level by level
            acc = [a + b for a, b in zip(r["stats_intra_sent_per_node"], r["stats_inter_sent_per_node"])]
        if r["layout"] != "flat":
            assert r["stats_inter_sent_per_node"] == r["peer_inter_sent_per_node"]
        assert tally == acc, r["layout"]
        if r["method"] == "gtopk":
            assert r["peer_inter_sent_per_node"] == [hier.expected_inter_per_node(r)] * 2
        assert len(r["exchange_times"]) == 1
    # the node sum's floor, measured in the same job, and its line in the goals
    assert [(j["nodes"], j["local"]) for j in res["jobs"]] == [(2, 2)]
    assert res["jobs"][0]["node_sum_floor_s"] > 0
    if hier.hier_available()[0]:
        assert any("node sum's floor" in line for line in hier.goals(res))
    if NETNS_OK:
        assert _ours() == before
