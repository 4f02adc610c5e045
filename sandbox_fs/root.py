"""``Root``: the capability object, the one door to a directory tree.

A :class:`Root` holds one ``O_PATH|O_DIRECTORY`` file descriptor.  Every
method resolves its *relative* POSIX path beneath that fd in the kernel
(``openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)``, or the fallback
walker that gives the same answers); operations on a *name* act on the last
component through an fd of its parent, without following it.  So ``..``,
absolute paths, symlinks pointing out, magic links and directories swapped
for symlinks between two calls cannot reach outside: an escape raises
:class:`PathEscapeError` (EXDEV), a refused symlink
:class:`SymlinkRefusedError` (ELOOP); escapes are never silently clamped.

This module is the public face (:class:`Root`, :class:`Subtree`, the
host-path functions).  The engines sit beside it: ``_root_copy`` (the
batched :meth:`Root.copy_files_from`), ``_root_remove`` (``rmdir`` checks,
``rmtree``, ``clear``) and ``_root_walk`` (the fd walk, the internal
contract for the package's bulk callers).  ``Root``'s ``_``-prefixed members
are internal to these modules (``tests/test_layering.py`` checks it).

Rule for the whole codebase: nothing outside this module and ``_native.py``
passes a workspace or host-source path string to ``os``, ``shutil``,
``open`` or ``pathlib`` for I/O.

Thread-safety: every method may be called from several threads at once.
``close()`` never closes the fd under an in-flight call (the last call out
closes it), so a closed Root can never act on a reused fd number.  The
pinning relies on the GIL (atomic ``list.append``/``list.pop``); a
free-threaded build would need a lock there.
"""

from __future__ import annotations

import errno
import io
import os
import stat as _stat
from dataclasses import dataclass
from typing import IO, Any, Callable, Iterable, Iterator, NamedTuple

from . import _hooks, _native
from ._root_handle import Handle
from ._root_walk import walk_dirs
from .errors import (
    InvalidArgumentError,
    InvalidPathError,
    PathEscapeError,
    ReadOnlyError,
    SandboxError,
    SandboxOSError,
    SymlinkRefusedError,
    WorkspaceClosedError,
    DirectoryReplacedError,
)

__all__ = ["Root", "Subtree", "Handle", "CopyItem", "open_root", "open_host_dir_fd", "open_host_file_fd", "open_host_device_fd",
           "write_host_file_atomic", "is_beneath",
           "UnsafeModeError", "SpecialFileError", "display_path", "DirEntry",
           "MAX_PATH_BYTES", "MAX_NAME_BYTES"]

MAX_PATH_BYTES = 4095  # PATH_MAX (4096) counts the terminating NUL
MAX_NAME_BYTES = 255  # NAME_MAX

_O_PATH = _native.O_PATH
_O_NOFOLLOW = os.O_NOFOLLOW
_O_NONBLOCK = os.O_NONBLOCK
_EINTR = errno.EINTR
_open_file: Callable[..., int] = _native.open_file
_open_member: Callable[..., int] = _native.open_member


def _retry_eintr(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    while True:
        try:
            return fn(*args, **kw)
        except InterruptedError:
            continue


_DIR_FLAGS = _O_PATH | os.O_DIRECTORY


def _via_proc(fn: Callable[..., Any], fd: int, *args: Any, **kw: Any) -> None:
    """``fn("/proc/self/fd/<fd>", ...)``: the magic link names exactly the inode ``fd`` refers to.

    Raises:
        OSError(EOPNOTSUPP): no usable /proc (never a FileNotFoundError, which
            callers would take for a vanished entry).
    """
    try:
        fn(f"/proc/self/fd/{fd}", *args, **kw)
    except FileNotFoundError:
        raise OSError(errno.EOPNOTSUPP, "changing an O_PATH fd's inode needs /proc/self/fd") from None


def fd_chmod(fd: int, mode: int) -> None:
    """``fchmod`` of the inode ``fd`` refers to, an ``O_PATH`` fd included (never a lookup by name).

    An ``O_PATH`` fd refuses ``fchmod`` (EBADF); it is then changed with
    ``fchmodat2(fd, "", mode, AT_EMPTY_PATH)`` (Linux 6.6).  Only on a kernel
    without fchmodat2 (ENOSYS) does its ``/proc/self/fd`` magic link name the
    inode instead (what glibc's ``fchmodat(AT_EMPTY_PATH)`` does).

    Raises:
        OSError: the change failed (EPERM ...; EOPNOTSUPP on a symlink, or on
            an old kernel without /proc).
    """
    try:
        os.fchmod(fd, mode)
    except OSError as exc:
        if exc.errno != errno.EBADF:
            raise
        ret = _native.fchmod_empty(fd, mode)
        if ret == -errno.ENOSYS:
            _via_proc(os.chmod, fd, mode)
        elif ret < 0:
            raise OSError(-ret, os.strerror(-ret)) from None


def fd_chown(fd: int, owner: tuple[int, int]) -> None:
    """``fchown`` of the inode ``fd`` refers to, an ``O_PATH`` fd included (never a lookup by name).

    An ``O_PATH`` fd refuses ``fchown`` (EBADF); it is then changed with
    ``fchownat(fd, "", AT_EMPTY_PATH|AT_SYMLINK_NOFOLLOW)`` (a symlink's own
    owner, never its target's).

    Raises:
        OSError: the change failed (EPERM without the privilege ...).
    """
    try:
        os.fchown(fd, owner[0], owner[1])
    except OSError as exc:
        if exc.errno != errno.EBADF:
            raise
        _native.fchown_fd(fd, owner, "chown", None)


#: the largest uid/gid ``fchown`` takes as an id: 2**32 - 1 is (uid_t)-1, "leave unchanged"
MAX_OWNER_ID = (1 << 32) - 2


def check_owner(owner: Any) -> tuple[int, int] | None:
    """Validate a Root ``owner``: None, or ``(uid, gid)`` of ints in 0 .. :data:`MAX_OWNER_ID`.

    Raises:
        InvalidArgumentError: anything else (-1 and 2**32 - 1 would mean
            "leave unchanged" to ``fchown``, so they are never an owner).
    """
    if owner is None:
        return None
    if (not isinstance(owner, tuple) or len(owner) != 2
            or not all(type(i) is int and 0 <= i <= MAX_OWNER_ID for i in owner)):
        raise InvalidArgumentError(f"owner must be None or (uid, gid), ints in 0 .. {MAX_OWNER_ID}",
                                   sandbox_path=None)
    return owner


def fd_set_times(fd: int, ns: int) -> None:
    """Set atime and mtime (nanoseconds) of the inode ``fd`` refers to, an ``O_PATH`` fd included.

    ``utimensat(fd, "", AT_EMPTY_PATH)``; on a kernel without that for
    utimensat (EINVAL), the ``/proc/self/fd`` magic link of a non-symlink.
    """
    try:
        _native.set_times_fd(fd, ns, "utime", None)
    except OSError as exc:
        if exc.errno != errno.EINVAL or _stat.S_ISLNK(os.fstat(fd).st_mode):
            raise
        _via_proc(os.utime, fd, ns=(ns, ns))
_COPY_UNBOUNDED = (1 << 62)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_O_TMPFILE = _native.O_TMPFILE


class SpecialFileError(SandboxOSError):
    """A FIFO, socket or device was met where only files and directories are opened.

    Opening a FIFO blocks until a writer appears, and devices have side
    effects on open: both are refused without blocking (PEP 706's data
    filter refuses special files for the same reason).
    """

    code = "special_file"
    errno_value = errno.EINVAL


class UnsafeModeError(SandboxError, ValueError):
    """A mode outside 0o777 (setuid, setgid, sticky or a file type) was asked for."""

    code = "unsafe_mode"


@dataclass(frozen=True)
class DirEntry:
    """One entry of :meth:`Root.scandir`.

    Attributes:
        name: the entry name (``str``, surrogate-escaped if not UTF-8).
        path: the sandbox path relative to the Root.
        kind: ``"file" | "dir" | "symlink" | "fifo" | "socket" | "char" | "block" | "unknown"``.
        stat: the ``lstat`` result (never follows a symlink).
    """

    name: str
    path: str
    kind: str
    stat: os.stat_result

    def is_dir(self) -> bool:
        return self.kind == "dir"

    def is_file(self) -> bool:
        return self.kind == "file"

    def is_symlink(self) -> bool:
        return self.kind == "symlink"


_KIND_NAMES = {_stat.S_IFREG: "file", _stat.S_IFDIR: "dir", _stat.S_IFLNK: "symlink", _stat.S_IFIFO: "fifo",
               _stat.S_IFSOCK: "socket", _stat.S_IFCHR: "char", _stat.S_IFBLK: "block"}


def kind_of(mode: int) -> str:
    """Map an ``st_mode`` to the names used by :class:`DirEntry` (``"unknown"`` for any other type)."""
    return _KIND_NAMES.get(_stat.S_IFMT(mode), "unknown")


_CONTROL = {i: f"\\x{i:02x}" for i in list(range(0x20)) + [0x7F]}


def display_path(text: str, limit: int = 200) -> str:
    """An untrusted path made safe for one log line: control characters
    escaped, surrogates shown as ``\\udcXX``, truncated to ``limit`` characters."""
    out = text.translate(_CONTROL).encode("utf-8", "backslashreplace").decode("utf-8")
    return out if len(out) <= limit else out[:limit] + "..."


class CopyItem(NamedTuple):
    """One file for :meth:`Root.copy_files_from`.

    A plain 5-tuple in this order is accepted too.
    """

    src: str
    """Relative sandbox path in the source Root."""
    dst: str
    """Relative sandbox path in the destination Root."""
    mode: int
    """Permission bits within 0o777, set exactly (the umask never applies)."""
    mtime_ns: int | None
    """The mtime (and atime) to set, nanoseconds since the epoch; None: left as the copy makes it."""
    ident: tuple[int, int] | None
    """The source's expected ``(st_dev, st_ino)``; None: no identity check."""


def _check_mode(mode: int, sandbox_path: str | None) -> int:
    if not isinstance(mode, int) or mode < 0 or mode & ~0o777:
        raise UnsafeModeError(
            f"mode {mode!r} is outside 0o777; setuid, setgid and sticky bits are never set",
            sandbox_path=sandbox_path,
        )
    return mode


class _FdUse:
    """Keeps the Root's fd alive for the duration of one call."""

    __slots__ = ("root",)

    def __init__(self, root: "Root") -> None:
        self.root = root

    def __enter__(self) -> int:
        return self.root._acquire()

    def __exit__(self, *exc: object) -> None:
        self.root._release()


class Root:
    """A capability on a directory tree.  Create with :func:`open_root`.

    A Root owns the directory fd it is made on, also when making it fails
    (the fd is closed before the error propagates).

    Paths given to methods are relative POSIX paths (``str`` or ``bytes``);
    ``""`` and ``"."`` name the root itself.  Symlinks *inside* the tree are
    followed by reads when they stay beneath the root; writes never follow a
    leaf symlink.  A Root made with ``no_symlinks=True`` refuses every
    symlink on every path (``RESOLVE_NO_SYMLINKS``).

    Ownership: a Root made with ``owner=(uid, gid)`` gives every entry it
    *creates* that owner, through the fd of the new object, before it is
    linked under its final name where a temporary name is used (files from
    :meth:`atomic_write` and :meth:`copy_files_from`), right after it is made
    otherwise (:meth:`open_fd`/:meth:`open` when the call created the file,
    :meth:`mkdir`, :meth:`symlink`); never by name, so a name swapped
    meanwhile for a hard link to a file outside never gives that file away.
    Existing entries, hard links (:meth:`link`: no new inode) and renames are
    left alone.  The owner is inherited by child Roots (:meth:`open_root`,
    :meth:`with_options`), so everything built on the Root (extraction,
    materialize, hydrate, :class:`Subtree`) creates with it.  ``owner=None``
    leaves entries as the process makes them.  Changing an owner needs the
    privilege (``CAP_CHOWN``): without it creates fail with PermissionError
    (EPERM), and what the failing call made is removed where it can tell it
    is its own.

    Errors (for every method, besides the ones listed per method):
        PathEscapeError: the path, or a symlink on it, resolves outside the root.
        SymlinkRefusedError: a symlink where none is allowed, or > 40 hops.
        InvalidPathError: NUL byte, a component over 255 bytes, a path over
            4096 bytes, or a name operation on ``""``, ``"."`` or ``".."``.
        ReadOnlyError: a write through a read-only Root.
        WorkspaceClosedError: use after :meth:`close`.
        OSError: the matching subclass (``FileNotFoundError`` ...) with
            ``filename`` set to the sandbox path, never a host path.
    """

    __slots__ = ("_closing", "_deny", "_fallback", "_fd_while_open", "_inflight", "_label",
                 "_resolve", "_root_id", "no_symlinks", "owner", "read_only", "resolver", "__weakref__")

    def __init__(self, _fd: int, *, read_only: bool, no_symlinks: bool, resolver: str,
                 label: str, deny_write_ids: frozenset[tuple[int, int]] = frozenset(),
                 owner: tuple[int, int] | None = None) -> None:
        # fd pinning without a lock on the hot path (relies on the GIL making
        # list.append / list.pop atomic): a call appends to _inflight *before*
        # reading the fd; close() sets _closing *before* looking at _inflight;
        # the fd is taken out of _fd_while_open (the one-element list holding it
        # until the close) by exactly one pop, then closed.
        self._fd_while_open = [_fd]
        self._inflight: list[None] = []
        self._closing = False
        self.read_only = read_only
        self.no_symlinks = no_symlinks
        self.resolver = resolver
        self._label = label
        #: ``(uid, gid)`` given to every entry this Root creates, or None (see the class docstring)
        self.owner = owner
        # Identities (st_dev, st_ino) of directories this Root must never
        # write into (read-only grants nested in it), checked on the fds a
        # write actually uses.
        self._deny = frozenset(deny_write_ids)
        try:
            st = os.fstat(_fd)
        except BaseException:
            # The Root owns ``_fd`` from the call on, also when it is never made (every caller hands
            # over a fd it made for it: a dup, an open).  Closed now: left to __del__, an EIO here
            # (fstat through the FUSE overlay) kept the fd open for as long as the traceback's frames
            # lived, until a garbage collection (the overlay fault suite's "an fd was left open").
            self._final_close()
            raise
        self._root_id = (st.st_dev, st.st_ino)
        self._resolve = (_native.RESOLVE_BENEATH | _native.RESOLVE_NO_MAGICLINKS |
                         (_native.RESOLVE_NO_SYMLINKS if no_symlinks else 0))
        self._fallback = 1 if resolver == "fallback" else 0

    # ------------------------------------------------------------------ basics

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("ro" if self.read_only else "rw")
        return f"<Root {self._label or '.'!s} {state} resolver={self.resolver}>"

    @property
    def closed(self) -> bool:
        return self._closing or not self._fd_while_open

    @property
    def label(self) -> str:
        """The sandbox path this Root was opened at, as errors show it (``""`` for a top-level Root)."""
        return self._label

    @property
    def _fd(self) -> int:
        box = self._fd_while_open
        return box[0] if box else -1

    def _acquire(self) -> int:
        self._inflight.append(None)
        if not self._closing:
            try:
                return self._fd_while_open[0]
            except IndexError:
                pass
        self._release()
        raise WorkspaceClosedError("this Root is closed", sandbox_path=self._label or ".")

    def _release(self) -> None:
        self._inflight.pop()
        if self._closing and not self._inflight:
            self._final_close()

    def _final_close(self) -> None:
        try:
            fd = self._fd_while_open.pop()
        except IndexError:
            return
        os.close(fd)

    def close(self) -> None:
        """Release the directory fd.  Idempotent; in-flight calls finish first.

        Raises:
            OSError(EBADF): other code closed the fd behind the Root's back.
        """
        self._closing = True
        if not self._inflight:
            self._final_close()

    def __enter__(self) -> "Root":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            if not self._inflight:
                self._final_close()
        except Exception:
            pass

    def _use(self) -> _FdUse:
        return _FdUse(self)

    @property
    def identity(self) -> tuple[int, int]:
        """``(st_dev, st_ino)`` of the root directory."""
        return self._root_id

    def set_dir_meta(self, path: str | bytes, *, mode: int | None = None, mtime_ns: int | None = None,
                     owner: tuple[int, int] | None = None) -> None:
        """Set a *directory*'s owner, mode and mtime through an fd of it, never by name.

        The directory is opened ``O_RDONLY|O_DIRECTORY|O_NOFOLLOW`` beneath
        the root and changed with ``fchown``/``fchmod``/``futimens`` on that
        fd (write guard checked on it).  A directory cannot be a hard link, so
        a name another process swaps for a hard link to a file outside (or for
        a symlink) is refused, never changed, which :meth:`chmod` by name
        cannot promise.

        Args:
            mode: permission bits within 0o777; mtime_ns: atime and mtime, in
                nanoseconds; owner: ``(uid, gid)`` (needs the privilege).

        Raises:
            NotADirectoryError: ``path`` is not a directory (a symlink or a
                hard link swapped in included).
            UnsafeModeError: ``mode`` outside 0o777.
            ReadOnlyError: a read-only Root, or a read-only grant.
            OSError: ``fchown``/``fchmod``/``futimens`` failed (operation
                ``set_dir_meta``, sandbox path only).
            FileNotFoundError: ``path`` is missing.
            PathEscapeError, SymlinkRefusedError, InvalidPathError, WorkspaceClosedError: see :class:`Root`.
        """
        rel = self._rel(path)
        if mode is not None:
            self._check_mode_of(mode, rel)
        # O_PATH only when its owner took away its own read permission (0o100): it needs
        # no permission on the directory itself, yet names exactly this inode.
        try:
            fd = self.open_fd(rel, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except PermissionError:
            fd = self.open_fd(rel, _O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            self.check_write_fd(fd, rel)
            try:
                if owner is not None:
                    fd_chown(fd, owner)
                if mode is not None:
                    fd_chmod(fd, mode)
                if mtime_ns is not None:
                    fd_set_times(fd, mtime_ns)
            except OSError as exc:
                self._oserror(exc, "set_dir_meta", rel)
        finally:
            os.close(fd)

    def check_write_fd(self, fd: int, path: str | bytes) -> None:
        """Refuse a change made through ``fd``, a directory opened beneath this Root at ``path``, where writes are denied.

        For callers that change a directory's metadata through its own fd
        (``fchmod``/``fchown``/``futimens``), never by name: the same rules as
        the Root's own writes, checked on the fd.

        Raises:
            ReadOnlyError: this Root is read-only, or ``fd`` is (or is beneath)
                a read-only grant nested in it.
            OSError: ``fd`` or a directory above it cannot be examined (EBADF ...).
            InvalidPathError, PathEscapeError: ``path`` is not a valid relative path.
        """
        rel = self._rel(path)
        self._check_writable(rel, "write")
        if self._deny:
            self._check_write_target(fd, None, rel, False)

    @property
    def denies_writes(self) -> bool:
        """True when read-only directories (grants) nested in this Root are refused to writes."""
        return bool(self._deny)

    def fileno_dup(self) -> int:
        """Return a new O_CLOEXEC duplicate of the root's O_PATH fd (caller closes it).

        Raises:
            WorkspaceClosedError: the Root is closed.
            OSError(EMFILE): the process has no free fd.
        """
        with self._use() as fd:
            return os.dup(fd)

    # ---------------------------------------------------------------- helpers

    def _show(self, rel: bytes | str) -> str:
        text = rel if isinstance(rel, str) else os.fsdecode(rel)
        text = text.strip("/") if text not in ("", ".") else ""
        if self._label and text:
            text = f"{self._label}/{text}"
        return display_path(text or self._label or ".")

    def _rel(self, path: str | bytes | os.PathLike[Any]) -> bytes:
        """Validate a relative path and return it as bytes (fast path first)."""
        t = type(path)
        if t is str:
            b = path.encode("utf-8", "surrogateescape")  # type: ignore[union-attr]
        elif t is bytes:
            b = path
        else:
            return self._rel_slow(path)
        if not b:
            return b"."
        if len(b) > MAX_NAME_BYTES or b"\0" in b or b[0] == 47:  # 47 == "/"
            return self._rel_slow(b)
        return b

    def _rel_slow(self, path: str | bytes | os.PathLike[Any]) -> bytes:
        if isinstance(path, os.PathLike):
            path = os.fspath(path)
        if isinstance(path, str):
            b = os.fsencode(path)
        elif isinstance(path, bytes):
            b = path
        else:
            raise TypeError(f"path must be str or bytes, not {type(path).__name__}")
        if b"\0" in b:
            raise InvalidPathError("path contains a NUL byte", sandbox_path=self._show(b.replace(b"\0", b"")))
        if len(b) > MAX_PATH_BYTES:
            raise InvalidPathError(f"path is over {MAX_PATH_BYTES} bytes", sandbox_path=self._show(b[:64]) + "...")
        for comp in b.split(b"/"):
            if len(comp) > MAX_NAME_BYTES:
                raise InvalidPathError(f"a path component is over {MAX_NAME_BYTES} bytes",
                                       sandbox_path=self._show(comp[:64]) + "...")
        if b.startswith(b"/"):
            raise PathEscapeError("absolute paths are not beneath the root", sandbox_path=os.fsdecode(b),
                                  context={"operation": "resolve"})
        return b if b else b"."

    def _split(self, rel: bytes, op: str = "", dir_op: bool = False) -> tuple[bytes, bytes]:
        stripped = rel.rstrip(b"/")
        if not stripped:
            raise InvalidPathError("this operation needs a name, not the root itself", sandbox_path=self._show(rel))
        parent, _, leaf = stripped.rpartition(b"/")
        if leaf in (b".", b".."):
            raise InvalidPathError("the last component may not be '.' or '..'", sandbox_path=self._show(rel))
        if not dir_op and len(stripped) != len(rel):
            # "name/" names a directory: never a file operation (as open(2)).
            _native.raise_errno(errno.ENOTDIR, op or "resolve", self._show(rel))
        return (parent or b"."), leaf

    def _resolve_flags(self) -> int:
        return _native.RESOLVE_NO_SYMLINKS if self.no_symlinks else 0

    def _check_mode_of(self, mode: int, rel: bytes) -> None:
        """``_check_mode`` of ``mode`` for ``rel`` (its sandbox path is formatted only for the error)."""
        if not isinstance(mode, int) or mode < 0 or mode & ~0o777:
            _check_mode(mode, self._show(rel))

    def _open_fd(self, rootfd: int, rel: bytes, flags: int, mode: int, op: str, extra_resolve: int = 0) -> int:
        ret = _native.open_beneath_ret(self.resolver, rootfd, rel, flags, mode, self._resolve_flags() | extra_resolve)
        if ret < 0:
            _native.raise_errno(-ret, op, self._show(rel))
        return ret

    def _check_writable(self, rel: bytes, op: str) -> None:
        if self.read_only:
            raise ReadOnlyError(f"{op}: this root is read-only", sandbox_path=self._show(rel),
                                context={"operation": op})

    def _open_parent(self, rootfd: int, rel: bytes, op: str, write: bool, *,
                     dir_op: bool = False, inplace: bool = False) -> tuple[int, bytes]:
        """Open the parent of ``rel`` (O_PATH dir fd) and return it with the leaf name.

        For writes through a Root with read-only directories nested in it,
        the parent's ancestry and the leaf itself are checked on the fd
        that the operation will use (see :meth:`_check_write_target`).
        """
        parent, leaf = self._split(rel, op, dir_op)
        if write:
            self._check_writable(rel, op)
        pfd = self._open_fd(rootfd, parent, _DIR_FLAGS, 0, op)
        if _hooks.current is not None:
            _hooks.fire("root.parent", root=self, path=rel, op=op, parent_fd=pfd)
        if write and self._deny:
            try:
                self._check_write_target(pfd, leaf, rel, inplace)
            except BaseException:
                os.close(pfd)
                raise
        return pfd, leaf

    def _check_write_target(self, pfd: int, leaf: bytes | None, rel: bytes, inplace: bool) -> None:
        """Refuse a write that would land in a denied (read-only) directory.

        Checks, on fds: every directory from ``pfd`` up to this Root's own
        directory; the leaf itself when it is a denied directory; and, for
        in-place changes (open for write, chmod, utime), a regular file with
        more than one link, which could be a hard link into a denied tree.
        """
        shown = self._show(rel)
        cur = os.dup(pfd)
        try:
            for _ in range(MAX_PATH_BYTES):
                st = os.fstat(cur)
                ident = (st.st_dev, st.st_ino)
                if ident in self._deny:
                    raise ReadOnlyError("write beneath a read-only grant", sandbox_path=shown)
                if ident == self._root_id:
                    break
                up = os.open("..", _DIR_FLAGS | os.O_CLOEXEC, dir_fd=cur)
                ust = os.fstat(up)
                os.close(cur)
                cur = up
                if (ust.st_dev, ust.st_ino) == ident:
                    break  # reached "/" without meeting our root: moved out, nothing denied above
        finally:
            os.close(cur)
        if leaf is None:
            return
        try:
            lst = os.stat(leaf, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if (lst.st_dev, lst.st_ino) in self._deny:
            raise ReadOnlyError("this directory is a read-only grant", sandbox_path=shown)
        if inplace and _stat.S_ISREG(lst.st_mode) and lst.st_nlink > 1:
            raise ReadOnlyError("in-place change of a multiply-linked file where read-only grants are "
                                "nested (it could be a hard link into one)", sandbox_path=shown)

    def _oserror(self, exc: OSError, op: str, rel: bytes) -> None:
        """Re-raise an OSError from ``os`` with the sandbox path, never a host path."""
        if isinstance(exc, SandboxError):
            raise exc
        _native.raise_errno(exc.errno or errno.EIO, op, self._show(rel))

    # ------------------------------------------------------------------ opening

    def open_fd(self, path: str | bytes, flags: int = os.O_RDONLY, mode: int = 0o644, *,
                follow_symlinks: bool = True, allow_special: bool = False) -> int:
        """Open ``path`` beneath the root and return a raw O_CLOEXEC fd (caller closes it).

        FIFOs, sockets and devices are refused without blocking: the open is
        done with ``O_NONBLOCK`` and ``fstat``-checked (O_NONBLOCK is then
        cleared unless asked for).  ``O_PATH`` opens are not checked (they
        cannot read or write).

        Args:
            path: relative sandbox path.
            flags: ``os.O_*`` flags.  Flags that write or create need a
                writable Root and never follow a leaf symlink.
            mode: permission bits for a created file, within 0o777 (the
                umask applies, as with ``os.open``; use :meth:`open` or
                :meth:`atomic_write` for an exact mode).
            follow_symlinks: False adds ``O_NOFOLLOW`` on the leaf.
            allow_special: open FIFOs, sockets and devices too.

        Owner: with a Root ``owner``, a file this call creates (``O_CREAT``
        that made it, ``O_CREAT|O_EXCL``, ``O_TMPFILE``) is given it with
        ``fchown`` of the returned fd before the fd is returned; an existing
        file opened with ``O_CREAT`` is left alone (without ``O_EXCL`` the
        create is tried with ``O_EXCL`` first, then the open without
        ``O_CREAT``, so the call knows which happened).

        Raises:
            SpecialFileError: ``path`` is a FIFO, socket or device.
            PermissionError: the owner could not be given (EPERM without the
                privilege); the file this call created is removed.  Also EACCES.
            UnsafeModeError: ``mode`` outside 0o777.
            ReadOnlyError: write or create flags on a read-only Root, or
                beneath a read-only grant.
            FileNotFoundError, FileExistsError, IsADirectoryError,
                NotADirectoryError: as ``open(2)`` for those flags.
            OSError: any other failure, ``filename`` the sandbox path.
            PathEscapeError, SymlinkRefusedError, InvalidPathError, WorkspaceClosedError: see :class:`Root`.
        """
        if type(path) is str and not flags & _WRITE_FLAGS and 0 <= mode <= 0o777:
            # Hot path for reads: validate inline, pin the fd, one native call.
            rel = path.encode("utf-8", "surrogateescape")
            # (O_TMPFILE needs O_WRONLY/O_RDWR, so it never takes this path.)
            if rel and len(rel) <= MAX_NAME_BYTES and rel[0] != 47 and b"\0" not in rel:
                if not follow_symlinks:
                    flags |= _O_NOFOLLOW
                # _acquire/_release inlined: this is the hottest path.
                inflight = self._inflight
                inflight.append(None)
                try:
                    box = self._fd_while_open
                    if self._closing or not box:
                        raise WorkspaceClosedError("this Root is closed", sandbox_path=self._label or ".")
                    ret = _open_file(box[0], rel, flags, mode, self._resolve, self._fallback, allow_special)
                except IndexError:  # closed between the check and the read of the box
                    raise WorkspaceClosedError("this Root is closed", sandbox_path=self._label or ".") from None
                finally:
                    inflight.pop()
                    if self._closing and not inflight:
                        self._final_close()
                if ret < 0:
                    if ret == -_EINTR:
                        return self._open_read(rel, flags, mode, allow_special)
                    self._open_failed(-ret, rel)
                return ret
        rel = self._rel(path)
        writes = flags & _WRITE_FLAGS or (flags & _O_TMPFILE) == _O_TMPFILE
        if mode & ~0o777 or mode < 0:
            _check_mode(mode, self._show(rel))
        if writes:
            return self._open_write(rel, flags, mode, allow_special)
        if not follow_symlinks:
            flags |= _O_NOFOLLOW
        return self._open_read(rel, flags, mode, allow_special)

    def _open_write(self, rel: bytes, flags: int, mode: int, allow_special: bool) -> int:
        """:meth:`open_fd` with flags that write or create.

        Opens the parent beneath the root, checks it (read-only grants), then
        opens the leaf relative to that very fd without following it: nothing
        can be swapped between check and use.
        """
        inplace = bool(flags & (os.O_WRONLY | os.O_RDWR))
        tmpfile = (flags & _O_TMPFILE) == _O_TMPFILE
        with self._use() as rootfd:
            pfd, leaf = self._open_parent(rootfd, rel, "open", write=True, inplace=inplace, dir_op=tmpfile)
            try:
                if self.owner is not None and (flags & os.O_CREAT or tmpfile):
                    fd = self._open_owned(pfd, leaf, rel, flags, mode, tmpfile)
                else:
                    fd = _retry_eintr(os.open, leaf, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                                      mode, dir_fd=pfd)
            except OSError as exc:
                self._oserror(exc, "open", rel)
                raise  # unreachable
            finally:
                os.close(pfd)
        return self._checked(fd, rel, flags, allow_special)

    def _open_owned(self, pfd: int, leaf: bytes, rel: bytes, flags: int, mode: int, tmpfile: bool) -> int:
        """:meth:`open_fd`'s leaf open for a Root with an owner: a file this call creates gets it through its fd.

        ``O_CREAT`` without ``O_EXCL`` is tried as ``O_EXCL`` (created: ours),
        then without ``O_CREAT`` (an existing file: left alone), as long as
        a racer keeps removing and re-making the name (bounded).
        """
        assert self.owner is not None
        base = flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        fd: int
        for _ in range(100):
            if tmpfile or flags & os.O_EXCL:
                fd, made = _retry_eintr(os.open, leaf, base, mode, dir_fd=pfd), True
            else:
                try:
                    fd, made = _retry_eintr(os.open, leaf, base | os.O_EXCL, mode, dir_fd=pfd), True
                except FileExistsError:
                    try:
                        fd, made = _retry_eintr(os.open, leaf, base & ~os.O_CREAT, mode, dir_fd=pfd), False
                    except FileNotFoundError:
                        continue  # removed meanwhile: try creating again
            if made:
                try:
                    os.fchown(fd, self.owner[0], self.owner[1])
                except BaseException:
                    st = os.fstat(fd)
                    os.close(fd)
                    if not tmpfile:
                        self._unlink_made(pfd, leaf, (st.st_dev, st.st_ino))
                    raise
            return fd
        raise OSError(errno.EAGAIN, "open: the name was removed and re-made too often")

    @staticmethod
    def _unlink_made(pfd: int, leaf: bytes, ident: tuple[int, int]) -> None:
        """Best effort: remove ``leaf`` of ``pfd``, a file this call just made, only while the name is still it."""
        try:
            st = os.stat(leaf, dir_fd=pfd, follow_symlinks=False)
            if (st.st_dev, st.st_ino) == ident:
                os.unlink(leaf, dir_fd=pfd)
        except OSError:
            pass

    def _open_read(self, rel: bytes, flags: int, mode: int, allow_special: bool) -> int:
        # One native call: open with O_NONBLOCK, fstat, refuse special files
        # (-ENXIO), restore blocking mode.
        rootfd = self._acquire()
        try:
            ret = _open_file(rootfd, rel, flags, mode, self._resolve, self._fallback, allow_special)
            while ret == -_EINTR:  # signal handlers ran; retry (PEP 475)
                ret = _open_file(rootfd, rel, flags, mode, self._resolve, self._fallback, allow_special)
        finally:
            self._release()
        if ret < 0:
            self._open_failed(-ret, rel)
        return ret

    def open_member_fd(self, path: str, flags: int, probe: bool, out: Any) -> int:
        """Open a file for reading as :meth:`open_fd` with ``follow_symlinks=False`` does, and ``fstat`` it.

        One native call (``sfs_open_member``) for a walk that opens and
        checks many files (persist): the open beneath the root with this
        Root's resolve flags and ``O_NOFOLLOW | O_NONBLOCK``, the refusal of a
        FIFO, socket or device, then the ``fstat`` of the new fd, and with
        ``probe`` a read-lease probe of a regular file; the caller checks
        the inode and type it reads in ``out`` before it uses the fd.

        Args:
            path: relative sandbox path.
            flags: ``os.O_*`` read flags (never ``O_PATH``, nor flags that write or create).
            probe: also probe whether the file may be open for writing anywhere.
            out: an ``int64_t[_native.MEMBER_FIELDS]`` (``_native.ffi``) it fills: ``st_mode, st_ino,
                st_dev, st_nlink, st_size``, the mtime's seconds and nanoseconds and the ctime's, of
                the fd, then 0 when the probe found the file open for writing nowhere, else 1 (see
                ``sfs_open_member``).

        Returns:
            The new O_CLOEXEC fd (caller closes it).

        Raises:
            SpecialFileError: ``path`` is a FIFO, socket or device.
            InvalidArgumentError: ``flags`` write, create or are ``O_PATH``.
            FileNotFoundError, NotADirectoryError, PermissionError, OSError: as :meth:`open_fd`.
            PathEscapeError, SymlinkRefusedError, InvalidPathError, WorkspaceClosedError: see :class:`Root`.
        """
        if flags & (_WRITE_FLAGS | os.O_PATH) or (flags & _O_TMPFILE) == _O_TMPFILE:
            raise InvalidArgumentError("open_member_fd opens for reading only", sandbox_path=self._show(path),
                                       context={"operation": "open"})
        rel = self._rel(path)
        flags |= _O_NOFOLLOW
        rootfd = self._acquire()
        try:
            ret = _open_member(rootfd, rel, flags, self._resolve, self._fallback, probe, out)
            while ret == -_EINTR:  # signal handlers ran; retry (PEP 475)
                ret = _open_member(rootfd, rel, flags, self._resolve, self._fallback, probe, out)
        finally:
            self._release()
        if ret < 0:
            self._open_failed(-ret, rel)
        return ret

    def _open_failed(self, err: int, rel: bytes) -> None:
        if err == errno.ENXIO:
            raise SpecialFileError("refusing to open a FIFO, socket or device: only regular files and "
                                   "directories are opened", sandbox_path=self._show(rel),
                                   context={"operation": "open"})
        _native.raise_errno(err, "open", self._show(rel))

    def _checked(self, fd: int, rel: bytes, flags: int, allow_special: bool) -> int:
        """Refuse special files on a freshly opened fd; restore blocking mode."""
        try:
            st = os.fstat(fd)
            if not allow_special and not (_stat.S_ISREG(st.st_mode) or _stat.S_ISDIR(st.st_mode)):
                raise SpecialFileError(f"refusing to open a {kind_of(st.st_mode)}: only regular files and "
                                       "directories are opened", sandbox_path=self._show(rel),
                                       context={"operation": "open", "kind": kind_of(st.st_mode)})
            if not flags & _O_NONBLOCK:
                os.set_blocking(fd, True)
            return fd
        except BaseException:
            os.close(fd)
            raise

    def open(self, path: str | bytes, mode: str = "r", *, buffering: int = -1,
             encoding: str | None = None, errors: str | None = None, newline: str | None = None,
             perm: int = 0o644) -> IO[Any]:
        """Open a file beneath the root like the builtin :func:`open`.

        Args:
            path: relative sandbox path.
            mode: ``"r" "rb" "w" "wb" "a" "ab" "x" "xb"`` with optional ``"+"``.
                Modes that write never follow a leaf symlink.
            perm: permission bits (within 0o777) of a created file; the umask
                is not applied.

        A file this call creates gets the Root's ``owner`` (if any) through
        its fd (see :meth:`open_fd`); an existing file keeps its owner.

        Returns:
            A binary or text file object over the opened fd.

        Raises:
            ValueError: ``mode`` is not one of the modes above.
            IsADirectoryError: ``path`` is a directory.
            UnsafeModeError: ``perm`` is outside 0o777.
            SpecialFileError: ``path`` is a FIFO, socket or device.
            FileNotFoundError: ``path`` is missing (reading), or its parent is.
            FileExistsError: ``"x"`` and ``path`` exists.
            ReadOnlyError: a writing mode on a read-only Root or beneath a read-only grant.
            PermissionError: EACCES, or the Root's ``owner`` could not be given
                (the file this call created is removed).
            OSError: any other failure, ``filename`` the sandbox path.
            PathEscapeError, SymlinkRefusedError, InvalidPathError, WorkspaceClosedError: see :class:`Root`.
        """
        m = set(mode)
        plus = "+" in m
        if "r" in m:
            flags = os.O_RDWR if plus else os.O_RDONLY
        elif "w" in m:
            flags = (os.O_RDWR if plus else os.O_WRONLY) | os.O_CREAT | os.O_TRUNC
        elif "a" in m:
            flags = (os.O_RDWR if plus else os.O_WRONLY) | os.O_CREAT | os.O_APPEND
        elif "x" in m:
            flags = (os.O_RDWR if plus else os.O_WRONLY) | os.O_CREAT | os.O_EXCL
        else:
            raise ValueError(f"invalid mode {mode!r}")
        _check_mode(perm, None)
        created = False
        if flags & os.O_CREAT and not flags & os.O_EXCL:
            # Learn whether we create the file (then its mode is exactly
            # ``perm``) or open an existing one (its mode is left alone).
            for _ in range(100):
                try:
                    fd = self.open_fd(path, flags | os.O_EXCL, perm)
                    created = True
                    break
                except FileExistsError:
                    pass
                try:
                    fd = self.open_fd(path, flags & ~os.O_CREAT, perm)
                    break
                except FileNotFoundError:
                    continue  # removed meanwhile: try creating again
            else:  # pragma: no cover - a tight create/delete race
                _native.raise_errno(errno.EAGAIN, "open", self._show(self._rel(path)))
        else:
            fd = self.open_fd(path, flags, perm)
            created = bool(flags & os.O_EXCL)
        try:
            st = os.fstat(fd)
            if _stat.S_ISDIR(st.st_mode):
                _native.raise_errno(errno.EISDIR, "open", self._show(self._rel(path)))
            if created and _stat.S_IMODE(st.st_mode) != perm:
                os.fchmod(fd, perm)  # explicit mode, never the umask's
            return io.open(fd, mode, buffering=buffering, encoding=encoding, errors=errors,
                           newline=newline, closefd=True)
        except BaseException:
            os.close(fd)
            raise

    def read_bytes(self, path: str | bytes, *, max_bytes: int | None = None) -> bytes:
        """Return the whole content of a regular file.

        Args:
            max_bytes: refuse files larger than this many bytes (None: no bound).

        Raises:
            OSError(EFBIG): the file holds more than ``max_bytes``.
            IsADirectoryError: ``path`` is a directory.
            SpecialFileError: ``path`` is a FIFO, socket or device (never read).
            FileNotFoundError, NotADirectoryError: ``path`` or a directory on it
                is missing, or a component is not a directory.
            PermissionError: EACCES on the file or a directory on its path.
            OSError: any other open or read failure, ``filename`` the sandbox path.
            PathEscapeError, SymlinkRefusedError, InvalidPathError, WorkspaceClosedError: see :class:`Root`.
        """
        fd = self.open_fd(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not _stat.S_ISREG(st.st_mode):
                _native.raise_errno(errno.EISDIR if _stat.S_ISDIR(st.st_mode) else errno.EINVAL,
                                    "read", self._show(self._rel(path)))
            chunks = []
            total = 0
            while True:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                total += len(chunk)
                if max_bytes is not None and total > max_bytes:
                    _native.raise_errno(errno.EFBIG, "read", self._show(self._rel(path)))
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def read_text(self, path: str | bytes, *, encoding: str = "utf-8", max_bytes: int | None = None) -> str:
        """Return the content of a regular file decoded with ``encoding``.

        Raises:
            UnicodeDecodeError: the content is not valid ``encoding``.
            LookupError: ``encoding`` is unknown.
            OSError(EFBIG), IsADirectoryError, SpecialFileError,
                FileNotFoundError, NotADirectoryError, PermissionError, OSError,
                PathEscapeError, SymlinkRefusedError, InvalidPathError,
                WorkspaceClosedError: as :meth:`read_bytes`.
        """
        return self.read_bytes(path, max_bytes=max_bytes).decode(encoding)

    # ------------------------------------------------------------------ writing

    def write_bytes(self, path: str | bytes, data: bytes | bytearray | memoryview, *,
                    mode: int = 0o644, fsync: bool = True) -> int:
        """Atomically replace ``path`` with ``data`` (see :meth:`atomic_write`); returns bytes written.

        Raises:
            UnsafeModeError: ``mode`` outside 0o777.
            ReadOnlyError: a read-only Root, or ``path`` beneath a read-only grant.
            IsADirectoryError: ``path`` is an existing directory.
            FileNotFoundError, NotADirectoryError: the parent directory is
                missing or not a directory.
            PermissionError: EACCES on the parent, or the Root's ``owner``
                could not be given (nothing is left behind).
            OSError: any other failure (ENOSPC ...), ``filename`` the sandbox path.
            PathEscapeError, SymlinkRefusedError, InvalidPathError, WorkspaceClosedError: see :class:`Root`.
        """
        return self.atomic_write(path, data, mode=mode, fsync=fsync)

    def write_text(self, path: str | bytes, text: str, *, encoding: str = "utf-8", mode: int = 0o644) -> int:
        """Atomically replace ``path`` with ``text`` encoded as ``encoding``; returns bytes written.

        Raises:
            UnicodeEncodeError: ``text`` cannot be encoded as ``encoding``.
            LookupError: ``encoding`` is unknown.
            UnsafeModeError, ReadOnlyError, IsADirectoryError,
                FileNotFoundError, NotADirectoryError, PermissionError, OSError,
                PathEscapeError, SymlinkRefusedError, InvalidPathError,
                WorkspaceClosedError: as :meth:`write_bytes`.
        """
        return self.atomic_write(path, text.encode(encoding), mode=mode)

    def atomic_write(self, path: str | bytes,
                     data: bytes | bytearray | memoryview | Iterable[bytes] | IO[bytes] | int, *,
                     mode: int = 0o644, fsync: bool = True, max_bytes: int | None = None,
                     mtime_ns: int | None = None, owner: tuple[int, int] | None = None) -> int:
        """Write a new file under a temporary name in the parent, then rename it over ``path``.

        A leaf symlink at ``path`` is *replaced*, never followed.  Readers see
        the old or the new content, never a mix.  The mode is set explicitly
        with ``fchmod`` (the umask is never applied).

        Args:
            path: relative sandbox path of the file.
            data: bytes, an iterable of bytes chunks, a binary file object, or
                an ``int`` file descriptor (copied fd to fd with
                ``copy_file_range``, read/write fallback; the caller keeps it).
            mode: permission bits within 0o777.
            fsync: fsync the file before the rename (default True).
            max_bytes: for file objects and fds, refuse sources larger than
                this (OSError EFBIG); None for no bound.
            mtime_ns: set the file's mtime (and atime) in nanoseconds.
            owner: ``(uid, gid)`` given to the new file (``fchown`` of its fd,
                before the rename: never by name); needs the privilege to.
                None: the Root's ``owner`` (None there too: as the process
                makes it).  An explicit ``owner`` wins over the Root's.

        Returns:
            The number of bytes written.

        Raises:
            IsADirectoryError: ``path`` is an existing directory.
            UnsafeModeError: ``mode`` outside 0o777.
            OSError(EFBIG): the source exceeds ``max_bytes``.
            PermissionError: the owner could not be given (EPERM without the
                privilege); nothing is left behind.  Also EACCES on the parent.
            ReadOnlyError: a read-only Root, or ``path`` beneath a read-only grant.
            FileNotFoundError, NotADirectoryError: the parent directory is
                missing or not a directory, or ``path`` ends in ``/``.
            OSError: any other failure (ENOSPC, a read error of ``data`` ...),
                ``filename`` the sandbox path; the temporary name is removed.
            PathEscapeError, SymlinkRefusedError, InvalidPathError, WorkspaceClosedError: see :class:`Root`.
        """
        rel = self._rel(path)
        self._check_mode_of(mode, rel)
        if owner is None:
            owner = self.owner
        with self._use() as rootfd:
            pfd, leaf = self._open_parent(rootfd, rel, "write", write=True)
            try:
                tmp = b".sfs-tmp-" + os.urandom(8).hex().encode()
                try:
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                 0o600, dir_fd=pfd)
                except OSError as exc:
                    self._oserror(exc, "write", rel)
                try:
                    try:
                        written = self._fill(fd, data, max_bytes, rel)
                        if owner is not None:
                            os.fchown(fd, owner[0], owner[1])  # before fchmod: chown clears setuid bits
                        os.fchmod(fd, mode)
                        if mtime_ns is not None:
                            os.utime(fd, ns=(mtime_ns, mtime_ns))
                        if fsync:
                            os.fsync(fd)
                    finally:
                        os.close(fd)
                    _native.renameat2(pfd, tmp, pfd, leaf, 0, "write", self._show(rel))
                except BaseException:
                    try:
                        os.unlink(tmp, dir_fd=pfd)
                    except OSError:
                        pass
                    raise
                return written
            except OSError as exc:
                self._oserror(exc, "write", rel)
                raise  # unreachable
            finally:
                os.close(pfd)

    def _fill(self, fd: int, data: Any, max_bytes: int | None, rel: bytes) -> int:
        if isinstance(data, (bytes, bytearray, memoryview)):
            view = memoryview(data)
            total = 0
            while total < len(view):
                total += os.write(fd, view[total:])
            return total
        if isinstance(data, int):
            bound = _COPY_UNBOUNDED if max_bytes is None else max_bytes
            return _native.copy_fd(data, fd, bound, "write", self._show(rel))
        if hasattr(data, "fileno"):
            try:
                src = data.fileno()
            except (OSError, io.UnsupportedOperation):
                src = -1
            if src >= 0 and not getattr(data, "_sfs_no_fd", False):
                if hasattr(data, "flush"):
                    pass
                bound = _COPY_UNBOUNDED if max_bytes is None else max_bytes
                return _native.copy_fd(src, fd, bound, "write", self._show(rel))
        if hasattr(data, "read"):
            chunks: Iterable[bytes] = iter(lambda: data.read(1 << 20), b"")
        else:
            chunks = data
        total = 0
        for chunk in chunks:
            view = memoryview(chunk)
            total += len(view)
            if max_bytes is not None and total > max_bytes:
                _native.raise_errno(errno.EFBIG, "write", self._show(rel))
            off = 0
            while off < len(view):
                off += os.write(fd, view[off:])
        return total

    def copy_files_from(self, src: "Root",
                        items: Iterable[CopyItem | tuple[str, str, int, int | None, tuple[int, int] | None]], *,
                        max_bytes: int | None = None, digest: bool = True, fsync: bool = False,
                        buffer_bytes: int = 1 << 20, buffer: bytearray | None = None,
                        before_each: Callable[[int], None] | None = None,
                        results: list[tuple[int, str | None]] | None = None) -> list[tuple[int, str | None]]:
        """Copy many regular files from ``src`` into this Root, each one atomically.

        The batched form of ``atomic_write(dst, src.open_fd(src_rel))``: each
        source and destination *directory* is opened once per call, beneath
        its root with ``RESOLVE_NO_SYMLINKS`` (whatever the Roots' own
        options), and each file is then copied by native code that opens the
        source name ``O_RDONLY|O_NOFOLLOW|O_NONBLOCK`` relative to that
        directory fd, checks it is a regular file (and, when given, its
        identity), creates a temporary name ``O_CREAT|O_EXCL|O_NOFOLLOW`` in
        the destination directory, gives it the Root's ``owner`` (if any)
        with ``fchown`` of its fd right after creating it, copies the data,
        sets the mode with ``fchmod`` (the umask never applies) and the times
        with ``futimens``, and renames the temporary name over the destination.  So no source
        is read through a symlink, no FIFO blocks, nothing is written
        through a symlink (one at a destination is replaced), and readers
        see the old file or the complete new one.  On any failure the
        temporary name is removed.

        Consecutive items of one directory pair go to the native code in
        groups of up to 64, one call (one GIL release) per group.  With
        ``digest``, their data are packed one after another in one
        ``buffer_bytes`` buffer and each sha256 is computed from the bytes
        written (no second read); a file reaching past the buffer's end is
        finished through the whole buffer.  Without ``digest``, data moves
        fd to fd (``copy_file_range``).

        Args:
            src: the Root the sources are read from (may be read-only).
            items: a :class:`CopyItem` (or a plain tuple ``(src_rel, dst_rel,
                mode, mtime_ns, ident)`` in its order) per file:
                relative sandbox paths in ``src`` and in this Root (``str``),
                permission bits within 0o777, the mtime (and atime) to set in
                nanoseconds or None to leave the current time, and the
                expected ``(st_dev, st_ino)`` of the source or None for no
                identity check.
            max_bytes: refuse a source over this many bytes (None: no bound).
            digest: compute each file's sha256 (hex); else report None.
            fsync: fsync each file before its rename.
            buffer_bytes: size of the copy buffer in bytes (>= 4096); files
                over it are copied in buffer-sized chunks.
            buffer: a ``bytearray`` (>= 4096 bytes) to copy through instead of
                a new ``buffer_bytes`` one, so a caller making many calls from
                one thread allocates (and page-faults) it once; its size
                replaces ``buffer_bytes``.  Not thread-safe: one call at a
                time per buffer.  Unused without ``digest``.
            before_each: called with each item's index before any of that
                item is written (up to one group ahead of the copy); an
                exception it raises stops the copy: the items before that
                index are copied first, nothing of that item is, and the
                exception propagates.
            results: a list to append each finished item's result to (so a
                caller sees what was written when an exception is raised).

        Returns:
            ``results`` (a new list when None): ``(bytes_written, sha256_hex
            or None)`` per finished item, in order.

        Raises:
            UnsafeModeError: a mode outside 0o777.
            ReadOnlyError: this Root is read-only, or a destination lies in a
                read-only grant nested in it.
            InvalidPathError: a path names a root itself, ends in ``/``,
                ``.`` or ``..``, holds NUL or is too long.
            SymlinkRefusedError: a symlink on a source or destination path
                (its directories, or the source name itself).
            PathEscapeError: a path resolves outside its root.
            SpecialFileError: a source is not a regular file (FIFO, socket,
                device, directory); it was never read from.
            OSError(ESTALE): a source's identity differs from ``ident``.
            OSError(EFBIG): a source holds more than ``max_bytes`` bytes.
            IsADirectoryError: a destination is an existing directory.
            FileNotFoundError, NotADirectoryError: a source or destination
                directory is missing or not a directory.
            PermissionError: the Root's ``owner`` could not be given (EPERM
                without the privilege); that file's temporary name is removed.
            OSError: any other failure, ``filename`` the sandbox path.
            ValueError: ``buffer_bytes`` (or ``len(buffer)``) below 4096.
            TypeError: ``buffer`` is not a ``bytearray``.
            WorkspaceClosedError: either Root is closed.
            Any exception ``before_each`` raises (the items before it are copied).
        """
        from ._root_copy import copy_files  # noqa: PLC0415  (it imports this module)

        return copy_files(self, src, items, max_bytes=max_bytes, digest=digest, fsync=fsync,
                          buffer_bytes=buffer_bytes, buffer=buffer, before_each=before_each, results=results)

    def mkdir(self, path: str | bytes, mode: int = 0o755, *, parents: bool = False, exist_ok: bool = False) -> None:
        """Create a directory with exactly ``mode`` (the umask is not applied).

        The mode (and the Root's ``owner``, if any, with ``fchown`` before
        the ``fchmod``) is set through an fd of the new directory, opened
        ``O_DIRECTORY|O_NOFOLLOW`` beneath the parent's fd and checked to be
        the directory ``mkdirat`` made (its ``(st_dev, st_ino)`` taken right
        after it), never by name.  A directory cannot be a hard link, so the
        owner never lands on anything outside.  Existing directories (with
        ``exist_ok`` or ``parents``) keep their owner and mode.

        Args:
            parents: create missing parents too (each with ``mode`` and the
                Root's owner).
            exist_ok: an existing *directory* (not a symlink to one) is fine.

        Raises:
            FileExistsError: the name exists and is not a directory, or
                ``exist_ok`` is False.
            FileNotFoundError: a parent is missing and ``parents`` is False.
            DirectoryReplacedError: another process replaced the new
                directory before its mode and owner were set (left alone).
            PermissionError: the owner could not be given (EPERM without the
                privilege); the directory made is removed.  Also EACCES on the parent.
            UnsafeModeError: ``mode`` outside 0o777.
            ReadOnlyError: a read-only Root, or ``path`` beneath a read-only grant.
            NotADirectoryError: a component of the parent is not a directory.
            OSError: any other failure (ENOSPC ...), ``filename`` the sandbox path.
            PathEscapeError, SymlinkRefusedError, InvalidPathError, WorkspaceClosedError: see :class:`Root`.
        """
        rel = self._rel(path)
        self._check_mode_of(mode, rel)
        self._check_writable(rel, "mkdir")
        if parents:
            comps = [c for c in rel.split(b"/") if c not in (b"", b".")]
            for i in range(1, len(comps)):
                sub = b"/".join(comps[:i])
                if comps[i - 1] == b"..":
                    continue
                self._mkdir_one(sub, mode, True)
        self._mkdir_one(rel, mode, exist_ok)

    def _mkdir_one(self, rel: bytes, mode: int, exist_ok: bool) -> None:
        with self._use() as rootfd:
            pfd, leaf = self._open_parent(rootfd, rel, "mkdir", write=True, dir_op=True)
            try:
                try:
                    os.mkdir(leaf, mode, dir_fd=pfd)
                except FileExistsError:
                    st = os.stat(leaf, dir_fd=pfd, follow_symlinks=False)
                    if exist_ok and _stat.S_ISDIR(st.st_mode):
                        return
                    raise
                # mkdir applies the umask; set the asked mode on what we made, through a
                # fd opened without following links and checked to be the directory made
                # (its identity taken right after mkdirat) and not a read-only grant.
                made = os.stat(leaf, dir_fd=pfd, follow_symlinks=False)
                ident = (made.st_dev, made.st_ino)
                try:
                    dfd = os.open(leaf, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
                    try:
                        st = os.fstat(dfd)
                        if (st.st_dev, st.st_ino) != ident:
                            raise DirectoryReplacedError("mkdir: the new directory was replaced by another process",
                                                         sandbox_path=self._show(rel))
                        if self._deny:
                            self._check_write_target(dfd, None, rel, False)
                        if self.owner is not None:
                            os.fchown(dfd, self.owner[0], self.owner[1])
                        os.fchmod(dfd, mode)
                    finally:
                        os.close(dfd)
                except SandboxError:
                    raise  # what is at the name is not ours (replaced, or a read-only grant): left alone
                except BaseException:
                    try:  # a failed mkdir leaves nothing: the directory it made, if still there and empty
                        now = os.stat(leaf, dir_fd=pfd, follow_symlinks=False)
                        if (now.st_dev, now.st_ino) == ident:
                            os.rmdir(leaf, dir_fd=pfd)
                    except OSError:
                        pass
                    raise
            except OSError as exc:
                self._oserror(exc, "mkdir", rel)
            finally:
                os.close(pfd)

    def remove(self, path: str | bytes) -> None:
        """Remove a non-directory.  A leaf symlink is removed, never its target.

        Raises:
            IsADirectoryError: ``path`` is a directory (use rmdir / rmtree).
            FileNotFoundError: nothing is at ``path``, or a directory on it is missing.
            NotADirectoryError: a component of the parent is not a directory,
                or ``path`` ends in ``/``.
            ReadOnlyError: a read-only Root, or ``path`` beneath a read-only grant.
            PermissionError: EACCES / EPERM on the parent (a sticky directory ...).
            OSError: any other failure (EBUSY ...), ``filename`` the sandbox path.
            PathEscapeError, SymlinkRefusedError, InvalidPathError, WorkspaceClosedError: see :class:`Root`.
        """
        rel = self._rel(path)
        with self._use() as rootfd:
            pfd, leaf = self._open_parent(rootfd, rel, "remove", write=True)
            try:
                os.unlink(leaf, dir_fd=pfd)
            except OSError as exc:
                self._oserror(exc, "remove", rel)
            finally:
                os.close(pfd)

    unlink = remove

    def rmdir(self, path: str | bytes, *, expect: tuple[int, int] | None = None) -> None:
        """Remove an empty directory (never through a leaf symlink).

        Args:
            expect: ``(st_dev, st_ino)`` the directory must have; another one
                at the name is left in place (``DirectoryReplacedError``).
                With read-only grants nested in this Root, or with ``expect``,
                the name is first moved into a private directory and checked
                there, so a directory swapped in at the name (an empty grant)
                is never removed (see ``_root_remove.rmdir_checked``).

        Raises:
            DirectoryReplacedError: the directory at the name is not ``expect``
                (or, with read-only grants, was swapped for one); it is left in place.
            OSError(ENOTEMPTY): the directory is not empty.
            NotADirectoryError: ``path`` is not a directory (a symlink included).
            FileNotFoundError: nothing is at ``path``, or a directory on it is missing.
            ReadOnlyError: a read-only Root, or ``path`` is (or is beneath) a
                read-only grant.
            InvalidPathError: ``path`` names the root itself or ends in ``.`` / ``..``.
            OSError(EBUSY): ``path`` is a mount point.
            PermissionError: EACCES / EPERM on the parent.
            OSError: any other failure, ``filename`` the sandbox path.
            PathEscapeError, SymlinkRefusedError, WorkspaceClosedError: as for
                every method (see :class:`Root`).
        """
        from . import _root_remove  # noqa: PLC0415  (it imports this module)

        _root_remove.rmdir(self, path, expect)

    def rmtree(self, path: str | bytes, *, missing_ok: bool = False,
               skip: Callable[[os.stat_result], bool] | None = None) -> None:
        """Remove a tree with an fd-based walk that never follows a symlink.

        The top, if a symlink, is removed itself.  Each directory is entered
        through an fd opened ``O_NOFOLLOW`` relative to its parent's fd, so an
        entry swapped for a symlink during the walk is unlinked, never
        followed.  A mount point is never entered (see :meth:`clear`): it and
        its ancestors stay.  Memory and open fds grow with depth, not with size.

        Args:
            missing_ok: a missing ``path`` is not an error.
            skip: called with the ``lstat`` of each directory before entering
                it; True leaves it (and so its ancestors) in place.  Used to
                keep mount points.

        ``""`` or ``"."`` empties the root (:meth:`clear`) and keeps it.
        Entries removed before an error stay removed.

        Raises:
            FileNotFoundError: ``path`` is missing (unless ``missing_ok``), or a
                directory on it is.
            ReadOnlyError: a read-only Root, ``path`` beneath a read-only
                grant, or the removal would enter one nested in the tree.
            InvalidPathError: ``path`` ends in ``..``.
            PermissionError: an entry cannot be removed or a directory entered
                (EACCES, EPERM).
            OSError: any other failure (EBUSY ...), ``filename`` the sandbox path.
            PathEscapeError, SymlinkRefusedError, WorkspaceClosedError: as for
                every method (see :class:`Root`).
        """
        from . import _root_remove  # noqa: PLC0415  (it imports this module)

        _root_remove.rmtree(self, path, missing_ok, skip)

    def sweep_removals(self, path: str | bytes = ".") -> int:
        """Undo the removals interrupted in directory ``path``: their stale ``.sfs-rm-*`` directories.

        :meth:`rmdir` (with ``expect`` or read-only grants, and so
        :meth:`rmtree`, :meth:`clear` and :meth:`Subtree.remove_tree`) moves a
        directory into a private ``.sfs-rm-<random>`` beside it before removing
        it there, and holds a ``flock`` on that private directory meanwhile.
        An I/O error at the wrong step, or a killed process, can leave one
        behind.  This takes each one that no removal in flight holds, checks
        it is one this process's uid made (a directory, owned by the
        effective uid, mode without group or other bits; never a symlink,
        never a mount point, never a read-only grant), moves what it holds
        back to its own name (``RENAME_NOREPLACE``: never over an entry, and
        nothing in it is removed) and removes it once empty.  Best effort per
        entry.  The name prefix is reserved.  Archive extraction runs it on
        the directory it stages in.

        Args:
            path: sandbox path of the directory to sweep (``"."``: the root).

        Returns:
            How many stale private directories were removed.

        Raises:
            ReadOnlyError: a read-only Root, or ``path`` is (or is beneath) a read-only grant.
            NotADirectoryError, FileNotFoundError, PermissionError,
                OSError(EMFILE): ``path`` cannot be opened as a directory.
            PathEscapeError, SymlinkRefusedError, InvalidPathError, WorkspaceClosedError: see :class:`Root`.
        """
        from . import _root_remove  # noqa: PLC0415  (it imports this module)

        return _root_remove.sweep(self, path)

    def clear(self, *, skip: Callable[[os.stat_result], bool] | None = None, make_writable: bool = False,
              keep_denied: bool = False) -> None:
        """Remove everything *inside* the root, never the root directory itself.

        Args:
            make_writable: give each directory entered below the root owner
                read, write and search permission first, through the fd it was
                entered with (an ``O_PATH`` fd for one its owner cannot read;
                never by name), so a tree with read-only directories can be
                removed by a non-root caller.  The root's own mode is kept.
            keep_denied: a read-only grant nested in this Root (its identity
                checked on the fd the clear entered, so a name swapped for one
                meanwhile is caught) is kept, like a mount point, instead of
                raising ReadOnlyError.
            skip: see :meth:`rmtree`; skipped directories (mount points) stay.
                A mount point is never entered whatever ``skip`` says: with
                openat2 (``RESOLVE_NO_XDEV``) a bind mount of the same
                filesystem included; without it, a directory on another
                device than its parent.

        Entries removed before an error stay removed.

        Raises:
            ReadOnlyError: a read-only Root, or the clear would enter a
                read-only grant nested in it (unless ``keep_denied``).
            PermissionError: an entry cannot be removed or a directory entered
                (EACCES without ``make_writable``, EPERM).
            OSError: any other failure (EBUSY ...), ``filename`` the Root's own sandbox path.
            WorkspaceClosedError: the Root is closed.
        """
        from . import _root_remove  # noqa: PLC0415  (it imports this module)

        _root_remove.clear(self, skip, make_writable, keep_denied)

    def rename(self, src: str | bytes, dst: str | bytes, *, no_replace: bool = False, exchange: bool = False) -> None:
        """Rename ``src`` to ``dst``, both beneath the root; links are moved, never followed.

        Args:
            no_replace: refuse to replace an existing ``dst`` (renameat2
                ``RENAME_NOREPLACE``): raises FileExistsError.
            exchange: swap ``src`` and ``dst`` atomically (renameat2
                ``RENAME_EXCHANGE``); both must exist (FileNotFoundError).
                Not with ``no_replace`` (InvalidArgumentError).

        Raises:
            OSError(EXDEV): ``src`` and ``dst`` are on different mounts beneath
                the root (a plain OSError, not a PathEscapeError).
            FileExistsError: ``no_replace`` and ``dst`` exists.
            FileNotFoundError: ``src`` is missing (with ``exchange``: either), or a directory on either path.
            InvalidArgumentError: both ``no_replace`` and ``exchange``.
            NotADirectoryError: a path ends in ``/`` and ``src`` is not a
                directory, or a directory is moved over a non-directory.
            IsADirectoryError: a non-directory is moved over a directory.
            OSError(ENOTEMPTY): ``dst`` is a non-empty directory.
            OSError(EINVAL): a directory is moved into itself.
            ReadOnlyError: a read-only Root, or either name is (or is beneath)
                a read-only grant.
            InvalidPathError: either path names the root itself or ends in ``.`` / ``..``.
            PermissionError: EACCES / EPERM on a parent (a sticky directory ...).
            OSError: any other failure (EBUSY ...), ``filename`` the sandbox path of ``src``.
            PathEscapeError, SymlinkRefusedError, WorkspaceClosedError: as for
                every method (see :class:`Root`).
        """
        if no_replace and exchange:
            raise InvalidArgumentError("rename: no_replace and exchange exclude each other",
                                       sandbox_path=display_path(os.fsdecode(dst)))
        srel, drel = self._rel(src), self._rel(dst)
        with self._use() as rootfd:
            spfd, sleaf = self._open_parent(rootfd, srel, "rename", write=True, dir_op=True)
            try:
                if srel.endswith(b"/") or drel.endswith(b"/"):
                    # "name/" names a directory (as rename(2))
                    try:
                        sst = os.stat(sleaf, dir_fd=spfd, follow_symlinks=False)
                    except OSError as exc:
                        self._oserror(exc, "rename", srel)
                    if not _stat.S_ISDIR(sst.st_mode):
                        _native.raise_errno(errno.ENOTDIR, "rename", self._show(srel))
                dpfd, dleaf = self._open_parent(rootfd, drel, "rename", write=True, dir_op=True)
                try:
                    flags = _native.RENAME_NOREPLACE if no_replace else _native.RENAME_EXCHANGE if exchange else 0
                    if _hooks.current is not None:
                        _hooks.fire("root.rename", root=self, src=srel, dst=drel)
                    ret = _native.renameat2_raw(spfd, sleaf, dpfd, dleaf, flags)
                    if ret == -errno.EXDEV:  # both parents are beneath: a mount boundary
                        cross = OSError(errno.EXDEV, "Invalid cross-device link (rename)", self._show(srel))
                        cross.operation = "rename"  # type: ignore[attr-defined]
                        raise cross
                    _native.check(ret, "rename", self._show(srel))
                finally:
                    os.close(dpfd)
            finally:
                os.close(spfd)

    def symlink(self, target: str | bytes, path: str | bytes) -> None:
        """Create a symlink at ``path`` pointing to ``target``.

        ``target`` must be relative, may use ``..`` only as leading
        components, and those may not climb above the root counted from the
        link's *physical* directory (found by walking ``..`` fds up to the
        root).  Absolute targets are refused.  With ``..`` only in front,
        each one is a real parent step, so the check is sound whatever the
        later names are.  (A creation-time rule: sandbox-fs itself never
        follows a link without ``RESOLVE_BENEATH``.)

        With a Root ``owner``, the new link is given it through an fd of the
        link itself: opened ``O_PATH|O_NOFOLLOW`` beneath the parent's fd,
        checked to be a symlink with one link (a name swapped meanwhile for a
        hard link to something outside is never changed), then
        ``fchownat(fd, "", AT_EMPTY_PATH|AT_SYMLINK_NOFOLLOW)``.

        Raises:
            PathEscapeError: the target is absolute, has ``..`` after a name,
                or climbs above the root.
            InvalidPathError: the target is empty or holds a NUL byte.
            FileExistsError: ``path`` exists.
            DirectoryReplacedError: (with an owner) another process replaced
                the new link before its owner was set (what is at the name is
                left alone).
            PermissionError: the owner could not be given (EPERM without the
                privilege); the link made is removed.  Also EACCES on the parent.
            ReadOnlyError: a read-only Root, or ``path`` beneath a read-only grant.
            FileNotFoundError, NotADirectoryError: the parent is missing or not
                a directory.
            OSError: any other failure, ``filename`` the sandbox path.
            SymlinkRefusedError, WorkspaceClosedError: as for every method (see :class:`Root`).
        """
        rel = self._rel(path)
        tb = os.fsencode(target) if isinstance(target, str) else bytes(target)
        if not tb or b"\0" in tb or len(tb) > MAX_PATH_BYTES:
            raise InvalidPathError("symlink target is empty, too long or holds NUL", sandbox_path=self._show(rel))
        if tb.startswith(b"/"):
            raise PathEscapeError("symlink target is absolute", sandbox_path=self._show(rel),
                                  context={"operation": "symlink"})
        comps = [c for c in tb.split(b"/") if c not in (b"", b".")]
        ups = 0
        while ups < len(comps) and comps[ups] == b"..":
            ups += 1
        if b".." in comps[ups:]:
            # A ".." after a name would be resolved *physically* from that
            # name, which may itself be a symlink: the lexical check below
            # would be unsound, so such targets are refused as a class.
            raise PathEscapeError("symlink target has '..' after a name; only leading '..' are allowed",
                                  sandbox_path=self._show(rel), context={"operation": "symlink"})
        with self._use() as rootfd:
            pfd, leaf = self._open_parent(rootfd, rel, "symlink", write=True)
            try:
                if ups and ups > self._depth_of(pfd, rootfd, rel):
                    raise PathEscapeError("symlink target resolves outside the root",
                                          sandbox_path=self._show(rel), context={"operation": "symlink"})
                try:
                    os.symlink(tb, leaf, dir_fd=pfd)
                    if self.owner is not None:
                        self._own_symlink(pfd, leaf, rel)
                except OSError as exc:
                    self._oserror(exc, "symlink", rel)
            finally:
                os.close(pfd)

    def _own_symlink(self, pfd: int, leaf: bytes, rel: bytes) -> None:
        """Give the symlink just made at ``leaf`` of ``pfd`` the Root's owner, through an fd proven to be it."""
        assert self.owner is not None
        fd = os.open(leaf, _O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
        try:
            st = os.fstat(fd)
            if not (_stat.S_ISLNK(st.st_mode) and st.st_nlink == 1):
                raise DirectoryReplacedError("symlink: the new link was replaced by another process (left alone)",
                                             sandbox_path=self._show(rel))
            try:
                _native.fchown_fd(fd, self.owner, "symlink", self._show(rel))
            except BaseException:
                self._unlink_made(pfd, leaf, (st.st_dev, st.st_ino))
                raise
        finally:
            os.close(fd)

    def _depth_of(self, dfd: int, rootfd: int, rel: bytes) -> int:
        """Physical depth of directory ``dfd`` below the root, by walking ``..`` fds."""
        depth = 0
        cur = os.dup(dfd)
        try:
            while True:
                st = os.fstat(cur)
                if (st.st_dev, st.st_ino) == self._root_id:
                    return depth
                up = os.open("..", _DIR_FLAGS | os.O_CLOEXEC, dir_fd=cur)
                ust = os.fstat(up)
                os.close(cur)
                cur = up
                if (ust.st_dev, ust.st_ino) == (st.st_dev, st.st_ino) or depth > MAX_PATH_BYTES:
                    raise PathEscapeError("directory is no longer beneath the root",
                                          sandbox_path=self._show(rel), context={"operation": "symlink"})
                depth += 1
        finally:
            os.close(cur)

    def link(self, src: str | bytes, dst: str | bytes) -> None:
        """Create hard link ``dst`` to the existing ``src`` (not following a leaf symlink).

        A hard link makes no new inode: its owner (the Root's ``owner``
        included) is left as it is.

        Raises:
            FileExistsError: ``dst`` exists.
            FileNotFoundError: ``src`` is missing, or a directory on either path.
            OSError(EXDEV): ``src`` and ``dst`` are on different mounts beneath the root.
            PermissionError: ``src`` is a directory (EPERM), or the kernel's
                ``protected_hardlinks`` refuses it; EACCES on a parent.
            NotADirectoryError: a path ends in ``/``, or a component is not a directory.
            ReadOnlyError: a read-only Root, or either name beneath a read-only grant.
            OSError: any other failure (EMLINK ...), ``filename`` the sandbox path of ``dst``.
            PathEscapeError, SymlinkRefusedError, InvalidPathError, WorkspaceClosedError: see :class:`Root`.
        """
        srel, drel = self._rel(src), self._rel(dst)
        with self._use() as rootfd:
            spfd, sleaf = self._open_parent(rootfd, srel, "link", write=True)
            try:
                dpfd, dleaf = self._open_parent(rootfd, drel, "link", write=True)
                try:
                    os.link(sleaf, dleaf, src_dir_fd=spfd, dst_dir_fd=dpfd, follow_symlinks=False)
                except OSError as exc:
                    if exc.errno == errno.EXDEV:  # both parents are beneath: a mount boundary
                        err = OSError(errno.EXDEV, "Invalid cross-device link (link)", self._show(drel))
                        err.operation = "link"  # type: ignore[attr-defined]
                        raise err from None
                    self._oserror(exc, "link", drel)
                finally:
                    os.close(dpfd)
            finally:
                os.close(spfd)

    def chmod(self, path: str | bytes, mode: int) -> None:
        """Set permission bits (within 0o777) of ``path``; a leaf symlink is refused, never followed.

        Raises:
            UnsafeModeError: ``mode`` has bits outside 0o777.
            SymlinkRefusedError: ``path`` is a symlink (or became one).
            FileNotFoundError: nothing is at ``path``.
            ReadOnlyError: a read-only Root, ``path`` beneath a read-only grant,
                or (with grants nested) a regular file with more than one link.
            PermissionError: EPERM: the caller does not own ``path``.
            InvalidPathError: ``path`` names the root itself or ends in ``..``.
            OSError: any other failure, ``filename`` the sandbox path.
            PathEscapeError, WorkspaceClosedError: as for every method (see :class:`Root`).
        """
        rel = self._rel(path)
        self._check_mode_of(mode, rel)
        with self._use() as rootfd:
            pfd, leaf = self._open_parent(rootfd, rel, "chmod", write=True, dir_op=True, inplace=True)
            try:
                st = os.stat(leaf, dir_fd=pfd, follow_symlinks=False)
                if _stat.S_ISLNK(st.st_mode):
                    raise SymlinkRefusedError("chmod: refusing to change a symlink's target",
                                              sandbox_path=self._show(rel), context={"operation": "chmod"})
                try:
                    os.chmod(leaf, mode, dir_fd=pfd, follow_symlinks=False)
                except (NotImplementedError, ValueError):
                    # swapped for a symlink since the lstat (fchmodat refuses links)
                    raise SymlinkRefusedError("chmod: the name became a symlink", sandbox_path=self._show(rel),
                                              context={"operation": "chmod"}) from None
            except OSError as exc:
                self._oserror(exc, "chmod", rel)
            finally:
                os.close(pfd)

    def utime(self, path: str | bytes, *, ns: tuple[int, int] | None = None) -> None:
        """Set (atime_ns, mtime_ns) of ``path`` (now if None); a leaf symlink's own times are set, never its target's.

        Raises:
            FileNotFoundError: nothing is at ``path``, or a directory on it is missing.
            ReadOnlyError: a read-only Root, ``path`` beneath a read-only grant,
                or (with grants nested) a regular file with more than one link.
            PermissionError: the caller does not own ``path`` (EPERM / EACCES).
            InvalidPathError: ``path`` names the root itself or ends in ``.`` / ``..``.
            OSError: any other failure, ``filename`` the sandbox path.
            PathEscapeError, SymlinkRefusedError, InvalidPathError, WorkspaceClosedError: see :class:`Root`.
        """
        rel = self._rel(path)
        with self._use() as rootfd:
            pfd, leaf = self._open_parent(rootfd, rel, "utime", write=True, dir_op=True, inplace=True)
            try:
                if ns is None:  # os.utime refuses ns=None: no times means now
                    os.utime(leaf, dir_fd=pfd, follow_symlinks=False)
                else:
                    os.utime(leaf, ns=ns, dir_fd=pfd, follow_symlinks=False)
            except OSError as exc:
                self._oserror(exc, "utime", rel)
            finally:
                os.close(pfd)

    # ------------------------------------------------------------------ reading

    def stat(self, path: str | bytes = ".", *, follow_symlinks: bool = True) -> os.stat_result:
        """``stat`` (or ``lstat`` with follow_symlinks=False) of ``path`` beneath the root.

        Raises:
            FileNotFoundError: nothing is at ``path`` (a dangling symlink
                followed included).
            NotADirectoryError: a component of ``path`` is not a directory.
            PermissionError: EACCES: no search permission on a directory on the path.
            PathEscapeError: ``path``, or a symlink followed on it, resolves outside the root.
            SymlinkRefusedError: a symlink where the Root refuses them, or over 40 hops.
            InvalidPathError, WorkspaceClosedError: as for every method (see :class:`Root`).
        """
        rel = self._rel(path)
        flags = _O_PATH | (0 if follow_symlinks else os.O_NOFOLLOW)
        with self._use() as rootfd:
            fd = self._open_fd(rootfd, rel, flags, 0, "stat")
            try:
                return os.fstat(fd)
            finally:
                os.close(fd)

    def lstat(self, path: str | bytes) -> os.stat_result:
        """``lstat`` of ``path``: a leaf symlink is described, not followed.

        Raises:
            FileNotFoundError, NotADirectoryError, PermissionError,
                PathEscapeError, SymlinkRefusedError, InvalidPathError,
                WorkspaceClosedError: as :meth:`stat` (the leaf never followed).
        """
        return self.stat(path, follow_symlinks=False)

    def exists(self, path: str | bytes) -> bool:
        """True when ``path`` exists beneath the root (a leaf symlink counts itself).

        Raises:
            NotADirectoryError, PermissionError, PathEscapeError,
                SymlinkRefusedError, InvalidPathError, WorkspaceClosedError: as
                :meth:`lstat` (only FileNotFoundError becomes False).
        """
        try:
            self.lstat(path)
            return True
        except FileNotFoundError:
            return False

    def readlink(self, path: str | bytes) -> str:
        """Return the target text of symlink ``path``.

        Raises:
            OSError(EINVAL): ``path`` is not a symlink.
            FileNotFoundError: nothing is at ``path``, or a directory on it is missing.
            NotADirectoryError: a component is not a directory, or ``path`` ends in ``/``.
            PermissionError: EACCES on a directory on the path.
            PathEscapeError, SymlinkRefusedError, InvalidPathError, WorkspaceClosedError: see :class:`Root`.
        """
        rel = self._rel(path)
        with self._use() as rootfd:
            pfd, leaf = self._open_parent(rootfd, rel, "readlink", write=False)
            try:
                return os.fsdecode(os.readlink(leaf, dir_fd=pfd))
            except OSError as exc:
                self._oserror(exc, "readlink", rel)
                raise
            finally:
                os.close(pfd)

    def open_dir_fd(self, path: str | bytes = ".") -> int:
        """Open directory ``path`` for reading (O_RDONLY|O_DIRECTORY); caller closes the fd.

        Raises:
            NotADirectoryError: ``path`` is not a directory.
            FileNotFoundError: ``path`` is missing.
            PermissionError: EACCES: no read permission on it, or no search
                permission on a directory on the path.
            OSError(EMFILE): the process has no free fd.
            PathEscapeError, SymlinkRefusedError, InvalidPathError, WorkspaceClosedError: see :class:`Root`.
        """
        return self.open_fd(path, os.O_RDONLY | os.O_DIRECTORY)

    def handle(self, path: str | bytes = ".") -> Handle:
        """An :class:`Handle` (an ``O_PATH|O_NOFOLLOW`` fd) on the entry at ``path`` beneath the root.

        ``path`` is resolved like every other method's (``RESOLVE_BENEATH``,
        the Root's symlink rule); its leaf is never followed, so a symlink
        gives a handle on the link itself.  The handle is read-only when this
        Root is, or when the entry is in a read-only grant nested in it; it
        stops working when this Root is closed (see :class:`Handle`).

        Raises:
            FileNotFoundError, NotADirectoryError, PermissionError: as :meth:`lstat`.
            PathEscapeError, SymlinkRefusedError, InvalidPathError, WorkspaceClosedError: see :class:`Root`.
        """
        rel = self._rel(path)
        with self._use() as rootfd:
            fd = self._open_fd(rootfd, rel, _O_PATH | os.O_NOFOLLOW, 0, "handle")
            try:
                read_only = self.read_only or (bool(self._deny) and self._handle_denied(rootfd, fd, rel))
            except BaseException:
                os.close(fd)
                raise
        return Handle(fd, self, read_only)

    def _handle_denied(self, rootfd: int, fd: int, rel: bytes) -> bool:
        """True when the entry ``fd`` (at ``rel``) is, or is beneath, a read-only grant nested in this Root."""
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) in self._deny:
            return True
        if rel.strip(b"/") in (b"", b"."):
            return False
        parent = rel.rstrip(b"/").rpartition(b"/")[0] or b"."
        pfd = fd if _stat.S_ISDIR(st.st_mode) else self._open_fd(rootfd, parent, _DIR_FLAGS, 0, "handle")
        try:
            self._check_write_target(pfd, None, rel, False)
            return False
        except ReadOnlyError:
            return True
        finally:
            if pfd != fd:
                os.close(pfd)

    def scandir(self, path: str | bytes = ".") -> list[DirEntry]:
        """List directory ``path`` with an ``lstat`` of each entry (sorted by name).

        An entry removed between the listing and its ``lstat`` is left out.

        Raises:
            NotADirectoryError, FileNotFoundError, PermissionError,
                OSError(EMFILE): as :meth:`open_dir_fd`.
            OSError: the listing failed, ``filename`` the sandbox path.
            PathEscapeError, SymlinkRefusedError, InvalidPathError, WorkspaceClosedError: see :class:`Root`.
        """
        rel = self._rel(path)
        dfd = self.open_dir_fd(rel)
        try:
            return self._scan_fd(dfd, rel)
        except OSError as exc:
            self._oserror(exc, "scandir", rel)
            raise
        finally:
            os.close(dfd)

    def _scan_fd(self, dfd: int, rel: bytes) -> list[DirEntry]:
        base = "" if rel in (b".", b"") else os.fsdecode(rel.rstrip(b"/"))
        out = []
        for name in sorted(os.listdir(dfd)):
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            out.append(DirEntry(name, f"{base}/{name}" if base else name, kind_of(st.st_mode), st))
        return out

    def listdir(self, path: str | bytes = ".") -> list[str]:
        """Sorted entry names of directory ``path``.

        Raises:
            NotADirectoryError, FileNotFoundError, PermissionError,
                OSError(EMFILE): as :meth:`open_dir_fd`.
            OSError: the listing failed.
            PathEscapeError, SymlinkRefusedError, InvalidPathError, WorkspaceClosedError: see :class:`Root`.
        """
        rel = self._rel(path)
        dfd = self.open_dir_fd(rel)
        try:
            return sorted(os.listdir(dfd))
        finally:
            os.close(dfd)

    def walk(self, path: str | bytes = ".") -> Iterator[tuple[str, list[str], list[DirEntry]]]:
        """Top-down fd-based walk that never follows a symlink.

        Yields ``(dirpath, dirnames, nondirs)`` where ``dirpath`` is the sandbox
        path relative to the root (``""`` for the root), ``dirnames`` a list
        the caller may prune in place, and ``nondirs`` the :class:`DirEntry`
        of every non-directory (symlinks included, never followed).  Each
        directory is opened ``O_NOFOLLOW`` relative to its parent's fd, so a
        directory swapped for a symlink mid-walk is skipped, never entered.

        Raises (at the first step for ``path``, later for a directory met):
            NotADirectoryError, FileNotFoundError: ``path`` is not a directory
                or is missing (a subdirectory removed or swapped mid-walk is
                skipped instead).
            PermissionError: EACCES: a directory cannot be read or entered.
            OSError: any other failure (EMFILE ...).
            PathEscapeError, SymlinkRefusedError, InvalidPathError, WorkspaceClosedError: see :class:`Root`.
        """
        for dpath, dents, nondirs in walk_dirs(self, path):
            names = [e.name for e in dents]
            yield dpath, names, nondirs
            if len(names) != len(dents) or any(n != e.name for n, e in zip(names, dents)):
                by_name = {e.name: e for e in dents}  # the caller pruned or reordered dirnames
                dents[:] = [by_name[n] for n in names if n in by_name]

    # --------------------------------------------------------------- sub-roots

    def open_root(self, path: str | bytes, *, read_only: bool | None = None,
                  no_symlinks: bool | None = None) -> "Root":
        """Return a child capability on directory ``path`` beneath this root.

        A child of a read-only Root is read-only whatever ``read_only`` says;
        it inherits this Root's ``owner`` and read-only grants.

        Raises:
            NotADirectoryError: ``path`` is not a directory.
            FileNotFoundError: ``path`` is missing.
            PermissionError: EACCES: no search permission on a directory on the path.
            OSError(EMFILE): the process has no free fd.
            PathEscapeError, SymlinkRefusedError, InvalidPathError, WorkspaceClosedError: see :class:`Root`.
        """
        rel = self._rel(path)
        ro = self.read_only or bool(read_only)
        ns = self.no_symlinks if no_symlinks is None else (self.no_symlinks or no_symlinks)
        with self._use() as rootfd:
            fd = self._open_fd(rootfd, rel, _DIR_FLAGS, 0, "open_root")
        if self._deny and not ro:
            # a child inside a denied (read-only) directory is read-only
            try:
                self._check_write_target(fd, None, rel, False)
            except ReadOnlyError:
                ro = True
            except BaseException:
                os.close(fd)
                raise
        label = self._show(rel)
        return Root(fd, read_only=ro, no_symlinks=ns, resolver=self.resolver,
                    label="" if label == "." else label, deny_write_ids=self._deny, owner=self.owner)

    def with_options(self, *, read_only: bool | None = None, no_symlinks: bool | None = None,
                     deny_write_ids: frozenset[tuple[int, int]] | None = None,
                     owner: tuple[int, int] | None = None) -> "Root":
        """A new Root on the same directory with narrower options (never wider).

        Args:
            deny_write_ids: extra ``(st_dev, st_ino)`` of directories beneath
                this root that must never be written into (read-only grants
                nested in it); added to the ones already denied.
            owner: ``(uid, gid)`` every entry the new Root creates is given
                (see the class docstring); None keeps this Root's owner.

        Raises:
            InvalidArgumentError: ``owner`` is not None or two ints in
                0 .. 2**32 - 2.
            WorkspaceClosedError: this Root is closed.
            OSError(EMFILE): the process has no free fd.
        """
        owner = check_owner(owner)
        with self._use() as rootfd:
            fd = os.dup(rootfd)
        return Root(fd, read_only=self.read_only or bool(read_only),
                    no_symlinks=self.no_symlinks or bool(no_symlinks), resolver=self.resolver,
                    label=self._label, deny_write_ids=self._deny | (deny_write_ids or frozenset()),
                    owner=self.owner if owner is None else owner)


class Subtree:
    """A directory this library made, reached by its *name* beneath a :class:`Root`, never by a kept fd.

    For a directory that is later referred to by its name too (a staging
    directory that is renamed into place): a kept fd and the name can come
    apart when another process renames the directory (TOCTOU).  So nothing
    here keeps an fd across calls.  Each method opens the directory at
    ``path`` beneath the Root's own fd *at the moment of the call*
    (``O_PATH|O_DIRECTORY``, with the Root's resolve flags; never through a
    symlink when the Root refuses them), checks that it is still the
    directory recorded at creation (``identity``), then acts beneath that fd
    for that call only, as a :class:`Root` does (read-only grants nested in the
    Root are honoured).  A directory moved away by another process is
    therefore never written into by a later call (the name now holds another
    directory, or nothing), and a directory put under the name is never
    acted on.

    Args:
        root: the Root every call resolves from (kept open by the caller).
        path: relative sandbox path of the directory (no ``..``, ``.`` or
            empty component, not absolute).
        identity: ``(st_dev, st_ino)`` the directory had when it was made.

    Argument paths of the methods are relative to the directory, as for a
    :class:`Root`; ``""``/``"."`` name the directory itself (only
    :meth:`chmod` acts on it).

    Raises (every method, besides the :class:`Root` method's own errors):
        DirectoryReplacedError: the directory at ``path`` is not ``identity``.
        FileNotFoundError, NotADirectoryError, SymlinkRefusedError: nothing,
            a non-directory, or a symlink is at ``path`` now.
        InvalidPathError: (constructor) ``path`` is not such a path.
    """

    __slots__ = ("root", "path", "identity")

    def __init__(self, root: Root, path: str | bytes, identity: tuple[int, int]) -> None:
        b = os.fsencode(path) if isinstance(path, str) else bytes(path)
        b = b.rstrip(b"/")
        wrapped = b"/" + b + b"/"
        if not b or b[:1] == b"/" or b"/../" in wrapped or b"/./" in wrapped or b"//" in wrapped:
            raise InvalidPathError("a Subtree needs a normalized path below the root",
                                   sandbox_path=display_path(os.fsdecode(b) or "."))
        self.root = root
        self.path = b
        self.identity = identity

    def __repr__(self) -> str:
        return f"<Subtree {display_path(os.fsdecode(self.path))} of {self.root!r}>"

    @property
    def resolver(self) -> str:
        return self.root.resolver

    def _shown(self) -> str:
        return self.root._show(self.path)

    def enter(self) -> Root:
        """A Root on the directory at ``path`` now, checked to be ``identity`` (the caller closes it).

        Hold it for one short step only: it follows the directory if that is
        moved meanwhile.

        Raises:
            DirectoryReplacedError: another directory is at ``path``.
            FileNotFoundError: nothing is at ``path`` now.
            NotADirectoryError: a non-directory is at ``path`` now.
            SymlinkRefusedError, PathEscapeError: a symlink is at ``path`` now
                (refused, or pointing outside the Root).
            WorkspaceClosedError: the Root is closed.
            OSError(EMFILE): the process has no free fd.
        """
        r = self.root.open_root(self.path)
        if r.identity != self.identity:
            r.close()
            raise DirectoryReplacedError("the directory was replaced by another process", sandbox_path=self._shown())
        return r

    def mkdir(self, path: str | bytes, mode: int = 0o755, *, parents: bool = False, exist_ok: bool = False) -> None:
        """:meth:`Root.mkdir` of ``path`` beneath the directory.

        Raises:
            FileExistsError, FileNotFoundError, PermissionError,
                UnsafeModeError, ReadOnlyError, OSError: as :meth:`Root.mkdir`; and those of :meth:`enter`.
        """
        with self.enter() as r:
            r.mkdir(path, mode, parents=parents, exist_ok=exist_ok)

    def open_fd(self, path: str | bytes, flags: int = os.O_RDONLY, mode: int = 0o644, **kw: Any) -> int:
        """:meth:`Root.open_fd` of ``path`` beneath the directory.

        Raises:
            SpecialFileError, FileNotFoundError, PermissionError,
                ReadOnlyError, OSError: as :meth:`Root.open_fd`; and those of :meth:`enter`.
        """
        with self.enter() as r:
            return r.open_fd(path, flags, mode, **kw)

    def remove(self, path: str | bytes) -> None:
        """:meth:`Root.remove` of ``path`` beneath the directory.

        Raises:
            IsADirectoryError, FileNotFoundError, ReadOnlyError,
                PermissionError, OSError: as :meth:`Root.remove`; and those of :meth:`enter`.
        """
        with self.enter() as r:
            r.remove(path)

    def atomic_write(self, path: str | bytes, data: Any, **kw: Any) -> int:
        """:meth:`Root.atomic_write` of ``path`` beneath the directory.

        Raises:
            IsADirectoryError, UnsafeModeError, ReadOnlyError,
                PermissionError, OSError: as :meth:`Root.atomic_write`; and those of :meth:`enter`.
        """
        with self.enter() as r:
            return r.atomic_write(path, data, **kw)

    def link(self, src: str | bytes, dst: str | bytes) -> None:
        """:meth:`Root.link`: both names beneath the directory.

        Raises:
            FileExistsError, FileNotFoundError, PermissionError,
                ReadOnlyError, OSError: as :meth:`Root.link`; and those of :meth:`enter`.
        """
        with self.enter() as r:
            r.link(src, dst)

    def symlink(self, target: str | bytes, path: str | bytes) -> None:
        """:meth:`Root.symlink` at ``path``: ``target`` may not climb above the directory.

        Raises:
            PathEscapeError: ``target`` is absolute or climbs above the directory
                (the link would point out of it).
            FileExistsError, ReadOnlyError, PermissionError, InvalidPathError,
                OSError: as :meth:`Root.symlink`; and those of :meth:`enter`.
        """
        with self.enter() as r:
            r.symlink(target, path)

    def chmod(self, path: str | bytes, mode: int) -> None:
        """:meth:`Root.chmod` of ``path``; ``""``/``"."``: the directory itself (``fchmod`` of a checked fd).

        Raises:
            UnsafeModeError: ``mode`` has bits outside 0o777.
            ReadOnlyError: a read-only Root, or the directory is (or is
                beneath) a read-only grant.
            PermissionError: EPERM: the caller does not own the directory.
            DirectoryReplacedError, FileNotFoundError, NotADirectoryError,
                SymlinkRefusedError: see :meth:`enter`.
            FileNotFoundError, SymlinkRefusedError, OSError: as :meth:`Root.chmod`.
        """
        if path in ("", ".", b"", b"."):
            _check_mode(mode, self._shown())
            self.root._check_writable(self.path, "chmod")
            with self.enter() as r:  # read-only grants: Root.open_root made r read-only
                r._check_writable(b".", "chmod")
                fd = r.open_fd(".", os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fchmod(fd, mode)
                finally:
                    os.close(fd)
            return
        with self.enter() as r:
            r.chmod(path, mode)

    def lstat(self, path: str | bytes) -> os.stat_result:
        """:meth:`Root.lstat` of ``path`` beneath the directory.

        Raises:
            FileNotFoundError, NotADirectoryError, PermissionError,
                PathEscapeError, SymlinkRefusedError, InvalidPathError: as :meth:`Root.lstat`;
                and those of :meth:`enter`.
        """
        with self.enter() as r:
            return r.lstat(path)

    def listdir(self, path: str | bytes = ".") -> list[str]:
        """:meth:`Root.listdir` of ``path`` beneath the directory.

        Raises:
            NotADirectoryError, FileNotFoundError, PermissionError,
                OSError: as :meth:`Root.listdir`; and those of :meth:`enter`.
        """
        with self.enter() as r:
            return r.listdir(path)

    def remove_tree(self) -> bool:
        """Remove the directory and everything in it, only if it is still the one recorded.

        Its contents are removed through the checked fd (:meth:`Root.clear`
        with ``make_writable``: never through a symlink, never into a mount
        point, read-only directories made writable through their own fds),
        then the empty directory by name, after one more identity check (a
        directory put at the name between that check and the ``rmdir`` is
        removed only if it is empty).

        Returns:
            True when it was removed; False when the name holds nothing, or
            something this Subtree did not make (left alone), or something
            was kept (a mount point).

        Raises:
            ReadOnlyError: a read-only grant was moved into the tree (kept).
            PermissionError: an entry cannot be removed (EPERM ...).
            OSError: a removal failed (EBUSY ...).
            WorkspaceClosedError: the Root is closed.
        """
        try:
            r = self.enter()
        except (FileNotFoundError, NotADirectoryError, DirectoryReplacedError, SymlinkRefusedError,
                PathEscapeError):
            return False
        with r:
            r.clear(make_writable=True)
        try:
            self.root.rmdir(self.path, expect=self.identity)  # checked where it cannot be swapped
        except OSError:
            return False  # not empty (something was kept), or another directory at the name (left)
        return True


_HOST_SYMLINK_REASON = ("the host path, or a directory on it, is a symlink (a sandboxed party could have "
                        "planted it); give the physical path, or opt in with follow_symlinks=True "
                        "(CLI: --follow-host-symlinks) for a trusted symlinked path")
_HOST_DIR_FLAGS = _DIR_FLAGS | os.O_CLOEXEC  # no O_NOFOLLOW: RESOLVE_NO_SYMLINKS refuses a final symlink too


def _host_components(host_dir: str | os.PathLike[Any] | bytes, shown: str) -> tuple[bool, int, list[bytes]]:
    """Split a host path lexically into ``(absolute, leading '..' count, components)``.

    ``.`` and empty components are dropped and ``..`` cancels the component
    before it: once no component may be a symlink this is also the physical
    answer, and no ``..`` is left for a concurrent rename to redirect.
    ``..`` at ``/`` stays at ``/`` (POSIX).
    """
    raw = os.fsencode(host_dir)
    if raw == b"":
        raise InvalidPathError("the host path is empty", sandbox_path=shown)
    if b"\0" in raw:
        raise InvalidPathError("the host path contains a NUL byte", sandbox_path=shown)
    absolute = raw.startswith(b"/")
    up = 0
    out: list[bytes] = []
    for comp in raw.split(b"/"):
        if comp in (b"", b"."):
            continue
        if comp == b"..":
            if out:
                out.pop()
            elif not absolute:
                up += 1
            continue
        out.append(comp)
    return absolute, up, out


def is_beneath(child_fd: int, ancestor: tuple[int, int]) -> bool:
    """True when directory ``child_fd`` is the directory ``ancestor`` or lies below it.

    Walks ``..`` from the fd with ``O_PATH`` fds (the physical parent, never
    a symlink; at the root of a mount, the directory the mount is on) and
    compares each directory's ``(st_dev, st_ino)``: nothing is resolved by
    path, so a symlinked or renamed path to the same directory is seen.

    Args:
        child_fd: a directory fd (borrowed; not closed).
        ancestor: the ``(st_dev, st_ino)`` of the directory looked for.

    Returns:
        False once ``/`` is passed without meeting it, or past 4096 levels.

    Raises:
        OSError: a ``..`` could not be opened.
    """
    cur = os.dup(child_fd)
    try:
        for _ in range(4096):
            st = os.fstat(cur)
            ident = (st.st_dev, st.st_ino)
            if ident == ancestor:
                return True
            up = os.open("..", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=cur)
            ust = os.fstat(up)
            os.close(cur)
            cur = up
            if (ust.st_dev, ust.st_ino) == ident:
                return False
        return False
    finally:
        os.close(cur)


def _host_start_fd(absolute: bool, up: int, shown: str) -> int:
    """An ``O_PATH`` fd of ``/`` (absolute paths) or of the cwd climbed ``up`` times by ``..``."""
    try:
        fd = os.open("/" if absolute else ".", _HOST_DIR_FLAGS)
    except OSError as exc:
        _native.raise_errno(exc.errno or errno.EIO, "open_root", shown)
        raise
    try:
        for _ in range(up):  # ".." is the physical parent, never a symlink
            parent = os.open("..", _HOST_DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = parent
    except OSError as exc:
        os.close(fd)
        _native.raise_errno(exc.errno or errno.EIO, "open_root", shown)
        raise
    return fd


def _open_host_step(resolver: str, dirfd: int, rel: bytes, shown: str) -> int:
    try:
        return _native.open_beneath(resolver, dirfd, rel, _HOST_DIR_FLAGS, 0, _native.RESOLVE_NO_SYMLINKS,
                                    "open_root", shown)
    except (SymlinkRefusedError, PathEscapeError):
        # ELOOP from RESOLVE_NO_SYMLINKS (EXDEV: the fallback walker meeting a magic link)
        raise SymlinkRefusedError(_HOST_SYMLINK_REASON, sandbox_path=shown,
                                  context={"operation": "open_root"}) from None


def open_host_dir_fd(host_dir: str | os.PathLike[Any] | bytes, *, create: bool = False, mode: int = 0o700,
                     follow_symlinks: bool = False, label: str = "") -> int:
    """Open a trusted host directory by the host-path rule; returns an ``O_PATH|O_DIRECTORY`` fd.

    The rule (one for every host path the library or the CLI is given: grants,
    workspace roots, trusted base directories, stores, extraction targets):
    the path is normalized lexically (``.``, ``//`` and ``..`` removed), then
    resolved by the kernel beneath an fd of ``/`` (absolute paths) or of the
    current directory (relative ones; leading ``..`` climb from it by fd) with
    ``openat2(RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)``, or the fallback
    walker with the same flags: no component, the last included, may be a
    symlink, so a link a confined command planted in a directory it can write
    cannot redirect the path.

    Args:
        host_dir: absolute or relative host path (``str``, ``bytes`` or path-like).
        create: make missing directories, one component at a time (``mkdirat``
            relative to the parent fd, ``mode`` before the umask, then
            entered again by the same rule), never following a symlink.
        mode: permission bits of directories made by ``create``.
        follow_symlinks: the documented opt-in for a *trusted* symlinked path
            (for example a ``/tmp -> /private/tmp`` host): symlinks on the
            path are followed by the kernel as ``open(2)`` does.  Only for
            paths whose every directory the sandbox cannot write.
        label: the sandbox-path prefix shown in errors (never the host path).

    Raises:
        SymlinkRefusedError: a component is a symlink (code ``symlink_refused``).
        InvalidPathError: ``host_dir`` is empty or holds a NUL byte.
        NotADirectoryError: a component is not a directory.
        FileNotFoundError: a component does not exist (and not ``create``).
        PermissionError: a component cannot be searched or made.
    """
    shown = label or "."
    if follow_symlinks:
        try:
            if create:
                os.makedirs(host_dir, mode=mode, exist_ok=True)  # host-access: trusted, caller opted in
            return os.open(host_dir, _HOST_DIR_FLAGS)  # host-access: trusted, caller opted in
        except OSError as exc:
            _native.raise_errno(exc.errno or errno.EIO, "open_root", shown)
            raise
    resolver = _native.choose_resolver()
    absolute, up, comps = _host_components(host_dir, shown)
    cur = _host_start_fd(absolute, up, shown)
    try:
        if not create:
            return _open_host_step(resolver, cur, b"/".join(comps) or b".", shown)
        for comp in comps:
            try:
                nxt = _open_host_step(resolver, cur, comp, shown)
            except FileNotFoundError:
                try:
                    os.mkdir(comp, mode, dir_fd=cur)
                except FileExistsError:
                    pass  # made meanwhile: entered by the same rule below
                except OSError as exc:
                    _native.raise_errno(exc.errno or errno.EIO, "open_root", shown)
                nxt = _open_host_step(resolver, cur, comp, shown)
            os.close(cur)
            cur = nxt
        out, cur = cur, -1
        return out
    finally:
        if cur >= 0:
            os.close(cur)


def open_root(host_dir: str | os.PathLike[Any], *, read_only: bool = False, no_symlinks: bool = False,
              label: str = "", follow_symlinks: bool = False, create: bool = False, mode: int = 0o700,
              owner: tuple[int, int] | None = None, shown: str | None = None) -> Root:
    """Open the trusted host directory ``host_dir`` as a :class:`Root`.  The explicit host-access constructor.

    ``host_dir`` is resolved by the host-path rule of :func:`open_host_dir_fd`:
    no symlink on any component (``RESOLVE_NO_SYMLINKS`` from an fd of ``/``
    or of the cwd), unless ``follow_symlinks``.  It is opened once as an
    ``O_PATH|O_DIRECTORY`` fd; from then on only that fd is used, so renaming
    or replacing the host path later does not move the capability.

    Args:
        host_dir: absolute or relative host path of a directory (trusted: it
            comes from the host application; the directories on it need not be).
        read_only: refuse every write through this Root.
        no_symlinks: refuse every symlink on every path beneath the Root
            (RESOLVE_NO_SYMLINKS).
        label: sandbox-path prefix shown in error messages (never the host path).
        follow_symlinks: opt in to following symlinks on ``host_dir`` itself,
            for a trusted symlinked path (see :func:`open_host_dir_fd`).
        create: make ``host_dir`` and missing parents (mode ``mode``) first,
            by the same rule.
        mode: permission bits of the directories ``create`` makes.
        owner: ``(uid, gid)`` given to every entry created through the Root
            and its children (see :class:`Root`); None: as the process makes
            them.  (The directories ``create`` makes keep the process's owner.)
        shown: the name errors from opening ``host_dir`` itself give it
            (``"grant data"``, ``"WORKSPACE"``: never the host path); default
            ``label``.

    Raises:
        InvalidArgumentError: ``owner`` is not None or two ints in 0 .. 2**32 - 2.
        SymlinkRefusedError: ``host_dir`` or a directory on it is a symlink.
        InvalidPathError: ``host_dir`` is empty or holds a NUL byte.
        NotADirectoryError: ``host_dir`` (or a component) is not a directory.
        FileNotFoundError: ``host_dir`` does not exist (and not ``create``).
    """
    owner = check_owner(owner)
    resolver = _native.choose_resolver()
    fd = open_host_dir_fd(host_dir, create=create, mode=mode, follow_symlinks=follow_symlinks,
                          label=label if shown is None else shown)
    return Root(fd, read_only=read_only, no_symlinks=no_symlinks, resolver=resolver, label=label, owner=owner)


def _host_parent(path: str | os.PathLike[Any] | bytes, follow_symlinks: bool, label: str) -> tuple[int, bytes]:
    """``(O_PATH fd of the parent directory, leaf name)`` of a host *file* path, by the host-path rule."""
    shown = label or "."
    absolute, up, comps = _host_components(path, shown)
    if not comps:
        _native.raise_errno(errno.EISDIR, "open_host_file", shown)
    parent = (b"/" if absolute else b"") + b"/".join([b".."] * up + comps[:-1])
    return open_host_dir_fd(parent or b".", follow_symlinks=follow_symlinks, label=label), comps[-1]


def open_host_file_fd(path: str | os.PathLike[Any] | bytes, *, follow_symlinks: bool = False, label: str = "") -> int:
    """Open a trusted host *file* for reading by the host-path rule; returns an ``O_RDONLY`` fd.

    The parent directory is opened as :func:`open_host_dir_fd` does (no
    symlink on any component unless ``follow_symlinks``); the file itself with
    ``O_NOFOLLOW|O_NONBLOCK`` relative to that fd, then checked to be a
    regular file, so a symlink, FIFO or device put at the name is never read.

    Args:
        path: absolute or relative host path of a regular file.
        follow_symlinks: the trusted-symlinked-path opt-in (see :func:`open_host_dir_fd`).
        label: the name shown in errors (never the host path).

    Raises:
        SymlinkRefusedError: the file or a directory on its path is a symlink.
        SpecialFileError: the file is a FIFO, socket, device or directory.
        FileNotFoundError, PermissionError: as ``open(2)``.
    """
    shown = label or "."
    pfd, leaf = _host_parent(path, follow_symlinks, label)
    try:
        nofollow = 0 if follow_symlinks else os.O_NOFOLLOW
        try:
            fd = os.open(leaf, os.O_RDONLY | os.O_NONBLOCK | nofollow | os.O_CLOEXEC, dir_fd=pfd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise SymlinkRefusedError(_HOST_SYMLINK_REASON, sandbox_path=shown,
                                          context={"operation": "open_host_file"}) from None
            _native.raise_errno(exc.errno or errno.EIO, "open_host_file", shown)
            raise
    finally:
        os.close(pfd)
    st = os.fstat(fd)
    if not _stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise SpecialFileError(f"not a regular file ({kind_of(st.st_mode)})", sandbox_path=shown,
                               context={"operation": "open_host_file"})
    os.set_blocking(fd, True)
    return fd


def open_host_device_fd(path: str | os.PathLike[Any] | bytes, *, label: str = "") -> int:
    """Open a trusted host *device node* by the host-path rule; returns an ``O_PATH`` fd on it.

    The parent directory is opened as :func:`open_host_dir_fd` does (no
    symlink on any component); the node itself with ``O_PATH|O_NOFOLLOW``
    relative to that fd (no device open: no driver code runs), then checked
    to be a character or block device.

    Args:
        path: absolute or relative host path of a device node.
        label: the name shown in errors (never the host path).

    Raises:
        SymlinkRefusedError: the node or a directory on its path is a symlink.
        SpecialFileError: the entry is not a character or block device.
        FileNotFoundError, PermissionError: as ``open(2)``.
    """
    shown = label or "."
    pfd, leaf = _host_parent(path, False, label)
    try:
        try:
            fd = os.open(leaf, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
        except OSError as exc:
            _native.raise_errno(exc.errno or errno.EIO, "open_host_device", shown)
            raise
    finally:
        os.close(pfd)
    st = os.fstat(fd)
    if _stat.S_ISLNK(st.st_mode):
        os.close(fd)
        raise SymlinkRefusedError(_HOST_SYMLINK_REASON, sandbox_path=shown, context={"operation": "open_host_device"})
    if not (_stat.S_ISCHR(st.st_mode) or _stat.S_ISBLK(st.st_mode)):
        os.close(fd)
        raise SpecialFileError(f"not a device node ({kind_of(st.st_mode)})", sandbox_path=shown,
                               context={"operation": "open_host_device"})
    return fd


def write_host_file_atomic(path: str | os.PathLike[Any] | bytes, data: bytes, *, mode: int = 0o600,
                           follow_symlinks: bool = False, label: str = "") -> None:
    """Write an operator-output file (a state file, a report) atomically, never replacing a special file.

    The parent directory is opened by the host-path rule
    (:func:`open_host_dir_fd`); the data goes to a new temporary file made
    there (``O_CREAT|O_EXCL|O_NOFOLLOW``, ``fchmod`` to ``mode``, ``fsync``),
    which then takes the name.  Anything but a regular file at the name (a
    symlink, a device such as ``/dev/full``, a FIFO, a socket, a directory)
    is refused without being touched; an empty name is taken with
    ``renameat2(RENAME_NOREPLACE)``; a regular file is swapped out with
    ``RENAME_EXCHANGE`` and what came out is checked: a regular file is
    unlinked, anything else (put there meanwhile) is exchanged back and the
    write refused, so a special file is never replaced or written through.  On a filesystem without ``RENAME_EXCHANGE`` the name is checked
    with ``fstatat`` first and replaced by ``renameat`` (a window between the
    two remains there).

    Args:
        path: the host file path the operator named.
        data: the bytes to write.
        mode: permission bits of the file (the umask is not applied).
        follow_symlinks: the trusted-symlinked-path opt-in for the *directories*
            on the path; the file name itself is never followed.
        label: the name shown in errors (never the host path).

    Raises:
        SpecialFileError: the name holds something other than a regular file.
        SymlinkRefusedError: a directory on the path is a symlink.
        OSError: the directory cannot be written.
    """
    shown = label or "."
    pfd, leaf = _host_parent(path, follow_symlinks, label)
    tmp = b".sfs-out-" + os.urandom(8).hex().encode()
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=pfd)
        placed = False
        try:
            try:
                view = memoryview(data)
                done = 0
                while done < len(view):
                    done += os.write(fd, view[done:])
                os.fchmod(fd, mode)
                os.fsync(fd)
            finally:
                os.close(fd)
            placed = _place_output(pfd, tmp, leaf, shown)
        finally:
            if not placed:
                try:
                    os.unlink(tmp, dir_fd=pfd)
                except OSError:
                    pass
    finally:
        os.close(pfd)


def check_host_output_target(path: str | os.PathLike[Any] | bytes, *, follow_symlinks: bool = False,
                             label: str = "") -> None:
    """Refuse early what :func:`write_host_file_atomic` would refuse at ``path``; writes nothing.

    For a caller that must not start work whose result it could then not
    record (``sandbox-fs run --state``).  The write itself checks again.

    Raises:
        SpecialFileError: the name holds something other than a regular file.
        SymlinkRefusedError: a directory on the path, or the name itself, is a symlink.
        OSError: the directory does not exist or cannot be opened.
    """
    shown = label or "."
    pfd, leaf = _host_parent(path, follow_symlinks, label)
    try:
        try:
            st = os.stat(leaf, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if _stat.S_ISLNK(st.st_mode):
            _native.raise_errno(errno.ELOOP, "write_host_file", shown)
        _refuse_output_target(st, shown)
    finally:
        os.close(pfd)


def _refuse_output_target(st: os.stat_result, shown: str) -> None:
    if not _stat.S_ISREG(st.st_mode):
        raise SpecialFileError(f"refusing to replace a {kind_of(st.st_mode)} with an output file",
                               sandbox_path=shown, context={"operation": "write_host_file"})


def _place_output(pfd: int, tmp: bytes, leaf: bytes, shown: str) -> bool:
    """Move ``tmp`` to ``leaf`` in ``pfd``; True once ``tmp`` no longer names our file."""
    for _ in range(8):  # bounded: each round lost means another party changed the name meanwhile
        try:
            _refuse_output_target(os.stat(leaf, dir_fd=pfd, follow_symlinks=False), shown)
        except FileNotFoundError:
            ret = _native.renameat2_raw(pfd, tmp, pfd, leaf, _native.RENAME_NOREPLACE)
            if ret == 0:
                return True
            if ret == -errno.EEXIST:
                continue  # made meanwhile: look again
            if ret != -errno.EINVAL:
                _native.raise_errno(-ret, "write_host_file", shown)
            break  # no renameat2 flags on this filesystem
        # A regular file is there: exchange, then check what was exchanged out
        # (another party may have put something else at the name meanwhile).
        ret = _native.renameat2_raw(pfd, tmp, pfd, leaf, _native.RENAME_EXCHANGE)
        if ret == -errno.ENOENT:
            continue  # the name went away meanwhile
        if ret == -errno.EINVAL:
            break
        _native.check(ret, "write_host_file", shown)
        old = os.stat(tmp, dir_fd=pfd, follow_symlinks=False)  # what was at the name
        if not _stat.S_ISREG(old.st_mode):
            _native.renameat2(pfd, tmp, pfd, leaf, _native.RENAME_EXCHANGE, "write_host_file", shown)
            _refuse_output_target(old, shown)
        os.unlink(tmp, dir_fd=pfd)  # the previous regular file, now under our temporary name
        return True
    else:
        _native.raise_errno(errno.EAGAIN, "write_host_file", shown)
    try:  # a filesystem without RENAME_NOREPLACE / RENAME_EXCHANGE: check, then rename
        _refuse_output_target(os.stat(leaf, dir_fd=pfd, follow_symlinks=False), shown)
    except FileNotFoundError:
        pass
    _native.renameat2(pfd, tmp, pfd, leaf, 0, "write_host_file", shown)
    return True
