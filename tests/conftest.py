import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def pytest_terminal_summary(terminalreporter):
    # The Horovod tests skip only when horovod cannot be imported; say so
    # loudly, since a silent skip would hide that they never ran.
    skipped = terminalreporter.stats.get("skipped", [])
    if any("test_horovod" in str(getattr(r, "nodeid", "")) or "HOROVOD TESTS SKIPPED" in str(r.longrepr)
           for r in skipped):
        terminalreporter.write_sep("!", "HOROVOD TESTS SKIPPED: horovod cannot be imported; "
                                        "run `bash scripts/install_horovod.sh` (make test does)",
                                   red=True, bold=True)
