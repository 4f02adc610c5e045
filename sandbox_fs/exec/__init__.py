"""Confined command execution under trio: Landlock, seccomp, namespaces, rlimits, supervision, PTY.

Processes started in a workspace are untrusted.  :func:`run_confined` starts
one through the ``sfs-exec`` helper so that on Linux it reads, writes and
executes only beneath the workspace, its grants (by their mode) and a
read-only system set; has no network unless a TCP port is allowed; runs
under a seccomp allow-list, without capabilities, as a leased unprivileged
identity on a root host, under an init of its own in its own PID namespace
with a process-count bound; sees an environment built from an allow-list;
and cannot make the host hold more than ``max_output_bytes`` per stream.
Nothing it starts outlives it, its :class:`ProcessSupervisor` or the host
process.  :class:`PtyManager` runs the same on pseudo-terminals.  With a
:class:`PrivateRoot` (the FUSE overlay's detached mount) the command runs in
a root of its own: the overlay, the system set, a private ``/tmp``, a
minimal ``/dev`` and its own ``/proc``, nothing else of the host.

What each layer guarantees, where it comes from and what remains is in
SECURITY.md, "Confined commands".  The private modules, in the order a run
uses them:

* ``_models``: :class:`ConfinementPolicy`, :class:`PrivateRoot`, :class:`ExecResult`, and the
  ``ExecRequest`` each call builds and validates once;
* ``_env`` (the command's environment), ``_grants`` (workspace and grants as
  trees), ``_ruleset`` and ``_landlock`` (the Landlock ruleset and the system
  set), ``_mounts`` (the read-only mount layer, the private root's trees),
  ``_seccomp`` (the socket allow-list), ``_identity`` (leased uid/gid, workspace ownership),
  ``_cgroups`` and ``_bounds`` (cgroup trees, the process-count bound);
* ``_prepare`` (the helper's argv and fds), ``_helper`` (the ``sfs-exec``
  helper and its status pipe), ``_spawn`` (:func:`run_confined`),
  ``_supervisor`` (:class:`ProcessSupervisor`), ``_pty`` (:class:`PtyManager`),
  ``_output`` (bounded capture), ``_errors``;
* ``_proxy``: :class:`EgressProxy`, the host-side allow-list proxy (HTTP
  CONNECT, plain HTTP, SOCKS5) serving the listening socket the helper
  makes in the command's network namespace.

Thread-safety: the async functions are meant for one trio run; a
ProcessSupervisor and a PtyManager belong to one trio run.
"""

from ._env import DEFAULT_PATH, ENV_ALLOWLIST, MAX_ENV_BYTES, MAX_ENV_ENTRIES, build_env
from ._env import HOME_DIR, TMP_DIR  # noqa: F401  (importable here as before, not in __all__)
from ._errors import (
    CommandNotFoundError,
    ConfinementError,
    ExecError,
    ExecFailedError,
    ExecTimeoutError,
    InvalidEnvError,  # noqa: F401  (importable here as before, not in __all__)
    PtyNotFoundError,
)
from ._devices import DeviceError  # noqa: F401  (importable here, not in __all__)
from ._helper import helper_path
from ._models import Confinement, ConfinementPolicy, ExecResult, PrivateRoot  # noqa: F401  (Confinement: as before)
from ._output import DEFAULT_MAX_OUTPUT_BYTES
from ._proxy import EgressEvent, EgressLog, EgressProxy, HostRule, ProxyLimits
from ._protected import DEFAULT_PROTECTED
from ._pty import PtyManager
from ._ruleset import build_ruleset
from ._spawn import run_confined
from ._supervisor import ProcessSupervisor
from ._violations import Violation, ViolationLog, violation_summary

__all__ = [
    "ExecResult",
    "ExecError",
    "ExecTimeoutError",
    "ExecFailedError",
    "CommandNotFoundError",
    "ConfinementError",
    "PtyNotFoundError",
    "ConfinementPolicy",
    "PrivateRoot",
    "EgressProxy",
    "HostRule",
    "EgressEvent",
    "EgressLog",
    "ProxyLimits",
    "ProcessSupervisor",
    "PtyManager",
    "run_confined",
    "build_ruleset",
    "build_env",
    "helper_path",
    "DEFAULT_MAX_OUTPUT_BYTES",
    "ENV_ALLOWLIST",
    "DEFAULT_PATH",
    "MAX_ENV_BYTES",
    "MAX_ENV_ENTRIES",
    "DEFAULT_PROTECTED",
    "Violation",
    "ViolationLog",
    "violation_summary",
]
