"""Hostile-review attacks on forks, holds, baselines and the generation pointer (the review of 2026-12-02).

Each test plays one hostile party (a misbehaving store, a second client
racing this one) against throw-away directories and checks an outside
sentinel: what a fork or a source must still restore, or that nothing
outside the store changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandbox_fs import open_root
from sandbox_fs.snapshot import (
    GenerationStore,
    LocalObjects,
    hydrate,
    persist,
)


def _persist(store: GenerationStore, name: str, ws_dir: Path, content: bytes) -> None:
    ws_dir.mkdir(exist_ok=True)
    (ws_dir / "f").write_bytes(content)
    with open_root(ws_dir) as ws:
        persist(ws, store, name)


class _Hooked(LocalObjects):
    """LocalObjects that runs ``hook`` once, the first time ``head(key)`` is called after arming."""

    key = ""
    hook: Any = None

    def head(self, key: str) -> Any:
        got = super().head(key)
        if key == self.key and self.hook is not None:
            hook, self.hook = self.hook, None
            hook()
        return got


# ------------------------------------------------------------- gc racing a fork onto a stale holder's name
def test_gc_never_removes_a_hold_a_fork_wrote_after_gc_read_the_stale_one(tmp_path: Path) -> None:
    """gc shrinks a stale hold to nothing; meanwhile another gc removed it and a fork of that name wrote its own.

    The stale hold's removal must be conditional on the very hold gc read
    (and a new fork's hold must never look like the old one), or the fork's
    shared generation loses its hold and the source's pruning deletes it.
    """
    objects = _Hooked(tmp_path / "objects")
    store = GenerationStore(objects, keep=1)
    with store, open_root(tmp_path / "out", create=True) as out:
        _persist(store, "src", tmp_path / "ws", b"shared")
        store.fork("src", "f")
        objects.delete("f/current")  # f went away without releasing its hold (a crash): the hold is stale

        def other_gc_then_fork() -> None:
            objects.delete("src/holds/f")  # a second gc removed the stale hold first
            store.fork("src", "f")  # a new fork of that name: its hold, then its pointer

        objects.key, objects.hook = "f/current", other_gc_then_fork
        store.gc(now=time.time() + 7200)  # reads the stale hold, then f's (not yet re-made) pointer
        assert objects.head("src/holds/f") is not None
        time.sleep(0.025)
        for i in range(2):  # a layer (as large as its base), then a full one: with keep=1, 1 and 2 are dropped
            _persist(store, "src", tmp_path / "ws", b"moved on %d" % i)
            time.sleep(0.025)
        hydrate(out, store, "f")
        assert (tmp_path / "out" / "f").read_bytes() == b"shared"  # the sentinel: the fork still restores


_DIRS = [f"{g:012d}-{g:016x}" for g in range(1, 6)]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dirs=st.lists(st.sampled_from(_DIRS), min_size=1, unique=True),
       shrunk=st.lists(st.sampled_from(_DIRS), unique=True))
def test_property_a_hold_changes_only_under_the_etag_it_had(tmp_path: Path, dirs: list[str],
                                                            shrunk: list[str]) -> None:
    """Rewritten with the very same directories, a hold gets a new etag; a write (or removal) under an old one fails."""
    from sandbox_fs.snapshot import SnapshotConflictError
    from sandbox_fs.snapshot._holds import held_dirs, write_hold

    with LocalObjects(tmp_path / os.urandom(8).hex()) as objects:
        write_hold(objects, "src", "f", set(dirs))
        first = objects.head("src/holds/f")
        write_hold(objects, "src", "f", set(dirs))  # removed and written again by a new fork of that name
        second = objects.head("src/holds/f")
        assert first is not None and second is not None and first.etag != second.etag
        with pytest.raises(SnapshotConflictError):
            write_hold(objects, "src", "f", set(shrunk), if_match=first.etag)
        assert held_dirs(objects, "src") == frozenset(dirs)
        write_hold(objects, "src", "f", set(shrunk), if_match=second.etag)
        assert held_dirs(objects, "src") == frozenset(shrunk)
        assert (objects.head("src/holds/f") is None) == (not shrunk)  # shrunk to nothing: gone, no tombstone left


# ------------------------------------------------------------- a store at the largest generation number
_MAX_GEN = 1 << 62  # the largest generation a pointer entry holds


def _forge_generation(store_dir: Path, name: str, generation: int) -> None:
    """Rewrite ``name``'s only generation as ``generation`` (directory, metadata, pointer), every digest recomputed."""
    ptr = json.loads((store_dir / name / "current").read_bytes())
    (entry,) = ptr["generations"]
    new_dir = f"{generation:012d}-{entry['dir'].split('-')[1]}"
    os.rename(store_dir / name / "gen" / entry["dir"], store_dir / name / "gen" / new_dir)
    meta_path = store_dir / name / "gen" / new_dir / "meta.json"
    meta = json.loads(meta_path.read_bytes())
    meta.update(generation=generation, archive=f"{name}/gen/{new_dir}/archive.tar", index_sha256="", index_bytes=0)
    raw = json.dumps(meta).encode()
    meta_path.write_bytes(raw)
    entry.update(generation=generation, dir=new_dir, meta_sha256=hashlib.sha256(raw).hexdigest())
    (store_dir / name / "current").write_text(json.dumps(ptr))


def _objects_below(store_dir: Path) -> set[str]:
    return {str(p.relative_to(store_dir)) for p in store_dir.rglob("*") if p.is_file() and p.name not in (".lock", ".state-key")}


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(below=st.sampled_from([0, 1, 2]), v1=st.booleans())
def test_property_a_forged_generation_at_the_limit_is_refused_before_any_upload(tmp_path: Path, below: int,
                                                                                  v1: bool) -> None:
    """A pointer (or a version-1 snapshot) at or near the largest generation: the next persist commits, or is
    refused as corrupt before anything is uploaded; never an error outside SnapshotError (an internal error at the CLI)."""
    from sandbox_fs.snapshot import DirectorySnapshotStore, LocalSnapshotStore, SnapshotCorruptError

    base = tmp_path / os.urandom(8).hex()
    ws_dir, store_dir = base / "ws", base / "store"
    ws_dir.mkdir(parents=True)
    (ws_dir / "f").write_bytes(b"x")
    generation = _MAX_GEN - below
    with open_root(ws_dir) as ws:
        if v1:
            with LocalSnapshotStore(store_dir) as legacy:
                persist(ws, legacy, "n")
            meta = json.loads((store_dir / "n.json").read_bytes())
            meta["generation"] = generation + 1  # a version-1 snapshot may record any number
            (store_dir / "n.json").write_text(json.dumps(meta))
            generation += 1
        else:
            with DirectorySnapshotStore(store_dir) as store:
                persist(ws, store, "n")
            _forge_generation(store_dir, "n", generation)
        before = _objects_below(store_dir)
        with DirectorySnapshotStore(store_dir) as store:
            if generation + 1 <= _MAX_GEN:
                assert persist(ws, store, "n").info.generation == generation + 1
                return
            with pytest.raises(SnapshotCorruptError, match="largest"):
                persist(ws, store, "n")
    assert _objects_below(store_dir) == before  # the sentinel: nothing uploaded, nothing left behind


def test_cli_save_onto_a_forged_generation_at_the_limit_is_one_line(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from sandbox_fs.cli import main

    ws_dir, store_dir = tmp_path / "ws", tmp_path / "store"
    ws_dir.mkdir()
    (ws_dir / "f").write_bytes(b"x")
    save = ["snapshot", "save", "--store", str(store_dir), "--workspace", str(ws_dir), "--name", "n"]
    assert main(save) == 0
    _forge_generation(store_dir, "n", _MAX_GEN)
    capsys.readouterr()
    rc = main(save)
    err = capsys.readouterr().err
    assert rc not in (0, 70) and len(err.strip().splitlines()) == 1 and "snapshot_corrupt" in err, err
    assert str(tmp_path) not in err and "Traceback" not in err


# ------------------------------------------------------------- the command line: an empty host path
def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    from sandbox_fs.cli import main

    try:
        rc = main(list(argv))
    except SystemExit as exc:  # usage errors
        rc = exc.code if isinstance(exc.code, int) else 2
    return rc, capsys.readouterr().err


def _listing(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): (p.read_bytes() if p.is_file() else b"") for p in sorted(d.rglob("*"))}


def test_cli_restore_with_an_empty_workspace_never_replaces_the_current_directory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``--workspace ""`` (an unset variable) was made the current directory by ``abspath`` and restored over."""
    ws, cwd = tmp_path / "ws", tmp_path / "cwd"
    ws.mkdir()
    cwd.mkdir()
    (ws / "a").write_text("snap")
    (cwd / "precious.txt").write_text("outside")
    store = str(tmp_path / "store")
    assert _cli(capsys, "snapshot", "save", "--store", store, "--workspace", str(ws), "--name", "n")[0] == 0
    monkeypatch.chdir(cwd)
    rc, err = _cli(capsys, "snapshot", "restore", "--store", store, "--name", "n", "--workspace", "")
    assert rc not in (0, 70) and len(err.strip().splitlines()) == 1 and "empty" in err, err
    assert _listing(cwd) == {"precious.txt": b"outside"}  # the sentinel


_EMPTY_PATH_CASES = [
    ["snapshot", "ls", "--store", ""],
    ["snapshot", "gc", "--store", ""],
    ["snapshot", "save", "--store", "", "--workspace", "{ws}", "--name", "n"],
    ["snapshot", "save", "--store", "{store}", "--workspace", "", "--name", "n"],
    ["snapshot", "restore", "--store", "", "--name", "n", "--workspace", "{ws}"],
    ["session", "create", "--workspaces-dir", "", "--store", "{store}", "--state", "{tmp}/s.json"],
    ["session", "create", "--workspaces-dir", "{tmp}/wsd", "--store", "", "--state", "{tmp}/s.json"],
    ["session", "create", "--workspaces-dir", "{tmp}/wsd", "--store", "{store}", "--root", "",
     "--state", "{tmp}/s.json"],
    ["session", "fork", "--workspaces-dir", "{tmp}/wsd", "--store", "{store}", "--state", "",
     "--state-out", "{tmp}/f.json"],
    ["session", "fork", "--workspaces-dir", "{tmp}/wsd", "--store", "{store}", "--state", "{tmp}/s.json",
     "--state-out", ""],
    ["extract", "{tmp}/a.tar", "--into", ""],
]


@pytest.mark.parametrize("follow", [False, True])
def test_property_no_host_path_option_takes_the_empty_string_as_the_current_directory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, follow: bool) -> None:
    """Every host-path option of the snapshot, session and extract commands, given "": one line, the cwd untouched."""
    ws, cwd = tmp_path / "ws", tmp_path / "cwd"
    ws.mkdir()
    cwd.mkdir()
    (ws / "a").write_text("snap")
    (cwd / "precious.txt").write_text("outside")
    fill = {"ws": str(ws), "store": str(tmp_path / "store"), "tmp": str(tmp_path)}
    monkeypatch.chdir(cwd)
    for case in _EMPTY_PATH_CASES:
        argv = [a.format(**fill) for a in case] + (["--follow-host-symlinks"] if follow else [])
        rc, err = _cli(capsys, *argv)
        assert rc not in (0, 70) and len(err.strip().splitlines()) == 1 and str(tmp_path) not in err, (argv, err)
        assert "Traceback" not in err
        assert _listing(cwd) == {"precious.txt": b"outside"}, argv  # the sentinel


# ------------------------------------------------------------- held: attacks that found the mechanism sound
def test_a_forged_fork_pointer_and_hold_never_delete_or_expose_another_names_objects(tmp_path: Path) -> None:
    """The store forges B's pointer to list victim V's generation (origin V) and a hold on V by a holder that
    does not exist: B's persist, B's removal and gc only ever drop what V's pointer no longer keeps."""
    store = GenerationStore(LocalObjects(tmp_path / "objects"), keep=1)
    with store, open_root(tmp_path / "out", create=True) as out:
        _persist(store, "V", tmp_path / "v", b"victim")
        v_ptr = json.loads(store.objects.get_bytes("V/current", 1 << 20))
        forged = dict(v_ptr, version=2, name="B",
                      generations=[dict(e, origin="V") for e in v_ptr["generations"]])
        store.objects.put_bytes("B/current", json.dumps(forged).encode())
        from sandbox_fs.snapshot._holds import write_hold

        write_hold(store.objects, "V", "evil", {e["dir"] for e in v_ptr["generations"]})
        _persist(store, "B", tmp_path / "b", b"mine")  # a layer over the forged entry: B writes only under B
        store.remove("B")
        store.gc(now=time.time() + 7200)
        hydrate(out, store, "V", digest=store.info("V").digest)  # type: ignore[union-attr]
        assert (tmp_path / "out" / "f").read_bytes() == b"victim"  # the sentinel
        assert store.objects.head("V/holds/evil") is None  # the forged hold went with gc
        assert all(not k.key.startswith("B/") for k in store.objects.list(""))


def test_a_replayed_genuine_baseline_never_makes_persist_skip_a_changed_file(tmp_path: Path) -> None:
    """Two genuine baselines (valid MAC, the current generation's digest): one from a restore over the workspace
    itself, one from a restore into another directory; the store replays each after the workspace changed a
    file keeping its size and mtime.  The next persist (a new process) still records the change."""
    import shutil

    from sandbox_fs.snapshot import DirectorySnapshotStore

    sdir, w, other = tmp_path / "store", tmp_path / "w", tmp_path / "other"
    w.mkdir()
    other.mkdir()
    (w / "f").write_text("one\n")
    with DirectorySnapshotStore(sdir) as st, open_root(w) as r:
        persist(r, st, "n")
    copies = []
    for target in (w, other):  # each restore leaves its own baseline in the store
        time.sleep(0.025)
        with DirectorySnapshotStore(sdir) as st, open_root(target) as r:
            hydrate(r, st, "n")
        copies.append(tmp_path / f"store-{len(copies)}")
        shutil.copytree(sdir, copies[-1])
    time.sleep(0.025)
    before = os.lstat(w / "f")
    (w / "f").write_text("TWO\n")
    os.utime(w / "f", ns=(before.st_atime_ns, before.st_mtime_ns))
    for i, copy in enumerate(copies):
        out = tmp_path / f"out-{i}"
        with DirectorySnapshotStore(copy) as st, open_root(w) as r, open_root(out, create=True) as o:
            persist(r, st, "n")
            hydrate(o, st, "n")
        assert (out / "f").read_text() == "TWO\n"  # the sentinel
