"""The fd-based directory walk beneath a :class:`~sandbox_fs.root.Root`.

The internal contract for the package's bulk callers (``Root.walk``,
``materialize``, ``snapshot``, exec's identity re-owning):

* :func:`walk_dirs` gives each directory's subdirectory entries with their
  ``lstat`` (so a caller can prune by device, inode or kind without a second
  stat), which the caller may prune in place;
* :func:`open_on_same_mount` opens an entry the walk listed again, by its
  path beneath the root, never across a mount point.

Callers outside the root modules use these instead of ``Root``'s private
methods.
"""

from __future__ import annotations

import errno
import os
from typing import TYPE_CHECKING, Iterator, NamedTuple

from . import _native

if TYPE_CHECKING:
    from .root import DirEntry, Root

__all__ = ["walk_dirs", "open_on_same_mount"]


class _Frame(NamedTuple):
    """One directory being walked: its open fd, sandbox path and subdirectories."""

    fd: int
    path: str
    subdirs: list[DirEntry]


def walk_dirs(root: Root, path: str | bytes = ".") -> Iterator[tuple[str, list[DirEntry], list[DirEntry]]]:
    """Walk ``path`` beneath ``root`` top-down, never following a symlink.

    Args:
        root: the Root to walk in.
        path: the directory to start at, relative to ``root`` (``"."``: the root).

    Yields:
        ``(dirpath, subdirs, nondirs)``: ``dirpath`` is the sandbox path
        relative to the root (``""`` for the root itself), ``subdirs`` the
        :class:`~sandbox_fs.root.DirEntry` (with ``lstat``) of each
        subdirectory, sorted by name, which the caller may prune in place
        before the next step, ``nondirs`` those of every other entry
        (symlinks included, never followed).

    Each subdirectory is opened ``O_NOFOLLOW`` relative to its parent's fd
    only when it is entered, so one swapped for a symlink (or removed)
    mid-walk is skipped, never entered.  Open fds: one per ancestor that
    still has a subdirectory to enter (a directory's fd is closed once its
    last subdirectory is opened), so at most the depth of the tree, never
    its width.

    Raises:
        PathEscapeError, SymlinkRefusedError: ``path`` resolves outside the root
            or through a refused symlink.
        WorkspaceClosedError: ``root`` is closed.
        OSError: ``path`` is missing or not a directory (ENOENT, ENOTDIR), or a
            directory cannot be listed or opened (EACCES, EMFILE ...).
    """
    rel = root._rel(path)
    top = root.open_dir_fd(rel)
    base = "" if rel in (b".", b"") else os.fsdecode(rel.rstrip(b"/"))
    frames: list[_Frame] = []
    next_index: list[int] = []  # per frame: index in subdirs of the next one to enter
    cur: tuple[int, str] | None = (top, base)
    try:
        while True:
            if cur is not None:
                dfd, dpath = cur
                cur = None
                try:
                    entries = root._scan_fd(dfd, os.fsencode(dpath) or b".")
                except BaseException:
                    os.close(dfd)
                    raise
                dirs = [e for e in entries if e.kind == "dir"]
                frames.append(_Frame(dfd, dpath, dirs))
                next_index.append(0)
                yield dpath, dirs, [e for e in entries if e.kind != "dir"]
            if not frames:
                return
            frame, i = frames[-1], next_index[-1]
            if i >= len(frame.subdirs):  # the caller may have pruned the list meanwhile
                frames.pop()
                next_index.pop()
                os.close(frame.fd)
                continue
            next_index[-1] = i + 1
            name = frame.subdirs[i].name
            try:
                cfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=frame.fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
                    continue  # swapped or removed meanwhile: never followed
                raise
            if i + 1 >= len(frame.subdirs):  # its last subdirectory: the parent's fd is no longer needed
                frames.pop()
                next_index.pop()
                os.close(frame.fd)
            cur = (cfd, f"{frame.path}/{name}" if frame.path else name)
    finally:
        if cur is not None:
            os.close(cur[0])
        for frame in frames:
            os.close(frame.fd)


def open_on_same_mount(root: Root, path: str | bytes, flags: int, op: str) -> int:
    """Open ``path`` beneath ``root`` with ``RESOLVE_NO_XDEV`` added: never through a mount point.

    Args:
        root: the Root to resolve in (its own resolve flags apply too).
        path: relative sandbox path.
        flags: ``os.O_*`` flags (``O_CLOEXEC`` is added); for example
            ``O_PATH | O_NOFOLLOW`` to reach an entry without opening it.
        op: the operation named in an error.

    Returns:
        A new fd (the caller closes it).

    Raises:
        PathEscapeError: ``path`` resolves outside the root, or crosses a mount
            point (EXDEV).
        SymlinkRefusedError: a refused symlink on ``path``.
        WorkspaceClosedError: ``root`` is closed.
        InvalidPathError: ``path`` is not a valid relative path.
        OSError: the open failed (ENOENT ...), ``filename`` the sandbox path.
    """
    rel = root._rel(path)
    with root._use() as rootfd:
        return root._open_fd(rootfd, rel, flags | os.O_CLOEXEC, 0, op, _native.RESOLVE_NO_XDEV)
