"""The staging directory is reached by its name only (``Subtree``), never through an fd of its own.

The finding (stop 8's review): the extractor held an fd of its staging
directory (``.sfs-extract-*``) and hydrate one of its own (``.sfs-hydrate-*``),
but the final step moved the staging directory by *name*.  A process able to
rename inside the destination moved the staging directory away (out of the
workspace, when it can write there) and put its own directory under that name:
every later member was written into the moved directory, and the racer's
directory was moved into place and reported as a success.

The class fix: every staged path is resolved as ``<staging>/<path>`` from the
fd of the directory the staging directory was made in, at the moment of use,
so writes and the final move always agree on one directory beneath the
destination; and the staging directory's identity is checked before it is
moved (a replaced one is refused).  These tests make the swap deterministic
(at a chosen member, before a batch, after hydrate's extraction) and check the
outside sentinel: nothing reaches a moved directory after the swap.
"""

from __future__ import annotations

import io
import os
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_archive_builders import tar_bytes, ti

from sandbox_fs import SandboxError, open_root
from sandbox_fs.archive import ArchiveLimits, ExtractPolicy, UnsafeArchiveMemberError, extract
from sandbox_fs.archive import _writer
from sandbox_fs.errors import InvalidPathError, PathEscapeError
from sandbox_fs.root import Subtree
from sandbox_fs.snapshot import LocalSnapshotStore, SnapshotError, hydrate, persist


def _files(top) -> dict[str, bytes]:
    out = {}
    for dirpath, _dirs, names in os.walk(top):
        for n in names:
            p = os.path.join(dirpath, n)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, top)] = fh.read()
    return out


def _staging_names(top) -> list[str]:
    return [n for n in os.listdir(top) if n.startswith((".sfs-extract-", ".sfs-hydrate-"))]


class _Swapper:
    """Moves the work directory out to ``outside/stolen`` and puts a racer's directory in its place."""

    def __init__(self, layout, parent, name: str | None = None) -> None:
        self.layout, self.parent, self.name = layout, parent, name
        self.stolen = layout.outside / "stolen"
        self.at_swap: dict[str, bytes] | None = None

    def swap(self) -> None:
        if self.at_swap is not None:
            return
        name = self.name or _staging_names(self.parent)[0]
        os.rename(self.parent / name, self.stolen)
        os.mkdir(self.parent / name)
        (self.parent / name / "racer.txt").write_bytes(b"racer\n")
        self.at_swap = _files(self.stolen)

    def assert_nothing_followed(self) -> None:
        assert self.at_swap is not None, "the swap never happened"
        assert _files(self.stolen) == self.at_swap, "a member was written into the moved directory"


def _members(n: int = 12, flat: bool = True) -> list:
    """Top-level files (``flat``: later members need nothing made before the swap, so they are made
    in the racer's directory and finish's identity check refuses it) or files in three directories
    (a later member's parent is gone with the moved directory: ENOENT, never made elsewhere)."""
    return [ti(f"f{i:02d}" if flat else f"d{i % 3}/f{i:02d}", data=b"payload %d\n" % i) for i in range(n)]


def _swap_at_member(monkeypatch, swapper: _Swapper, k: int) -> None:
    real = _writer.Extractor.count_member

    def count_member(self, member):
        if self.members == k:
            swapper.swap()
        return real(self, member)

    monkeypatch.setattr(_writer.Extractor, "count_member", count_member)


# ------------------------------------------------------------------ the extractor, deterministic


@pytest.mark.parametrize("flat", [True, False])
@pytest.mark.parametrize("source", ["stream", "file"])
@pytest.mark.parametrize("dest_exists", [False, True])
def test_staging_swapped_mid_extraction_is_refused_and_nothing_follows_it(layout, tmp_path, monkeypatch, resolver,
                                                                          source, dest_exists, flat):
    data = tar_bytes(_members(flat=flat))
    parent = layout.ws / "dest" if dest_exists else layout.ws
    if dest_exists:
        (layout.ws / "dest").mkdir()
        (layout.ws / "dest" / "keep.txt").write_bytes(b"kept\n")
    swapper = _Swapper(layout, parent)
    _swap_at_member(monkeypatch, swapper, 5)
    before = layout.snapshot()
    src = io.BytesIO(data) if source == "stream" else tmp_path / "a.tar"
    if source == "file":
        src.write_bytes(data)
    with open_root(layout.ws) as root, pytest.raises(OSError if not flat else UnsafeArchiveMemberError) as ei:
        extract(root, "dest", src)
    if flat:
        assert ei.value.rule == "conflict" and "staging directory was replaced" in str(ei.value)
    else:
        assert isinstance(ei.value, FileNotFoundError) and str(tmp_path) not in str(ei.value)
    swapper.assert_nothing_followed()
    after = layout.snapshot()
    assert {k: v for k, v in after.items() if k != "stolen" and not k.startswith("stolen/") and k != "."} == \
        {k: v for k, v in before.items() if k != "."}
    # nothing new remains: the destination is as it was, the staging name is gone
    if dest_exists:
        assert _files(layout.ws / "dest") == {"keep.txt": b"kept\n"}
        assert _staging_names(layout.ws / "dest") == []
    else:
        assert os.listdir(layout.ws) == []


def test_staging_swapped_before_a_batch_runs_the_batch_writes_by_name(layout, tmp_path, monkeypatch, resolver):
    """The batched path (one native call per batch): files queued before the swap and made after it
    go to the staging *name* (the racer's directory, in the workspace), never the moved directory."""
    data = tar_bytes(_members(40))
    (tmp_path / "a.tar").write_bytes(data)
    swapper = _Swapper(layout, layout.ws)
    real_run = _writer._Batch.run

    def run(self, src_fd):
        swapper.swap()
        real_run(self, src_fd)

    monkeypatch.setattr(_writer._Batch, "run", run)
    with open_root(layout.ws) as root, pytest.raises(UnsafeArchiveMemberError) as ei:
        extract(root, "dest", tmp_path / "a.tar")
    assert "staging directory was replaced" in str(ei.value)
    swapper.assert_nothing_followed()
    assert os.listdir(layout.ws) == []


def test_in_place_new_destination_swapped_is_written_by_name(layout, monkeypatch, resolver):
    """In place into a new destination: the directory made for it is reached by name too, so members
    after the swap land in whatever sits at ``dest`` now (inside the workspace), never the moved one."""
    swapper = _Swapper(layout, layout.ws, "dest")
    _swap_at_member(monkeypatch, swapper, 5)
    with open_root(layout.ws) as root:
        extract(root, "dest", io.BytesIO(tar_bytes(_members())), policy=ExtractPolicy(in_place=True))
    swapper.assert_nothing_followed()
    got = _files(layout.ws / "dest")
    assert got.pop("racer.txt") == b"racer\n"
    assert sorted(got) == [f"f{i:02d}" for i in range(5, 12)]


def test_staged_path_bound_is_an_archive_limit(layout):
    """Staged paths are "<staging>/<member>": a member path over STAGED_PATH_MAX is refused as
    max_path_bytes (never an ENAMETOOLONG from deep inside), one at the bound is extracted."""
    def deep(total: int) -> str:
        parts, n = [], 0
        while n + 201 < total:
            parts.append(f"{len(parts):03d}" + "x" * 197)
            n += 201
        return "/".join(parts + ["y" * (total - n)])

    ok, over = deep(_writer.STAGED_PATH_MAX), deep(_writer.STAGED_PATH_MAX + 1)
    assert len(ok.encode()) == _writer.STAGED_PATH_MAX
    lim = ArchiveLimits(max_depth=64)
    with open_root(layout.ws) as root:
        rep = extract(root, "dest", io.BytesIO(tar_bytes([ti(ok, data=b"deep")])), limits=lim)
        assert rep.files == 1
        with pytest.raises(SandboxError) as ei:
            extract(root, "dest2", io.BytesIO(tar_bytes([ti(over, data=b"deep")])), limits=lim)
    assert ei.value.code == "archive_limit" and ei.value.limit == "max_path_bytes"
    assert ei.value.allowed == _writer.STAGED_PATH_MAX


# ------------------------------------------------------------------------------------ hydrate


@pytest.fixture()
def store(tmp_path):
    s = LocalSnapshotStore(tmp_path / "store")
    yield s
    s.close()


def _saved(layout, store) -> dict[str, bytes]:
    for i in range(30):
        d = layout.ws / f"d{i % 3}"
        d.mkdir(exist_ok=True)
        (d / f"f{i:02d}").write_bytes(b"saved %d\n" % i)
    with open_root(layout.ws) as ws:
        persist(ws, store, "s")
    (layout.ws / "newer.txt").write_bytes(b"newer\n")  # the live workspace differs from the snapshot
    return _files(layout.ws)


@pytest.mark.parametrize("which", ["extract_staging", "hydrate_staging"])
def test_hydrate_staging_swapped_is_refused_workspace_unchanged(layout, store, monkeypatch, resolver, which):
    live = _saved(layout, store)
    from sandbox_fs import snapshot as snap

    swapper = _Swapper(layout, layout.ws)
    if which == "extract_staging":
        _swap_at_member(monkeypatch, swapper, 10)
    else:
        real = snap._restore_modes

        def restore_modes(ws, info, **kw):
            swapper.swap()  # after the extractor renamed its tree to .sfs-hydrate-*
            return real(ws, info, **kw)

        monkeypatch.setattr(snap, "_restore_modes", restore_modes)
    with open_root(layout.ws) as ws, pytest.raises((SandboxError, FileNotFoundError)) as ei:
        hydrate(ws, store, "s")
    if which == "extract_staging":  # the next member's parent left with the moved directory
        assert isinstance(ei.value, FileNotFoundError) and str(layout.base) not in str(ei.value)
    else:
        assert "replaced" in str(ei.value)
    swapper.assert_nothing_followed()
    assert _files(layout.ws) == live  # the workspace is exactly as it was
    assert _staging_names(layout.ws) == []
    if which == "hydrate_staging":
        assert isinstance(ei.value, SnapshotError)


def test_hydrate_restores_a_path_at_the_staged_bound(layout, store):
    """What persist accepts, hydrate restores: paths up to STAGED_PATH_MAX round-trip, and a longer
    one is an unrestorable entry at persist (hydrate could not stage it)."""
    fd = os.open(layout.ws, os.O_RDONLY)
    parts: list[str] = []
    try:
        while sum(len(p) + 1 for p in parts) + 250 < _writer.STAGED_PATH_MAX:
            name = f"{len(parts):02d}" + "x" * 198
            os.mkdir(name, dir_fd=fd)
            nfd = os.open(name, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = nfd
            parts.append(name)
        used = sum(len(p) + 1 for p in parts)
        ok, over = "y" * (_writer.STAGED_PATH_MAX - used), "z" * (_writer.STAGED_PATH_MAX - used + 1)
        for n in (ok, over):
            os.close(os.open(n, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    finally:
        os.close(fd)
    with open_root(layout.ws) as ws:
        rep = persist(ws, store, "s", on_unrestorable="skip")
        assert [p.rsplit("/", 1)[-1] for p, _why in rep.skipped] == [over]
        hydrate(ws, store, "s")
    deepest = layout.ws.joinpath(*parts)
    assert sorted(os.listdir(deepest)) == [ok]


# ------------------------------------------------------------------------- Subtree itself


def test_subtree_refuses_to_leave_its_directory(layout):
    (layout.ws / "a" / "b").mkdir(parents=True)
    with open_root(layout.ws) as root:
        sub = Subtree(root, "a")
        for bad in ("../x", "b/../../x", "/etc/passwd", "b/.."):
            with pytest.raises(PathEscapeError):
                sub.join(bad)
        for bad in ("", "."):
            with pytest.raises(InvalidPathError):
                sub.remove(bad)
        for bad in ("", ".", "..", "a/../b", "/a"):
            with pytest.raises(InvalidPathError):
                Subtree(root, bad)
        sub.mkdir("b/c")
        assert (layout.ws / "a" / "b" / "c").is_dir()
        os.rename(layout.ws / "a", layout.outside / "moved")
        os.mkdir(layout.ws / "a")
        sub.mkdir("new")  # by name: the new "a", never the moved one
    assert (layout.ws / "a" / "new").is_dir() and not (layout.outside / "moved" / "new").exists()


# ---------------------------------------------------------------------- property: any swap point

_NAMES = st.sampled_from(["a", "b", "a/x", "a/y", "b/c/d", "e"])
_MEMBER = st.tuples(st.sampled_from(["file", "file", "dir", "symlink"]), _NAMES, st.integers(0, 3000))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(members=st.lists(_MEMBER, min_size=1, max_size=10), k=st.integers(1, 10),
       mode=st.sampled_from(["missing", "existing", "in_place"]), source=st.sampled_from(["stream", "file"]))
def test_property_a_work_directory_swapped_at_any_member_receives_nothing_after(layout, tmp_path, monkeypatch,
                                                                                members, k, mode, source):
    """Whatever the archive, the swap point and the source (one by one or batched): once the work
    directory (staging, or a new in-place destination) is moved out, no write reaches it; the
    extraction ends in a SandboxError or (in place) a success; no staging directory is left."""
    for p in list(layout.ws.iterdir()) + [layout.outside / "stolen"]:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
    tis = []
    for kind, name, size in members:
        if kind == "file":
            tis.append(ti(name, data=bytes([65 + size % 26]) * size))
        elif kind == "dir":
            tis.append(ti(name, "dir"))
        else:
            tis.append(ti(name, "symlink", linkname="e"))
    data = tar_bytes(tis)
    parent = layout.ws
    if mode == "existing":
        (layout.ws / "dest").mkdir()
        parent = layout.ws / "dest"
    swapper = _Swapper(layout, parent, "dest" if mode == "in_place" else None)
    with monkeypatch.context() as m:
        _swap_at_member(m, swapper, k)
        src = io.BytesIO(data)
        if source == "file":
            (tmp_path / "p.tar").write_bytes(data)
            src = tmp_path / "p.tar"
        try:
            with open_root(layout.ws) as root:
                extract(root, "dest", src, policy=ExtractPolicy(in_place=mode == "in_place"))
            ok = True
        except (SandboxError, OSError):  # OSError: a parent made before the swap is gone (ENOENT)
            ok = False
    if swapper.at_swap is None:
        return  # fewer members than k: nothing was swapped
    swapper.assert_nothing_followed()
    if mode != "in_place":
        assert not ok
    assert _staging_names(parent) == []


_COMP = st.sampled_from(["a", "b", "..", ".", "", "c d", "\udcff", "x" * 10])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(comps=st.lists(_COMP, max_size=6), lead=st.sampled_from(["", "/", "//"]), as_bytes=st.booleans())
def test_property_subtree_paths_stay_beneath_their_directory(layout, comps, lead, as_bytes):
    """Any argument path: Subtree.join refuses it or returns a path that names something beneath the
    directory (lexically, since the Root refuses symlinks only if asked: no '..' survives), and a
    mkdir through it never creates anything outside the directory."""
    text = lead + "/".join(comps)
    arg = os.fsencode(text) if as_bytes else text
    (layout.ws / "sub").mkdir(exist_ok=True)
    with open_root(layout.ws) as root:
        sub = Subtree(root, "sub")
        try:
            joined = sub.join(arg)
        except (PathEscapeError, InvalidPathError):
            joined = None
        if joined is not None:
            parts = joined.split(b"/")
            assert parts[0] == b"sub" and b".." not in parts
        before = sorted(os.listdir(layout.ws))
        try:
            sub.mkdir(arg, exist_ok=True)
        except (SandboxError, OSError):
            pass
        assert sorted(os.listdir(layout.ws)) == before  # only beneath sub/ can anything appear
