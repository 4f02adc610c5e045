"""The Landlock ruleset of one confined process, built from file descriptors."""

from __future__ import annotations

import errno
import os
from typing import TYPE_CHECKING, Sequence

from . import _egress, _landlock
from ._errors import ConfinementError
from ._grants import grant_roots, _nested_read_only
from ._models import ConfinementPolicy

if TYPE_CHECKING:  # pragma: no cover
    from ..paths import PathPolicy
    from ..root import Root


def build_ruleset(workspace: Root, grants: Sequence[tuple[Root, bool]] | PathPolicy | None = None,
                  policy: "ConfinementPolicy | None" = None, *, tty: bool = False,
                  abi: int | None = None, read_only_binds: bool = False,
                  workspace_fd: int | None = None) -> _landlock.Ruleset:
    """Build the Landlock ruleset for one confined process, from file descriptors.

    Rules: read-write beneath the workspace (read-only when the Root is), each
    grant by its mode, the read-only system set of :mod:`sandbox_fs.exec._landlock`
    (``/dev/tty`` too when ``tty``), TCP ports of ``policy``; signal and
    abstract-unix scoping per ``policy`` (ABI >= 6).

    Args:
        workspace: the workspace Root (its ``O_PATH`` fd is duplicated).
        grants: ``[(Root, read_only), ...]`` or a :class:`PathPolicy` whose
            grants are used.
        policy: network and scoping choices (default :class:`ConfinementPolicy`).
        tty: also allow ``/dev/tty`` (read, write, ioctl) for a PTY session.
        abi: Landlock ABI to target (default: the kernel's).
        read_only_binds: the caller's child gets the read-only mount layer,
            which covers each read-only grant nested in a writable tree with
            a read-only bind (``--ro-tree``), so such a grant is not refused.
        workspace_fd: the workspace rule's object instead of the workspace
            Root's fd: the root of the overlay's detached mount when the
            command runs in a private root (its clone shares that root's
            inode; the backing directory is not in the command's root).
            Borrowed; the rule's rights follow ``workspace.read_only``.

    Returns:
        A :class:`sandbox_fs.exec._landlock.Ruleset`; the caller closes it.

    Raises:
        ConfinementError: Landlock is unavailable, the kernel refuses a rule,
            or a read-only grant lies inside the read-write workspace or a
            read-write grant and ``read_only_binds`` is False (Landlock rules
            only add rights, so it could not be enforced), or a nesting no
            bind can enforce (see :func:`_nested_read_only`).
    """
    policy = policy or ConfinementPolicy()
    version = _landlock.abi() if abi is None else abi
    if version <= 0:
        raise ConfinementError("Landlock is not available on this kernel")
    roots = grant_roots(grants)
    try:
        scopes = ((_landlock.SCOPE_SIGNAL if policy.scope_signals else 0)
                  | (_landlock.SCOPE_ABSTRACT_UNIX_SOCKET if policy.scope_abstract_unix else 0))
        ruleset = _landlock.Ruleset(version, handle_net=not policy.unrestricted_tcp, scopes=scopes)
    except OSError as exc:
        raise ConfinementError("the kernel refused to create a Landlock ruleset",
                               diagnostic=str(exc)) from None
    try:
        read_write = _landlock.fs_read_write(version)
        ws_fd = workspace.fileno_dup() if workspace_fd is None else os.dup(workspace_fd)
        try:
            ruleset.add_fd(ws_fd, _landlock.FS_READ_EXEC if workspace.read_only else read_write)
        finally:
            os.close(ws_fd)
        _nested_read_only(workspace, roots, binds=read_only_binds)
        for root, read_only in roots:
            grant_fd = root.fileno_dup()
            try:
                ruleset.add_fd(grant_fd, _landlock.FS_READ_EXEC if read_only else read_write)
            finally:
                os.close(grant_fd)
        ruleset.add_system_set()
        if tty:
            ruleset.add_host_path("/dev/tty", _landlock.FS_READ_FILE | _landlock.FS_WRITE_FILE | _landlock.FS_IOCTL_DEV)
        ruleset.allow_tcp(sorted(policy.allow_tcp_connect | _egress.connect_ports(policy)), _landlock.NET_CONNECT_TCP)
        ruleset.allow_tcp(sorted(policy.allow_tcp_bind), _landlock.NET_BIND_TCP)
    except ConfinementError:
        ruleset.close()
        raise
    except OSError as exc:
        ruleset.close()
        raise ConfinementError("a Landlock rule was refused by the kernel",
                               context={"errno": errno.errorcode.get(exc.errno or 0, str(exc.errno))},
                               diagnostic=str(exc)) from None
    return ruleset
