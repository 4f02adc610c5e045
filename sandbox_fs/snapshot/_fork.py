"""Fork a snapshot under a new name: shared where the store allows it, else copied through the store API."""

from __future__ import annotations

import secrets
import zlib

from ._digest import archive_check
from ._errors import SnapshotConflictError, SnapshotCorruptError, SnapshotError
from ._generations import GenerationStore
from ._models import SnapshotInfo, SnapshotLimits, validate_name
from ._store import SnapshotStore

__all__ = ["fork_snapshot", "copy_snapshot"]

_CHUNK = 1 << 20


def fork_snapshot(store: SnapshotStore, source: str, target: str, *, generation: int | None = None,
                  digest: str | None = None, limits: SnapshotLimits | None = None) -> tuple[SnapshotInfo, bool]:
    """Make snapshot ``target`` hold what the current snapshot ``source`` holds.

    A :class:`GenerationStore` (a local object directory, S3) *shares*: see
    :meth:`GenerationStore.fork`; nothing is copied and ``target`` starts at
    ``source``'s generation.  Any other enabled store (the version-1
    :class:`LocalSnapshotStore`, a host's own store) gets a *copy* through
    the :class:`SnapshotStore` methods: the archive, verified by
    ``open_archive``, is streamed into ``begin(target)`` in 1 MiB chunks
    (memory bounded by the chunk, whatever the archive's size) and committed
    with the source's metadata; ``target`` starts at the store's first
    generation.  A store that keeps nothing (:class:`NoSnapshot`) is refused.

    Args:
        store: the snapshot store.
        source: the snapshot to fork (a plain token).
        target: the new snapshot name (a plain token, not ``source``).
        generation: the generation ``source`` must be at (None: whichever is current).
        digest: the metadata SHA-256 ``source`` must have (None: not checked).
        limits: ``max_archive_bytes`` bounds a copied archive.

    Returns:
        ``(info, shared)``: the new snapshot's metadata (its ``generation``
        and ``digest`` are what a state records) and whether the store
        shares the source's objects (True) or copied them (False).

    Raises:
        InvalidPathError: ``source`` or ``target`` is not a plain token.
        SnapshotError: the store keeps no snapshots.
        SnapshotNotFoundError: no snapshot ``source`` (or not at ``generation``, with a GenerationStore).
        SnapshotConflictError: ``target`` is ``source`` or exists; or ``source``
            is no longer at ``generation`` / ``digest`` (a copying store).
        SnapshotCorruptError: the source does not verify, is not ``digest`` (a GenerationStore),
            or changed while it was copied.
        SnapshotLimitError: a copied archive is larger than ``max_archive_bytes``.
        SnapshotStoreError, OSError: the store failed; nothing was made.
    """
    validate_name(source)
    validate_name(target)
    if isinstance(store, GenerationStore):
        legacy = store.legacy_store(source)  # a version-1 snapshot a directory store still holds: copied
        if legacy is None:
            return store.fork(source, target, generation=generation, digest=digest), True
        return copy_snapshot(legacy, store, source, target, generation, digest, limits or SnapshotLimits()), False
    if not store.enabled:
        raise SnapshotError("the store keeps no snapshots: there is nothing to fork", sandbox_path=None,
                            context={"snapshot": source})
    return copy_snapshot(store, store, source, target, generation, digest, limits or SnapshotLimits()), False


def copy_snapshot(src: SnapshotStore, store: SnapshotStore, source: str, target: str, generation: int | None,
                  digest: str | None, limits: SnapshotLimits) -> SnapshotInfo:
    """Copy the current snapshot ``source`` of ``src`` to new name ``target`` of ``store``, through their methods.

    The copying half of :func:`fork_snapshot`, shared within the package
    (:meth:`DirectorySnapshotStore.fork` copies a version-1 source with it):
    the archive, verified by ``src.open_archive``, is streamed in 1 MiB
    chunks into ``store.begin(target)`` and committed with the source's
    metadata, once what was written matched the source's archive digest (CRC-32 for
    a version-1 source; see ``_OwnDigest``).  ``src`` and ``store`` are one
    store, or a store and the version-1 store its directory still holds
    ``source`` in.  Names are checked by the caller.

    Args:
        src: the store ``source`` is read from.
        store: the store ``target`` is written to.
        source: the snapshot to copy.
        target: the new name (not ``source``, not in ``store``).
        generation: the generation ``source`` must be at (None: not checked).
        digest: the metadata SHA-256 ``source`` must have (None: not checked).
        limits: ``max_archive_bytes`` bounds the archive.

    Returns:
        The committed metadata of ``target`` (as ``store`` read it back).

    Raises:
        SnapshotConflictError: ``target`` is ``source`` or exists, or
            ``source`` is not at ``generation`` / ``digest``; nothing was made.
        SnapshotNotFoundError: no snapshot ``source`` in ``src``.
        SnapshotCorruptError: the source does not verify, changed while it was copied, or its version-2
            metadata records no archive digest.
        SnapshotLimitError: the archive is larger than ``max_archive_bytes``.
        SnapshotStoreError, OSError: a store failed; nothing was made.
    """
    ctx = {"snapshot": source, "target": target}
    if target == source or store.info(target) is not None:
        raise SnapshotConflictError("the fork's snapshot name is in use; nothing was made", sandbox_path=None,
                                    context=ctx)
    reader, info = src.open_archive(source, limits)  # verified by the store
    with reader:
        if (generation is not None and info.generation != generation) or (digest is not None and info.digest != digest):
            raise SnapshotConflictError("the source snapshot changed since its state was taken; nothing was made",
                                        sandbox_path=None, context=ctx)
        own = _OwnDigest(info)
        if own.check is None and info.version != 1:
            raise SnapshotCorruptError("the source snapshot's metadata records no archive digest; nothing was made",
                                       sandbox_path=None, context=ctx)
        pending = store.begin(target)
        try:
            left = info.archive_bytes
            while left > 0:
                chunk = reader.read(min(_CHUNK, left))
                if not chunk:
                    break
                pending.stream.write(chunk)
                own.update(chunk)
                left -= len(chunk)
            pending.stream.flush()
            if pending.sink.count != info.archive_bytes or not own.matches():
                raise SnapshotCorruptError("the source archive changed while it was copied; nothing was made",
                                            sandbox_path=None, context=ctx)
            copy = info.model_copy(update={"name": target, "archive": f"{target}.{secrets.token_hex(8)}.tar",
                                           "generation": 0, "digest": ""})
            committed = store.commit(pending, copy)
        except BaseException:
            store.abort(pending)
            raise
    if committed is None:  # a store without generations: what was committed is ``copy``, read back
        committed = store.info(target) or copy
    return committed


class _OwnDigest:
    """How :func:`copy_snapshot` checks that what it copied is the archive the source metadata describes.

    The digest of the chunks as they are written: the archive digest the
    metadata records (BLAKE3 or, in an older version-2 generation, SHA-256:
    :func:`._digest.archive_check`), else the CRC-32 against
    ``archive_crc32`` (version 1 only: a version-2 CRC-32 is never relied
    on, and :func:`copy_snapshot` refuses version-2 metadata with no archive
    digest before copying, as hydrate does).  Metadata recording none never matches.
    """

    def __init__(self, info: SnapshotInfo) -> None:
        self.info = info
        self.check = archive_check(info)
        self.crc = 0

    def update(self, chunk: bytes) -> None:
        if self.check is not None:
            self.check[0].update(chunk)
        else:
            self.crc = zlib.crc32(chunk, self.crc)

    def matches(self) -> bool:
        if self.check is not None:
            return self.check[0].hexdigest() == self.check[1]
        return self.info.version == 1 and bool(self.info.archive_crc32) and f"{self.crc:08x}" == self.info.archive_crc32
