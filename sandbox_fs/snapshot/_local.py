"""The default store of a local directory: generations and layers, still restoring version-1 snapshots.

:class:`DirectorySnapshotStore` is a :class:`GenerationStore` over
:class:`LocalObjects` in the directory (``NAME/current``, ``NAME/gen/...``,
``.partial/``, ``.lock``: see ``_generations`` and ``_objects_local``).  A
directory written by :class:`LocalSnapshotStore` (format version 1:
``NAME.json`` and ``NAME.g<N>.<token>.tar``) keeps working: what a name holds
is detected per name, from its objects.  A name with a generation pointer is
read through it; a name with only version-1 files is read (``info``,
``open_archive``, :func:`hydrate`) from those, with its generation number and
metadata digest, so a session state that recorded them resumes unchanged.  The
first persist of such a name writes generation ``N + 1`` (a full one, since a
version-1 snapshot has no index) and, once it is committed, removes the
version-1 files.  The two layouts never share a file name (version-1 names
hold a dot, object keys of a name are below the directory ``NAME/``).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import IO

from .._keyfile import installation_key
from ..errors import SandboxError
from ._baseline import baseline_key_of
from ._errors import SnapshotConflictError, SnapshotError
from ._fork import copy_snapshot
from ._generations import GenerationStore, _PendingGeneration
from ._models import SnapshotInfo, SnapshotLimits, validate_name
from ._objects_local import LocalObjects
from ._store import LocalSnapshotStore, PendingArchive

__all__ = ["DirectorySnapshotStore"]


class DirectorySnapshotStore(GenerationStore):
    """Snapshots in one trusted host directory: generations and incremental layers (the default).

    A :class:`GenerationStore` over :class:`LocalObjects`; version-1
    snapshots a :class:`LocalSnapshotStore` left in the directory still
    restore, and their next persist continues their generation numbers (see
    the module docstring).  Every access goes through a
    :class:`~sandbox_fs.root.Root` on the directory (no symlink followed).

    Args:
        directory: the trusted host directory (``str`` or path-like), from the
            host application; opened by the host-path rule (no symlink on any
            component).
        create: create it (mode 0700, parents too) when missing.
        keep: restore points kept per name (see :class:`GenerationStore`).

    Baselines (what a restore leaves so that the next persist, also in a new
    process, is a layer) are stored authenticated with a key derived from the
    directory's installation key ``.state-key`` (the one the client keeps
    there): see ``_baseline`` and :mod:`sandbox_fs._keyfile`.  Opening the store and
    reading it (``info``, ``list``, ``generations``, ``open_archive``) write
    nothing: the key is made (0600) when the first baseline is written, and
    the upload directory ``.partial/`` with the first upload.

    Attributes:
        root: the :class:`~sandbox_fs.root.Root` of the directory (the client
            keeps its installation state key there, as with :class:`LocalSnapshotStore`).

    Raises:
        FileNotFoundError: ``directory`` is missing and ``create`` is False.
        SymlinkRefusedError: ``directory``, or a directory on it, is a symlink.
        SnapshotError: the directory changed between the two opens (another
            directory was moved to its path meanwhile).
        ValueError: ``keep`` is not within 1 to 1000.
    """

    def __init__(self, directory: str | os.PathLike[str], *, create: bool = True, keep: int = 2) -> None:
        objects = LocalObjects(directory, create=create)
        try:
            self.legacy = LocalSnapshotStore(directory, create=False)
        except BaseException:
            objects.close()
            raise
        try:
            a, b = objects._root.stat("."), self.legacy.root.stat(".")
            if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
                raise SnapshotError("the snapshot store directory was replaced while it was opened",
                                    sandbox_path=None)
            super().__init__(objects, keep=keep)
        except BaseException:
            objects.close()
            self.legacy.close()
            raise
        self.root = self.legacy.root
        self._key_lock = threading.Lock()
        self._mac_key: bytes | None = None

    def baseline_mac_key(self, *, create: bool) -> bytes | None:
        """The baseline MAC key, derived from the directory's installation key (made 0600 when ``create``).

        The installation key is the file :class:`~sandbox_fs.client.LocalSandboxClient`
        authenticates session states with when given no ``state_key``.  None
        (baselines then keep their index in memory only) when there is no key
        and ``create`` is False, when the key file is damaged or cannot be made
        (a read-only directory), or when another user could have written or
        read it (see :func:`sandbox_fs._keyfile.installation_key`: a key
        planted by whoever can write a shared store directory would let them
        forge baselines).  Never raises.
        """
        with self._key_lock:
            if self._mac_key is None:
                try:
                    secret = installation_key(self.root, create=create)
                except (OSError, SandboxError):  # UnsafeKeyFileError: a key another user could know is no key
                    secret = None
                if secret is not None and len(secret) >= 32:
                    self._mac_key = baseline_key_of(secret)
            return self._mac_key

    # -- the version-1 snapshots

    def _has_pointer(self, name: str) -> bool:
        return self.objects.head(f"{name}/current") is not None

    def _legacy_info(self, name: str) -> SnapshotInfo | None:
        return self.legacy.info(name)

    def legacy_store(self, name: str) -> LocalSnapshotStore | None:
        """The version-1 store when ``name`` has version-1 files and no generation pointer, else None.

        Raises:
            InvalidPathError: ``name`` is not a plain token.
            SnapshotStoreError: the directory cannot be read.
        """
        validate_name(name)
        if self._has_pointer(name) or not self.legacy.root.exists(f"{name}.json"):
            return None
        return self.legacy

    def info(self, name: str) -> SnapshotInfo | None:
        """The current metadata of ``name``: its current generation, else its version-1 snapshot, else None.

        Raises:
            InvalidPathError: ``name`` is not a plain token.
            SnapshotCorruptError: the pointer or the metadata is not valid.
            SnapshotStoreError: the store failed.
        """
        legacy = self.legacy_store(name)
        return legacy.info(name) if legacy is not None else super().info(name)

    def generations(self, name: str) -> list[SnapshotInfo]:
        """The restore points of ``name``, newest first (a version-1 snapshot is its only one).

        Raises:
            The errors of :meth:`GenerationStore.generations`.
        """
        legacy = self.legacy_store(name)
        if legacy is None:
            return super().generations(name)
        info = legacy.info(name)
        return [info] if info is not None else []

    def kept(self, name: str) -> list[int]:
        """The generation numbers of the restore points of ``name``, newest first.

        Raises:
            The errors of :meth:`GenerationStore.kept`.
        """
        return [i.generation for i in self.generations(name)] if self.legacy_store(name) else super().kept(name)

    def list(self) -> list[SnapshotInfo]:
        """The current metadata of every snapshot name, generations and version-1 ones, sorted by name.

        Raises:
            SnapshotStoreError, OSError: the directory cannot be listed.
        """
        out = {i.name: i for i in super().list()}
        for info in self.legacy.list():
            if info.name not in out and not self._has_pointer(info.name):
                out[info.name] = info
        return [out[n] for n in sorted(out)]

    def open_archive(self, name: str, limits: SnapshotLimits) -> tuple[IO[bytes], SnapshotInfo]:
        """Open the current archive of ``name``, verified (a version-1 one from its file).

        Raises:
            The errors of :meth:`GenerationStore.open_archive` and :meth:`LocalSnapshotStore.open_archive`.
        """
        legacy = self.legacy_store(name)
        return legacy.open_archive(name, limits) if legacy is not None else super().open_archive(name, limits)

    def fork(self, source: str, target: str, *, generation: int | None = None,
             digest: str | None = None) -> SnapshotInfo:
        """Fork as :meth:`GenerationStore.fork`; a version-1 ``source`` is copied into ``target``'s first generation.

        Raises:
            The errors of :meth:`GenerationStore.fork`; SnapshotConflictError
            also when ``target`` is a version-1 snapshot.
        """
        if self.legacy_store(target) is not None:
            raise SnapshotConflictError("the fork's snapshot name is in use; nothing was made", sandbox_path=None,
                                        context={"snapshot": source, "target": target})
        legacy = self.legacy_store(source)
        if legacy is None:
            return super().fork(source, target, generation=generation, digest=digest)
        return copy_snapshot(legacy, self, source, target, generation, digest, SnapshotLimits())

    # -- writing and removal

    def commit(self, pending: PendingArchive, info: SnapshotInfo) -> SnapshotInfo:
        """Commit as :meth:`GenerationStore.commit`; the first generation of a version-1 name then removes its files.

        Raises:
            The errors of :meth:`GenerationStore.commit` (the version-1 files are left on any of them).
        """
        first = isinstance(pending, _PendingGeneration) and pending.pointer is None \
            and self.legacy.root.exists(f"{pending.name}.json")
        committed = super().commit(pending, info)
        if first:  # best effort: a leftover is hidden by the pointer and goes with remove()
            with contextlib.suppress(OSError, SnapshotError):
                self.legacy.remove(pending.name)
        return committed

    def remove(self, name: str) -> None:
        """Delete ``name``: its generations (pointer first) and any version-1 files.

        Raises:
            InvalidPathError: ``name`` is not a plain token.
            SnapshotStoreError, OSError: the store failed.
        """
        super().remove(name)
        self.legacy.remove(name)

    def close(self) -> None:
        """Close both views of the directory.  Idempotent."""
        super().close()
        self.legacy.close()

    def __enter__(self) -> "DirectorySnapshotStore":
        return self
