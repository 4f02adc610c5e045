"""Root ``owner``: every entry the library creates through a Root with an owner gets it, through the new entry's fd.

Issue 11 (A): the confined command runs as an unprivileged identity, so the
workspace content it must write is owned by that identity.  Materialize,
extract, hydrate and the Root's own file operations create entries with that
owner (``fchown`` of the fd they made the entry with, never by name), and a
name swapped meanwhile for a hard link to a file outside never gives that
file away.  Every test checks the owners on the host (``lstat``), and the
attack tests an outside sentinel's owner.
"""

from __future__ import annotations

import errno
import io
import os
import stat
import subprocess
import sys
import tarfile
import threading
import zipfile
from pathlib import Path

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandbox_fs import open_root
from sandbox_fs import _native
from sandbox_fs.archive import ExtractPolicy, extract
from sandbox_fs.errors import DirectoryReplacedError, InvalidArgumentError
from sandbox_fs.manifest import load_manifest
from sandbox_fs.materialize import MaterializeOptions, materialize
from sandbox_fs.root import Subtree
from sandbox_fs.snapshot import LocalSnapshotStore, hydrate, persist

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="giving entries another owner needs root (CAP_CHOWN)")

OWNER = (4000123, 4000456)  # ids no account on the machine uses
ME = (os.geteuid(), os.getegid())


def owners(top: Path, *, include_top: bool = False) -> dict[str, tuple[int, int]]:
    """``(uid, gid)`` of every node under ``top`` (lstat: symlinks themselves)."""
    out = {}
    if include_top:
        st_ = top.lstat()
        out["."] = (st_.st_uid, st_.st_gid)
    for dirpath, dirs, files in os.walk(top, followlinks=False):
        for n in dirs + files:
            p = Path(dirpath, n)
            s = p.lstat()
            out[str(p.relative_to(top))] = (s.st_uid, s.st_gid)
    return out


def own(p: Path) -> tuple[int, int]:
    s = p.lstat()
    return s.st_uid, s.st_gid


def assert_all_owned(top: Path, owner=OWNER) -> dict[str, tuple[int, int]]:
    got = owners(top)
    wrong = {k: v for k, v in got.items() if v != owner}
    assert not wrong, f"entries not owned by {owner}: {wrong}"
    return got


# ------------------------------------------------------------------ arguments


@pytest.mark.parametrize("bad", [(-1, 0), (0, -1), (1 << 32) - 1, ((1 << 32) - 1, 0), (0, 1 << 32), (True, 0),
                                 [1, 2], (1, 2, 3), ("1", 2), (1.0, 2)])
def test_bad_owner_is_refused(layout, bad):
    with pytest.raises(InvalidArgumentError) as ei:
        open_root(layout.ws, owner=bad)
    assert ei.value.code == "invalid_argument" and str(layout.base) not in str(ei.value)
    with open_root(layout.ws) as r, pytest.raises(InvalidArgumentError):
        r.with_options(owner=bad)


def test_owner_is_inherited(layout, resolver):
    (layout.ws / "sub").mkdir()
    with open_root(layout.ws, owner=OWNER) as r:
        assert r.owner == OWNER
        with r.open_root("sub") as c, r.with_options(no_symlinks=True) as w, r.with_options(owner=(7, 8)) as o:
            assert (c.owner, w.owner, o.owner) == (OWNER, OWNER, (7, 8))
    with open_root(layout.ws) as r, r.with_options(owner=OWNER) as w:
        assert (r.owner, w.owner) == (None, OWNER)


# ----------------------------------------------------------- every create path


def test_root_create_paths_give_the_owner(layout, resolver):
    ws = layout.ws
    (ws / "pre").write_bytes(b"existing")
    (ws / "predir").mkdir()
    with open_root(ws, owner=OWNER) as r:
        os.close(r.open_fd("excl", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.close(r.open_fd("creat", os.O_WRONLY | os.O_CREAT, 0o600))
        os.close(r.open_fd("pre", os.O_WRONLY | os.O_CREAT, 0o600))  # exists: left alone
        with r.open("w.txt", "w") as f:
            f.write("w")
        with r.open("pre", "a") as f:  # exists: left alone
            f.write("more")
        with r.open("x.txt", "xb") as f:
            f.write(b"x")
        r.write_bytes("wb", b"1")
        r.write_text("wt", "2")
        r.atomic_write("aw", iter([b"a", b"b"]), mode=0o640)
        r.atomic_write("explicit", b"e", owner=(7, 8))  # an explicit owner wins over the Root's
        r.mkdir("d")
        r.mkdir("p/q/r", parents=True)
        r.mkdir("predir", exist_ok=True)  # exists: left alone
        r.symlink("w.txt", "link")
        r.symlink("../../w.txt", "p/q/uplink")
        r.link("w.txt", "hard")  # no new inode: the target's owner, whatever it is
        os.link(ws / "pre", ws / "pre-hard")
        r.link("pre-hard", "hard2")
        fd = r.open_fd("d", os.O_WRONLY | _native.O_TMPFILE, 0o600)
        try:
            assert (os.fstat(fd).st_uid, os.fstat(fd).st_gid) == OWNER
        finally:
            os.close(fd)
        sub = Subtree(r, "d", (r.lstat("d").st_dev, r.lstat("d").st_ino))
        sub.mkdir("sd")
        sub.atomic_write("sf", b"s")
        sub.symlink("sf", "sl")
        os.close(sub.open_fd("so", os.O_WRONLY | os.O_CREAT | os.O_EXCL))
    got = owners(ws)
    expect_mine = {"pre", "predir", "pre-hard", "hard2"}
    assert {k for k, v in got.items() if v == ME} == expect_mine
    assert got["explicit"] == (7, 8)
    assert {k for k, v in got.items() if v == OWNER} == set(got) - expect_mine - {"explicit"}
    assert stat.S_IMODE((ws / "aw").stat().st_mode) == 0o640 and stat.S_IMODE((ws / "d").stat().st_mode) == 0o755
    assert os.readlink(ws / "p/q/uplink") == "../../w.txt"


def test_without_owner_nothing_changes(layout, resolver):
    with open_root(layout.ws) as r:
        r.write_bytes("f", b"1")
        r.mkdir("d")
        r.symlink("f", "l")
        os.close(r.open_fd("c", os.O_WRONLY | os.O_CREAT, 0o600))
    assert set(owners(layout.ws).values()) == {ME}


@pytest.mark.parametrize("digest", [True, False])
def test_copy_files_from_gives_the_owner(layout, resolver, digest):
    src = layout.base / "src"
    (src / "a").mkdir(parents=True)
    for i in range(70):  # more than one native group
        (src / "a" / f"f{i}").write_bytes(b"x" * i)
    (src / "a" / "big").write_bytes(os.urandom(9000))  # over the buffer: finished in Python
    (layout.ws / "a").mkdir()
    items = [(f"a/{n}", f"a/{n}", 0o644, None, None) for n in sorted(os.listdir(src / "a"))]
    with open_root(src, read_only=True) as s, open_root(layout.ws, owner=OWNER) as r:
        res = r.copy_files_from(s, items, digest=digest, buffer_bytes=4096)
    assert len(res) == 71
    got = owners(layout.ws / "a")
    assert set(got.values()) == {OWNER} and len(got) == 71
    assert (layout.ws / "a" / "big").read_bytes() == (src / "a" / "big").read_bytes()


def test_native_batches_take_owner_ids(tmp_path, resolver):
    from array import array

    src = tmp_path / "src"
    src.write_bytes(b"s" * 100)
    stage = tmp_path / "stage"
    stage.mkdir()
    sfd = os.open(src, os.O_RDONLY)
    dfd = os.open(stage, os.O_PATH | os.O_DIRECTORY)
    try:
        nums = array("q", [0, 5, -1, 0o644, 0, 0, 0, 5, -1, 0o644, 0, 0])
        assert _native.extract_files(sfd, dfd, resolver, nums, bytearray(b"a\0b\0"), 2, OWNER)[0] == 2
        assert _native.extract_files(sfd, dfd, resolver, nums, bytearray(b"c\0"), 1, None)[0] == 1
        assert (own(stage / "a"), own(stage / "b"), own(stage / "c")) == (OWNER, OWNER, ME)
        # an id fchown cannot take is refused in C too, and the file it made is removed
        out = _native.ffi.new("int64_t[2]")
        done = _native.lib.sfs_extract_files(sfd, _native.ffi.NULL, 0, dfd, 0 if resolver == "openat2" else 1,
                                             _native.ffi.from_buffer("int64_t[]", nums), b"d\0", 2, 1, out,
                                             1 << 32, 0)
        assert done == 0 and (out[0], out[1]) == (errno.EINVAL, _native.XF_STAGE_META)
        assert sorted(os.listdir(stage)) == ["a", "b", "c"]
    finally:
        os.close(sfd)
        os.close(dfd)


def test_old_native_build_fails_with_the_abi_message(tmp_path):
    """A native module built before the owner arguments (ABI 6) is refused at import with a clear message."""
    code = (
        "import sys, types\n"
        "fake = types.ModuleType('sandbox_fs._sfs_native')\n"
        "fake.ffi = None\n"
        "fake.lib = types.SimpleNamespace(SFS_ABI_VERSION=6)\n"
        "sys.modules['sandbox_fs._sfs_native'] = fake\n"
        "try:\n"
        "    import sandbox_fs\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, getattr(exc, 'code', None), exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert out.startswith("NativeUnavailableError native_unavailable")
    assert f"native ABI 6 does not match the Python package (expects {_native.EXPECTED_ABI}); rebuild" in out
    assert _native.EXPECTED_ABI == _native.lib.SFS_ABI_VERSION == 11


# ----------------------------------------------------------------- extraction


def _tar(members: list[tuple[str, str, bytes | str]], *, owner: tuple[int, int] = (0, 0), gz: bool = False) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w", format=tarfile.PAX_FORMAT) as tf:
        for name, kind, data in members:
            info = tarfile.TarInfo(name)
            info.uid, info.gid = owner
            info.mtime = 1_600_000_000
            if kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tf.addfile(info)
            elif kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, str(data)
                tf.addfile(info)
            elif kind == "hardlink":
                info.type, info.linkname = tarfile.LNKTYPE, str(data)
                tf.addfile(info)
            else:
                assert isinstance(data, bytes)
                info.size, info.mode = len(data), 0o644
                tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


_MEMBERS = [("top", "dir", b""), ("top/sub", "dir", b""), ("top/sub/f", "file", b"data"),
            ("implied/deep/g", "file", b"g" * 5000), ("big", "file", os.urandom(9 << 20)),
            ("top/link", "symlink", "sub/f"), ("top/hard", "hardlink", "top/sub/f")]


def _zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("z/a.txt", b"a")
        zf.writestr("z/d/", b"")
        zf.writestr("z/d/b.txt", b"b" * 3000)
        info = zipfile.ZipInfo("z/l")
        info.external_attr = (stat.S_IFLNK | 0o777) << 16
        zf.writestr(info, "a.txt")
    return buf.getvalue()


@pytest.mark.parametrize("how", ["file", "stream", "gz", "in_place", "existing", "zip", "preserve_owner"])
def test_extract_gives_every_entry_the_owner(layout, resolver, tmp_path, how, monkeypatch):
    """Batched (uncompressed tar from a file), one by one, compressed, in place, into an existing
    destination (the root: hydrate's case) and zip: directories, files, symlinks and the staging
    directory all get the Root's owner; archive owners never win over it."""
    from sandbox_fs.archive import _writer

    batches = []
    real = _writer._native.extract_files
    monkeypatch.setattr(_writer._native, "extract_files", lambda *a: batches.append(a[6]) or real(*a))
    before = owners(layout.outside, include_top=True)
    data = _zip() if how == "zip" else _tar(_MEMBERS, owner=(11, 12), gz=how == "gz")
    src: object = io.BytesIO(data)
    if how in ("file", "existing", "preserve_owner", "zip"):
        src = tmp_path / "a.archive"
        src.write_bytes(data)
    policy = ExtractPolicy(in_place=how == "in_place", preserve_owner=how == "preserve_owner")
    dest = "." if how == "existing" else "dest"
    with open_root(layout.ws, owner=OWNER) as r:
        rep = extract(r, dest, src, policy=policy)
    top = layout.ws if dest == "." else layout.ws / "dest"
    got = assert_all_owned(top)
    if how == "zip":
        assert rep.files == 2 and rep.symlinks == 1 and os.readlink(top / "z/l") == "a.txt"
    else:
        assert rep.hardlinks == 1 and rep.symlinks == 1 and (top / "top/hard").read_bytes() == b"data"
        assert "implied/deep" in got and (top / "big").stat().st_size == 9 << 20
    assert (batches == [OWNER]) == (how in ("file", "existing", "preserve_owner"))  # the native batch path
    if dest != ".":
        assert own(top) == OWNER  # the destination made (the staging directory renamed, or made in place)
    assert not [n for n in os.listdir(layout.ws) if n.startswith(".sfs-")]
    assert owners(layout.outside, include_top=True) == before


def test_extract_without_owner_keeps_preserve_owner(layout, tmp_path):
    src = tmp_path / "a.tar"
    src.write_bytes(_tar([("d", "dir", b""), ("d/f", "file", b"1")], owner=(11, 12)))
    with open_root(layout.ws) as r:
        extract(r, "dest", src, policy=ExtractPolicy(preserve_owner=True))
    assert owners(layout.ws / "dest") == {"d": (11, 12), "d/f": (11, 12)}


# ---------------------------------------------------------------- materialize


async def test_materialize_gives_every_entry_the_owner(layout, resolver):
    base = layout.base / "base"
    (base / "proj" / "sub" / "deeper").mkdir(parents=True)
    for i in range(80):
        (base / "proj" / "sub" / f"f{i}").write_bytes(b"z" * i)
    (base / "proj" / "big").write_bytes(os.urandom(3 << 20))
    os.symlink("../big", base / "proj" / "sub" / "inside_link")
    os.link(base / "proj" / "big", base / "proj" / "big_hard")
    os.chown(base / "proj" / "sub" / "f1", 11, 12)  # the source's owners are never copied
    (base / "vendor.tar").write_bytes(_tar(_MEMBERS[:4] + _MEMBERS[5:], owner=(11, 12)))
    (base / "single").write_bytes(b"single")
    m = {"entries": {
        "README": {"type": "file", "content": "hello\n"},
        "data": {"type": "dir", "mode": 0o750, "children": {"x/y.txt": {"type": "file", "content": "y"}}},
        "single": {"type": "local_file", "src": "single"},
        "proj": {"type": "local_dir", "src": "proj"},
        "nested/proj2": {"type": "local_dir", "src": "proj"},
        "latest": {"type": "symlink", "target": "data/x/y.txt"},
        "vendor": {"type": "archive", "src": "vendor.tar"},
        "vendor_gz": {"type": "archive", "src": "vendor.tar"},
    }}
    before = owners(layout.outside, include_top=True)
    with open_root(layout.ws, owner=OWNER) as ws:
        res = await materialize(ws, load_manifest(m), MaterializeOptions(base_dir=str(base)))
    got = assert_all_owned(layout.ws)
    assert "proj/sub/deeper" in got and "nested" in got and "vendor/top/link" in got
    assert len(res.files) >= 80 and own(base / "proj" / "sub" / "f1") == (11, 12)
    assert set(owners(base).values()) <= {ME, (11, 12)}  # the trusted base is only read
    assert owners(layout.outside, include_top=True) == before


# ------------------------------------------------------------------- hydrate


def test_hydrate_gives_every_entry_the_owner(layout, resolver, tmp_path):
    ws = layout.ws
    (ws / "d" / "e").mkdir(parents=True)
    (ws / "d" / "e" / "f").write_bytes(b"f")
    (ws / "ro").mkdir(mode=0o500)
    os.symlink("d/e/f", ws / "l")
    (ws / "g").write_bytes(b"g" * 10000)
    os.link(ws / "g", ws / "g2")
    store = LocalSnapshotStore(tmp_path / "store")
    with open_root(ws, read_only=True) as r:
        persist(r, store, "s1")
    with tarfile.open(_archive(tmp_path)) as tf:
        assert {(m.uid, m.gid, m.uname, m.gname) for m in tf.getmembers()} == {(0, 0, "", "")}  # no owners
    before = owners(layout.outside, include_top=True)
    with open_root(ws, owner=OWNER) as r:
        hydrate(r, store, "s1")
    got = assert_all_owned(ws)
    assert set(got) == {"d", "d/e", "d/e/f", "ro", "l", "g", "g2"}
    assert stat.S_IMODE((ws / "ro").stat().st_mode) == 0o500
    assert owners(layout.outside, include_top=True) == before


def _archive(tmp_path: Path) -> Path:
    found = [p for p in (tmp_path / "store").rglob("*") if p.is_file() and p.name.startswith("s1")
             and not p.name.endswith((".json", ".lock"))]
    assert len(found) == 1, found
    return found[0]


# ------------------------------------------------------------------- property

_names = st.sampled_from(["a", "b", "c", "d", "é", "x y", "-", ".h"])
_trees = st.recursive(
    st.one_of(st.binary(max_size=64), st.just(None)),  # bytes: a file; None: a symlink to a sibling
    lambda kids: st.dictionaries(_names, kids, max_size=4),
    max_leaves=12,
)


def _build(top: Path, tree) -> None:
    top.mkdir()
    for name, sub in tree.items():
        p = top / name
        if isinstance(sub, dict):
            _build(p, sub)
        elif sub is None:
            os.symlink(".", p)
        else:
            p.write_bytes(sub)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(tree=st.dictionaries(_names, _trees, max_size=5), via=st.sampled_from(["tar", "tar-stream", "local_dir"]))
def test_property_every_entry_made_has_the_owner_and_nothing_outside_changes(layout, tree, via):
    run = layout.base / f"run-{os.urandom(4).hex()}"
    src, ws = run / "src", run / "ws"
    run.mkdir()
    _build(src, tree)
    ws.mkdir()
    sentinel = run / "beside"
    sentinel.mkdir()
    (sentinel / "keep").write_bytes(b"k")
    os.symlink("keep", sentinel / "keep-link")
    before = {**owners(sentinel, include_top=True), **{"outside:" + k: v for k, v in owners(layout.outside).items()}}
    if via.startswith("tar"):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            tf.add(src, arcname="t")
        arc = run / "a.tar"
        arc.write_bytes(buf.getvalue())
        with open_root(ws, owner=OWNER) as r:
            extract(r, "dest", arc if via == "tar" else io.BytesIO(buf.getvalue()))
        top = ws / "dest"
    else:
        m = {"entries": {"dest": {"type": "local_dir", "src": "src"}}}

        async def go() -> None:
            with open_root(ws, owner=OWNER) as r:
                await materialize(r, load_manifest(m), MaterializeOptions(base_dir=str(run)))

        trio.run(go)
        top = ws / "dest"
    got = assert_all_owned(top)
    assert own(top) == OWNER
    assert len(got) >= sum(1 for _ in os.walk(src)) - 1
    assert {**owners(sentinel, include_top=True),
            **{"outside:" + k: v for k, v in owners(layout.outside).items()}} == before


# ---------------------------------------------------------------------- races


def _outside_file(layout) -> Path:
    p = layout.outside / "victim"
    p.write_bytes(b"victim")
    return p


def _swap_for_hard_link(dfd: int, name: bytes, victim: Path) -> None:
    os.unlink(name, dir_fd=dfd)
    os.link(victim, name, dst_dir_fd=dfd)


def test_race_open_create_swapped_for_a_hard_link_before_the_chown(layout, resolver, monkeypatch):
    """Between the create and the chown another process puts a hard link to a file outside at the
    name: the chown goes through the created fd, so the outside file keeps its owner."""
    victim = _outside_file(layout)
    real = os.fchown
    hits = []

    def racing(fd, uid, gid):
        dfd = os.open(layout.ws, os.O_PATH | os.O_DIRECTORY)
        try:
            for name in os.listdir(layout.ws):
                lst = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if lst.st_ino == os.fstat(fd).st_ino and stat.S_ISREG(lst.st_mode):
                    _swap_for_hard_link(dfd, os.fsencode(name), victim)
                    hits.append(name)
        finally:
            os.close(dfd)
        return real(fd, uid, gid)

    monkeypatch.setattr(os, "fchown", racing)
    with open_root(layout.ws, owner=OWNER) as r:
        fd = r.open_fd("new", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        assert (os.fstat(fd).st_uid, os.fstat(fd).st_gid) == OWNER  # the inode made got it
        os.close(fd)
        r.atomic_write("aw", b"data")  # the temporary name swapped: the victim is renamed in, unchanged
        r.mkdir("d")  # a directory cannot be a hard link: nothing to swap in
    assert "new" in hits and any(h.startswith(".sfs-tmp-") for h in hits)
    assert own(victim) == ME and victim.read_bytes() == b"victim"
    assert own(layout.ws / "d") == OWNER


def test_race_extract_staged_file_swapped_for_a_hard_link_before_the_chown(layout, resolver, tmp_path, monkeypatch):
    victim = _outside_file(layout)
    real = os.fchown
    swapped = []

    def racing(fd, uid, gid):
        s = os.fstat(fd)
        if stat.S_ISREG(s.st_mode) and not swapped:
            for dirpath, _dirs, files in os.walk(layout.ws):
                for n in files:
                    if os.lstat(os.path.join(dirpath, n)).st_ino == s.st_ino:
                        os.unlink(os.path.join(dirpath, n))
                        os.link(victim, os.path.join(dirpath, n))
                        swapped.append(n)
        return real(fd, uid, gid)

    monkeypatch.setattr(os, "fchown", racing)
    # A stream source is never batched: the member is written one by one and given its owner by
    # os.fchown here (a batched member's owner is set by the native call on the fd it created).
    src = io.BytesIO(_tar([("big", "file", b"b" * (9 << 20))]))
    with open_root(layout.ws, owner=OWNER) as r:
        extract(r, "dest", src)
    assert swapped == ["big"]
    assert own(victim) == ME and victim.read_bytes() == b"victim"


def test_race_symlink_swapped_for_a_hard_link_is_refused(layout, resolver, monkeypatch):
    """A symlink's owner is set through an O_PATH fd checked to be a symlink with one link: a hard
    link to an outside symlink (or file) swapped in at the name is refused, never changed."""
    out_link = layout.outside / "out-link"
    os.symlink("victim", out_link)
    victim = _outside_file(layout)
    real = os.symlink

    def racing(target, name, *, dir_fd=None, target_is_directory=False):
        real(target, name, dir_fd=dir_fd)
        os.unlink(name, dir_fd=dir_fd)
        os.link(out_link if name == b"l1" else victim, name, dst_dir_fd=dir_fd, follow_symlinks=False)

    monkeypatch.setattr(os, "symlink", racing)
    with open_root(layout.ws, owner=OWNER) as r:
        for name in ("l1", "l2"):
            with pytest.raises(DirectoryReplacedError) as ei:
                r.symlink("x", name)
            assert ei.value.sandbox_path == name and str(layout.base) not in str(ei.value)
    assert own(out_link) == ME and own(victim) == ME


def test_race_copy_files_from_hammered_temporary_names(layout, resolver):
    """A racer keeps replacing the copy's temporary names with hard links to a file outside (bounded):
    the native copy chowns the fd it created, so the outside file keeps its owner and content."""
    victim = _outside_file(layout)
    src = layout.base / "src"
    src.mkdir()
    for i in range(64):
        (src / f"f{i}").write_bytes(b"s" * 100)
    stop = threading.Event()
    wins = []

    def hammer() -> None:
        dfd = os.open(layout.ws, os.O_PATH | os.O_DIRECTORY)
        try:
            while not stop.is_set():
                for n in os.listdir(layout.ws):
                    if n.startswith(".sfs-tmp-"):
                        try:
                            _swap_for_hard_link(dfd, os.fsencode(n), victim)
                            wins.append(n)
                        except OSError:
                            pass
        finally:
            os.close(dfd)

    t = threading.Thread(target=hammer)
    t.start()
    try:
        with open_root(src, read_only=True) as s, open_root(layout.ws, owner=OWNER) as r:
            for _ in range(6):
                try:
                    r.copy_files_from(s, [(f"f{i}", f"f{i}", 0o644, None, None) for i in range(64)])
                except OSError:
                    pass  # a racer's swap may make one copy fail: only the outside file matters here
    finally:
        stop.set()
        t.join()
    assert own(victim) == ME and victim.read_bytes() == b"victim"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644
