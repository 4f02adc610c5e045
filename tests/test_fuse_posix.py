"""POSIX behaviour through the overlay's mount, compared with a plain directory, operation by operation.

A pjdfstest-style table written in Python: each script in ``SCRIPTS`` is a
short sequence of file-system calls made through an :class:`FS` bound to a
directory fd.  The same script runs once against a plain directory under
``tmp_path`` and once against the overlay's detached mount
(``os.*(..., dir_fd=overlay.mount_fd)``, in a worker thread: the daemon is
another process, so the blocking calls cannot deadlock it).  Every call
records its outcome: the return value (normalized: fds and inode numbers
never appear, only whether two names share an inode), the errno name of a
failure, and for stats the fields that must match (file type, permission
bits, size of non-directories, link count; times where the script set them
explicitly).  The two logs must be equal, and so must the resulting trees:
the plain directory and the overlay's backing directory, read host-side.

Needs root, /dev/fuse and pyfuse3 (skipped with the reason otherwise).
"""

from __future__ import annotations

import errno
import hashlib
import json
import importlib.util
import os
import stat
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from sandbox_fs import _native
from sandbox_fs.fuse import Overlay, OverlayPolicy
from sandbox_fs.root import open_root

if not os.path.exists("/dev/fuse"):
    pytest.skip("the FUSE overlay needs /dev/fuse", allow_module_level=True)
if os.geteuid() != 0:
    pytest.skip("the FUSE overlay daemon needs root (fsopen needs CAP_SYS_ADMIN)", allow_module_level=True)
if importlib.util.find_spec("pyfuse3") is None:
    pytest.skip("the FUSE overlay needs pyfuse3 (the fuse extra)", allow_module_level=True)


# ---------------------------------------------------------------- the recorder


class FS:
    """File-system calls relative to one directory fd, each recording its outcome in :attr:`log`.

    A failing call records ``(label, "ERR", errno name)`` and returns None, so
    a script goes on after an expected error.  Open files are named by small
    integers (the order they were opened in), never by their fd number.
    """

    def __init__(self, dir_fd: int) -> None:
        self.dir_fd = dir_fd
        self.log: list[tuple[Any, ...]] = []
        self._fds: dict[int, int] = {}

    # -- plumbing

    def _call(self, label: tuple[Any, ...], fn: Callable[[], Any], norm: Callable[[Any], Any] = lambda r: r) -> Any:
        try:
            ret = fn()
        except OSError as exc:
            self.log.append((*label, "ERR", errno.errorcode.get(exc.errno or 0, str(exc.errno))))
            return None
        self.log.append((*label, "OK", norm(ret)))
        return ret

    def note(self, *what: Any) -> None:
        """Record a value computed by the script itself (e.g. a comparison)."""
        self.log.append(("note", *what))

    def close_all(self) -> None:
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()

    @staticmethod
    def norm_stat(st: os.stat_result, times: bool = False) -> tuple[Any, ...]:
        kind = stat.S_IFMT(st.st_mode)
        size = None if stat.S_ISDIR(st.st_mode) else st.st_size
        out: tuple[Any, ...] = (stat.filemode(st.st_mode), oct(stat.S_IMODE(st.st_mode)), kind, size, st.st_nlink)
        if times:
            out += (st.st_atime_ns, st.st_mtime_ns)
        return out

    # -- files

    def open(self, path: str, flags: int, mode: int = 0o644) -> int | None:
        fd = self._call(("open", path, flags, oct(mode)),
                        lambda: os.open(path, flags | os.O_CLOEXEC, mode, dir_fd=self.dir_fd), lambda r: None)
        if fd is None:
            return None
        h = len(self._fds) + 1
        while h in self._fds:
            h += 1
        self._fds[h] = fd
        return h

    def close(self, h: int | None) -> None:
        if h is None or h not in self._fds:
            self.log.append(("close", h, "no such handle"))
            return
        fd = self._fds.pop(h)
        self._call(("close", h), lambda: os.close(fd))

    def _fd(self, h: int | None) -> int:
        if h is None or h not in self._fds:
            raise OSError(errno.EBADF, "the script has no such open file")
        return self._fds[h]

    def write(self, h: int | None, data: bytes) -> None:
        self._call(("write", h, len(data)), lambda: os.write(self._fd(h), data))

    def pwrite(self, h: int | None, data: bytes, offset: int) -> None:
        self._call(("pwrite", h, len(data), offset), lambda: os.pwrite(self._fd(h), data, offset))

    def read(self, h: int | None, n: int) -> None:
        self._call(("read", h, n), lambda: os.read(self._fd(h), n))

    def pread(self, h: int | None, n: int, offset: int) -> None:
        self._call(("pread", h, n, offset), lambda: os.pread(self._fd(h), n, offset))

    def lseek(self, h: int | None, offset: int, whence: int = os.SEEK_SET) -> None:
        self._call(("lseek", h, offset, whence), lambda: os.lseek(self._fd(h), offset, whence))

    def ftruncate(self, h: int | None, length: int) -> None:
        self._call(("ftruncate", h, length), lambda: os.ftruncate(self._fd(h), length))

    def fsync(self, h: int | None) -> None:
        self._call(("fsync", h), lambda: os.fsync(self._fd(h)))

    def fstat(self, h: int | None, times: bool = False) -> None:
        self._call(("fstat", h), lambda: os.fstat(self._fd(h)), lambda st: self.norm_stat(st, times))

    def read_file(self, path: str) -> None:
        """open O_RDONLY + read everything + close, recorded as one step."""

        def go() -> bytes:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=self.dir_fd)
            try:
                chunks = []
                while chunk := os.read(fd, 1 << 16):
                    chunks.append(chunk)
                return b"".join(chunks)
            finally:
                os.close(fd)

        self._call(("read_file", path), go)

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """open O_WRONLY|O_CREAT|O_TRUNC + write + close, recorded as one step."""

        def go() -> int:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode, dir_fd=self.dir_fd)
            try:
                return os.write(fd, data)
            finally:
                os.close(fd)

        self._call(("write_file", path, len(data)), go)

    # -- names

    def stat(self, path: str, times: bool = False) -> None:
        self._call(("stat", path), lambda: os.stat(path, dir_fd=self.dir_fd), lambda st: self.norm_stat(st, times))

    def lstat(self, path: str, times: bool = False) -> None:
        self._call(("lstat", path), lambda: os.stat(path, dir_fd=self.dir_fd, follow_symlinks=False),
                   lambda st: self.norm_stat(st, times))

    def same_inode(self, a: str, b: str) -> None:
        def go() -> bool:
            sa = os.stat(a, dir_fd=self.dir_fd, follow_symlinks=False)
            sb = os.stat(b, dir_fd=self.dir_fd, follow_symlinks=False)
            return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)

        self._call(("same_inode", a, b), go)

    def mtime_after(self, path: str, ref_ns: int) -> None:
        """Record whether ``path``'s mtime is later than ``ref_ns`` (the time itself differs per run)."""
        self._call(("mtime_after", path, ref_ns),
                   lambda: os.stat(path, dir_fd=self.dir_fd, follow_symlinks=False).st_mtime_ns > ref_ns)

    def mkdir(self, path: str, mode: int = 0o755) -> None:
        self._call(("mkdir", path, oct(mode)), lambda: os.mkdir(path, mode, dir_fd=self.dir_fd))

    def rmdir(self, path: str) -> None:
        self._call(("rmdir", path), lambda: os.rmdir(path, dir_fd=self.dir_fd))

    def unlink(self, path: str) -> None:
        self._call(("unlink", path), lambda: os.unlink(path, dir_fd=self.dir_fd))

    def rename(self, src: str, dst: str, flags: int = 0) -> None:
        def go() -> None:
            if flags == 0:
                os.rename(src, dst, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
                return
            ret = _native.renameat2_raw(self.dir_fd, os.fsencode(src), self.dir_fd, os.fsencode(dst), flags)
            if ret < 0:
                raise OSError(-ret, os.strerror(-ret))

        self._call(("rename", src, dst, flags), go)

    def symlink(self, target: str, path: str) -> None:
        self._call(("symlink", target, path), lambda: os.symlink(target, path, dir_fd=self.dir_fd))

    def readlink(self, path: str) -> None:
        self._call(("readlink", path), lambda: os.readlink(path, dir_fd=self.dir_fd))

    def link(self, src: str, dst: str) -> None:
        self._call(("link", src, dst), lambda: os.link(src, dst, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd,
                                                         follow_symlinks=False))

    def chmod(self, path: str, mode: int) -> None:
        self._call(("chmod", path, oct(mode)), lambda: os.chmod(path, mode, dir_fd=self.dir_fd))

    def utime(self, path: str, ns: tuple[int, int] | None, follow: bool = True) -> None:
        def go() -> None:
            if ns is None:
                os.utime(path, dir_fd=self.dir_fd, follow_symlinks=follow)
            else:
                os.utime(path, ns=ns, dir_fd=self.dir_fd, follow_symlinks=follow)

        self._call(("utime", path, ns, follow), go)

    def listdir(self, path: str = ".") -> None:
        def go() -> list[str]:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.dir_fd)
            try:
                return sorted(os.listdir(fd))
            finally:
                os.close(fd)

        self._call(("listdir", path), go)


def host_tree(top: Path) -> dict[str, tuple[Any, ...]]:
    """Type, permission bits, size, link count and content of every node under ``top`` (no times)."""
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                extra: Any = os.readlink(p)
            elif stat.S_ISREG(st.st_mode):
                extra = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                extra = None
            size = None if stat.S_ISDIR(st.st_mode) else st.st_size
            out[str(p.relative_to(top))] = (stat.filemode(st.st_mode), size, st.st_nlink, extra)
    return out


# ---------------------------------------------------------------- the scripts

SCRIPTS: dict[str, Callable[[FS], None]] = {}


def script(fn: Callable[[FS], None]) -> Callable[[FS], None]:
    SCRIPTS[fn.__name__] = fn
    return fn


WR = os.O_WRONLY
RW = os.O_RDWR
CREAT = os.O_CREAT


@script
def create(fs: FS) -> None:
    h = fs.open("new", WR | CREAT | os.O_EXCL, 0o640)
    fs.fstat(h)
    fs.stat("new")
    fs.open("new", WR | CREAT | os.O_EXCL, 0o640)        # EEXIST
    h2 = fs.open("new", WR | CREAT, 0o600)                # exists: mode unchanged
    fs.stat("new")
    fs.close(h2)
    fs.close(h)
    fs.open("missing", os.O_RDONLY)                       # ENOENT
    fs.open("nodir/x", WR | CREAT)                        # ENOENT
    h3 = fs.open("empty", RW | CREAT | os.O_TRUNC, 0o666)
    fs.read(h3, 10)                                       # b""
    fs.close(h3)
    fs.stat("empty")
    fs.listdir()


@script
def read_write(fs: FS) -> None:
    h = fs.open("f", RW | CREAT, 0o644)
    fs.write(h, b"hello world\n")
    fs.lseek(h, 0)
    fs.read(h, 5)
    fs.read(h, 100)
    fs.read(h, 100)                                       # EOF: b""
    fs.pread(h, 5, 6)
    fs.pread(h, 5, 1000)                                  # past EOF: b""
    fs.pwrite(h, b"WORLD", 6)
    fs.pwrite(h, b"!", 20)                                # a hole
    fs.fstat(h)
    fs.fsync(h)
    fs.close(h)
    fs.read_file("f")
    fs.stat("f")
    big = bytes(range(256)) * 4096                        # 1 MiB: several write requests
    fs.write_file("big", big)
    fs.read_file("big")
    hr = fs.open("big", os.O_RDONLY)
    fs.pread(hr, 300, (1 << 20) - 100)
    fs.write(hr, b"x")                                    # EBADF: read-only fd
    fs.close(hr)
    hw = fs.open("f", WR)
    fs.read(hw, 1)                                        # EBADF: write-only fd
    fs.close(hw)


@script
def append(fs: FS) -> None:
    fs.write_file("log", b"one\n")
    h = fs.open("log", WR | os.O_APPEND)
    fs.write(h, b"two\n")
    fs.lseek(h, 0)
    fs.write(h, b"three\n")                               # O_APPEND: still at the end
    fs.lseek(h, 0, os.SEEK_CUR)
    fs.fstat(h)
    h2 = fs.open("log", WR)                               # a plain writer, then the appender again
    fs.pwrite(h2, b"ONE\n", 0)
    fs.write(h2, b"X")
    fs.write(h, b"four\n")
    fs.close(h2)
    fs.close(h)
    fs.read_file("log")
    h3 = fs.open("new", WR | CREAT | os.O_APPEND, 0o600)
    fs.write(h3, b"a")
    fs.write(h3, b"b")
    fs.close(h3)
    fs.read_file("new")
    fs.stat("log")


@script
def truncate(fs: FS) -> None:
    fs.write_file("f", b"0123456789" * 10)
    h = fs.open("f", RW)
    fs.ftruncate(h, 5)
    fs.fstat(h)
    fs.pread(h, 100, 0)
    fs.ftruncate(h, 4096 * 3 + 1)                         # grow: zeros
    fs.fstat(h)
    fs.pread(h, 20, 0)
    fs.pread(h, 10, 4096 * 3 - 5)
    fs.ftruncate(h, 0)
    fs.fstat(h)
    fs.close(h)
    fs.stat("f")
    fs.write_file("g", b"content to be dropped")
    h2 = fs.open("g", WR | os.O_TRUNC)                    # truncate via a new open
    fs.fstat(h2)
    fs.write(h2, b"new")
    fs.close(h2)
    fs.read_file("g")
    fs.stat("g")
    h3 = fs.open("g", os.O_RDONLY)
    fs.ftruncate(h3, 0)                                   # EINVAL/EBADF: not open for writing
    fs.close(h3)
    fs.read_file("g")
    fs.mkdir("d")
    fs.open("d", WR | os.O_TRUNC)                         # EISDIR


@script
def rename_over_file(fs: FS) -> None:
    fs.write_file("a", b"AAA")
    fs.write_file("b", b"BBBBBB")
    fs.rename("a", "b")
    fs.stat("a")                                          # ENOENT
    fs.stat("b")
    fs.read_file("b")
    fs.mkdir("d")
    fs.rename("b", "d/b")                                 # into a subdirectory
    fs.read_file("d/b")
    fs.rename("d/b", "d/b")                               # same name: no-op
    fs.read_file("d/b")
    fs.rename("missing", "x")                             # ENOENT
    fs.rename("d/b", "nodir/b")                           # ENOENT
    fs.write_file("c", b"C")
    fs.link("c", "c2")
    fs.rename("c", "c2")                                  # hard links of one inode: no-op, both stay
    fs.stat("c")
    fs.stat("c2")
    fs.listdir()
    fs.listdir("d")


@script
def rename_dirs(fs: FS) -> None:
    fs.mkdir("src")
    fs.write_file("src/inner", b"inner")
    fs.mkdir("empty")
    fs.rename("src", "empty")                             # dir over an empty dir
    fs.stat("src")
    fs.read_file("empty/inner")
    fs.stat("empty")
    fs.mkdir("full")
    fs.write_file("full/x", b"x")
    fs.rename("empty", "full")                            # ENOTEMPTY (or EEXIST)
    fs.write_file("file", b"f")
    fs.rename("full", "file")                             # ENOTDIR
    fs.rename("file", "full")                             # EISDIR
    fs.rename("full", "full/sub")                         # EINVAL: into itself
    fs.mkdir("a")
    fs.mkdir("a/b")
    fs.rename("a/b", "top")                               # up one level
    fs.stat("a")
    fs.stat("top")
    fs.rename("top", "a/b")                               # and back
    fs.stat("a")
    fs.listdir()
    fs.listdir("a")


@script
def rename_noreplace(fs: FS) -> None:
    fs.write_file("a", b"A")
    fs.write_file("b", b"B")
    fs.rename("a", "b", _native.RENAME_NOREPLACE)         # EEXIST
    fs.read_file("a")
    fs.read_file("b")
    fs.rename("a", "c", _native.RENAME_NOREPLACE)
    fs.stat("a")
    fs.read_file("c")
    fs.mkdir("d")
    fs.mkdir("e")
    fs.rename("d", "e", _native.RENAME_NOREPLACE)         # EEXIST even for an empty dir
    fs.rename("d", "e/d", _native.RENAME_NOREPLACE)
    fs.listdir()
    fs.listdir("e")


@script
def rename_exchange(fs: FS) -> None:
    fs.write_file("a", b"AAAA")
    fs.write_file("b", b"BB")
    fs.chmod("b", 0o600)
    fs.rename("a", "b", _native.RENAME_EXCHANGE)
    fs.read_file("a")
    fs.read_file("b")
    fs.stat("a")
    fs.stat("b")
    fs.rename("a", "missing", _native.RENAME_EXCHANGE)    # ENOENT
    fs.mkdir("d")
    fs.write_file("d/inner", b"in d")
    fs.rename("a", "d", _native.RENAME_EXCHANGE)          # a file and a dir swap
    fs.stat("a")
    fs.stat("d")
    fs.read_file("a/inner")
    fs.read_file("d")
    fs.mkdir("a/sub")
    fs.rename("a/sub", "d", _native.RENAME_EXCHANGE)      # across levels
    fs.stat("d")
    fs.stat("a/sub")
    fs.rename("a", "b", _native.RENAME_EXCHANGE | _native.RENAME_NOREPLACE)   # EINVAL
    fs.listdir()
    fs.listdir("a")


@script
def unlink_open_file(fs: FS) -> None:
    fs.write_file("f", b"still readable")
    h = fs.open("f", RW)
    fs.unlink("f")
    fs.stat("f")                                          # ENOENT
    fs.pread(h, 100, 0)                                   # the open fd still reads
    fs.fstat(h)                                           # nlink 0
    fs.pwrite(h, b"STILL", 0)
    fs.pread(h, 100, 0)
    fs.ftruncate(h, 3)
    fs.fstat(h)
    fs.write_file("f", b"a new file")                     # the name is free again
    fs.pread(h, 100, 0)
    fs.read_file("f")
    fs.close(h)
    fs.unlink("f")
    fs.unlink("f")                                        # ENOENT
    fs.mkdir("d")
    fs.unlink("d")                                        # EISDIR
    fs.listdir()


@script
def symlink_readlink(fs: FS) -> None:
    fs.write_file("target", b"through the link")
    fs.symlink("target", "l")
    fs.readlink("l")
    fs.lstat("l")
    fs.stat("l")                                          # follows: the file
    fs.read_file("target")
    fs.symlink("target", "l")                             # EEXIST
    fs.symlink("dangling", "l2")
    fs.readlink("l2")
    fs.stat("l2")                                         # ENOENT
    fs.mkdir("d")
    fs.symlink("../target", "d/up")
    fs.readlink("d/up")
    fs.stat("d/up")
    fs.symlink("d", "dl")
    fs.stat("dl/up")                                      # through a dir link
    fs.readlink("target")                                 # EINVAL: not a link
    fs.readlink("missing")                                # ENOENT
    fs.open("l", os.O_RDONLY | os.O_NOFOLLOW)             # ELOOP
    fs.symlink("x" * 4000, "long")
    fs.readlink("long")
    fs.unlink("l")
    fs.stat("target")
    fs.rename("l2", "d/l2")
    fs.readlink("d/l2")
    fs.symlink("made-through-link", "tolink")
    h = fs.open("tolink", WR | CREAT, 0o600)              # O_CREAT through a dangling link makes its target
    fs.close(h)
    fs.stat("made-through-link")
    fs.open("tolink", WR | CREAT | os.O_EXCL, 0o600)      # EEXIST: O_EXCL never follows
    fs.listdir()


@script
def hard_links(fs: FS) -> None:
    fs.write_file("a", b"shared")
    fs.link("a", "b")
    fs.stat("a")                                          # nlink 2
    fs.stat("b")
    fs.same_inode("a", "b")
    fs.mkdir("d")
    fs.link("a", "d/c")
    fs.stat("b")                                          # nlink 3
    ha = fs.open("a", WR)
    fs.pwrite(ha, b"SHARED, written through a", 0)
    fs.close(ha)
    fs.read_file("b")                                     # written through one, read through the other
    fs.read_file("d/c")
    fs.chmod("b", 0o600)
    fs.stat("a")                                          # one inode: the mode changed for all
    fs.unlink("a")
    fs.stat("b")                                          # nlink 2
    fs.read_file("b")
    fs.link("b", "d/c")                                   # EEXIST
    fs.link("missing", "x")                               # ENOENT
    fs.link("d", "dlink")                                 # EPERM: a directory
    fs.symlink("b", "sl")
    fs.link("sl", "sl2")                                  # links the symlink itself
    fs.lstat("sl2")
    fs.same_inode("sl", "sl2")
    fs.unlink("b")
    fs.stat("d/c")                                        # nlink 1
    fs.listdir()


@script
def chmod(fs: FS) -> None:
    fs.write_file("f", b"x", 0o644)
    for mode in (0o600, 0o755, 0o000, 0o777, 0o1644):
        fs.chmod("f", mode)
        fs.stat("f")
    fs.mkdir("d", 0o700)
    fs.stat("d")
    fs.chmod("d", 0o1777)                                 # sticky is not a set-id bit
    fs.stat("d")
    fs.chmod("d", 0o755)
    fs.stat("d")
    fs.chmod("missing", 0o644)                            # ENOENT
    h = fs.open("f", RW)                                  # root may open a 0o1644 file for writing
    fs.fstat(h)
    fs.close(h)


@script
def utimens(fs: FS) -> None:
    fs.write_file("f", b"x")
    fs.utime("f", (1_000_000_000_123_456_789, 1_500_000_000_987_654_321))
    fs.stat("f", times=True)
    fs.utime("f", (0, 1))
    fs.stat("f", times=True)
    fs.mkdir("d")
    fs.utime("d", (2_000_000_000, 3_000_000_000))
    fs.stat("d", times=True)
    fs.symlink("f", "l")
    fs.utime("l", (4_000_000_000, 5_000_000_000), follow=False)   # the link, not the file
    fs.lstat("l", times=True)
    fs.stat("f", times=True)
    fs.utime("l", (6_000_000_000, 7_000_000_000))                  # follows: the file
    fs.stat("f", times=True)
    fs.utime("missing", (1, 1))                                    # ENOENT
    fs.utime("f", None)                                            # now: succeeds


OLD_NS = 1_000_000_000 * 10**9   # 2001: any time the kernel sets now is later


@script
def times_move(fs: FS) -> None:
    """mtime moves on write, truncate and directory changes (set to 2001 first, then compared)."""
    fs.write_file("f", b"x")
    fs.mkdir("d")
    fs.mkdir("d2")
    for path in ("f", "d", "d2"):
        fs.utime(path, (OLD_NS, OLD_NS))
        fs.mtime_after(path, OLD_NS)                      # False: just set
    h = fs.open("f", WR)
    fs.write(h, b"more")
    fs.close(h)
    fs.mtime_after("f", OLD_NS)                           # True: written
    fs.utime("f", (OLD_NS, OLD_NS))
    h = fs.open("f", WR | os.O_TRUNC)
    fs.close(h)
    fs.mtime_after("f", OLD_NS)                           # True: truncated by open
    fs.write_file("d/x", b"")
    fs.mtime_after("d", OLD_NS)                           # True: an entry was made
    fs.utime("d", (OLD_NS, OLD_NS))
    fs.rename("d/x", "d2/x")
    fs.mtime_after("d", OLD_NS)                           # True: an entry left
    fs.mtime_after("d2", OLD_NS)                          # True: an entry came
    fs.utime("d2", (OLD_NS, OLD_NS))
    fs.unlink("d2/x")
    fs.mtime_after("d2", OLD_NS)                          # True: an entry was removed
    fs.utime("f", (OLD_NS, OLD_NS))
    fs.chmod("f", 0o600)
    fs.mtime_after("f", OLD_NS)                           # False: chmod changes ctime only
    fs.stat("f", times=True)


@script
def mkdir_rmdir(fs: FS) -> None:
    fs.mkdir("d", 0o750)
    fs.stat("d")
    fs.mkdir("d")                                         # EEXIST
    fs.mkdir("d/e")
    fs.stat("d")                                          # nlink 3
    fs.mkdir("missing/e")                                 # ENOENT
    fs.write_file("file", b"f")
    fs.mkdir("file")                                      # EEXIST
    fs.mkdir("file/e")                                    # ENOTDIR
    fs.rmdir("d")                                         # ENOTEMPTY
    fs.rmdir("file")                                      # ENOTDIR
    fs.rmdir("missing")                                   # ENOENT
    fs.rmdir("d/e/.")                                     # EINVAL
    fs.rmdir("d/e")
    fs.stat("d")                                          # nlink 2
    fs.rmdir("d")
    fs.stat("d")                                          # ENOENT
    fs.open("file/x", os.O_RDONLY)                        # ENOTDIR
    fs.stat("file/")                                      # ENOTDIR
    fs.mkdir("d2")
    fs.open("d2", WR)                                     # EISDIR
    fs.open("file", os.O_RDONLY | os.O_DIRECTORY)         # ENOTDIR
    fs.unlink("d2")                                       # EISDIR
    fs.listdir("file")                                    # ENOTDIR
    fs.listdir()


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    return await trio.to_thread.run_sync(fn, *args)


@asynccontextmanager
async def mounted(ws_dir: Path, policy: OverlayPolicy | None = None):
    """Start an overlay on ``ws_dir``; always closed (daemon stopped, fds closed) on the way out."""
    ws = open_root(ws_dir)
    try:
        ov = await Overlay.start(ws, policy=policy or OverlayPolicy())
        try:
            yield ov
        finally:
            await ov.aclose()
    finally:
        ws.close()


def run_script(fn: Callable[[FS], None], dir_fd: int) -> list[tuple[Any, ...]]:
    fs = FS(dir_fd)
    try:
        fn(fs)
    finally:
        fs.close_all()
    return fs.log


def first_difference(a: list[tuple[Any, ...]], b: list[tuple[Any, ...]]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"step {i}: plain {x!r} != overlay {y!r}"
    return f"lengths differ: {len(a)} != {len(b)}"


@pytest.fixture
def dirs(tmp_path):
    plain = tmp_path / "plain"
    ws = tmp_path / "ws"
    plain.mkdir()
    ws.mkdir()
    return plain, ws


@pytest.mark.parametrize("name", sorted(SCRIPTS))
async def test_script_matches_a_plain_directory(name, dirs):
    plain, ws = dirs
    fn = SCRIPTS[name]
    pfd = os.open(plain, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        expected = await in_thread(run_script, fn, pfd)
    finally:
        os.close(pfd)
    async with mounted(ws) as ov:
        # Really the FUSE mount, not the backing directory under another fd.
        assert os.stat(ov.mount_fd).st_dev != os.stat(ws).st_dev
        got = await in_thread(run_script, fn, ov.mount_fd)
        assert ov.alive
    assert got == expected, first_difference(expected, got)
    assert host_tree(ws) == host_tree(plain), "the backing directory differs from the plain one"


def test_the_recorder_sees_differences(tmp_path):
    """The comparison can fail: one extra byte, one changed mode, one errno all show."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (b / "f").write_bytes(b"x")
    fa = os.open(a, os.O_PATH | os.O_DIRECTORY)
    fb = os.open(b, os.O_PATH | os.O_DIRECTORY)
    try:
        def probe(fs: FS) -> None:
            fs.stat("f")
            fs.mkdir("f")

        la, lb = run_script(probe, fa), run_script(probe, fb)
        assert la != lb
        assert la[0][-2] == "ERR" and la[0][-1] == "ENOENT"
        assert lb[1][-1] == "EEXIST"
    finally:
        os.close(fa)
        os.close(fb)


# ---------------------------------------------------------------- readdir, statfs

N_ENTRIES = 10_000


async def test_readdir_of_10k_entries_gives_every_name_once(dirs):
    plain, ws = dirs
    for d in (plain, ws):
        big = d / "big"
        big.mkdir()
        for i in range(N_ENTRIES):
            (big / f"entry-{i:05d}-{'x' * (i % 40)}").write_bytes(b"")
    expected = sorted(os.listdir(plain / "big"))

    def listing(dir_fd: int) -> list[tuple[str, bool]]:
        fd = os.open("big", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            with os.scandir(fd) as it:
                return [(e.name, e.is_file(follow_symlinks=False)) for e in it]
        finally:
            os.close(fd)

    def churn(dir_fd: int) -> None:
        # Through the mount: drop every 10th entry, add as many new ones, and a subdirectory.
        for i in range(0, N_ENTRIES, 10):
            os.unlink(f"big/entry-{i:05d}-{'x' * (i % 40)}", dir_fd=dir_fd)
            fd = os.open(f"big/new-{i:05d}", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
            os.close(fd)
        os.mkdir("big/subdir", dir_fd=dir_fd)

    async with mounted(ws) as ov:
        got = await in_thread(listing, ov.mount_fd)
        names = [n for n, _ in got]
        assert len(names) == len(set(names)), "a name was listed twice"
        assert sorted(names) == expected
        assert all(is_file for _, is_file in got)
        await in_thread(churn, ov.mount_fd)
        got2 = await in_thread(listing, ov.mount_fd)
        assert ov.alive
    pfd = os.open(plain, os.O_PATH | os.O_DIRECTORY)
    try:
        churn(pfd)
        expected2 = sorted(listing(pfd))
    finally:
        os.close(pfd)
    names2 = [n for n, _ in got2]
    assert len(names2) == len(set(names2)), "a name was listed twice after the churn"
    assert sorted(got2) == expected2
    assert sorted(os.listdir(ws / "big")) == sorted(n for n, _ in expected2)


async def test_statfs_on_the_mount_has_sane_fields(dirs):
    _plain, ws = dirs
    backing = os.statvfs(ws)
    async with mounted(ws) as ov:
        st = await in_thread(os.statvfs, ov.mount_fd)
        fd = await in_thread(lambda: os.open("f", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644,
                                             dir_fd=ov.mount_fd))
        try:
            st_file = await in_thread(os.statvfs, fd)
        finally:
            os.close(fd)
    for s in (st, st_file):
        assert s.f_bsize > 0 and s.f_frsize > 0
        assert 0 < s.f_blocks
        assert 0 <= s.f_bavail <= s.f_bfree <= s.f_blocks
        assert 0 <= s.f_ffree <= s.f_files
        assert 0 < s.f_namemax <= 255 + 1
        # The workspace's filesystem: same size (in bytes) as the backing one, give or take rounding.
        assert abs(s.f_blocks * s.f_frsize - backing.f_blocks * backing.f_frsize) <= backing.f_frsize * 16


# ---------------------------------------------------------------- the confined command's side

_DRIVER = '''
def _jsonable(v):
    if isinstance(v, bytes):
        return "bytes:" + (v.hex() if len(v) <= 64 else hashlib.sha256(v).hexdigest() + ":" + str(len(v)))
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


_out = {}
for _name in sys.argv[1:]:
    os.mkdir(_name)
    _fd = os.open(_name, os.O_PATH | os.O_DIRECTORY)
    _fs = FS(_fd)
    try:
        globals()[_name](_fs)
    finally:
        _fs.close_all()
        os.close(_fd)
    _out[_name] = _jsonable(_fs.log)
print(json.dumps(_out))
'''


def confined_program() -> str:
    """The recorder and every script as one self-contained program (stdlib only) for ``python -I -S -c``.

    ``_native`` is replaced by a shim that calls renameat2 through libc (the
    confined command has no sandbox_fs); the driver runs each script named
    in argv in a fresh directory of its own and prints the logs as JSON.
    """
    import inspect

    shim = (
        "class _native:\n"
        f"    RENAME_NOREPLACE = {_native.RENAME_NOREPLACE}\n"
        f"    RENAME_EXCHANGE = {_native.RENAME_EXCHANGE}\n"
        "    _libc = ctypes.CDLL(None, use_errno=True)\n"
        "    @staticmethod\n"
        "    def renameat2_raw(olddirfd, old, newdirfd, new, flags):\n"
        "        ret = _native._libc.syscall(316, olddirfd, old, newdirfd, new, flags)  # SYS_renameat2, x86_64\n"
        "        return 0 if ret == 0 else -ctypes.get_errno()\n"
    )
    parts = [
        "from __future__ import annotations",
        "import ctypes, errno, hashlib, json, os, stat, sys",
        "from typing import Any, Callable",
        shim,
        "def script(fn):\n    return fn\n",
        f"WR, RW, CREAT, OLD_NS = {WR}, {RW}, {CREAT}, {OLD_NS}",
        inspect.getsource(FS),
        *(inspect.getsource(fn) for fn in SCRIPTS.values()),
        _DRIVER,
    ]
    return "\n\n".join(parts)


@pytest.fixture
def search_base():
    """A temp dir under /tmp every uid may search (pytest's tmp_path sits under a 0700 directory)."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="sfs-posix-"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d)


async def test_a_confined_command_sees_the_same_posix_behaviour_through_its_private_root(search_base, pygrant):
    """Every script, run by a confined command (leased non-root identity, Landlock, seccomp) in its
    private root with the overlay at /workspace, gives the log the same command gives on a plain
    workspace without the overlay."""
    import sys

    from sandbox_fs import exec as sfs_exec
    from sandbox_fs import features
    from sandbox_fs.exec import PrivateRoot, run_confined

    if os.uname().machine != "x86_64":
        pytest.skip("the confined program calls renameat2 by its x86_64 syscall number")
    if not os.access(sfs_exec.helper_path(), os.X_OK):
        pytest.skip("sandbox_fs/sfs-exec is not built")
    if features()["landlock_abi"] == 0:
        pytest.skip("features()['landlock_abi'] is 0: the kernel has no Landlock")
    cmd = [os.path.realpath(sys.executable), "-I", "-S", "-c", confined_program(), *sorted(SCRIPTS)]
    plain, backing = search_base / "plain", search_base / "backing"
    plain.mkdir()
    backing.mkdir()
    with open_root(plain) as plain_root:
        control = await run_confined(cmd, workspace=plain_root, workspace_host_path=str(plain), grants=pygrant,
                                     check=True)
    with open_root(backing) as backing_root:
        ov = await Overlay.start(backing_root, policy=OverlayPolicy())
        try:
            r = await run_confined(cmd, workspace=ov.root, workspace_host_path=str(backing), grants=pygrant,
                                   private_root=PrivateRoot(ov.mount_fd), check=True)
            assert ov.alive
        finally:
            await ov.aclose()
    assert r.overlay and not control.overlay
    assert r.identity is not None and r.identity[0] != 0
    expected, got = json.loads(control.stdout), json.loads(r.stdout)
    assert sorted(got) == sorted(SCRIPTS)
    assert all(len(got[name]) >= 5 for name in got), "a script stopped early"
    assert ["mkdir", "d", "0o755", "ERR", "EEXIST"] in got["mkdir_rmdir"]
    for name in sorted(SCRIPTS):
        assert got[name] == expected[name], f"{name}: {first_difference(expected[name], got[name])}"
    assert host_tree(backing) == host_tree(plain), "the backing directory differs from the plain one"
