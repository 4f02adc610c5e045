"""Landlock ruleset construction from file descriptors (private to :mod:`sandbox_fs.exec`).

The ruleset is built in the parent process from **fds**: the workspace Root's
``O_PATH`` fd (``Root.fileno_dup()``), each grant Root's fd, and the fixed
system paths opened ``O_PATH`` by their host paths.  The resulting ruleset fd
is handed to the ``sfs-exec`` helper, which applies it to itself just before
``execve`` (see ``native/sfs_exec.c``).

Access rights and their ABI versions follow the kernel's
``include/uapi/linux/landlock.h`` and Documentation/userspace-api/landlock.rst:
ABI 1 the 13 basic filesystem rights, ABI 2 ``REFER``, ABI 3 ``TRUNCATE``,
ABI 4 TCP ``BIND``/``CONNECT``, ABI 5 ``IOCTL_DEV``, ABI 6 scoping of
abstract unix sockets and signals.  Rights a kernel does not know are never
asked for, so the same code runs on every ABI >= 1.
"""

from __future__ import annotations

import errno
import os
import stat as _stat
from dataclasses import dataclass
from typing import Iterable

from .. import _native

# --- filesystem rights (landlock.h) ---------------------------------------
FS_EXECUTE = 1 << 0
FS_WRITE_FILE = 1 << 1
FS_READ_FILE = 1 << 2
FS_READ_DIR = 1 << 3
FS_REMOVE_DIR = 1 << 4
FS_REMOVE_FILE = 1 << 5
FS_MAKE_CHAR = 1 << 6
FS_MAKE_DIR = 1 << 7
FS_MAKE_REG = 1 << 8
FS_MAKE_SOCK = 1 << 9
FS_MAKE_FIFO = 1 << 10
FS_MAKE_BLOCK = 1 << 11
FS_MAKE_SYM = 1 << 12
FS_REFER = 1 << 13        # ABI 2
FS_TRUNCATE = 1 << 14     # ABI 3
FS_IOCTL_DEV = 1 << 15    # ABI 5

NET_BIND_TCP = 1 << 0     # ABI 4
NET_CONNECT_TCP = 1 << 1  # ABI 4

SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
SCOPE_SIGNAL = 1 << 1                # ABI 6

_FS_ABI1 = (1 << 13) - 1

#: Rights that only make sense on a directory: a rule on a regular file
#: carrying one of them is refused by the kernel with EINVAL.
FS_DIR_ONLY = (FS_READ_DIR | FS_REMOVE_DIR | FS_REMOVE_FILE | FS_MAKE_CHAR | FS_MAKE_DIR | FS_MAKE_REG
               | FS_MAKE_SOCK | FS_MAKE_FIFO | FS_MAKE_BLOCK | FS_MAKE_SYM | FS_REFER)

#: Read-only and execute (system set, read-only grants).
FS_READ_EXEC = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR


def fs_mask(abi: int) -> int:
    """All filesystem rights the kernel with Landlock ABI ``abi`` handles."""
    if abi <= 0:
        return 0
    mask = _FS_ABI1
    if abi >= 2:
        mask |= FS_REFER
    if abi >= 3:
        mask |= FS_TRUNCATE
    if abi >= 5:
        mask |= FS_IOCTL_DEV
    return mask


def fs_read_write(abi: int) -> int:
    """Read-write rights for the workspace and read-write grants.

    Everything the ABI offers except creating character or block devices
    (``MAKE_CHAR``/``MAKE_BLOCK``: a device node in the workspace is a way
    out, CVE-style "mknod escape") and ``IOCTL_DEV`` on device files.
    """
    return fs_mask(abi) & ~(FS_MAKE_CHAR | FS_MAKE_BLOCK | FS_IOCTL_DEV)


def net_mask(abi: int) -> int:
    return (NET_BIND_TCP | NET_CONNECT_TCP) if abi >= 4 else 0


def scope_mask(abi: int) -> int:
    return (SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL) if abi >= 6 else 0


def abi() -> int:
    """The Landlock ABI version to target: the running kernel's, 0 when Landlock is unavailable,
    capped by ``SANDBOX_FS_DEGRADE=landlock=N`` (:func:`sandbox_fs._features.lowered`)."""
    from .._features import lowered  # noqa: PLC0415

    return lowered().abi(_native.landlock_abi())


# --- the system set ----------------------------------------------------------

#: Directories granted read + execute to every confined process.  On a
#: merged-/usr system ``/bin``, ``/sbin`` and ``/lib*`` are symlinks into
#: ``/usr``; opening them follows the link, so the rule lands on the target.
SYSTEM_READ_EXEC_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")

#: Device files: (path, rights).  Writing /dev/null, /dev/zero and /dev/full
#: is what ``cmd > /dev/null`` needs; the random devices are read-only.
SYSTEM_DEVICES = (
    ("/dev/null", FS_READ_FILE | FS_WRITE_FILE),
    ("/dev/zero", FS_READ_FILE | FS_WRITE_FILE),
    ("/dev/full", FS_READ_FILE | FS_WRITE_FILE),
    ("/dev/random", FS_READ_FILE),
    ("/dev/urandom", FS_READ_FILE),
)

#: Paths under ``/etc`` never granted (besides everything that is not
#: world-readable, such as ``shadow`` and ``gshadow``): credentials, private
#: keys and privilege configuration.  A nested name makes its parent be
#: granted entry by entry.
ETC_EXCLUDED = frozenset({
    "shadow", "shadow-", "gshadow", "gshadow-", "sudoers", "sudoers.d", "ssh", "ssl/private",
    "security/opasswd", "credstore", "credstore.encrypted", "wireguard", "krb5.keytab",
    "ppp", "NetworkManager/system-connections", ".pwd.lock", "machine-id",
})


@dataclass(frozen=True)
class SystemRule:
    """One system rule: a fixed host path, its rights, and whether it is a directory."""

    host_path: str
    access: int


_SYSTEM_PREFIXES = ("/etc/", "/usr/")


def _inside_system(real: str) -> bool:
    """True when a resolved path lies under ``/etc`` or ``/usr`` (never ``/`` itself)."""
    return real.startswith(_SYSTEM_PREFIXES)


#: Bounds of the /etc walk: entries looked at and rules made.  Past them the
#: rest is left out (less access, never more).
ETC_MAX_ENTRIES = 20000
ETC_MAX_RULES = 1500


def _etc_rules(top: str = "/etc") -> list[SystemRule]:
    """The world-readable part of ``/etc`` minus :data:`ETC_EXCLUDED`, as few rules as possible.

    The whole tree is checked, not only its top level: a directory gets one
    rule only when everything beneath it is world-readable (files ``o+r``,
    directories ``o+rx``, no other file types, no excluded name); otherwise
    its world-readable children get rules one by one and its other
    subdirectories are looked into the same way.  A directory that is not
    ``o+rx`` is skipped with all it holds (``polkit-1/rules.d``), a file that
    is not ``o+r`` too (``default/cacerts``, ``postgresql/*/pg_hba.conf``):
    a uid-0 child passes their owner check, only Landlock can keep them out.

    A symlink is followed only when it resolves under ``/usr`` (granted
    anyway), or under ``/etc`` to something this walk grants itself: a link
    to ``/`` (or to ``/proc/<pid>``, like ``mtab``) or to a private file
    would otherwise grant more than the system set.  Symlinks do not make a
    directory "unclean": Landlock checks their target, not the link.
    """
    top = top.rstrip("/") or "/"
    walk = _EtcWalk(top)
    root = _EtcNode(top, "dir", True)
    walk.scan(root)
    walk.emit(root)
    walk.add_links()
    return walk.rules[:ETC_MAX_RULES]


class _EtcNode:
    """An entry of the /etc walk: ``kind`` is "dir", "file", "link" or "other".

    ``ok``: world-readable (a directory: ``o+rx``).  ``clean``: it and
    everything beneath it is world-readable and allowed, so one rule covers it.
    """

    __slots__ = ("path", "kind", "ok", "clean", "children")

    def __init__(self, path: str, kind: str, ok: bool) -> None:
        self.path, self.kind, self.ok = path, kind, ok
        self.clean = ok and kind != "other"
        self.children: list[_EtcNode] = []


class _EtcWalk:
    """One walk of /etc (see :func:`_etc_rules`): the entries left to look at, and the rules made."""

    def __init__(self, top: str) -> None:
        self.top = top
        self.budget = ETC_MAX_ENTRIES
        self.excluded = {f"{top}/{e}" for e in ETC_EXCLUDED}
        self.rules: list[SystemRule] = []
        self.granted_dirs: list[str] = []
        self.granted_files: set[str] = set()
        self.links: list[str] = []

    def scan(self, node: _EtcNode) -> None:
        """Fill node.children; node.clean = everything beneath is world-readable and allowed."""
        try:
            # host-access: system set: walking /etc to grant only world-readable files (fixed host paths, never a workspace)
            with os.scandir(node.path) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError:
            node.clean = False
            return
        for e in entries:
            self.budget -= 1
            if self.budget < 0:
                node.clean = False
                return
            path = f"{node.path}/{e.name}"
            if path in self.excluded:
                node.clean = False
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                node.clean = False
                continue
            mode = st.st_mode
            if _stat.S_ISLNK(mode):
                node.children.append(_EtcNode(path, "link", True))
                continue
            if _stat.S_ISDIR(mode):
                child = _EtcNode(path, "dir", mode & 0o005 == 0o005)
                if child.ok:
                    self.scan(child)
            elif _stat.S_ISREG(mode):
                child = _EtcNode(path, "file", bool(mode & 0o004))
            else:
                child = _EtcNode(path, "other", False)
            node.children.append(child)
            if not child.clean:
                node.clean = False

    def emit(self, node: _EtcNode) -> None:
        """Rules for node's children: one per clean directory or readable file; links kept for later."""
        for c in node.children:
            if c.kind == "link":
                self.links.append(c.path)
            elif not c.ok or c.kind == "other":
                continue
            elif c.kind == "file":
                self.rules.append(SystemRule(c.path, FS_READ_FILE | FS_EXECUTE))
                self.granted_files.add(c.path)
            elif c.clean:
                self.rules.append(SystemRule(c.path, FS_READ_EXEC))
                self.granted_dirs.append(c.path)
            else:
                self.emit(c)

    def granted(self, real: str) -> bool:
        return real in self.granted_files or any(real == d or real.startswith(d + "/") for d in self.granted_dirs)

    def add_links(self) -> None:
        """A rule for each symlink that lands under ``/usr`` or on something this walk granted."""
        for path in self.links:
            try:
                real = os.path.realpath(path)
                st = os.stat(real)  # host-access: system set: where an /etc symlink lands (fixed host paths)
            except OSError:
                continue
            if not (real.startswith("/usr/") or (real.startswith(self.top + "/") and self.granted(real))):
                continue  # e.g. mtab -> /proc/<our pid>/mounts, a stray link to "/", a private file
            if _stat.S_ISDIR(st.st_mode):
                if st.st_mode & 0o005 == 0o005:
                    self.rules.append(SystemRule(path, FS_READ_EXEC))
            elif _stat.S_ISREG(st.st_mode) and st.st_mode & 0o004:
                self.rules.append(SystemRule(path, FS_READ_FILE | FS_EXECUTE))


_SYSTEM_CACHE: list[SystemRule] | None = None
_WATCHED_DIRS = ("/etc", "/etc/ssl", "/etc/security", "/etc/NetworkManager")


def system_rules() -> list[SystemRule]:
    """The documented read-only system set.

    ``/usr``, ``/bin``, ``/sbin``, ``/lib*`` (read + execute), the device
    files of :data:`SYSTEM_DEVICES`, and ``/etc`` entry by entry minus
    :data:`ETC_EXCLUDED` and what is not world-readable.  ``/proc/self`` is
    added by the helper itself (see ``--proc-self`` in ``native/sfs_exec.c``),
    because the parent's ``/proc/self`` is another process.
    """
    rules = [SystemRule(p, FS_READ_EXEC) for p in SYSTEM_READ_EXEC_DIRS
             if os.path.realpath(p) == p or _inside_system(os.path.realpath(p))]
    rules += [SystemRule(p, a) for p, a in SYSTEM_DEVICES]
    rules += _etc_rules()
    return rules


def _dir_signature() -> tuple:
    sig = []
    for d in _WATCHED_DIRS:
        try:
            st = os.stat(d)  # host-access: system set: the fixed system directories
            sig.append((st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns))
        except OSError:
            sig.append(None)
    return tuple(sig)


class _SystemFds:
    """The system set opened ``O_PATH`` once and kept, so each ruleset costs only add_rule calls.

    The cache is rebuilt whenever ``/etc`` (or an expanded subdirectory)
    changes: a file replaced by rename gets a new inode and must get a new
    rule.  It holds about 150 ``O_PATH`` fds for the life of the process;
    :func:`clear_system_cache` closes them.
    """

    def __init__(self) -> None:
        self.signature = _dir_signature()
        self.entries: list[tuple[int, int, bool]] = []  # (fd, access, is_dir)
        try:
            for rule in system_rules():
                try:
                    # host-access: system set: O_PATH fd for a Landlock rule on a fixed host path
                    fd = os.open(rule.host_path, _native.O_PATH | os.O_CLOEXEC)
                except OSError:
                    continue  # vanished or changed since listing: less access, never more
                try:
                    is_dir = _stat.S_ISDIR(os.fstat(fd).st_mode)
                except OSError:
                    os.close(fd)
                    continue
                self.entries.append((fd, rule.access if is_dir else rule.access & ~FS_DIR_ONLY, is_dir))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for fd, _a, _d in self.entries:
            os.close(fd)
        self.entries = []


_SYSTEM_FDS: _SystemFds | None = None


def system_fds() -> list[tuple[int, int, bool]]:
    """``(fd, access, is_dir)`` of the system set, from the cache (rebuilt when /etc changed)."""
    global _SYSTEM_FDS
    cur = _SYSTEM_FDS
    if cur is None or cur.signature != _dir_signature():
        fresh = _SystemFds()
        _SYSTEM_FDS = fresh
        if cur is not None:
            cur.close()
        cur = fresh
    return cur.entries


def clear_system_cache() -> None:
    """Close the cached system fds (they are reopened on the next ruleset)."""
    global _SYSTEM_FDS
    if _SYSTEM_FDS is not None:
        _SYSTEM_FDS.close()
        _SYSTEM_FDS = None


class RulesetError(OSError):
    """A Landlock syscall failed (carries errno)."""


def _check(ret: int, what: str) -> int:
    if ret < 0:
        raise RulesetError(-ret, f"{what}: {os.strerror(-ret)}")
    return ret


class Ruleset:
    """A Landlock ruleset fd under construction (O_CLOEXEC; close it when done).

    Args:
        abi_version: the kernel's ABI (from :func:`abi`), >= 1.
        handle_net: handle TCP bind/connect (ABI >= 4), i.e. deny unless a port rule allows.
        scopes: ``SCOPE_*`` bits to scope (ABI >= 6); None: every scope the ABI has.

    Raises:
        RulesetError: the kernel refused to create the ruleset.
    """

    def __init__(self, abi_version: int, *, handle_net: bool = True, scopes: int | None = None) -> None:
        self.abi = abi_version
        self.fs = fs_mask(abi_version)
        self.net = net_mask(abi_version) if handle_net else 0
        self.scoped = scope_mask(abi_version) & (scope_mask(abi_version) if scopes is None else scopes)
        self.fd = _check(_native.landlock_create(self.fs, self.net, self.scoped),
                         "landlock_create_ruleset")

    def add_fd(self, fd: int, access: int) -> None:
        """Allow ``access`` beneath the object ``fd`` refers to (dir or file).

        Directory-only rights are dropped for a non-directory.
        """
        st = os.fstat(fd)
        if not _stat.S_ISDIR(st.st_mode):
            access &= ~FS_DIR_ONLY
        access &= self.fs
        if access:
            _check(_native.landlock_add_path(self.fd, fd, access), "landlock_add_rule")

    def add_system_set(self) -> None:
        """Add the documented system set (cached fds; see :class:`_SystemFds`)."""
        for fd, access, _is_dir in system_fds():
            access &= self.fs
            if access:
                _check(_native.landlock_add_path(self.fd, fd, access), "landlock_add_rule")

    def add_host_path(self, host_path: str, access: int) -> bool:
        """Open a fixed system path ``O_PATH`` and add it; False when it does not exist."""
        try:
            # host-access: system set: O_PATH fd for a Landlock rule on a fixed host path
            fd = os.open(host_path, _native.O_PATH | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return False
        try:
            self.add_fd(fd, access)
        finally:
            os.close(fd)
        return True

    def allow_tcp(self, ports: Iterable[int], access: int) -> None:
        """Allow TCP ``access`` (NET_BIND_TCP / NET_CONNECT_TCP) on each port (ABI >= 4)."""
        access &= self.net
        if not access:
            return
        for port in ports:
            if not 0 <= int(port) <= 65535:
                raise RulesetError(errno.EINVAL, f"TCP port out of range: {port}")
            _check(_native.landlock_add_port(self.fd, int(port), access), "landlock_add_rule")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Ruleset":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
