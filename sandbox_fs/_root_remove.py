"""The checked removal engine behind ``Root.rmdir``, ``Root.rmtree`` and ``Root.clear``.

A tree is removed with an fd-based walk that never follows a symlink and
never enters a mount point; with read-only grants nested in the Root, a
directory is removed only after it has been moved into a private directory
and checked there (:func:`rmdir_checked`), so a grant swapped in at its
name is never removed.

Each private directory (``.sfs-rm-<random>``) is held with an exclusive
``flock`` from the moment it is made until it is removed again; the kernel
drops the lock when that fd closes or the process dies.  An I/O error at
the wrong step, or a kill, can leave one behind (empty, or holding the
directory being removed); nothing else can tell such a leftover from a
removal in flight, but the lock can: :func:`sweep` (``Root.sweep_removals``,
run by the next extraction into that directory) takes it, moves what is
inside back to its name (undoing the interrupted removal, never removing
it) and removes the then empty directory, checked by identity.

Internal to the root modules: it uses ``Root`` internals (``_rel``,
``_use``, ``_open_parent``, ``_oserror``, ``_check_writable``, ``_show``,
``_deny``), which no other module calls.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets as _secrets
import stat as _stat
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

from . import _hooks, _native
from .errors import DirectoryReplacedError, ReadOnlyError, SandboxError

if TYPE_CHECKING:
    from .root import Root

__all__ = ["rmdir", "rmdir_checked", "rmtree", "clear", "sweep", "TRASH_PREFIX"]

Skip = Callable[[os.stat_result], bool]

_ENTER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: openat2 resolve flags of one step of a removal: never a symlink, never across a mount.
_CLEAR_RESOLVE = (_native.RESOLVE_BENEATH | _native.RESOLVE_NO_XDEV | _native.RESOLVE_NO_SYMLINKS |
                  _native.RESOLVE_NO_MAGICLINKS)
#: the reserved name prefix of :func:`rmdir_checked`'s private directories
TRASH_PREFIX = b".sfs-rm-"
#: attempts at a private directory that no concurrent sweep took first
_TRASH_ATTEMPTS = 3


class _MountPoint(Exception):
    """A recursive removal met a mount point (kept, never entered)."""


def rmdir(root: Root, path: str | bytes, expect: tuple[int, int] | None) -> None:
    """``Root.rmdir``: remove the empty directory ``path`` (see there for the errors)."""
    rel = root._rel(path)
    with root._use() as rootfd:
        pfd, leaf = root._open_parent(rootfd, rel, "rmdir", write=True, dir_op=True)
        try:
            if rmdir_checked(root, pfd, leaf, expect) is False:
                raise DirectoryReplacedError("rmdir: the directory at this name is not the one expected "
                                             "(left in place)", sandbox_path=root._show(rel))
        except OSError as exc:
            if isinstance(exc, SandboxError):
                raise
            root._oserror(exc, "rmdir", rel)
        finally:
            os.close(pfd)


def rmdir_checked(root: Root, pfd: int, name: bytes, expect: tuple[int, int] | None) -> bool:
    """``rmdir(name)`` in directory ``pfd``, never of a directory swapped in at that name.

    Without read-only grants and ``expect``: a plain ``rmdir``.  Otherwise
    ``rmdir`` goes by name, so a process that exchanges the name with an
    empty grant meanwhile would have the grant removed: the directory is
    first moved (``renameat2(RENAME_NOREPLACE)``) into a fresh private
    directory beside it, checked there (``fstatat``: not a grant, and
    ``expect`` if given), removed there only then, or moved back.

    Moving a directory into another one rewrites its ``..``: that needs
    write permission on it (its owner's, or root's), which
    ``clear(make_writable=True)`` gives a non-root owner's read-only
    directories first.

    The private directory is held with an exclusive ``flock`` from its
    ``mkdir`` until it is removed (see :func:`_make_trash`); one that an
    error or a kill leaves behind is unlocked, and :func:`sweep` undoes it.

    Returns:
        True when removed; False when the directory found was not ours (moved
        back to its name, or, if that name was taken meanwhile or the move
        back failed, left in the private ``.sfs-rm-*`` directory, which is
        then kept until a sweep can move it back).

    Raises:
        DirectoryReplacedError: the private directory was replaced by another process.
        OSError: the ``rmdir`` failed (ENOTEMPTY ...), after moving it back; or
            removing the then empty private directory failed (the directory is
            removed, the private one is left for a sweep).
    """
    if not root._deny and expect is None:
        os.rmdir(name, dir_fd=pfd)
        return True
    trash, tfd, tst = _make_trash(pfd)
    try:
        try:
            _native.renameat2(pfd, name, tfd, name, _native.RENAME_NOREPLACE, "rmdir", None)
        except OSError:
            # Nothing was moved: the private directory is removed again (only if it is still
            # the empty one made above), so a failed rmdir leaves no ``.sfs-rm-*`` behind.
            _remove_own_empty(pfd, trash, tst)
            raise
        ours = removed = False
        err: OSError | None = None
        try:
            st = os.stat(name, dir_fd=tfd, follow_symlinks=False)
            ident = (st.st_dev, st.st_ino)
            ours = ident not in root._deny and (expect is None or ident == expect)
            if ours:
                os.rmdir(name, dir_fd=tfd)
                removed = True
        except OSError as exc:
            err = exc
        if not removed:
            try:
                _native.renameat2(tfd, name, pfd, name, _native.RENAME_NOREPLACE, "rmdir", None)
            except OSError:
                # the name was taken meanwhile (or the move failed): it stays in the private
                # directory, kept; a later sweep moves it back once its name is free
                return False
        left = os.stat(trash, dir_fd=pfd, follow_symlinks=False)
        if (left.st_dev, left.st_ino) == (tst.st_dev, tst.st_ino):
            os.rmdir(trash, dir_fd=pfd)  # (only ever an empty directory, in a directory we write)
        if err is not None:
            raise err
        return ours
    finally:
        os.close(tfd)  # releases the lock: a private directory still there is a sweepable leftover


def _make_trash(pfd: int) -> tuple[bytes, int, os.stat_result]:
    """Make, open and lock a fresh private directory in ``pfd`` for :func:`rmdir_checked`.

    Every later step goes through the returned fd, never the path
    ``.sfs-rm-*/name``: the private directory sits in a directory others may
    write, and its name could be exchanged with a symlink or another
    directory meanwhile.  It is checked to be the empty directory just made,
    owned by us and closed to others, and, once locked, to still be at its
    name: a concurrent :func:`sweep` that locked (and removed) it first
    makes this try again with a new name.

    Returns:
        ``(name, fd holding the lock, its fstat)``; the caller closes the fd.

    Raises:
        DirectoryReplacedError: the private directory was replaced by another
            process (or swept away on every attempt).
        OSError: ``mkdir`` or the open failed (EROFS, ENOSPC, EMFILE ...).
    """
    for _ in range(_TRASH_ATTEMPTS):
        trash = TRASH_PREFIX + _secrets.token_hex(8).encode()
        os.mkdir(trash, 0o700, dir_fd=pfd)
        try:
            tfd = os.open(trash, _ENTER_FLAGS, dir_fd=pfd)
        except FileNotFoundError:
            continue  # a sweep removed it before the open
        except OSError:
            with contextlib.suppress(OSError):
                os.rmdir(trash, dir_fd=pfd)  # (an empty directory, or whatever took the name: then kept)
            raise
        try:
            tst = os.fstat(tfd)
            if tst.st_uid != os.geteuid() or _stat.S_IMODE(tst.st_mode) & 0o077:
                raise DirectoryReplacedError("rmdir: its private directory was replaced by another process",
                                             sandbox_path=None)
            try:
                fcntl.flock(tfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(tfd)  # a sweep holds it (and removes the empty directory): another name
                continue
            try:
                at_name = os.stat(trash, dir_fd=pfd, follow_symlinks=False)
            except FileNotFoundError:
                at_name = None
            if at_name is None or (at_name.st_dev, at_name.st_ino) != (tst.st_dev, tst.st_ino):
                os.close(tfd)  # a sweep locked and removed it before our lock: another name
                continue
            if os.fstat(tfd).st_nlink != 2:  # something was made in it
                raise DirectoryReplacedError("rmdir: its private directory was changed by another process",
                                             sandbox_path=None)
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(tfd)
            raise
        return trash, tfd, tst
    raise DirectoryReplacedError("rmdir: its private directory was removed by another process on every attempt",
                                 sandbox_path=None)


def _remove_own_empty(pfd: int, name: bytes, made: os.stat_result) -> None:
    """Best effort: ``rmdir(name)`` in ``pfd`` if it is still the directory ``made`` (an empty one is all rmdir takes)."""
    with contextlib.suppress(OSError):
        left = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        if (left.st_dev, left.st_ino) == (made.st_dev, made.st_ino):
            os.rmdir(name, dir_fd=pfd)


def sweep(root: Root, path: str | bytes) -> int:
    """``Root.sweep_removals``: undo and remove the stale private directories in directory ``path``.

    Each ``.sfs-rm-*`` entry is opened as one component beneath the
    directory's fd (``O_NOFOLLOW``, never across a mount point: a symlink,
    a file or a mount at such a name is left), locked without waiting (one
    held by a removal in flight is left), and checked to be what
    :func:`rmdir_checked` makes (a directory owned by this process's
    effective uid, closed to group and others, not a read-only grant).
    What it holds is then moved back to its own name in the directory
    (``RENAME_NOREPLACE``, through the locked fd: a name taken meanwhile
    keeps the entry where it is), and the private directory is removed if
    it is then empty and still the one locked.  Nothing in it is ever
    removed.  Best effort: a step that fails leaves that entry.

    Returns:
        How many private directories were removed.

    Raises:
        Nothing for a leftover; those of :meth:`Root.open_dir_fd` when
        ``path`` itself cannot be opened; ReadOnlyError when ``path`` is a
        read-only Root or grant.
    """
    rel = root._rel(path)
    root._check_writable(rel, "sweep")
    with root._use() as rootfd:
        dfd = root._open_fd(rootfd, rel, _ENTER_FLAGS & ~os.O_NOFOLLOW, 0, "sweep")
        try:
            if root._deny:
                root._check_write_target(dfd, None, rel, False)  # never in or beneath a read-only grant
            try:
                # host-access: none; lists the directory fd just opened beneath the Root (no path is walked)
                names = [os.fsencode(n) for n in os.listdir(dfd) if n.startswith(".sfs-rm-")]
            except OSError:
                return 0
            return sum(_sweep_one(root, dfd, name) for name in names)
        finally:
            os.close(dfd)


def _sweep_one(root: Root, dfd: int, name: bytes) -> bool:
    """:func:`sweep` of the entry ``name`` of ``dfd``: True when it was a stale private directory, now removed."""
    try:
        tfd = _open_dir_here(root, dfd, name, _ENTER_FLAGS)
    except (OSError, _MountPoint):
        return False  # gone, not a directory, a symlink, a mount point, or not ours to open
    try:
        tst = os.fstat(tfd)
        if tst.st_uid != os.geteuid() or _stat.S_IMODE(tst.st_mode) & 0o077 or \
                (tst.st_dev, tst.st_ino) in root._deny:
            return False  # not one rmdir_checked made
        try:
            fcntl.flock(tfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # a removal in flight holds it
        # host-access: none; lists the directory fd just entered and locked (no path is walked)
        for entry in os.listdir(tfd):
            ename = os.fsencode(entry)
            with contextlib.suppress(OSError):
                _native.renameat2(tfd, ename, dfd, ename, _native.RENAME_NOREPLACE, "sweep", None)
        try:
            left = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if (left.st_dev, left.st_ino) != (tst.st_dev, tst.st_ino):
                return False
            os.rmdir(name, dir_fd=dfd)  # only ever an empty directory (a name taken meanwhile kept its entry)
        except OSError:
            return False
        return True
    finally:
        os.close(tfd)


def rmtree(root: Root, path: str | bytes, missing_ok: bool, skip: Skip | None) -> None:
    """``Root.rmtree``: remove the tree at ``path`` (see there for the errors)."""
    rel = root._rel(path)
    if rel.rstrip(b"/") in (b"", b"."):
        with root._use():
            pass
        root.clear(skip=skip)
        return
    with root._use() as rootfd:
        pfd, leaf = root._open_parent(rootfd, rel, "rmtree", write=True, dir_op=True)
        try:
            try:
                os.unlink(leaf, dir_fd=pfd)
                return
            except FileNotFoundError:
                if missing_ok:
                    return
                raise
            except IsADirectoryError:
                pass
            st = os.stat(leaf, dir_fd=pfd, follow_symlinks=False)
            if skip is not None and skip(st):
                return
            if _clear_dir(root, pfd, leaf, rel, skip):
                rmdir_checked(root, pfd, leaf, None)
        except OSError as exc:
            root._oserror(exc, "rmtree", rel)
        finally:
            os.close(pfd)


def clear(root: Root, skip: Skip | None, make_writable: bool, keep_denied: bool) -> None:
    """``Root.clear``: remove everything inside the root (see there for the errors)."""
    root._check_writable(b".", "clear")
    with root._use() as rootfd:
        try:
            _clear_dir(root, rootfd, b".", b".", skip, make_writable, keep_denied)
        except OSError as exc:
            root._oserror(exc, "clear", b".")


@dataclass
class _Frame:
    """One directory of a removal being emptied; its fd is owned by the stack from the moment it is opened."""

    fd: int
    names: Iterator[str]
    """Its entries not yet removed."""
    name_in_parent: bytes | None
    """None for the top directory (never removed here)."""
    identity: tuple[int, int] | None
    """With read-only grants: the directory the ``rmdir`` must find at its name."""
    restore_mode: int | None = None
    """The mode it had when the removal made it writable: given back if it is kept."""
    kept: bool = False
    """Something inside was kept (a mount point, a grant, a skipped directory)."""


def _clear_dir(root: Root, parent_fd: int, name: bytes, rel: bytes, skip: Skip | None,
               writable: bool = False, keep_denied: bool = False) -> bool:
    """Empty directory ``name`` under ``parent_fd``; True when it is empty now (``writable``: see ``Root.clear``).

    Raises:
        ReadOnlyError: the removal would enter a read-only grant (without ``keep_denied``).
        OSError: an entry could not be removed or entered (EACCES, EBUSY ...).
    """
    stack: list[_Frame] = []
    try:
        try:
            top, _ = _open_dir_entered(root, parent_fd, name, _ENTER_FLAGS, False)
        except _MountPoint:
            return False
        stack.append(_Frame(top, iter(()), None, None))
        _check_entered(root, top, rel)  # the top's own mode is never changed
        # host-access: none; lists the directory fd just entered beneath the Root (no path is walked)
        stack[-1].names = iter(os.listdir(top))
        while True:  # until the top directory is left
            frame = stack[-1]
            child = next(frame.names, None)
            if child is None:
                stack.pop()
                _leave_dir(root, frame, stack[-1] if stack else None)
                if not stack:
                    return not frame.kept
                continue
            _remove_entry(root, frame, os.fsencode(child), rel, stack, skip, writable, keep_denied)
    except BaseException:
        for frame in stack:
            os.close(frame.fd)
        raise


def _leave_dir(root: Root, frame: _Frame, parent: _Frame | None) -> None:
    """Close an emptied ``frame`` and remove it from ``parent`` (or mark ``parent`` as keeping something)."""
    try:
        if frame.kept and frame.restore_mode is not None:
            os.fchmod(frame.fd, frame.restore_mode)  # kept (a mount point inside): its mode as it was
    finally:
        os.close(frame.fd)
    if parent is None:
        return
    if frame.kept:
        parent.kept = True
        return
    assert frame.name_in_parent is not None
    try:
        if not rmdir_checked(root, parent.fd, frame.name_in_parent, frame.identity):
            parent.kept = True  # another directory was at the name: kept
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
            raise
        parent.kept = exc.errno != errno.ENOENT


def _remove_entry(root: Root, frame: _Frame, cname: bytes, rel: bytes, stack: list[_Frame], skip: Skip | None,
                  writable: bool, keep_denied: bool) -> None:
    """Unlink entry ``cname`` of ``frame``, or, for a directory to empty, push its frame on ``stack``."""
    dfd = frame.fd
    try:
        os.unlink(cname, dir_fd=dfd)
        return
    except FileNotFoundError:
        return
    except IsADirectoryError:
        pass
    except PermissionError as exc:
        if exc.errno != errno.EPERM:  # EPERM from unlink(dir) on some fs
            raise
    if _hooks.current is not None:
        _hooks.fire("remove.enter_dir", root=root, name=cname, parent_fd=dfd)
    try:
        if skip is not None and skip(os.stat(cname, dir_fd=dfd, follow_symlinks=False)):
            frame.kept = True
            return
        cfd, orig = _open_dir_entered(root, dfd, cname, _ENTER_FLAGS, writable, keep_denied)
    except _MountPoint:
        frame.kept = True  # never removed through a mount point (bind mounts included)
        return
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            # swapped for a symlink or file since: unlink that instead
            try:
                os.unlink(cname, dir_fd=dfd)
            except FileNotFoundError:
                pass
            return
        raise
    if keep_denied and root._deny:
        cst = os.fstat(cfd)
        if (cst.st_dev, cst.st_ino) in root._deny:  # checked on the fd entered
            os.close(cfd)
            frame.kept = True
            return
    entered = os.fstat(cfd) if root._deny else None
    child = _Frame(cfd, iter(()), cname, (entered.st_dev, entered.st_ino) if entered else None, orig)
    stack.append(child)
    changed = _check_entered(root, cfd, rel, writable)
    if orig is None:
        child.restore_mode = changed
    # host-access: none; lists the directory fd just entered beneath the Root (no path is walked)
    child.names = iter(os.listdir(cfd))


def _open_dir_entered(root: Root, dfd: int, name: bytes, flags: int, writable: bool,
                      keep_denied: bool = False) -> tuple[int, int | None]:
    """:func:`_open_dir_here`, returning ``(fd, mode it had if this changed it, else None)``.

    With ``writable``, a directory its owner cannot read (EACCES) is first
    opened ``O_PATH`` (the same checks), given u+rwx through that fd, then
    opened from it.

    Raises:
        _MountPoint: ``name`` is a mount point, or (``keep_denied``) a read-only grant.
        ReadOnlyError: ``name`` is a read-only grant.
        OSError: as :func:`_open_dir_here`.
    """
    from .root import fd_chmod  # noqa: PLC0415  (root imports this module)

    try:
        return _open_dir_here(root, dfd, name, flags), None
    except PermissionError:
        if not writable:
            raise
    pfd = _open_dir_here(root, dfd, name, (flags & ~os.O_RDONLY & ~os.O_WRONLY & ~os.O_RDWR) | _native.O_PATH)
    try:
        if keep_denied and root._deny:
            pst = os.fstat(pfd)
            if (pst.st_dev, pst.st_ino) in root._deny:
                raise _MountPoint()  # kept like a mount point: never made writable
        _check_entered(root, pfd, b".", False)  # never a read-only grant
        orig = _stat.S_IMODE(os.fstat(pfd).st_mode)
        fd_chmod(pfd, orig | 0o700)
        return os.open(".", flags, dir_fd=pfd), orig
    finally:
        os.close(pfd)


def _open_dir_here(root: Root, dfd: int, name: bytes, flags: int) -> int:
    """Open directory entry ``name`` of ``dfd`` (one component, ``O_NOFOLLOW``) for a recursive removal.

    Whenever the kernel has openat2 (whichever resolver the Root uses for
    paths), with ``RESOLVE_NO_XDEV``: a mount point, a same-filesystem bind
    mount included (which ``st_dev`` does not reveal), raises
    :class:`_MountPoint` and is kept.  Without openat2, a directory on
    another device than its parent is kept (a same-filesystem bind mount
    is not seen there).

    Raises:
        _MountPoint: ``name`` is a mount point.
        OSError: as ``os.open`` (ELOOP for a symlink, ENOTDIR ...).
    """
    if name == b".":
        return os.open(name, flags, dir_fd=dfd)
    if not _native.have_openat2():
        fd = os.open(name, flags, dir_fd=dfd)
        if os.fstat(fd).st_dev != os.fstat(dfd).st_dev:
            os.close(fd)
            raise _MountPoint()
        return fd
    ret = _native.openat2_raw(dfd, name, flags, 0, _CLEAR_RESOLVE)
    if ret >= 0:
        return ret
    if -ret == errno.EXDEV:
        raise _MountPoint()
    raise OSError(-ret, os.strerror(-ret))


def _check_entered(root: Root, dfd: int, rel: bytes, writable: bool = False) -> int | None:
    """A recursive removal never enters a denied (read-only grant) directory; ``writable``: make it u+rwx.

    Returns:
        The mode the directory had when this made it writable, else None.

    Raises:
        ReadOnlyError: ``dfd`` is a read-only grant nested in the Root.
    """
    if root._deny or writable:
        st = os.fstat(dfd)
        if (st.st_dev, st.st_ino) in root._deny:
            raise ReadOnlyError("removal would enter a read-only grant", sandbox_path=root._show(rel))
        if writable and st.st_mode & 0o700 != 0o700:
            os.fchmod(dfd, _stat.S_IMODE(st.st_mode) | 0o700)
            return _stat.S_IMODE(st.st_mode)
    return None
