"""How the ``sandbox-fs`` command line ends: exit codes, and every error as one stderr line.

:func:`report` turns whatever a subcommand raised into its exit code and at
most one line on stderr; no traceback ever reaches the terminal
(``SANDBOX_FS_DEBUG=1`` adds one after the line, for a bug report).
A trio nursery wraps errors in exception groups: :func:`exception_leaves`
is the one walker that finds the refusal inside them.

Exit codes: 0 success; 1 a refusal (``SandboxError``) or an OS error;
2 usage error; 70 an internal error (a bug: please report it); 130 interrupted.
"""

from __future__ import annotations

import os
import sys

from ..errors import SandboxError
from ._output import error_line

__all__ = ["EXIT_REFUSED", "EXIT_USAGE", "EXIT_INTERNAL", "EXIT_INTERRUPTED", "CliInputError",
           "exception_leaves", "first_refusal", "report"]

EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 70
EXIT_INTERRUPTED = 130


class CliInputError(SandboxError):
    """A command-line input file (state, manifest, key) cannot be read or parsed."""

    code = "cli_input"


def exception_leaves(group: BaseException) -> list[BaseException]:
    """The non-group exceptions inside ``group``, depth first (``[group]`` for a plain exception)."""
    if isinstance(group, BaseExceptionGroup):
        out: list[BaseException] = []
        for e in group.exceptions:
            out.extend(exception_leaves(e))
        return out
    return [group]


def first_refusal(exc: BaseException) -> SandboxError | OSError | None:
    """The refusal ``exc`` stands for: the first ``SandboxError`` among its leaves, else the first
    ``OSError``, else None (``exc`` is a bug, an interrupt or an exit)."""
    leaves = exception_leaves(exc)
    return (next((e for e in leaves if isinstance(e, SandboxError)), None)
            or next((e for e in leaves if isinstance(e, OSError)), None))


def report(exc: BaseException) -> int:
    """Write ``exc`` as one line on stderr and return the exit code it means.

    A ``SystemExit`` is not handled here: the caller lets it through.
    """
    if isinstance(exc, KeyboardInterrupt):
        print("sandbox-fs: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    refusal = first_refusal(exc)
    if refusal is not None:
        print(f"sandbox-fs: error: {error_line(refusal)}", file=sys.stderr)
        return EXIT_REFUSED
    print(f"sandbox-fs: internal error: {type(exc).__name__} (set SANDBOX_FS_DEBUG=1 for details)",
          file=sys.stderr)
    if os.environ.get("SANDBOX_FS_DEBUG") == "1":
        import traceback  # noqa: PLC0415

        traceback.print_exception(exc, file=sys.stderr)
    return EXIT_INTERNAL
