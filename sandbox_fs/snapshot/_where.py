"""Where a directory store lies: never at or beneath the workspace it persists or restores."""

from __future__ import annotations

import os

from ..root import Root, is_beneath
from ._errors import SnapshotStoreError

__all__ = ["refuse_store_in_workspace"]


def refuse_store_in_workspace(ws: Root, store: object, *, what: str = "the workspace") -> None:
    """Refuse a store whose directory overlaps the workspace (or a grant's directory): either lies inside the other.

    A store at or beneath the workspace is in reach of the confined command
    (which could read its ``.state-key`` and rewrite its snapshots and
    baselines), is persisted into its own snapshots, and is replaced by a
    restore of the workspace.  A workspace beneath the store is the same
    overlap seen from the other side: its files are store objects (with
    ``workspaces_dir`` the store's directory, the workspace of session ``ID``
    is the directory of snapshot ``ID``'s pointer, generations and the holds
    its forks keep), so the command rewrites or deletes them, a restore's
    clear deletes them, and the store's listings walk the whole workspace.
    Compared by directory identity (``(st_dev, st_ino)`` of each directory up
    the ``..`` chain of the store's own fd, and of the workspace's, walked by
    :func:`~sandbox_fs.root.is_beneath`, never by path), so a symlinked or
    renamed path to either is seen.  A store with no directory (S3) passes.

    Args:
        ws: the workspace Root, or a grant's (borrowed): a directory the confined command reaches.
        store: the snapshot store; its ``root`` (a :class:`~sandbox_fs.root.Root`) is its directory.
        what: that directory, for the message (``"the workspace"``, ``"a grant"``).

    Raises:
        SnapshotStoreError: the store is that directory, lies inside it, or
            contains it (not retryable).
        OSError: a ``..`` could not be opened.
    """
    root = getattr(store, "root", None)
    if not isinstance(root, Root):
        return
    if _beneath(root, ws):
        raise SnapshotStoreError(f"the snapshot store is {what} or lies inside it (a command in the "
                                 "workspace could read its key and rewrite its snapshots)",
                                 sandbox_path=None, retryable=False, context={"overlap": what})
    if _beneath(ws, root):
        raise SnapshotStoreError(f"{what} lies inside the snapshot store's directory (a command in it could "
                                 "rewrite the store's snapshots, and a restore would delete them)",
                                 sandbox_path=None, retryable=False, context={"overlap": what, "inside": "store"})


def _beneath(inner: Root, outer: Root) -> bool:
    """True when ``inner``'s directory is ``outer``'s or lies inside it (by identity up ``inner``'s ``..`` chain)."""
    fd = inner.fileno_dup()
    try:
        return is_beneath(fd, outer.identity)
    finally:
        os.close(fd)
