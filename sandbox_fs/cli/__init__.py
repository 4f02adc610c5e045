"""The ``sandbox-fs`` command line (entry point ``sandbox-fs = sandbox_fs.cli:main``)."""

from __future__ import annotations

from ._main import EXIT_INTERNAL, EXIT_REFUSED, EXIT_USAGE, build_parser, exception_leaves, main

__all__ = ["main", "build_parser", "exception_leaves", "EXIT_REFUSED", "EXIT_USAGE", "EXIT_INTERNAL"]
