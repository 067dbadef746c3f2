"""Tests of the lab (studies and probes, not the package).  The repository
root goes on sys.path for ``lab``, tests/support for the shared helpers
(process launchers, workers) and this folder for ``netns_marks``.  Every
test is marked ``lab`` and, as under tests/, ``unit``, ``distributed`` or
``horovod``."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for path in (HERE, os.path.join(ROOT, "tests", "support"), ROOT):
    if path not in sys.path:
        sys.path.insert(0, path)
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

_UNIT = {"test_cpu_account.py", "test_train_combine.py", "test_train_cycle.py", "test_train_rates.py",
         "test_train_report.py", "test_lab_cli.py", "test_results_page.py"}
_HOROVOD = {"test_horovod_benches.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = str(item.fspath)
        if os.path.dirname(path) != HERE:
            continue
        name = os.path.basename(path)
        kind = "unit" if name in _UNIT else "horovod" if name in _HOROVOD else "distributed"
        item.add_marker(pytest.mark.lab)
        item.add_marker(getattr(pytest.mark, kind))
