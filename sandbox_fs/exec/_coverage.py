"""Which protections a run's policy asks for that no layer gives it on this host.

A protection can come from more than one layer: TCP is restricted by
Landlock (ABI >= 4) or taken away with a network namespace of the command's
own; abstract unix sockets are scoped by Landlock (ABI >= 6) or belong to
that network namespace; signals are scoped by Landlock (ABI >= 6) or cannot
name a process outside the command's PID namespace; ``truncate(2)`` of a
file Landlock grants read-only is handled from ABI 3 on, and the read-only
mount layer refuses it on every file outside the workspace and read-write
grants.  An entry is *missing* when every layer that could give it is
absent here.  The ABI numbers are the kernel's
(Documentation/userspace-api/landlock.rst).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from ._models import ExecRequest
    from ._prepare import Prepared

#: Entries of :func:`missing_protections`, and why each matters.
MISSING_TEXT = {
    "landlock": "no Landlock: the command's file access is not confined",
    "landlock.truncate": "Landlock ABI < 3 and no read-only mount layer: files granted read-only can be truncated",
    "landlock.tcp": "Landlock ABI < 4 and no network namespace: TCP is not restricted",
    "landlock.scope_abstract_unix": "Landlock ABI < 6 and no network namespace: abstract unix sockets "
                                    "outside the sandbox can be reached",
    "landlock.scope_signals": "Landlock ABI < 6 and no PID namespace: processes of the same uid outside "
                              "the sandbox can be signalled",
    "process_bound": "no process-count bound can be enforced",
    "mount_layer": "no read-only mount layer (chmod, chown, utime and xattr changes outside the workspace "
                   "are left to file ownership)",
}

#: Entries whose absence ``confinement="required"`` accepts (documented at
#: :attr:`ConfinementPolicy.read_only_mounts`: ``"required"`` promises Landlock).
TOLERATED_BY_REQUIRED = frozenset({"mount_layer"})


def missing_protections(request: ExecRequest, prep: Prepared, *, pid_namespace: bool) -> tuple[str, ...]:
    """The protections ``request.policy`` asks for that neither Landlock nor a namespace gives the run.

    Args:
        request: the validated request.
        prep: the prepared run (its Landlock ABI, mount layer, network
            namespace and process bounds are decided).
        pid_namespace: the exec helper will run the command in a PID
            namespace of its own.

    Returns:
        keys of :data:`MISSING_TEXT`, in that order; empty with
        ``confinement="none"`` (which asks for nothing).
    """
    if request.confinement == "none":
        return ()
    policy = request.policy
    abi = prep.abi if prep.level == "landlock" else 0
    found = set()
    if abi <= 0:
        found.add("landlock")
    else:
        if abi < 3 and not prep.ro_mounts:
            found.add("landlock.truncate")
        if abi < 4 and not policy.unrestricted_tcp and not prep.net_isolated:
            found.add("landlock.tcp")
        if abi < 6 and policy.scope_abstract_unix and not prep.net_isolated:
            found.add("landlock.scope_abstract_unix")
        if abi < 6 and policy.scope_signals and not pid_namespace:
            found.add("landlock.scope_signals")
    if (policy.pids_max is not None or policy.processes is not None) and not prep.process_bounds:
        found.add("process_bound")
    if policy.read_only_mounts and not prep.ro_mounts:
        found.add("mount_layer")
    return tuple(k for k in MISSING_TEXT if k in found)


def pid_namespace_expected(ro_mounts_possible: bool) -> bool:
    """Will the helper's init get a PID namespace?  As root always; otherwise only inside a user
    namespace, which the read-only mount layer's probe (``ro_mounts_possible``) tells."""
    return os.geteuid() == 0 or ro_mounts_possible
