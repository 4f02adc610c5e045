"""The mount layers' arguments: read-only binds of nested grants, pinned parents, masks; the private root."""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING, Sequence

from ._errors import ConfinementError
from ._grants import Grants, _nested_read_only, grant_roots, is_beneath, rw_grant_trees
from ._landlock import SYSTEM_READ_EXEC_DIRS

if TYPE_CHECKING:  # pragma: no cover
    from ..root import Root
    from ._models import PrivateRoot


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
    return ro_bind_pin_args(nested, {r.identity for r in rw_grant_trees(workspace, grants)})


def ro_bind_pin_args(nested: Sequence[Root], writable: set[tuple[int, int]]) -> tuple[list[str], list[int]]:
    """``--ro-tree`` for each of ``nested`` and ``--pin-tree`` for each directory up to a ``writable`` tree.

    Args:
        nested: read-only grants, each beneath one of the writable trees.
        writable: ``(st_dev, st_ino)`` of the writable trees' roots.

    Returns:
        ``(args, fds)``: the arguments and the new fds they name (the caller's to close).
    """
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


def private_root_args(private_root: PrivateRoot, workspace: Root, grants: Grants) -> tuple[list[str], list[int]]:
    """The helper's ``--private-root`` arguments, and the new fds they name (the caller's to close).

    The workspace overlay (a dup of ``private_root.workspace_fd``) at its
    path; the system set's directories (``/usr``, ``/etc`` and those of
    :data:`~sandbox_fs.exec._landlock.SYSTEM_READ_EXEC_DIRS` that are real
    directories) as ``--sys-tree``, and those that are symlinks into
    ``/usr`` or ``/etc`` (merged ``/usr``: ``/bin -> usr/bin``) as
    ``--sys-link``; read-write grants as ``--rw-tree``; read-only grants as
    ``--reach-tree``, or, when nested in a read-write grant, as
    ``--ro-tree`` with their parents up to it pinned (:func:`ro_bind_pin_args`).
    The workspace's backing directory is not among them: the command sees
    the workspace only through the overlay.

    Raises:
        ConfinementError: a read-only grant lies in ``workspace``: the overlay
            serves the whole workspace read-write, so only an overlay mount
            (a manifest ``mount`` entry) can make part of it read-only.  (The
            check sees nesting beneath ``workspace`` itself: pass the backing
            Root, or the overlay's Root, whichever the grants were made under.)
    """
    fds: list[int] = []
    try:
        ws = os.dup(private_root.workspace_fd)
        fds.append(ws)
        args = ["--private-root", str(ws), "--workspace-path", private_root.workspace_path]
        for path in (*SYSTEM_READ_EXEC_DIRS, "/etc"):
            args += _system_tree_arg(path, fds)
        roots = grant_roots(grants)
        rw = [r for r, ro in roots if not ro]
        writable = {r.identity for r in rw}
        nested: list[Root] = []
        for root in rw:
            fd = root.fileno_dup()
            fds.append(fd)
            args += ["--rw-tree", str(fd)]
        for root, ro in roots:
            if not ro:
                continue
            fd = root.fileno_dup()
            fds.append(fd)
            if is_beneath(fd, workspace.identity):
                raise ConfinementError("a read-only grant inside the workspace cannot be enforced in a private root "
                                       "(the overlay serves the workspace read-write): expose it as a read-only "
                                       "overlay mount instead", sandbox_path=root.label or None)
            if any(is_beneath(fd, w) for w in writable):
                nested.append(root)  # bound by ro_bind_pin_args below, on fds of its own
                continue
            args += ["--reach-tree", str(fd)]
        if nested:
            pin_args, pin_fds = ro_bind_pin_args(nested, writable)
            fds += pin_fds
            args += pin_args
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return args, fds


def _system_tree_arg(path: str, fds: list[int]) -> list[str]:
    """``--sys-tree FD`` (fd appended to ``fds``) or ``--sys-link PATH=TARGET`` for one system path, or nothing."""
    try:
        st = os.lstat(path)  # host-access: system set: a fixed system path (directory or merged-/usr link)
    except OSError:
        return []
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(path)  # host-access: system set: the link's text, recreated in the private root
        except OSError:
            return []
        real = os.path.realpath(path)  # host-access: system set: where a fixed system link lands
        if not real.startswith(("/usr/", "/etc/")):
            return []
        return ["--sys-link", f"{path}={target}"]
    if not stat.S_ISDIR(st.st_mode):
        return []
    try:
        # host-access: system set: O_PATH fd of a fixed system directory, bound read-only in the private root
        fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return []
    fds.append(fd)
    return ["--sys-tree", str(fd)]


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
