"""cgroup trees of a supervisor: a v2 directory with one leaf per process, or a v1 ``pids`` one.

Every path here is under cgroupfs (a kernel interface), never a workspace.
"""

from __future__ import annotations

import itertools
import os
import signal
import time

from .._features import lowered


def _mounts_and_cgroups() -> tuple[list[list[str]], list[str]] | None:
    """This process's mount table (split lines) and its ``/proc/self/cgroup`` lines, or None."""
    try:
        # host-access: our own process mount table (finding the cgroup mounts)
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
        with open("/proc/self/cgroup") as f:  # host-access: our own process's cgroups
            return mounts, f.read().splitlines()
    except OSError:
        return None


def _own_dir(mount_root: str, mount_point: str, own: str) -> str:
    """Host path of our cgroup ``own`` under a mount of the hierarchy rooted at ``mount_root``."""
    rel = own
    if mount_root != "/" and rel.startswith(mount_root):
        rel = rel[len(mount_root):]
    return (mount_point.rstrip("/") + "/" + rel.strip("/")).rstrip("/")


def _find_cgroup2() -> str | None:
    """Host path of this process's cgroup v2 directory, or None without a cgroup2 mount
    (or when ``SANDBOX_FS_DEGRADE`` removes ``cgroup2``)."""
    found = _mounts_and_cgroups() if lowered().has("cgroup2") else None
    if found is None:
        return None
    mounts, cgroups = found
    own = next((line.strip()[3:] for line in cgroups if line.startswith("0::")), None)
    for parts in mounts:
        try:
            sep = parts.index("-")
        except ValueError:
            continue
        if parts[sep + 1] == "cgroup2" and own is not None:
            return _own_dir(parts[3], parts[4], own)
    return None


def _dead_owner_trees(base: str) -> list[str]:
    """Paths of ``sandbox-fs-<pid>-*`` trees under cgroupfs ``base`` whose owner process is gone."""
    try:  # host-access: cgroupfs (kernel interface): our own stale supervisor dirs, never a workspace
        names = [n for n in os.listdir(base) if n.startswith("sandbox-fs-")]
    except OSError:
        return []
    paths = []
    for name in names:
        try:
            pid = int(name.split("-")[2])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            paths.append(f"{base}/{name}")
    return paths


def _leaf_paths(tree_dir: str) -> list[str]:
    """The process leaves (``p1``, ``p2`` ...) of a supervisor's tree.

    Raises:
        OSError: the tree cannot be listed.
    """
    # host-access: cgroupfs (kernel interface): our own supervisor's tree, never a workspace
    return [f"{tree_dir}/{n}" for n in os.listdir(tree_dir) if n.startswith("p") and os.path.isdir(f"{tree_dir}/{n}")]


def _remove_leaf(leaf: str) -> bool:
    """Remove an empty leaf directory; True when it is gone (it was, or it is now)."""
    try:  # host-access: cgroupfs (kernel interface): our own supervisor's leaf, never a workspace
        os.rmdir(leaf)
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False


class CgroupTree:
    """One cgroup v2 directory per supervisor, one leaf per started process."""

    _ids = itertools.count(1)

    def __init__(self, base: str, pids_max: int | None) -> None:
        self.dir = f"{base}/sandbox-fs-{os.getpid()}-{next(self._ids)}-{os.urandom(3).hex()}"
        # host-access: the supervisor cgroup dir under cgroupfs (kernel interface, not a workspace)
        os.mkdir(self.dir, 0o755)
        self._leaves = itertools.count(1)
        self.pids = False
        try:
            with open(f"{self.dir}/cgroup.controllers") as f:
                if "pids" in f.read().split() and pids_max is not None:
                    with open(f"{self.dir}/cgroup.subtree_control", "w") as f2:
                        f2.write("+pids")
                    self.pids = True
        except OSError:
            self.pids = False

    @classmethod
    def create(cls, pids_max: int | None) -> "CgroupTree | None":
        base = _find_cgroup2()
        if base is None:
            return None
        cls._sweep_stale(base)
        try:
            return cls(base, pids_max)
        except OSError:
            return None

    @staticmethod
    def _sweep_stale(base: str) -> None:
        """Remove empty trees left by processes that died without closing their supervisor."""
        for path in _dead_owner_trees(base):
            if CgroupTree.populated(path):
                continue  # something still runs there: leave it for its owner / an operator
            try:  # host-access: cgroupfs, as above
                for leaf in _leaf_paths(path):
                    os.rmdir(leaf)
                os.rmdir(path)
            except OSError:
                pass

    def new_leaf(self, pids_max: int | None) -> str:
        leaf = f"{self.dir}/p{next(self._leaves)}"
        os.mkdir(leaf, 0o755)  # host-access: a leaf cgroup under our supervisor dir (cgroupfs)
        if self.pids and pids_max is not None:
            try:
                with open(f"{leaf}/pids.max", "w") as f:
                    f.write(str(int(pids_max)))
            except OSError:
                pass
        return leaf

    @staticmethod
    def populated(leaf: str) -> bool:
        try:  # host-access: cgroupfs (kernel interface): our own supervisor's leaf, never a workspace
            with open(f"{leaf}/cgroup.events") as f:
                for line in f:
                    if line.startswith("populated "):
                        return line.split()[1] != "0"
        except FileNotFoundError:
            return False
        except OSError:
            return True
        return True

    @staticmethod
    def kill(leaf: str) -> None:
        try:  # host-access: cgroupfs (kernel interface): our own supervisor's leaf, never a workspace
            with open(f"{leaf}/cgroup.kill", "w") as f:
                f.write("1")
        except OSError:
            pass

    remove = staticmethod(_remove_leaf)

    def close(self) -> bool:
        """Kill and remove every leaf, then the tree; True when it is gone (nothing runs in it)."""
        try:  # host-access: cgroupfs (kernel interface): our own supervisor's leaf, never a workspace
            for leaf in _leaf_paths(self.dir):
                self.kill(leaf)
                self.remove(leaf)
            os.rmdir(self.dir)  # host-access: cgroupfs (kernel interface)
            return True
        except OSError:
            return False


def _read_pids_max(leaf: str) -> int | None:
    """The ``pids.max`` the kernel holds for a leaf (v1 or v2), or None when unlimited or unreadable."""
    try:
        with open(f"{leaf}/pids.max") as f:  # host-access: cgroupfs (kernel interface)
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _find_pids_v1() -> str | None:
    """Host path of this process's cgroup v1 ``pids`` directory, or None without a v1 pids hierarchy
    (or when ``SANDBOX_FS_DEGRADE`` removes ``cgroup1``)."""
    found = _mounts_and_cgroups() if lowered().has("cgroup1") else None
    if found is None:
        return None
    mounts, cgroups = found
    own = next((line.strip().split(":", 2)[2] for line in cgroups
                if line.count(":") >= 2 and "pids" in line.split(":", 2)[1].split(",")), None)
    if own is None:
        return None
    for parts in mounts:
        try:
            sep = parts.index("-")
        except ValueError:
            continue
        if parts[sep + 1] == "cgroup" and len(parts) > sep + 3 and "pids" in parts[sep + 3].split(","):
            return _own_dir(parts[3], parts[4].replace("\\040", " "), own)
    return None


class PidsV1Tree:
    """One cgroup v1 ``pids`` directory per supervisor, one leaf per started process.

    Used where cgroup v2 has no ``pids`` controller but a v1 ``pids``
    hierarchy is mounted (a hybrid host), and the target's uid is not bound
    by ``RLIMIT_NPROC``.  The target joins its leaf by writing its
    ``cgroup.procs`` (``--pids-procs``) before anything else runs in it; v1
    has no ``cgroup.kill``, so :meth:`kill` signals the listed processes.
    """

    _ids = itertools.count(1)

    def __init__(self, base: str) -> None:
        self.dir = f"{base}/sandbox-fs-{os.getpid()}-{next(self._ids)}-{os.urandom(3).hex()}"
        # host-access: the supervisor's v1 pids dir under cgroupfs (kernel interface, not a workspace)
        os.mkdir(self.dir, 0o755)
        self._leaves = itertools.count(1)

    @classmethod
    def create(cls) -> "PidsV1Tree | None":
        base = _find_pids_v1()
        if base is None:
            return None
        cls._sweep_stale(base)
        try:
            return cls(base)
        except OSError:
            return None

    @staticmethod
    def _sweep_stale(base: str) -> None:
        """Remove empty trees left by processes that died without closing their supervisor."""
        for path in _dead_owner_trees(base):
            try:  # host-access: cgroupfs, as above
                for leaf in _leaf_paths(path):
                    if not PidsV1Tree.populated(leaf):
                        os.rmdir(leaf)
                os.rmdir(path)
            except OSError:
                pass

    def new_leaf(self, pids_max: int) -> str:
        """A new leaf with ``pids.max`` set.

        Raises:
            OSError: the leaf cannot be made or its bound cannot be written
                (the leaf is removed again).
        """
        leaf = f"{self.dir}/p{next(self._leaves)}"
        os.mkdir(leaf, 0o755)  # host-access: a leaf under our v1 pids dir (cgroupfs)
        try:
            with open(f"{leaf}/pids.max", "w") as f:
                f.write(str(int(pids_max)))
        except OSError:
            self.remove(leaf)
            raise
        return leaf

    @staticmethod
    def pids(leaf: str) -> list[int]:
        try:  # host-access: cgroupfs (kernel interface): our own supervisor's leaf, never a workspace
            with open(f"{leaf}/cgroup.procs") as f:
                return [int(x) for x in f.read().split()]
        except OSError:
            return []

    @staticmethod
    def populated(leaf: str) -> bool:
        return bool(PidsV1Tree.pids(leaf))

    @staticmethod
    def kill(leaf: str) -> None:
        """SIGKILL every process listed in the leaf, through pidfds.

        Each pid is opened as a pidfd, then the leaf is listed again: a pid
        still listed after its pidfd was opened is the same process or a
        later one forked inside the leaf, so no process outside the leaf is
        ever signalled (a recycled pid's pidfd refers to the dead process).
        """
        fds = []
        for pid in PidsV1Tree.pids(leaf):
            try:
                fds.append((pid, os.pidfd_open(pid)))
            except OSError:
                pass
        still = set(PidsV1Tree.pids(leaf))
        for pid, fd in fds:
            try:
                if pid in still:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(fd)

    remove = staticmethod(_remove_leaf)

    def close(self) -> None:
        try:  # host-access: cgroupfs (kernel interface): our own supervisor's leaf, never a workspace
            for leaf in _leaf_paths(self.dir):
                for _ in range(100):
                    self.kill(leaf)
                    if not self.populated(leaf):
                        break
                    time.sleep(0.002)
                self.remove(leaf)
            os.rmdir(self.dir)  # host-access: cgroupfs (kernel interface)
        except OSError:
            pass
