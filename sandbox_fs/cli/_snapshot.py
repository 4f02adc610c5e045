"""``sandbox-fs snapshot save|restore|ls``: persist a workspace into a store, hydrate it back, list.

``save`` streams the workspace (fd walk, never follows a symlink) into the
store; ``restore`` verifies the snapshot and replaces the workspace
contents; ``ls`` lists valid snapshots.  Progress is shown on stderr when it
is a terminal; ``--json`` prints a JSON report on stdout.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable

from ._output import print_report, progress_printer
from . import _hostpath
from ._hostpath import host_path
from ..root import open_root
from ..snapshot import LocalSnapshotStore, SnapshotLimits, hydrate, persist


def _save(args: argparse.Namespace) -> int:
    show = progress_printer()
    t0 = time.monotonic()
    # both host paths by the host-path rule (no symlink on any component)
    with LocalSnapshotStore(host_path(args, args.store)) as store, \
            open_root(host_path(args, args.workspace), read_only=True) as ws:
        try:
            rep = persist(ws, store, args.name, excluded=args.exclude,
                          on_unrestorable="skip" if args.skip_unrestorable else "refuse",
                          limits=SnapshotLimits(), progress=show)
        finally:
            if show is not None:
                print(file=sys.stderr)
    info = rep.info
    assert info is not None
    print_report(args, {"action": "save", "name": info.name, "entries": info.entries,
                   "content_bytes": info.content_bytes, "archive_bytes": info.archive_bytes,
                   "fingerprint": info.fingerprint, "seconds": round(time.monotonic() - t0, 3),
                   "skipped": [{"path": p, "reason": r} for p, r in rep.skipped] or None})
    return 0


def _restore(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    tty = sys.stderr.isatty()
    if tty:
        print("restoring...", end="", file=sys.stderr, flush=True)
    try:
        with LocalSnapshotStore(host_path(args, args.store), create=False) as store, \
                open_root(host_path(args, args.workspace)) as ws:
            rep = hydrate(ws, store, args.name)
    finally:
        if tty:
            print("\r" + " " * 20 + "\r", end="", file=sys.stderr, flush=True)
    print_report(args, {"action": "restore", "name": rep.info.name, "entries": rep.info.entries,
                   "content_bytes": rep.info.content_bytes, "fingerprint": rep.info.fingerprint,
                   "seconds": round(time.monotonic() - t0, 3)})
    return 0


def _ls(args: argparse.Namespace) -> int:
    with LocalSnapshotStore(host_path(args, args.store), create=False) as store:
        rows = [{"name": i.name, "entries": i.entries, "content_bytes": i.content_bytes,
                 "archive_bytes": i.archive_bytes, "created_ns": i.created_ns, "fingerprint": i.fingerprint}
                for i in store.list()]
    print_report(args, rows)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``sandbox-fs snapshot ACTION``."""
    ss = p.add_subparsers(dest="snapshot_command", metavar="ACTION")
    ss.required = True

    s = ss.add_parser("save", help="persist a workspace directory as a named snapshot")
    s.add_argument("--workspace", required=True, help="workspace directory (read only, through a Root)")
    s.add_argument("--store", required=True, help="snapshot store directory (created 0700)")
    s.add_argument("--name", required=True, help="snapshot name (letters, digits, '_' or '-')")
    s.add_argument("--exclude", action="append", default=[], help="workspace-relative path to leave out (repeatable)")
    s.add_argument("--skip-unrestorable", action="store_true",
                   help="leave out entries a restore would refuse instead of failing")
    s.add_argument("--json", action="store_true", help="print a JSON report on stdout")
    _hostpath.add_flag(s)

    r = ss.add_parser("restore", help="replace a workspace's contents with a verified snapshot")
    r.add_argument("--workspace", required=True, help="workspace directory (its contents are replaced)")
    r.add_argument("--store", required=True, help="snapshot store directory")
    r.add_argument("--name", required=True, help="snapshot name")
    r.add_argument("--json", action="store_true", help="print a JSON report on stdout")
    _hostpath.add_flag(r)

    ls = ss.add_parser("ls", help="list the valid snapshots in a store")
    ls.add_argument("--store", required=True, help="snapshot store directory")
    ls.add_argument("--json", action="store_true", help="print a JSON report on stdout")
    _hostpath.add_flag(ls)


_ACTIONS: dict[str, Callable[[argparse.Namespace], int]] = {"save": _save, "restore": _restore, "ls": _ls}


def handle(args: argparse.Namespace) -> int:
    """Run ``sandbox-fs snapshot ACTION``; 0 when done (a refusal raises, see ``_errors``)."""
    return _ACTIONS[args.snapshot_command](args)
