"""Staging directories of atomic extraction: each is locked by its extraction; unlocked ones are stale.

An atomic extraction stages its members in ``.sfs-extract-<random>`` (next
to a missing destination, or inside an existing one).  Removing it at the
end is best effort: an I/O error or fd exhaustion during that removal (or a
killed process) leaves it behind, and nothing could tell a leftover from a
staging directory in use.  So each extraction holds an exclusive ``flock``
on an fd of its own staging directory from the moment it makes it until it
is done with it; the kernel drops the lock when that fd closes or the
process dies.  Before staging, an extraction sweeps the directory it stages
in: every ``.sfs-extract-*`` directory whose lock it can take belongs to no
live extraction and is removed (through the Root, checked by identity, never
following a symlink).  The prefix is reserved: a user's directory of that
name in a destination is treated as a leftover.  The sweep first undoes the
checked removals interrupted in that directory (``Root.sweep_removals``:
stale ``.sfs-rm-*`` directories, locked the same way while in use), which a
failed removal of a staging directory leaves beside it.

The new directory is locked right after ``mkdir``; a sweep that takes its
lock first wins, and the extraction then fails with ``conflict`` (it never
writes into a directory it does not hold): whether the sweep still holds the
lock, or has already removed the directory and released it (the name is
checked to still hold the directory made once the lock is taken).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets

from ..errors import SandboxError
from ..root import Root, Subtree
from ._errors import UnsafeArchiveMemberError
from ._meta import identity

__all__ = ["STAGING_PREFIX", "make_staging", "sweep_stale"]

STAGING_PREFIX = ".sfs-extract-"
#: the private directories of ``Root``'s checked removal (see ``Root.sweep_removals``)
REMOVAL_PREFIX = ".sfs-rm-"


def make_staging(owner: Root) -> tuple[str, tuple[int, int], int]:
    """Make and lock a new staging directory in ``owner``'s directory.

    Returns:
        ``(name, (st_dev, st_ino), lock fd)``: the caller owns the fd and
        closes it once the directory is moved in or removed.

    Raises:
        UnsafeArchiveMemberError: ``conflict``, the directory at the new name
            is not the one made, or a sweep took its lock first (and may
            have removed it).
        OSError, SandboxError: from ``mkdir`` or the open (EROFS, ENOSPC, ...).
    """
    name = STAGING_PREFIX + secrets.token_hex(8)
    owner.mkdir(name, 0o700)
    try:
        made = identity(owner.lstat(name))
        fd = owner.open_dir_fd(name)
    except FileNotFoundError:  # a sweep removed it before it could be locked
        raise UnsafeArchiveMemberError("conflict", None,
                                       "another extraction's sweep removed the new staging directory") from None
    try:
        if identity(os.fstat(fd)) != made:
            raise UnsafeArchiveMemberError("conflict", None, "the staging directory was replaced as it was made")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UnsafeArchiveMemberError("conflict", None,
                                           "another extraction's sweep took the new staging directory") from None
        try:
            # a sweep that locked, emptied and removed it before this lock leaves the lock on a
            # directory no longer at the name: the name must still hold the one made
            held = identity(owner.lstat(name)) == made
        except FileNotFoundError:
            held = False
        if not held:
            raise UnsafeArchiveMemberError("conflict", None,
                                           "another extraction's sweep removed the new staging directory")
    except BaseException:
        os.close(fd)
        raise
    return name, made, fd


def sweep_stale(owner: Root) -> int:
    """Remove every ``.sfs-extract-*`` directory in ``owner``'s directory that no live extraction holds.

    First the removals interrupted there are undone (``Root.sweep_removals``:
    a stale ``.sfs-rm-*`` directory, which a failed removal of a staging
    directory leaves beside it, gives back what it holds and goes), so a
    staging directory that was half-way through its removal is swept here too.
    Best effort: an entry that cannot be opened, locked or removed is left.

    Returns:
        How many were removed.
    """
    try:
        names = owner.listdir(".")
        if any(n.startswith(REMOVAL_PREFIX) for n in names):
            with contextlib.suppress(OSError, SandboxError):
                owner.sweep_removals(".")
            names = owner.listdir(".")  # what the undone removals gave back included
    except (OSError, SandboxError):
        return 0
    names = [n for n in names if n.startswith(STAGING_PREFIX)]
    removed = 0
    for name in names:
        try:
            fd = owner.open_dir_fd(name)
        except (OSError, SandboxError):
            continue  # not a directory, gone, or not ours to open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            Subtree(owner, name, identity(os.fstat(fd))).remove_tree()
            removed += 1
        except (OSError, SandboxError):
            continue  # held by a live extraction (EWOULDBLOCK), or the removal failed
        finally:
            os.close(fd)
    return removed
