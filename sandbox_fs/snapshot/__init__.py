"""Streaming snapshots of a workspace: persist (tar), hydrate, stores, fingerprint.

:func:`persist` walks a workspace through its :class:`~sandbox_fs.root.Root`
(fd-based, never following a symlink) and streams a PAX tar into a
:class:`SnapshotStore`; :func:`hydrate` restores one, staged and verified
before it replaces anything; :func:`tree_digest` and :func:`fingerprint`
tell whether a live workspace still matches a snapshot.  Persist applies
hydrate's own rules (:class:`SnapshotPolicy`), so whatever it commits,
hydrate restores.

Modules: ``_errors`` (the errors), ``_models`` (limits, metadata, policy,
reports), ``_store`` (stores), ``_objects`` (the object contract under stores), ``_objects_local`` (it over a local directory), ``_s3`` (it over an S3 bucket, and S3SnapshotStore), ``_walk`` (the fd walk), ``_entries`` (what
the walk keeps of each entry; the tree digest), ``_tar`` (the tar stream),
``_generations`` (generations over an object store: pointer, retention, gc, fork), ``_reader`` (the
verifying reader hydrate reads a generation's archive through), ``_holds`` (what a fork
shares, kept from deletion), ``_fork`` (fork on any store), ``_local`` (the default
directory store: generations over LocalObjects, reading version-1 snapshots too), ``_persist``, ``_hydrate``.
"""

from __future__ import annotations

# Names importable from here but outside ``__all__`` (the session and hosts use them), re-exported with ``as``:
# SNAPSHOT_FORMAT, SNAPSHOT_VERSION, WORKSPACE_ID_NAME, PendingArchive, is_mount_point_of, MIN_GC_AGE_S,
# refuse_store_in_workspace.
from ._entries import fingerprint, tree_digest
from ._errors import (
    SnapshotCorruptError,
    SnapshotError,
    SnapshotLimitError,
    SnapshotNotFoundError,
    SnapshotSourceChangedError,
    SnapshotConflictError,
    SnapshotStoreError,
    SnapshotVerifyError,
    UnrestorableEntryError,
)
from ._fork import fork_snapshot
from ._generations import GcReport, GenerationStore
from ._generations import MIN_GC_AGE_S as MIN_GC_AGE_S
from ._local import DirectorySnapshotStore
from ._hydrate import hydrate
from ._hydrate import is_mount_point_of as is_mount_point_of
from ._models import (
    SNAPSHOT_FORMAT as SNAPSHOT_FORMAT,
    SNAPSHOT_VERSION as SNAPSHOT_VERSION,
    HydrateReport,
    PersistReport,
    SnapshotInfo,
    SnapshotLimits,
    SnapshotPolicy,
    validate_name,
)
from ._objects import ObjectInfo, ObjectStore, ObjectWriter
from ._objects_local import LocalObjects
from ._s3 import S3Objects, S3Options, S3SnapshotStore
from ._persist import persist
from ._store import LocalSnapshotStore, NoSnapshot, SnapshotStore
from ._store import PendingArchive as PendingArchive
from ._walk import WORKSPACE_ID_NAME as WORKSPACE_ID_NAME
from ._where import refuse_store_in_workspace as refuse_store_in_workspace

__all__ = [
    "SnapshotError",
    "SnapshotNotFoundError",
    "SnapshotCorruptError",
    "SnapshotLimitError",
    "SnapshotSourceChangedError",
    "UnrestorableEntryError",
    "SnapshotVerifyError",
    "SnapshotStoreError",
    "SnapshotConflictError",
    "ObjectStore",
    "ObjectWriter",
    "ObjectInfo",
    "LocalObjects",
    "S3Objects",
    "S3Options",
    "S3SnapshotStore",
    "SnapshotLimits",
    "SnapshotPolicy",
    "SnapshotInfo",
    "PersistReport",
    "HydrateReport",
    "SnapshotStore",
    "LocalSnapshotStore",
    "DirectorySnapshotStore",
    "GenerationStore",
    "GcReport",
    "NoSnapshot",
    "persist",
    "hydrate",
    "fork_snapshot",
    "tree_digest",
    "fingerprint",
    "validate_name",
]
