"""extract_async: one worker thread per archive, cancellable between members."""

from __future__ import annotations

import io
import os
import threading

import pytest
import trio
from test_archive_builders import cancel_once_started, tar_bytes, ti

from sandbox_fs import open_root
from sandbox_fs.archive import ExtractPolicy, UnsafeArchiveMemberError, extract_async


async def test_extract_async_one_thread_hop(layout):
    data = tar_bytes([ti(f"d/f{i}", data=b"x") for i in range(50)])
    threads = set()

    class Src(io.BytesIO):
        def read(self, n=-1):
            threads.add(threading.get_ident())
            return super().read(n)

    with open_root(layout.ws) as root:
        rep = await extract_async(root, "dest", Src(data))
    assert rep.files == 50
    assert len(threads) == 1 and threading.get_ident() not in threads


async def test_extract_async_errors_propagate(layout):
    with open_root(layout.ws) as root:
        with pytest.raises(UnsafeArchiveMemberError):
            await extract_async(root, "dest", io.BytesIO(tar_bytes([ti("../x", data=b"1")])))
    assert os.listdir(layout.ws) == []


class _SlowSource(io.RawIOBase):
    """Yields a tar slowly and signals once the extraction has started."""

    def __init__(self, data: bytes, started: threading.Event):
        self._b = io.BytesIO(data)
        self._started = started

    def readable(self):
        return True

    def readinto(self, buf):
        self._started.set()
        threading.Event().wait(0.002)
        chunk = self._b.read(min(len(buf), 512))
        buf[: len(chunk)] = chunk
        return len(chunk)


@pytest.mark.parametrize("in_place", [False, True])
async def test_cancel_between_members_cleans_up(layout, in_place):
    data = tar_bytes([ti(f"f{i:04d}", data=b"x" * 100) for i in range(2000)])
    started = threading.Event()
    with open_root(layout.ws) as root:
        await cancel_once_started(root, _SlowSource(data, started), started, timeout=10, settle=0.2,
                                  policy=ExtractPolicy(in_place=in_place))
    if in_place:
        names = os.listdir(layout.ws / "dest")
        assert 0 < len(names) < 2000 and not any(n.startswith(".sfs-") for n in names)
        for n in names:  # no partial member
            assert (layout.ws / "dest" / n).read_bytes() == b"x" * 100
    else:
        assert os.listdir(layout.ws) == []


async def test_custom_limiter_is_used(layout):
    lim = trio.CapacityLimiter(1)
    seen = []

    class Src(io.BytesIO):
        def read(self, n=-1):
            seen.append(lim.borrowed_tokens)
            return super().read(n)

    with open_root(layout.ws) as root:
        await extract_async(root, "dest", Src(tar_bytes([ti("a", data=b"1")])), limiter=lim)
    assert seen and all(b == 1 for b in seen)


async def test_cancel_inside_one_large_member(layout):
    from test_archive_builders import raw_tar_header

    size = 64 << 20
    head = raw_tar_header("big", size)

    class Slow(io.RawIOBase):
        def __init__(self):
            self.sent = 0

        def readable(self):
            return True

        def readinto(self, buf):
            threading.Event().wait(0.003)
            if self.sent < len(head):
                n = min(len(buf), len(head) - self.sent)
                buf[:n] = head[self.sent:self.sent + n]
            else:
                n = min(len(buf), 64 << 10, len(head) + size - self.sent)
                buf[:n] = b"z" * n
            self.sent += n
            return n

    src = Slow()
    t0 = trio.current_time()
    with open_root(layout.ws) as root:
        with trio.move_on_after(0.3):
            await extract_async(root, "dest", src)
            raise AssertionError("not cancelled")
    assert trio.current_time() - t0 < 2.0
    assert src.sent < size // 2, "the member was read to the end before the cancel was honoured"
    assert os.listdir(layout.ws) == []
