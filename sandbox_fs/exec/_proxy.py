"""The host-side egress proxy: HTTP CONNECT, plain-HTTP forwarding and SOCKS5 on a listening socket fd.

A confined command keeps its private network namespace (only loopback).  The
``sfs-exec`` helper binds and listens on ``127.0.0.1:PORT`` inside it and
hands the *listening* fd to the host; :meth:`EgressProxy.serve` accepts on
that fd (a socket keeps the namespace it was made in, so no relay process and
no ``setns`` are needed) and connects outwards from the host's namespace, but
only to what its :class:`HostRule` allow-list permits.

Per connection, the first byte decides the protocol: ``0x05`` is SOCKS5 (no
authentication, ``CONNECT`` only; a domain name, IPv4 or IPv6 address), any
other byte starts an HTTP request head: ``CONNECT host:port`` (a tunnel), or
an absolute-URI request ``GET http://host[:port]/path`` (forwarded as one
request: ``Host`` is set from the URI, ``Connection: close``).

Every decision happens before any byte reaches a server:

1. the name is normalised (case, trailing dot, IDNA) and matched against the
   rules, port included; an IP literal must match a rule whose pattern is
   that literal (wildcards never match an address);
2. the proxy resolves the name itself (``resolve``, default trio's
   ``getaddrinfo``) and drops every answer in a loopback, link-local,
   private, shared, multicast, unspecified or reserved range, v4 and v6,
   including v4 addresses embedded in v6 (v4-mapped, v4-compatible, 6to4,
   Teredo, NAT64) unless ``allow_private`` (a test-only policy; multicast and
   unspecified stay refused);
3. it connects to the checked address itself, never to the name again, so
   a second answer (DNS rebinding) is never used.

Request heads and SOCKS handshakes are bounded in size and in time (a client
sending one byte a second is cut off), upstream connects and idle tunnels
time out, and the number of concurrent connections is capped (further
clients wait in the listen backlog).  Every attempt, refused or not, ends in
one :class:`EgressEvent` in the :class:`EgressLog` with the payload bytes
each way.  Refusals answer HTTP ``403`` (``X-Sandbox-Egress: refused``) or
SOCKS reply ``0x02`` (connection not allowed by ruleset).

The proxy sees host names and ports, never content: a CONNECT tunnel is
opaque bytes (TLS) to the allowed address.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import os
import re
import socket
import struct
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import trio

__all__ = [
    "EgressEvent",
    "EgressLog",
    "EgressProxy",
    "HostRule",
    "ProxyLimits",
    "Resolver",
    "normalize_host",
]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

#: ``async resolve(host, port) -> addresses``: the proxy's name resolution (a test hook).
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]

_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?\Z")
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+\Z")
_HOP_BY_HOP = {b"connection", b"proxy-connection", b"keep-alive", b"proxy-authorization",
               b"proxy-authenticate", b"te", b"trailer", b"upgrade", b"host"}
_SPLICE_CHUNK = 256 * 1024  # per splice and the pipe's size: at most 2 such pipes per connection
_RECV_CHUNK = 64 * 1024  # the recv/send fallback's buffer, per direction
# Bulk mode: once one read moves a full loopback segment, the source wakes the relay only when
# _BULK_LOWAT is queued (SO_RCVLOWAT) and the relay moves up to _BULK_BUFFER per recv/send (one
# sendmsg, where a splice from a pipe sends 16 pages per call): fewer wake-ups of the relay and of
# the reader behind it.  A wait that sees less than the mark for _BULK_WAIT_S takes what is there;
# if that is less than _BULK_AFTER (a lull) the source wakes on every byte again, so an
# interactive exchange, or a stream's last bytes before a pause, is held that long at most, once;
# the buffer is dropped with bulk mode.  At most
# ProxyLimits.max_bulk_streams directions are in bulk mode at once; the others keep splicing.
_BULK_AFTER = 64 * 1024
_BULK_LOWAT = 1024 * 1024
_BULK_BUFFER = 2 * 1024 * 1024
_BULK_WAIT_S = 0.001
# accept(2): a connection's own pending network error (skip it), or a shortage that passes (wait)
_ACCEPT_TRANSIENT = {errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EAGAIN, errno.ENETDOWN, errno.ENOPROTOOPT,
                     errno.EHOSTDOWN, errno.ENONET, errno.EHOSTUNREACH, errno.EOPNOTSUPP, errno.ENETUNREACH,
                     errno.EPERM, errno.ETIMEDOUT}
_ACCEPT_RESOURCE = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_HAVE_SPLICE = hasattr(os, "splice") and hasattr(os, "pipe2")
_SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 0) | getattr(os, "SPLICE_F_NONBLOCK", 0)
_MAX_REASON_CHARS = 200


# --------------------------------------------------------------------------- names and rules


def _ip_literal(host: str) -> IPAddress | None:
    text = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if "%" in text:  # a v6 zone id: not a global address, never allowed
        return None
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def normalize_host(host: str) -> str:
    """The canonical form of a host name or IP literal, as rules and events use it.

    Args:
        host: a DNS name (any case, Unicode allowed, one trailing dot allowed)
            or an IP literal (IPv6 with or without brackets).

    Returns:
        A name: lowercase ASCII (IDNA 2003, ``xn--`` labels), no trailing dot.
        An address: its compressed form without brackets (v4-mapped v6
        stays v6: ``::ffff:127.0.0.1``).

    Raises:
        ValueError: not a valid name (empty or over-long labels, characters
            outside letters, digits, ``-`` and ``_``, over 253 characters, an
            all-numeric last label such as ``127.1``, or anything
            ``inet_aton`` reads as an address such as ``0x7f000001``) nor an
            IP literal.
    """
    addr = _ip_literal(host)
    if addr is not None:
        return str(addr)
    name = host[:-1] if host.endswith(".") else host
    if not name or len(name) > 253 * 4:
        raise ValueError("invalid host name")
    try:
        name = name.encode("idna").decode("ascii").lower()
    except UnicodeError:
        raise ValueError("invalid host name") from None
    labels = name.split(".")
    if len(name) > 253 or not all(_LABEL.match(label) for label in labels) or labels[-1].isdigit():
        raise ValueError("invalid host name")
    try:
        socket.inet_aton(name)  # "0x7f000001", "017700000001": resolvers read these as addresses
    except OSError:
        return name
    raise ValueError("invalid host name")


@dataclass(frozen=True)
class HostRule:
    """One allow-list entry: a host pattern and the ports it allows.

    Args:
        pattern: a name (``"pypi.org"``), a wildcard ``"*.pythonhosted.org"``
            (one or more labels below that domain, never the bare domain), or
            an IP literal (matched only by that address).  Case-insensitive,
            IDNA; stored normalised (:func:`normalize_host`).
        ports: the allowed TCP ports (1-65535); ``None`` allows every port.

    Raises:
        ValueError: the pattern is not a valid name, wildcard or IP literal
            (``*`` anywhere but a leading ``*.``; a bare ``*``; a wildcard over
            a single label such as ``*.com``), or a port is out of range.
    """

    pattern: str
    ports: frozenset[int] | None = None

    def __post_init__(self) -> None:
        pattern = self.pattern
        if pattern.startswith("*."):
            normalized = "*." + normalize_host(pattern[2:])
            if _ip_literal(normalized[2:]) is not None:
                raise ValueError("a wildcard cannot cover an IP address")
            if "." not in normalized[2:]:
                raise ValueError("a wildcard needs a domain of two labels or more (not '*.com')")
        else:
            normalized = normalize_host(pattern)
        object.__setattr__(self, "pattern", normalized)
        if self.ports is not None:
            ports = frozenset(self.ports)
            if not ports or any(isinstance(p, bool) or not isinstance(p, int) or not 0 < p < 65536 for p in ports):
                raise ValueError("ports must be a non-empty set of integers 1-65535, or None")
            object.__setattr__(self, "ports", ports)

    @classmethod
    def parse(cls, text: str) -> HostRule:
        """A rule from ``NAME``, ``NAME:PORT``, ``[V6]`` or ``[V6]:PORT`` (the ``--allow-host`` syntax).

        Raises:
            ValueError: malformed, or as the constructor.
        """
        host, port = text, None
        if text.startswith("["):
            end = text.find("]")
            if end < 0 or text[end + 1:] not in ("",) and not text[end + 1:].startswith(":"):
                raise ValueError("malformed host rule")
            host, rest = text[:end + 1], text[end + 1:]
            port = rest[1:] if rest else None
        elif text.count(":") == 1:
            host, port = text.split(":")
        if port is not None and not (port.isascii() and port.isdigit()):
            raise ValueError("malformed port in host rule")
        return cls(host, None if port is None else frozenset({int(port)}))

    @property
    def is_address(self) -> bool:
        """Whether the pattern is an IP literal."""
        return _ip_literal(self.pattern) is not None

    def matches_host(self, host: str) -> bool:
        """Whether a normalised host (:func:`normalize_host`) falls under the pattern (ports aside)."""
        if self.pattern.startswith("*."):
            return _ip_literal(host) is None and host.endswith(self.pattern[1:])
        return host == self.pattern

    def matches(self, host: str, port: int) -> bool:
        """Whether a normalised host and a port are allowed by this rule."""
        return self.matches_host(host) and (self.ports is None or port in self.ports)


_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")


def _embedded_v4(addr: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    out = []
    if addr.ipv4_mapped is not None:
        out.append(addr.ipv4_mapped)
    if addr.sixtofour is not None:
        out.append(addr.sixtofour)
    if addr.teredo is not None:
        out.extend(addr.teredo)
    value = int(addr)
    if value >> 32 == 0 and value > 1:  # v4-compatible ::a.b.c.d (deprecated)
        out.append(ipaddress.IPv4Address(value & 0xFFFFFFFF))
    if addr in _NAT64 or addr in _NAT64_LOCAL:
        out.append(ipaddress.IPv4Address(value & 0xFFFFFFFF))
    return out


def address_refusal(addr: IPAddress, *, allow_private: bool = False) -> str | None:
    """Why the proxy will not connect to ``addr``, or ``None`` when it may.

    Args:
        addr: a resolved address.
        allow_private: allow loopback, private, link-local, shared and
            reserved ranges (test-only policies); multicast and unspecified
            stay refused.

    Returns:
        ``None``, or a short reason (``"loopback"``, ``"private"``, ...).
    """
    candidates: list[IPAddress] = [addr]
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None or addr in _NAT64:
            candidates = []  # the v6 form only carries the v4 destination: judge that alone
        candidates.extend(_embedded_v4(addr))
    for a in candidates:
        if a.is_unspecified:
            return "unspecified"
        if a.is_multicast:
            return "multicast"
        if allow_private:
            continue
        for kind in ("loopback", "link_local", "reserved", "private"):
            if getattr(a, "is_" + kind):
                return kind.replace("_", "-")
        if not a.is_global:
            return "not global"
    return None


# --------------------------------------------------------------------------- events


class EgressEvent(NamedTuple):
    """One connection attempt through the proxy.

    Attributes:
        time_s: wall-clock time of the attempt (``time.time()``, seconds).
        host: the normalised host asked for (``""`` when the request could
            not be read; control characters never appear).
        port: the TCP port asked for (``0`` when unknown).
        allowed: whether the policy allowed it (an allowed attempt can still
            fail to connect: see ``reason``).
        reason: ``"ok"``, or why it was refused or failed (``"host not
            allowed"``, ``"port not allowed"``, ``"address refused: 10.0.0.1
            (private)"``, ``"resolve failed"``, ``"connect failed: ..."``,
            ``"bad request"``, ``"header too large"``, ``"timeout"``, ...).
        bytes_up: payload bytes written to the server (for plain HTTP the
            rewritten request head included; proxy handshakes excluded).
        bytes_down: payload bytes written back to the client (proxy replies
            excluded).
    """

    time_s: float
    host: str
    port: int
    allowed: bool
    reason: str
    bytes_up: int
    bytes_down: int


class EgressLog:
    """A bounded buffer of :class:`EgressEvent` with a count of drops.

    When full, new events are dropped and counted (the earliest are kept).

    Args:
        capacity: most events held between drains (``0``: every event is
            dropped and counted).

    Raises:
        ValueError: ``capacity`` is negative.
    """

    def __init__(self, capacity: int = 10000) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._events: deque[EgressEvent] = deque()
        self._dropped = 0

    def __len__(self) -> int:
        return len(self._events)

    @property
    def dropped(self) -> int:
        """Events dropped since the last :meth:`drain`."""
        return self._dropped

    def record(self, event: EgressEvent) -> None:
        """Keep one event, or count it as dropped when full; never blocks or raises."""
        if len(self._events) >= self.capacity:
            self._dropped += 1
        else:
            self._events.append(event)

    def drain(self, max_events: int | None = None) -> tuple[list[EgressEvent], int]:
        """Take the oldest events (all, or at most ``max_events``).

        Returns:
            ``(events, dropped)``: events in recording order and the drops
            since the previous drain (the count restarts at zero).
        """
        count = len(self._events) if max_events is None else min(max_events, len(self._events))
        out = [self._events.popleft() for _ in range(count)]
        dropped, self._dropped = self._dropped, 0
        return out, dropped


# --------------------------------------------------------------------------- the proxy


@dataclass(frozen=True)
class ProxyLimits:
    """Bounds on what a client may make the proxy hold or wait for.

    Attributes:
        max_connections: concurrent client connections (further ones wait
            in the listen backlog until one ends).
        max_header_bytes: an HTTP request head (request line and headers,
            blank line included) or a SOCKS5 handshake; larger gets ``431``.
        handshake_timeout_s: time for the whole request head or SOCKS
            handshake to arrive (``408``; slow clients are cut off).
        connect_timeout_s: resolution plus the upstream connect (``504`` /
            SOCKS ``0x06``).
        idle_timeout_s: a relay with no byte either way for this long is
            closed.
        max_bulk_streams: relay directions in bulk mode at once (each holds
            a 2 MiB buffer while a stream is fast; 0: never).
    """

    max_connections: int = 64
    max_header_bytes: int = 16 * 1024
    handshake_timeout_s: float = 10.0
    connect_timeout_s: float = 15.0
    idle_timeout_s: float = 300.0
    max_bulk_streams: int = 8

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.max_header_bytes < 64 or self.max_bulk_streams < 0:
            raise ValueError("max_connections must be >= 1, max_header_bytes >= 64 and max_bulk_streams >= 0")
        if min(self.handshake_timeout_s, self.connect_timeout_s, self.idle_timeout_s) <= 0:
            raise ValueError("timeouts must be positive")


class _Refused(Exception):
    """A request ends here: HTTP status / SOCKS reply code, event reason, whether policy allowed it."""

    def __init__(self, status: int, socks: int, reason: str, *, allowed: bool = False) -> None:
        super().__init__(reason)
        self.status, self.socks, self.reason, self.allowed = status, socks, reason, allowed


_STATUS_TEXT = {400: "Bad Request", 403: "Forbidden", 408: "Request Timeout", 431: "Request Header Fields Too Large",
                501: "Not Implemented", 502: "Bad Gateway", 504: "Gateway Timeout"}


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() and c.isascii() else f"\\x{ord(c) & 0xFF:02x}" for c in text)[
        :_MAX_REASON_CHARS]


async def _default_resolve(host: str, port: int) -> list[str]:
    infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    return [str(info[4][0]) for info in infos]


@dataclass
class _Conn:
    """One client connection's state (for its event)."""

    sock: trio.socket.SocketType
    started: float = field(default_factory=time.time)
    buf: bytearray = field(default_factory=bytearray)
    host: str = ""
    port: int = 0
    up: int = 0
    down: int = 0

    async def fill(self, want: int, limit: int) -> None:
        """Read until ``buf`` holds ``want`` bytes; a longer need than ``limit`` is ``431``."""
        if want > limit:
            raise _Refused(431, 1, "header too large")
        while len(self.buf) < want:
            data = await self.sock.recv(limit - len(self.buf))
            if not data:
                raise _Refused(400, 1, "client closed")
            self.buf += data

    def take(self, n: int) -> bytes:
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data


class EgressProxy:
    """The allow-list proxy for one confined command (or one held network namespace).

    Args:
        rules: the allow-list; a host:port no rule matches is refused.
        allow_private: connect to loopback/private/link-local/reserved answers
            too (test-only: production policies never set it).
        events: where each attempt's :class:`EgressEvent` goes.
        limits: size, time and concurrency bounds.
        resolve: ``async (host, port) -> [address, ...]`` (default: trio's
            ``getaddrinfo``); a test hook. Only its answers are connected to.
    """

    def __init__(self, rules: Sequence[HostRule], *, allow_private: bool = False, events: EgressLog,
                 limits: ProxyLimits = ProxyLimits(), resolve: Resolver | None = None) -> None:
        self.rules = tuple(rules)
        self.allow_private = allow_private
        self.events = events
        self.limits = limits
        self._resolve: Resolver = resolve or _default_resolve
        self._bulk_free = [limits.max_bulk_streams]  # bulk slots not taken (shared by every _Lane)

    def check(self, host: str, port: int) -> str | None:
        """Why the policy refuses ``host:port`` before resolution, or ``None`` (``host`` normalised)."""
        if not 0 < port < 65536:
            return "bad port"
        hits = [rule for rule in self.rules if rule.matches_host(host)]
        if not hits:
            return "host not allowed"
        if not any(rule.ports is None or port in rule.ports for rule in hits):
            return "port not allowed"
        return None

    async def serve(self, listen_fd: int, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Accept and serve clients on ``listen_fd`` until cancelled; always closes the fd.

        Args:
            listen_fd: a listening TCP socket (owned from now on; made
                non-blocking).
            task_status: started (``None``) once accepting.

        Raises:
            OSError: ``listen_fd`` is not a listening stream socket
                (``EINVAL``, ``ENOTSOCK``, ...), or accepting failed for
                another reason than a client's pending network error or a
                passing shortage of fds or memory.
        """
        try:
            std = socket.socket(fileno=listen_fd)
        except BaseException:
            os.close(listen_fd)
            raise
        with std:
            if std.type != socket.SOCK_STREAM or not std.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                raise OSError(errno.EINVAL, "the egress listener is not a listening stream socket")
            sock = trio.socket.from_stdlib_socket(std)  # made non-blocking; closing it closes std's fd
            slots = trio.Semaphore(self.limits.max_connections)
            async with trio.open_nursery() as nursery:
                task_status.started()
                while True:
                    await slots.acquire()
                    try:
                        client, _ = await sock.accept()
                    except OSError as exc:
                        slots.release()
                        if exc.errno in _ACCEPT_RESOURCE:
                            await trio.sleep(0.1)  # out of fds or memory for now: let connections end
                        elif exc.errno not in _ACCEPT_TRANSIENT:
                            raise
                        continue
                    except BaseException:
                        slots.release()
                        raise
                    nursery.start_soon(self._client, client, slots)

    async def _client(self, client: trio.socket.SocketType, slots: trio.Semaphore) -> None:
        conn = _Conn(client)
        allowed, reason = False, "ok"
        try:
            with client:
                allowed, reason = await self._handle(conn)
        except _Refused as exc:  # raised after the client socket closed (never in practice)
            allowed, reason = exc.allowed, exc.reason
        except OSError as exc:
            reason = f"client error: {errno.errorcode.get(exc.errno or 0, 'EIO')}"
        except Exception as exc:  # a bug here must end this connection, never the proxy (and its run)
            reason = f"internal error: {type(exc).__name__}"
        finally:
            slots.release()
            self.events.record(EgressEvent(conn.started, _printable(conn.host), conn.port, allowed,
                                           _printable(reason), conn.up, conn.down))

    async def _handle(self, conn: _Conn) -> tuple[bool, str]:
        """Serve one client; returns the event's ``(allowed, reason)``."""
        lim = self.limits
        socks = False
        try:
            with trio.fail_after(lim.handshake_timeout_s):
                await conn.fill(1, lim.max_header_bytes)
                socks = conn.buf[0] == 0x05
                request = await (self._socks_request(conn) if socks else self._http_request(conn))
            upstream = await self._connect(conn)
        except _Refused as exc:
            await self._refuse(conn, socks, exc)
            return exc.allowed, exc.reason
        except trio.TooSlowError:
            await self._refuse(conn, socks, _Refused(408, 1, "timeout"))
            return False, "timeout"
        with upstream:
            await self._send_all(conn.sock, self._socks_reply(0) if socks else request[1])
            head = request[0]
            if head:  # plain HTTP: the rewritten request head; the response ends the connection
                await self._send_all(upstream, head)
                conn.up += len(head)
            await self._relay(conn, upstream, until_server_eof=bool(head))
        return True, "ok"

    # ----------------------------------------------------------------- HTTP

    async def _http_request(self, conn: _Conn) -> tuple[bytes, bytes]:
        """Read and check an HTTP request head; returns ``(bytes for upstream, reply for the client)``."""
        limit = self.limits.max_header_bytes
        searched = 0
        while (end := conn.buf.find(b"\r\n\r\n", searched)) < 0:
            if len(conn.buf) >= limit:
                raise _Refused(431, 1, "header too large")
            searched = max(0, len(conn.buf) - 3)  # a client dripping bytes costs linear time, not quadratic
            await conn.fill(len(conn.buf) + 1, limit)
        head = conn.take(end + 4)
        lines = head[:-4].split(b"\r\n")
        if any(b"\n" in line or b"\r" in line or b"\0" in line for line in lines):
            raise _Refused(400, 1, "bad request")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1.") or not _TOKEN.match(parts[0]):
            raise _Refused(400, 1, "bad request")
        method, target, version = parts
        headers = []
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not _TOKEN.match(name):
                raise _Refused(400, 1, "bad request")
            headers.append((name, value.strip()))
        if method == b"CONNECT":
            self._set_target(conn, target.decode("latin-1"), None)
            return b"", b"HTTP/1.1 200 Connection established\r\n\r\n"
        text = target.decode("latin-1")
        if not text.lower().startswith("http://"):
            raise _Refused(400, 1, "not an absolute http:// URI")
        rest = text[7:]
        slash = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
        authority, path = rest[:slash], rest[slash:] or "/"
        if path.startswith("?"):
            path = "/" + path
        if "@" in authority:
            raise _Refused(400, 1, "userinfo in URI")
        self._set_target(conn, authority, 80)
        host = f"[{conn.host}]" if ":" in conn.host else conn.host
        host += "" if conn.port == 80 else f":{conn.port}"
        out = [b" ".join((method, path.encode("latin-1"), version)), b"Host: " + host.encode("ascii")]
        out += [name + b": " + value for name, value in headers if name.lower() not in _HOP_BY_HOP]
        out.append(b"Connection: close")
        return b"\r\n".join(out) + b"\r\n\r\n", b""

    def _set_target(self, conn: _Conn, authority: str, default_port: int | None) -> None:
        """Parse ``host:port`` / ``[v6]:port`` into ``conn``; ``400`` when malformed."""
        host, port_text = authority, ""
        if authority.startswith("["):
            end = authority.find("]")
            if end < 0 or (authority[end + 1:] and not authority[end + 1:].startswith(":")):
                raise _Refused(400, 1, "bad authority")
            host, port_text = authority[:end + 1], authority[end + 2:]
            if _ip_literal(host) is None:
                raise _Refused(400, 1, "bad authority")
        elif ":" in authority:
            host, _, port_text = authority.rpartition(":")
        if port_text:
            if not (port_text.isascii() and port_text.isdigit() and len(port_text) <= 5):
                raise _Refused(400, 1, "bad port")
            conn.port = int(port_text)
            if not 0 < conn.port < 65536:
                raise _Refused(400, 1, "bad port")
        elif default_port is None:
            raise _Refused(400, 1, "CONNECT needs a port")
        else:
            conn.port = default_port
        try:
            conn.host = normalize_host(host)
        except ValueError:
            conn.host = host
            raise _Refused(400, 1, "invalid host") from None

    # ----------------------------------------------------------------- SOCKS5

    async def _socks_request(self, conn: _Conn) -> tuple[bytes, bytes]:
        """The SOCKS5 greeting (no-auth) and CONNECT request; target into ``conn``."""
        limit = self.limits.max_header_bytes
        await conn.fill(2, limit)
        nmethods = conn.buf[1]
        await conn.fill(2 + nmethods, limit)
        methods = conn.take(2 + nmethods)[2:]
        if 0x00 not in methods:
            await self._send_all(conn.sock, b"\x05\xff")
            raise _Refused(0, -1, "socks: no acceptable auth method")
        await self._send_all(conn.sock, b"\x05\x00")
        await conn.fill(5, limit)
        ver, cmd, _rsv, atyp, first = conn.buf[:5]
        if ver != 0x05:
            raise _Refused(0, 1, "bad request")
        if atyp == 0x01:
            size, raw = 4 + 4, True
        elif atyp == 0x04:
            size, raw = 4 + 16, True
        elif atyp == 0x03:
            size, raw = 5 + first, False
        else:
            raise _Refused(0, 8, "socks: address type not supported")
        await conn.fill(size + 2, limit)
        req = conn.take(size + 2)
        conn.port = struct.unpack("!H", req[-2:])[0]
        if raw:
            conn.host = str(ipaddress.ip_address(req[4:size]))
        else:
            try:
                conn.host = normalize_host(req[5:size].decode("ascii"))
            except (UnicodeDecodeError, ValueError):
                conn.host = req[5:size].decode("ascii", "backslashreplace")
                raise _Refused(0, 4, "invalid host") from None
        if cmd != 0x01:
            raise _Refused(0, 7, "socks: command not supported")
        return b"", b""

    @staticmethod
    def _socks_reply(code: int) -> bytes:
        return bytes((0x05, code, 0x00, 0x01)) + b"\0\0\0\0\0\0"  # BND 0.0.0.0:0: nothing of the host shown

    # ----------------------------------------------------------------- connect, refuse, relay

    async def _connect(self, conn: _Conn) -> trio.socket.SocketType:
        """Check, resolve, filter and connect; ``_Refused`` for each way it can fail."""
        why = self.check(conn.host, conn.port)
        if why is not None:
            raise _Refused(403, 2, why)
        literal = _ip_literal(conn.host)
        try:
            with trio.fail_after(self.limits.connect_timeout_s):
                answers = [conn.host] if literal is not None else await self._resolve(conn.host, conn.port)
                addrs: list[IPAddress] = []
                refusals: list[str] = []
                for text in answers:
                    addr = ipaddress.ip_address(text.split("%")[0])
                    bad = address_refusal(addr, allow_private=self.allow_private)
                    if bad is None:
                        addrs.append(addr)
                    else:
                        refusals.append(f"address refused: {addr} ({bad})")
                if not addrs:
                    if refusals:
                        raise _Refused(403, 2, refusals[0])
                    raise _Refused(502, 4, "resolve failed", allowed=True)
                return await self._connect_any(addrs, conn.port)
        except trio.TooSlowError:
            raise _Refused(504, 6, "connect timeout", allowed=True) from None
        except (OSError, ValueError) as exc:
            if isinstance(exc, socket.gaierror):
                raise _Refused(502, 4, "resolve failed", allowed=True) from None
            code = {errno.ECONNREFUSED: 5, errno.ENETUNREACH: 3, errno.EHOSTUNREACH: 4}.get(
                getattr(exc, "errno", None) or 0, 1)
            name = errno.errorcode.get(getattr(exc, "errno", None) or 0, "error")
            raise _Refused(502, code, f"connect failed: {name}", allowed=True) from None

    async def _connect_any(self, addrs: list[IPAddress], port: int) -> trio.socket.SocketType:
        last: OSError | None = None
        for addr in addrs:
            family = socket.AF_INET6 if addr.version == 6 else socket.AF_INET
            sock = trio.socket.socket(family, socket.SOCK_STREAM)
            try:
                await sock.connect((str(addr), port))
            except OSError as exc:
                sock.close()
                last = exc
                continue
            except BaseException:
                sock.close()
                raise
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        assert last is not None
        raise last

    async def _refuse(self, conn: _Conn, socks: bool, exc: _Refused) -> None:
        """Answer a refusal (best effort, bounded in time): HTTP status or SOCKS reply code."""
        if socks:
            if exc.socks < 0:
                return
            reply = self._socks_reply(exc.socks)
        else:
            body = f"sandbox-fs egress: {exc.reason}: {_printable(conn.host)}:{conn.port}\n".encode()
            reply = (f"HTTP/1.1 {exc.status} {_STATUS_TEXT.get(exc.status, 'Error')}\r\n"
                     f"Content-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
                     f"X-Sandbox-Egress: {'refused' if exc.status == 403 else 'error'}\r\n"
                     "Connection: close\r\n\r\n").encode() + body
        with trio.move_on_after(1.0):
            try:
                await self._send_all(conn.sock, reply)
            except OSError:
                pass

    @staticmethod
    async def _send_all(sock: trio.socket.SocketType, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            sent = await sock.send(view)
            view = view[sent:]

    async def _relay(self, conn: _Conn, upstream: trio.socket.SocketType, *, until_server_eof: bool) -> None:
        """Copy both ways until both ends finish (half-close passed on) or the link is idle too long.

        With ``until_server_eof`` (a forwarded HTTP request, sent with
        ``Connection: close``) the server's EOF ends the whole connection, so
        a keep-alive client does not hold a connection slot.
        """
        if conn.buf:  # bytes the client sent right behind its request head
            pending = conn.take(len(conn.buf))
            await self._send_all(upstream, pending)
            conn.up += len(pending)
        idle = self.limits.idle_timeout_s
        with trio.CancelScope() as scope:
            scope.deadline = trio.current_time() + idle

            def moved_up(n: int) -> None:
                conn.up += n
                scope.deadline = trio.current_time() + idle

            def moved_down(n: int) -> None:
                conn.down += n
                scope.deadline = trio.current_time() + idle

            async def pump(src: trio.socket.SocketType, dst: trio.socket.SocketType,
                           moved: Callable[[int], None], last: bool) -> None:
                try:
                    await _copy(src, dst, moved, _Lane(self._bulk_free))
                    dst.shutdown(socket.SHUT_WR)
                    if last:
                        scope.cancel()
                except OSError:
                    scope.cancel()  # a reset either side ends the whole connection

            async with trio.open_nursery() as nursery:
                nursery.start_soon(pump, conn.sock, upstream, moved_up, False)
                nursery.start_soon(pump, upstream, conn.sock, moved_down, until_server_eof)


class _Lane:
    """One relay direction's claim on the proxy's bulk slots (``free``: a one-item list, the count left)."""

    def __init__(self, free: list[int]) -> None:
        self._free, self.held = free, False

    def enter(self) -> bool:
        """Take a slot unless held already; whether one is held now."""
        if not self.held and self._free[0] > 0:
            self._free[0] -= 1
            self.held = True
        return self.held

    def leave(self) -> None:
        """Give the slot back (idempotent)."""
        if self.held:
            self._free[0] += 1
            self.held = False


async def _copy(src: trio.socket.SocketType, dst: trio.socket.SocketType, moved: Callable[[int], None],
                lane: _Lane) -> None:
    """Copy ``src`` to ``dst`` until EOF, calling ``moved(n)`` for bytes written to ``dst``.

    Linux: ``splice`` through a pipe (the payload never enters this
    process) until the stream turns bulk, then :func:`_recv_copy` in bulk
    mode; elsewhere, or if the kernel refuses splice, :func:`_recv_copy`.

    Raises:
        OSError: either socket failed (reset, ...).
    """
    try:
        if _HAVE_SPLICE:
            try:
                if await _splice_copy(src, dst, moved, lane):
                    return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
        await _recv_copy(src, dst, moved, lane)
    finally:
        lane.leave()


async def _recv_copy(src: trio.socket.SocketType, dst: trio.socket.SocketType, moved: Callable[[int], None],
                     lane: _Lane) -> None:
    """:func:`_copy` by ``recv_into``/``send``: a 64 KiB buffer, or in bulk mode (``lane`` held) the mark and a ``_BULK_BUFFER``."""
    bulk = lane.held and _set_lowat(src, _BULK_LOWAT)
    if not bulk:
        lane.leave()
    buf, full = bytearray(_BULK_BUFFER if bulk else _RECV_CHUNK), False
    while True:
        n: int | None = None
        if bulk:  # never an untimed wait while the mark is up
            if full:  # more is likely queued: read it now
                n = _read_now(src, buf)
            if n is None:
                ready = await _wait_bulk(src)
                n = _read_now(src, buf)  # the mark filled, or did not in time: take what is there
                if not ready and (n is None or n < _BULK_AFTER):  # a lull: wake on every byte again
                    if not _set_lowat(src, 1):  # a mark that stays would stall: end the connection
                        raise OSError(errno.EIO, "SO_RCVLOWAT could not be lowered")
                    bulk = False
                    lane.leave()
                elif n is None:
                    continue  # woken with nothing to read
        if n is None:
            n = await src.recv_into(buf)
        if n == 0:
            return
        full = n == len(buf)
        await _send_all_counted(dst, memoryview(buf)[:n], moved)
        if not bulk and len(buf) > _RECV_CHUNK:
            buf = bytearray(_RECV_CHUNK)  # bulk mode's buffer goes with it
        if not bulk and n >= _BULK_AFTER and lane.enter():
            if _set_lowat(src, _BULK_LOWAT):
                bulk, full, buf = True, False, bytearray(_BULK_BUFFER)
            else:
                lane.leave()


def _read_now(sock: trio.socket.SocketType, buf: bytearray) -> int | None:
    """One non-blocking read into ``buf`` (it ignores the mark): bytes read, or None when none are queued.

    Raises:
        OSError: the socket failed.
    """
    try:
        return os.readv(sock.fileno(), [buf])
    except BlockingIOError:
        return None


async def _send_all_counted(dst: trio.socket.SocketType, view: memoryview, moved: Callable[[int], None]) -> None:
    while view:
        sent = await dst.send(view)
        view = view[sent:]
        moved(sent)


async def _splice_copy(src: trio.socket.SocketType, dst: trio.socket.SocketType,
                       moved: Callable[[int], None], lane: _Lane) -> bool:
    """:func:`_copy` by ``splice``; False when the first splice says EINVAL (nothing moved) or the stream
    turns bulk (``lane`` took a slot).

    It returns with the pipe empty: everything read was written.
    """
    r, w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        try:
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, _SPLICE_CHUNK)
        except OSError:
            pass  # the default pipe size only costs more rounds
        src_fd, dst_fd, first, waited = src.fileno(), dst.fileno(), True, False
        while True:
            if not waited:  # every round passes one checkpoint: a wait, or this one
                await trio.lowlevel.checkpoint()
            waited = False
            try:
                n = os.splice(src_fd, w, _SPLICE_CHUNK, flags=_SPLICE_FLAGS)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(src)
                waited = True
                continue
            except OSError as exc:
                if first and exc.errno == errno.EINVAL:
                    return False
                raise
            first = False
            if n == 0:
                return True
            bulk = n >= _BULK_AFTER
            while n:
                try:
                    sent = os.splice(r, dst_fd, n, flags=_SPLICE_FLAGS)
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(dst)
                    waited = True
                    continue
                n -= sent
                moved(sent)
            if bulk and lane.enter():
                return False
    finally:
        os.close(r)
        os.close(w)


async def _wait_bulk(src: trio.socket.SocketType) -> bool:
    """Wait until ``src`` has the mark queued (or EOF, or an error); False after ``_BULK_WAIT_S`` without."""
    with trio.move_on_after(_BULK_WAIT_S):
        await trio.lowlevel.wait_readable(src)
        return True
    return False


def _set_lowat(sock: trio.socket.SocketType, lowat: int) -> bool:
    """Set ``SO_RCVLOWAT``; whether it took."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
    except OSError:
        return False
    return True
