"""One ``horovodrun`` job per world size for the Horovod-TensorFlow test
modules (tests/horovod/test_horovod_tf*.py), imported by them from here.

Each module names at import the parts of tests/jobs/hvd_tf_jobs.py it
reads (:func:`want`); the first :func:`results` call at a world size runs
every part wanted at that size, not yet run, in ONE job: TensorFlow starts
once per rank, and AutoGraph converts the layer's code once per rank
(both cost many seconds), instead of once per module.  A part that failed
fails the tests that read it, with its traceback; the others go on.
"""
from __future__ import annotations

import os
import pickle
import tempfile
import time
from typing import Dict, List

from hvd_launch import JOBS, horovodrun

# seconds for a job: the first part, and each further one
TIMEOUT_FIRST, TIMEOUT_EACH = 400, 200
_WANTED: Dict[int, List[str]] = {}
_RESULTS: Dict[tuple, object] = {}


def want(np_: int, *parts: str) -> None:
    """Run ``parts`` in the job at world size ``np_`` (call at import)."""
    for p in parts:
        if p not in _WANTED.setdefault(np_, []):
            _WANTED[np_].append(p)


def results(np_: int, part: str) -> list:
    """Per rank, what ``part`` pickled (a failed part or job: AssertionError)."""
    if (np_, part) not in _RESULTS:
        want(np_, part)
        parts = [p for p in _WANTED[np_] if (np_, p) not in _RESULTS]
        t0 = time.time()
        with tempfile.TemporaryDirectory(prefix="gtopk-hvdtf-") as d:
            rc, out = horovodrun(np_, [os.path.join(JOBS, "hvd_tf_jobs.py"), d, ",".join(parts)],
                                 timeout=TIMEOUT_FIRST + TIMEOUT_EACH * (len(parts) - 1), gloo_timeout=90)
            for p in parts:
                _RESULTS[np_, p] = _load(d, np_, p, rc, out)
        print(f"horovodrun -np {np_} TensorFlow job ({','.join(parts)}): {time.time() - t0:.1f} s")
    res = _RESULTS[np_, part]
    if isinstance(res, str):
        raise AssertionError(res)
    return res


def _load(d: str, np_: int, part: str, rc: int, out: str):
    """The part's per-rank results, or the failure as a message."""
    path = os.path.join(d, part, "error.txt")  # written by any rank whose part raised
    if os.path.exists(path):
        with open(path) as f:
            return f"horovodrun -np {np_}: part {part!r} raised:\n{f.read()}"
    try:
        res = []
        for r in range(np_):
            with open(os.path.join(d, part, f"rank{r}.pkl"), "rb") as f:
                res.append(pickle.load(f))
    except OSError as e:
        return f"horovodrun -np {np_} (rc {rc}): part {part!r} left no results ({e}):\n{out[-6000:]}"
    if rc != 0:
        return f"horovodrun -np {np_} failed (rc {rc}) after part {part!r} finished:\n{out[-6000:]}"
    return res
