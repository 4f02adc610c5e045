"""Which digest checks a generation's archive: BLAKE3 for what persist writes now, SHA-256 for older ones.

A version-2 generation is checked by one digest of its whole archive,
recorded in its metadata (which the pointer and a session's MAC-protected
state pin by its own SHA-256):

* ``archive_blake3``: BLAKE3 with its default 256-bit output, through the
  ``blake3`` package (the Python binding of the BLAKE3 team's own Rust
  implementation).  Every generation persisted or copied now records this
  one.  BLAKE3 is specified in "BLAKE3: one function, fast everywhere"
  (O'Connor, Aumasson, Neves, Wilcox-O'Hearn, 2020); its 256-bit output
  gives 128-bit collision resistance, as SHA-256 does.  It is chosen for
  speed: on this machine kind it hashes ~8 GB/s on one core where
  hashlib's SHA-256 (with the SHA extensions) does ~1.8 GB/s, and a round
  trip hashes every archive byte twice (persist's writer, hydrate's reader).
* ``archive_sha256``: what generations persisted before carry; still
  checked as before.

Metadata carries at most one of the two (:class:`SnapshotInfo` refuses
both); version-1 metadata carries neither and is checked by its CRC-32.
File contents in the index stay SHA-256 (the index format and the tree
digest are unchanged).
"""

from __future__ import annotations

import hashlib
from typing import Protocol

import blake3

from ._models import SnapshotInfo

__all__ = ["ArchiveHasher", "new_archive_hasher", "archive_check"]


class ArchiveHasher(Protocol):
    """The hasher interface both digests share (``hashlib`` and ``blake3`` objects: ``name`` is the algorithm's)."""

    name: str

    def update(self, data: bytes | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


def new_archive_hasher() -> ArchiveHasher:
    """The hasher persist records a new generation's archive digest with (BLAKE3, ``archive_blake3``)."""
    return blake3.blake3()


def archive_check(info: SnapshotInfo) -> tuple[ArchiveHasher, str] | None:
    """The hasher that checks ``info``'s archive and the hex digest it must end with.

    Args:
        info: a generation's metadata.

    Returns:
        ``(hasher, expected)`` from ``archive_blake3`` when set, else from
        ``archive_sha256`` when set; None when the metadata records neither
        (version 1, checked by its CRC-32; version-2 metadata with neither
        never verifies).
    """
    if info.archive_blake3:
        return blake3.blake3(), info.archive_blake3
    if info.archive_sha256:
        return hashlib.sha256(), info.archive_sha256
    return None
