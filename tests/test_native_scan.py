"""The native directory scan (native/scan.c, ``_native.scan_dir``) and the walk's decoding of it.

One call lists a directory through its fd and ``fstatat``-s every name with
``AT_SYMLINK_NOFOLLOW``: each record must be the entry's own ``lstat``
(never a symlink's target), for names of any bytes and any length, in a
directory larger than the first buffer, and the same on a second call.
"""

from __future__ import annotations

import errno
import os
import stat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox_fs import _native
from sandbox_fs.snapshot._walk import _list_dir, _Listing, parse_scan


def _by_name(dfd: int) -> dict[bytes, tuple[int, ...]]:
    """name -> the fields a scan record carries, from os.lstat (relative to ``dfd``)."""
    out = {}
    for name in os.listdir(dfd):
        s = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        out[os.fsencode(name)] = (s.st_ino, s.st_dev, s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_nlink,
                                  s.st_mode)
    return out


def _scanned(dfd: int) -> dict[bytes, tuple[int, ...]]:
    return {os.fsencode(name): (s.st_ino, s.st_dev, s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_nlink, s.st_mode)
            for name, s in parse_scan(_native.scan_dir(dfd))}


@pytest.fixture
def dfd(tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    yield fd
    os.close(fd)


def test_every_byte_long_names_and_each_kind_are_their_own_lstat(tmp_path, dfd):
    top = os.fsencode(tmp_path)
    names = [bytes([b]) for b in range(1, 256) if b not in (ord("/"), ord("."))]
    names += [b"..x", b".hidden", b"\xff\xfe" * 127 + b"z", b"n" * 255, b"caf\xe9", "snow\u2603".encode()]
    for i, n in enumerate(names):
        with open(os.path.join(top, n), "wb") as f:
            f.write(b"x" * i)
    os.mkdir(os.path.join(top, b"sub"))
    os.symlink(b"/nonexistent/\xff", os.path.join(top, b"dangling"))
    os.symlink(b"sub", os.path.join(top, b"to-dir"))  # lstat: a symlink, never the directory it names
    os.mkfifo(os.path.join(top, b"fifo"))
    os.link(os.path.join(top, b"n" * 255), os.path.join(top, b"hard"))
    got = _scanned(dfd)
    assert got == _by_name(dfd)
    assert stat.S_ISLNK(got[b"to-dir"][6]) and stat.S_ISFIFO(got[b"fifo"][6]) and got[b"hard"][5] == 2
    assert b"." not in got and b".." not in got
    assert _scanned(dfd) == got  # a second scan of the same fd lists from the start again
    listing = _list_dir(dfd)
    assert isinstance(listing, _Listing)
    assert [n for n, _s in listing] == sorted(os.listdir(dfd))  # str order, as sorted(os.listdir) gives


def test_a_directory_larger_than_the_first_buffer_is_listed_whole(tmp_path, dfd):
    top = os.fsencode(tmp_path)
    for i in range(400):  # 400 records of 256 bytes: past the first 64 KiB buffer
        os.close(os.open(os.path.join(top, b"%03d" % i + b"\x80" * 197), os.O_CREAT | os.O_WRONLY, 0o600))
    raw = _native.scan_dir(dfd)
    assert len(raw) == 400 * 256
    assert _scanned(dfd) == _by_name(dfd)


def test_errors_are_the_errno(tmp_path):
    (tmp_path / "f").write_text("x")
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        with pytest.raises(OSError) as ei:
            _native.scan_dir(fd)
        assert ei.value.errno == errno.ENOTDIR
    finally:
        os.close(fd)
    with pytest.raises(OSError) as ei:
        _native.scan_dir(fd)  # closed
    assert ei.value.errno == errno.EBADF


_NAME = st.binary(min_size=1, max_size=255).filter(lambda b: b"/" not in b and b"\0" not in b
                                                   and b not in (b".", b".."))


@settings(max_examples=25, deadline=None)
@given(names=st.sets(_NAME, max_size=12))
def test_property_scan_lists_exactly_the_names_with_their_lstat(tmp_path_factory, names):
    top = os.fsencode(tmp_path_factory.mktemp("scan"))
    for i, n in enumerate(sorted(names)):
        if i % 3 == 2:
            os.symlink(n, os.path.join(top, n))
        elif i % 3 == 1:
            os.mkdir(os.path.join(top, n))
        else:
            with open(os.path.join(top, n), "wb") as f:
                f.write(n)
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        got = _scanned(fd)
        assert set(got) == names
        assert got == _by_name(fd)
    finally:
        os.close(fd)


def _records_bytes(names: list[bytes]) -> int:
    return sum(_native.SCAN_HEADER_BYTES + (len(n) + 7) // 8 * 8 for n in names)


def test_a_buffer_too_small_is_told_apart_from_an_errno_by_need(tmp_path, dfd):
    """-ENOBUFS with ``need`` set to the whole listing's bytes; a second call of that size lists it all."""
    names = [b"%03d" % i + b"n" * 40 for i in range(30)]
    for n in names:
        os.close(os.open(os.path.join(os.fsencode(tmp_path), n), os.O_CREAT | os.O_WRONLY, 0o600))
    whole = _records_bytes(names)
    ffi, lib = _native.ffi, _native.lib
    need = ffi.new("uint64_t *")
    small = ffi.new("char[]", 200)
    assert lib.sfs_scan_dir(dfd, small, 200, need) == -errno.ENOBUFS
    assert need[0] == whole > 200
    big = ffi.new("char[]", whole)
    assert lib.sfs_scan_dir(dfd, big, whole, need) == whole == need[0]
    # an errno is never "too small": need stays 0 (ENOTDIR: a file's fd)
    fd = os.open(os.path.join(os.fsencode(tmp_path), names[0]), os.O_RDONLY)
    try:
        assert lib.sfs_scan_dir(fd, big, whole, need) == -errno.ENOTDIR and need[0] == 0
    finally:
        os.close(fd)


@pytest.mark.parametrize("err", [errno.EOVERFLOW, errno.ENOBUFS])
def test_an_errno_from_the_scan_is_raised_as_it_is_never_retried(monkeypatch, dfd, err):
    """A real EOVERFLOW (or ENOBUFS) from a syscall (``need`` 0) is that errno, not a larger buffer."""
    calls = []

    class _Lib:
        @staticmethod
        def sfs_scan_dir(fd, buf, size, need):  # type: ignore[no-untyped-def]
            calls.append(size)
            need[0] = 0
            return -err

    monkeypatch.setattr(_native, "lib", _Lib)
    with pytest.raises(OSError) as ei:
        _native.scan_dir(dfd)
    assert ei.value.errno == err and len(calls) == 1


def test_the_listing_is_bounded(tmp_path, dfd, monkeypatch):
    """A listing past ``max_bytes`` is EFBIG, and the snapshot walk's limit error."""
    from sandbox_fs import open_root
    from sandbox_fs.snapshot import SnapshotLimitError, tree_digest

    names = [b"%04d" % i + b"x" * 100 for i in range(40)]
    for n in names:
        os.close(os.open(os.path.join(os.fsencode(tmp_path), n), os.O_CREAT | os.O_WRONLY, 0o600))
    whole = _records_bytes(names)
    assert len(_native.scan_dir(dfd, max_bytes=whole)) == whole
    with pytest.raises(OSError) as ei:
        _native.scan_dir(dfd, max_bytes=whole - 1)
    assert ei.value.errno == errno.EFBIG
    monkeypatch.setattr(_native, "SCAN_MAX_BYTES", whole - 1)
    with open_root(str(tmp_path)) as ws, pytest.raises(SnapshotLimitError) as li:
        tree_digest(ws)
    assert li.value.sandbox_path == "."
