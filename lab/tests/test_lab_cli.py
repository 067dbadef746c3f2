"""``python -m lab NAME``: every study and probe of the lab dispatches to
its command line; an unknown name is a clear error."""
import subprocess
import sys
from pathlib import Path

import pytest

from lab import __main__ as lab_cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(lab_cli.STUDIES))
def test_every_listed_study_dispatches_to_its_parser(name, capsys):
    with pytest.raises(SystemExit) as e:  # argparse exits 0 after --help
        lab_cli.main([name.replace("_", "-"), "--help"])
    assert e.value.code == 0
    assert "usage" in capsys.readouterr().out.lower()


def test_unknown_name_is_a_clear_error(capsys):
    assert lab_cli.main(["nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown study 'nope'" in err and "cluster" in err and "convergence" in err
    assert lab_cli.main([]) == 2 and lab_cli.main(["--help"]) == 0


def test_python_m_lab_lists_the_studies():
    out = subprocess.run([sys.executable, "-m", "lab", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "train-report" in out.stdout and "render-results" in out.stdout
