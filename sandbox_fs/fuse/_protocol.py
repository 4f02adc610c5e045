"""The control channel between a session and its overlay daemon.

One ``AF_UNIX``/``SOCK_SEQPACKET`` socketpair: every message is one datagram
(boundaries kept by the kernel), a UTF-8 JSON object of at most
:data:`MAX_MESSAGE_BYTES`, with file descriptors (if any) in one
``SCM_RIGHTS`` control message.

Requests (host to daemon) are tagged and batched::

    {"tag": 7, "ops": [{"op": "invalidate", "paths": ["a/b"]}, {"op": "quota", ...}]}

and each gets exactly one reply carrying the same tag and one result per op,
in order::

    {"tag": 7, "results": [{"ok": true}, {"ok": false, "errno": 22, "reason": "..."}]}

Messages the daemon sends on its own carry ``tag`` 0 and an ``event``:
``{"tag": 0, "event": "ready", ...}`` once mounted (with the mount fd), and
``{"tag": 0, "event": "audit", "events": [[t, op, path, errno], ...],
"dropped": n}`` batches.

Nothing here trusts the peer's content beyond its shape: a malformed message
raises :class:`ProtocolError`.
"""

from __future__ import annotations

import array
import json
import os
import socket
from typing import Any

from .._json import loads_untrusted

MAX_MESSAGE_BYTES = 256 << 10
"""Largest datagram either side sends or accepts, in bytes."""

MAX_FDS = 64
"""Most descriptors one message may carry."""


class ProtocolError(Exception):
    """A message was truncated, oversized, not a JSON object, or carried too many fds."""


SOCKET_BUFFER_BYTES = 4 * MAX_MESSAGE_BYTES
"""``SO_SNDBUF``/``SO_RCVBUF`` asked for on both ends (the kernel doubles it, capped by ``net.core.wmem_max``).

A unix datagram larger than the sender's ``SO_SNDBUF`` minus a little
fails ``sendmsg`` with ``EMSGSIZE``; the default (212992 bytes) is below
:data:`MAX_MESSAGE_BYTES`.  Where the host caps it lower, senders bound
their messages by :func:`max_datagram` instead."""

# What the kernel keeps of SO_SNDBUF for itself before a unix datagram fits (32 there; with room to spare).
_SNDBUF_HEADROOM = 1024


def socketpair() -> tuple[socket.socket, socket.socket]:
    """A close-on-exec ``SOCK_SEQPACKET`` pair: ``(host_end, daemon_end)``, both with :data:`SOCKET_BUFFER_BYTES` buffers (as far as allowed)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    for sock in (a, b):
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
            except OSError:
                pass  # the default stays; max_datagram() tells senders what fits
    return a, b


def max_datagram(sock: socket.socket) -> int:
    """The largest message ``sock`` can send in one datagram, in bytes: at most :data:`MAX_MESSAGE_BYTES`.

    Raises:
        OSError: the socket's ``SO_SNDBUF`` cannot be read (it is closed).
    """
    sndbuf = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    return max(0, min(MAX_MESSAGE_BYTES, sndbuf - _SNDBUF_HEADROOM))


def encode(msg: dict[str, Any]) -> bytes:
    """The datagram for ``msg``. Raises ProtocolError past MAX_MESSAGE_BYTES."""
    data = json.dumps(msg, separators=(",", ":"), ensure_ascii=True).encode()
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return data


def decode(data: bytes) -> dict[str, Any]:
    """The JSON object in ``data``. Raises ProtocolError for anything else."""
    try:
        msg = loads_untrusted(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"not JSON: {e}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("tag"), int):
        raise ProtocolError("not a tagged JSON object")
    return msg


def send(sock: socket.socket, msg: dict[str, Any], fds: list[int] | tuple[int, ...] = ()) -> None:
    """Send ``msg`` (and ``fds``, duplicated into the peer) as one datagram (blocking).

    Raises:
        ProtocolError: the message is too large or carries more than MAX_FDS fds.
        OSError: the socket failed (EPIPE once the peer is gone).
    """
    if len(fds) > MAX_FDS:
        raise ProtocolError(f"{len(fds)} fds exceed {MAX_FDS}")
    data = encode(msg)
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    sock.sendmsg([data], anc)


def recv(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """Receive one message: ``(msg, fds)``, or None at EOF (blocking).

    The received fds are close-on-exec and the caller's to close, also when
    this raises after receiving them (they are closed here then).

    Raises:
        ProtocolError: a truncated datagram or control message, or bad content.
        OSError: the socket failed.
    """
    data, anc, flags, _ = sock.recvmsg(MAX_MESSAGE_BYTES + 1,
                                       socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize),
                                       socket.MSG_CMSG_CLOEXEC)
    fds: list[int] = []
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(payload[: len(payload) - len(payload) % arr.itemsize])
            fds.extend(arr)
    try:
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise ProtocolError("truncated message")
        if not data and not fds:
            return None
        return decode(data), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
