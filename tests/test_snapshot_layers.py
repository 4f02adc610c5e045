"""Incremental persist: layers over a parent index, change detection, one-pass hydrate, compaction, layer attacks.

Stores are :class:`GenerationStore` over the in-memory ``DictObjects`` of
``test_snapshot_generations`` (a forged store is one whose objects the test
rewrites: the index, the metadata naming it and the pointer naming that).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
import time
import zlib
from pathlib import Path

import blake3
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandbox_fs import open_root
from sandbox_fs.snapshot import GenerationStore, SnapshotCorruptError, SnapshotLimits, hydrate, persist, tree_digest
from sandbox_fs.snapshot import _layers
from sandbox_fs.snapshot._generations import MAX_CHAIN
from sandbox_fs.snapshot._index import index_digest
from tests.test_snapshot import _host_view, _trees
from tests.test_snapshot_generations import DictObjects


def _tick() -> None:
    time.sleep(0.012)  # past the coarse clock's tick (4 ms at HZ=250), so the racy rule does not re-read


def _members(objects: DictObjects, info) -> list[str]:
    data = objects.objs[info.archive][0]
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        return [m.name.rstrip("/") for m in tf.getmembers()]


@pytest.fixture
def env(tmp_path):
    ws, dst = tmp_path / "ws", tmp_path / "dst"
    ws.mkdir()
    dst.mkdir()
    (ws / "d").mkdir()
    (ws / "d" / "a.txt").write_text("a\n")
    (ws / "big").write_bytes(os.urandom(200_000))
    (ws / "keep").write_text("unchanged\n")
    (ws / "ln").symlink_to("d/a.txt")
    _tick()  # the tree is strictly older than the first persist's walk: no file of it is racy
    objects = DictObjects()
    store = GenerationStore(objects, keep=2)
    with open_root(ws) as w, open_root(dst) as d:
        yield ws, dst, w, d, objects, store


def test_unchanged_files_are_neither_read_nor_written(env, monkeypatch):
    ws, dst, w, d, objects, store = env
    full = persist(w, store, "s").info
    assert full.chain_length == 1 and set(_members(objects, full)) == {"d", "d/a.txt", "big", "keep", "ln"}
    _tick()
    (ws / "d" / "a.txt").write_text("changed\n")
    (ws / "new").write_text("new\n")
    (ws / "keep").unlink()
    read = []
    real = os.readv
    monkeypatch.setattr(os, "readv", lambda fd, bufs: read.append(fd) or real(fd, bufs))
    layer = persist(w, store, "s").info
    monkeypatch.undo()
    assert layer.chain_length == 2 and layer.parent_generation == 1 and layer.parent_digest == full.digest
    assert layer.deleted == 1
    # not big, not keep, nor the directory d (a file's content changed in it: its mtime did not)
    assert set(_members(objects, layer)) == {"d/a.txt", "new", "ln"}
    assert len(read) == 2  # the two small changed files, one readv each (big and keep never read)
    assert layer.archive_bytes < full.archive_bytes // 10
    assert layer.tree_digest == tree_digest(w)  # the fingerprint matches a full walk
    rep = hydrate(d, store, "s")
    assert rep.generation == 2
    assert _host_view(dst) == _host_view(ws)


def test_racy_files_are_read_again(env, monkeypatch):
    """A file whose timestamps are not strictly older than the parent's walk is re-read, though it matches."""
    ws, _dst, w, _d, objects, store = env
    monkeypatch.setattr(_layers, "coarse_now_ns", lambda: 0)  # the parent's walk "began" before every file
    persist(w, store, "s")
    monkeypatch.undo()
    read = []
    real = os.readv
    monkeypatch.setattr(os, "readv", lambda fd, bufs: read.append(fd) or real(fd, bufs))
    layer = persist(w, store, "s").info
    monkeypatch.undo()
    assert len(read) >= 3  # big, keep and d/a.txt read again (their content is the parent's: not written)
    assert not {"big", "keep", "d/a.txt"} & set(_members(objects, layer))


def test_same_size_rewrite_with_restored_mtime_is_caught_by_ctime(env):
    ws, dst, w, d, objects, store = env
    persist(w, store, "s")
    _tick()
    st0 = os.stat(ws / "keep")
    (ws / "keep").write_text("UNCHANGED\n")  # same size
    os.utime(ws / "keep", ns=(st0.st_atime_ns, st0.st_mtime_ns))  # mtime put back; ctime moves
    layer = persist(w, store, "s").info
    assert "keep" in _members(objects, layer)
    hydrate(d, store, "s")
    assert (dst / "keep").read_text() == "UNCHANGED\n"


def _touch_ctimes(ws: Path) -> None:
    """Change every regular file's ctime and nothing else (as a re-own by another identity does)."""
    for p in (ws / "d" / "a.txt", ws / "big", ws / "keep"):
        mode = p.stat().st_mode
        os.chmod(p, 0o600)
        os.chmod(p, mode)


def test_a_ctime_only_change_is_read_but_not_written_again(env, monkeypatch):
    """Issue 16: a re-own changes every ctime; the files are hashed, and the layer carries none of them."""
    ws, dst, w, d, objects, store = env
    full = persist(w, store, "s").info
    _tick()
    _touch_ctimes(ws)
    (ws / "new").write_text("new\n")
    _tick()
    read = []
    real = os.readv
    monkeypatch.setattr(os, "readv", lambda fd, bufs: read.append(fd) or real(fd, bufs))
    layer = persist(w, store, "s").info
    monkeypatch.undo()
    assert len(read) >= 4  # the three files compared by content, and new
    assert layer.chain_length == 2 and set(_members(objects, layer)) == {"new", "ln"}  # (a symlink always is)
    assert layer.archive_bytes < full.archive_bytes // 10 and layer.tree_digest == tree_digest(w)
    _tick()
    again = persist(w, store, "s").info  # their new ctimes are in the index: neither read nor written now
    assert _members(objects, again) == ["ln"] and again.chain_length == 3
    hydrate(d, store, "s")
    assert _host_view(dst) == _host_view(ws)


def test_a_ctime_only_candidate_changed_while_hashed_or_open_for_writing_is_written(env, monkeypatch):
    """Content that changes during the comparison, or a file a writer holds open, goes into the layer as read."""
    from sandbox_fs.snapshot import _entries

    ws, dst, w, d, objects, store = env
    persist(w, store, "s")
    _tick()
    _touch_ctimes(ws)
    _tick()
    real_sha = _entries._content_sha

    def rewrite_after_hashing(fd, size):  # a same-size write with the mtime put back, just after the read
        out = real_sha(fd, size)
        old = (ws / "keep").stat()
        (ws / "keep").write_text("REWRITTEN\n")
        os.utime(ws / "keep", ns=(old.st_atime_ns, old.st_mtime_ns))
        return out

    monkeypatch.setattr(_entries, "_content_sha", rewrite_after_hashing)
    writer = os.open(ws / "big", os.O_WRONLY)  # open for writing: a mapping could change it unseen
    try:
        layer = persist(w, store, "s").info
    finally:
        os.close(writer)
        monkeypatch.undo()
    assert {"keep", "big"} <= set(_members(objects, layer))
    hydrate(d, store, "s")
    assert (dst / "keep").read_text() == "REWRITTEN\n" and _host_view(dst) == _host_view(ws)


def test_the_first_persist_after_a_hydrate_is_incremental(env, monkeypatch):
    ws, dst, w, d, objects, store = env
    persist(w, store, "s")
    # the restored files are hashed by the next persist (their ctimes are at or after the baseline's
    # time), and those unchanged are not written again
    hydrate(d, store, "s")  # "another machine": new inodes and ctimes
    time.sleep(0.024)
    (dst / "d" / "a.txt").write_text("on the other machine\n")
    layer = persist(d, store, "s").info
    assert layer.chain_length == 2
    assert set(_members(objects, layer)) == {"d", "d/a.txt", "ln"}
    other = GenerationStore(objects)  # a store object without the baseline: the index's inodes are another tree's
    persist(d, other, "s")  # still correct: everything is read again
    out = Path(str(dst) + "-2")
    out.mkdir()
    with open_root(out) as o:
        hydrate(o, other, "s")
    assert _host_view(out) == _host_view(dst)


def test_compaction_past_the_chain_length_and_retention_keeps_chains(env):
    ws, _dst, w, d, objects, store = env
    infos = []
    for i in range(MAX_CHAIN + 1):
        _tick()
        (ws / "d" / "a.txt").write_text(f"v{i}\n")
        infos.append(persist(w, store, "s").info)
    lengths = [i.chain_length for i in infos]
    assert lengths[:MAX_CHAIN] == list(range(1, MAX_CHAIN + 1)) and lengths[MAX_CHAIN] == 1
    assert store.kept("s") == [MAX_CHAIN + 1, MAX_CHAIN]
    # the previous restore point (a layer) still restores: its whole chain was kept
    got = hydrate(d, store, "s", generation=MAX_CHAIN)
    assert got.generation == MAX_CHAIN and (d.stat("d/a.txt").st_size == len(f"v{MAX_CHAIN - 1}\n"))
    dirs = {k.split("/")[2] for k in objects.objs if "/gen/" in k}
    assert len(dirs) == MAX_CHAIN + 1  # base..gen MAX_CHAIN and the new full one
    assert store.gc(now=objects.clock + 10**6).objects == []  # nothing kept is an orphan
    _tick()
    persist(w, store, "s")  # now the old chain is no restore point's: pruned
    dirs = {k.split("/")[2] for k in objects.objs if "/gen/" in k}
    assert len(dirs) == 2


def test_delta_ratio_compacts(env):
    ws, _dst, w, _d, _objects, store = env
    persist(w, store, "s")
    _tick()
    (ws / "big").write_bytes(os.urandom(200_000))  # a layer as big as the base
    assert persist(w, store, "s").info.chain_length == 2
    _tick()
    (ws / "d" / "a.txt").write_text("x\n")
    assert persist(w, store, "s").info.chain_length == 1  # the chain's layers exceed half the base


def test_dir_replaced_by_symlink_in_a_later_layer(env):
    ws, dst, w, d, objects, store = env
    (ws / "sub").mkdir()
    (ws / "sub" / "inner").write_text("inner\n")
    persist(w, store, "s")
    _tick()
    shutil.rmtree(ws / "sub")
    (ws / "sub").symlink_to("d")
    layer = persist(w, store, "s").info
    assert layer.chain_length == 2 and layer.deleted == 1
    hydrate(d, store, "s")
    assert (dst / "sub").is_symlink() and os.readlink(dst / "sub") == "d"
    assert sorted(os.listdir(dst / "d")) == ["a.txt"]  # the base's sub/inner went nowhere


def test_hard_links_across_layers(env):
    ws, dst, w, d, objects, store = env
    os.link(ws / "keep", ws / "keep2")
    persist(w, store, "s")
    _tick()
    os.link(ws / "keep", ws / "d" / "keep3")  # a third name in the layer; the first two are in the base
    layer = persist(w, store, "s").info
    assert {"keep", "keep2", "d/keep3"} <= set(_members(objects, layer))  # a link group is whole in one layer
    hydrate(d, store, "s")
    ino = {os.stat(dst / p).st_ino for p in ("keep", "keep2", "d/keep3")}
    assert len(ino) == 1 and os.stat(dst / "keep").st_nlink == 3
    _tick()
    (ws / "keep2").unlink()
    (ws / "d" / "keep3").unlink()  # back to one link: "keep" is written again (its ctime moved)
    layer = persist(w, store, "s").info
    hydrate(d, store, "s")
    assert os.stat(dst / "keep").st_nlink == 1 and not (dst / "keep2").exists()


# ------------------------------------------------------------- forged layers


def _forge(objects: DictObjects, store: GenerationStore, info, mutate, tree=None) -> None:
    """Rewrite the current generation's index as ``mutate(doc)`` and re-sign its metadata and the pointer."""
    meta_key = info.archive.replace("archive.tar", "meta.json")
    index_key = info.archive.replace("archive.tar", "index")
    doc = json.loads(zlib.decompress(objects.objs[index_key][0]))
    mutate(doc)
    raw = zlib.compress(json.dumps(doc).encode())
    objects.objs[index_key] = (raw, "f1", 0)
    meta = json.loads(objects.objs[meta_key][0])
    meta.update(index_sha256=hashlib.sha256(raw).hexdigest(), index_bytes=len(raw))
    from sandbox_fs.snapshot._index import IndexEntry
    try:
        meta["tree_digest"] = index_digest([IndexEntry(*e) for e in doc["entries"]]) if tree is None else tree
    except (TypeError, UnicodeEncodeError):  # (not an index; a symlink target that is no file name)
        pass
    mraw = json.dumps(meta).encode()
    objects.objs[meta_key] = (mraw, "f2", 0)
    ptr = json.loads(objects.objs[f"{info.name}/current"][0])
    ptr["generations"][0]["meta_sha256"] = hashlib.sha256(mraw).hexdigest()
    objects.objs[f"{info.name}/current"] = (json.dumps(ptr).encode(), "f3", 0)


def _layered(env):
    ws, dst, w, d, objects, store = env
    persist(w, store, "s")
    _tick()
    (ws / "d" / "a.txt").write_text("layer\n")
    info = persist(w, store, "s").info
    assert info.chain_length == 2
    return info


def _rename_first_file(doc, name):
    for e in doc["entries"]:
        if e[1] == "file" and e[0] == "keep":
            e[0] = name


def _retarget_symlinks(doc, target):
    """Every symlink entry's target becomes ``target`` (a lone surrogate: a bare UnicodeEncodeError before)."""
    links = [e for e in doc["entries"] if e[1] == "symlink"]
    assert links
    for e in links:
        e[7] = target


@pytest.mark.parametrize("mutate", [
    pytest.param(lambda doc: _rename_first_file(doc, "../escape"), id="dotdot-entry"),
    pytest.param(lambda doc: _rename_first_file(doc, "/etc/passwd"), id="absolute-entry"),
    pytest.param(lambda doc: _rename_first_file(doc, "d/./x"), id="non-normalized-entry"),
    pytest.param(lambda doc: _rename_first_file(doc, "d//x"), id="double-slash-entry"),
    pytest.param(lambda doc: doc["deleted"].append("../../outside"), id="dotdot-deletion"),
    pytest.param(lambda doc: doc["deleted"].append("/abs"), id="absolute-deletion"),
    pytest.param(lambda doc: doc["deleted"].append("d/../keep"), id="non-normalized-deletion"),
    pytest.param(lambda doc: doc["deleted"].append("keep"), id="deletes-a-kept-path"),
    pytest.param(lambda doc: doc["entries"].append(["ln/x", "file", 1, 0, 0, 0, 0o644, "0" * 64, 1, 1]),
                 id="entry-below-a-symlink"),
    pytest.param(lambda doc: doc["entries"].append(list(doc["entries"][0])), id="duplicate"),
    pytest.param(lambda doc: doc["entries"][0].__setitem__(9, 99), id="layer-outside-the-chain"),
    pytest.param(lambda doc: doc["entries"][0].__setitem__(1, "fifo"), id="unknown-kind"),
    pytest.param(lambda doc: doc["entries"][0].__setitem__(2, -1), id="negative-inode"),
    pytest.param(lambda doc: doc.__setitem__("deleted", "keep"), id="deletion-list-not-a-list"),
    pytest.param(lambda doc: _retarget_symlinks(doc, "\ud800"), id="symlink-target-lone-surrogate"),
    pytest.param(lambda doc: _retarget_symlinks(doc, "d/\udc00"), id="symlink-target-low-surrogate"),
])
def test_forged_indexes_are_refused_before_the_workspace_changes(env, mutate):
    ws, dst, w, d, objects, store = env
    info = _layered(env)
    _forge(objects, store, info, mutate)
    (dst / "mine").write_text("before")
    with pytest.raises(SnapshotCorruptError):
        hydrate(d, store, "s")
    assert os.listdir(dst) == ["mine"]
    assert not (dst.parent / "escape").exists() and not (dst.parent / "outside").exists()


def test_deletion_list_and_entries_are_bounded_by_max_entries(env):
    ws, dst, w, d, objects, store = env
    info = _layered(env)
    _forge(objects, store, info, lambda doc: doc["deleted"].extend(f"gone{i}" for i in range(50)))
    with pytest.raises(SnapshotCorruptError):
        hydrate(d, store, "s", limits=SnapshotLimits(max_entries=40))
    assert os.listdir(dst) == []
    hydrate(d, store, "s")  # within the default limits the same list is fine (names nothing kept)


def test_an_index_not_matching_the_tree_digest_is_refused(env):
    ws, dst, w, d, objects, store = env
    info = _layered(env)
    _forge(objects, store, info, lambda doc: doc["entries"].pop(), tree=info.tree_digest)
    with pytest.raises(SnapshotCorruptError, match="tree digest"):
        hydrate(d, store, "s")


def test_a_member_the_index_does_not_name_is_never_restored(env):
    """A forged layer archive with an extra member: only what the index names comes out."""
    ws, dst, w, d, objects, store = env
    info = _layered(env)
    data = objects.objs[info.archive][0]
    buf = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(data)) as src, tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as out:
        for m in src.getmembers():
            out.addfile(m, src.extractfile(m) if m.isreg() else None)
        extra = tarfile.TarInfo("planted")
        extra.size = 4
        out.addfile(extra, io.BytesIO(b"evil"))
    forged = buf.getvalue()
    objects.objs[info.archive] = (forged, "x", 0)
    meta_key = info.archive.replace("archive.tar", "meta.json")
    meta = json.loads(objects.objs[meta_key][0])
    meta.update(archive_bytes=len(forged), archive_blake3=blake3.blake3(forged).hexdigest(),
                archive_crc32=f"{zlib.crc32(forged):08x}")
    mraw = json.dumps(meta).encode()
    objects.objs[meta_key] = (mraw, "y", 0)
    ptr = json.loads(objects.objs["s/current"][0])
    ptr["generations"][0]["meta_sha256"] = hashlib.sha256(mraw).hexdigest()
    objects.objs["s/current"] = (json.dumps(ptr).encode(), "z", 0)
    hydrate(d, store, "s")
    assert not (dst / "planted").exists() and (dst / "d" / "a.txt").read_text() == "layer\n"


def test_a_broken_chain_is_refused(env):
    ws, dst, w, d, objects, store = env
    info = _layered(env)
    base_meta = next(k for k in objects.objs if "/gen/000000000001-" in k and k.endswith("meta.json"))
    del objects.objs[base_meta]
    with pytest.raises(SnapshotCorruptError):
        hydrate(d, store, "s")
    assert os.listdir(dst) == []
    assert info.chain_length == 2


# ------------------------------------------------------------- what persist commits, hydrate restores


def _build(top: Path, tree: dict) -> None:
    for path, (kind, data, mode) in sorted(tree.items()):
        p = top / path
        if kind == "dir":
            p.mkdir(exist_ok=True)
        elif kind == "file":
            p.write_bytes(data)
            os.chmod(p, mode)
        else:
            p.symlink_to(data)
    for path, (kind, _d, mode) in sorted(tree.items(), reverse=True):
        if kind == "dir":
            os.chmod(top / path, mode)


def _wipe(top: Path) -> None:
    for dirpath, dirnames, _f in os.walk(top):
        for n in dirnames:
            os.chmod(Path(dirpath, n), 0o755)
    for p in list(top.iterdir()):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(trees=st.lists(_trees(), min_size=2, max_size=4), keep_some=st.booleans())
def test_property_layers_restore_what_persist_committed(trees, keep_some, tmp_path_factory):
    """Each persist of a changing tree (a layer over the last) hydrates back to exactly that tree."""
    base = tmp_path_factory.mktemp("layers")
    ws, dst = base / "ws", base / "dst"
    ws.mkdir()
    dst.mkdir()
    store = GenerationStore(DictObjects(), keep=len(trees))
    lengths: list[int] = []
    with open_root(ws) as w, open_root(dst) as d:
        for i, tree in enumerate(trees):
            if not (keep_some and i % 2):
                _wipe(ws)
            with pytest.MonkeyPatch.context():
                try:
                    _build(ws, tree)
                except (FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError):
                    pass  # a name of the kept tree in the way: persist whatever is there
            _tick()
            rep = persist(w, store, "p", on_unrestorable="skip")
            lengths.append(rep.info.chain_length)
            hydrate(d, store, "p")
            skipped = {p for p, _ in rep.skipped}
            assert _host_view(dst) == {k: v for k, v in _host_view(ws).items() if k not in skipped}
            assert tree_digest(d) == rep.info.tree_digest
        assert lengths[0] == 1 and lengths[1] == 2  # the second persist is always a layer
        assert store.kept("p") == list(range(len(trees), 0, -1))


# ------------------------------------------------------------- the command line


def test_cli_generations_ls_restore_and_gc(tmp_path, capsys):
    from sandbox_fs.cli import main

    ws, dst, store = tmp_path / "ws", tmp_path / "dst", tmp_path / "objects"
    (ws / "d").mkdir(parents=True)
    (ws / "d" / "f").write_text("one")
    (ws / "big").write_bytes(os.urandom(100_000))
    dst.mkdir()
    _tick()  # the files are strictly older than the first save's walk: none is racy at the second

    def run(*argv):
        rc = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        assert rc == 0, err
        return json.loads(out) if "--json" in argv else out

    first = run("snapshot", "save", "--workspace", ws, "--store", store, "--generations", "--name", "s", "--json")
    assert first["generation"] == 1 and first["chain_length"] == 1
    _tick()
    (ws / "d" / "f").write_text("two")
    second = run("snapshot", "save", "--workspace", ws, "--store", store, "--name", "s", "--json")  # recognized
    assert second["generation"] == 2 and second["chain_length"] == 2
    assert second["archive_bytes"] < first["archive_bytes"] // 5
    rows = run("snapshot", "ls", "--store", store, "--json")
    assert [(r["name"], r["generation"], r["chain_length"]) for r in rows] == [("s", 2, 2), ("s", 1, 1)]
    assert all(r["age_s"] is not None and r["age_s"] >= 0 for r in rows)
    got = run("snapshot", "restore", "--workspace", dst, "--store", store, "--name", "s", "--generation", "1",
              "--json")
    assert got["generation"] == 1 and (dst / "d" / "f").read_text() == "one"
    run("snapshot", "restore", "--workspace", dst, "--store", store, "--name", "s")
    assert (dst / "d" / "f").read_text() == "two"
    orphan = store / "s" / "gen" / "000000000009-00000000000000aa"
    orphan.mkdir(parents=True)
    (orphan / "archive.tar").write_bytes(b"left by a crash")
    os.utime(orphan / "archive.tar", (1, 1))
    assert run("snapshot", "gc", "--store", store, "--json") == {"action": "gc", "objects": 1, "bytes": 15,
                                                                 "uploads": 0, "holds": 0}
    assert not (orphan / "archive.tar").exists()
    assert run("snapshot", "gc", "--store", store, "--json")["objects"] == 0
