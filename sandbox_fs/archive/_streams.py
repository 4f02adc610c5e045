"""Counting readers and compression detection.

The source is read through :class:`InputCounter` (bytes actually read from
the source: the *compressed* bytes), a tar stream's decompressed bytes through
:class:`StreamCounter`.  :class:`Meter` holds the totals and enforces
``max_input_bytes``, ``max_total_bytes`` and the expansion ratio, measured
while streaming.
"""

from __future__ import annotations

import bz2
import errno
import gzip
import os
import lzma
import struct
import time
import zlib
from typing import Any, BinaryIO

from ._errors import ArchiveFormatError, ArchiveLimitError
from ._models import ArchiveLimits

__all__ = ["CHUNK_BYTES", "Meter", "InputCounter", "SeekCounter", "StreamCounter", "sniff", "decompressor",
           "PARSE_ERRORS"]

# Exceptions the parsers (tarfile, zipfile, gzip, bz2, lzma) raise on bad input.
PARSE_ERRORS: tuple[type[BaseException], ...] = (
    EOFError, zlib.error, lzma.LZMAError, gzip.BadGzipFile, struct.error, UnicodeError,
    NotImplementedError, OverflowError, ValueError, KeyError, IndexError, TypeError,
)

#: the most member data bytes one read or write moves (a long member stays cancellable once a chunk)
CHUNK_BYTES = 1 << 20
#: bytes tarfile may read past a header in one go (one 512-byte block of a sparse map): slack for the header bound.
HEADER_SLACK_BYTES = 4096

_MAGIC = {
    b"\x1f\x8b": "gz",
    b"BZh": "bz2",
    b"\xfd7zXZ\x00": "xz",
    b"\x28\xb5\x2f\xfd": "zst",
    b"PK\x03\x04": "zip",
    b"PK\x05\x06": "zip",
    b"PK\x07\x08": "zip",
}


class Meter:
    """Totals of one extraction and the limits that bound them.

    Attributes:
        input_bytes: bytes read from the source (compressed bytes).
        stream_bytes: decompressed archive-stream bytes (tar only).
        written_bytes: file bytes written to disk.
        member: the member being processed (for error messages).
        cpu_limited: ``max_cpu_seconds`` is set.
    """

    __slots__ = ("limits", "input_bytes", "stream_bytes", "written_bytes", "member", "_ratio", "_grace",
                 "_cpu_limit", "_cpu_start", "cpu_limited")

    def __init__(self, limits: ArchiveLimits) -> None:
        self.limits = limits
        self.input_bytes = 0
        self.stream_bytes = 0
        self.written_bytes = 0
        self.member: str | bytes | None = None
        self._ratio = limits.max_expansion_ratio
        self._grace = limits.ratio_grace_bytes
        self._cpu_limit = limits.max_cpu_seconds
        self._cpu_start = time.thread_time() if self._cpu_limit is not None else 0.0
        self.cpu_limited = self._cpu_limit is not None

    def check_cpu(self) -> None:
        """Enforce ``max_cpu_seconds`` (CPU time of the calling thread since this meter was made).

        Raises:
            ArchiveLimitError: ``max_cpu_seconds`` exceeded.
        """
        if self._cpu_limit is not None:
            used = time.thread_time() - self._cpu_start
            if used > self._cpu_limit:
                raise ArchiveLimitError("max_cpu_seconds", self._cpu_limit, round(used, 3), self.member)

    def add_input(self, n: int) -> None:
        """Count ``n`` bytes read from the source.

        Raises:
            ValueError: ``n`` is negative (an internal invariant: a count never lowers a total).
            ArchiveLimitError: ``max_input_bytes``.
        """
        if n < 0:
            raise ValueError("Meter.add_input: negative byte count")
        self.input_bytes += n
        if self.input_bytes > self.limits.max_input_bytes:
            raise ArchiveLimitError("max_input_bytes", self.limits.max_input_bytes, self.input_bytes, self.member)

    def add_stream(self, n: int) -> None:
        """Count ``n`` decompressed archive-stream bytes.

        Raises:
            ValueError: ``n`` is negative (an internal invariant).
            ArchiveLimitError: ``max_expansion_ratio``, ``max_cpu_seconds``.
        """
        if n < 0:
            raise ValueError("Meter.add_stream: negative byte count")
        self.stream_bytes += n
        if self._cpu_limit is not None:
            self.check_cpu()
        if self.stream_bytes > self._grace:
            self._check_ratio()

    def add_read(self, n: int) -> None:
        """Count ``n`` bytes read from an uncompressed source as both input and stream bytes.

        The same totals and checks, in the same order, as ``add_input(n)``
        then ``add_stream(n)`` (one call: this runs once a read).

        Raises:
            ValueError: ``n`` is negative (an internal invariant).
            ArchiveLimitError: ``max_input_bytes``, ``max_expansion_ratio``, ``max_cpu_seconds``.
        """
        if n < 0:
            raise ValueError("Meter.add_read: negative byte count")
        self.input_bytes += n
        if self.input_bytes > self.limits.max_input_bytes:
            raise ArchiveLimitError("max_input_bytes", self.limits.max_input_bytes, self.input_bytes, self.member)
        stream = self.stream_bytes = self.stream_bytes + n
        if self._cpu_limit is not None:
            self.check_cpu()
        if stream > self._grace:
            self._check_ratio()

    def add_written(self, n: int) -> None:
        """Count ``n`` file bytes written to disk.

        Raises:
            ValueError: ``n`` is negative (an internal invariant).
            ArchiveLimitError: ``max_total_bytes``, ``max_expansion_ratio``, ``max_cpu_seconds``.
        """
        if n < 0:
            raise ValueError("Meter.add_written: negative byte count")
        self.written_bytes += n
        if self._cpu_limit is not None:
            self.check_cpu()
        if self.written_bytes > self.limits.max_total_bytes:
            raise ArchiveLimitError("max_total_bytes", self.limits.max_total_bytes, self.written_bytes, self.member)
        if self.written_bytes > self._grace:
            self._check_ratio()

    def add_skipped(self, n: int, written: int) -> None:
        """Count ``n`` archive bytes stepped over unread and ``written`` of them as file bytes.

        The same totals and checks, in the same order, as ``add_input(n)``,
        ``add_stream(n)``, ``add_written(written)`` (one call: this runs once a member).

        Raises:
            ValueError: ``n`` or ``written`` is negative, or ``written > n``
                (an internal invariant: a count never lowers a total).
            ArchiveLimitError: ``max_input_bytes``, ``max_total_bytes``,
                ``max_expansion_ratio``, ``max_cpu_seconds``.
        """
        if not 0 <= written <= n:
            raise ValueError("Meter.add_skipped: byte counts must satisfy 0 <= written <= n")
        self.input_bytes += n
        if self.input_bytes > self.limits.max_input_bytes:
            raise ArchiveLimitError("max_input_bytes", self.limits.max_input_bytes, self.input_bytes, self.member)
        self.stream_bytes += n
        if self._cpu_limit is not None:
            self.check_cpu()
        if self.stream_bytes > self._grace:
            self._check_ratio()
        self.written_bytes += written
        if self.written_bytes > self.limits.max_total_bytes:
            raise ArchiveLimitError("max_total_bytes", self.limits.max_total_bytes, self.written_bytes, self.member)
        if self.written_bytes > self._grace:
            self._check_ratio()

    def _check_ratio(self) -> None:
        # (max() of two ints, spelled out: this runs once a read and once a file)
        stream, written, read = self.stream_bytes, self.written_bytes, self.input_bytes or 1
        produced = stream if stream >= written else written
        if produced > self._grace and produced > self._ratio * read:
            observed = round(produced / read, 1)
            raise ArchiveLimitError("max_expansion_ratio", self._ratio, observed, self.member,
                                    reason=f"expansion ratio {observed} > {self._ratio} "
                                           f"({produced} bytes from {self.input_bytes} compressed bytes read)")


def _read_to_eof(raw: Any, meter: Meter) -> bytes:
    """Read until EOF in 1 MiB chunks, counting each (the count stops at ``max_input_bytes``)."""
    parts = []
    while True:
        data = raw.read(1 << 20)
        if not data:
            return b"".join(parts)
        meter.add_input(len(data))
        parts.append(data)


class InputCounter:
    """A forward-only reader over the source that counts bytes read.

    ``prefix`` holds bytes already read for format detection; they are
    returned first.  Never seeks.
    """

    def __init__(self, raw: Any, meter: Meter, prefix: bytes = b"") -> None:
        self._raw = raw
        self._meter = meter
        self._prefix = prefix

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def read(self, n: int = -1) -> bytes:
        if self._prefix:
            if n is None or n < 0:
                out = self._prefix + self._read_raw(-1)
                self._prefix = b""
                return out
            out, self._prefix = self._prefix[:n], self._prefix[n:]
            return out
        return self._read_raw(n)

    def _read_raw(self, n: int) -> bytes:
        if n is None or n < 0:
            return _read_to_eof(self._raw, self._meter)
        data = self._raw.read(n)
        if data:
            self._meter.add_input(len(data))
        return data or b""

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def read_into(self, view: memoryview) -> int:
        """Read at most ``len(view)`` bytes into ``view`` (0: the end), counted; straight from the
        source's ``readinto`` when it has one and the sniffed prefix is consumed (no copy between)."""
        readinto = getattr(self._raw, "readinto", None)
        if self._prefix or readinto is None:
            return self.readinto(view)
        n = readinto(view) or 0
        if n:
            self._meter.add_input(n)
        return n

    def passthrough(self) -> Any:
        """The source, once the sniffed prefix is consumed (reads of it are then this counter's reads), else None."""
        return None if self._prefix else self._raw

    def close(self) -> None:  # the caller owns the source
        pass


class SeekCounter:
    """A seekable view of a seekable source that counts bytes read (for zip).

    ``read_budget`` (None: unbounded) caps the bytes the next reads may
    return: a read asking for more is refused *before* reading, as
    ``max_central_directory_bytes`` (zipfile reads the whole central
    directory with one ``read``).
    """

    def __init__(self, raw: BinaryIO, meter: Meter) -> None:
        self._raw = raw
        self._meter = meter
        self.read_budget: int | None = None

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._raw.seek(offset, whence)

    def tell(self) -> int:
        return self._raw.tell()

    def read(self, n: int = -1) -> bytes:
        budget = self.read_budget
        if budget is not None:
            to_eof = n is None or n < 0
            if not to_eof and n > budget:  # refused before reading: no allocation
                raise ArchiveLimitError("max_central_directory_bytes", self._meter.limits.max_central_directory_bytes,
                                        n, None, reason="the zip reader asked for more than the checked "
                                                        "central directory")
            data = self._raw.read(budget + 1 if to_eof else n)
            if len(data) > budget:
                raise ArchiveLimitError("max_central_directory_bytes", self._meter.limits.max_central_directory_bytes,
                                        len(data), None, reason="the zip reader read past the checked "
                                                                "central directory")
            self.read_budget = budget - len(data)
            if data:
                self._meter.add_input(len(data))
            return data
        if n is None or n < 0:
            return _read_to_eof(self._raw, self._meter)
        data = self._raw.read(n)
        if data:
            self._meter.add_input(len(data))
        return data

    def close(self) -> None:
        pass


class StreamCounter:
    """The decompressed tar stream as a *forward-only* seekable file, counting every byte.

    tarfile is opened in random-access mode (``"r:"``) over this object, so
    member data is read straight from the decompressor with no stream-buffer
    copies; a "seek" forward reads and discards (still counted, still bounded
    by the ratio), a seek backward is refused as a format error, so the input
    is still read exactly once, in order.  Decompressor errors become
    :class:`ArchiveFormatError`.

    While tarfile parses a header (``header_depth > 0``) the bytes it reads
    are bounded too: a PAX sparse map or an old-GNU sparse extension chain
    can never pull more than ``max_header_bytes`` (plus slack) into memory.

    An uncompressed tar in a regular file (``splice_fd``) is read at
    explicit offsets (``pread``, ``sendfile`` with an offset) once the
    sniffed prefix is consumed: stepping over member data then needs no
    ``lseek``.  The source's file offset is put back where reads would have
    left it by :meth:`restore_source_offset`.
    """

    def __init__(self, stream: Any, meter: Meter, splice_fd: int = -1) -> None:
        self._stream = stream
        self._meter = meter
        self.position = 0
        self.header_depth = 0
        self.header_start = 0
        self._splice_fd = splice_fd  # a regular, unbuffered, uncompressed source: member data may be sendfile'd
        self._file_base: int | None = None  # source file offset of stream position 0, once reads are direct
        self._source_size = -1  # the source file's size when last asked (fstat)
        self._pushback = b""  # bytes already read (and counted) by peek(), returned again by the next read
        self._direct: Any = None  # the source beneath a bare InputCounter, read without it (see _direct_source)

    @property
    def splice_fd(self) -> int:
        """The source's fd when member data may be copied kernel-side from it, else -1."""
        return self._splice_fd

    def _source_base(self) -> int | None:
        """The source file offset of stream position 0 when reads go straight to the source fd, else None.

        Fixed the first time it is asked with the sniffed prefix consumed and
        nothing pushed back: the source's file offset is then the stream
        position plus that base, and every later read is at an explicit offset.
        """
        base = self._file_base
        if base is None and self._splice_fd >= 0 and not self._pushback and \
                not getattr(self._stream, "_prefix", b""):
            base = self._file_base = os.lseek(self._splice_fd, 0, os.SEEK_CUR) - self.position
        return base

    def restore_source_offset(self) -> None:
        """Put the source's file offset where forward reads would have left it (after direct reads)."""
        if self._file_base is not None:
            try:
                os.lseek(self._splice_fd, self._file_base + self.position + len(self._pushback), os.SEEK_SET)
            except OSError:
                pass

    def has_data(self, offset_data: int, size: int) -> bool:
        """True when the source file holds a member's ``size`` data bytes at ``offset_data`` and their padding.

        Only when :meth:`can_splice` and the stream is at ``offset_data``.
        Asks the kernel for the file's size (``fstat``) only when a member
        ends past the size last seen, so a whole archive usually costs one
        ``fstat``.  A member whose data is not all there must be read one by
        one (the caller's fallback), which writes what exists and then raises
        the same ``unexpected end of data`` (or a limit reached by the bytes
        that do exist) as a stream source: declared sizes are never counted
        for bytes that are not in the archive.

        Raises:
            ValueError: ``size`` is negative (the caller refuses it first).
            OSError: ``lseek``/``fstat`` of the source failed.
        """
        if size < 0:
            raise ValueError("StreamCounter.has_data: negative size")
        base = self._file_base
        assert base is not None  # can_splice() was true
        end = base + offset_data + ((size + 511) & ~511)
        if end <= self._source_size:
            return True
        self._source_size = os.fstat(self._splice_fd).st_size
        return end <= self._source_size

    def skip_data(self, offset_data: int, size: int) -> tuple[int, int]:
        """Step over a member's ``size`` data bytes and their block padding without reading them.

        Only when :meth:`can_splice`, the stream is at ``offset_data`` and
        :meth:`has_data` said the bytes exist.  The bytes are counted (input
        and stream bytes, limits checked) as reads of them would be, and
        ``size`` as written bytes (:meth:`Meter.add_skipped`), then the
        stream position moves past them: the caller copies them later at an
        explicit offset.

        Returns:
            ``(source offset of the data, source offset of the padding's last
            byte or -1 when there is no padding)``; the caller must check that
            byte exists, as tarfile does before the next header.

        Raises:
            ValueError: ``size`` is negative (the caller refuses it first).
            ArchiveLimitError: ``max_input_bytes``, ``max_total_bytes``,
                ``max_expansion_ratio``, ``max_cpu_seconds``.
        """
        if size < 0:
            raise ValueError("StreamCounter.skip_data: negative size")
        blk = (size + 511) & ~511  # tarfile's TarInfo._block
        self._meter.add_skipped(blk, size)
        self.position = offset_data + blk
        assert self._file_base is not None  # can_splice() was true
        start = self._file_base + offset_data
        return start, (start + blk - 1 if blk > size else -1)

    def can_splice(self) -> bool:
        """True when the next bytes can be copied kernel-side from the source fd."""
        return not self._pushback and (self._file_base is not None or self._source_base() is not None)

    def splice(self, dst_fd: int, n: int) -> int:
        """Copy the next ``n`` (or fewer) stream bytes to ``dst_fd`` with ``sendfile``; counted like reads.

        Raises:
            ArchiveFormatError: the source ended early.
        """
        base = self._source_base()
        assert base is not None  # can_splice() was true
        try:
            got = os.sendfile(dst_fd, self._splice_fd, base + self.position, n)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                data = self.read(n)  # fall back to a copy through memory (already counted)
                if not data:
                    raise ArchiveFormatError("unexpected end of data", member=self._meter.member) from None
                return _write_all(dst_fd, data)
            raise
        if got == 0:
            raise ArchiveFormatError("unexpected end of data", member=self._meter.member)
        self.position += got
        self._meter.add_input(got)
        self._meter.add_stream(got)
        return got

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence == 1:
            offset += self.position
        elif whence != 0:
            raise ArchiveFormatError("tar stream: seeking from the end is not possible on a stream")
        if offset < self.position:
            raise ArchiveFormatError("tar stream: a header points backwards (corrupt archive)",
                                     member=self._meter.member)
        left = offset - self.position
        while left > 0:
            data = self.read_chunk(min(left, 1 << 20))  # read and dropped: no copy where the source lends a view
            if not data:
                break  # at EOF: tarfile notices the short read itself
            left -= len(data)
        return self.position

    def peek(self, n: int) -> bytes:
        """Read the next ``n`` bytes (fewer at EOF) and keep them for the next :meth:`read`.

        Counted and bounded once, like any read; the position is unchanged,
        so tarfile then reads exactly these bytes.  Used to validate a PAX
        header body before tarfile's own parser sees it.
        """
        data = self.read(n)
        self.unread(data)
        return data

    def unread(self, data: bytes) -> None:
        """Give back ``data``, the bytes just read (already counted): the next :meth:`read` returns them again."""
        self._pushback = data + self._pushback
        self.position -= len(data)

    def _direct_source(self) -> Any:
        """The source beneath an :class:`InputCounter` stream (uncompressed, no source file to ``pread``) once
        its sniffed prefix is consumed, else None.

        Reads then go to it straight, each counted as the InputCounter counts
        it (:meth:`Meter.add_input` once a source read) and as this counter
        counts (:meth:`Meter.add_stream`): :meth:`Meter.add_read` for a full
        read.  Kept once found: the prefix never comes back.
        """
        stream = self._stream
        if self._splice_fd < 0 and type(stream) is InputCounter:
            self._direct = stream.passthrough()
        return self._direct

    def _header_bound(self) -> None:
        """While tarfile parses a header chain: refuse it past ``max_header_bytes`` (plus slack).

        Raises:
            ArchiveLimitError: ``max_header_bytes``.
        """
        if self.position - self.header_start > self._meter.limits.max_header_bytes + HEADER_SLACK_BYTES:
            raise ArchiveLimitError("max_header_bytes", self._meter.limits.max_header_bytes,
                                    self.position - self.header_start, self._meter.member,
                                    reason="tar header data (PAX, GNU long name or sparse map) is too large")

    def _corrupt(self, exc: BaseException) -> ArchiveFormatError:
        return ArchiveFormatError(f"corrupt compressed data: {type(exc).__name__}", member=self._meter.member,
                                  diagnostic=str(exc))

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = 1 << 20  # tarfile never asks for "all"; stay bounded anyway
        if self._pushback:
            data, self._pushback = self._pushback[:n], self._pushback[n:]
            self.position += len(data)
            if len(data) < n and not self._pushback:
                more = self.read(n - len(data))
                data += more
            return data
        raw = self._direct
        if raw is not None or (self._splice_fd < 0 and (raw := self._direct_source()) is not None):
            try:
                data = raw.read(n) or b""
                got = len(data)
                if got and got != n:  # short (a pipe): counted once a source read, as InputCounter counts
                    self._meter.add_input(got)
                    data = self._read_rest(raw, data, n)
            except (OSError, *PARSE_ERRORS) as exc:
                raise self._corrupt(exc) from None
            if got:
                if got == n:
                    self._meter.add_read(got)
                else:
                    self._meter.add_stream(len(data))
                self.position += len(data)
                if self.header_depth:
                    self._header_bound()
            return data
        try:
            base = self._file_base if self._file_base is not None else self._source_base()
            if base is not None:  # the source file itself, at an explicit offset (counted as InputCounter would)
                data = os.pread(self._splice_fd, n, base + self.position)
                if data and len(data) < n:  # tarfile wants full reads; a regular file reads short at its end
                    parts = [data]
                    got = len(data)
                    while got < n:
                        more = os.pread(self._splice_fd, n - got, base + self.position + got)
                        if not more:
                            break
                        parts.append(more)
                        got += len(more)
                    data = b"".join(parts)
                if data:
                    self._meter.add_input(len(data))
            else:
                data = self._read_stream(n)
        except (OSError, *PARSE_ERRORS) as exc:
            raise self._corrupt(exc) from None
        if data:
            self.position += len(data)
            self._meter.add_stream(len(data))
            if self.header_depth:
                self._header_bound()
        return data

    def _read_rest(self, raw: Any, data: bytes, n: int) -> bytes:
        """``data`` (a short read of the direct source) and up to ``n - len(data)`` more bytes, each read counted."""
        parts = [data]
        got = len(data)
        while got < n:
            more = raw.read(n - got)
            if not more:
                break
            self._meter.add_input(len(more))
            parts.append(more)
            got += len(more)
        return b"".join(parts)

    def read_into(self, view: memoryview) -> int:
        """Read the next ``len(view)`` bytes (fewer only at the end) into ``view``; counted as :meth:`read` counts.

        From an :class:`InputCounter` stream (uncompressed, not a source file,
        nothing pushed back) the bytes go from the source's ``readinto``
        straight into ``view``; otherwise through :meth:`read`.

        Returns:
            The count of bytes read.

        Raises:
            The errors of :meth:`read`.
        """
        n = len(view)
        raw = self._direct
        if raw is None and (self._splice_fd >= 0 or (raw := self._direct_source()) is None) \
                or self._pushback or getattr(raw, "readinto", None) is None:
            data = self.read(n)
            view[:len(data)] = data
            return len(data)
        meter = self._meter
        got = 0
        try:
            k = raw.readinto(view) or 0
            if k == n:  # full: the common case
                meter.add_read(k)
                got = k
            else:
                while k:
                    meter.add_input(k)
                    got += k
                    if got >= n:
                        break
                    k = raw.readinto(view[got:]) or 0
                if got:
                    meter.add_stream(got)
        except (OSError, *PARSE_ERRORS) as exc:
            raise self._corrupt(exc) from None
        if got:
            self.position += got
            if self.header_depth:
                self._header_bound()
        return got

    def read_chunk(self, n: int) -> bytes | memoryview:
        """The next bytes of member data, at most ``n`` (fewer: the end, or a source block's end), counted.

        From a direct source (see :meth:`_direct_source`) that offers
        ``read_view(n)`` (a read-only view of at most ``n`` next bytes, as
        hydrate's verifying reader gives of its hashed blocks), outside a
        header and with nothing pushed back: that view, no copy made.
        Otherwise :meth:`read` (a full read).  Empty only at the end.

        Raises:
            The errors of :meth:`read`.
        """
        raw = self._direct
        if raw is None and self._splice_fd < 0:
            raw = self._direct_source()
        view_of = getattr(raw, "read_view", None) if raw is not None else None
        if view_of is None or self._pushback or self.header_depth:
            return self.read(n)
        try:
            data = view_of(n)
        except (OSError, *PARSE_ERRORS) as exc:
            raise self._corrupt(exc) from None
        got = len(data)
        if got:
            self._meter.add_read(got)
            self.position += got
        return data

    def read_member_into(self, view: memoryview, size: int) -> int:
        """Read a member's ``size`` data bytes into ``view`` and, from a direct source, its block padding too.

        ``view`` is ``size`` rounded up to the tar block (512 bytes) long.
        From the source beneath a bare :class:`InputCounter` (see
        :meth:`_direct_source`; nothing pushed back) the data and the padding
        are read at once, so tarfile's step to the next header reads nothing;
        the padding is then counted with the data, before the caller counts
        the written bytes (tarfile's step counted it after them: on such a
        stream the input and stream totals are equal, so the expansion ratio
        cannot be reached either way, and ``max_input_bytes`` is reached by
        the same byte).  Otherwise only the data is read (:meth:`read_into`).

        Returns:
            The bytes read: fewer than ``size`` only when the stream ended
            inside the data; more than ``size`` when padding was read (and
            counted) too.

        Raises:
            The errors of :meth:`read`.
        """
        if not self._pushback and (self._direct is not None or self._direct_source() is not None):
            return self.read_into(view)
        with view[:size] as data:
            return self.read_into(data)

    def _read_stream(self, n: int) -> bytes:
        """Read ``n`` bytes (fewer only at the end) from the decompressor or the source's reader."""
        data = self._stream.read(n)
        if data and len(data) < n:  # pipes and the sniffed prefix give short reads: tarfile wants full ones
            parts = [data]
            got = len(data)
            while got < n:
                more = self._stream.read(n - got)
                if not more:
                    break
                parts.append(more)
                got += len(more)
            data = b"".join(parts)
        return data

    def close(self) -> None:
        pass


def _write_all(fd: int, data: bytes) -> int:
    view = memoryview(data)
    off = 0
    while off < len(view):
        off += os.write(fd, view[off:])
    return off


def sniff(reader: Any, n: int = 6) -> bytes:
    """Read up to ``n`` bytes (fewer only at EOF) for format detection."""
    out = b""
    while len(out) < n:
        chunk = reader.read(n - len(out))
        if not chunk:
            break
        out += chunk
    return out


def detect(head: bytes) -> str:
    """Return ``"gz" | "bz2" | "xz" | "zst" | "zip"`` from the first bytes, else ``"tar"``."""
    for magic, kind in _MAGIC.items():
        if head.startswith(magic):
            return kind
    return "tar"


def decompressor(kind: str, reader: Any) -> Any:
    """Wrap ``reader`` in a streaming decompressor for ``kind`` (``"tar"``: no compression).

    Raises:
        ArchiveFormatError: ``kind`` is ``"zst"`` (no well-kept zstd library
            is a dependency of sandbox-fs) or unknown.
    """
    if kind == "tar":
        return reader
    if kind == "gz":
        return gzip.GzipFile(fileobj=reader, mode="rb")
    if kind == "bz2":
        return bz2.BZ2File(reader, mode="rb")
    if kind == "xz":
        return lzma.LZMAFile(reader, mode="rb")
    if kind == "zst":
        raise ArchiveFormatError("zstd-compressed archives are not supported (no zstd library is a dependency)")
    raise ArchiveFormatError(f"unknown compression {kind!r}")
