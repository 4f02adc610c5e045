"""The object contract between snapshot generations and where their bytes live.

A snapshot store keeps generations (full archives and incremental layers,
their indexes and metadata) as immutable *objects* under string keys, plus
one small mutable *pointer* object per snapshot name that says which
generation is current.  :class:`ObjectStore` is everything the generation
logic needs from the medium; a local directory and an S3-compatible bucket
each implement it, and the generation, layer, retention and gc rules are
written once on top of it.

Rules every implementation keeps:

- Keys are ``/``-separated ASCII made by the snapshot code (validated names,
  hex digests, generation numbers); an implementation refuses any other key
  with :class:`ValueError` and never maps a key to a host path outside its
  own directory or prefix.
- :meth:`ObjectStore.put_stream` objects become visible only at
  :meth:`ObjectWriter.commit`; an aborted or abandoned writer leaves nothing
  a reader can see (S3: the multipart upload is aborted, or removed by
  :meth:`ObjectStore.abort_stale_uploads`).
- :meth:`ObjectStore.put_bytes` with ``if_match``/``if_none_match`` is a
  compare-and-swap: of two writers expecting the same state, exactly one
  succeeds and the other gets :class:`SnapshotConflictError`.
- Transient failures raise :class:`SnapshotStoreError` (``retryable=True``);
  permanent ones (credentials, missing bucket) the same class with
  ``retryable=False``.  Messages name the key, never a credential.
"""

from __future__ import annotations

from typing import IO, Iterator, NamedTuple, Protocol

__all__ = ["ObjectInfo", "ObjectWriter", "ObjectStore"]


class ObjectInfo(NamedTuple):
    """What the store knows about one object.

    Attributes:
        key: the object's key.
        size: its length in bytes.
        etag: an opaque version tag; :meth:`ObjectStore.put_bytes` compares it
            for ``if_match``.  Changes whenever the object is rewritten.
        mtime: last-modified time, seconds since the epoch (the store's clock).
    """

    key: str
    size: int
    etag: str
    mtime: float


class ObjectWriter(Protocol):
    """A streaming upload of one object (memory bounded by the part size)."""

    def write(self, data: bytes | memoryview) -> int:
        """Append ``data``; returns ``len(data)``.  Raises :class:`SnapshotStoreError`."""
        ...

    def commit(self) -> ObjectInfo:
        """Finish the upload and make the object visible.  Raises :class:`SnapshotStoreError`."""
        ...

    def abort(self) -> None:
        """Discard the upload; nothing becomes visible.  Never raises for an already-finished writer."""
        ...


class ObjectStore(Protocol):
    """Immutable objects plus conditional small writes, under one directory or prefix."""

    def put_stream(self, key: str) -> ObjectWriter:
        """Start a streaming upload of ``key`` (an existing object is replaced at commit)."""
        ...

    def put_bytes(self, key: str, data: bytes, *, if_match: str | None = None,
                  if_none_match: bool = False) -> ObjectInfo:
        """Write a small object, optionally conditionally.

        Args:
            key: the object key.
            data: the whole object (a pointer or metadata; at most a few MiB).
            if_match: succeed only if the current object's etag equals this.
            if_none_match: succeed only if no object ``key`` exists.

        Raises:
            SnapshotConflictError: the condition did not hold.
            SnapshotStoreError: the store failed.
        """
        ...

    def open_range(self, key: str, start: int = 0, length: int | None = None) -> IO[bytes]:
        """A readable stream of ``length`` bytes (or to the end) from byte ``start``.

        Raises:
            SnapshotNotFoundError: no object ``key``.
            SnapshotStoreError: the store failed.
        """
        ...

    def get_bytes(self, key: str, limit: int) -> bytes:
        """The whole of a small object.

        Raises:
            SnapshotNotFoundError: no object ``key``.
            SnapshotLimitError: it is longer than ``limit`` bytes.
            SnapshotStoreError: the store failed.
        """
        ...

    def head(self, key: str) -> ObjectInfo | None:
        """The object's info, or None when it does not exist.  Raises :class:`SnapshotStoreError`."""
        ...

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``, in key order.  Raises :class:`SnapshotStoreError`."""
        ...

    def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is not an error.  Raises :class:`SnapshotStoreError`."""
        ...

    def abort_stale_uploads(self, older_than: float) -> int:
        """Abort unfinished uploads started more than ``older_than`` seconds ago; returns how many.

        The age is measured on the clock the upload's start was stamped
        with (S3: the server's), never a local clock against a server's.
        """
        ...

    def close(self) -> None:
        """Release connections and fds.  Idempotent."""
        ...
