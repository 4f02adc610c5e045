"""Persist's SHA-256 of large files in the writer thread (``_tar.PendingSha``): same digest, same order.

A persist that records no index (a :class:`LocalSnapshotStore`) leaves the
SHA-256 of each file of ``OFFLOAD_SHA_BYTES`` or more to the writer thread;
the tree digest must still cover exactly the records, in exactly the
order, that the inline-hashing walk (:func:`tree_digest`) makes.
"""

from __future__ import annotations

import os
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sandbox_fs.snapshot._tar as snap_tar
from sandbox_fs import open_root
from sandbox_fs.snapshot import LocalSnapshotStore, hydrate, persist, tree_digest

_BIG = snap_tar.OFFLOAD_SHA_BYTES


@pytest.fixture
def counted(monkeypatch):
    """Counts the files whose SHA-256 the writer thread computed."""
    made = []
    real = snap_tar.PendingSha.__init__

    def init(self, *args):
        made.append(1)
        real(self, *args)

    monkeypatch.setattr(snap_tar.PendingSha, "__init__", init)
    return made


def _no_persist_thread_left() -> bool:
    return not [t for t in threading.enumerate() if t.name.startswith("sfs-")]


def test_deferred_hashes_give_the_inline_digest_in_walk_order(tmp_path, counted, monkeypatch):
    """Large files around small ones, a symlink and hard links between them, files across buffer swaps."""
    monkeypatch.setattr(snap_tar, "_WRITE_BUF_BYTES", 64 << 10)  # many swaps, files spanning buffers
    ws_dir = tmp_path / "ws"
    (ws_dir / "d").mkdir(parents=True)
    sizes = [0, 1, _BIG - 1, _BIG, _BIG + 1, 200_000, 3, 3 << 20, 511, 70_000]
    for i, n in enumerate(sizes):
        (ws_dir / "d" / f"f{i:02d}").write_bytes(os.urandom(n))
    os.link(ws_dir / "d" / "f05", ws_dir / "d" / "f05-link")  # a hard link of a deferred file
    (ws_dir / "d" / "f04-sym").symlink_to("f04")
    (ws_dir / "z").write_bytes(os.urandom(_BIG * 2))
    with LocalSnapshotStore(tmp_path / "store") as store, open_root(ws_dir) as ws:
        info = persist(ws, store, "s").info
        assert counted, "no file was hashed by the writer thread"
        assert info.tree_digest == tree_digest(ws)
        dst = tmp_path / "dst"
        dst.mkdir()
        with open_root(dst) as out:
            hydrate(out, store, "s")
            assert tree_digest(out) == info.tree_digest
    assert _no_persist_thread_left()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.sampled_from([0, 7, 4095, _BIG - 1, _BIG, _BIG + 513, 100_000]), min_size=1, max_size=8),
       buf=st.sampled_from([8 << 10, 64 << 10, snap_tar._WRITE_BUF_BYTES]))
def test_property_deferred_and_inline_digests_agree(tmp_path_factory, monkeypatch, sizes, buf):
    monkeypatch.setattr(snap_tar, "_WRITE_BUF_BYTES", buf)
    base = tmp_path_factory.mktemp("p")
    ws_dir = base / "ws"
    ws_dir.mkdir()
    for i, n in enumerate(sizes):
        (ws_dir / f"f{i}").write_bytes(os.urandom(n))
    with LocalSnapshotStore(base / "store") as store, open_root(ws_dir) as ws:
        assert persist(ws, store, "s").info.tree_digest == tree_digest(ws)


def test_a_file_that_grows_while_deferred_is_still_refused(tmp_path, monkeypatch):
    """The header check stays in the caller's thread: a large file that grew is refused, nothing committed."""
    from sandbox_fs.snapshot import SnapshotSourceChangedError

    ws_dir = tmp_path / "ws"
    ws_dir.mkdir()
    (ws_dir / "big").write_bytes(os.urandom(_BIG * 4))
    real_readv = os.readv
    grown = []

    def readv(fd, bufs):
        if not grown:
            grown.append(1)
            with open(ws_dir / "big", "ab") as fh:  # host-access: the test's own workspace directory
                fh.write(b"x")
        return real_readv(fd, bufs)

    monkeypatch.setattr(snap_tar.os, "readv", readv)
    with LocalSnapshotStore(tmp_path / "store") as store, open_root(ws_dir) as ws:
        with pytest.raises(SnapshotSourceChangedError):
            persist(ws, store, "s")
        assert store.info("s") is None
    assert _no_persist_thread_left()


# -- the commit's read-back CRC-32 over two threads (_store._archive_crc_split)


@settings(max_examples=60, deadline=None)
@given(a=st.binary(max_size=3000), b=st.binary(max_size=3000))
def test_property_crc32_combine_is_zlibs(a, b):
    import zlib

    from sandbox_fs.snapshot._store import crc32_combine

    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@pytest.mark.parametrize("size", [0, 1, (1 << 20) - 1, 1 << 20, (3 << 20) + 7])
@pytest.mark.parametrize("extra", [-1, 0, 1, 4096])
def test_split_read_back_matches_the_one_thread_read(tmp_path, monkeypatch, size, extra):
    """Same (bytes, CRC-32) as _archive_crc for a file of the recorded size, shorter or longer."""
    from sandbox_fs.snapshot import _store

    monkeypatch.setattr(_store, "_SPLIT_CRC_BYTES", 0)  # split even the small ones
    data = os.urandom(max(0, size + extra))
    path = tmp_path / "a.tar"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)  # host-access: the test's own temporary file
    try:
        assert _store._archive_crc_split(fd, size) == _store._archive_crc(fd, size)
    finally:
        os.close(fd)
    assert _no_persist_thread_left()


# -- the header of a listed member that fits ustar (_header.encode_listed)


_ASCII_NAME = st.text(alphabet=st.characters(min_codepoint=1, max_codepoint=127, blacklist_characters="/"),
                      min_size=1, max_size=40)


@settings(max_examples=80, deadline=None)
@given(parts=st.lists(_ASCII_NAME, min_size=1, max_size=3),
       kind=st.sampled_from([b"0", b"1", b"2", b"5"]), mode=st.integers(0, 0o7777),
       mtime=st.integers(0, 8 ** 11 - 1), size=st.integers(0, 8 ** 11 - 1), link=_ASCII_NAME | st.just(""))
def test_property_encode_listed_is_encode_header(parts, kind, mode, mtime, size, link):
    from sandbox_fs.snapshot._header import MemberHeader, encode_header, encode_listed, ustar_fits

    name = "/".join(parts) + ("/" if kind == b"5" else "")
    if kind in (b"5", b"1", b"2"):
        size = 0
    if kind in (b"0", b"5"):
        link = ""
    if not ustar_fits(name, link, size, mtime):
        return
    assert encode_listed(name, kind, mode, mtime, size, link) == \
        encode_header(MemberHeader(name, kind, mode, mtime, size, link))


def test_the_walk_gets_ahead_of_a_slow_writer_by_at_most_max_buffers(monkeypatch):
    """While the writer thread is behind, swap makes another buffer instead of waiting, up to _MAX_BUFFERS;
    then it waits.  Every byte is still written once and in order."""
    monkeypatch.setattr(snap_tar, "_WRITE_BUF_BYTES", 1024)
    monkeypatch.setattr(snap_tar, "_MAX_BUFFERS", 4)
    made: list[int] = []
    real_buffer = snap_tar._buffer
    monkeypatch.setattr(snap_tar, "_buffer", lambda: made.append(1) or real_buffer())
    go = threading.Event()

    class SlowSink:
        def __init__(self):
            self.data = bytearray()

        def write(self, b):
            go.wait()
            self.data += b
            return len(b)

    sink = SlowSink()
    tar = snap_tar._TarStream(sink)  # type: ignore[arg-type]
    blocks = [bytes([i]) * 512 for i in range(20)]
    feeder = threading.Thread(target=lambda: [tar.add(b) for b in blocks])
    try:
        feeder.start()
        feeder.join(0.5)
        assert feeder.is_alive() and len(made) == 4  # 4 buffers: 1 being written, 2 queued, 1 filling
        go.set()
        feeder.join()
        tar.close()
    finally:
        go.set()
        tar.stop()
    assert len(made) == 4 and bytes(sink.data[:20 * 512]) == b"".join(blocks)
    assert len(sink.data) % 10240 == 0 and not any(sink.data[20 * 512:])
