"""A workspace file another process holds a write lease on: persist's open is a retryable source change.

The confined command owns the workspace's files, so it may take a write
lease (``F_SETLEASE F_WRLCK``) on one.  Persist opens each file with
``O_NONBLOCK`` (never to block on a FIFO, nor for the lease-break time): the
open then fails with ``EAGAIN`` (and tells the holder to give the lease up).
That is the file in use by another process, like a file changing under the
walk: :class:`SnapshotSourceChangedError` (retryable, naming the file), not
a bare ``BlockingIOError``; once the lease is gone persist succeeds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandbox_fs import open_root
from sandbox_fs.snapshot import DirectorySnapshotStore, SnapshotSourceChangedError, persist

# the lease holder: a separate process (its own open file description), SIGIO ignored (a lease break sends it)
_HOLD = """
import fcntl, os, signal, sys
signal.signal(signal.SIGIO, signal.SIG_IGN)
fd = os.open(sys.argv[1], os.O_WRONLY if sys.argv[2] == "w" else os.O_RDONLY)
fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK if sys.argv[2] == "w" else fcntl.F_RDLCK)
print("held", flush=True)
sys.stdin.read()
"""


class _Lease:
    def __init__(self, path: Path, kind: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(path), kind], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        line = self.proc.stdout.readline() if self.proc.stdout else b""
        if line != b"held\n":
            err = self.proc.communicate()[1].decode(errors="replace").strip().splitlines()
            pytest.skip(f"this file system or process cannot take a file lease: {err[-1] if err else line!r}")

    def release(self) -> None:
        self.proc.communicate(b"")


def test_a_write_leased_file_is_a_retryable_source_change_then_persists(tmp_path, resolver):
    ws = tmp_path / "ws"
    (ws / "d").mkdir(parents=True)
    (ws / "d" / "f").write_bytes(b"data" * 100)
    (ws / "g").write_bytes(b"other")
    with DirectorySnapshotStore(tmp_path / "store") as store:
        lease = _Lease(ws / "d" / "f", "w")
        try:
            fds = len(os.listdir("/proc/self/fd"))
            with open_root(ws) as w, pytest.raises(SnapshotSourceChangedError) as ei:
                persist(w, store, "s")
            assert ei.value.retryable and ei.value.sandbox_path == "d/f"
            assert str(tmp_path) not in str(ei.value)
            assert len(os.listdir("/proc/self/fd")) == fds
            assert store.info("s") is None
        finally:
            lease.release()
        with open_root(ws) as w:
            assert persist(w, store, "s").info is not None


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 6), pick=st.integers(0, 5), kind=st.sampled_from(["w", "r"]), layered=st.booleans())
def test_any_leased_file_gives_success_or_a_retryable_change(tmp_path_factory, n, pick, kind, layered):
    """Property: whichever file holds a lease (write or read), in a full or a layered persist, persist
    succeeds (a read lease never conflicts with reading) or raises SnapshotSourceChangedError naming it."""
    base = tmp_path_factory.mktemp("lease")
    ws = base / "ws"
    ws.mkdir()
    for i in range(n):
        (ws / f"f{i}").write_bytes(b"x" * (i * 100))
    victim = f"f{pick % n}"
    with DirectorySnapshotStore(base / "store") as store:
        if layered:
            with open_root(ws) as w:
                persist(w, store, "s")
            (ws / victim).write_bytes(b"changed")  # read again by the layered walk
        lease = _Lease(ws / victim, kind)
        try:
            with open_root(ws) as w:
                try:
                    persist(w, store, "s")
                    assert kind == "r"
                except SnapshotSourceChangedError as exc:
                    assert kind == "w" and exc.retryable and exc.sandbox_path == victim
        finally:
            lease.release()
