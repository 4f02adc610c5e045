"""Starting a prepared run: :func:`run_confined`, the helper's spawn, output and timeout."""

from __future__ import annotations

import dataclasses
import math
import signal
import subprocess
import time
from typing import AsyncIterable, Iterable, Mapping, Sequence

import trio

from ..errors import redact
from ..paths import PathPolicy
from ..root import Root
from ._cgroups import CgroupTree
from ._egress import EgressChannel
from ._errors import ExecFailedError, ExecTimeoutError
from ._helper import _HELPER_ENV, _STATUS_TIMEOUT_S, _Status, _status_error
from ._models import Confinement, ConfinementPolicy, ExecRequest, ExecResult, PrivateRoot
from ._output import _CHUNK, DEFAULT_MAX_OUTPUT_BYTES, _HeadTail
from ._prepare import Prepared, prepare_run
from ._supervisor import ProcessSupervisor, _ForeignChild, _Tracked
from ._violations import AuditWatch, add_proxy_refusals


async def _spawn(prep: Prepared, supervisor: ProcessSupervisor, argv0: str, *, stdin: object,
                 stdout: object, stderr: object) -> tuple[trio.Process, _Tracked, _Status]:
    """Start the helper and track the command's init; return (helper process, tracked init, status).

    The helper forks the init as our direct child ("pid N MODE" on the
    status pipe) and exits; the init forks the command.  The streams are
    always the helper's.  The caller reads the command's start
    (:meth:`_Status.startup`) alongside the output, so the spawn costs no
    extra round trip, and raises :func:`_status_error` when it is not empty.
    """
    try:
        proc = await trio.lowlevel.open_process(
            prep.helper_argv, stdin=stdin, stdout=stdout, stderr=stderr, env=_HELPER_ENV,
            pass_fds=tuple(prep.pass_fds), close_fds=True)
    except BaseException:
        prep.close_all()
        if prep.leaf is not None:
            CgroupTree.remove(prep.leaf)
        raise
    prep.close_child_fds()
    status = _Status(prep.status_r)
    prep.status_r = -1
    # Shielded: until the first status line is read we may not know the
    # init's pid, and an unknown child could never be reaped.
    with trio.CancelScope(shield=True):
        with trio.move_on_after(_STATUS_TIMEOUT_S):
            first = await status.read_line()
        target: trio.Process | _ForeignChild = proc
        if first is not None and first.startswith(b"pid "):
            words = first.split()
            target = _ForeignChild(int(words[1]), words[2:3] == [b"ns"], status)
            first = None
        tracked = supervisor._track(target, prep.leaf, argv0, pids_leaf=prep.pids_leaf)
        if first is not None:  # the helper failed before forking / exec
            await _abort_spawn(proc, tracked, supervisor, status)
            raise _status_error(first, argv0, prep)
    return proc, tracked, status


async def _abort_spawn(proc: trio.Process, tracked: _Tracked, supervisor: ProcessSupervisor,
                       status: _Status) -> None:
    with trio.CancelScope(shield=True):
        await supervisor._kill_one(tracked, 0)
        await proc.wait()
        await status.aclose()
        for s in (proc.stdin, proc.stdout, proc.stderr):
            if s is not None:
                await s.aclose()


async def run_confined(
    argv: Sequence[str],
    *,
    workspace: Root,
    workspace_host_path: str,
    grants: Sequence[tuple[Root, bool]] | PathPolicy | None = None,
    cwd: str = "",
    env: Mapping[str, str] | None = None,
    secret_env: Iterable[str] = frozenset(),
    stdin: bytes | AsyncIterable[bytes] | None = None,
    shell: bool | Sequence[str] = False,
    timeout_s: float | None = None,
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
    confinement: Confinement = "required",
    supervisor: ProcessSupervisor | None = None,
    policy: ConfinementPolicy = ConfinementPolicy(),
    check: bool = False,
    private_root: PrivateRoot | None = None,
) -> ExecResult:
    """Run a command confined to the workspace and return its result.

    Args:
        argv: program and arguments (``list[str]``); ``argv[0]`` is looked
            up on the child's ``PATH`` and must be executable inside the sandbox.
        workspace: the workspace Root; the child gets read-write access
            beneath it (read-only when the Root is read-only).
        workspace_host_path: the workspace's host path (trusted, from the
            application); used only for ``HOME``/``TMPDIR`` in the child's
            environment, never for I/O.
        grants: extra path grants ``[(Root, read_only), ...]`` or a
            :class:`PathPolicy`; each reaches the child by its mode.
        cwd: working directory as a sandbox path relative to the workspace
            (absolute under a grant or the workspace when ``grants`` is a
            PathPolicy); opened through the Root, handed over as an fd.
        env: environment entries added over the allow-list (see
            :func:`build_env`); the application is trusted with any name.
            Handed to the helper through a memfd, applied at the command's
            ``execve`` only.
        secret_env: names in ``env`` whose values are secrets: they never
            appear in error messages or reprs.
        stdin: bytes, an async iterable of byte chunks, or None (``/dev/null``).
        shell: False (run ``argv``), True (``/bin/sh -c``) or a custom prefix
            such as ``["bash", "-lc"]``; a multi-element ``argv`` is joined with
            :func:`shlex.join`.
        timeout_s: wall-clock seconds (finite, > 0) before SIGTERM to the
            command's tree, ``policy.kill_grace_s`` of grace, then SIGKILL
            (None: no limit).
        max_output_bytes: bytes kept per stream (head half and tail half);
            memory does not grow with what the child prints.
        confinement: ``"required"`` fails closed without Landlock;
            ``"best_effort"`` runs anyway and reports the level in
            :attr:`ExecResult.confinement`; ``"none"`` skips Landlock (the
            helper still applies rlimits, setsid, fd closing, capabilities).
        supervisor: tracks the command's init; background processes the
            command leaves end with it (its PID namespace).  Without one, a
            private supervisor is made and closed before this returns.
        policy: rlimits, network ports, namespaces, grace periods.
        check: raise :class:`ExecFailedError` on a non-zero exit status.
        private_root: run the command in a root of its own built around the
            workspace overlay (:class:`PrivateRoot`; root hosts only): it
            sees the overlay at ``private_root.workspace_path``, the system
            set, a private ``/tmp``, a minimal ``/dev``, its own ``/proc`` and
            the grants at their host paths, nothing else of the host.  A
            ``cwd`` beneath the workspace is entered there.  Reported in
            :attr:`ExecResult.overlay`.

    Returns:
        :class:`ExecResult`; a non-zero exit is a result, not an exception.

    Raises:
        ConfinementError: ``confinement="required"`` and Landlock is
            unavailable, or no process-count bound can be enforced, or a
            confinement step fails (fails closed: building the private root
            included); ``private_root`` on a non-root host; on a root host, no
            identity can be leased, the workspace cannot be re-owned, or a
            read-write grant is not owned by the identity.
        CommandNotFoundError: the program does not exist or may not be
            executed inside the sandbox.
        ExecTimeoutError: ``timeout_s`` passed; ``.result`` has the partial output.
        ExecFailedError: ``check`` and the exit status is non-zero.
        InvalidEnvError: a malformed ``env`` entry, or an environment over
            :data:`MAX_ENV_BYTES` bytes or :data:`MAX_ENV_ENTRIES` entries.
        ExecError: bad ``argv``/``shell``/``confinement`` values, a
            ``timeout_s`` that is not a finite number of seconds > 0, a
            malformed ``policy.identity``, a ``private_root`` that is not a
            :class:`PrivateRoot`, or the cwd cannot be entered.
        PathEscapeError, FileNotFoundError, NotADirectoryError: ``cwd`` does
            not resolve to a directory beneath the workspace.

    *Cancellation*: a cancel kills the command's whole tree (and cgroup leaf)
    with SIGKILL and reaps it before propagating; nothing keeps running and
    no fd is left open.
    """
    await trio.lowlevel.checkpoint()
    request = ExecRequest.build(argv, workspace=workspace, workspace_host_path=workspace_host_path, grants=grants,
                                cwd=cwd, env=env, secret_env=secret_env, shell=shell, confinement=confinement,
                                policy=policy, stdin=stdin, timeout_s=timeout_s,
                                max_output_bytes=max_output_bytes, check=check, private_root=private_root)
    own = supervisor is None
    sup = supervisor if supervisor is not None else ProcessSupervisor(use_cgroup=policy.use_cgroup,
                                                                     pids_max=policy.pids_max,
                                                                     hold_mount_ns=False)
    try:
        return await _run(request, sup)
    finally:
        if own:
            with trio.CancelScope(shield=True):
                await sup.aclose()


async def _run(request: ExecRequest, supervisor: ProcessSupervisor) -> ExecResult:
    """Prepare, spawn, feed and read the command, end it at the deadline; the result or its error."""
    prep = await prepare_run(request, supervisor)
    start = time.monotonic()
    try:
        proc, tracked, status = await _spawn(
            prep, supervisor, request.argv0,
            stdin=subprocess.PIPE if request.stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except BaseException:
        prep.release_guards()
        if prep.violations is not None:
            prep.violations.close()
        raise
    capture = _Capture(request.max_output_bytes)
    watch = prep.violations
    try:
        try:
            timed_out = await _wait_and_read(request, supervisor, proc, tracked, status, capture, prep.egress, watch)
        finally:
            await _end_run(supervisor, proc, tracked, status, capture)
            if prep.egress is not None:
                prep.egress.close()
            prep.release_guards()  # the command's tree is gone: placeholders come out
        if watch is not None and not capture.failure:
            await watch.finish()  # the tree is gone: every denial it made is queued
    finally:
        if watch is not None:
            watch.close()
    if capture.failure:
        raise _status_error(capture.failure, request.argv0, prep)
    target = tracked.process
    out, err = capture.out, capture.err
    result = ExecResult(
        exit_code=target.returncode if target.returncode is not None else -signal.SIGKILL,
        stdout=out.value(), stderr=err.value(),
        stdout_truncated=out.truncated, stderr_truncated=err.truncated,
        duration_s=time.monotonic() - start, confinement=prep.level, landlock_abi=prep.abi,
        read_only_mounts=prep.ro_mounts, network_isolated=prep.net_isolated,
        stdout_bytes=out.total, stderr_bytes=err.total, process_bounds=prep.process_bounds,
        missing=prep.missing,
        identity=prep.identity, overlay=prep.overlay,
        violations=watch.log.violations if watch is not None else (),
        violations_dropped=watch.log.dropped if watch is not None else 0, violations_observed=watch is not None)
    if prep.egress is not None:
        egress, dropped = prep.egress.events()
        result = dataclasses.replace(result, egress=egress, egress_dropped=dropped)
        # The proxy's refusals are violations too (after the kernel's, bounded together).
        violations, v_dropped = add_proxy_refusals(result.violations, result.violations_dropped, egress,
                                                   request.policy.max_violations)
        result = dataclasses.replace(result, violations=violations, violations_dropped=v_dropped)
    _raise_if_timed_out_or_failed(request, prep, result, timed_out)
    return result


class _Capture:
    """What the run's reader tasks collect: bounded stdout/stderr, and the command's start status."""

    def __init__(self, max_output_bytes: int) -> None:
        self.out, self.err = _HeadTail(max_output_bytes), _HeadTail(max_output_bytes)
        self.out_eof, self.err_eof = trio.Event(), trio.Event()
        self.failure = b""  # the helper's failure line, b"" once the command reached execve
        self.started = False  # the start status was read

    async def pump(self, stream: trio.abc.ReceiveStream, buf: _HeadTail, done: trio.Event) -> None:
        try:
            while True:
                try:
                    data = await stream.receive_some(_CHUNK)
                except trio.BrokenResourceError:
                    break
                if not data:
                    break
                buf.append(data)
        finally:
            done.set()

    async def read_status(self, status: _Status) -> None:
        self.failure = await status.startup()
        self.started = True


async def _feed(stream: trio.abc.SendStream, stdin: bytes | AsyncIterable[bytes]) -> None:
    """Write ``stdin`` to the command, then close its input (a closed pipe ends the feed quietly)."""
    try:
        if isinstance(stdin, (bytes, bytearray, memoryview)):
            if stdin:
                await stream.send_all(bytes(stdin))
        else:
            async for chunk in stdin:
                await stream.send_all(bytes(chunk))
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()


async def _wait_and_read(request: ExecRequest, supervisor: ProcessSupervisor, proc: trio.Process,
                         tracked: _Tracked, status: _Status, capture: _Capture,
                         egress: EgressChannel | None = None, watch: AuditWatch | None = None) -> bool:
    """Read the output until the command exits (or its deadline ends it); True when it timed out.

    ``egress``: the run's proxy, served alongside until the output is read;
    ``watch``: the run's audit watch, read alongside (see :meth:`AuditWatch.pump`).
    """
    timed_out = False
    async with trio.open_nursery() as nursery:
        if egress is not None:
            nursery.start_soon(egress.run)
        nursery.start_soon(capture.read_status, status)
        nursery.start_soon(capture.pump, proc.stdout, capture.out, capture.out_eof)
        nursery.start_soon(capture.pump, proc.stderr, capture.err, capture.err_eof)
        if proc.stdin is not None:
            nursery.start_soon(_feed, proc.stdin, request.stdin)
        if watch is not None:
            nursery.start_soon(watch.pump)
        deadline = trio.current_time() + request.timeout_s if request.timeout_s is not None else math.inf
        with trio.move_on_at(deadline) as cs:
            await tracked.process.wait()
        if cs.cancelled_caught:
            timed_out = True
            await supervisor._kill_one(tracked, request.policy.kill_grace_s)
        with trio.move_on_after(request.policy.eof_grace_s):
            await capture.out_eof.wait()
            await capture.err_eof.wait()
        nursery.cancel_scope.cancel()
    return timed_out


async def _end_run(supervisor: ProcessSupervisor, proc: trio.Process, tracked: _Tracked, status: _Status,
                   capture: _Capture) -> None:
    """Shielded: the tree killed if still running, the helper reaped, the start status read, streams closed."""
    target = tracked.process
    with trio.CancelScope(shield=True):
        if target.returncode is None:
            await supervisor._kill_one(tracked, 0)
        if target is not proc:
            await proc.wait()  # the helper exited right after forking the target
        if not capture.started:
            with trio.move_on_after(1.0):
                capture.failure = await status.startup()
        await status.aclose()
        for s in (proc.stdin, proc.stdout, proc.stderr):
            if s is not None:
                await s.aclose()
        supervisor._release_if_done(tracked)


def _raise_if_timed_out_or_failed(request: ExecRequest, prep: Prepared, result: ExecResult,
                                  timed_out: bool) -> None:
    """Raises:
        ExecTimeoutError: the run timed out.
        ExecFailedError: ``check`` and a non-zero exit status.
    """
    shown = redact(request.argv0, prep.secrets)
    if timed_out:
        raise ExecTimeoutError(f"{shown} ran past {request.timeout_s} s; its process tree was killed",
                               result=result, sandbox_path=prep.cwd_shown,
                               context={"timeout_s": request.timeout_s}, secrets=prep.secrets)
    if request.check and result.exit_code != 0:
        raise ExecFailedError(f"{shown} exited with status {result.exit_code}", result=result,
                              sandbox_path=prep.cwd_shown, context={"exit_code": result.exit_code},
                              secrets=prep.secrets)
