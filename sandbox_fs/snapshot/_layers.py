"""Layered persist: the index a persist records, and change detection against its parent's index.

See :mod:`._index` for the index and the rule that decides that a file is
unchanged (inode, size, mtime, ctime and mode equal; mtime and ctime strictly
older than the parent index's walk).  A persist into a
:class:`~sandbox_fs.snapshot.GenerationStore` records an index for every
generation; over a parent index taken on the same device it writes a layer
(only what changed, and the deletion list), else a full generation.
"""

from __future__ import annotations

from ..root import Root
from ._entries import _WalkState
from ._index import Index, IndexEntry, coarse_now_ns
from ._models import SnapshotPolicy
from ._walk import _ListedEntry

__all__ = ["Layering"]


class Layering:
    """The index of one persist, and its change detection over ``parent`` (None: a full generation).

    Args:
        ws: the workspace Root (its device is recorded; inode numbers are per device).
        parent: the parent generation's index (or the baseline hydrate left), or None.

    Attributes:
        layered: True when a layer is written (``parent`` was taken on this device).
        time_ns: when the walk began (the coarse real-time clock file timestamps come from).
    """

    def __init__(self, ws: Root, parent: Index | None) -> None:
        self.time_ns = coarse_now_ns()  # before the walk: a change during it is at or after this
        self.dev = ws.stat(".").st_dev
        self.parent = parent if parent is not None and parent.dev == self.dev else None
        self.layered = self.parent is not None
        self._old = self.parent.by_path() if self.parent is not None else {}
        self.records: list[IndexEntry] = []

    def setup(self, state: _WalkState) -> None:
        """Make the walk record index entries, and (for a layer) skip unchanged files."""
        state.records = self.records
        if self.parent is not None:
            state.reuse = self.reuse

    def reuse(self, item: _ListedEntry) -> IndexEntry | None:
        """The parent entry of a regular file with one link that is provably unchanged, else None."""
        old = self._old.get(item.path)
        if old is None or old.kind != "file" or old.nlink != 1:
            return None
        st = item.st
        if st.st_nlink != 1 or st.st_ino != old.ino or st.st_size != old.size or st.st_mtime_ns != old.mtime_ns \
                or st.st_ctime_ns != old.ctime_ns or SnapshotPolicy.mode(st.st_mode) != old.mode:
            return None
        assert self.parent is not None
        if st.st_mtime_ns >= self.parent.time_ns or st.st_ctime_ns >= self.parent.time_ns:
            return None  # racy: written in or after the tick the parent's walk began; read it again
        return old

    def index(self, generation: int) -> Index:
        """The new generation's index: entries written now get ``generation`` as their layer."""
        entries = [e if e.layer else e._replace(layer=generation) for e in self.records]
        deleted: list[str] = []
        if self.parent is not None:
            now = {e.path for e in entries}
            deleted = [p for p in self._old if p not in now]
        return Index(self.time_ns, self.dev, entries, deleted)
