"""A directory the confined command removes while persist walks it: retryable, never a bare OSError.

A hostile command can empty and ``rmdir`` a directory between the walk's
open of it and its listing: ``getdents64`` on the still-open fd then fails
with ENOENT.  That is a source change like a directory swapped or moved
(:class:`SnapshotSourceChangedError`, retryable, naming the directory), not
a ``FileNotFoundError`` a host would take for a fault of its own.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sandbox_fs.snapshot as snap
from sandbox_fs import open_root
from sandbox_fs.snapshot import LocalSnapshotStore, SnapshotSourceChangedError, persist, tree_digest


def _remove_at_listing(monkeypatch, victim: Path) -> list[int]:
    """Empty and remove ``victim`` right before the walk lists it (its fd is open then)."""
    ident = (os.stat(victim).st_dev, os.stat(victim).st_ino)
    real = snap._walk._list_dir
    hits: list[int] = []

    def racing(dfd):
        st_ = os.fstat(dfd)
        if (st_.st_dev, st_.st_ino) == ident and not hits:
            shutil.rmtree(victim)  # the hostile command: empties it, then rmdir
            hits.append(1)
        return real(dfd)

    monkeypatch.setattr(snap._walk, "_list_dir", racing)
    return hits


@pytest.mark.parametrize("op", ["persist", "tree_digest"])
def test_a_directory_removed_before_its_listing_is_a_retryable_source_change(tmp_path, monkeypatch, op):
    ws = tmp_path / "ws"
    (ws / "d" / "e").mkdir(parents=True)
    (ws / "d" / "e" / "f").write_text("x")
    (ws / "top").write_text("top")
    with LocalSnapshotStore(tmp_path / "store") as store:
        with open_root(ws) as w:
            first = persist(w, store, "s").info
        hits = _remove_at_listing(monkeypatch, ws / "d" / "e")
        fds = len(os.listdir("/proc/self/fd"))
        with open_root(ws) as w, pytest.raises(SnapshotSourceChangedError) as ei:
            if op == "persist":
                persist(w, store, "s")
            else:
                tree_digest(w)
        assert hits == [1] and ei.value.retryable
        assert ei.value.sandbox_path == "d/e"
        assert len(os.listdir("/proc/self/fd")) == fds
        assert store.info("s") == first


_TREE = st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=1, max_size=8)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=_TREE, pick=st.integers(0, 50))
def test_any_directory_removed_at_its_listing_gives_success_or_a_retryable_change(tmp_path_factory, monkeypatch,
                                                                                  shape, pick):
    """Property: whichever directory is removed as the walk reaches it, persist raises nothing but
    :class:`SnapshotSourceChangedError` (or succeeds), and the store keeps its previous snapshot."""
    base = tmp_path_factory.mktemp("walk")
    ws = base / "ws"
    ws.mkdir()
    dirs = [ws]
    for i, (parent, is_dir) in enumerate(shape):  # a small random tree: each node under a directory made so far
        p = dirs[parent % len(dirs)] / f"n{i}"
        if is_dir:
            p.mkdir()
            dirs.append(p)
        else:
            p.write_bytes(b"x" * parent)
    subdirs = dirs[1:]
    if not subdirs:
        (ws / "only").mkdir()
        subdirs = [ws / "only"]
    victim = subdirs[pick % len(subdirs)]
    with LocalSnapshotStore(base / "store") as store:
        with open_root(ws) as w:
            first = persist(w, store, "s").info
        with monkeypatch.context() as m:
            hits = _remove_at_listing(m, victim)
            with open_root(ws) as w:
                try:
                    persist(w, store, "s")
                except SnapshotSourceChangedError as exc:
                    assert exc.retryable
                    assert store.info("s") == first
        assert hits == [1]
