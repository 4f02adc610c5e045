"""The object contract (:mod:`._objects`) over one trusted local directory: :class:`LocalObjects`.

Each object is a regular file: key ``a/b/c`` is the file ``c`` in the
directory ``a/b`` beneath the store directory.  Every access goes through a
:class:`~sandbox_fs.root.Root` opened on that directory with
``no_symlinks=True``: each call resolves relative to the one held directory
fd with ``openat2(RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS)``, so no key reaches
outside the directory, also when something replaced a directory in it by a
symlink.

- Uploads (:meth:`LocalObjects.put_stream`, :meth:`LocalObjects.put_bytes`)
  write a file in ``.partial/`` named by their start time and a random
  token, fsync it, and rename it onto the key at commit (the parent
  directory is fsynced after): a reader sees the old object or the new one,
  never a part.  Key components start with a letter or digit, so no key
  names ``.partial`` or ``.lock``.
- Every change of a key (rename onto it, delete) is made holding an
  exclusive ``flock`` on ``.lock`` (opened per operation, so threads of one
  process exclude each other as well as processes), which makes the
  compare-and-swap of :meth:`LocalObjects.put_bytes` atomic.
- ETags: for an object of at most :data:`CONTENT_ETAG_MAX_BYTES`, the first
  32 hex digits of the SHA-256 of its content (like S3's single-part ETag,
  equal contents have equal tags; a pointer names its generation, so its
  tag never comes back to an earlier state by accident); for a larger one,
  its inode, size, mtime and ctime in nanoseconds (no read of a large
  object per :meth:`LocalObjects.head`).
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import fcntl
import hashlib
import io
import os
import re
import secrets
import stat as _stat
import time
from typing import IO, Iterator

from ..errors import SandboxError
from ..root import Root, open_root
from ._errors import SnapshotConflictError, SnapshotLimitError, SnapshotNotFoundError, SnapshotStoreError
from ._objects import ObjectInfo

__all__ = ["LocalObjects", "validate_key", "CONTENT_ETAG_MAX_BYTES", "MAX_KEY_BYTES"]

#: Objects up to this size (bytes) get a content ETag (SHA-256); larger ones an identity ETag.
CONTENT_ETAG_MAX_BYTES = 1 << 20
#: Longest key, in bytes (S3's limit on an object key).
MAX_KEY_BYTES = 1024
_COMPONENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
_PREFIX_CHARS = re.compile(r"[A-Za-z0-9._/-]*")
_PARTIAL = ".partial"
_LOCK = ".lock"
_PARTIAL_NAME = re.compile(r"([0-9a-f]{1,16})\.[0-9a-f]{16}")
_CHUNK = 1 << 20
# errnos a retry may fix (the disk fills and empties, an I/O error on a network filesystem)
_TRANSIENT = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EINTR, errno.EAGAIN, errno.ETIMEDOUT, errno.ESTALE}


def validate_key(key: str) -> list[str]:
    """Check an object key and return its ``/``-separated components.

    A key is 1 to :data:`MAX_KEY_BYTES` ASCII bytes: components separated by
    single ``/``, each 1-255 characters of ``[A-Za-z0-9._-]`` starting with a
    letter or digit (so never empty, ``.`` or ``..``).

    Args:
        key: the key (``str``).

    Returns:
        The key's components (``list[str]``, at least one).

    Raises:
        ValueError: ``key`` is not such a key.
    """
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_BYTES:
        raise ValueError("object key must be 1-1024 characters")
    parts = key.split("/")
    for part in parts:
        if not _COMPONENT.fullmatch(part):
            raise ValueError("object key component is not a plain name (letters, digits, . _ -, not leading .)")
    return parts


def _validate_prefix(prefix: str) -> None:
    if not isinstance(prefix, str) or len(prefix) > MAX_KEY_BYTES or not _PREFIX_CHARS.fullmatch(prefix):
        raise ValueError("object key prefix must be up to 1024 characters of letters, digits, . _ - /")


def _store_error(reason: str, key: str | None, exc: BaseException) -> SnapshotStoreError:
    """A SnapshotStoreError for a failed local operation (retryable for the errnos in ``_TRANSIENT``).

    The context names the key and the errno symbol, never a host path.
    """
    code = exc.errno if isinstance(exc, OSError) else None
    if isinstance(exc, SandboxError):  # a symlink or an escape beneath the store directory: never followed
        context: dict[str, str] = {"error": exc.code}
        code = None
    else:
        context = {"error": errno.errorcode.get(code, str(code)) if code else type(exc).__name__}
    if key is not None:
        context["key"] = key
    return SnapshotStoreError(reason, sandbox_path=None, context=context, retryable=code in _TRANSIENT)


def _content_etag(fd: int, size: int) -> str:
    h = hashlib.sha256()
    offset = 0
    while offset < size:
        chunk = os.pread(fd, min(_CHUNK, size - offset), offset)
        if not chunk:
            break
        h.update(chunk)
        offset += len(chunk)
    return h.hexdigest()[:32]


def _info_of_fd(key: str, fd: int, st: os.stat_result, written: bytes | None = None) -> ObjectInfo:
    """The object's info from its fd; ``written``: the bytes this process just wrote to it (not read back)."""
    if st.st_size <= CONTENT_ETAG_MAX_BYTES:
        if written is not None and len(written) == st.st_size:
            etag = hashlib.sha256(written).hexdigest()[:32]
        else:
            etag = _content_etag(fd, st.st_size)
    else:
        etag = f"i{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}-{st.st_ctime_ns:x}"
    return ObjectInfo(key, st.st_size, etag, st.st_mtime)


class _Lock:
    """The store's exclusive ``flock`` on ``.lock``, on a new open file description each time."""

    def __init__(self, root: Root) -> None:
        self._root = root
        self._fd = -1

    def __enter__(self) -> None:
        self._fd = self._root.open_fd(_LOCK, os.O_RDWR | os.O_CREAT, 0o600, follow_symlinks=False)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(self._fd)
            raise

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)  # releases the flock
        self._fd = -1


class _RangeReader(io.RawIOBase):
    """Reads ``length`` bytes of an open file from ``start`` with ``pread`` (never past them); owns the fd."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        self._fd = fd
        self._pos = start
        self._left = length

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(b).cast("B")
        want = min(len(view), self._left)
        if want <= 0:
            return 0
        n = os.preadv(self._fd, [view[:want]], self._pos)
        self._pos += n
        self._left -= n
        return n

    def close(self) -> None:
        if not self.closed and self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        super().close()


class _LocalWriter:
    """A streaming upload into ``.partial/``; :meth:`commit` renames it onto the key."""

    def __init__(self, store: LocalObjects, key: str) -> None:
        self._store = store
        self.key = key
        self.partial = f"{_PARTIAL}/{time.time_ns():x}.{secrets.token_hex(8)}"
        try:
            self._fd = store._root.open_fd(self.partial, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileNotFoundError:  # the store's first upload: .partial/ is made on the first write, not at open
            store._root.mkdir(_PARTIAL, 0o700, exist_ok=True)
            self._fd = store._root.open_fd(self.partial, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._done = False

    def fileno(self) -> int:
        """The upload's fd (owned by the writer until :meth:`abort`)."""
        return self._fd

    def write(self, data: bytes | memoryview) -> int:
        """Append ``data``; returns ``len(data)``.  Raises :class:`SnapshotStoreError`."""
        if self._done:
            raise SnapshotStoreError("write after the upload finished", sandbox_path=None,
                                     context={"key": self.key}, retryable=False)
        view = memoryview(data).cast("B")
        off = 0
        try:
            while off < len(view):
                off += os.write(self._fd, view[off:])
        except OSError as exc:
            raise _store_error("writing the object failed", self.key, exc) from None
        return len(view)

    def commit(self) -> ObjectInfo:
        """fsync the upload and rename it onto the key (under the lock).  Raises :class:`SnapshotStoreError`."""
        if self._done:
            raise SnapshotStoreError("the upload already finished", sandbox_path=None,
                                     context={"key": self.key}, retryable=False)
        try:
            os.fsync(self._fd)
            with _Lock(self._store._root):
                self._store._place(self.partial, self.key)
            # after the rename, which changed the inode's ctime: the tag head() gives from now on
            return _info_of_fd(self.key, self._fd, os.fstat(self._fd))
        except FileNotFoundError as exc:
            raise SnapshotStoreError("the upload was aborted before its commit (abort_stale_uploads?)",
                                     sandbox_path=None, context={"key": self.key}, retryable=False) from exc
        except (OSError, SandboxError) as exc:
            if isinstance(exc, SnapshotStoreError):
                raise
            raise _store_error("committing the object failed", self.key, exc) from None
        finally:
            self.abort()

    def abort(self) -> None:
        """Discard the upload (idempotent, never raises)."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1
        if not self._done:
            self._done = True
            with contextlib.suppress(OSError, SandboxError):
                self._store._root.remove(self.partial)


class LocalObjects:
    """Objects as files beneath one trusted host directory (see the module docstring for the layout).

    Implements :class:`~sandbox_fs.snapshot.ObjectStore`.  Safe to use from
    several threads and processes at once.  Files are created mode 0600,
    directories 0700.  Opening and reading write nothing in the directory
    (``.partial/`` and ``.lock`` are made by the first upload and change).

    Args:
        directory: the trusted host directory (``str`` or path-like), from the
            host application; opened by the host-path rule (no symlink on
            any component, :func:`sandbox_fs.root.open_root`).
        create: create it (mode 0700, parents too) when missing.

    Raises:
        FileNotFoundError: ``directory`` is missing and ``create`` is False.
        SymlinkRefusedError: ``directory`` or a directory on it is a symlink.
        NotADirectoryError: ``directory`` is not a directory.
    """

    def __init__(self, directory: str | os.PathLike[str], *, create: bool = True) -> None:
        # nothing is written here: ``.partial/`` is made by the first upload and ``.lock`` by the first change
        # (a store directory this process may only read works for reads; an upload fails, SnapshotStoreError)
        self._root = open_root(os.fspath(directory), label="object-store", create=create, no_symlinks=True)

    # -- writing

    def put_stream(self, key: str) -> _LocalWriter:
        """Start a streaming upload of ``key``; it replaces an existing object at commit.

        Raises:
            ValueError: ``key`` is not a valid key (:func:`validate_key`).
            SnapshotStoreError: the store cannot be written.
        """
        validate_key(key)
        try:
            return _LocalWriter(self, key)
        except (OSError, SandboxError) as exc:
            raise _store_error("starting the upload failed", key, exc) from None

    def put_bytes(self, key: str, data: bytes, *, if_match: str | None = None,
                  if_none_match: bool = False) -> ObjectInfo:
        """Write a small object, optionally as a compare-and-swap under the store's lock.

        Args:
            key: the object key.
            data: the whole object (bytes).
            if_match: succeed only if the current object's ETag equals this.
            if_none_match: succeed only if no object ``key`` exists.

        Returns:
            The new object's :class:`ObjectInfo`.

        Raises:
            ValueError: ``key`` is not a valid key.
            SnapshotConflictError: the condition did not hold (nothing was written).
            SnapshotStoreError: the store failed.
        """
        validate_key(key)
        writer = self.put_stream(key)
        try:
            writer.write(data)
            os.fsync(writer.fileno())
            with _Lock(self._root):
                if if_match is not None or if_none_match:
                    current = self.head(key)
                    if if_none_match and current is not None:
                        raise SnapshotConflictError("the object already exists", sandbox_path=None,
                                                    context={"key": key})
                    if if_match is not None and (current is None or current.etag != if_match):
                        raise SnapshotConflictError("the object changed since it was read", sandbox_path=None,
                                                    context={"key": key})
                self._place(writer.partial, key)
            return _info_of_fd(key, writer.fileno(), os.fstat(writer.fileno()), data)
        except (OSError, SandboxError) as exc:
            if isinstance(exc, (SnapshotStoreError, SnapshotConflictError)):
                raise
            raise _store_error("writing the object failed", key, exc) from None
        finally:
            writer.abort()

    def _place(self, partial: str, key: str) -> None:
        """Rename the upload ``partial`` onto ``key`` and fsync the parent (caller holds the lock)."""
        parts = key.split("/")
        parent = "/".join(parts[:-1]) or "."
        if parent != ".":
            self._root.mkdir(parent, 0o700, parents=True, exist_ok=True)
        self._root.rename(partial, key)
        self._fsync_dir(parent)

    def _fsync_dir(self, path: str) -> None:
        dfd = self._root.open_dir_fd(path)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def delete(self, key: str) -> None:
        """Remove ``key`` (a missing key is no error) and the directories it leaves empty.

        Raises:
            ValueError: ``key`` is not a valid key.
            SnapshotStoreError: the store failed.
        """
        parts = validate_key(key)
        try:
            with _Lock(self._root):
                try:
                    self._root.remove(key)
                except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                    return
                for depth in range(len(parts) - 1, 0, -1):
                    try:
                        self._root.rmdir("/".join(parts[:depth]))
                    except OSError:
                        break
        except (OSError, SandboxError) as exc:
            raise _store_error("deleting the object failed", key, exc) from None

    # -- reading

    def _open(self, key: str) -> tuple[int, os.stat_result] | None:
        """An O_RDONLY fd of object ``key`` and its fstat, or None when there is no such object."""
        try:
            fd = self._root.open_fd(key, os.O_RDONLY, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (OSError, SandboxError) as exc:
            raise _store_error("reading the object failed", key, exc) from None
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode):
            os.close(fd)
            return None
        return fd, st

    def head(self, key: str) -> ObjectInfo | None:
        """The object's :class:`ObjectInfo`, or None when it does not exist.

        Raises:
            ValueError: ``key`` is not a valid key.
            SnapshotStoreError: the store failed.
        """
        validate_key(key)
        opened = self._open(key)
        if opened is None:
            return None
        fd, st = opened
        try:
            return _info_of_fd(key, fd, st)
        except OSError as exc:
            raise _store_error("reading the object failed", key, exc) from None
        finally:
            os.close(fd)

    def open_range(self, key: str, start: int = 0, length: int | None = None) -> IO[bytes]:
        """A reader of ``length`` bytes (or to the end) of ``key`` from byte ``start``.

        The object is opened once; a rename onto the key after that does not
        change what the reader returns.

        Args:
            key: the object key.
            start: first byte offset (>= 0).
            length: how many bytes at most (>= 0), or None for the rest.

        Raises:
            ValueError: ``key`` is not a valid key, or ``start``/``length`` is negative.
            SnapshotNotFoundError: no object ``key``.
            SnapshotStoreError: the store failed.
        """
        validate_key(key)
        if start < 0 or (length is not None and length < 0):
            raise ValueError("start and length must be >= 0")
        opened = self._open(key)
        if opened is None:
            raise SnapshotNotFoundError("no such object", sandbox_path=None, context={"key": key})
        fd, st = opened
        end = st.st_size if length is None else min(st.st_size, start + length)
        return io.BufferedReader(_RangeReader(fd, start, max(0, end - start)), _CHUNK)

    def get_bytes(self, key: str, limit: int) -> bytes:
        """The whole of a small object.

        Args:
            key: the object key.
            limit: the most bytes accepted.

        Raises:
            ValueError: ``key`` is not a valid key.
            SnapshotNotFoundError: no object ``key``.
            SnapshotLimitError: it is longer than ``limit`` bytes.
            SnapshotStoreError: the store failed.
        """
        validate_key(key)
        opened = self._open(key)
        if opened is None:
            raise SnapshotNotFoundError("no such object", sandbox_path=None, context={"key": key})
        fd, st = opened
        try:
            if st.st_size > limit:
                raise SnapshotLimitError("the object is larger than its limit", sandbox_path=None,
                                         context={"key": key, "limit": limit})
            data = os.pread(fd, limit + 1, 0)
            if len(data) > limit:  # grew since the fstat
                raise SnapshotLimitError("the object is larger than its limit", sandbox_path=None,
                                         context={"key": key, "limit": limit})
            return data
        except OSError as exc:
            raise _store_error("reading the object failed", key, exc) from None
        finally:
            os.close(fd)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``, in key order.

        Raises:
            ValueError: ``prefix`` has characters no key has.
            SnapshotStoreError: the store failed.
        """
        _validate_prefix(prefix)
        top = prefix.rpartition("/")[0]
        if top:
            try:
                validate_key(top)
            except ValueError:
                return iter(())  # no key has an empty, "." or ".." component
        keys: builtins.list[str] = []
        try:
            self._collect(top, prefix, keys)
        except (OSError, SandboxError) as exc:
            raise _store_error("listing the store failed", None, exc) from None
        infos = [self.head(key) for key in sorted(keys)]
        return iter([info for info in infos if info is not None])

    def _collect(self, top: str, prefix: str, out: builtins.list[str]) -> None:
        """Append the keys below directory ``top`` that start with ``prefix`` to ``out``.

        Only what can be a key is taken: a name that is not a key component
        (``.partial``, ``.lock``, anything not made by this class) and a path
        longer than :data:`MAX_KEY_BYTES` are left out, never entered (as
        :meth:`S3Objects.list` leaves out what is not a valid key); the
        directories are walked with a list, not by recursion, so the
        directory's shape (whoever can write it chooses it) bounds neither.
        """
        todo = [top]
        while todo:
            directory = todo.pop()
            try:
                entries = self._root.scandir(directory or ".")
            except (FileNotFoundError, NotADirectoryError):
                continue
            for entry in entries:
                if not _COMPONENT.fullmatch(entry.name):
                    continue  # .partial, .lock, anything not made by this class
                key = f"{directory}/{entry.name}" if directory else entry.name
                if len(key) > MAX_KEY_BYTES:
                    continue  # no key is this long (ASCII: characters are bytes)
                if entry.is_dir():
                    if key.startswith(prefix) or prefix.startswith(key + "/"):
                        todo.append(key)
                elif entry.is_file() and key.startswith(prefix):
                    out.append(key)

    # -- upkeep

    def abort_stale_uploads(self, older_than: float) -> int:
        """Remove uploads started more than ``older_than`` seconds ago and never committed; returns how many.

        The start time is the one in the upload's name (written when it
        began), not its mtime, so an upload still being written counts from
        its start, as S3 counts a multipart upload from its initiation.  A
        writer whose upload was removed gets :class:`SnapshotStoreError` at
        commit.

        Raises:
            SnapshotStoreError: the store failed.
        """
        cutoff = time.time_ns() - int(older_than * 1e9)
        removed = 0
        try:
            try:
                names = self._root.listdir(_PARTIAL)
            except FileNotFoundError:
                return 0  # no upload was ever started here
            for name in names:
                m = _PARTIAL_NAME.fullmatch(name)
                if m is None or int(m.group(1), 16) >= cutoff:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    self._root.remove(f"{_PARTIAL}/{name}")
                    removed += 1
        except (OSError, SandboxError) as exc:
            raise _store_error("cleaning unfinished uploads failed", None, exc) from None
        return removed

    def close(self) -> None:
        """Release the directory fd.  Idempotent."""
        self._root.close()

    def __enter__(self) -> LocalObjects:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
