"""``sandbox-fs extract ARCHIVE --into DIR``: bounded, atomic archive extraction.

Exit 0 with a one-line summary (or the JSON report with ``--json``); on a
refusal ``main`` prints one line on stderr (code, member, reason) and exits 1.
SIGTERM during the extraction takes the same path as SIGINT: the staging
directory (``.sfs-extract-*``) is removed, then the process exits 143.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from typing import Any, Iterator

from . import _hostpath
from ._args import INT64_MAX, MAX_SECONDS, NumericType
from ._hostpath import host_path
from ._output import escape_text, json_text
from ..archive import FORMATS, ArchiveLimits, ExtractPolicy, extract
from ..errors import InvalidArgumentError
from ..root import open_host_file_fd, open_root

_LIMIT_FLAGS = {
    "max_members": ("--max-members", int),
    "max_total_bytes": ("--max-total-bytes", int),
    "max_member_bytes": ("--max-member-bytes", int),
    "max_expansion_ratio": ("--max-ratio", float),
    "max_path_bytes": ("--max-path-bytes", int),
    "max_depth": ("--max-depth", int),
    "max_header_bytes": ("--max-header-bytes", int),
    "max_input_bytes": ("--max-input-bytes", int),
    "max_cpu_seconds": ("--max-cpu-seconds", float),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``sandbox-fs extract``."""
    p.description = ("Extract ARCHIVE (a host path, or - for stdin) into DIR with every "
                     "write confined beneath DIR; atomic unless --in-place.")
    p.add_argument("archive", help="archive host path, or - to read a tar stream from stdin")
    p.add_argument("--into", required=True, metavar="DIR", help="destination directory (created if missing)")
    p.add_argument("--format", default="auto", choices=sorted(FORMATS))
    defaults = ArchiveLimits()
    for field, (flag, typ) in _LIMIT_FLAGS.items():
        p.add_argument(flag, dest=field, type=_limit_type(field, typ), default=None,
                       help=f"default {getattr(defaults, field)}")
    p.add_argument("--in-place", action="store_true", help="write directly into DIR (faster, not atomic)")
    p.add_argument("--skip-special", action="store_true",
                   help="skip (and report) devices, FIFOs, sockets and unknown types instead of refusing")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of a summary line")
    _hostpath.add_flag(p)


def _limit_type(field: str, kind: type) -> NumericType:
    """The checked argparse type of one limit: the bounds of ``ArchiveLimits.<field>`` (``ge``, ``gt``,
    ``le``), within 0 .. 2**63-1 (counts, bytes, the ratio) or 0 .. one year (seconds)."""
    low: float = 0
    low_open = False
    high: float = MAX_SECONDS if field.endswith("_seconds") else INT64_MAX
    for rule in ArchiveLimits.model_fields[field].metadata:
        if getattr(rule, "ge", None) is not None:
            low, low_open = rule.ge, False
        elif getattr(rule, "gt", None) is not None:
            low, low_open = rule.gt, True
        elif getattr(rule, "le", None) is not None:
            high = min(high, rule.le)
    return NumericType(kind, low, high, low_open=low_open, unit="s" if field.endswith("_seconds") else "")


EXIT_TERMINATED = 128 + signal.SIGTERM


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """Turn SIGTERM into ``SystemExit(143)`` raised in the extracting (main) thread.

    The extractor cleans up on any ``BaseException`` (staging tree removed,
    the partial member removed), exactly as for SIGINT's ``KeyboardInterrupt``.
    The first SIGTERM sets the signal to ignored so a second one cannot cut the
    cleanup short.  Outside the main thread (tests, embedding) nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(_signum: int, _frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("sandbox-fs: terminated", file=sys.stderr)
        raise SystemExit(EXIT_TERMINATED)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def handle(args: argparse.Namespace) -> int:
    """Run ``sandbox-fs extract``: 0 when extracted (a refusal raises, see ``_errors``)."""
    overrides = {f: getattr(args, f) for f in _LIMIT_FLAGS if getattr(args, f) is not None}
    try:
        limits = ArchiveLimits(**overrides)
    except ValueError as exc:  # pydantic ValidationError
        first = exc.errors()[0] if hasattr(exc, "errors") else None
        what = f"{first['loc'][0]}: {first['msg']}" if first else " ".join(str(exc).split())[:200]
        raise InvalidArgumentError(f"invalid limit {what}", sandbox_path=None) from None
    policy = ExtractPolicy(in_place=args.in_place, special_files="skip" if args.skip_special else "refuse")
    # --into and ARCHIVE are opened by the host-path rule: no symlink on any component
    into = host_path(args, args.into) or args.into
    parent, leaf = os.path.split(into)
    label = os.path.basename(into) or "."
    if leaf and not os.path.lexists(into):  # picks the branch only; both open by the rule
        root = open_root(parent or "/", label="")
        dest = leaf
    else:
        root = open_root(into, label=label)
        dest = "."
    with root, _sigterm_unwinds():
        if args.archive == "-":
            # Unbuffered: every read is one syscall issued from Python code, so a SIGTERM or
            # SIGINT while waiting for input interrupts it and runs the handler at once (a
            # buffered reader can sit in its C read loop with the signal already noted).
            # host-access: stdin fd, not a path
            with open(sys.stdin.fileno(), "rb", buffering=0, closefd=False) as stdin:
                report = extract(root, dest, stdin, format=args.format, limits=limits, policy=policy)
        else:
            afd = open_host_file_fd(host_path(args, args.archive) or args.archive, label="ARCHIVE")
            with open(afd, "rb", buffering=0) as fh:  # host-access: an fd opened by the host-path rule
                report = extract(root, dest, fh, format=args.format, limits=limits, policy=policy)
    if args.json:
        print(json_text(report.model_dump()))
    else:
        print(f"extracted {escape_text(report.summary(), keep_backslash=True)} into {escape_text(args.into)}")
    return 0
