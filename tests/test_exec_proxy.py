"""The egress proxy (sandbox_fs.exec._proxy): HTTP CONNECT, plain-HTTP forwarding, SOCKS5, the checks.

Every server here is one the test starts on 127.0.0.1; names are resolved by a
test resolver (``resolve=``), never by DNS, and only the tests that say so use
the test-only ``allow_private``.  The outside sentinel of each refusal is the
upstream server's connection count: a refused request never reaches it.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import struct
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox_fs.exec import EgressEvent, EgressLog, EgressProxy, HostRule, ProxyLimits
from sandbox_fs.exec import _proxy
from sandbox_fs.exec._proxy import address_refusal, normalize_host


# --------------------------------------------------------------------------- fixtures


@dataclass
class Upstream:
    """A server on 127.0.0.1: ``sink`` mode reads to EOF then sends ``reply``; ``http`` mode reads one head."""

    port: int = 0
    reply: bytes = b""
    http: bool = False
    connections: int = 0
    received: list[bytes] = field(default_factory=list)

    async def handler(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        data = bytearray()
        async with stream:
            while chunk := await stream.receive_some(65536):
                data += chunk
                if self.http and b"\r\n\r\n" in data:
                    break
            self.received.append(bytes(data))
            await stream.send_all(self.reply)


@asynccontextmanager
async def upstream(reply: bytes = b"", *, http: bool = False) -> AsyncIterator[Upstream]:
    up = Upstream(reply=reply, http=http)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, up.handler, 0, host="127.0.0.1"))
        up.port = listeners[0].socket.getsockname()[1]
        yield up
        nursery.cancel_scope.cancel()


def resolver(table: dict[str, Sequence[str]], calls: list[str] | None = None):
    async def resolve(host: str, port: int) -> Sequence[str]:
        if calls is not None:
            calls.append(host)
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "not in the test table")
        return table[host]
    return resolve


LOCAL = resolver({"allowed.test": ["127.0.0.1"], "other.test": ["127.0.0.1"], "a.wild.test": ["127.0.0.1"]})


_OPEN: list[trio.SocketStream] = []


@asynccontextmanager
async def proxy(rules: Sequence[HostRule], *, allow_private: bool = True, resolve=LOCAL,
                limits: ProxyLimits = ProxyLimits(), capacity: int = 1000) -> AsyncIterator[tuple[int, EgressLog]]:
    """A proxy serving a listening socket the test made (as the helper hands one over)."""
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(16)
    port = lsock.getsockname()[1]
    log = EgressLog(capacity)
    egress = EgressProxy(rules, allow_private=allow_private, events=log, limits=limits, resolve=resolve)
    async with trio.open_nursery() as nursery:
        await nursery.start(egress.serve, lsock.detach())
        try:
            yield port, log
        finally:
            while _OPEN:
                await _OPEN.pop().aclose()
            nursery.cancel_scope.cancel()


class Client:
    """A raw client connection with a read buffer (closed when its ``proxy`` context ends)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream, self.buf = stream, bytearray()
        _OPEN.append(stream)

    @classmethod
    async def open(cls, port: int) -> Client:
        return cls(await trio.open_tcp_stream("127.0.0.1", port))

    async def read_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = await self.stream.receive_some(65536)
            if not chunk:
                raise EOFError(bytes(self.buf))
            self.buf += chunk
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    async def read_head(self) -> bytes:
        while b"\r\n\r\n" not in self.buf:
            chunk = await self.stream.receive_some(65536)
            if not chunk:
                raise EOFError(bytes(self.buf))
            self.buf += chunk
        end = self.buf.index(b"\r\n\r\n") + 4
        out = bytes(self.buf[:end])
        del self.buf[:end]
        return out

    async def read_all(self) -> bytes:
        try:
            while chunk := await self.stream.receive_some(65536):
                self.buf += chunk
        except trio.BrokenResourceError:
            pass
        out = bytes(self.buf)
        self.buf.clear()
        return out


async def http_connect(port: int, authority: str) -> tuple[Client, bytes]:
    client = await Client.open(port)
    await client.stream.send_all(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    return client, await client.read_head()


def socks_addr(host: str) -> bytes:
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return b"\x03" + bytes([len(host)]) + host.encode()
    return (b"\x01" if addr.version == 4 else b"\x04") + addr.packed


async def socks_connect_raw(port: int, host: str, dport: int, *, cmd: int = 1) -> tuple[Client, bytes]:
    client = await Client.open(port)
    await client.stream.send_all(b"\x05\x01\x00")
    assert await client.read_exact(2) == b"\x05\x00"
    await client.stream.send_all(bytes([5, cmd, 0]) + socks_addr(host) + struct.pack("!H", dport))
    return client, await client.read_all()


async def socks_connect(port: int, host: str, dport: int, *, cmd: int = 1) -> tuple[Client, int]:
    client = await Client.open(port)
    await client.stream.send_all(b"\x05\x01\x00")
    assert await client.read_exact(2) == b"\x05\x00"
    await client.stream.send_all(bytes([5, cmd, 0]) + socks_addr(host) + struct.pack("!H", dport))
    reply = await client.read_exact(10)
    assert reply[0] == 5 and reply[3] == 1, reply
    return client, reply[1]


async def tunnel_round_trip(client: Client, payload: bytes) -> bytes:
    await client.stream.send_all(payload)
    await client.stream.send_eof()
    return await client.read_all()


def only(log: EgressLog) -> EgressEvent:
    events, dropped = log.drain()
    assert dropped == 0 and len(events) == 1, events
    return events[0]


async def settle(log: EgressLog, count: int = 1) -> None:
    """Wait until the proxy has recorded ``count`` events (it records when a connection ends)."""
    with trio.fail_after(10):
        while len(log) < count:
            await trio.sleep(0.01)


# --------------------------------------------------------------------------- HTTP CONNECT


@pytest.fixture(params=["splice", "recv-send"])
def copy_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both relay paths: splice (Linux) and the portable recv/send loop."""
    if request.param == "recv-send":
        monkeypatch.setattr(_proxy, "_HAVE_SPLICE", False)
    elif not _proxy._HAVE_SPLICE:
        pytest.skip("os.splice is not available here")
    return str(request.param)


async def test_connect_allowed_relays_and_counts_bytes_exactly(copy_path: str) -> None:
    payload, reply = b"u" * 3_000_001, b"d" * 12_345_679
    async with upstream(reply) as up, proxy([HostRule("allowed.test", frozenset({up.port}))]) as (port, log):
        client, head = await http_connect(port, f"allowed.test:{up.port}")
        assert head.startswith(b"HTTP/1.1 200 ")
        assert await tunnel_round_trip(client, payload) == reply
        await settle(log)
    assert up.received == [payload]
    ev = only(log)
    assert (ev.host, ev.port, ev.allowed, ev.reason) == ("allowed.test", up.port, True, "ok")
    assert (ev.bytes_up, ev.bytes_down) == (len(payload), len(reply))


async def test_connect_bytes_sent_with_the_head_are_forwarded_and_counted() -> None:
    async with upstream(b"pong") as up, proxy([HostRule("allowed.test")]) as (port, log):
        client = await Client.open(port)
        await client.stream.send_all(f"CONNECT allowed.test:{up.port} HTTP/1.1\r\n\r\nearly-bytes".encode())
        await client.stream.send_eof()
        assert (await client.read_head()).startswith(b"HTTP/1.1 200 ")
        assert await client.read_all() == b"pong"
        await settle(log)
    assert up.received == [b"early-bytes"]
    assert only(log)[5:] == (len(b"early-bytes"), 4)


async def _bulk_then_ping(stream: trio.SocketStream, bulk: int, *, first: bool) -> None:
    """In turn, each side sends ``bulk`` bytes, waits for the other's "ok", then sends "ping" alone."""
    async def read(n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = await stream.receive_some(n - len(data))
            assert chunk, bytes(data[-20:])
            data += chunk
        return bytes(data)

    for turn in range(2):
        if (turn == 0) == first:
            await stream.send_all(b"b" * bulk)
            assert await read(2) == b"ok"
            await stream.send_all(b"ping")  # the relay drained the bulk: these 4 bytes come alone
        else:
            assert await read(bulk) == b"b" * bulk
            await stream.send_all(b"ok")
            assert await read(4) == b"ping"


@pytest.mark.parametrize("slots", [1, 0])
async def test_relay_after_a_bulk_burst_still_passes_a_small_message_on(copy_path: str, slots: int,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream that sent in bulk (the source's low-water mark raised) and then pauses must not hold its tail.

    Each side in turn sends 2 MiB, and after the other's "ok" 4 bytes alone:
    those (below the mark), and the "ok" going back, must still be passed on.
    With one bulk slot both directions use it in turn (a burst's end gives it
    back); with none, no mark is ever set.
    """
    marks: list[tuple[int, int]] = []  # (source fd, mark)
    real = _proxy._set_lowat

    def spy(sock: trio.socket.SocketType, lowat: int) -> bool:
        marks.append((sock.fileno(), lowat))
        return real(sock, lowat)

    monkeypatch.setattr(_proxy, "_set_lowat", spy)
    bulk = 2 << 20
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, partial(_bulk_then_ping, bulk=bulk, first=False),
                                                0, host="127.0.0.1"))
        sport = listeners[0].socket.getsockname()[1]
        async with proxy([HostRule("allowed.test")], limits=ProxyLimits(max_bulk_streams=slots)) as (port, log):
            client, head = await http_connect(port, f"allowed.test:{sport}")
            assert head.startswith(b"HTTP/1.1 200 ")
            with trio.fail_after(20):  # a guard against a held tail, not a timing assertion
                await _bulk_then_ping(client.stream, bulk, first=True)
        nursery.cancel_scope.cancel()
    if slots:  # bulk mode was entered by each direction: the first gave the slot back
        # (the kernel may also wake a reader below its mark, so a lull is not always seen: no assert on 1)
        assert len({fd for fd, mark in marks if mark == _proxy._BULK_LOWAT}) == 2, marks
    else:
        assert marks == []


@pytest.mark.parametrize("authority, reason", [
    ("other.test:{port}", "host not allowed"),
    ("allowed.test:{port1}", "port not allowed"),
    ("127.0.0.1:{port}", "host not allowed"),  # an address only matches a rule that is that address
    ("ALLOWED.test.evil:{port}", "host not allowed"),
])
async def test_connect_refused_is_403_and_never_reaches_the_server(authority: str, reason: str) -> None:
    async with upstream(b"secret") as up, proxy([HostRule("allowed.test", frozenset({up.port}))]) as (port, log):
        client, head = await http_connect(port, authority.format(port=up.port, port1=up.port + 1))
        assert head.startswith(b"HTTP/1.1 403 Forbidden\r\n") and b"X-Sandbox-Egress: refused" in head
        body = await client.read_all()
        assert reason.encode() in body and b"secret" not in body
        await settle(log)
    assert up.connections == 0
    ev = only(log)
    assert (ev.allowed, ev.reason, ev.bytes_up, ev.bytes_down) == (False, reason, 0, 0)


async def test_connect_name_is_case_insensitive_and_trailing_dot() -> None:
    async with upstream(b"ok") as up, proxy([HostRule("Allowed.Test")]) as (port, log):
        client, head = await http_connect(port, f"ALLOWED.test.:{up.port}")
        assert head.startswith(b"HTTP/1.1 200 ")
        assert await tunnel_round_trip(client, b"x") == b"ok"
        await settle(log)
    assert only(log).host == "allowed.test"


@pytest.mark.parametrize("request_head, status", [
    (b"CONNECT allowed.test HTTP/1.1\r\n\r\n", b"400"),  # no port
    (b"CONNECT allowed.test:99999 HTTP/1.1\r\n\r\n", b"400"),
    (b"CONNECT bad\x01host:80 HTTP/1.1\r\n\r\n", b"400"),
    (b"GET /relative HTTP/1.1\r\nHost: allowed.test\r\n\r\n", b"400"),
    (b"GET https://allowed.test/ HTTP/1.1\r\n\r\n", b"400"),
    (b"GET http://user@allowed.test/ HTTP/1.1\r\n\r\n", b"400"),
    (b"CONNECT allowed.test:80 HTTP/1.1\r\n folded\r\n\r\n", b"400"),
    (b"CONNECT 127.1:80 HTTP/1.1\r\n\r\n", b"400"),  # resolvers read it as an address: not a name
    (b"CONNECT 0x7f000001:80 HTTP/1.1\r\n\r\n", b"400"),
    (b"CONNECT 017700000001:80 HTTP/1.1\r\n\r\n", b"400"),
])
async def test_malformed_requests_are_400(request_head: bytes, status: bytes) -> None:
    async with proxy([HostRule("allowed.test"), HostRule("*.wild.test")]) as (port, log):
        client = await Client.open(port)
        await client.stream.send_all(request_head)
        head = await client.read_head()
        await settle(log)
    assert head.split(b" ")[1] == status, head
    assert only(log).allowed is False


async def test_oversize_header_is_431() -> None:
    limits = ProxyLimits(max_header_bytes=1024)
    async with upstream() as up, proxy([HostRule("allowed.test")], limits=limits) as (port, log):
        client = await Client.open(port)
        await client.stream.send_all(f"CONNECT allowed.test:{up.port} HTTP/1.1\r\n".encode()
                                     + b"X-Pad: " + b"a" * 2000 + b"\r\n\r\n")
        head = await client.read_head()
        await settle(log)
    assert head.startswith(b"HTTP/1.1 431 ")
    assert up.connections == 0
    assert only(log).reason == "header too large"


async def test_slowloris_head_times_out_with_408() -> None:
    limits = ProxyLimits(handshake_timeout_s=0.5)
    async with upstream() as up, proxy([HostRule("allowed.test")], limits=limits) as (port, log):
        client = await Client.open(port)
        request = f"CONNECT allowed.test:{up.port} HTTP/1.1\r\nX-Slow: ".encode() + b"z" * 10_000

        async def drip() -> None:
            for i in range(len(request)):  # one byte every 20 ms: ~200 s to finish, far past the bound
                await client.stream.send_all(request[i:i + 1])
                await trio.sleep(0.02)

        with trio.fail_after(20):  # a guard against hanging, not a timing assertion
            async with trio.open_nursery() as nursery:
                nursery.start_soon(drip)
                head = await client.read_head()
                nursery.cancel_scope.cancel()
        await settle(log)
    assert head.startswith(b"HTTP/1.1 408 ")
    assert up.connections == 0
    assert only(log).reason == "timeout"


async def test_idle_tunnel_is_closed_and_still_recorded() -> None:
    async with upstream() as up, proxy([HostRule("allowed.test")],
                                       limits=ProxyLimits(idle_timeout_s=0.3)) as (port, log):
        client, head = await http_connect(port, f"allowed.test:{up.port}")
        assert head.startswith(b"HTTP/1.1 200 ")
        await client.stream.send_all(b"abc")
        with trio.fail_after(20):  # a guard, not a timing assertion: the proxy must close it
            assert await client.read_all() == b""
        await settle(log)
    assert only(log)[3:] == (True, "ok", 3, 0)


async def test_a_failing_connection_does_not_end_the_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(self: EgressProxy, conn: object) -> None:
        raise RuntimeError("a bug")

    async with upstream(b"ok") as up, proxy([HostRule("allowed.test")]) as (port, log):
        with monkeypatch.context() as m:
            m.setattr(EgressProxy, "_connect", broken)
            client, _ = await socks_connect_raw(port, "allowed.test", up.port)
            await settle(log)
        client2, head = await http_connect(port, f"allowed.test:{up.port}")
        assert head.startswith(b"HTTP/1.1 200 ")
        assert await tunnel_round_trip(client2, b"x") == b"ok"
        await settle(log, 2)
    events, _ = log.drain()
    assert [(ev.allowed, ev.reason) for ev in events] == [(False, "internal error: RuntimeError"), (True, "ok")]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
@pytest.mark.parametrize("how", [["-x", "http://127.0.0.1:{p}"], ["-p", "-x", "http://127.0.0.1:{p}"],
                                 ["--socks5-hostname", "127.0.0.1:{p}"]])
async def test_curl_through_each_protocol(how: list[str]) -> None:
    body = b"x" * 100_000
    response = b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    async with upstream(response, http=True) as up, proxy([HostRule("allowed.test")]) as (port, log):
        args = [a.format(p=port) for a in how]
        ok = await trio.run_process(["curl", "-fsS", "--noproxy", "", *args, f"http://allowed.test:{up.port}/f"],
                                    capture_stdout=True, capture_stderr=True, check=False)
        refused = await trio.run_process(["curl", "-fsS", "--noproxy", "", *args, f"http://other.test:{up.port}/f"],
                                         capture_stdout=True, capture_stderr=True, check=False)
        await settle(log, 2)
    assert ok.returncode == 0 and ok.stdout == body, ok.stderr
    assert refused.returncode != 0 and b"x" not in refused.stdout
    assert up.connections == 1
    events, _ = log.drain()
    assert sorted((ev.host, ev.allowed) for ev in events) == [("allowed.test", True), ("other.test", False)]


# --------------------------------------------------------------------------- plain HTTP forwarding


async def test_plain_http_absolute_uri_is_rewritten_and_forwarded() -> None:
    response = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"
    async with upstream(response, http=True) as up, proxy([HostRule("allowed.test")]) as (port, log):
        client = await Client.open(port)
        await client.stream.send_all(
            f"GET http://allowed.test:{up.port}/simple/pkg/?q=1 HTTP/1.1\r\nHost: evil.example\r\n"
            "Proxy-Authorization: Basic c2VjcmV0\r\nProxy-Connection: keep-alive\r\nAccept: */*\r\n\r\n".encode())
        assert await client.read_all() == response
        await settle(log)
    [sent] = up.received
    assert sent == (f"GET /simple/pkg/?q=1 HTTP/1.1\r\nHost: allowed.test:{up.port}\r\n"
                    "Accept: */*\r\nConnection: close\r\n\r\n").encode()
    ev = only(log)
    assert (ev.allowed, ev.bytes_up, ev.bytes_down) == (True, len(sent), len(response))


async def test_plain_http_refused_is_403() -> None:
    async with upstream(b"secret", http=True) as up, proxy([HostRule("allowed.test")]) as (port, log):
        client = await Client.open(port)
        await client.stream.send_all(f"GET http://other.test:{up.port}/ HTTP/1.1\r\n\r\n".encode())
        assert (await client.read_head()).startswith(b"HTTP/1.1 403 ")
        await settle(log)
    assert up.connections == 0
    assert only(log).reason == "host not allowed"


# --------------------------------------------------------------------------- SOCKS5


async def test_socks5_domain_allowed_counts_bytes(copy_path: str) -> None:
    payload, reply = b"p" * 70_000, b"r" * 123_457
    async with upstream(reply) as up, proxy([HostRule("allowed.test")]) as (port, log):
        client, code = await socks_connect(port, "allowed.test", up.port)
        assert code == 0
        assert await tunnel_round_trip(client, payload) == reply
        await settle(log)
    assert up.received == [payload]
    ev = only(log)
    assert (ev.host, ev.allowed, ev.bytes_up, ev.bytes_down) == ("allowed.test", True, len(payload), len(reply))


@pytest.mark.parametrize("host, rules, allow_private, reason", [
    ("other.test", ["allowed.test"], True, "host not allowed"),
    ("127.0.0.1", ["*.wild.test"], True, "host not allowed"),  # a wildcard never covers an address
    ("127.0.0.1", ["127.0.0.1"], False, "address refused: 127.0.0.1 (loopback)"),
    ("::ffff:127.0.0.1", ["::ffff:127.0.0.1"], False, "address refused: ::ffff:7f00:1 (loopback)"),
    ("::ffff:127.0.0.1", ["127.0.0.1"], True, "host not allowed"),  # v4-mapped is another literal
])
async def test_socks5_refusals_reply_0x02(host: str, rules: list[str], allow_private: bool, reason: str) -> None:
    async with upstream(b"secret") as up, \
            proxy([HostRule(r) for r in rules], allow_private=allow_private) as (port, log):
        client, code = await socks_connect(port, host, up.port)
        assert code == 0x02
        assert await client.read_all() == b""
        await settle(log)
    assert up.connections == 0
    ev = only(log)
    assert (ev.allowed, ev.reason) == (False, reason)


async def test_socks5_ipv4_literal_allowed_by_its_own_rule() -> None:
    async with upstream(b"ok") as up, proxy([HostRule("127.0.0.1", frozenset({up.port}))]) as (port, log):
        client, code = await socks_connect(port, "127.0.0.1", up.port)
        assert code == 0
        assert await tunnel_round_trip(client, b"hi") == b"ok"
        await settle(log)
    assert only(log)[1:] == ("127.0.0.1", up.port, True, "ok", 2, 2)


async def test_socks5_ipv6_literal() -> None:
    try:
        probe = socket.socket(socket.AF_INET6)
        probe.bind(("::1", 0))
        probe.close()
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    got: list[bytes] = []

    async def handler(stream: trio.SocketStream) -> None:
        got.append(await stream.receive_some(100))
        await stream.send_all(b"six")
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        [listener] = await nursery.start(partial(trio.serve_tcp, handler, 0, host="::1"))
        v6port = listener.socket.getsockname()[1]
        async with proxy([HostRule("[::1]")]) as (port, log):
            client, code = await socks_connect(port, "::1", v6port)
            assert code == 0
            assert await tunnel_round_trip(client, b"v6") == b"six"
            await settle(log)
        nursery.cancel_scope.cancel()
    assert got == [b"v6"]
    assert only(log)[1:4] == ("::1", v6port, True)


async def test_socks5_unsupported_command_and_auth() -> None:
    async with upstream() as up, proxy([HostRule("allowed.test")]) as (port, log):
        _, code = await socks_connect(port, "allowed.test", up.port, cmd=2)  # BIND
        assert code == 0x07
        client = await Client.open(port)
        await client.stream.send_all(b"\x05\x01\x02")  # username/password only
        assert await client.read_exact(2) == b"\x05\xff"
        assert await client.read_all() == b""
        await settle(log, 2)
    assert up.connections == 0
    events, _ = log.drain()
    assert [ev.allowed for ev in events] == [False, False]


# --------------------------------------------------------------------------- resolution and rebinding


@pytest.mark.parametrize("answers", [
    ["127.0.0.1"], ["::ffff:127.0.0.1"], ["::1"], ["10.0.0.1", "127.0.0.1"], ["169.254.169.254"],
    ["64:ff9b::7f00:1"], ["0.0.0.0"],
])
async def test_rebinding_a_name_resolving_to_a_local_address_is_refused(answers: list[str]) -> None:
    calls: list[str] = []
    resolve = resolver({"rebind.test": answers}, calls)
    async with upstream(b"secret") as up, \
            proxy([HostRule("rebind.test")], allow_private=False, resolve=resolve) as (port, log):
        client, head = await http_connect(port, f"rebind.test:{up.port}")
        assert head.startswith(b"HTTP/1.1 403 ")
        client2, code = await socks_connect(port, "rebind.test", up.port)
        assert code == 0x02
        await settle(log, 2)
    assert up.connections == 0
    assert calls == ["rebind.test", "rebind.test"]  # resolved once per request, by the proxy
    events, _ = log.drain()
    first = ipaddress.ip_address(answers[0])
    assert {ev.reason for ev in events} == {f"address refused: {first} ({address_refusal(first)})"}
    assert not any(ev.allowed for ev in events)


async def test_a_refused_answer_is_skipped_and_only_the_checked_one_used() -> None:
    # allow_private (to reach a 127.0.0.1 server) still refuses multicast: the proxy skips that answer
    # and connects to the address it checked.
    resolve = resolver({"mixed.test": ["224.0.0.1", "127.0.0.1"]})
    async with upstream(b"ok") as up, proxy([HostRule("mixed.test")], resolve=resolve) as (port, log):
        client, head = await http_connect(port, f"mixed.test:{up.port}")
        assert head.startswith(b"HTTP/1.1 200 ")
        assert await tunnel_round_trip(client, b"x") == b"ok"
        await settle(log)
    assert up.connections == 1
    assert only(log).allowed


async def test_resolve_failure_is_502_allowed() -> None:
    async with proxy([HostRule("*.wild.test")]) as (port, log):
        _, head = await http_connect(port, "missing.wild.test:80")
        await settle(log)
    assert head.startswith(b"HTTP/1.1 502 ")
    assert only(log)[3:5] == (True, "resolve failed")


@pytest.mark.parametrize("text, reason", [
    ("127.0.0.1", "loopback"), ("10.1.2.3", "private"), ("192.168.0.1", "private"), ("172.16.0.1", "private"),
    ("169.254.169.254", "link-local"), ("100.64.0.1", "not global"), ("0.0.0.0", "unspecified"),
    ("224.0.0.1", "multicast"), ("240.0.0.1", "reserved"), ("255.255.255.255", "reserved"),
    ("::1", "loopback"), ("::", "unspecified"), ("fe80::1", "link-local"), ("fc00::1", "private"),
    ("ff02::1", "multicast"), ("::ffff:127.0.0.1", "loopback"), ("::ffff:10.0.0.1", "private"),
    ("::ffff:8.8.8.8", None), ("2002:7f00:1::", "loopback"), ("64:ff9b::a00:1", "private"), ("64:ff9b::808:808", None), ("64:ff9b:1::a00:1", "reserved"),
    ("::127.0.0.1", "reserved"), ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "private"),
    ("8.8.8.8", None), ("2606:4700::1111", None),
])
def test_address_ranges(text: str, reason: str | None) -> None:
    assert address_refusal(ipaddress.ip_address(text)) == reason


def test_allow_private_keeps_multicast_and_unspecified_refused() -> None:
    assert address_refusal(ipaddress.ip_address("127.0.0.1"), allow_private=True) is None
    assert address_refusal(ipaddress.ip_address("::ffff:192.168.1.1"), allow_private=True) is None
    assert address_refusal(ipaddress.ip_address("224.0.0.1"), allow_private=True) == "multicast"
    assert address_refusal(ipaddress.ip_address("0.0.0.0"), allow_private=True) == "unspecified"


# --------------------------------------------------------------------------- rules


_label = st.text("abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=12).filter(
    lambda s: not s.startswith("-") and not s.endswith("-"))
_domain = st.lists(_label, min_size=1, max_size=3).map(lambda ls: ".".join(ls) + ".org")


@settings(max_examples=200, deadline=None)
@given(domain=_domain, below=st.lists(_label, min_size=0, max_size=3), prefix=_label,
       upper=st.booleans())
def test_wildcard_matches_one_or_more_labels_below_never_the_bare_domain(
        domain: str, below: list[str], prefix: str, upper: bool) -> None:
    rule = HostRule("*." + (domain.upper() if upper else domain))
    host = ".".join([*below, domain])
    assert rule.matches_host(normalize_host(host)) == bool(below)
    assert not rule.matches_host(normalize_host(prefix + domain))  # "evilpypi.org" is not "*.pypi.org"
    assert not rule.matches_host(normalize_host(domain + "." + prefix + "x"))
    exact = HostRule(domain)
    assert exact.matches_host(normalize_host(host.upper())) == (not below)


def test_rule_idna_ports_and_parse() -> None:
    rule = HostRule("*.Bücher.de", frozenset({443}))
    assert rule.pattern == "*.xn--bcher-kva.de"
    assert rule.matches(normalize_host("WWW.BÜCHER.DE"), 443)
    assert not rule.matches(normalize_host("www.bücher.de"), 80)
    assert HostRule.parse("pypi.org:443") == HostRule("pypi.org", frozenset({443}))
    assert HostRule.parse("*.pythonhosted.org") == HostRule("*.pythonhosted.org", None)
    assert HostRule.parse("[::1]:8080") == HostRule("::1", frozenset({8080}))
    for bad in ("*", "*.org", "a.*.org", "*.127.0.0.1", "", "a b.org", "x.org:0", "x.org:70000", "[::1", "1.2.3.4.5"):
        with pytest.raises(ValueError):
            HostRule.parse(bad)


# --------------------------------------------------------------------------- serving, bounds, the log


async def test_concurrent_connection_cap_queues_the_next_client() -> None:
    async with upstream(b"ok") as up, proxy([HostRule("allowed.test")],
                                            limits=ProxyLimits(max_connections=1)) as (port, log):
        first, head = await http_connect(port, f"allowed.test:{up.port}")
        assert head.startswith(b"HTTP/1.1 200 ")
        second = await Client.open(port)  # the kernel backlog takes it; the proxy does not yet
        await second.stream.send_all(f"CONNECT allowed.test:{up.port} HTTP/1.1\r\n\r\n".encode())
        with trio.move_on_after(0.3):
            await second.read_head()
            pytest.fail("a second connection was served while the cap was reached")
        assert await tunnel_round_trip(first, b"1") == b"ok"
        assert (await second.read_head()).startswith(b"HTTP/1.1 200 ")
        assert await tunnel_round_trip(second, b"2") == b"ok"
        await settle(log, 2)
    assert up.received == [b"1", b"2"]


async def test_log_is_bounded_and_counts_drops() -> None:
    async with proxy([], capacity=2) as (port, log):
        for _ in range(5):
            client, head = await http_connect(port, "other.test:80")
            assert head.startswith(b"HTTP/1.1 403 ")
            await client.read_all()
        with trio.fail_after(10):
            while len(log) + log.dropped < 5:
                await trio.sleep(0.01)
    events, dropped = log.drain()
    assert (len(events), dropped) == (2, 3)
    assert log.drain() == ([], 0)


async def test_serve_closes_the_listening_fd_when_cancelled() -> None:
    async with proxy([]) as (port, _):
        client, head = await http_connect(port, "other.test:80")
        assert head.startswith(b"HTTP/1.1 403 ")
    with pytest.raises(OSError):
        await trio.open_tcp_stream("127.0.0.1", port)


async def test_serve_refuses_a_non_socket_fd_and_closes_it() -> None:
    r, w = os.pipe()
    os.close(w)
    with pytest.raises(OSError):
        await EgressProxy([], events=EgressLog()).serve(r)
    with pytest.raises(OSError):
        os.fstat(r)


async def test_serve_refuses_a_socket_that_is_not_listening() -> None:
    a, b = socket.socketpair()
    b.close()
    fd = a.detach()
    with pytest.raises(OSError):
        await EgressProxy([], events=EgressLog()).serve(fd)
    with pytest.raises(OSError):
        os.fstat(fd)
    unbound = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with pytest.raises(OSError):
        await EgressProxy([], events=EgressLog()).serve(unbound.detach())


def test_limits_validate() -> None:
    with pytest.raises(ValueError):
        ProxyLimits(max_connections=0)
    with pytest.raises(ValueError):
        ProxyLimits(idle_timeout_s=0)
    with pytest.raises(ValueError):
        ProxyLimits(max_bulk_streams=-1)
    with pytest.raises(ValueError):
        EgressLog(-1)


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=80))
def test_normalize_host_yields_only_plain_names_or_addresses(text: str) -> None:
    try:
        host = normalize_host(text)
    except ValueError:
        return
    try:
        ipaddress.ip_address(host)
    except ValueError:
        assert host and all(c in "abcdefghijklmnopqrstuvwxyz0123456789.-_" for c in host), host
        assert normalize_host(host) == host


@settings(max_examples=60, deadline=None)
@given(head=st.binary(max_size=300))
def test_arbitrary_request_bytes_never_reach_a_server_or_end_the_proxy(head: bytes) -> None:
    async def scenario() -> None:
        async with upstream(b"secret") as up, proxy([HostRule("allowed.test")]) as (port, log):
            client = await Client.open(port)
            await client.stream.send_all(head)
            await client.stream.send_eof()
            with trio.fail_after(20):
                reply = await client.read_all()
                await settle(log)
            assert b"secret" not in reply
            client2, ok = await http_connect(port, "other.test:1")  # still serving
            assert ok.startswith(b"HTTP/1.1 403 ")
        assert up.connections == 0

    trio.run(scenario)
