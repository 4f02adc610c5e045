"""What a confined run is asked and what it returns.

:class:`ConfinementPolicy` (limits and network rules), :class:`ExecResult`
(what a command did), and :class:`ExecRequest`: one call's arguments,
validated once where the call starts and passed down as one object.
"""

from __future__ import annotations

import math
import numbers
import os
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterable, Awaitable, Callable, Iterable, Literal, Mapping, Sequence

from ..errors import InvalidPathError, redact
from ..paths import normalize
from . import _devices, _egress, _identity, _protected, _seccomp
from ._env import build_env
from ._errors import ConfinementError, ExecError
from ._output import DEFAULT_MAX_OUTPUT_BYTES
from ._violations import Violation

if TYPE_CHECKING:  # pragma: no cover
    from ..root import Root
    from ._grants import Grants
    from ._proxy import EgressEvent

#: The confinement levels a caller may ask for (see :func:`sandbox_fs.exec.run_confined`).
Confinement = Literal["required", "best_effort", "none"]

#: ``ConfinementPolicy.namespaces`` names and their ``CLONE_NEW*`` flags.
NS_FLAGS = {"net": 0x40000000, "ipc": 0x08000000, "uts": 0x04000000}
CLONE_NEWCGROUP = 0x02000000


@dataclass(frozen=True)
class ConfinementPolicy:
    """Limits and network rules for confined processes.  Defaults are the documented ones.

    Attributes:
        cpu_time_s: ``RLIMIT_CPU`` in CPU seconds (None: unlimited).
        address_space_bytes: ``RLIMIT_AS`` in bytes.
        file_size_bytes: ``RLIMIT_FSIZE`` in bytes (largest file the child may write).
        open_files: ``RLIMIT_NOFILE``.
        processes: ``RLIMIT_NPROC`` (per user; not enforced by Linux for uid 0,
            so it is a bound only for a non-root command).
        core_dump_bytes: ``RLIMIT_CORE`` (0: no core dumps that could hold secrets).
        pids_max: cgroup ``pids.max`` of each process's leaf: the cgroup v2
            leaf when v2 has the ``pids`` controller, else a cgroup v1
            ``pids`` leaf when ``processes`` is no bound (see SECURITY.md,
            "Other rules and limits").
        allow_tcp_connect: TCP ports the child may connect to (Landlock ABI >= 4).
        allow_tcp_bind: TCP ports the child may bind (Landlock ABI >= 4).
        unrestricted_tcp: do not handle TCP at all (every port allowed).
        scope_signals: deny signals to processes outside the sandbox (ABI >= 6).
        scope_abstract_unix: deny connecting to abstract unix sockets
            outside the sandbox (ABI >= 6).
        drop_capabilities: drop every capability when running as root.
        read_only_mounts: give the child a private mount namespace where
            every mount is read-only except the workspace and read-write
            grants (as root directly; otherwise inside a user namespace that
            maps only our own uid/gid, when the system allows one: probed
            once).  Its absence does not fail ``"required"``, which promises
            Landlock; :attr:`ExecResult.read_only_mounts` says if it applied.  Landlock does not cover
            ``chmod``, ``chown``, ``utime`` or xattr changes, and a child
            running as uid 0 owns every system file: without this it could
            ``chmod 4755`` a system binary or ``chmod 644 /etc/shadow``.
        namespaces: subset of ``{"net", "ipc", "uts"}`` to unshare (root only).
        isolate_network: when no TCP port is allowed (and not
            ``unrestricted_tcp``), run the child in a new network namespace
            (no interface but a down loopback: no TCP, UDP, ICMP ...).  As
            root directly, otherwise inside the read-only mount layer's user
            namespace; :attr:`ExecResult.network_isolated` says if it applied.
        allow_unix_sockets: let the child create ``AF_UNIX`` sockets
            (``socket()`` of type ``SOCK_STREAM``, ``SOCK_DGRAM`` or
            ``SOCK_SEQPACKET``, and datagram ``socketpair``).  By default they
            are refused (seccomp, ``EAFNOSUPPORT``): Landlock does not govern
            ``connect()``/``sendto()`` to a socket path, so any host socket
            the child can name (docker.sock, D-Bus, syslog) would be
            reachable.  Stream and seqpacket ``socketpair`` stay allowed
            (connected for good to each other).
        allow_udp: let the child create UDP sockets (``AF_INET``/``AF_INET6``
            ``SOCK_DGRAM``, protocol 0 or ``IPPROTO_UDP``).  Landlock does not
            govern UDP: with the host network (a TCP port allowed) the child
            can then send datagrams to any address, a DNS resolver included.
            In an isolated network namespace they reach nothing.
        allow_icmp: let the child create ICMP echo ("ping") sockets
            (``SOCK_DGRAM`` with ``IPPROTO_ICMP``/``IPPROTO_ICMPV6``; the
            kernel also requires ``net.ipv4.ping_group_range``).
        allow_netlink: let the child create ``NETLINK_ROUTE`` sockets
            (``SOCK_RAW``/``SOCK_DGRAM``): interface and address queries of
            the child's network namespace (``getifaddrs``, ``ip addr``).
            Other netlink protocols need :attr:`extra_sockets`.
        extra_sockets: further ``(family, type, protocol)`` triples the child
            may create with ``socket()`` (``protocol`` None: any), e.g.
            ``(40, 1, None)`` for ``AF_VSOCK`` streams or ``(17, 3, None)``
            for ``AF_PACKET``.  Nothing else governs them (vsock is not
            network-namespaced: it reaches the hypervisor and every VM-wide
            listener); the host application takes that on.  ``type`` is
            compared after removing ``SOCK_NONBLOCK``/``SOCK_CLOEXEC``.
        identity: who the child runs as (see "Confined commands run as an
            unprivileged identity" in SECURITY.md).  ``"auto"`` (default):
            on a root host a uid/gid leased for the supervisor (one per
            session; per call without a supervisor) from ``identity_range``,
            the host's own ids otherwise, and the host's ids whenever
            ``confinement="none"``; ``(uid, gid)``: exactly those (the
            caller keeps them apart from system users and other sessions;
            root host only, neither may be 0); ``"host"``: uid 0 with
            capabilities dropped, which gives up the ownership protections
            (set-id files, ``RLIMIT_NPROC``, root-only files the ruleset
            would cover).
        identity_range: ``(base, count)`` of the ids ``"auto"`` leases
            (:data:`sandbox_fs.exec._identity.DEFAULT_ID_BASE`, 65536 ids).
        kill_grace_s: seconds between SIGTERM and SIGKILL on timeout or terminate.
        eof_grace_s: seconds to keep reading stdout/stderr after the main
            process exited (a background child may keep the pipes open).
        use_cgroup: put each process in its own cgroup v2 leaf when possible.
        allow_hosts: egress by host name: ``"NAME[:PORT]"`` entries
            (``"pypi.org"``, ``"*.pythonhosted.org:443"``; see
            :mod:`sandbox_fs._hosts`).  Non-empty: the command keeps its own
            network namespace (loopback up), gets a listener there on
            ``127.0.0.1:PROXY_PORT`` served by the host's egress proxy, may
            connect to that port only, and ``HTTPS_PROXY``/``HTTP_PROXY``/
            ``ALL_PROXY`` name it (see "Egress by host name" in SECURITY.md).
            Needs ``isolate_network`` and no ``allow_tcp_connect``,
            ``allow_tcp_bind`` or ``unrestricted_tcp``; ignored with
            ``confinement="none"`` (the command then has the host's network).
        allow_private_egress: **tests only**: let the proxy connect to
            loopback, private and link-local answers (a server the test
            starts on 127.0.0.1).  Never set it in production: it opens
            the host's own services and the local network to the command.
        protected: paths and globs, relative to the workspace and to each
            read-write grant, that the command may read but not change,
            replace or create (read-only binds in its mount namespace; see
            :mod:`sandbox_fs.exec._protected` and SECURITY.md "Protected
            paths").  Empty by default; :data:`DEFAULT_PROTECTED` is the
            documented set (``.git/hooks/``, ``.git/config``, shell rc
            files, editor task files ...).  Needs the mount layer
            (``read_only_mounts``); with ``confinement="required"`` a run
            without it is refused.
        deny_read: the same syntax: entries the command cannot read either
            (an empty mode-0000 file or directory is mounted over each).
        devices: absolute host paths of device nodes the command may open
            for read, write and ``ioctl`` (``"/dev/nvidia0"``): each opened
            ``O_PATH`` by the host-path rule (no symlink on any component),
            each a character or block device, at most 32; Landlock grants
            exactly those inodes and the mount layer binds each at its path
            without ``nodev`` (see SECURITY.md "Devices").  Refused
            (``DeviceError``, code ``device_refused``) otherwise.
        device_families: names of driver families (``"nvidia"``, ``"dri"``,
            ``"amd"``; :data:`sandbox_fs.exec._devices.DEVICE_FAMILIES`):
            each adds its control nodes that exist on the host and the
            read-only ``/sys`` and ``/proc`` paths its library reads.  A
            family whose driver is not loaded is refused.
        report_violations: report what the command was denied in
            :attr:`ExecResult.violations` (Landlock ABI >= 7 denial logging
            read from the audit subsystem: root or ``CAP_AUDIT_READ``, and
            audit already enabled; never enabled here).  Where it cannot,
            the run goes on and :attr:`ExecResult.violations_observed` is
            False.  See SECURITY.md, "Violation reports".
        max_violations: violations kept per run; the rest are counted in
            :attr:`ExecResult.violations_dropped`.
    """

    cpu_time_s: int | None = 3600
    address_space_bytes: int | None = 8 << 30
    file_size_bytes: int | None = 4 << 30
    open_files: int | None = 4096
    processes: int | None = 4096
    core_dump_bytes: int | None = 0
    pids_max: int | None = 4096
    allow_tcp_connect: frozenset[int] = frozenset()
    allow_tcp_bind: frozenset[int] = frozenset()
    unrestricted_tcp: bool = False
    scope_signals: bool = True
    scope_abstract_unix: bool = True
    drop_capabilities: bool = True
    read_only_mounts: bool = True
    namespaces: frozenset[str] = frozenset()
    isolate_network: bool = True
    allow_unix_sockets: bool = False
    allow_udp: bool = False
    allow_icmp: bool = False
    allow_netlink: bool = False
    extra_sockets: frozenset[tuple[int, int, int | None]] = frozenset()
    identity: Literal["auto", "host"] | tuple[int, int] = "auto"
    identity_range: tuple[int, int] = (_identity.DEFAULT_ID_BASE, _identity.DEFAULT_ID_COUNT)
    kill_grace_s: float = 2.0
    eof_grace_s: float = 1.0
    use_cgroup: bool = True
    allow_hosts: tuple[str, ...] = ()
    allow_private_egress: bool = False

    protected: tuple[str, ...] = ()
    deny_read: tuple[str, ...] = ()
    report_violations: bool = False
    max_violations: int = 256

    devices: tuple[str, ...] = ()
    device_families: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _egress.check_policy(self)
        _protected.check_policy(self.protected, self.deny_read)
        _devices.check_policy_devices(self.devices, self.device_families)

    def rlimit_args(self) -> list[str]:
        """The helper's ``--rlimit NAME=VALUE`` arguments.

        Raises:
            ValueError: a limit is negative.
        """
        out: list[str] = []
        for name, value in (("cpu", self.cpu_time_s), ("as", self.address_space_bytes),
                            ("fsize", self.file_size_bytes), ("nofile", self.open_files),
                            ("nproc", self.processes), ("core", self.core_dump_bytes)):
            if value is not None:
                if int(value) < 0:
                    raise ValueError(f"rlimit {name} must be >= 0")
                out += ["--rlimit", f"{name}={int(value)}"]
        return out

    def socket_args(self) -> list[str]:
        """The helper's ``--socket KIND:FAMILY:TYPE:PROTO`` rules: the socket allow-list.

        Always: ``socketpair(AF_UNIX)`` of type ``SOCK_STREAM`` and
        ``SOCK_SEQPACKET``.  ``AF_INET``/``AF_INET6`` ``SOCK_STREAM``
        (protocol 0 or ``IPPROTO_TCP``: MPTCP and SCTP get
        ``EPROTONOSUPPORT``) only when TCP is allowed (``allow_tcp_connect``,
        ``allow_tcp_bind`` or ``unrestricted_tcp``); then Landlock governs
        the ports.  The ``allow_*`` fields and :attr:`extra_sockets` add the
        rest; everything else gets ``EAFNOSUPPORT``.

        Raises:
            ValueError: an :attr:`extra_sockets` entry is not three integers
                in 0..65535 (the protocol may be None), or there are more
                than 32 rules in all.
        """
        return _seccomp.socket_args(self)


#: Sandbox paths a private root's ``workspace_path`` may not be at or under: the
#: mounts the helper makes itself and the read-only system trees.
_RESERVED_ROOT_PATHS = ("/proc", "/dev", "/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


@dataclass(frozen=True)
class PrivateRoot:
    """Run the command in a root of its own, with the workspace overlay at ``workspace_path``.

    The exec helper builds, in the command's private mount namespace: a
    tmpfs root (read-only); the read-only system set (``/usr``, ``/etc``,
    ``/bin`` ...) bound read-only, nosuid, nodev; a private ``/tmp``
    (tmpfs, 256 MiB); a minimal ``/dev`` (``null``, ``zero``, ``full``,
    ``random``, ``urandom``; ``tty`` and the PTY slave on a PTY); a
    read-only ``/proc`` of the command's own PID namespace; each grant at its host
    path by its mode; and last (so nothing shadows it) a clone of
    ``workspace_fd`` at ``workspace_path``.  Nothing else of the host is
    there: a symlink to an absolute path planted in the workspace resolves
    in this root, never on the host.  Landlock stays on, with the
    workspace rule on ``workspace_fd``'s root.  Root hosts only.

    Attributes:
        workspace_fd: borrowed ``O_PATH`` fd on the root of a *detached*
            mount made with ``fsmount`` (the overlay's mount fd); it stays
            the caller's and must stay open for the call.
        workspace_path: the workspace's path in the command's root
            (absolute; not ``/``, and not at or under ``/proc``, ``/dev`` or
            a system tree).  ``HOME`` and ``TMPDIR`` default beneath it.
        refresh: None, or an async callable (no arguments) that makes the
            view current: the overlay's invalidate-all.  The run's identity
            walk acts on the *backing* workspace (the ``workspace`` Root
            given to run_confined, never the view: the view's mount entries
            are host directories); when it changed owners there, ``refresh``
            is awaited before the command starts, so the kernel's cached
            attributes of the view are not the old owners.

    Raises:
        ExecError: ``workspace_fd`` is not a non-negative int, or
            ``workspace_path`` is not such a path.
    """

    workspace_fd: int
    workspace_path: str = "/workspace"
    refresh: Callable[[], Awaitable[None]] | None = None

    def __post_init__(self) -> None:
        fd = self.workspace_fd
        if not isinstance(fd, int) or isinstance(fd, bool) or fd < 0:
            raise ExecError("PrivateRoot.workspace_fd must be an open file descriptor")
        path = self.workspace_path
        try:
            shown = normalize(path, allow_absolute=True) if isinstance(path, str) else None
        except InvalidPathError:
            shown = None
        if (shown is None or shown != path or not shown.startswith("/") or shown == "/"
                or any(shown == r or shown.startswith(r + "/") for r in _RESERVED_ROOT_PATHS)):
            raise ExecError("PrivateRoot.workspace_path must be a normalized absolute path other than /, "
                            "outside /proc, /dev and the system trees",
                            context={"workspace_path": str(path)[:200]})


@dataclass(frozen=True)
class ExecResult:
    """What a command did.

    Attributes:
        exit_code: the exit status; ``-N`` when killed by signal N.
        stdout: captured standard output (head and tail when truncated).
        stderr: captured standard error (head and tail when truncated).
        stdout_truncated: stdout was longer than ``max_output_bytes``; the
            middle was dropped.
        stderr_truncated: the same for stderr.
        duration_s: wall-clock seconds from spawn to exit.
        confinement: the level applied: ``"landlock"`` or ``"none"``.
        landlock_abi: the Landlock ABI used (0 when none).
        read_only_mounts: everything but the workspace and read-write grants
            was mounted read-only for the child.
        network_isolated: the child ran in its own network namespace (no network).
        stdout_bytes: total bytes the child wrote to stdout.
        stderr_bytes: total bytes the child wrote to stderr.
        process_bounds: the process-count bounds in force for the command,
            as read back from the kernel: ``"cgroup2.pids.max=N"``,
            ``"cgroup1.pids.max=N"``, ``"rlimit.nproc=N"`` (only when Linux
            enforces it: a non-root command).  Empty when none holds (then
            only ``confinement="best_effort"`` or ``"none"`` ran it).
        missing: protections the policy asks for that no layer gave this
            run on this host (keys of
            :data:`sandbox_fs.exec._coverage.MISSING_TEXT`: ``"landlock"``,
            ``"landlock.truncate"`` (ABI < 3), ``"landlock.tcp"`` (ABI < 4),
            ``"landlock.scope_abstract_unix"`` / ``"landlock.scope_signals"``
            (ABI < 6), each only where no namespace or mount layer stands
            in; ``"process_bound"``; ``"mount_layer"``).  Only
            ``"best_effort"`` runs with any but ``"mount_layer"``:
            ``"required"`` refuses them (``ConfinementError``).  Empty
            with ``confinement="none"``.
        identity: ``(uid, gid)`` the child ran as, or None for the host's own.
        overlay: the command ran in its private root (:class:`PrivateRoot`),
            seeing the workspace only through the overlay.
        egress: the egress proxy's events of this run (``EgressEvent``:
            host, port, allowed, reason, bytes each way), oldest first;
            empty without ``allow_hosts``.
        egress_dropped: events the proxy's bounded log dropped.
        violations: what the command was denied, in order
            (:class:`Violation`: ``op``, ``target``, ``errno``, ``pid``), at
            most ``policy.max_violations``; only this command's (its
            Landlock domain), never another session's.
        violations_dropped: further denials not in :attr:`violations` (past
            the bound, or lost by the audit backlog: the kernel's count).
        violations_observed: denials were watched
            (``policy.report_violations`` and the kernel could report them);
            False: an empty :attr:`violations` says nothing.
    """

    exit_code: int
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    duration_s: float
    confinement: str
    landlock_abi: int = 0
    read_only_mounts: bool = False
    network_isolated: bool = False
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    process_bounds: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    identity: tuple[int, int] | None = None
    overlay: bool = False
    egress: tuple[EgressEvent, ...] = ()
    egress_dropped: int = 0
    violations: tuple[Violation, ...] = ()
    violations_dropped: int = 0
    violations_observed: bool = False

    def __repr__(self) -> str:
        return (f"ExecResult(exit_code={self.exit_code}, stdout=<{len(self.stdout)} bytes"
                f"{', truncated' if self.stdout_truncated else ''}>, stderr=<{len(self.stderr)} bytes"
                f"{', truncated' if self.stderr_truncated else ''}>, duration_s={self.duration_s:.3f}, "
                f"confinement={self.confinement!r})")


def _command(argv: Sequence[str], shell: bool | Sequence[str]) -> list[str]:
    """The argv the helper executes: ``argv``, or ``argv`` joined behind a shell prefix.

    Raises:
        ExecError: ``argv`` is a string or empty, an argument holds NUL, or
            a custom shell prefix is empty.
    """
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


def explicit_identity(ident: object) -> tuple[int, int]:
    """``ConfinementPolicy.identity`` given as ``(uid, gid)``, checked.

    Raises:
        ExecError: not two ints with 0 < id < 2^32-1.
    """
    if isinstance(ident, (tuple, list)) and len(ident) == 2 and all(
            isinstance(x, int) and not isinstance(x, bool) for x in ident):
        uid, gid = int(ident[0]), int(ident[1])
        if 0 < uid < 0xFFFFFFFF and 0 < gid < 0xFFFFFFFF:
            return uid, gid
    raise ExecError("identity must be 'auto', 'host' or (uid, gid) with 0 < uid, gid < 2^32-1")


def _check_timeout(timeout_s: float | None, secrets: tuple[str, ...]) -> float | None:
    """``timeout_s`` itself once it is None or a finite number of seconds > 0.

    Raises:
        ExecError: not a number, not finite, or not > 0.
    """
    if timeout_s is None:
        return None
    is_number = isinstance(timeout_s, numbers.Real) and not isinstance(timeout_s, bool)
    try:
        finite = is_number and math.isfinite(timeout_s)
    except OverflowError:  # an int too large for a float: no deadline trio can keep
        finite = False
    if not finite or timeout_s <= 0:
        raise ExecError("timeout_s must be a finite number of seconds > 0, or None",
                        context={"timeout_s": repr(timeout_s)[:32]}, secrets=secrets)
    return timeout_s


@dataclass(frozen=True, eq=False, repr=False)
class ExecRequest:
    """One confined run as asked: built and validated once (:meth:`build`), then passed down.

    Attributes:
        command: the argv the helper executes (``shell`` applied).
        workspace: the workspace Root.
        workspace_host_path: its host path (``HOME``/``TMPDIR`` only).
        grants: ``[(Root, read_only), ...]``, a :class:`~sandbox_fs.paths.PathPolicy` or None.
        cwd: working directory as a sandbox path (``""``: the workspace).
        child_env: the command's whole environment (:func:`build_env`;
            ``TERM`` defaults to ``xterm`` for a PTY).
        secrets: values of ``env`` named in ``secret_env``: never shown.
        confinement: ``"required"``, ``"best_effort"`` or ``"none"``.
        policy: the :class:`ConfinementPolicy`.
        tty: the command runs on a PTY (:class:`~sandbox_fs.exec.PtyManager`).
        stdin: bytes, an async iterable of chunks, or None (``/dev/null``).
        timeout_s: seconds before the tree is ended (None: no limit).
        max_output_bytes: bytes kept per stream.
        check: a non-zero exit raises :class:`~sandbox_fs.exec.ExecFailedError`.
        private_root: the command's own root (:class:`PrivateRoot`), or None.
    """

    command: tuple[str, ...]
    workspace: Root
    workspace_host_path: str
    grants: Grants
    cwd: str
    child_env: Mapping[str, str]
    secrets: tuple[str, ...]
    confinement: Confinement
    policy: ConfinementPolicy
    tty: bool = False
    stdin: bytes | AsyncIterable[bytes] | None = None
    timeout_s: float | None = None
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES
    check: bool = False
    private_root: PrivateRoot | None = None

    @classmethod
    def build(cls, argv: Sequence[str], *, workspace: Root, workspace_host_path: str, grants: Grants,
              cwd: str, env: Mapping[str, str] | None, secret_env: Iterable[str],
              shell: bool | Sequence[str], confinement: str, policy: ConfinementPolicy, tty: bool = False,
              stdin: bytes | AsyncIterable[bytes] | None = None, timeout_s: float | None = None,
              max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES, check: bool = False,
              private_root: PrivateRoot | None = None) -> ExecRequest:
        """Check the arguments of :func:`~sandbox_fs.exec.run_confined` (or a PTY start) and build the request.

        Nothing is opened or started here; every argument error is raised
        before any process, namespace, lease or fd exists.

        Raises:
            ExecError: bad ``argv``/``shell``, an unknown ``confinement`` or
                namespace name, a malformed ``policy.identity``, or a
                ``timeout_s`` that is not a finite number > 0.
            ConfinementError: ``policy.namespaces`` or ``private_root`` on a
                non-root host.
            InvalidEnvError: a malformed ``env`` entry.
        """
        caller_env = dict(env or {})
        secret_names = set(secret_env)
        secrets = tuple(v for k, v in caller_env.items() if k in secret_names and v)
        if confinement not in ("required", "best_effort", "none"):
            raise ExecError("confinement must be 'required', 'best_effort' or 'none'", secrets=secrets)
        bad_ns = set(policy.namespaces) - set(NS_FLAGS)
        if bad_ns:
            raise ExecError(f"unknown namespaces: {sorted(bad_ns)}", secrets=secrets)
        command = _command(argv, shell)
        if private_root is not None and not isinstance(private_root, PrivateRoot):
            raise ExecError("private_root must be a PrivateRoot or None", secrets=secrets)
        if private_root is not None and os.geteuid() != 0:
            raise ConfinementError("a private root for the command needs a root host", secrets=secrets)
        # HOME and TMPDIR name the workspace as the command sees it.
        seen_at = private_root.workspace_path if private_root is not None else workspace_host_path
        child_env = build_env(caller_env, workspace_host_path=seen_at)
        if tty:
            child_env.setdefault("TERM", "xterm")
        if policy.allow_hosts and confinement != "none":
            if tty:
                raise ExecError("allow_hosts is not offered on a PTY", secrets=secrets)
            child_env.update(_egress.proxy_env())  # the only way out of the command's namespace
        if policy.namespaces and os.geteuid() != 0:
            raise ConfinementError("namespaces are only offered when running as root", secrets=secrets)
        if policy.identity not in ("auto", "host"):
            explicit_identity(policy.identity)
        return cls(command=tuple(command), workspace=workspace, workspace_host_path=workspace_host_path,
                   grants=grants, cwd=cwd, child_env=child_env, secrets=secrets,
                   confinement=confinement,  # type: ignore[arg-type]
                   policy=policy, tty=tty, stdin=stdin, timeout_s=_check_timeout(timeout_s, secrets),
                   max_output_bytes=max_output_bytes, check=check, private_root=private_root)

    @property
    def argv0(self) -> str:
        """The program as shown in errors (redacted there)."""
        return self.command[0]

    @property
    def cwd_shown(self) -> str:
        """The working directory as a sandbox path for errors (``"."``: the workspace)."""
        return self.cwd or "."

    def __repr__(self) -> str:  # never the environment: it may hold secrets
        return (f"ExecRequest(argv0={redact(self.argv0, self.secrets)!r}, cwd={self.cwd_shown!r}, "
                f"confinement={self.confinement!r})")
