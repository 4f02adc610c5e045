"""``sandbox-fs session create|resume|fork|rm``: sessions with their state kept in JSON files.

Each command is one-shot: it starts the session (materialize, reattach or
restore), closes it (which persists a snapshot when a store is given) and
writes the serialized state.  The workspace stays in place for the next
``resume`` until ``rm``.  The state file carries no authority: the
workspaces directory, the store and the grants are given on the command
line every time.

``fork`` writes the state of a new session seeded from the source state's
snapshot (shared with it in a store with generations, copied in a plain
version-1 directory store: see :meth:`LocalSandboxClient.fork`); its
workspace is built by the first ``resume`` of that state.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

import trio

from . import _hostpath
from ._errors import CliInputError
from ._hostpath import host_path, load_state, parse_grant, read_input
from ._output import print_report, progress_printer
from ._store import STORE_HELP, add_endpoint_arg, client_store_options


def add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workspaces-dir", required=True,
                   help="trusted host directory holding private workspaces (created 0700)")
    p.add_argument("--store", help=STORE_HELP + "; no snapshots without it")
    add_endpoint_arg(p)
    p.add_argument("--grant", action="append", default=[], metavar="[NAME=]PATH[:ro|:rw]",
                   help="extra path grant (repeatable; default read-only)")
    p.add_argument("--base-dir", help="trusted base directory for manifest host sources")
    p.add_argument("--state-key-file", help="file holding the HMAC key (>= 16 bytes) protecting state files")
    p.add_argument("--skip-unrestorable", action="store_true",
                   help="leave out entries a restore would refuse instead of failing the persist")
    p.add_argument("--json", action="store_true", help="print a JSON report on stdout")
    _hostpath.add_flag(p)


def client_options(args: argparse.Namespace) -> Any:
    from ..client import ClientOptions  # noqa: PLC0415

    key = None
    if args.state_key_file:
        key = read_input(args, args.state_key_file, "state key", 4096).strip()
        if len(key) < 16:
            raise CliInputError("the state key must be at least 16 bytes", sandbox_path=None)
    return ClientOptions(
        workspaces_dir=host_path(args, args.workspaces_dir),
        **client_store_options(args, args.store),
        extra_path_grants=tuple(parse_grant(g, args) for g in args.grant),
        base_dir=host_path(args, args.base_dir),
        state_key=key,
        on_unrestorable="skip" if args.skip_unrestorable else "refuse",
    )


def _load_manifest(path: str | None, args: argparse.Namespace | None = None) -> Any:
    if not path:
        return None
    from ..manifest import load_manifest  # noqa: PLC0415

    return load_manifest(read_input(args, path, "manifest"), trust="untrusted")


async def _close_with_progress(session: Any) -> None:
    show = progress_printer()
    if show is not None:
        print("persisting...", end="", file=sys.stderr, flush=True)
    try:
        await session.aclose()
    finally:
        if show is not None:
            print("\r" + " " * 60 + "\r", end="", file=sys.stderr, flush=True)


def _summary(session: Any, action: str) -> dict[str, Any]:
    rep = session.last_persist
    return {
        "action": action,
        "session_id": session.id,
        "start_mode": session.start_mode,
        "snapshot": session.snapshot_name if rep is not None and rep.info is not None else None,
        "fingerprint": session.fingerprint,
        "skipped": [{"path": p, "reason": r} for p, r in (rep.skipped if rep else [])] or None,
    }


def _create(args: argparse.Namespace) -> int:
    from ..client import LocalSandboxClient  # noqa: PLC0415

    _hostpath.check_output(args, args.state)

    async def main() -> dict[str, Any]:
        with LocalSandboxClient(client_options(args)) as client:
            session = client.create(manifest=_load_manifest(args.manifest, args), snapshot=args.snapshot,
                                    root=host_path(args, args.root),
                                    session_id=args.session_id)
            await session.start()
            await _close_with_progress(session)
            _hostpath.write_json(args, args.state, client.serialize_state(session))
            return _summary(session, "create")

    print_report(args, trio.run(main))
    return 0


def _resume(args: argparse.Namespace) -> int:
    from ..client import LocalSandboxClient  # noqa: PLC0415

    _hostpath.check_output(args, args.state_out or args.state)

    async def main() -> dict[str, Any]:
        with LocalSandboxClient(client_options(args), create=False) as client:
            session = client.resume(load_state(args, args.state), root=host_path(args, args.root),
                                    manifest=_load_manifest(args.manifest, args), allow_rollback=args.allow_rollback)
            await session.start()
            await _close_with_progress(session)
            _hostpath.write_json(args, args.state_out or args.state, client.serialize_state(session))
            return _summary(session, "resume")

    print_report(args, trio.run(main))
    return 0


def _fork(args: argparse.Namespace) -> int:
    from ..client import LocalSandboxClient  # noqa: PLC0415

    if args.store is None:
        raise CliInputError("session fork needs --store: the store the source session persisted its snapshot to",
                            sandbox_path=None)
    _hostpath.check_output(args, args.state_out)

    async def main() -> dict[str, Any]:
        with LocalSandboxClient(client_options(args), create=False) as client:
            source = client.deserialize_state(load_state(args, args.state))
            state = await client.fork(source, session_id=args.session_id)
            _hostpath.write_json(args, args.state_out, state)
            return {"action": "fork", "session_id": state["session_id"], "source_session_id": source.session_id,
                    "snapshot": state["snapshot"], "generation": state["generation"]}

    print_report(args, trio.run(main))
    return 0


def _rm(args: argparse.Namespace) -> int:
    from ..client import LocalSandboxClient  # noqa: PLC0415

    async def main() -> dict[str, Any]:
        with LocalSandboxClient(client_options(args), create=False) as client:
            session = client.resume(load_state(args, args.state))
            removed = await client.delete(session, snapshot=args.snapshot)
            return {"action": "rm", "session_id": session.id, "workspace_removed": removed,
                    "snapshot_removed": bool(args.snapshot)}

    print_report(args, trio.run(main))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``sandbox-fs session ACTION``."""
    ss = p.add_subparsers(dest="session_command", metavar="ACTION")
    ss.required = True

    c = ss.add_parser("create", help="create a session, fill it, persist it, write its state")
    add_client_args(c)
    c.add_argument("--manifest", help="manifest JSON file (loaded as untrusted)")
    c.add_argument("--snapshot", help="seed the workspace from this snapshot name")
    c.add_argument("--root", help="use this caller-owned directory as the workspace (never deleted)")
    c.add_argument("--session-id", help="plain token to use as the session id (default random)")
    c.add_argument("--state", required=True, help="where to write the session state JSON")

    r = ss.add_parser("resume", help="reattach to (or rebuild) a session from its state, persist, update the state")
    add_client_args(r)
    r.add_argument("--state", required=True, help="session state JSON file")
    r.add_argument("--state-out", help="write the updated state here (default: --state)")
    r.add_argument("--root", help="the caller-owned workspace directory, if it was one")
    r.add_argument("--manifest", help="manifest JSON file replacing the state's copy (untrusted)")
    r.add_argument("--allow-rollback", action="store_true",
                   help="resume even when the store's snapshot is at another generation than the state recorded "
                        "(a stale or replayed state file, or a store rolled back)")

    f = ss.add_parser("fork", help="write the state of a new session seeded from a stopped session's snapshot "
                                   "(shared in a store with generations, copied in a plain directory store)")
    add_client_args(f)
    f.add_argument("--state", required=True, help="the source session's state JSON file")
    f.add_argument("--state-out", required=True, help="where to write the new session's state JSON")
    f.add_argument("--session-id", help="plain token to use as the new session id (default random)")

    d = ss.add_parser("rm", help="remove the session's private workspace (never a caller-owned one)")
    add_client_args(d)
    d.add_argument("--state", required=True, help="session state JSON file")
    d.add_argument("--snapshot", action="store_true", help="also remove the session's snapshot")


_ACTIONS: dict[str, Callable[[argparse.Namespace], int]] = {"create": _create, "resume": _resume, "fork": _fork,
                                                           "rm": _rm}


def handle(args: argparse.Namespace) -> int:
    """Run ``sandbox-fs session ACTION``; 0 when done (a refusal raises, see ``_errors``)."""
    return _ACTIONS[args.session_command](args)
