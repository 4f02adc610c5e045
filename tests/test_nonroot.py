"""Snapshots restored by a non-root owner: read-only and unreadable directories.

A workspace owner without root privileges must be able to restore a snapshot
holding directories it cannot write or read (``0o500``, ``0o555``, ``0o100``:
saved by root, or made by a process in the workspace), over a workspace that
already holds such directories, and a failed restore must leave neither the
workspace changed nor a staging directory behind.  Runs the restore as user
``nobody`` (65534) through ``setpriv``; skips where that is impossible.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile

import pytest

from sandbox_fs import open_root
from sandbox_fs.snapshot import LocalSnapshotStore, persist

_AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root to switch to user nobody"
    if shutil.which("setpriv") is None:
        return "needs setpriv(1) (util-linux)"
    probe = subprocess.run(_AS_NOBODY + [sys.executable, "-c", "import sandbox_fs"], capture_output=True,
                           cwd="/", timeout=60)
    if probe.returncode != 0:
        return "user nobody cannot import sandbox_fs from this checkout (a parent directory is private)"
    return None


_WHY = _why_not()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=str(_WHY))


def _modes(top: str) -> dict[str, int]:
    out = {}
    for dirpath, dirs, files in os.walk(top):
        for n in dirs + files:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, top)] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


def _restore_as_nobody(base: str) -> subprocess.CompletedProcess:
    code = (f"from sandbox_fs import open_root\n"
            f"from sandbox_fs.snapshot import LocalSnapshotStore, hydrate\n"
            f"with LocalSnapshotStore({base + '/store'!r}) as s, open_root({base + '/ws'!r}) as w:\n"
            f"    hydrate(w, s, 's1')\n")
    return subprocess.run(_AS_NOBODY + [sys.executable, "-c", code], capture_output=True, text=True, cwd="/",
                          timeout=120)


@pytest.fixture()
def base():
    b = tempfile.mkdtemp(prefix="sfs-nonroot-", dir="/tmp")
    os.chmod(b, 0o755)
    yield b
    for dirpath, dirs, _files in os.walk(b):
        for d in dirs:
            os.chmod(os.path.join(dirpath, d), 0o700)
    shutil.rmtree(b)


def test_non_root_owner_restores_unreadable_and_read_only_directories_twice(base):
    src = os.path.join(base, "src")
    os.makedirs(os.path.join(src, "locked"))
    with open(os.path.join(src, "locked", "f"), "w") as fh:
        fh.write("x")
    os.makedirs(os.path.join(src, "r555", "deep"))
    with open(os.path.join(src, "r555", "deep", "g"), "w") as fh:
        fh.write("y")
    os.chmod(os.path.join(src, "r555", "deep"), 0o500)
    os.chmod(os.path.join(src, "r555"), 0o555)
    os.chmod(os.path.join(src, "locked"), 0o100)  # its owner can enter it, not list it
    with LocalSnapshotStore(os.path.join(base, "store")) as store, open_root(src) as ws:
        persist(ws, store, "s1")  # as root: root can list it
    want = _modes(src)
    os.makedirs(os.path.join(base, "ws", "olddir"))
    with open(os.path.join(base, "ws", "old"), "w") as fh:
        fh.write("old")
    for dirpath, dirs, files in os.walk(base):
        for n in [dirpath] + [os.path.join(dirpath, x) for x in dirs + files]:
            os.lchown(n, 65534, 65534)
    for attempt in ("over the old contents", "again, over read-only and unreadable directories"):
        res = _restore_as_nobody(base)
        assert res.returncode == 0, (attempt, res.stderr[-1500:])
        assert _modes(os.path.join(base, "ws")) == want, attempt
        assert not [n for n in os.listdir(os.path.join(base, "ws")) if n.startswith(".sfs-")]


def test_non_root_failed_restore_leaves_the_workspace_and_no_staging(base):
    """A corrupt archive found only after extraction (CRC-32) with read-only directories staged:
    the staging tree is removed by its non-root owner, the workspace is unchanged."""
    src = os.path.join(base, "src")
    os.makedirs(os.path.join(src, "ro", "sub"))
    with open(os.path.join(src, "ro", "sub", "f"), "w") as fh:
        fh.write("data" * 100)
    os.chmod(os.path.join(src, "ro", "sub"), 0o500)
    os.chmod(os.path.join(src, "ro"), 0o500)
    with LocalSnapshotStore(os.path.join(base, "store")) as store, open_root(src) as ws:
        persist(ws, store, "s1")
    (archive,) = [n for n in os.listdir(os.path.join(base, "store")) if n.endswith(".tar")]
    path = os.path.join(base, "store", archive)
    with open(path, "r+b") as fh:  # flip one byte of file data: a valid tar, a wrong CRC-32
        data = fh.read()
        at = data.index(b"datadata")
        fh.seek(at)
        fh.write(b"X")
    os.makedirs(os.path.join(base, "ws"))
    with open(os.path.join(base, "ws", "keep"), "w") as fh:
        fh.write("keep")
    for dirpath, dirs, files in os.walk(base):
        for n in [dirpath] + [os.path.join(dirpath, x) for x in dirs + files]:
            os.lchown(n, 65534, 65534)
    res = _restore_as_nobody(base)
    assert res.returncode != 0 and "SnapshotCorruptError" in res.stderr
    assert sorted(os.listdir(os.path.join(base, "ws"))) == ["keep"]
