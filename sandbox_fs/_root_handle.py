"""``Handle``: an ``O_PATH`` fd on one entry beneath a :class:`~sandbox_fs.root.Root`, never a path.

A libpathrs-style handle for callers that keep inodes, not names (the FUSE
daemon keeps one per inode it has told the kernel about).  Every method acts
on the held fd itself, or on the held directory fd plus ONE name component:

* a ``name`` is ``bytes``, one component; empty, ``b"."``, ``b".."``, or
  anything holding ``b"/"`` or NUL raises :class:`InvalidPathError` before
  any system call, so no name can climb out of, or walk beneath, the
  directory held;
* every ``*at`` call acts on the name without following it
  (``O_NOFOLLOW``/``AT_SYMLINK_NOFOLLOW``): a symlink leaf is the link;
* calls on the entry itself use ``AT_EMPTY_PATH`` on the fd (``fstat``,
  ``fchmodat2``, ``fchownat``, ``utimensat``, ``linkat``, ``readlinkat``):
  nothing reopens ``/proc/self/fd/N`` (a magic link) and nothing builds a
  path string.

So a directory swapped for a symlink after a handle on it was taken changes
nothing: the handle still acts on the inode it holds.

Errors: every failure of the file system is an ``OSError`` with its errno
(the matching subclass: ``FileNotFoundError`` ...; ``filename`` is the
``label`` the caller passed, or None: never a host path).  Refusals made
here are :class:`ReadOnlyError` (EROFS: any change through a handle of a
read-only Root), :class:`PathEscapeError` (EXDEV: a link or rename between
handles of different Roots), :class:`SymlinkRefusedError` (ELOOP:
:meth:`Handle.open` met a symlink), :class:`SpecialFileError` (errno EINVAL:
:meth:`Handle.open` met a FIFO, socket or device) and, with errno EBADF, a
plain ``OSError`` when the handle or its Root is closed.  The
one exception that is not an ``OSError`` is :class:`InvalidPathError` for a
malformed name (and ``TypeError`` for a name that is not ``bytes``).

Thread-safety: methods may be called from several threads at once; do not
call :meth:`Handle.close` while another thread uses the handle (the fd number
could be reused).
"""

from __future__ import annotations

import errno
import os
import stat as _stat
import struct
from typing import TYPE_CHECKING, Any, Final

from . import _native
from .errors import InvalidPathError, PathEscapeError, ReadOnlyError, SymlinkRefusedError

if TYPE_CHECKING:
    from .root import Root

__all__ = ["Handle"]

_O_PATH: Final = _native.O_PATH
_LOOKUP_FLAGS: Final = _native.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_OPEN_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_WRITE_FLAGS: Final = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_RENAME_FLAGS: Final = _native.RENAME_NOREPLACE | _native.RENAME_EXCHANGE
_EINTR: Final = errno.EINTR
_open_name = _native.open_name
_make_name = _native.make_name
_getdents = _native.getdents
_NULL = _native.NULL
_DIRENT = struct.Struct("=QqHB")  # linux_dirent64: d_ino, d_off, d_reclen, d_type; then the name
_DIRENT_SIZE: Final = _DIRENT.size
_LISTDIR_BUF_BYTES: Final = 1 << 16


class _Now:
    """The type of :data:`Handle.NOW`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "Handle.NOW"


def _bad_name(name: Any) -> None:
    """Raise for a name that is not exactly one component (called only once the quick test failed)."""
    if type(name) is not bytes:
        raise TypeError(f"name must be bytes, not {type(name).__name__}")
    raise InvalidPathError("a name must be one path component: not empty, '.' or '..', no '/' or NUL",
                           sandbox_path=None)


def _fail(err: int, op: str, label: str | None) -> None:
    """Raise the OSError for positive errno ``err`` during ``op``; ``label`` is the only path shown."""
    if err == errno.ELOOP:
        raise SymlinkRefusedError(f"{op}: the name is a symlink, which is never followed here",
                                  sandbox_path=label, context={"operation": op})
    exc = OSError(err, f"{os.strerror(err)} ({op})", label)
    exc.operation = op  # type: ignore[attr-defined]
    raise exc


def _check(ret: int, op: str, label: str | None) -> int:
    if ret < 0:
        _fail(-ret, op, label)
    return ret


class Handle:
    """An ``O_PATH|O_NOFOLLOW|O_CLOEXEC`` fd on one entry beneath a Root (see the module docstring).

    Made by :meth:`sandbox_fs.root.Root.handle` and by the methods here that
    return one; never construct it directly.  A handle belongs to the Root
    it came from: it is read-only when that Root is, it stops working when
    that Root is closed, and it refuses links and renames with handles of
    another Root (``EXDEV``).  It owns its fd (closed by :meth:`close`, the
    context manager, or garbage collection).

    Every method takes a keyword-only ``label``: the sandbox path errors
    show (``OSError.filename``); it is never used for anything else.

    Attributes:
        fd: the owned ``O_PATH`` fd (-1 once closed).
        read_only: True when every change through this handle is refused
            (``EROFS``): its Root is read-only, or it is in a read-only grant
            nested in its Root.
    """

    __slots__ = ("fd", "read_only", "_key", "_root", "__weakref__")

    #: pass as ``atime_ns``/``mtime_ns`` to :meth:`set_times` for the current time
    NOW: Final = _Now()

    def __init__(self, fd: int, root: "Root", read_only: bool) -> None:
        self.fd = fd
        self._root = root
        self.read_only = read_only
        self._key: tuple[int, int] | None = None

    # ------------------------------------------------------------------ basics

    def __repr__(self) -> str:
        return f"<Handle fd={self.fd} {'ro' if self.read_only else 'rw'}>"

    def close(self) -> None:
        """Close the fd.  Idempotent."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> "Handle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass

    @property
    def closed(self) -> bool:
        """True once this handle or its Root is closed."""
        return self.fd < 0 or self._root.closed

    @property
    def key(self) -> tuple[int, int]:
        """``(st_dev, st_ino)`` of the entry held (taken once, by ``fstat``, then remembered).

        Raises:
            OSError(EBADF): the handle or its Root is closed.
        """
        key = self._key
        if key is None:
            st = self.stat()
            key = (st.st_dev, st.st_ino)
        return key

    def _fd(self, label: str | None) -> int:
        """The fd to use, or OSError(EBADF) when this handle or its Root is closed."""
        fd = self.fd
        if fd < 0 or self._root._closing:
            _fail(errno.EBADF, "handle", label)
        return fd

    def _dir_fd(self, name: Any, label: str | None) -> int:
        """Check ``name`` (one component), then return the fd to use."""
        if type(name) is not bytes or not name or b"/" in name or b"\0" in name or name == b"." or name == b"..":
            _bad_name(name)
        return self._fd(label)

    def _writable(self, op: str, label: str | None) -> None:
        if self.read_only:
            raise ReadOnlyError(f"{op}: this handle's Root is read-only", sandbox_path=label,
                                context={"operation": op})

    def _writable_leaf(self, fd: int, name: bytes, op: str, label: str | None) -> None:
        """:meth:`_writable`, and where read-only grants are nested in the Root: ``name`` is not one of them."""
        self._writable(op, label)
        deny = self._root._deny
        if deny:
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                return  # nothing there (the call itself reports it)
            if (st.st_dev, st.st_ino) in deny:
                raise ReadOnlyError(f"{op}: this directory is a read-only grant", sandbox_path=label,
                                    context={"operation": op})

    def _writable_inplace(self, fd: int, op: str, label: str | None) -> None:
        """:meth:`_writable`, and where read-only grants are nested in the Root: not a multiply-linked file."""
        self._writable(op, label)
        if self._root._deny:
            st = os.fstat(fd)
            if _stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                raise ReadOnlyError(f"{op}: in-place change of a multiply-linked file where read-only grants "
                                    "are nested (it could be a hard link into one)", sandbox_path=label,
                                    context={"operation": op})

    def _same_root(self, other: "Handle", op: str, label: str | None) -> None:
        if type(other) is not Handle:
            raise TypeError(f"{op}: expected a Handle, not {type(other).__name__}")
        if other._root is not self._root and other._root.identity != self._root.identity:
            raise PathEscapeError(f"{op}: the handles belong to different Roots", sandbox_path=label,
                                  context={"operation": op})

    def _child(self, fd: int) -> "Handle":
        """A Handle on ``fd`` (an entry beneath this one): read-only as this one, or a read-only grant."""
        child = Handle(fd, self._root, self.read_only)
        deny = self._root._deny
        if deny and not child.read_only:
            try:
                st = os.fstat(fd)
            except BaseException:
                os.close(fd)
                raise
            child._key = (st.st_dev, st.st_ino)
            child.read_only = child._key in deny
        return child

    def _owner(self, owner: tuple[int, int] | None) -> tuple[int, int]:
        if owner is None:
            owner = self._root.owner
            if owner is None:
                return (-1, -1)
        if (type(owner) is not tuple or len(owner) != 2
                or not all(type(i) is int and 0 <= i <= 0xFFFFFFFE for i in owner)):
            _fail(errno.EINVAL, "owner", None)
        return owner

    # ------------------------------------------------------------ the entry itself

    def stat(self, *, label: str | None = None) -> os.stat_result:
        """``fstat`` of the entry held (a symlink's own status for a handle on a link).

        Raises:
            OSError: EBADF when the handle or its Root is closed.
        """
        try:
            st = os.fstat(self._fd(label))
        except OSError as exc:
            _fail(exc.errno or errno.EIO, "stat", label)
            raise  # unreachable
        if self._key is None:
            self._key = (st.st_dev, st.st_ino)
        return st

    def statvfs(self, *, label: str | None = None) -> os.statvfs_result:
        """``fstatvfs`` of the file system holding the entry.

        Raises:
            OSError: EBADF when the handle or its Root is closed.
        """
        try:
            return os.fstatvfs(self._fd(label))
        except OSError as exc:
            _fail(exc.errno or errno.EIO, "statvfs", label)
            raise  # unreachable

    def readlink(self, *, label: str | None = None) -> bytes:
        """The target of the symlink held: ``readlinkat(fd, "")``.

        Raises:
            OSError(EINVAL): the entry held is not a symlink.
        """
        try:
            return os.readlink(b"", dir_fd=self._fd(label))
        except OSError as exc:
            # readlinkat(fd, "") of a non-link is ENOENT; readlink(2) says EINVAL for that
            _fail(errno.EINVAL if exc.errno == errno.ENOENT else exc.errno or errno.EIO, "readlink", label)
            raise  # unreachable

    def open_dir(self, *, label: str | None = None) -> int:
        """A new ``O_RDONLY|O_DIRECTORY|O_CLOEXEC`` fd on the directory held (``openat(fd, ".")``); caller closes it.

        Raises:
            NotADirectoryError: the entry held is not a directory.
            PermissionError: no read permission on it.
        """
        fd = self._fd(label)
        while True:
            try:
                return os.open(".", _DIR_OPEN_FLAGS, dir_fd=fd)
            except InterruptedError:
                continue
            except OSError as exc:
                _fail(exc.errno or errno.EIO, "open_dir", label)

    def listdir(self, *, label: str | None = None) -> list[tuple[bytes, int, int]]:
        """The entries of the directory held, without ``.`` and ``..``: ``[(name, d_ino, d_type), ...]``.

        ``d_type`` is a ``DT_*`` value (``stat.S_IFMT(mode) >> 12``); 0
        (``DT_UNKNOWN``) where the file system does not tell.  Read with
        ``getdents64`` on a new fd of the directory, in the order the file
        system gives.

        Raises:
            NotADirectoryError, PermissionError: see :meth:`open_dir`.
        """
        dfd = self.open_dir(label=label)
        try:
            buf = bytearray(_LISTDIR_BUF_BYTES)
            cbuf = _native.buffer_of(buf)
            out: list[tuple[bytes, int, int]] = []
            unpack = _DIRENT.unpack_from
            while True:
                n = _getdents(dfd, cbuf, _LISTDIR_BUF_BYTES)
                if n <= 0:
                    if n == -_EINTR:
                        continue
                    _check(n, "listdir", label)
                    return out
                view = bytes(memoryview(buf)[:n])
                pos = 0
                while pos < n:
                    d_ino, _, reclen, d_type = unpack(view, pos)
                    start = pos + _DIRENT_SIZE
                    name = view[start:view.index(b"\0", start)]
                    if name != b"." and name != b"..":
                        out.append((name, d_ino, d_type))
                    pos += reclen
        finally:
            os.close(dfd)

    def chmod(self, mode: int, *, label: str | None = None) -> None:
        """Set the permission bits (``mode & 0o7777``) of the entry held: ``fchmodat2(fd, "", AT_EMPTY_PATH)``.

        No set-id policy here (that is the caller's).

        Raises:
            ReadOnlyError: a read-only handle.
            OSError(EOPNOTSUPP): the entry held is a symlink (Linux never
                changes a link's mode); EINVAL: ``mode`` outside 0 .. 0o7777;
                ENOSYS: a kernel older than 6.6 (no fchmodat2).
        """
        fd = self._fd(label)
        self._writable_inplace(fd, "chmod", label)
        if type(mode) is not int or mode < 0 or mode > 0o7777:
            _fail(errno.EINVAL, "chmod", label)
        _check(_native.fchmod_empty(fd, mode), "chmod", label)

    def chown(self, uid: int, gid: int, *, label: str | None = None) -> None:
        """Set the owner of the entry held (a symlink's own): ``fchownat(fd, "", AT_EMPTY_PATH|AT_SYMLINK_NOFOLLOW)``.

        Args:
            uid, gid: ids in 0 .. 2**32 - 2, or -1 to leave that one.

        Raises:
            ReadOnlyError: a read-only handle.
            OSError: EPERM without the privilege; EINVAL for an id out of range.
        """
        fd = self._fd(label)
        self._writable_inplace(fd, "chown", label)
        if type(uid) is not int or type(gid) is not int or uid < -1 or gid < -1:
            _fail(errno.EINVAL, "chown", label)
        _check(_native.fchown_empty(fd, uid, gid), "chown", label)

    def set_times(self, atime_ns: int | None | _Now, mtime_ns: int | None | _Now, *,
                  label: str | None = None) -> None:
        """Set atime and mtime of the entry held (a symlink's own): ``utimensat(fd, "", AT_EMPTY_PATH)``.

        Args:
            atime_ns, mtime_ns: nanoseconds since the epoch (negative: before
                it); None leaves that time; :data:`Handle.NOW` sets the current time.

        Raises:
            ReadOnlyError: a read-only handle.
            OSError: EPERM/EACCES without the right; EINVAL for a time out of range.
        """
        fd = self._fd(label)
        self._writable_inplace(fd, "set_times", label)
        how = 0
        if atime_ns is None:
            how, atime_ns = _native.TIME_ATIME_OMIT, 0
        elif atime_ns is Handle.NOW:
            how, atime_ns = _native.TIME_ATIME_NOW, 0
        if mtime_ns is None:
            how, mtime_ns = how | _native.TIME_MTIME_OMIT, 0
        elif mtime_ns is Handle.NOW:
            how, mtime_ns = how | _native.TIME_MTIME_NOW, 0
        if type(atime_ns) is not int or type(mtime_ns) is not int or not (
                -(1 << 63) <= atime_ns < (1 << 63) and -(1 << 63) <= mtime_ns < (1 << 63)):
            _fail(errno.EINVAL, "set_times", label)
        _check(_native.utimens_empty(fd, atime_ns, mtime_ns, how), "set_times", label)

    # ------------------------------------------------------------ one name in the directory held

    def lookup(self, name: bytes, *, label: str | None = None) -> "Handle":
        """A handle on ``name`` in the directory held: ``openat(fd, name, O_PATH|O_NOFOLLOW)``.

        A symlink gives a handle on the link itself.

        Raises:
            InvalidPathError: ``name`` is not one component.
            FileNotFoundError, NotADirectoryError (the handle is not a
            directory), PermissionError (no search permission), OSError.
        """
        fd = self._dir_fd(name, label)
        try:
            new = os.open(name, _LOOKUP_FLAGS, dir_fd=fd)
        except OSError as exc:
            _fail(exc.errno or errno.EIO, "lookup", label)
            raise  # unreachable
        return self._child(new)

    def open(self, name: bytes, flags: int, mode: int = 0o644, *, owner: tuple[int, int] | None = None,
             expect: tuple[int, int] | None = None, allow_special: bool = False,
             label: str | None = None) -> int:
        """Open ``name`` in the directory held for I/O; returns a new fd (caller closes it).

        ``O_NOFOLLOW | O_NOCTTY | O_CLOEXEC`` are added: a symlink is never
        followed.  The open is made ``O_NONBLOCK`` so that a FIFO or a device
        swapped in cannot block or act; such an entry is refused unless
        ``allow_special`` (and O_NONBLOCK is then cleared again unless asked).

        Args:
            name: one component (bytes).
            flags: ``os.O_*`` flags; any of O_WRONLY, O_RDWR, O_CREAT, O_TRUNC,
                O_APPEND is a change (refused on a read-only handle).
            mode: permission bits of a file this call creates, given exactly
                (the process umask does not apply: the caller applies the
                requester's, as the FUSE kernel module does before a request).
            owner: ``(uid, gid)`` given, through its fd, to a file this call
                created (O_CREAT); an existing file is left alone.  None: the
                Root's owner, if it has one.
            expect: ``(st_dev, st_ino)``: the entry opened must be that inode,
                else the fd is closed and ``ESTALE`` raised (``O_TRUNC`` is
                applied only after that check; ``O_CREAT`` is refused, EINVAL).
                This is how an inode known by its handle is opened for I/O:
                through one of its names, then verified.

        Raises:
            InvalidPathError: ``name`` is not one component.
            ReadOnlyError: a change through a read-only handle.
            SymlinkRefusedError: ``name`` is a symlink (ELOOP).
            SpecialFileError: a FIFO, socket or device without ``allow_special``.
            OSError: ESTALE (``expect`` did not match), EEXIST, ENOENT, EISDIR,
                EACCES ..., EPERM (the owner could not be given: the file made
                is removed again).
        """
        fd = self._dir_fd(name, label)
        if flags & _WRITE_FLAGS:
            self._writable("open", label)
        uid, gid = self._owner(owner) if flags & os.O_CREAT else (-1, -1)
        dev, ino = (-1, -1) if expect is None else expect
        ret: int = _open_name(fd, name, flags, mode, 1 if allow_special else 0, dev, ino, uid, gid)
        while ret == -_EINTR:
            ret = _open_name(fd, name, flags, mode, 1 if allow_special else 0, dev, ino, uid, gid)
        if ret < 0:
            self._open_failed(-ret, label)
        if self._root._deny and flags & (os.O_WRONLY | os.O_RDWR):
            self._refuse_shared_write(ret, label)
        return ret

    def create(self, name: bytes, flags: int, mode: int = 0o644, *, owner: tuple[int, int] | None = None,
               label: str | None = None) -> tuple[int, "Handle"]:
        """:meth:`open` with ``O_CREAT`` added, and a handle on the very inode opened (a FUSE create).

        The handle is taken by :meth:`lookup` of ``name`` right after the
        open and checked to be the inode the fd is open on.

        Returns:
            ``(fd, handle)``: the caller owns both.

        Raises:
            OSError(ESTALE): another process replaced ``name`` between the
                open and the lookup (nothing is returned; the file made stays).
            InvalidPathError, ReadOnlyError, SymlinkRefusedError,
            SpecialFileError, OSError: as :meth:`open`.
        """
        fd = self.open(name, flags | os.O_CREAT, mode, owner=owner, label=label)
        try:
            st = os.fstat(fd)
            handle = self.lookup(name, label=label)
        except BaseException:
            os.close(fd)
            raise
        try:
            if handle.key != (st.st_dev, st.st_ino):
                _fail(errno.ESTALE, "create", label)
        except BaseException:
            handle.close()
            os.close(fd)
            raise
        return fd, handle

    def _open_failed(self, err: int, label: str | None) -> None:
        if err == errno.ENXIO:
            from .root import SpecialFileError  # the module that defines it imports this one
            raise SpecialFileError("open: a FIFO, socket or device is refused (only regular files and "
                                   "directories are opened)", sandbox_path=label, context={"operation": "open"})
        _fail(err, "open", label)

    @staticmethod
    def _refuse_shared_write(fd: int, label: str | None) -> None:
        """Where read-only grants are nested in the Root: refuse writing a multiply-linked regular file."""
        try:
            st = os.fstat(fd)
            if _stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                raise ReadOnlyError("open: in-place change of a multiply-linked file where read-only grants "
                                    "are nested (it could be a hard link into one)", sandbox_path=label)
        except BaseException:
            os.close(fd)
            raise

    def _make(self, op: str, name: bytes, kind: int, mode: int, rdev: int, target: Any,
              owner: tuple[int, int] | None, label: str | None) -> "Handle":
        fd = self._dir_fd(name, label)
        self._writable(op, label)
        uid, gid = self._owner(owner)
        ret: int = _make_name(fd, name, kind, mode, rdev, target, uid, gid)
        while ret == -_EINTR:
            ret = _make_name(fd, name, kind, mode, rdev, target, uid, gid)
        return self._child(_check(ret, op, label))

    def mkdir(self, name: bytes, mode: int = 0o755, *, owner: tuple[int, int] | None = None,
              label: str | None = None) -> "Handle":
        """Make directory ``name`` (``mkdirat``) with exactly ``mode`` and return a handle on it.

        The handle is opened ``O_PATH|O_NOFOLLOW`` right after and checked to
        be the directory made (a directory, two links, owned by this process).
        Then the owner is set, and the mode where the process umask took bits
        away (``fchmodat2`` on the handle): the umask never applies, and a
        set-group-ID parent's S_ISGID is kept.

        Args:
            owner: ``(uid, gid)`` given to the new directory through its fd;
                None: the Root's owner, if it has one.

        Raises:
            InvalidPathError: ``name`` is not one component.
            ReadOnlyError: a read-only handle.
            OSError: EEXIST, ENOENT (the directory held was removed), EACCES,
                ESTALE (another process replaced the new directory at once: it
                is left alone), EPERM (the owner could not be given: removed again).
        """
        return self._make("mkdir", name, _native.MAKE_DIR, mode, 0, _NULL, owner, label)

    def mknod(self, name: bytes, mode: int, rdev: int = 0, *, owner: tuple[int, int] | None = None,
              label: str | None = None) -> "Handle":
        """Make a regular file, FIFO, socket or device ``name`` (``mknodat``) and return a handle on it.

        No policy on the kind (that is the caller's).  Checked, owned and
        moded as :meth:`mkdir` (one link instead of two).

        Args:
            mode: file type (``stat.S_IF*``; 0 means regular) and permission bits.
            rdev: the device number (``os.makedev``) for a device.

        Raises:
            OSError(EINVAL): ``mode`` names a directory or a symlink.
            InvalidPathError, ReadOnlyError, OSError: as :meth:`mkdir`.
        """
        return self._make("mknod", name, _native.MAKE_NODE, mode, rdev, _NULL, owner, label)

    def symlink(self, name: bytes, target: bytes, *, owner: tuple[int, int] | None = None,
                label: str | None = None) -> "Handle":
        """Make symlink ``name`` pointing to ``target`` (``symlinkat``) and return a handle on the link.

        No check of ``target`` here (that is policy).  Checked as :meth:`mknod`.

        Raises:
            OSError(EINVAL): ``target`` is empty or holds NUL.
            InvalidPathError, ReadOnlyError, OSError: as :meth:`mkdir`.
        """
        if type(target) is not bytes or not target or b"\0" in target:
            _fail(errno.EINVAL, "symlink", label)
        return self._make("symlink", name, _native.MAKE_SYMLINK, 0, 0, target, owner, label)

    def link(self, src: "Handle", name: bytes, *, label: str | None = None) -> "Handle":
        """Give the inode ``src`` holds the new name ``name`` here: ``linkat(src.fd, "", fd, name, AT_EMPTY_PATH)``.

        Returns a new handle on the same inode (a duplicate of ``src``'s fd).

        Raises:
            InvalidPathError: ``name`` is not one component.
            ReadOnlyError: this handle or ``src`` is read-only (a link would
                make a read-only file writable through the new name).
            PathEscapeError: ``src`` belongs to another Root (EXDEV).
            OSError: EEXIST; EPERM (``src`` is a directory; or, without
                CAP_DAC_READ_SEARCH, ``src``'s fd was opened with other
                credentials: Linux >= 6.10 allows the opener's own);
                ENOENT (``src`` was unlinked); EXDEV (another file system); EMLINK.
        """
        fd = self._dir_fd(name, label)
        self._writable("link", label)
        self._same_root(src, "link", label)
        src._writable("link", label)
        sfd = src._fd(label)
        _check(_native.link_empty(sfd, fd, name), "link", label)
        try:
            new = os.dup(sfd)
        except OSError as exc:
            _fail(exc.errno or errno.EIO, "link", label)
            raise  # unreachable
        child = Handle(new, self._root, src.read_only)
        child._key = src._key
        return child

    def unlink(self, name: bytes, *, label: str | None = None) -> None:
        """Remove the non-directory ``name`` (``unlinkat``; a symlink is removed, never followed).

        Raises:
            InvalidPathError, ReadOnlyError: as :meth:`mkdir`.
            OSError: ENOENT, EISDIR (a directory), EACCES/EPERM, EBUSY.
        """
        fd = self._dir_fd(name, label)
        self._writable_leaf(fd, name, "unlink", label)
        try:
            os.unlink(name, dir_fd=fd)
        except OSError as exc:
            _fail(exc.errno or errno.EIO, "unlink", label)

    def rmdir(self, name: bytes, *, label: str | None = None) -> None:
        """Remove the empty directory ``name`` (``unlinkat(AT_REMOVEDIR)``).

        Raises:
            InvalidPathError, ReadOnlyError: as :meth:`mkdir`.
            OSError: ENOENT, ENOTDIR (not a directory, a symlink included),
                ENOTEMPTY, EBUSY (a mount point).
        """
        fd = self._dir_fd(name, label)
        self._writable_leaf(fd, name, "rmdir", label)
        try:
            os.rmdir(name, dir_fd=fd)
        except OSError as exc:
            _fail(exc.errno or errno.EIO, "rmdir", label)

    def rename(self, name: bytes, newdir: "Handle", newname: bytes, flags: int = 0, *,
               label: str | None = None) -> None:
        """Rename ``name`` here to ``newname`` in the directory ``newdir`` holds: ``renameat2``.

        Neither name is followed (a symlink is renamed as the link).

        Args:
            flags: 0, ``RENAME_NOREPLACE`` or ``RENAME_EXCHANGE`` (``_native``'s
                constants, the kernel's values).

        Raises:
            InvalidPathError: a name is not one component.
            ReadOnlyError: this handle or ``newdir`` is read-only.
            PathEscapeError: ``newdir`` belongs to another Root (EXDEV).
            OSError: ENOENT, EEXIST (RENAME_NOREPLACE), ENOTEMPTY, EISDIR,
                ENOTDIR, EINVAL (a directory into itself, or bad flags),
                EXDEV (another file system), EBUSY.
        """
        fd = self._dir_fd(name, label)
        self._same_root(newdir, "rename", label)
        nfd = newdir._dir_fd(newname, label)
        self._writable_leaf(fd, name, "rename", label)
        newdir._writable_leaf(nfd, newname, "rename", label)
        if type(flags) is not int or flags & ~_RENAME_FLAGS:
            _fail(errno.EINVAL, "rename", label)
        _check(_native.renameat2_fn(fd, name, nfd, newname, flags), "rename", label)
