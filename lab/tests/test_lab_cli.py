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


def _lab_import_graph():
    import ast

    mods = {}
    for path in (ROOT / "lab").rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        if "tests" in rel.parts or "results" in rel.parts:
            continue
        name = ".".join(rel.parts)
        mods[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    edges = {m: set() for m in mods}
    for m, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):  # imports inside functions too
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    edges[m].add(full if full in mods else node.module)
            elif isinstance(node, ast.Import):
                edges[m].update(a.name for a in node.names)
    return {m: {t for t in e if t in mods and t != m} for m, e in edges.items()}


def test_the_lab_has_no_import_cycle_and_no_relative_import():
    edges = _lab_import_graph()
    assert len(edges) > 40
    state = {}

    def visit(m, path):
        state[m] = "open"
        for t in sorted(edges[m]):
            if state.get(t) == "open":
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(t):] + [t]))
            if t not in state:
                visit(t, path + [t])
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    relative = [str(p) for p in (ROOT / "lab").rglob("*.py")
                if any(line.lstrip().startswith("from .") for line in p.read_text().splitlines())]
    assert not relative, relative
