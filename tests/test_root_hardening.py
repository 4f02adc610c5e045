"""Regression tests for the attacker review of Root (each a class, not an instance).

* writes are checked on every object they act on (leaf, entered dirs), not only
  the parent: read-only grants nested in the workspace or in a read-write grant;
* symlink targets may use ``..`` only in front (the lexical check is sound);
* special files are refused without blocking, for reads and writes;
* the fallback walker holds one directory fd whatever the depth;
* PATH_MAX counts the NUL; a trailing slash names a directory;
* fds are owned from the moment they are opened (walk, rmtree);
* an existing file's mode is left alone by open(); error text is one safe line.
"""

from __future__ import annotations

import errno
import os
import resource
import stat
import subprocess
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandbox_fs import (Grant, InvalidPathError, PathEscapeError, PathPolicy, ReadOnlyError,
                        SymlinkRefusedError, open_root)
from sandbox_fs import root as root_mod
from sandbox_fs import _root_remove
from sandbox_fs.root import SpecialFileError, display_path


@pytest.fixture
def ro_env(layout, resolver):
    ro = layout.ws / "ro"
    (ro / "sub").mkdir(parents=True)
    (ro / "secret").write_text("keep")
    os.utime(ro / "secret", ns=(10**18, 10**18))
    ws_root = open_root(layout.ws)
    pol = PathPolicy(ws_root, str(layout.ws), [Grant(str(ro), read_only=True)])

    def state():
        s = (ro / "secret").stat()
        return sorted(os.listdir(ro)), stat.S_IMODE(ro.stat().st_mode), s.st_mtime_ns, (ro / "secret").read_text()

    before = state()
    yield layout, pol, pol.workspace
    pol.close()
    ws_root.close()
    assert state() == before, "the read-only grant changed"


def test_nested_ro_grant_every_write_refused(ro_env):
    layout, pol, ws = ro_env
    os.symlink("ro/secret", layout.ws / "l")
    os.link(layout.ws / "ro" / "secret", layout.ws / "hardlink")
    for op in (lambda: ws.rmtree("ro"), lambda: ws.clear(), lambda: ws.rmtree(""),
               lambda: ws.chmod("ro", 0o777), lambda: ws.utime("ro"), lambda: ws.rename("ro", "moved"),
               lambda: ws.open_fd("ro", os.O_TMPFILE | os.O_WRONLY, 0o600),
               lambda: ws.open("hardlink", "w"), lambda: ws.open("hardlink", "a"),
               lambda: ws.chmod("hardlink", 0o777), lambda: ws.utime("hardlink"),
               lambda: ws.rmtree("ro/sub"), lambda: ws.mkdir("ro/new")):
        with pytest.raises(ReadOnlyError):
            op()
    # a child Root opened inside the grant is read-only
    with ws.open_root("ro/sub") as child:
        assert child.read_only
    # writes elsewhere still work, and replacing the hard link's *name* is fine
    ws.write_bytes("hardlink", b"new content")
    assert (layout.ws / "ro" / "secret").read_text() == "keep"


def test_ro_grant_inside_rw_grant(layout, resolver):
    data = layout.base / "data"
    (data / "ro").mkdir(parents=True)
    (data / "ro" / "secret").write_text("keep")
    os.symlink("ro", data / "link")
    with open_root(layout.ws) as ws, PathPolicy(ws, str(layout.ws), [
            Grant(str(data), read_only=False), Grant(str(data / "ro"), read_only=True)]) as pol:
        r = pol.resolve(str(data / "link" / "secret"))
        assert not r.read_only  # lexically in the read-write grant...
        with pytest.raises(ReadOnlyError):  # ...physically in the read-only one
            r.root.write_bytes(r.rel, b"PWNED")
        r = pol.resolve(str(data / "fine"))
        r.root.write_bytes(r.rel, b"ok")
    assert (data / "ro" / "secret").read_text() == "keep"
    assert (data / "fine").read_text() == "ok"


def test_symlink_dotdot_after_name_refused(layout, resolver):
    before = layout.snapshot()
    with open_root(layout.ws) as r:
        r.symlink(".", "up")
        with pytest.raises(PathEscapeError):
            r.symlink("up/../secret", "esc")
        with pytest.raises(PathEscapeError):
            r.symlink("a/../../x", "esc2")
        r.mkdir("d")
        r.symlink("../up", "d/ok")  # leading '..' within depth is fine
    assert not os.path.lexists(layout.ws / "esc")
    layout.assert_outside_unchanged(before)


NAME = st.sampled_from(["a", "b", "c"])
TARGET = st.lists(st.sampled_from(["a", "b", "c", "..", "."]), min_size=1, max_size=6).map("/".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["mkdir", "symlink"]),
                              st.lists(NAME, min_size=1, max_size=3).map("/".join), TARGET), max_size=15))
def test_property_created_symlinks_never_point_outside(tmp_path_factory, ops):
    base = tmp_path_factory.mktemp("symprop")
    ws = base / "ws"
    ws.mkdir()
    with open_root(ws) as r:
        made = []
        for kind, path, target in ops:
            try:
                if kind == "mkdir":
                    r.mkdir(path, parents=True, exist_ok=True)
                else:
                    r.symlink(target, path)
                    made.append(path)
            except (OSError, InvalidPathError):
                pass
        for path in made:
            # how a host program would follow it: must stay inside
            real = os.path.realpath(ws / path)
            assert real == str(ws) or real.startswith(str(ws) + "/"), (path, os.readlink(ws / path), real)


def test_special_files_refused_without_blocking(layout, resolver):
    os.mkfifo(layout.ws / "fifo")
    os.symlink("fifo", layout.ws / "innocent.txt")
    result = {}

    def attempt():
        with open_root(layout.ws) as r:
            for name, op in [("open", lambda: r.open("innocent.txt", "rb")),
                             ("open_fd", lambda: r.open_fd("fifo")),
                             ("read_bytes", lambda: r.read_bytes("fifo")),
                             ("open_w", lambda: r.open("fifo", "wb")),
                             ("open_a", lambda: r.open("fifo", "a"))]:
                try:
                    op()
                    result[name] = "opened"
                except (SpecialFileError, OSError) as exc:
                    result[name] = type(exc).__name__

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "an open blocked on a FIFO"
    assert result["open"] == result["open_fd"] == result["read_bytes"] == "SpecialFileError"
    assert result["open_w"] != "opened" and result["open_a"] != "opened"
    with open_root(layout.ws) as r:  # explicit opt-in still works, non-blocking
        fd = r.open_fd("fifo", os.O_RDONLY | os.O_NONBLOCK, allow_special=True)
        os.close(fd)


def test_fallback_walker_uses_one_fd_per_walk(tmp_path, monkeypatch):
    monkeypatch.setenv("SANDBOX_FS_RESOLVER", "fallback")
    ws = tmp_path / "ws"
    ws.mkdir()
    depth = 800
    fd = os.open(ws, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):  # no recursion, no long host paths
        os.mkdir("d", dir_fd=fd)
        nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nfd
    with open(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "w") as f:
        f.write("deep")
    os.close(fd)
    deep = "/".join(["d"] * depth)
    half = "/".join(["d"] * (depth // 2))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with open_root(ws) as r:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(128, hard), hard))
        try:
            assert r.read_bytes(deep + "/f") == b"deep"
            back = "/".join([".."] * (depth // 2))
            assert r.read_bytes(f"{deep}/{back}/{half}/f") == b"deep"
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_path_max_counts_the_nul(layout, resolver):
    (layout.ws / "f").write_text("x")
    with open_root(layout.ws) as r:
        ok = "./" * 2046 + "f"  # 4093 bytes
        assert r.read_bytes(ok + "") == b"x"
        assert r.read_bytes("./" + ok) == b"x"  # 4095 bytes
        with pytest.raises(InvalidPathError):
            r.read_bytes("././" + ok)  # 4097 bytes
        with pytest.raises(InvalidPathError):
            r.read_bytes("./" + ok + "/")  # 4096 bytes


def test_trailing_slash_names_a_directory(layout, resolver):
    (layout.ws / "file").write_text("x")
    with open_root(layout.ws) as r:
        with pytest.raises(NotADirectoryError):
            r.remove("file/")
        with pytest.raises(NotADirectoryError):
            r.write_bytes("new/", b"x")
        with pytest.raises(NotADirectoryError):
            r.rename("file/", "moved")
        with pytest.raises(NotADirectoryError):
            r.open("new2/", "w")
        r.mkdir("d/")
        r.rename("d/", "e/")
        r.rmdir("e/")
    assert sorted(os.listdir(layout.ws)) == ["file"]


def test_fds_owned_when_a_walk_or_rmtree_fails(layout, resolver, monkeypatch):
    os.makedirs(layout.ws / "t" / "a")
    os.makedirs(layout.ws / "t" / "b")
    real_open = os.open

    def failing_open(path, flags, *a, **kw):
        if path in ("b", b"b") and kw.get("dir_fd") is not None:
            raise PermissionError(errno.EACCES, "denied")
        return real_open(path, flags, *a, **kw)

    real_here = _root_remove._open_dir_here

    def failing_here(self, dfd, name, flags):  # the openat2 path of a recursive removal
        if name in ("b", b"b"):
            raise PermissionError(errno.EACCES, "denied")
        return real_here(self, dfd, name, flags)

    monkeypatch.setattr(_root_remove, "_open_dir_here", failing_here)
    n0 = len(os.listdir("/proc/self/fd"))
    with open_root(layout.ws) as r:
        monkeypatch.setattr(root_mod.os, "open", failing_open)
        for _ in range(20):
            with pytest.raises(PermissionError):
                list(r.walk("t"))
            with pytest.raises(PermissionError):
                r.rmtree("t")
        monkeypatch.setattr(root_mod.os, "open", real_open)
    assert len(os.listdir("/proc/self/fd")) == n0


def test_open_leaves_existing_mode_alone(layout, resolver):
    p = layout.ws / "empty"
    p.touch()
    os.chmod(p, 0o600)
    with open_root(layout.ws) as r:
        r.open("empty", "a").close()
        r.open("empty", "w").close()
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
        old = os.umask(0o077)
        try:
            r.open("fresh", "w", perm=0o640).close()
        finally:
            os.umask(old)
        assert stat.S_IMODE((layout.ws / "fresh").stat().st_mode) == 0o640


def test_error_text_is_one_safe_line(layout, resolver):
    evil = "x\n\x1b[31mFAKE LOG LINE\r/" + "/".join(["y" * 200] * 3)
    with open_root(layout.ws) as r:
        with pytest.raises(FileNotFoundError) as ei:
            r.read_bytes(evil)
    text = str(ei.value)
    assert "\n" not in text and "\x1b" not in text and "\r" not in text
    assert len(display_path(evil)) <= 203


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs inside the workspace needs root")
def test_cross_mount_rename_is_not_an_escape(layout, resolver):
    mnt = layout.ws / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount tmpfs here")
    try:
        (layout.ws / "f").write_text("x")
        with open_root(layout.ws) as r:
            with pytest.raises(OSError) as ei:
                r.rename("f", "mnt/f")
            assert ei.value.errno == errno.EXDEV and not isinstance(ei.value, PathEscapeError)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_chmod_of_symlink_swapped_in_is_a_sandbox_error(layout, resolver, monkeypatch):
    (layout.ws / "f").write_text("x")
    with open_root(layout.ws) as r:
        def chmod_raises(*a, **kw):
            raise NotImplementedError("chmod: follow_symlinks unavailable")
        monkeypatch.setattr(root_mod.os, "chmod", chmod_raises)
        with pytest.raises(SymlinkRefusedError):
            r.chmod("f", 0o600)


def test_walk_of_a_directory_wider_than_the_fd_limit(layout):
    """Root.walk held one fd per subdirectory of the directory being walked, so a directory with more
    subdirectories than RLIMIT_NOFILE failed with EMFILE; it now holds fds by depth only."""
    wide = layout.ws / "wide"
    wide.mkdir()
    for i in range(300):
        (wide / f"d{i:03d}").mkdir()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    used = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (used + 64, hard))
    try:
        with open_root(layout.ws) as r:
            seen = [d for d, _names, _files in r.walk("wide")]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert seen == ["wide"] + [f"wide/d{i:03d}" for i in range(300)]


_TREE = st.recursive(st.just(None), lambda kids: st.dictionaries(st.sampled_from("abcde"), kids, max_size=4),
                     max_leaves=40)


def _build(fd: int, tree) -> None:
    for name, sub in tree.items():
        if sub is None:
            os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=fd))
        else:
            os.mkdir(name, 0o755, dir_fd=fd)
            cfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            try:
                _build(cfd, sub)
            finally:
                os.close(cfd)


def _reference(tree, prefix: str, prune: str):
    """(dirpath, sorted files) in Root.walk's order: preorder, names sorted, pruned names skipped."""
    yield prefix, sorted(n for n, s in tree.items() if s is None)
    for name in sorted(n for n, s in tree.items() if s is not None and n != prune):
        yield from _reference(tree[name], f"{prefix}/{name}" if prefix else name, prune)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=st.dictionaries(st.sampled_from("abcde"), _TREE, max_size=5), prune=st.sampled_from("abcdez"),
       stop=st.integers(0, 30))
def test_property_walk_order_pruning_and_fds_bounded_by_depth(tmp_path_factory, tree, prune, stop):
    base = tmp_path_factory.mktemp("walk")
    bfd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _build(bfd, tree)
    finally:
        os.close(bfd)
    n0 = len(os.listdir("/proc/self/fd"))
    with open_root(base) as r:
        n_root = len(os.listdir("/proc/self/fd"))
        got = []
        for dpath, names, files in r.walk("."):
            depth = dpath.count("/") + 1 if dpath else 0
            assert len(os.listdir("/proc/self/fd")) <= n_root + depth + 2  # + the listdir's own fd
            got.append((dpath, sorted(e.name for e in files)))
            names[:] = [n for n in names if n != prune]
        assert got == list(_reference(tree, "", prune))
        it = r.walk(".")
        for k, _ in enumerate(it):  # abandoned part-way: every fd it held is closed
            if k >= stop:
                break
        it.close()
    assert len(os.listdir("/proc/self/fd")) == n0
