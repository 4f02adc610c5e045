"""The tar header checksum the extractor checks (``archive/_tar._HeaderSums``) is tarfile's.

tarfile's ``calc_chksums`` unpacks 504 ints per header; the extractor sums
the header in C (Adler-32 pieces) and checks the signed sum only when the
unsigned one does not match.  Both sums must be exactly tarfile's.
"""

from __future__ import annotations

import io
import tarfile

from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_archive_builders import tar_bytes, ti

from sandbox_fs import open_root
from sandbox_fs.archive import ArchiveFormatError, extract
from sandbox_fs.archive import _tar

import pytest


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=512, max_size=512))
@example(bytes(512))
@example(b"\xff" * 512)
def test_the_header_checksum_is_tarfiles(buf):
    unsigned, signed = tarfile.calc_chksums(buf)
    sums = _tar._HeaderSums(buf)
    assert (sums.unsigned, sums.signed()) == (unsigned, signed)
    for x in (unsigned, signed, unsigned + 1, signed - 256, 0, -1):
        assert (x in sums) == (x in (unsigned, signed))


def test_a_header_with_a_signed_checksum_still_parses(layout):
    """An old writer summed the header bytes as signed chars: tarfile accepts it, so do we."""
    data = bytearray(tar_bytes([ti("n\xe9\xe9", data=b"x")], fmt=tarfile.GNU_FORMAT))
    signed = tarfile.calc_chksums(bytes(data[:512]))[1]
    data[148:156] = b"%06o\0 " % signed
    assert signed != tarfile.calc_chksums(bytes(data[:512]))[0]
    with open_root(layout.ws) as root:
        assert extract(root, "dest", io.BytesIO(bytes(data))).files == 1
        data[148:156] = b"%06o\0 " % (signed + 1)  # neither sum: refused
        with pytest.raises(ArchiveFormatError):
            extract(root, "bad", io.BytesIO(bytes(data)))


_FIELDS = ("name", "mode", "uid", "gid", "size", "mtime", "chksum", "type", "linkname", "uname", "gname",
           "devmajor", "devminor")


def _parse(frombuf, buf: bytes):
    try:
        obj = frombuf(tarfile.TarInfo, buf, "utf-8", "surrogateescape")
    except tarfile.HeaderError as exc:
        return type(exc).__name__
    return tuple(getattr(obj, f) for f in _FIELDS)


@settings(max_examples=150, deadline=None)
@given(nums=st.lists(st.tuples(st.integers(0, (1 << 70)), st.integers(0, 1 << 40), st.integers(0, 0o7777)),
                     min_size=1, max_size=6),
       garbage=st.lists(st.tuples(st.integers(0, 5), st.sampled_from([100, 108, 116, 124, 136, 329, 337]),
                                  st.binary(min_size=1, max_size=8)), max_size=4))
def test_the_memoized_header_parser_gives_tarfiles_fields_and_errors(nums, garbage):
    """One archive's parser (``_archive_frombuf``: tarfile's frombuf, its ``nti`` memoized) gives exactly what
    tarfile's own frombuf gives for every header, valid or not, parsed once or again (the memo answering):
    the same fields, the same refusal (a refused number field raises each time, never remembered)."""
    blocks = []
    for size, mtime, mode in nums:
        info = tarfile.TarInfo("f")
        info.size, info.mtime, info.mode, info.uid = size, mtime, mode, mtime % 70000
        blocks.append(bytearray(info.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape")[-512:]))
    for i, at, junk in garbage:  # a number field that is not a number, checksum fixed so that the field decides
        block = blocks[i % len(blocks)]
        block[at:at + len(junk)] = junk
        block[148:156] = b"        "
        block[148:156] = b"%06o\0 " % tarfile.calc_chksums(bytes(block))[0]
    parser = _tar._archive_frombuf()
    std = tarfile.TarInfo.frombuf.__func__
    for _ in range(2):
        for block in blocks:
            assert _parse(parser, bytes(block)) == _parse(std, bytes(block))
