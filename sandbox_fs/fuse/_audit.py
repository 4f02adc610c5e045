"""The overlay's audit stream: (time, operation, sandbox path, result) events.

The daemon records one :class:`AuditEvent` per request it audits into an
:class:`AuditLog`, a bounded buffer: recording never blocks and never
grows memory past ``capacity`` events; an event recorded while the buffer
is full is dropped and counted (the buffer keeps the earliest events, so a
drop is a gap *after* what was kept).  The daemon drains the buffer into
``audit`` event messages of the control protocol (:func:`to_wire`); the
host reads them back with :func:`from_wire`, trusting nothing in them
beyond their shape.

Not thread-safe: one daemon thread records and drains.
"""

from __future__ import annotations

import errno as _errno
import json
import math
import time
from collections import deque
from typing import Any, NamedTuple

from ._protocol import MAX_MESSAGE_BYTES, ProtocolError

__all__ = ["AuditEvent", "AuditLog", "to_wire", "from_wire", "MAX_PATH_CHARS", "MAX_OP_CHARS", "ENVELOPE_BYTES"]

MAX_PATH_CHARS = 4096
"""Longest sandbox path an event keeps, in characters; a longer one is cut and ends in ``…`` (U+2026)."""

MAX_OP_CHARS = 64
"""Longest operation name an event keeps, in characters (cut like a path)."""

ENVELOPE_BYTES = 128
"""Room an ``audit`` message needs besides its events (``{"tag":0,"event":"audit","events":[],"dropped":N}``)."""
_ENVELOPE_BYTES = ENVELOPE_BYTES


class AuditEvent(NamedTuple):
    """One audited request.

    Attributes:
        time_s: wall-clock time of the event, in seconds since the epoch.
        op: the FUSE operation (``"write"``, ``"rename"``, ...).
        path: the sandbox path relative to the workspace (``""``: the root),
            from the daemon's dentry table at the time of the event.
        errno: 0 for success, else the errno the request failed with.
    """

    time_s: float
    op: str
    path: str
    errno: int

    @property
    def result(self) -> str:
        """``"ok"``, or the errno's name (``"EACCES"``; ``"E<n>"`` for a number without one)."""
        if self.errno == 0:
            return "ok"
        return _errno.errorcode.get(self.errno, f"E{self.errno}")

    def to_wire(self) -> list[Any]:
        """This event as the protocol carries it: ``[time_s, op, path, errno]``."""
        return [self.time_s, self.op, self.path, self.errno]

    @classmethod
    def from_wire(cls, item: Any) -> AuditEvent:
        """The event a decoded ``[time_s, op, path, errno]`` item carries.

        Raises:
            ProtocolError: ``item`` is not of that shape (a non-finite time,
                a string over its bound, a negative or non-int errno).
        """
        return _event(item)


_now = time.time


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def _plain(text: str) -> bool:
    """True when ASCII JSON writes ``text`` as itself (no escapes)."""
    return text.isascii() and text.isprintable() and '"' not in text and "\\" not in text


def _wire_bytes(ev: AuditEvent) -> int:
    """Bytes this event adds to an ``audit`` message: its JSON array ``[t,"op","path",errno]`` and a comma."""
    if _plain(ev.path) and _plain(ev.op):  # the common case, without encoding (json writes floats by repr)
        return len(repr(ev.time_s)) + len(ev.op) + len(ev.path) + len(str(ev.errno)) + 10
    return len(json.dumps(ev.to_wire(), separators=(",", ":"), ensure_ascii=True)) + 1


def to_wire(events: list[AuditEvent], dropped: int) -> dict[str, Any]:
    """The control-protocol ``audit`` event message for a drained batch.

    Args:
        events: the batch, as :meth:`AuditLog.drain` returned it.
        dropped: the drop count returned with it.

    Returns:
        ``{"tag": 0, "event": "audit", "events": [[time_s, op, path, errno], ...],
        "dropped": dropped}`` (paths may hold surrogate escapes; the protocol's
        ASCII JSON keeps them).
    """
    return {"tag": 0, "event": "audit", "events": [ev.to_wire() for ev in events], "dropped": dropped}


def _event(item: Any) -> AuditEvent:
    if not (isinstance(item, list) and len(item) == 4):
        raise ProtocolError("an audit event is not a 4-item list")
    t, op, path, err = item
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        raise ProtocolError("an audit event's time is not a finite number")
    if not isinstance(op, str) or not isinstance(path, str):
        raise ProtocolError("an audit event's op or path is not a string")
    if len(op) > MAX_OP_CHARS or len(path) > MAX_PATH_CHARS:
        raise ProtocolError("an audit event's op or path is too long")
    if isinstance(err, bool) or not isinstance(err, int) or err < 0:
        raise ProtocolError("an audit event's errno is not a non-negative int")
    return AuditEvent(float(t), op, path, err)


def from_wire(msg: dict[str, Any]) -> tuple[list[AuditEvent], int]:
    """The events and drop count of an ``audit`` event message (as :func:`to_wire` built it).

    Args:
        msg: a decoded protocol message.

    Returns:
        ``(events, dropped)``.

    Raises:
        ProtocolError: ``msg`` is not an ``audit`` event of that shape.
    """
    if msg.get("tag") != 0 or msg.get("event") != "audit":
        raise ProtocolError("not an audit event message")
    events, dropped = msg.get("events"), msg.get("dropped")
    if not isinstance(events, list):
        raise ProtocolError("an audit message's events are not a list")
    if isinstance(dropped, bool) or not isinstance(dropped, int) or dropped < 0:
        raise ProtocolError("an audit message's drop count is not a non-negative int")
    return [AuditEvent.from_wire(item) for item in events], dropped


class AuditLog:
    """A bounded buffer of audit events with a count of drops.

    Args:
        capacity: most events held between drains (``0``: every event is
            dropped and counted).

    Raises:
        ValueError: ``capacity`` is negative.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._events: deque[AuditEvent] = deque()
        self._dropped = 0

    def __len__(self) -> int:
        return len(self._events)

    @property
    def dropped(self) -> int:
        """Events dropped since the last :meth:`drain` that returned them."""
        return self._dropped

    @property
    def full(self) -> bool:
        """True when the next :meth:`record` would only count a drop (the daemon then skips deriving its path)."""
        return len(self._events) >= self.capacity

    def record(self, op: str, path: str, err: int = 0) -> None:
        """Record one event at the current time; never blocks, never raises for a full buffer.

        Args:
            op: the FUSE operation name (cut to :data:`MAX_OP_CHARS`).
            path: its sandbox path (cut to :data:`MAX_PATH_CHARS`).
            err: 0 for success, else the errno (its absolute value is kept).
        """
        if len(self._events) >= self.capacity:
            self._dropped += 1
            return
        if len(op) > MAX_OP_CHARS:
            op = _cut(op, MAX_OP_CHARS)
        if len(path) > MAX_PATH_CHARS:
            path = _cut(path, MAX_PATH_CHARS)
        if type(err) is not int or err < 0:
            # abs: a -errno from a C wrapper is still that errno (a negative one would fail from_wire)
            err = abs(int(err))
        self._events.append(AuditEvent(_now(), op, path, err))

    def drain(self, max_events: int = 2000, *,
              max_wire_bytes: int = MAX_MESSAGE_BYTES - _ENVELOPE_BYTES) -> tuple[list[AuditEvent], int]:
        """Take the oldest buffered events: as many as fit one ``audit`` message.

        Args:
            max_events: most events returned.
            max_wire_bytes: most bytes the events may take in
                :func:`to_wire`'s message (default: what one protocol
                datagram holds); at least one event is returned when any is
                buffered.

        Returns:
            ``(events, dropped)``: the events in recording order, and the
            count of events dropped since the previous drain (reported
            once: the next drain counts from zero).  Events left over stay
            buffered for the next drain.
        """
        out: list[AuditEvent] = []
        used = 0
        while self._events and len(out) < max_events:
            size = _wire_bytes(self._events[0])
            if out and used + size > max_wire_bytes:
                break
            used += size
            out.append(self._events.popleft())
        dropped, self._dropped = self._dropped, 0
        return out, dropped

    def requeue(self, events: list[AuditEvent], dropped: int) -> None:
        """Put a drained batch back in front (its send failed): the next drain returns it again.

        Events beyond :attr:`capacity` (newer ones were recorded meanwhile)
        are not kept but counted as dropped, as is ``dropped`` itself: a
        batch is never lost without a count.

        Args:
            events: the batch :meth:`drain` returned, in its order.
            dropped: the drop count returned with it.
        """
        self._dropped += dropped
        room = max(0, self.capacity - len(self._events))
        keep = events[:room]
        self._dropped += len(events) - len(keep)
        self._events.extendleft(reversed(keep))

    # the wire codec, also reachable as AuditLog.to_wire / AuditLog.from_wire
    to_wire = staticmethod(to_wire)
    from_wire = staticmethod(from_wire)
