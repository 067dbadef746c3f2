"""The ``gtopk-bench`` console script: installed, lists every benchmark and
dispatches to its command line; the package's benchmarks and the product's
tests never import the lab."""
import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gtopk_plugin.bench import bench_cli as cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(cli.BENCHMARKS))
def test_every_listed_benchmark_dispatches_to_its_parser(name, capsys):
    with pytest.raises(SystemExit) as e:  # argparse exits 0 after --help
        cli.main([name.replace("_", "-"), "--help"])
    assert e.value.code == 0
    assert "usage" in capsys.readouterr().out.lower()


def test_unknown_name_is_a_clear_error(capsys):
    assert cli.main(["nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'nope'" in err and "bytes-per-step" in err
    assert cli.main([]) == 2 and cli.main(["--help"]) == 0


def test_console_script_is_installed():
    exe = shutil.which("gtopk-bench") or shutil.which("gtopk-bench", path=sys.prefix + "/bin")
    assert exe, "gtopk-bench is not on PATH: reinstall with `pip install --no-build-isolation -e .`"
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "selection" in out.stdout and "ddp-step" in out.stdout


def _imported_roots(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module.split(".")[0]


def test_no_product_test_or_benchmark_imports_the_lab():
    """tests/ (the package's tests and their helpers) and gtopk_plugin/bench
    import neither ``lab`` nor the old ``benchmarks`` folder, at any level."""
    files = sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "gtopk_plugin" / "bench").glob("*.py"))
    bad = [f"{p.relative_to(ROOT)} imports {name}" for p in files for name in _imported_roots(p)
           if name in ("lab", "benchmarks")]
    assert len(files) > 50 and not bad, "\n".join(bad)
