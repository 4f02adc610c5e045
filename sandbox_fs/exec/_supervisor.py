"""Supervision: :class:`ProcessSupervisor` tracks each command's init and ends every tree.

See "Supervision" in SECURITY.md for what is guaranteed where.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import weakref
from dataclasses import dataclass
from typing import Sequence

import trio

from ..root import Root
from . import _helper, _identity
from ._cgroups import CgroupTree, PidsV1Tree
from ._errors import ConfinementError
from ._helper import _HELPER_ENV, _STATUS_TIMEOUT_S, _Status
from ._models import NS_FLAGS
from ._mounts import _mask_dirs


def _release_resources(cgroup_tree: "CgroupTree | None", ns_fds: dict[tuple, tuple[int, ...]],
                       pids_v1_tree: "PidsV1Tree | None" = None, lifeline: list[int] | None = None,
                       leases: "list[_identity.IdentityLease] | None" = None,
                       leafless: list[bool] | None = None) -> None:
    """Finalizer of a ProcessSupervisor: close its lifeline (every init it started then
    ends its tree), kill and remove its cgroup trees, close its namespace fds, give back its
    identity (after the kill; marked free of processes only when every process ran in a
    cgroup v2 leaf and that tree is gone)."""
    for i, fd in enumerate(lifeline or ()):
        if fd >= 0:
            os.close(fd)
            lifeline[i] = -1  # type: ignore[index]
    emptied = (cgroup_tree.close() if cgroup_tree is not None else False) and not (leafless or [True])[0]
    if pids_v1_tree is not None:
        pids_v1_tree.close()
    for fds in ns_fds.values():
        for fd in fds:
            if fd >= 0:
                os.close(fd)
    ns_fds.clear()
    while leases:
        leases.pop().release(no_processes_left=emptied)



async def _take_held_ns(proc: trio.Process, status: _Status) -> tuple[int, int, int, int] | None:
    """Open the namespaces of a ``--hold-ns`` helper once it is "ready", then let it exit.

    Returns ``(mntns_fd, userns_fd or -1, netns_fd, ipcns_fd)``, or None
    when the helper failed or did not get ready in time.  Shielded: the
    helper is always reaped.
    """
    mnt = user = net = ipc = -1
    with trio.CancelScope(shield=True):
        try:
            with trio.move_on_after(_STATUS_TIMEOUT_S):
                if await status.read_line() == b"ready":  # host-access: procfs ns files of our own helper child, held while it waits
                    mnt = os.open(f"/proc/{proc.pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
                    net = os.open(f"/proc/{proc.pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
                    ipc = os.open(f"/proc/{proc.pid}/ns/ipc", os.O_RDONLY | os.O_CLOEXEC)
                    if os.geteuid() != 0:
                        user = os.open(f"/proc/{proc.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            for fd in (mnt, net, ipc):
                if fd >= 0:
                    os.close(fd)
            mnt = user = net = ipc = -1
        finally:
            assert proc.stdin is not None
            await proc.stdin.aclose()
            await proc.wait()
            await status.aclose()
    if mnt < 0:
        return None
    return mnt, user, net, ipc

#: how long a killed tree's cgroup leaf may stay populated (a process still leaving the kernel)
#: before :meth:`ProcessSupervisor.kill_all` reports that the tree may have outlived the kill
_LEAF_EMPTY_WAIT_S = 5.0
_LEAF_POLL_S = 0.005


@dataclass(eq=False)
class _Tracked:
    """A started command: ``process`` is the helper's init (our own unreaped child)."""

    process: "trio.Process | _ForeignChild"
    pidfd: int
    leaf: str | None
    argv0: str
    pids_leaf: str | None = None  # its cgroup v1 pids leaf, if any
    pid_ns: bool = False


class ProcessSupervisor:
    """Tracks every command started through it (its init, and cgroup leaf) and kills them all.

    Give one to :func:`run_confined` / :class:`PtyManager` per session; call
    :meth:`kill_all` (or ``await aclose()``) at shutdown. What is guaranteed
    where is described in SECURITY.md ("Supervision"): each command runs under
    an init of the helper (in its own PID namespace where one can be made)
    that ends the whole tree when the command exits, when this supervisor is
    closed or collected, and when the host process dies; signals go only
    through pidfds of our own unreaped children; cgroup v2 leaves
    (:attr:`uses_cgroup`) are killed too.

    Args:
        use_cgroup: try a cgroup v2 leaf per process (needs a writable
            cgroup2 mount: root here).
        pids_max: ``pids.max`` of each leaf (the cgroup v2 ``pids``
            controller, else a cgroup v1 ``pids`` leaf; None: neither is made).
        hold_mount_ns: make the read-only mount namespace once per set of
            writable trees and let every process join it, instead of one per
            process (a namespace's teardown waits for an RCU grace period in
            the exiting process).  The supervisor holds its nsfs fds until
            :meth:`aclose`.
    """

    def __init__(self, *, use_cgroup: bool = True, pids_max: int | None = 4096,
                 hold_mount_ns: bool = True) -> None:
        self._tracked: list[_Tracked] = []
        self._survivors = False  # a kill_all could not prove a tree gone (see kill_all)
        self._cg: CgroupTree | None = CgroupTree.create(pids_max) if use_cgroup else None
        self._closed = False
        self._hold_mount_ns = hold_mount_ns
        self._ns_fds: dict[tuple, tuple[int, int, int, int]] = {}
        self._ns_lock = trio.Lock()
        # cgroup v1 pids leaves: only where cgroup v2 cannot bound the task count.
        self._v1: PidsV1Tree | None = None
        if use_cgroup and pids_max is not None and (self._cg is None or not self._cg.pids):
            self._v1 = PidsV1Tree.create()
        # The lifeline: every init started through this supervisor holds the
        # read end and ends its tree at EOF, which comes when the write end
        # (only ever in this process, close-on-exec) is closed by aclose(),
        # by the finalizer, or by the death of this process.
        self._lifeline: list[int] = list(os.pipe2(os.O_CLOEXEC))
        self._leases: list[_identity.IdentityLease] = []
        self._lease_lock = threading.Lock()
        self._leafless = [False]  # a process ran outside a cgroup v2 leaf
        # A supervisor dropped without aclose() still ends its processes,
        # removes its cgroup directories, releases its mount namespaces and
        # gives back its identity.
        self._finalizer = weakref.finalize(self, _release_resources, self._cg, self._ns_fds, self._v1,
                                           self._lifeline, self._leases, self._leafless)

    def _auto_identity(self, id_range: tuple[int, int], prefer: int | None = None) -> tuple[int, int]:
        """The supervisor's leased ``(uid, gid)`` (leased on first use, given back at :meth:`aclose`).

        Blocking (scans ``/proc``): call from a worker thread.  ``prefer``:
        the id to take when it is free and in range (the workspace's owner:
        a hint only, see :func:`sandbox_fs.exec._identity.lease`).

        Raises:
            ConfinementError: no identity can be leased.
        """
        with self._lease_lock:
            if not self._leases:
                if self._closed:
                    raise ConfinementError("the process supervisor is closed")
                try:
                    self._leases.append(_identity.lease(*id_range, prefer=prefer))
                except (OSError, ValueError) as exc:
                    raise ConfinementError("no unprivileged identity could be leased for the confined command",
                                           diagnostic=str(exc)) from None
            return self._leases[0].ids

    @property
    def uses_cgroup(self) -> bool:
        """True when processes start in their own cgroup v2 leaf."""
        return self._cg is not None

    def __len__(self) -> int:
        return len(self._tracked)

    def _new_leaf(self, pids_max: int | None) -> str | None:
        if self._cg is None:
            return None
        try:
            return self._cg.new_leaf(pids_max)
        except OSError:
            return None

    def _new_pids_leaf(self, pids_max: int) -> str | None:
        """A cgroup v1 pids leaf with ``pids.max`` set, or None (no v1 hierarchy, or refused)."""
        if self._v1 is None:
            return None
        try:
            return self._v1.new_leaf(pids_max)
        except OSError:
            return None

    def _lifeline_fd(self) -> int:
        """A new fd on the lifeline's read end, for one helper's ``--lifeline``."""
        if self._lifeline[1] < 0:  # used again after aclose(): a fresh lifeline
            self._lifeline = list(os.pipe2(os.O_CLOEXEC))
            self._finalizer = weakref.finalize(self, _release_resources, None, {}, None, self._lifeline)
        return os.dup(self._lifeline[0])

    def _track(self, process: "trio.Process | _ForeignChild", leaf: str | None, argv0: str, *,
               pids_leaf: str | None = None) -> _Tracked:
        for old in list(self._tracked):  # forget commands that ended since (keeps the list short)
            self._release_if_done(old)
        try:
            pidfd = os.pidfd_open(process.pid)
        except OSError:
            pidfd = -1
        tracked = _Tracked(process, pidfd, leaf, argv0, pids_leaf, pid_ns=getattr(process, "pid_ns", False))
        if leaf is None:
            self._leafless[0] = True
        self._tracked.append(tracked)
        return tracked

    @staticmethod
    def _signal(tracked: _Tracked, sig: int) -> None:
        """Signal the command's init through its pidfd (never a raw pid or process group).

        The init is our child and not yet reaped (``returncode`` is None), so
        the pidfd cannot name another process.  The init forwards SIGTERM to
        its whole tree; SIGKILL ends it and, in a PID namespace, the kernel
        kills the rest.
        """
        if tracked.process.returncode is None and tracked.pidfd >= 0:
            try:
                signal.pidfd_send_signal(tracked.pidfd, sig)
            except OSError:
                pass

    def _group_alive(self, tracked: _Tracked) -> bool:
        if tracked.pids_leaf is not None and PidsV1Tree.populated(tracked.pids_leaf):
            return True
        if tracked.process.returncode is None:
            return True
        return tracked.leaf is not None and CgroupTree.populated(tracked.leaf)

    def _untrack(self, tracked: _Tracked) -> None:
        if tracked in self._tracked:
            self._tracked.remove(tracked)
        if tracked.pidfd >= 0:
            os.close(tracked.pidfd)
            tracked.pidfd = -1
        if tracked.leaf is not None:
            CgroupTree.remove(tracked.leaf)
        if tracked.pids_leaf is not None:
            PidsV1Tree.remove(tracked.pids_leaf)

    @staticmethod
    def _init_died_unended(tracked: _Tracked) -> bool:
        """A subreaper init (no PID namespace) without a cgroup leaf that died of a signal.

        Such an init never ended its tree (it does so only before it exits by
        itself), and nothing else can name what it leaves behind: its orphans
        run on.  The command itself can send that signal where nothing keeps it
        from signalling its init (same uid, Landlock ABI < 6: ``best_effort``).
        """
        return (not tracked.pid_ns and tracked.leaf is None and tracked.pids_leaf is None
                and bool(getattr(tracked.process, "init_signalled", False)))

    def _release_if_done(self, tracked: _Tracked) -> None:
        """Forget ``tracked`` once its leader is reaped and nothing of its group/leaf is left.

        An init that died of a signal without ending its tree (see
        :meth:`_init_died_unended`) marks the supervisor: :meth:`kill_all`
        raises from then on.
        """
        if tracked.process.returncode is None:
            return
        if self._init_died_unended(tracked):
            self._survivors = True
        if tracked.pidfd >= 0:  # the leader is reaped: its pidfd is no longer needed
            os.close(tracked.pidfd)
            tracked.pidfd = -1
        if not self._group_alive(tracked):
            self._untrack(tracked)

    async def _kill_one(self, tracked: _Tracked, grace_s: float) -> bool:
        """SIGTERM the tree, wait up to ``grace_s`` for the command, then SIGKILL everything and reap.

        Returns:
            True when the whole tree is known to be gone: its cgroup leaf (v2 or
            v1) is empty, its PID namespace died with its init, or its
            subreaper init ended the tree itself.  False when something of it
            may still run (a leaf still populated after :data:`_LEAF_EMPTY_WAIT_S`,
            or a subreaper init without a leaf that had to be SIGKILLed, or that
            died of a signal before (its command can send one where nothing
            keeps it from signalling its init), which orphans what it had not
            killed yet); the tree stays tracked when a
            leaf can still be killed again, and :meth:`kill_all` raises from
            then on.
        """
        if grace_s > 0 and tracked.process.returncode is None:
            self._signal(tracked, signal.SIGTERM)
            with trio.move_on_after(grace_s):
                await tracked.process.wait()
        if tracked.process.returncode is None and not tracked.pid_ns:
            # A subreaper init (no PID namespace): SIGUSR1 makes it kill its
            # tree before it exits; SIGKILL would orphan the tree instead.
            self._signal(tracked, signal.SIGUSR1)
            with trio.move_on_after(1.0):
                await tracked.process.wait()
        orphans = (tracked.process.returncode is None and not tracked.pid_ns
                   and tracked.leaf is None and tracked.pids_leaf is None)
        self._signal(tracked, signal.SIGKILL)
        if tracked.leaf is not None:
            CgroupTree.kill(tracked.leaf)
        await tracked.process.wait()
        gone = not orphans and not self._init_died_unended(tracked)
        polls = max(1, int(_LEAF_EMPTY_WAIT_S / _LEAF_POLL_S))
        if tracked.leaf is not None:
            for _ in range(polls):
                if not CgroupTree.populated(tracked.leaf):
                    break
                await trio.sleep(_LEAF_POLL_S)
            gone = not CgroupTree.populated(tracked.leaf)
        elif tracked.pids_leaf is not None:  # v1 has no cgroup.kill: signal what it lists
            for _ in range(polls):
                PidsV1Tree.kill(tracked.pids_leaf)
                if not PidsV1Tree.populated(tracked.pids_leaf):
                    break
                await trio.sleep(_LEAF_POLL_S)
            gone = not PidsV1Tree.populated(tracked.pids_leaf)
        if gone or (tracked.leaf is None and tracked.pids_leaf is None):
            self._untrack(tracked)  # a populated leaf stays tracked: the next kill_all kills it again
        if not gone:
            self._survivors = True  # whoever killed it (a run's timeout, a PTY, kill_all): kill_all raises
        return gone

    async def _mount_ns(self, rw_roots: list[Root], ro_binds: Sequence[Root] = (),
                        bind: tuple[list[str], list[int]] = ([], []),
                        reach: Sequence[Root] = ()) -> tuple[int, int, int, int] | None:
        """The supervisor's read-only mount namespace for these writable trees and read-only binds (made once).

        ``bind``: the ``--ro-tree``/``--pin-tree`` arguments for ``ro_binds``
        and their fds (see :func:`_ro_bind_args`; the caller closes them).
        ``reach``: the read-only trees the command must reach (``--reach-tree``).

        The helper making it also makes a network namespace (no network),
        which children join when their policy isolates the network (a fresh
        one per process costs ~2 ms to set up), and an IPC namespace every
        child joins.

        Returns ``(mntns_fd, userns_fd or -1, netns_fd or -1, ipcns_fd or -1)``
        owned by the supervisor, or
        None when holding is off or the namespace cannot be made (the helper
        then makes one per process).  Making a mount namespace is cheap; its
        teardown waits for an RCU grace period inside the exiting process,
        which delays every exit by milliseconds on a loaded machine.
        """
        if not self._hold_mount_ns or self._closed:
            return None
        key = (tuple(sorted(r.identity for r in rw_roots)), tuple(sorted(r.identity for r in ro_binds)),
               tuple(sorted(r.identity for r in reach)))
        async with self._ns_lock:
            if key in self._ns_fds:
                return self._ns_fds[key]
            fds = [r.fileno_dup() for r in rw_roots]
            ro_fds = [r.fileno_dup() for r in reach]
            status_r, status_w = os.pipe2(os.O_CLOEXEC)
            args = [_helper.helper_path(), "--status", str(status_w), "--ro-mounts"]
            for fd in fds:
                args += ["--rw-tree", str(fd)]
            bind_args, bind_fds = bind  # the caller's fds: passed, not closed here
            args += bind_args
            for fd in ro_fds:
                args += ["--reach-tree", str(fd)]
            for d in _mask_dirs(rw_roots):
                args += ["--mask", d]
            args += ["--unshare", str(NS_FLAGS["net"] | NS_FLAGS["ipc"]), "--hold-ns", "--", "true"]
            try:
                proc = await trio.lowlevel.open_process(
                    args, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    pass_fds=tuple(fds + ro_fds) + tuple(bind_fds) + (status_w,), env=_HELPER_ENV,
                    close_fds=True)
            except OSError:
                os.close(status_r)
                return None
            finally:
                for fd in fds + ro_fds + [status_w]:
                    os.close(fd)
            held = await _take_held_ns(proc, _Status(status_r))
            if held is not None:
                self._ns_fds[key] = held
            return held

    async def kill_all(self, *, grace_s: float = 0.0) -> None:
        """Kill every command tree and cgroup leaf started through this supervisor, and reap.

        Args:
            grace_s: seconds to wait after SIGTERM before SIGKILL (0: SIGKILL at once).

        Every tree is killed (and reaped) even when one of them fails.

        *Cancellation*: the kill runs shielded; a cancel arriving meanwhile is
        delivered at the next checkpoint after every process is gone.

        Raises:
            ConfinementError: something of a tree may have outlived the kill:
                its cgroup leaf was still populated :data:`_LEAF_EMPTY_WAIT_S`
                after ``cgroup.kill`` (a process stuck in the kernel), or a
                subreaper init without a PID namespace or leaf had to be
                SIGKILLed, or died of a signal (sent by its own command, say),
                before it ended its tree (its orphans run on).  Once
                raised, every later call raises it too: a caller that persists
                the workspace afterwards (:meth:`sandbox_fs.session.Session.aclose`)
                must not trust it to be at rest.
        """
        with trio.CancelScope(shield=True):
            await trio.lowlevel.checkpoint()
            for tracked in list(self._tracked):
                await self._kill_one(tracked, grace_s)
        if self._survivors:
            # Sticky: a tree that escaped once cannot be proved gone later (a subreaper's orphans
            # are nobody's to wait for), so whoever persists after this must not trust the kill.
            raise ConfinementError("processes of a confined command may have outlived the kill "
                                   "(a cgroup that stayed populated, or a tree without a PID namespace or cgroup "
                                   "whose init was killed)")

    async def aclose(self) -> None:
        """:meth:`kill_all`, then close the lifeline and remove the cgroup directory.  Idempotent.

        *Cancellation*: shielded like :meth:`kill_all`.

        Raises:
            ConfinementError: as :meth:`kill_all` (the supervisor is closed all the same).
        """
        try:
            await self.kill_all()
        finally:  # a kill that could not prove every tree gone still closes (and raises after)
            with self._lease_lock:
                self._closed = True
            self._finalizer()  # runs _release_resources once (the identity goes back after the kill)
            self._cg = None
            self._v1 = None

    async def __aenter__(self) -> "ProcessSupervisor":
        await trio.lowlevel.checkpoint()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class _ForeignChild:
    """The helper's init, forked with ``CLONE_PARENT``: our direct child, not a trio.Process.

    Waited for through a pidfd; reaped with ``waitpid`` (it is our child, so
    its pid cannot be reused before we reap it).  Its ``returncode`` is the
    *command's* status, which the init writes on the status pipe ("exit
    WSTATUS") just before it exits; the init's own status is used only when
    that line is missing (the init was killed).

    Attributes:
        pid: the init's pid (in our PID namespace).
        pid_ns: the init is pid 1 of a PID namespace of its own (else a
            child subreaper).
        init_signalled: once reaped, the init itself died of a signal (so a
            subreaper init did not end its tree).
    """

    def __init__(self, pid: int, pid_ns: bool, status: "_Status | None" = None) -> None:
        self.pid = pid
        self.pid_ns = pid_ns
        self._status = status
        self._pidfd = os.pidfd_open(pid)
        self._returncode: int | None = None
        #: the init itself died of a signal (it did not end its tree: it does that only before exiting)
        self.init_signalled = False
        self._lock = trio.Lock()

    def _reap(self, flags: int) -> None:
        try:
            wpid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:  # pragma: no cover - someone else reaped it
            wpid, status = self.pid, 255 << 8
        if wpid == self.pid:
            code = os.waitstatus_to_exitcode(status)
            self.init_signalled = os.WIFSIGNALED(status)
            reported = None
            if self._status is not None:
                reported = self._status.take_exit()
                self._status.close()  # nothing more can come: every writer is gone
            self._returncode = os.waitstatus_to_exitcode(reported) if reported is not None else code
            if self._pidfd >= 0:
                trio.lowlevel.notify_closing(self._pidfd)
                os.close(self._pidfd)
                self._pidfd = -1

    @property
    def returncode(self) -> int | None:
        if self._returncode is None:
            self._reap(os.WNOHANG)
        return self._returncode

    async def wait(self) -> int:
        async with self._lock:
            while self.returncode is None:
                try:
                    await trio.lowlevel.wait_readable(self._pidfd)
                except trio.ClosedResourceError:
                    pass  # reaped meanwhile by a returncode poll
        assert self._returncode is not None
        return self._returncode
