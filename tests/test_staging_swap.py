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
import stat

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_archive_builders import tar_bytes, ti

from sandbox_fs import SandboxError, open_root
from sandbox_fs.archive import ArchiveLimits, ExtractPolicy, UnsafeArchiveMemberError, extract
from sandbox_fs.archive import _batch, _writer
from sandbox_fs.errors import DirectoryReplacedError, InvalidPathError, PathEscapeError
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

    def assert_racer_dir_left_alone(self) -> None:
        """The directory put at the staging name is not ours: never removed (it may hold members
        written by name after the swap, under the reserved in-flight name), the racer's file kept."""
        names = _staging_names(self.parent)
        assert len(names) == 1
        assert _files(self.parent / names[0]).get("racer.txt") == b"racer\n"


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
    # the destination is as it was; the racer's directory at the staging name is left alone
    swapper.assert_racer_dir_left_alone()
    if dest_exists:
        got = _files(layout.ws / "dest")
        assert got.pop("keep.txt") == b"kept\n"
        assert all(k.startswith(".sfs-extract-") for k in got)
    else:
        assert os.listdir(layout.ws) == _staging_names(layout.ws)


def test_staging_swapped_before_a_batch_runs_the_batch_writes_by_name(layout, tmp_path, monkeypatch, resolver):
    """The batched path (one native call per batch): files queued before the swap and made after it
    go to the staging *name* (the racer's directory, in the workspace), never the moved directory."""
    data = tar_bytes(_members(40))
    (tmp_path / "a.tar").write_bytes(data)
    swapper = _Swapper(layout, layout.ws)
    real_run = _batch.FileBatch.run

    def run(self, src_fd):
        swapper.swap()
        real_run(self, src_fd)

    monkeypatch.setattr(_batch.FileBatch, "run", run)
    with open_root(layout.ws) as root, pytest.raises(UnsafeArchiveMemberError) as ei:
        extract(root, "dest", tmp_path / "a.tar")
    assert "staging directory was replaced" in str(ei.value)
    swapper.assert_nothing_followed()
    swapper.assert_racer_dir_left_alone()
    assert os.listdir(layout.ws) == _staging_names(layout.ws)


def test_in_place_new_destination_swapped_is_refused(layout, monkeypatch, resolver):
    """In place into a new destination: the directory made for it is reached by name and checked by
    identity at every call, so once another directory is put at ``dest`` nothing more is written,
    neither there nor into the moved directory."""
    swapper = _Swapper(layout, layout.ws, "dest")
    _swap_at_member(monkeypatch, swapper, 5)
    with open_root(layout.ws) as root, pytest.raises(DirectoryReplacedError) as ei:
        extract(root, "dest", io.BytesIO(tar_bytes(_members())), policy=ExtractPolicy(in_place=True))
    assert ei.value.retryable and str(layout.base) not in str(ei.value)
    swapper.assert_nothing_followed()
    assert _files(layout.ws / "dest") == {"racer.txt": b"racer\n"}


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
        real = snap._hydrate._extract_with_archive

        def extract_then_swap(*a, **kw):
            real(*a, **kw)
            swapper.swap()  # after the extractor renamed its tree to .sfs-hydrate-*

        monkeypatch.setattr(snap._hydrate, "_extract_with_archive", extract_then_swap)
    with open_root(layout.ws) as ws, pytest.raises((SandboxError, FileNotFoundError)) as ei:
        hydrate(ws, store, "s")
    if which == "extract_staging":  # the next member's parent left with the moved directory
        assert isinstance(ei.value, FileNotFoundError) and str(layout.base) not in str(ei.value)
    else:
        assert "replaced" in str(ei.value)
    swapper.assert_nothing_followed()
    swapper.assert_racer_dir_left_alone()
    left = {k: v for k, v in _files(layout.ws).items() if not k.startswith(".sfs-")}
    assert left == live  # the workspace is exactly as it was
    if which == "hydrate_staging":
        assert isinstance(ei.value, (SnapshotError, DirectoryReplacedError))


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


def _subtree(root, layout, name: str = "a") -> Subtree:
    st_ = os.lstat(layout.ws / name)
    return Subtree(root, name, (st_.st_dev, st_.st_ino))


def test_subtree_acts_only_on_the_directory_it_made(layout):
    (layout.ws / "a" / "b").mkdir(parents=True)
    with open_root(layout.ws) as root:
        sub = _subtree(root, layout)
        for bad in ("../x", "b/../../x", "/etc/passwd"):
            with pytest.raises(PathEscapeError):
                sub.mkdir(bad)
        for bad in ("", "."):
            with pytest.raises(InvalidPathError):
                sub.remove(bad)
        for bad in ("", ".", "..", "a/../b", "/a", "a//b"):
            with pytest.raises(InvalidPathError):
                Subtree(root, bad, (0, 0))
        sub.mkdir("b/c")
        assert (layout.ws / "a" / "b" / "c").is_dir()
        os.rename(layout.ws / "a", layout.outside / "moved")
        os.mkdir(layout.ws / "a")
        (layout.ws / "a" / "theirs").write_text("theirs")
        # another directory at the name: refused, never acted on, never removed
        for call in (lambda: sub.mkdir("new"), lambda: sub.chmod(".", 0o700), lambda: sub.remove("theirs"),
                     lambda: sub.atomic_write("f", b"x")):
            with pytest.raises(DirectoryReplacedError):
                call()
        assert sub.remove_tree() is False
    assert sorted(os.listdir(layout.ws / "a")) == ["theirs"]
    assert sorted(os.listdir(layout.outside / "moved")) == ["b"]


def test_subtree_remove_tree_removes_its_own_directory_even_read_only(layout):
    (layout.ws / "a" / "b" / "c").mkdir(parents=True)
    (layout.ws / "a" / "b" / "c" / "f").write_text("x")
    os.chmod(layout.ws / "a" / "b", 0o500)
    with open_root(layout.ws) as root:
        assert _subtree(root, layout).remove_tree() is True
    assert os.listdir(layout.ws) == []


def _can_bind_mount() -> str | None:
    if os.geteuid() != 0:
        return "needs root (a bind mount in a private mount namespace)"
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "needs unshare(1) and mount(1)"
    import sandbox_fs
    if not sandbox_fs.features()["openat2"]:
        return "the kernel has no openat2 (RESOLVE_NO_XDEV finds same-filesystem bind mounts)"
    return None


@pytest.mark.skipif(_can_bind_mount() is not None, reason=str(_can_bind_mount()))
def test_removal_never_enters_a_bind_mount_of_the_same_filesystem(layout, tmp_path, resolver):
    """Root.clear / rmtree / Subtree.remove_tree keep a mount point, a same-filesystem bind mount
    included (st_dev is the same; openat2 RESOLVE_NO_XDEV sees it): the mounted files survive."""
    import subprocess
    import sys
    import textwrap

    host = tmp_path / "hostdir"
    host.mkdir()
    (host / "precious.txt").write_text("precious")
    (layout.ws / "t" / "mnt").mkdir(parents=True)
    (layout.ws / "t" / "k" / "mnt2").mkdir(parents=True)
    (layout.ws / "t" / "other.txt").write_text("x")
    script = textwrap.dedent(f"""
        import os, subprocess
        subprocess.run(["mount", "--bind", {str(host)!r}, {str(layout.ws / "t" / "mnt")!r}], check=True)
        subprocess.run(["mount", "--bind", {str(host)!r}, {str(layout.ws / "t" / "k" / "mnt2")!r}], check=True)
        os.chmod({str(layout.ws / "t" / "k")!r}, 0o500)
        from sandbox_fs import open_root
        from sandbox_fs.root import Subtree
        with open_root({str(layout.ws)!r}) as root:
            st = os.lstat({str(layout.ws / "t")!r})
            print(Subtree(root, "t", (st.st_dev, st.st_ino)).remove_tree())
            root.rmtree("t")
            root.clear()
        print(sorted(os.listdir({str(host)!r})))
        print(oct(os.stat({str(layout.ws / "t" / "k")!r}).st_mode & 0o777))
    """)
    os.chmod(host, 0o555)
    (layout.ws / "t" / "ro").mkdir()
    (layout.ws / "t" / "ro" / "f").write_text("x")
    os.chmod(layout.ws / "t" / "ro", 0o555)  # made writable through its own fd, never by name
    env = dict(os.environ, SANDBOX_FS_RESOLVER=resolver)
    out = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c", script],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:3] == ["False", "['precious.txt']", "0o500"]  # a kept parent keeps its mode
    assert (host / "precious.txt").read_text() == "precious"
    assert stat.S_IMODE(os.stat(host).st_mode) == 0o555  # never chmod'ed through the mount
    assert not (layout.ws / "t" / "other.txt").exists() and not (layout.ws / "t" / "ro").exists()


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
        swapper.assert_racer_dir_left_alone()  # never removed: not ours
    else:
        assert _staging_names(parent) == []


_COMP = st.sampled_from(["a", "b", "..", ".", "", "c d", "\udcff", "x" * 10])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(comps=st.lists(_COMP, max_size=6), lead=st.sampled_from(["", "/", "//"]), as_bytes=st.booleans())
def test_property_subtree_paths_stay_beneath_their_directory(layout, comps, lead, as_bytes):
    """Any argument path: a Subtree call is refused or acts beneath its directory; a mkdir through
    it never creates anything beside the directory or outside the workspace."""
    text = lead + "/".join(comps)
    arg = os.fsencode(text) if as_bytes else text
    (layout.ws / "sub").mkdir(exist_ok=True)
    before_out = layout.snapshot()
    with open_root(layout.ws) as root:
        sub = _subtree(root, layout, "sub")
        before = sorted(os.listdir(layout.ws))
        try:
            sub.mkdir(arg, exist_ok=True)
        except (SandboxError, OSError):
            pass
        assert sorted(os.listdir(layout.ws)) == before  # only beneath sub/ can anything appear
    layout.assert_outside_unchanged(before_out)


# ---------------------------------------------------- the review of the fix: guards stay on every path


@pytest.mark.parametrize("source", ["stream", "file"])
def test_read_only_grant_put_at_the_staging_name_is_never_written(layout, tmp_path, monkeypatch, resolver, source):
    """A racer renames the staging directory away and a read-only grant nested in the workspace to the
    staging name: no member may be created in the grant (the fast paths that skip Root's write
    guard are off when the Root has read-only grants; every other call checks the identity)."""
    from sandbox_fs.paths import Grant, PathPolicy

    ro = layout.ws / "ro_grant"
    ro.mkdir()
    (ro / "config").write_text("host config\n")
    data = tar_bytes(_members())
    (tmp_path / "a.tar").write_bytes(data)

    class _ToGrant(_Swapper):
        def swap(self) -> None:
            if self.at_swap is None:
                name = _staging_names(self.parent)[0]
                os.rename(self.parent / name, self.stolen)
                os.rename(ro, self.parent / name)
                self.at_swap = _files(self.stolen)

    swapper = _ToGrant(layout, layout.ws)
    _swap_at_member(monkeypatch, swapper, 3)
    with open_root(layout.ws) as wsroot:
        pol = PathPolicy(wsroot, "/workspace", [Grant(str(ro), read_only=True)])
        try:
            assert pol.workspace.denies_writes
            with pytest.raises((DirectoryReplacedError, UnsafeArchiveMemberError)):
                extract(pol.workspace, ".", io.BytesIO(data) if source == "stream" else tmp_path / "a.tar")
        finally:
            pol.close()
    swapper.assert_nothing_followed()
    grant_now = layout.ws / _staging_names(layout.ws)[0]
    assert _files(grant_now) == {"config": b"host config\n"}  # nothing written into the grant


def test_hydrate_never_changes_what_another_process_put_at_its_staging_name(layout, store, monkeypatch, tmp_path):
    """Between the extractor's move and hydrate's next step, the staging name is made a hard link to
    an outside file: hydrate's chmod of its staging directory (and everything after) is refused by
    identity, the outside file's mode and content are unchanged, the workspace is untouched."""
    from sandbox_fs import snapshot as snap

    live = _saved(layout, store)
    target = layout.outside / "sentinel.txt"
    before = layout.snapshot()
    real = snap._hydrate._extract_with_archive

    def extract_then_swap(ws, dest, *a, **kw):
        real(ws, dest, *a, **kw)
        os.rename(layout.ws / dest, tmp_path / "ours-moved")
        os.link(target, layout.ws / dest)

    monkeypatch.setattr(snap._hydrate, "_extract_with_archive", extract_then_swap)
    with open_root(layout.ws) as ws, pytest.raises((DirectoryReplacedError, NotADirectoryError)):
        hydrate(ws, store, "s")
    after = layout.snapshot()
    # mode, size, mtime and content unchanged (the link count is the hard link left at the name)
    assert {k: v[:4] + v[5:] for k, v in after.items()} == {k: v[:4] + v[5:] for k, v in before.items()}
    left = {k: v for k, v in _files(layout.ws).items() if not k.startswith(".sfs-")}
    assert left == live


def _outside_file(layout) -> tuple:
    p = layout.outside / "secret.txt"
    os.chmod(p, 0o600)
    st_ = os.stat(p)
    return p, (stat.S_IMODE(st_.st_mode), st_.st_uid, st_.st_gid, st_.st_mtime_ns)


def _meta(p) -> tuple:
    st_ = os.stat(p)
    return stat.S_IMODE(st_.st_mode), st_.st_uid, st_.st_gid, st_.st_mtime_ns


@pytest.mark.skipif(os.geteuid() != 0, reason="preserve_owner applies owners only as root")
def test_directory_metadata_never_reaches_a_hard_link_swapped_in(layout, monkeypatch, resolver):
    """A staged directory swapped for a hard link to an outside file just before the directory
    metadata pass: mode, owner (preserve_owner, as root) and mtime are set through a directory fd,
    so the outside file keeps its mode, owner and mtime."""
    target, before = _outside_file(layout)
    os.link(target, layout.ws / "planted")
    data = tar_bytes([ti("d", "dir", mode=0o777), ti("d/f", data=b"x")])
    real_scandir = os.scandir
    done = []

    class _Listing:
        """os.scandir of the staging root; once the pass has seen ``d`` as a directory, swap it."""

        def __init__(self, fd):
            self._it = real_scandir(fd)
            self._names = []

        def __enter__(self):
            return self

        def __iter__(self):
            for ent in self._it:
                self._names.append(ent.name)
                yield ent

        def __exit__(self, *exc):
            self._it.close()
            stg = _staging_names(layout.ws)
            if "d" in self._names and stg and not done:
                done.append(1)
                os.rename(layout.ws / stg[0] / "d", layout.base / "moved-d")
                os.rename(layout.ws / "planted", layout.ws / stg[0] / "d")

    monkeypatch.setattr(_writer.os, "scandir", lambda fd: _Listing(fd))
    with open_root(layout.ws) as root:
        try:
            extract(root, "out", io.BytesIO(data), policy=ExtractPolicy(preserve_owner=True))
        except (SandboxError, OSError):
            pass
    assert done, "the swap never happened"
    assert _meta(target) == before


def test_symlink_time_never_reaches_a_hard_link_swapped_in(layout, monkeypatch, resolver):
    """The symlink member's mtime is set through an O_PATH fd checked to be a symlink with one
    link: a name swapped for a hard link to an outside file is refused, the file's mtime kept."""
    target, before = _outside_file(layout)
    os.link(target, layout.ws / "planted")
    data = tar_bytes([ti("f", data=b"x"), ti("l", "symlink", linkname="f")])
    real = Subtree.symlink

    def symlink_then_swap(self, tgt, path):
        real(self, tgt, path)
        stg = _staging_names(layout.ws)[0]
        os.unlink(layout.ws / stg / "l")
        os.rename(layout.ws / "planted", layout.ws / stg / "l")

    monkeypatch.setattr(Subtree, "symlink", symlink_then_swap)
    with open_root(layout.ws) as root, pytest.raises(UnsafeArchiveMemberError) as ei:
        extract(root, "out", io.BytesIO(data))
    assert ei.value.rule == "conflict"
    assert _meta(target) == before


def test_hydrate_modes_never_reach_a_hard_link_swapped_in(layout, store, monkeypatch, resolver):
    """Snapshot modes are applied by the extractor through the fds it makes the entries with: a
    staged file or directory swapped for a hard link to an outside file afterwards is never
    chmod'ed (hydrate restores 0o777 modes here, persist recorded them)."""
    target, before = _outside_file(layout)
    (layout.ws / "d").mkdir()
    (layout.ws / "d" / "f").write_text("x")
    os.chmod(layout.ws / "d" / "f", 0o777)
    os.chmod(layout.ws / "d", 0o777)
    with open_root(layout.ws) as ws:
        persist(ws, store, "s")
    os.link(target, layout.ws / "planted")
    real = _writer.Extractor.finish

    def swap_then_finish(self):
        self.flush()
        stg = _staging_names(layout.ws)[0]
        os.rename(layout.ws / stg / "d" / "f", layout.base / "moved-f")
        os.link(layout.ws / "planted", layout.ws / stg / "d" / "f")
        return real(self)

    monkeypatch.setattr(_writer.Extractor, "finish", swap_then_finish)
    with open_root(layout.ws) as ws:
        try:
            hydrate(ws, store, "s")
        except (SandboxError, OSError):
            pass
    assert _meta(target) == before


def test_remove_tree_rechecks_the_name_before_the_last_rmdir(layout, monkeypatch):
    (layout.ws / "a" / "x").mkdir(parents=True)
    from sandbox_fs.root import Root

    real_clear = Root.clear

    def clear_then_swap(self, **kw):
        real_clear(self, **kw)
        os.rename(layout.ws / "a", layout.base / "ours-moved")
        os.mkdir(layout.ws / "a")  # an empty directory someone else put at the name

    with open_root(layout.ws) as root:
        sub = _subtree(root, layout)
        monkeypatch.setattr(Root, "clear", clear_then_swap)
        assert sub.remove_tree() is False
    assert (layout.ws / "a").is_dir()  # theirs: left alone


def test_a_cleanup_error_never_hides_the_error_that_failed_the_run(layout, monkeypatch):
    def busy(self):
        raise OSError(16, "Device or resource busy")

    monkeypatch.setattr(Subtree, "remove_tree", busy)
    data = tar_bytes([ti("ok", data=b"x"), ti("../evil", data=b"x")])
    with open_root(layout.ws) as root, pytest.raises(UnsafeArchiveMemberError) as ei:
        extract(root, "out", io.BytesIO(data))
    assert ei.value.rule == "dotdot"


# ------------------------------------- the third review: every fd-based write keeps the write guard


def _grant_policy(wsroot, ro):
    from sandbox_fs.paths import Grant, PathPolicy
    return PathPolicy(wsroot, "/workspace", [Grant(str(ro), read_only=True)])


def test_mkdir_never_chmods_a_grant_put_at_the_new_name(layout, monkeypatch, resolver):
    """Root.mkdir sets the asked mode through a fd checked to be the directory it made and
    writable: a read-only grant renamed to the new name right after mkdirat keeps its mode."""
    from sandbox_fs import root as root_mod
    from sandbox_fs.errors import ReadOnlyError

    ro = layout.ws / "ro_grant"
    ro.mkdir()
    os.chmod(ro, 0o555)
    real = os.mkdir
    fired = []

    def mkdir(path, mode=0o777, *, dir_fd=None):
        real(path, mode, dir_fd=dir_fd)
        if path == b"d" and not fired:
            fired.append(1)
            os.rename(layout.ws / "d", layout.base / "ours-moved")
            os.rename(ro, layout.ws / "d")

    with open_root(layout.ws) as wsroot:
        pol = _grant_policy(wsroot, ro)
        try:
            monkeypatch.setattr(root_mod.os, "mkdir", mkdir)
            with pytest.raises((ReadOnlyError, DirectoryReplacedError)):
                pol.workspace.mkdir("d", 0o777)
        finally:
            monkeypatch.setattr(root_mod.os, "mkdir", real)
            pol.close()
    assert fired and stat.S_IMODE(os.stat(layout.ws / "d").st_mode) == 0o555


def test_symlink_time_never_reaches_a_grant_swapped_in(layout, monkeypatch, resolver):
    """The symlink's directory is checked to be the one made for it, and writable, before its
    time is set: a read-only grant holding a same-named symlink, swapped in, is never changed."""
    ro = layout.ws / "ro_grant"
    ro.mkdir()
    (ro / "config").write_text("cfg")
    os.symlink("config", ro / "l")
    os.utime(ro / "l", ns=(10**18, 10**18), follow_symlinks=False)
    data = tar_bytes([ti("d", "dir"), ti("d/f", data=b"x"), ti("d/l", "symlink", linkname="f")])
    real = Subtree.symlink
    fired = []

    def symlink_then_swap(self, tgt, path):
        real(self, tgt, path)
        if path == b"d/l" and not fired:
            fired.append(1)
            stg = _staging_names(layout.ws)[0]
            os.rename(layout.ws / stg / "d", layout.base / "ours-moved")
            os.rename(ro, layout.ws / stg / "d")

    monkeypatch.setattr(Subtree, "symlink", symlink_then_swap)
    with open_root(layout.ws) as wsroot:
        pol = _grant_policy(wsroot, ro)
        try:
            with pytest.raises(SandboxError):
                extract(pol.workspace, "out", io.BytesIO(data))
        finally:
            pol.close()
    assert fired
    (grant_now,) = [p for p in layout.ws.rglob("config")]
    assert os.lstat(grant_now.parent / "l").st_mtime_ns == 10**18


@pytest.mark.parametrize("preserve_owner", [False, True])
def test_directory_metadata_only_on_the_directory_made(layout, monkeypatch, resolver, preserve_owner):
    """Between listing the directories and setting their metadata, a staged directory is swapped
    for another directory of the workspace: refused (identity recorded when it was made); the
    other directory keeps its mode, owner and mtime."""
    from sandbox_fs.root import Root

    other = layout.ws / "home"
    other.mkdir()
    os.chmod(other, 0o700)
    os.utime(other, (5, 5))
    before = _meta(other)
    data = tar_bytes([ti("d", "dir", mode=0o755), ti("d/f", data=b"x")])
    real = Root.open_fd
    seen = []

    def open_fd(self, path, flags=os.O_RDONLY, mode=0o644, **kw):
        if path == b"d" and flags & os.O_DIRECTORY:
            seen.append(1)
            if len(seen) == 2:  # the metadata pass
                stg = _staging_names(layout.ws)[0]
                os.rename(layout.ws / stg / "d", layout.base / "ours-moved")
                os.rename(other, layout.ws / stg / "d")
        return real(self, path, flags, mode, **kw)

    monkeypatch.setattr(Root, "open_fd", open_fd)
    with open_root(layout.ws) as root, pytest.raises(UnsafeArchiveMemberError) as ei:
        extract(root, "out", io.BytesIO(data), policy=ExtractPolicy(preserve_owner=preserve_owner))
    assert ei.value.rule == "conflict" and len(seen) >= 2
    moved = [p for p in layout.ws.rglob("*") if p.is_dir() and _meta(p)[3] == before[3]]
    assert not moved or all(_meta(p) == before for p in moved)


def test_fd_chmod_without_proc_is_an_error_not_a_vanished_entry(monkeypatch):
    """On a kernel without fchmodat2 (ENOSYS), changing an O_PATH fd's inode goes through
    /proc/self/fd; without /proc that is EOPNOTSUPP, never FileNotFoundError (a recursive removal
    would take it for a vanished entry and skip it)."""
    import errno as _errno
    import tempfile as _tf

    from sandbox_fs import root as root_mod

    monkeypatch.setattr(root_mod._native, "fchmod_empty", lambda fd, mode: -_errno.ENOSYS)

    real_chmod = os.chmod

    def no_proc(path, *a, **kw):
        if str(path).startswith("/proc/self/fd/"):
            raise FileNotFoundError(2, "No such file or directory")
        return real_chmod(path, *a, **kw)

    d = _tf.mkdtemp()
    try:
        fd = os.open(d, os.O_PATH | os.O_DIRECTORY)
        try:
            monkeypatch.setattr(root_mod.os, "chmod", no_proc)
            with pytest.raises(OSError) as ei:
                root_mod.fd_chmod(fd, 0o700)
            assert ei.value.errno == __import__("errno").EOPNOTSUPP
        finally:
            os.close(fd)
    finally:
        os.rmdir(d)


def test_fd_chmod_of_an_o_path_fd_needs_no_proc(monkeypatch):
    """With fchmodat2 (Linux 6.6), an O_PATH fd's mode changes without the /proc magic link."""
    import tempfile as _tf

    from sandbox_fs import root as root_mod

    def no_proc(path, *a, **kw):
        raise AssertionError(f"fd_chmod went by name: {path!r}")

    d = _tf.mkdtemp()
    try:
        fd = os.open(d, os.O_PATH | os.O_DIRECTORY)
        try:
            monkeypatch.setattr(root_mod.os, "chmod", no_proc)
            root_mod.fd_chmod(fd, 0o701)
            assert os.stat(d).st_mode & 0o7777 == 0o701
        finally:
            os.close(fd)
    finally:
        os.rmdir(d)


def test_hydrate_refuses_an_entry_where_a_kept_grant_is_before_any_change(layout, store):
    """A snapshot holding an entry at the path of a directory hydrate must keep (a read-only grant
    nested in the workspace): refused before the clear, the workspace unchanged."""
    (layout.ws / "granted").mkdir()
    (layout.ws / "granted" / "x").write_text("snap")
    (layout.ws / "own").write_text("own")
    with open_root(layout.ws) as ws:
        persist(ws, store, "s")
    (layout.ws / "own").write_text("changed")
    (layout.ws / "granted" / "x").write_text("host data")
    st_ = os.stat(layout.ws / "granted")
    with open_root(layout.ws) as ws, pytest.raises(SnapshotError) as ei:
        hydrate(ws, store, "s", keep_identities=[(st_.st_dev, st_.st_ino)])
    assert "read-only grant" in str(ei.value)
    assert (layout.ws / "own").read_text() == "changed" and (layout.ws / "granted" / "x").read_text() == "host data"
    assert _staging_names(layout.ws) == []


# ---------------------------------- the sixth review: a racer swapping a grant in during the restore


def _exchange(a, b) -> None:
    from sandbox_fs import _native
    _native.renameat2(-100, os.fsencode(a), -100, os.fsencode(b), _native.lib.RENAME_EXCHANGE, "test", None)


def _grant_with_snapshot(layout, store, grant_mode: int = 0o555):
    """A snapshot with ``d/`` and ``decoy/`` directories, then a read-only grant ``granted`` (host data)."""
    for d in ("d", "decoy"):
        (layout.ws / d).mkdir()
        (layout.ws / d / "SNAP").write_text("from snapshot")
    with open_root(layout.ws) as ws:
        persist(ws, store, "s")
    g = layout.ws / "granted"
    g.mkdir()
    (g / "host.txt").write_text("host data")
    os.chmod(g, grant_mode)
    st_ = os.stat(g)
    return g, (st_.st_dev, st_.st_ino), os.open(g, os.O_PATH)


def _grant_intact(gfd: int, mode: int) -> bool:
    st_ = os.fstat(gfd)
    return st_.st_nlink > 0 and stat.S_IMODE(st_.st_mode) == mode and \
        sorted(os.listdir(f"/proc/self/fd/{gfd}")) == ["host.txt"]


def test_clear_keeps_a_grant_swapped_in_after_its_name_was_looked_at(layout, store, monkeypatch, resolver):
    """The clear looks at ``decoy`` (not kept), then the racer exchanges it with the grant before the
    clear opens it: the identity is checked on the fd entered, the grant kept, never emptied."""
    from sandbox_fs import _root_remove

    g, gid, gfd = _grant_with_snapshot(layout, store)
    real = _root_remove._open_dir_entered
    fired = []

    def exchange_then_open(self, dfd, name, flags, writable, keep_denied=False):
        if name == b"decoy" and not fired:
            fired.append(1)
            _exchange(layout.ws / "decoy", g)
        return real(self, dfd, name, flags, writable, keep_denied)

    monkeypatch.setattr(_root_remove, "_open_dir_entered", exchange_then_open)
    try:
        with open_root(layout.ws) as ws:
            try:
                hydrate(ws, store, "s", keep_identities=[gid])
            except (SandboxError, OSError):
                pass
        assert fired and _grant_intact(gfd, 0o555)
    finally:
        os.close(gfd)


def test_restore_never_merges_into_a_grant_swapped_in_at_a_merge_target(layout, store, monkeypatch, resolver):
    """After the clear the racer puts its own ``d`` there (so the staged ``d`` is merged into it),
    then exchanges ``d`` with the grant just before a staged entry is moved into ``d``: the move
    checks its parent's fd against the grants and is refused."""
    from sandbox_fs.root import Root

    g, gid, gfd = _grant_with_snapshot(layout, store)
    real = Root.rename
    fired = []

    def exchange_then_rename(self, src, dst, **kw):
        if dst == "d" and not (layout.ws / "d").exists():
            (layout.ws / "d").mkdir()  # the racer's own "d": the staged one is merged into it
        elif str(dst).startswith("d/") and not fired:
            fired.append(1)
            _exchange(layout.ws / "d", g)  # checked by name a moment ago; the grant now
        return real(self, src, dst, **kw)

    monkeypatch.setattr(Root, "rename", exchange_then_rename)
    try:
        with open_root(layout.ws) as ws:
            try:
                hydrate(ws, store, "s", keep_identities=[gid])
            except (SandboxError, OSError):
                pass
        assert fired and _grant_intact(gfd, 0o555)
    finally:
        os.close(gfd)


def test_an_empty_grant_exchanged_in_at_a_removed_name_is_never_removed(layout, store, monkeypatch, resolver):
    """Seventh review: the clear's last ``rmdir`` of an emptied directory goes by name; the racer
    exchanges that name with an EMPTY read-only grant just before it.  The directory is moved into
    a private directory and checked there first: the grant is moved back, never removed."""
    for d in ("d", "decoy"):
        (layout.ws / d).mkdir()
    (layout.ws / "d" / "SNAP").write_text("from snapshot")
    with open_root(layout.ws) as ws:
        persist(ws, store, "s")
    g = layout.ws / "granted"
    g.mkdir()
    os.chmod(g, 0o555)
    st_ = os.stat(g)
    gfd = os.open(g, os.O_PATH)
    from sandbox_fs import root as root_mod
    fired = []

    def exchange_first(real, names_decoy):
        """``real``, after exchanging ``decoy`` with the grant the first time it acts on ``decoy``."""
        def hooked(*a, **kw):
            if not fired and names_decoy(a):
                fired.append(1)
                _exchange(layout.ws / "decoy", g)
            return real(*a, **kw)
        return hooked

    # the previous code removed by name (os.rmdir); this one moves the name first (renameat2)
    monkeypatch.setattr(root_mod.os, "rmdir", exchange_first(os.rmdir, lambda a: a[0] in (b"decoy", "decoy")))
    monkeypatch.setattr(root_mod._native, "renameat2",
                        exchange_first(root_mod._native.renameat2, lambda a: a[1] == b"decoy"))
    try:
        with open_root(layout.ws) as ws:
            try:
                hydrate(ws, store, "s", keep_identities=[(st_.st_dev, st_.st_ino)])
            except (SandboxError, OSError):
                pass
        monkeypatch.undo()
        assert fired and os.fstat(gfd).st_nlink > 0  # the grant still exists
        assert stat.S_IMODE(os.fstat(gfd).st_mode) == 0o555
    finally:
        os.close(gfd)
        monkeypatch.undo()


def test_checked_rmdir_works_through_its_private_directory_fd(layout, monkeypatch, resolver):
    """Eighth review: after moving the directory into its private ``.sfs-rm-*`` directory, a racer
    exchanges that name with a symlink to outside; every later step goes through the private
    directory's fd, so nothing outside is removed (the old path ``.sfs-rm-*/d`` followed the link)."""
    from sandbox_fs import root as root_mod
    from sandbox_fs.paths import Grant, PathPolicy

    (layout.outside / "d").mkdir()  # an empty directory outside: the target
    ro = layout.ws / "ro_grant"
    ro.mkdir()
    (layout.ws / "d").mkdir()
    os.symlink(layout.outside, layout.ws / "lnk")
    real = root_mod._native.renameat2
    fired = []

    def move_then_exchange(olddirfd, old, newdirfd, new, flags, op, shown):
        real(olddirfd, old, newdirfd, new, flags, op, shown)
        if old == b"d" and not fired:
            fired.append(1)
            (trash,) = [n for n in os.listdir(layout.ws) if n.startswith(".sfs-rm-")]
            _exchange(layout.ws / trash, layout.ws / "lnk")

    with open_root(layout.ws) as wsroot:
        pol = PathPolicy(wsroot, "/workspace", [Grant(str(ro), read_only=True)])
        try:
            monkeypatch.setattr(root_mod._native, "renameat2", move_then_exchange)
            try:
                pol.workspace.rmdir("d")
            except (SandboxError, OSError):
                pass
            monkeypatch.undo()
        finally:
            pol.close()
    assert fired and (layout.outside / "d").is_dir()
    assert not (layout.ws / "d").exists()  # ours was removed, inside its private directory
