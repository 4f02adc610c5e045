"""Hostile-review attacks on a store directory whose entries another party planted (the review of 2026-12-03).

These attacks held when they were tried; they stay as cheap tests so they
keep holding.  Each checks an outside sentinel (a host file's content,
mode and link count), never only an exit code.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sandbox_fs import open_root
from sandbox_fs.snapshot import DirectorySnapshotStore, SnapshotError, SnapshotStoreError, hydrate, persist


def _state(p: Path) -> tuple[str, int, int]:
    st = os.stat(p)
    return hashlib.sha256(p.read_bytes()).hexdigest(), st.st_mode, st.st_size


def test_planted_hard_links_and_fifos_never_change_an_outside_file_or_hang(tmp_path: Path) -> None:
    """Hard links of a host file at keys persist replaces or deletes (the baseline, a hold), FIFOs at another
    name's pointer and at a hold: every store operation runs to its end (no open blocks) and the host file
    keeps its content and mode (a rename replaces the name, a delete unlinks only the name)."""
    sdir, w, outside = tmp_path / "store", tmp_path / "w", tmp_path / "outside"
    outside.mkdir()
    w.mkdir()
    sentinel = outside / "sentinel"
    sentinel.write_bytes(b"SENTINEL\n")
    (w / "f").write_text("one\n")
    with DirectorySnapshotStore(sdir) as st, open_root(w) as r:
        persist(r, st, "n")
    os.link(sentinel, sdir / "n" / "baseline")
    (sdir / "n" / "holds").mkdir()
    os.link(sentinel, sdir / "n" / "holds" / "y")
    os.mkfifo(sdir / "n" / "holds" / "x")
    (sdir / "v").mkdir()
    os.mkfifo(sdir / "v" / "current")
    before = _state(sentinel)
    hung = threading.Timer(60, lambda: os._exit(3))  # an open that blocks on a FIFO would hang the run
    hung.start()
    try:
        (w / "f").write_text("two\n")
        with DirectorySnapshotStore(sdir) as st, open_root(w) as r:
            for _ in range(3):  # the pointer prunes generations: deletes beside the planted names
                persist(r, st, "n")
            hydrate(r, st, "n")
            assert [i.name for i in st.list()] == ["n"]
            st.gc(older_than=900)
            with pytest.raises(SnapshotError):
                st.info("v")
            st.remove("n")
    finally:
        hung.cancel()
    assert _state(sentinel) == before  # the sentinel
    assert (w / "f").read_text() == "two\n"


def _sfs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sandbox_fs", *args], capture_output=True, text=True, timeout=120)


def test_cli_restore_never_replaces_a_store_that_lies_inside_the_workspace(tmp_path: Path) -> None:
    """``snapshot restore --workspace W --store W/.st`` replaced W's contents, the store with them (by the
    archive's copy of whatever the snapshot held there): the store's generations were gone.  Refused now in
    one line, the store and the workspace as they were."""
    v, w = tmp_path / "v", tmp_path / "w"
    v.mkdir()
    w.mkdir()
    (v / "f").write_text("from v\n")
    (w / "g").write_text("mine\n")
    assert _sfs("snapshot", "save", "--workspace", str(v), "--store", str(w / ".st"), "--name", "n").returncode == 0
    before = sorted(str(p.relative_to(w)) for p in w.rglob("*"))
    r = _sfs("snapshot", "restore", "--workspace", str(w), "--store", str(w / ".st"), "--name", "n")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "lies inside it" in r.stderr and str(tmp_path) not in r.stderr
    assert sorted(str(p.relative_to(w)) for p in w.rglob("*")) == before  # the sentinel: nothing moved
    with DirectorySnapshotStore(w / ".st") as st:
        assert [i.name for i in st.list()] == ["n"]


@pytest.mark.parametrize("where", ["same", "child", "deep", "moved_in", "sibling", "parent"])
def test_a_store_at_or_beneath_the_workspace_is_refused_before_anything_is_written(tmp_path: Path,
                                                                                 where: str) -> None:
    """persist and hydrate refuse a directory store whose directory is the workspace or lies beneath it
    (compared by identity: a store directory moved into the workspace after it was opened too), or holds
    it (the workspace's files would be store objects: ``test_attack_workspace_in_store``); a store beside
    it works."""
    w = tmp_path / "w"
    (w / "a" / "b").mkdir(parents=True)
    (w / "f").write_text("one\n")
    sdir = {"same": w, "child": w / ".st", "deep": w / "a" / "b" / "st", "moved_in": tmp_path / "st2",
            "sibling": tmp_path / "st", "parent": tmp_path}[where]
    refused = where in ("same", "child", "deep", "moved_in", "parent")
    with DirectorySnapshotStore(sdir) as store, open_root(w) as r:
        if where == "moved_in":
            os.rename(sdir, w / "a" / "st")  # the store's open directory now lies inside the workspace
            sdir = w / "a" / "st"
        if refused:
            with pytest.raises(SnapshotStoreError) as err:
                persist(r, store, "n")
            assert not err.value.retryable
            with pytest.raises(SnapshotStoreError):
                hydrate(r, store, "n")
        else:
            persist(r, store, "n")
            (w / "f").write_text("two\n")
            hydrate(r, store, "n")
            assert (w / "f").read_text() == "one\n"
    if refused:  # the sentinel: nothing of a snapshot or a key was written into the store
        assert not any(p.name in (".state-key", "gen", "current") for p in Path(sdir).rglob("*"))


@pytest.mark.parametrize("where", ["workspace", "grant", "beside"])
def test_cli_run_never_starts_a_command_beside_its_store(tmp_path: Path, where: str) -> None:
    """``run --root W --store W/.snap`` (or a store inside a ``--grant``, read-only too): the confined
    command could read the store's ``.state-key`` (and every snapshot in the store) and rewrite them.
    Refused before the command runs (in the workspace: before the manifest too); a store beside both works."""
    w, base, g = tmp_path / "w", tmp_path / "base", tmp_path / "g"
    for d in (w, base, g):
        d.mkdir()
    store = {"workspace": w / ".snap", "grant": g / "sub" / ".snap", "beside": tmp_path / "snap"}[where]
    (base / "m.json").write_text('{"entries": {"hello.txt": {"type": "file", "content": "hello\\n"}}}')
    r = _sfs("run", "--manifest", str(base / "m.json"), "--base", str(base), "--root", str(w), "--grant", str(g),
             "--store", str(store), "--state", str(tmp_path / "state.json"), "--confinement", "none", "--",
             "/bin/sh", "-c", "echo ran > ran")
    if where == "beside":
        assert r.returncode == 0, r.stderr
        assert (w / "ran").exists()  # positive control
        return
    assert r.returncode == 1 and "lies inside it" in r.stderr and "Traceback" not in r.stderr
    assert str(tmp_path) not in r.stderr
    assert not (w / "ran").exists()  # the sentinel: the command never ran
    if where == "workspace":
        assert not (w / "hello.txt").exists()  # refused before the manifest too
