"""Streaming snapshots of a workspace: persist (tar), hydrate, stores, fingerprint.

*Persist* walks the workspace through its :class:`~sandbox_fs.root.Root`
(fd-based, never follows a symlink) and streams a POSIX.1-2001 (PAX) tar
with workspace-relative member names straight into a :class:`SnapshotStore`:
an unnamed ``O_TMPFILE`` (or a uniquely named partial file) in the store
directory, ``fsync``, then an atomic link/rename and an atomic rewrite of the
snapshot's metadata.  Memory is O(1) in workspace size: one file is open at
a time and data moves through two fixed 1 MiB buffers: each file is read
into one (``readv``), SHA-256-hashed there for the fingerprint and, with
its tarfile-built header, handed to one writer thread that writes (and
CRC-32s) the other buffer meanwhile, so every byte is read once and the
write uses the second core.  A file that grows or shrinks while it is read
no longer matches its header and is refused
(:class:`SnapshotSourceChangedError`, retryable).  The writer thread is
joined before persist returns or raises, and a write error (ENOSPC) is
raised by persist: the archive is then discarded, never committed.

The walk never follows a symlink and never trusts a held directory fd.
Directories are *listed* through fds the walk holds (one per level, so the
fd count is bounded by the depth), with every ``lstat`` taken relative to
the listed directory; but a held fd can be moved out of the workspace at
any moment, so every entry the snapshot reads or records -- a regular
file's content and metadata, a subdirectory to list (and its mode), a
symlink's target -- is opened by its *path* beneath the workspace Root's
own fd at the moment of use (``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``,
``O_NOFOLLOW`` on the leaf, ``O_NONBLOCK`` for files; a symlink as an
``O_PATH`` fd read with ``readlinkat(fd, "")``) and ``fstat``-checked to be
the very inode (device, inode number, type) the listing's ``lstat`` saw.
So a file swapped for a symlink (or a FIFO, or another file), a parent
swapped for a symlink, or a directory moved out of the workspace while
the walk held it (and written into afterwards) is never read through: the
retryable :class:`SnapshotSourceChangedError`.  An entry gone both from
its path and from its listed directory was deleted and is skipped; one
still listed but not at its path (a parent moved) is
:class:`SnapshotSourceChangedError`.  A path longer than PATH_MAX is an
unrestorable entry (refused or skipped) like any other.

*Hard links*: ordinary files stream as they are listed (O(1) memory); a
regular file with ``st_nlink > 1`` is deferred until the walk has counted
its names (only multi-linked inodes are remembered) and archived only when
every one of its links is inside the walk (the first name as a file, the
others as hard-link members).  A file also linked from outside the
workspace (or from an excluded path) is never read: refused, or skipped
and reported, so outside content cannot reach a snapshot.

*One policy for persist and hydrate* (a saved snapshot is always restorable):
persist applies the archive extractor's own rules (its member-name and
symlink-target functions, and the same limits): regular files, directories,
relative symlinks whose target stays beneath the workspace without passing
through another symlink, and hard links between members.  Absolute or
escaping symlinks, FIFOs, sockets, device nodes and names the extractor
refuses are refused at persist time (:class:`UnrestorableEntryError`) or,
with ``on_unrestorable="skip"``, left out and listed in the report.  Owners are
never recorded (uid/gid 0, no names); setuid/setgid/sticky bits are never
stored (modes are masked to 0o777, as :meth:`Root.chmod` enforces).

*Hydrate* verifies the archive's size and CRC-32 against the metadata, so a
truncated or corrupted snapshot is refused with :class:`SnapshotCorruptError`;
the previous good snapshot stays valid because a new one only becomes
current when its metadata file is atomically replaced.  It stages before it
swaps: extraction goes through the archive extractor
(:mod:`sandbox_fs.archive`, limits on) into a private ``.sfs-hydrate-<hex>``
directory inside the workspace (reached by its name from the workspace fd in
every step, never through an fd of its own, and checked to be the directory
the extractor made before anything moves) while a thread computes the archive's CRC-32
(``pread`` of the same fd, at most the recorded size and one byte more:
never to the end of a file grown after its size check; the exact recorded
modes are applied by the extractor through the fds it makes the entries
with, never by name), the CRC-32 is checked, and only then is the workspace
cleared and the staged entries moved up.  Any failure before the swap leaves the previous contents untouched.

The *fingerprint* is ``sha256("sfs-fp-v1" NUL manifest_digest NUL tree_digest)``
where the tree digest covers, in walk order, every kept entry's path, type,
size, permission bits and content SHA-256 (symlink: its target text).  It is
computed in Python over the fd walk, never by running a command in the
workspace, and lets a resumed session skip a restore when the live
workspace provably matches the snapshot.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import json
import os
import queue
import re
import secrets
import stat as _stat
import tarfile
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Iterable, Iterator, Literal, NamedTuple, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from .. import _native
from ..errors import InvalidPathError, SandboxError
from ..paths import normalize
from ..archive import ArchiveFormatError, ArchiveLimitError, ArchiveLimits, ExtractPolicy, UnsafeArchiveMemberError
from ..archive._extract import _extract as _archive_extract
from ..archive._names import normalize_member, symlink_walk
from ..archive._tar import _EXT_TYPES, MAX_HEADER_CHAIN, PaxBudget, check_pax_body
from ..archive._writer import STAGED_PATH_MAX
from ..archive._writer import dir_mode as _x_dir_mode
from ..archive._writer import file_mode as _x_file_mode
from ..root import MAX_PATH_BYTES, Root, Subtree, kind_of, open_root

__all__ = [
    "SnapshotError",
    "SnapshotNotFoundError",
    "SnapshotCorruptError",
    "SnapshotLimitError",
    "SnapshotSourceChangedError",
    "UnrestorableEntryError",
    "SnapshotVerifyError",
    "SnapshotLimits",
    "SnapshotPolicy",
    "SnapshotInfo",
    "PersistReport",
    "HydrateReport",
    "SnapshotStore",
    "LocalSnapshotStore",
    "NoSnapshot",
    "persist",
    "hydrate",
    "tree_digest",
    "fingerprint",
    "validate_name",
]

SNAPSHOT_FORMAT = "sandbox-fs-snapshot"
SNAPSHOT_VERSION = 1
_TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
_READ_CHUNK = 1 << 20
_MAX_META_BYTES = 256 << 20
_WRITEBACK_BYTES = 8 << 20  # start writeback of the archive every 8 MiB (see _HashingSink); 0: never
# In-flight names (Root.atomic_write temp files, archive and hydrate staging dirs, the private directory of a
# checked rmdir): never persisted.
_IN_FLIGHT_PREFIXES = (".sfs-tmp-", ".sfs-extract-", ".sfs-hydrate-", ".sfs-rm-")
#: the workspace id file of a session (see :mod:`sandbox_fs.session`): at the workspace's top, never persisted
WORKSPACE_ID_NAME = ".sfs-workspace-id"
_GEN_ARCHIVE = re.compile(r"([A-Za-z0-9][A-Za-z0-9_-]{0,127})\.g([0-9]{1,18})\.[0-9a-f]{16}\.tar")


# ---------------------------------------------------------------------- errors


class SnapshotError(SandboxError):
    """Base of snapshot refusals."""

    code = "snapshot_error"


class SnapshotNotFoundError(SnapshotError, LookupError):
    """The named snapshot does not exist in the store."""

    code = "snapshot_not_found"


class SnapshotCorruptError(SnapshotError, ValueError):
    """A snapshot's archive or metadata is truncated, altered or malformed."""

    code = "snapshot_corrupt"


class SnapshotLimitError(SnapshotError):
    """A snapshot exceeds :class:`SnapshotLimits` (at persist or at hydrate)."""

    code = "snapshot_limit"


class SnapshotSourceChangedError(SnapshotError):
    """The workspace changed under the walk (a file resized or replaced, a directory moved); retry may succeed."""

    code = "snapshot_source_changed"
    retryable = True


class UnrestorableEntryError(SnapshotError):
    """A workspace entry that hydrate would refuse (absolute/escaping symlink, FIFO, device, socket)."""

    code = "snapshot_unrestorable_entry"


class SnapshotVerifyError(SnapshotError):
    """A committed archive failed its CRC-32 read-back: the store fell back to the previous generation.

    ``context["generation"]`` is the generation that is current now (the
    previous one, or 0 when there was none) and ``context["failed_generation"]``
    the one that was withdrawn.  Nothing the previous generation held is lost;
    the workspace is unchanged, so persisting again may succeed.
    """

    code = "snapshot_verify_failed"
    retryable = True


def validate_name(name: str, what: str = "snapshot name") -> str:
    """Return ``name`` if it is a plain token (``[A-Za-z0-9][A-Za-z0-9_-]{0,127}``).

    Snapshot names and session ids become file names in trusted host
    directories, so they may hold no ``/``, ``.``, NUL or anything else.

    Raises:
        InvalidPathError: ``name`` is not such a token.
    """
    if not isinstance(name, str) or not _TOKEN.fullmatch(name):
        shown = name[:64] if isinstance(name, str) else type(name).__name__
        raise InvalidPathError(f"{what} must be a plain token of letters, digits, '_' or '-'",
                               sandbox_path=None, context={"value": shown})
    return name


# ---------------------------------------------------------------------- models


@dataclass(frozen=True)
class SnapshotLimits:
    """Bounds applied identically when persisting and when hydrating.

    Attributes:
        max_entries: most members (files, dirs, links) in one snapshot.
        max_file_bytes: largest single regular file, in bytes.
        max_total_bytes: most file content in one snapshot, in bytes.
        max_archive_bytes: largest archive file hydrate will read, in bytes.
    """

    max_entries: int = 1_000_000
    max_file_bytes: int = 16 << 30
    max_total_bytes: int = 64 << 30
    max_archive_bytes: int = 80 << 30


class SnapshotInfo(BaseModel):
    """Metadata stored next to each snapshot (``<name>.json`` in a local store)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["sandbox-fs-snapshot"] = SNAPSHOT_FORMAT
    version: Literal[1] = SNAPSHOT_VERSION
    name: str
    archive: str
    archive_bytes: int = Field(ge=0)
    archive_crc32: str = Field(pattern=r"^[0-9a-f]{8}$")
    fingerprint: str = Field(pattern=r"^[0-9a-f]{64}$")
    manifest_digest: str = ""
    tree_digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    excluded: list[str] = Field(default_factory=list)
    mode_fixups: list[tuple[str, int]] = Field(default_factory=list)
    entries: int = Field(ge=0)
    content_bytes: int = Field(ge=0)
    created_ns: int = 0
    generation: int = Field(0, ge=0)  # 1, 2, ... per name, assigned by the store at commit; 0: before generations


def _ustar_fits(name: str, link: str, size: int, mtime: int) -> bool:
    """True when a member needs no PAX header (the condition of :func:`_header`'s fast path)."""
    return len(name) <= 100 and len(link) <= 100 and name.isascii() and link.isascii() \
        and 0 <= size < _USTAR_MAX_NUMBER and 0 <= mtime < _USTAR_MAX_NUMBER


class SnapshotPolicy:
    """The restore rules of a snapshot: one object, applied by persist and by hydrate.

    Hydrate treats a snapshot as an untrusted archive: it extracts it with
    :meth:`archive_limits` and :meth:`extract_policy` through the archive
    extractor, which parses every header with tarfile behind its guards.
    Persist applies the *same* object to what it is about to write, before
    anything is committed, so whatever persist commits, hydrate restores:

    * member names: the extractor's :func:`~sandbox_fs.archive._names.normalize_member`
      with :meth:`archive_limits` (zip slip CVE-2007-4559, backslash ``..``
      CVE-2021-37713, drive letters, NUL, a component over 255 bytes, depth,
      paths over :data:`~sandbox_fs.archive._writer.STAGED_PATH_MAX`);
    * symlink targets: the extractor's ``symlink_walk`` (absolute, escaping,
      through another symlink: CVE-2025-4517);
    * the header chain of every member exactly as written
      (:meth:`header_check`): each PAX extended header or GNU long name no
      larger than ``max_header_bytes``, at most ``MAX_HEADER_CHAIN`` of them,
      each PAX body well formed and within the extractor's CVE-2024-6232
      digit-run budget (:class:`~sandbox_fs.archive._tar.PaxBudget`, the same
      class the extractor charges, per header and per archive);
    * counts and sizes: ``max_entries`` (members), ``max_file_bytes``,
      ``max_total_bytes`` and the archive's own size against
      ``max_archive_bytes`` (:meth:`check_archive_bytes`);
    * modes (:meth:`mode`): only the permission bits 0o777.  Set-user-ID,
      set-group-ID and sticky bits are never recorded at persist and always
      cleared at hydrate (a forged archive or ``mode_fixups`` carrying them
      restores the file without them): a snapshot never restores a set-id file.

    Args:
        limits: the :class:`SnapshotLimits` both sides apply (default: its defaults).
    """

    def __init__(self, limits: "SnapshotLimits | None" = None) -> None:
        self.limits = limits or SnapshotLimits()
        self.archive = self.archive_limits()

    def archive_limits(self, archive_bytes: int | None = None) -> ArchiveLimits:
        """The extractor's limits: the same bounds persist applied.

        Depth and path length are as wide as hydrate can stage: a path is at
        most :data:`~sandbox_fs.archive._writer.STAGED_PATH_MAX` bytes (PATH_MAX
        less the staging directory's name, through which every restored path is
        reached).  An uncompressed tar never expands, so the expansion-ratio
        bound is left at its default.  With ``archive_bytes`` (the validated
        archive size, in bytes), the input is bounded by it too, not only by
        ``max_archive_bytes``.
        """
        limits = self.limits
        max_input = limits.max_archive_bytes if archive_bytes is None else max(
            1, min(limits.max_archive_bytes, archive_bytes))
        return ArchiveLimits(max_members=limits.max_entries, max_member_bytes=limits.max_file_bytes,
                             max_total_bytes=limits.max_total_bytes, max_input_bytes=max_input,
                             max_depth=MAX_PATH_BYTES // 2, max_path_bytes=STAGED_PATH_MAX)

    @staticmethod
    def extract_policy() -> ExtractPolicy:
        """How hydrate extracts: atomic staging, special files refused, links created, owners never applied."""
        return ExtractPolicy(in_place=False, special_files="refuse", symlinks="create", hardlinks="create",
                             preserve_owner=False, apply_mtime=True)

    @staticmethod
    def mode(st_mode: int) -> int:
        """The mode a snapshot records and restores: the permission bits only (set-id and sticky cleared)."""
        return _stat.S_IMODE(st_mode) & 0o777

    def header_check(self) -> "_HeaderCheck":
        """A fresh per-archive checker of written header chains (its PAX budget starts empty)."""
        return _HeaderCheck(self.archive)

    def check_archive_bytes(self, nbytes: int) -> None:
        """Refuse an archive hydrate would not read (larger than ``max_archive_bytes``).

        Raises:
            SnapshotLimitError: ``nbytes`` > ``max_archive_bytes``.
        """
        if nbytes > self.limits.max_archive_bytes:
            raise SnapshotLimitError("the snapshot archive would be larger than max_archive_bytes", sandbox_path=None,
                                     context={"max_archive_bytes": self.limits.max_archive_bytes,
                                              "archive_bytes": nbytes})


class _HeaderCheck:
    """The extractor's header rules applied to the header chain persist is about to write (one archive).

    Args:
        alimits: the policy's :class:`ArchiveLimits` (``max_header_bytes``).
    """

    def __init__(self, alimits: ArchiveLimits) -> None:
        self._max_header = alimits.max_header_bytes
        self.budget = PaxBudget()

    def check(self, hdr: bytes, member: str) -> tuple[str | None, int]:
        """``(why hydrate would refuse this header chain or None, its PAX digit cost)``; admits nothing."""
        pos = 0
        cost = 0
        chain = 0
        while pos + _BLOCK_BYTES <= len(hdr):
            block = hdr[pos:pos + _BLOCK_BYTES]
            kind = block[156:157]
            if kind not in _EXT_TYPES:
                break  # the member's own header: the chain is over
            chain += 1
            if chain >= MAX_HEADER_CHAIN:
                return f"its tar header needs more than {MAX_HEADER_CHAIN} extension headers", 0
            try:
                size = int(block[124:136].rstrip(b"\0 ") or b"0", 8)
            except ValueError:
                return "its tar header has an unreadable size field", 0
            if size > self._max_header:
                return f"its tar extension header ({size} bytes) exceeds max_header_bytes", 0
            body = hdr[pos + _BLOCK_BYTES:pos + _BLOCK_BYTES + size + (-size % _BLOCK_BYTES)]
            if kind in (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE):
                try:
                    one = check_pax_body(body, size, member)
                except ArchiveFormatError:
                    return "its PAX header would not parse", 0
                spent = self.budget.spent
                self.budget.spent = spent + cost  # the chain's earlier PAX headers count too
                try:
                    why = self.budget.refusal(one)
                finally:
                    self.budget.spent = spent
                if why is not None:
                    return why, 0
                cost += one
            pos += _BLOCK_BYTES + size + (-size % _BLOCK_BYTES)
        return None, cost

    def admit(self, cost: int) -> None:
        """Count an admitted header chain's digit cost against the archive budget."""
        self.budget.spent += cost


@dataclass
class PersistReport:
    """What :func:`persist` wrote.

    Attributes:
        info: the committed snapshot's metadata (None with :class:`NoSnapshot`).
        skipped: ``(sandbox path, reason)`` of entries left out (mount
            points, excluded paths, unrestorable entries with ``on_unrestorable="skip"``).
    """

    info: SnapshotInfo | None
    skipped: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class HydrateReport:
    """What :func:`hydrate` restored: the snapshot's metadata and the extractor used."""

    info: SnapshotInfo
    extractor: str


# ---------------------------------------------------------------------- stores


@runtime_checkable
class SnapshotStore(Protocol):
    """Where snapshots live.  Every method is blocking (call it from a worker thread).

    ``enabled`` is False for :class:`NoSnapshot`.  ``begin`` returns a binary
    writable sink; ``commit`` makes it the named snapshot atomically (the
    previous one stays valid until then) and returns the metadata it
    committed, with a ``generation`` one more than the previous one (a store
    without generations may return None: generation 0); ``abort`` discards it.
    """

    enabled: bool

    def info(self, name: str) -> SnapshotInfo | None: ...

    def begin(self, name: str) -> "PendingArchive": ...

    def commit(self, pending: "PendingArchive", info: SnapshotInfo) -> "SnapshotInfo | None": ...

    def abort(self, pending: "PendingArchive") -> None: ...

    def open_archive(self, name: str, limits: SnapshotLimits) -> tuple[IO[bytes], SnapshotInfo]: ...

    def list(self) -> list[SnapshotInfo]: ...

    def remove(self, name: str) -> None: ...

    def close(self) -> None: ...


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

    def write(self, b: Any) -> int:  # type: ignore[override]
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
    """An archive being written into a store; ``stream`` is the buffered sink."""

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
        raise SnapshotError("this client has no snapshot store", sandbox_path=None)

    def commit(self, pending: PendingArchive, info: SnapshotInfo) -> None:
        raise SnapshotError("this client has no snapshot store", sandbox_path=None)

    def abort(self, pending: PendingArchive) -> None:
        pass

    def open_archive(self, name: str, limits: SnapshotLimits) -> tuple[IO[bytes], SnapshotInfo]:
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
    return SnapshotInfo.model_validate(json.loads(raw))


class LocalSnapshotStore:
    """Snapshots as files in one trusted host directory (the embedded default).

    Layout: ``<name>.json`` (the :class:`SnapshotInfo`, replaced atomically:
    the commit point) and ``<name>.<token>.tar`` (the archive it names).
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

    def __init__(self, directory: str | os.PathLike, *, create: bool = True) -> None:
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
        return info

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
        """Metadata of every valid snapshot in the store, sorted by name (corrupt ones left out)."""
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
        """Start a new archive for ``name``: an ``O_TMPFILE`` in the store (a named partial as fallback)."""
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
            gen = 1 + max(prev.generation if prev is not None else 0, self._archived_generation(name))
            info = info.model_copy(update={"generation": gen,
                                           "archive": f"{name}.g{gen}.{secrets.token_hex(8)}.tar"})
            if pending.partial is None:
                dfd = self.root.open_dir_fd(".")
                try:
                    os.link(f"/proc/self/fd/{pending.fd}", info.archive, dst_dir_fd=dfd, follow_symlinks=True)
                finally:
                    os.close(dfd)
            else:
                self.root.rename(pending.partial, info.archive, no_replace=True)
                pending.partial = None
            self._fsync_dir()
            prev_gen = prev.generation if prev is not None else 0
            if not self._verify_committed(info):
                with contextlib.suppress(OSError):
                    self.root.remove(info.archive)
                raise SnapshotVerifyError("the new snapshot archive did not read back with its CRC-32; it was "
                                          "withdrawn and the previous generation stays current", sandbox_path=None,
                                          context={"snapshot": name, "generation": prev_gen,
                                                   "failed_generation": gen})
            self.root.atomic_write(f"{name}.json", _info_to_json(info), mode=0o600)
            self._fsync_dir()
            try:
                ok = self.info(name) == info
            except SnapshotCorruptError:
                ok = False
            if not ok:
                if prev_raw is not None:
                    self.root.atomic_write(f"{name}.json", prev_raw, mode=0o600)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        self.root.remove(f"{name}.json")
                self._fsync_dir()
                with contextlib.suppress(OSError):
                    self.root.remove(info.archive)
                raise SnapshotVerifyError("the new snapshot metadata did not read back; the store fell back to the "
                                          "previous generation", sandbox_path=None,
                                          context={"snapshot": name, "generation": prev_gen,
                                                   "failed_generation": gen})
            for fname in self.root.listdir("."):
                if fname.startswith(f"{name}.") and fname.endswith(".tar") and fname != info.archive:
                    with contextlib.suppress(FileNotFoundError):
                        self.root.remove(fname)
            return info
        finally:
            os.close(lock_fd)
            self.abort(pending)

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
            _check_crc(_archive_crc(fd, info.archive_bytes), info)
            return True
        except (OSError, SnapshotCorruptError):
            return False
        finally:
            os.close(fd)

    def remove(self, name: str) -> None:
        """Delete snapshot ``name`` (metadata first, then its archives).  Missing is fine."""
        validate_name(name)
        for fname in [f"{name}.json"] + [f for f in self.root.listdir(".")
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


# ------------------------------------------------------------------- the walk


class _Item(NamedTuple):
    path: str  # workspace-relative sandbox path
    kind: str  # file | dir | symlink | fifo | socket | char | block | unknown
    st: os.stat_result
    name: str = ""  # its name in its parent directory (fd-relative calls)


def _excluded(path: str, excluded: frozenset[str]) -> bool:
    if not excluded:
        return False
    if path in excluded:
        return True
    i = path.find("/")
    while i > 0:
        if path[:i] in excluded:
            return True
        i = path.find("/", i + 1)
    return False


def _norm_set(paths: Iterable[str]) -> frozenset[str]:
    out = set()
    for p in paths:
        sp = normalize(p)
        if sp:
            out.add(str(sp))
    return frozenset(out)


# Opened by path through the source view (Root.open_fd adds O_CLOEXEC; follow_symlinks=False adds O_NOFOLLOW).
_SUBDIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY
_MEMBER_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY


def _list_dir(dfd: int) -> list[tuple[str, os.stat_result]]:
    """``(name, lstat)`` of every entry of the open directory ``dfd``, sorted by name.

    Each ``lstat`` is taken relative to ``dfd`` (never follows a symlink);
    an entry removed between the listing and its ``lstat`` is left out.
    (Tests replace this function to change the tree between a listing and
    the opens that follow it.)

    Raises:
        OSError: the directory cannot be read.
    """
    out = []
    stat = os.stat
    for name in sorted(os.listdir(dfd)):
        try:
            out.append((name, stat(name, dir_fd=dfd, follow_symlinks=False)))
        except FileNotFoundError:
            continue
    return out


def _source_view(ws: Root) -> Root:
    """The Root every entry the walk keeps is opened through: the workspace's own fd, read-only, no symlinks.

    ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`` from the workspace Root's fd
    (a ``dup`` of it; the caller closes the view), so a path resolves only
    through real directories beneath the workspace, at the moment of use.
    """
    return ws.with_options(read_only=True, no_symlinks=True)


def _still_listed(dfd: int, name: str) -> bool:
    """True when ``name`` still exists in the directory open on ``dfd`` (the walk's held listing fd)."""
    try:
        os.stat(name, dir_fd=dfd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot tell: treat as changed (retryable), never as vanished


def _open_listed(src: Root, item: _Item, flags: int, dfd: int | None = None) -> int | None:
    """Open a listed entry by its path beneath the workspace Root, now; None when it has vanished.

    The path is resolved from the workspace Root's own fd (``src``, see
    :func:`_source_view`: ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``, ``O_NOFOLLOW``
    on the leaf) at the moment of use, never relative to a directory fd the
    walk has held since the listing: that directory may have been moved out
    of the workspace meanwhile (and anything written into it since).  The
    caller ``fstat``-checks that the fd is the inode the listing's ``lstat``
    saw (:func:`_check_identity`, :func:`_member_stat`).

    ``ENOENT``: with ``dfd`` (the held directory the name was listed in),
    an entry also gone from there has vanished (None: skipped, like a file
    deleted mid-walk); one still there is no longer at its path (a parent
    was moved or renamed): :class:`SnapshotSourceChangedError`.  Without
    ``dfd``, ``ENOENT`` is a vanished entry.

    Args:
        src: the source view of the workspace Root.
        item: the listed entry (its sandbox path and listing ``lstat``).
        flags: ``os.O_*`` read flags (``O_PATH``, ``O_DIRECTORY``, ``O_NONBLOCK`` ...).
        dfd: the walk's fd of the directory ``item`` was listed in, if still held.

    Raises:
        SnapshotSourceChangedError: a symlink, a special file (for a read
            open), a non-directory or an escape on its path now, or ``ENOENT``
            while still listed (retryable).
        OSError: any other failure (with its sandbox path, never a host path).
    """
    try:
        return src.open_fd(item.path, flags, follow_symlinks=False)
    except FileNotFoundError:
        if dfd is not None and _still_listed(dfd, item.name):
            raise SnapshotSourceChangedError("entry is no longer at its path (a parent directory was moved "
                                             "while the workspace was being persisted)",
                                             sandbox_path=item.path) from None
        return None
    except (OSError, SandboxError) as exc:
        # ELOOP: a symlink now; special_file: Root refuses FIFOs/devices; ENOTDIR/EXDEV: a parent swapped
        if getattr(exc, "code", None) in _CHANGED_CODES or \
                getattr(exc, "errno", None) in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO, errno.EXDEV):
            raise SnapshotSourceChangedError("entry was replaced while it was being persisted",
                                             sandbox_path=item.path) from None
        if isinstance(exc, SandboxError):
            raise
        _native.raise_errno(exc.errno or errno.EIO, "persist", item.path)
        raise  # unreachable


def _check_identity(fd: int, item: _Item) -> os.stat_result:
    """``fstat`` of an entry just opened by path: the very inode (and type) the listing's ``lstat`` saw.

    Raises:
        SnapshotSourceChangedError: another inode or another type (replaced
            or moved between the listing and the open; retryable).
    """
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (item.st.st_dev, item.st.st_ino) or \
            _stat.S_IFMT(st.st_mode) != _stat.S_IFMT(item.st.st_mode):
        raise SnapshotSourceChangedError("entry was replaced while it was being persisted", sandbox_path=item.path)
    return st


def _lstat_listed(src: Root, item: _Item, dfd: int | None = None) -> os.stat_result | None:
    """The ``lstat`` of a listed entry taken by its path beneath the workspace Root now, identity-checked.

    What the snapshot records of a directory (mode, mtime) or a symlink
    comes from this, never from the listing alone.  None when it vanished
    (see :func:`_open_listed`).

    Raises:
        SnapshotSourceChangedError: see :func:`_open_listed` and :func:`_check_identity`.
    """
    fd = _open_listed(src, item, os.O_PATH, dfd)
    if fd is None:
        return None
    try:
        return _check_identity(fd, item)
    finally:
        os.close(fd)


def _readlink_listed(src: Root, item: _Item, dfd: int | None = None) -> tuple[str, os.stat_result] | None:
    """``(target, lstat)`` of a listed symlink, read through an ``O_PATH|O_NOFOLLOW`` fd opened by its path.

    The link is opened beneath the workspace Root (:func:`_open_listed`),
    ``fstat``-checked to be the listed symlink, and read with
    ``readlinkat(fd, "")``: the target read is the one of the checked inode.
    None when it vanished.

    Raises:
        SnapshotSourceChangedError: see :func:`_open_listed` and :func:`_check_identity`.
        OSError: reading the link failed.
    """
    fd = _open_listed(src, item, os.O_PATH, dfd)
    if fd is None:
        return None
    try:
        st = _check_identity(fd, item)
        return os.fsdecode(os.readlink(b"", dir_fd=fd)), st
    finally:
        os.close(fd)


def _walk(ws: Root, src: Root, excluded: frozenset[str], skipped: list[tuple[str, str]],
          mount_points: frozenset[str], skip_ids: frozenset[tuple[int, int]],
          admit_dir: Callable[[_Item, int], bool]) -> Iterator[tuple[int, list[_Item]]]:
    """Deterministic top-down walk over directory fds, pruning excluded paths, mount points and grant roots.

    Yields ``(dfd, nondirs)`` once per directory: its open fd (valid until
    the next iteration; it is only the *listing*: the caller opens every
    entry it reads by its path beneath the workspace Root, see
    :func:`_open_listed`, and may use ``dfd`` only to tell a vanished entry
    from a moved one) and its non-directory entries.  Subdirectories are
    offered to ``admit_dir(item, dfd)`` (the persist policy, which records
    them) in name order while their parent is listed, and the admitted ones
    are entered after the parent's non-directories, depth first: the order
    of :meth:`Root.walk`.

    A listing comes from a held directory fd, and a held fd can be moved
    out of the workspace at any time (with anything written into it
    afterwards), so nothing read through it is trusted: every directory
    after the top is opened by its path beneath the workspace Root's own
    fd (``src``: ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``, ``O_NOFOLLOW``)
    when it is entered, and ``fstat``-checked to be the very inode its
    listing's ``lstat`` saw, so a directory moved out, swapped for a
    symlink or for another directory (a grant root, a mount point) after
    the listing is never entered.  Every ``lstat`` of a listing is taken
    relative to the open directory, so a path longer than PATH_MAX is
    listed like any other (and refused by the policy before it is opened
    by path).  A directory that vanished before it was entered is skipped
    (like a vanished file); a swapped or moved one is
    :class:`SnapshotSourceChangedError`.

    Open fds: one per ancestor that still has a subdirectory to enter (a
    directory's fd is closed as soon as its last subdirectory is opened),
    so at most the depth, never the width of the tree.

    Raises:
        SnapshotSourceChangedError: a directory was replaced after its listing (retryable).
        OSError: a directory cannot be read (with its sandbox path, never a host path).
    """
    root_dev = ws.stat(".").st_dev
    frames: list[list[Any]] = []  # [dfd, admitted subdirectories, index of the next one]; each dfd owned here
    cur: tuple[int, str] | None = (ws.open_dir_fd("."), "")
    try:
        while True:
            if cur is not None:
                dfd, dpath = cur
                frames.append([dfd, (), 0])
                cur = None
                prefix = dpath + "/" if dpath else ""
                try:
                    listing = _list_dir(dfd)
                except OSError as exc:
                    _native.raise_errno(exc.errno or errno.EIO, "persist", dpath or ".")
                dirs = []
                nondirs = []
                for name, st in listing:
                    p = prefix + name
                    if excluded and _excluded(p, excluded):
                        skipped.append((p, "excluded"))
                        continue
                    isdir = _stat.S_ISDIR(st.st_mode)
                    if name.startswith(_IN_FLIGHT_PREFIXES):
                        skipped.append((p, "in-flight staging" if isdir else "in-flight atomic write"))
                        continue
                    if not dpath and name == WORKSPACE_ID_NAME:
                        continue  # the session's binding to this workspace, not workspace content
                    if not isdir:
                        nondirs.append(_Item(p, kind_of(st.st_mode), st, name))
                        continue
                    if st.st_dev != root_dev or p in mount_points:
                        skipped.append((p, "mount point"))
                        continue
                    if (st.st_dev, st.st_ino) in skip_ids:
                        skipped.append((p, "extra path grant"))
                        continue
                    item = _Item(p, "dir", st, name)
                    if admit_dir(item, dfd):
                        dirs.append(item)
                frames[-1][1] = dirs
                yield dfd, nondirs
            if not frames:
                return
            frame = frames[-1]
            dfd, dirs, i = frame
            if i >= len(dirs):
                frames.pop()
                os.close(dfd)
                continue
            frame[2] = i + 1
            item = dirs[i]
            cfd = _open_listed(src, item, _SUBDIR_FLAGS, dfd)  # by path beneath the Root, now
            if cfd is None:
                continue  # removed since the listing: skipped, like a vanished file
            cur = (cfd, item.path)
            if i + 1 >= len(dirs):  # its last subdirectory: the parent's fd is no longer needed
                frames.pop()
                os.close(dfd)
            _check_identity(cfd, item)
    finally:
        if cur is not None:
            os.close(cur[0])
        for frame in frames:
            os.close(frame[0])


_BLOCK_BYTES = tarfile.BLOCKSIZE  # 512: tar members and headers are padded to this
_RECORD_BYTES = tarfile.RECORDSIZE  # 10240: the archive is padded to this, as tarfile does
_ZEROS = bytes(_RECORD_BYTES)


# Not exactly 1 MiB: on ext4 (Linux 6.x, large folios) appending exactly 1 MiB
# at 1 MiB-aligned offsets stalled for 0.6-1 s in about half the runs (240 MiB
# archive; large-folio allocation), while 1 MiB - 512 never did.  A multiple of
# the tar block, so headers and padding still pack.
_WRITE_BUF_BYTES = (1 << 20) - _BLOCK_BYTES
_USTAR_MAX_NUMBER = 8 ** 11  # size and mtime fields: 11 octal digits


def _header(ti: tarfile.TarInfo) -> bytes:
    """The PAX-format header of ``ti``, as ``tobuf(PAX_FORMAT, "utf-8", "surrogateescape")`` builds it.

    When no PAX record is needed (ASCII name and link target of at most 100
    bytes, size and mtime within 11 octal digits), tarfile's PAX writer
    emits exactly its ustar header; asking for that directly skips its
    field-by-field PAX checks (about a sixth of the header's cost).  The
    bytes are the same (tests compare both).
    """
    if _ustar_fits(ti.name, ti.linkname, ti.size, ti.mtime):
        return ti.tobuf(tarfile.USTAR_FORMAT, "ascii", "strict")
    return ti.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


class _Writer:
    """The persist writer thread: writes filled buffers to the sink, in order.

    Double buffering: :class:`_TarWriter` fills one buffer while this thread
    writes the other to the sink (``os.write`` and the sink's ``zlib.crc32``
    of 1 MiB, both release the GIL, so they run on the second core while
    the caller walks, builds headers, reads and hashes files).  Buffers go
    round through two queues (filled -> written -> free again), and there
    are only two, so :meth:`swap` waits until the other one is written and
    memory stays two buffers however large the workspace.  (Moving the
    SHA-256 of file data here as well was measured: for every file it was
    slower, the many small per-file hash steps each needing the GIL; for
    files of 64 KiB and more only it gained nothing, this thread then
    being the slower one while large files stream.)

    The first error (ENOSPC ...) is kept and raised in the caller's thread
    by the next :meth:`swap` or :meth:`drain`; buffers after it are
    dropped, never written.  :meth:`stop` must be called on every path
    (persist does it in a ``finally``): it joins the thread before the
    caller closes the sink's fd, so no write can ever reach a reused fd.
    """

    def __init__(self, sink: "_HashingSink", spare: memoryview) -> None:
        self._sink = sink
        self._filled: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._free: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._free.put(spare)
        self._error: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="sfs-persist-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        filled, free, write = self._filled, self._free, self._sink.write
        while True:
            job = filled.get()
            if job is None:
                return
            buf, n = job
            try:
                if self._error is None:
                    write(buf[:n])
            except BaseException as exc:  # kept and raised in the caller's thread
                self._error = exc
            free.put(buf)

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def swap(self, buf: memoryview, n: int) -> memoryview:
        """Queue the first ``n`` bytes of ``buf`` for writing; return the other buffer once it is written.

        The caller must not touch ``buf`` until it is returned by a later swap.

        Raises:
            OSError: an earlier buffer failed to write (ENOSPC ...).
        """
        self._raise()
        self._filled.put((buf, n))
        other = self._free.get()
        self._raise()
        return other

    def write_now(self, data: bytes) -> None:
        """Write ``data`` after everything queued, and wait for it (a very long header; never in practice).

        Raises:
            OSError: writing failed.
        """
        spare = self._free.get()  # the buffer in flight is written
        self._filled.put((memoryview(data), len(data)))
        self._free.get()  # ``data`` is written
        self._free.put(spare)
        self._raise()

    def drain(self) -> None:
        """Wait until every queued buffer is written (the caller holds the other one).

        Raises:
            OSError: writing a buffer failed.
        """
        self._free.put(self._free.get())  # the spare comes back only once its write is done
        self._raise()

    def stop(self) -> None:
        """End the thread and join it (idempotent); nothing queued after an error is written."""
        if not self._stopped:
            self._stopped = True
            if self._error is None:
                self._error = SnapshotError("persist was abandoned", sandbox_path=None)
            self._filled.put(None)
        self._thread.join()


class _TarWriter:
    """Streams tar members through fixed buffers of ``_WRITE_BUF_BYTES`` (1 MiB - 512) bytes into a sink.

    Headers come from :meth:`tarfile.TarInfo.tobuf` (POSIX.1-2001 / PAX, UTF-8
    with ``surrogateescape``: the standard library owns the format); file
    data is read from the member's fd straight into the buffer with
    ``readv`` (no per-chunk ``bytes`` objects, no second copy) and
    SHA-256-hashed there for the fingerprint.  With a sink, there are two
    buffers and a :class:`_Writer` thread: while this thread walks, builds
    headers and reads files into one buffer, the writer writes the other
    to the sink (which CRC-32s and counts every byte).  So each file byte
    is read once, hashed once and written once, and memory stays two
    buffers however large the workspace.  The caller must :meth:`stop` the
    writer on every path (success or failure) before the sink's fd is closed.

    With ``sink=None`` nothing is written and there is no thread: files are
    only hashed, in place (:func:`tree_digest`).

    A member must match its header: a file that returns fewer bytes than
    the size in its header (it shrank) or more (it grew) while it is read
    raises :class:`SnapshotSourceChangedError` (retryable); the archive is
    then discarded by the caller, never committed.
    """

    def __init__(self, sink: "_HashingSink | None") -> None:
        self.sink = sink
        self.view = memoryview(bytearray(_WRITE_BUF_BYTES))
        self.pos = 0
        self.total = 0  # bytes handed to the sink so far
        self._writer: _Writer | None = None
        if sink is not None:
            self._writer = _Writer(sink, memoryview(bytearray(_WRITE_BUF_BYTES)))

    def flush(self) -> None:
        """Hand the buffered bytes to the writer thread and switch buffers.

        Raises:
            OSError: writing an earlier buffer to the sink failed (ENOSPC ...).
        """
        if self._writer is None:
            self.pos = 0
            return
        if not self.pos:
            return
        self.view = self._writer.swap(self.view, self.pos)  # returns once the other buffer is written
        self.total += self.pos
        self.pos = 0

    def _put(self, data: bytes) -> None:
        n = len(data)
        if self.pos + n > _WRITE_BUF_BYTES:
            self.flush()
            if n > _WRITE_BUF_BYTES:  # a very long PAX header; never in practice (PATH_MAX)
                assert self._writer is not None
                self._writer.write_now(data)
                self.total += n
                return
        self.view[self.pos:self.pos + n] = data
        self.pos += n

    def add(self, ti: tarfile.TarInfo, hdr: bytes | None = None) -> None:
        """Append a member header without data (directory, symlink, hard link); ``hdr``: its bytes, if built."""
        if self._writer is not None:
            self._put(hdr if hdr is not None else _header(ti))

    def add_file(self, ti: tarfile.TarInfo, fd: int, path: str, hdr: bytes | None = None) -> str:
        """Append a regular file's header and exactly ``ti.size`` bytes read from ``fd``, then padding.

        Args:
            ti: the member header; ``ti.size`` (bytes, from the caller's
                ``fstat``) is the exact length the data must have.
            fd: the member's fd, opened ``O_NOFOLLOW`` and identity-checked
                by the caller, positioned at offset 0.
            path: its sandbox path (for errors).

        Returns:
            The hex SHA-256 of the file's content.

        Raises:
            SnapshotSourceChangedError: the file shrank or grew while read.
            OSError: reading ``fd`` or writing the sink failed.
        """
        size = ti.size
        self.add(ti, hdr)
        sha = hashlib.sha256()
        threaded = self._writer is not None
        left = size
        while True:
            room = _WRITE_BUF_BYTES - self.pos
            if not room:
                self.flush()
                room = _WRITE_BUF_BYTES
            # Ask for one byte more than the header's size: getting it means the file grew.
            want = left + 1 if left < room else room
            pos = self.pos
            view = self.view
            got = os.readv(fd, [view[pos:pos + want]])
            if got > left:
                raise SnapshotSourceChangedError("file grew while it was being persisted (a tar member must "
                                                 "match its header)", sandbox_path=path)
            if not got:
                if left:
                    raise SnapshotSourceChangedError("file shrank while it was being persisted",
                                                     sandbox_path=path)
                break
            sha.update(view[pos:pos + got])
            left -= got
            if threaded:
                self.pos = pos + got
            if not left and got < want:
                break  # a short read of a regular file: end of file, exactly at the header's size
        pad = -size % _BLOCK_BYTES
        if pad and threaded:
            self._put(_ZEROS[:pad])
        return sha.hexdigest()

    def close(self) -> None:
        """End the archive as tarfile does (two zero blocks, zero-padded to a 10240-byte record), write it all.

        Waits until the writer thread has written everything.

        Raises:
            OSError: writing the sink failed.
        """
        assert self._writer is not None
        self._put(_ZEROS[:2 * _BLOCK_BYTES])
        pad = -(self.total + self.pos) % _RECORD_BYTES
        if pad:
            self._put(_ZEROS[:pad])
        self.flush()
        self._writer.drain()

    def stop(self) -> None:
        """Join the writer thread (idempotent; call on every path before the sink's fd is closed)."""
        if self._writer is not None:
            self._writer.stop()


class _Digest:
    def __init__(self) -> None:
        self.sha = hashlib.sha256()

    def add(self, path: str, kind: str, size: int, mode: int, content: str) -> None:
        rec = f"{path}\0{kind}\0{size}\0{mode:o}\0{content}\n"
        self.sha.update(rec.encode("utf-8", "surrogateescape"))

    def hexdigest(self) -> str:
        return self.sha.hexdigest()


def fingerprint(manifest_digest: str, tree_digest_hex: str) -> str:
    """The snapshot fingerprint: SHA-256 over a version tag, the manifest digest and the tree digest."""
    return hashlib.sha256(f"sfs-fp-v1\0{manifest_digest}\0{tree_digest_hex}".encode()).hexdigest()


def _open_member(src: Root, item: _Item, dfd: int | None = None) -> int | None:
    """Open a listed regular file for reading by its path beneath the workspace Root; None when it vanished.

    Opened through the source view (:func:`_open_listed`: from the Root's
    own fd, no symlink anywhere on the path, ``O_NOFOLLOW | O_NONBLOCK`` so
    a FIFO never blocks), never by its name relative to a held directory
    fd.  ``dfd`` (the walk's fd of the directory it was listed in, when
    held) only tells a vanished file from a moved one.  The caller
    ``fstat``-checks the fd (:func:`_member_stat`).

    Raises:
        SnapshotSourceChangedError: it is now a symlink or a special file,
            a parent was swapped or moved (retryable).
        OSError: any other failure (with its sandbox path).
    """
    return _open_listed(src, item, _MEMBER_FLAGS, dfd)


def _walk_target(link: bytes, target: str | bytes, alimits: Any) -> tuple[list[bytes], bytes]:
    """The extractor's lexical target walk: ``(paths passed through, final path)``."""
    res = symlink_walk(link, target, alimits, link)
    if isinstance(res, tuple):
        return res
    # older form: only the through-list; compute the final path the same way
    stack = link.split(b"/")[:-1]
    for comp in (c for c in os.fsencode(target).split(b"/") if c and c != b"."):
        if comp == b"..":
            stack.pop()
        else:
            stack.append(comp)
    return res, b"/".join(stack)


def _is_link(ws: Root, path: bytes) -> bool | None:
    """True/False for a symlink / something else at ``path``; None when missing or unreachable."""
    try:
        return _stat.S_ISLNK(ws.lstat(path or b".").st_mode)
    except (FileNotFoundError, NotADirectoryError, InvalidPathError):
        return None  # (InvalidPathError: a name no file can have, such as a component over 255 bytes)
    except SandboxError:
        return True  # reaching it needs a symlink the kernel refused: treat as a link


def _symlink_reason(ws: Root, link: bytes, target: str, alimits: Any) -> str | None:
    """Why hydrate would refuse this symlink (None: it restores), by the extractor's rules.

    Absolute or escaping targets raise from :func:`symlink_walk`; a target
    passing *through* another symlink is refused (CVE-2025-4517 chains);
    a chain of links that comes back on itself is a cycle, also refused.
    Up to 40 links are followed (the kernel's own bound, ELOOP).
    """
    through, final = _walk_target(link, target, alimits)
    for p in through:
        is_link = _is_link(ws, p)
        if is_link:
            return "symlink target passes through another symlink"
        if is_link is None:
            break
    seen = {link}
    cur = final
    for _ in range(40):
        if cur in seen:
            return "symlinks form a cycle"
        seen.add(cur)
        if not _is_link(ws, cur):
            return None
        try:
            nxt = ws.readlink(cur)
            _t, cur = _walk_target(cur, nxt, alimits)
        except FileNotFoundError:
            return None
        except (UnsafeArchiveMemberError, ArchiveLimitError):
            return None  # that link is refused on its own when the walk reaches it
    return "symlink chain is longer than 40 links"


def _policy_check(ws: Root, src: Root, item: _Item, on_unrestorable: str, skipped: list[tuple[str, str]],
                  alimits: Any, dfd: int | None = None) -> tuple[bool, str | None, os.stat_result | None]:
    """``(True, symlink target or None, lstat)`` when the item may be persisted; refuses or records it otherwise.

    The rules are the archive extractor's own (:func:`sandbox_fs.archive._names.normalize_member`
    and ``symlink_walk``), applied here so a saved snapshot always hydrates:
    names (zip slip, CVE-2007-4559; backslash ``..``, CVE-2021-37713; drive
    letters; over PATH_MAX), symlink targets (absolute, escaping, or passing
    through another symlink: CVE-2025-4517), and special files.  The name is
    checked first, so a path the Root could not even address is refused or
    skipped like any other unrestorable entry.

    What the snapshot records of a symlink (its target, its mtime) or a
    directory (mode, mtime), and what a refusal of a special file names,
    comes from the entry opened by its path beneath the workspace Root now
    (``src``, :func:`_readlink_listed`, :func:`_lstat_listed`) and checked to
    be the listed inode, never from the held listing directory ``dfd``
    alone (used only to tell a vanished entry from a moved one).  The
    returned ``lstat`` is that checked one (for a regular file, the
    listing's: the file is checked when it is opened).  An entry that
    vanished is ``(False, None, None)``, like a deleted file.

    Raises:
        UnrestorableEntryError: with ``on_unrestorable="refuse"``.
        SnapshotSourceChangedError: the entry changed type, or moved or
            vanished from under a parent while it was examined (retryable).
    """
    reason = None
    target = None
    st: os.stat_result | None = item.st
    raw = item.path.encode("utf-8", "surrogateescape")
    try:
        normalize_member(raw, alimits)
        if item.kind == "symlink":
            with _source_changed(item.path):
                got = _readlink_listed(src, item, dfd)
                if got is None:
                    return False, None, None  # removed since the listing, like a vanished file
                target, st = got
                reason = _symlink_reason(ws, raw, target, alimits)
        elif item.kind != "file":
            st = _lstat_listed(src, item, dfd)
            if st is None:
                return False, None, None
            if item.kind != "dir":
                reason = f"{item.kind} entries are not restorable"
    except UnsafeArchiveMemberError as exc:
        reason = {"symlink_target": "symlink is absolute or resolves outside the workspace"}.get(
            exc.rule, f"name is refused by hydrate ({exc.rule})")
    except ArchiveLimitError as exc:
        reason = f"path exceeds {exc.limit}"
    if reason is None:
        return True, target, st
    if on_unrestorable == "skip":
        skipped.append((item.path, reason))
        return False, None, None
    raise UnrestorableEntryError(f"{reason}; hydrate would refuse it, so persist refuses it too",
                                 sandbox_path=item.path, context={"kind": item.kind})


# errnos / codes of an entry changed under the walk: gone, no longer a symlink, a parent swapped
_CHANGED_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EINVAL, errno.ELOOP, errno.EXDEV, errno.ENXIO})
_CHANGED_CODES = frozenset({"path_escape", "symlink_refused", "special_file"})


@contextlib.contextmanager
def _source_changed(path: str) -> Iterator[None]:
    """Turn the errors of an entry changing under the walk into the retryable SnapshotSourceChangedError."""
    try:
        yield
    except (SnapshotError, UnsafeArchiveMemberError, ArchiveLimitError):
        raise
    except (OSError, SandboxError) as exc:
        if getattr(exc, "code", None) in _CHANGED_CODES or getattr(exc, "errno", None) in _CHANGED_ERRNOS:
            raise SnapshotSourceChangedError("entry changed while the workspace was being persisted",
                                             sandbox_path=path) from None
        raise


def tree_digest(ws: Root, *, excluded: Iterable[str] = (), mount_points: Iterable[str] = (),
                skip_identities: Iterable[tuple[int, int]] = (),
                on_unrestorable: Literal["refuse", "skip"] = "skip",
                limits: SnapshotLimits | None = None) -> str:
    """SHA-256 tree digest of the workspace, exactly as :func:`persist` would compute it.

    Blocking: call from a worker thread.

    Args:
        ws: the workspace Root.
        excluded: sandbox paths (relative) left out, with everything under them.
        mount_points: sandbox paths of mount points (also detected by ``st_dev``).
        skip_identities: ``(st_dev, st_ino)`` of directories never entered
            (extra path grants nested in the workspace).
        on_unrestorable: ``"skip"`` leaves unrestorable entries out of the
            digest (the default here: a digest is a comparison, not a save).
        limits: bound on entries and bytes hashed.

    Raises:
        UnrestorableEntryError: ``on_unrestorable="refuse"`` and such an entry exists.
        SnapshotLimitError: the tree exceeds ``limits``.
        SnapshotSourceChangedError: the tree changed under the walk (an
            entry replaced, a directory moved out while held; retryable).
    """
    digest = _Digest()
    _walk_into(ws, _norm_set(excluded), _norm_set(mount_points), on_unrestorable,
               limits or SnapshotLimits(), [], digest, None, None, frozenset(skip_identities))
    return digest.hexdigest()


def _walk_into(ws: Root, excluded: frozenset[str], mounts: frozenset[str], on_unrestorable: str,
               limits: SnapshotLimits, skipped: list[tuple[str, str]], digest: _Digest,
               tar: _TarWriter | None, progress: Callable[[int, int], None] | None,
               skip_ids: frozenset[tuple[int, int]] = frozenset(),
               fixups: list[tuple[str, int]] | None = None) -> tuple[int, int]:
    """Walk the workspace once and stream every kept entry into ``digest`` (and ``tar``).

    Ordinary entries stream as they are listed (O(1) memory).  Listings
    come from directory fds the walk holds (see :func:`_walk`), but every
    entry that is read (a file's content, a symlink's target, a
    subdirectory to list) and everything recorded of it is taken from the
    entry opened by its path beneath the workspace Root's own fd at that
    moment (:func:`_source_view`, ``RESOLVE_NO_SYMLINKS``) and ``fstat``-checked
    to be the listed inode, so a directory moved out of the workspace while
    the walk holds it contributes nothing (retryable
    :class:`SnapshotSourceChangedError`).  A regular file with more than one link is
    deferred until the walk has counted its names (only multi-linked
    inodes are remembered): it is archived only when every one of its
    links was seen inside the workspace walk (the first name as a file,
    the others as hard-link members); otherwise it is linked to a file
    outside the workspace (or to an excluded path) and its content is
    never read: refused, or skipped and reported.
    """
    policy = SnapshotPolicy(limits)
    writes = tar is not None
    files = tar if tar is not None else _TarWriter(None)
    with _source_view(ws) as src:
        state = _WalkState(src, policy, digest, files, writes, fixups, on_unrestorable, skipped)
        return _walk_entries(ws, src, state, excluded, mounts, on_unrestorable, skipped, policy.archive,
                             progress, skip_ids)


def _walk_entries(ws: Root, src: Root, state: "_WalkState", excluded: frozenset[str], mounts: frozenset[str],
                  on_unrestorable: str, skipped: list[tuple[str, str]], alimits: Any,
                  progress: Callable[[int, int], None] | None,
                  skip_ids: frozenset[tuple[int, int]]) -> tuple[int, int]:
    """The body of :func:`_walk_into`, with the source view ``src`` open."""
    digest, files, writes, fixups = state.digest, state.files, state.write, state.fixups
    multi: dict[tuple[int, int], _Linked] = {}  # (dev, ino) -> names seen, for st_nlink > 1 only
    last_report = time.monotonic()

    def admit_dir(item: _Item, dfd: int) -> bool:
        ok, _target, st = _policy_check(ws, src, item, on_unrestorable, skipped, alimits, dfd)
        if ok:
            assert st is not None  # checked by its path beneath the Root: mode and mtime are the workspace's
            mode = SnapshotPolicy.mode(st.st_mode)
            admitted, ti, hdr = state.header(item.path, tarfile.DIRTYPE, mode, st.st_mtime)
            if not admitted:
                return False
            state.count(item)
            digest.add(item.path, "dir", 0, mode, "")
            if fixups is not None and mode != _x_dir_mode(mode):
                fixups.append((item.path, mode))
            if writes:
                files.add(ti, hdr)
            return True
        return False

    with contextlib.closing(_walk(ws, src, excluded, skipped, mounts, skip_ids, admit_dir)) as walk:
        for dfd, nondirs in walk:
            for item in nondirs:
                ok, target, checked = _policy_check(ws, src, item, on_unrestorable, skipped, alimits, dfd)
                if not ok:
                    continue
                st = item.st
                if item.kind == "symlink":
                    assert target is not None and checked is not None
                    st = checked  # the symlink opened by its path and identity-checked
                    admitted, ti, hdr = state.header(item.path, tarfile.SYMTYPE, 0o777, st.st_mtime, link=target)
                    if not admitted:
                        continue
                    state.count(item)
                    digest.add(item.path, "symlink", 0, 0o777, target)
                    if writes:
                        files.add(ti, hdr)
                elif st.st_nlink > 1:
                    state.count(item)
                    key = (st.st_dev, st.st_ino)
                    linked = multi.get(key)
                    if linked is None:
                        multi[key] = _Linked(st.st_nlink, [item])
                    else:
                        linked.items.append(item)
                        if st.st_nlink != linked.nlink:
                            linked.changed = True
                else:
                    state.count(item)
                    fd = _open_member(src, item, dfd)
                    if fd is None:
                        state.entries -= 1
                        continue
                    try:
                        if state.add_file(item, fd, []) is None:
                            state.entries -= 1  # its header is refused by the policy and skipped
                    finally:
                        os.close(fd)
                if progress is not None:
                    now = time.monotonic()
                    if now - last_report >= 0.2:
                        last_report = now
                        progress(state.entries, state.content)
    for linked in multi.values():
        _add_linked(src, state, linked, on_unrestorable, skipped)
    if progress is not None:
        progress(state.entries, state.content)
    return state.entries, state.content


@dataclass
class _Linked:
    """The names of one multi-linked inode seen by the walk, with its link count at listing time."""

    nlink: int
    items: list[_Item]
    changed: bool = False


class _WalkState:
    """Counters and sinks shared by the streaming walk and the deferred hard-linked files."""

    def __init__(self, src: Root, policy: SnapshotPolicy, digest: _Digest, files: _TarWriter, write: bool,
                 fixups: list[tuple[str, int]] | None, on_unrestorable: str = "refuse",
                 skipped: list[tuple[str, str]] | None = None) -> None:
        self.src = src  # the source view: every entry is opened by its path beneath the workspace Root
        self.policy = policy
        self.limits = policy.limits
        self.headers = policy.header_check()
        self.on_unrestorable = on_unrestorable
        self.skipped = skipped if skipped is not None else []
        self.digest = digest
        self.files = files
        self.write = write
        self.fixups = fixups
        self.entries = 0
        self.content = 0

    def header(self, path: str, kind: bytes, mode: int, mtime: float, size: int = 0,
               link: str = "") -> tuple[bool, tarfile.TarInfo | None, bytes | None]:
        """``(admitted, TarInfo, header bytes)`` of one member, its header chain checked by the policy.

        The policy's :meth:`SnapshotPolicy.header_check` judges the exact
        bytes that will be written (and, for :func:`tree_digest`, the bytes
        persist would write, so both make the same decisions).  A member
        whose header fits ustar has no extension header and nothing to check;
        without a sink it is not even built (``(True, None, None)``).  A
        refused one is skipped and reported (``(False, None, None)``) with
        ``on_unrestorable="skip"``.

        Raises:
            UnrestorableEntryError: the header is refused and ``on_unrestorable="refuse"``.
        """
        name = path + "/" if kind == tarfile.DIRTYPE else path
        fits = _ustar_fits(name, link, size, int(mtime))
        if fits and not self.write:
            return True, None, None
        ti = _tarinfo(path, kind, mode, mtime)
        ti.size = size
        ti.linkname = link
        hdr = _header(ti)
        if not fits:
            why, cost = self.headers.check(hdr, path)
            if why is not None:
                if self.on_unrestorable == "skip":
                    self.skipped.append((path, why))
                    return False, None, None
                raise UnrestorableEntryError(f"{why}; hydrate would refuse it, so persist refuses it too",
                                             sandbox_path=path, context={"kind": _KIND_NAMES.get(kind, "file")})
            self.headers.admit(cost)
        return True, ti, hdr

    def count(self, item: _Item) -> None:
        self.entries += 1
        if self.entries > self.limits.max_entries:
            raise SnapshotLimitError("workspace has more entries than max_entries", sandbox_path=item.path,
                                     context={"max_entries": self.limits.max_entries})

    def add_file(self, item: _Item, fd: int, links: list[_Item]) -> os.stat_result | None:
        """Archive the file open on ``fd`` as ``item``, then ``links`` as hard links to it.

        Each name in ``links`` is looked up by its path beneath the workspace
        Root and checked to be this very inode before it is recorded.

        Returns:
            Its ``fstat``, or None when the policy refused its header and it
            was skipped (``links`` then too; the caller uncounts them).

        Raises:
            UnrestorableEntryError: the policy refuses its header (or a link's)
                and ``on_unrestorable="refuse"``.
            SnapshotSourceChangedError: the file or one of its links changed (retryable).
            SnapshotLimitError: a size limit is exceeded.
            OSError: reading the file or writing the sink failed.
        """
        limits = self.limits
        st = _member_stat(fd, item)
        for other in links:
            if _lstat_listed(self.src, other) is None:
                raise SnapshotSourceChangedError("hard links of this file changed while the workspace was "
                                                 "persisted", sandbox_path=other.path)
        mode = SnapshotPolicy.mode(st.st_mode)
        admitted, ti, hdr = self.header(item.path, tarfile.REGTYPE, mode, st.st_mtime, size=st.st_size)
        if not admitted:
            self.skipped.extend((other.path, "a hard link of a skipped file") for other in links)
            return None
        if st.st_size > limits.max_file_bytes:
            raise SnapshotLimitError("file is larger than max_file_bytes", sandbox_path=item.path,
                                     context={"max_file_bytes": limits.max_file_bytes})
        self.content += st.st_size
        if self.content > limits.max_total_bytes:
            raise SnapshotLimitError("workspace holds more than max_total_bytes", sandbox_path=item.path,
                                     context={"max_total_bytes": limits.max_total_bytes})
        if self.fixups is not None and mode != _x_file_mode(mode):
            self.fixups.append((item.path, mode))
        if ti is None:  # no sink: the digest needs no header
            ti = _tarinfo(item.path, tarfile.REGTYPE, mode, st.st_mtime)
            ti.size = st.st_size
        sha_hex = self.files.add_file(ti, fd, item.path, hdr)
        self.digest.add(item.path, "file", st.st_size, mode, sha_hex)
        for other in links:
            admitted, lti, lhdr = self.header(other.path, tarfile.LNKTYPE, mode, st.st_mtime, link=item.path)
            if not admitted:
                self.entries -= 1
                continue
            self.digest.add(other.path, "file", st.st_size, mode, sha_hex)
            if self.write:
                self.files.add(lti, lhdr)
        return st


def _add_linked(src: Root, state: _WalkState, linked: _Linked, on_unrestorable: str,
                skipped: list[tuple[str, str]]) -> None:
    """Archive one multi-linked inode if all its links are inside the walk, else refuse or skip it."""
    items = linked.items
    if linked.changed or len(items) > linked.nlink:
        raise SnapshotSourceChangedError("hard links of this file changed while the workspace was persisted",
                                         sandbox_path=items[0].path)
    if len(items) < linked.nlink:
        reason = (f"file has {linked.nlink} hard links but only {len(items)} in the persisted workspace "
                  "(linked to a file outside it or to an excluded path); its content is never read")
        if on_unrestorable == "skip":
            skipped.extend((it.path, reason) for it in items)
            state.entries -= len(items)
            return
        raise UnrestorableEntryError(reason, sandbox_path=items[0].path, context={"kind": "file"})
    for i, first in enumerate(items):
        fd = _open_member(src, first)
        if fd is None:
            state.entries -= 1  # removed since the listing: its other names still hold the inode
            continue
        try:
            st = os.fstat(fd)
            if st.st_nlink != linked.nlink:
                raise SnapshotSourceChangedError("hard links of this file changed while the workspace was "
                                                 "persisted", sandbox_path=first.path)
            if state.add_file(first, fd, items[i + 1:]) is None:
                state.entries -= len(items) - i  # refused by the policy and skipped, with all its names
        finally:
            os.close(fd)
        return


def _member_stat(fd: int, item: _Item) -> os.stat_result:
    """``fstat`` of a member just opened: still a regular file, and the very inode the walk listed.

    Raises:
        SnapshotSourceChangedError: it is no longer a regular file, or it is
            another file than the one the directory listing's ``lstat``
            saw (replaced between the listing and the open; retryable).
    """
    st = os.fstat(fd)
    if not _stat.S_ISREG(st.st_mode) or st.st_ino != item.st.st_ino or st.st_dev != item.st.st_dev:
        raise SnapshotSourceChangedError("entry was replaced while it was being persisted",
                                         sandbox_path=item.path)
    return st


_KIND_NAMES = {tarfile.DIRTYPE: "dir", tarfile.SYMTYPE: "symlink", tarfile.LNKTYPE: "file", tarfile.REGTYPE: "file"}


def _tarinfo(path: str, kind: bytes, mode: int, mtime: float) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(path + "/" if kind == tarfile.DIRTYPE else path)
    ti.type = kind
    ti.mode = mode
    ti.mtime = int(mtime)  # whole seconds: a float would force a PAX header on every member
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti


# ----------------------------------------------------------------- persist


def persist(ws: Root, store: SnapshotStore, name: str, *, manifest_digest: str = "",
            excluded: Iterable[str] = (), mount_points: Iterable[str] = (),
            skip_identities: Iterable[tuple[int, int]] = (),
            on_unrestorable: Literal["refuse", "skip"] = "refuse",
            limits: SnapshotLimits | None = None,
            progress: Callable[[int, int], None] | None = None) -> PersistReport:
    """Stream the workspace into ``store`` as snapshot ``name``.  Blocking: call from one worker thread.

    Uses one more thread of its own (the archive writer, see
    :class:`_Writer`), always joined before this returns or raises.

    Args:
        ws: the workspace Root (read through it only; never follows a symlink).
        store: the destination; :class:`NoSnapshot` makes this a no-op.
        name: snapshot name, a plain token (see :func:`validate_name`).
        manifest_digest: the manifest's digest, folded into the fingerprint.
        excluded: relative sandbox paths left out (ephemeral entries,
            registered persist skip paths); recorded in the metadata.
        mount_points: relative sandbox paths of mounts (also found by ``st_dev``).
        skip_identities: ``(st_dev, st_ino)`` of directories never entered
            (extra path grants nested in the workspace: grants are never persisted).
        on_unrestorable: ``"refuse"`` (default) raises on an entry hydrate
            would refuse; ``"skip"`` leaves it out and lists it in the report.
        limits: the same :class:`SnapshotLimits` hydrate will apply.
        progress: called with ``(entries, content_bytes)`` at most every 0.2 s.

    Returns:
        A :class:`PersistReport`; ``info`` is the committed snapshot.

    Raises:
        UnrestorableEntryError: an absolute/escaping symlink, FIFO, socket or
            device node, with ``on_unrestorable="refuse"``.
        SnapshotLimitError: the workspace exceeds ``limits``.
        SnapshotSourceChangedError: a file shrank, grew or was swapped
            (symlink, FIFO, another inode) while read, or an entry is no
            longer at its path beneath the workspace (a directory moved
            while the walk held it) (retryable).
        InvalidPathError: ``name`` is not a plain token.
        OSError: the store cannot be written (ENOSPC ...).  In every error
            case the previous snapshot of ``name`` stays current and intact.
    """
    validate_name(name)
    limits = limits or SnapshotLimits()
    excl = _norm_set(excluded)
    mounts = _norm_set(mount_points)
    skipped: list[tuple[str, str]] = []
    if not store.enabled:
        return PersistReport(None, skipped)
    pending = store.begin(name)
    try:
        digest = _Digest()
        fixups: list[tuple[str, int]] = []
        tar = _TarWriter(pending.sink)
        try:
            entries, content = _walk_into(ws, excl, mounts, on_unrestorable, limits, skipped,
                                          digest, tar, progress, frozenset(skip_identities), fixups)
            tar.close()
        finally:
            tar.stop()  # the writer thread is joined before the archive's fd can be closed
        SnapshotPolicy(limits).check_archive_bytes(pending.sink.count)  # hydrate would not read a larger one
        tree = digest.hexdigest()
        info = SnapshotInfo(
            name=name, archive=f"{name}.{secrets.token_hex(8)}.tar", archive_bytes=pending.sink.count,
            archive_crc32=pending.sink.hexdigest(), fingerprint=fingerprint(manifest_digest, tree),
            manifest_digest=manifest_digest, tree_digest=tree, excluded=sorted(excl), mode_fixups=fixups,
            entries=entries,
            content_bytes=content, created_ns=time.time_ns())
        committed = store.commit(pending, info)
        return PersistReport(committed if isinstance(committed, SnapshotInfo) else info, skipped)
    except BaseException:
        store.abort(pending)
        raise


# ------------------------------------------------------------------ hydrate


def is_mount_point_of(ws: Root, mount_points: Iterable[str] = ()) -> Callable[[os.stat_result], bool]:
    """A ``skip`` predicate for :meth:`Root.clear`: True for mount points.

    A mount point is a directory on another device than the root, or one of
    ``mount_points`` (sandbox paths; bind mounts of the same device), matched
    by ``(st_dev, st_ino)`` taken now.
    """
    dev = ws.stat(".").st_dev
    ids = set()
    for p in mount_points:
        try:
            st = ws.lstat(p)
        except (FileNotFoundError, NotADirectoryError):
            continue
        ids.add((st.st_dev, st.st_ino))
    return lambda st: st.st_dev != dev or (st.st_dev, st.st_ino) in ids


def hydrate(ws: Root, store: SnapshotStore, name: str, *, limits: SnapshotLimits | None = None,
            mount_points: Iterable[str] = (), keep_identities: Iterable[tuple[int, int]] = ()) -> HydrateReport:
    """Replace the workspace's contents with snapshot ``name``.  Blocking: call from one worker thread.

    Verify and stage first, then swap: the archive's size is checked, then
    it is extracted by :func:`sandbox_fs.archive.extract` (limits on, as for
    any untrusted archive) into a private staging directory inside the
    workspace (``.sfs-hydrate-<hex>``, mode 0700, never persisted nor
    fingerprinted; reached by name from ``ws`` in every step, never through
    an fd of its own), with the exact permission bits recorded at persist
    (applied by the extractor through the fd each entry is made or opened
    with, never by name: a name another process swaps for a hard link to a
    file outside is never changed).  Meanwhile one thread of its own (``sfs-hydrate-crc``,
    with a :class:`LocalSnapshotStore`) reads the same fd with ``pread`` and
    computes the archive's CRC-32 (both release the GIL: the second core),
    so the archive is not read twice in a row; the CRC-32 is compared with
    the metadata before anything in the workspace changes, and a corrupted
    archive that made the extractor fail is reported as corrupt too.  The
    thread is joined before this returns or raises.  (Other stores verify
    in ``open_archive``, first.)
    Only when all of that succeeded is the workspace cleared (never the
    root itself, never a mount point, never the staging directory) and the
    staged entries moved up (``renameat2(RENAME_NOREPLACE)`` through the
    Root; a directory kept by the clear because it holds a mount point is
    merged into).  Any failure before the swap (a member the extractor
    refuses, a limit, a full disk, an interrupt) removes only the staging
    directory: the previous contents are left exactly as they were.  A
    staging directory left by a killed process is ignored by persist and
    :func:`tree_digest` and removed by the next successful hydrate.

    Args:
        ws: the workspace Root (writable).  With ``ws.owner`` set, every
            restored entry (and the staging directory) is made with that
            owner, through its own fd; persist records no owners.
        store: where the snapshot lives.
        name: snapshot name.
        limits: :class:`SnapshotLimits` (entries, bytes, archive size).
        mount_points: sandbox paths of mounts kept by the clear (besides
            directories on another device, always kept).
        keep_identities: ``(st_dev, st_ino)`` of directories nested in the
            workspace that are not its own (read-only grants): kept by the
            clear, never entered, and never merged into; a snapshot with an
            entry where one is (or below it) is refused before anything in the
            workspace changes.

    Raises:
        SnapshotNotFoundError: no such snapshot.
        SnapshotCorruptError: the archive fails verification or is not a
            readable tar (the workspace is untouched).
        SnapshotLimitError: the archive is larger than ``max_archive_bytes``.
        ArchiveLimitError, UnsafeArchiveMemberError: the extractor refuses a
            member (a forged store: persist never writes such members); the
            workspace is untouched.
        SnapshotError: the staging directory was replaced by another
            process before the swap, or the snapshot has an entry where a
            kept directory of ``keep_identities`` is (the workspace is
            untouched); a staged
            entry cannot be moved over a kept mount point (after the clear;
            rare).
        OSError: the extraction failed on the filesystem (a full disk, a
            staged directory moved away by another process: ENOENT); the
            workspace is untouched.
    """
    limits = limits or SnapshotLimits()
    if isinstance(store, LocalSnapshotStore):
        f, info = store.open_archive_unverified(name, limits)  # size checked; CRC-32 checked below
    else:
        f, info = store.open_archive(name, limits)  # verified by the store
    with f:
        check = _CrcCheck(f.fileno(), info.archive_bytes) if isinstance(store, LocalSnapshotStore) else None
        keep = frozenset(keep_identities)
        # With kept directories (read-only grants), every write of the restore checks its fds
        # against them: a name swapped for one meanwhile is refused or kept, never entered,
        # emptied, chmod'ed or merged into.
        target = ws.with_options(deny_write_ids=keep) if keep else contextlib.nullcontext(ws)
        try:
            with target as guarded:
                _hydrate_staged(guarded, f, info, limits, mount_points, check, keep)
        finally:
            if check is not None:
                check.stop()  # joined before the archive's fd is closed
    return HydrateReport(info, "archive")


def _hydrate_staged(ws: Root, f: IO[bytes], info: SnapshotInfo, limits: SnapshotLimits,
                    mount_points: Iterable[str], check: _CrcCheck | None,
                    keep_ids: frozenset[tuple[int, int]] = frozenset()) -> None:
    """Extract into a staging directory, verify (``check``), then swap it in (see :func:`hydrate`)."""
    # The staging directory is reached by its name only (never through an fd of its own),
    # from the workspace fd, in every step: the extractor stages beside it and renames its
    # tree to this name (applying the exact recorded modes through the fds it makes the
    # entries with), and the clear keeps and the moves read whatever is at that name,
    # checked to be the directory the extractor made.  So a process that swaps it can
    # change only what is moved in, never where anything goes.
    staging = f"{_HYDRATE_PREFIX}{secrets.token_hex(8)}"
    made: list[tuple[int, int]] = []  # the identity of the directory the extractor made at ``staging``
    exact = {p.encode("utf-8", "surrogateescape"): SnapshotPolicy.mode(m) for p, m in info.mode_fixups}
    try:
        try:
            _extract_with_archive(ws, staging, f, limits, info.archive_bytes, made, exact)
            sid = made[0]
            sub = Subtree(ws, staging, sid)
            sub.chmod(".", 0o700)  # the extractor made it 0755, as for any new destination
        except Exception as exc:
            # A corrupted archive may fail extraction in any way: report it as what it is.
            # (An interrupt does not wait for the check.)
            if check is not None:
                try:
                    check.verify(info)
                except SnapshotCorruptError as corrupt:
                    raise corrupt from exc
            raise
        if check is not None:
            check.verify(info)  # before anything in the workspace changes
        st = ws.lstat(staging)
        if (st.st_dev, st.st_ino) != sid:
            raise SnapshotError("the restore's staging directory was replaced during the restore; "
                                "the workspace is unchanged", sandbox_path=staging)
        is_mount = is_mount_point_of(ws, mount_points)
        if keep_ids:
            _refuse_entries_over_kept(ws, sub, keep_ids, sid, is_mount)
        # Before anything in the workspace changes, make every staged top-level directory
        # movable (renaming a directory rewrites its ".." entry: its owner needs write
        # permission on it); its recorded mode is set again once it is in place.  So no
        # step that can fail for lack of permission comes after the clear.
        modes: dict[str, int] = {}
        for entry in sub.listdir("."):
            est = sub.lstat(entry)
            if _stat.S_ISDIR(est.st_mode) and est.st_mode & 0o700 != 0o700:
                modes[entry] = _stat.S_IMODE(est.st_mode) & 0o777
                ws.set_dir_meta(f"{staging}/{entry}", mode=modes[entry] | 0o700)
        keep = lambda st: (st.st_dev, st.st_ino) in keep_ids or (st.st_dev, st.st_ino) == sid \
            or is_mount(st)  # noqa: E731
        ws.clear(skip=keep, make_writable=True, keep_denied=True)  # a non-root owner empties its read-only dirs
        for entry in sub.listdir("."):
            _move_up(ws, f"{staging}/{entry}", entry, is_mount, modes.get(entry), keep_ids)
    finally:
        # On a failure before the swap this is all that changes; after the swap it is empty.
        # Only the directory the extractor made (checked by identity) is removed, never
        # whatever another process put at its name.  Best effort: a leftover is never
        # persisted and goes with the next hydrate's clear.
        if made:
            with contextlib.suppress(OSError, SandboxError):
                Subtree(ws, staging, made[0]).remove_tree()


_HYDRATE_PREFIX = ".sfs-hydrate-"


def _refuse_entries_over_kept(ws: Root, sub: Subtree, keep_ids: frozenset[tuple[int, int]],
                              sid: tuple[int, int], is_mount: Callable[[os.stat_result], bool]) -> None:
    """Refuse (before the clear) a snapshot with an entry where a kept directory of ``keep_ids`` is.

    Finds the kept directories by identity with one fd walk of the workspace
    (not entering them, nor the staging directory), then looks each path and
    its ancestors up in the staging tree: an entry at a kept path, or a
    non-directory at one of its ancestors, would have to replace or merge into
    it.

    Raises:
        SnapshotError: such an entry (nothing in the workspace changed).
    """
    kept: list[str] = []
    try:
        for dirpath, dents, _nondirs in ws._walk_dirs("."):
            for ent in list(dents):  # lstat taken relative to the listed directory's fd
                ident = (ent.stat.st_dev, ent.stat.st_ino)
                if ident in keep_ids or ident == sid or is_mount(ent.stat):  # is_mount: another device too
                    dents.remove(ent)  # never entered: kept, the staging directory, a mount
                    if ident in keep_ids:
                        kept.append(ent.path)
    except (FileNotFoundError, NotADirectoryError):
        raise SnapshotSourceChangedError("the workspace changed while the restore looked for its read-only grants; "
                                         "nothing was changed", sandbox_path=None) from None
    for path in kept:
        parts = path.split("/")
        for i in range(1, len(parts) + 1):
            pre = "/".join(parts[:i])
            try:
                st = sub.lstat(pre)
            except (FileNotFoundError, NotADirectoryError, InvalidPathError):
                break  # (longer than any staged path can be: nothing there)
            if i == len(parts) or not _stat.S_ISDIR(st.st_mode):
                raise SnapshotError("the snapshot has an entry where a read-only grant nested in the workspace is; "
                                    "nothing was changed", sandbox_path=pre)


def _move_up(ws: Root, src: str, dst: str, is_mount: Callable[[os.stat_result], bool],
             final_mode: int | None = None, keep_ids: frozenset[tuple[int, int]] = frozenset()) -> None:
    """Move staged ``src`` to ``dst`` without replacing anything; merge into a kept directory.

    ``final_mode``: the recorded mode of a top-level directory that hydrate
    made movable before the clear, set once it is in place.  Directory modes
    are changed through the directory's own fd (:meth:`Root.set_dir_meta`),
    never by name.
    """
    sst = ws.lstat(src)
    if final_mode is not None:
        pass  # already movable
    elif _stat.S_ISDIR(sst.st_mode) and not sst.st_mode & _stat.S_IWUSR:
        final_mode = _stat.S_IMODE(sst.st_mode) & 0o777
        ws.set_dir_meta(src, mode=final_mode | 0o700)  # renaming a dir rewrites its ".."
    try:
        ws.rename(src, dst, no_replace=True)
    except FileExistsError:
        dst_st = ws.lstat(dst)
        if (dst_st.st_dev, dst_st.st_ino) in keep_ids:
            raise SnapshotError("a snapshot entry would merge into a read-only grant", sandbox_path=dst)
        if not (_stat.S_ISDIR(sst.st_mode) and _stat.S_ISDIR(dst_st.st_mode)):
            raise SnapshotError("a snapshot entry collides with an entry the restore must keep (a mount point?)",
                                sandbox_path=dst) from None
        for entry in ws.listdir(src):
            _move_up(ws, f"{src}/{entry}", f"{dst}/{entry}", is_mount, None, keep_ids)
        if not is_mount(dst_st):
            ws.set_dir_meta(dst, mode=final_mode if final_mode is not None else _stat.S_IMODE(sst.st_mode) & 0o777)
        return
    if final_mode is not None:
        ws.set_dir_meta(dst, mode=final_mode)


def _archive_limits(limits: SnapshotLimits, archive_bytes: int | None = None) -> ArchiveLimits:
    """The extractor's limits for a snapshot (:meth:`SnapshotPolicy.archive_limits`)."""
    return SnapshotPolicy(limits).archive_limits(archive_bytes)


def _extract_with_archive(ws: Root, dest: str, f: IO[bytes], limits: SnapshotLimits,
                          archive_bytes: int, made: list[tuple[int, int]], exact: dict[bytes, int]) -> None:
    # ``dest`` is hydrate's staging name, not yet existing: the extractor stages in a sibling
    # directory (reached by name from ``ws``) and renames it to ``dest`` when complete.
    # Its input is bounded by the validated archive size, not by the file's current end
    # (a store file grown after the size check): reading more is a limit error, reported
    # by hydrate as a corrupt archive once the CRC-32 check (also bounded) disagrees.
    rules = SnapshotPolicy(limits)
    try:
        _archive_extract(ws, dest, f, "tar", rules.archive_limits(archive_bytes), rules.extract_policy(), None,
                         made, exact)
    except ArchiveFormatError as exc:
        raise SnapshotCorruptError("snapshot archive is not a readable tar", sandbox_path=None,
                                   diagnostic=str(exc)) from None
    # ``made`` now holds the identity of the directory the extractor made and moved to ``dest``


