"""The ``sandbox-fs`` command line: the top-level parser and ``main``.

Each subcommand NAME lives in its own module ``sandbox_fs.cli._NAME`` that
defines ``add_arguments(parser)`` (its options, on the parser made here) and
``handle(args) -> int`` (runs it, returns the exit code).  A subcommand's
module is imported only when that subcommand is chosen, so a usage error,
``--help`` or ``--version`` loads none of them (nor pydantic, trio or the
archive code).  ``main`` guarantees the contract for every input: a refusal
prints one line on stderr (code, sandbox path, reason) and exits non-zero; no
traceback ever reaches the terminal (see :mod:`sandbox_fs.cli._errors` for
the exit codes).

Every text line goes through :func:`sandbox_fs.cli._output.escape_text`
and every JSON document through ``json_text`` (``ensure_ascii``): no name
chosen by a confined command, an archive or a snapshot can put a raw control
byte on the operator's terminal.  Numeric options are checked types
(:mod:`sandbox_fs.cli._args`): nan, inf, out-of-range values are usage errors.
"""

from __future__ import annotations

import argparse
import importlib
import resource
import sys
from typing import Collection, NoReturn, Sequence

from ._errors import EXIT_USAGE, report
from ._output import escape_text, one_line

# name -> the one-line help shown by ``sandbox-fs --help``, in that order
SUBCOMMANDS = {
    "demo": "show a Root refusing escapes in a throw-away workspace",
    "extract": "extract a tar or zip archive into a directory, safely",
    "apply": "materialize a manifest into a workspace directory",
    "schema": "print the JSON Schema of the manifest format",
    "run": "materialize a manifest (or resume), run a command confined, persist a snapshot",
    "session": "create, resume, fork or remove a sandbox session (state in a JSON file)",
    "snapshot": "save a workspace into a snapshot store, restore it, list snapshots",
    "features": "what the kernel offers here and what confinement a run would get",
    "fuzz": "fuzz a parser or the path policy, asserting the sandbox invariant (needs sandbox-fs[fuzz])",
}


def version_text() -> str:
    """``sandbox-fs VERSION (native ABI N)``: the package version and its C module's ABI."""
    from .. import __version__, _native  # noqa: PLC0415

    return f"sandbox-fs {__version__} (native ABI {_native.EXPECTED_ABI})"


def _raise_nofile() -> None:
    """Deep trees are walked with one fd per level: lift the soft fd limit to the hard one."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        pass


class _VersionAction(argparse.Action):
    """``--version``: print :func:`version_text` on stdout and exit 0."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kw: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the package version and the native ABI, and exit")

    def __call__(self, parser: argparse.ArgumentParser, *_args: object, **_kw: object) -> None:
        print(version_text())
        parser.exit()


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors on one stderr line (exit 2), like every other refusal."""

    def error(self, message: str) -> NoReturn:
        text = escape_text(one_line(message), keep_backslash=True)
        self.exit(EXIT_USAGE, f"sandbox-fs: error: usage: {text} (see {escape_text(self.prog)} --help)\n")


def _module(name: str) -> object:
    return importlib.import_module(f"sandbox_fs.cli._{name}")


def build_parser(full: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The ``sandbox-fs`` parser.

    Args:
        full: the subcommands whose options are added (their modules are
            imported); the others get their name and help only.  None (the
            default) builds every subcommand in full.

    Returns:
        the parser; the subcommand's name parses into ``args.command``.
    """
    parser = _Parser(prog="sandbox-fs", description="A security-hardened filesystem sandbox.")
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if full is None or name in full:
            _module(name).add_arguments(p)  # type: ignore[attr-defined]
    return parser


def _chosen(argv: Sequence[str]) -> tuple[str, ...]:
    """The subcommand named in ``argv`` (as a 1-tuple): the first word not an option (the top
    level takes no option with a value); ``()`` when there is none or it names no subcommand."""
    for word in argv:
        if not word.startswith("-"):
            return (word,) if word in SUBCOMMANDS else ()
    return ()


def _safe_streams() -> None:
    """Text that cannot be encoded for stdout/stderr (a C locale, PYTHONIOENCODING=ascii) is
    written backslash-escaped instead of failing the command."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            pass


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code (also used as console_scripts entry).

    Args:
        argv: the arguments after the program name (default ``sys.argv[1:]``).

    Returns:
        0 on success, else the code from :mod:`sandbox_fs.cli._errors`
        (or the confined command's status for ``run``).

    Raises:
        SystemExit: from argparse (``--help``, ``--version``, a usage error: code 0 or 2)
            and from a subcommand ending on a signal.
    """
    _raise_nofile()
    _safe_streams()
    words = sys.argv[1:] if argv is None else argv
    try:
        parser = build_parser(_chosen(words))
        args = parser.parse_args(words)
        if args.command is None:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        return int(_module(args.command).handle(args) or 0)  # type: ignore[attr-defined]
    except SystemExit:
        raise
    except BaseException as exc:  # never a traceback at the command line
        return report(exc)
