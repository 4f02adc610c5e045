"""Byte and inode quotas of the overlay.

Usage is measured once when the overlay mounts (:meth:`Quota.measure`, an
fd walk of the workspace), then kept by the daemon: every request that
grows the workspace is checked *before* it acts (:meth:`Quota.check_grow`,
:meth:`Quota.check_new_inode`) and charged after it succeeded
(:meth:`Quota.add_bytes`, :meth:`Quota.add_inodes`; negative deltas give
space back).  A request that would take usage past a limit fails whole
with ``EDQUOT``: nothing of it is written.  (The kernel splits a large
``write(2)`` into ``max_write``-sized requests, 1 MiB with libfuse 3.14, so
such a call may return short at the limit, having written the requests
before the one refused.)

What counts:

* bytes: the apparent size (``st_size``) of regular files and the length
  of symlink targets, a hard-linked inode once, however many names it has;
  plus every *name* (directory entry) beneath the workspace root, each
  :func:`name_cost` bytes (its length plus :data:`NAME_ENTRY_BYTES`):
  directory blocks are disk too, and hard links or long names would fill
  it past both limits otherwise.  A name is charged when made (create,
  mkdir, mknod, symlink, link, a rename's new name) and given back when
  removed (unlink, rmdir, a rename's old name or the name it replaced);
* inodes: every entry beneath the workspace root (the root itself is not
  counted), a hard-linked inode once.

:meth:`Quota.usage` (the ``usage`` control op) reports the same two numbers.

Limits may change at run time (:meth:`Quota.set_limits`).  Lowering one
below the current usage deletes nothing: growth fails until usage is back
under it.

Not thread-safe: one daemon thread checks and charges (so a check and its
charge are never split by another request).
"""

from __future__ import annotations

import errno
import stat
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from ..root import Handle

__all__ = ["NAME_ENTRY_BYTES", "Quota", "name_cost"]


NAME_ENTRY_BYTES = 64
"""Fixed bytes charged per directory entry on top of its name's length (about what ext4 and xfs
spend per entry beyond the name: inode number, lengths, type, alignment, hashed-index overhead)."""


def name_cost(name: bytes) -> int:
    """Bytes a directory entry called ``name`` is charged: ``len(name) + NAME_ENTRY_BYTES``."""
    return len(name) + NAME_ENTRY_BYTES


def _check_limit(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{name} must be a non-negative int or None")


class Quota:
    """Usage and limits of one overlay: bytes of regular files and inodes.

    Args:
        max_bytes: the byte limit, or None for unlimited.
        max_inodes: the inode limit, or None for unlimited.

    Raises:
        ValueError: a limit is negative or not an int.
    """

    def __init__(self, max_bytes: int | None = None, max_inodes: int | None = None) -> None:
        self._bytes = 0
        self._inodes = 0
        self.max_bytes: int | None = None
        self.max_inodes: int | None = None
        self.set_limits(max_bytes, max_inodes)

    @property
    def bytes(self) -> int:
        """Bytes in use (regular files' apparent size, symlink targets, names; see the module docstring)."""
        return self._bytes

    @property
    def inodes(self) -> int:
        """Inodes in use (entries beneath the workspace root)."""
        return self._inodes

    def usage(self) -> dict[str, int]:
        """``{"bytes": n, "inodes": n}``: the control protocol's ``usage`` result."""
        return {"bytes": self._bytes, "inodes": self._inodes}

    def set_limits(self, max_bytes: int | None, max_inodes: int | None) -> None:
        """Replace both limits (None: unlimited); usage is kept, nothing is deleted.

        Raises:
            ValueError: a limit is negative or not an int (neither is changed).
        """
        _check_limit("max_bytes", max_bytes)
        _check_limit("max_inodes", max_inodes)
        self.max_bytes = max_bytes
        self.max_inodes = max_inodes

    def check_grow(self, delta_bytes: int) -> None:
        """Refuse a request that would grow usage by ``delta_bytes`` past ``max_bytes``.

        Usage exactly at the limit is allowed; a delta <= 0 is always allowed.

        Raises:
            OSError: ``EDQUOT``, ``bytes + delta_bytes > max_bytes``.
        """
        if delta_bytes > 0 and self.max_bytes is not None and self._bytes + delta_bytes > self.max_bytes:
            raise OSError(errno.EDQUOT, f"byte quota of {self.max_bytes} would be exceeded")

    def check_new_inode(self, count: int = 1) -> None:
        """Refuse a request that would create ``count`` inodes past ``max_inodes``.

        Raises:
            OSError: ``EDQUOT``, ``inodes + count > max_inodes``.
        """
        if count > 0 and self.max_inodes is not None and self._inodes + count > self.max_inodes:
            raise OSError(errno.EDQUOT, f"inode quota of {self.max_inodes} would be exceeded")

    def add_bytes(self, delta: int) -> None:
        """Charge ``delta`` bytes (negative: give them back); usage never goes below 0."""
        self._bytes = max(0, self._bytes + delta)

    def add_inodes(self, delta: int) -> None:
        """Charge ``delta`` inodes (negative: give them back); usage never goes below 0."""
        self._inodes = max(0, self._inodes + delta)

    def measure(self, handle: Handle) -> tuple[int, int]:
        """Set usage to what the tree beneath ``handle`` holds now, by an fd walk.

        Every entry is reached by :meth:`~sandbox_fs.root.Handle.lookup` of
        one listed name from its directory's handle (``O_PATH|O_NOFOLLOW``)
        and judged by ``fstat`` of that fd, never by a path: every name
        costs :func:`name_cost` bytes (each name of a hard-linked inode); a
        symlink is counted as an entry (its target's length once) and never
        followed; an entry on another
        ``st_dev`` than ``handle`` (a mount point) is neither counted nor
        entered; a non-directory with ``st_nlink > 1`` is counted once per
        ``(st_dev, st_ino)``; an entry gone between listing and lookup is
        skipped.  Memory: the multi-linked inodes seen and one listing per
        open directory; open fds: one per directory level being walked.

        Args:
            handle: a directory handle on the workspace root (borrowed: not
                closed; every handle the walk opens is closed).  Only its
                ``stat``, ``listdir``, ``lookup`` and ``close`` are used.

        Returns:
            ``(bytes, inodes)``, now also :attr:`bytes` and :attr:`inodes`.

        Raises:
            OSError: a directory could not be listed or an entry opened or
                stat'ed (other than ENOENT); usage is then left unchanged.
        """
        dev = handle.stat().st_dev
        seen: set[tuple[int, int]] = set()
        nbytes = ninodes = 0
        stack: list[tuple[Handle, Iterator[tuple[bytes, int, int]]]] = [(handle, iter(handle.listdir()))]
        try:
            while stack:
                parent, names = stack[-1]
                entry = next(names, None)
                if entry is None:
                    stack.pop()
                    if parent is not handle:
                        parent.close()
                    continue
                try:
                    child = parent.lookup(entry[0])
                except FileNotFoundError:
                    continue  # removed since the listing
                entered = False
                try:
                    st = child.stat()
                    if st.st_dev != dev:
                        continue
                    nbytes += name_cost(entry[0])
                    if stat.S_ISDIR(st.st_mode):
                        stack.append((child, iter(child.listdir())))
                        entered = True
                    elif st.st_nlink > 1:
                        if (st.st_dev, st.st_ino) in seen:
                            continue
                        seen.add((st.st_dev, st.st_ino))
                    ninodes += 1
                    if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                        nbytes += st.st_size
                finally:
                    if not entered:
                        child.close()
        finally:
            for h, _ in stack:
                if h is not handle:
                    h.close()
        self._bytes, self._inodes = nbytes, ninodes
        return nbytes, ninodes
