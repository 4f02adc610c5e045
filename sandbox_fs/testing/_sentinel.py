"""The security invariant after an operation: the outside is untouched, the destination is tame.

Three checks, used by the fuzz targets, the stateful suite and the pytest
plugin alike (issue 15, part 1):

* :class:`OutsideSentinel` records a host tree *beside* a destination
  (every name, its type, mode, owner, size, link count, inode, mtime and
  ctime in nanoseconds, a regular file's SHA-256 and a symlink's target;
  atime is left aside, since reading a file may change it) and
  :meth:`OutsideSentinel.check` raises ``AssertionError`` naming what changed.
* :func:`check_destination` walks a destination by directory fds (so paths
  longer than ``PATH_MAX`` are walked too) and raises ``AssertionError`` for
  a symlink that resolves outside it, a device, FIFO or socket, a set-uid
  node or a set-gid non-directory, and a file that is one of the sentinel's
  inodes (hard-linked to an outside file).
* :func:`classify_failure` tells an allowed failure (a refusal) from a
  finding.

These helpers use host paths and ``os`` directly: they run in tests, on
throw-away directories the test made, never inside the library.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from dataclasses import dataclass
from typing import Iterable, Iterator

__all__ = ["ALLOWED_ERRNOS", "OutsideSentinel", "check_destination", "classify_failure"]

# The errnos an operation on hostile input may end with, as a plain OSError that carries the
# sandbox path (DESIGN.md "Errors": an errno stays an OSError subclass): the state of the
# workspace (a name missing, present, of the wrong type, not empty, too long, busy, replaced,
# not permitted) and exhausted resources (space, quota, descriptors, links).  EXDEV and ELOOP
# normally arrive as PathEscapeError / SymlinkRefusedError, which are SandboxErrors.
ALLOWED_ERRNOS: frozenset[int] = frozenset({
    errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENOTEMPTY, errno.ENAMETOOLONG,
    errno.ENOSPC, errno.EDQUOT, errno.EMFILE, errno.ENFILE, errno.EMLINK, errno.EFBIG,
    errno.EACCES, errno.EPERM, errno.EROFS, errno.EBUSY, errno.ESTALE, errno.EXDEV, errno.ELOOP,
    errno.ETXTBSY,
})

_CHUNK = 1 << 16


@dataclass(frozen=True)
class _Record:
    """What the sentinel keeps of one name (atime aside)."""

    kind: str
    mode: int
    uid: int
    gid: int
    size: int
    nlink: int
    dev: int
    ino: int
    mtime_ns: int
    ctime_ns: int
    content: str  # a regular file's SHA-256, a symlink's target, else ""


def _digest(dirfd: int, name: str) -> str:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dirfd)
    except OSError as exc:
        return f"<unreadable: errno {exc.errno}>"
    h = hashlib.sha256()
    try:
        while chunk := os.read(fd, _CHUNK):
            h.update(chunk)
    finally:
        os.close(fd)
    return h.hexdigest()


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "file"), (stat.S_ISDIR, "dir"), (stat.S_ISLNK, "symlink"),
                       (stat.S_ISFIFO, "fifo"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "char device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "unknown"


def _record(dirfd: int, name: str, st: os.stat_result) -> _Record:
    kind = _kind(st.st_mode)
    content = ""
    if kind == "file":
        content = _digest(dirfd, name)
    elif kind == "symlink":
        content = os.readlink(name, dir_fd=dirfd)
    return _Record(kind, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_size, st.st_nlink,
                   st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, content)


def _walk(top: str) -> Iterator[tuple[str, int, str, os.stat_result]]:
    """Yield ``(relative dir, dir fd, name, lstat)`` for every name under ``top``, never following a symlink."""
    for dirpath, dirnames, filenames, dirfd in os.fwalk(top, follow_symlinks=False):
        rel = os.path.relpath(dirpath, top)
        for name in sorted(dirnames + filenames):
            try:
                st = os.lstat(name, dir_fd=dirfd)
            except FileNotFoundError:
                continue
            yield rel, dirfd, name, st


def _join(rel: str, name: str) -> str:
    return name if rel == "." else f"{rel}/{name}"


class OutsideSentinel:
    """A recorded host tree that must not change: bytes and metadata, atime aside.

    Args:
        path: the host directory (``str`` or ``os.PathLike``) to record; the
            test made it, beside the destination (never inside it).

    Attributes:
        path: the recorded directory (``str``).
        inodes: ``frozenset`` of ``(st_dev, st_ino)`` of the directory and
            every name in it, for :func:`check_destination`.

    Raises:
        NotADirectoryError, FileNotFoundError: ``path`` is not a directory.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        # host-access: the sentinel tree is the test's own outside tree, which it must read as the host sees it
        top = os.lstat(self.path)
        if not stat.S_ISDIR(top.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "the sentinel must be a directory", self.path)
        self._before = self._snapshot()
        self.inodes = frozenset((r.dev, r.ino) for r in self._before.values())

    def _snapshot(self) -> dict[str, _Record]:
        # host-access: the sentinel tree is the test's own outside tree, which it must read as the host sees it
        top = os.lstat(self.path)
        records = {".": _record(-1, self.path, top)} if stat.S_ISDIR(top.st_mode) else {}
        records.update((_join(rel, name), _record(dirfd, name, st)) for rel, dirfd, name, st in _walk(self.path))
        return records

    def changes(self) -> list[str]:
        """Return one line per difference from the recorded state (``list[str]``; empty: unchanged).

        A line names the path relative to the sentinel and what changed
        (``"secret.txt: content, mtime_ns"``, ``"new: created"``, ``"sub: removed"``);
        ``"."`` is the directory itself (its entries changed: ``mtime_ns``).
        """
        try:
            after = self._snapshot()
        except FileNotFoundError:
            return [".: removed"]
        out = []
        for name in sorted(self._before.keys() | after.keys()):
            old, new = self._before.get(name), after.get(name)
            if old is None:
                out.append(f"{name}: created ({new.kind if new else '?'})")
            elif new is None:
                out.append(f"{name}: removed")
            elif old != new:
                fields = [f for f in old.__dataclass_fields__ if getattr(old, f) != getattr(new, f)]
                out.append(f"{name}: {', '.join(fields)}")
        return out

    def check(self) -> None:
        """Raise ``AssertionError`` naming every change since the tree was recorded; return None if unchanged."""
        diff = self.changes()
        if diff:
            raise AssertionError(f"the outside tree {self.path} changed: " + "; ".join(diff[:20])
                                 + (f"; ... {len(diff) - 20} more" if len(diff) > 20 else ""))


def _real_of_fd(fd: int) -> str:
    # host-access: the target of an fd this sentinel opened, for its report only
    return os.readlink(f"/proc/self/fd/{fd}")


def _inside(real: str, top: str) -> bool:
    return real == top or real.startswith(top.rstrip("/") + "/")


def _link_resolves_inside(dirfd: int, name: str, top: str) -> bool:
    """Whether the symlink ``name`` in ``dirfd`` resolves inside the real directory ``top``.

    An existing target is asked of the kernel (open with ``O_PATH``, then
    the fd's ``/proc`` link); a dangling one is resolved as far as it exists
    and the rest taken lexically (``os.path.realpath``), since creating
    through it would land there.  A
    loop resolves nowhere and counts as inside.
    """
    try:
        fd = os.open(name, os.O_PATH | os.O_CLOEXEC, dir_fd=dirfd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return True
        if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ENAMETOOLONG):
            raise
    else:
        try:
            return _inside(_real_of_fd(fd), top)
        finally:
            os.close(fd)
    target = os.readlink(name, dir_fd=dirfd)
    base = _real_of_fd(dirfd)
    return _inside(os.path.realpath(os.path.join(base, target)), top)


def check_destination(destination: str | os.PathLike[str], *, sentinel: OutsideSentinel | None = None,
                      outside_inodes: Iterable[tuple[int, int]] = ()) -> None:
    """Raise ``AssertionError`` if the destination tree breaks the invariant; return None if it holds.

    Args:
        destination: the host directory (``str`` or ``os.PathLike``) the
            operation wrote into.  A missing destination holds trivially.
        sentinel: its ``inodes`` count as outside inodes.
        outside_inodes: more ``(st_dev, st_ino)`` pairs that no name in the
            destination may be (a hard link to an outside file).

    Raises:
        AssertionError: naming the first offending path (relative to the
            destination) and why: a symlink resolving outside, a device,
            FIFO or socket, a set-uid node or set-gid non-directory, or a
            hard link to an outside inode.
    """
    top = os.fspath(destination)
    if not os.path.lexists(top):
        return
    outside = set(outside_inodes) | (set(sentinel.inodes) if sentinel is not None else set())
    real_top = os.path.realpath(top)
    for rel, dirfd, name, st in _walk(top):
        where = _join(rel, name)
        mode = st.st_mode
        if stat.S_ISLNK(mode):
            if not _link_resolves_inside(dirfd, name, real_top):
                raise AssertionError(f"symlink escapes the destination: {where} -> {os.readlink(name, dir_fd=dirfd)}")
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise AssertionError(f"special node in the destination ({_kind(mode)}): {where}")
        if mode & stat.S_ISUID or (mode & stat.S_ISGID and not stat.S_ISDIR(mode)):
            raise AssertionError(f"set-id node in the destination ({stat.filemode(mode)}): {where}")
        if (st.st_dev, st.st_ino) in outside:
            raise AssertionError(f"hard link to an outside inode in the destination: {where}")


def classify_failure(exc: BaseException, *, host_paths: Iterable[str] = ()) -> bool:
    """Return True when ``exc`` is an allowed way for an operation on hostile input to fail.

    Allowed: a :class:`~sandbox_fs.errors.SandboxError`, or an ``OSError``
    whose errno is in :data:`ALLOWED_ERRNOS` and whose ``filename`` is the
    sandbox path (set, and not a host path).  In both cases no text of the
    exception may contain one of ``host_paths`` (DESIGN.md "Errors": messages
    name sandbox paths, never host paths).  Anything else (``TypeError``,
    ``KeyError``, an OSError without a path or with another errno, an
    ``AssertionError``) is a finding: return False.

    Args:
        exc: the exception the operation raised.
        host_paths: host directories (``str``) the test used (its base
            directory, workspace, sentinel); empty values are ignored.
    """
    from ..errors import SandboxError  # noqa: PLC0415  (the plugin imports this module before the library)

    hosts = [h for h in host_paths if h]
    texts = [str(exc)]
    if isinstance(exc, SandboxError):
        return not any(h in t for h in hosts for t in texts)
    if not isinstance(exc, OSError) or exc.errno not in ALLOWED_ERRNOS:
        return False
    filename = exc.filename
    if not isinstance(filename, str) or not filename:
        return False
    texts.append(filename)
    return not any(h in t for h in hosts for t in texts)
