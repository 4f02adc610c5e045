"""Zip reader: zipfile parses, our rules decide.

Before zipfile builds its entry list we read the end-of-central-directory
record (EOCD, and the ZIP64 EOCD when present) ourselves and check the entry
count and the central-directory size against the limits.  Then, before any
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


def precheck_eocd(f: SeekCounter, limits: ArchiveLimits) -> None:
    """Find the EOCD the way zipfile does and bound the entry count and central directory size.

    Raises:
        ArchiveFormatError: no EOCD record.
        ArchiveLimitError: ``max_members`` or ``max_central_directory_bytes``.
    """
    size = f.seek(0, 2)
    if size < 22:
        raise _fmt("not a zip archive (too short)")
    tail_len = min(size, 22 + 65535 + 20 + 56)
    f.seek(size - tail_len)
    tail = f.read(tail_len)
    pos = -1
    if tail[-22:-18] == _EOCD and tail[-2:] == b"\0\0":
        pos = len(tail) - 22
    else:
        pos = tail.rfind(_EOCD, max(0, len(tail) - 22 - 65535 - 22))
    if pos < 0 or len(tail) - pos < 22:
        raise _fmt("not a zip archive (no end-of-central-directory record)")
    (_sig, _disk, _cd_disk, _n_disk, entries, cd_size, _cd_off, _clen) = struct.unpack("<4s4H2LH", tail[pos:pos + 22])
    loc = pos - 20
    if loc >= 0 and tail[loc:loc + 4] == _EOCD64_LOC:
        rec = loc - 56
        if rec >= 0 and tail[rec:rec + 4] == _EOCD64:
            (_s, _sz, _cv, _ev, _d, _dcd, _nd, entries, cd_size, _off) = struct.unpack("<4sQ2H2L4Q", tail[rec:rec + 56])
    if entries > limits.max_members:
        raise ArchiveLimitError("max_members", limits.max_members, entries, None,
                                reason=f"central directory declares {entries} entries > max_members {limits.max_members}")
    if cd_size > limits.max_central_directory_bytes:
        raise ArchiveLimitError("max_central_directory_bytes", limits.max_central_directory_bytes, cd_size, None)


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
        precheck_eocd(f, limits)
        zf = zipfile.ZipFile(f)  # type: ignore[arg-type]
    except (ArchiveLimitError, ArchiveFormatError):
        raise
    except (zipfile.BadZipFile, OSError, *PARSE_ERRORS) as exc:
        raise _fmt(f"not a valid zip archive ({type(exc).__name__})", exc) from None
    with zf:
        infos = zf.infolist()
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
