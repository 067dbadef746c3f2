"""Files a killed leader leaves in the shared-memory directory (the two-level
reduction's fabric, gtopk_plugin/two_level/shared_memory.py): a later set-up removes
exactly those whose creator is gone and that are older than any set-up,
and nothing else.  Oracle: the directory listing, built by hand."""
import os
import subprocess
import sys
import time

import torch

from gtopk_plugin.two_level import shared_memory as shm
from gtopk_plugin.collectives.transport import SingleProcessTransport


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _file(d, name, age_s):
    path = os.path.join(d, name)
    with open(path, "wb") as f:
        f.write(b"x" * 4096)
    t = time.time() - age_s
    os.utime(path, (t, t))
    return name


def _fixture(d):
    dead, old = _dead_pid(), shm.STALE_AGE_S + 60
    return {
        "stale": _file(d, f"gtopk-node-{dead}-abc123", old),
        "fresh_dead": _file(d, f"gtopk-node-{dead}-def456", 5),      # a set-up in progress elsewhere
        "old_alive": _file(d, f"gtopk-node-{os.getpid()}-ghi789", old),  # its creator still runs
        "no_pid": _file(d, "gtopk-node-q1w2e3", old),                # an older version's name
        "other": _file(d, f"something-{dead}-else", old),
    }


def test_sweep_removes_only_files_of_gone_creators_past_the_age(tmp_path):
    d = str(tmp_path)
    f = _fixture(d)
    removed = shm.sweep_stale(d)
    assert removed == [os.path.join(d, f["stale"])]
    assert sorted(os.listdir(d)) == sorted(v for k, v in f.items() if k != "stale")
    assert shm.sweep_stale(d) == []  # nothing more to do
    assert shm.sweep_stale(str(tmp_path / "missing")) == []  # never raises


def test_a_set_up_sweeps_and_names_its_file_after_its_pid(tmp_path, monkeypatch):
    d = str(tmp_path)
    monkeypatch.setenv("GTOPK_SHM_DIR", d)
    f = _fixture(d)
    created = []
    real_mkstemp = shm.tempfile.mkstemp

    def spy(*a, **kw):
        fd, path = real_mkstemp(*a, **kw)
        created.append(os.path.basename(path))
        return fd, path

    monkeypatch.setattr(shm.tempfile, "mkstemp", spy)
    node = shm.SharedMemoryNode(SingleProcessTransport())
    assert node.ensure(4096)
    slot = node.slot(1024, torch.float32)
    slot.fill_(2.0)
    assert float(slot.sum()) == 2048.0
    # the set-up removed the stale file, and its own file (unlinked once
    # mapped) was named after this process
    assert f["stale"] not in os.listdir(d)
    assert len(created) == 1 and created[0].startswith(f"gtopk-node-{os.getpid()}-")
    assert sorted(os.listdir(d)) == sorted(v for k, v in f.items() if k != "stale")
    node.close()
