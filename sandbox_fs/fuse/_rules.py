"""The overlay's policy: its settings and the checks every creating request passes.

:class:`OverlayPolicy` is what the session sends the daemon in the ``config``
message (a frozen pydantic model, JSON round trip).  The three checks are
pure functions of their arguments (no filesystem access, no pyfuse3): each
returns ``None`` when the request may go on and raises ``OSError(errno,
reason)`` when it is refused, so a handler can pass the errno to the kernel
unchanged.

* :func:`check_mode`: no set-user-ID or set-group-ID bit is ever set through
  the overlay (a second layer under the confinement's seccomp rule).
* :func:`check_special`: device nodes, FIFOs and sockets only where the
  policy allows their kind.
* :func:`check_symlink`: the symlink-target rule snapshot persist applies
  (:func:`sandbox_fs.archive.symlink_target_walk` with
  :class:`sandbox_fs.snapshot.SnapshotPolicy`'s limits), so a link made
  through the overlay is one persist keeps and hydrate restores.
"""

from __future__ import annotations

import errno
import math
import stat
from functools import lru_cache
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

if TYPE_CHECKING:
    from ..archive import ArchiveLimits

__all__ = ["OverlayPolicy", "SpecialKind", "check_mode", "check_special", "check_symlink", "check_shared_symlink"]

SpecialKind = Literal["fifo", "socket", "chr", "blk"]
"""A kind of special file :attr:`OverlayPolicy.allow_special` may allow."""

_SPECIAL_KINDS: dict[int, SpecialKind] = {
    stat.S_IFIFO: "fifo",
    stat.S_IFSOCK: "socket",
    stat.S_IFCHR: "chr",
    stat.S_IFBLK: "blk",
}
# Kinds that are not special files.  0 is mknod(2)'s "regular file".
_PLAIN_KINDS = frozenset({0, stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK})


class OverlayPolicy(BaseModel):
    """The settings of one overlay mount (frozen; ``model_dump_json`` / ``model_validate_json`` round trip).

    Attributes:
        read_only: every mutating request fails with ``EROFS``.
        allow_special: the special-file kinds that may be created
            (``"fifo"``, ``"socket"``, ``"chr"``, ``"blk"``); default none.
            The daemon creates them with its own privilege, so ``"chr"`` and
            ``"blk"`` are only sound on a ``nodev`` mount.
        max_bytes: byte quota (apparent size of regular files, a hard-linked
            inode counted once), or None for unlimited.
        max_inodes: inode quota (entries beneath the workspace root), or None.
        audit_capacity: most audit events buffered in the daemon between two
            drains; later ones are dropped and counted.
        entry_timeout_s: kernel dentry cache timeout of workspace entries, in seconds.
        attr_timeout_s: kernel attribute cache timeout of workspace entries, in seconds.
        shared_timeout_s: both timeouts for entries of host-directory mounts
            (shared with the host, so kept short), in seconds.

    Raises:
        pydantic.ValidationError: a negative quota or capacity, a negative or
            non-finite timeout, an unknown special kind or field.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)

    read_only: bool = False
    allow_special: frozenset[SpecialKind] = frozenset()
    max_bytes: int | None = Field(default=None, ge=0)
    max_inodes: int | None = Field(default=None, ge=0)
    audit_capacity: int = Field(default=10000, ge=0)
    entry_timeout_s: float = Field(default=3600, ge=0)
    attr_timeout_s: float = Field(default=3600, ge=0)
    shared_timeout_s: float = Field(default=1.0, ge=0)

    @field_validator("entry_timeout_s", "attr_timeout_s", "shared_timeout_s")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("a timeout must be finite")
        return v


def check_mode(mode: int) -> None:
    """Refuse a mode that carries a set-id bit (creation modes, chmod).

    Args:
        mode: a permission mode or a full ``st_mode`` (the file-type bits are
            ignored).

    Raises:
        OSError: ``EPERM``, ``mode`` has ``S_ISUID`` or ``S_ISGID``.
    """
    if mode & (stat.S_ISUID | stat.S_ISGID):
        raise OSError(errno.EPERM, "set-user-ID and set-group-ID bits are never set through the overlay")


def check_special(mode: int, policy: OverlayPolicy) -> None:
    """Refuse to create a special file whose kind ``policy`` does not allow.

    Args:
        mode: the ``st_mode`` of the entry to create (``mknod``/``create``
            mode; file-type bits 0 mean a regular file, as for mknod(2)).
        policy: supplies :attr:`OverlayPolicy.allow_special`.

    Raises:
        OSError: ``EPERM``, a FIFO, socket, character or block device not in
            ``allow_special``; ``EINVAL``, file-type bits that name no kind.
    """
    fmt = stat.S_IFMT(mode)
    kind = _SPECIAL_KINDS.get(fmt)
    if kind is None:
        if fmt in _PLAIN_KINDS:
            return
        raise OSError(errno.EINVAL, f"file type bits {fmt:#o} name no file kind")
    if kind not in policy.allow_special:
        raise OSError(errno.EPERM, f"creating {kind} special files is not allowed in this workspace")


@lru_cache(maxsize=1)
def _persist_limits() -> ArchiveLimits:
    """The archive limits snapshot persist judges symlinks with (imported on first use: ~0.1 s)."""
    from ..snapshot import SnapshotPolicy

    return SnapshotPolicy().archive


def check_symlink(link_rel: str, target: bytes) -> None:
    """Refuse a symlink that snapshot persist would refuse for its target alone.

    The rule is :func:`sandbox_fs.archive.symlink_target_walk` (the one
    symlink-target predicate of sandbox-fs, shared by the extractor, persist
    and ``Root.symlink``) with the limits persist uses: the target is
    relative, not empty, uses ``..`` only as leading components, and those
    do not climb above the workspace counted from the link's directory.  It
    is lexical: whether a component of the target is itself a symlink is the
    tree's state, not the request's, and persist checks it when it runs.

    Args:
        link_rel: the path of the link to create relative to the root of
            the tree it is made in (``"a/b/link"``; components joined by
            ``/``, with no empty, ``.`` or ``..`` component): the workspace
            root, or for a link inside a host-directory mount, that mount's
            root, so a link never points out of the host directory it is
            made in when the host follows it.
        target: the link's target, as the kernel passed it.

    Raises:
        OSError: ``EPERM``, the target is absolute (``/...``, or starts
            with a drive letter such as ``C:``), has ``..`` after a name, or
            climbs above the workspace; ``ENOENT``, the target is empty;
            ``ENAMETOOLONG``, the target or the path it names exceeds the
            limits persist applies.
        ValueError: ``link_rel`` is not a normalized relative path (a caller bug).
    """
    from ..archive import ArchiveLimitError, UnsafeArchiveMemberError, symlink_target_walk

    parts = link_rel.split("/")
    if not link_rel or any(p in ("", ".", "..") for p in parts):
        raise ValueError("link_rel must be a normalized relative sandbox path naming the link")
    if not target:
        raise OSError(errno.ENOENT, "a symlink target may not be empty")
    link = link_rel.encode("utf-8", "surrogateescape")
    try:
        symlink_target_walk(link=link, target=bytes(target), limits=_persist_limits())
    except UnsafeArchiveMemberError:
        raise OSError(errno.EPERM, "symlink target is absolute (or a drive letter), has '..' after a name, "
                      "or climbs above the workspace") from None
    except ArchiveLimitError as exc:
        raise OSError(errno.ENAMETOOLONG, f"symlink refused: exceeds {exc.limit}") from None


def check_shared_symlink(target: bytes) -> None:
    """Refuse a symlink target in a host-directory mount (a shared tree) that could ever lead out of it.

    Stricter than :func:`check_symlink`, which is lexical from the link's
    place *at creation*: in a tree the host also uses, a relative link
    with ``..`` can be made to climb out later (its directory renamed to
    another depth, by the confined command or by the host), and the host
    follows links in its own directories with its own root.  So in such a
    tree a target may not be absolute nor contain any ``..`` component:
    it can only name something at or beneath the link's own directory,
    wherever that directory is moved.

    Args:
        target: the link's target, as the kernel passed it.

    Raises:
        OSError: ``EPERM``, the target is absolute or has a ``..`` component.
    """
    if target.startswith(b"/") or b".." in target.split(b"/"):
        raise OSError(errno.EPERM, "a symlink in a host-directory mount may not be absolute or contain '..'")
