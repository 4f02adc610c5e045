"""What this host offers a sandbox, and what confinement a confined run would get here.

:func:`host_features` probes, without changing anything on the host, what
``sandbox-fs features`` reports: the resolver (``openat2``), Landlock's ABI,
seccomp filters, user / PID / mount namespaces, the process-count bound a
run would get (cgroup v2 ``pids``, ``RLIMIT_NPROC``, cgroup v1 ``pids``, in
the order :mod:`sandbox_fs.exec` tries them), FUSE and the identity a
command runs as.  Every value is read from the kernel: ``/proc``, cgroupfs,
and for the namespaces an ``unshare(2)`` in a forked child that exits at once.

``SANDBOX_FS_DEGRADE`` (:func:`lowered`) makes this process take the host as
offering *less* than it does, so that degraded platforms can be tested on a
full kernel: every probe here, :func:`sandbox_fs.features`, the resolver
choice, the Landlock ABI a ruleset targets, the cgroup trees a supervisor
makes and the exec helper's namespaces all read it.  It can only remove a
feature or lower the ABI, never claim what the kernel lacks.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
from dataclasses import dataclass
from typing import Any

from .errors import InvalidArgumentError

__all__ = ["host_features", "cgroup_dirs", "can_unshare", "fuse_status", "Lowered", "lowered", "DEGRADE_ENV"]

# <linux/sched.h>
CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000


#: The environment variable read by :func:`lowered`.
DEGRADE_ENV = "SANDBOX_FS_DEGRADE"

#: The feature names :data:`DEGRADE_ENV` may remove (besides ``landlock=N``).
_REMOVABLE = ("openat2", "fuse", "cgroup2", "cgroup1", "userns")


@dataclass(frozen=True)
class Lowered:
    """What :data:`DEGRADE_ENV` takes away from this host (nothing, by default).

    Attributes:
        landlock_abi: the highest Landlock ABI to use (``None``: no cap; ``0``:
            no Landlock); the kernel's own ABI when that is lower.
        removed: feature names taken as absent: ``"openat2"``, ``"fuse"``,
            ``"cgroup2"``, ``"cgroup1"`` (the v1 ``pids`` hierarchy), ``"userns"``.
    """

    landlock_abi: int | None = None
    removed: frozenset[str] = frozenset()

    def has(self, name: str) -> bool:
        """False when ``name`` is removed (the kernel may still lack it: this never adds)."""
        return name not in self.removed

    def abi(self, kernel_abi: int) -> int:
        """The Landlock ABI to use on a kernel offering ``kernel_abi`` (0: none): never above it."""
        kernel_abi = max(kernel_abi, 0)
        return kernel_abi if self.landlock_abi is None else min(kernel_abi, self.landlock_abi)

    def tokens(self) -> list[str]:
        """The lowering as the sorted tokens of :data:`DEGRADE_ENV` (empty: none)."""
        out = sorted(self.removed)
        return out + ([f"landlock={self.landlock_abi}"] if self.landlock_abi is not None else [])


@functools.lru_cache(maxsize=8)
def _parse_lowered(text: str) -> Lowered:
    cap: int | None = None
    removed: set[str] = set()
    for raw in text.split(","):
        token = raw.strip().lower()
        if not token:
            continue
        name, eq, value = token.partition("=")
        if name == "landlock" and eq and value.isdigit() and len(value) <= 3:
            cap = int(value) if cap is None else min(cap, int(value))
        elif name in _REMOVABLE and not eq:
            removed.add(name)
        else:
            raise InvalidArgumentError(f"{DEGRADE_ENV}: unknown entry {token[:40]!r} (known: landlock=N, "
                                       f"{', '.join(_REMOVABLE)})", sandbox_path=None)
    return Lowered(cap, frozenset(removed))


def lowered() -> Lowered:
    """What :data:`DEGRADE_ENV` removes, read from the environment now (parsed once per value).

    The value is a comma-separated list: ``landlock=N`` (use at most Landlock
    ABI ``N``; ``0``: no Landlock) and feature names taken as absent:
    ``openat2`` (the fallback resolver), ``fuse``, ``cgroup2``, ``cgroup1``
    (the v1 ``pids`` hierarchy), ``userns`` (no user namespaces: on a
    non-root host no mount layer and no PID namespace).  Example:
    ``SANDBOX_FS_DEGRADE=landlock=3,cgroup2``.  It is for testing degraded
    platforms; it only ever removes (see :class:`Lowered`).

    Raises:
        InvalidArgumentError: an entry is not one of those (a ``ValueError``).
    """
    return _parse_lowered(os.environ.get(DEGRADE_ENV, ""))


def _read(path: str) -> str | None:
    try:
        with open(path) as f:  # host-access: a kernel interface file under /proc or cgroupfs
            return f.read()
    except OSError:
        return None


def cgroup_dirs() -> tuple[str | None, str | None]:
    """This process's cgroup directories: ``(cgroup v2 dir, cgroup v1 pids dir)``, each None when
    that hierarchy is not mounted (host paths under cgroupfs, from ``/proc/self/mountinfo``)."""
    mountinfo, own = _read("/proc/self/mountinfo"), _read("/proc/self/cgroup")
    if mountinfo is None or own is None:
        return None, None
    v2_own = v1_own = None
    for line in own.splitlines():
        hier, _sep, rest = line.partition(":")
        controllers, _sep, path = rest.partition(":")
        if hier == "0" and controllers == "":
            v2_own = path
        elif "pids" in controllers.split(","):
            v1_own = path
    v2 = v1 = None
    for line in mountinfo.splitlines():
        parts = line.split()
        if "-" not in parts:
            continue
        sep = parts.index("-")
        fstype = parts[sep + 1] if len(parts) > sep + 1 else ""
        if fstype == "cgroup2" and v2_own is not None and v2 is None:
            v2 = _beneath(parts[3], parts[4], v2_own)
        elif (fstype == "cgroup" and v1_own is not None and v1 is None and len(parts) > sep + 3
              and "pids" in parts[sep + 3].split(",")):
            v1 = _beneath(parts[3], parts[4], v1_own)
    low = lowered()
    return (v2 if low.has("cgroup2") else None), (v1 if low.has("cgroup1") else None)


def _beneath(mount_root: str, mount_point: str, own: str) -> str:
    """The host path of cgroup ``own`` in a hierarchy mounted at ``mount_point`` (its ``mount_root``)."""
    rel = own[len(mount_root):] if mount_root != "/" and own.startswith(mount_root) else own
    return (mount_point.replace("\\040", " ").rstrip("/") + "/" + rel.strip("/")).rstrip("/")


def can_unshare(flags: int) -> bool:
    """Can this process make the namespaces ``flags`` (``CLONE_NEW*``)?  Tried in a forked child
    (``unshare(2)``, then ``_exit``), so this process's own namespaces never change.
    False for a user namespace that :func:`lowered` removes."""
    if flags & CLONE_NEWUSER and not lowered().has("userns"):
        return False
    try:
        unshare = ctypes.CDLL(None, use_errno=True).unshare
    except (OSError, AttributeError):
        return False
    try:
        pid = os.fork()
    except OSError:
        return False
    if pid == 0:  # pragma: no cover - the child only reports and exits
        os._exit(0 if unshare(ctypes.c_int(flags)) == 0 else 1)
    _pid, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def fuse_status() -> tuple[bool, str | None]:
    """Can the FUSE overlay run here?  ``(usable, reason)``; ``reason`` is None when it can.

    Three cheap probes, in order, the first failing one giving the reason:
    ``/dev/fuse`` opens read-write; :mod:`pyfuse3` imports (the extra
    ``sandbox-fs[fuse]``); ``fsopen("fuse")`` is permitted (the privilege to
    make a FUSE mount; the context is closed at once, nothing is mounted).
    Probed once per process; ``(False, reason)`` when :func:`lowered` removes FUSE.
    """
    if not lowered().has("fuse"):
        return False, f"FUSE is removed by {DEGRADE_ENV}"
    return _probe_fuse()


@functools.lru_cache(maxsize=1)
def _probe_fuse() -> tuple[bool, str | None]:
    try:
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)  # host-access: probe of a fixed device node
    except OSError as exc:
        return False, f"/dev/fuse cannot be opened ({errno.errorcode.get(exc.errno or 0, 'error')})"
    os.close(fd)
    try:
        import pyfuse3  # noqa: F401, PLC0415
    except Exception:  # ImportError, or a pyfuse3 whose libfuse3 is missing
        return False, "pyfuse3 is not installed (the extra sandbox-fs[fuse])"
    from . import _native  # noqa: PLC0415

    fsopen = getattr(_native, "fsopen", None)
    if fsopen is None:
        return False, "this sandbox-fs build has no fsopen(2) wrapper"
    fs_fd = fsopen(b"fuse", _native.FSOPEN_CLOEXEC)  # an fd, or -errno
    if fs_fd < 0:
        name = errno.errorcode.get(-fs_fd, "error")
        return False, f"fsopen(\"fuse\") is refused ({name}: no privilege to make a FUSE mount)"
    os.close(fs_fd)
    return True, None


def _seccomp_filters() -> bool:
    """The kernel takes seccomp filters (``SECCOMP_RET_ERRNO``, what the exec helper's allow-list uses)."""
    actions = _read("/proc/sys/kernel/seccomp/actions_avail")
    return actions is not None and "errno" in actions.split()


def _process_bounds(root: bool, leased: bool) -> dict[str, Any]:
    """Which process-count bounds a run can have here, and the one it gets (``bound``)."""
    v2, v1 = cgroup_dirs()
    v2_pids = (v2 is not None and os.access(v2, os.W_OK)  # host-access: cgroupfs (kernel interface)
               and "pids" in (_read(f"{v2}/cgroup.subtree_control") or "").split())
    v1_pids = v1 is not None and os.access(v1, os.W_OK)  # host-access: cgroupfs (kernel interface)
    nproc = not root or leased  # RLIMIT_NPROC never binds uid 0
    bound = ("cgroup2.pids" if v2_pids else "rlimit.nproc" if nproc else "cgroup1.pids" if v1_pids else "none")
    return {"cgroup2_pids": v2_pids, "cgroup1_pids": v1_pids, "rlimit_nproc": nproc, "bound": bound,
            "cgroup2_dir": v2, "cgroup1_pids_dir": v1}


def host_features() -> dict[str, Any]:
    """Probe this host (nothing is changed; the namespace probes fork a child each).

    Returns:
        a JSON-ready ``dict``: ``openat2`` (bool), ``resolver`` (``"openat2"`` or
        ``"fallback"``), ``landlock_abi`` (int, 0 without Landlock), ``seccomp``
        (bool), ``user_namespace`` / ``pid_namespace`` / ``mount_namespace``
        (bool: can this process make one; unprivileged, inside a user
        namespace as the exec helper does), ``processes`` (``cgroup2_pids``,
        ``cgroup1_pids``, ``rlimit_nproc``: bool each; ``bound``: the one a run
        gets, ``"cgroup2.pids"``, ``"rlimit.nproc"``, ``"cgroup1.pids"`` or
        ``"none"``; ``cgroup2_dir``, ``cgroup1_pids_dir``: str or None),
        ``fuse`` (bool: the FUSE overlay can run, see :func:`fuse_status`),
        ``fuse_reason`` (str, why it cannot; None when it can), ``identity`` (``root``, ``leasable``: bool; ``base``,
        ``count``: the range leased from, ints; ``runs_as``: ``"leased"`` or
        ``"host"``), ``lowered`` (list of str: what :data:`DEGRADE_ENV`
        removes, as :meth:`Lowered.tokens`; every value above already
        reflects it).

    Raises:
        InvalidArgumentError: :data:`DEGRADE_ENV` is malformed (see :func:`lowered`).
    """
    from . import features  # noqa: PLC0415
    from .exec import ConfinementPolicy  # noqa: PLC0415

    kernel = features()
    root = os.geteuid() == 0
    policy = ConfinementPolicy()
    base, count = policy.identity_range
    leased = root and policy.identity == "auto"
    userns = 0 if root else CLONE_NEWUSER
    return {
        "openat2": bool(kernel["openat2"]),
        "resolver": kernel["resolver"],
        "landlock_abi": int(kernel["landlock_abi"]),  # type: ignore[call-overload]
        "seccomp": _seccomp_filters(),
        "user_namespace": can_unshare(CLONE_NEWUSER),
        "pid_namespace": can_unshare(userns | CLONE_NEWPID),
        "mount_namespace": can_unshare(userns | CLONE_NEWNS),
        "processes": _process_bounds(root, leased),
        "fuse": bool(kernel["fuse"]),
        "fuse_reason": fuse_status()[1],
        "identity": {"root": root, "leasable": root, "base": base, "count": count,
                     "runs_as": "leased" if leased else "host"},
        "lowered": lowered().tokens(),
    }
