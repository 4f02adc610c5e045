"""Streaming tar reader: tarfile parses, our rules decide (see ``_writer``).

One pass, never seeking back, never ``getmembers()``: tarfile reads from
:class:`StreamCounter`, a forward-only view of our own decompressor (gzip /
bz2 / lzma from the standard library), so member data flows straight from
the decompressor to the file with no extra stream-buffer copy (measured: the
``"r|"`` stream buffer copied its tail on every read).  Members are taken
with ``next()`` and dropped from ``TarFile.members`` at once so memory does
not grow with the member count.

Plain headers are parsed here (:func:`parse_simple_header`): a one-block
regular / directory / symlink / hard-link header with an unsigned checksum
and octal-text numbers, while no PAX global header is in force, gives exactly
the values tarfile's ``frombuf`` + ``_proc_builtin`` give (a differential
test holds the two together), with one read a member for the padding and the
next header.  Every other block (extension headers, sparse and special
types, base-256 numbers, a bad checksum, the end of the archive) is pushed
back and parsed by tarfile under all the guards below.  Measured on the
stdlib tarball: tarfile's header parsing was ~40 us a member, a third of the
extraction time on tmpfs.

Header-size bound (the sound way to check before tarfile reads a header body
into memory): tarfile builds every header from its 512-byte block with
``TarInfo.frombuf`` and only then reads the body of a PAX extended header
(``x``/``g``/Solaris ``X``) or a GNU long name/link (``L``/``K``).  Our
``TarInfo`` subclass checks the block's size field in ``frombuf`` and raises
:class:`ArchiveLimitError` before the body is read.  A second bound in
:class:`StreamCounter` caps every byte tarfile reads while parsing one header
chain (sparse maps included), and the chain length is capped so tarfile's
recursion cannot overflow the stack.

PAX body check (CVE-2024-6232): CPython before 3.11.10 / 3.12.6 runs
``re.search`` for a ``hdrcharset`` record (and, for GNU sparse 0.0, two
``finditer``) over every PAX body; the pattern starts with ``\\d+``, so each
digit run costs its length squared (a 1 MiB run: ~48 minutes).  Our
``_proc_pax`` override peeks the body (:meth:`StreamCounter.peek`: read and
counted once, handed back to tarfile's own read) and validates it with
:func:`check_pax_body`, a linear parser of the record format that refuses
records not tiling the body exactly, non-NUL padding, and digit runs whose
squared lengths add up past :data:`PAX_DIGIT_COST_HEADER` per header or
:data:`PAX_DIGIT_COST_ARCHIVE` per archive.  The regex then costs at most
16 steps a byte plus those bounds, on any Python.
"""

from __future__ import annotations

import codecs
import re
import stat as _stat
import struct
import tarfile
from typing import Any, Callable

from ._errors import ArchiveFormatError, ArchiveLimitError
from ._models import ArchiveLimits
from ._streams import PARSE_ERRORS, Meter, StreamCounter
from ._writer import Extractor

__all__ = ["extract_tar"]

_EXT_TYPES = frozenset({tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE,
                        tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE})
MAX_HEADER_CHAIN = 16

#: digit runs up to this length are free: a regex scan over them is linear (at most this many steps a byte)
FREE_DIGIT_RUN = 16
#: sum of squared lengths of longer digit runs allowed in one PAX header body (one 2,048-digit run)
PAX_DIGIT_COST_HEADER = 1 << 22
#: the same sum over all PAX headers of one archive
PAX_DIGIT_COST_ARCHIVE = 1 << 25
_LONG_DIGITS = re.compile(rb"[0-9]{%d,}" % (FREE_DIGIT_RUN + 1))
_PAX_LEN_DIGITS = 20  # as CPython's fixed parser (gh-121285): "([0-9]{1,20}) "


def check_pax_body(buf: bytes, size: int, member: str | bytes | None) -> int:
    """Validate a PAX extended header body with a linear parser; return its digit-run cost.

    POSIX pax (IEEE 1003.1, "pax Extended Header"): the body is a sequence
    of records ``"<len> <keyword>=<value>\\n"`` where ``<len>`` is the decimal
    length of the whole record.  The records must tile the first ``size``
    bytes exactly, and the block padding after them must be NUL bytes
    (tarfile's parser would otherwise read records from the padding that a
    reader honouring ``size`` does not see).

    The cost returned is the sum of squared lengths of the digit runs longer
    than :data:`FREE_DIGIT_RUN` anywhere in ``buf``: what CPython 3.11.7's
    ``re.search`` for a ``hdrcharset`` record (and the GNU sparse 0.0
    ``finditer``) spend on them, CVE-2024-6232.  Linear in ``len(buf)``.

    Raises:
        ArchiveFormatError: a malformed record, lengths that do not tile the
            body, or padding that is not NUL.
    """
    if len(buf) < size:
        raise ArchiveFormatError("truncated PAX extended header", member=member)
    pos = 0
    while pos < size:
        sp = buf.find(b" ", pos, min(size, pos + _PAX_LEN_DIGITS + 1))
        field = buf[pos:sp] if sp > pos else b""
        if not field or not field.isdigit():
            raise ArchiveFormatError("malformed PAX record (no decimal length)", member=member)
        length = int(field)
        end = pos + length
        if length < 5 or end > size:
            raise ArchiveFormatError("malformed PAX record (length does not fit the header)", member=member)
        if buf[end - 1] != 0x0A:
            raise ArchiveFormatError("malformed PAX record (no newline at its length)", member=member)
        eq = buf.find(b"=", sp + 1, end - 1)
        if eq <= sp + 1:
            raise ArchiveFormatError("malformed PAX record (no keyword=value)", member=member)
        pos = end
    if buf[size:].strip(b"\0"):
        raise ArchiveFormatError("PAX header padding holds data after the last record", member=member)
    cost = 0
    for m in _LONG_DIGITS.finditer(buf):
        n = m.end() - m.start()
        cost += n * n
    return cost


def _guarded_tarinfo(limits: ArchiveLimits, counter: StreamCounter, meter: Meter) -> type[tarfile.TarInfo]:
    state = {"global_bytes": 0, "digit_cost": 0}

    class GuardedTarInfo(tarfile.TarInfo):
        """TarInfo that bounds extension headers before tarfile reads them."""

        @classmethod
        def frombuf(cls, buf, encoding, errors):  # type: ignore[override]
            obj = super().frombuf(buf, encoding, errors)
            if obj.type in _EXT_TYPES:
                if obj.size > limits.max_header_bytes:
                    kind = "PAX header" if obj.type in (tarfile.XHDTYPE, tarfile.XGLTYPE,
                                                        tarfile.SOLARIS_XHDTYPE) else "GNU long name"
                    raise ArchiveLimitError("max_header_bytes", limits.max_header_bytes, obj.size, meter.member,
                                            reason=f"{kind} of {obj.size} bytes > max_header_bytes "
                                                   f"{limits.max_header_bytes}")
                if obj.type == tarfile.XGLTYPE:
                    state["global_bytes"] += obj.size
                    if state["global_bytes"] > limits.max_header_bytes:
                        raise ArchiveLimitError("max_header_bytes", limits.max_header_bytes, state["global_bytes"],
                                                meter.member, reason="PAX global headers are too large in total")
            return obj

        def _proc_pax(self, tf):  # type: ignore[override]
            # Validate the body before tarfile's parser (and its quadratic regex on
            # CPython < 3.11.10, CVE-2024-6232) sees it: peek() keeps the bytes for
            # the read tarfile makes next, so the stream is still read once.
            buf = counter.peek(self._block(self.size))
            cost = check_pax_body(buf, self.size, meter.member)
            state["digit_cost"] += cost
            if cost > PAX_DIGIT_COST_HEADER or state["digit_cost"] > PAX_DIGIT_COST_ARCHIVE:
                raise ArchiveFormatError("PAX header refused: digit runs too long to parse in bounded time "
                                         "(CVE-2024-6232)", member=meter.member)
            return super()._proc_pax(tf)

        @classmethod
        def fromtarfile(cls, tf):  # type: ignore[override]
            if counter.header_depth == 0:
                counter.header_start = counter.position
            counter.header_depth += 1
            try:
                if counter.header_depth > MAX_HEADER_CHAIN:
                    raise ArchiveFormatError(f"more than {MAX_HEADER_CHAIN} chained extension headers")
                return super().fromtarfile(tf)
            finally:
                counter.header_depth -= 1

    return GuardedTarInfo


def _format_error(exc: BaseException, meter: Meter) -> ArchiveFormatError:
    return ArchiveFormatError(f"not a valid tar stream ({type(exc).__name__})", member=meter.member,
                              diagnostic=str(exc))


def extract_tar(stream: Any, ex: Extractor, limits: ArchiveLimits, meter: Meter,
                check_cancel: Callable[[], None] | None, splice_fd: int = -1) -> None:
    """Read the (already decompressed) tar ``stream`` and apply each member to ``ex``.

    Plain one-block headers (see :func:`parse_simple_header`) are parsed here;
    every other header (PAX, GNU long names, sparse, special types, base-256
    numbers, a bad checksum, the end of the archive ...) is pushed back and
    parsed by tarfile, with all the guards above.  Both give the same member.

    Raises:
        ArchiveFormatError: the stream is not a valid tar archive.
        ArchiveLimitError, UnsafeArchiveMemberError: see :func:`extract`.
    """
    counter = StreamCounter(stream, meter, splice_fd)
    info_cls = _guarded_tarinfo(limits, counter, meter)
    try:
        tf = tarfile.open(fileobj=counter, mode="r:", tarinfo=info_cls)
    except (tarfile.TarError, OSError, *PARSE_ERRORS) as exc:
        raise _format_error(exc, meter) from None
    # the fast path decodes names exactly as tarfile would: only for utf-8 + surrogateescape,
    # which decode any bytes (tarfile's default on Linux)
    fast = tf.errors == "surrogateescape" and codecs.lookup(tf.encoding).name == "utf-8"
    try:
        while True:
            if check_cancel is not None:
                check_cancel()
            if fast and tf.firstmember is None and not tf.pax_headers:
                fields = _next_simple(tf, counter, meter)
                if fields is not None:
                    _apply_simple(fields, ex, counter)
                    continue
            try:
                ti = tf.next()
            except (tarfile.TarError, OSError, *PARSE_ERRORS) as exc:
                raise _format_error(exc, meter) from None
            if ti is None:
                break
            tf.members.clear()  # tarfile appends every member: keep memory flat
            _apply(tf, ti, ex, meter, counter)
    finally:
        tf.close()


_HEADER = struct.Struct("100s8s8s8s12s12s8sc100s6s2s32s32s8s8s155s12x")
#: member types whose header is one block and whose meaning tarfile does not change later
_SIMPLE_TYPES = frozenset({tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE,
                           tarfile.LNKTYPE})
#: padding skipped with one read together with the next header; more is skipped in bounded chunks
_MAX_JOINED_SKIP = 4096


def parse_simple_header(buf: bytes) -> tuple[str, bytes, int, int, int, int, int, str] | None:
    """Parse a plain one-block tar header as ``tarfile.TarInfo.frombuf`` + ``_proc_builtin`` would.

    Returns ``(name, type, mode, uid, gid, size, mtime, linkname)`` for a
    512-byte header of type regular (``0``/NUL), directory, symlink or hard
    link whose checksum is the unsigned one and whose numeric fields are
    octal text; the values are exactly tarfile's (utf-8, surrogateescape).
    Returns None for anything else, which tarfile then parses (and judges):
    an end-of-archive block, a bad or signed checksum, base-256 or odd
    numbers, extension headers, sparse and special types.
    """
    if len(buf) != 512:
        return None
    (name, mode, uid, gid, size, mtime, chk, typ, link, _magic, _version, _uname, _gname, dmajor, dminor,
     prefix) = _HEADER.unpack(buf)
    if typ not in _SIMPLE_TYPES:
        return None
    try:
        # tarfile's nti(): the text up to the first NUL, stripped, read as octal ("" is 0).
        # int() on bytes strips only ASCII whitespace and refuses non-ASCII and base-256
        # fields: those raise here and go to tarfile, which decides.
        c = chk.partition(b"\0")[0]
        if not c or int(c, 8) != 256 + sum(buf) - sum(chk):
            return None
        f = mode.partition(b"\0")[0]
        imode = int(f, 8) if f else 0
        f = uid.partition(b"\0")[0]
        iuid = int(f, 8) if f else 0
        f = gid.partition(b"\0")[0]
        igid = int(f, 8) if f else 0
        f = size.partition(b"\0")[0]
        isize = int(f, 8) if f else 0
        f = mtime.partition(b"\0")[0]
        imtime = int(f, 8) if f else 0
        f = dmajor.partition(b"\0")[0]  # unused, but tarfile refuses the header when invalid
        if f:
            int(f, 8)
        f = dminor.partition(b"\0")[0]
        if f:
            int(f, 8)
    except ValueError:
        return None
    sname = name.partition(b"\0")[0].decode("utf-8", "surrogateescape")
    if typ == tarfile.AREGTYPE and sname.endswith("/"):
        typ = tarfile.DIRTYPE  # old V7 directory
    if typ == tarfile.DIRTYPE:
        sname = sname.rstrip("/")
    p = prefix.partition(b"\0")[0]
    if p:
        sname = p.decode("utf-8", "surrogateescape") + "/" + sname
        if typ == tarfile.DIRTYPE:
            sname = sname.rstrip("/")
    slink = link.partition(b"\0")[0].decode("utf-8", "surrogateescape")
    return sname, typ, imode, iuid, igid, isize, imtime, slink


def _next_simple(tf: tarfile.TarFile, counter: StreamCounter,
                 meter: Meter) -> tuple[str, bytes, int, int, int, int, int, str] | None:
    """Read the next header at ``tf.offset``; parse it when simple, else push it back for tarfile.

    The padding before the header and the header are read together (one
    read a member).  A stream that ends inside the padding is the error
    tarfile gives (``unexpected end of data``).
    """
    off = tf.offset
    skip = off - counter.position
    if skip < 0:
        return None  # tarfile reports the corrupt offset
    if skip > _MAX_JOINED_SKIP:
        counter.seek(off)
        if counter.position != off:
            raise _format_error(tarfile.ReadError("unexpected end of data"), meter)
        skip = 0
    got = counter.read(skip + 512)
    if len(got) < skip:
        raise _format_error(tarfile.ReadError("unexpected end of data"), meter)
    buf = got[skip:] if skip else got
    fields = parse_simple_header(buf)
    if fields is None:
        counter.unread(buf)  # position is ``off`` again: tarfile reads this block itself
        return None
    size = fields[5]
    data = counter.position
    # as _proc_builtin: only regular files have data blocks (a directory's or link's size is ignored)
    tf.offset = data + ((size + 511) & ~511 if fields[1] in (tarfile.REGTYPE, tarfile.AREGTYPE) else 0)
    return fields


def _apply_simple(fields: tuple[str, bytes, int, int, int, int, int, str], ex: Extractor,
                  counter: StreamCounter) -> None:
    name, typ, mode, uid, gid, size, mtime, link = fields
    ex.count_member(name)
    if typ == tarfile.DIRTYPE:
        ex.add_dir(name, mode & 0o7777, mtime, owner=(uid, gid))
    elif typ == tarfile.SYMTYPE:
        ex.add_symlink(name, link, mtime)
    elif typ == tarfile.LNKTYPE:
        ex.add_hardlink(name, link)
    else:
        _add_plain_file(name, mode, uid, gid, size, mtime, ex, counter, counter.position)


def _add_plain_file(name: str, mode: int, uid: int, gid: int, size: int, mtime: int, ex: Extractor,
                    counter: StreamCounter, offset_data: int) -> None:
    """A regular member whose data is the next ``size`` bytes of the stream: read them straight
    from the counter (no ExFileObject/_FileInFile layers); a short stream is a format error,
    as tarfile would say."""
    counter.seek(offset_data)
    left = size
    splice = counter.splice if size and counter.can_splice() else None

    def read(n: int) -> bytes:
        nonlocal left
        if left <= 0:
            return b""
        data = counter.read(min(n, left))
        if not data:
            raise ArchiveFormatError("unexpected end of data", member=name)
        left -= len(data)
        return data

    ex.add_file(name, read, mode & 0o7777, mtime, declared_size=size, owner=(uid, gid), splice=splice)


def _apply(tf: tarfile.TarFile, ti: tarfile.TarInfo, ex: Extractor, meter: Meter, counter: StreamCounter) -> None:
    name = ti.name
    ex.count_member(name)
    owner = (ti.uid, ti.gid)
    if ti.isreg():
        if ti.sparse is None and ti.type != tarfile.GNUTYPE_SPARSE:
            _add_plain_file(name, ti.mode, ti.uid, ti.gid, ti.size, ti.mtime, ex, counter, ti.offset_data)
            return
        fobj = tf.extractfile(ti)  # sparse: tarfile expands the holes
        assert fobj is not None

        def read(n: int) -> bytes:
            try:
                return fobj.read(n)
            except (tarfile.TarError, OSError, *PARSE_ERRORS) as exc:
                raise _format_error(exc, meter) from None

        ex.add_file(name, read, _stat.S_IMODE(ti.mode), ti.mtime, declared_size=ti.size, owner=owner)
    elif ti.isdir():
        ex.add_dir(name, _stat.S_IMODE(ti.mode), ti.mtime, owner=owner)
    elif ti.issym():
        ex.add_symlink(name, ti.linkname, ti.mtime)
    elif ti.islnk():
        ex.add_hardlink(name, ti.linkname)
    elif ti.ischr():
        ex.special(name, "character device")
    elif ti.isblk():
        ex.special(name, "block device")
    elif ti.isfifo():
        ex.special(name, "FIFO")
    else:
        ex.special(name, "unknown")
