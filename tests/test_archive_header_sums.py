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
