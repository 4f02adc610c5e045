"""A plain directory store keeps generations and layers; version-1 directories still restore; resume bindings.

The directory default is :class:`DirectorySnapshotStore` (a GenerationStore
over LocalObjects).  A directory a :class:`LocalSnapshotStore` (format
version 1) wrote keeps restoring, and its next persist continues its
generation numbers.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_snapshot_generations import DictObjects

from sandbox_fs import open_root
from sandbox_fs.client import ClientOptions, LocalSandboxClient
from sandbox_fs.snapshot import (
    DirectorySnapshotStore,
    GenerationStore,
    LocalSnapshotStore,
    SnapshotConflictError,
    hydrate,
    persist,
)
from sandbox_fs.snapshot import _hydrate


def _tick() -> None:
    time.sleep(0.012)  # past the coarse clock's tick, so the racy rule does not re-read


def _client(tmp_path, which: str, **store) -> LocalSandboxClient:
    return LocalSandboxClient(ClientOptions(workspaces_dir=str(tmp_path / f"ws-{which}"), **store))


# ------------------------------------------------------------- version-1 directories after the switch


async def test_a_version_1_directory_still_restores_and_continues_as_generations(tmp_path):
    sdir = tmp_path / "store"
    old_store = LocalSnapshotStore(sdir)  # what a client of the previous release made of snapshot_dir
    with _client(tmp_path, "old", snapshot_store=old_store) as old:
        async with old.create(session_id="s1") as s:
            await s.write("f", b"v1 content")
        async with old.resume(old.serialize_state(s)) as s:
            await s.write("g", b"second")
        state = old.serialize_state(s)  # installation key in the store directory, generation 2
        await old.delete(s)
    old_store.close()
    assert state["generation"] == 2 and os.path.exists(sdir / "s1.json") and not (sdir / "s1").exists()
    with _client(tmp_path, "new", snapshot_dir=str(sdir)) as new:
        assert isinstance(new.store, DirectorySnapshotStore)
        assert [(i.name, i.generation, i.version) for i in new.store.list()] == [("s1", 2, 1)]
        async with new.resume(state) as r:  # same key file, same generation and digest: accepted
            assert r.start_mode == "restored" and r.generation == 2
            assert await r.read("f") == b"v1 content" and await r.read("g") == b"second"
            await r.write("f", b"changed")
        after = new.serialize_state(r)
        assert after["generation"] == 3
        info = new.store.info("s1")
        assert info.version == 2 and info.chain_length == 1  # the first generation is full
        assert not os.path.exists(sdir / "s1.json") and not [f for f in os.listdir(sdir) if f.endswith(".tar")]
        await new.delete(r)
        async with new.resume(after) as again:
            assert await again.read("f") == b"changed"
            await again.write("f", b"third")
        assert new.store.info("s1").chain_length == 2  # and now layers


async def test_a_fork_of_a_version_1_snapshot_in_a_directory_store_is_a_copy(tmp_path):
    sdir = tmp_path / "store"
    old_store = LocalSnapshotStore(sdir)
    with _client(tmp_path, "old", snapshot_store=old_store) as old:
        async with old.create(session_id="src") as s:
            await s.write("f", b"version 1")
        state = old.serialize_state(s)
    old_store.close()
    with _client(tmp_path, "new", snapshot_dir=str(sdir)) as new:
        forked = await new.fork(state)
        info = new.store.info(forked["session_id"])
        assert info.version == 2 and forked["generation"] == info.generation == 1
        assert new.store.legacy_store("src") is not None  # the source is untouched
        async with new.resume(forked) as r:
            assert await r.read("f") == b"version 1"
        with pytest.raises(SnapshotConflictError):  # a version-1 name is in use
            new.store.fork(forked["session_id"], "src")
        new.store.remove("src")
        assert new.store.info("src") is None and not [f for f in os.listdir(sdir) if f.startswith("src.")]


def test_a_read_only_version_1_directory_still_restores(tmp_path, monkeypatch):
    import errno

    from sandbox_fs.root import Root
    from sandbox_fs.snapshot import SnapshotStoreError

    ws, dst, sdir = tmp_path / "ws", tmp_path / "dst", tmp_path / "store"
    ws.mkdir()
    dst.mkdir()
    (ws / "a").write_text("read only")
    with LocalSnapshotStore(sdir) as v1, open_root(ws) as w:
        persist(w, v1, "snap")

    real_mkdir = Root.mkdir

    def read_only(self, path, *a, **k):
        if path == ".partial":
            raise OSError(errno.EROFS, "read-only file system")
        return real_mkdir(self, path, *a, **k)
    monkeypatch.setattr(Root, "mkdir", read_only)  # as on a read-only mount: .partial cannot be made
    with DirectorySnapshotStore(sdir, create=False) as st, open_root(dst) as d:
        assert hydrate(d, st, "snap").generation == 1 and (dst / "a").read_text() == "read only"
        assert [i.name for i in st.list()] == ["snap"]
        with pytest.raises(SnapshotStoreError):
            persist(d, st, "snap")
    assert not (sdir / ".partial").exists()


def test_cli_restores_a_version_1_snapshot(tmp_path, capsys):
    from sandbox_fs.cli import main

    ws, dst, sdir = tmp_path / "ws", tmp_path / "dst", tmp_path / "store"
    ws.mkdir()
    dst.mkdir()
    (ws / "a").write_text("old format")
    with LocalSnapshotStore(sdir) as v1, open_root(ws) as w:
        persist(w, v1, "snap")
    assert main(["snapshot", "ls", "--store", str(sdir), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["generation"]) for r in rows] == [("snap", 1)]
    assert main(["snapshot", "restore", "--workspace", str(dst), "--store", str(sdir), "--name", "snap"]) == 0
    assert (dst / "a").read_text() == "old format"
    assert main(["snapshot", "save", "--workspace", str(dst), "--store", str(sdir), "--name", "snap",
                 "--json"]) == 0
    saved = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert saved["generation"] == 2 and (sdir / "snap" / "current").exists()


# ------------------------------------------------------------- a digest-less state is bound


async def test_a_digest_less_state_restores_the_generation_it_recorded_not_what_became_current(tmp_path, monkeypatch):
    """A state that recorded no digest (from before the digest, or a store that sets none) is still bound.

    Between the resume's generation check and its restore another writer
    commits a newer generation: the restore must read the generation the check
    accepted (by the digest that check read), never the newer one.
    """
    sdir = tmp_path / "store"
    with _client(tmp_path, "a", snapshot_dir=str(sdir)) as a:
        async with a.create(session_id="s") as s:
            await s.write("f", b"recorded")
        state = a.serialize_state(s)
        await a.delete(s)
        digest_less = a.sign_state(dict(state, snapshot_digest=None))
        other = tmp_path / "other"
        other.mkdir()
        (other / "f").write_text("committed meanwhile")
        store = a.store
        real_info = type(store).info
        raced = []

        def info_then_race(self, name):
            got = real_info(self, name)
            if name == "s" and not raced:
                raced.append(1)
                with open_root(other) as w:  # another writer commits generation 2
                    persist(w, GenerationStore(self.objects), "s")
            return got

        monkeypatch.setattr(type(store), "info", info_then_race)
        r = a.resume(digest_less)
        await r.start()
        monkeypatch.undo()
        try:
            assert raced and store.kept("s") == [2, 1]
            assert await r.read("f") == b"recorded" and r.generation == 1
            await r.write("f", b"mine")
        finally:
            with pytest.raises(SnapshotConflictError):  # and its persist cannot go over generation 2
                await r.aclose()


# ------------------------------------------------------------- the baseline outlives the process


def _file_members(store, info) -> set[str]:
    with store.objects.open_range(info.archive) as f, tarfile.open(fileobj=io.BytesIO(f.read())) as tf:
        return {m.name for m in tf.getmembers() if m.isfile()}


def _seed_tree(ws) -> None:
    (ws / "d").mkdir(parents=True)
    (ws / "d" / "a.txt").write_text("a\n")
    (ws / "big").write_bytes(os.urandom(200_000))
    (ws / "keep").write_text("unchanged\n")


async def test_a_resume_in_a_fresh_client_then_one_change_persists_a_one_file_layer(tmp_path, monkeypatch):
    sdir = tmp_path / "store"
    with _client(tmp_path, "a", snapshot_dir=str(sdir)) as a:
        async with a.create(session_id="s") as s:
            await s.write("big", os.urandom(200_000))
            await s.write("keep", b"unchanged\n")
            await s.write("d/a.txt", b"a\n", parents=True)
        state = a.serialize_state(s)
        await a.delete(s)  # the next resume restores
    with _client(tmp_path, "b", snapshot_dir=str(sdir)) as b:  # restores, then its process ends without a persist
        r = b.resume(state)
        await r.start()
        assert r.start_mode == "restored"
        restored = b.serialize_state(r)

        async def gone(_s):
            raise RuntimeError("the host process ends here")
        r.register_pre_stop_hook(gone)
        with pytest.raises(RuntimeError):
            await r.aclose()
    time.sleep(0.024)
    # a fresh client object (a new process): the same workspaces directory, its own store object
    with _client(tmp_path, "b", snapshot_dir=str(sdir)) as c:
        async with c.resume(restored) as again:
            assert again.start_mode == "reattached"
            await again.write("d/a.txt", b"changed\n")
        info = c.store.info("s")
        assert info.generation == 2 and info.chain_length == 2
        assert _file_members(c.store, info) == {"d/a.txt"}


def test_cli_restore_then_save_in_new_processes_writes_a_layer(tmp_path, capsys, monkeypatch):
    from sandbox_fs.cli import main

    ws, dst, sdir = tmp_path / "ws", tmp_path / "dst", tmp_path / "store"
    _seed_tree(ws)
    dst.mkdir()
    _tick()
    assert main(["snapshot", "save", "--workspace", str(ws), "--name", "n", "--store", str(sdir)]) == 0
    assert main(["snapshot", "restore", "--workspace", str(dst), "--name", "n", "--store", str(sdir)]) == 0
    time.sleep(0.024)
    (dst / "keep").write_text("changed!!\n")
    assert main(["snapshot", "save", "--workspace", str(dst), "--store", str(sdir), "--name", "n"]) == 0
    capsys.readouterr()
    with DirectorySnapshotStore(sdir) as st:
        info = st.info("n")
        assert info.chain_length == 2 and _file_members(st, info) == {"keep"}


# ------------------------------------------------------------- a forged baseline never skips a changed file


def _restore_then_change(tmp_path, monkeypatch, sdir):
    ws, dst = tmp_path / "ws", tmp_path / "dst"
    _seed_tree(ws)
    dst.mkdir()
    _tick()
    with DirectorySnapshotStore(sdir) as st, open_root(ws) as w, open_root(dst) as d:
        persist(w, st, "n")
        hydrate(d, st, "n")
    time.sleep(0.024)
    (dst / "keep").write_text("CHANGED!!\n")  # same size: only the stat tells
    return dst


@pytest.mark.parametrize("key", ["the store's own", "another", "none"])
def test_a_forged_baseline_never_makes_persist_skip_a_changed_file(tmp_path, monkeypatch, key):
    """The store's operator rewrites NAME/baseline to claim the changed file's new inode and times."""
    from sandbox_fs.snapshot._baseline import read_baseline, write_baseline

    sdir = tmp_path / "store"
    dst = _restore_then_change(tmp_path, monkeypatch, sdir)
    live = os.lstat(dst / "keep")
    with DirectorySnapshotStore(sdir) as st, open_root(dst) as d:
        base = read_baseline(st.objects, "n", st.baseline_key)
        from sandbox_fs.snapshot._index import stamp_latest_ns
        # listings taken now (the changed file's new inode and times), "taken" just past the change
        after = max(live.st_mtime_ns, stamp_latest_ns(live.st_ctime_ns)) + 1
        base.listings = _hydrate._baseline_listings(d, after, 1000)
        forged_key = {"the store's own": st.baseline_key, "another": b"x" * 32, "none": None}[key]
        write_baseline(st.objects, "n", base, forged_key)
    with DirectorySnapshotStore(sdir) as st, open_root(dst) as d:  # a new process's persist
        info = persist(d, st, "n").info
        out = tmp_path / "out"
        out.mkdir()
        with open_root(out) as o:
            hydrate(o, st, "n")
    # even under the store's own key: a listed file older than the listings' time was not made by the
    # restore (index_with_listings marks it), and a newer one is racy, so no baseline skips a read
    assert (out / "keep").read_text() == "CHANGED!!\n"
    assert info.chain_length == 2 or key != "the store's own"


# ------------------------------------------------------------- never chain onto a generation a restore passed over


def _three_generations(tmp_path, store_of):
    ws = tmp_path / "ws"
    _seed_tree(ws)
    _tick()
    with store_of() as st, open_root(ws) as w:
        for text in ("one", "two", "three"):
            (ws / "d" / "a.txt").write_text(text)
            _tick()
            persist(w, st, "n")
        assert st.info("n").chain_length == 3
        return [st.objects.head(i.archive) and i.archive for i in st.generations("n")]


def _corrupt(sdir, key: str) -> None:
    p = sdir / key
    data = bytearray(p.read_bytes())
    data[600] ^= 0xFF
    p.write_bytes(bytes(data))


@pytest.mark.parametrize("keyed", [True, False])
@pytest.mark.parametrize("what", ["archive.tar", "meta.json"])
def test_after_a_fallback_restore_save_never_chains_onto_the_corrupt_generation(tmp_path, keyed, what):
    from sandbox_fs.snapshot import LocalObjects

    sdir = tmp_path / "store"

    def store_of():  # keyed: the directory default; unkeyed: as an S3 store without baseline_key
        return DirectorySnapshotStore(sdir) if keyed else GenerationStore(LocalObjects(sdir))

    archives = _three_generations(tmp_path, store_of)
    _corrupt(sdir, archives[0].replace("archive.tar", what))  # the current generation, 3
    dst = tmp_path / "dst"
    dst.mkdir()
    with store_of() as st, open_root(dst) as d:  # `snapshot restore` (falls back to 2)
        rep = hydrate(d, st, "n", fallback=True)
        assert rep.generation == 2 and rep.skipped_generations == [3]
    (dst / "new").write_text("after the restore")
    with store_of() as st, open_root(dst) as d:  # `snapshot save`, a new process
        info = persist(d, st, "n").info
        assert info.generation == 4 and info.parent_generation in (0, 2)
        assert info.chain_length == (3 if keyed else 1)  # a layer over 2 (trusted baseline), else a full one
        out = tmp_path / "out"
        out.mkdir()
        with open_root(out) as o:
            assert hydrate(o, st, "n").generation == 4  # restorable: no corrupt archive in its chain
        assert (out / "new").read_text() == "after the restore" and (out / "d" / "a.txt").read_text() == "two"


# ------------------------------------------------------------- the hydrate fuzz target reaches layers


def test_fuzz_hydrate_chains_pass_the_store_checks_and_reach_the_layer_rules():
    """The forged store's digests match (the real chain restores); each mutation dies on a layer or index rule."""
    from sandbox_fs.testing.fuzz import _hydrate as target
    from sandbox_fs.testing.fuzz._layers import decode_chain, forged_store

    env = target._get_env()
    outcomes = []
    for data in env.chains:
        env.scene.reset()
        tars, index_json = decode_chain(data)
        try:
            with open_root(env.scene.ws) as ws:
                outcomes.append(hydrate(ws, forged_store(target.NAME, tars, index_json, env.layer_info),
                                        target.NAME, limits=env.limits).generation)
        except Exception as exc:  # noqa: BLE001
            outcomes.append(getattr(exc, "reason", str(exc)))
        target.one_input(data)  # and the target's invariant holds
    assert outcomes[0] == 4  # the real chain: a base and three layers
    refused = [o for o in outcomes if isinstance(o, str)]
    assert len(refused) >= 10 and not [r for r in refused if "match" in r or "chain" in r], refused
    assert any("extractor refuses" in r for r in refused) and any("not normalized" in r for r in refused)
    assert any("below a non-directory" in r for r in refused) and any("zip slip" in r for r in refused)


@pytest.mark.parametrize("scan_fails", [False, True])
def test_restore_baseline_listings_give_each_file_its_lstat_or_mark_it_read_again(tmp_path, monkeypatch, scan_fails):
    """The listings hydrate leaves (one native scan per directory, found from the workspace down), applied to
    the generation's index, give each file what an lstat of its path beneath the Root gives: a plain file its
    inode and times, and a file that is not there as restored (hard-linked, replaced by a symlink, another
    size, missing, or under a parent that is now a symlink to an outside directory) is marked to be read
    again.  With every scan failing nothing is listed, and every file is read again."""
    from sandbox_fs.snapshot._baseline import index_with_listings
    from sandbox_fs.snapshot._index import Index, IndexEntry

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x").write_text("12345")  # as restored: only the symlink on its path marks it
    ws_dir = tmp_path / "ws"
    (ws_dir / "d" / "e").mkdir(parents=True)
    for rel in ("a", "d/b", "d/e/c", "d/linked", "d/sized", "d/was_file"):
        (ws_dir / rel).write_text("12345")
    os.link(ws_dir / "d" / "linked", ws_dir / "d" / "linked2")
    (ws_dir / "d" / "sized").write_text("123456")
    (ws_dir / "d" / "was_file").unlink()
    (ws_dir / "d" / "was_file").symlink_to("b")
    (ws_dir / "s").symlink_to(outside)  # a parent the index names as a directory, now a symlink
    paths = ["a", "d/b", "d/e/c", "d/linked", "d/sized", "d/was_file", "d/missing", "s/x"]
    dirs = [IndexEntry(p, "dir", 7, 0, 1, 1, 0o755, "", 2, 1) for p in ("d", "d/e", "s")]
    index = Index(0, 0, dirs + [IndexEntry(p, "file", 1, 5, 1, 1, 0o644, "0" * 64, 1, 1) for p in paths], [])
    if scan_fails:
        def refuse(dfd: int, max_bytes: int | None = None) -> bytes:
            raise OSError(27, "too large")
        monkeypatch.setattr(_hydrate._native, "scan_dir", refuse)
    with open_root(ws_dir) as ws:
        listings = _hydrate._baseline_listings(ws, 12345, 1000)
    assert listings.time_ns == 12345 and listings.dev == os.stat(ws_dir).st_dev
    made = index_with_listings(index, listings)
    got = {e.path: e for e in made.entries}
    assert (made.time_ns, made.dev, made.entries[:3]) == (12345, listings.dev, dirs)  # directories as indexed
    if scan_fails:
        assert not listings.dirs and all(got[p].nlink == 0 and got[p].ino == 1 for p in paths)
        return
    assert sorted(listings.dirs) == ["", "d", "d/e"]  # never through the symlink
    for p in ("a", "d/b", "d/e/c"):
        st = os.lstat(ws_dir / p)
        assert (got[p].ino, got[p].mtime_ns, got[p].ctime_ns, got[p].nlink) == \
            (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, 1), p
    for p in ("d/linked", "d/sized", "d/was_file", "d/missing", "s/x"):
        assert got[p].nlink == 0 and got[p].ino == 1, p


def test_restore_listings_stop_at_the_record_bound_and_skip_kept_directories(tmp_path):
    """Past ``max_records`` no directory is scanned (another process may add any number); a directory in
    ``skip`` (a kept read-only grant, a mount point) is never entered; files not listed are read again."""
    from sandbox_fs.snapshot._baseline import index_with_listings
    from sandbox_fs.snapshot._index import Index, IndexEntry

    ws_dir = tmp_path / "ws"
    for d in ("a", "b", "k"):
        (ws_dir / d).mkdir(parents=True)
        (ws_dir / d / "f").write_text("x")
    k = os.stat(ws_dir / "k")
    with open_root(ws_dir) as ws:
        skipped = _hydrate._baseline_listings(ws, 1, 1000, frozenset({(k.st_dev, k.st_ino)}))
        bounded = _hydrate._baseline_listings(ws, 1, 2)
    assert sorted(skipped.dirs) == ["", "a", "b"]
    assert len(bounded.dirs) == 1  # the workspace's 3 records are already past 2
    index = Index(0, 0, [IndexEntry(f"{d}/f", "file", 1, 1, 1, 1, 0o644, "0" * 64, 1, 1) for d in "abk"], [])
    assert [e.nlink for e in index_with_listings(index, skipped).entries] == [1, 1, 0]
    assert [e.nlink for e in index_with_listings(index, bounded).entries] == [0, 0, 0]


# ------------------------------------------------------------- the stored baseline (version 2): ignored unless whole


def _baseline_object(sdir) -> bytes:
    return (sdir / "n" / "baseline").read_bytes()


def _padding_byte(flat: bytes) -> int:
    """The offset of a zero padding byte after a record's name in a baseline body (see ``_baseline``)."""
    import struct

    from sandbox_fs.snapshot._walk import SCAN_HEADER

    plen, rlen = struct.unpack_from("<II", flat, 0)
    off, end = 8 + plen, 8 + plen + rlen
    while off < end:
        nlen = SCAN_HEADER.unpack_from(flat, off)[7]
        if nlen % 8:
            return off + SCAN_HEADER.size + nlen
        off += SCAN_HEADER.size + ((nlen + 7) & ~7)
    raise AssertionError("no record with padding")


@pytest.mark.parametrize("damage", ["control", "truncated", "one-more-byte", "body-altered", "header-only",
                                    "other-generation", "other-scan-layout", "version-1", "mac-not-ascii",
                                    "mac-lone-surrogate"])
def test_a_damaged_or_stale_stored_baseline_makes_the_next_persist_read_more_never_less(tmp_path, monkeypatch,
                                                                                          damage):
    """A new process's persist after a restore: with the stored baseline whole, only the changed file is in
    the layer; with it cut, grown, altered (same size, parsing as the same listings), for another generation,
    of another scan layout, or of version 1 (a whole index), the listings are ignored and every file is read
    again (none taken over).  The changed file's new content is in the snapshot in every case (the sentinel)."""
    import hashlib
    import zlib

    from sandbox_fs.snapshot import _baseline

    sdir = tmp_path / "store"
    dst = _restore_then_change(tmp_path, monkeypatch, sdir)
    obj = sdir / "n" / "baseline"
    raw = _baseline_object(sdir)
    line, body = raw.split(b"\n", 1)
    head = json.loads(line)
    assert head["version"] == 2 and head["body_bytes"] == len(body) > 0
    assert b"a.txt" in zlib.decompress(body)  # the listings of the restored tree
    key = DirectorySnapshotStore(sdir).baseline_mac_key(create=False)

    def resign(**changes):  # a header the store's own key signs (only the named fields changed)
        h = dict(head, **changes)
        h["mac"] = _baseline._mac(key, h)
        obj.write_bytes(json.dumps(h, sort_keys=True, separators=(",", ":")).encode() + b"\n" + body)

    if damage == "truncated":
        obj.write_bytes(raw[:-1])
    elif damage == "one-more-byte":
        obj.write_bytes(raw + b"\0")
    elif damage == "body-altered":  # one padding byte of a record flipped: parses as the same listings
        flat = bytearray(zlib.decompress(body))
        flat[_padding_byte(bytes(flat))] ^= 1
        forged = zlib.compress(bytes(flat), 0)
        assert len(forged) == len(body)
        obj.write_bytes(line + b"\n" + forged)
    elif damage == "header-only":
        obj.write_bytes(line + b"\n")
    elif damage == "other-generation":
        resign(digest="0" * 64)
    elif damage == "other-scan-layout":
        resign(scan="=QQqqqQIIQ/pad8/little")
    elif damage == "version-1":
        resign(version=1, body_sha256=hashlib.sha256(body).hexdigest())
    elif damage.startswith("mac-"):  # hmac.compare_digest raised TypeError for a non-ASCII str: persist failed
        mac = "\u00e9" * 64 if damage == "mac-not-ascii" else "\ud800" + "0" * 63
        obj.write_bytes(json.dumps(dict(head, mac=mac), sort_keys=True, separators=(",", ":")).encode() + b"\n" + body)
    with DirectorySnapshotStore(sdir) as st, open_root(dst) as d:  # a new process's persist
        info = persist(d, st, "n").info
        members = _file_members(st, info)
        out = tmp_path / "out"
        out.mkdir()
        with open_root(out) as o:
            hydrate(o, st, "n")
    assert (out / "keep").read_text() == "CHANGED!!\n"
    assert info.chain_length == 2
    assert members == ({"keep"} if damage == "control" else {"keep", "big", "d/a.txt"})


def test_a_file_changed_after_a_restore_is_read_again_in_the_same_process_too(tmp_path, monkeypatch):
    """The same store object: its in-memory listings, applied to the generation's index, take the unchanged
    files over and read the changed one (the sentinel)."""
    ws, dst, sdir = tmp_path / "ws", tmp_path / "dst", tmp_path / "store"
    _seed_tree(ws)
    dst.mkdir()
    _tick()
    with DirectorySnapshotStore(sdir) as st, open_root(ws) as w, open_root(dst) as d:
        persist(w, st, "n")
        hydrate(d, st, "n")
        time.sleep(0.024)
        (dst / "keep").write_text("CHANGED!!\n")
        info = persist(d, st, "n").info
        assert info.chain_length == 2 and _file_members(st, info) == {"keep"}
        out = tmp_path / "out"
        out.mkdir()
        with open_root(out) as o:
            hydrate(o, st, "n")
    assert (out / "keep").read_text() == "CHANGED!!\n"


def test_a_restore_whose_generation_index_is_corrupt_still_saves_as_a_full_generation(tmp_path, monkeypatch):
    """A full generation's index is read by the persist that chains onto it, not by the restore: one that does
    not match its metadata makes that persist write a full generation (never a layer over it, never an error)."""
    ws, dst, sdir = tmp_path / "ws", tmp_path / "dst", tmp_path / "store"
    _seed_tree(ws)
    dst.mkdir()
    _tick()
    with DirectorySnapshotStore(sdir) as st, open_root(ws) as w:
        info = persist(w, st, "n").info
    _corrupt(sdir, info.archive.replace("archive.tar", "index"))
    with DirectorySnapshotStore(sdir) as st, open_root(dst) as d:
        hydrate(d, st, "n")
        (dst / "new").write_text("after the restore")
        again = persist(d, st, "n").info
    assert again.chain_length == 1 and again.parent_generation == 0
    assert _file_members(DirectorySnapshotStore(sdir), again) == {"keep", "big", "d/a.txt", "new"}


def test_a_restore_by_the_store_object_that_committed_a_layer_uses_the_index_it_wrote(tmp_path, monkeypatch):
    """A commit's index is kept in memory: a restore of that layer by the same store object, and the persist
    after it, use it without reading it back; another store object reads and checks the stored one.  What
    each restores is the same, and a change after the restore is in the next snapshot (the sentinel)."""
    ws, dst, dst2, sdir = tmp_path / "ws", tmp_path / "dst", tmp_path / "dst2", tmp_path / "store"
    _seed_tree(ws)
    dst.mkdir()
    dst2.mkdir()
    _tick()
    reads: list[str] = []

    def counting(st):
        real = st.objects.get_bytes

        def get_bytes(key, limit):
            if key.endswith("/index"):
                reads.append(key)
            return real(key, limit)
        monkeypatch.setattr(st.objects, "get_bytes", get_bytes)

    with DirectorySnapshotStore(sdir) as st, open_root(ws) as w, open_root(dst) as d:
        persist(w, st, "n")
        _tick()
        (ws / "d" / "a.txt").write_text("layer\n")
        assert persist(w, st, "n").info.chain_length == 2
        counting(st)
        hydrate(d, st, "n")
        time.sleep(0.024)
        (dst / "keep").write_text("CHANGED!!\n")
        info = persist(d, st, "n").info
        assert reads == [] and info.chain_length == 3 and _file_members(st, info) == {"keep"}
    with DirectorySnapshotStore(sdir) as st2, open_root(dst2) as d2:
        counting(st2)
        hydrate(d2, st2, "n")
    assert len(reads) == 1  # the new store object read the layer's index
    assert (dst2 / "keep").read_text() == "CHANGED!!\n" and (dst2 / "d" / "a.txt").read_text() == "layer\n"


_JSON_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2, 2), st.text(
    alphabet="0af\u00e9\ud800\udc80", max_size=66), st.lists(st.integers(0, 1), max_size=2))


@settings(max_examples=200, deadline=None)
@given(fields=st.dictionaries(st.sampled_from(["mac", "digest", "instead_of", "body_sha256", "generation",
                                               "body_bytes", "name", "version"]), _JSON_VALUES, max_size=3),
       keyed=st.booleans())
def test_property_reading_a_stored_baseline_header_never_raises(fields, keyed):
    """A store's writer sets any header field to any JSON value (a non-ASCII or lone-surrogate ``mac`` made
    hmac.compare_digest raise TypeError, and the persist after a restore failed): read_baseline returns a
    baseline or None, never raises, and with a key returns one only when the MAC verifies."""
    from sandbox_fs.snapshot._baseline import _mac, read_baseline

    key = b"k" * 32
    head = {"body_bytes": 0, "body_sha256": "0" * 64, "digest": "1" * 64, "format": "sandbox-fs-baseline",
            "generation": 1, "instead_of": "", "name": "n", "version": 2}
    head["mac"] = _mac(key, head)
    head.update(fields)
    objects = DictObjects()
    objects.put_bytes("n/baseline", json.dumps(head, sort_keys=True, separators=(",", ":")).encode() + b"\n")
    got = read_baseline(objects, "n", key if keyed else None)
    if got is not None and keyed:
        assert head["mac"] == _mac(key, head)
