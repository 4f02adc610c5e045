"""Preparing one run: the helper's command line and the fds it is handed (:class:`_Prepared`)."""

from __future__ import annotations

import errno
import os
import shlex
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from ..paths import PathPolicy
from ..root import Root
from . import _helper, _identity, _landlock
from ._bounds import _process_bounds
from ._cgroups import _CgroupTree, _PidsV1Tree
from ._env import _ensure_dirs, _env_blob_fd, build_env
from ._errors import ConfinementError, ExecError
from ._grants import _check_rw_grants, _grant_roots, _ro_trees, _rw_trees
from ._helper import _helper_or_raise, _ro_mounts_available
from ._models import _CLONE_NEWCGROUP, _NS_FLAGS, ConfinementPolicy
from ._mounts import _mask_dirs, _ro_bind_args, _ro_binds
from ._ruleset import build_ruleset
from ._seccomp import _SECCOMP_KEYS, _SECCOMP_TCP
from ._supervisor import ProcessSupervisor


def _command(argv: Sequence[str], shell: bool | Sequence[str]) -> list[str]:
    if isinstance(argv, (str, bytes)) or not argv:
        raise ExecError("argv must be a non-empty list of strings")
    argv = [str(a) for a in argv]
    if any("\0" in a for a in argv):
        raise ExecError("an argument holds a NUL byte")
    if shell is False:
        return argv
    cmd = argv[0] if len(argv) == 1 else shlex.join(argv)
    prefix = ["/bin/sh", "-c"] if shell is True else [str(p) for p in shell]
    if not prefix:
        raise ExecError("a custom shell prefix must not be empty")
    return prefix + [cmd]


@dataclass
class _Prepared:
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

    def close_child_fds(self) -> None:
        for fd in self.pass_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.pass_fds = []

    def close_all(self) -> None:
        self.close_child_fds()
        if self.status_r >= 0:
            os.close(self.status_r)
            self.status_r = -1


async def _held_mount_ns(sup: ProcessSupervisor, workspace: Root, grants, confinement: str,
                         policy: ConfinementPolicy) -> tuple[int, int, int, int] | None:
    if confinement == "none" or not policy.read_only_mounts or not _ro_mounts_available(_helper.helper_path()):
        return None
    ro = _ro_binds(workspace, grants)
    bind = _ro_bind_args(workspace, grants, ro)
    try:
        return await sup._mount_ns(_rw_trees(workspace, grants), ro, bind, _ro_trees(workspace, grants))
    finally:
        for fd in bind[1]:
            os.close(fd)


def _explicit_identity(ident: object) -> tuple[int, int]:
    if isinstance(ident, (tuple, list)) and len(ident) == 2 and all(
            isinstance(x, int) and not isinstance(x, bool) for x in ident):
        uid, gid = int(ident[0]), int(ident[1])
        if 0 < uid < 0xFFFFFFFF and 0 < gid < 0xFFFFFFFF:
            return uid, gid
    raise ExecError("identity must be 'auto', 'host' or (uid, gid) with 0 < uid, gid < 2^32-1")


def _ready_identity(sup: ProcessSupervisor, policy: ConfinementPolicy, confinement: str, workspace: Root,
                    grants: Sequence[tuple[Root, bool]] | PathPolicy | None) -> tuple[int, int] | None:
    """The ``(uid, gid)`` the child runs as (None: the host's own), with the workspace given to it.

    Blocking (lease, ownership walk): runs in a worker thread, once per run.
    On a root host the workspace root, ``.home``, ``.tmp`` and every entry
    beneath them not yet owned by the identity are re-owned (for the host's
    own uid 0: those an id of ``identity_range`` owns) (:func:`sandbox_fs.exec._identity.reown_tree`; nested grants are
    left alone).  A read-only workspace is left as it is.

    Raises:
        ExecError: a malformed ``policy.identity``.
        ConfinementError: an explicit identity on a non-root host, no id to
            lease, or the workspace cannot be re-owned.
    """
    ident = policy.identity
    is_root = os.geteuid() == 0
    ids: tuple[int, int] | None
    if ident == "host" or (ident == "auto" and (not is_root or confinement == "none")):
        ids = None
    elif ident == "auto":
        ids = sup._auto_identity(policy.identity_range)
    else:
        ids = _explicit_identity(ident)
        if not is_root:
            if ids == (os.geteuid(), os.getegid()):
                return None
            raise ConfinementError("an explicit identity needs a root host")
    if is_root and not workspace.read_only:
        # A uid-0 command without capabilities can only write what uid 0 owns: what an
        # identity of the range owned goes back to root for it.
        base, count = policy.identity_range
        try:
            _ensure_dirs(workspace)
            _identity.reown_tree(workspace, ids or (0, 0),
                                 skip_identities=frozenset(r.identity for r, _ro in _grant_roots(grants)),
                                 only_uids=None if ids else range(int(base), int(base) + int(count)))
        except OSError as exc:
            raise ConfinementError("the workspace could not be given to the confined identity",
                                   context={"errno": errno.errorcode.get(exc.errno or 0, str(exc.errno))},
                                   diagnostic=str(exc)) from None
    return ids


def _prepare(argv: Sequence[str], *, workspace: Root, workspace_host_path: str,
             grants: Sequence[tuple[Root, bool]] | PathPolicy | None, cwd: str,
             env: Mapping[str, str] | None, secret_env: Iterable[str], shell: bool | Sequence[str],
             confinement: str, supervisor: ProcessSupervisor, policy: ConfinementPolicy,
             tty: bool, mount_ns: tuple[int, int, int, int] | None = None,
             identity: tuple[int, int] | None = None) -> _Prepared:
    caller_env = dict(env or {})
    secrets = tuple(v for k, v in caller_env.items() if k in set(secret_env) and v)
    if confinement not in ("required", "best_effort", "none"):
        raise ExecError("confinement must be 'required', 'best_effort' or 'none'", secrets=secrets)
    bad_ns = set(policy.namespaces) - set(_NS_FLAGS)
    if bad_ns:
        raise ExecError(f"unknown namespaces: {sorted(bad_ns)}", secrets=secrets)
    command = _command(argv, shell)
    helper = _helper_or_raise(secrets)
    child_env = build_env(caller_env, workspace_host_path=workspace_host_path)
    if tty:
        child_env.setdefault("TERM", "xterm")
    _ensure_dirs(workspace)

    pass_fds: list[int] = []
    prep = _Prepared([], child_env, pass_fds, -1, "none", 0, None, secrets, cwd or ".")
    try:
        args = [helper]
        status_r, status_w = os.pipe2(os.O_CLOEXEC)
        prep.status_r = status_r
        pass_fds.append(status_w)
        args += ["--status", str(status_w)]
        env_fd = _env_blob_fd(child_env, secrets)
        pass_fds.append(env_fd)
        args += ["--env-fd", str(env_fd)]

        if isinstance(grants, PathPolicy) and cwd.startswith("/"):
            resolved = grants.resolve(cwd)
            cwd_fd = resolved.root.open_dir_fd(resolved.rel or ".")
        else:
            cwd_fd = workspace.open_dir_fd(cwd or ".")
        pass_fds.append(cwd_fd)
        args += ["--cwd", str(cwd_fd)]

        leaf = supervisor._new_leaf(policy.pids_max) if policy.use_cgroup else None
        if leaf is not None:
            prep.leaf = leaf
            cg_fd = os.open(leaf, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)  # host-access: cgroupfs (kernel interface)
            pass_fds.append(cg_fd)
            args += ["--cgroup", str(cg_fd)]
        args += _process_bounds(prep, supervisor, policy, confinement, identity)

        # Supervision: the command runs under the helper's init (a PID
        # namespace of its own when one can be made), which the supervisor's
        # lifeline ends when the supervisor or this process goes away.
        life_fd = supervisor._lifeline_fd()
        pass_fds.append(life_fd)
        args += ["--init", "--lifeline", str(life_fd)]

        args += policy.rlimit_args()
        if tty:
            args.append("--tty")
        is_root = os.geteuid() == 0
        flags = 0
        if policy.namespaces:
            if not is_root:
                raise ConfinementError("namespaces are only offered when running as root", secrets=secrets)
            for ns in policy.namespaces:
                flags |= _NS_FLAGS[ns]
        if policy.drop_capabilities and is_root:
            args.append("--drop-caps")
        if identity is not None:
            _check_rw_grants(grants, identity, secrets)
            args += ["--uid", str(identity[0]), "--gid", str(identity[1])]

        if confinement != "none":
            version = _landlock.abi()
            if version <= 0:
                if confinement == "required":
                    raise ConfinementError("Landlock is not available on this kernel; "
                                           "confinement='required' fails closed", secrets=secrets)
            else:
                rs = build_ruleset(workspace, grants, policy, tty=tty, abi=version,
                                   read_only_binds=policy.read_only_mounts and _ro_mounts_available(helper))
                pass_fds.append(rs.fd)
                args += ["--ruleset", str(rs.fd), "--proc-self", str(_landlock.FS_READ_FILE | _landlock.FS_READ_DIR)]
                prep.level, prep.abi = "landlock", version
            isolate = (policy.isolate_network and not policy.unrestricted_tcp
                       and not policy.allow_tcp_connect and not policy.allow_tcp_bind)
            held_net = held_ipc = False
            if policy.read_only_mounts and _ro_mounts_available(helper):
                if mount_ns is not None:
                    mfd = os.dup(mount_ns[0])
                    pass_fds.append(mfd)
                    args += ["--mntns", str(mfd)]
                    if mount_ns[1] >= 0:
                        ufd = os.dup(mount_ns[1])
                        pass_fds.append(ufd)
                        args += ["--userns", str(ufd)]
                    if isolate and mount_ns[2] >= 0 and not flags & _NS_FLAGS["net"]:
                        nfd = os.dup(mount_ns[2])
                        pass_fds.append(nfd)
                        args += ["--netns", str(nfd)]
                        held_net = True
                    if mount_ns[3] >= 0 and not flags & _NS_FLAGS["ipc"]:
                        ifd = os.dup(mount_ns[3])
                        pass_fds.append(ifd)
                        args += ["--ipcns", str(ifd)]
                        held_ipc = True
                else:
                    args.append("--ro-mounts")
                    trees = _rw_trees(workspace, grants)
                    for tree in trees:
                        tfd = tree.fileno_dup()
                        pass_fds.append(tfd)
                        args += ["--rw-tree", str(tfd)]
                    bind_args, bind_fds = _ro_bind_args(workspace, grants)
                    pass_fds.extend(bind_fds)
                    args += bind_args
                    for tree in _ro_trees(workspace, grants):
                        tfd = tree.fileno_dup()
                        pass_fds.append(tfd)
                        args += ["--reach-tree", str(tfd)]
                    for d in _mask_dirs(trees):
                        args += ["--mask", d]
                prep.ro_mounts = True
            # Namespaces are made after the mount layer: on an unprivileged
            # host, inside its user namespace.  IPC: the host's System V
            # segments, semaphores and message queues; cgroup: the child sees
            # its leaf as the root (with cgroupfs hidden by --mask above).
            if is_root or prep.ro_mounts:
                if not held_ipc:
                    flags |= _NS_FLAGS["ipc"]
                if isolate and not held_net:
                    flags |= _NS_FLAGS["net"]
                if prep.leaf is not None:
                    flags |= _CLONE_NEWCGROUP
            prep.net_isolated = held_net or bool(flags & _NS_FLAGS["net"])
            bits = _SECCOMP_KEYS
            if not prep.net_isolated and not policy.unrestricted_tcp:
                bits |= _SECCOMP_TCP
            args += ["--seccomp", str(bits)] + policy.socket_args()
        if flags:
            args += ["--unshare", str(flags)]
        prep.helper_argv = args + ["--"] + command
        return prep
    except BaseException:
        prep.close_all()
        if prep.leaf is not None:
            _CgroupTree.remove(prep.leaf)
        if prep.pids_leaf is not None:
            _PidsV1Tree.remove(prep.pids_leaf)
        raise
