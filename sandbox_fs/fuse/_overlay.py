"""The host side of the FUSE overlay: :class:`Overlay` starts, talks to and stops one daemon.

The daemon (``python -m sandbox_fs.fuse._daemon FD``) is a child process
with only its end of the control socketpair passed to it.  It makes a
*detached* FUSE mount of the workspace (attached to no mount table) and hands
its ``O_PATH`` mount fd back; the host builds a :class:`~sandbox_fs.root.Root`
on it (:attr:`Overlay.root`) and passes the same fd to the exec helper
(:attr:`Overlay.mount_fd`), which clones it into a confined command's
private root.  The mount dissolves when the last fd on it closes, so a
SIGKILL of either side leaves nothing mounted.

Requests are answered in order: each call sends one tagged request and reads
messages until its reply arrives; ``audit`` events that arrive meanwhile are
buffered here (bounded by the policy's ``audit_capacity``, the rest counted
as dropped).  Requests made from several trio tasks are serialized by an
internal lock; not thread-safe (call it from the trio thread only).
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import trio

from ..root import Root
from . import _protocol
from ._audit import AuditEvent
from ._audit import from_wire as audit_from_wire
from ._errors import OverlayError, OverlayUnavailableError
from ._faults import FaultRule
from ._rules import OverlayPolicy

START_TIMEOUT_S = 60.0
"""Longest wait for the daemon to start and mount (interpreter start-up, pyfuse3 import, quota walk)."""

STOP_TIMEOUT_S = 5.0
"""Longest wait for the daemon to exit after ``shutdown`` before it is killed."""

LIST_FIELDS = {"invalidate": "paths", "faults": "rules"}
"""The ops whose list field :func:`split_ops` may spread over several requests."""

MESSAGE_BUDGET = _protocol.MAX_MESSAGE_BYTES // 2
"""Most bytes one request is encoded to (also under the socket's send buffer, see :meth:`Overlay._budget`)."""

_UNAVAILABLE_ERRNOS = (errno.EPERM, errno.EACCES, errno.ENODEV, errno.ENOSYS, errno.ENOENT)

MAX_ANCESTRY = 4096
"""Most directories :func:`mount_overlap` walks up from one directory before giving up."""

Overlap = Literal["same", "inside", "contains"]
"""How a mount's directory overlaps the workspace: the same directory, inside it, or containing it."""

_OVERLAP_TEXT = {"same": "is the workspace itself", "inside": "lies inside the workspace",
                 "contains": "contains the workspace"}


@dataclass(frozen=True)
class OverlayMount:
    """A host directory exposed at a workspace path through the overlay.

    Attributes:
        path: the workspace-relative sandbox path it appears at (``"data/in"``);
            an empty placeholder directory there is expected (the overlay
            serves the mount in its place).
        root: the capability on the host directory (borrowed: the overlay
            sends the daemon a duplicate of its fd).
        read_only: every write beneath it fails with EROFS.
    """

    path: str
    root: Root
    read_only: bool = True


def _ancestry(root: Root) -> list[tuple[int, int]]:
    """``(st_dev, st_ino)`` of ``root``'s directory, then of each directory above it, up to ``/``.

    Walks ``..`` with ``O_PATH`` fds from the Root's own fd (no path string
    is looked up); ``/`` (of this process) is the directory whose ``..`` is
    itself.  At the root of a mount, ``..`` leads (as the kernel resolves
    it) to the directory the mount is on.

    Raises:
        OverlayError: more than MAX_ANCESTRY levels.
        OSError: a ``..`` could not be opened (EACCES on a search-less directory).
        WorkspaceClosedError: ``root`` is closed.
    """
    fd = root.fileno_dup()
    try:
        st = os.fstat(fd)
        chain = [(st.st_dev, st.st_ino)]
        for _ in range(MAX_ANCESTRY):
            parent = os.open("..", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = parent
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
            if key == chain[-1]:
                return chain
            chain.append(key)
        raise OverlayError("a directory is nested too deeply to check it against the workspace")
    finally:
        os.close(fd)


def mount_overlap(workspace: Root, mount: Root) -> Overlap | None:
    """Whether ``mount``'s directory is, lies inside, or contains ``workspace``'s directory.

    Compared by directory identity (``(st_dev, st_ino)`` of each directory
    up the ``..`` chain of both), never by path, so a symlinked or renamed
    path to the same directory is seen.  A bind mount of a directory of the
    workspace elsewhere is a different ``..`` chain and is not seen.

    Args:
        workspace: the workspace Root (borrowed).
        mount: a host directory's Root (borrowed).

    Returns:
        ``"same"``, ``"inside"`` (the mount is beneath the workspace),
        ``"contains"`` (the workspace is beneath the mount), or None.

    Raises:
        OverlayError: a chain is deeper than MAX_ANCESTRY.
        OSError: a ``..`` could not be opened.
        WorkspaceClosedError: a Root is closed.
    """
    ws_chain, m_chain = _ancestry(workspace), _ancestry(mount)
    if ws_chain[0] == m_chain[0]:
        return "same"
    if ws_chain[0] in m_chain:
        return "inside"
    if m_chain[0] in ws_chain:
        return "contains"
    return None


def overlap_text(overlap: Overlap) -> str:
    """A sentence end for an error: ``"lies inside the workspace"`` and the like."""
    return _OVERLAP_TEXT[overlap]


def _encoded_len(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=True))


def split_ops(ops: list[dict[str, Any]], budget: int) -> list[list[dict[str, Any]]]:
    """``ops`` as a list of requests (each a list of ops) whose encoding fits ``budget`` bytes.

    Sizes are computed from the JSON encoding, with room for the request's
    envelope (``{"tag": n, "ops": [...]}``).  An op in :data:`LIST_FIELDS`
    whose list does not fit is cut into several ops of the same kind, in
    order.  ``faults`` chunks carry ``"part": i`` and all but the last
    ``"more": true``: the daemon stages them (part 0 starts afresh, so a
    split cut short by cancellation is discarded) and replaces its rule
    set once, at the last chunk.

    Args:
        ops: protocol ops (dicts with ``"op"``).
        budget: most bytes of one encoded request.

    Raises:
        OverlayError: a single op, or one item of its list, cannot fit
            ``budget`` on its own (nothing was sent).
    """
    room = budget - _encoded_len({"tag": 2**53, "ops": []})
    requests: list[list[dict[str, Any]]] = []
    cur: list[dict[str, Any]] = []
    used = 0
    for op in _cut_lists(ops, room):
        size = _encoded_len(op) + 1
        if size > room:
            raise OverlayError(f"overlay {op.get('op')}: the request is too large to send")
        if cur and used + size > room:
            requests.append(cur)
            cur, used = [], 0
        cur.append(op)
        used += size
    if cur:
        requests.append(cur)
    return requests


def _cut_lists(ops: list[dict[str, Any]], room: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for op in ops:
        field = LIST_FIELDS.get(str(op.get("op")))
        items = op.get(field) if field else None
        if field is None or not isinstance(items, list) or _encoded_len(op) + 1 <= room:
            out.append(op)
            continue
        base = _encoded_len({**op, field: [], "more": True}) + 1
        chunks: list[list[Any]] = [[]]
        used = base
        for item in items:
            size = _encoded_len(item) + 1
            if base + size > room:
                raise OverlayError(f"overlay {op.get('op')}: one of its items is too large to send")
            if chunks[-1] and used + size > room:
                chunks.append([])
                used = base
            chunks[-1].append(item)
            used += size
        for i, chunk in enumerate(chunks):
            part = {**op, field: chunk}
            if op.get("op") == "faults":
                part["part"] = i
                if i < len(chunks) - 1:
                    part["more"] = True
            out.append(part)
    return out


def _check_available() -> None:
    if not os.path.exists("/dev/fuse"):
        raise OverlayUnavailableError("the FUSE overlay needs /dev/fuse, which this machine lacks")
    if importlib.util.find_spec("pyfuse3") is None:
        raise OverlayUnavailableError("the FUSE overlay needs pyfuse3: install sandbox-fs[fuse]")


class Overlay:
    """One running overlay daemon and its detached mount.  Create with :meth:`start`."""

    def __init__(self, process: trio.Process, sock: Any, policy: OverlayPolicy) -> None:
        self._process = process
        self._sock = sock
        self._policy = policy
        self._lock = trio.Lock()
        self._tag = 1
        self._broken = False
        self._mount_fd = -1
        self._root: Root | None = None
        self._events: list[AuditEvent] = []
        self._dropped = 0
        self.initial_usage: dict[str, int] = {}
        """``{"bytes": n, "inodes": n}`` the daemon measured at mount."""

    # ------------------------------------------------------------- start

    @classmethod
    async def start(cls, workspace: Root, *, policy: OverlayPolicy,
                    mounts: Sequence[OverlayMount] = ()) -> "Overlay":
        """Start a daemon serving ``workspace`` (and ``mounts``) and wait until it is mounted.

        Args:
            workspace: the workspace Root (borrowed; the daemon gets a
                duplicate of its fd).  :attr:`root` gets its ``read_only``,
                ``no_symlinks``, ``owner`` and label; read-only grants nested
                in it are *not* carried over (use :class:`OverlayMount`).
            policy: the overlay policy (read-only, special files, quotas,
                audit capacity, cache timeouts).
            mounts: host directories to serve at workspace paths.

        Raises:
            OverlayUnavailableError: no ``/dev/fuse``, no pyfuse3, or no
                privilege to mount (EPERM from fsopen).
            OverlayError: a mount's directory is, lies inside or contains
                the workspace (:func:`mount_overlap`; ``context["mount"]`` is
                its path, ``context["overlap"]`` how; checked before any
                daemon starts), or another mount's directory
                (``context["other"]`` its path: a read-only mount inside a
                writable one would be writable through it), or the daemon failed to start, died, or did
                not answer within START_TIMEOUT_S.
            OSError: walking up from a directory failed (see :func:`mount_overlap`).
            WorkspaceClosedError: ``workspace`` or a mount's Root is closed.

        Cancellation: the daemon is killed and every fd closed.
        """
        _check_available()
        for m in mounts:
            how = await trio.to_thread.run_sync(mount_overlap, workspace, m.root)
            if how is not None:
                raise OverlayError(f"the mount at {m.path!r} {overlap_text(how)}",
                                   context={"mount": m.path, "overlap": how})
        for i, a in enumerate(mounts):
            for b in mounts[i + 1:]:
                # a read-only mount inside a writable one would be writable through the other
                how = await trio.to_thread.run_sync(mount_overlap, a.root, b.root)
                if how is not None:
                    raise OverlayError(f"the mounts at {a.path!r} and {b.path!r} overlap",
                                       context={"mount": b.path, "other": a.path, "overlap": how})
        host, daemon = _protocol.socketpair()
        fds: list[int] = []
        process: trio.Process | None = None
        overlay: Overlay | None = None
        try:
            fds.append(workspace.fileno_dup())
            fds.extend(m.root.fileno_dup() for m in mounts)
            process = await trio.lowlevel.open_process(
                [sys.executable, "-m", "sandbox_fs.fuse._daemon", str(daemon.fileno())],
                pass_fds=(daemon.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True)
            daemon.close()
            host.setblocking(False)
            overlay = cls(process, host, policy)
            config = {"op": "config", "policy": policy.model_dump(mode="json"),
                      "read_only": workspace.read_only,
                      "mounts": [{"path": m.path, "read_only": m.read_only} for m in mounts]}
            with trio.fail_after(START_TIMEOUT_S):
                await overlay._start(config, fds)
            overlay._root = Root(os.dup(overlay._mount_fd), read_only=workspace.read_only,
                              no_symlinks=workspace.no_symlinks, resolver=workspace.resolver,
                              label=workspace.label, owner=workspace.owner)
            return overlay
        except BaseException as exc:
            daemon.close()
            for fd in fds:
                os.close(fd)
            if overlay is not None:
                await overlay.aclose()
            else:
                host.close()
                if process is not None:
                    with trio.CancelScope(shield=True):
                        process.kill()
                        await process.wait()
            if isinstance(exc, trio.TooSlowError):
                raise OverlayError("the overlay daemon did not start in time") from None
            raise
        finally:
            fds.clear()

    async def _start(self, config: dict[str, Any], fds: list[int]) -> None:
        await self._send({"tag": self._tag, "ops": [config]}, fds)
        for fd in fds:
            os.close(fd)
        fds.clear()
        while True:
            msg, got = await self._recv_or_raise()
            if msg["tag"] == 0 and msg.get("event") == "ready":
                if len(got) != 1:
                    raise OverlayError("the overlay daemon's ready message carries no mount fd")
                self._mount_fd = got[0]
                usage = msg.get("usage")
                self.initial_usage = dict(usage) if isinstance(usage, dict) else {}
                continue
            for fd in got:
                os.close(fd)
            if msg["tag"] == self._tag:
                self._tag += 1
                result = (msg.get("results") or [{}])[0]
                if not result.get("ok"):
                    err = result.get("errno")
                    text = f"the overlay could not be mounted: {result.get('reason', 'unknown error')}"
                    kind = OverlayUnavailableError if err in _UNAVAILABLE_ERRNOS else OverlayError
                    raise kind(text, context={"errno": err}, diagnostic=str(result.get("detail")))
                if self._mount_fd < 0:
                    raise OverlayError("the overlay daemon answered without a mount fd")
                return
            self._on_event(msg)

    # ----------------------------------------------------------- channel

    async def _send(self, msg: dict[str, Any], fds: Sequence[int] = ()) -> None:
        while True:
            try:
                _protocol.send(self._sock, msg, list(fds))
                return
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self._sock)
            except _protocol.ProtocolError as e:
                # a local encoding/size error: nothing was sent, the channel is intact
                raise OverlayError(f"the overlay request cannot be sent: {e}") from None
            except OSError as e:
                if e.errno == errno.EMSGSIZE:
                    raise OverlayError("the overlay request is too large to send",
                                       context={"errno": e.errno}) from None
                self._broken = True
                raise OverlayError("the overlay daemon is gone", context={"errno": e.errno}) from None

    async def _recv_or_raise(self) -> tuple[dict[str, Any], list[int]]:
        while True:
            try:
                got = _protocol.recv(self._sock)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self._sock)
                continue
            except _protocol.ProtocolError as e:
                self._broken = True
                raise OverlayError(f"the overlay daemon sent a bad message: {e}") from None
            except OSError as e:
                got = None
                err = e.errno
            else:
                err = None
            if got is None:
                self._broken = True
                raise OverlayError("the overlay daemon exited", context={"errno": err})
            return got

    def _on_event(self, msg: dict[str, Any]) -> None:
        if msg.get("event") != "audit":
            return
        try:
            events, dropped = audit_from_wire(msg)
        except _protocol.ProtocolError:
            self._dropped += 1  # a malformed batch: its size is unknown, count it once
            return
        self._dropped += dropped
        room = max(0, self._policy.audit_capacity - len(self._events))
        self._events.extend(events[:room])
        self._dropped += max(0, len(events) - room)

    def _budget(self) -> int:
        """Most bytes one request may encode to: MESSAGE_BUDGET, and below the socket's send buffer."""
        try:
            sndbuf = int(self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF))
        except OSError:
            return MESSAGE_BUDGET
        return max(4096, min(MESSAGE_BUDGET, sndbuf - 1024))

    async def _request(self, ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Send ``ops`` as tagged requests; returns their results (each checked ``ok``).

        Ops are split over as many requests as their encoded size needs
        (:func:`split_ops`), sent one after the other under the lock; the
        results of a split op are those of its chunks (the first refusal
        raises).  A local encoding or size error never marks the channel
        broken: only EOF, a socket error or a protocol violation of the peer do.

        Raises:
            OverlayError: the daemon is gone or refused an op, or an op is too large to send.
        """
        requests = split_ops(ops, self._budget())
        results: list[dict[str, Any]] = []
        async with self._lock:
            for part in requests:
                results += await self._exchange(part)
        return results

    async def _exchange(self, ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One tagged request and its reply (the lock is held)."""
        if self._broken:
            raise OverlayError("the overlay daemon is gone")
        tag = self._tag
        self._tag += 1
        await self._send({"tag": tag, "ops": ops})
        while True:
            msg, fds = await self._recv_or_raise()
            for fd in fds:
                os.close(fd)
            if msg["tag"] == tag:
                break
            if msg["tag"] == 0:
                self._on_event(msg)
            # else: the reply to a request whose caller was cancelled
        results = msg.get("results")
        if not isinstance(results, list) or len(results) != len(ops):
            self._broken = True
            raise OverlayError("the overlay daemon answered out of protocol")
        for op, res in zip(ops, results):
            if not isinstance(res, dict) or not res.get("ok"):
                reason = res.get("reason", "refused") if isinstance(res, dict) else "bad reply"
                raise OverlayError(f"overlay {op.get('op')}: {reason}",
                                   context={"errno": res.get("errno") if isinstance(res, dict) else None})
        return results

    # ------------------------------------------------------------ public

    @property
    def root(self) -> Root:
        """A Root on the mount (the workspace as the overlay serves it): host-side access goes through it.

        Raises:
            OverlayError: the overlay is closed.
        """
        if self._root is None:
            raise OverlayError("the overlay is closed")
        return self._root

    @property
    def mount_fd(self) -> int:
        """The ``O_PATH`` fd on the detached mount's root (borrowed: valid until :meth:`aclose`)."""
        return self._mount_fd

    @property
    def pid(self) -> int:
        """The daemon's process id."""
        return int(self._process.pid)

    @property
    def alive(self) -> bool:
        """True while the daemon runs and the channel works."""
        return not self._broken and self._process.returncode is None

    async def invalidate(self, paths: Sequence[str] | None = None, *, attrs_only: bool = False) -> None:
        """Drop the kernel's cached entries and attributes for ``paths`` (workspace-relative), or all.

        Returns once the kernel processed every invalidation.  Call it after
        any change made to the backing workspace other than through the
        mount.  A directory's path drops everything the kernel cached
        beneath it too.  A path the kernel has not looked up costs nothing.
        ``None`` walks the daemon's whole inode table (about 15 ms per 1,000
        entries here).  An open file keeps its cached pages until it is
        opened again (only its attributes are dropped while open).
        ``attrs_only=True`` drops cached attributes (owners, modes, sizes)
        only, never an entry or pages: enough after owners changed, and it
        leaves alone the mounts on those entries (a dropped entry unmounts,
        in every namespace, what is mounted on it: the protected-path binds
        of runs going on).

        Raises:
            OverlayError: the daemon is gone or refused.

        Cancellation: the invalidation may or may not have completed.
        """
        op: dict[str, Any] = {"op": "invalidate", "all": True} if paths is None else \
            {"op": "invalidate", "paths": [str(p) for p in paths]}
        if attrs_only:
            op["attrs_only"] = True
        await self._request([op])

    async def set_faults(self, rules: Sequence[FaultRule]) -> None:
        """Replace the daemon's fault rules (``[]`` clears them).

        Raises:
            OverlayError: the daemon is gone or refused a rule.
        """
        await self._request([{"op": "faults", "rules": [r.model_dump(mode="json") for r in rules]}])

    async def set_quota(self, max_bytes: int | None, max_inodes: int | None) -> None:
        """Set the workspace's byte and inode limits (None = unlimited).

        Raises:
            OverlayError: the daemon is gone or refused.
        """
        await self._request([{"op": "quota", "max_bytes": max_bytes, "max_inodes": max_inodes}])

    async def usage(self) -> dict[str, int]:
        """The workspace's charged usage: ``{"bytes": n, "inodes": n}``.

        Raises:
            OverlayError: the daemon is gone.
        """
        res = (await self._request([{"op": "usage"}]))[0]
        return {"bytes": int(res["bytes"]), "inodes": int(res["inodes"])}

    async def audit_events(self) -> tuple[list[AuditEvent], int]:
        """Every audit event since the last call, oldest first, and how many were dropped.

        Raises:
            OverlayError: the daemon is gone (events already received are kept for the next call).
        """
        await self._request([{"op": "audit"}])
        events, dropped = self._events, self._dropped
        self._events, self._dropped = [], 0
        return events, dropped

    async def aclose(self) -> None:
        """Shut the daemon down (bounded wait, then SIGKILL) and close every fd.  Idempotent.

        Cancellation: shielded; it always completes (within about
        2 x STOP_TIMEOUT_S).
        """
        with trio.CancelScope(shield=True):
            if self.alive:
                with trio.move_on_after(STOP_TIMEOUT_S):
                    try:
                        await self._request([{"op": "shutdown"}])
                    except OverlayError:
                        pass
            self._broken = True
            if self._root is not None:
                self._root.close()
                self._root = None
            if self._mount_fd >= 0:
                os.close(self._mount_fd)
                self._mount_fd = -1
            with trio.move_on_after(STOP_TIMEOUT_S):
                await self._process.wait()
            if self._process.returncode is None:
                self._process.send_signal(signal.SIGKILL)
                await self._process.wait()
            if self._sock.fileno() >= 0:
                self._sock.close()

    async def __aenter__(self) -> "Overlay":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
