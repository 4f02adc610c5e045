"""Where a directory store lies: never at or beneath the workspace it persists or restores."""

from __future__ import annotations

import os

from ..root import Root, is_beneath
from ._errors import SnapshotStoreError

__all__ = ["refuse_store_in_workspace"]


def refuse_store_in_workspace(ws: Root, store: object, *, what: str = "the workspace") -> None:
    """Refuse a store whose directory is the workspace (or a grant's directory) or lies beneath it.

    Such a store is in reach of the confined command (which could read its
    ``.state-key`` and rewrite its snapshots and baselines), is persisted
    into its own snapshots, and is replaced by a restore of the workspace.
    Compared by directory identity (``(st_dev, st_ino)`` of the store's
    directory and of each one up its ``..`` chain, walked by
    :func:`~sandbox_fs.root.is_beneath` from the store's own fd, never by path), so a symlinked or renamed
    path to it is seen.  A store with no directory (S3) passes.

    Args:
        ws: the workspace Root, or a grant's (borrowed): a directory the confined command reaches.
        store: the snapshot store; its ``root`` (a :class:`~sandbox_fs.root.Root`) is its directory.
        what: that directory, for the message (``"the workspace"``, ``"a grant"``).

    Raises:
        SnapshotStoreError: the store is that directory or lies inside it (not retryable).
        OSError: a ``..`` could not be opened.
    """
    root = getattr(store, "root", None)
    if not isinstance(root, Root):
        return
    fd = root.fileno_dup()
    try:
        inside = is_beneath(fd, ws.identity)
    finally:
        os.close(fd)
    if inside:
        raise SnapshotStoreError(f"the snapshot store is {what} or lies inside it (a command in the "
                                 "workspace could read its key and rewrite its snapshots)",
                                 sandbox_path=None, retryable=False, context={"overlap": what})
