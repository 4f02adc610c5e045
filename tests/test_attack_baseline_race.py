"""A process racing hydrate: a file rewritten (same size, same mtime) after the swap, before the baseline scan.

The baseline hydrate leaves for the next persist takes each restored file's
stat from a scan made after the swap.  A change made between the swap and
that scan is in the scan's stat; unless the baseline's time is read before
the swap, that change's ctime is older than the baseline's time, and the next
persist takes the file as unchanged (the restored content's SHA-256): the
change is lost from the snapshot.  The sentinel is the content a restore of
the next snapshot gives.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandbox_fs import _hooks, open_root
from sandbox_fs.snapshot import DirectorySnapshotStore, hydrate, persist
from sandbox_fs.snapshot import _hydrate as hydrate_mod


def _race_after_swap(monkeypatch, w: Path, rel: str, new: bytes, pause_s: float) -> None:
    """Rewrite ``w/rel`` (size and mtime kept) when the baseline scan is about to run, then let time pass."""
    real = hydrate_mod._baseline_listings

    def racing(ws, *args, **kwargs):
        p = w / rel
        before = os.lstat(p)
        assert len(new) == before.st_size
        p.write_bytes(new)
        os.utime(p, ns=(before.st_atime_ns, before.st_mtime_ns))
        time.sleep(pause_s)  # past the coarse clock's tick: the change's ctime is before a clock read now
        return real(ws, *args, **kwargs)

    monkeypatch.setattr(hydrate_mod, "_baseline_listings", racing)


def _round(tmp_path: Path, monkeypatch, rel: str, old: bytes, new: bytes, pause_s: float) -> bytes:
    sdir, w, out = tmp_path / "store", tmp_path / "w", tmp_path / "out"
    (w / rel).parent.mkdir(parents=True, exist_ok=True)
    (w / rel).write_bytes(old)
    (w / "other").write_bytes(b"x" * 100)
    with DirectorySnapshotStore(sdir) as s, open_root(w) as r:
        persist(r, s, "n")
    time.sleep(0.025)
    _race_after_swap(monkeypatch, w, rel, new, pause_s)
    with DirectorySnapshotStore(sdir) as s, open_root(w) as r:
        hydrate(r, s, "n")
    monkeypatch.undo()
    with DirectorySnapshotStore(sdir) as s, open_root(w) as r, open_root(out, create=True) as o:
        persist(r, s, "n")
        hydrate(o, s, "n")
    return (out / rel).read_bytes()


def test_a_file_changed_after_the_swap_before_the_baseline_scan_is_in_the_next_snapshot(tmp_path, monkeypatch):
    assert _round(tmp_path, monkeypatch, "d/f", b"one\n", b"TWO\n", 0.03) == b"TWO\n"  # the sentinel


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(depth=st.integers(0, 3), old=st.binary(min_size=1, max_size=64), flip=st.integers(0, 63),
       pause_ms=st.sampled_from([0, 5, 30]))
def test_property_any_same_size_change_racing_the_baseline_is_persisted(tmp_path_factory, monkeypatch,
                                                                        depth, old, flip, pause_ms):
    rel = "/".join(["d"] * depth + ["f"])
    new = bytearray(old)
    new[flip % len(old)] ^= 0xFF
    tmp = tmp_path_factory.mktemp("race")
    assert _round(tmp, monkeypatch, rel, old, bytes(new), pause_ms / 1000) == bytes(new)


# ------------------------------------------------- a process racing the restore before the swap (the staged tree)


def _race_before_swap(w: Path, rel: str, new: bytes, how: str):
    """A hook that, once the staged tree is complete (before the swap), puts ``new`` at ``rel`` in it.

    ``how``: "write" rewrites the staged file (size kept), "write_utime" also
    sets its mtime back, "move" moves a directory made before the restore
    (holding ``rel``'s leaf with ``new``) over the staged one: the files in
    it keep their older ctimes.
    """
    def hook(point, ctx):
        if point != "hydrate.swap":
            return
        staged = w / ctx["staging"] / rel
        if how == "move":
            os.rename(staged.parent, w / "pre" / "old")
            os.rename(w / "pre" / "dir", staged.parent)
        else:
            before = os.lstat(staged)
            assert len(new) == before.st_size
            staged.write_bytes(new)
            if how == "write_utime":
                os.utime(staged, ns=(before.st_atime_ns, before.st_mtime_ns))
        time.sleep(0.03)  # past the coarse clock's tick: the change is older than a clock read at the swap

    return hook


def _round_staged(tmp_path: Path, rel: str, old: bytes, new: bytes, how: str) -> bytes:
    sdir, w, out = tmp_path / "store", tmp_path / "w", tmp_path / "out"
    (w / rel).parent.mkdir(parents=True, exist_ok=True)
    (w / rel).write_bytes(old)
    with DirectorySnapshotStore(sdir) as s, open_root(w) as r:
        persist(r, s, "n")
    if how == "move":  # a directory another process made before the restore started
        (w / "pre" / "dir").mkdir(parents=True)
        (w / "pre" / "dir" / rel.rpartition("/")[2]).write_bytes(new)
    time.sleep(0.025)
    with DirectorySnapshotStore(sdir) as s, open_root(w) as r, _hooks.installed(_race_before_swap(w, rel, new, how)):
        hydrate(r, s, "n")
    assert (w / rel).read_bytes() == new  # the workspace holds the change
    with DirectorySnapshotStore(sdir) as s, open_root(w) as r, open_root(out, create=True) as o:
        persist(r, s, "n")
        hydrate(o, s, "n")
    return (out / rel).read_bytes()


@pytest.mark.parametrize("how", ["write", "write_utime", "move"])
def test_a_staged_file_changed_before_the_swap_is_in_the_next_snapshot(tmp_path, how):
    """The staged tree is inside the workspace: a change made to it before the swap (a staged file rewritten,
    or a directory made before the restore moved over a staged one) is in the workspace after the restore, and
    the next persist must read it, not take the restored content's SHA-256 for it."""
    assert _round_staged(tmp_path, "d/f", b"one\n", b"TWO\n", how) == b"TWO\n"  # the sentinel


@settings(max_examples=6, deadline=None)
@given(depth=st.integers(1, 3), old=st.binary(min_size=1, max_size=64), flip=st.integers(0, 63),
       how=st.sampled_from(["write", "write_utime", "move"]))
def test_property_any_change_to_the_staged_tree_is_persisted(tmp_path_factory, depth, old, flip, how):
    rel = "/".join(["d"] * depth + ["f"])
    new = bytearray(old)
    new[flip % len(old)] ^= 0xFF
    tmp = tmp_path_factory.mktemp("staged")
    assert _round_staged(tmp, rel, old, bytes(new), how) == bytes(new)


@settings(max_examples=200, deadline=None)
@given(time_ns=st.integers(0, 1 << 40), ctimes=st.lists(st.integers(0, 1 << 40), min_size=1, max_size=8))
def test_property_a_listed_file_older_than_the_listings_is_read_again(time_ns, ctimes):
    """``index_with_listings`` gives a file the scan's stat only when its ctime is at or after the listings'
    time (the restore made or changed it since); an older one is marked to be read again (link count 0)."""
    from sandbox_fs.snapshot._baseline import Listings, index_with_listings
    from sandbox_fs.snapshot._index import Index, IndexEntry
    from sandbox_fs.snapshot._walk import SCAN_HEADER

    raw = b""
    for i, ctime in enumerate(ctimes):
        name = f"f{i}".encode()
        raw += SCAN_HEADER.pack(100 + i, 5, 3, 1, ctime, 1, stat.S_IFREG | 0o644, len(name))
        raw += name.ljust((len(name) + 7) & ~7, b"\0")
    index = Index(0, 5, [IndexEntry(f"f{i}", "file", 1, 3, 9, 9, 0o644, "0" * 64, 1, 1)
                         for i in range(len(ctimes))], [])
    got = index_with_listings(index, Listings(time_ns, 5, {"": raw})).entries
    for e, ctime in zip(got, ctimes):
        assert (e.nlink, e.ino, e.ctime_ns) == ((1, 100 + int(e.path[1:]), ctime) if ctime >= time_ns else (0, 1, 9))
