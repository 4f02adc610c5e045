"""byte_sum (sandbox_fs/_bytesum.py), the byte sum both tar header checksums are made of, is sum()."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from sandbox_fs._bytesum import PIECE_BYTES, byte_sum


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=3 * PIECE_BYTES + 7))
@example(b"")
@example(b"\xff" * PIECE_BYTES)  # the largest sum one piece holds
@example(b"\xff" * (PIECE_BYTES + 1))  # one piece more: 1 + 257 * 255 would wrap modulo 65521
@example(b"\xff" * 512)  # a whole header block of 0xff
def test_byte_sum_is_sum(data):
    assert byte_sum(data) == sum(data)
    assert byte_sum(memoryview(data)) == sum(data)
    assert byte_sum(bytearray(data)) == sum(data)
