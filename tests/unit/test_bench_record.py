"""gtopk_plugin/bench/bench_record.py: the one JSON writer of the benchmarks (compact,
floats to 6 significant digits, integers exact, the record's fields)."""
import json
import math

from gtopk_plugin.bench import bench_record as record
def test_write_json_is_one_line_with_the_record(tmp_path):
    path = tmp_path / "r.json"
    record.write_json(str(path), "demo-bench", {"steps": 3}, {"curve": [0.1234567891, 2.0, 12345678.9]},
                      packages=("torch", "no_such_module"))
    text = path.read_text()
    assert text.count("\n") == 1 and ": " not in text
    doc = json.loads(text)
    assert doc["benchmark"] == "demo-bench" and doc["settings"] == {"steps": 3}
    assert doc["results"]["curve"] == [0.123457, 2.0, 12345700.0]
    assert "torch" in doc["machine"] and "no_such_module" not in doc["machine"]
    assert not (tmp_path / "r.json.tmp").exists()


def test_integers_flags_and_integral_floats_are_exact():
    obj = {"bytes": 123456789, "mean_bytes": 123456789.0, "ok": True, "n": None, "s": "x",
           "t": (1.000000001, -3.14159265), "nan": float("nan"), "inf": float("inf")}
    out = record.compact(obj)
    assert out["bytes"] == 123456789 and out["mean_bytes"] == 123456789.0 and out["ok"] is True
    assert out["t"] == [1.0, -3.14159] and math.isnan(out["nan"]) and out["inf"] == math.inf
    # rounding moves a value by at most half a unit in the 6th digit
    for x in (1e-30 / 3, 2 / 3, 1e20 / 7):
        assert abs(record.compact(x) - x) <= 5e-6 * abs(x)


def test_a_document_keeps_its_layout(tmp_path):
    path = tmp_path / "d.json"
    record.write_json(str(path), "cluster comm", document={"meta": {"a": 1}, "rows": [{"t": 1 / 3}],
                                                           "machine": "kept"})
    doc = json.loads(path.read_text())
    assert doc["meta"] == {"a": 1} and doc["rows"] == [{"t": 0.333333}]
    assert doc["benchmark"] == "cluster comm" and doc["machine"] == "kept" and "when" in doc
    assert "settings" not in doc and "results" not in doc


def test_digits_none_keeps_floats_exact(tmp_path):
    path = tmp_path / "x.json"
    record.dump(str(path), {"v": 1 / 3}, digits=None)
    assert json.loads(path.read_text())["v"] == 1 / 3
