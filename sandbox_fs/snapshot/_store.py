"""Snapshot stores: the :class:`SnapshotStore` protocol, :class:`LocalSnapshotStore`, :class:`NoSnapshot`.

A store keeps the previous good snapshot valid until a new one is committed:
a new archive only becomes current when its metadata file is atomically
replaced, after the archive was read back and its size and CRC-32 checked.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import json
import os
import re
import secrets
import stat as _stat
import threading
import zlib
from dataclasses import dataclass
from typing import IO, Any, Protocol, runtime_checkable

from .. import _native
from .._json import loads_untrusted
from ..root import open_root
from ._errors import SnapshotCorruptError, SnapshotError, SnapshotLimitError, SnapshotNotFoundError, SnapshotVerifyError
from ._models import _TOKEN, SnapshotInfo, SnapshotLimits, validate_name

__all__ = ["SnapshotStore", "LocalSnapshotStore", "NoSnapshot", "PendingArchive"]

_READ_CHUNK = 1 << 20
_MAX_META_BYTES = 256 << 20
_WRITEBACK_BYTES = 8 << 20  # start writeback of the archive every 8 MiB (see _HashingSink); 0: never
def _meta_partial(name: str) -> str:
    """The temporary a commit of ``name`` writes its new metadata to (see :meth:`LocalSnapshotStore._write_metadata`)."""
    return f".{name}.json.partial"


_GEN_ARCHIVE = re.compile(r"([A-Za-z0-9][A-Za-z0-9_-]{0,127})\.g([0-9]{1,18})\.[0-9a-f]{16}\.tar")


@runtime_checkable
class SnapshotStore(Protocol):
    """Where snapshots live: the extension point a host implements to keep snapshots elsewhere.

    :func:`persist`, :func:`hydrate`, sessions and the client call these
    methods; :class:`LocalSnapshotStore` (files in a host directory) and
    :class:`NoSnapshot` (keeps nothing) implement them.  Every method is
    blocking and is called from a worker thread, never from the event loop;
    one store may serve several sessions at once, so its methods may be
    called from several threads concurrently, also for the same name.  Snapshot
    names are plain tokens (:func:`validate_name`); a store must not accept
    other names, since they may become file names.

    What a store must guarantee: a snapshot becomes current only at
    :meth:`commit`, atomically, and until then the previous snapshot of that
    name stays readable and intact (also when the commit fails or the process
    dies mid-way); what :meth:`open_archive` returns is exactly what was
    committed (verified against the metadata, or refused).

    Attributes:
        enabled: False only for a store that keeps nothing (:class:`NoSnapshot`):
            persist is then a no-op and nothing is ever restored.
    """

    enabled: bool

    def info(self, name: str) -> SnapshotInfo | None:
        """The metadata of the current snapshot ``name``, or None when there is none.

        Args:
            name: the snapshot name (a plain token).

        Returns:
            The :class:`SnapshotInfo` last committed for ``name``, or None.

        Raises:
            InvalidPathError: ``name`` is not a plain token.
            SnapshotCorruptError: the stored metadata is not valid.
        """
        ...

    def begin(self, name: str) -> PendingArchive:
        """Start writing a new archive for ``name``; nothing is visible until :meth:`commit`.

        Persist writes the archive through ``pending.sink`` only, from one
        writer thread of its own, in order: ``sink.write(b)`` (a bytes-like
        object; returns its length, writing all of it), then reads
        ``sink.count`` (the bytes written, an int) and ``sink.hexdigest()``
        (their CRC-32, 8 lowercase hex digits) once every write returned.  The
        other fields of :class:`PendingArchive` are the store's own.  (A
        :class:`GenerationStore`'s own sink returns "": its version-2
        metadata records the archive's BLAKE3 and no CRC-32.)

        Args:
            name: the snapshot name (a plain token).

        Returns:
            The :class:`PendingArchive` to write and then pass to
            :meth:`commit` or :meth:`abort` (exactly one of them).

        Raises:
            InvalidPathError: ``name`` is not a plain token.
            SnapshotError: the store keeps nothing (:class:`NoSnapshot`).
            OSError: the store cannot be written.
        """
        ...

    def commit(self, pending: PendingArchive, info: SnapshotInfo) -> SnapshotInfo | None:
        """Make the written archive the current snapshot ``pending.name``, atomically.

        ``info`` is the metadata persist computed (``archive_bytes`` and
        ``archive_crc32`` of what was written, the fingerprint, the
        ``mode_fixups`` ...); the store may set ``archive`` (its own name for the
        archive) and ``generation``.  The store must make the archive durable
        and check that it reads back with ``archive_bytes`` and
        ``archive_crc32`` before it becomes current; the previous snapshot of
        the name stays current until then, and may be dropped after.

        Args:
            pending: what :meth:`begin` returned, fully written.
            info: the snapshot's metadata.

        Returns:
            The metadata committed, with ``generation`` one more than the
            previous one of this name (monotonic per name); or None for a store
            without generations (``info`` is then what was committed,
            generation 0).

        Raises:
            SnapshotVerifyError: the archive or its metadata did not read back
                as written; the previous snapshot (``context["generation"]``) is
                current (retryable).
            SnapshotError: the store keeps nothing (:class:`NoSnapshot`).
            OSError: the store cannot be written (ENOSPC ...); the previous
                snapshot stays current.
        """
        ...

    def abort(self, pending: PendingArchive) -> None:
        """Discard an archive that will not be committed; the current snapshot is unchanged.

        Called by persist on every failure, also after :meth:`commit` raised,
        so it must be idempotent and must not raise.

        Args:
            pending: what :meth:`begin` returned.
        """
        ...

    def open_archive(self, name: str, limits: SnapshotLimits) -> tuple[IO[bytes], SnapshotInfo]:
        """Open the current snapshot ``name`` for reading, verified.

        Hydrate extracts the archive from the returned reader (reading it
        once, forward only, never past ``info.archive_bytes``) and closes it.

        Args:
            name: the snapshot name (a plain token).
            limits: ``limits.max_archive_bytes`` (bytes) bounds the archive
                the store may hand out.

        Returns:
            ``(reader, info)``: a binary reader at offset 0 whose content is
            exactly ``info.archive_bytes`` bytes with CRC-32
            ``info.archive_crc32`` (checked before returning), and the
            snapshot's metadata.  The caller closes the reader.

        Raises:
            InvalidPathError: ``name`` is not a plain token.
            SnapshotNotFoundError: no snapshot with this name.
            SnapshotCorruptError: the archive is missing, or its size or
                CRC-32 does not match the metadata.
            SnapshotLimitError: the archive is larger than ``limits.max_archive_bytes``.
        """
        ...

    def list(self) -> list[SnapshotInfo]:
        """The metadata of every current snapshot, sorted by name (unreadable ones left out).

        Raises:
            OSError: the store cannot be read.
        """
        ...

    def remove(self, name: str) -> None:
        """Delete snapshot ``name`` and its archives; a missing one is no error.

        Args:
            name: the snapshot name (a plain token).

        Raises:
            InvalidPathError: ``name`` is not a plain token.
            OSError: the store cannot be written.
        """
        ...

    def close(self) -> None:
        """Release the store's resources (idempotent).  The client calls it when it closes."""
        ...


class _HashingSink(io.RawIOBase):
    """A forward-only writer over a fd that CRC-32s and counts every byte written.

    Not thread-safe: persist writes it from its one writer thread only, and
    reads ``count`` / :meth:`hexdigest` after that thread has drained.

    ``tell()`` reports the bytes written so far; ``seek`` is never supported.

    Every ``_WRITEBACK_BYTES`` written, writeback of that range is started
    early with ``posix_fadvise(POSIX_FADV_DONTNEED)``: on Linux that starts
    asynchronous writeback of the range's dirty pages and then drops only
    pages already clean, so the data stays readable (a dropped clean page
    is read back from disk; tmpfs pages are never dropped) and the commit's
    ``fsync``, which is still done, waits for the tail only instead of the
    whole archive (measured on ext4: ~200 ms -> ~5 ms for 240 MiB).  The
    hint is best effort; its errors are ignored.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.crc = 0
        self.count = 0
        self._advised = 0  # bytes before this offset already had writeback started

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.count

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        total = len(view)
        off = 0
        while off < total:
            off += os.write(self.fd, view[off:])
        self.crc = zlib.crc32(view, self.crc)
        self.count += total
        if _WRITEBACK_BYTES and self.count - self._advised >= _WRITEBACK_BYTES:
            with contextlib.suppress(OSError, AttributeError):
                os.posix_fadvise(self.fd, self._advised, self.count - self._advised, os.POSIX_FADV_DONTNEED)
            self._advised = self.count
        return total

    def hexdigest(self) -> str:
        return f"{self.crc:08x}"


@dataclass
class PendingArchive:
    """An archive being written into a store (returned by :meth:`SnapshotStore.begin`).

    Attributes:
        name: the snapshot name it will be committed as.
        fd: the archive file's fd (-1 once released).
        sink: what persist writes through (``write``, ``count``, ``hexdigest()``).
        stream: a buffered writer over ``sink`` (the local store's own).
        partial: the name of a named partial file, or None for an ``O_TMPFILE``.
    """

    name: str
    fd: int
    sink: _HashingSink
    stream: io.BufferedWriter
    partial: str | None  # named partial file, or None for an O_TMPFILE


class NoSnapshot:
    """A store that keeps nothing: persist is a no-op and nothing is ever restored."""

    enabled = False

    def info(self, name: str) -> SnapshotInfo | None:
        return None

    def begin(self, name: str) -> PendingArchive:
        """Refused: this store keeps nothing.

        Raises:
            SnapshotError: always.
        """
        raise SnapshotError("this client has no snapshot store", sandbox_path=None)

    def commit(self, pending: PendingArchive, info: SnapshotInfo) -> None:
        """Refused: this store keeps nothing.

        Raises:
            SnapshotError: always.
        """
        raise SnapshotError("this client has no snapshot store", sandbox_path=None)

    def abort(self, pending: PendingArchive) -> None:
        pass

    def open_archive(self, name: str, limits: SnapshotLimits) -> tuple[IO[bytes], SnapshotInfo]:
        """Refused: this store keeps nothing.

        Raises:
            SnapshotNotFoundError: always.
        """
        raise SnapshotNotFoundError("this client has no snapshot store", sandbox_path=None,
                                    context={"snapshot": name})

    def list(self) -> list[SnapshotInfo]:
        return []

    def remove(self, name: str) -> None:
        pass

    def close(self) -> None:
        pass


def _proc_fd_available() -> bool:
    return os.path.isdir("/proc/self/fd")


def _archive_crc(fd: int, limit: int, stop: threading.Event | None = None) -> tuple[int, int]:
    """``(bytes, CRC-32)`` of the file open on ``fd``, reading at most ``limit + 1`` bytes.

    Read with ``preadv`` (the fd's offset is not moved).  ``limit`` is the
    size already validated (the metadata's ``archive_bytes``): the read is
    bounded by it, never by the file's current end, so a store file grown
    after the size check (even sparse to 1 TiB) costs at most one extra
    byte, and that byte makes the result a size mismatch (:func:`_check_crc`).
    Memory: one 1 MiB buffer.  With ``stop`` set, returns early (the result
    is then meaningless).

    Args:
        fd: the archive, open for reading.
        limit: the validated archive size, in bytes (>= 0).
        stop: set by another thread to end the read early.

    Raises:
        OSError: reading failed.
    """
    buf = bytearray(_READ_CHUNK)
    view = memoryview(buf)
    crc = 0
    total = 0
    bound = limit + 1
    while total < bound and (stop is None or not stop.is_set()):
        want = min(_READ_CHUNK, bound - total)
        n = os.preadv(fd, [view[:want]], total)
        if not n:
            break
        crc = zlib.crc32(view[:n], crc)
        total += n
    return total, crc


def _gf2_times(mat: list[int], vec: int) -> int:
    """The GF(2) 32x32 matrix ``mat`` (one int per column) times the 32-bit vector ``vec``."""
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, col) for col in mat]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc1 = crc32(A)``, ``crc2 = crc32(B)`` and ``len2 = len(B)``.

    zlib's ``crc32_combine`` (not exposed by Python's :mod:`zlib`): ``crc1``
    is advanced over ``len2`` zero bytes by repeated squaring of the
    one-zero-bit operator in GF(2), then XORed with ``crc2``.  About 30
    matrix squarings for a 1 GiB ``len2`` (a few ms in Python).
    """
    if len2 <= 0:
        return crc1  # (B is empty: crc2 is 0)
    op = [0xEDB88320] + [1 << n for n in range(31)]  # the operator of one zero bit
    op = _gf2_square(_gf2_square(op))  # four zero bits
    while len2:  # squared first: one zero byte, then 2, 4, ... bytes, applied for each set bit of len2
        op = _gf2_square(op)
        if len2 & 1:
            crc1 = _gf2_times(op, crc1)
        len2 >>= 1
    return crc1 ^ crc2


#: below this size a read-back is not split over two threads (the thread costs more than it saves)
_SPLIT_CRC_BYTES = 16 << 20


def _archive_crc_split(fd: int, limit: int) -> tuple[int, int]:
    """:func:`_archive_crc` over two threads: this one reads the first half, a helper the rest.

    Same result, same bound (at most ``limit + 1`` bytes read; a shorter
    file reads short in either half and gives a size mismatch).  The helper
    is joined before this returns or raises.

    Raises:
        OSError: reading failed (in either thread).
    """
    if limit < _SPLIT_CRC_BYTES:
        return _archive_crc(fd, limit)
    half = (limit // 2) & ~(_READ_CHUNK - 1)
    second: list[tuple[int, int] | BaseException] = []

    def run() -> None:
        try:
            second.append(_archive_crc_range(fd, half, limit + 1))
        except BaseException as exc:  # raised in the caller's thread below
            second.append(exc)

    helper = threading.Thread(target=run, name="sfs-persist-verify", daemon=True)
    helper.start()
    try:
        n1, crc1 = _archive_crc_range(fd, 0, half)
    finally:
        helper.join()
    got = second[0]
    if isinstance(got, BaseException):
        raise got
    n2, crc2 = got
    if n1 < half:
        return n1, crc1  # the file is shorter than its first half: a size mismatch either way
    return n1 + n2, crc32_combine(crc1, crc2, n2)


def _archive_crc_range(fd: int, start: int, end: int) -> tuple[int, int]:
    """``(bytes, CRC-32)`` of bytes ``start`` to at most ``end`` of the file open on ``fd`` (``preadv``, 1 MiB)."""
    buf = bytearray(_READ_CHUNK)
    view = memoryview(buf)
    crc = 0
    total = 0
    while start + total < end:
        n = os.preadv(fd, [view[:min(_READ_CHUNK, end - start - total)]], start + total)
        if not n:
            break
        crc = zlib.crc32(view[:n], crc)
        total += n
    return total, crc


def _check_crc(result: tuple[int, int], info: SnapshotInfo) -> None:
    """Raise SnapshotCorruptError unless ``(bytes, CRC-32)`` is what ``info`` recorded.

    ``bytes`` is at most ``info.archive_bytes + 1`` (:func:`_archive_crc`):
    one byte more means the file is longer than recorded.
    """
    total, crc = result
    if total != info.archive_bytes or f"{crc:08x}" != info.archive_crc32:
        raise SnapshotCorruptError("snapshot archive does not match its CRC-32 (corrupted?)",
                                   sandbox_path=None, context={"snapshot": info.name})


class _CrcCheck:
    """The archive's CRC-32, computed by one thread (``sfs-hydrate-crc``) while hydrate extracts.

    ``preadv`` and ``zlib.crc32`` of 1 MiB both release the GIL, so the
    check runs on the second core.  The thread reads at most ``limit + 1``
    bytes (the validated size and one more, see :func:`_archive_crc`), so
    :meth:`verify` waits for a bounded read even if the file has grown
    since its size was checked.  :meth:`stop` must be called on every
    path before the fd is closed (it joins the thread).

    Args:
        fd: the archive, open for reading (``pread`` only; its offset is the extractor's).
        limit: the validated archive size, in bytes.
    """

    def __init__(self, fd: int, limit: int) -> None:
        self._fd = fd
        self._limit = limit
        self._stop = threading.Event()
        self._result: tuple[int, int] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="sfs-hydrate-crc", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = _archive_crc(self._fd, self._limit, self._stop)
        except BaseException as exc:  # raised in the caller's thread by verify()
            self._error = exc

    def verify(self, info: SnapshotInfo) -> None:
        """Wait for the whole archive to be read and compare it with ``info``.

        Raises:
            SnapshotCorruptError: size or CRC-32 differs from the metadata.
            OSError: the archive could not be read.
        """
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        _check_crc(self._result, info)

    def stop(self) -> None:
        """Stop reading and join the thread (idempotent)."""
        self._stop.set()
        self._thread.join()


def _info_to_json(info: SnapshotInfo) -> bytes:
    """The metadata as ASCII JSON; a path that is not UTF-8 (``mode_fixups``) keeps its ``\\udcXX`` escapes.

    A workspace name may be any bytes: its ``surrogateescape`` str survives
    :mod:`json` (which escapes lone surrogates) where pydantic's encoder refuses it.
    """
    return json.dumps(info.model_dump(mode="python"), indent=1, ensure_ascii=True).encode()


def _info_from_json(raw: bytes) -> SnapshotInfo:
    """Parse :func:`_info_to_json` output (and older metadata).

    Raises:
        ValueError: not JSON, or not valid :class:`SnapshotInfo`.
    """
    return SnapshotInfo.model_validate(loads_untrusted(raw))


class LocalSnapshotStore:
    """Snapshots as files in one trusted host directory (the embedded default).

    Layout: ``<name>.json`` (the :class:`SnapshotInfo`, replaced atomically:
    the commit point) and ``<name>.<token>.tar`` (the archive it names);
    ``.<name>.json.partial`` is a commit's new metadata before its rename
    (one left by a killed process goes with the name's next commit).
    Files are created mode 0600; a directory this class creates is 0700.
    Every access goes through a :class:`Root` opened on the directory.
    A per-name ``flock`` on ``<name>.lock`` serializes commits of one name.

    Args:
        directory: trusted host directory (from the host application).
        create: create it (mode 0700, parents 0700) when missing.

    Raises:
        FileNotFoundError: ``directory`` is missing and ``create`` is False.
        SymlinkRefusedError: ``directory``, or a directory on it, is a symlink
            (see :func:`sandbox_fs.root.open_host_dir_fd`).
    """

    enabled = True

    def __init__(self, directory: str | os.PathLike[str], *, create: bool = True) -> None:
        # made when missing (0700) and opened by the host-path rule: no symlink on any component
        self.root = open_root(os.fspath(directory), label="snapshot-store", create=create)

    # -- reading

    def info(self, name: str) -> SnapshotInfo | None:
        """The metadata of snapshot ``name``, or None when it does not exist.

        Raises:
            InvalidPathError: ``name`` is not a plain token.
            SnapshotCorruptError: the metadata file is not valid.
        """
        validate_name(name)
        try:
            raw = self.root.read_bytes(f"{name}.json", max_bytes=_MAX_META_BYTES)
        except FileNotFoundError:
            return None
        try:
            info = _info_from_json(raw)
        except ValueError as exc:
            raise SnapshotCorruptError("snapshot metadata is not valid", sandbox_path=None,
                                       context={"snapshot": name}, diagnostic=str(exc)) from None
        if info.name != name or not info.archive.startswith(f"{name}.") or "/" in info.archive:
            raise SnapshotCorruptError("snapshot metadata names another snapshot", sandbox_path=None,
                                       context={"snapshot": name})
        return info.model_copy(update={"digest": hashlib.sha256(raw).hexdigest()})

    def open_archive(self, name: str, limits: SnapshotLimits) -> tuple[IO[bytes], SnapshotInfo]:
        """Open and verify snapshot ``name``; returns a binary reader at offset 0 and its info.

        The archive is hashed through the same fd that is returned, so what is
        verified is what will be read; the hash reads at most the recorded
        size and one byte more (a file grown since its size was checked is a
        mismatch, however large it has grown).

        Raises:
            SnapshotNotFoundError: no such snapshot.
            SnapshotCorruptError: size or CRC-32 does not match its metadata.
            SnapshotLimitError: the archive is larger than ``limits.max_archive_bytes``.
        """
        f, info = self.open_archive_unverified(name, limits)
        try:
            _check_crc(_archive_crc(f.fileno(), info.archive_bytes), info)
            return f, info
        except BaseException:
            f.close()
            raise

    def open_archive_unverified(self, name: str, limits: SnapshotLimits) -> tuple[IO[bytes], SnapshotInfo]:
        """:meth:`open_archive` without the CRC-32 pass: only the size is checked here.

        For :func:`hydrate`, which computes the CRC-32 with ``pread`` on the
        returned reader's fd in a thread while it extracts into its staging
        directory, and checks it before the swap.  A caller that reads the
        archive must check it the same way (:func:`_archive_crc`).

        Raises:
            SnapshotNotFoundError: no such snapshot.
            SnapshotCorruptError: the archive is missing or its size does not match its metadata.
            SnapshotLimitError: the archive is larger than ``limits.max_archive_bytes``.
        """
        info = self.info(name)
        if info is None:
            raise SnapshotNotFoundError("no snapshot with this name", sandbox_path=None, context={"snapshot": name})
        if info.archive_bytes > limits.max_archive_bytes:
            raise SnapshotLimitError("snapshot archive is larger than max_archive_bytes", sandbox_path=None,
                                     context={"snapshot": name, "max_archive_bytes": limits.max_archive_bytes})
        try:
            fd = self.root.open_fd(info.archive, os.O_RDONLY | os.O_NONBLOCK, follow_symlinks=False)
        except FileNotFoundError:
            raise SnapshotCorruptError("snapshot archive is missing", sandbox_path=None,
                                       context={"snapshot": name}) from None
        # unbuffered (io.FileIO): the file offset is the read position, so the extractor copies
        # member data kernel-side from this fd (its batched path), not through Python buffers
        f = io.open(fd, "rb", buffering=0, closefd=True)
        try:
            st = os.fstat(fd)
            if not _stat.S_ISREG(st.st_mode) or st.st_size != info.archive_bytes:
                raise SnapshotCorruptError("snapshot archive size does not match its metadata (truncated?)",
                                           sandbox_path=None, context={"snapshot": name})
            return f, info
        except BaseException:
            f.close()
            raise

    def list(self) -> list[SnapshotInfo]:
        """Metadata of every valid snapshot in the store, sorted by name (corrupt ones left out).

        Raises:
            OSError: the store directory cannot be read.
        """
        out = []
        for fname in self.root.listdir("."):
            if fname.endswith(".json") and _TOKEN.fullmatch(fname[:-5]):
                try:
                    info = self.info(fname[:-5])
                except SnapshotCorruptError:
                    continue
                if info is not None:
                    out.append(info)
        return out

    # -- writing

    def begin(self, name: str) -> PendingArchive:
        """Start a new archive for ``name``: an ``O_TMPFILE`` in the store (a named partial as fallback).

        Raises:
            InvalidPathError: ``name`` is not a plain token.
            OSError: the store directory cannot be written.
        """
        validate_name(name)
        partial = None
        try:
            if not _proc_fd_available():  # commit names an O_TMPFILE through /proc
                raise OSError(errno.EOPNOTSUPP, "no /proc/self/fd")
            # Root.open_fd(".", O_TMPFILE) is refused (it wants a name): open the
            # store's own directory fd and create the unnamed file relative to it.
            dfd = self.root.open_dir_fd(".")
            try:
                fd = os.open(".", os.O_WRONLY | _native.O_TMPFILE | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            finally:
                os.close(dfd)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
            partial = f".{name}.{secrets.token_hex(8)}.partial"
            fd = self.root.open_fd(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.fchmod(fd, 0o600)
        sink = _HashingSink(fd)
        return PendingArchive(name, fd, sink, io.BufferedWriter(sink, _READ_CHUNK), partial)

    def abort(self, pending: PendingArchive) -> None:
        """Discard an unfinished archive (idempotent)."""
        with contextlib.suppress(Exception):
            pending.stream.close()
        if pending.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(pending.fd)
            pending.fd = -1
        if pending.partial:
            with contextlib.suppress(OSError):
                self.root.remove(pending.partial)
            pending.partial = None

    def commit(self, pending: PendingArchive, info: SnapshotInfo) -> SnapshotInfo:
        """Make ``pending`` the next generation of its snapshot; returns the metadata committed.

        Under the name's ``flock``: the generation is one more than the
        current one (and than any archive of the name still on disk), so it
        grows monotonically per name; the archive is fsynced and linked as
        ``<name>.g<generation>.<token>.tar``, then *read back by that name*
        and its size and CRC-32 checked against ``info``; only then is the
        metadata atomically replaced (the commit point) and read back.  The
        previous generation's archive is removed last, once the new one is
        known good.  A crash at any step leaves the previous generation
        current and intact.

        Returns:
            ``info`` with ``generation`` and ``archive`` set by the store.

        Raises:
            SnapshotVerifyError: the read-back of the archive or of the
                metadata did not match: the new generation is withdrawn and
                the previous one (``context["generation"]``) stays or is made
                current again.
            OSError: the store cannot be written.
        """
        name = pending.name
        pending.stream.flush()
        os.fsync(pending.fd)
        lock_fd = self.root.open_fd(f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            prev_raw, prev = self._current(name)
            prev_gen = prev.generation if prev is not None else 0
            gen = 1 + max(prev_gen, self._archived_generation(name))
            info = info.model_copy(update={"generation": gen,
                                           "archive": f"{name}.g{gen}.{secrets.token_hex(8)}.tar"})
            self._link_archive(pending, info.archive)
            verify_context = {"snapshot": name, "generation": prev_gen, "failed_generation": gen}
            if not self._verify_committed(info):
                with contextlib.suppress(OSError):
                    self.root.remove(info.archive)
                raise SnapshotVerifyError("the new snapshot archive did not read back with its CRC-32; it was "
                                          "withdrawn and the previous generation stays current", sandbox_path=None,
                                          context=verify_context)
            committed = self._replace_metadata(info, prev_raw)
            if committed is None:
                raise SnapshotVerifyError("the new snapshot metadata did not read back; the store fell back to the "
                                          "previous generation", sandbox_path=None, context=verify_context)
            for fname in self.root.listdir("."):
                if fname.startswith(f"{name}.") and fname.endswith(".tar") and fname != info.archive:
                    with contextlib.suppress(FileNotFoundError):
                        self.root.remove(fname)
            return committed
        finally:
            os.close(lock_fd)
            self.abort(pending)

    def _link_archive(self, pending: PendingArchive, archive: str) -> None:
        """Give the written archive its name ``archive`` in the store (never replacing a file), durably.

        Raises:
            OSError: the link or rename failed (EEXIST: the name exists).
        """
        if pending.partial is None:
            dfd = self.root.open_dir_fd(".")
            try:
                os.link(f"/proc/self/fd/{pending.fd}", archive, dst_dir_fd=dfd, follow_symlinks=True)
            finally:
                os.close(dfd)
        else:
            self.root.rename(pending.partial, archive, no_replace=True)
            pending.partial = None
        self._fsync_dir()

    def _replace_metadata(self, info: SnapshotInfo, prev_raw: bytes | None) -> SnapshotInfo | None:
        """Atomically replace the metadata of ``info.name`` with ``info`` (the commit point) and read it back.

        Returns what was read back (``info`` with its :attr:`~SnapshotInfo.digest`).
        When it does not read back as ``info``, the previous metadata
        (``prev_raw``; None: there was none) is put back and the new archive
        removed: None.

        Raises:
            OSError: the store cannot be written.
        """
        meta = f"{info.name}.json"
        self._write_metadata(info.name, _info_to_json(info))
        try:
            got = self.info(info.name)
            if got is not None and got.model_copy(update={"digest": ""}) == info.model_copy(update={"digest": ""}):
                return got
        except SnapshotCorruptError:
            pass
        if prev_raw is not None:
            self._write_metadata(info.name, prev_raw)
        else:
            with contextlib.suppress(FileNotFoundError):
                self.root.remove(meta)
        self._fsync_dir()
        with contextlib.suppress(OSError):
            self.root.remove(info.archive)
        return None

    def _write_metadata(self, name: str, raw: bytes) -> None:
        """Atomically replace ``<name>.json`` with ``raw``, durably; the caller holds the name's lock.

        The new content is written to the name's own temporary,
        ``.<name>.json.partial`` (fsynced, then renamed over the metadata and
        the directory fsynced).  Only a commit holding the name's ``flock``
        writes it, so one left by a process killed mid-write is removed here
        by the next commit of the name: a crash never leaves a temporary the
        store would keep forever (a randomly named one could never be told
        from another commit's, in flight).

        Raises:
            OSError: the store cannot be written (ENOSPC, EIO ...); the
                temporary is removed and the metadata is unchanged.
        """
        tmp = _meta_partial(name)
        with contextlib.suppress(FileNotFoundError):
            self.root.remove(tmp)
        fd = self.root.open_fd(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.fchmod(fd, 0o600)
                view = memoryview(raw)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            self.root.rename(tmp, f"{name}.json")
        except BaseException:
            with contextlib.suppress(OSError):
                self.root.remove(tmp)
            raise
        self._fsync_dir()

    def _current(self, name: str) -> tuple[bytes | None, SnapshotInfo | None]:
        """The current metadata of ``name`` as stored and parsed (``(None, None)``: none, or unreadable)."""
        try:
            raw = self.root.read_bytes(f"{name}.json", max_bytes=_MAX_META_BYTES)
        except FileNotFoundError:
            return None, None
        try:
            return raw, self.info(name)
        except SnapshotCorruptError:
            return None, None

    def _archived_generation(self, name: str) -> int:
        """The highest generation among the archives of ``name`` on disk (0: none)."""
        best = 0
        for fname in self.root.listdir("."):
            m = _GEN_ARCHIVE.fullmatch(fname)
            if m is not None and m.group(1) == name:
                best = max(best, int(m.group(2)))
        return best

    def _verify_committed(self, info: SnapshotInfo) -> bool:
        """Read the archive just linked back by its name: a regular file of the recorded size and CRC-32."""
        try:
            fd = self.root.open_fd(info.archive, os.O_RDONLY | os.O_NONBLOCK, follow_symlinks=False)
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            if not _stat.S_ISREG(st.st_mode) or st.st_size != info.archive_bytes:
                return False
            _check_crc(_archive_crc_split(fd, info.archive_bytes), info)  # both cores: it is all persist does now
            return True
        except (OSError, SnapshotCorruptError):
            return False
        finally:
            os.close(fd)

    def remove(self, name: str) -> None:
        """Delete snapshot ``name`` (metadata first, then its archives).  Missing is fine.

        Raises:
            InvalidPathError: ``name`` is not a plain token.
            OSError: the store directory cannot be written.
        """
        validate_name(name)
        for fname in [f"{name}.json", _meta_partial(name)] + [f for f in self.root.listdir(".")
                                          if f.startswith(f"{name}.") and f.endswith((".tar", ".lock"))]:
            with contextlib.suppress(FileNotFoundError):
                self.root.remove(fname)
        self._fsync_dir()

    def _fsync_dir(self) -> None:
        dfd = self.root.open_dir_fd(".")
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def close(self) -> None:
        """Release the store's directory fd.  Idempotent."""
        self.root.close()

    def __enter__(self) -> "LocalSnapshotStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
