"""Streaming tar reader: tarfile parses, our rules decide (see ``_writer``).

One pass, never seeking back, never ``getmembers()``: tarfile reads from
:class:`StreamCounter`, a forward-only view of our own decompressor (gzip /
bz2 / lzma from the standard library), so member data flows straight from
the decompressor to the file with no extra stream-buffer copy (measured: the
``"r|"`` stream buffer copied its tail on every read).  Members are taken
with ``next()`` and dropped from ``TarFile.members`` at once so memory does
not grow with the member count.

Header-size bound (the sound way to check before tarfile reads a header body
into memory): tarfile builds every header from its 512-byte block with
``TarInfo.frombuf`` and only then reads the body of a PAX extended header
(``x``/``g``/Solaris ``X``) or a GNU long name/link (``L``/``K``).  Our
``TarInfo`` subclass checks the block's size field in ``frombuf`` and raises
:class:`ArchiveLimitError` before the body is read.  A second bound in
:class:`StreamCounter` caps every byte tarfile reads while parsing one header
chain (sparse maps included), and the chain length is capped so tarfile's
recursion cannot overflow the stack.
"""

from __future__ import annotations

import stat as _stat
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


def _guarded_tarinfo(limits: ArchiveLimits, counter: StreamCounter, meter: Meter) -> type[tarfile.TarInfo]:
    state = {"global_bytes": 0}

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
            _apply(tf, ti, ex, meter, counter)
    finally:
        tf.close()


def _apply(tf: tarfile.TarFile, ti: tarfile.TarInfo, ex: Extractor, meter: Meter, counter: StreamCounter) -> None:
    name = ti.name
    ex.count_member(name)
    owner = (ti.uid, ti.gid)
    if ti.isreg():
        splice = None
        if ti.sparse is None and ti.type != tarfile.GNUTYPE_SPARSE:
            # Plain member: its data is the next ``size`` bytes of the stream.  Read them
            # straight from the counter (no ExFileObject/_FileInFile layers); a short
            # stream is a format error, as tarfile would say.
            counter.seek(ti.offset_data)
            left = ti.size
            if ti.size and counter.can_splice():
                splice = counter.splice

            def read(n: int) -> bytes:
                nonlocal left
                if left <= 0:
                    return b""
                data = counter.read(min(n, left))
                if not data:
                    raise ArchiveFormatError("unexpected end of data", member=name)
                left -= len(data)
                return data
        else:
            fobj = tf.extractfile(ti)  # sparse: tarfile expands the holes
            assert fobj is not None

            def read(n: int) -> bytes:
                try:
                    return fobj.read(n)
                except (tarfile.TarError, OSError, *PARSE_ERRORS) as exc:
                    raise _format_error(exc, meter) from None

        ex.add_file(name, read, _stat.S_IMODE(ti.mode), ti.mtime, declared_size=ti.size, owner=owner, splice=splice)
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
