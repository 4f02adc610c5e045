"""Confined command execution under trio: Landlock, rlimits, bounded output, supervision, PTY.

Processes started in a workspace are untrusted.  :func:`run_confined` starts
one so that on Linux it

* reads, writes and executes only beneath the workspace (read-write, or
  read-only when the workspace Root is read-only), the application's extra
  path grants (by their mode) and a documented read-only system set;
* has no network at all (its own network namespace) unless a TCP port is
  allowed; then it cannot connect to or bind TCP ports but the allowed ones
  (Landlock ABI >= 4, with a seccomp filter closing the MPTCP and TCP Fast
  Open ways around it), and cannot signal processes or reach abstract unix
  sockets outside its sandbox (ABI >= 6);
* runs under a seccomp allow-list of system calls and socket types (see
  below): no ``AF_UNIX`` socket (so no host socket such as docker.sock or
  D-Bus by path), UDP, ICMP, netlink, packet or vsock socket unless the
  policy allows it, and no set-id file can be created;
* does not share the host's System V IPC, kernel keyrings or cgroup view;
* runs with rlimits, no capabilities (when started as root), no new
  privileges, in its own session, under an init of its own in its own PID
  namespace (and cgroup v2 leaf when one can be made), with only fds 0/1/2
  open; nothing it starts outlives it, its supervisor or the host process;
* on a root host, runs as an unprivileged uid/gid leased for its session
  (``ConfinementPolicy.identity``; :mod:`sandbox_fs._identity`), which owns
  its workspace and nothing else;
* sees an environment built from an allow-list plus the caller's entries,
  never the host's whole environment, with ``HOME`` and ``TMPDIR`` inside
  the workspace and a fixed system ``PATH`` (:data:`DEFAULT_PATH`) unless
  the caller sets one; the helper that confines it never sees that
  environment (it runs with an empty one and gets the command's through a
  memfd, applied at the command's ``execve``);
* has a process-count bound (:attr:`ExecResult.process_bounds`), or
  ``confinement="required"`` refuses to start it;
* cannot make the host hold more than ``max_output_bytes`` per stream.

How confinement is applied
--------------------------
No Python code runs in a forked child (trio keeps worker threads, so
``preexec_fn`` is unsafe).  The parent builds the Landlock ruleset from
**file descriptors** (the workspace Root's ``O_PATH`` fd, each grant Root's
fd, the fixed system paths opened ``O_PATH``), opens the working directory
through the Root, and spawns the tiny single-threaded C helper
``sandbox_fs/sfs-exec`` (``native/sfs_exec.c``) with those fds in
``pass_fds``.  The helper forks its init into the cgroup leaf and a new
PID namespace; the init forks the command, which calls ``setsid`` (and
``TIOCSCTTY`` for a PTY), sets the rlimits, ``fchdir``\\ s to the cwd fd,
switches to the leased identity (``setgroups(0)``, ``setresgid``,
``setresuid``), drops capabilities, sets ``PR_SET_NO_NEW_PRIVS``, adds its own
``/proc/self`` and calls ``landlock_restrict_self``, installs the seccomp
filter (see below), marks every fd but
0/1/2 close-on-exec (``close_range``) and ``execve``\\ s the target, searched
on the target's own ``PATH``.  A status pipe tells the parent which step
failed, if one did.

The helper is spawned with an empty environment, whatever the caller's: it
starts as root with every capability, and a dynamically linked helper runs
the loader (``LD_PRELOAD``, ``LD_AUDIT``, ``GLIBC_TUNABLES`` ...) before its
``main()`` confines it.  The command's environment reaches it as data: a
memfd of NUL-terminated ``KEY=VALUE`` entries (``--env-fd``, at most
:data:`MAX_ENV_BYTES` bytes and :data:`MAX_ENV_ENTRIES` entries), never argv
(``/proc/PID/cmdline`` is world-readable, and ``secret`` values must not
show there), applied only at the command's ``execve``.

The default read-only system set (:mod:`sandbox_fs._landlock`)
--------------------------------------------------------------
* read + execute beneath ``/usr``, ``/bin``, ``/sbin``, ``/lib``,
  ``/lib32``, ``/lib64``, ``/libx32`` (whichever exist);
* the world-readable part of ``/etc`` at every depth: a directory as one
  rule only when everything beneath it is world-readable, otherwise its
  readable files one by one (so ``shadow``, ``default/cacerts`` 0600 or a
  0700 ``polkit-1/rules.d`` are left out; a symlink only when it resolves
  under ``/usr`` or to something granted), minus ``sudoers``, ``sudoers.d``,
  ``ssh``, ``ssl/private``, ``security/opasswd``, ``credstore*``,
  ``wireguard``, ``krb5.keytab``, ``ppp``,
  ``NetworkManager/system-connections``, ``machine-id``;
* ``/dev/null``, ``/dev/zero``, ``/dev/full`` (read, write),
  ``/dev/random``, ``/dev/urandom`` (read); ``/dev/tty`` for PTY sessions;
* ``/proc/self`` of the started process (read).  Its own children do not
  get their ``/proc/self``; the rest of ``/proc``, ``/sys``, ``/tmp``,
  ``/root``, ``/home`` and ``/run`` are not granted.

The system paths are opened ``O_PATH`` once per process and kept (about
150 fds), then reopened whenever ``/etc`` changes, so building a ruleset
costs only the ``landlock_add_rule`` calls (~0.6 ms).

Tools living outside that set (on the project machine Python lives under
``/root/.pyenv``) need an explicit read-only grant of their prefix, never a
wider default.  Landlock rules only add rights: a read-only grant *inside* a
tree the child may write (the read-write workspace or a read-write grant)
is enforced by a read-only bind of itself in the child's mount namespace
(its parents up to that tree pinned as mount points, so they cannot be
renamed) where the read-only mount layer applies, and refused
(:class:`ConfinementError`) otherwise, unless ``confinement="none"``.

Metadata changes outside the workspace
--------------------------------------
Landlock (ABI <= 7) does not restrict ``chmod``, ``chown``, ``utime`` or
extended attributes.  A child running as uid 0 owns every system file, and
any child owns its user's files, so it could change their metadata (make a
system binary setuid, make ``/etc/shadow`` world-readable).  When the host
runs as root the helper therefore also gives the child a private mount
namespace in which every mount is read-only except clones of the workspace
and the read-write grants (``ConfinementPolicy.read_only_mounts``): such
changes fail with EROFS.  Every mount there, the clones included, is also
``nosuid``.  A non-root host gets the same layer inside a user
namespace that maps only its own uid and gid; where the system forbids user
namespaces, a child can change the metadata of files its user owns outside
the workspace (``ExecResult.read_only_mounts`` is then False).

Other rules and where they come from
------------------------------------
* ``setsid`` without a controlling terminal (PTY sessions get their own
  PTY as one): a child cannot push input into the host's terminal with
  ``TIOCSTI`` (CVE-2017-5226, the bubblewrap escape).
* Landlock ABI < 3 does not restrict ``truncate``; ABI < 4 has no TCP rules;
  ABI < 6 no signal or abstract-socket scoping.  The read-only mount layer
  covers truncation outside the workspace whatever the ABI.
* ``PR_SET_NO_NEW_PRIVS``: setuid/setgid and file capabilities are ignored
  at ``execve`` (required by ``landlock_restrict_self`` for unprivileged use).
* Device nodes cannot be created (``MAKE_CHAR``/``MAKE_BLOCK`` withheld, and
  ``CAP_MKNOD`` dropped), so a device file cannot open a way out.

Default rlimits (:class:`ConfinementPolicy`)
--------------------------------------------
CPU 3600 s, address space 8 GiB, file size 4 GiB, 4096 open files, 4096
processes, core dumps 0.  Soft and hard limits are equal and capabilities
are dropped, so the child cannot raise them.

Process-count bounds (:attr:`ExecResult.process_bounds`, read back from the
kernel).  ``RLIMIT_NPROC`` counts per user and Linux does not enforce it for
uid 0, so a root child is bounded by a cgroup ``pids.max``:

* the cgroup v2 leaf's ``pids.max`` when the v2 ``pids`` controller is
  there (``"cgroup2.pids.max=N"``);
* ``RLIMIT_NPROC`` when the command runs under a non-root uid: the leased
  identity on a root host (one per session, so the limit is that session's),
  the host's own uid otherwise (``"rlimit.nproc=N"``);
* only when neither holds, a cgroup v1 ``pids`` leaf (a hybrid host whose
  ``pids`` controller is on v1, ``"cgroup1.pids.max=N"``): the target writes
  its own pid to the leaf's ``cgroup.procs`` (an fd opened by the parent)
  before anything else runs in it, so it never runs outside the bound.
  An isolated join waits for an RCU grace period (~14 ms measured on the
  2-core VM); back-to-back spawns share one (+0.4 ms median in
  ``bench/bench_exec.py``), hence last.  v1 has no ``cgroup.kill``: the supervisor kills what the leaf
  lists, through pidfds opened before a second listing, so a recycled pid
  is never signalled.

Where none holds, ``confinement="required"`` refuses
(:class:`ConfinementError`, ``confinement_unavailable``) unless the policy
asks for no bound (``pids_max=None`` and ``processes=None``);
``"best_effort"`` and ``"none"`` run with an empty ``process_bounds``.

Supervision guarantees (:class:`ProcessSupervisor`)
---------------------------------------------------
The confined tree cannot outlive its supervisor, and signals reach only
processes that are provably the sandbox's:

* Every command runs under an init of the helper (``native/sfs_exec_init.h``),
  our direct child (``CLONE_PARENT``), which forks the command.  The init
  is pid 1 of a PID namespace of its own: as root directly; unprivileged,
  inside a user namespace mapping only our own uid and gid (the
  supervisor's held one when there is one).  The command sees itself as
  pid 2 and cannot see or signal any host process (the host's ``/proc``
  stays mounted; Landlock grants only the command's own ``/proc/self``).
* When the command exits, the init exits with it and the kernel SIGKILLs
  everything left in the namespace: background and ``setsid`` processes do
  not outlive the command that started them.  Orphans, the command's
  ``clone(CLONE_PARENT)`` children included, are the init's children and
  are reaped by it, never zombies of the host.  ``ExecResult.exit_code`` is
  the command's own status (the init reports it on the status pipe).
* The supervisor signals only through a pidfd of the init, our unreaped
  child (so the pid cannot have been reused), never ``os.kill`` or
  ``os.killpg`` on a stored pid or process group.  SIGTERM is forwarded by
  the init to the whole namespace; SIGKILL ends the init and so the
  namespace.  Where a cgroup v2 leaf exists, ``cgroup.kill`` is written too.
* The lifeline: every init holds the read end of a pipe whose write end
  only the supervisor's process holds (close-on-exec), and a pidfd of the
  host process (which a fork of the host without exec, inheriting the
  pipe, does not hold open).  ``aclose()``, the supervisor's finalizer, or
  the death of the host process (SIGKILL included) closes the pipe or
  fires the pidfd, and every init then ends its tree.
  ``PR_SET_PDEATHSIG`` is not used: trio forks from a worker thread and
  that signal fires when the thread exits.
* Where no PID namespace can be made (no user namespaces for an
  unprivileged host), the init is a child subreaper instead: orphans still
  reparent to it, and it ends the tree by SIGKILLing its own unreaped
  children until none is left (SIGUSR1 from the supervisor asks it to).
  What it cannot end there: a process that re-parents out of the tree by
  other means (none is known to an unprivileged process) or a host SIGKILL
  of the init itself (the supervisor never sends one before SIGUSR1).
* Where a cgroup v2 hierarchy is mounted and writable (root here), each
  command also starts in its own cgroup leaf (``pids.max`` when the
  ``pids`` controller is enabled for cgroup v2, else see *Process-count
  bounds* above for the v1 leaf).  A supervisor garbage-collected without
  ``aclose()`` still kills its leaves and removes its tree; empty trees
  left by dead owners are swept when the next supervisor starts.

Namespaces and the seccomp filter (confined processes)
------------------------------------------------------
Made by the helper after the mount layer (as root directly; unprivileged,
inside the mount layer's user namespace, and only when that layer applies):

* IPC, always: the host's System V shared memory, semaphores and message
  queues are out of reach (Landlock does not cover them; uid 0 passes
  their owner checks).  A supervisor's processes share one (held with its
  mount namespace); without a supervisor each process gets its own.
* cgroup, when the process has a cgroup leaf: it sees its leaf as ``/``.
  Every cgroup mount is also hidden under an empty read-only tmpfs in the
  child's mount namespace: with an ``O_PATH`` fd on the cgroup2 root
  (Landlock does not check ``O_PATH``), ``clone3(CLONE_INTO_CGROUP)``
  would otherwise move a child out of its leaf (uid 0 passes the
  ``cgroup.procs`` owner check; a cgroup namespace alone only stops this
  when cgroup2 is mounted with ``nsdelegate``).
* network, when no TCP port is allowed (``isolate_network``): only a down
  loopback, so no TCP, UDP or ICMP reaches anything.  A supervisor makes
  it once (with its held mount namespace) and every process joins it; a
  fresh one costs ~2 ms.

The seccomp filter (installed last, after ``no_new_privs`` and Landlock) is
an allow-list modelled on Docker's default profile for a container without
``CAP_SYS_ADMIN`` (moby ``profiles/seccomp/default.json``):

* a syscall not on the list fails with ``ENOSYS``, so libc and programs
  that probe a newer syscall fall back to an older one.  Among them:
  ``openat2`` and ``clone3`` (their arguments sit behind a pointer seccomp
  cannot read; glibc falls back to ``clone`` for threads), ``io_uring``
  (its operations bypass seccomp) and every syscall of another ABI (x32,
  32-bit compat: ``socketcall`` hides its arguments);
* privileged and namespace syscalls fail with ``EPERM``: ``mount`` and the
  new mount API, ``unshare``, ``setns``, ``clone`` with a ``CLONE_NEW*``
  flag (a new user namespace would hold ``CAP_SETFCAP`` and friends),
  ``keyctl``/``add_key``/``request_key`` (after joining a fresh session
  keyring: a uid-0 child could otherwise read root's keys), ``bpf``,
  ``perf_event_open``, ``userfaultfd``, ``kcmp``, ``pidfd_getfd``, module,
  swap, reboot and clock calls, and ``personality`` other than Docker's
  values (no ``ADDR_NO_RANDOMIZE``);
* set-id files: ``open``/``openat``/``creat`` with ``O_CREAT`` or
  ``O_TMPFILE``, ``mkdir``/``mkdirat``, ``mknod``/``mknodat``, ``chmod``,
  ``fchmod``, ``fchmodat`` and ``fchmodat2`` fail with ``EPERM`` when the
  mode has ``S_ISUID`` or ``S_ISGID`` (a setgid directory too: files made
  in it take its group).  The sticky bit grants nothing and stays allowed;
  ``umask`` only removes bits.  A directory made inside one that already
  has ``S_ISGID`` (placed by the host) inherits it, as the kernel does;
* ``socket()`` and ``socketpair()`` only for the triples of
  :meth:`ConfinementPolicy.socket_args` (family, type after
  ``SOCK_NONBLOCK|SOCK_CLOEXEC``, protocol): another family or type gets
  ``EAFNOSUPPORT``, another protocol of an allowed family and type
  ``EPROTONOSUPPORT`` (MPTCP: programs fall back to TCP).  By default only
  ``socketpair(AF_UNIX)`` stream and seqpacket pairs (a datagram pair,
  which ``SOCK_RAW`` also gives, can ``sendto()`` any socket path);
  ``AF_INET``/``AF_INET6`` ``SOCK_STREAM`` when a TCP port is allowed (the
  ports then governed by Landlock); ``allow_unix_sockets``, ``allow_udp``,
  ``allow_icmp``, ``allow_netlink`` and ``extra_sockets`` add more;
* when the host network is used, ``sendto``/``sendmsg``/``sendmmsg`` with
  ``MSG_FASTOPEN`` and ``setsockopt(TCP_FASTOPEN_CONNECT)`` fail with
  ``EOPNOTSUPP``: they reach a TCP port without the ``connect()`` Landlock
  checks.

DNS: by default a confined command has no resolver.  With no TCP port
allowed it has no network at all; with one, glibc's resolver still needs
UDP (``allow_udp``, which Landlock does not govern, so the child can then
send datagrams to any address the host network reaches) or a TCP-only
resolver configuration with port 53 allowed.  Numeric addresses and
``/etc/hosts`` names work; resolve names in the host and pass addresses.

Every mount in the child's mount namespace (workspace and read-write grants
included) is ``nosuid``.  A hard link to a host set-id file cannot be made
in the workspace: Landlock gives ``REFER`` (links across directories) only
beneath the workspace and read-write grants, and in the mount layer each
writable tree is its own mount, which ``link(2)`` never crosses.  Without
the mount layer a set-id file already in a read-write grant on the
workspace's filesystem can be linked into it.

``ConfinementPolicy.namespaces`` (root only) adds namespaces on request:
``"net"`` even when ports are allowed, ``"ipc"`` (always on anyway),
``"uts"`` a private host name.  A PID namespace is always made (see
"Supervision guarantees").  ``/proc/self/mountinfo`` still shows the host's
mount layout (paths only).

What remains: with a TCP port allowed the child uses the host network, so
whatever sockets the policy opens beyond TCP (``allow_udp``,
``allow_icmp``, ``allow_netlink``, ``extra_sockets``) reach the host;
``confinement="none"`` applies none of these layers; without the
read-only mount layer (``read_only_mounts=False``) cgroupfs stays visible.

Thread-safety: the async functions are meant for one trio run; a
ProcessSupervisor and a PtyManager belong to one trio run.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import math
import os
import shlex
import signal
import struct
import subprocess
import termios
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import AsyncIterable, Iterable, Literal, Mapping, Sequence

import trio

from . import _identity, _landlock
from .errors import SandboxError, redact
from .paths import PathPolicy
from .root import Root

__all__ = [
    "ExecResult",
    "ExecError",
    "ExecTimeoutError",
    "ExecFailedError",
    "CommandNotFoundError",
    "ConfinementError",
    "PtyNotFoundError",
    "ConfinementPolicy",
    "ProcessSupervisor",
    "PtyManager",
    "run_confined",
    "build_ruleset",
    "build_env",
    "helper_path",
    "DEFAULT_MAX_OUTPUT_BYTES",
    "ENV_ALLOWLIST",
    "DEFAULT_PATH",
    "MAX_ENV_BYTES",
    "MAX_ENV_ENTRIES",
]

#: Default bound on each of stdout and stderr kept in memory (1 MiB).
DEFAULT_MAX_OUTPUT_BYTES = 1 << 20

#: Host environment names copied to the child (exact names; ``LC_*`` by prefix).
#: ``PATH`` is not one of them: the child's default is :data:`DEFAULT_PATH`.
ENV_ALLOWLIST = ("LANG", "LANGUAGE", "TERM", "TZ", "COLORTERM", "NO_COLOR")
_ENV_PREFIXES = ("LC_",)
#: The child's ``PATH`` unless the caller's environment sets one: fixed system
#: directories, never the host's ``PATH`` (which may name directories outside
#: the system set, or writable ones).
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"
#: The exec helper's own environment, whatever the caller's: empty.  The
#: helper starts as root with every capability and (when dynamically linked)
#: runs the loader before main() confines it, so nothing from a manifest or
#: the caller (``LD_PRELOAD``, ``GLIBC_TUNABLES`` ...) may reach it; the
#: command's environment is handed over as data (``--env-fd``).
_HELPER_ENV: Mapping[str, str] = {}
#: Bounds of the environment blob (native/sfs_exec.c: SFS_MAX_ENV, SFS_MAX_ENV_ENTRIES).
MAX_ENV_BYTES = 1 << 20
MAX_ENV_ENTRIES = 4096

#: Workspace directories used as ``HOME`` and ``TMPDIR`` (created when missing).
HOME_DIR = ".home"
TMP_DIR = ".tmp"

_CHUNK = 1 << 16
_STATUS_MAX = 256
_NS_FLAGS = {"net": 0x40000000, "ipc": 0x08000000, "uts": 0x04000000}
_CLONE_NEWCGROUP = 0x02000000

# The helper's --seccomp bits (native/sfs_exec.c); the allow-list itself is always installed.
_SECCOMP_KEYS = 1   # join a fresh session keyring first
_SECCOMP_TCP = 2    # MSG_FASTOPEN sends and TCP_FASTOPEN_CONNECT refused

# (family, type) pairs for the helper's --socket rules; protocol None: any.
_AF_UNIX, _AF_INET, _AF_INET6, _AF_NETLINK = 1, 2, 10, 16
_SOCK_STREAM, _SOCK_DGRAM, _SOCK_RAW, _SOCK_SEQPACKET = 1, 2, 3, 5
_IPPROTO_ICMP, _IPPROTO_TCP, _IPPROTO_UDP, _IPPROTO_ICMPV6 = 1, 6, 17, 58
_NETLINK_ROUTE = 0
_MAX_SOCKET_RULES = 32  # SFS_MAX_SOCKETS in native/sfs_exec.c

Confinement = Literal["required", "best_effort", "none"]


# ----------------------------------------------------------------- errors

class ExecError(SandboxError):
    """A command could not be started or run as asked."""

    code = "exec_error"


class ConfinementError(ExecError):
    """Confinement was required but cannot be applied (fails closed).

    Raised when Landlock is unavailable (ABI 0), the exec helper is missing,
    a step of the helper fails (landlock, capabilities, cgroup, namespaces),
    or a rule cannot be expressed (a read-only grant inside the workspace).
    """

    code = "confinement_unavailable"


class CommandNotFoundError(ExecError):
    """The program (``argv[0]``) does not exist or is not executable inside the sandbox."""

    code = "command_not_found"


class ExecTimeoutError(ExecError):
    """The command ran past ``timeout_s`` and its whole process tree was killed.

    Attributes:
        result: the :class:`ExecResult` with the output captured so far.
    """

    code = "exec_timeout"
    retryable = False

    def __init__(self, reason: str, *, result: "ExecResult", **kw) -> None:
        super().__init__(reason, **kw)
        self.result = result


class ExecFailedError(ExecError):
    """``check=True`` and the command exited non-zero.

    Attributes:
        result: the :class:`ExecResult`.
    """

    code = "exec_failed"

    def __init__(self, reason: str, *, result: "ExecResult", **kw) -> None:
        super().__init__(reason, **kw)
        self.result = result


class PtyNotFoundError(ExecError, KeyError):
    """No live PTY session has this id (never started, terminated or pruned)."""

    code = "pty_not_found"

    def __str__(self) -> str:  # KeyError would quote the message
        return self._message()


# ----------------------------------------------------------------- data

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
            ``pids`` leaf when ``processes`` is no bound (see the module
            docstring, *Process-count bounds*).
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
            (:data:`sandbox_fs._identity.DEFAULT_ID_BASE`, 65536 ids).
        kill_grace_s: seconds between SIGTERM and SIGKILL on timeout or terminate.
        eof_grace_s: seconds to keep reading stdout/stderr after the main
            process exited (a background child may keep the pipes open).
        use_cgroup: put each process in its own cgroup v2 leaf when possible.
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

    def rlimit_args(self) -> list[str]:
        """The helper's ``--rlimit NAME=VALUE`` arguments."""
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
        rules: list[tuple[str, int, int, int | None]] = [
            ("p", _AF_UNIX, _SOCK_STREAM, None), ("p", _AF_UNIX, _SOCK_SEQPACKET, None)]
        inet = (_AF_INET, _AF_INET6)
        if self.unrestricted_tcp or self.allow_tcp_connect or self.allow_tcp_bind:
            rules += [("s", af, _SOCK_STREAM, p) for af in inet for p in (0, _IPPROTO_TCP)]
        if self.allow_unix_sockets:
            rules += [("s", _AF_UNIX, t, None) for t in (_SOCK_STREAM, _SOCK_DGRAM, _SOCK_SEQPACKET)]
            rules.append(("p", _AF_UNIX, _SOCK_DGRAM, None))
        if self.allow_udp:
            rules += [("s", af, _SOCK_DGRAM, p) for af in inet for p in (0, _IPPROTO_UDP)]
        if self.allow_icmp:
            rules += [("s", _AF_INET, _SOCK_DGRAM, _IPPROTO_ICMP), ("s", _AF_INET6, _SOCK_DGRAM, _IPPROTO_ICMPV6)]
        if self.allow_netlink:
            rules += [("s", _AF_NETLINK, t, _NETLINK_ROUTE) for t in (_SOCK_RAW, _SOCK_DGRAM)]
        for entry in sorted(self.extra_sockets, key=repr):
            if (not isinstance(entry, tuple) or len(entry) != 3
                    or not all(type(v) is int and 0 <= v <= 0xFFFF for v in entry[:2])
                    or not (entry[2] is None or (type(entry[2]) is int and 0 <= entry[2] <= 0xFFFF))):
                raise ValueError(f"extra_sockets entry {entry!r} is not (family, type, protocol or None)")
            rules.append(("s", *entry))
        unique = list(dict.fromkeys(rules))
        if len(unique) > _MAX_SOCKET_RULES:
            raise ValueError(f"at most {_MAX_SOCKET_RULES} socket rules (extra_sockets has too many)")
        out: list[str] = []
        for kind, family, type_, proto in unique:
            out += ["--socket", f"{kind}:{family}:{type_}:{'*' if proto is None else proto}"]
        return out


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
        identity: ``(uid, gid)`` the child ran as, or None for the host's own.
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
    identity: tuple[int, int] | None = None

    def __repr__(self) -> str:
        return (f"ExecResult(exit_code={self.exit_code}, stdout=<{len(self.stdout)} bytes"
                f"{', truncated' if self.stdout_truncated else ''}>, stderr=<{len(self.stderr)} bytes"
                f"{', truncated' if self.stderr_truncated else ''}>, duration_s={self.duration_s:.3f}, "
                f"confinement={self.confinement!r})")


class _HeadTail:
    """Keeps the first and last bytes of a stream: memory <= ~1.5 x max_bytes whatever arrives."""

    __slots__ = ("head_cap", "tail_cap", "head", "tail", "total")

    def __init__(self, max_bytes: int) -> None:
        max_bytes = max(0, int(max_bytes))
        self.tail_cap = max_bytes // 2
        self.head_cap = max_bytes - self.tail_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def append(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data and self.tail_cap:
            self.tail += data
            if len(self.tail) > 2 * self.tail_cap:
                del self.tail[:-self.tail_cap]

    @property
    def truncated(self) -> bool:
        return self.total > self.head_cap + self.tail_cap

    def value(self) -> bytes:
        tail = self.tail[-self.tail_cap:] if self.tail_cap else b""
        return bytes(self.head) + bytes(tail)


# ----------------------------------------------------------------- helper, env, ruleset

def helper_path() -> str:
    """Host path of the ``sfs-exec`` helper shipped inside the package."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "sfs-exec")


def _helper_or_raise(secrets: Iterable[str]) -> str:
    path = helper_path()
    if not os.access(path, os.X_OK):
        raise ConfinementError("the exec helper sandbox_fs/sfs-exec is missing; reinstall the package",
                               secrets=secrets)
    return path


def build_env(caller_env: Mapping[str, str] | None, *, workspace_host_path: str,
              host_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Build a child's environment: the allow-list from the host, then the caller's entries.

    The result is the *command's* environment, applied only at its
    ``execve`` after every confinement step; the exec helper itself always
    runs with an empty environment.  The caller (the application) is trusted
    with any name, ``LD_PRELOAD`` included: it affects only the confined
    command.  An untrusted manifest's loader and interpreter hooks are
    refused earlier, by :func:`sandbox_fs.manifest.load_manifest`.

    Args:
        caller_env: entries from the application or manifest; they override
            the allow-list (``HOME``/``TMPDIR``/``PATH`` included).
        workspace_host_path: the workspace's host path (trusted, from the
            application); ``HOME`` is ``<it>/.home`` and ``TMPDIR``
            ``<it>/.tmp`` unless ``caller_env`` sets them.
        host_env: the host environment (``os.environ`` when None).  Only
            :data:`ENV_ALLOWLIST` names and ``LC_*`` are copied; ``PATH`` is
            :data:`DEFAULT_PATH` unless ``caller_env`` sets it.

    Returns:
        A new ``dict[str, str]``.

    Raises:
        InvalidEnvError: a name is empty or holds ``=`` or NUL, or a value
            holds NUL (the error names the entry, never its value).
    """
    host = os.environ if host_env is None else host_env
    env = {k: v for k, v in host.items() if k in ENV_ALLOWLIST or k.startswith(_ENV_PREFIXES)}
    env["PATH"] = DEFAULT_PATH
    base = workspace_host_path.rstrip("/") or "/"
    env["HOME"] = f"{base}/{HOME_DIR}"
    env["TMPDIR"] = f"{base}/{TMP_DIR}"
    for k, v in (caller_env or {}).items():
        if not isinstance(k, str) or not isinstance(v, str) or not k or "=" in k or "\0" in k or "\0" in v:
            raise InvalidEnvError("environment names must be non-empty without '=' or NUL, values without NUL",
                                  context={"name": str(k)[:64]})
        env[k] = v
    return env


class InvalidEnvError(ExecError, ValueError):
    """An environment entry is malformed, or the environment is too large."""

    code = "invalid_env"


def _env_blob_fd(env: Mapping[str, str], secrets: Iterable[str]) -> int:
    """A memfd holding ``env`` as NUL-terminated ``KEY=VALUE`` entries, for ``--env-fd``.

    Data for the helper, which applies it at the command's ``execve`` only:
    never argv (``/proc/PID/cmdline`` is world-readable) nor the helper's own
    environment (its loader runs before it confines itself).

    Raises:
        InvalidEnvError: over :data:`MAX_ENV_BYTES` bytes or
            :data:`MAX_ENV_ENTRIES` entries, or not encodable.
    """
    try:
        blob = b"".join(f"{k}={v}".encode("utf-8", "surrogateescape") + b"\0" for k, v in env.items())
    except UnicodeEncodeError:
        raise InvalidEnvError("an environment entry is not encodable", secrets=secrets) from None
    if len(blob) > MAX_ENV_BYTES or len(env) > MAX_ENV_ENTRIES:
        raise InvalidEnvError(f"the environment is over {MAX_ENV_BYTES} bytes or {MAX_ENV_ENTRIES} entries",
                              context={"entries": len(env)}, secrets=secrets)
    fd = os.memfd_create("sfs-env", os.MFD_CLOEXEC)
    try:
        view = memoryview(blob)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        raise
    return fd


def _grant_roots(grants: Sequence[tuple[Root, bool]] | PathPolicy | None) -> list[tuple[Root, bool]]:
    if grants is None:
        return []
    if isinstance(grants, PathPolicy):
        out = []
        for g in grants.grants:
            out.append((grants.resolve(g.path).root, g.read_only))
        return out
    return [(r, bool(ro) or r.read_only) for r, ro in grants]


def _is_beneath(child_fd: int, ancestor: tuple[int, int]) -> bool:
    """True when directory ``child_fd`` is ``ancestor`` or below it (walking ``..`` by fd)."""
    cur = os.dup(child_fd)
    try:
        for _ in range(4096):
            st = os.fstat(cur)
            ident = (st.st_dev, st.st_ino)
            if ident == ancestor:
                return True
            up = os.open("..", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=cur)
            ust = os.fstat(up)
            os.close(cur)
            cur = up
            if (ust.st_dev, ust.st_ino) == ident:
                return False
        return False
    finally:
        os.close(cur)


def _nested_read_only(workspace: Root, roots: Sequence[tuple[Root, bool]], *, binds: bool) -> list[Root]:
    """One nesting rule against every writable tree (the workspace and each read-write grant).

    Landlock rules only add rights, so a read-only grant at or beneath a
    tree the child may write would be writable through that tree's rule
    (issue 11, F).  Where the read-only mount layer applies (``binds``), each
    such grant is covered by a read-only bind of itself in the child's mount
    namespace (the helper's ``--ro-tree``) and returned; otherwise it is
    refused.  Refused either way: a read-only grant that *is* a writable tree,
    and a read-write grant beneath a grant that gets a read-only bind (the
    recursive bind would cover it).  Checked on the rule fds (``..`` walked by
    fd), so a symlink or a path alias cannot hide a nesting.

    Returns:
        The read-only grants to bind read-only (empty unless ``binds``).

    Raises:
        ConfinementError: a nesting that cannot be enforced.
    """
    writable = ([("the read-write workspace", workspace.identity)] if not workspace.read_only else []) + [
        ("a read-write grant", r.identity) for r, ro in roots if not ro]
    nested: list[Root] = []
    for root, read_only in roots:
        if not read_only:
            continue
        gfd = root.fileno_dup()
        try:
            for what, ident in writable:
                if not _is_beneath(gfd, ident):
                    continue
                if ident == root.identity:
                    raise ConfinementError(f"a read-only grant is also {what}: give each directory one mode",
                                           sandbox_path=root._label or None)
                if not binds:
                    raise ConfinementError(
                        f"a read-only grant inside {what} cannot be enforced by Landlock (its rules only add "
                        "rights) and the read-only mount layer is off or unavailable; move the grant out, "
                        "or make the outer tree read-only", sandbox_path=root._label or None)
                nested.append(root)
                break
        finally:
            os.close(gfd)
    for r, ro in roots:
        if ro or not nested:
            continue
        rfd = r.fileno_dup()
        try:
            for g in nested:
                if _is_beneath(rfd, g.identity):
                    raise ConfinementError(
                        "a read-write grant inside a read-only grant that is itself inside a writable tree "
                        "cannot be enforced", sandbox_path=r._label or None)
        finally:
            os.close(rfd)
    return nested


def _ro_binds(workspace: Root, grants: Sequence[tuple[Root, bool]] | PathPolicy | None) -> list[Root]:
    """The read-only grants the mount layer covers with a read-only bind (see :func:`_nested_read_only`)."""
    return _nested_read_only(workspace, _grant_roots(grants), binds=True)


def _ro_bind_args(workspace: Root, grants: Sequence[tuple[Root, bool]] | PathPolicy | None,
                  nested: list[Root] | None = None) -> tuple[list[str], list[int]]:
    """Helper arguments (and the new fds they name, the caller's to close) for the read-only binds.

    Each read-only grant nested in a writable tree gets ``--ro-tree``; each
    directory between it and that tree gets ``--pin-tree`` (outer first),
    bound onto itself so that the child cannot rename or remove it (a mount
    point gives EBUSY): otherwise renaming the grant's parent would leave the
    grant's contents writable under another name in a later session, whose
    grant path would then name a directory the child made.
    """
    if nested is None:
        nested = _ro_binds(workspace, grants)
    if not nested:
        return [], []
    writable = {r.identity for r in _rw_trees(workspace, grants)}
    pins: dict[tuple[int, int], tuple[str, int]] = {}
    fds: list[int] = []
    args: list[str] = []
    try:
        for g in nested:
            cur = g.fileno_dup()
            fds.append(cur)
            args += ["--ro-tree", str(cur)]
            for _ in range(4096):
                up = os.open("..", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=cur)
                st = os.fstat(up)
                ident = (st.st_dev, st.st_ino)
                if ident in writable or ident in pins:
                    os.close(up)
                    break
                fds.append(up)
                # host-access: our own fd's path, used only to order the pins (the helper gets the fds)
                pins[ident] = (os.readlink(f"/proc/self/fd/{up}"), up)
                cur = up
        for _path, fd in sorted(pins.values()):  # an ancestor's path is a prefix: outer first
            args += ["--pin-tree", str(fd)]
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return args, fds


def build_ruleset(workspace: Root, grants: Sequence[tuple[Root, bool]] | PathPolicy | None = None,
                  policy: "ConfinementPolicy | None" = None, *, tty: bool = False,
                  abi: int | None = None, read_only_binds: bool = False) -> _landlock.Ruleset:
    """Build the Landlock ruleset for one confined process, from file descriptors.

    Rules: read-write beneath the workspace (read-only when the Root is), each
    grant by its mode, the read-only system set of :mod:`sandbox_fs._landlock`
    (``/dev/tty`` too when ``tty``), TCP ports of ``policy``; signal and
    abstract-unix scoping per ``policy`` (ABI >= 6).

    Args:
        workspace: the workspace Root (its ``O_PATH`` fd is duplicated).
        grants: ``[(Root, read_only), ...]`` or a :class:`PathPolicy` whose
            grants are used.
        policy: network and scoping choices (default :class:`ConfinementPolicy`).
        tty: also allow ``/dev/tty`` (read, write, ioctl) for a PTY session.
        abi: Landlock ABI to target (default: the kernel's).
        read_only_binds: the caller's child gets the read-only mount layer,
            which covers each read-only grant nested in a writable tree with
            a read-only bind (``--ro-tree``), so such a grant is not refused.

    Returns:
        A :class:`sandbox_fs._landlock.Ruleset`; the caller closes it.

    Raises:
        ConfinementError: Landlock is unavailable, the kernel refuses a rule,
            or a read-only grant lies inside the read-write workspace or a
            read-write grant and ``read_only_binds`` is False (Landlock rules
            only add rights, so it could not be enforced), or a nesting no
            bind can enforce (see :func:`_nested_read_only`).
    """
    policy = policy or ConfinementPolicy()
    version = _landlock.abi() if abi is None else abi
    if version <= 0:
        raise ConfinementError("Landlock is not available on this kernel")
    roots = _grant_roots(grants)
    try:
        scopes = ((_landlock.SCOPE_SIGNAL if policy.scope_signals else 0)
                  | (_landlock.SCOPE_ABSTRACT_UNIX_SOCKET if policy.scope_abstract_unix else 0))
        rs = _landlock.Ruleset(version, handle_net=not policy.unrestricted_tcp, scopes=scopes)
    except OSError as exc:
        raise ConfinementError("the kernel refused to create a Landlock ruleset",
                               diagnostic=str(exc)) from None
    try:
        rw = _landlock.fs_read_write(version)
        ws_fd = workspace.fileno_dup()
        try:
            rs.add_fd(ws_fd, _landlock.FS_READ_EXEC if workspace.read_only else rw)
        finally:
            os.close(ws_fd)
        _nested_read_only(workspace, roots, binds=read_only_binds)
        for root, read_only in roots:
            gfd = root.fileno_dup()
            try:
                rs.add_fd(gfd, _landlock.FS_READ_EXEC if read_only else rw)
            finally:
                os.close(gfd)
        rs.add_system_set()
        if tty:
            rs.add_host_path("/dev/tty", _landlock.FS_READ_FILE | _landlock.FS_WRITE_FILE | _landlock.FS_IOCTL_DEV)
        rs.allow_tcp(sorted(policy.allow_tcp_connect), _landlock.NET_CONNECT_TCP)
        rs.allow_tcp(sorted(policy.allow_tcp_bind), _landlock.NET_BIND_TCP)
    except ConfinementError:
        rs.close()
        raise
    except OSError as exc:
        rs.close()
        raise ConfinementError("a Landlock rule was refused by the kernel",
                               context={"errno": errno.errorcode.get(exc.errno or 0, str(exc.errno))},
                               diagnostic=str(exc)) from None
    return rs


# ----------------------------------------------------------------- cgroups

def _find_cgroup2() -> str | None:
    """Host path of this process's cgroup v2 directory, or None without a cgroup2 mount."""
    try:
        # host-access: our own process mount table (finding the cgroup2 mount)
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
        with open("/proc/self/cgroup") as f:  # host-access: our own process's cgroup
            own = next((line.strip()[3:] for line in f if line.startswith("0::")), None)
    except OSError:
        return None
    for parts in mounts:
        try:
            sep = parts.index("-")
        except ValueError:
            continue
        if parts[sep + 1] == "cgroup2" and own is not None:
            root, mnt = parts[3], parts[4]
            rel = own
            if root != "/" and rel.startswith(root):
                rel = rel[len(root):]
            path = mnt.rstrip("/") + "/" + rel.strip("/")
            return path.rstrip("/")
    return None


def _dead_owner_trees(base: str) -> list[str]:
    """Paths of ``sandbox-fs-<pid>-*`` trees under cgroupfs ``base`` whose owner process is gone."""
    try:  # host-access: cgroupfs (kernel interface): our own stale supervisor dirs, never a workspace
        names = [n for n in os.listdir(base) if n.startswith("sandbox-fs-")]
    except OSError:
        return []
    paths = []
    for name in names:
        try:
            pid = int(name.split("-")[2])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            paths.append(f"{base}/{name}")
    return paths


class _CgroupTree:
    """One cgroup v2 directory per supervisor, one leaf per started process."""

    _ids = itertools.count(1)

    def __init__(self, base: str, pids_max: int | None) -> None:
        self.dir = f"{base}/sandbox-fs-{os.getpid()}-{next(self._ids)}-{os.urandom(3).hex()}"
        # host-access: the supervisor cgroup dir under cgroupfs (kernel interface, not a workspace)
        os.mkdir(self.dir, 0o755)
        self._leaves = itertools.count(1)
        self.pids = False
        try:
            with open(f"{self.dir}/cgroup.controllers") as f:
                if "pids" in f.read().split() and pids_max is not None:
                    with open(f"{self.dir}/cgroup.subtree_control", "w") as f2:
                        f2.write("+pids")
                    self.pids = True
        except OSError:
            self.pids = False

    @classmethod
    def create(cls, pids_max: int | None) -> "_CgroupTree | None":
        base = _find_cgroup2()
        if base is None:
            return None
        cls._sweep_stale(base)
        try:
            return cls(base, pids_max)
        except OSError:
            return None

    @staticmethod
    def _sweep_stale(base: str) -> None:
        """Remove empty trees left by processes that died without closing their supervisor."""
        for path in _dead_owner_trees(base):
            if _CgroupTree.populated(path):
                continue  # something still runs there: leave it for its owner / an operator
            try:  # host-access: cgroupfs, as above
                for leaf in os.listdir(path):
                    if leaf.startswith("p") and os.path.isdir(f"{path}/{leaf}"):
                        os.rmdir(f"{path}/{leaf}")
                os.rmdir(path)
            except OSError:
                pass

    def new_leaf(self, pids_max: int | None) -> str:
        leaf = f"{self.dir}/p{next(self._leaves)}"
        os.mkdir(leaf, 0o755)  # host-access: a leaf cgroup under our supervisor dir (cgroupfs)
        if self.pids and pids_max is not None:
            try:
                with open(f"{leaf}/pids.max", "w") as f:
                    f.write(str(int(pids_max)))
            except OSError:
                pass
        return leaf

    @staticmethod
    def populated(leaf: str) -> bool:
        try:  # host-access: cgroupfs (kernel interface): our own supervisor's leaf, never a workspace
            with open(f"{leaf}/cgroup.events") as f:
                for line in f:
                    if line.startswith("populated "):
                        return line.split()[1] != "0"
        except FileNotFoundError:
            return False
        except OSError:
            return True
        return True

    @staticmethod
    def kill(leaf: str) -> None:
        try:  # host-access: cgroupfs (kernel interface): our own supervisor's leaf, never a workspace
            with open(f"{leaf}/cgroup.kill", "w") as f:
                f.write("1")
        except OSError:
            pass

    @staticmethod
    def remove(leaf: str) -> bool:
        try:  # host-access: cgroupfs (kernel interface): our own supervisor's leaf, never a workspace
            os.rmdir(leaf)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            return False

    def close(self) -> bool:
        """Kill and remove every leaf, then the tree; True when it is gone (nothing runs in it)."""
        try:  # host-access: cgroupfs (kernel interface): our own supervisor's leaf, never a workspace
            for name in os.listdir(self.dir):
                p = f"{self.dir}/{name}"
                if name.startswith("p") and os.path.isdir(p):
                    self.kill(p)
                    self.remove(p)
            os.rmdir(self.dir)  # host-access: cgroupfs (kernel interface)
            return True
        except OSError:
            return False


def _read_pids_max(leaf: str) -> int | None:
    """The ``pids.max`` the kernel holds for a leaf (v1 or v2), or None when unlimited or unreadable."""
    try:
        with open(f"{leaf}/pids.max") as f:  # host-access: cgroupfs (kernel interface)
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _find_pids_v1() -> str | None:
    """Host path of this process's cgroup v1 ``pids`` directory, or None without a v1 pids hierarchy."""
    try:
        # host-access: our own process mount table (finding the v1 pids mount)
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
        with open("/proc/self/cgroup") as f:  # host-access: our own process's cgroups
            own = next((line.strip().split(":", 2)[2] for line in f
                        if line.count(":") >= 2 and "pids" in line.split(":", 2)[1].split(",")), None)
    except OSError:
        return None
    if own is None:
        return None
    for parts in mounts:
        try:
            sep = parts.index("-")
        except ValueError:
            continue
        if parts[sep + 1] == "cgroup" and len(parts) > sep + 3 and "pids" in parts[sep + 3].split(","):
            root, mnt = parts[3], parts[4].replace("\\040", " ")
            rel = own
            if root != "/" and rel.startswith(root):
                rel = rel[len(root):]
            return (mnt.rstrip("/") + "/" + rel.strip("/")).rstrip("/")
    return None


class _PidsV1Tree:
    """One cgroup v1 ``pids`` directory per supervisor, one leaf per started process.

    Used where cgroup v2 has no ``pids`` controller but a v1 ``pids``
    hierarchy is mounted (a hybrid host), and the target's uid is not bound
    by ``RLIMIT_NPROC``.  The target joins its leaf by writing its
    ``cgroup.procs`` (``--pids-procs``) before anything else runs in it; v1
    has no ``cgroup.kill``, so :meth:`kill` signals the listed processes.
    """

    _ids = itertools.count(1)

    def __init__(self, base: str) -> None:
        self.dir = f"{base}/sandbox-fs-{os.getpid()}-{next(self._ids)}-{os.urandom(3).hex()}"
        # host-access: the supervisor's v1 pids dir under cgroupfs (kernel interface, not a workspace)
        os.mkdir(self.dir, 0o755)
        self._leaves = itertools.count(1)

    @classmethod
    def create(cls) -> "_PidsV1Tree | None":
        base = _find_pids_v1()
        if base is None:
            return None
        cls._sweep_stale(base)
        try:
            return cls(base)
        except OSError:
            return None

    @staticmethod
    def _sweep_stale(base: str) -> None:
        """Remove empty trees left by processes that died without closing their supervisor."""
        for path in _dead_owner_trees(base):
            try:  # host-access: cgroupfs, as above
                for leaf in os.listdir(path):
                    if leaf.startswith("p") and os.path.isdir(f"{path}/{leaf}"):
                        if not _PidsV1Tree.populated(f"{path}/{leaf}"):
                            os.rmdir(f"{path}/{leaf}")
                os.rmdir(path)
            except OSError:
                pass

    def new_leaf(self, pids_max: int) -> str:
        """A new leaf with ``pids.max`` set.

        Raises:
            OSError: the leaf cannot be made or its bound cannot be written
                (the leaf is removed again).
        """
        leaf = f"{self.dir}/p{next(self._leaves)}"
        os.mkdir(leaf, 0o755)  # host-access: a leaf under our v1 pids dir (cgroupfs)
        try:
            with open(f"{leaf}/pids.max", "w") as f:
                f.write(str(int(pids_max)))
        except OSError:
            self.remove(leaf)
            raise
        return leaf

    @staticmethod
    def pids(leaf: str) -> list[int]:
        try:  # host-access: cgroupfs (kernel interface): our own supervisor's leaf, never a workspace
            with open(f"{leaf}/cgroup.procs") as f:
                return [int(x) for x in f.read().split()]
        except OSError:
            return []

    @staticmethod
    def populated(leaf: str) -> bool:
        return bool(_PidsV1Tree.pids(leaf))

    @staticmethod
    def kill(leaf: str) -> None:
        """SIGKILL every process listed in the leaf, through pidfds.

        Each pid is opened as a pidfd, then the leaf is listed again: a pid
        still listed after its pidfd was opened is the same process or a
        later one forked inside the leaf, so no process outside the leaf is
        ever signalled (a recycled pid's pidfd refers to the dead process).
        """
        fds = []
        for pid in _PidsV1Tree.pids(leaf):
            try:
                fds.append((pid, os.pidfd_open(pid)))
            except OSError:
                pass
        still = set(_PidsV1Tree.pids(leaf))
        for pid, fd in fds:
            try:
                if pid in still:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(fd)

    @staticmethod
    def remove(leaf: str) -> bool:
        try:
            os.rmdir(leaf)  # host-access: cgroupfs
            return True
        except FileNotFoundError:
            return True
        except OSError:
            return False

    def close(self) -> None:
        try:  # host-access: cgroupfs (kernel interface): our own supervisor's leaf, never a workspace
            for name in os.listdir(self.dir):
                p = f"{self.dir}/{name}"
                if name.startswith("p") and os.path.isdir(p):
                    for _ in range(100):
                        self.kill(p)
                        if not self.populated(p):
                            break
                        time.sleep(0.002)
                    self.remove(p)
            os.rmdir(self.dir)  # host-access: cgroupfs (kernel interface)
        except OSError:
            pass


def _nproc_enforced() -> bool:
    """Does Linux enforce ``RLIMIT_NPROC`` on a command run under the host's own uid?

    Not for uid 0 (nor with ``CAP_SYS_RESOURCE``/``CAP_SYS_ADMIN``, which a
    non-root command does not hold): only when the host process is not
    root.  A command switched to an unprivileged identity is always bound.
    """
    return os.geteuid() != 0


# ----------------------------------------------------------------- supervision

def _release_resources(cg: "_CgroupTree | None", ns_fds: dict[tuple, tuple[int, ...]],
                       v1: "_PidsV1Tree | None" = None, lifeline: list[int] | None = None,
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
    emptied = (cg.close() if cg is not None else False) and not (leafless or [True])[0]
    if v1 is not None:
        v1.close()
    for fds in ns_fds.values():
        for fd in fds:
            if fd >= 0:
                os.close(fd)
    ns_fds.clear()
    while leases:
        leases.pop().release(no_processes_left=emptied)


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

    Give one to :func:`run_confined` / :class:`PtyManager` per session;
    call :meth:`kill_all` (or ``await aclose()``) at shutdown.  What is
    guaranteed where is described in the module docstring ("Supervision
    guarantees"): each command runs under an init of the helper (in its own
    PID namespace where one can be made) that ends the whole tree when the
    command exits, when this supervisor is closed or collected, and when the
    host process dies; signals go only through pidfds of our own unreaped
    children; cgroup v2 leaves (:attr:`uses_cgroup`) are killed too.

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
        self._cg: _CgroupTree | None = _CgroupTree.create(pids_max) if use_cgroup else None
        self._closed = False
        self._hold_mount_ns = hold_mount_ns
        self._ns_fds: dict[tuple, tuple[int, int, int, int]] = {}
        self._ns_lock = trio.Lock()
        # cgroup v1 pids leaves: only where cgroup v2 cannot bound the task count.
        self._v1: _PidsV1Tree | None = None
        if use_cgroup and pids_max is not None and (self._cg is None or not self._cg.pids):
            self._v1 = _PidsV1Tree.create()
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

    def _auto_identity(self, id_range: tuple[int, int]) -> tuple[int, int]:
        """The supervisor's leased ``(uid, gid)`` (leased on first use, given back at :meth:`aclose`).

        Blocking (scans ``/proc``): call from a worker thread.

        Raises:
            ConfinementError: no identity can be leased.
        """
        with self._lease_lock:
            if not self._leases:
                if self._closed:
                    raise ConfinementError("the process supervisor is closed")
                try:
                    self._leases.append(_identity.lease(*id_range))
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
        t = _Tracked(process, pidfd, leaf, argv0, pids_leaf, pid_ns=getattr(process, "pid_ns", False))
        if leaf is None:
            self._leafless[0] = True
        self._tracked.append(t)
        return t

    @staticmethod
    def _signal(t: _Tracked, sig: int) -> None:
        """Signal the command's init through its pidfd (never a raw pid or process group).

        The init is our child and not yet reaped (``returncode`` is None), so
        the pidfd cannot name another process.  The init forwards SIGTERM to
        its whole tree; SIGKILL ends it and, in a PID namespace, the kernel
        kills the rest.
        """
        if t.process.returncode is None and t.pidfd >= 0:
            try:
                signal.pidfd_send_signal(t.pidfd, sig)
            except OSError:
                pass

    def _group_alive(self, t: _Tracked) -> bool:
        if t.pids_leaf is not None and _PidsV1Tree.populated(t.pids_leaf):
            return True
        if t.process.returncode is None:
            return True
        return t.leaf is not None and _CgroupTree.populated(t.leaf)

    def _untrack(self, t: _Tracked) -> None:
        if t in self._tracked:
            self._tracked.remove(t)
        if t.pidfd >= 0:
            os.close(t.pidfd)
            t.pidfd = -1
        if t.leaf is not None:
            _CgroupTree.remove(t.leaf)
        if t.pids_leaf is not None:
            _PidsV1Tree.remove(t.pids_leaf)

    def _release_if_done(self, t: _Tracked) -> None:
        """Forget ``t`` once its leader is reaped and nothing of its group/leaf is left."""
        if t.process.returncode is None:
            return
        if t.pidfd >= 0:  # the leader is reaped: its pidfd is no longer needed
            os.close(t.pidfd)
            t.pidfd = -1
        if not self._group_alive(t):
            self._untrack(t)

    async def _kill_one(self, t: _Tracked, grace_s: float) -> None:
        """SIGTERM the tree, wait up to ``grace_s`` for the command, then SIGKILL everything and reap."""
        if grace_s > 0 and t.process.returncode is None:
            self._signal(t, signal.SIGTERM)
            with trio.move_on_after(grace_s):
                await t.process.wait()
        if t.process.returncode is None and not t.pid_ns:
            # A subreaper init (no PID namespace): SIGUSR1 makes it kill its
            # tree before it exits; SIGKILL would orphan the tree instead.
            self._signal(t, signal.SIGUSR1)
            with trio.move_on_after(1.0):
                await t.process.wait()
        self._signal(t, signal.SIGKILL)
        if t.leaf is not None:
            _CgroupTree.kill(t.leaf)
        await t.process.wait()
        if t.leaf is not None:
            for _ in range(200):
                if not _CgroupTree.populated(t.leaf):
                    break
                await trio.sleep(0.005)
        elif t.pids_leaf is not None:  # v1 has no cgroup.kill: signal what it lists
            for _ in range(200):
                _PidsV1Tree.kill(t.pids_leaf)
                if not _PidsV1Tree.populated(t.pids_leaf):
                    break
                await trio.sleep(0.005)
        self._untrack(t)

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
            args = [helper_path(), "--status", str(status_w), "--ro-mounts"]
            for fd in fds:
                args += ["--rw-tree", str(fd)]
            bind_args, bind_fds = bind  # the caller's fds: passed, not closed here
            args += bind_args
            for fd in ro_fds:
                args += ["--reach-tree", str(fd)]
            for d in _mask_dirs(rw_roots):
                args += ["--mask", d]
            args += ["--unshare", str(_NS_FLAGS["net"] | _NS_FLAGS["ipc"]), "--hold-ns", "--", "true"]
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
            status = _Status(status_r)
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
            self._ns_fds[key] = (mnt, user, net, ipc)
            return mnt, user, net, ipc

    async def kill_all(self, *, grace_s: float = 0.0) -> None:
        """Kill every command tree and cgroup leaf started through this supervisor, and reap.

        Args:
            grace_s: seconds to wait after SIGTERM before SIGKILL (0: SIGKILL at once).

        *Cancellation*: the kill runs shielded; a cancel arriving meanwhile is
        delivered at the next checkpoint after every process is gone.
        """
        with trio.CancelScope(shield=True):
            await trio.lowlevel.checkpoint()
            for t in list(self._tracked):
                await self._kill_one(t, grace_s)

    async def aclose(self) -> None:
        """:meth:`kill_all`, then close the lifeline and remove the cgroup directory.  Idempotent.

        *Cancellation*: shielded like :meth:`kill_all`.
        """
        await self.kill_all()
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


# ----------------------------------------------------------------- spawning

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


_RO_MOUNTS: bool | None = None


def _rw_trees(workspace: Root, grants: Sequence[tuple[Root, bool]] | PathPolicy | None) -> list[Root]:
    """The directories that stay writable under the read-only mount layer."""
    trees = [] if workspace.read_only else [workspace]
    return trees + [r for r, ro in _grant_roots(grants) if not ro]


def _ro_trees(workspace: Root, grants: Sequence[tuple[Root, bool]] | PathPolicy | None) -> list[Root]:
    """The read-only trees the child must reach (a read-only workspace, read-only grants)."""
    trees = [workspace] if workspace.read_only else []
    return trees + [r for r, ro in _grant_roots(grants) if ro]


async def _held_mount_ns(sup: ProcessSupervisor, workspace: Root, grants, confinement: str,
                         policy: ConfinementPolicy) -> tuple[int, int, int, int] | None:
    if confinement == "none" or not policy.read_only_mounts or not _ro_mounts_available(helper_path()):
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
    own uid 0: those an id of ``identity_range`` owns) (:func:`sandbox_fs._identity.reown_tree`; nested grants are
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


def _check_rw_grants(grants: Sequence[tuple[Root, bool]] | PathPolicy | None, ids: tuple[int, int],
                     secrets: tuple[str, ...]) -> None:
    """Refuse a read-write grant whose directory the identity does not own (it could not write it)."""
    shown = [g.path for g in grants.grants] if isinstance(grants, PathPolicy) else None
    for i, (root, ro) in enumerate(_grant_roots(grants)):
        if ro:
            continue
        fd = root.fileno_dup()
        try:
            owner = os.fstat(fd).st_uid
        finally:
            os.close(fd)
        if owner != ids[0]:
            raise ConfinementError(
                "a read-write grant is not owned by the confined identity, so the command could not write it: "
                "chown it to that identity (policy.identity=(uid, gid)) or use identity='host'",
                sandbox_path=shown[i] if shown else None, secrets=secrets)


def _ro_mounts_available(helper: str) -> bool:
    """Can the helper make the read-only mount layer?  Root: yes.  Otherwise probed once
    (a user namespace is needed; some systems disable them)."""
    global _RO_MOUNTS
    if os.geteuid() == 0:
        return True
    if _RO_MOUNTS is None:
        try:
            _RO_MOUNTS = subprocess.run([helper, "--ro-mounts", "--", "true"], stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        env=_HELPER_ENV, timeout=10).returncode == 0
        except (OSError, subprocess.SubprocessError):
            _RO_MOUNTS = False
    return _RO_MOUNTS


_CGROUP_MOUNTS: tuple[str, ...] | None = None


def _cgroup_mounts() -> tuple[str, ...]:
    """Mount points of every cgroup / cgroup2 filesystem (read once per process)."""
    global _CGROUP_MOUNTS
    if _CGROUP_MOUNTS is None:
        found = []
        try:
            # host-access: our own process mount table (finding the cgroup2 mount)
            with open("/proc/self/mountinfo") as f:
                for line in f:
                    parts = line.split()
                    try:
                        sep = parts.index("-")
                    except ValueError:
                        continue
                    if parts[sep + 1] in ("cgroup", "cgroup2"):
                        found.append(parts[4].replace("\\040", " "))
        except OSError:
            pass
        _CGROUP_MOUNTS = tuple(found)
    return _CGROUP_MOUNTS


def _mask_dirs(rw_trees: Sequence[Root] = ()) -> list[str]:
    """Host directories hidden from the child under an empty read-only tmpfs: cgroupfs.

    A child holding an ``O_PATH`` fd on a cgroup directory (Landlock does not
    check ``O_PATH``) could fork into it with ``clone3(CLONE_INTO_CGROUP)``,
    leaving its leaf (uid 0 passes the ``cgroup.procs`` owner check).  Every
    cgroup mount under ``/sys/fs/cgroup`` is covered by one mask on
    ``/sys/fs/cgroup``; others get their own.  A directory holding a
    writable tree is never masked.
    """
    out: list[str] = []
    for mp in _cgroup_mounts():
        d = "/sys/fs/cgroup" if mp == "/sys/fs/cgroup" or mp.startswith("/sys/fs/cgroup/") else mp
        if d not in out and not any(d.startswith(o + "/") for o in out):
            out = [o for o in out if not o.startswith(d + "/")] + [d]
    if rw_trees and out:
        homes = []
        for t in rw_trees:
            fd = t.fileno_dup()
            try:
                # host-access: our own fd's path, compared with the mask list only (never opened)
                homes.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass
            finally:
                os.close(fd)
        out = [d for d in out if not any(h == d or h.startswith(d + "/") for h in homes)]
    return out[:32]


def _ensure_dirs(workspace: Root) -> None:
    if workspace.read_only:
        return
    for name in (HOME_DIR, TMP_DIR):
        try:
            workspace.mkdir(name, 0o700, exist_ok=True)
        except FileExistsError:
            pass


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


def _process_bounds(prep: _Prepared, supervisor: ProcessSupervisor, policy: ConfinementPolicy,
                    confinement: str, identity: tuple[int, int] | None = None) -> list[str]:
    """Choose the process-count bounds; set ``prep.process_bounds``; return the helper's extra args.

    In order: the cgroup v2 leaf's ``pids.max``; ``RLIMIT_NPROC`` when Linux
    enforces it (a non-root command); and only when neither holds, a cgroup
    v1 pids leaf (an isolated join waits for an RCU grace period, ~14 ms
    measured on the 2-core VM, so it is the last resort).  Each bound is read back from
    the kernel.

    Raises:
        ConfinementError: ``confinement="required"``, the policy asks for a
            bound (``pids_max`` or ``processes``) and none can be enforced.
    """
    bounds: list[str] = []
    args: list[str] = []
    if prep.leaf is not None and policy.pids_max is not None:
        n = _read_pids_max(prep.leaf)
        if n is not None:
            bounds.append(f"cgroup2.pids.max={n}")
    if policy.processes is not None and (identity is not None or _nproc_enforced()):
        bounds.append(f"rlimit.nproc={int(policy.processes)}")
    if not bounds and policy.pids_max is not None and policy.use_cgroup:
        leaf = supervisor._new_pids_leaf(policy.pids_max)
        if leaf is not None:
            prep.pids_leaf = leaf
            n = _read_pids_max(leaf)
            if n is not None:
                fd = os.open(f"{leaf}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)  # host-access: cgroupfs (kernel interface)
                prep.pass_fds.append(fd)
                args += ["--pids-procs", str(fd)]
                bounds.append(f"cgroup1.pids.max={n}")
    if not bounds and confinement == "required" and (policy.pids_max is not None or policy.processes is not None):
        raise ConfinementError("no process-count bound can be enforced on this host (no cgroup pids "
                               "controller, and RLIMIT_NPROC does not bind uid 0); confinement='required' "
                               "fails closed", secrets=prep.secrets)
    prep.process_bounds = tuple(bounds)
    return args


_STAGE_TEXT = {
    "landlock": "applying the Landlock ruleset failed",
    "no_new_privs": "setting no_new_privs failed",
    "capabilities": "dropping capabilities failed",
    "cgroup": "joining the cgroup failed",
    "unshare": "creating namespaces failed",
    "rlimit": "setting an rlimit failed",
    "setsid": "starting a new session failed",
    "tty": "making the PTY the controlling terminal failed",
    "cwd": "changing to the working directory failed",
    "proc_self": "granting /proc/self failed",
    "mounts": "making the mounts outside the workspace read-only failed",
    "mask": "hiding a host directory (cgroupfs) from the child failed",
    "netns": "joining the supervisor's network or IPC namespace failed",
    "seccomp": "installing the seccomp filter failed",
    "keyring": "joining a fresh session keyring failed",
    "env": "handing the environment to the exec helper failed",
    "pids": "joining the cgroup v1 pids leaf failed",
    "usage": "the exec helper was called wrongly",
    "identity": "switching to the unprivileged identity failed",
    "reach": "making a granted tree reachable for the unprivileged identity failed",
}


def _status_error(status: bytes, argv0: str, prep: _Prepared) -> ExecError:
    try:
        stage, err_s = status.decode("ascii", "replace").split()[:2]
        err = int(err_s)
    except ValueError:
        stage, err = "unknown", 0
    name = errno.errorcode.get(err, str(err))
    shown = redact(argv0, prep.secrets)
    if stage == "exec":
        if err in (errno.ENOENT, errno.ENOTDIR):
            return CommandNotFoundError(f"program not found: {shown}", sandbox_path=prep.cwd_shown,
                                        context={"errno": name}, secrets=prep.secrets)
        if err == errno.EACCES:
            return CommandNotFoundError(
                f"program not executable inside the sandbox: {shown} (outside the system set and every grant?)",
                sandbox_path=prep.cwd_shown, context={"errno": name}, secrets=prep.secrets)
        return ExecError(f"starting {shown} failed ({name})", sandbox_path=prep.cwd_shown,
                         context={"errno": name}, secrets=prep.secrets)
    if stage == "cwd":
        return ExecError("changing to the working directory failed", sandbox_path=prep.cwd_shown,
                         context={"errno": name}, secrets=prep.secrets)
    return ConfinementError(f"{_STAGE_TEXT.get(stage, 'the exec helper failed')} ({name})",
                            sandbox_path=prep.cwd_shown, context={"stage": stage, "errno": name},
                            secrets=prep.secrets)


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
    """

    def __init__(self, pid: int, pid_ns: bool, status: "_Status | None" = None) -> None:
        self.pid = pid
        self.pid_ns = pid_ns
        self._status = status
        self._pidfd = os.pidfd_open(pid)
        self._returncode: int | None = None
        self._lock = trio.Lock()

    def _reap(self, flags: int) -> None:
        try:
            wpid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:  # pragma: no cover - someone else reaped it
            wpid, status = self.pid, 255 << 8
        if wpid == self.pid:
            code = os.waitstatus_to_exitcode(status)
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


_STATUS_TIMEOUT_S = 30.0


class _Status:
    """The helper's status pipe.

    Lines: "pid N MODE" (the helper forked its init), then "ok" (the command
    reached ``execve``) or a failure "STAGE ERRNO", then "exit WSTATUS"
    when the init ends.  Without ``--init`` the helper writes a failure
    line or nothing (EOF at ``execve``).
    """

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self.fd = fd
        self.data = b""
        self.eof = False
        self.exit_status: int | None = None

    @property
    def stream(self) -> int | None:
        return self.fd if self.fd >= 0 else None

    def _read_now(self) -> bool:
        """Read what is there without blocking; False when it would block."""
        while not self.eof and self.fd >= 0 and len(self.data) < _STATUS_MAX:
            try:
                chunk = os.read(self.fd, _STATUS_MAX)
            except BlockingIOError:
                return False
            if not chunk:
                self.eof = True
            self.data += chunk
        return True

    async def read_line(self) -> bytes | None:
        """Read until a full line or EOF; returns the line, or None at EOF with nothing pending."""
        while b"\n" not in self.data and not self.eof and self.fd >= 0 and len(self.data) < _STATUS_MAX:
            if not self._read_now() and b"\n" not in self.data:
                try:
                    await trio.lowlevel.wait_readable(self.fd)
                except trio.ClosedResourceError:
                    break
        if b"\n" in self.data:
            line, _, self.data = self.data.partition(b"\n")
            return line
        line, self.data = self.data, b""
        return line or None

    async def startup(self) -> bytes:
        """The command's start: b"" once it reached ``execve`` (or at EOF), else the failure line."""
        line = await self.read_line()
        return b"" if line in (None, b"ok") else line.strip()

    async def rest(self) -> bytes:
        """Everything up to EOF (EOF comes at the target's execve or its failure exit)."""
        while not self.eof and self.fd >= 0 and len(self.data) < _STATUS_MAX:
            if not self._read_now():
                try:
                    await trio.lowlevel.wait_readable(self.fd)
                except trio.ClosedResourceError:
                    break
        await self.aclose()
        return self.data.strip()

    def take_exit(self) -> int | None:
        """After the init was reaped: the command's raw wait status from the "exit" line, or None."""
        self._read_now()
        for line in self.data.split(b"\n"):
            if line.startswith(b"exit "):
                try:
                    self.exit_status = int(line.split()[1])
                except (IndexError, ValueError):
                    pass
        self.data = b"\n".join(ln for ln in self.data.split(b"\n") if not ln.startswith(b"exit "))
        return self.exit_status

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            trio.lowlevel.notify_closing(fd)
            os.close(fd)

    async def aclose(self) -> None:
        self.close()
        await trio.lowlevel.checkpoint_if_cancelled()


async def _spawn(prep: _Prepared, supervisor: ProcessSupervisor, argv0: str, *, stdin: object,
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
            _CgroupTree.remove(prep.leaf)
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
        timeout_s: wall-clock seconds before SIGTERM to the command's tree,
            ``policy.kill_grace_s`` of grace, then SIGKILL (None: no limit).
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

    Returns:
        :class:`ExecResult`; a non-zero exit is a result, not an exception.

    Raises:
        ConfinementError: ``confinement="required"`` and Landlock is
            unavailable, or no process-count bound can be enforced, or a
            confinement step fails (fails closed); on a root host, no
            identity can be leased, the workspace cannot be re-owned, or a
            read-write grant is not owned by the identity.
        CommandNotFoundError: the program does not exist or may not be
            executed inside the sandbox.
        ExecTimeoutError: ``timeout_s`` passed; ``.result`` has the partial output.
        ExecFailedError: ``check`` and the exit status is non-zero.
        InvalidEnvError: a malformed ``env`` entry, or an environment over
            :data:`MAX_ENV_BYTES` bytes or :data:`MAX_ENV_ENTRIES` entries.
        ExecError: bad ``argv``/``shell``/``confinement`` values, or the cwd
            cannot be entered.
        PathEscapeError, FileNotFoundError, NotADirectoryError: ``cwd`` does
            not resolve to a directory beneath the workspace.

    *Cancellation*: a cancel kills the command's whole tree (and cgroup leaf)
    with SIGKILL and reaps it before propagating; nothing keeps running and
    no fd is left open.
    """
    await trio.lowlevel.checkpoint()
    own = supervisor is None
    sup = supervisor if supervisor is not None else ProcessSupervisor(use_cgroup=policy.use_cgroup,
                                                                     pids_max=policy.pids_max,
                                                                     hold_mount_ns=False)
    try:
        return await _run(argv, workspace=workspace, workspace_host_path=workspace_host_path, grants=grants,
                          cwd=cwd, env=env, secret_env=secret_env, stdin=stdin, shell=shell,
                          timeout_s=timeout_s, max_output_bytes=max_output_bytes, confinement=confinement,
                          sup=sup, policy=policy, check=check)
    finally:
        if own:
            with trio.CancelScope(shield=True):
                await sup.aclose()


async def _run(argv, *, workspace, workspace_host_path, grants, cwd, env, secret_env, stdin, shell, timeout_s,
               max_output_bytes, confinement, sup, policy, check) -> ExecResult:
    mount_ns = await _held_mount_ns(sup, workspace, grants, confinement, policy)
    ids = await trio.to_thread.run_sync(_ready_identity, sup, policy, confinement, workspace, grants)
    prep = _prepare(argv, workspace=workspace, workspace_host_path=workspace_host_path, grants=grants, cwd=cwd,
                    env=env, secret_env=secret_env, shell=shell, confinement=confinement, supervisor=sup,
                    policy=policy, tty=False, mount_ns=mount_ns, identity=ids)
    argv0 = _command(argv, shell)[0]
    start = time.monotonic()
    proc, tracked, status = await _spawn(prep, sup, argv0,
                                         stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    target = tracked.process
    failure = b""
    started = False
    out, err = _HeadTail(max_output_bytes), _HeadTail(max_output_bytes)
    out_eof, err_eof = trio.Event(), trio.Event()
    timed_out = False

    async def pump(stream: trio.abc.ReceiveStream, buf: _HeadTail, done: trio.Event) -> None:
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

    async def feed(stream: trio.abc.SendStream) -> None:
        try:
            if isinstance(stdin, (bytes, bytearray, memoryview)):
                if stdin:
                    await stream.send_all(bytes(stdin))
            else:
                async for chunk in stdin:  # type: ignore[union-attr]
                    await stream.send_all(bytes(chunk))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def read_status() -> None:
        nonlocal failure, started
        failure = await status.startup()
        started = True

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_status)
            nursery.start_soon(pump, proc.stdout, out, out_eof)
            nursery.start_soon(pump, proc.stderr, err, err_eof)
            if proc.stdin is not None:
                nursery.start_soon(feed, proc.stdin)
            deadline = trio.current_time() + timeout_s if timeout_s is not None else math.inf
            with trio.move_on_at(deadline) as cs:
                await target.wait()
            if cs.cancelled_caught:
                timed_out = True
                await sup._kill_one(tracked, policy.kill_grace_s)
            with trio.move_on_after(policy.eof_grace_s):
                await out_eof.wait()
                await err_eof.wait()
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            if target.returncode is None:
                await sup._kill_one(tracked, 0)
            if target is not proc:
                await proc.wait()  # the helper exited right after forking the target
            if not started:
                with trio.move_on_after(1.0):
                    failure = await status.startup()
            await status.aclose()
            for s in (proc.stdin, proc.stdout, proc.stderr):
                if s is not None:
                    await s.aclose()
            sup._release_if_done(tracked)
    if failure:
        raise _status_error(failure, argv0, prep)
    result = ExecResult(
        exit_code=target.returncode if target.returncode is not None else -signal.SIGKILL,
        stdout=out.value(), stderr=err.value(),
        stdout_truncated=out.truncated, stderr_truncated=err.truncated,
        duration_s=time.monotonic() - start, confinement=prep.level, landlock_abi=prep.abi,
        read_only_mounts=prep.ro_mounts, network_isolated=prep.net_isolated,
        stdout_bytes=out.total, stderr_bytes=err.total, process_bounds=prep.process_bounds, identity=ids)
    shown = redact(argv0, prep.secrets)
    if timed_out:
        raise ExecTimeoutError(f"{shown} ran past {timeout_s} s; its process tree was killed",
                               result=result, sandbox_path=prep.cwd_shown,
                               context={"timeout_s": timeout_s}, secrets=prep.secrets)
    if check and result.exit_code != 0:
        raise ExecFailedError(f"{shown} exited with status {result.exit_code}", result=result,
                              sandbox_path=prep.cwd_shown, context={"exit_code": result.exit_code},
                              secrets=prep.secrets)
    return result


# ----------------------------------------------------------------- PTY

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
    ) -> tuple[str, bytes]:
        """Start ``argv`` on a new PTY, confined like :func:`run_confined`.

        Args:
            argv, workspace, workspace_host_path, grants, cwd, env, secret_env,
                shell, confinement, policy: as for :func:`run_confined`.
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
        if len(self._ptys) >= self.max_live:
            await self._prune_one()
        caller_env = dict(env or {})
        mount_ns = await _held_mount_ns(self.supervisor, workspace, grants, confinement, policy)
        ids = await trio.to_thread.run_sync(_ready_identity, self.supervisor, policy, confinement, workspace, grants)
        prep = _prepare(argv, workspace=workspace, workspace_host_path=workspace_host_path, grants=grants,
                        cwd=cwd, env=caller_env, secret_env=secret_env, shell=shell, confinement=confinement,
                        supervisor=self.supervisor, policy=policy, tty=True, mount_ns=mount_ns, identity=ids)
        argv0 = _command(argv, shell)[0]
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
        now = time.monotonic()
        pty_id = f"pty-{next(self._ids)}-{os.urandom(4).hex()}"
        p = _Pty(pty_id, tracked, trio.lowlevel.FdStream(master), now, now)
        self._ptys[pty_id] = p
        first = await self.pty_read(pty_id, timeout_s=first_output_timeout_s)
        return pty_id, first

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
