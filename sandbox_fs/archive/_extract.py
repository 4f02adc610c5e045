"""``extract`` and ``extract_async``: the public entry points."""

from __future__ import annotations

import io
import os
import stat
import threading
from typing import TYPE_CHECKING, Any, BinaryIO, Callable

if TYPE_CHECKING:
    import trio

from ..root import Root, open_host_file_fd
from ._errors import ArchiveFormatError, ArchiveLimitError, UnsafeArchiveMemberError
from ._models import ArchiveLimits, ExtractPolicy, ExtractReport
from ._streams import InputCounter, Meter, decompressor, detect, sniff
from ._tar import extract_tar
from ._writer import Extractor
from ._zip import extract_zip

__all__ = ["extract", "extract_async", "FORMATS"]

#: Accepted ``format`` values and the compression each forces (None: detect).
FORMATS: dict[str, str | None] = {
    "auto": None, "tar": None, "tar.gz": "gz", "tgz": "gz", "tar.bz2": "bz2", "tbz2": "bz2",
    "tar.xz": "xz", "txz": "xz", "zip": "zip",
}
_NAMES = {"tar": "tar", "gz": "tar.gz", "bz2": "tar.bz2", "xz": "tar.xz", "zip": "zip", "zst": "tar.zst"}

_DEFAULT_LIMITS = ArchiveLimits()
_DEFAULT_POLICY = ExtractPolicy()


def extract(root: Root, dest: str, source: BinaryIO | str | os.PathLike, *, format: str = "auto",
            limits: ArchiveLimits = _DEFAULT_LIMITS, policy: ExtractPolicy = _DEFAULT_POLICY) -> ExtractReport:
    """Extract a tar or zip archive into ``dest`` beneath ``root``, bounded and race-free.

    Every node is created through a ``Root`` that refuses symlinks on every
    path (``RESOLVE_NO_SYMLINKS``), so no member can be written through a
    symlink, whatever came earlier; symlink members are created last and only
    when their target stays beneath the destination without passing through
    another symlink.  See :mod:`sandbox_fs.archive` for the full rule list.

    Atomic by default: members go to a private staging directory (next to a
    missing destination, or inside an existing one as
    ``.sfs-extract-<random>``) and are moved into place only when all of
    them were extracted; on any failure nothing new remains.  Pre-existing
    files of an existing destination are kept, except that a member with the
    same name replaces a pre-existing file or symlink (a directory is merged
    into a pre-existing directory; type conflicts are refused before anything
    moves).  ``ExtractPolicy(in_place=True)`` writes directly (faster, not
    atomic).  The archive itself is never copied into the workspace.

    Ownership: with ``root.owner`` set, every entry the extraction makes
    (the staging directory included) is given that owner through its own fd
    (see :class:`~sandbox_fs.root.Root`), and ``policy.preserve_owner`` is
    ignored: the Root's owner wins.

    Args:
        root: the workspace capability.
        dest: sandbox path of the destination relative to ``root``; ``""`` or
            ``"."`` is the root itself.  Its parent must exist; ``dest`` must
            not involve a symlink.
        source: a readable binary stream (tar: read once, forward only; zip:
            must be seekable) or a host path (``str``/``os.PathLike``, trusted,
            from the host application) that is opened and closed here by the
            host-path rule (:func:`sandbox_fs.root.open_host_file_fd`: no symlink
            on any component, a regular file; else ``SymlinkRefusedError`` or
            ``SpecialFileError``).
        format: ``"auto"`` (from the magic bytes), ``"tar"`` (any
            compression, detected), ``"tar.gz"``/``"tgz"``, ``"tar.bz2"``,
            ``"tar.xz"``, or ``"zip"``.  zstd is not supported (no zstd library
            is a dependency).
        limits: resource bounds, checked while streaming (see :class:`ArchiveLimits`).
        policy: what to do with links and special files (see :class:`ExtractPolicy`).

    Returns:
        An :class:`ExtractReport` with counts, bytes written and skipped members.

    Raises:
        ArchiveLimitError: a limit was reached (``limit``, ``allowed``,
            ``observed``, ``member``).
        UnsafeArchiveMemberError: a member breaks a rule (``rule``, ``member``);
            ``conflict`` also when another process replaced the staging
            directory during the extraction (nothing new remains).
        ArchiveFormatError: unreadable, corrupt, or of another format than asked.
        PathEscapeError, SymlinkRefusedError: ``dest`` escapes ``root`` or
            involves a symlink.
        FileNotFoundError: ``dest``'s parent, or the host path ``source``, is
            missing; a directory made for earlier members was moved away by
            another process during the extraction (nothing is made elsewhere).
        ValueError: ``format`` is not one of the accepted values.
    """
    return run_extraction(root, dest, source, format, limits, policy, None)


def run_extraction(root: Root, dest: str, source: Any, format: str, limits: ArchiveLimits, policy: ExtractPolicy,
             check_cancel: Callable[[], None] | None, made: list[tuple[int, int]] | None = None,
             exact_modes: dict[bytes, int] | None = None, batch_in_memory: bool = False) -> ExtractReport:
    """:func:`extract`; with ``made``, the ``(st_dev, st_ino)`` of the directory made for a new
    destination (atomic mode), as checked when it was moved into place, is appended to it;
    ``exact_modes``: see :class:`~sandbox_fs.archive._writer.Extractor` (snapshot hydrate);
    ``batch_in_memory``: new files read from a stream are queued with their bytes (snapshot hydrate,
    see ``_batching.add_new_file_data``)."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {sorted(FORMATS)}, not {format!r}")
    if isinstance(source, (str, os.PathLike)):
        # a trusted host path given by the host application, opened by the host-path rule (no
        # symlink on any component, a regular file); unbuffered, so the fd offset is the stream
        # position and plain tar member data can be sendfile'd
        with open(open_host_file_fd(source, label="archive"), "rb", buffering=0) as fh:
            return run_extraction(root, dest, fh, format, limits, policy, check_cancel, made, exact_modes,
                                  batch_in_memory)
    meter = Meter(limits)
    forced = FORMATS[format]
    if forced == "zip":
        kind = "zip"
        head = b""
        raw = None
    else:
        raw = InputCounter(source, meter)
        head = sniff(raw)
        kind = detect(head)
        if not head:
            raise ArchiveFormatError("the archive is empty")
        if forced is not None and kind != forced:
            raise ArchiveFormatError(f"format {format!r} was asked but the data looks like {_NAMES.get(kind, kind)}")
        if format == "tar" and kind == "zip":
            raise ArchiveFormatError("format 'tar' was asked but the data is a zip archive")
    if kind == "zip" and raw is not None:
        # zip needs random access: rewind the caller's seekable stream.
        seekable = getattr(source, "seekable", None)
        if seekable is None or not seekable():
            raise ArchiveFormatError("zip archives need a seekable source (a regular file)")
        source.seek(source.tell() - len(head))
        meter.input_bytes = 0
    if kind != "zip":
        assert raw is not None
        stream = decompressor(kind, InputCounter(source, meter, prefix=head))
        meter.input_bytes = len(head)
    ex = Extractor(root, dest, limits, policy, meter, exact_modes)
    ex.check_cancel = check_cancel
    ex.batch_in_memory = batch_in_memory
    try:
        if kind == "zip":
            extract_zip(source, ex, limits, meter, check_cancel)
        else:
            extract_tar(stream, ex, limits, meter, check_cancel, _splice_fd(source) if kind == "tar" else -1)
        if check_cancel is not None:
            check_cancel()
        ex.finish()
    except BaseException as exc:
        # a queued file before this member failed: that error comes first (not for a cancellation)
        earlier = ex.pending_error(run_queued=isinstance(exc, Exception))
        ex.abort()
        if earlier is not None and isinstance(exc, Exception):
            exc = earlier
        if isinstance(exc, (ArchiveFormatError, ArchiveLimitError, UnsafeArchiveMemberError)) and \
                exc.sandbox_path is None:
            exc.sandbox_path = ex.shown_dest  # the destination (a sandbox path) for the error line
        if exc is not earlier:
            raise
        raise exc from None
    finally:
        if made is not None and ex.made_identity is not None:
            made.append(ex.made_identity)  # even when interrupted after the move: the caller owns it now
        ex.close()
    return ExtractReport(format=_NAMES.get(kind, kind), members=ex.members, files=ex.files, dirs=ex.dirs,
                         symlinks=ex.symlinks, hardlinks=ex.hardlinks, bytes_written=meter.written_bytes,
                         input_bytes=meter.input_bytes, skipped=ex.skipped,
                         skipped_count=ex.skipped_count)


def _splice_fd(source: Any) -> int:
    """The source's fd when kernel-side copies are exact: an unbuffered regular file (``io.FileIO``)."""
    if not isinstance(source, io.FileIO):
        return -1
    try:
        fd = source.fileno()
        return fd if stat.S_ISREG(os.fstat(fd).st_mode) else -1
    except (OSError, ValueError):
        return -1


# trio is imported on the first async call: it costs ~150 ms of start-up that a synchronous
# extraction (the CLI, a host without trio) never needs.
_LIMITER: "trio.lowlevel.RunVar[trio.CapacityLimiter] | None" = None
_LIMITER_LOCK = threading.Lock()


def default_limiter() -> trio.CapacityLimiter:
    """The archive module's own ``CapacityLimiter`` for this trio run (2 concurrent extractions)."""
    global _LIMITER
    import trio

    with _LIMITER_LOCK:
        if _LIMITER is None:
            _LIMITER = trio.lowlevel.RunVar("sandbox_fs_archive_limiter")
        var = _LIMITER
    try:
        return var.get()
    except LookupError:
        lim = trio.CapacityLimiter(2)
        var.set(lim)
        return lim


async def extract_async(root: Root, dest: str, source: BinaryIO | str | os.PathLike, *, format: str = "auto",
                        limits: ArchiveLimits = _DEFAULT_LIMITS, policy: ExtractPolicy = _DEFAULT_POLICY,
                        limiter: trio.CapacityLimiter | None = None) -> ExtractReport:
    """Run :func:`extract` in one worker thread (one hop per archive, never per member).

    An uncompressed tar from a host path may use one more helper thread of
    its own for batches of new files (see :mod:`sandbox_fs.archive`); it is
    joined before this returns.

    Args:
        root, dest, source, format, limits, policy: as for :func:`extract`.
        limiter: the ``trio.CapacityLimiter`` bounding concurrent extractions;
            None uses this module's own limiter (2 at a time per trio run).

    Returns:
        The :class:`ExtractReport`.

    Raises:
        The same errors as :func:`extract`, and ``trio.Cancelled``.

    Cancellation:
        This function is always a checkpoint.  A cancel is noticed between
        members (``trio.from_thread.check_cancelled``): the worker stops,
        waits for the batch of new files in flight, if any (at most 64
        files / 8 MiB, see :mod:`sandbox_fs.archive`), removes the partly
        written member and, in atomic mode, the whole staging tree, so
        nothing new remains in the destination; then
        ``Cancelled`` propagates.  In in-place mode the members completed
        before the cancel remain.  The thread is never abandoned: the call
        returns only once the worker has cleaned up.
    """
    import trio

    lim = limiter if limiter is not None else default_limiter()
    return await trio.to_thread.run_sync(
        run_extraction, root, dest, source, format, limits, policy, trio.from_thread.check_cancelled,
        limiter=lim, abandon_on_cancel=False)
