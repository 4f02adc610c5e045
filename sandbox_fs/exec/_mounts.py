"""The read-only mount layer's arguments: read-only binds of nested grants, pinned parents, masks."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Sequence

from ._grants import Grants, grant_roots, _nested_read_only, rw_grant_trees

if TYPE_CHECKING:  # pragma: no cover
    from ..root import Root


def _ro_binds(workspace: Root, grants: Grants) -> list[Root]:
    """The read-only grants the mount layer covers with a read-only bind (see :func:`_nested_read_only`)."""
    return _nested_read_only(workspace, grant_roots(grants), binds=True)


def _ro_bind_args(workspace: Root, grants: Grants,
                  nested: list[Root] | None = None) -> tuple[list[str], list[int]]:
    """Helper arguments (and the new fds they name, the caller's to close) for the read-only binds.

    Each read-only grant nested in a writable tree gets ``--ro-tree``; each
    directory between it and that tree gets ``--pin-tree`` (outer first),
    bound onto itself so that the child cannot rename or remove it (a mount
    point gives EBUSY): otherwise renaming the grant's parent would leave the
    grant's contents writable under another name in a later session, whose
    grant path would then name a directory the child made.
    """
    if nested is None:
        nested = _ro_binds(workspace, grants)
    if not nested:
        return [], []
    writable = {r.identity for r in rw_grant_trees(workspace, grants)}
    pins: dict[tuple[int, int], tuple[str, int]] = {}
    fds: list[int] = []
    args: list[str] = []
    try:
        for g in nested:
            cur = g.fileno_dup()
            fds.append(cur)
            args += ["--ro-tree", str(cur)]
            for _ in range(4096):
                up = os.open("..", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=cur)
                st = os.fstat(up)
                ident = (st.st_dev, st.st_ino)
                if ident in writable or ident in pins:
                    os.close(up)
                    break
                fds.append(up)
                # host-access: our own fd's path, used only to order the pins (the helper gets the fds)
                pins[ident] = (os.readlink(f"/proc/self/fd/{up}"), up)
                cur = up
        for _path, fd in sorted(pins.values()):  # an ancestor's path is a prefix: outer first
            args += ["--pin-tree", str(fd)]
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return args, fds


_CGROUP_MOUNTS: tuple[str, ...] | None = None


def _cgroup_mounts() -> tuple[str, ...]:
    """Mount points of every cgroup / cgroup2 filesystem (read once per process)."""
    global _CGROUP_MOUNTS
    if _CGROUP_MOUNTS is None:
        found = []
        try:
            # host-access: our own process mount table (finding the cgroup2 mount)
            with open("/proc/self/mountinfo") as f:
                for line in f:
                    parts = line.split()
                    try:
                        sep = parts.index("-")
                    except ValueError:
                        continue
                    if parts[sep + 1] in ("cgroup", "cgroup2"):
                        found.append(parts[4].replace("\\040", " "))
        except OSError:
            pass
        _CGROUP_MOUNTS = tuple(found)
    return _CGROUP_MOUNTS


def _mask_dirs(rw_trees: Sequence[Root] = ()) -> list[str]:
    """Host directories hidden from the child under an empty read-only tmpfs: cgroupfs.

    A child holding an ``O_PATH`` fd on a cgroup directory (Landlock does not
    check ``O_PATH``) could fork into it with ``clone3(CLONE_INTO_CGROUP)``,
    leaving its leaf (uid 0 passes the ``cgroup.procs`` owner check).  Every
    cgroup mount under ``/sys/fs/cgroup`` is covered by one mask on
    ``/sys/fs/cgroup``; others get their own.  A directory holding a
    writable tree is never masked.
    """
    out: list[str] = []
    for mp in _cgroup_mounts():
        d = "/sys/fs/cgroup" if mp == "/sys/fs/cgroup" or mp.startswith("/sys/fs/cgroup/") else mp
        if d not in out and not any(d.startswith(o + "/") for o in out):
            out = [o for o in out if not o.startswith(d + "/")] + [d]
    if rw_trees and out:
        homes = []
        for t in rw_trees:
            fd = t.fileno_dup()
            try:
                # host-access: our own fd's path, compared with the mask list only (never opened)
                homes.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass
            finally:
                os.close(fd)
        out = [d for d in out if not any(h == d or h.startswith(d + "/") for h in homes)]
    return out[:32]
