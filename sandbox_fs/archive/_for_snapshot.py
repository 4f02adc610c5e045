"""The internal API archive offers :mod:`sandbox_fs.snapshot`: the extractor's rules and engine, by name.

Snapshot persist applies the extractor's own rules to what it is about to
write (so whatever persist commits, hydrate restores), and hydrate extracts
through the extractor with two things a public caller never needs: the
identity of the directory made for the destination, and exact modes.  This
module is that contract; :mod:`sandbox_fs.archive` re-exports its names
(not in its ``__all__``: they are internal, not public API).  Every function
takes keyword arguments only.  Snapshot imports them from
``sandbox_fs.archive``, never from a private module of it.

Names:

* :func:`extract_stream`: extract an uncompressed tar into a new destination.
* :func:`extract_streams`: extract several uncompressed tars, in order, into
  one new destination in one staged pass, taking only the members a filter
  selects (a snapshot's base and layers).
* :func:`normalize_member_name`: the member-name rule.
* :func:`symlink_target_walk`: the lexical symlink-target rule.
* :class:`HeaderChainCheck`: the header-chain rules (size, count, PAX bodies
  and their CVE-2024-6232 digit budget) applied to headers being written.
* :func:`extracted_file_mode`, :func:`extracted_dir_mode`: the modes the
  extractor gives entries without an exact mode.
* :data:`STAGED_PATH_MAX`: the longest member path an atomic extraction stages.
* :func:`mtime_is_applied`: whether the extractor applies a member's mtime
  (outside its range it leaves the time of extraction).
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
from typing import Any, Callable, Sequence

from ..root import Root
from ._errors import ArchiveFormatError
from ._errors import ArchiveLimitError, UnsafeArchiveMemberError
from ._extract import run_extraction
from ._streams import InputCounter, Meter
from ._tar import extract_tar
from ._writer import Extractor
from ._models import ArchiveLimits, ExtractPolicy, ExtractReport
from ._names import normalize_member, symlink_walk
from ._tar import EXT_TYPES, MAX_HEADER_CHAIN, PaxBudget, check_pax_body
from ._writer import STAGED_PATH_MAX, dir_mode, file_mode
from ._meta import mtime_ns_of

__all__ = [
    "extract_stream",
    "extract_streams",
    "normalize_member_name",
    "symlink_target_walk",
    "HeaderChainCheck",
    "extracted_file_mode",
    "extracted_dir_mode",
    "STAGED_PATH_MAX",
    "mtime_is_applied",
]


def mtime_is_applied(*, mtime: int) -> bool:
    """True when the extractor sets a member's mtime of ``mtime`` whole seconds since the epoch.

    The extractor applies mtimes strictly within +-2**62 ns of the epoch
    (about 1824 to 2116: nanoseconds that fit the native batch's signed
    64-bit field with room to spare); outside that range the member keeps
    the time it was extracted at.
    """
    return mtime_ns_of(mtime) is not None

_BLOCK_BYTES = tarfile.BLOCKSIZE
_PAX_TYPES = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE)


def extract_stream(*, root: Root, dest: str, source: Any, limits: ArchiveLimits, policy: ExtractPolicy,
                   made: list[tuple[int, int]] | None = None,
                   exact_modes: dict[bytes, int] | None = None) -> ExtractReport:
    """Extract the tar read from ``source`` into ``dest`` beneath ``root``: :func:`~sandbox_fs.archive.extract`
    with ``format="tar"`` and two additions.

    Args:
        root: the destination's capability.
        dest: sandbox path of the destination relative to ``root``.
        source: a readable binary stream, read once, forward only (an
            unbuffered ``io.FileIO`` of a regular file lets member data be
            copied kernel-side; from any other stream, new files of up to
            1 MiB are queued with their bytes, read once, and made by the
            native batches in a helper thread).
        limits: the bounds, as for :func:`~sandbox_fs.archive.extract`.
        policy: the choices, as for :func:`~sandbox_fs.archive.extract`.
        made: when given, the ``(st_dev, st_ino)`` of the directory made for
            a new destination (atomic mode), as checked when it was moved into
            place, is appended to it -- also when the extraction then fails
            or is interrupted: the caller owns that directory from then on.
        exact_modes: normalized member path (bytes) -> permission bits
            (within 0o777) applied exactly instead of
            :func:`extracted_file_mode` / :func:`extracted_dir_mode`, through
            the fd the entry was made or opened with, never by name.

    Returns:
        The :class:`~sandbox_fs.archive.ExtractReport`.

    Raises:
        The errors of :func:`~sandbox_fs.archive.extract`.
    """
    return run_extraction(root, dest, source, "tar", limits, policy, check_cancel=None, made=made,
                          exact_modes=exact_modes, batch_in_memory=True)


def normalize_member_name(*, name: str | bytes, limits: ArchiveLimits) -> bytes:
    """The normalized relative path the extractor gives member ``name``, or its refusal.

    Args:
        name: the member name (``str``, surrogate-escaped, or ``bytes``).
        limits: supplies ``max_path_bytes`` and ``max_depth``.

    Returns:
        Components joined by ``/``, without ``.`` or empty ones; ``b""`` for
        the destination itself.

    Raises:
        UnsafeArchiveMemberError: absolute, drive letter, ``..``, NUL, a
            component over 255 bytes (``rule`` says which).
        ArchiveLimitError: ``max_path_bytes`` or ``max_depth``.
    """
    return normalize_member(name, limits)


def symlink_target_walk(*, link: bytes, target: str | bytes, limits: ArchiveLimits,
                        member: str | bytes | None = None) -> tuple[list[bytes], bytes]:
    """The extractor's lexical check of a symlink target, and the paths it traverses.

    Args:
        link: normalized path of the link (relative to the destination).
        target: the link's target.
        limits: supplies ``max_path_bytes`` and ``max_depth``.
        member: the name shown in errors (default: ``link``).

    Returns:
        ``(through, final)``: the normalized paths of every directory the
        target passes through after its leading ``..`` (none of them may be a
        symlink for the target to be accepted), and the path it names
        (``b""``: the destination itself).

    Raises:
        UnsafeArchiveMemberError: rule ``symlink_target`` (absolute, ``..``
            after a name, or above the destination).
        ArchiveLimitError: ``max_path_bytes`` or ``max_depth``.
    """
    return symlink_walk(link, target, limits, link if member is None else member)


def extracted_file_mode(*, mode: int | None) -> int:
    """The permission bits the extractor gives a regular file whose archive mode is ``mode`` (None: none)."""
    return file_mode(mode)


def extracted_dir_mode(*, mode: int | None) -> int:
    """The permission bits the extractor gives a directory whose archive mode is ``mode`` (None: none)."""
    return dir_mode(mode)


class HeaderChainCheck:
    """The extractor's header rules, applied to the header chains of one archive being written.

    A member's header chain is its extension headers (PAX ``x``/``g``/``X``,
    GNU long name/link ``L``/``K``) followed by its own header.  The
    extractor refuses a chain with ``MAX_HEADER_CHAIN`` extension headers or
    more, an extension header larger than ``limits.max_header_bytes``, a PAX
    body that does not parse, or PAX digit runs past the CVE-2024-6232
    budget (per header and per archive, the same :class:`PaxBudget` the
    extractor charges).  One instance per archive: its budget accumulates
    over :meth:`admit`.

    Args:
        limits: the :class:`ArchiveLimits` the archive will be extracted with
            (keyword only).
    """

    def __init__(self, *, limits: ArchiveLimits) -> None:
        self._max_header = limits.max_header_bytes
        self.budget = PaxBudget()

    def check(self, *, header: bytes, member: str) -> tuple[str | None, int]:
        """Judge one member's header chain as it will be written; admits nothing.

        Args:
            header: the chain's bytes (extension headers and their bodies,
                then the member's own 512-byte header).
            member: the member's name, for errors.

        Returns:
            ``(why the extractor would refuse it, or None; its PAX digit cost)``.
            The cost is counted against the archive only by :meth:`admit`.
        """
        pos = 0
        cost = 0
        chain = 0
        while pos + _BLOCK_BYTES <= len(header):
            block = header[pos:pos + _BLOCK_BYTES]
            kind = block[156:157]
            if kind not in EXT_TYPES:
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
            padded = size + (-size % _BLOCK_BYTES)
            if kind in _PAX_TYPES:
                why, one = self._pax_refusal(header[pos + _BLOCK_BYTES:pos + _BLOCK_BYTES + padded], size,
                                             member, cost)
                if why is not None:
                    return why, 0
                cost += one
            pos += _BLOCK_BYTES + padded
        return None, cost

    def _pax_refusal(self, body: bytes, size: int, member: str, earlier: int) -> tuple[str | None, int]:
        """``(why a PAX body is refused or None, its digit cost)``; ``earlier``: the cost of the chain before it."""
        try:
            one = check_pax_body(body, size, member)
        except ArchiveFormatError:
            return "its PAX header would not parse", 0
        spent = self.budget.spent
        self.budget.spent = spent + earlier  # the chain's earlier PAX headers count too
        try:
            return self.budget.refusal(one), one
        finally:
            self.budget.spent = spent

    def admit(self, *, cost: int) -> None:
        """Count an admitted header chain's digit cost (from :meth:`check`) against the archive's budget."""
        self.budget.spent += cost


class _TakingExtractor(Extractor):
    """The extractor, handed only the members ``take(source index, normalized name, kind)`` selects.

    A member not taken is passed over as tarfile steps to the next header
    (its data is read and discarded, counted like any read); every member
    taken goes through the extractor's own rules, across all sources
    together (a hard link may name a file taken from an earlier source; a
    path below a symlink taken earlier is refused as ever).  Kinds: ``file``
    (also a hard link), ``dir``, ``symlink``.  A name the extractor refuses
    is refused, taken or not.
    """

    take: Callable[[int, bytes, str], bool]
    source = 0

    def _taken(self, name: str | bytes, kind: str) -> bool:
        return self.take(self.source, self.name(name), kind)

    def add_new_file_from(self, name: str | bytes, mode: int, mtime: float | int | None, size: int,
                          counter: Any, offset_data: int) -> bool:
        if not self._taken(name, "file"):
            return False  # the caller falls back to add_file, which passes it over
        return super().add_new_file_from(name, mode, mtime, size, counter, offset_data)

    def add_new_file_data(self, name: str | bytes, mode: int, mtime: float | int | None, size: int,
                          counter: Any) -> bool:
        if not self._taken(name, "file"):
            return False  # the caller falls back to add_file, which passes it over
        return super().add_new_file_data(name, mode, mtime, size, counter)

    def add_file(self, name: str | bytes, read: Callable[[int], bytes], mode: int | None,
                 mtime: float | int | None, declared_size: int | None = None,
                 owner: tuple[int, int] | None = None,
                 splice: Callable[[int, int], int] | None = None) -> None:
        if self._taken(name, "file"):
            super().add_file(name, read, mode, mtime, declared_size=declared_size, owner=owner, splice=splice)

    def add_dir(self, name: str | bytes, mode: int | None, mtime: float | int | None,
                owner: tuple[int, int] | None = None) -> None:
        if self._taken(name, "dir"):
            super().add_dir(name, mode, mtime, owner=owner)

    def add_symlink(self, name: str | bytes, target: str | bytes, mtime: float | int | None) -> None:
        if self._taken(name, "symlink"):
            super().add_symlink(name, target, mtime)

    def add_hardlink(self, name: str | bytes, target: str | bytes) -> None:
        if self._taken(name, "file"):
            super().add_hardlink(name, target)


def extract_streams(*, root: Root, dest: str, sources: Sequence[Any], take: Callable[[int, bytes, str], bool],
                    limits: ArchiveLimits, policy: ExtractPolicy, made: list[tuple[int, int]] | None = None,
                    exact_modes: dict[bytes, int] | None = None) -> ExtractReport:
    """Extract the uncompressed tars ``sources``, in order, into ``dest`` in one staged pass, filtered by ``take``.

    One extractor (one staging directory, one set of limits counted over all
    sources, one ``finish``) applies the members ``take(i, name, kind)``
    selects (``i``: the source's index; ``name``: the normalized member
    name; ``kind``: ``file``, ``dir`` or ``symlink``).  Every member of every
    source is parsed by tarfile behind the extractor's guards and counted
    against ``max_members``, taken or not.

    Args:
        root, dest, limits, policy, made, exact_modes: as for :func:`extract_stream`
            (``limits.max_input_bytes`` bounds all sources together).
        sources: readable binary streams, each read once, forward only.
        take: the member filter.

    Returns:
        The :class:`~sandbox_fs.archive.ExtractReport` of the whole pass.

    Raises:
        The errors of :func:`~sandbox_fs.archive.extract`; nothing is left
        at ``dest`` when one is raised (the staging directory is removed).
    """
    meter = Meter(limits)
    ex = _TakingExtractor(root, dest, limits, policy, meter, exact_modes)
    ex.take = take
    ex.batch_in_memory = True
    try:
        for i, source in enumerate(sources):
            ex.source = i
            extract_tar(InputCounter(source, meter), ex, limits, meter, None, _splice_fd(source))
        ex.finish()
    except BaseException as exc:
        earlier = ex.pending_error(run_queued=isinstance(exc, Exception))
        ex.abort()
        if earlier is not None and isinstance(exc, Exception):
            exc = earlier
        if isinstance(exc, (ArchiveFormatError, ArchiveLimitError, UnsafeArchiveMemberError)) and \
                exc.sandbox_path is None:
            exc.sandbox_path = ex.shown_dest
        if exc is not earlier:
            raise
        raise exc from None
    finally:
        if made is not None and ex.made_identity is not None:
            made.append(ex.made_identity)
        ex.close()
    return ExtractReport(format="tar", members=ex.members, files=ex.files, dirs=ex.dirs, symlinks=ex.symlinks,
                         hardlinks=ex.hardlinks, bytes_written=meter.written_bytes, input_bytes=meter.input_bytes,
                         skipped=ex.skipped, skipped_count=ex.skipped_count)


def _splice_fd(source: Any) -> int:
    """The source's fd when kernel-side copies are exact: an unbuffered regular file (``io.FileIO``)."""
    if not isinstance(source, io.FileIO):
        return -1
    try:
        fd = source.fileno()
        return fd if stat.S_ISREG(os.fstat(fd).st_mode) else -1
    except (OSError, ValueError):
        return -1
