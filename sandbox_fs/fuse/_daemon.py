"""The overlay daemon: ``python -m sandbox_fs.fuse._daemon FD``, one FUSE mount per process.

``FD`` is the daemon's end of the control socketpair
(:mod:`sandbox_fs.fuse._protocol`).  The first message is ``config``: the
policy, the mounts, and their fds (the workspace's ``O_PATH`` directory fd,
then one per mount).  The daemon then:

1. raises its ``RLIMIT_NOFILE`` soft and hard limits (to ``fs.nr_open``, at
   most 2**20): every inode the kernel knows holds one ``O_PATH`` fd, and
   past :func:`handle_budget` of the limit the least recently used are
   closed and reopened by name when next used (``_inodes``);
2. measures the workspace's usage for the quota;
3. opens ``/dev/fuse`` and makes a *detached* mount (``fsopen("fuse")``,
   ``fsconfig`` with ``allow_other`` and ``default_permissions``,
   ``fsmount`` always ``nosuid`` and ``nodev``): attached nowhere, so it
   appears in no mount table and dissolves when the last fd on it closes;
4. drops every capability serving does not need (:func:`drop_capabilities`:
   CAP_SYS_ADMIN and the rest go, from every set, bounding included);
5. freezes its start-up heap out of the garbage collector's scans
   (:func:`freeze_startup_heap`), sends ``ready`` with the mount fd and the
   measured usage, then the config reply;
6. serves ``pyfuse3.main()`` (one worker task, see ``_loop``) and the
   control channel side by side, raises the mount's read-ahead, and closes
   its own copy of the mount fd.

It exits when the control socket reaches EOF (the host closed it or died),
on ``shutdown``, or when the mount is gone (every fd on it closed).  A
parent-death signal is not used: the host spawns it from a trio worker
thread, and ``PR_SET_PDEATHSIG`` fires when that *thread* exits.

Invalidation runs on one dedicated thread (:class:`Invalidator`): the
``invalidate_*`` calls can deadlock when made from a request handler.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import queue
import resource
import socket
import sys
import threading
from typing import Any

import pyfuse3
import trio

from .. import _native
from ..root import Root
from . import _loop, _protocol
from ._audit import ENVELOPE_BYTES as AUDIT_ENVELOPE_BYTES
from ._audit import AuditLog
from ._audit import to_wire as audit_to_wire
from ._faults import FaultRule, FaultRules
from ._inodes import ROOT_INODE, InodeTable, Tree
from ._ops import OverlayOps
from ._quota import Quota
from ._rules import OverlayPolicy

log = logging.getLogger("sandbox_fs.fuse.daemon")

NOFILE_MAX = 1 << 20
"""The most ``RLIMIT_NOFILE`` the daemon asks for."""

FD_RESERVE = 4096
"""fds the inode table leaves free of its handles, for open files, directory streams
(``_ops.MAX_DIR_STREAMS``), the new entries of one readdirplus reply and the daemon's own fds."""


def handle_budget(nofile: int) -> int:
    """Most inode handles kept after a request under an ``RLIMIT_NOFILE`` of ``nofile`` (at least half of it)."""
    return max(nofile // 2, nofile - FD_RESERVE)


READ_AHEAD_KB = 1024
"""Read-ahead of the mount, in KiB (the kernel's default 128 gave 0.85 GiB/s through the daemon, this 1.5)."""

AUDIT_BATCH = 2000
"""Most audit events drained into one ``audit`` message (fewer when their size needs it)."""

MOUNT_ATTRS = _native.MOUNT_ATTR_NOSUID | _native.MOUNT_ATTR_NODEV
"""The mount's attributes, for every policy (see :func:`make_mount`)."""


def raise_nofile() -> int:
    """Raise this process's ``RLIMIT_NOFILE`` as far as allowed; returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        # host-access: a kernel sysctl (procfs, root-owned), no workspace or host-source path
        with open("/proc/sys/fs/nr_open") as f:
            ceiling = min(int(f.read()), NOFILE_MAX)
    except (OSError, ValueError):
        ceiling = hard
    for limit in (max(hard, ceiling), hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
            return limit
        except (OSError, ValueError):
            continue
    return soft


def _check(ret: int, what: str) -> int:
    if ret < 0:
        raise OSError(-ret, f"{what}: {os.strerror(-ret)}")
    return ret


def make_mount(dev_fd: int) -> int:
    """A detached FUSE mount served through ``dev_fd``; returns its ``O_PATH`` mount fd.

    Always ``nosuid`` and ``nodev``, whatever the policy: the daemon makes
    the device nodes a policy allows (``"chr"``, ``"blk"``) with its own
    privilege, so on this mount such a node is an entry only (stat, list,
    rename, unlink), and opening it fails with EACCES; every clone of the
    mount (a confined command's private root) keeps both flags.

    Raises:
        OSError: EPERM without CAP_SYS_ADMIN, or any other fsopen/fsconfig/fsmount failure.
    """
    fs_fd = _check(_native.fsopen(b"fuse", _native.FSOPEN_CLOEXEC), "fsopen")
    try:
        for key, value in ((b"fd", str(dev_fd).encode()), (b"rootmode", b"40000"),
                           (b"user_id", b"0"), (b"group_id", b"0")):
            _check(_native.fsconfig_string(fs_fd, key, value), "fsconfig")
        for flag in (b"default_permissions", b"allow_other"):
            _check(_native.fsconfig_flag(fs_fd, flag), "fsconfig")
        _check(_native.fsconfig_create(fs_fd), "fsconfig create")
        return _check(_native.fsmount(fs_fd, _native.FSMOUNT_CLOEXEC, MOUNT_ATTRS), "fsmount")
    finally:
        os.close(fs_fd)


SERVING_CAPS = (_native.CAP_CHOWN, _native.CAP_FOWNER, _native.CAP_DAC_OVERRIDE, _native.CAP_DAC_READ_SEARCH)
"""What serving needs: creates chown to the requester, chmod/utimens/links of others' files,
access to every backing entry, and ``linkat(AT_EMPTY_PATH)`` (hard links from an ``O_PATH`` fd)."""


def capabilities_kept(policy: OverlayPolicy) -> int:
    """The capability bit mask the daemon keeps: SERVING_CAPS, plus CAP_MKNOD where devices are allowed."""
    keep = 0
    for cap in SERVING_CAPS:
        keep |= 1 << cap
    if policy.allow_special & {"chr", "blk"}:
        keep |= 1 << _native.CAP_MKNOD
    return keep


def drop_capabilities(policy: OverlayPolicy) -> None:
    """Keep only :func:`capabilities_kept` in every capability set (bounding, ambient, inheritable too).

    Capabilities are per thread, so this runs while the daemon has its one
    thread (before the invalidation thread and any worker thread start);
    threads made later inherit the reduced sets.

    Raises:
        OSError: EBUSY, another thread exists already; or the capset/prctl errno.
    """
    try:
        # host-access: our own process's task list (procfs), no workspace path
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        threads = threading.active_count()
    if threads != 1:
        raise OSError(errno.EBUSY, "capabilities are per thread: dropped before any other thread starts")
    _check(_native.drop_capabilities(capabilities_kept(policy)), "capability drop")


async def tune_readahead(mount_fd: int) -> None:
    """Raise the mount's read-ahead to READ_AHEAD_KB (best effort, as root), then close ``mount_fd``.

    The mount's device number needs a ``fstat`` of the mount, which the
    daemon itself answers: so it is made from a worker thread, once
    ``pyfuse3.main()`` serves (never block on the mount from the trio thread).
    """
    try:
        st = await trio.to_thread.run_sync(os.fstat, mount_fd, abandon_on_cancel=True)
        bdi = f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/read_ahead_kb"
        # host-access: the mount's own sysfs bdi knob (root-owned), built from st_dev, not from a name
        with open(bdi, "w") as f:
            f.write(str(READ_AHEAD_KB))
    except OSError:
        pass
    finally:
        os.close(mount_fd)


def freeze_startup_heap() -> None:
    """Move every object alive now (modules, pydantic, trio, pyfuse3: ~36,000) out of the collector's reach.

    They live as long as the daemon, yet every full collection scanned them
    again, and full collections come often here: each inode the kernel
    learns adds long-lived objects (its ``Inode``, handle, dentry set).
    Measured side by side (5 cold lstat and 5 cold ``ls -lR`` passes over
    10,000 files): 0.36 s of full collections without, 0.09 s with; the
    daemon's CPU per lstat pass 0.49 -> 0.40 s.  Objects made later are
    collected as before.
    """
    gc.freeze()


class Invalidator:
    """The one thread that calls ``pyfuse3.invalidate_entry`` / ``invalidate_inode``.

    Jobs are lists of ``("entry", parent ino, name)`` and ``("inode", ino,
    attr_only)``; :meth:`run` returns once the kernel processed all of them.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="sfs-invalidate", daemon=True)
        self._thread.start()

    async def run(self, jobs: list[tuple[str, int, Any]]) -> int:
        """Invalidate ``jobs`` on the thread; returns how many failed (other than ENOENT).

        Cancellation: the thread still completes the jobs; nothing is reported.
        """
        if not jobs:
            return 0
        done = trio.Event()
        box: dict[str, int] = {}
        self._jobs.put((jobs, trio.lowlevel.current_trio_token(), done, box))
        await done.wait()
        return box.get("failed", 0)

    def _loop(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            jobs, token, done, box = item
            failed = 0
            for kind, a, b in jobs:
                try:
                    if kind == "entry":
                        pyfuse3.invalidate_entry(a, b)
                    else:
                        pyfuse3.invalidate_inode(a, attr_only=b)
                except OSError as e:
                    if e.errno != errno.ENOENT:
                        failed += 1
            box["failed"] = failed
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:
                return

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop the thread; True when it ended within ``timeout_s`` seconds."""
        self._jobs.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


class Daemon:
    """One overlay daemon: its tables, policy state and control channel."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.ops: OverlayOps | None = None
        self.invalidator: Invalidator | None = None
        self.roots: list[Root] = []
        self.dev_fd = -1
        self.staged_faults: list[FaultRule] = []

    # ------------------------------------------------------------ channel

    async def recv(self) -> tuple[dict[str, Any], list[int]] | None:
        while True:
            try:
                return _protocol.recv(self.sock)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.sock)
            except (ConnectionResetError, BrokenPipeError):
                return None

    async def send(self, msg: dict[str, Any], fds: list[int] | tuple[int, ...] = ()) -> None:
        while True:
            try:
                _protocol.send(self.sock, msg, fds)
                return
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self.sock)

    # ------------------------------------------------------------- config

    def configure(self, op: dict[str, Any], fds: list[int]) -> tuple[int, dict[str, int]]:
        """Build the trees, tables and the mount from ``config``, then drop capabilities; returns ``(mount fd, usage)``.

        Raises:
            OSError: the mount could not be made (EPERM: no privilege), a
                tree's fd is not a directory, or the capability drop failed.
            ValueError: the config is malformed.
        """
        policy = OverlayPolicy.model_validate(op["policy"])
        mounts_cfg = list(op.get("mounts", []))
        if len(fds) != 1 + len(mounts_cfg):
            raise ValueError("config carries the wrong number of fds")
        resolver = _native.choose_resolver()
        ws_ro = bool(op.get("read_only", False)) or policy.read_only
        for ro in [ws_ro] + [bool(m["read_only"]) or policy.read_only for m in mounts_cfg]:
            # the Root owns the fd from the call on (closed by it on an error): out of ``fds``, which
            # the caller closes on an error, first
            self.roots.append(Root(fds.pop(0), read_only=ro, no_symlinks=False, resolver=resolver, label=""))
        workspace = Tree(0, self.roots[0], ws_ro, False, policy.entry_timeout_s, policy.attr_timeout_s)
        mounts: dict[str, Tree] = {}
        for i, m in enumerate(mounts_cfg, 1):
            path = "/".join(p for p in str(m["path"]).split("/") if p not in ("", "."))
            mounts[path] = Tree(i, self.roots[i], bool(m["read_only"]) or policy.read_only, True,
                                policy.shared_timeout_s, policy.shared_timeout_s, mount_path=path)
        quota = Quota()
        root_handle = self.roots[0].handle(".")
        quota.measure(root_handle)
        quota.set_limits(policy.max_bytes, policy.max_inodes)
        table = InodeTable(root_handle, workspace)
        table.max_held = handle_budget(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        self.ops = OverlayOps(table, policy, mounts, AuditLog(policy.audit_capacity), FaultRules(), quota)
        # host-access: the FUSE device node (devtmpfs, root-owned), no workspace path
        self.dev_fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        mount_fd = make_mount(self.dev_fd)
        try:
            drop_capabilities(policy)
        except BaseException:
            os.close(mount_fd)
            raise
        return mount_fd, {"bytes": quota.bytes, "inodes": quota.inodes}

    # ------------------------------------------------------------ control

    async def handle(self, op: dict[str, Any]) -> dict[str, Any]:
        """One control op -> its result (``{"ok": true, ...}`` or ``{"ok": false, "errno", "reason"}``)."""
        assert self.ops is not None
        kind = op.get("op")
        try:
            if kind == "invalidate":
                return await self.invalidate(op)
            if kind == "faults":
                rules = self.stage_faults(op)
                if rules is None:
                    pass
                elif rules:
                    self.ops.faults.set(rules)
                else:
                    self.ops.faults.clear()
            elif kind == "quota":
                self.ops.quota.set_limits(op.get("max_bytes"), op.get("max_inodes"))
            elif kind == "usage":
                return {"ok": True, "bytes": self.ops.quota.bytes, "inodes": self.ops.quota.inodes}
            elif kind == "audit":
                await self.flush_audit()
            elif kind == "shutdown":
                pass
            else:
                return {"ok": False, "errno": errno.EINVAL, "reason": f"unknown op {kind!r}"}
        except (ValueError, TypeError, KeyError) as e:
            return {"ok": False, "errno": errno.EINVAL, "reason": f"bad {kind} request: {type(e).__name__}"}
        except OSError as e:
            return {"ok": False, "errno": e.errno or errno.EIO, "reason": f"{kind} failed"}
        return {"ok": True}

    def stage_faults(self, op: dict[str, Any]) -> list[FaultRule] | None:
        """The rule set a ``faults`` op completes, or None while chunks of a split one are still coming.

        A large rule set arrives as several ops (``"part": 0, 1, ...``, all but
        the last with ``"more": true``); part 0 starts a new stage, so the
        rules are replaced once and atomically at the last chunk.

        Raises:
            ValueError: a rule is malformed (the stage is discarded).
        """
        if not op.get("part"):
            self.staged_faults = []
        try:
            self.staged_faults += [FaultRule.model_validate(r) for r in op.get("rules", [])]
        except ValueError:
            self.staged_faults = []
            raise
        if op.get("more"):
            return None
        rules, self.staged_faults = self.staged_faults, []
        return rules

    async def invalidate(self, op: dict[str, Any]) -> dict[str, Any]:
        assert self.ops is not None and self.invalidator is not None
        table = self.ops.table
        jobs: list[tuple[str, int, Any]] = []
        if op.get("all"):
            jobs += [("entry", p, n) for p, n, _ in table.dentries()]
            nodes = list(table.inodes())
        else:
            nodes = []
            for path in op.get("paths", []):
                if not isinstance(path, str):
                    raise TypeError("paths must be strings")
                found = table.resolve(path)
                if found is None:
                    if path.strip("/.") == "":
                        nodes.append(table.get(ROOT_INODE))
                    continue
                parent, name, node = found
                jobs.append(("entry", parent, name))
                jobs.append(("inode", parent, True))
                if node is not None:
                    nodes.append(node)
        attrs_only = bool(op.get("attrs_only"))
        if attrs_only:  # no entry: d_invalidate would detach the binds on it (other runs' protected paths)
            jobs = []
        for node in nodes:
            # an open file keeps its pages until its next open (PLATFORM.md §9)
            if node.opens and not attrs_only:
                node.data_stale = True
            jobs.append(("inode", node.ino, attrs_only or bool(node.opens)))
        failed = await self.invalidator.run(jobs)
        return {"ok": True, "invalidated": len(jobs), "failed": failed}

    async def flush_audit(self) -> None:
        """Send every buffered audit event now, as ``audit`` messages (tag 0), each one datagram.

        A batch is bounded by what the socket can send in one datagram
        (:func:`_protocol.max_datagram`), and leaves the buffer only once
        sent: a failed send puts it back (:meth:`AuditLog.requeue`).  A
        batch too large anyway (EMSGSIZE) is retried at half the size; one
        event that cannot be sent alone is counted as dropped, never lost
        silently.

        Raises:
            OSError: the socket failed (the batch is back in the buffer).
        """
        assert self.ops is not None
        audit = self.ops.audit
        budget = _protocol.max_datagram(self.sock) - AUDIT_ENVELOPE_BYTES
        while True:
            events, dropped = audit.drain(AUDIT_BATCH, max_wire_bytes=budget)
            if not events and not dropped:
                return
            try:
                await self.send(audit_to_wire(events, dropped))
            except (OSError, _protocol.ProtocolError) as e:
                too_big = isinstance(e, _protocol.ProtocolError) or e.errno == errno.EMSGSIZE
                if too_big and len(events) == 1:
                    audit.requeue([], dropped + 1)
                    continue
                audit.requeue(events, dropped)
                if not too_big:
                    raise
                budget = max(1, budget // 2)
                continue
            if not len(audit):
                return

    async def control(self) -> None:
        """Serve control requests until EOF or ``shutdown``."""
        while True:
            got = await self.recv()
            if got is None:
                return
            msg, fds = got
            for fd in fds:
                os.close(fd)
            ops = msg.get("ops")
            if not isinstance(ops, list):
                await self.send({"tag": msg["tag"], "results": [], "error": "no ops"})
                continue
            results = [await self.handle(op) if isinstance(op, dict) else
                       {"ok": False, "errno": errno.EINVAL, "reason": "op is not an object"} for op in ops]
            await self.send({"tag": msg["tag"], "results": results})
            if any(isinstance(op, dict) and op.get("op") == "shutdown" for op in ops):
                return

    # -------------------------------------------------------------- serve

    async def serve(self) -> int:
        """Configure, mount, serve; returns the exit status."""
        got = await self.recv()
        if got is None:
            return 0
        msg, fds = got
        ops = msg.get("ops") or [{}]
        try:
            if ops[0].get("op") != "config":
                raise ValueError("the first message must be config")
            mount_fd, usage = self.configure(ops[0], fds)
            freeze_startup_heap()
        except Exception as e:
            for fd in fds:
                os.close(fd)
            err = e.errno if isinstance(e, OSError) and e.errno else errno.EINVAL
            await self.send({"tag": msg["tag"], "results": [
                {"ok": False, "errno": err, "reason": f"setup failed ({errno.errorcode.get(err, err)})",
                 "detail": f"{type(e).__name__}: {e}"}]})
            return 1
        assert self.ops is not None
        os.set_inheritable(self.dev_fd, True)
        pyfuse3.init(self.ops, f"/dev/fd/{self.dev_fd}", set())
        self.invalidator = Invalidator()
        try:
            await self.send({"tag": 0, "event": "ready", "usage": usage}, [mount_fd])
            await self.send({"tag": msg["tag"], "results": [{"ok": True}]})
        except BaseException:
            os.close(mount_fd)
            raise
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._main_then_cancel, nursery.cancel_scope)
            nursery.start_soon(tune_readahead, mount_fd)
            await self.control()
            # terminate inside the nursery, close only after it (PLATFORM.md §3 gotcha 1)
            pyfuse3.terminate()
        if self.invalidator.stop():
            pyfuse3.close(unmount=False)
        self.ops.table.close()
        for root in self.roots:
            root.close()
        return 0

    async def _main_then_cancel(self, scope: trio.CancelScope) -> None:
        try:
            await _loop.serve()
        finally:
            scope.cancel()  # the mount is gone: stop serving the channel too


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m sandbox_fs.fuse._daemon FD``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit():
        print("usage: python -m sandbox_fs.fuse._daemon FD", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="sfs-overlay: %(levelname)s %(message)s")
    raise_nofile()
    sock = socket.socket(fileno=int(args[0]))
    sock.setblocking(False)
    try:
        return trio.run(Daemon(sock).serve)
    finally:
        sock.close()


if __name__ == "__main__":
    sys.exit(main())
