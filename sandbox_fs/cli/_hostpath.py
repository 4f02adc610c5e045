"""Host paths on the command line: one rule for every subcommand.

Every host path the operator gives (``--root``, ``--base``, ``--into``,
``--workspace``, ``--store``, ``--workspaces-dir``, ``--snapshot-dir``,
``--grant``, input and output files) is opened by the library's host-path
rule (:func:`sandbox_fs.root.open_host_dir_fd`): no symlink on any
component, so a link a confined command planted in a workspace cannot
redirect it.  ``--follow-host-symlinks`` is the opt-in for trusted
symlinked paths (a ``/tmp -> /private/tmp`` host): each such path is then
resolved with ``realpath`` first, and the physical result opened by the rule.

Not a subcommand (``_main`` registers only ``_SUBCOMMANDS``).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from ..root import check_host_output_target, open_host_file_fd, write_host_file_atomic

FLAG = "--follow-host-symlinks"


def add_flag(p: argparse.ArgumentParser) -> None:
    """Add ``--follow-host-symlinks`` to a subcommand parser."""
    p.add_argument(FLAG, dest="follow_host_symlinks", action="store_true",
                   help="follow symlinks in the host paths given here (only for trusted paths: by default "
                        "a host path with a symlink on it is refused, since a sandboxed command may have "
                        "planted it)")


def host_path(args: argparse.Namespace, path: str | None) -> str | None:
    """The absolute host path to hand to the library (None stays None).

    Without the opt-in: ``os.path.abspath`` (lexical only; the library
    refuses a symlink on it).  With ``--follow-host-symlinks``: ``realpath``.
    """
    if path is None:
        return None
    if getattr(args, "follow_host_symlinks", False):
        return os.path.realpath(path)
    return os.path.abspath(path)


def read_file(args: argparse.Namespace, path: str, max_bytes: int, label: str) -> bytes:
    """Read at most ``max_bytes + 1`` bytes of an operator input file by the host-path rule."""
    fd = open_host_file_fd(host_path(args, path) or path, label=label)
    try:
        with os.fdopen(fd, "rb", closefd=False) as fh:
            return fh.read(max_bytes + 1)
    finally:
        os.close(fd)


def write_json(args: argparse.Namespace | None, path: str, data: dict[str, Any], label: str = "state") -> None:
    """Write ``data`` as JSON (mode 0600) atomically; never replaces a special file or follows a symlink."""
    text = json.dumps(data, indent=1, sort_keys=True) + "\n"
    target = host_path(args, path) if args is not None else os.path.abspath(path)
    write_host_file_atomic(target or path, text.encode(), mode=0o600, label=label)


def check_output(args: argparse.Namespace, path: str | None, label: str = "state") -> None:
    """Refuse, before any work, an operator output path :func:`write_json` would refuse."""
    if path is not None:
        check_host_output_target(host_path(args, path) or path, label=label)
