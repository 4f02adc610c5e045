"""The extractor's last pass over its directories: modes, owners and mtimes, through each one's fd.

:class:`DirMetadata` is a part of :class:`~sandbox_fs.archive._writer.Extractor`
(its base class): its state lives on the extractor, set up by its ``__init__``.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

from ..errors import PathEscapeError, SymlinkRefusedError
from ._errors import UnsafeArchiveMemberError
from ._meta import DIR, identity, path_key

if TYPE_CHECKING:
    from ..root import Root

__all__ = ["DirMetadata"]



class DirMetadata:
    """The directory metadata pass (:meth:`_apply_dir_meta`); a base of ``Extractor``."""

    _kinds: dict[bytes, str]
    _owner: bool
    _dir_meta: dict[bytes, tuple[int, int | None, tuple[int, int] | None]]
    _dir_ids: dict[bytes, tuple[int, int]]

    if TYPE_CHECKING:
        def _entered(self) -> contextlib.AbstractContextManager[Root]: ...

    def _apply_dir_meta(self) -> None:
        """Set modes, owners and mtimes of the directory members, walking only our directories.

        Done after every member (a directory's mtime changes as entries are
        added); order does not matter since changing a child's metadata never
        changes its parent's mtime.

        Each directory of ours is opened ``O_DIRECTORY|O_NOFOLLOW`` through
        the work Root (``RESOLVE_NO_SYMLINKS``: a symlink or non-directory
        there is skipped, never followed) and its entries are listed from
        that fd by type (``getdents``, no ``lstat`` each); owners, modes and
        mtimes are set through that same fd (``fchown``, ``fchmod``,
        ``futimens``; read-only grants checked on it), never by name: a
        directory cannot be a hard link, so nothing outside is ever changed.
        Memory: the paths of our directories still to visit; fds: one at a time.
        """
        if not self._dir_meta:
            return
        # One checked fd of the staging directory for this metadata-only step (modes and
        # times of our own directories; nothing is created), not one lookup per call.
        with self._entered() as work:
            self._apply_dir_meta_in(work)

    def _apply_dir_meta_in(self, work: Root) -> None:
        kinds, meta = self._kinds, self._dir_meta
        dflags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
        owner_ok = self._owner
        todo: list[bytes] = []  # our directories with metadata, parents before children
        stack: list[bytes] = [b""]
        while stack:
            rel = stack.pop()
            try:
                fd = work.open_fd(rel or b".", dflags)
            except (FileNotFoundError, NotADirectoryError, SymlinkRefusedError, PathEscapeError):
                if not rel:
                    raise
                continue  # swapped or removed meanwhile: never followed
            try:
                if rel and path_key(rel) in meta:
                    todo.append(rel)
                with os.scandir(fd) as it:
                    for ent in it:
                        if ent.is_dir(follow_symlinks=False):
                            name = os.fsencode(ent.name)
                            child = rel + b"/" + name if rel else name
                            if kinds.get(path_key(child)) == DIR:
                                stack.append(child)
            finally:
                os.close(fd)
        # Children before parents, so a mode without search permission never blocks the rest;
        # each through the directory's own fd, never by name (a name swapped for a hard link to
        # a file outside is never changed), checked to be the directory made for the member.
        for rel in reversed(todo):
            try:
                fd = work.open_fd(rel, dflags)
            except (FileNotFoundError, NotADirectoryError, SymlinkRefusedError, PathEscapeError):
                continue
            try:
                k = path_key(rel)
                mode, mtime_ns, owner = meta[k]
                if identity(os.fstat(fd)) != self._dir_ids.get(k):
                    raise UnsafeArchiveMemberError("conflict", rel, "a directory of this archive was replaced by "
                                                   "another process during the extraction")
                work.check_write_fd(fd, rel)
                if owner_ok and owner is not None:
                    os.fchown(fd, owner[0], owner[1])
                os.fchmod(fd, mode)
                if mtime_ns is not None:
                    os.utime(fd, ns=(mtime_ns, mtime_ns))
            finally:
                os.close(fd)
