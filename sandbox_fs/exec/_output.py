"""Bounded capture of a command's output: memory does not grow with what the child prints."""

from __future__ import annotations

#: Default bound on each of stdout and stderr kept in memory (1 MiB).
DEFAULT_MAX_OUTPUT_BYTES = 1 << 20

#: Bytes asked for per read of a pipe or PTY.
_CHUNK = 1 << 16


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
