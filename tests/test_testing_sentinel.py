"""sandbox_fs.testing's outside sentinel, destination check, failure classifier and pytest plugin.

Every check is shown to fire: a change is planted and the check must name it.
"""

from __future__ import annotations

import errno
import os
import socket
import stat

import pytest

from sandbox_fs import PathEscapeError
from sandbox_fs.materialize import SourceChangedError
from sandbox_fs.testing import OutsideSentinel, check_destination, classify_failure

pytest_plugins = ["pytester"]


@pytest.fixture
def tree(tmp_path):
    out = tmp_path / "outside"
    (out / "sub").mkdir(parents=True)
    (out / "secret.txt").write_bytes(b"SECRET\n")
    (out / "sub" / "f").write_bytes(b"f")
    os.symlink("secret.txt", out / "link")
    dest = tmp_path / "dest"
    dest.mkdir()
    return out, dest


def _fires(sentinel, *words):
    with pytest.raises(AssertionError) as info:
        sentinel.check()
    for w in words:
        assert w in str(info.value)


def test_unchanged_tree_passes_and_reading_changes_nothing(tree):
    out, _ = tree
    s = OutsideSentinel(out)
    (out / "secret.txt").read_bytes()
    os.listdir(out / "sub")
    s.check()
    assert s.changes() == []


def test_same_size_content_change_with_mtime_restored_fires(tree):
    out, _ = tree
    s = OutsideSentinel(out)
    st = os.stat(out / "secret.txt")
    (out / "secret.txt").write_bytes(b"SECRET!")
    os.utime(out / "secret.txt", ns=(st.st_atime_ns, st.st_mtime_ns))
    _fires(s, "secret.txt", "content")


@pytest.mark.parametrize("plant", ["chmod", "create", "remove", "hardlink", "retarget", "replace_dir"])
def test_each_kind_of_change_fires(tree, plant):
    out, _ = tree
    s = OutsideSentinel(out)
    if plant == "chmod":
        os.chmod(out / "secret.txt", 0o600)
        _fires(s, "secret.txt", "mode")
    elif plant == "create":
        (out / "sub" / "new").write_bytes(b"")
        _fires(s, "sub/new: created")
    elif plant == "remove":
        os.unlink(out / "sub" / "f")
        _fires(s, "sub/f: removed")
    elif plant == "hardlink":  # a link from elsewhere raises nlink and ctime
        os.link(out / "secret.txt", out.parent / "dest" / "h")
        _fires(s, "secret.txt", "nlink")
    elif plant == "retarget":
        os.unlink(out / "link")
        os.symlink("sub/f", out / "link")
        _fires(s, "link")
    else:
        os.rename(out / "sub", out.parent / "moved")
        os.symlink("/", out / "sub")
        _fires(s, "sub")


def test_sentinel_root_replaced_fires(tree):
    out, _ = tree
    s = OutsideSentinel(out)
    os.rename(out, out.parent / "old")
    os.mkdir(out)
    _fires(s, ".: nlink, ino", "secret.txt: removed")


def test_clean_destination_passes(tree):
    out, dest = tree
    (dest / "d").mkdir()
    (dest / "d" / "f").write_bytes(b"x")
    os.symlink("d/f", dest / "in")
    os.symlink("d/../d", dest / "in2")
    os.symlink("nope/x", dest / "dangling")
    os.symlink("loop", dest / "loop")
    os.link(dest / "d" / "f", dest / "h")  # hard links inside are fine
    os.chmod(dest / "d", 0o2755)  # set-gid directories only pass the group on
    check_destination(dest, sentinel=OutsideSentinel(out))


@pytest.mark.parametrize("target", ["../outside", "../outside/secret.txt", "/", "../outside/newname",
                                    "d/../../outside", "up/outside", "deep" + "/.." * 40])
def test_symlink_resolving_outside_fires(tree, target):
    out, dest = tree
    (dest / "d").mkdir()
    os.symlink("..", dest / "up")
    os.symlink(target, dest / "d" / "l")
    with pytest.raises(AssertionError, match="symlink escapes"):
        check_destination(dest)


def test_long_paths_are_walked(tree):
    _, dest = tree
    fd = os.open(dest, os.O_PATH)
    try:
        for _ in range(30):  # 30 * 200 bytes: past PATH_MAX
            name = "n" * 200
            os.mkdir(name, dir_fd=fd)
            nfd = os.open(name, os.O_PATH, dir_fd=fd)
            os.close(fd)
            fd = nfd
        os.symlink("/" + "/".join([".."] * 3), "esc", dir_fd=fd)
    finally:
        os.close(fd)
    with pytest.raises(AssertionError, match="symlink escapes"):
        check_destination(dest)


@pytest.mark.parametrize("kind", ["fifo", "socket", "setuid", "setgid_file", "device", "outside_link"])
def test_special_and_linked_nodes_fire(tree, kind):
    out, dest = tree
    s = OutsideSentinel(out)
    p = dest / "x"
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(p))
        sock.close()
    elif kind in ("setuid", "setgid_file"):
        p.write_bytes(b"")
        os.chmod(p, 0o4755 if kind == "setuid" else 0o2755)
    elif kind == "device":
        if os.geteuid() != 0:
            pytest.skip("mknod of a device node needs root")
        os.mknod(p, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    else:
        os.link(out / "secret.txt", p)
    with pytest.raises(AssertionError) as info:
        check_destination(dest, sentinel=s)
    assert "x" in str(info.value)
    if kind == "outside_link":
        assert "hard link" in str(info.value)


def test_classify_failure():
    host = "/tmp/host-base-dir"
    assert classify_failure(PathEscapeError("open: outside", sandbox_path="a/b"))
    assert classify_failure(SourceChangedError("changed", sandbox_path="d"))
    assert classify_failure(FileNotFoundError(errno.ENOENT, "No such file", "a/b"), host_paths=[host])
    assert classify_failure(OSError(errno.ENOSPC, "No space", "f"))
    # not allowed: no path, another errno, a host path shown, other exception types
    assert not classify_failure(FileNotFoundError(errno.ENOENT, "No such file"))
    assert not classify_failure(OSError(errno.EIO, "I/O error", "a"))
    assert not classify_failure(OSError(errno.ENOENT, "No such file", host + "/ws/a"), host_paths=[host])
    assert not classify_failure(PathEscapeError(f"bad {host}/x", sandbox_path="x"), host_paths=[host])
    assert not classify_failure(TypeError("boom"))
    assert not classify_failure(KeyError("k"))
    assert not classify_failure(AssertionError("invariant"))


PLUGIN_TESTS = '''
import os

def test_untouched(outside_sentinel, tmp_path):
    (tmp_path / "dest").mkdir()
    assert outside_sentinel.secret.read_bytes().startswith(b"SECRET")

def test_writes_outside(outside_sentinel):
    outside_sentinel.secret.write_bytes(b"changed")

def test_writes_watched_tree(outside_sentinel, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    outside_sentinel.watch(other)
    (other / "planted").write_bytes(b"")

def test_escaping_destination(outside_sentinel, tmp_path):
    dest = tmp_path / "dest"
    dest.mkdir()
    os.symlink(outside_sentinel.path, dest / "l")
    outside_sentinel.check_destination(dest)

def test_body_raises_and_outside_changed(outside_sentinel):
    (outside_sentinel.path / "sub" / "new").write_bytes(b"")
    raise RuntimeError("body failed first")
'''


def test_plugin_fixture_fails_the_test_when_outside_changed(pytester):
    import importlib.metadata as md

    names = [ep.value for ep in md.entry_points(group="pytest11") if ep.name == "sandbox_fs"]
    assert names == ["sandbox_fs.testing._plugin"], "the pytest11 entry point is not installed"
    pytester.makepyfile(test_downstream=PLUGIN_TESTS)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=4, errors=1)
    out = result.stdout.str()
    assert "secret.txt: size, mtime_ns, ctime_ns, content" in out
    assert "planted: created" in out
    assert "symlink escapes the destination: l" in out
    assert "sub/new: created" in out  # reported at teardown when the body raised first
