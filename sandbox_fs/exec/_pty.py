"""Interactive confined processes on pseudo-terminals: :class:`PtyManager`."""

from __future__ import annotations

import fcntl
import itertools
import os
import signal
import struct
import termios
import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import trio

from ..paths import PathPolicy
from ..root import Root
from ._errors import ExecError, PtyNotFoundError
from ._helper import _STATUS_TIMEOUT_S, _status_error
from ._models import Confinement, ConfinementPolicy, ExecRequest, PrivateRoot
from ._output import _CHUNK, DEFAULT_MAX_OUTPUT_BYTES
from ._prepare import Prepared, prepare_run
from ._protected import GuardPlan
from ._spawn import _abort_spawn, _spawn
from ._supervisor import ProcessSupervisor, _Tracked


@dataclass(eq=False)
class _Pty:
    pty_id: str
    tracked: _Tracked
    stream: trio.lowlevel.FdStream
    started: float
    last_activity: float
    pending: bytearray = field(default_factory=bytearray)
    dropped_bytes: int = 0
    eof: bool = False
    lock: trio.Lock = field(default_factory=trio.Lock)
    guards: GuardPlan | None = None     # protected paths' placeholders, released at the end


class PtyManager:
    """Interactive confined processes on pseudo-terminals, with bounded buffers and a live cap.

    Each session runs through the same confinement path as
    :func:`run_confined` (the helper makes the PTY its controlling terminal
    with ``setsid`` + ``TIOCSCTTY``).  Output is read on demand: the kernel's
    PTY buffer applies back-pressure to the child, and at most
    ``max_buffer_bytes`` read but not yet returned is kept (oldest bytes
    dropped first, counted in :meth:`pty_info`).

    Cap: at most ``max_live`` sessions exist at once.  Starting one more
    prunes (terminates and forgets) the session idle the longest, where
    *idle* means no start, write or read: sessions whose process has already
    exited go first.

    Args:
        supervisor: tracks the PTY processes (killed by its ``kill_all`` too).
        max_live: the cap on sessions (>= 1).
        max_buffer_bytes: bound on buffered unread output per session.

    Raises:
        ValueError: ``max_live`` < 1.
    """

    _ids = itertools.count(1)

    def __init__(self, supervisor: ProcessSupervisor, *, max_live: int = 8,
                 max_buffer_bytes: int = DEFAULT_MAX_OUTPUT_BYTES) -> None:
        if max_live < 1:
            raise ValueError("max_live must be >= 1")
        self.supervisor = supervisor
        self.max_live = max_live
        self.max_buffer_bytes = max_buffer_bytes
        self._ptys: dict[str, _Pty] = {}

    def __len__(self) -> int:
        return len(self._ptys)

    def _get(self, pty_id: str) -> _Pty:
        p = self._ptys.get(pty_id)
        if p is None:
            raise PtyNotFoundError("no live PTY session with this id", context={"pty_id": str(pty_id)[:64]})
        return p

    async def pty_exec_start(
        self,
        argv: Sequence[str],
        *,
        workspace: Root,
        workspace_host_path: str,
        grants: Sequence[tuple[Root, bool]] | PathPolicy | None = None,
        cwd: str = "",
        env: Mapping[str, str] | None = None,
        secret_env: Iterable[str] = frozenset(),
        shell: bool | Sequence[str] = False,
        confinement: Confinement = "required",
        policy: ConfinementPolicy = ConfinementPolicy(),
        rows: int = 24,
        cols: int = 80,
        first_output_timeout_s: float = 0.5,
        private_root: PrivateRoot | None = None,
    ) -> tuple[str, bytes]:
        """Start ``argv`` on a new PTY, confined like :func:`run_confined`.

        Args:
            argv, workspace, workspace_host_path, grants, cwd, env, secret_env,
                shell, confinement, policy, private_root: as for
                :func:`run_confined`; in a private root ``/dev`` also holds
                ``tty`` and the PTY's slave at its ``/dev/pts`` name.
                ``TERM`` defaults to ``xterm`` when neither the host allow-list
                nor ``env`` sets it.
            rows, cols: the terminal size.
            first_output_timeout_s: seconds to wait for the first output.

        Returns:
            ``(pty_id, first_output)``.

        Raises:
            ConfinementError, CommandNotFoundError, ExecError, InvalidEnvError:
                as for :func:`run_confined`.

        *Cancellation*: a cancel before the process is registered kills it;
        after that the session stays registered and is ended by
        :meth:`pty_terminate` / :meth:`pty_terminate_all`.
        """
        await trio.lowlevel.checkpoint()
        request = ExecRequest.build(argv, workspace=workspace, workspace_host_path=workspace_host_path,
                                    grants=grants, cwd=cwd, env=env, secret_env=secret_env, shell=shell,
                                    confinement=confinement, policy=policy, tty=True,
                                    private_root=private_root)
        if len(self._ptys) >= self.max_live:
            await self._prune_one()
        prep = await prepare_run(request, self.supervisor)
        try:
            tracked, master = await self._spawn_on_pty(request, prep, rows, cols)
        except BaseException:
            prep.release_guards()
            raise
        now = time.monotonic()
        pty_id = f"pty-{next(self._ids)}-{os.urandom(4).hex()}"
        p = _Pty(pty_id, tracked, trio.lowlevel.FdStream(master), now, now, guards=prep.guards)
        prep.guards = None
        self._ptys[pty_id] = p
        first = await self.pty_read(pty_id, timeout_s=first_output_timeout_s)
        return pty_id, first

    async def _spawn_on_pty(self, request: ExecRequest, prep: Prepared, rows: int,
                            cols: int) -> tuple[_Tracked, int]:
        """Spawn on a new PTY and wait for the command's start; returns (tracked init, PTY master fd)."""
        argv0 = request.argv0
        master, slave = os.openpty()
        try:
            os.set_inheritable(master, False)
            fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
            proc, tracked, status = await _spawn(prep, self.supervisor, argv0, stdin=slave, stdout=slave,
                                                 stderr=slave)
        except BaseException:
            os.close(master)
            os.close(slave)
            raise
        os.close(slave)
        with trio.CancelScope(shield=True):
            with trio.move_on_after(_STATUS_TIMEOUT_S):
                failure = await status.startup()  # the status pipe stays with the init (its "exit" line)
            if failure:
                await _abort_spawn(proc, tracked, self.supervisor, status)
                os.close(master)
                raise _status_error(failure, argv0, prep)
            if tracked.process is not proc:
                await proc.wait()
        return tracked, master

    async def _prune_one(self) -> None:
        def key(p: _Pty) -> tuple[int, float]:
            return (0 if p.tracked.process.returncode is not None else 1, p.last_activity)
        victim = min(self._ptys.values(), key=key)
        await self.pty_terminate(victim.pty_id)

    async def pty_write_stdin(self, pty_id: str, data: bytes) -> None:
        """Write ``data`` (bytes) to the session's terminal input.

        Raises:
            PtyNotFoundError: unknown ``pty_id``.
            ExecError: the session's process has exited and the terminal is closed.

        *Cancellation*: a cancel may leave part of ``data`` written.
        """
        p = self._get(pty_id)
        p.last_activity = time.monotonic()
        try:
            await p.stream.send_all(bytes(data))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise ExecError("the PTY session's terminal is closed", context={"pty_id": pty_id}) from None

    async def pty_read(self, pty_id: str, *, timeout_s: float = 0.1, max_bytes: int = 1 << 16) -> bytes:
        """Return output available now, waiting up to ``timeout_s`` seconds for some.

        After the first bytes arrive, keeps collecting while more follows
        within 50 ms, up to ``max_bytes``.  Returns ``b""`` when nothing came
        (or the session ended and everything was read).

        Raises:
            PtyNotFoundError: unknown ``pty_id``.

        *Cancellation*: bytes already read are kept in the session's buffer
        for the next call, never lost.
        """
        await trio.lowlevel.checkpoint()
        p = self._get(pty_id)
        p.last_activity = time.monotonic()
        async with p.lock:
            deadline = trio.current_time() + max(0.0, timeout_s)
            with trio.move_on_at(deadline) as cs:
                while not p.eof and len(p.pending) < max_bytes:
                    if p.pending:
                        cs.deadline = min(cs.deadline, trio.current_time() + 0.05)
                    try:
                        data = await p.stream.receive_some(_CHUNK)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        data = b""  # EIO: every slave fd is closed
                    if not data:
                        p.eof = True
                        break
                    p.pending += data
                    if len(p.pending) > self.max_buffer_bytes:
                        excess = len(p.pending) - self.max_buffer_bytes
                        del p.pending[:excess]
                        p.dropped_bytes += excess
            out = bytes(p.pending[:max_bytes])
            del p.pending[:max_bytes]
            return out

    def pty_info(self, pty_id: str) -> dict[str, object]:
        """``{"pid", "exit_code" (None while running), "dropped_bytes", "idle_s"}`` of a session.

        Raises:
            PtyNotFoundError: unknown ``pty_id``.
        """
        p = self._get(pty_id)
        return {"pid": p.tracked.process.pid, "exit_code": p.tracked.process.returncode,
                "dropped_bytes": p.dropped_bytes, "idle_s": time.monotonic() - p.last_activity}

    async def pty_terminate(self, pty_id: str, *, grace_s: float = 0.5) -> int:
        """End a session: SIGTERM its process tree, ``grace_s`` seconds, SIGKILL; reap; close the PTY.

        Returns:
            The exit status (``-N`` when ended by signal N).

        Raises:
            PtyNotFoundError: unknown ``pty_id``.

        *Cancellation*: a cancel before the call starts leaves the session
        untouched; once started, the end is shielded and always completes.
        """
        await trio.lowlevel.checkpoint()
        p = self._get(pty_id)
        del self._ptys[pty_id]
        with trio.CancelScope(shield=True):
            await self.supervisor._kill_one(p.tracked, grace_s)
            await p.stream.aclose()
            if p.guards is not None:
                p.guards.release()
        code = p.tracked.process.returncode
        return code if code is not None else -signal.SIGKILL

    async def pty_terminate_all(self) -> None:
        """End every session (SIGKILL at once).

        *Cancellation*: a cancel before the call starts changes nothing; once
        started, every session is ended (shielded).
        """
        await trio.lowlevel.checkpoint()
        with trio.CancelScope(shield=True):
            for pty_id in list(self._ptys):
                await self.pty_terminate(pty_id, grace_s=0)

    async def aclose(self) -> None:
        """Same as :meth:`pty_terminate_all`.

        *Cancellation*: shielded.
        """
        await self.pty_terminate_all()
