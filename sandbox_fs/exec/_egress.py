"""Egress by host name: the policy's checks, the command's proxy variables, and one run's proxy.

With ``ConfinementPolicy.allow_hosts`` the command keeps a network namespace
of its own.  The helper (``--egress-listen PORT --egress-sock FD``) brings
its loopback up, binds and listens on ``127.0.0.1:PORT`` there before it
confines itself, and sends the *listening* fd over the inherited unix
socket (SCM_RIGHTS).  :class:`EgressChannel` receives it and runs the host's
:class:`~sandbox_fs.exec._proxy.EgressProxy` on it for as long as the run
lives: a socket keeps its namespace, so the host accepts the command's
connections with no relay process and no ``setns``.  Landlock lets the
command connect to that port only; nothing else is reachable from its
namespace.  See "Egress by host name" in SECURITY.md.
"""

from __future__ import annotations

import array
import os
import socket
from typing import TYPE_CHECKING, Callable

import trio

from .. import _hosts
from ._errors import ExecError
from ._proxy import EgressEvent, EgressLog, EgressProxy, HostRule

if TYPE_CHECKING:  # pragma: no cover
    from ._models import ConfinementPolicy

#: The proxy's port on the command's loopback (its own namespace: no clash with the host).
PROXY_PORT = 3128

_INT = array.array("i")

#: Events kept per run; more are counted in ``ExecResult.egress_dropped``.
EVENT_CAPACITY = 1000


def check_policy(policy: ConfinementPolicy) -> None:
    """Validate ``allow_hosts`` and ``allow_private_egress`` (stores ``allow_hosts`` as a tuple).

    Raises:
        ExecError: an entry is malformed, or hosts are asked for together
            with ``allow_tcp_connect``, ``allow_tcp_bind``,
            ``unrestricted_tcp`` or ``isolate_network=False`` (the proxy
            needs the command in a network namespace of its own).
    """
    hosts = policy.allow_hosts
    if isinstance(hosts, (str, bytes)) or not isinstance(hosts, (tuple, list)):
        raise ExecError("allow_hosts must be a tuple of 'NAME[:PORT]' strings")
    try:
        proxy_rules(_hosts.parse_hosts(hosts))  # the proxy takes every entry this module accepts
    except ValueError as exc:
        raise ExecError(f"allow_hosts: {exc}") from None
    object.__setattr__(policy, "allow_hosts", tuple(hosts))
    if not isinstance(policy.allow_private_egress, bool):
        raise ExecError("allow_private_egress must be a bool")
    if hosts and (policy.allow_tcp_connect or policy.allow_tcp_bind or policy.unrestricted_tcp
                  or not policy.isolate_network):
        raise ExecError("allow_hosts needs the command's own network namespace: not together with "
                        "allow_tcp_connect, allow_tcp_bind, unrestricted_tcp or isolate_network=False")


def proxy_rules(entries: tuple[_hosts.HostEntry, ...]) -> list[HostRule]:
    """The proxy's rules for parsed entries.

    Raises:
        ValueError: the proxy refuses an entry.
    """
    return [HostRule(e.pattern, e.ports) for e in entries]


def connect_ports(policy: ConfinementPolicy) -> frozenset[int]:
    """The TCP ports Landlock lets the command connect to for egress: the proxy's, when hosts are allowed."""
    return frozenset({PROXY_PORT}) if policy.allow_hosts else frozenset()


def proxy_env() -> dict[str, str]:
    """The command's proxy variables, upper and lower case (``ALL_PROXY`` as ``socks5h://``: names resolved by the proxy)."""
    http = f"http://127.0.0.1:{PROXY_PORT}"
    values = {"HTTPS_PROXY": http, "HTTP_PROXY": http, "ALL_PROXY": f"socks5h://127.0.0.1:{PROXY_PORT}"}
    return {**values, **{k.lower(): v for k, v in values.items()}}


class EgressChannel:
    """One run's egress: the socket the helper sends its listener on, the proxy, its events.

    Args:
        policy: the run's policy (``allow_hosts`` non-empty).
    """

    def __init__(self, policy: ConfinementPolicy) -> None:
        self._rules = _hosts.parse_hosts(policy.allow_hosts)
        self._allow_private = policy.allow_private_egress
        host, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._host: socket.socket | None = host
        self.child_fd = child.detach()  # the helper's end (the caller passes and closes it)
        self._log: EgressLog | None = None

    def helper_args(self, pass_fd: Callable[[int], str]) -> list[str]:
        """The helper's arguments; ``pass_fd`` hands it the child end (:meth:`Prepared.pass_fd`)."""
        return ["--egress-listen", str(PROXY_PORT), "--egress-sock", pass_fd(self.child_fd)]

    async def run(self) -> None:
        """Receive the listener and serve it until cancelled (returns at once when the helper sent none).

        The proxy's own failures propagate (into the run's nursery).
        """
        listen_fd = await self._receive()
        if listen_fd is None:
            return
        try:
            self._log = EgressLog(EVENT_CAPACITY)
            proxy = EgressProxy(proxy_rules(self._rules),
                                allow_private=self._allow_private, events=self._log)
        except BaseException:
            os.close(listen_fd)
            raise
        async with trio.open_nursery() as nursery:
            await nursery.start(proxy.serve, listen_fd)  # serve owns (and closes) the fd from here

    async def _receive(self) -> int | None:
        """The listening fd the helper sent, or None at EOF (it failed or exited first)."""
        sock = self._host
        if sock is None:
            return None
        sock.setblocking(False)
        while True:
            try:
                # MSG_CMSG_CLOEXEC: close-on-exec at once, no concurrent spawn may inherit the
                # listener (socket.recv_fds drops its flags argument before Python 3.12)
                _msg, ancdata, _flags, _addr = sock.recvmsg(16, socket.CMSG_SPACE(_INT.itemsize),
                                                            socket.MSG_CMSG_CLOEXEC)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(sock)
                continue
            fds = array.array("i")
            for level, kind, data in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(data[:len(data) - len(data) % _INT.itemsize])
            for extra in fds[1:]:
                os.close(extra)
            return fds[0] if fds else None

    def events(self) -> tuple[tuple[EgressEvent, ...], int]:
        """``(events, dropped)`` the proxy logged (empty when it never served)."""
        if self._log is None:
            return (), 0
        events, dropped = self._log.drain()
        return tuple(events), int(dropped)

    def close(self) -> None:
        """Close the host end (idempotent)."""
        if self._host is not None:
            sock, self._host = self._host, None
            trio.lowlevel.notify_closing(sock)
            sock.close()
