"""Preparing one run: the helper's command line and the fds it is handed (:class:`Prepared`).

:func:`prepare_run` is the one path of :func:`~sandbox_fs.exec.run_confined`
and :meth:`~sandbox_fs.exec.PtyManager.pty_exec_start`: the supervisor's
held mount namespace, the identity (and the workspace given to it), then
:func:`_prepare`, which builds the helper's arguments step by step, in the
order the helper documents them.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

import trio

from ..errors import SandboxError
from ..paths import PathPolicy, normalize
from ..root import Root
from . import _helper, _identity, _landlock
from ._bounds import read_process_bounds
from ._coverage import MISSING_TEXT, TOLERATED_BY_REQUIRED, missing_protections, pid_namespace_expected
from ._cgroups import CgroupTree, PidsV1Tree
from ._devices import DeviceError, OpenedDevices, open_devices
from ._env import ensure_dirs, env_blob_fd
from ._egress import EgressChannel
from ._errors import ConfinementError
from ._grants import check_rw_grants, grant_roots, ro_grant_trees, rw_grant_trees
from ._helper import helper_or_raise, ro_mounts_available
from ._models import CLONE_NEWCGROUP, NS_FLAGS, ExecRequest, explicit_identity
from ._mounts import _mask_dirs, _ro_bind_args, _ro_binds, private_root_args
from ._protected import GuardPlan, plan_guards
from ._ruleset import build_ruleset
from ._violations import LOG_MIN_ABI, RESTRICT_SELF_LOG_FLAGS, AuditWatch
from ._seccomp import _SECCOMP_KEYS, _SECCOMP_TCP
from ._supervisor import ProcessSupervisor

#: The supervisor's held namespaces: ``(mntns_fd, userns_fd, netns_fd, ipcns_fd)``, -1 when absent.
HeldNamespaces = tuple[int, int, int, int]


@dataclass
class Prepared:
    """The helper's argv and the fds it gets, and what the run will report.

    Attributes:
        helper_argv: the helper's whole command line (the command after ``--``).
        env: the command's environment (handed over as a memfd).
        pass_fds: fds the helper inherits (closed here once it started).
        status_r: the read end of the helper's status pipe (-1 once taken).
        level: the confinement applied, ``"landlock"`` or ``"none"``.
        abi: the Landlock ABI used (0: none).
        leaf: the command's cgroup v2 leaf, if any.
        secrets: values never shown in errors.
        cwd_shown: the working directory as shown in errors.
        ro_mounts: the read-only mount layer applies.
        net_isolated: the command gets its own network namespace.
        pids_leaf: its cgroup v1 pids leaf, if any.
        process_bounds: see :attr:`ExecResult.process_bounds`.
        missing: see :attr:`ExecResult.missing`.
        identity: ``(uid, gid)`` the command runs as (None: the host's own).
        overlay: the command runs in its private root (``--private-root``).
        egress: the run's egress proxy channel (``allow_hosts``), or None.
        violations: the run's audit watch when its denials are reported.
    """

    helper_argv: list[str]
    env: dict[str, str]
    pass_fds: list[int]
    status_r: int
    level: str
    abi: int
    leaf: str | None
    secrets: tuple[str, ...]
    cwd_shown: str
    ro_mounts: bool = False
    net_isolated: bool = False
    pids_leaf: str | None = None
    process_bounds: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    identity: tuple[int, int] | None = None
    overlay: bool = False
    egress: EgressChannel | None = None
    guards: GuardPlan | None = None

    def release_guards(self) -> None:
        """Remove the placeholders made for protected paths (after the run, or when it never starts)."""
        if self.guards is not None:
            self.guards.release()
            self.guards = None
    violations: AuditWatch | None = None

    def pass_fd(self, fd: int) -> str:
        """Hand ``fd`` to the helper (closed here after the spawn); returns it as an argument."""
        self.pass_fds.append(fd)
        return str(fd)

    def close_child_fds(self) -> None:
        for fd in self.pass_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.pass_fds = []

    def close_all(self) -> None:
        self.close_child_fds()
        if self.egress is not None:
            self.egress.close()
        if self.violations is not None:
            self.violations.close()
        if self.status_r >= 0:
            os.close(self.status_r)
            self.status_r = -1

    def discard(self) -> None:
        """Undo a preparation that will not be spawned: its fds and cgroup leaves."""
        self.close_all()
        self.release_guards()
        if self.leaf is not None:
            CgroupTree.remove(self.leaf)
        if self.pids_leaf is not None:
            PidsV1Tree.remove(self.pids_leaf)


async def prepare_run(request: ExecRequest, supervisor: ProcessSupervisor) -> Prepared:
    """Everything before the spawn: held namespaces, the identity (in a worker thread), the arguments.

    Raises:
        ConfinementError, ExecError, InvalidEnvError: as for :func:`_ready_identity` and :func:`_prepare`.
        PathEscapeError, FileNotFoundError, NotADirectoryError: the cwd is not a directory beneath the workspace.
    """
    mount_ns = await _held_mount_ns(supervisor, request)
    ids, changed = await trio.to_thread.run_sync(_ready_identity, supervisor, request)
    if changed and request.private_root is not None and request.private_root.refresh is not None:
        await request.private_root.refresh()  # the view's cached attributes still name the old owners
    # The audit watch asks the kernel (AUDIT_GET): a sender can be made to wait
    # there while the audit backlog is full, so never on this thread.
    watch = (await trio.to_thread.run_sync(AuditWatch.open, request.policy.max_violations)
             if request.policy.report_violations and not request.tty else None)  # PTYs: not watched
    try:
        return _prepare(request, supervisor, mount_ns=mount_ns, identity=ids, violations=watch)
    except BaseException:
        if watch is not None:
            watch.close()
        raise


def _mount_layer_applies(request: ExecRequest, helper: str) -> bool:
    return (request.confinement != "none" and request.policy.read_only_mounts
            and ro_mounts_available(helper))


async def _held_mount_ns(sup: ProcessSupervisor, request: ExecRequest) -> HeldNamespaces | None:
    """The supervisor's read-only mount namespace for this run's trees (None: the helper makes one)."""
    if request.private_root is not None or not _mount_layer_applies(request, _helper.helper_path()):
        return None  # a private root is the command's own: made per run
    if request.policy.protected or request.policy.deny_read:
        return None  # protected paths are bound per run, in a namespace of the run's own
    if request.policy.devices or request.policy.device_families:
        return None  # granted device nodes are bound in a mount namespace of the run's own
    workspace, grants = request.workspace, request.grants
    ro = _ro_binds(workspace, grants)
    bind = _ro_bind_args(workspace, grants, ro)
    try:
        return await sup._mount_ns(rw_grant_trees(workspace, grants), ro, bind, ro_grant_trees(workspace, grants))
    finally:
        for fd in bind[1]:
            os.close(fd)


def _owner_hint(workspace: Root) -> int | None:
    """The workspace's owner uid (read on its fd): the id its last command ran as, when one of the range did."""
    try:
        return workspace.stat(".").st_uid
    except (OSError, SandboxError):
        return None


def _ready_identity(sup: ProcessSupervisor, request: ExecRequest) -> tuple[tuple[int, int] | None, int]:
    """``(ids, changed)``: the ``(uid, gid)`` the child runs as (None: the host's own), with the workspace given to it, and how many entries were re-owned.

    Blocking (lease, ownership walk): runs in a worker thread, once per run.
    On a root host the workspace root, ``.home``, ``.tmp`` and every entry
    beneath them not yet owned by the identity are re-owned (for the host's
    own uid 0: those an id of ``identity_range`` owns;
    :func:`sandbox_fs.exec._identity.reown_tree`, nested grants left alone).
    A read-only workspace is left as it is.

    With a private root (the overlay), ``request.workspace`` is the
    *backing* workspace, never the overlay's view: a walk through the view
    would descend into its mount entries (host directories, all on the
    FUSE mount's one st_dev, so neither the device check nor the nested
    grants' host ``(st_dev, st_ino)`` would stop it) and re-own them, and
    would meet EROFS in a read-only one.  In the backing workspace a mount
    entry is an empty placeholder directory; the walk never crosses to
    another st_dev or through a mount point (RESOLVE_NO_XDEV).  A
    read-write grant behind a mount entry is then judged as any read-write
    grant (:func:`check_rw_grants`: refused unless the identity owns it).

    Raises:
        ConfinementError: an explicit identity on a non-root host, no id to
            lease, or the workspace cannot be re-owned.
    """
    policy, confinement, workspace, grants = request.policy, request.confinement, request.workspace, request.grants
    ident = policy.identity
    is_root = os.geteuid() == 0
    ids: tuple[int, int] | None
    if ident == "host" or (ident == "auto" and (not is_root or confinement == "none")):
        ids = None
    elif ident == "auto":
        ids = sup._auto_identity(policy.identity_range, prefer=_owner_hint(workspace))
    else:
        ids = explicit_identity(ident)
        if not is_root:
            if ids == (os.geteuid(), os.getegid()):
                return None, 0
            raise ConfinementError("an explicit identity needs a root host")
    changed = 0
    if is_root and not workspace.read_only:
        # A uid-0 command without capabilities can only write what uid 0 owns: what an
        # identity of the range owned goes back to root for it.
        base, count = policy.identity_range
        try:
            ensure_dirs(workspace)
            changed = _identity.reown_tree(
                workspace, ids or (0, 0),
                skip_identities=frozenset(r.identity for r, _ro in grant_roots(grants)),
                only_uids=None if ids else range(int(base), int(base) + int(count)))
        except OSError as exc:
            raise ConfinementError("the workspace could not be given to the confined identity",
                                   context={"errno": errno.errorcode.get(exc.errno or 0, str(exc.errno))},
                                   diagnostic=str(exc)) from None
    return ids, changed


def _prepare(request: ExecRequest, supervisor: ProcessSupervisor, *, mount_ns: HeldNamespaces | None = None,
             identity: tuple[int, int] | None = None, violations: AuditWatch | None = None) -> Prepared:
    """The helper's command line for ``request``, with the fds it names (all closed again on failure).

    Args:
        request: the validated request.
        supervisor: makes the cgroup leaves and holds the lifeline.
        mount_ns: the supervisor's held namespaces (:func:`_held_mount_ns`), or None.
        identity: ``(uid, gid)`` from :func:`_ready_identity` (None: the host's own).
        violations: the run's open audit watch (``report_violations``), kept
            in :attr:`Prepared.violations` when a Landlock domain is made,
            closed otherwise.

    Raises:
        ConfinementError: the helper is missing; ``confinement="required"``
            and Landlock or every process-count bound is unavailable; a
            read-write grant the identity does not own; a nesting of grants
            that cannot be enforced.
        InvalidEnvError: the environment is over its bounds.
        ValueError: a negative rlimit, or a bad ``extra_sockets`` entry.
        PathEscapeError, FileNotFoundError, NotADirectoryError: the cwd.
    """
    helper = helper_or_raise(request.secrets)
    ensure_dirs(request.workspace)
    prep = Prepared([], dict(request.child_env), [], -1, "none", 0, None, request.secrets, request.cwd_shown,
                     identity=identity, violations=violations)
    try:
        args = [helper]
        args += _io_args(prep, request)
        args += _cgroup_args(prep, request, supervisor)
        args += read_process_bounds(prep, supervisor, request.policy, request.confinement, identity)
        # Supervision: the command runs under the helper's init (a PID
        # namespace of its own when one can be made), which the supervisor's
        # lifeline ends when the supervisor or this process goes away.
        pid_ns = pid_namespace_expected(os.geteuid() == 0 or ro_mounts_available(helper))
        args += ["--init" if pid_ns else "--no-pid-ns", "--lifeline", prep.pass_fd(supervisor._lifeline_fd())]
        args += _privilege_args(prep, request)
        flags = 0
        for ns in request.policy.namespaces:
            flags |= NS_FLAGS[ns]
        if request.confinement != "none":
            devices = _open_devices(prep, request)
            args += _landlock_args(prep, request, helper, devices)
            layer_args, flags = _mount_layer(prep, request, helper, mount_ns, flags)
            args += layer_args
            if devices is not None:
                args += _device_args(prep, request, devices)
            args += _seccomp_args(prep, request)
            args += _egress_args(prep, request)
        elif request.private_root is not None:
            args += _private_root_args(prep, request)
        if flags:
            args += ["--unshare", str(flags)]
        _check_missing(prep, request, pid_ns)
        if prep.violations is not None and "--domain-tag" not in args:
            prep.violations.close()  # no Landlock domain to watch (confinement "none", ABI < 7)
            prep.violations = None
        prep.helper_argv = args + ["--", *request.command]
        return prep
    except BaseException:
        prep.discard()
        raise


def _check_missing(prep: Prepared, request: ExecRequest, pid_ns: bool) -> None:
    """Set ``prep.missing``; under ``confinement="required"`` refuse a run missing a protection it needs.

    Raises:
        ConfinementError: ``"required"`` and an entry of
            :func:`missing_protections` other than the tolerated ones.
    """
    prep.missing = missing_protections(request, prep, pid_namespace=pid_ns)
    fatal = [k for k in prep.missing if k not in TOLERATED_BY_REQUIRED]
    if fatal and request.confinement == "required":
        raise ConfinementError("this host cannot give the run every protection its policy asks for ("
                               + "; ".join(MISSING_TEXT[k] for k in fatal) + "); confinement='required' fails closed",
                               context={"missing": ",".join(fatal)}, secrets=prep.secrets)


def _io_args(prep: Prepared, request: ExecRequest) -> list[str]:
    """The status pipe, the environment memfd, the working directory's fd."""
    status_r, status_w = os.pipe2(os.O_CLOEXEC)
    prep.status_r = status_r
    args = ["--status", prep.pass_fd(status_w)]
    args += ["--env-fd", prep.pass_fd(env_blob_fd(prep.env, prep.secrets))]
    cwd, grants, workspace = request.cwd, request.grants, request.workspace
    root, rel = workspace, cwd
    if isinstance(grants, PathPolicy) and cwd.startswith("/"):
        resolved = grants.resolve(cwd)
        root, rel = resolved.root, resolved.rel
    cwd_fd = root.open_dir_fd(rel or ".")
    args += ["--cwd", prep.pass_fd(cwd_fd)]
    if request.private_root is not None and root.identity == workspace.identity:
        # In the private root the workspace is the overlay at workspace_path: the
        # helper resolves the same sandbox path beneath it (RESOLVE_BENEATH).
        args += ["--cwd-rel", normalize(rel) if rel else ""]
    return args


def _cgroup_args(prep: Prepared, request: ExecRequest, supervisor: ProcessSupervisor) -> list[str]:
    """The command's cgroup v2 leaf (none without a cgroup tree or with ``use_cgroup=False``)."""
    policy = request.policy
    leaf = supervisor._new_leaf(policy.pids_max) if policy.use_cgroup else None
    if leaf is None:
        return []
    prep.leaf = leaf
    leaf_fd = os.open(leaf, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)  # host-access: cgroupfs (kernel interface)
    return ["--cgroup", prep.pass_fd(leaf_fd)]


def _privilege_args(prep: Prepared, request: ExecRequest) -> list[str]:
    """rlimits, the PTY, capabilities, and the identity switch."""
    policy = request.policy
    args = policy.rlimit_args()
    if request.tty:
        args.append("--tty")
    if policy.drop_capabilities and os.geteuid() == 0:
        args.append("--drop-caps")
    if prep.identity is not None:
        check_rw_grants(request.grants, prep.identity, prep.secrets)
        args += ["--uid", str(prep.identity[0]), "--gid", str(prep.identity[1])]
    return args


def _landlock_args(prep: Prepared, request: ExecRequest, helper: str,
                   devices: OpenedDevices | None = None) -> list[str]:
    """The Landlock ruleset's fd (and ``/proc/self``), or nothing where the kernel has no Landlock."""
    version = _landlock.abi()
    if version <= 0:
        if request.confinement == "required":
            raise ConfinementError("Landlock is not available on this kernel; "
                                   "confinement='required' fails closed", secrets=prep.secrets)
        return []
    private_root = request.private_root
    ruleset = build_ruleset(request.workspace, request.grants, request.policy, tty=request.tty, abi=version,
                            read_only_binds=private_root is not None or (
                                request.policy.read_only_mounts and ro_mounts_available(helper)),
                            workspace_fd=private_root.workspace_fd if private_root is not None else None)
    if devices is not None:
        _device_rules(ruleset, devices, version)
    prep.level, prep.abi = "landlock", version
    args = ["--ruleset", prep.pass_fd(ruleset.fd), "--proc-self", str(_landlock.FS_READ_FILE | _landlock.FS_READ_DIR)]
    if private_root is not None:  # its /tmp exists only in the command's root: the helper adds its rule
        args += ["--tmp-access", str(_landlock.fs_read_write(version))]
    args += _violation_args(prep, request, version)
    return args


def _open_devices(prep: Prepared, request: ExecRequest) -> OpenedDevices | None:
    """The policy's device nodes and driver-family paths, opened (their fds handed to the helper), or None."""
    policy = request.policy
    if not policy.devices and not policy.device_families:
        return None
    devices = open_devices(policy.devices, policy.device_families)
    prep.pass_fds.extend(fd for fd, *_ in (*devices.nodes, *devices.read_paths))  # closed after the spawn
    return devices


def _device_rules(ruleset: _landlock.Ruleset, devices: OpenedDevices, abi: int) -> None:
    """Landlock rules on exactly the granted nodes and family paths (the ruleset is closed on failure)."""
    try:
        devices.add_rules(ruleset, abi)
    except OSError as exc:
        ruleset.close()
        raise DeviceError("the kernel refused a Landlock rule for a granted device",
                          context={"errno": errno.errorcode.get(exc.errno or 0, str(exc.errno))}) from None


def _device_args(prep: Prepared, request: ExecRequest, devices: OpenedDevices) -> list[str]:
    """``--device FD`` per node where a mount layer applies; in a private root the family paths too."""
    if not prep.ro_mounts:
        return []  # no mount namespace of ours: the host's mounts decide, Landlock grants the nodes
    args: list[str] = []
    for fd, _path in devices.nodes:
        args += ["--device", str(fd)]
    if request.private_root is not None:
        for fd, path, is_dir in devices.read_paths:
            if path.startswith("/proc/"):
                args += ["--proc-read", path]  # the command's own /proc instance: its own inodes
            elif is_dir:
                args += ["--sys-tree", str(fd)]  # bound read-only at its path, as the system set
    return args


def _violation_args(prep: Prepared, request: ExecRequest, version: int) -> list[str]:
    """Landlock denial logging for :attr:`ConfinementPolicy.report_violations` (ABI >= 7, audit on).

    The domain is tagged (its creator's comm) so the run's audit watch can
    tell its records from every other domain's; nothing when the kernel or
    the audit subsystem cannot report (the run then says it did not observe).
    """
    watch = prep.violations  # opened by prepare_run (None: not asked for, or audit cannot report)
    if watch is None or version < LOG_MIN_ABI:
        return []
    return ["--ruleset-flags", str(RESTRICT_SELF_LOG_FLAGS), "--domain-tag", watch.tag]


def _mount_layer(prep: Prepared, request: ExecRequest, helper: str, mount_ns: HeldNamespaces | None,
                 flags: int) -> tuple[list[str], int]:
    """The read-only mount layer's arguments, and the ``--unshare`` flags grown by what it allows.

    Namespaces are made after the mount layer: on an unprivileged host,
    inside its user namespace.  IPC: the host's System V segments,
    semaphores and message queues; cgroup: the child sees its leaf as the
    root (with cgroupfs hidden by ``--mask``).
    """
    policy = request.policy
    isolate = (policy.isolate_network and not policy.unrestricted_tcp
               and not policy.allow_tcp_connect and not policy.allow_tcp_bind)
    held_net = held_ipc = False
    args: list[str] = []
    if request.private_root is not None:
        args = _private_root_args(prep, request)
    elif policy.read_only_mounts and ro_mounts_available(helper):
        if mount_ns is not None:
            # egress: a namespace of the command's own, for the proxy's listener
            args, held_net, held_ipc = _held_ns_args(prep, mount_ns, isolate and not policy.allow_hosts, flags)
        else:
            args = _fresh_mount_layer_args(prep, request)
        prep.ro_mounts = True
    if os.geteuid() == 0 or prep.ro_mounts:
        if not held_ipc:
            flags |= NS_FLAGS["ipc"]
        if isolate and not held_net:
            flags |= NS_FLAGS["net"]
        if prep.leaf is not None:
            flags |= CLONE_NEWCGROUP
    prep.net_isolated = held_net or bool(flags & NS_FLAGS["net"])
    if (policy.protected or policy.deny_read) and not prep.ro_mounts and request.confinement == "required":
        raise ConfinementError("protected paths need the mount layer, which is unavailable or turned off",
                               sandbox_path=None)
    return args, flags


def _held_ns_args(prep: Prepared, mount_ns: HeldNamespaces, isolate: bool,
                  flags: int) -> tuple[list[str], bool, bool]:
    """Join the supervisor's held namespaces; returns ``(args, joined its net ns, joined its IPC ns)``."""
    mnt_fd, user_fd, net_fd, ipc_fd = mount_ns
    args = ["--mntns", prep.pass_fd(os.dup(mnt_fd))]
    if user_fd >= 0:
        args += ["--userns", prep.pass_fd(os.dup(user_fd))]
    held_net = isolate and net_fd >= 0 and not flags & NS_FLAGS["net"]
    if held_net:
        args += ["--netns", prep.pass_fd(os.dup(net_fd))]
    held_ipc = ipc_fd >= 0 and not flags & NS_FLAGS["ipc"]
    if held_ipc:
        args += ["--ipcns", prep.pass_fd(os.dup(ipc_fd))]
    return args, held_net, held_ipc


def _fresh_mount_layer_args(prep: Prepared, request: ExecRequest) -> list[str]:
    """A mount layer of the command's own: its writable trees, read-only binds, reachable trees, masks."""
    workspace, grants = request.workspace, request.grants
    args = ["--ro-mounts"]
    trees = rw_grant_trees(workspace, grants)
    for tree in trees:
        args += ["--rw-tree", prep.pass_fd(tree.fileno_dup())]
    bind_args, bind_fds = _ro_bind_args(workspace, grants)
    prep.pass_fds.extend(bind_fds)
    args += bind_args
    for tree in ro_grant_trees(workspace, grants):
        args += ["--reach-tree", prep.pass_fd(tree.fileno_dup())]
    for d in _mask_dirs(trees):
        args += ["--mask", d]
    return args + _guard_args(prep, request, [(t, None) for t in trees])


def _guard_args(prep: Prepared, request: ExecRequest, trees: list[tuple[Root, str | None]]) -> list[str]:
    """``--guard`` arguments for the policy's protected and unreadable paths (the plan kept in ``prep``)."""
    policy = request.policy
    if not (policy.protected or policy.deny_read) or not trees:
        return []
    prep.guards = plan_guards(trees, policy.protected, policy.deny_read, prep.pass_fd, owner=prep.identity)
    return prep.guards.args


def _private_root_args(prep: Prepared, request: ExecRequest) -> list[str]:
    """The command's own root (:class:`PrivateRoot`): the overlay, the system trees, the grants."""
    assert request.private_root is not None
    args, fds = private_root_args(request.private_root, request.workspace, request.grants)
    prep.pass_fds.extend(fds)
    prep.ro_mounts = prep.overlay = True
    policy = request.policy
    if policy.protected or policy.deny_read:
        ws = request.workspace
        trees: list[tuple[Root, str | None]] = []
        if not ws.read_only:  # the workspace as the command sees it: through the overlay's mount
            trees.append((Root(os.dup(request.private_root.workspace_fd), read_only=False, no_symlinks=False,
                               resolver=ws.resolver, label=""), "w"))
        trees += [(r, None) for r, ro in grant_roots(request.grants) if not ro]
        try:
            args += _guard_args(prep, request, trees)
        finally:
            if trees and trees[0][1] == "w":
                if prep.guards is not None:
                    prep.guards.roots.append(trees[0][0])
                else:
                    trees[0][0].close()
    return args


def _seccomp_args(prep: Prepared, request: ExecRequest) -> list[str]:
    """The seccomp bits and the socket allow-list (see :mod:`sandbox_fs.exec._seccomp`)."""
    bits = _SECCOMP_KEYS
    if not prep.net_isolated and not request.policy.unrestricted_tcp:
        bits |= _SECCOMP_TCP
    return ["--seccomp", str(bits)] + request.policy.socket_args()


def _egress_args(prep: Prepared, request: ExecRequest) -> list[str]:
    """With ``allow_hosts``: the proxy's listener in the command's own network namespace.

    Raises:
        ConfinementError: the command gets no network namespace of its own
            (a non-root host without user namespaces): its connect rule for
            the proxy's port would then reach the host's loopback.
    """
    if not request.policy.allow_hosts:
        return []
    if not prep.net_isolated:
        raise ConfinementError("allow_hosts needs a network namespace of the command's own, "
                               "which this host cannot make", secrets=prep.secrets)
    prep.egress = EgressChannel(request.policy)
    return prep.egress.helper_args(prep.pass_fd)
