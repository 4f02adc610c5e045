"""The ``sandbox-fs`` command line (entry point ``sandbox-fs = sandbox_fs.cli:main``).

:func:`main` runs it; :func:`build_parser` is its parser.  The subcommands
live in private modules ``sandbox_fs.cli._NAME`` (see ``_main``); the helpers
they share: ``_output`` (what reaches the terminal), ``_args`` (checked
numeric options), ``_hostpath`` (host paths and operator input files),
``_errors`` (exit codes, every error as one stderr line).
"""

from __future__ import annotations

from ._errors import EXIT_INTERNAL, EXIT_REFUSED, EXIT_USAGE, exception_leaves
from ._main import build_parser, main

__all__ = ["main", "build_parser", "exception_leaves", "EXIT_REFUSED", "EXIT_USAGE", "EXIT_INTERNAL"]
