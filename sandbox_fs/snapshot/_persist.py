"""Persist: stream the workspace into a store as one snapshot.

*Persist* walks the workspace through its :class:`~sandbox_fs.root.Root`
(fd-based, never follows a symlink) and streams a POSIX.1-2001 (PAX) tar
with workspace-relative member names straight into a :class:`SnapshotStore`:
an unnamed ``O_TMPFILE`` (or a uniquely named partial file) in the store
directory, ``fsync``, then an atomic link/rename and an atomic rewrite of the
snapshot's metadata.
"""

from __future__ import annotations

import secrets
import time
from typing import Callable, Iterable, Literal

from ..root import Root
from ._entries import _walk_into, fingerprint
from ._generations import GenerationStore, _PendingGeneration
from ._layers import Layering
from ._objects_local import LocalObjects
from ._models import (
    SNAPSHOT_VERSION,
    SNAPSHOT_VERSION_OBJECTS,
    PersistReport,
    SnapshotInfo,
    SnapshotLimits,
    SnapshotPolicy,
    validate_name,
)
from ._store import SnapshotStore
from ._tar import _TarStream
from ._walk import _Prune
from ._where import refuse_store_in_workspace

__all__ = ["persist"]


def persist(ws: Root, store: SnapshotStore, name: str, *, manifest_digest: str = "",
            excluded: Iterable[str] = (), mount_points: Iterable[str] = (),
            skip_identities: Iterable[tuple[int, int]] = (),
            on_unrestorable: Literal["refuse", "skip"] = "refuse",
            limits: SnapshotLimits | None = None,
            progress: Callable[[int, int], None] | None = None,
            expect_generation: int | None = None, expect_digest: str | None = None) -> PersistReport:
    """Stream the workspace into ``store`` as snapshot ``name``.  Blocking: call from one worker thread.

    Uses one more thread of its own once the archive outgrows one buffer
    (the archive writer, see :class:`_WriterThread`), always joined before
    this returns or raises.

    Args:
        ws: the workspace Root (read through it only; never follows a symlink).
        store: the destination; :class:`NoSnapshot` makes this a no-op.
        name: snapshot name, a plain token (see :func:`validate_name`).
        manifest_digest: the manifest's digest, folded into the fingerprint.
        excluded: relative sandbox paths left out (ephemeral entries,
            registered persist skip paths); recorded in the metadata.
        mount_points: relative sandbox paths of mounts (also found by ``st_dev``).
        skip_identities: ``(st_dev, st_ino)`` of directories never entered
            (extra path grants nested in the workspace: grants are never persisted).
        on_unrestorable: ``"refuse"`` (default) raises on an entry hydrate
            would refuse; ``"skip"`` leaves it out and lists it in the report.
        limits: the same :class:`SnapshotLimits` hydrate will apply.
        progress: called with ``(entries, content_bytes)`` at most every 0.2 s.
        expect_generation: with a :class:`GenerationStore`, the generation of
            ``name`` the caller last saw current (0: none); the persist is
            refused when another is current, and its commit when another
            writer committed meanwhile (None: only the latter).
        expect_digest: with a :class:`GenerationStore`, the metadata digest of
            the generation the caller last saw current; another one is a conflict.

    With a :class:`GenerationStore`, persist records the new generation's
    index and, when the current generation has one taken on this device (or
    hydrate left a baseline for it) and its chain is short enough, writes a
    *layer*: only the entries changed since then, and the deletion list (see
    :mod:`~sandbox_fs.snapshot._layers`).  The fingerprint comes from the
    walk's digest, which takes unchanged files' SHA-256 from the index.

    Returns:
        A :class:`PersistReport`; ``info`` is the committed snapshot.

    Raises:
        UnrestorableEntryError: an absolute/escaping symlink, FIFO, socket or
            device node, with ``on_unrestorable="refuse"``.
        SnapshotLimitError: the workspace exceeds ``limits``.
        SnapshotSourceChangedError: a file shrank, grew or was swapped
            (symlink, FIFO, another inode) while read, or an entry is no
            longer at its path beneath the workspace (a directory moved
            while the walk held it) (retryable).
        InvalidPathError: ``name`` is not a plain token.
        SnapshotConflictError: another writer committed ``name`` first
            (:class:`GenerationStore`; not retryable).
        OSError: the store cannot be written (ENOSPC ...).  In every error
            case the previous snapshot of ``name`` stays current and intact.
    """
    validate_name(name)
    refuse_store_in_workspace(ws, store)
    policy = SnapshotPolicy(limits or SnapshotLimits())
    prune = _Prune.of(excluded, mount_points, skip_identities)
    if not store.enabled:
        return PersistReport(None, [])
    layering: Layering | None = None
    if isinstance(store, GenerationStore):
        pending = store.begin(name, expect_generation=expect_generation, expect_digest=expect_digest)
    else:
        pending = store.begin(name)
    try:
        if isinstance(pending, _PendingGeneration):
            layering = Layering(ws, store.parent_index(pending, policy) if isinstance(store, GenerationStore)
                                else None, pending.generation,
                                stored=isinstance(getattr(store, "objects", None), LocalObjects))
            pending.layered = layering.layered
        tar = _TarStream(pending.sink)
        try:
            walked = _walk_into(ws, prune, policy, on_unrestorable, tar, progress,
                                layering.setup if layering is not None else None)
            tar.close()
        finally:
            tar.stop()  # the writer thread is joined before the archive's fd can be closed
        if layering is not None and isinstance(pending, _PendingGeneration):
            pending.index = layering.index(pending.generation)
        policy.check_archive_bytes(pending.sink.count)  # hydrate would not read a larger one
        tree = walked.digest.hexdigest()
        info = SnapshotInfo(  # a generation (version 2) has no CRC-32: its BLAKE3 is set at commit
            version=SNAPSHOT_VERSION_OBJECTS if isinstance(pending, _PendingGeneration) else SNAPSHOT_VERSION,
            name=name, archive=f"{name}.{secrets.token_hex(8)}.tar", archive_bytes=pending.sink.count,
            archive_crc32=pending.sink.hexdigest(), fingerprint=fingerprint(manifest_digest, tree),
            manifest_digest=manifest_digest, tree_digest=tree, excluded=sorted(prune.excluded),
            mode_fixups=walked.fixups or [], entries=walked.entries, content_bytes=walked.content,
            created_ns=time.time_ns())
        committed = store.commit(pending, info)
        return PersistReport(committed if isinstance(committed, SnapshotInfo) else info, walked.skipped)
    except BaseException:
        store.abort(pending)
        raise
