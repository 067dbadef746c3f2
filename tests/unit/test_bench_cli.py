"""The ``gtopk-bench`` console script: installed, lists every benchmark and
dispatches to its command line."""
import shutil
import subprocess
import sys

import pytest

from benchmarks import cli


@pytest.mark.parametrize("name", sorted(cli.BENCHMARKS))
def test_every_listed_benchmark_dispatches_to_its_parser(name, capsys):
    if name == "elastic":  # lands with the elastic scheduler
        pytest.importorskip("benchmarks.elastic")
    with pytest.raises(SystemExit) as e:  # argparse exits 0 after --help
        cli.main([name.replace("_", "-"), "--help"])
    assert e.value.code == 0
    assert "usage" in capsys.readouterr().out.lower()


def test_unknown_name_is_a_clear_error(capsys):
    assert cli.main(["nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'nope'" in err and "cluster" in err
    assert cli.main([]) == 2 and cli.main(["--help"]) == 0


def test_console_script_is_installed():
    exe = shutil.which("gtopk-bench") or shutil.which("gtopk-bench", path=sys.prefix + "/bin")
    assert exe, "gtopk-bench is not on PATH: reinstall with `pip install --no-build-isolation -e .`"
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "convergence" in out.stdout
