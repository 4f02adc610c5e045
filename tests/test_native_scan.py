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
from sandbox_fs.snapshot._walk import _list_dir, _Listing, _parse_scan


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
            for name, s in _parse_scan(_native.scan_dir(dfd))}


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
