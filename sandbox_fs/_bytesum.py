"""The sum of a byte string's bytes, computed in C: what a tar header's checksum is made of.

A ustar header's checksum is the sum of its 512 bytes, the checksum field
counted as eight spaces (POSIX.1-2001 ``pax``, "ustar Interchange Format").
``sum(data)`` makes a Python int per byte.  Adler-32's low half is one plus
the byte sum modulo 65521 (RFC 1950, section 8), which is the exact sum for a
piece of at most :data:`PIECE_BYTES` bytes (at most 1 + 256 * 255 = 65281).
Persist's header writer (``snapshot/_header``) and the extractor's header
check (``archive/_tar``) both sum with :func:`byte_sum`.
"""

from __future__ import annotations

import zlib

__all__ = ["byte_sum", "PIECE_BYTES"]

#: the longest piece whose byte sum Adler-32's low half gives exactly
PIECE_BYTES = 256


def byte_sum(data: bytes) -> int:
    """The sum of the bytes of ``data`` (any length), as ``sum(data)``.

    Args:
        data: the bytes (``bytes``, ``bytearray`` or a byte ``memoryview``).

    Returns:
        The sum, an int from 0 to ``255 * len(data)``.
    """
    n = len(data)
    if n <= PIECE_BYTES:
        return (zlib.adler32(data) & 0xFFFF) - 1
    total = 0
    for i in range(0, n, PIECE_BYTES):
        total += (zlib.adler32(data[i:i + PIECE_BYTES]) & 0xFFFF) - 1
    return total
