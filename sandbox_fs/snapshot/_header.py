"""Tar member headers for persist: ustar when the member fits, a PAX extended header before it otherwise.

Persist describes entries it has just ``fstat``-ed, so building their
headers is writing, not parsing untrusted input: this module writes them
itself (about a tenth of the cost of :meth:`tarfile.TarInfo.tobuf`), while
everything that *reads* a tar stays with :mod:`tarfile`.

The bytes are exactly those of ``TarInfo.tobuf(tarfile.PAX_FORMAT, "utf-8",
"surrogateescape")`` for the same fields (``uname``/``gname`` empty, no
device numbers), so what tarfile, GNU tar and bsdtar read back is what
tarfile's own writer would have produced (``tests/test_snapshot_header.py``
checks both the bytes and the three readers' decoded fields):

* the ustar header block (POSIX.1-1988 ``ustar`` with POSIX.1-2001's
  ``"ustar\\0" "00"`` magic): name and link target of at most 100 bytes,
  octal size and mtime below ``8 ** 11`` (8 GiB; year 2242), uid and gid
  below ``8 ** 7``; the ``prefix`` field is never used (as tarfile's PAX
  writer; a longer name goes to a PAX record);
* when a field does not fit, or a name or link target is not ASCII, a PAX
  extended header (POSIX.1-2001 ``pax`` interchange format, typeflag
  ``x``, named ``././@PaxHeader`` as tarfile and star name it) precedes the
  ustar block, with ``path``, ``linkpath``, ``uid``, ``gid``, ``size`` and
  ``mtime`` records, in that order, for the fields that need one; the
  ustar block then holds the ASCII form of the names (``?`` for each
  non-ASCII character, cut to 100 bytes) and 0 for each number that
  overflowed;
* names are ``str`` as :func:`os.fsdecode` gives them (UTF-8 with
  ``surrogateescape``), and every record carries the name's original
  bytes: a name that is not valid UTF-8 makes the header start with
  ``hdrcharset=BINARY`` (POSIX.1-2008), as tarfile writes and reads it.

mtime is whole seconds (an ``int``: persist records no sub-second times),
any sign: a negative one, or one from year 2242 on, goes to a PAX record.
"""

from __future__ import annotations

from typing import NamedTuple

from .._bytesum import byte_sum

__all__ = ["MemberHeader", "encode_header", "encode_listed", "ustar_fits", "BLOCK_BYTES"]

BLOCK_BYTES = 512
_MAX_11_DIGITS = 8 ** 11  # size and mtime: 11 octal digits
_MAX_7_DIGITS = 8 ** 7  # mode, uid, gid: 7 octal digits
_DIRTYPE = b"5"
_KINDS = (b"0", b"1", b"2", b"5")  # regular file, hard link, symlink, directory: what persist writes
_PAX_TYPE = b"x"
_PAX_NAME = b"././@PaxHeader"
# After the link target: magic and version, empty uname/gname (32 bytes each), empty
# devmajor/devminor (8 each: no device members), empty prefix (155) and the block's last 12.
_TAIL = b"ustar\x0000" + bytes(32 + 32 + 8 + 8 + 155 + 12)
# The checksum is the sum of the block's bytes with the 8 checksum bytes counted as spaces.
_TAIL_SUM = sum(_TAIL) + 8 * 0x20


class MemberHeader(NamedTuple):
    """The fields of one tar member header.

    Attributes:
        name: member name (``str``, UTF-8 with ``surrogateescape`` for bytes
            that are not UTF-8); a directory's gets a trailing ``/``.
        kind: tar typeflag: ``tarfile.REGTYPE``, ``LNKTYPE``, ``SYMTYPE`` or ``DIRTYPE``.
        mode: permission bits; only ``mode & 0o7777`` is written.
        mtime: modification time, whole seconds since the epoch (any sign).
        size: data bytes that follow the header (0 for non-files), >= 0.
        linkname: link target (symlink text, or a hard link's member name).
        uid: owner user id, >= 0.
        gid: owner group id, >= 0.
    """

    name: str
    kind: bytes
    mode: int
    mtime: int
    size: int = 0
    linkname: str = ""
    uid: int = 0
    gid: int = 0


def ustar_fits(name: str, linkname: str, size: int, mtime: int, uid: int = 0, gid: int = 0) -> bool:
    """True when a member needs no PAX header: its ustar block holds every field exactly.

    ``name`` is the member name as written (a directory's with its trailing ``/``).
    """
    return len(name) <= 100 and len(linkname) <= 100 and name.isascii() and linkname.isascii() \
        and 0 <= size < _MAX_11_DIGITS and 0 <= mtime < _MAX_11_DIGITS \
        and 0 <= uid < _MAX_7_DIGITS and 0 <= gid < _MAX_7_DIGITS


def encode_header(m: MemberHeader) -> bytes:
    """The header bytes of member ``m``: one ustar block, or a PAX extended header and then one.

    Returns:
        ``512 * k`` bytes (k >= 1), equal to ``tobuf(tarfile.PAX_FORMAT,
        "utf-8", "surrogateescape")`` of a TarInfo with the same fields.

    Raises:
        ValueError: ``size``, ``uid`` or ``gid`` is negative; the name is
            empty (or only slashes), or ends in ``/`` but is not a directory's (tarfile strips
            that ``/`` from a PAX path but not from a ustar name); a name
            holds a NUL (no file name can; the ustar field would end there);
            or ``kind`` is
            not one of the four typeflags above (no devices, FIFOs or
            contiguous files: persist never writes them).
        TypeError: a field has the wrong type (``mtime`` must be an ``int``).
        UnicodeEncodeError: a name holds a surrogate that ``surrogateescape``
            did not make (not from :func:`os.fsdecode`; tarfile refuses it too).
    """
    name, kind, mode, mtime, size, linkname, uid, gid = m
    if type(mtime) is not int or type(size) is not int or type(uid) is not int or type(gid) is not int:
        raise TypeError("header numbers must be int (mtime in whole seconds)")
    if size < 0 or uid < 0 or gid < 0:
        raise ValueError("size, uid and gid cannot be negative")
    if kind not in _KINDS:
        raise ValueError("kind must be REGTYPE, LNKTYPE, SYMTYPE or DIRTYPE")
    if "\0" in name or "\0" in linkname:
        raise ValueError("a member name or link target cannot hold NUL")
    if kind == _DIRTYPE:
        if not name.endswith("/"):
            name += "/"
    elif name.endswith("/"):
        raise ValueError("only a directory's member name ends in /")
    if not name.rstrip("/"):
        raise ValueError("a member name cannot be empty (or only slashes)")
    if ustar_fits(name, linkname, size, mtime, uid, gid):
        return _ustar(name.encode("ascii"), kind, mode & 0o7777, mtime, size, linkname.encode("ascii"), uid, gid)
    return _pax(name, kind, mode & 0o7777, mtime, size, linkname, uid, gid)


def encode_listed(name: str, kind: bytes, mode: int, mtime: int, size: int = 0, linkname: str = "") -> bytes:
    """:func:`encode_header` of a member that :func:`ustar_fits`, with fields taken from the file system.

    The same bytes as ``encode_header(MemberHeader(name, kind, mode, mtime,
    size, linkname))``, without its argument checks, which such fields
    always pass: ``name`` is a walk path (never empty, no NUL, ending in
    ``/`` exactly when ``kind`` is a directory's), ``linkname`` a link target
    or member name (no NUL), ``kind`` one of the four persist writes,
    ``mtime`` and ``size`` ints from ``fstat``.  The caller checked
    :func:`ustar_fits` (so both names are ASCII).
    """
    return _ustar(name.encode("ascii"), kind, mode & 0o7777, mtime, size, linkname.encode("ascii"), 0, 0)


def _ustar(name: bytes, kind: bytes, mode: int, mtime: int, size: int, link: bytes, uid: int, gid: int) -> bytes:
    """One ustar block; every field must already fit (names ASCII and at most 100 bytes, numbers in range)."""
    head = b"%s%07o\0%07o\0%07o\0%011o\0%011o\0" % (name.ljust(100, b"\0"), mode, uid, gid, size, mtime)
    linkf = link.ljust(100, b"\0")
    assert len(head) == 148 and len(linkf) == 100, "a ustar field does not fit"
    chksum = byte_sum(head) + byte_sum(link) + kind[0] + _TAIL_SUM  # (linkf's NUL padding adds nothing)
    return b"".join((head, b"%06o\0 " % chksum, kind, linkf, _TAIL))


def _record(keyword: bytes, value: bytes) -> bytes:
    """One PAX record ``"<length> <keyword>=<value>\\n"``; the length counts its own digits."""
    n = len(keyword) + len(value) + 3  # ' ', '=', '\n'
    length = n + len(str(n))
    if len(str(length)) != len(str(n)):  # one more digit once the digits are counted (e.g. 98 -> 101)
        length = n + len(str(length))
    return b"%d %s=%s\n" % (length, keyword, value)


def _pax(name: str, kind: bytes, mode: int, mtime: int, size: int, linkname: str, uid: int, gid: int) -> bytes:
    """A PAX extended header with the records the ustar block cannot hold, then that ustar block."""
    texts = []
    if len(name) > 100 or not name.isascii():
        texts.append((b"path", name))
    if len(linkname) > 100 or not linkname.isascii():
        texts.append((b"linkpath", linkname))
    binary = False
    for _kw, text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # bytes that are not UTF-8 (surrogateescape): the records are raw bytes
            binary = True
    records = [b"21 hdrcharset=BINARY\n"] if binary else []
    records.extend(_record(kw, text.encode("utf-8", "surrogateescape")) for kw, text in texts)
    fields = {"uid": uid, "gid": gid, "size": size, "mtime": mtime}
    for kw, limit in (("uid", _MAX_7_DIGITS), ("gid", _MAX_7_DIGITS), ("size", _MAX_11_DIGITS),
                      ("mtime", _MAX_11_DIGITS)):
        value = fields[kw]
        if not 0 <= value < limit:
            records.append(_record(kw.encode("ascii"), b"%d" % value))
            fields[kw] = 0  # the ustar field holds 0; the record holds the value
    body = b"".join(records)
    ext = _ustar(_PAX_NAME, _PAX_TYPE, 0, 0, len(body), b"", 0, 0)
    pad = bytes(-len(body) % BLOCK_BYTES)
    member = _ustar(name.encode("ascii", "replace")[:100], kind, mode, fields["mtime"], fields["size"],
                    linkname.encode("ascii", "replace")[:100], fields["uid"], fields["gid"])
    return b"".join((ext, body, pad, member))
