"""Streaming tar reader: tarfile parses, our rules decide (see ``_writer``).

One pass, never seeking back, never ``getmembers()``: tarfile reads from
:class:`StreamCounter`, a forward-only view of our own decompressor (gzip /
bz2 / lzma from the standard library), so member data flows straight from
the decompressor to the file with no extra stream-buffer copy (measured: the
``"r|"`` stream buffer copied its tail on every read).  Members are taken
with ``next()`` and dropped from ``TarFile.members`` at once so memory does
not grow with the member count.

Every header is parsed by tarfile (the project keeps format parsing in the
well-kept library: a second parser of our own would be a second place for
parser differentials).

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

Header numbers used as lengths or offsets are never trusted to be
non-negative: tarfile decodes a GNU base-256 field whose first byte is
``0xff`` as a negative number, and a PAX ``size`` or sparse record as any
``int()``.  Every header block's size field is checked in ``frombuf`` (before
tarfile uses it to read a body or to place the next header), and each
member's final size and sparse map (offsets and sizes) in :func:`_apply`,
before the member is counted or anything is created: a negative one is an
:class:`ArchiveFormatError` on every path (batched, one by one, stream,
in place).
"""

from __future__ import annotations

import functools
import re
import stat as _stat
import tarfile
import types
from typing import Any, Callable

from .._bytesum import byte_sum
from ._errors import ArchiveFormatError, ArchiveLimitError
from ._models import ArchiveLimits
from ._streams import PARSE_ERRORS, Meter, StreamCounter
from ._writer import Extractor

__all__ = ["extract_tar", "check_pax_body", "PaxBudget"]

EXT_TYPES = frozenset({tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE,
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


class PaxBudget:
    """The CVE-2024-6232 digit-run budget of one archive, per PAX header and in total.

    One accounting shared by the extractor (every PAX body it reads) and by
    snapshot persist (every PAX header it writes, so that what persist
    commits, hydrate reads).  The bounds are read at each call from
    :data:`PAX_DIGIT_COST_HEADER` and :data:`PAX_DIGIT_COST_ARCHIVE`.

    Attributes:
        spent: the digit cost admitted so far (sum of squared run lengths).
    """

    def __init__(self) -> None:
        self.spent = 0

    def refusal(self, cost: int) -> str | None:
        """Why a header of digit cost ``cost`` would be refused now (None: it fits the budget)."""
        if cost > PAX_DIGIT_COST_HEADER:
            return "a PAX header's digit runs are too long to parse in bounded time (CVE-2024-6232)"
        if self.spent + cost > PAX_DIGIT_COST_ARCHIVE:
            return "the archive's PAX headers hold too many long digit runs in all (CVE-2024-6232)"
        return None

    def charge(self, buf: bytes, size: int, member: str | bytes | None) -> None:
        """Validate one PAX body (:func:`check_pax_body`) and admit its cost.

        Raises:
            ArchiveFormatError: a malformed body, or its cost breaks the per-header or archive budget.
        """
        cost = check_pax_body(buf, size, member)
        why = self.refusal(cost)
        if why is not None:
            raise ArchiveFormatError("PAX header refused: " + why, member=member)
        self.spent += cost


_HIGH_BYTES = bytes(range(128, 256))


class _HeaderSums:
    """``tarfile.calc_chksums(buf)`` as a container, computed in C: ``x in _HeaderSums(buf)`` is
    ``x in calc_chksums(buf)`` for a 512-byte header ``buf``.

    tarfile unpacks the header into 504 ints and sums them twice, which was
    about a sixth of hydrate's parsing thread (the stdlib tree: ~0.1 s).
    Here the unsigned sum comes from :func:`~sandbox_fs._bytesum.byte_sum`
    (Adler-32 pieces, in C); the signed sum (bytes >= 0x80 counted negative), which
    only an old or odd writer needs, is computed only when the unsigned one
    does not match.
    """

    __slots__ = ("_buf", "unsigned")

    def __init__(self, buf: bytes) -> None:
        self._buf = buf
        # the 8 checksum bytes (148:156) count as spaces: 8 * 0x20 = 256
        self.unsigned = 256 + byte_sum(buf[:148]) + byte_sum(buf[156:512])

    def __contains__(self, x: object) -> bool:
        return x == self.unsigned or x == self.signed()

    def signed(self) -> int:
        buf = self._buf
        high = 0
        for piece in (buf[:148], buf[156:512]):
            high += len(piece) - len(piece.translate(None, _HIGH_BYTES))
        return self.unsigned - 256 * high


# tarfile's own TarInfo.frombuf (the running interpreter's code), with the checksum above in place of
# calc_chksums in a copy of its globals: tarfile itself is not changed, and every other step is its own.
_STD_FROMBUF = tarfile.TarInfo.frombuf.__func__  # type: ignore[attr-defined]
_FROMBUF_GLOBALS = {**vars(tarfile), "calc_chksums": _HeaderSums}
_frombuf = types.FunctionType(_STD_FROMBUF.__code__, _FROMBUF_GLOBALS,
                              _STD_FROMBUF.__name__, _STD_FROMBUF.__defaults__, _STD_FROMBUF.__closure__)
#: distinct number fields one archive's header parser remembers (each a field of at most 12 bytes)
NTI_MEMO = 256


def _archive_frombuf() -> Callable[..., tarfile.TarInfo]:
    """:data:`_frombuf` for one archive, with tarfile's own ``nti`` memoized (``functools.lru_cache``).

    ``nti`` (a header's octal or base-256 number field to an int) is a pure
    function of the field's bytes; a header has eight such fields, and most
    (mode, uid, gid, device numbers, often mtime) repeat from member to member,
    so most calls are answered from the memo (frombuf: ~10 -> ~5.5 us a header).
    tarfile still parses every field: the memo only keeps ``nti``'s own results
    (a field it refuses raises each time: exceptions are not kept), at most
    :data:`NTI_MEMO` of them, for one archive.
    """
    memo = {**_FROMBUF_GLOBALS, "nti": functools.lru_cache(maxsize=NTI_MEMO)(tarfile.nti)}
    return types.FunctionType(_STD_FROMBUF.__code__, memo, _STD_FROMBUF.__name__, _STD_FROMBUF.__defaults__,
                              _STD_FROMBUF.__closure__)


def _guarded_tarinfo(limits: ArchiveLimits, counter: StreamCounter, meter: Meter) -> type[tarfile.TarInfo]:
    state = {"global_bytes": 0}
    budget = PaxBudget()
    frombuf = _archive_frombuf()

    class GuardedTarInfo(tarfile.TarInfo):
        """TarInfo that bounds extension headers before tarfile reads them."""

        @classmethod
        def frombuf(cls, buf, encoding, errors):  # type: ignore[override]
            obj = frombuf(cls, buf, encoding, errors)
            if obj.size < 0:
                raise ArchiveFormatError("a header's size field is negative", member=obj.name or meter.member)
            if obj.type in EXT_TYPES:
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
            budget.charge(counter.peek(self._block(self.size)), self.size, meter.member)
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

    Every header is parsed by tarfile, with all the guards above.

    Raises:
        ArchiveFormatError: the stream is not a valid tar archive.
        ArchiveLimitError, UnsafeArchiveMemberError: see :func:`extract`.
    """
    counter = StreamCounter(stream, meter, splice_fd)
    # new plain files go to Extractor.add_new_file_from (copied from the source file), or with a source
    # that is not a regular file, when the caller asked for it (snapshot hydrate), to
    # Extractor.add_new_file_data (their bytes, read here, kept in the batch)
    batch = ex.can_batch() and (splice_fd >= 0 or ex.batch_in_memory)
    info_cls = _guarded_tarinfo(limits, counter, meter)
    try:
        _read_members(counter, info_cls, ex, meter, check_cancel, batch)
    finally:
        counter.restore_source_offset()


def _read_members(counter: StreamCounter, info_cls: type[tarfile.TarInfo], ex: Extractor, meter: Meter,
                  check_cancel: Callable[[], None] | None, batch: bool) -> None:
    """Open tarfile over ``counter`` and apply every member, one header at a time."""
    try:
        tf = tarfile.open(fileobj=counter, mode="r:", tarinfo=info_cls)
    except (tarfile.TarError, OSError, *PARSE_ERRORS) as exc:
        raise _format_error(exc, meter) from None
    try:
        while True:
            if check_cancel is not None:
                check_cancel()
            try:
                ti = tf.next()
            except (tarfile.TarError, OSError, *PARSE_ERRORS) as exc:
                raise _format_error(exc, meter) from None
            if ti is None:
                break
            tf.members.clear()  # tarfile appends every member: keep memory flat
            _apply(tf, ti, ex, meter, counter, batch)
    finally:
        tf.close()


def _add_plain_file(name: str, mode: int, uid: int, gid: int, size: int, mtime: int, ex: Extractor,
                    counter: StreamCounter, offset_data: int) -> None:
    """A regular member whose data is the next ``size`` bytes of the stream: read them straight
    from the counter (no ExFileObject/_FileInFile layers); a short stream is a format error,
    as tarfile would say."""
    counter.seek(offset_data)
    left = size
    splice = counter.splice if size and counter.can_splice() else None

    def read(n: int) -> bytes | memoryview:
        nonlocal left
        if left <= 0:
            return b""
        data = counter.read_chunk(min(n, left))  # a view of the source's block where it lends one (hydrate)
        if not data:
            raise ArchiveFormatError("unexpected end of data", member=name)
        left -= len(data)
        return data

    ex.add_file(name, read, mode & 0o7777, mtime, declared_size=size, owner=(uid, gid), splice=splice)


def _check_numbers(ti: tarfile.TarInfo) -> None:
    """Refuse a member whose size, or any offset or size of its sparse map, is negative.

    Raises:
        ArchiveFormatError: a negative size, sparse offset or sparse size.
    """
    if ti.size < 0:
        raise ArchiveFormatError("negative member size", member=ti.name)
    sparse = ti.sparse
    if sparse is not None:
        for entry in sparse:
            if any(v < 0 for v in entry):
                raise ArchiveFormatError("negative offset or size in a sparse map", member=ti.name)


def _apply(tf: tarfile.TarFile, ti: tarfile.TarInfo, ex: Extractor, meter: Meter, counter: StreamCounter,
           batch: bool) -> None:
    name = ti.name
    if ti.size < 0 or ti.sparse is not None:
        _check_numbers(ti)  # before the member is counted or anything is made
    ex.count_member(name)
    if ti.isreg():
        if ti.sparse is None and ti.type != tarfile.GNUTYPE_SPARSE:
            if batch and counter.position == ti.offset_data:
                if counter.splice_fd < 0:  # (can_splice() is false without a source file)
                    if ex.add_new_file_data(name, ti.mode, ti.mtime, ti.size, counter):
                        return
                elif counter.can_splice() and \
                        ex.add_new_file_from(name, ti.mode, ti.mtime, ti.size, counter, ti.offset_data):
                    return
            _add_plain_file(name, ti.mode, ti.uid, ti.gid, ti.size, ti.mtime, ex, counter, ti.offset_data)
            return
        fobj = tf.extractfile(ti)  # sparse: tarfile expands the holes
        assert fobj is not None

        def read(n: int) -> bytes:
            try:
                return fobj.read(n)
            except (tarfile.TarError, OSError, *PARSE_ERRORS) as exc:
                raise _format_error(exc, meter) from None

        ex.add_file(name, read, _stat.S_IMODE(ti.mode), ti.mtime, declared_size=ti.size, owner=(ti.uid, ti.gid))
    elif ti.isdir():
        ex.add_dir(name, _stat.S_IMODE(ti.mode), ti.mtime, owner=(ti.uid, ti.gid))
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
