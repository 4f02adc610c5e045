"""The ``sandbox-fs`` command line.

Each subcommand lives in its own module ``sandbox_fs.cli._<name>`` that
defines ``register(subparsers)``; the parser it adds sets ``func(args) ->
int``.  ``main`` guarantees the contract for every input: a refusal prints
one line on stderr (code, sandbox path, reason) and exits non-zero; no
traceback ever reaches the terminal.

Every text line goes through :func:`sandbox_fs.cli._output.escape_text`
and every JSON document through ``json_text`` (``ensure_ascii``): no name
chosen by a confined command, an archive or a snapshot can put a raw control
byte on the operator's terminal.  Numeric options are checked types
(:mod:`sandbox_fs.cli._args`): nan, inf, out-of-range values are usage errors.

Exit codes: 0 success; 1 a refusal (SandboxError) or an OS error;
2 usage error; 70 an internal error (a bug: please report it); 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import os
import resource
import sys
from typing import NoReturn

from ._output import error_line, escape_text, one_line
from ..errors import SandboxError

_SUBCOMMANDS = ("demo", "extract", "apply", "schema", "run", "session", "snapshot")

EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 70


def _raise_nofile() -> None:
    """Deep trees are walked with one fd per level: lift the soft fd limit to the hard one."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        pass


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors on one stderr line (exit 2), like every other refusal."""

    def error(self, message: str) -> NoReturn:
        text = escape_text(one_line(message), keep_backslash=True)
        self.exit(EXIT_USAGE, f"sandbox-fs: error: usage: {text} (see {escape_text(self.prog)} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sandbox-fs", description="A security-hardened filesystem sandbox.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _SUBCOMMANDS:
        modname = f"sandbox_fs.cli._{name}"
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as exc:
            if exc.name == modname:
                continue  # subcommand not built yet
            raise
        mod.register(sub)
    return parser


def _safe_streams() -> None:
    """Text that cannot be encoded for stdout/stderr (a C locale, PYTHONIOENCODING=ascii) is
    written backslash-escaped instead of failing the command."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            pass


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code (also used as console_scripts entry)."""
    _raise_nofile()
    _safe_streams()
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        return int(args.func(args) or 0)
    except (SandboxError, OSError) as exc:
        print(f"sandbox-fs: error: {error_line(exc)}", file=sys.stderr)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        print("sandbox-fs: interrupted", file=sys.stderr)
        return 130
    except SystemExit:
        raise
    except BaseException as exc:  # never a traceback at the command line
        if isinstance(exc, BaseExceptionGroup):
            leaves = exception_leaves(exc)
            sandbox = ([e for e in leaves if isinstance(e, SandboxError)]
                       or [e for e in leaves if isinstance(e, OSError)])
            if sandbox:
                print(f"sandbox-fs: error: {error_line(sandbox[0])}", file=sys.stderr)
                return EXIT_REFUSED
        print(f"sandbox-fs: internal error: {type(exc).__name__} (set SANDBOX_FS_DEBUG=1 for details)",
              file=sys.stderr)
        if os.environ.get("SANDBOX_FS_DEBUG") == "1":
            import traceback

            traceback.print_exception(exc, file=sys.stderr)
        return EXIT_INTERNAL


def exception_leaves(group: BaseException) -> list[BaseException]:
    """The non-group exceptions inside ``group``, depth first (``[group]`` for a plain exception)."""
    if isinstance(group, BaseExceptionGroup):
        out: list[BaseException] = []
        for e in group.exceptions:
            out.extend(exception_leaves(e))
        return out
    return [group]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
