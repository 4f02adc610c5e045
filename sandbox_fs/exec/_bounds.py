"""The process-count bound of one run: a cgroup v2 ``pids.max``, ``RLIMIT_NPROC``, or a v1 pids leaf."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from . import _cgroups
from ._errors import ConfinementError

if TYPE_CHECKING:  # pragma: no cover
    from ._models import ConfinementPolicy
    from ._prepare import Prepared
    from ._supervisor import ProcessSupervisor


def _nproc_enforced() -> bool:
    """Does Linux enforce ``RLIMIT_NPROC`` on a command run under the host's own uid?

    Not for uid 0 (nor with ``CAP_SYS_RESOURCE``/``CAP_SYS_ADMIN``, which a
    non-root command does not hold): only when the host process is not
    root.  A command switched to an unprivileged identity is always bound.
    """
    return os.geteuid() != 0


def read_process_bounds(prep: Prepared, supervisor: ProcessSupervisor, policy: ConfinementPolicy,
                    confinement: str, identity: tuple[int, int] | None = None) -> list[str]:
    """Choose the process-count bounds; set ``prep.process_bounds``; return the helper's extra args.

    In order: the cgroup v2 leaf's ``pids.max``; ``RLIMIT_NPROC`` when Linux
    enforces it (a non-root command); and only when neither holds, a cgroup
    v1 pids leaf (an isolated join waits for an RCU grace period, ~14 ms
    measured on the 2-core VM, so it is the last resort).  Each bound is read back from
    the kernel.

    Raises:
        ConfinementError: ``confinement="required"``, the policy asks for a
            bound (``pids_max`` or ``processes``) and none can be enforced.
    """
    bounds: list[str] = []
    args: list[str] = []
    if prep.leaf is not None and policy.pids_max is not None:
        n = _cgroups._read_pids_max(prep.leaf)
        if n is not None:
            bounds.append(f"cgroup2.pids.max={n}")
    if policy.processes is not None and (identity is not None or _nproc_enforced()):
        bounds.append(f"rlimit.nproc={int(policy.processes)}")
    if not bounds and policy.pids_max is not None and policy.use_cgroup:
        leaf = supervisor._new_pids_leaf(policy.pids_max)
        if leaf is not None:
            prep.pids_leaf = leaf
            n = _cgroups._read_pids_max(leaf)
            if n is not None:
                fd = os.open(f"{leaf}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)  # host-access: cgroupfs (kernel interface)
                prep.pass_fds.append(fd)
                args += ["--pids-procs", str(fd)]
                bounds.append(f"cgroup1.pids.max={n}")
    if not bounds and confinement == "required" and (policy.pids_max is not None or policy.processes is not None):
        raise ConfinementError("no process-count bound can be enforced on this host (no cgroup pids "
                               "controller, and RLIMIT_NPROC does not bind uid 0); confinement='required' "
                               "fails closed", secrets=prep.secrets)
    prep.process_bounds = tuple(bounds)
    return args
