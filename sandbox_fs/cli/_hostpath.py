"""Host paths on the command line: one rule for every subcommand.

Every host path the operator gives (``--root``, ``--base``, ``--into``,
``--workspace``, ``--store``, ``--workspaces-dir``, ``--snapshot-dir``,
``--grant``, input and output files) is opened by the library's host-path
rule (:func:`sandbox_fs.root.open_host_dir_fd`): no symlink on any
component, so a link a confined command planted in a workspace cannot
redirect it.  ``--follow-host-symlinks`` is the opt-in for trusted
symlinked paths (a ``/tmp -> /private/tmp`` host): each such path is then
resolved with ``realpath`` first, and the physical result opened by the rule.

Operator input files (manifests, state files, keys) are read by
:func:`read_input`, the one bounded reader: a regular file by that rule (or
stdin where a subcommand takes ``-``), at most ``max_bytes``, every failure
one refusal.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, overload

from .._json import loads_untrusted
from ..errors import SandboxError
from ..paths import Grant
from ..root import check_host_output_target, open_host_file_fd, write_host_file_atomic
from ._errors import CliInputError

FLAG = "--follow-host-symlinks"


def add_flag(p: argparse.ArgumentParser) -> None:
    """Add ``--follow-host-symlinks`` to a subcommand parser."""
    p.add_argument(FLAG, dest="follow_host_symlinks", action="store_true",
                   help="follow symlinks in the host paths given here (only for trusted paths: by default "
                        "a host path with a symlink on it is refused, since a sandboxed command may have "
                        "planted it)")


@overload
def host_path(args: argparse.Namespace, path: str) -> str: ...
@overload
def host_path(args: argparse.Namespace, path: None) -> None: ...
@overload
def host_path(args: argparse.Namespace, path: str | None) -> str | None: ...


def host_path(args: argparse.Namespace, path: str | None) -> str | None:
    """The absolute host path to hand to the library (None stays None).

    Without the opt-in: ``os.path.abspath`` (lexical only; the library
    refuses a symlink on it).  With ``--follow-host-symlinks``: ``realpath``.

    Raises:
        CliInputError: ``path`` is empty (both would make it the current
            directory, which the library's own rule refuses: ``--workspace ""``
            from an unset variable would restore a snapshot over it).
    """
    if path is None:
        return None
    if path == "":
        raise CliInputError("a host path given is empty (an unset variable?); give the directory or file",
                            sandbox_path=None)
    if getattr(args, "follow_host_symlinks", False):
        return os.path.realpath(path)
    return os.path.abspath(path)


def _read_file(args: argparse.Namespace, path: str, max_bytes: int, label: str) -> bytes:
    """Read at most ``max_bytes + 1`` bytes of an operator input file by the host-path rule."""
    fd = open_host_file_fd(host_path(args, path) or path, label=label)
    try:
        with os.fdopen(fd, "rb", closefd=False) as fh:
            return fh.read(max_bytes + 1)
    finally:
        os.close(fd)


def _cli_input_error(reason: str) -> SandboxError:
    return CliInputError(reason, sandbox_path=None)


def read_input(args: argparse.Namespace | None, path: str, what: str, max_bytes: int = 64 << 20, *,
               label: str | None = None, allow_stdin: bool = False,
               refuse: Callable[[str], SandboxError] = _cli_input_error) -> bytes:
    """Read an operator input file, at most ``max_bytes`` bytes.

    Args:
        args: the parsed command line (for ``--follow-host-symlinks``), or None.
        path: the host path the operator gave; ``-`` is stdin when ``allow_stdin``.
        what: the file's name in messages (``"manifest"``, ``"state"``).
        max_bytes: the largest input taken, in bytes.
        label: the name the host-path rule's refusals give the path (default ``what``).
        allow_stdin: read ``-`` as stdin instead of a file named ``-``.
        refuse: makes the refusal from its reason (default :class:`CliInputError`).

    Returns:
        the file's bytes.

    Raises:
        SandboxError: ``refuse(reason)`` when the file cannot be read or is
            over ``max_bytes``; the host-path rule's own refusals
            (``SymlinkRefusedError``, ``SpecialFileError``) as they are.
    """
    if allow_stdin and path == "-":
        data = sys.stdin.buffer.read(max_bytes + 1)
    else:
        try:
            data = _read_file(args or argparse.Namespace(), path, max_bytes, label or what)
        except SandboxError:
            raise
        except OSError as exc:
            raise refuse(f"cannot read the {what} file ({os.strerror(exc.errno or 5)})") from None
    if len(data) > max_bytes:
        raise refuse(f"the {what} file is over {max_bytes} bytes")
    return data


def load_state(args: argparse.Namespace | None, path: str) -> dict[str, Any]:
    """The session state JSON object in the operator's file ``path`` (at most 64 MiB).

    Raises:
        CliInputError: the file cannot be read, is too big, is not JSON or not an object.
        SandboxError: the host-path rule refused ``path`` (see :func:`read_input`).
    """
    try:
        data = loads_untrusted(read_input(args, path, "state"))
    except ValueError:
        raise CliInputError("the state file is not valid JSON", sandbox_path=None) from None
    if not isinstance(data, dict):
        raise CliInputError("the state file must hold a JSON object", sandbox_path=None)
    return data


def parse_grant(spec: str, args: argparse.Namespace | None = None) -> Grant:
    """``[NAME=]PATH``, ``[NAME=]PATH:ro`` or ``[NAME=]PATH:rw`` (default read-only, no name).

    A relative PATH is taken from the cwd; NAME is what a manifest ``mount``
    entry names the grant by.  With ``--follow-host-symlinks`` the PATH is
    resolved with ``realpath`` first.

    Raises:
        InvalidPathError: ``spec`` is no grant (see :meth:`sandbox_fs.paths.Grant.parse`).
        InvalidArgumentError: NAME is followed by no path.
    """
    g = Grant.parse(spec, relative_to=os.getcwd())
    if args is not None and getattr(args, "follow_host_symlinks", False):
        g = Grant(os.path.realpath(g.path), read_only=g.read_only, name=g.name)
    return g


def write_json(args: argparse.Namespace | None, path: str, data: dict[str, Any], label: str = "state") -> None:
    """Write ``data`` as JSON to the operator-named ``path`` (mode 0600): temp file, fsync, rename.

    By :func:`sandbox_fs.root.write_host_file_atomic`: the directory is
    opened by the host-path rule and anything but a regular file at the name
    (a symlink, a device such as ``/dev/full``) is refused, never replaced.

    Raises:
        SpecialFileError: something other than a regular file is at ``path``.
        SymlinkRefusedError: a directory on ``path`` is a symlink.
    """
    text = json.dumps(data, indent=1, sort_keys=True) + "\n"
    target = host_path(args, path) if args is not None else os.path.abspath(path)
    write_host_file_atomic(target or path, text.encode(), mode=0o600, label=label)


def check_output(args: argparse.Namespace, path: str | None, label: str = "state") -> None:
    """Refuse, before any work, an operator output path :func:`write_json` would refuse."""
    if path is not None:
        check_host_output_target(host_path(args, path) or path, label=label)
