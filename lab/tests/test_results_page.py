"""docs/results.md is what ``python -m lab render-results`` renders from the
committed data in docs/results/, and stays a results page: short, every
figure beside its command, nothing in docs/results/ that the page does not
show."""
import json
import os
import re
import shutil

from lab import render_results as rr

PAGE = rr.PAGE


def test_the_committed_page_is_what_the_data_renders():
    with open(PAGE) as f:
        committed = f.read()
    assert committed == rr.render(rr.DATA), "docs/results.md is stale: run `python -m lab render-results`"
    assert rr.main(["--check"]) == 0


def test_the_page_follows_the_data(tmp_path):
    """A changed number in the data changes the page (and --check says so)."""
    data = tmp_path / "results"
    shutil.copytree(rr.DATA, data)
    doc = json.loads((data / "cluster_ddp.json").read_text())
    doc["tables"]["rows"][0]["median_ms"] = 123456.0
    (data / "cluster_ddp.json").write_text(json.dumps(doc))
    page = rr.render(str(data))
    assert "123,456" in page and page != rr.render(rr.DATA)
    out = tmp_path / "results.md"
    out.write_text(rr.render(rr.DATA))
    assert rr.main(["--check", "--data", str(data), "--out", str(out)]) == 1


def test_a_results_page_not_a_notebook():
    text = open(PAGE).read()
    lines = text.splitlines()
    assert len(lines) <= 340
    assert not re.search(r"(?i)session \d|issue #\d|DESIGN\.md", text)
    assert text.count("**Machine.**") == 1
    # every figure sits in a section that names the command regenerating it
    for section in text.split("\n## ")[1:]:
        assert "Regenerate: `" in section, section.splitlines()[0]
    # every file in docs/results/ is shown (or is the machine's record); all are small
    shown = set(re.findall(r"\]\(results/([\w.]+)\)", text))
    keys = {s["key"] for s in rr.SECTIONS}
    total = 0
    for name in os.listdir(rr.DATA):
        total += os.path.getsize(os.path.join(rr.DATA, name))
        stem, ext = os.path.splitext(name)
        assert (ext == ".png" and name in shown) or (ext == ".json" and stem in keys | {"machine"}), name
    assert total < 3 * 2**20


def test_collect_keeps_only_the_rows_the_page_shows(tmp_path):
    """--collect from a study's output writes the section's summary (not
    the raw curves) and leaves the other sections' data alone."""
    raw, data = tmp_path / "raw", tmp_path / "data"
    raw.mkdir()
    shutil.copytree(rr.DATA, data)
    before = (data / "step.json").read_text()
    rows = [{"P": P, "method": m, "density": d, "k": 10, "bytes_sent": b, "dense_bytes": 7000, "comm_ms": 1.5,
             "curve": list(range(1000))}
            for P in (4, 8) for m, d, b in (("dense", 0.01, 7000), ("gtopk", 0.01, 240))]
    (raw / "bytes_per_step.json").write_text(json.dumps({"args": {"numel": 1000}, "rows": rows}))
    done = rr.collect(str(raw), str(data))
    assert done == ["bytes_per_step"]
    doc = json.loads((data / "bytes_per_step.json").read_text())
    got = doc["tables"]["rows"]
    assert [(r["method"], r["bytes_sent"]) for r in got] == [("dense", 7000), ("gtopk", 240)]
    assert doc["meta"]["P"] == 8 and all("curve" not in r for r in got)
    assert (data / "step.json").read_text() == before
