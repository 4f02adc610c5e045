"""Every Root operation, with both resolvers (the ``resolver`` fixture)."""

from __future__ import annotations

import errno
import io
import os
import stat
import threading
import time

import pytest

import sandbox_fs
from sandbox_fs.errors import InvalidArgumentError
from sandbox_fs import (InvalidPathError, PathEscapeError, ReadOnlyError, SymlinkRefusedError,
                        UnsafeModeError, WorkspaceClosedError, open_root)


@pytest.fixture
def root(resolver, tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    r = open_root(ws)
    assert r.resolver == resolver
    yield r
    r.close()


def test_open_root_refuses_symlink_and_file(tmp_path, resolver):
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_text("x")
    os.symlink("d", tmp_path / "link")
    with pytest.raises(SymlinkRefusedError):
        open_root(tmp_path / "link")
    with pytest.raises(NotADirectoryError):
        open_root(tmp_path / "f")
    with pytest.raises(FileNotFoundError):
        open_root(tmp_path / "missing")


def test_write_read_roundtrip_and_mode(root, tmp_path):
    old = os.umask(0o077)
    try:
        n = root.write_bytes("f.bin", b"\x00\x01data", mode=0o640)
    finally:
        os.umask(old)
    assert n == 6
    assert root.read_bytes("f.bin") == b"\x00\x01data"
    assert stat.S_IMODE((tmp_path / "ws" / "f.bin").stat().st_mode) == 0o640
    root.write_text("t.txt", "héllo")
    assert root.read_text("t.txt") == "héllo"
    with pytest.raises(OSError) as ei:
        root.read_bytes("f.bin", max_bytes=3)
    assert ei.value.errno == errno.EFBIG


def test_atomic_write_sources(root, tmp_path):
    root.atomic_write("chunks", [b"a", b"bc", b""])
    assert root.read_bytes("chunks") == b"abc"
    root.atomic_write("fobj", io.BytesIO(b"x" * 100000))
    assert root.read_bytes("fobj") == b"x" * 100000
    src = tmp_path / "src.bin"
    src.write_bytes(b"y" * 300000)
    fd = os.open(src, os.O_RDONLY)
    try:
        assert root.atomic_write("fromfd", fd, mode=0o600, mtime_ns=10**18) == 300000
    finally:
        os.close(fd)
    st = root.stat("fromfd")
    assert st.st_size == 300000 and st.st_mtime_ns == 10**18 and stat.S_IMODE(st.st_mode) == 0o600
    fd = os.open(src, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as ei:
            root.atomic_write("toobig", fd, max_bytes=1000)
        assert ei.value.errno == errno.EFBIG
    finally:
        os.close(fd)
    assert not root.exists("toobig")
    assert not [n for n in root.listdir() if n.startswith(".sfs-tmp-")], "temp files left behind"


def test_atomic_write_replaces_leaf_symlink_not_target(root, tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    os.symlink(str(outside), tmp_path / "ws" / "leaf")
    root.write_bytes("leaf", b"new")
    assert outside.read_text() == "keep"
    assert not (tmp_path / "ws" / "leaf").is_symlink()
    assert root.read_bytes("leaf") == b"new"


def test_atomic_write_on_directory_fails_clean(root):
    root.mkdir("d")
    with pytest.raises(OSError):
        root.write_bytes("d", b"x")
    assert root.listdir() == ["d"]


def test_open_modes(root):
    with root.open("a.txt", "w") as f:
        f.write("one\n")
    with root.open("a.txt", "a") as f:
        f.write("two\n")
    with root.open("a.txt") as f:
        assert f.read() == "one\ntwo\n"
    with root.open("a.txt", "rb") as f:
        assert f.read(3) == b"one"
    with pytest.raises(FileExistsError):
        root.open("a.txt", "x")
    with root.open("b.bin", "xb", perm=0o600) as f:
        f.write(b"z")
    assert stat.S_IMODE(root.stat("b.bin").st_mode) == 0o600
    root.mkdir("d")
    with pytest.raises(IsADirectoryError):
        root.open("d")
    with pytest.raises(ValueError):
        root.open("a.txt", "q")


def test_mkdir_variants(root):
    root.mkdir("a/b/c", parents=True, mode=0o700)
    assert stat.S_IMODE(root.stat("a/b").st_mode) == 0o700
    with pytest.raises(FileExistsError):
        root.mkdir("a")
    root.mkdir("a", exist_ok=True)
    with pytest.raises(FileNotFoundError):
        root.mkdir("x/y")
    root.write_bytes("file", b"")
    with pytest.raises(FileExistsError):
        root.mkdir("file", exist_ok=True)
    root.symlink("a", "la")
    with pytest.raises(FileExistsError):
        root.mkdir("la", exist_ok=True)  # a symlink to a dir is not a dir
    with pytest.raises(UnsafeModeError):
        root.mkdir("s", mode=0o4755)


def test_remove_rmdir_rmtree(root):
    root.mkdir("t/u/v", parents=True)
    root.write_bytes("t/u/v/f", b"1")
    root.write_bytes("t/g", b"2")
    root.symlink("u", "t/link")
    with pytest.raises(IsADirectoryError):
        root.remove("t")
    with pytest.raises(OSError) as ei:
        root.rmdir("t")
    assert ei.value.errno == errno.ENOTEMPTY
    root.remove("t/link")
    assert root.exists("t/u")
    root.rmtree("t")
    assert not root.exists("t")
    root.rmtree("t", missing_ok=True)
    with pytest.raises(FileNotFoundError):
        root.rmtree("t")


def test_rmtree_deep_tree(root):
    path = "/".join(["d"] * 300)
    root.mkdir(path, parents=True)
    root.write_bytes(path + "/f", b"x")
    root.rmtree("d")
    assert root.listdir() == []


def test_clear_keeps_root_and_skipped(root, tmp_path):
    root.mkdir("keep/inner", parents=True)
    root.mkdir("gone/x", parents=True)
    root.write_bytes("keep/inner/f", b"1")
    root.write_bytes("top", b"1")
    keep_ino = root.stat("keep/inner").st_ino
    root.clear(skip=lambda st: st.st_ino == keep_ino)
    assert (tmp_path / "ws").is_dir()
    assert root.listdir() == ["keep"]
    assert root.read_bytes("keep/inner/f") == b"1"


def test_rename(root):
    root.write_bytes("a", b"A")
    root.write_bytes("b", b"B")
    with pytest.raises(FileExistsError):
        root.rename("a", "b", no_replace=True)
    root.rename("a", "b")
    assert root.read_bytes("b") == b"A" and not root.exists("a")
    root.mkdir("d")
    root.rename("b", "d/c")
    assert root.read_bytes("d/c") == b"A"
    with pytest.raises(PathEscapeError):
        root.rename("d/c", "../c")


def test_rename_exchange(root):
    root.write_bytes("a", b"A")
    root.mkdir("d")
    root.write_bytes("d/f", b"F")
    root.rename("a", "d", exchange=True)  # a file and a directory swap names atomically
    assert root.read_bytes("d") == b"A" and root.read_bytes("a/f") == b"F"
    with pytest.raises(FileNotFoundError):
        root.rename("a", "missing", exchange=True)
    with pytest.raises(InvalidArgumentError):
        root.rename("a", "d", exchange=True, no_replace=True)
    with pytest.raises(PathEscapeError):
        root.rename("a", "../d", exchange=True)


def test_stat_lstat_readlink_symlink(root):
    root.mkdir("dir")
    root.write_bytes("dir/f", b"abc")
    root.symlink("dir/f", "l")
    assert stat.S_ISLNK(root.lstat("l").st_mode)
    assert root.stat("l").st_size == 3
    assert root.readlink("l") == "dir/f"
    with pytest.raises(OSError) as ei:
        root.readlink("dir/f")
    assert ei.value.errno == errno.EINVAL
    root.symlink("../l", "dir/up")  # stays inside
    assert root.read_bytes("dir/up") == b"abc"
    with pytest.raises(PathEscapeError):
        root.symlink("../../x", "dir/esc")
    with pytest.raises(PathEscapeError):
        root.symlink("/etc/passwd", "abs")
    with pytest.raises(InvalidPathError):
        root.symlink("", "empty")
    assert not root.exists("dir/esc") and not root.exists("abs")


def test_symlink_depth_is_physical(root):
    # "c" is a symlink to "." so "a/b/c" is physically at depth 2, not 3
    root.mkdir("a/b", parents=True)
    root.symlink(".", "a/b/c")
    with pytest.raises(PathEscapeError):
        root.symlink("../../../x", "a/b/c/l")
    root.symlink("../../x", "a/b/c/ok")


def test_link(root, tmp_path):
    root.write_bytes("f", b"data")
    root.link("f", "g")
    assert root.stat("g").st_ino == root.stat("f").st_ino
    with pytest.raises(PathEscapeError):
        root.link("f", "../g")
    with pytest.raises(PathEscapeError):
        root.link("../outside", "h")


def test_chmod_and_utime(root):
    root.write_bytes("f", b"x", mode=0o600)
    root.chmod("f", 0o755)
    assert stat.S_IMODE(root.stat("f").st_mode) == 0o755
    for bad in (0o4755, 0o2755, 0o1777, 0o100644, -1):
        with pytest.raises(UnsafeModeError):
            root.chmod("f", bad)
    root.symlink("f", "l")
    with pytest.raises(SymlinkRefusedError):
        root.chmod("l", 0o700)
    assert stat.S_IMODE(root.stat("f").st_mode) == 0o755
    root.utime("f", ns=(10**9, 2 * 10**9))
    assert root.stat("f").st_mtime_ns == 2 * 10**9
    root.utime("l", ns=(10**9, 3 * 10**9))  # the link itself
    assert root.lstat("l").st_mtime_ns == 3 * 10**9
    assert root.stat("f").st_mtime_ns == 2 * 10**9


def test_utime_without_ns_sets_now(root):
    root.write_bytes("f", b"x")
    root.utime("f", ns=(10**9, 2 * 10**9))
    before = time.time_ns()
    root.utime("f")  # ns=None: now (os.utime refuses ns=None, so Root passes none)
    assert root.stat("f").st_mtime_ns >= before - 10**9


def test_scandir_listdir_walk(root):
    root.mkdir("a/b", parents=True)
    root.write_bytes("a/f", b"1")
    root.write_bytes("a/b/g", b"2")
    root.symlink("b", "a/lb")
    ents = {e.name: e.kind for e in root.scandir("a")}
    assert ents == {"b": "dir", "f": "file", "lb": "symlink"}
    assert root.listdir("a") == ["b", "f", "lb"]
    walked = [(d, sorted(ds), sorted(e.name for e in nd)) for d, ds, nd in root.walk()]
    assert walked == [("", ["a"], []), ("a", ["b"], ["f", "lb"]), ("a/b", [], ["g"])]
    # pruning works
    out = []
    for d, ds, _ in root.walk():
        out.append(d)
        ds.clear()
    assert out == [""]


def test_child_root(root):
    root.mkdir("sub/deeper", parents=True)
    root.write_bytes("sub/x", b"1")
    with root.open_root("sub") as child:
        assert child.read_bytes("x") == b"1"
        with pytest.raises(PathEscapeError) as ei:
            child.read_bytes("../sub/x")
        assert "sub/../sub/x" in str(ei.value)  # labelled with its sandbox prefix
    with root.open_root("sub", read_only=True) as ro:
        with pytest.raises(ReadOnlyError):
            ro.write_bytes("y", b"")
        with ro.open_root("deeper", read_only=False) as still_ro:
            assert still_ro.read_only


def test_read_only_root_refuses_every_write(tmp_path, resolver):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "f").write_text("x")
    (ws / "d").mkdir()
    before = sorted(os.listdir(ws))
    with open_root(ws, read_only=True) as r:
        ops = [
            lambda: r.write_bytes("g", b""), lambda: r.mkdir("n"), lambda: r.remove("f"),
            lambda: r.rmdir("d"), lambda: r.rmtree("d"), lambda: r.rename("f", "g"),
            lambda: r.symlink("f", "s"), lambda: r.link("f", "h"), lambda: r.chmod("f", 0o600),
            lambda: r.utime("f"), lambda: r.open("f", "w"), lambda: r.open("f", "a"),
            lambda: r.open_fd("f", os.O_RDWR), lambda: r.clear(),
        ]
        for op in ops:
            with pytest.raises(ReadOnlyError):
                op()
        assert r.read_bytes("f") == b"x"
    assert sorted(os.listdir(ws)) == before and (ws / "f").read_text() == "x"


def test_closed_root(root):
    root.close()
    root.close()  # idempotent
    for op in (lambda: root.stat("."), lambda: root.listdir(), lambda: root.write_bytes("x", b"")):
        with pytest.raises(WorkspaceClosedError):
            op()


def test_invalid_paths(root):
    for bad in ("a\0b", "x" * 256, "a/" * 2100):
        with pytest.raises(InvalidPathError):
            root.stat(bad)
    for bad_name in (".", "..", "a/..", ""):
        with pytest.raises(InvalidPathError):
            root.remove(bad_name)


def test_concurrent_calls_and_close(root):
    root.write_bytes("f", b"x" * 10)
    errors = []

    def worker():
        try:
            for _ in range(300):
                assert root.read_bytes("f") == b"x" * 10
        except WorkspaceClosedError:
            pass
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    root.close()
    for t in threads:
        t.join()
    assert not errors


def test_errors_show_sandbox_paths_never_host_paths(root, tmp_path):
    host = str(tmp_path)
    for op in (lambda: root.read_bytes("missing/file"), lambda: root.stat("../x"),
               lambda: root.symlink("/etc", "l"), lambda: root.mkdir("a/b")):
        with pytest.raises(OSError) as ei:
            op()
        assert host not in str(ei.value) and host not in repr(ei.value)


def test_features_shape():
    f = sandbox_fs.features()
    assert set(f) == {"openat2", "landlock_abi", "fuse", "resolver"}
    assert isinstance(f["landlock_abi"], int) and f["resolver"] in ("openat2", "fallback")


def test_walk_dirs_contract_yields_subdir_entries_and_honours_pruning(root):
    """``_root_walk.walk_dirs``: the subdirectories' DirEntry (with lstat), prunable in place."""
    from sandbox_fs._root_walk import walk_dirs

    for d in ("a/x", "a/y", "b/z"):
        root.mkdir(d, parents=True)
    root.write_bytes("a/f", b"1")
    root.symlink("a", "link")
    seen = []
    for dpath, dirs, nondirs in walk_dirs(root):
        seen.append(dpath)
        assert all(e.kind == "dir" and stat.S_ISDIR(e.stat.st_mode) for e in dirs)
        if dpath == "":
            assert [e.name for e in dirs] == ["a", "b"] and [e.name for e in nondirs] == ["link"]
            dirs[:] = [e for e in dirs if e.name == "a"]  # prune b
        if dpath == "a":
            assert [e.path for e in nondirs] == ["a/f"]
    assert seen == ["", "a", "a/x", "a/y"]


def test_open_on_same_mount_opens_beneath_and_refuses_escapes(root):
    from sandbox_fs._root_walk import open_on_same_mount

    root.mkdir("d")
    root.write_bytes("d/f", b"x")
    fd = open_on_same_mount(root, "d/f", os.O_PATH | os.O_NOFOLLOW, "test")
    try:
        assert os.fstat(fd)[1:3] == root.lstat("d/f")[1:3]
        assert os.get_inheritable(fd) is False
    finally:
        os.close(fd)
    with pytest.raises(PathEscapeError):
        open_on_same_mount(root, "../x", os.O_PATH, "test")
    with pytest.raises(FileNotFoundError):
        open_on_same_mount(root, "d/missing", os.O_PATH, "test")


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs inside the workspace needs root")
def test_open_on_same_mount_never_crosses_a_mount_point(root, tmp_path):
    import subprocess

    from sandbox_fs._root_walk import open_on_same_mount

    root.mkdir("mnt")
    host = str(tmp_path / "ws" / "mnt")  # the root fixture's directory
    if subprocess.run(["mount", "-t", "tmpfs", "tmpfs", host], capture_output=True).returncode != 0:
        pytest.skip("cannot mount tmpfs here")
    try:
        with open(host + "/f", "w") as fh:
            fh.write("x")
        with pytest.raises(PathEscapeError):
            open_on_same_mount(root, "mnt/f", os.O_PATH | os.O_NOFOLLOW, "test")
        os.close(root.open_fd("mnt/f", os.O_PATH))  # a plain open goes through it
    finally:
        subprocess.run(["umount", "-l", host], check=False)


@pytest.mark.parametrize("make", ["with_options", "open_root", "subroot"])
def test_a_root_whose_construction_fails_closes_its_fd_at_once(tmp_path, monkeypatch, make):
    """Regression (the overlay fault suite's flaky "an fd was left open"): an EIO from the
    constructor's fstat (through the FUSE overlay) left the dup'd fd to ``Root.__del__``, and the
    error's traceback kept the half-made Root alive until a garbage collection."""
    import errno as _errno
    import gc

    (tmp_path / "d").mkdir()
    with sandbox_fs.open_root(tmp_path) as base:
        real = os.fstat

        def failing(fd):
            raise OSError(_errno.EIO, "injected")

        before = sorted(os.listdir("/proc/self/fd"))
        gc.disable()
        try:
            monkeypatch.setattr(os, "fstat", failing)
            with pytest.raises(OSError) as got:
                {"with_options": lambda: base.with_options(read_only=True),
                 "open_root": lambda: sandbox_fs.open_root(tmp_path / "d"),
                 "subroot": lambda: base.open_root("d")}[make]()
            monkeypatch.setattr(os, "fstat", real)
            assert got.value.errno == _errno.EIO
            assert sorted(os.listdir("/proc/self/fd")) == before  # the traceback is alive: closed at once
        finally:
            gc.enable()
