"""The native copy loop (native/copy.c) through each way it copies.

``sfs_copy`` (``_native.copy_fd``) and the batched extract share one loop:
copy_file_range, then sendfile, then read/write when the kernel refuses the
way before.  A file on the same filesystem takes the first, a file on another
filesystem (``/dev/shm`` next to ``tmp_path``) the second, a pipe or a socket
the third; each must copy the same bytes with the same bound.
"""

from __future__ import annotations

import errno
import os
import socket
import tempfile
from array import array

import pytest

from sandbox_fs import _native

DATA = bytes(range(256)) * 800  # 204,800 bytes: more than one read/write step


def _other_fs_dir(tmp_path):
    """A scratch directory on another filesystem than ``tmp_path``, or skip."""
    shm = "/dev/shm"
    if not os.path.isdir(shm) or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no /dev/shm on another filesystem than tmp_path")
    return tempfile.mkdtemp(dir=shm, prefix="sfs-native-copy-")


@pytest.fixture
def other_fs(tmp_path):
    top = _other_fs_dir(tmp_path)
    yield top
    for name in os.listdir(top):
        os.unlink(os.path.join(top, name))
    os.rmdir(top)


def _source_fd(kind, data, tmp_path, other_fs_dir):
    """An fd reading ``data`` from a source of ``kind``; the caller closes it."""
    if kind in ("same-fs", "other-fs"):
        path = os.path.join(tmp_path if kind == "same-fs" else other_fs_dir, "src")
        with open(path, "wb") as f:
            f.write(data)
        return os.open(path, os.O_RDONLY)
    if kind == "pipe":
        r, w = os.pipe()
        os.write(w, data)
        os.close(w)
        return r
    a, b = socket.socketpair()
    a.sendall(data)
    a.close()
    fd = b.detach()
    return fd


@pytest.mark.parametrize("kind", ["same-fs", "other-fs", "pipe", "socket"])
@pytest.mark.parametrize("size", [0, 1, 60_000])
def test_copy_fd_copies_every_byte_from_each_kind_of_source(tmp_path, other_fs, kind, size):
    data = DATA[:size]
    src = _source_fd(kind, data, tmp_path, other_fs)
    out = tmp_path / "out"
    dst = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        assert _native.copy_fd(src, dst, 1 << 40, "write", "out") == size
    finally:
        os.close(src)
        os.close(dst)
    assert out.read_bytes() == data


@pytest.mark.parametrize("kind", ["same-fs", "other-fs", "pipe"])
def test_copy_fd_bound(tmp_path, other_fs, kind):
    for bound, want in ((len(DATA[:50_000]), 50_000), (49_999, None)):
        src = _source_fd(kind, DATA[:50_000], tmp_path, other_fs)
        out = tmp_path / f"out{bound}"
        dst = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if want is None:
                with pytest.raises(OSError) as ei:
                    _native.copy_fd(src, dst, bound, "write", "out")
                assert ei.value.errno == errno.EFBIG
            else:
                assert _native.copy_fd(src, dst, bound, "write", "out") == want
        finally:
            os.close(src)
            os.close(dst)
        assert out.read_bytes() == DATA[:min(bound, 50_000)]  # nothing past the bound is written


@pytest.mark.parametrize("kind", ["same-fs", "other-fs"])
def test_copy_fd_starts_at_the_source_position_and_advances_it(tmp_path, other_fs, kind):
    src = _source_fd(kind, DATA, tmp_path, other_fs)
    out = tmp_path / "out"
    dst = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.lseek(src, 1000, os.SEEK_SET)
        assert _native.copy_fd(src, dst, 1 << 40, "write", "out") == len(DATA) - 1000
        assert os.lseek(src, 0, os.SEEK_CUR) == len(DATA)
    finally:
        os.close(src)
        os.close(dst)
    assert out.read_bytes() == DATA[1000:]


@pytest.mark.parametrize("resolver_name", ["openat2", "fallback"])
@pytest.mark.parametrize("kind", ["same-fs", "other-fs"])
def test_extract_files_copies_at_explicit_offsets_from_either_filesystem(tmp_path, other_fs, resolver_name,
                                                                          kind):
    if resolver_name == "openat2" and not _native.have_openat2():
        pytest.skip("kernel has no openat2")
    src = _source_fd(kind, DATA, tmp_path, other_fs)
    stage = tmp_path / "stage"
    stage.mkdir()
    dfd = os.open(stage, os.O_PATH | os.O_DIRECTORY)
    entries = [(0, 70_000), (70_000, 0), (512, 100_000), (len(DATA) - 10, 10), (len(DATA) - 10, 11)]
    nums = array("q")
    for off, size in entries:
        nums.extend([off, size, -1, 0o644, 0, 0])
    try:
        os.lseek(src, 7, os.SEEK_SET)
        done, err, stage_no = _native.extract_files(src, dfd, resolver_name, nums,
                                                    bytearray(b"a\0b\0c\0d\0short\0"), len(entries))
        assert os.lseek(src, 0, os.SEEK_CUR) == 7  # the source's position is the caller's
    finally:
        os.close(src)
        os.close(dfd)
    # The last entry asks for a byte past the source's end: refused, its file removed.
    assert (done, err, stage_no) == (4, errno.ENODATA, _native.XF_STAGE_SHORT)
    assert sorted(os.listdir(stage)) == ["a", "b", "c", "d"]
    for name, (off, size) in zip("abcd", entries):
        assert (stage / name).read_bytes() == DATA[off:off + size]
