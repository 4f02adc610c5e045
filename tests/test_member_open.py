"""The walk's one-call member open (``Root.open_member_fd`` / ``_walk.MemberOpener``): the same answers as
``Root.open_fd`` + ``os.fstat`` + the read-lease probe it replaces in persist's walk."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from sandbox_fs import _native, open_root
from sandbox_fs.errors import InvalidArgumentError, SandboxError
from sandbox_fs.snapshot import SnapshotSourceChangedError
from sandbox_fs.snapshot._entries import _open_for_writing
from sandbox_fs.snapshot._walk import _MEMBER_FLAGS, MemberOpener, _ListedEntry, _Stat

_FIELDS = ("st_mode", "st_ino", "st_dev", "st_nlink", "st_size", "st_mtime_ns", "st_ctime_ns")


def _listed(ws, path: str) -> _ListedEntry:
    st = os.lstat(ws / path)
    return _ListedEntry(path, "file", _Stat(*(getattr(st, f) for f in _FIELDS)), os.path.basename(path))


@pytest.mark.parametrize("mtime_ns", [0, 1_700_000_000_123_456_789, -1_500_000_001, (1 << 40) * 10**9 + 7,
                                      -(1 << 40) * 10**9 + 3])
def test_the_stat_is_the_fds_and_times_never_overflow(tmp_path, mtime_ns):
    """Every field is os.fstat's, a time past what int64 nanoseconds hold included (seconds and ns apart)."""
    (tmp_path / "d").mkdir()
    f = tmp_path / "d" / "f"
    f.write_bytes(b"x" * 1234)
    try:
        os.utime(f, ns=(0, mtime_ns))
    except (OverflowError, OSError):
        pytest.skip("this file system does not take that time")
    opener = MemberOpener()
    with open_root(tmp_path) as ws, ws.with_options(read_only=True, no_symlinks=True) as src:
        got = opener.open(src, _listed(tmp_path, "d/f"), None, False)
        assert got is not None
        fd, st, writable = got
        try:
            real = os.fstat(fd)
            assert tuple(st) == tuple(getattr(real, f) for f in _FIELDS)
            assert st.st_mtime == real.st_mtime and writable  # (no probe: taken as writable)
        finally:
            os.close(fd)


def test_the_probe_answers_as_open_for_writing_does(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"data")
    opener = MemberOpener()
    with open_root(tmp_path) as ws, ws.with_options(read_only=True, no_symlinks=True) as src:
        for held in (False, True):
            writer = os.open(f, os.O_WRONLY) if held else None
            try:
                got = opener.open(src, _listed(tmp_path, "f"), None, True)
                assert got is not None
                fd, _st, writable = got
                try:
                    assert writable == held == _open_for_writing(fd)
                finally:
                    os.close(fd)
            finally:
                if writer is not None:
                    os.close(writer)


def test_what_the_walk_must_not_read_is_refused_without_blocking(resolver, tmp_path):
    """A FIFO, a socket, a symlink (leaf or parent) or another inode than the listed one: retryable, never read."""
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "f").write_text("x")
    (tmp_path / "other").write_text("y")
    os.mkfifo(tmp_path / "fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    os.symlink("real/f", tmp_path / "leaf")
    os.symlink("real", tmp_path / "parent")
    opener = MemberOpener()
    with open_root(tmp_path) as ws, ws.with_options(read_only=True, no_symlinks=True) as src:
        fds = len(os.listdir("/proc/self/fd"))
        for path, listed_as in (("fifo", "fifo"), ("sock", "sock"), ("leaf", "real/f"), ("parent/f", "real/f"),
                                ("real/f", "other")):
            item = _listed(tmp_path, listed_as)._replace(path=path)
            with pytest.raises(SnapshotSourceChangedError):
                opener.open(src, item, None, True)
        assert opener.open(src, _listed(tmp_path, "real/f")._replace(path="gone"), None, True) is None
        assert len(os.listdir("/proc/self/fd")) == fds
        out = _native.member_out(bytearray(8 * _native.MEMBER_FIELDS))
        for flags in (os.O_PATH, os.O_WRONLY, os.O_RDWR | os.O_CREAT):
            with pytest.raises(InvalidArgumentError):
                src.open_member_fd("real/f", flags, False, out)
        with pytest.raises(SandboxError):
            src.open_member_fd("../x", _MEMBER_FLAGS, False, out)
    sock.close()


_BREAK_SCRIPT = """
import os, signal, sys, threading, time
from sandbox_fs import open_root
from sandbox_fs.snapshot._walk import MemberOpener, _ListedEntry, _Stat
d = sys.argv[1]
broke = []
signal.signal(signal.SIGURG, lambda *a: broke.append(1))  # SIGIO is left as it is: its default terminates
st = os.lstat(os.path.join(d, "f"))
item = _ListedEntry("f", "file", _Stat(st.st_mode, st.st_ino, st.st_dev, st.st_nlink, st.st_size,
                                       st.st_mtime_ns, st.st_ctime_ns), "f")
stop = time.monotonic() + 5
def writer():
    while time.monotonic() < stop and not broke:
        os.close(os.open(os.path.join(d, "f"), os.O_WRONLY))
threading.Thread(target=writer, daemon=True).start()
opener = MemberOpener()
with open_root(d) as ws:
    while time.monotonic() < stop and not broke:
        fd = opener.open(ws, item, None, True)[0]
        os.close(fd)
print("alive", len(broke))
"""


def test_a_writer_breaking_the_native_probes_lease_never_kills_the_process(tmp_path):
    """Writers open the file while the walk probes it in a loop until a break lands in a lease's window: the
    break's signal is SIGURG (counted here), never SIGIO (whose default action would kill the process)."""
    (tmp_path / "f").write_bytes(b"x")
    out = subprocess.run([sys.executable, "-c", _BREAK_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("alive"), (out.returncode, out.stderr)
    if out.stdout.split() == ["alive", "0"]:
        pytest.skip("no writer's open landed inside a probe's lease in 5 s")
