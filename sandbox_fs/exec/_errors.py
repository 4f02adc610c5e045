"""The errors of confined execution (all :class:`~sandbox_fs.errors.SandboxError`, stable ``code``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import SandboxError

if TYPE_CHECKING:  # pragma: no cover
    from ._models import ExecResult


class ExecError(SandboxError):
    """A command could not be started or run as asked."""

    code = "exec_error"


class ConfinementError(ExecError):
    """Confinement was required but cannot be applied (fails closed).

    Raised when Landlock is unavailable (ABI 0), the exec helper is missing,
    a step of the helper fails (landlock, capabilities, cgroup, namespaces),
    or a rule cannot be expressed (a read-only grant inside the workspace).
    """

    code = "confinement_unavailable"


class CommandNotFoundError(ExecError):
    """The program (``argv[0]``) does not exist or is not executable inside the sandbox."""

    code = "command_not_found"


class ExecTimeoutError(ExecError):
    """The command ran past ``timeout_s`` and its whole process tree was killed.

    Attributes:
        result: the :class:`ExecResult` with the output captured so far.
    """

    code = "exec_timeout"
    retryable = False

    def __init__(self, reason: str, *, result: "ExecResult", **kw) -> None:
        super().__init__(reason, **kw)
        self.result = result


class ExecFailedError(ExecError):
    """``check=True`` and the command exited non-zero.

    Attributes:
        result: the :class:`ExecResult`.
    """

    code = "exec_failed"

    def __init__(self, reason: str, *, result: "ExecResult", **kw) -> None:
        super().__init__(reason, **kw)
        self.result = result


class PtyNotFoundError(ExecError, KeyError):
    """No live PTY session has this id (never started, terminated or pruned)."""

    code = "pty_not_found"

    def __str__(self) -> str:  # KeyError would quote the message
        return self._message()

class InvalidEnvError(ExecError, ValueError):
    """An environment entry is malformed, or the environment is too large."""

    code = "invalid_env"
