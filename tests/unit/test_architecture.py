"""Architecture invariants (docs/design.md §1), checked on the source tree
itself (an AST walk, independent of the code it checks):

- no module of gtopk_plugin/ over MAX_LINES lines;
- no import cycle among the package's modules, counting imports deferred
  into functions too (a deferred import hides a cycle, it does not remove
  it; a package's ``__init__`` re-exporting its children is not a cycle);
- file names unique under gtopk_plugin/ (``__init__``/``__main__`` aside);
- the lab (lab/: studies, emulator drivers, probes) is neither shipped nor
  imported by the package;
- only gtopk_plugin/frameworks/ imports an optional framework (horovod,
  tensorflow, byteps), at any depth, and the core never imports
  gtopk_plugin.frameworks (only the public shims at the top level do);
- only gtopk_plugin/config.py reads the environment (os.environ reads,
  os.getenv); writing a child's environment (launchers) is allowed;
- ``import gtopk_plugin`` pulls in none of the optional frameworks
  (a fresh interpreter).
"""
from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "gtopk_plugin"
MAX_LINES = 480  # a smell detector, not a target: split modules by responsibility
OPTIONAL = ("horovod", "tensorflow", "byteps", "keras")
# the public entry points users import (gtopk_plugin.horovod etc.): thin
# re-exports of frameworks/, which is their whole job
PUBLIC_SHIMS = {"gtopk_plugin", "gtopk_plugin.horovod", "gtopk_plugin.tensorflow", "gtopk_plugin.torch_ddp",
                "gtopk_plugin.torch_fsdp",
                "gtopk_plugin.byteps"}
# gtopk-bench measures the framework layers against the frameworks' own
# reductions: a consumer of the layers (like the demo), never imported by them
CONSUMERS = ("gtopk_plugin.bench",)


def _modules():
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _is_package(name):
    return MODULES.get(name, Path()).name == "__init__.py"


def _resolve(module, node):
    """Absolute module names an ImportFrom/Import statement in ``module`` names."""
    names = []
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base_pkg = module if _is_package(module) else module.rpartition(".")[0]
    if node.level:
        parts = base_pkg.split(".")
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    names.append(base)
    for a in node.names:
        cand = f"{base}.{a.name}"
        if cand in MODULES:
            names.append(cand)
    return names


def _imports(module, path, top_level_only):
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = []
    if top_level_only:
        # module-level statements, including those inside top-level try/if
        stack = list(tree.body)
        while stack:
            n = stack.pop()
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                nodes.append(n)
            elif isinstance(n, (ast.Try, ast.If)):
                stack.extend(n.body + n.orelse + getattr(n, "finalbody", []))
                for h in getattr(n, "handlers", []):
                    stack.extend(h.body)
    else:
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    out = set()
    for n in nodes:
        out.update(_resolve(module, n))
    return out


def _internal_edges(module, path, top_level_only=True):
    """Edges to package modules; importing a.b.c also runs a and a.b, except
    the importer's own ancestors (already being imported)."""
    ancestors = {module.rsplit(".", i)[0] for i in range(1, module.count(".") + 1)}
    edges = set()
    for name in _imports(module, path, top_level_only=top_level_only):
        if not name.startswith("gtopk_plugin"):
            continue
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            cand = ".".join(parts[:i])
            if cand in MODULES and cand not in ancestors and cand != module:
                edges.add(cand)
    return edges


def test_no_module_over_the_line_budget():
    long = {m: sum(1 for _ in p.open()) for m, p in MODULES.items()}
    over = {m: n for m, n in long.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines: {over}"


def _cycles(graph):
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    cycles = []

    def visit(m, stack):
        color[m] = GREY
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if color.get(n) == GREY:
                cycles.append(stack[stack.index(n):] + [n])
            elif color.get(n) == WHITE:
                visit(n, stack)
        stack.pop()
        color[m] = BLACK

    for m in sorted(graph):
        if color[m] == WHITE:
            visit(m, [])
    return cycles


def test_no_import_cycles():
    cycles = _cycles({m: _internal_edges(m, p) for m, p in MODULES.items()})
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_import_cycles_through_deferred_imports():
    """An import inside a function runs later, but the two modules still
    need each other: each must be readable without the other's internals."""
    graph = {m: _internal_edges(m, p, top_level_only=False) for m, p in MODULES.items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles (counting imports inside functions): " + "; ".join(
        " -> ".join(c) for c in cycles)


def test_file_names_are_unique_in_the_package():
    seen = {}
    for p in sorted(PKG.rglob("*.py")):
        if p.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(p.name, []).append(str(p.relative_to(ROOT)))
    dup = {k: v for k, v in seen.items() if len(v) > 1}
    assert not dup, f"file names used twice under gtopk_plugin/: {dup}"


LAB_NAMES = ("lab", "benchmarks")


def test_the_package_never_imports_the_lab():
    bad = [f"{m} imports {name}" for m, p in MODULES.items()
           for name in _imports(m, p, top_level_only=False) if name.split(".")[0] in LAB_NAMES]
    assert not bad, "\n".join(bad)


def test_the_wheel_ships_only_the_package(monkeypatch):
    """setup.py's package list, read by running it with setuptools.setup
    replaced: gtopk_plugin and its sub-packages (and the kernel sources),
    nothing of the lab."""
    import setuptools

    captured = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: captured.update(kw))
    monkeypatch.setenv("GTOPK_BUILD_EXT", "0")
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["setup.py", "--name"])
    code = compile((ROOT / "setup.py").read_text(), str(ROOT / "setup.py"), "exec")
    exec(code, {"__file__": str(ROOT / "setup.py"), "__name__": "__main__"})
    packages = captured["packages"]
    assert "gtopk_plugin" in packages and "gtopk_plugin.pipeline" in packages
    stray = [p for p in packages if p != "gtopk_plugin.csrc" and
             (p.split(".")[0] != "gtopk_plugin" or p.split(".")[1:2] in (["lab"], ["benchmarks"]))]
    assert not stray, f"setup.py ships lab or foreign packages: {stray}"
    dirs = set((captured.get("package_dir") or {}).values())
    assert not any(d.split("/")[0] in LAB_NAMES for d in dirs), captured.get("package_dir")


def test_nothing_imports_the_bench():
    bad = [f"{m} imports {name}" for m, p in MODULES.items() if not m.startswith(CONSUMERS)
           for name in _imports(m, p, top_level_only=False) if name.startswith(CONSUMERS)]
    assert not bad, "\n".join(bad)


def test_only_frameworks_import_a_framework():
    bad = []
    for m, p in MODULES.items():
        in_frameworks = m.startswith("gtopk_plugin.frameworks") or m.startswith(CONSUMERS)
        for name in _imports(m, p, top_level_only=False):
            top = name.split(".")[0]
            if top in OPTIONAL and not in_frameworks:
                bad.append(f"{m} imports {name}")
            if (name.startswith("gtopk_plugin.frameworks") and not in_frameworks
                    and m not in PUBLIC_SHIMS):
                bad.append(f"{m} imports {name} (upward: the core must not depend on a layer)")
    assert not bad, "\n".join(bad)


def _env_reads(tree):
    for n in ast.walk(tree):
        # os.environ[...] / os.environ.get(...) / os.getenv(...) / "X" in os.environ
        if isinstance(n, ast.Attribute) and n.attr in ("getenv", "environb"):
            yield n.lineno
        if isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Load) and _is_environ(n.value):
            yield n.lineno
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and _is_environ(n.func.value) \
                and n.func.attr in ("get", "copy", "items", "keys", "values"):
            yield n.lineno
        if isinstance(n, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in n.ops) \
                and any(_is_environ(c) for c in n.comparators):
            yield n.lineno


def _is_environ(n):
    return isinstance(n, ast.Attribute) and n.attr == "environ"


def test_only_config_reads_the_environment():
    bad = []
    for m, p in MODULES.items():
        if m == "gtopk_plugin.config":
            continue
        for line in _env_reads(ast.parse(p.read_text())):
            bad.append(f"{p.relative_to(ROOT)}:{line}")
    assert not bad, "environment read outside config.py: " + ", ".join(bad)


def test_the_checks_can_fail():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
    # the AST checks above see what they claim to see
    tree = ast.parse("import os\nx = os.environ.get('A')\ny = os.environ['B']\nz = 'C' in os.environ\n"
                     "w = os.getenv('D')\nos.environ['E'] = '1'\n")
    assert sorted(set(_env_reads(tree))) == [2, 3, 4, 5]
    # a deferred import is an edge when asked for, and only then
    tree_src = "def f():\n    import gtopk_plugin.config\n"
    fake = Path("/nonexistent")
    assert _resolve("gtopk_plugin.x", ast.parse(tree_src).body[0].body[0]) == ["gtopk_plugin.config"]
    assert fake not in MODULES.values()


def test_import_gtopk_plugin_pulls_no_optional_framework():
    code = ("import sys, gtopk_plugin, gtopk_plugin.compress, gtopk_plugin.reducer; "
            f"bad = [m for m in sys.modules if m.split('.')[0] in {OPTIONAL!r}]; "
            "print(bad); sys.exit(1 if bad else 0)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr


def test_test_modules_have_unique_basenames():
    """pytest imports test modules by basename (rootdir-relative, no
    packages): two tests/**/test_x.py abort the whole collection ("import
    file mismatch") -- on a clean checkout only, once the .pyc caches differ."""
    tests = Path(__file__).resolve().parents[1]
    seen = {}
    for f in sorted(tests.rglob("test_*.py")):
        seen.setdefault(f.name, []).append(str(f.relative_to(tests)))
    dup = {k: v for k, v in seen.items() if len(v) > 1}
    assert not dup, dup


def test_momentum_correction_has_one_spelling():
    """Every public constructor that turns DGC momentum correction on takes
    ``momentum_correction=`` (True: the optimizer's; a number: the momentum)
    and none takes ``momentum=``; rebinding is ``bind_optimizer``.  Checked
    on the source, so the Horovod/TF layers count without their frameworks."""
    import gtopk_plugin as gp
    from gtopk_plugin.frameworks.ddp.ddp_hook import SparseState
    ctors = {"GradientReducer": gp.GradientReducer.__init__, "HierarchicalReducer": gp.HierarchicalReducer.__init__,
             "SparseState": SparseState.__init__, "ElasticScheduler": gp.ElasticScheduler.__init__}
    for name, fn in ctors.items():
        params = inspect.signature(fn).parameters
        assert "momentum_correction" in params and "momentum" not in params, name
    for cls in (gp.GradientReducer, gp.HierarchicalReducer, SparseState):
        assert hasattr(cls, "bind_optimizer") and not hasattr(cls, "correct_momentum"), cls
    # the framework layers' constructors, read from their source
    for rel in ("frameworks/horovod/hvd_compression.py", "frameworks/horovod_tf/tf_compression.py",
                "frameworks/horovod_tf/tf_optimizer.py", "frameworks/fsdp/fsdp_replica.py"):
        tree = ast.parse((ROOT / "gtopk_plugin" / rel).read_text())
        args = {a.arg for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                for a in f.args.args + f.args.kwonlyargs}
        assert "momentum_correction" in args and "momentum" not in args, rel
        assert "correct_momentum" not in (ROOT / "gtopk_plugin" / rel).read_text(), rel
    # a number and True are the two forms; the old keyword is refused by name
    red = gp.GradientReducer("topk", 0.5, momentum_correction=0.9, transport=gp.SingleProcessTransport())
    assert red.config.momentum_correction == 0.9
    with pytest.raises(ValueError, match="momentum"):
        gp.GradientReducer("topk", 0.5, momentum=0.9, transport=gp.SingleProcessTransport())
