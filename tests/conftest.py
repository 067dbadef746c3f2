"""Test layout (markers are added from the folder, so `pytest -m unit` etc. work):

- tests/unit/         single-process tests (kernels, reducer on a loopback
                      transport, settings, CLIs)             -> marker ``unit``
- tests/distributed/  real torch.distributed gloo process groups, the
                      emulated cluster, the demo and studies -> marker ``distributed``
- tests/horovod/      real ``horovodrun --gloo`` jobs (PyTorch and
                      TensorFlow)                            -> marker ``horovod``
- tests/jobs/         the scripts those horovodrun jobs run (not collected)
- tests/support/      shared helpers: process launchers, numpy oracles,
                      worker functions (importable as top-level modules)
"""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# support modules are imported by name (and by the spawned workers, which
# inherit sys.path); the repository root
for path in (os.path.join(HERE, "support"), ROOT):
    if path not in sys.path:
        sys.path.insert(0, path)
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

_KIND_BY_FOLDER = {"unit": "unit", "distributed": "distributed", "horovod": "horovod"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        folder = os.path.basename(os.path.dirname(str(item.fspath)))
        kind = _KIND_BY_FOLDER.get(folder)
        if kind is not None:
            item.add_marker(getattr(pytest.mark, kind))


def pytest_terminal_summary(terminalreporter):
    # The Horovod (and Horovod-TensorFlow) tests skip only when their
    # framework cannot be imported; say so loudly, since a silent skip would
    # hide that they never ran.  Matched on the skip reasons the modules give.
    reasons = [str(r.longrepr) for r in terminalreporter.stats.get("skipped", [])]
    for tag, hint in (("HOROVOD TESTS SKIPPED", "horovod cannot be imported; run `bash scripts/install_horovod.sh`"),
                      ("HOROVOD-TENSORFLOW TESTS SKIPPED", "tensorflow or horovod.tensorflow cannot be imported; "
                       "run `GTOPK_HOROVOD_TF=1 bash scripts/install_horovod.sh`")):
        if any(tag in r for r in reasons):
            terminalreporter.write_sep("!", f"{tag}: {hint} (make test does)", red=True, bold=True)
