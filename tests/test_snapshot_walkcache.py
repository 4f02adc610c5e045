"""Layered persist over a parent this store object walked: directories taken over whole or all but what changed.

The walk keeps, per directory, what its listing added (``Index.walk_cache``,
see :mod:`sandbox_fs.snapshot._layers`); the next layered persist takes an
unchanged directory over without decoding, opening or reading any entry of
it, and a directory whose names are the same takes over all but the
changed entries.  What it commits must be what a full walk sees (the tree
digest), what hydrate restores (the host view), and an index object that
is the very document ``encode_index`` writes.  A directory moved out of the
workspace while held still leaks nothing.
"""

from __future__ import annotations

import dataclasses
import io
import json
import mmap
import os
import subprocess
import sys
import tarfile
import time
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sandbox_fs import _native, open_root
from sandbox_fs.snapshot import (
    GenerationStore,
    SnapshotLimitError,
    SnapshotLimits,
    SnapshotSourceChangedError,
    hydrate,
    persist,
    tree_digest,
)
from sandbox_fs.snapshot import _entries, _layers, _walk
from sandbox_fs.snapshot._index import encode_index
from sandbox_fs.snapshot._objects_local import LocalObjects
from tests.test_snapshot import _host_view, _move_out_and_plant
from tests.test_snapshot_generations import DictObjects


def _tick() -> None:
    time.sleep(0.012)  # past the coarse clock's tick: what was written before is not racy


def _index_docs(objects: DictObjects) -> list[dict]:
    """The documents of every index object in the store, oldest generation first."""
    keys = sorted(k for k in objects.objs if k.endswith("/index"))
    return [json.loads(zlib.decompress(objects.objs[k][0])) for k in keys]


def _check_index(store: GenerationStore, objects: DictObjects, name: str = "s") -> None:
    """The newest index object is the document encode_index writes for the same index."""
    index = store._baselines[name].index  # the commit's own index, kept in memory for the next layer
    assert index is not None
    assert index.encoded is not None  # made by the walk, piece by piece
    plain = encode_index(dataclasses.replace(index, encoded=None, walk_cache=None))
    assert _index_docs(objects)[-1] == json.loads(zlib.decompress(plain))


@pytest.fixture
def tree(tmp_path):
    ws = tmp_path / "ws"
    for d in ("a/b", "c", "big"):
        (ws / d).mkdir(parents=True)
    for i in range(40):
        (ws / "big" / f"f{i:02d}").write_text(f"file {i}\n")
    (ws / "a" / "x.txt").write_text("x\n")
    (ws / "a" / "b" / "y.txt").write_text("y\n")
    os.chmod(ws / "a" / "b" / "y.txt", 0o444)  # restored as 0o644 but for its mode fix-up
    (ws / "c" / os.fsdecode(b"odd\xff\n\"name\\")).write_text("odd\n")
    (ws / "c" / "link").symlink_to("../a/x.txt")
    _tick()
    objects = DictObjects()
    store = GenerationStore(objects, keep=2)
    with open_root(ws) as w:
        yield ws, w, objects, store


def _members(objects: DictObjects, info) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(objects.objs[info.archive][0])) as tf:
        return [m.name for m in tf.getmembers()]


def _opened(monkeypatch) -> list[str]:
    """Record every entry the walk opens by its path."""
    seen: list[str] = []
    real = _walk._open_listed

    def recording(src, item, flags, dfd=None):
        seen.append(item.path)
        return real(src, item, flags, dfd)

    monkeypatch.setattr(_walk, "_open_listed", recording)
    return seen


def test_an_unchanged_tree_is_taken_over_directory_by_directory(tree, monkeypatch):
    ws, w, objects, store = tree
    persist(w, store, "s")
    _tick()
    opened = _opened(monkeypatch)
    decoded = []
    real_parse = _walk.parse_scan
    monkeypatch.setattr(_walk, "parse_scan", lambda raw: decoded.append(1) or real_parse(raw))
    searched = []  # listings searched for a repeated name (each is byte for byte one the last walk checked)
    real_records = _walk._scan_records
    monkeypatch.setattr(_walk, "_scan_records", lambda raw: searched.append(1) or real_records(raw))
    info = persist(w, store, "s").info
    monkeypatch.undo()
    # only directories are opened (to be entered, by path, identity-checked), and the symlink: a symlink
    # is always written again (whether it restores depends on other entries), so "c" is walked entry by
    # entry; no other listing is decoded
    assert sorted(opened) == ["a", "a/b", "big", "c", "c/link"] and len(decoded) == 1 and not searched
    assert info.chain_length == 2 and info.deleted == 0
    assert _members(objects, info) == ["c/link"]
    assert info.tree_digest == tree_digest(w)
    _check_index(store, objects)


def test_an_unchanged_tree_takes_the_parent_walks_digest_state(tree, monkeypatch):
    """Every directory taken over whole, at the parent walk's place: no digest record is hashed again, and
    the digest is still a full walk's; a change in the last directory walked is hashed after the others."""
    ws, w, objects, store = tree
    (ws / "c" / "link").unlink()  # (a symlink is always written again: its directory is never taken whole)
    _tick()
    persist(w, store, "s")
    _tick()
    hashed: list[bytes] = []
    real = _entries._Digest.add_records
    monkeypatch.setattr(_entries._Digest, "add_records", lambda self, recs: hashed.append(recs) or real(self, recs))
    for _ in range(2):
        info = persist(w, store, "s").info
        assert hashed == [] and info.tree_digest == tree_digest(w)
        assert objects.objs[info.archive][0] == bytes(10240) and _members(objects, info) == []  # the end record
        _check_index(store, objects)
        _tick()
    odd = ws / "c" / os.fsdecode(b"odd\xff\n\"name\\")  # "c": the last directory in walk order
    odd.write_text("odd, changed\n")
    info = persist(w, store, "s").info
    assert len(hashed) == 4 and info.tree_digest == tree_digest(w)  # "", "a", "a/b", "big"; then "c" itself
    _tick()
    info = persist(w, store, "s").info  # the jump again, to the state the walk before it left
    assert len(hashed) == 4 and info.tree_digest == tree_digest(w)
    _check_index(store, objects)


def test_a_changed_file_is_the_only_entry_walked_in_its_directory(tree, monkeypatch):
    ws, w, objects, store = tree
    persist(w, store, "s")
    _tick()
    persist(w, store, "s")
    _tick()
    (ws / "big" / "f17").write_text("file 17, changed\n")
    os.chmod(ws / "big" / "f03", 0o700)
    opened = _opened(monkeypatch)
    searched = []  # listings searched for a repeated name: "big" holds the recorded names in their places
    real_records = _walk._scan_records
    monkeypatch.setattr(_walk, "_scan_records", lambda raw: searched.append(1) or real_records(raw))
    info = persist(w, store, "s").info
    monkeypatch.undo()
    assert sorted(opened) == ["a", "a/b", "big", "big/f03", "big/f17", "c", "c/link"] and not searched
    assert info.tree_digest == tree_digest(w)
    assert info.mode_fixups == [("a/b/y.txt", 0o444)]  # taken over with the rest; f03's 0o700 needs none
    _check_index(store, objects)
    _tick()
    (ws / "big" / "f17").unlink()  # another name set: the directory is walked entry by entry
    (ws / "big" / "new").write_text("new\n")
    info = persist(w, store, "s").info
    assert info.deleted == 1 and info.tree_digest == tree_digest(w)
    _check_index(store, objects)
    out = ws.parent / "out"
    out.mkdir()
    with open_root(out) as o:
        hydrate(o, store, "s")
    assert _host_view(out) == _host_view(ws)


@pytest.mark.parametrize("local", [True, False])
def test_a_local_store_keeps_the_index_in_stored_blocks(tree, tmp_path, local):
    """Into a local directory the walk's index segments are stored blocks; into another store, deflated.

    Either way the object is the document ``encode_index`` writes, and hydrate restores through it.
    """
    ws, w, objects, store = tree
    if local:
        objects = LocalObjects(tmp_path / "store")
        store = GenerationStore(objects, keep=2)
    persist(w, store, "s")
    _tick()
    (ws / "big" / "f17").write_text("file 17, changed\n")  # a layer: a changed segment re-encoded
    persist(w, store, "s")
    keys = sorted(o.key for o in objects.list("s/") if o.key.endswith("/index"))
    assert len(keys) == 2
    for key in keys:
        raw = objects.get_bytes(key, 1 << 24)
        text = zlib.decompress(raw)
        # stored blocks keep every byte of the text (and a few more); deflate shrinks it (hex digests, names)
        assert (len(raw) > len(text)) == local
    index = store._baselines["s"].index
    assert zlib.decompress(objects.get_bytes(keys[-1], 1 << 24)) == \
        zlib.decompress(encode_index(dataclasses.replace(index, encoded=None, walk_cache=None)))
    out = tmp_path / "out"
    out.mkdir()
    with open_root(out) as o:
        hydrate(o, store, "s")
    assert _host_view(out) == _host_view(ws)


@given(st.binary(max_size=200_000))
@settings(max_examples=25, deadline=None)
def test_property_stored_pieces_decode_to_their_text(text):
    """A stored piece (one block per 64 KiB) between pieces of any kind decodes to its text in a zlib stream."""
    head, end = _layers._deflate_piece(b"[head]"), _layers._deflate_piece(b"[end]")
    body = _layers._stored_piece(text)
    raw = _layers._ZLIB_HEADER + head + body + end + _layers._FINAL_BLOCK + \
        zlib.adler32(b"[head]" + text + b"[end]").to_bytes(4, "big")
    assert zlib.decompress(raw) == b"[head]" + text + b"[end]"


@pytest.mark.parametrize("later_s", [0, 1, 3])
def test_a_chunks_racy_positions_are_the_entries_changed_at_or_after_the_walks_start(tree, monkeypatch, later_s):
    """Whether the walk begins in the tick the tree was written or seconds later (no entry can be racy: the
    positions are not searched one by one), each chunk's racy positions are exactly those the racy rule names."""
    from sandbox_fs.snapshot._index import coarse_now_ns, stamp_latest_ns

    ws, w, objects, store = tree
    newest = max(os.lstat(p).st_ctime_ns for p in [ws, *ws.rglob("*")])
    began = newest + later_s * 10**9 if later_s else coarse_now_ns()
    monkeypatch.setattr(_layers, "coarse_now_ns", lambda: began)
    persist(w, store, "s")
    for c in store._baselines["s"].index.walk_cache.order:
        if c.plain:
            assert c.racy == [k for k, e in enumerate(c.entries)
                              if e.mtime_ns >= began or stamp_latest_ns(e.ctime_ns) >= began]
    if later_s == 3:
        assert all(not c.racy for c in store._baselines["s"].index.walk_cache.order)


def test_a_tree_past_the_cache_bound_is_compared_entry_by_entry(tree, monkeypatch):
    ws, w, objects, store = tree
    monkeypatch.setattr(_layers, "_CACHE_MAX_ENTRIES", 3)
    persist(w, store, "s")
    assert store._baselines["s"].index.walk_cache is None
    _tick()
    (ws / "big" / "f05").write_text("changed\n")
    opened = _opened(monkeypatch)
    info = persist(w, store, "s").info
    # unchanged files still not read (a directory is opened twice: checked when listed, then entered)
    assert sorted(set(opened)) == ["a", "a/b", "big", "big/f05", "c", "c/link"]
    assert info.tree_digest == tree_digest(w)


def test_limits_hold_for_directories_taken_over(tree):
    ws, w, _objects, store = tree
    n = persist(w, store, "s").info.entries
    _tick()
    (ws / "0-new").write_text("walked before every directory below the top\n")
    (ws / "1-new").write_text("and this one\n")
    with pytest.raises(SnapshotLimitError):
        persist(w, store, "s", limits=SnapshotLimits(max_entries=n + 1))


@pytest.mark.parametrize("change", [False, True])
def test_a_directory_moved_out_after_its_listing_leaks_nothing(tree, tmp_path, monkeypatch, change):
    """``a`` is taken over (whole, or all but a changed file), then moved out and filled: nothing of it is read."""
    ws, w, objects, store = tree
    persist(w, store, "s")
    _tick()
    if change:
        (ws / "a" / "x.txt").write_text("changed\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = "OUTSIDE-" + os.urandom(8).hex()
    a_ino = os.stat(ws / "a").st_ino
    real = _walk._list_dir
    moved = []

    def racing(dfd):
        out = real(dfd)
        if os.fstat(dfd).st_ino == a_ino and not moved:
            _move_out_and_plant(ws / "a", outside / "a", secret)
            (outside / "a" / "b" / "y.txt").write_text(secret)
            moved.append(1)
        return out

    monkeypatch.setattr(_walk, "_list_dir", racing)
    before = store.info("s")
    with pytest.raises(SnapshotSourceChangedError) as ei:
        persist(w, store, "s")
    assert moved and ei.value.retryable and store.info("s") == before
    assert secret.encode() not in b"".join(v[0] for v in objects.objs.values())


# ------------------------------------------------------------------ property

_DIRS = ["", "d", "d/e", "f"]
_NAMES = ["n0", "n1", os.fsdecode(b"n\xff"), "n 3"]
_OP = st.tuples(st.sampled_from(["write", "append", "unlink", "chmod", "mkdir", "rmtree", "symlink", "link",
                                 "rename", "utime", "tick"]),
                st.sampled_from(_DIRS), st.sampled_from(_NAMES), st.integers(0, 7))


def _apply(ws: Path, op: str, d: str, name: str, n: int) -> None:
    here = ws / d if d else ws
    p = here / name
    try:
        if op == "tick":
            _tick()
        elif op == "write":
            p.write_bytes(b"v" * n)
        elif op == "append":
            with open(p, "ab") as f:
                f.write(b"+")
        elif op == "unlink":
            p.unlink()
        elif op == "chmod" and not p.is_symlink():
            os.chmod(p, 0o600 | (n << 6) & 0o700)
        elif op == "mkdir":
            here.mkdir(parents=True, exist_ok=True)
        elif op == "rmtree":
            import shutil
            shutil.rmtree(here) if d else None
        elif op == "symlink":
            p.symlink_to(_NAMES[n % len(_NAMES)])
        elif op == "link":
            os.link(ws / "root-file", p)
        elif op == "rename":
            os.rename(p, here / _NAMES[n % len(_NAMES)])
        elif op == "utime":
            st_ = os.stat(p, follow_symlinks=False)
            os.utime(p, ns=(st_.st_atime_ns, st_.st_mtime_ns - 10**9 * n), follow_symlinks=False)
    except (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, OSError):
        pass


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.lists(_OP, max_size=5), min_size=1, max_size=5))
def test_property_what_a_layered_persist_commits_is_the_tree(tmp_path_factory, steps):
    """Whatever changes between persists (contents, modes, names, links, times put back): each layer's tree
    digest is a full walk's, its index object is encode_index's document, and hydrate restores the tree."""
    base = tmp_path_factory.mktemp("walkcache")
    ws = base / "ws"
    for d in _DIRS[1:]:
        (ws / d).mkdir(parents=True, exist_ok=True)
    for d in _DIRS:
        for name in _NAMES[:2]:
            ((ws / d) if d else ws).joinpath(name).write_text(f"{d}/{name}\n")
    (ws / "root-file").write_text("linked\n")
    objects = DictObjects()
    store = GenerationStore(objects, keep=2)
    with open_root(ws) as w:
        persist(w, store, "s", on_unrestorable="skip")
        skipped: list[tuple[str, str]] = []
        for batch in steps:
            for op in batch:
                _apply(ws, *op)
            rep = persist(w, store, "s", on_unrestorable="skip")
            assert rep.info.tree_digest == tree_digest(w)
            _check_index(store, objects)
            skipped = rep.skipped
        out = base / "out"
        out.mkdir()
        with open_root(out) as o:
            hydrate(o, store, "s")
    left_out = {p for p, _why in skipped}  # a symlink naming itself, or one escaping: never persisted
    assert _host_view(out) == {k: v for k, v in _host_view(ws).items() if k not in left_out}


def _mapped(path: Path) -> tuple[int, mmap.mmap]:
    fd = os.open(path, os.O_RDWR)
    return fd, mmap.mmap(fd, os.fstat(fd).st_size)


def test_a_file_written_through_a_shared_mapping_is_read_again(tree):
    """A write through a mapping whose page is already dirty keeps mtime and ctime: never taken over stale."""
    ws, w, objects, store = tree
    f = ws / "big" / "f05"
    fd, m = _mapped(f)
    try:
        m[0:1] = b"F"  # dirties the page (mtime and ctime set now)
        _tick()
        persist(w, store, "s")
        _tick()
        ctime = f.stat().st_ctime_ns
        m[1:2] = b"I"  # the same dirty page: on ext4 and tmpfs no timestamp changes
        assert f.read_bytes().startswith(b"FIle")
        info = persist(w, store, "s").info
        assert info.tree_digest == tree_digest(w), f"stale content committed (ctime kept: {f.stat().st_ctime_ns == ctime})"
    finally:
        m.close()
        os.close(fd)
    # once no one can write it, it is read once more (its content is the last layer's: not written again)
    # and then taken over like any file
    _tick()
    reads = []
    real = os.readv
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "readv", lambda rfd, bufs: reads.append(rfd) or real(rfd, bufs))
        persist(w, store, "s")
    assert reads
    _tick()
    assert _members(objects, persist(w, store, "s").info) == ["c/link"]
    out = ws.parent / "out"
    out.mkdir()
    with open_root(out) as o:
        hydrate(o, store, "s")
    assert (out / "big" / "f05").read_bytes() == f.read_bytes()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["map", "write", "utime", "chmod", "persist"]), st.integers(0, 3)),
                    min_size=1, max_size=8))
@example(ops=[("map", 0), ("persist", 0), ("map", 2), ("persist", 0)])  # f0 twice, through one mapping
def test_property_persist_never_commits_stale_content(tmp_path_factory, ops):
    """Writes through a long-lived shared mapping, same-size writes, mtimes set back, ctime-only changes: each persist commits the live tree."""
    base = tmp_path_factory.mktemp("mm")
    ws = base / "ws"
    (ws / "d").mkdir(parents=True)
    files = [ws / "d" / f"f{i}" for i in range(2)]
    for f in files:
        f.write_bytes(b"0" * 8)
    maps = [_mapped(f) for f in files]
    store = GenerationStore(DictObjects(), keep=2)
    try:
        with open_root(ws) as w:
            for n, (op, i) in enumerate(ops + [("persist", 0)]):
                f, (_fd, m) = files[i % 2], maps[i % 2]
                if op == "map":
                    m[i:i + 1] = b"%d" % (n % 10)
                elif op == "write":
                    old = f.stat()
                    f.write_bytes(b"%d" % (n % 10) * 8)
                    os.utime(f, ns=(old.st_atime_ns, old.st_mtime_ns))
                elif op == "utime":
                    os.utime(f, ns=(0, 0))
                elif op == "chmod":  # only the ctime moves (as a re-own does): compared by content
                    mode = f.stat().st_mode
                    os.chmod(f, 0o600)
                    os.chmod(f, mode)
                else:
                    _tick()
                    assert persist(w, store, "s").info.tree_digest == tree_digest(w)
                    _tick()
    finally:
        for fd, m in maps:
            m.close()
            os.close(fd)


_BREAK_SCRIPT = """
import fcntl, os, sys, threading, time
from sandbox_fs.snapshot import _entries
path = sys.argv[1]
real = _entries._FCNTL
def breaking(fd, cmd, arg):
    out = real(fd, cmd, arg)
    if cmd == fcntl.F_SETLEASE and arg == fcntl.F_RDLCK:  # a writer opens the file while the lease is held
        threading.Thread(target=lambda: os.close(os.open(path, os.O_WRONLY)), daemon=True).start()
        time.sleep(0.2)
    return out
_entries._FCNTL = breaking
fd = os.open(path, os.O_RDONLY)
_entries._open_for_writing(fd)
print("alive")
"""


def test_a_writer_breaking_the_probe_lease_never_kills_the_persisting_process(tmp_path):
    """The lease probe's break signal (SIGIO by default: terminate) is one whose default is to ignore it."""
    f = tmp_path / "f"
    f.write_bytes(b"x")
    out = subprocess.run([sys.executable, "-c", _BREAK_SCRIPT, str(f)], capture_output=True, text=True, timeout=30)
    assert (out.returncode, out.stdout.strip()) == (0, "alive"), out.stderr


def _chunk_of(dfd: int) -> _layers._Chunk:
    """A plain chunk of the directory open on ``dfd`` as a walk records it (names in walk order, scan records)."""
    listing = _walk._Listing(_native.scan_dir(dfd))
    recs = listing.records()
    names = [os.fsencode(n) for n, _st in listing]
    return _layers._Chunk(listing.raw, [], [], [], 0, [], True, names=names, recs=[recs[n] for n in names],
                          offs=listing.offsets())


_CHANGE = st.tuples(st.sampled_from(["append", "chmod", "utime", "rename-same-length", "replace-by-dir", "add",
                                     "remove"]), st.integers(0, 63))


@settings(max_examples=40, deadline=None)
@given(count=st.integers(1, 40), changes=st.lists(_CHANGE, max_size=6))
def test_property_changes_found_in_place_are_the_changes_found_by_name(tmp_path_factory, count, changes):
    """The halving search over a listing laid out as the recorded one finds exactly the entries whose
    record differs (or gives up: None); it never misses one (a missed one would be taken over unread)."""
    top = tmp_path_factory.mktemp("diff")
    names = [f"f{i:03d}" for i in range(count)]
    for n in names:
        (top / n).write_text(n)
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        old = _chunk_of(fd)
        for op, i in changes:
            p = top / names[i % count]
            try:
                if op == "append":
                    with open(p, "a") as f:
                        f.write("+")
                elif op == "chmod":
                    os.chmod(p, 0o600 | (i & 0o77))
                elif op == "utime":
                    os.utime(p, ns=(i, i * 10**9))
                elif op == "rename-same-length":
                    os.rename(p, top / ("g" + p.name[1:]))
                elif op == "replace-by-dir":
                    p.unlink()
                    p.mkdir()
                elif op == "add":
                    (top / f"n{i:03d}").write_text("new")
                else:
                    p.unlink()
            except OSError:
                pass
        raw = _native.scan_dir(fd)
        in_place = _layers._diff_in_place(old, raw, False)
        by_name = _layers._diff_by_name(old, _walk._Listing(raw), "x")
        if in_place is not None:  # (None: another layout; the names decide, see _diff_by_name)
            assert in_place == by_name
        if all(op in ("append", "chmod", "utime") for op, _i in changes):
            assert in_place == by_name and by_name is not None  # same names, same place: never given up
    finally:
        os.close(fd)
