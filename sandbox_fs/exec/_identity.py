"""Unprivileged identities for confined commands on a root host: allocation and workspace ownership.

On a root host a confined command runs as a dedicated uid/gid (uid == gid)
leased from a documented range, one per live session (or per
:func:`sandbox_fs.exec.run_confined` call without a supervisor), so that
file ownership and ``RLIMIT_NPROC`` (both per uid) separate it from root,
from system daemons and from every other live session.

The range
---------
Default: :data:`DEFAULT_ID_BASE` .. ``+ DEFAULT_ID_COUNT - 1``
(1879113728 .. 1879179263, ``0x70010000`` .. ``0x7001ffff``).  Per systemd's
"Users, Groups, UIDs and GIDs on systemd Systems" (systemd.io/UIDS-GIDS)
``0x70000000`` .. ``0x7ffdffff`` is unused by systemd; it lies above the
regular users (login.defs ``UID_MAX`` 60000), ``nobody`` (65534), the
default ``/etc/subuid`` allocations of useradd (100000 .. 600100000) and
systemd-nspawn's container range (524288 .. 1879048191), and below the
foreign/nsresourced ranges (``0x7ffe0000``) and 2^31 (ids some tools read
as signed).  A host picks another with ``ConfinementPolicy.identity_range``.

Allocation, reuse, clean-up
---------------------------
A lease is an exclusive ``flock`` on ``/run/sandbox-fs/ids/<uid>``: the
directory is made mode 0700 by root and opened without following symlinks
(a directory not owned by root or open to others is refused), and each
lock file is opened ``O_NOFOLLOW`` beneath it.  The id the workspace's
owner names is tried first, when it lies in the range (a resumed session
keeps its id, so nothing is re-owned and its files' ctimes stay: layered
persists stay small), then ids from the bottom of the range; a hint is only
a hint, and every id gets the same checks.  One is refused (and the next tried) when another
lease holds its lock, when it names a user or group in the system database
(``getpwuid``/``getgrgid``: ``/etc/passwd``, ``/etc/group``, NSS), or when
any running process has it as a real, effective, saved or filesystem uid or
gid (``/proc/*/status``; skipped only when the lock file says its last
holder released it with every process of the id killed and gone: a
supervisor whose processes all ran in cgroup leaves).  :meth:`IdentityLease.release` (session close,
supervisor close, garbage collection) unlocks it; the kernel drops an
``flock`` when its holder dies, so ids of a crashed or SIGKILLed host
become free again, once their processes are gone (the process check).  The
lock files themselves stay (empty, root-only).  Files the identity made
stay in that session's workspace (removed with it, or re-owned by the next
identity on resume); outside the workspace it can make nothing.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import os
import pwd
import stat
import threading
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from ..root import Root

__all__ = ["DEFAULT_ID_BASE", "DEFAULT_ID_COUNT", "LOCK_DIR", "IdentityLease", "lease", "reown_tree"]

#: First uid/gid of the default range (``0x70010000``).
DEFAULT_ID_BASE = 0x70010000
#: Number of ids in the default range (one per concurrent session).
DEFAULT_ID_COUNT = 65536
#: Root-only directory holding one lock file per leased id.
LOCK_DIR = "/run/sandbox-fs/ids"

_ID_MAX = 0x7FFFFFFF


class IdentityUnavailableError(OSError):
    """No id of the range can be leased (all held, in the user database, or running processes)."""


def _open_lock_dir(path: str) -> int:
    """Open (making it mode 0700) ``path`` component by component, never following a symlink."""
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)  # host-access: the walk's start: each component below is opened O_NOFOLLOW from this fd
    try:
        for name in [p for p in path.split("/") if p]:
            try:
                os.mkdir(name, 0o700, dir_fd=fd)
            except FileExistsError:
                pass
            nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nfd
        st = os.fstat(fd)
        if st.st_uid != 0 or stat.S_IMODE(st.st_mode) & 0o077:
            raise PermissionError(errno.EPERM, "the identity lock directory is not root-only")
        return fd
    except BaseException:
        os.close(fd)
        raise


def _ids_with_processes() -> set[int]:
    """Every uid and gid (real, effective, saved, filesystem) of a running process."""
    found: set[int] = set()
    try:
        pids = [n for n in os.listdir("/proc") if n.isdigit()]  # host-access: the process table
    except OSError:
        return found
    for pid in pids:
        try:
            fd = os.open(f"/proc/{pid}/status", os.O_RDONLY | os.O_CLOEXEC)  # host-access: the process table
        except OSError:
            continue  # exited meanwhile
        try:
            data = os.read(fd, 8192)
        except OSError:
            continue
        finally:
            os.close(fd)
        for key in (b"\nUid:", b"\nGid:"):
            at = data.find(key)
            if at >= 0:
                end = data.find(b"\n", at + 1)
                found.update(int(x) for x in data[at + 5:end if end > 0 else None].split())
    return found


def _in_user_database(ident: int) -> bool:
    for lookup in (pwd.getpwuid, grp.getgrgid):
        try:
            lookup(ident)
            return True
        except KeyError:
            continue
        except OSError:  # an unreachable NSS backend: do not guess that the id is free
            return True
    return False


#: Content of a lock file whose last holder released it knowing no process of the id was
#: left (its processes ran in cgroup leaves that were killed and found empty).  Anything
#: else (a new file, a crashed holder's "held") makes the next lease scan ``/proc``.
_CLEAN = b"clean\n"
_HELD = b"held\n"


def _unlock(fd_box: list[int], clean_box: list[bool]) -> None:
    fd = fd_box[0]
    fd_box[0] = -1
    if fd >= 0:
        if clean_box[0]:
            try:
                os.pwrite(fd, _CLEAN, 0)
            except OSError:
                pass
        os.close(fd)  # closing the only fd of the open file description drops the flock


class IdentityLease:
    """One leased uid/gid (uid == gid); held until :meth:`release` or garbage collection.

    Attributes:
        uid: the leased uid.
        gid: the leased gid (equal to ``uid``).

    Thread-safety: :meth:`release` may be called from any thread, any number of times.
    """

    def __init__(self, ident: int, fd: int) -> None:
        self.uid = ident
        self.gid = ident
        self._fd = [fd]
        self._clean = [False]
        self._finalizer = weakref.finalize(self, _unlock, self._fd, self._clean)

    @property
    def ids(self) -> tuple[int, int]:
        """``(uid, gid)``."""
        return (self.uid, self.gid)

    @property
    def held(self) -> bool:
        """True until :meth:`release`."""
        return self._fd[0] >= 0

    def release(self, *, no_processes_left: bool = False) -> None:
        """Give the id back (unlock its lock file).  Idempotent.

        Args:
            no_processes_left: the caller knows that no process of the id
                is left (its cgroup leaves were killed and found empty): the
                next lease of the id may skip the ``/proc`` scan.
        """
        self._clean[0] = bool(no_processes_left)
        self._finalizer()

    def __enter__(self) -> "IdentityLease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<IdentityLease uid={self.uid} {'held' if self.held else 'released'}>"


_LOCK = threading.Lock()


def lease(base: int = DEFAULT_ID_BASE, count: int = DEFAULT_ID_COUNT, *, lock_dir: str = LOCK_DIR,
          prefer: int | None = None) -> IdentityLease:
    """Lease ``prefer`` when it is a free id of ``[base, base + count)``, else the lowest free one.

    ``prefer`` is only a hint (a session's workspace owner: hostile), so it
    gets exactly the checks every other id gets (the exclusive lock, the
    user database, the process table); an id outside the range, 0, or one
    another lease holds is passed over for the lowest free id.  Keeping a
    session's id across resumes keeps its workspace's ownership, so no
    re-own changes every ctime (which made every layered persist a full
    copy of the tree).

    Args:
        base: first uid/gid of the range (> 65535, and ``base + count`` <= 2^31).
        count: number of ids in the range (>= 1).
        lock_dir: host path of the root-only lock directory (trusted).
        prefer: the id to try first (None: none).

    Returns:
        An :class:`IdentityLease`; release it when its session closes.

    Raises:
        ValueError: the range is empty, reaches 65535 or below, or 2^31.
        PermissionError: not root, or ``lock_dir`` is not root-only (owner
            root, no group/other bits).
        IdentityUnavailableError: every id of the range is leased, in the
            user database, or used by a running process.
        OSError: the lock directory cannot be made or opened.
    """
    base, count = int(base), int(count)
    if count < 1 or base <= 65535 or base + count - 1 > _ID_MAX:
        raise ValueError("the identity range must lie within 65536 .. 2^31-1 and hold at least one id")
    if os.geteuid() != 0:
        raise PermissionError(errno.EPERM, "only a root host leases identities")
    first = [int(prefer)] if isinstance(prefer, int) and base <= prefer < base + count else []
    with _LOCK:
        dfd = _open_lock_dir(lock_dir)
        try:
            busy: list[set[int] | None] = [None]
            for ident in first + [i for i in range(base, base + count) if i not in first]:
                got = _try_lease(dfd, ident, busy)
                if got is not None:
                    return got
        finally:
            os.close(dfd)
    raise IdentityUnavailableError(errno.EAGAIN, "no free identity in the configured range")


def _try_lease(dfd: int, ident: int, busy: list[set[int] | None]) -> IdentityLease | None:
    """``ident``'s lease when its lock is free and it is in neither the user database nor the process table.

    ``busy``: a one-item box for the process table's ids, scanned on first need.
    """
    fd = os.open(str(ident), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "an identity lock file is not a regular file")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    try:
        clean = os.pread(fd, 16, 0) == _CLEAN
        os.ftruncate(fd, 0)
        os.pwrite(fd, _HELD, 0)
    except BaseException:
        os.close(fd)
        raise
    if not clean and busy[0] is None:
        busy[0] = _ids_with_processes()
    if (not clean and ident in (busy[0] or ())) or _in_user_database(ident):
        os.close(fd)  # left "held": the next lease scans again
        return None
    return IdentityLease(ident, fd)


# ------------------------------------------------------------------ workspace ownership

_REOWN_KINDS = (stat.S_IFDIR, stat.S_IFREG, stat.S_IFIFO, stat.S_IFSOCK)


def reown_tree(root: "Root", owner: tuple[int, int], *,
               skip_identities: frozenset[tuple[int, int]] = frozenset(), only_uids: range | None = None) -> int:
    """Give ``owner`` every directory, regular file, FIFO and socket beneath ``root`` (the root too).

    The tree is hostile and may change meanwhile: each entry is opened
    ``O_PATH | O_NOFOLLOW`` beneath the root (never by a host path), checked
    on its fd (same inode as listed, same device as the root: a mount is
    never crossed nor entered), and changed with ``fchown`` on that fd.
    Left alone: entries already owned by ``owner`` (a stat, no open),
    symlinks (removing or replacing one needs only its directory), device
    nodes, regular files with more than one link (one may be a hard link to
    an inode outside the workspace), and the directories of
    ``skip_identities`` (nested grants) with everything beneath them.
    ``chown`` clears set-id bits of a regular file.

    Args:
        root: the workspace Root (must not be read-only).
        owner: ``(uid, gid)``.
        skip_identities: ``(st_dev, st_ino)`` of directories never entered.
        only_uids: change only entries whose owner uid is in this range
            (None: every entry not owned by ``owner``).

    Returns:
        The number of entries changed.

    Raises:
        OSError: the root itself cannot be changed; entries that vanish
            meanwhile are skipped.
    """
    from .._root_walk import walk_dirs  # noqa: PLC0415

    reown = _Reown(root, owner, only_uids)
    for _dpath, dirs, nondirs in walk_dirs(root, "."):
        keep = []
        for e in dirs:
            if e.stat.st_dev != reown.dev or (e.stat.st_dev, e.stat.st_ino) in skip_identities:
                continue  # another filesystem (a mount) or a nested grant: never entered
            fd = reown.open_here(e.path)  # every directory: a same-filesystem bind mount is pruned here
            if fd is None:
                continue
            keep.append(e)
            if reown.wanted(e.stat):
                reown.fix(e.path, e.stat, fd)
            else:
                os.close(fd)
        dirs[:] = keep
        for e in nondirs:
            if reown.wanted(e.stat) and reown.changeable(e.stat):
                reown.fix(e.path, e.stat)
    return reown.changed


class _Reown:
    """One :func:`reown_tree` run: the owner wanted, the root's device, and what it changed.

    The root itself is changed (when wanted) on construction.
    """

    def __init__(self, root: "Root", owner: tuple[int, int], only_uids: range | None) -> None:
        from ..root import fd_chown  # noqa: PLC0415

        self.root, self.owner, self.only_uids = root, (owner[0], owner[1]), only_uids
        self._chown = fd_chown
        self.changed = 0
        top = root.open_fd(".", os.O_PATH | os.O_DIRECTORY)
        try:
            st = os.fstat(top)
            self.dev = st.st_dev
            if self.wanted(st):
                fd_chown(top, owner)
                self.changed += 1
        finally:
            os.close(top)

    def wanted(self, st: os.stat_result) -> bool:
        """Not yet owned by the owner, and (with ``only_uids``) owned by one of those uids."""
        return (st.st_uid, st.st_gid) != self.owner and (self.only_uids is None or st.st_uid in self.only_uids)

    def changeable(self, st: os.stat_result) -> bool:
        """A kind that is re-owned, on the root's filesystem, and not a regular file with other links."""
        return (stat.S_IFMT(st.st_mode) in _REOWN_KINDS and st.st_dev == self.dev
                and not (stat.S_ISREG(st.st_mode) and st.st_nlink > 1))

    def open_here(self, path: str) -> int | None:
        """O_PATH|O_NOFOLLOW beneath the root, never through a mount point (RESOLVE_NO_XDEV)."""
        from .._root_walk import open_on_same_mount  # noqa: PLC0415

        try:
            return open_on_same_mount(self.root, path, os.O_PATH | os.O_NOFOLLOW, "chown")
        except OSError:
            return None  # removed, swapped or beyond a mount point

    def fix(self, path: str, listed: os.stat_result, fd: int | None = None) -> None:
        """Re-own ``path`` (or ``fd``, then closed) when it is still the listed entry and changeable."""
        fd = self.open_here(path) if fd is None else fd
        if fd is None:
            return
        try:
            cur = os.fstat(fd)
            if ((cur.st_dev, cur.st_ino) != (listed.st_dev, listed.st_ino)
                    or not self.changeable(cur) or not self.wanted(cur)):
                return
            self._chown(fd, self.owner)
            self.changed += 1
        finally:
            os.close(fd)
