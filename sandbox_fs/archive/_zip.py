"""Zip reader: zipfile parses, our rules decide.

Before zipfile builds its entry list we find the end-of-central-directory
record (EOCD, and the ZIP64 EOCD when present) exactly as zipfile does,
refuse data after it, bound the central-directory size zipfile will read and
count its entries by walking the headers (see
:func:`locate_central_directory`); zipfile's reads are then bounded to what
was checked.  Then, before any
entry is extracted:

* each local header's name must equal its central-directory name (a
  mismatch is how a scanner and an extractor are made to see different
  files);
* entries whose local header + data ranges overlap each other, or run into
  the central directory, are refused (overlapping-entry bombs, D. Fifield
  "A better zip bomb", 2019);
* encrypted entries are refused; stored / deflate / bzip2 / lzma are read.

Unix modes and symlinks come from the external attributes when the entry was
made on Unix (``create_system == 3``).
"""

from __future__ import annotations

import stat as _stat
import struct
import zipfile
from typing import Callable

from ._errors import ArchiveFormatError, ArchiveLimitError, UnsafeArchiveMemberError
from ._models import ArchiveLimits
from ._streams import PARSE_ERRORS, Meter, SeekCounter
from ._writer import Extractor

__all__ = ["extract_zip"]

_EOCD = b"PK\x05\x06"
_EOCD64_LOC = b"PK\x06\x07"
_EOCD64 = b"PK\x06\x06"
_LOCAL = b"PK\x03\x04"
_SUPPORTED = {zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA}
_UNIX = 3


def _fmt(reason: str, exc: BaseException | None = None, member: str | None = None) -> ArchiveFormatError:
    return ArchiveFormatError(reason, member=member, diagnostic=repr(exc) if exc else None)


_EOCD_SIZE = 22
_EOCD64_LOC_SIZE = 20
_EOCD64_SIZE = 56
_CENTRAL = b"PK\x01\x02"
_CENTRAL_SIZE = 46
_CD_CHUNK_BYTES = 1 << 20
#: bytes zipfile may read while locating the EOCD records: the last 22 bytes, the 64 KiB comment
#: window from the end, the ZIP64 locator and record
_LOCATE_READ_BYTES = _EOCD_SIZE + (1 << 16) + _EOCD_SIZE + _EOCD64_LOC_SIZE + _EOCD64_SIZE


class CentralDirectory:
    """Where the central directory is and what it holds, as zipfile will read it.

    Attributes:
        start: file offset of the first central-directory header (zipfile's ``start_dir``).
        size: central-directory bytes (from the ZIP64 record when present).
        entries: entries counted by walking the headers (never the declared count).
    """

    __slots__ = ("start", "size", "entries")

    def __init__(self, start: int, size: int, entries: int) -> None:
        self.start, self.size, self.entries = start, size, entries


#: A ZIP64 locator naming another record than the one right before it (where zipfile reads it) makes
#: readers that follow the offset (libarchive) list other members than zipfile (CVE-2025-8291).
_LOCATOR_ELSEWHERE = ("the ZIP64 end-of-central-directory locator does not point at the ZIP64 record right "
                      "before it (readers would disagree on the members, CVE-2025-8291)")


def _read_at(f: SeekCounter, offset: int, n: int) -> bytes:
    f.seek(offset)
    return f.read(n)


def locate_central_directory(f: SeekCounter, limits: ArchiveLimits) -> CentralDirectory:
    """Find the EOCD exactly as zipfile does, then walk the central directory counting entries.

    The search mirrors ``zipfile._EndRecData``/``_EndRecData64`` (same
    window: the last 22 bytes, else the last ``64 KiB + 22`` bytes searched
    backwards; the ZIP64 locator and record right before the EOCD, wherever
    that is), so the records checked here are the records zipfile uses.  A
    ZIP64 locator must point at that record (its offset counted like the
    central directory's): zipfile ignores the offset and other readers follow
    it, so an archive where they differ lists different members to each
    (CVE-2025-8291).
    Data after the EOCD and its comment is refused: it is how a second,
    unchecked ZIP64 record is hidden from a reader with a narrower window.
    The limits then apply to what zipfile will read: ``max_central_directory_bytes``
    to the central-directory size it takes (the ZIP64 one when present),
    ``max_members`` to the entries counted while walking the headers (a
    declared count of 1 over 340,000 headers stops at ``max_members + 1``).

    Raises:
        ArchiveFormatError: no EOCD record, data after it, a multi-disk
            archive, a ZIP64 locator not pointing at the record right before
            it, a central directory outside the file or malformed.
        ArchiveLimitError: ``max_members`` or ``max_central_directory_bytes``.
    """
    size = f.seek(0, 2)
    if size < _EOCD_SIZE:
        raise _fmt("not a zip archive (too short)")
    rec = _read_at(f, size - _EOCD_SIZE, _EOCD_SIZE)
    if rec[:4] == _EOCD and rec[-2:] == b"\0\0":
        pos = size - _EOCD_SIZE
    else:
        window_start = max(size - (1 << 16) - _EOCD_SIZE, 0)
        window = _read_at(f, window_start, size - window_start)
        start = window.rfind(_EOCD)
        if start < 0 or len(window) - start < _EOCD_SIZE:
            raise _fmt("not a zip archive (no end-of-central-directory record)")
        pos = window_start + start
        rec = window[start:start + _EOCD_SIZE]
    (_sig, _disk, _cd_disk, _n_disk, entries, cd_size, cd_off, clen) = struct.unpack("<4s4H2LH", rec)
    if pos + _EOCD_SIZE + clen != size:
        raise _fmt("data after the end-of-central-directory record and its comment")
    zip64 = False
    if pos >= _EOCD64_LOC_SIZE:
        loc = _read_at(f, pos - _EOCD64_LOC_SIZE, _EOCD64_LOC_SIZE)
        sig, diskno, reloff, disks = struct.unpack("<4sLQL", loc)
        if sig == _EOCD64_LOC:
            if diskno != 0 or disks > 1:
                raise _fmt("zip archives spanning several disks are not supported")
            at = pos - _EOCD64_LOC_SIZE - _EOCD64_SIZE
            r64 = _read_at(f, at, _EOCD64_SIZE) if at >= 0 else b""
            if r64[:4] != _EOCD64:
                raise _fmt(_LOCATOR_ELSEWHERE)
            (_s, _sz, _cv, _ev, _d, _dcd, _nd, entries, cd_size, cd_off) = struct.unpack("<4sQ2H2L4Q", r64)
            zip64 = True
            # The record follows the central directory, and the locator's offset counts from the same
            # origin as the record's cd_off (the start of the zip data, after any prepended stub):
            # pointing at the record used here, it equals cd_off + cd_size.
            if reloff != cd_off + cd_size:
                raise _fmt(_LOCATOR_ELSEWHERE)
    if entries > limits.max_members:
        raise ArchiveLimitError("max_members", limits.max_members, entries, None,
                                reason=f"central directory declares {entries} entries > max_members {limits.max_members}")
    if cd_size > limits.max_central_directory_bytes:
        raise ArchiveLimitError("max_central_directory_bytes", limits.max_central_directory_bytes, cd_size, None)
    start_dir = pos - cd_size - (_EOCD64_SIZE + _EOCD64_LOC_SIZE if zip64 else 0)  # zipfile's offset_cd + concat
    if start_dir < 0:
        raise _fmt("bad offset for the central directory")
    # Walk the headers as zipfile will (total += 46 + name + extra + comment), counting and
    # reading the directory in chunks: memory stays one chunk, the walk stops at max_members.
    count = 0
    total = 0
    unpack = struct.Struct("<HHH").unpack_from
    buf = b""
    buf_at = 0  # central-directory offset of buf[0]
    while total < cd_size:
        if cd_size - total < _CENTRAL_SIZE:
            raise _fmt("truncated central directory")
        rel = total - buf_at
        if rel + _CENTRAL_SIZE > len(buf):
            buf = _read_at(f, start_dir + total, min(_CD_CHUNK_BYTES, cd_size - total))
            buf_at, rel = total, 0
            if len(buf) < _CENTRAL_SIZE:
                raise _fmt("truncated central directory")
        if buf[rel:rel + 4] != _CENTRAL:
            raise _fmt("bad central directory header")
        n, m, k = unpack(buf, rel + 28)
        total += _CENTRAL_SIZE + n + m + k
        count += 1
        if count > limits.max_members:
            raise ArchiveLimitError("max_members", limits.max_members, count, None,
                                    reason=f"central directory holds more than max_members {limits.max_members} "
                                           f"entries")
    return CentralDirectory(start_dir, cd_size, count)


def _central_name(zi: zipfile.ZipInfo) -> bytes:
    enc = "utf-8" if zi.flag_bits & 0x800 else "cp437"
    return zi.orig_filename.encode(enc, "surrogateescape")


def check_layout(f: SeekCounter, zf: zipfile.ZipFile, infos: list[zipfile.ZipInfo]) -> None:
    """Compare local and central names and refuse overlapping entries.

    Raises:
        UnsafeArchiveMemberError: ``name_mismatch`` or ``overlapping_entries``.
        ArchiveFormatError: a local header is missing or truncated.
    """
    cd_start = zf.start_dir
    ranges: list[tuple[int, int, str]] = []
    for zi in infos:
        if not 0 <= zi.header_offset < cd_start:
            raise _fmt("local header offset outside the archive", member=zi.orig_filename)
        try:
            f.seek(zi.header_offset)
            head = f.read(30)
            if len(head) != 30 or head[:4] != _LOCAL:
                raise _fmt("bad local file header", member=zi.orig_filename)
            n, m = struct.unpack("<HH", head[26:30])
            local = f.read(n)
        except (OSError, *PARSE_ERRORS) as exc:
            raise _fmt(f"unreadable local header ({type(exc).__name__})", exc, member=zi.orig_filename) from None
        if local != _central_name(zi):
            raise UnsafeArchiveMemberError("name_mismatch", zi.orig_filename,
                                           "local header name differs from the central directory name")
        end = zi.header_offset + 30 + n + m + zi.compress_size
        if end > cd_start:
            raise UnsafeArchiveMemberError("overlapping_entries", zi.orig_filename,
                                           "entry data runs into the central directory")
        ranges.append((zi.header_offset, end, zi.orig_filename))
    ranges.sort()
    for (s0, e0, _n0), (s1, _e1, n1) in zip(ranges, ranges[1:]):
        if s1 < e0:
            raise UnsafeArchiveMemberError("overlapping_entries", n1,
                                           "entry overlaps another entry's data (overlap zip bomb)")


def extract_zip(source: object, ex: Extractor, limits: ArchiveLimits, meter: Meter,
                check_cancel: Callable[[], None] | None) -> None:
    """Read a seekable zip ``source`` and apply each entry to ``ex``.

    Raises:
        ArchiveFormatError: not a zip, not seekable, corrupt, CRC mismatch.
        ArchiveLimitError, UnsafeArchiveMemberError: see :func:`extract`.
    """
    seekable = getattr(source, "seekable", None)
    if seekable is None or not seekable():
        raise _fmt("zip archives need a seekable source (a regular file)")
    f = SeekCounter(source, meter)  # type: ignore[arg-type]
    try:
        cd = locate_central_directory(f, limits)
        # zipfile now reads what was checked: bound its reads while it builds the entry
        # list (the EOCD search window plus the checked central directory), so a reader
        # that disagreed with ours could not pull more into memory.
        f.read_budget = _LOCATE_READ_BYTES + cd.size
        try:
            zf = zipfile.ZipFile(f)  # type: ignore[arg-type]
        finally:
            f.read_budget = None
    except (ArchiveLimitError, ArchiveFormatError):
        raise
    except (zipfile.BadZipFile, OSError, *PARSE_ERRORS) as exc:
        raise _fmt(f"not a valid zip archive ({type(exc).__name__})", exc) from None
    with zf:
        infos = zf.infolist()
        if zf.start_dir != cd.start or len(infos) != cd.entries:
            raise _fmt("zipfile and the central-directory check disagree (refused)")
        if len(infos) > limits.max_members:
            raise ArchiveLimitError("max_members", limits.max_members, len(infos), None)
        check_layout(f, zf, infos)
        for zi in infos:
            if check_cancel is not None:
                check_cancel()
            _apply(zf, zi, ex, limits, meter)


def _apply(zf: zipfile.ZipFile, zi: zipfile.ZipInfo, ex: Extractor, limits: ArchiveLimits, meter: Meter) -> None:
    name = zi.orig_filename
    ex.count_member(name)
    if zi.flag_bits & 0x1:
        raise UnsafeArchiveMemberError("encrypted", name, "encrypted entries are refused")
    if zi.compress_type not in _SUPPORTED:
        raise UnsafeArchiveMemberError("unsupported_compression", name,
                                       f"compression method {zi.compress_type} is not supported")
    mode = (zi.external_attr >> 16) & 0xFFFF if zi.create_system == _UNIX else 0
    ftype = _stat.S_IFMT(mode)
    perm = _stat.S_IMODE(mode) if mode else None
    mtime = _mtime(zi)
    if ftype == _stat.S_IFLNK:
        if zi.file_size > limits.max_path_bytes:
            raise ArchiveLimitError("max_path_bytes", limits.max_path_bytes, zi.file_size, name)
        target = _read_all(zf, zi, limits.max_path_bytes, meter)
        ex.add_symlink(name, target, mtime)
    elif name.endswith("/") or ftype == _stat.S_IFDIR:
        ex.add_dir(name, perm, mtime)
    elif ftype in (0, _stat.S_IFREG):
        if zi.file_size > limits.max_member_bytes:
            raise ArchiveLimitError("max_member_bytes", limits.max_member_bytes, zi.file_size, name,
                                    reason=f"declared size {zi.file_size} > max_member_bytes {limits.max_member_bytes}")
        try:
            fobj = zf.open(zi)
        except (zipfile.BadZipFile, OSError, RuntimeError, *PARSE_ERRORS) as exc:
            raise _fmt(f"cannot open entry ({type(exc).__name__})", exc, member=name) from None
        with fobj:
            def read(n: int) -> bytes:
                try:
                    return fobj.read(n)
                except (zipfile.BadZipFile, OSError, *PARSE_ERRORS) as exc:
                    raise _fmt(f"corrupt entry data ({type(exc).__name__})", exc, member=name) from None

            ex.add_file(name, read, perm, mtime)
    elif ftype in (_stat.S_IFCHR, _stat.S_IFBLK, _stat.S_IFIFO, _stat.S_IFSOCK):
        ex.special(name, {_stat.S_IFCHR: "character device", _stat.S_IFBLK: "block device",
                          _stat.S_IFIFO: "FIFO", _stat.S_IFSOCK: "socket"}[ftype])
    else:
        ex.special(name, "unknown")


def _read_all(zf: zipfile.ZipFile, zi: zipfile.ZipInfo, max_bytes: int, meter: Meter) -> bytes:
    try:
        with zf.open(zi) as fobj:
            data = fobj.read(max_bytes + 1)
    except (zipfile.BadZipFile, OSError, RuntimeError, *PARSE_ERRORS) as exc:
        raise _fmt(f"corrupt entry data ({type(exc).__name__})", exc, member=zi.orig_filename) from None
    if len(data) > max_bytes:
        raise ArchiveLimitError("max_path_bytes", max_bytes, len(data), zi.orig_filename)
    return data


def _mtime(zi: zipfile.ZipInfo) -> float | None:
    import time

    try:
        return time.mktime(zi.date_time + (0, 0, -1))
    except (OverflowError, ValueError):
        return None
