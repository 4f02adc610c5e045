"""Property tests: the fallback resolver answers exactly like openat2.

On random trees with random symlinks (relative, absolute, dangling, loops,
pointing above the root), every random path opened with random flags must
give the same result from ``openat2(RESOLVE_BENEATH|RESOLVE_NO_MAGICLINKS)``
and from the component walker: the same object (dev, ino) or the same errno.
And every object either returns is beneath the root.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sandbox_fs
from sandbox_fs import _native
from sandbox_fs.paths import normalize
from sandbox_fs.errors import InvalidPathError

pytestmark = pytest.mark.skipif(not sandbox_fs.features()["openat2"],
                                reason="kernel has no openat2: nothing to compare the fallback with")

NAMES = ["a", "b", "c", "d"]
component = st.sampled_from(NAMES + [".", ".."])
rel_path = st.lists(component, min_size=1, max_size=7).map("/".join)
link_target = st.one_of(
    rel_path,
    st.sampled_from(["/", "/etc", "/tmp", "..", "../..", "../outside", "a/../../outside", ""]),
)
entry = st.tuples(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3).map("/".join),
                  st.sampled_from(["dir", "file", "symlink"]), link_target)

FLAG_SETS = [
    os.O_PATH,
    os.O_PATH | os.O_NOFOLLOW,
    os.O_RDONLY,
    os.O_RDONLY | os.O_DIRECTORY,
    os.O_RDONLY | os.O_NOFOLLOW,
    os.O_PATH | os.O_DIRECTORY,
]
RESOLVES = [0, _native.RESOLVE_NO_SYMLINKS]


def build_tree(top: str, entries) -> None:
    """Create the entries with fd-relative calls that never follow a symlink.

    (A path-string builder would follow links the tree itself plants, such as
    ``a -> /etc`` then ``a/b``, and write outside the temp dir.)
    """
    topfd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for path, kind, target in entries:
            *parents, leaf = path.split("/")
            cur = os.dup(topfd)
            try:
                for comp in parents:
                    try:
                        os.mkdir(comp, dir_fd=cur)
                    except FileExistsError:
                        pass
                    nxt = os.open(comp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=cur)
                    os.close(cur)
                    cur = nxt
                if kind == "dir":
                    os.mkdir(leaf, dir_fd=cur)
                elif kind == "file":
                    fd = os.open(leaf, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=cur)
                    os.write(fd, path.encode())
                    os.close(fd)
                elif target:
                    os.symlink(target, leaf, dir_fd=cur)
            except OSError:
                pass  # a parent is a file or a link: skip that entry
            finally:
                os.close(cur)
    finally:
        os.close(topfd)


def attempt(fn, rootfd, path, flags, resolve):
    ret = fn(rootfd, path.encode(), flags, 0, resolve | _native.RESOLVE_BENEATH | _native.RESOLVE_NO_MAGICLINKS)
    if ret < 0:
        return ("err", -ret)
    try:
        st = os.fstat(ret)
        return ("ok", st.st_dev, st.st_ino)
    finally:
        os.close(ret)


def attempt_named(fn, rootfd, path, flags, resolve):
    """Like attempt, but names what was opened by its device, type and the kernel's path
    for the fd, not its inode number: a file one call creates, and the test unlinks
    before the other call creates it again, need not get the same inode back (on ext4
    under load it does not)."""
    ret = fn(rootfd, path.encode(), flags, 0, resolve | _native.RESOLVE_BENEATH | _native.RESOLVE_NO_MAGICLINKS)
    if ret < 0:
        return ("err", -ret)
    try:
        st_ = os.fstat(ret)
        return ("ok", st_.st_dev, stat.S_IFMT(st_.st_mode), os.readlink(f"/proc/self/fd/{ret}"))
    finally:
        os.close(ret)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entries=st.lists(entry, max_size=12), paths=st.lists(rel_path, min_size=1, max_size=8),
       flags=st.sampled_from(FLAG_SETS), resolve=st.sampled_from(RESOLVES))
def test_fallback_agrees_with_openat2(entries, paths, flags, resolve):
    base = tempfile.mkdtemp(prefix="sfs-prop-")
    try:
        top = os.path.join(base, "root")
        os.makedirs(os.path.join(base, "outside"))
        os.mkdir(top)
        build_tree(top, entries)
        inside = set()
        for dirpath, dirs, files in os.walk(top):
            for n in dirs + files + ["."]:
                st_ = os.lstat(os.path.join(dirpath, n))
                inside.add((st_.st_dev, st_.st_ino))
        rootfd = os.open(top, os.O_PATH | os.O_DIRECTORY)
        try:
            for p in paths:
                a = attempt(_native.lib.sfs_openat2, rootfd, p, flags, resolve)
                b = attempt(_native.lib.sfs_open_fallback, rootfd, p, flags, resolve)
                assert a == b, (p, entries, flags, resolve, a, b)
                if a[0] == "ok":
                    assert (a[1], a[2]) in inside, f"{p} opened something outside the root"
        finally:
            os.close(rootfd)
    finally:
        shutil.rmtree(base)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", ".", "..", "", "x y", "é", "a\\..", "..."]), min_size=1, max_size=12)
       .map("/".join), st.booleans())
def test_normalize_never_yields_dotdot_or_leading_slash(raw, absolute):
    text = ("/" + raw) if absolute else raw
    try:
        sp = normalize(text, allow_absolute=absolute)
    except InvalidPathError:
        return
    parts = sp.split("/")
    assert ".." not in parts
    assert "." not in parts
    if absolute:
        assert sp.startswith("/") and not sp.startswith("//")
    else:
        assert not sp.startswith("/")
    assert not sp.endswith("/") or sp == "/"
    # idempotent
    assert normalize(sp, allow_absolute=absolute) == sp if sp else True


def test_hop_limit_is_40_in_both_resolvers(tmp_path):
    top = tmp_path / "r"
    top.mkdir()
    (top / "target").mkdir()
    # l0 -> l1 -> ... -> l40 -> target : 41 hops
    n = 41
    for i in range(n):
        nxt = f"l{i + 1}" if i + 1 < n else "target"
        os.symlink(nxt, top / f"l{i}")
    rootfd = os.open(top, os.O_PATH | os.O_DIRECTORY)
    try:
        for fn in (_native.lib.sfs_openat2, _native.lib.sfs_open_fallback):
            assert attempt(fn, rootfd, "l0", os.O_PATH, 0) == ("err", errno.ELOOP)
            assert attempt(fn, rootfd, "l1", os.O_PATH, 0)[0] == "ok"  # 40 hops is fine
    finally:
        os.close(rootfd)


EDGE_PATHS = ["file/", "ldir/", "ldir", "new/", "dir/", "dir/.", "dir/..", ".", "..", "dang", "dang/",
              "dangslash", "lfileslash", "ldirslash", "ldotdot/..", "lfile/..", "file/..", "dir/sub/../..",
              "dir//sub///", "./dir/./sub/.", "ldir/sub/../../dir"]
EDGE_FLAGS = [0, os.O_DIRECTORY, os.O_PATH, os.O_PATH | os.O_NOFOLLOW, os.O_NOFOLLOW,
              os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY, os.O_WRONLY | os.O_CREAT,
              os.O_WRONLY | os.O_CREAT | os.O_EXCL, os.O_PATH | os.O_RDWR, 0x40000000,
              os.O_CREAT | os.O_DIRECTORY]


@pytest.mark.parametrize("flags", EDGE_FLAGS)
def test_edge_cases_agree(tmp_path, flags):
    """Trailing slashes, dots at the end, dangling links with O_CREAT, flag validation."""
    ws = tmp_path / "ws"
    (ws / "dir" / "sub").mkdir(parents=True)
    (ws / "file").write_text("")
    for name, target in [("ldir", "dir"), ("lfile", "file"), ("dang", "nope"), ("ldirslash", "dir/"),
                         ("lfileslash", "file/"), ("dangslash", "new2/"), ("ldotdot", "dir/sub/..")]:
        os.symlink(target, ws / name)
    for path in EDGE_PATHS:
        results = []
        for fn in (_native.lib.sfs_openat2, _native.lib.sfs_open_fallback):
            rootfd = os.open(ws, os.O_PATH | os.O_DIRECTORY)
            try:
                results.append(attempt_named(fn, rootfd, path, flags, 0))
            finally:
                os.close(rootfd)
            for created in ("nope", "new", "new2", "dir/new"):  # undo creations between the two
                p = ws / created
                if os.path.lexists(p) and not p.is_dir():
                    p.unlink()
        assert results[0] == results[1], (path, oct(flags), results)
    for length in (4094, 4095, 4096):
        k, odd = divmod(length - 4, 2)
        p = "./" * k + ("/" if odd else "") + "file"
        assert len(p) == length
        rootfd = os.open(ws, os.O_PATH | os.O_DIRECTORY)
        try:
            a = attempt(_native.lib.sfs_openat2, rootfd, p, os.O_PATH, 0)
            b = attempt(_native.lib.sfs_open_fallback, rootfd, p, os.O_PATH, 0)
        finally:
            os.close(rootfd)
        assert a == b, (len(p), a, b)
