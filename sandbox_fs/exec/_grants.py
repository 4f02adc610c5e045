"""The workspace and the path grants as trees: their modes, and the nestings that cannot be enforced."""

from __future__ import annotations

import os
from typing import Sequence

from ..paths import PathPolicy
from ..root import Root, is_beneath
from ._errors import ConfinementError

#: What a caller passes as grants: ``[(Root, read_only), ...]``, a :class:`PathPolicy`, or None.
Grants = Sequence[tuple[Root, bool]] | PathPolicy | None


def grant_roots(grants: Grants) -> list[tuple[Root, bool]]:
    if grants is None:
        return []
    if isinstance(grants, PathPolicy):
        out = []
        for g in grants.grants:
            out.append((grants.resolve(g.path).root, g.read_only))
        return out
    return [(r, bool(ro) or r.read_only) for r, ro in grants]


def _nested_read_only(workspace: Root, roots: Sequence[tuple[Root, bool]], *, binds: bool) -> list[Root]:
    """One nesting rule against every writable tree (the workspace and each read-write grant).

    Landlock rules only add rights, so a read-only grant at or beneath a tree
    the child may write would be writable through that tree's rule. Where the
    read-only mount layer applies (``binds``), each such grant is covered by a
    read-only bind of itself in the child's mount namespace (the helper's
    ``--ro-tree``) and returned; otherwise it is refused. Refused either way:
    a read-only grant that *is* a writable tree, and a read-write grant
    beneath a grant that gets a read-only bind (the recursive bind would cover
    it). Checked on the rule fds (``..`` walked by fd), so a symlink or a path
    alias cannot hide a nesting.

    Returns:
        The read-only grants to bind read-only (empty unless ``binds``).

    Raises:
        ConfinementError: a nesting that cannot be enforced.
    """
    writable = ([("the read-write workspace", workspace.identity)] if not workspace.read_only else []) + [
        ("a read-write grant", r.identity) for r, ro in roots if not ro]
    nested: list[Root] = []
    for root, read_only in roots:
        if not read_only:
            continue
        grant_fd = root.fileno_dup()
        try:
            for what, ident in writable:
                if not is_beneath(grant_fd, ident):
                    continue
                if ident == root.identity:
                    raise ConfinementError(f"a read-only grant is also {what}: give each directory one mode",
                                           sandbox_path=root.label or None)
                if not binds:
                    raise ConfinementError(
                        f"a read-only grant inside {what} cannot be enforced by Landlock (its rules only add "
                        "rights) and the read-only mount layer is off or unavailable; move the grant out, "
                        "or make the outer tree read-only", sandbox_path=root.label or None)
                nested.append(root)
                break
        finally:
            os.close(grant_fd)
    for r, ro in roots:
        if ro or not nested:
            continue
        rw_fd = r.fileno_dup()
        try:
            for g in nested:
                if is_beneath(rw_fd, g.identity):
                    raise ConfinementError(
                        "a read-write grant inside a read-only grant that is itself inside a writable tree "
                        "cannot be enforced", sandbox_path=r.label or None)
        finally:
            os.close(rw_fd)
    return nested


def rw_grant_trees(workspace: Root, grants: Grants) -> list[Root]:
    """The directories that stay writable under the read-only mount layer."""
    trees = [] if workspace.read_only else [workspace]
    return trees + [r for r, ro in grant_roots(grants) if not ro]


def ro_grant_trees(workspace: Root, grants: Grants) -> list[Root]:
    """The read-only trees the child must reach (a read-only workspace, read-only grants)."""
    trees = [workspace] if workspace.read_only else []
    return trees + [r for r, ro in grant_roots(grants) if ro]


def check_rw_grants(grants: Grants, ids: tuple[int, int],
                     secrets: tuple[str, ...]) -> None:
    """Refuse a read-write grant whose directory the identity does not own (it could not write it)."""
    shown = [g.path for g in grants.grants] if isinstance(grants, PathPolicy) else None
    for i, (root, ro) in enumerate(grant_roots(grants)):
        if ro:
            continue
        fd = root.fileno_dup()
        try:
            owner = os.fstat(fd).st_uid
        finally:
            os.close(fd)
        if owner != ids[0]:
            raise ConfinementError(
                "a read-write grant is not owned by the confined identity, so the command could not write it: "
                "chown it to that identity (policy.identity=(uid, gid)) or use identity='host'",
                sandbox_path=shown[i] if shown else None, secrets=secrets)
