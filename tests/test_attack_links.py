"""Hostile-review attacks on persist's hard-link count (the review of 2026-12-03).

Persist never reads a file that has a link outside the workspace: it counts
the names it lists of a multi-linked inode and refuses when they are fewer
than ``st_nlink``.  Before the fix, a confined command could make the count
whole by renaming its one name from a directory the walk had listed into
one it had not: the walk saw the name twice, and the host file's content
(one the command could not read) went into the snapshot.  The hook points
of ``sandbox_fs._hooks`` play the command at the exact windows.  The
sentinel is the host file's content: it must be in no stored object.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandbox_fs import _hooks, _native, open_root
from sandbox_fs.snapshot import (
    DirectorySnapshotStore,
    SnapshotSourceChangedError,
    UnrestorableEntryError,
    hydrate,
    persist,
)

SECRET = b"HOST SECRET 8d1f0c\n"


def _store_holds_secret(sdir: Path) -> bool:
    return any(SECRET in p.read_bytes() for p in sdir.rglob("*") if p.is_file() and not p.is_symlink())


def _workspace(tmp: Path, dirs: list[str]) -> tuple[Path, Path]:
    """A workspace with directories ``dirs`` and, in the first, ``f``: a hard link of a 0600 host file."""
    w, outside = tmp / "w", tmp / "outside"
    w.mkdir()
    outside.mkdir()
    for d in dirs:
        (w / d).mkdir()
    secret = outside / "secret"
    secret.write_bytes(SECRET)
    os.chmod(secret, 0o600)
    os.link(secret, w / dirs[0] / "f")
    return w, secret


class _Mover:
    """The confined command: moves its one name ``f`` between directories at the walk's windows.

    ``into``: after the walk listed ``dirs[0]``, the name moves into this directory
    just before the walk enters it (so the walk lists it twice).  ``chase``: then,
    before every later lookup of a name ``D/f``, the name is moved to ``D`` first
    (so every lookup by path finds it where it is looked for).
    """

    def __init__(self, w: Path, into: str, chase: bool) -> None:
        self.w, self.into, self.chase = w, into, chase
        self.opens: dict[str, int] = {}
        self.moved = False

    def where(self) -> Path | None:
        found = [p for p in self.w.rglob("f")]
        return found[0] if found else None

    def __call__(self, point: str, ctx: dict) -> None:  # type: ignore[type-arg]
        if point != "persist.open_entry":
            return
        path = ctx["path"]
        self.opens[path] = self.opens.get(path, 0) + 1
        if not self.moved and path == self.into and self.opens[path] == 2:  # entering it (the first is its lstat)
            here = self.where()
            assert here is not None
            os.rename(here, self.w / self.into / "f")
            self.moved = True
        elif self.moved and self.chase and path.endswith("/f"):
            here = self.where()
            want = self.w / path
            if here is not None and here != want:
                os.rename(here, want)


def test_a_name_moved_into_a_directory_not_listed_yet_is_never_counted_as_a_second_link(tmp_path: Path) -> None:
    """The name stays where it moved: the walk counted two names for ``st_nlink`` 2, one of them stale."""
    w, _secret = _workspace(tmp_path, ["a", "b"])
    sdir = tmp_path / "store"
    with DirectorySnapshotStore(sdir) as store, open_root(w) as r:
        with pytest.raises(UnrestorableEntryError):
            persist(r, store, "plain")  # without the move: refused, never read
        mover = _Mover(w, "b", chase=False)
        refused: BaseException | None = None
        with _hooks.installed(mover):
            try:
                persist(r, store, "n")
            except (SnapshotSourceChangedError, UnrestorableEntryError) as exc:
                refused = exc
        assert mover.moved
    assert not _store_holds_secret(sdir)  # the sentinel
    assert isinstance(refused, SnapshotSourceChangedError)  # retryable: the name moved under the walk


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ndirs=st.integers(2, 4), into=st.integers(1, 3), chase=st.booleans(),
       mode=st.sampled_from(["refuse", "skip"]))
def test_property_a_host_files_content_never_reaches_a_snapshot_through_a_moving_name(
        tmp_path_factory: pytest.TempPathFactory, ndirs: int, into: int, chase: bool, mode: str) -> None:
    """Every layout, target directory, and an attacker that also moves the name to each path as it is looked up
    again: persist refuses (changed, or a link outside), or commits a snapshot without the host file's content."""
    tmp = tmp_path_factory.mktemp("links")
    dirs = [f"d{i}" for i in range(ndirs)]
    w, _secret = _workspace(tmp, dirs)
    sdir = tmp / "store"
    mover = _Mover(w, dirs[min(into, ndirs - 1)], chase)
    with DirectorySnapshotStore(sdir) as store, open_root(w) as r, _hooks.installed(mover):
        try:
            persist(r, store, "n", on_unrestorable=mode)  # type: ignore[arg-type]
        except (SnapshotSourceChangedError, UnrestorableEntryError):
            pass
    assert not _store_holds_secret(sdir)  # the sentinel


def test_hard_links_inside_the_workspace_made_just_before_persist_still_persist(tmp_path: Path) -> None:
    """The check waits out the clock tick of a fresh change: links made right before persist are archived."""
    w, sdir, out = tmp_path / "w", tmp_path / "store", tmp_path / "out"
    (w / "a").mkdir(parents=True)
    (w / "b").mkdir()
    (w / "a" / "f").write_bytes(b"shared\n")
    os.link(w / "a" / "f", w / "b" / "g")
    with DirectorySnapshotStore(sdir) as store, open_root(w) as r, open_root(out, create=True) as o:
        persist(r, store, "n")
        hydrate(o, store, "n")
    assert (out / "a" / "f").read_bytes() == (out / "b" / "g").read_bytes() == b"shared\n"
    assert os.stat(out / "a" / "f").st_ino == os.stat(out / "b" / "g").st_ino


@pytest.mark.parametrize("chase", [False, True])
def test_a_subtree_moved_between_listings_never_counts_its_file_twice(tmp_path: Path, chase: bool) -> None:
    """The directory holding the name moves (the walk enters it twice, under two paths); with ``chase``
    it is moved again before each later lookup so that every path looked up resolves."""
    w, _secret = _workspace(tmp_path, ["a", "a/x", "b"])
    os.rename(w / "a" / "f", w / "a" / "x" / "f")
    sdir = tmp_path / "store"
    opens: dict[str, int] = {}

    def mover(point: str, ctx: dict) -> None:  # type: ignore[type-arg]
        if point != "persist.open_entry":
            return
        path = ctx["path"]
        opens[path] = opens.get(path, 0) + 1
        if path == "b" and opens[path] == 2:  # entering b, after a/x was walked
            os.rename(w / "a" / "x", w / "b" / "x")
        elif chase and path.endswith("/x/f"):
            want = w / path.rsplit("/", 2)[0] / "x"
            here = next(p for p in (w / "a" / "x", w / "b" / "x") if p.exists())
            if here != want:
                os.rename(here, want)

    with DirectorySnapshotStore(sdir) as store, open_root(w) as r, _hooks.installed(mover):
        try:
            persist(r, store, "n")
        except (SnapshotSourceChangedError, UnrestorableEntryError):
            pass
    assert opens.get("b/x", 0) >= 1  # the walk did list the subtree a second time
    assert not _store_holds_secret(sdir)  # the sentinel


class _Doubled:
    """A directory listing that gives some names twice (POSIX leaves a name renamed while its directory is
    read listed once, twice or not at all): wraps ``_native.scan_dir`` and appends a second record of each
    name in ``names`` (bytes) that the listing holds, ``times`` extra times."""

    def __init__(self, names: set[bytes], times: int = 1) -> None:
        self.names, self.times, self.hits = names, times, 0
        self.orig = _native.scan_dir

    def __call__(self, dfd: int, max_bytes: int | None = None) -> bytes:
        raw = self.orig(dfd) if max_bytes is None else self.orig(dfd, max_bytes)
        head = _native.SCAN_HEADER_BYTES
        out, off = bytearray(raw), 0
        while off < len(raw):
            (nlen,) = struct.unpack_from("=I", raw, off + head - 4)
            nxt = off + head + ((nlen + 7) & ~7)
            if raw[off + head:off + head + nlen] in self.names:
                out += raw[off:nxt] * self.times
                self.hits += 1
            off = nxt
        return bytes(out)


def test_a_name_listed_twice_in_one_directory_is_never_counted_as_a_second_link(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The walk's one listing of ``a`` gives ``f`` twice: two names for ``st_nlink`` 2, the other link being the
    host file.  Both names are there when looked up again (they are one name), so before the fix the count
    passed and the host file's content went into the snapshot."""
    w, _secret = _workspace(tmp_path, ["a"])
    sdir = tmp_path / "store"
    doubled = _Doubled({b"f"})
    monkeypatch.setattr(_native, "scan_dir", doubled)
    with DirectorySnapshotStore(sdir) as store, open_root(w) as r:
        with pytest.raises(SnapshotSourceChangedError):
            persist(r, store, "n")
    assert doubled.hits
    assert not _store_holds_secret(sdir)  # the sentinel


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(inside=st.integers(1, 3), outside=st.booleans(), doubled=st.sets(st.integers(0, 2)),
       times=st.integers(1, 2), mode=st.sampled_from(["refuse", "skip"]))
def test_property_a_link_count_made_whole_by_repeated_names_never_reads_the_file(
        tmp_path_factory: pytest.TempPathFactory, inside: int, outside: bool, doubled: set[int], times: int,
        mode: str) -> None:
    """``inside`` names of one inode in the workspace (``d0/f0``, ``d1/f1``, ...), plus the host file when
    ``outside``; the listings repeat the names ``doubled`` picks.  Persist reads the file only when every
    link is in the workspace and no name was listed twice; the host file's content is never stored."""
    tmp = tmp_path_factory.mktemp("dup")
    w, secret = tmp / "w", tmp / "outside" / "secret"
    w.mkdir()
    secret.parent.mkdir()
    secret.write_bytes(SECRET)
    for i in range(inside):
        (w / f"d{i}").mkdir()
        os.link(secret, w / f"d{i}" / f"f{i}")
    if not outside:
        os.rename(secret, tmp / "gone")
        os.unlink(tmp / "gone")
    names = {f"f{i}".encode() for i in doubled if i < inside}
    sdir = tmp / "store"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_native, "scan_dir", _Doubled(names, times))
        with DirectorySnapshotStore(sdir) as store, open_root(w) as r:
            try:
                persist(r, store, "n", on_unrestorable=mode)  # type: ignore[arg-type]
                stored = True
            except (SnapshotSourceChangedError, UnrestorableEntryError):
                stored = False
    if outside:
        assert not _store_holds_secret(sdir)  # the sentinel
    else:
        assert stored == (not names)  # positive control: all links inside and listed once: archived
        if stored:
            assert _store_holds_secret(sdir)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doubled=st.sets(st.sampled_from([b"f", b"d", b"g", b"e"]), min_size=1), times=st.integers(1, 2),
       layered=st.booleans())
def test_property_a_listing_that_repeats_a_name_never_commits_a_generation(
        tmp_path_factory: pytest.TempPathFactory, doubled: set[bytes], times: int, layered: bool) -> None:
    """Plain files and directories listed twice (first persist, or a re-persist over the walk cache): before
    the fix persist committed an index naming the path twice, which hydrate then refused as corrupt.  Now
    persist is refused as changed (retryable) and the current generation is still the last good one."""
    tmp = tmp_path_factory.mktemp("dupw")
    w = tmp / "w"
    (w / "d").mkdir(parents=True)
    (w / "f").write_bytes(b"f1")
    (w / "d" / "g").write_bytes(b"g1")
    (w / "e").mkdir()
    sdir = tmp / "store"
    with DirectorySnapshotStore(sdir) as store, open_root(w) as r:
        if layered:
            persist(r, store, "n")
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_native, "scan_dir", _Doubled(doubled, times))
            with pytest.raises(SnapshotSourceChangedError):
                persist(r, store, "n")
    if layered:
        (tmp / "back").mkdir()
        with DirectorySnapshotStore(sdir) as store, open_root(tmp / "back") as r:
            hydrate(r, store, "n")
        assert (tmp / "back" / "f").read_bytes() == b"f1" and (tmp / "back" / "d" / "g").read_bytes() == b"g1"
