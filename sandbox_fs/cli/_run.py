"""``sandbox-fs run``: the main job.

Create a session (or resume one from a state file), materialize the
manifest (or reattach / restore from the snapshot), run one command
confined to the workspace, print its output, persist a snapshot, write the
session state, clean up.  The command's exit status is passed through;
refusals are one line on stderr and exit 1 (see :mod:`sandbox_fs.cli`).

When the command ran but closing the session failed (a persist refused, for
example an entry a restore would refuse): the command's stdout and stderr
are printed all the same (in ``--json``, the report carries them and an
``error`` object), then the note naming the command's exit status, then the
error line; the exit status is 1, since the run's work was not saved.  The
state is still written when asked for: it names the last good snapshot, so a
``--resume`` reaches the workspace and its unsaved work.

The command's output goes to a terminal escaped (controls as ``\\xNN``,
lines kept, see :func:`sandbox_fs.cli._output.write_command_output`) and to
a pipe or file unchanged.

SIGTERM and SIGINT are handled alike: the command's tree gets SIGTERM,
``ConfinementPolicy.kill_grace_s`` seconds (2 s), then SIGKILL (a command
not started yet is not started); the session then stops as it normally
would (persist, state file), one line on stderr says so, and the exit status
is 128 + the signal number.  If ``run`` itself is killed (SIGKILL), the
command's init sees its lifeline close and ends the tree (see
:class:`sandbox_fs.exec.ProcessSupervisor`).

``--overlay`` serves the workspace through the FUSE overlay (extra
``sandbox-fs[fuse]``, see :mod:`sandbox_fs.fuse`): the command runs in a
private root on the mount, with ``--quota-bytes`` / ``--quota-inodes``
bounding what the workspace may hold and ``--audit FILE`` writing every
operation on the mount as JSON lines (``time_s``, ``op``, ``path``,
``result``, ``errno``; mode 0600; a special file at FILE is refused before
the command runs, never replaced).  Where the overlay cannot run,
``--confinement required`` (the Linux default) refuses the run before
anything is touched; ``best_effort`` runs without it and says so.

Authority comes only from the command line (the operator): ``--base``,
``--grant``, ``--root``, ``--workspaces-dir`` and ``--snapshot-dir``.  The
manifest is loaded as untrusted, and the state file carries no authority.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import sys
from dataclasses import dataclass, field
from typing import Any

import trio

from . import _hostpath
from ._args import int_option, seconds_option
from ._errors import CliInputError, exception_leaves, first_refusal
from ._hostpath import host_path, load_state, parse_grant, read_input
from ._output import escape_text, json_text, write_command_output
from ._store import STORE_HELP, add_endpoint_arg, client_store_options
from ..root import open_root


def _default_workspaces_dir() -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "sandbox-fs", "workspaces")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``sandbox-fs run``."""
    p.description = ("Create or resume a session, run CMD confined to its workspace, persist a snapshot, "
                     "write the session state.  Exit status: CMD's, or 1 on a refusal "
                     "(also when the persist after CMD fails: CMD's output is still printed first).")
    p.add_argument("--manifest", help="manifest JSON file (loaded as untrusted); required unless --resume")
    p.add_argument("--base", help="trusted base directory for the manifest's host sources")
    p.add_argument("--root", help="caller-owned workspace directory (created 0700 if missing; never deleted); "
                                  "default: a private workspace (a manifest's own root is never used)")
    p.add_argument("--workspaces-dir", default=None,
                   help="parent of private workspaces (default $XDG_STATE_HOME/sandbox-fs/workspaces)")
    p.add_argument("--grant", action="append", default=[], metavar="[NAME=]PATH[:ro|:rw]",
                   help="extra path grant for the manifest and the command (repeatable; default read-only)")
    p.add_argument("--store", "--snapshot-dir", dest="snapshot_dir", metavar="STORE",
                   help=STORE_HELP + " (--snapshot-dir DIR: the same); no snapshot without it")
    add_endpoint_arg(p)
    p.add_argument("--state", help="write the session state JSON here after the run")
    p.add_argument("--resume", metavar="FILE", help="resume the session recorded in this state file")
    p.add_argument("--allow-rollback", action="store_true",
                   help="with --resume: resume even when the store's snapshot is at another generation than the "
                        "state recorded (a stale or replayed state file, or a store rolled back)")
    p.add_argument("--timeout", type=seconds_option(), default=None, metavar="S",
                   help="command wall-clock limit, seconds (> 0, at most one year)")
    p.add_argument("--confinement", choices=("required", "best_effort", "none"),
                   default="required" if sys.platform.startswith("linux") else "best_effort",
                   help="Landlock confinement (default: required on Linux)")
    p.add_argument("--cwd", default="", help="working directory, a sandbox path relative to the workspace")
    p.add_argument("--max-output-bytes", type=int_option(), default=None,
                   help="bound on captured stdout/stderr each (0 to 2**63-1)")
    p.add_argument("--json", action="store_true", help="print a JSON report instead of the command's output")
    p.add_argument("--overlay", action="store_true",
                   help="serve the workspace through the FUSE overlay (quotas, audit, a private root for CMD); "
                        "refused where it cannot run unless --confinement best_effort")
    p.add_argument("--audit", metavar="FILE",
                   help="with --overlay: write the overlay's audit events here as JSON lines (mode 0600)")
    p.add_argument("--quota-bytes", type=int_option(), default=None, metavar="N",
                   help="with --overlay: most bytes the workspace's regular files may hold (0 to 2**63-1)")
    p.add_argument("--quota-inodes", type=int_option(), default=None, metavar="N",
                   help="with --overlay: most entries the workspace may hold (0 to 2**63-1)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME[:PORT]",
                   help="let the command reach this host (or *.domain pattern) through the egress proxy "
                        "(repeatable); a new session's manifest may narrow the list with network.allow_hosts, "
                        "never widen it")
    p.add_argument("--device", action="append", default=[], metavar="PATH",
                   help="grant CMD read, write and ioctl on this host device node (absolute path, no symlink on "
                        "it; a character or block device; repeatable)")
    p.add_argument("--device-family", action="append", default=[], metavar="NAME",
                   help="grant a driver family's control nodes and read-only /sys and /proc paths "
                        "(nvidia, dri, amd; see SECURITY.md \"Devices\"; repeatable)")
    p.add_argument("--protect", action="append", default=[], metavar="PATTERN",
                   help="keep this path (relative to the workspace and each read-write grant; globs allowed, "
                        "a trailing / for a directory) read-only to CMD, and uncreatable if missing (repeatable)")
    p.add_argument("--protect-defaults", action="store_true",
                   help="also protect the documented default set (.git/hooks/, .git/config, shell rc files, "
                        "editor task files; see SECURITY.md \"Protected paths\")")
    p.add_argument("--deny-read", action="append", default=[], metavar="PATTERN",
                   help="make this path (same syntax as --protect) unreadable to CMD (repeatable)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS",
                   help="the command to run inside the workspace")
    _hostpath.add_flag(p)


@dataclass
class _Run:
    """One ``sandbox-fs run``: what the command line asked for, and how it ended."""

    args: argparse.Namespace
    argv: list[str]  # the command to run confined
    manifest: Any  # a loaded Manifest, or None (resume from the state's copy)
    root: str | None  # the operator's --root, or None (a private workspace)
    options: Any  # ClientOptions
    exec_kw: dict[str, Any]  # keyword arguments of Session.exec
    grace_s: float  # SIGTERM to SIGKILL, seconds
    stopped: list[int] = field(default_factory=list)  # the signal that stopped the run, once one came
    running_at_signal: list[int] = field(default_factory=list)  # commands tracked when it came
    result: Any = None  # the ExecResult, once the command ran to its end
    report: dict[str, Any] = field(default_factory=dict)  # the --json report (without the output)
    failed: Exception | None = None  # a refusal after the command ran (printed after its output)
    persisted: bool = True  # closing the session (persist) succeeded
    audit: "_AuditSink | None" = None  # --audit: the events taken from the overlay
    overlay: bool = False  # the session ran with the overlay
    overlay_reason: str | None = None  # why it did not, when --overlay asked for it


_AUDIT_FOLLOW_S = 0.25  # how often the audit buffer is drained while the command runs, seconds
_AUDIT_MAX_EVENTS = 1_000_000  # most events kept for the file; more are counted as dropped


@dataclass
class _AuditSink:
    """The audit events of one run, drained from the overlay's bounded buffer while the command runs."""

    lines: list[bytes] = field(default_factory=list)
    dropped: int = 0

    async def drain(self, session: Any) -> None:
        """Take what the overlay buffered (OverlayError and the like propagate)."""
        events, dropped = await session.audit_events()
        self.dropped += dropped
        room = max(0, _AUDIT_MAX_EVENTS - len(self.lines))
        self.dropped += max(0, len(events) - room)
        for ev in events[:room]:
            self.lines.append(json.dumps({"time_s": ev.time_s, "op": ev.op, "path": ev.path, "result": ev.result,
                                          "errno": ev.errno}, ensure_ascii=True).encode() + b"\n")

    async def follow(self, session: Any) -> None:
        """Drain every _AUDIT_FOLLOW_S until cancelled; a failing drain ends it (the last drain reports)."""
        while True:
            await trio.sleep(_AUDIT_FOLLOW_S)
            try:
                await self.drain(session)
            except Exception:
                return


def _command(args: argparse.Namespace) -> list[str]:
    argv = list(args.cmd)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise CliInputError("no command given: sandbox-fs run ... -- CMD [ARGS...]", sandbox_path=None)
    if not args.manifest and not args.resume:
        raise CliInputError("give --manifest (a new session) or --resume FILE", sandbox_path=None)
    return argv


def _prepare(args: argparse.Namespace) -> _Run:
    """Check the command line, load the manifest, make --root: everything before the session starts."""
    from ..client import ClientOptions  # noqa: PLC0415
    from ..exec import DEFAULT_PROTECTED, ConfinementPolicy  # noqa: PLC0415
    from ..manifest import load_manifest  # noqa: PLC0415

    argv = _command(args)
    if not args.overlay:
        for flag, value in (("--audit", args.audit), ("--quota-bytes", args.quota_bytes),
                            ("--quota-inodes", args.quota_inodes)):
            if value is not None:
                raise CliInputError(f"{flag} needs --overlay", sandbox_path=None)
    # a state or audit file that could not be written is refused before the command runs
    _hostpath.check_output(args, args.state)
    _hostpath.check_output(args, args.audit, label="audit")
    manifest = None
    root = host_path(args, args.root)
    if args.manifest:
        raw = read_input(args, args.manifest, "manifest")
        manifest = load_manifest(raw, trust="untrusted")
        # The manifest's own "root" is never used here: where the workspace
        # lives is authority, and only the operator's --root (or a private
        # workspace under --workspaces-dir) decides it.
    if root is not None:
        # the operator's --root, made (0700) when missing by the host-path rule: no symlink on any component
        open_root(root, create=True).close()

    # the client makes (0700) and opens the workspaces and snapshot directories by the same rule
    options = ClientOptions(
        workspaces_dir=host_path(args, args.workspaces_dir or _default_workspaces_dir()),
        **client_store_options(args, args.snapshot_dir),
        extra_path_grants=tuple(parse_grant(g, args) for g in args.grant),
        base_dir=host_path(args, args.base),
        confinement=args.confinement,
        overlay=args.overlay,
        overlay_policy=_overlay_policy(args),
    )
    exec_kw: dict[str, Any] = {"timeout_s": args.timeout, "confinement": args.confinement, "cwd": args.cwd}
    if args.max_output_bytes is not None:
        exec_kw["max_output_bytes"] = args.max_output_bytes
    if manifest is not None and hasattr(manifest, "environment_values"):
        env, secret = _environment(manifest)
        if env:
            exec_kw["env"] = env
            exec_kw["secret_env"] = secret
    hosts = manifest.egress_hosts(args.allow_host) if manifest is not None else tuple(args.allow_host)
    if hosts:
        exec_kw["policy"] = ConfinementPolicy(allow_hosts=hosts)  # ExecError: a malformed entry
    if args.device or args.device_family:
        exec_kw["policy"] = dataclasses.replace(exec_kw.get("policy") or ConfinementPolicy(),
                                                devices=tuple(args.device), device_families=tuple(args.device_family))
    protected = (*(DEFAULT_PROTECTED if args.protect_defaults else ()), *args.protect)
    if protected or args.deny_read:  # InvalidArgumentError: a malformed pattern
        exec_kw["policy"] = dataclasses.replace(exec_kw.get("policy") or ConfinementPolicy(),
                                                protected=protected, deny_read=tuple(args.deny_read))
    # What the command is denied is reported (one stderr line, the --json list)
    # wherever the kernel can tell: Landlock ABI 7 logging with audit enabled.
    exec_kw["policy"] = dataclasses.replace(exec_kw.get("policy") or ConfinementPolicy(), report_violations=True)
    run = _Run(args, argv, manifest, root, options, exec_kw, ConfinementPolicy().kill_grace_s)
    run.audit = _AuditSink() if args.audit else None
    return run


def _overlay_policy(args: argparse.Namespace) -> Any:
    """The OverlayPolicy --quota-bytes / --quota-inodes ask for (None: the overlay's defaults)."""
    if not args.overlay or (args.quota_bytes is None and args.quota_inodes is None):
        return None
    from ..fuse import OverlayPolicy  # noqa: PLC0415

    return OverlayPolicy(max_bytes=args.quota_bytes, max_inodes=args.quota_inodes)


async def _exec(run: _Run, session: Any) -> Any:
    """``session.exec`` of the command; with --audit, the audit buffer is drained while it runs."""
    sink = run.audit
    if sink is None or not session.overlay_active:
        return await session.exec(run.argv, **run.exec_kw)
    result: Any = None
    failure: Exception | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sink.follow, session)
        try:
            result = await session.exec(run.argv, **run.exec_kw)
        except Exception as exc:  # re-raised bare below (not in an ExceptionGroup)
            failure = exc
        finally:
            nursery.cancel_scope.cancel()
    if failure is not None:
        raise failure
    return result


def _write_audit(run: _Run) -> None:
    """Write the --audit file: the events, one JSON object a line (empty when the overlay did not run)."""
    from ..root import write_host_file_atomic  # noqa: PLC0415

    assert run.audit is not None and run.args.audit is not None
    write_host_file_atomic(host_path(run.args, run.args.audit), b"".join(run.audit.lines), mode=0o600,
                           label="audit")


async def _in_session(run: _Run, sup: Any, exec_scope: trio.CancelScope) -> None:
    """Start (or resume) the session, run the command, close it, write the state; fill ``run``."""
    from ..client import LocalSandboxClient  # noqa: PLC0415

    args = run.args
    # a resume reads existing state: a missing store or key is refused, never made
    with LocalSandboxClient(run.options, create=not args.resume) as client:
        if args.resume:
            session = client.resume(load_state(args, args.resume), root=run.root, manifest=run.manifest,
                                    allow_rollback=args.allow_rollback)
        else:
            session = client.create(manifest=run.manifest, root=run.root)
        session.attach_supervisor(sup)
        try:
            async with session:
                run.overlay, run.overlay_reason = session.overlay_active, session.overlay_unavailable_reason
                with exec_scope:  # cancelled only when a signal stops the run
                    run.result = await _exec(run, session)
                if run.audit is not None and session.overlay_active:
                    await run.audit.drain(session)
        except Exception as exc:
            if run.result is None and not run.stopped:
                raise  # the command did not run to the end: nothing of it to print
            run.failed, run.persisted = exc, False  # it ran: print its output first, then refuse
        state: dict[str, Any] = {}
        try:
            state = client.serialize_state(session)
            if args.state:
                _hostpath.write_json(args, args.state, state)
        except Exception as exc:
            run.failed = run.failed or exc
        if run.audit is not None:
            try:
                _write_audit(run)
            except Exception as exc:
                run.failed = run.failed or exc
        result = run.result
        ran = result is not None
        run.report = {
            "session_id": session.id,
            "start_mode": session.start_mode,
            "snapshot": state.get("snapshot"),
            "exit_code": result.exit_code if ran else None,
            "confinement": result.confinement if ran else None,
            "landlock_abi": result.landlock_abi if ran else 0,
            "process_bounds": list(result.process_bounds) if ran else [],
            "duration_s": round(result.duration_s, 3) if ran else 0.0,
            "stdout_truncated": result.stdout_truncated if ran else False,
            "stderr_truncated": result.stderr_truncated if ran else False,
        }
        if args.overlay:
            run.report["overlay"] = run.overlay
            run.report["overlay_reason"] = run.overlay_reason
        if run.audit is not None:
            run.report["audit"] = {"events": len(run.audit.lines), "dropped": run.audit.dropped}
        if args.allow_host or run.exec_kw["policy"].allow_hosts:
            run.report["egress"] = [{"host": e.host, "port": e.port, "allowed": e.allowed, "reason": e.reason,
                                     "bytes_up": e.bytes_up, "bytes_down": e.bytes_down}
                                    for e in (result.egress if ran else ())]
            run.report["egress_dropped"] = result.egress_dropped if ran else 0
        run.report["violations"] = [v.to_json() for v in (result.violations if ran else ())]
        run.report["violations_dropped"] = result.violations_dropped if ran else 0
        run.report["violations_observed"] = result.violations_observed if ran else False


async def _supervised(run: _Run) -> None:
    """:func:`_in_session` under a supervisor, with SIGTERM and SIGINT stopping the command."""
    from ..exec import ConfinementError, ProcessSupervisor  # noqa: PLC0415

    sup = ProcessSupervisor()
    exec_scope = trio.CancelScope()
    error: Exception | None = None
    try:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                async def stop_command() -> None:
                    # SIGTERM, grace, SIGKILL for what runs; then give the
                    # exec a moment to return its result, and cancel it
                    # (a command not started yet never starts).
                    # A kill that cannot prove the tree gone raises again at the session's
                    # shutdown (it is sticky), which then refuses to persist: not here.
                    with contextlib.suppress(ConfinementError):
                        await sup.kill_all(grace_s=run.grace_s)
                    exec_scope.deadline = min(exec_scope.deadline, trio.current_time() + run.grace_s)
                    with contextlib.suppress(ConfinementError):
                        await sup.kill_all()

                async def watch() -> None:
                    async for signum in signals:
                        if not run.stopped:
                            run.stopped.append(signum)
                            run.running_at_signal.append(len(sup))
                            nursery.start_soon(stop_command)

                nursery.start_soon(watch)
                try:
                    await _in_session(run, sup, exec_scope)
                except Exception as exc:  # re-raised bare below (not in an ExceptionGroup)
                    error = exc
                finally:
                    nursery.cancel_scope.cancel()
        if error is not None:
            raise error
    finally:
        # the session's shutdown already met (and reported) a tree that outlived the kill
        with trio.CancelScope(shield=True), contextlib.suppress(ConfinementError):
            await sup.aclose()


def _print_outcome(run: _Run) -> None:
    """The command's output and the notes on stderr (or the --json report) of a finished run."""
    args, result, report = run.args, run.result, run.report
    if args.json:
        report["stdout"] = result.stdout.decode("utf-8", "replace") if result is not None else ""
        report["stderr"] = result.stderr.decode("utf-8", "replace") if result is not None else ""
        if run.failed is not None:
            report["error"] = _error_dict(run.failed)
        if run.stopped:
            report["stopped_by_signal"] = run.stopped[0]
        print(json_text(report))
    elif result is not None:
        write_command_output(result.stdout, sys.stdout)
        write_command_output(result.stderr, sys.stderr)
        snap = report["snapshot"]
        print(f"sandbox-fs: session {escape_text(str(report['session_id']))} "
              f"({escape_text(str(report['start_mode']))}); command exited "
              f"{result.exit_code} under {escape_text(str(result.confinement))}"
              f"{' (Landlock ABI %d)' % result.landlock_abi if result.landlock_abi else ''}"
              f"{'; snapshot ' + escape_text(str(snap)) if snap else ''}"
              f"{'' if run.persisted else '; closing the session failed, nothing new persisted'}",
              file=sys.stderr)
        if args.overlay:
            print(_overlay_note(run), file=sys.stderr)
        from ..exec import violation_summary  # noqa: PLC0415

        denials = violation_summary(result.violations, result.violations_dropped, escape=escape_text)
        if denials:
            print(f"sandbox-fs: {denials}", file=sys.stderr)
    sys.stdout.flush()
    if run.stopped:
        name = signal.Signals(run.stopped[0]).name
        ended = ("was not started" if result is None and not run.running_at_signal[0]
                 else f"was stopped (SIGTERM, then SIGKILL after {run.grace_s:g} s)")
        snap = report["snapshot"]
        print(f"sandbox-fs: {name} received: the command {ended}; session "
              f"{escape_text(str(report['session_id']))} stopped"
              f"{' with snapshot ' + escape_text(str(snap)) if snap and run.persisted else ''}"
              f"{' and its state written' if args.state and run.failed is None else ''}", file=sys.stderr)


def handle(args: argparse.Namespace) -> int:
    """Run ``sandbox-fs run``: the command's exit status (128 + N after signal N).

    Raises:
        SandboxError: a refusal (before the command, or when closing the session after it).
    """
    run = _prepare(args)
    trio.run(_supervised, run)
    _print_outcome(run)
    if run.failed is not None:
        raise run.failed  # sandbox_fs.cli prints the one error line, exit 1
    if run.stopped:
        return 128 + run.stopped[0]
    code = run.result.exit_code
    return code if 0 <= code <= 255 else 128 + (-code if code < 0 else 0)


def _overlay_note(run: _Run) -> str:
    """The stderr line on the overlay of a ``run --overlay`` (and its audit file)."""
    if not run.overlay:
        return (f"sandbox-fs: overlay: off, the command ran without it "
                f"({escape_text(str(run.overlay_reason))}; --confinement {run.args.confinement})"
                f"{'; the audit file is empty' if run.audit is not None else ''}")
    audit = ""
    if run.audit is not None:
        audit = f"; {len(run.audit.lines)} audit events written"
        if run.audit.dropped:
            audit += f", {run.audit.dropped} dropped (the overlay's audit buffer was full)"
    return f"sandbox-fs: overlay: on{audit}"


def _error_dict(exc: BaseException) -> dict[str, Any]:
    """The JSON view of a close failure: a SandboxError's to_dict, else its code only."""
    from ..errors import SandboxError  # noqa: PLC0415

    refusal = first_refusal(exc)
    if isinstance(refusal, SandboxError):
        return refusal.to_dict()
    leaf = exception_leaves(exc)[0]
    return {"code": "os_error" if isinstance(leaf, OSError) else "internal", "reason": type(leaf).__name__}


def _environment(manifest: Any) -> tuple[dict[str, str], set[str]]:
    """The manifest's environment as (values, names of secret values)."""
    values = manifest.environment_values()
    secret: set[str] = set()
    for name, value in (getattr(manifest, "environment", None) or {}).items():
        if getattr(value, "secret", False):
            secret.add(name)
    return dict(values), secret
