"""Generations over an object store: pointer last by compare-and-swap, retention, fallback, conflicts, gc.

The store here is an in-memory :class:`ObjectStore` (``DictObjects``) that
keeps the contract's rules (objects visible at commit only, conditional
writes); the local-directory and S3 implementations have their own contract
tests.  Nothing here needs a server.
"""

from __future__ import annotations

import io
import json
import os
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox_fs import open_root
from sandbox_fs.snapshot import (
    GenerationStore,
    ObjectInfo,
    SnapshotConflictError,
    SnapshotCorruptError,
    SnapshotLimits,
    SnapshotNotFoundError,
    SnapshotStoreError,
    SnapshotVerifyError,
    hydrate,
    persist,
    tree_digest,
)
from sandbox_fs.snapshot._objects import ObjectStore
from sandbox_fs.snapshot import MIN_GC_AGE_S

MiB = 1 << 20


class _Writer:
    def __init__(self, store: "DictObjects", key: str) -> None:
        self.store, self.key, self.buf, self.done = store, key, bytearray(), False

    def write(self, data) -> int:
        if self.store.fail_writes:
            raise SnapshotStoreError("injected write failure", sandbox_path=None)
        self.buf += bytes(data)  # persist reuses its buffers: copy
        return len(data)

    def commit(self) -> ObjectInfo:
        self.done = True
        return self.store._set(self.key, bytes(self.buf))

    def abort(self) -> None:
        self.done = True
        self.store.aborted += 1


class DictObjects:
    """An in-memory ObjectStore: etags are a counter, conditional writes under one lock."""

    def __init__(self) -> None:
        self.objs: dict[str, tuple[bytes, str, float]] = {}
        self.lock = threading.Lock()
        self.n = 0
        self.aborted = 0
        self.fail_writes = False
        self.clock = 1000.0
        self.closed = False

    def _set(self, key: str, data: bytes) -> ObjectInfo:
        with self.lock:
            self.n += 1
            self.objs[key] = (data, f"e{self.n}", self.clock)
            return ObjectInfo(key, len(data), f"e{self.n}", self.clock)

    def put_stream(self, key: str) -> _Writer:
        return _Writer(self, key)

    def put_bytes(self, key, data, *, if_match=None, if_none_match=False) -> ObjectInfo:
        with self.lock:
            cur = self.objs.get(key)
            if if_none_match and cur is not None or if_match is not None and (cur is None or cur[1] != if_match):
                raise SnapshotConflictError("precondition failed", sandbox_path=None, context={"key": key})
            self.n += 1
            self.objs[key] = (bytes(data), f"e{self.n}", self.clock)
            return ObjectInfo(key, len(data), f"e{self.n}", self.clock)

    def open_range(self, key, start=0, length=None):
        cur = self.objs.get(key)
        if cur is None:
            raise SnapshotNotFoundError("no such object", sandbox_path=None, context={"key": key})
        end = len(cur[0]) if length is None else start + length
        return io.BytesIO(cur[0][start:end])

    def get_bytes(self, key, limit):
        from sandbox_fs.snapshot import SnapshotLimitError
        cur = self.objs.get(key)
        if cur is None:
            raise SnapshotNotFoundError("no such object", sandbox_path=None, context={"key": key})
        if len(cur[0]) > limit:
            raise SnapshotLimitError("too large", sandbox_path=None)
        return cur[0]

    def head(self, key):
        cur = self.objs.get(key)
        return None if cur is None else ObjectInfo(key, len(cur[0]), cur[1], cur[2])

    def list(self, prefix):
        for key in sorted(self.objs):
            if key.startswith(prefix):
                data, etag, mtime = self.objs[key]
                yield ObjectInfo(key, len(data), etag, mtime)

    def delete(self, key):
        self.objs.pop(key, None)

    def abort_stale_uploads(self, older_than):
        return 0

    def close(self):
        self.closed = True


def _tree(ws: Path, tag: str) -> None:
    (ws / "d").mkdir(exist_ok=True)
    (ws / "d" / "f.txt").write_text(f"content {tag}\n")
    (ws / "big").write_bytes(os.urandom(64 * 1024) * 4)
    (ws / "link").unlink(missing_ok=True)
    (ws / "link").symlink_to("d/f.txt")


@pytest.fixture
def env(tmp_path):
    ws, dst = tmp_path / "ws", tmp_path / "dst"
    ws.mkdir()
    dst.mkdir()
    objects = DictObjects()
    store = GenerationStore(objects, keep=2)
    with open_root(ws) as w, open_root(dst) as d:
        yield ws, dst, w, d, objects, store


@pytest.fixture
def local(tmp_path):
    """The same store over a real directory (LocalObjects)."""
    from sandbox_fs.snapshot._objects_local import LocalObjects

    ws, dst = tmp_path / "ws", tmp_path / "dst"
    ws.mkdir()
    dst.mkdir()
    store = GenerationStore(LocalObjects(tmp_path / "objects"), keep=2)
    with store, open_root(ws) as w, open_root(dst) as d:
        yield ws, dst, w, d, tmp_path / "objects", store


def test_local_directory_round_trip_conflict_and_fallback(local):
    ws, dst, w, d, objdir, store = local
    _tree(ws, "one")
    first = persist(w, store, "s", expect_generation=0).info
    _tree(ws, "two")
    second = persist(w, store, "s", expect_generation=1).info
    with pytest.raises(SnapshotConflictError):
        persist(w, store, "s", expect_generation=1)
    got = hydrate(d, store, "s", digest=second.digest)
    assert got.generation == 2 and (dst / "d" / "f.txt").read_text() == "content two\n"
    archive = objdir / second.archive
    data = bytearray(archive.read_bytes())
    data[700] ^= 0xFF
    archive.write_bytes(bytes(data))
    got = hydrate(d, store, "s", fallback=True)
    assert got.generation == 1 and got.skipped_generations == [2]
    assert tree_digest(d) == first.tree_digest


def test_the_test_store_has_every_method_of_the_contract():
    wanted = {n for n in vars(ObjectStore) if not n.startswith("_")}
    assert wanted and wanted <= set(dir(DictObjects))


def test_round_trip_and_layout(env):
    ws, dst, w, d, objects, store = env
    _tree(ws, "one")
    rep = persist(w, store, "s")
    info = rep.info
    assert info.generation == 1 and info.version == 2 and len(info.archive_blake3) == 64 and info.archive_sha256 == ""
    assert len(info.digest) == 64
    keys = sorted(objects.objs)
    gen_dir = info.archive.split("/")[2]
    assert keys == sorted(["s/current", f"s/gen/{gen_dir}/archive.tar", f"s/gen/{gen_dir}/meta.json",
                           f"s/gen/{gen_dir}/index"])
    assert gen_dir.startswith("000000000001-")
    got = hydrate(d, store, "s")
    assert got.generation == 1 and got.skipped_generations == []
    assert tree_digest(d) == info.tree_digest
    assert (dst / "d" / "f.txt").read_text() == "content one\n"
    assert store.info("s") == info


def test_generations_are_kept_up_to_keep_and_older_ones_deleted(env):
    ws, dst, w, d, objects, _ = env
    store = GenerationStore(objects, keep=3)
    for i in range(5):
        _tree(ws, str(i))
        assert persist(w, store, "s").info.generation == i + 1
    assert store.kept("s") == [5, 4, 3]
    assert [g.generation for g in store.generations("s")] == [5, 4, 3]
    dirs = {k.split("/")[2] for k in objects.objs if "/gen/" in k}
    assert sorted(int(x.split("-")[0]) for x in dirs) == [3, 4, 5]
    got = hydrate(d, store, "s", generation=4)
    assert got.generation == 4 and (dst / "d" / "f.txt").read_text() == "content 3\n"
    with pytest.raises(SnapshotNotFoundError):
        hydrate(d, store, "s", generation=2)


def _corrupt_archive(objects: DictObjects, gen: int) -> None:
    key = next(k for k in objects.objs if f"/gen/{gen:012d}-" in k and k.endswith("archive.tar"))
    data, etag, mtime = objects.objs[key]
    flipped = bytearray(data)
    flipped[700] ^= 0xFF  # inside the first file's data (the header is the first 512 bytes)
    objects.objs[key] = (bytes(flipped), etag, mtime)


def test_hydrate_falls_back_to_the_previous_good_generation(env):
    ws, dst, w, d, objects, store = env
    _tree(ws, "old")
    persist(w, store, "s")
    _tree(ws, "new")
    persist(w, store, "s")
    _corrupt_archive(objects, 2)
    (dst / "keep").write_text("before")
    with pytest.raises(SnapshotCorruptError):
        hydrate(d, store, "s")  # no fallback asked: refused, workspace untouched
    assert (dst / "keep").read_text() == "before"
    got = hydrate(d, store, "s", fallback=True)
    assert got.generation == 1 and got.skipped_generations == [2]
    assert (dst / "d" / "f.txt").read_text() == "content old\n"
    assert not (dst / "keep").exists()


def test_every_generation_corrupt_is_refused_and_leaves_the_workspace(env):
    ws, dst, w, d, objects, store = env
    _tree(ws, "a")
    persist(w, store, "s")
    persist(w, store, "s")
    _corrupt_archive(objects, 1)
    _corrupt_archive(objects, 2)
    (dst / "keep").write_text("before")
    with pytest.raises(SnapshotCorruptError):
        hydrate(d, store, "s", fallback=True)
    assert sorted(os.listdir(dst)) == ["keep"]


def test_metadata_swapped_with_its_archive_is_refused_by_digest(env):
    """An older generation's archive and metadata relabeled as the current one: caught by the MAC'd digest."""
    ws, dst, w, d, objects, store = env
    _tree(ws, "old")
    old = persist(w, store, "s").info
    _tree(ws, "new")
    new = persist(w, store, "s").info
    # The attacker controls the store: rewrite the pointer so the current entry names the old objects.
    ptr = json.loads(objects.objs["s/current"][0])
    ptr["generations"][0] = dict(ptr["generations"][1])
    ptr["generations"] = [ptr["generations"][0]]
    ptr["restore_points"] = 1
    objects.put_bytes("s/current", json.dumps(ptr).encode())
    assert store.info("s").digest == old.digest
    with pytest.raises(SnapshotCorruptError, match="session state recorded"):
        hydrate(d, store, "s", digest=new.digest)
    assert os.listdir(dst) == []


def test_archive_replaced_under_intact_metadata_is_refused(env):
    ws, dst, w, d, objects, store = env
    _tree(ws, "one")
    info = persist(w, store, "s").info
    data, etag, mtime = objects.objs[info.archive]
    objects.objs[info.archive] = (data[:-10240] + bytes(10240), etag, mtime)  # same size, different bytes
    with pytest.raises(SnapshotCorruptError):
        hydrate(d, store, "s")
    assert os.listdir(dst) == []


def test_metadata_not_matching_the_pointer_is_corrupt(env):
    ws, _dst, w, _d, objects, store = env
    _tree(ws, "one")
    info = persist(w, store, "s").info
    meta_key = info.archive.replace("archive.tar", "meta.json")
    raw = json.loads(objects.objs[meta_key][0])
    raw["mode_fixups"] = [["d/f.txt", 0o777]]
    objects.objs[meta_key] = (json.dumps(raw).encode(), "x", 0)
    with pytest.raises(SnapshotCorruptError, match="pointer"):
        store.info("s")


def test_two_writers_from_one_pointer_exactly_one_wins(env):
    ws, dst, w, d, objects, store = env
    _tree(ws, "base")
    persist(w, store, "s")
    a = store.begin("s")
    b = store.begin("s")
    from sandbox_fs.snapshot._tar import _TarStream
    from sandbox_fs.snapshot._entries import _walk_into
    from sandbox_fs.snapshot._models import SnapshotInfo, SnapshotPolicy
    from sandbox_fs.snapshot._walk import _Prune

    def write(pending):
        tar = _TarStream(pending.sink)
        try:
            walked = _walk_into(w, _Prune(), SnapshotPolicy(), "refuse", tar)
            tar.close()
        finally:
            tar.stop()
        t = walked.digest.hexdigest()
        return SnapshotInfo(version=2, name="s", archive="x", archive_bytes=pending.sink.count,
                            archive_crc32=pending.sink.hexdigest(), fingerprint=t, tree_digest=t,
                            entries=walked.entries, content_bytes=walked.content)

    ia, ib = write(a), write(b)
    won = store.commit(a, ia)
    assert won.generation == 2
    with pytest.raises(SnapshotConflictError) as exc:
        store.commit(b, ib)
    store.abort(b)
    assert exc.value.retryable is False
    assert store.kept("s") == [2, 1]
    # the loser's objects are gone: only kept generations remain
    dirs = {k.split("/")[2] for k in objects.objs if "/gen/" in k}
    assert len(dirs) == 2
    assert hydrate(d, store, "s").generation == 2


def test_expect_generation_refuses_a_writer_that_saw_an_older_generation(env):
    ws, _dst, w, _d, objects, store = env
    _tree(ws, "a")
    persist(w, store, "s", expect_generation=0)
    persist(w, store, "s", expect_generation=1)  # machine A
    before = dict(objects.objs)
    with pytest.raises(SnapshotConflictError):
        persist(w, store, "s", expect_generation=1)  # machine B resumed the same state
    assert objects.objs == before  # nothing written
    with pytest.raises(SnapshotConflictError):
        persist(w, store, "fresh", expect_generation=3)


def test_failed_upload_leaves_the_previous_generation_current(env):
    ws, dst, w, d, objects, store = env
    _tree(ws, "good")
    persist(w, store, "s")
    objects.fail_writes = True
    _tree(ws, "lost")
    with pytest.raises(SnapshotStoreError):
        persist(w, store, "s")
    objects.fail_writes = False
    assert objects.aborted == 1
    assert store.kept("s") == [1]
    hydrate(d, store, "s")
    assert (dst / "d" / "f.txt").read_text() == "content good\n"


def test_size_mismatch_after_upload_is_a_verify_error(env, monkeypatch):
    ws, _dst, w, _d, objects, store = env
    _tree(ws, "a")
    persist(w, store, "s")
    real = objects.head

    def short_head(key):
        got = real(key)
        return got._replace(size=got.size - 1) if got is not None and key.endswith("archive.tar") else got

    monkeypatch.setattr(objects, "head", short_head)
    with pytest.raises(SnapshotVerifyError) as exc:
        persist(w, store, "s")
    assert exc.value.context["generation"] == 1
    monkeypatch.undo()
    assert store.kept("s") == [1]
    assert sum(1 for k in objects.objs if k.endswith("archive.tar")) == 1


def test_gc_removes_orphans_only_after_the_grace_period(env):
    ws, _dst, w, _d, objects, store = env
    _tree(ws, "a")
    persist(w, store, "s")
    objects._set("s/gen/000000000009-00000000000000aa/archive.tar", b"orphan")  # a crashed writer
    objects._set("gone/gen/000000000001-00000000000000bb/archive.tar", b"no pointer")
    assert store.gc(older_than=MIN_GC_AGE_S, now=objects.clock + MIN_GC_AGE_S - 1).objects == []
    rep = store.gc(older_than=MIN_GC_AGE_S, now=objects.clock + MIN_GC_AGE_S)
    assert sorted(rep.objects) == ["gone/gen/000000000001-00000000000000bb/archive.tar",
                                   "s/gen/000000000009-00000000000000aa/archive.tar"]
    assert rep.bytes == len(b"orphan") + len(b"no pointer")
    assert store.kept("s") == [1]
    assert store.info("s") is not None and len([k for k in objects.objs if k.startswith("s/gen/")]) == 3


def test_open_archive_returns_verified_bytes(env):
    ws, _dst, w, _d, objects, store = env
    _tree(ws, "a")
    info = persist(w, store, "s").info
    f, got = store.open_archive("s", SnapshotLimits())
    with f:
        assert f.read() == objects.objs[info.archive][0]
    assert got == info
    with pytest.raises(Exception):
        store.open_archive("s", SnapshotLimits(max_archive_bytes=10))


def test_list_remove_and_names(env):
    ws, _dst, w, _d, objects, store = env
    _tree(ws, "a")
    persist(w, store, "b")
    persist(w, store, "a")
    assert [i.name for i in store.list()] == ["a", "b"]
    store.remove("a")
    assert [i.name for i in store.list()] == ["b"]
    assert not any(k.startswith("a/") for k in objects.objs)
    assert store.info("a") is None


@pytest.mark.parametrize("ptr", [
    b"not json",
    json.dumps({"format": "sandbox-fs-generations", "version": 1, "name": "other",
                "generations": [{"generation": 1, "dir": "000000000001-" + "0" * 16, "meta_sha256": "0" * 64}]}),
    json.dumps({"format": "sandbox-fs-generations", "version": 1, "name": "s",
                "generations": [{"generation": 1, "dir": "../../../etc-" + "0" * 16, "meta_sha256": "0" * 64}]}),
    json.dumps({"format": "sandbox-fs-generations", "version": 1, "name": "s",
                "generations": [{"generation": 2, "dir": "000000000001-" + "0" * 16, "meta_sha256": "0" * 64}]}),
    json.dumps({"format": "sandbox-fs-generations", "version": 1, "name": "s",
                "generations": [{"generation": 1, "dir": "000000000001-" + "0" * 16, "meta_sha256": "0" * 64},
                                {"generation": 1, "dir": "000000000001-" + "1" * 16, "meta_sha256": "0" * 64}]}),
])
def test_forged_pointers_are_corrupt(env, ptr):
    objects, store = env[4], env[5]
    objects.put_bytes("s/current", ptr if isinstance(ptr, bytes) else ptr.encode())
    with pytest.raises(SnapshotCorruptError):
        store.info("s")
    with pytest.raises(SnapshotCorruptError):
        persist(env[2], store, "s")


def test_keep_is_bounded():
    with pytest.raises(ValueError):
        GenerationStore(DictObjects(), keep=0)


# ------------------------------------------------------------- sessions: two machines, one store


def _machine(tmp_path, objects_dir, which: str):
    from sandbox_fs.client import ClientOptions, LocalSandboxClient
    from sandbox_fs.snapshot._objects_local import LocalObjects

    store = GenerationStore(LocalObjects(objects_dir), keep=2)
    return LocalSandboxClient(ClientOptions(workspaces_dir=str(tmp_path / f"ws-{which}"), snapshot_store=store,
                                            state_key=b"k" * 32))


async def test_a_session_stopped_on_one_machine_resumes_on_another(tmp_path):
    from sandbox_fs.session import SnapshotGenerationError

    objs = tmp_path / "objects"
    with _machine(tmp_path, objs, "a") as a, _machine(tmp_path, objs, "b") as b:
        async with a.create() as s:
            await s.write("notes.txt", b"from A")
        state1 = a.serialize_state(s)
        assert state1["generation"] == 1 and len(state1["snapshot_digest"]) == 64
        r = b.resume(state1)
        async with r:
            assert r.start_mode == "restored"
            assert await r.read("notes.txt") == b"from A"
            await r.write("notes.txt", b"from B")
        state2 = b.serialize_state(r)
        assert state2["generation"] == 2 and state2["snapshot_digest"] != state1["snapshot_digest"]
        with pytest.raises(SnapshotGenerationError):  # A's old state is stale now
            async with a.resume(state1):
                pass
        async with a.resume(state2) as again:
            assert await again.read("notes.txt") == b"from B"


async def test_two_machines_resuming_one_state_cannot_both_commit(tmp_path):
    objs = tmp_path / "objects"
    with _machine(tmp_path, objs, "a") as a, _machine(tmp_path, objs, "b") as b:
        async with a.create() as s:
            await s.write("f", b"base")
        state = a.serialize_state(s)
        ra, rb = a.resume(state), b.resume(state)
        await ra.start()
        await rb.start()
        await ra.write("f", b"A wins")
        await rb.write("f", b"B loses")
        await ra.aclose()  # persists: generation 2
        with pytest.raises(SnapshotConflictError):
            await rb.aclose()
        assert GenerationStore(a.store.objects).kept(s.id) == [2, 1]
        async with b.resume(a.serialize_state(ra)) as c:
            assert await c.read("f") == b"A wins"


async def test_metadata_and_data_replaced_together_are_refused_on_resume(tmp_path):
    """A store that swaps in another valid generation (same number, other metadata + archive) is refused."""
    from sandbox_fs.session import SnapshotDigestMismatchError

    objs, evil_objs = tmp_path / "objects", tmp_path / "evil"
    with _machine(tmp_path, objs, "a") as a, _machine(tmp_path, evil_objs, "e") as e:
        async with a.create(session_id="victim") as s:
            await s.write("f", b"genuine")
        state = a.serialize_state(s)
        async with e.create(session_id="victim") as forged:
            await forged.write("f", b"forged")
        # the store's operator replaces the whole snapshot with the forged one (pointer, metadata, archive)
        import shutil
        shutil.rmtree(objs / "victim")
        shutil.copytree(evil_objs / "victim", objs / "victim")
        r = a.resume(state)
        with pytest.raises(SnapshotDigestMismatchError):
            await r.start()
        assert (tmp_path / "ws-a" / "victim" / "f").read_bytes() == b"genuine"  # nothing changed


# -- the verifying reader hydrate reads a generation's archive through


@settings(max_examples=60, deadline=None)
@given(size=st.integers(0, 3 << 20), extra=st.integers(0, 2), flip=st.booleans(),
       reads=st.lists(st.tuples(st.booleans(), st.integers(0, 1 << 21)), max_size=12))
def test_verifying_reader_hands_out_exactly_the_recorded_bytes(size: int, extra: int, flip: bool,
                                                              reads: list[tuple[bool, int]]) -> None:
    """Reads of any sizes (read and readinto, within and across its 1 MiB blocks) give the archive's bytes
    in order, full (short only at the recorded end), never past it; verify passes exactly when the
    store's bytes are the recorded ones, whatever the reads left."""
    import hashlib
    import zlib

    from sandbox_fs.snapshot._generations import VerifyingReader
    from sandbox_fs.snapshot._models import SnapshotInfo

    data = (bytes(range(251)) * ((size // 251) + 1))[:size]
    stored = bytearray(data + b"x" * extra)
    if flip and size:
        stored[size // 2] ^= 1
    t = "0" * 64
    info = SnapshotInfo(name="s", archive="x", archive_bytes=size, archive_crc32=f"{zlib.crc32(data):08x}",
                        archive_sha256=hashlib.sha256(data).hexdigest(), fingerprint=t, tree_digest=t, entries=0,
                        content_bytes=size)
    reader = VerifyingReader(io.BufferedReader(io.BytesIO(bytes(stored)), 1 << 20), info)
    pos = 0
    for use_readinto, n in reads:
        if use_readinto:
            buf = bytearray(n)
            got = bytes(buf[:reader.readinto(buf)])
        else:
            got = reader.read(n)
        assert got == bytes(stored[pos:min(pos + n, size)])  # full reads, cut only at the recorded size
        pos += len(got)
    if extra or (flip and size):
        with pytest.raises(SnapshotCorruptError):
            reader.verify(info)
    else:
        reader.verify(info)


def test_verifying_reader_raises_the_stores_error_and_close_joins_its_thread() -> None:
    """The reader's thread takes blocks ahead of the extractor: a store error mid-read reaches the read at
    that point and verify (a failing store is not a corrupt archive, so hydrate's fallback does not pass
    over a good generation for it); close mid-read, with the read-ahead queue full, ends the thread."""
    import hashlib
    import zlib

    from sandbox_fs.snapshot._models import SnapshotInfo
    from sandbox_fs.snapshot._reader import VerifyingReader

    data = bytes(range(256)) * (40 << 12)  # 40 MiB: more blocks than the read-ahead queue holds
    t = "0" * 64
    info = SnapshotInfo(name="s", archive="x", archive_bytes=len(data), archive_crc32=f"{zlib.crc32(data):08x}",
                        archive_sha256=hashlib.sha256(data).hexdigest(), fingerprint=t, tree_digest=t, entries=0,
                        content_bytes=len(data))

    class Failing(io.RawIOBase):
        def __init__(self) -> None:
            self.pos = 0

        def readable(self) -> bool:
            return True

        def readinto(self, b) -> int:  # type: ignore[no-untyped-def]
            if self.pos >= 3 * MiB:
                raise SnapshotStoreError("the store went away", sandbox_path=None, retryable=True)
            n = min(len(b), 3 * MiB - self.pos)
            b[:n] = data[self.pos:self.pos + n]
            self.pos += n
            return n

    reader = VerifyingReader(io.BufferedReader(Failing(), MiB), info)
    assert reader.read(2 * MiB) == data[:2 * MiB]
    with pytest.raises(SnapshotStoreError):
        reader.read(2 * MiB)
    with pytest.raises(SnapshotStoreError):
        reader.verify(info)
    reader.close()

    reader = VerifyingReader(io.BufferedReader(io.BytesIO(data), MiB), info)
    assert reader.read(1000) == data[:1000]
    deadline = 0
    while reader._pump.queue.qsize() < 4 and deadline < 500:  # the thread is blocked on a full queue
        threading.Event().wait(0.01)
        deadline += 1
    thread = reader._thread
    reader.close()
    assert thread is not None and not thread.is_alive()
    with pytest.raises(ValueError):
        reader.read(1)


@pytest.mark.parametrize("at", [0, 600, -1])
def test_open_archive_refuses_an_object_swapped_after_its_verified_read(env, at):
    """A hostile store serves the recorded bytes to the verifying read and others (same size) after it:
    the reader returned never hands out the swapped archive's last byte (CRC-32 kept or not)."""
    ws, _dst, w, _d, objects, store = env
    _tree(ws, "a")
    info = persist(w, store, "s").info
    good = objects.objs[info.archive][0]
    bad = bytearray(good)
    bad[at] ^= 0x20
    real, calls = objects.open_range, []

    def swapping(key, start=0, length=None):
        calls.append(key)
        if key == info.archive and calls.count(key) == 2:  # the read after the verified one
            data, etag, mtime = objects.objs[key]
            objects.objs[key] = (bytes(bad), etag, mtime)
        return real(key, start, length)
    objects.open_range = swapping
    f, _got = store.open_archive("s", SnapshotLimits())
    with f, pytest.raises(SnapshotCorruptError):
        while f.read(100):
            pass


@settings(max_examples=25, deadline=None)
@given(pos=st.floats(0, 1, exclude_max=True), chunk=st.sampled_from([1, 7, 512, 4096, 1 << 20]), swap=st.booleans())
def test_property_open_archive_reads_the_recorded_bytes_or_refuses(tmp_path_factory, pos, chunk, swap):
    """Any read sizes: exactly the recorded bytes when the store keeps them; a refusal when any byte was swapped."""
    ws = tmp_path_factory.mktemp("ws")
    _tree(ws, "a")
    objects = DictObjects()
    store = GenerationStore(objects, keep=2)
    with open_root(ws) as w:
        info = persist(w, store, "s").info
    good = objects.objs[info.archive][0]
    real, calls = objects.open_range, []

    def swapping(key, start=0, length=None):
        calls.append(key)
        if swap and key == info.archive and calls.count(key) == 2:
            data, etag, mtime = objects.objs[key]
            bad = bytearray(data)
            bad[int(pos * len(bad))] ^= 1
            objects.objs[key] = (bytes(bad), etag, mtime)
        return real(key, start, length)
    objects.open_range = swapping
    f, _got = store.open_archive("s", SnapshotLimits())
    out = bytearray()
    with f:
        if swap:
            with pytest.raises(SnapshotCorruptError):
                while data := f.read(chunk):
                    out += data
            assert len(out) < len(good)  # the last bytes never came out
        else:
            while data := f.read(chunk):
                out += data
            assert bytes(out) == good
