"""``sandbox-fs snapshot save|restore|ls|gc``: persist a workspace into a store, hydrate it back, list, collect.

``save`` streams the workspace (fd walk, never follows a symlink) into the
store; ``restore`` verifies the snapshot and replaces the workspace
contents; ``ls`` lists valid snapshots (for a store with generations, every
restore point: generation, chain length, sizes, age); ``gc`` removes
orphaned objects and stale uploads.  Progress is shown on stderr when it is
a terminal; ``--json`` prints a JSON report on stdout.

``--store`` is a directory or ``s3://BUCKET[/PREFIX]`` (an
:class:`~sandbox_fs.snapshot.S3SnapshotStore`: credentials and endpoint from
the standard AWS configuration chain, or ``--store-endpoint``).  A directory
is a :class:`~sandbox_fs.snapshot.DirectorySnapshotStore` (generations and
incremental layers; version-1 snapshots a
:class:`~sandbox_fs.snapshot.LocalSnapshotStore` wrote there still restore,
and their next save continues their generations).  ``save --generations`` is
accepted and changes nothing (it was needed before directories had layers).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from typing import Callable

from ._args import MAX_SECONDS, float_option, int_option
from ._output import print_report, progress_printer
from ._store import open_store
from . import _hostpath
from ._hostpath import host_path
from ..root import open_root
from ..snapshot import (
    MIN_GC_AGE_S,
    GenerationStore,
    SnapshotLimits,
    SnapshotStore,
    hydrate,
    persist,
)


def _open_store(args: argparse.Namespace, *, create: bool) -> SnapshotStore:
    """The store ``--store`` names (see the module docstring and :func:`._store.open_store`).

    Raises:
        as :func:`._store.open_store` (``create`` False: a missing directory
        is a ``SnapshotStoreError``, and none is made).
    """
    return open_store(args, str(args.store), create=create, keep=getattr(args, "keep", 2))  # type: ignore[no-any-return]


def _save(args: argparse.Namespace) -> int:
    show = progress_printer()
    t0 = time.monotonic()
    # both host paths by the host-path rule (no symlink on any component); the workspace first, so that
    # a missing one is refused before a store directory is made for it
    with open_root(host_path(args, args.workspace), read_only=True, shown="WORKSPACE") as ws, \
            contextlib.closing(_open_store(args, create=True)) as store:
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
                   "generation": info.generation, "chain_length": info.chain_length,
                   "fingerprint": info.fingerprint, "seconds": round(time.monotonic() - t0, 3),
                   "skipped": [{"path": p, "reason": r} for p, r in rep.skipped] or None})
    return 0


def _restore(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    tty = sys.stderr.isatty()
    if tty:
        print("restoring...", end="", file=sys.stderr, flush=True)
    try:
        with contextlib.closing(_open_store(args, create=False)) as store, \
                open_root(host_path(args, args.workspace), shown="WORKSPACE") as ws:
            rep = hydrate(ws, store, args.name, generation=args.generation, fallback=args.generation is None)
    finally:
        if tty:
            print("\r" + " " * 20 + "\r", end="", file=sys.stderr, flush=True)
    print_report(args, {"action": "restore", "name": rep.info.name, "generation": rep.generation,
                        "skipped_generations": rep.skipped_generations or None, "entries": rep.info.entries,
                   "content_bytes": rep.info.content_bytes, "fingerprint": rep.info.fingerprint,
                   "seconds": round(time.monotonic() - t0, 3)})
    return 0


def _ls(args: argparse.Namespace) -> int:
    now = time.time_ns()
    with contextlib.closing(_open_store(args, create=False)) as store:
        infos = store.list()
        if isinstance(store, GenerationStore):
            infos = [g for i in infos for g in store.generations(i.name)]
        rows = [{"name": i.name, "generation": i.generation, "chain_length": i.chain_length,
                 "entries": i.entries, "content_bytes": i.content_bytes, "archive_bytes": i.archive_bytes,
                 "age_s": round(max(0, now - i.created_ns) / 1e9, 1) if i.created_ns else None,
                 "fingerprint": i.fingerprint} for i in infos]
    if not rows and not args.json:  # stdout stays empty for scripts; a person sees why
        print("sandbox-fs: no snapshots in the store", file=sys.stderr)
    print_report(args, rows)
    return 0


def _gc(args: argparse.Namespace) -> int:
    with contextlib.closing(_open_store(args, create=False)) as store:
        if isinstance(store, GenerationStore):
            rep = store.gc(older_than=args.older_than)
            row = {"action": "gc", "objects": len(rep.objects), "bytes": rep.bytes, "uploads": rep.uploads,
                   "holds": rep.holds}
        else:  # not reached for a directory or s3:// (both are generation stores)
            row = {"action": "gc", "objects": 0, "bytes": 0, "uploads": 0, "holds": 0}
    print_report(args, row)
    return 0


def _store_flags(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--store", required=True, help=f"{what}: a directory or s3://BUCKET[/PREFIX]")
    p.add_argument("--store-endpoint", default=None,
                   help="S3 endpoint URL (default: the AWS configuration chain, e.g. AWS_ENDPOINT_URL_S3)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``sandbox-fs snapshot ACTION``."""
    ss = p.add_subparsers(dest="snapshot_command", metavar="ACTION")
    ss.required = True

    s = ss.add_parser("save", help="persist a workspace directory as a named snapshot")
    s.add_argument("--workspace", required=True, help="workspace directory (read only, through a Root)")
    _store_flags(s, "snapshot store (a directory is created 0700)")
    s.add_argument("--generations", action="store_true",
                   help="accepted for compatibility: a store directory always keeps generations and layers")
    s.add_argument("--keep", type=int_option(1, 1000), default=2, help="restore points kept per name (generations; default 2)")
    s.add_argument("--name", required=True, help="snapshot name (letters, digits, '_' or '-')")
    s.add_argument("--exclude", action="append", default=[], help="workspace-relative path to leave out (repeatable)")
    s.add_argument("--skip-unrestorable", action="store_true",
                   help="leave out entries a restore would refuse instead of failing")
    s.add_argument("--json", action="store_true", help="print a JSON report on stdout")
    _hostpath.add_flag(s)

    r = ss.add_parser("restore", help="replace a workspace's contents with a verified snapshot")
    r.add_argument("--workspace", required=True, help="workspace directory (its contents are replaced)")
    _store_flags(r, "snapshot store")
    r.add_argument("--name", required=True, help="snapshot name")
    r.add_argument("--generation", type=int_option(1, 1 << 62), default=None,
                   help="restore this generation (default: the newest that verifies)")
    r.add_argument("--json", action="store_true", help="print a JSON report on stdout")
    _hostpath.add_flag(r)

    ls = ss.add_parser("ls", help="list the valid snapshots in a store")
    _store_flags(ls, "snapshot store")
    ls.add_argument("--json", action="store_true", help="print a JSON report on stdout")
    _hostpath.add_flag(ls)

    gc = ss.add_parser("gc", help="remove orphaned objects and stale uploads from a store with generations")
    _store_flags(gc, "snapshot store")
    gc.add_argument("--older-than", type=float_option(MIN_GC_AGE_S, MAX_SECONDS, unit="s"), default=3600.0,
                    help="grace period in seconds, on the store's clock: younger orphans may be a persist or "
                         f"fork in progress (default 3600, at least {MIN_GC_AGE_S:.0f})")
    gc.add_argument("--json", action="store_true", help="print a JSON report on stdout")
    _hostpath.add_flag(gc)


_ACTIONS: dict[str, Callable[[argparse.Namespace], int]] = {"save": _save, "restore": _restore, "ls": _ls,
                                                           "gc": _gc}


def handle(args: argparse.Namespace) -> int:
    """Run ``sandbox-fs snapshot ACTION``; 0 when done (a refusal raises, see ``_errors``)."""
    return _ACTIONS[args.snapshot_command](args)
