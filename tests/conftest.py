import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


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
