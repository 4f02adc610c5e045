"""Escape attempts against Root, with both resolvers.

Each test checks the outside sentinel tree (``layout``) is unchanged and
that no outside data is returned, not only that an error was raised.
"""

from __future__ import annotations

import os
import stat

import pytest

from sandbox_fs import PathEscapeError, SymlinkRefusedError, open_root


@pytest.fixture
def env(layout, resolver):
    before = layout.snapshot()
    root = open_root(layout.ws)
    yield layout, root
    root.close()
    layout.assert_outside_unchanged(before)


def test_dotdot_and_absolute(env):
    layout, root = env
    root.mkdir("a")
    for p in ("../outside/secret.txt", "a/../../outside/secret.txt", "./../outside/secret.txt",
              str(layout.outside / "secret.txt"), "/etc/passwd"):
        with pytest.raises(PathEscapeError):
            root.read_bytes(p)
        with pytest.raises(PathEscapeError):
            root.write_bytes(p, b"pwned")


def test_symlink_to_etc_and_outside(env):
    layout, root = env
    os.symlink("/etc", layout.ws / "etc")
    os.symlink("../outside", layout.ws / "out")
    os.symlink(str(layout.outside / "secret.txt"), layout.ws / "abs_secret")
    for p in ("etc/passwd", "out/secret.txt", "abs_secret", "out/subdir/inner.txt"):
        with pytest.raises(PathEscapeError):
            root.read_bytes(p)
    for p in ("out/pwned.txt", "out/subdir/pwned", "etc/pwned"):
        with pytest.raises((PathEscapeError, SymlinkRefusedError)):
            root.write_bytes(p, b"pwned")
        with pytest.raises((PathEscapeError, SymlinkRefusedError)):
            root.mkdir(p)
    with pytest.raises(PathEscapeError):
        root.listdir("out")
    assert not (layout.outside / "pwned.txt").exists()


def test_symlink_chains_and_loops(env):
    layout, root = env
    ws = layout.ws
    os.symlink("l2", ws / "l1")
    os.symlink("l3", ws / "l2")
    os.symlink("../outside/secret.txt", ws / "l3")
    os.symlink("loop_b", ws / "loop_a")
    os.symlink("loop_a", ws / "loop_b")
    with pytest.raises(PathEscapeError):
        root.read_bytes("l1")
    with pytest.raises(SymlinkRefusedError):
        root.read_bytes("loop_a")
    os.symlink("..", ws / "up")
    with pytest.raises(PathEscapeError):
        root.read_bytes("up/outside/secret.txt")
    with pytest.raises(PathEscapeError):
        root.write_bytes("up/outside/pwned", b"x")


def test_proc_magic_links(resolver, layout):
    before = layout.snapshot()
    with open_root(f"/proc/{os.getpid()}") as proc:
        for p in ("root/etc/passwd", "cwd", "fd/0", "exe"):
            with pytest.raises((SymlinkRefusedError, PathEscapeError)):
                proc.read_bytes(p)
    # a magic link planted in a workspace through a bind of proc is out of
    # scope; a symlink named like one is just text and stays confined
    os.symlink("/proc/self/root/etc/passwd", layout.ws / "magic")
    with open_root(layout.ws) as root:
        with pytest.raises(PathEscapeError):
            root.read_bytes("magic")
    layout.assert_outside_unchanged(before)


def test_leaf_symlink_targets_untouched(env):
    layout, root = env
    ws = layout.ws
    target = layout.outside / "sentinel.txt"
    os.symlink(str(target), ws / "abs")
    os.symlink("../outside/sentinel.txt", ws / "rel")
    for name in ("abs", "rel"):
        root.remove(name)  # removes the link itself
        assert target.exists()
    os.symlink("../outside/sentinel.txt", ws / "rel")
    with pytest.raises(SymlinkRefusedError):
        root.chmod("rel", 0o777)
    root.write_bytes("rel", b"replaced")  # replaces the link, not its target
    assert root.read_bytes("rel") == b"replaced"
    os.symlink("../outside", ws / "dirlink")
    root.rmtree("dirlink")  # the link goes, the outside tree stays
    assert not os.path.lexists(ws / "dirlink")
    os.symlink("../outside/sentinel.txt", ws / "t")
    root.utime("t", ns=(0, 0))
    with pytest.raises((PathEscapeError, SymlinkRefusedError)):
        root.open("t", "w")
    with pytest.raises((PathEscapeError, SymlinkRefusedError)):
        root.open("t", "a")
    with pytest.raises(PathEscapeError):
        root.link("t/../x", "y")


def test_directory_swapped_for_symlink_between_calls(env):
    layout, root = env
    ws = layout.ws
    root.mkdir("d")
    root.write_bytes("d/f", b"inside")
    assert root.read_bytes("d/f") == b"inside"
    # attacker swaps d for a symlink to outside between our calls
    os.rename(ws / "d", ws / "d.old")
    os.symlink("../outside/subdir", ws / "d")
    with pytest.raises(PathEscapeError):
        root.read_bytes("d/inner.txt")
    with pytest.raises(PathEscapeError):
        root.write_bytes("d/f", b"pwned")
    with pytest.raises(PathEscapeError):
        root.remove("d/inner.txt")
    with pytest.raises(PathEscapeError):
        root.rename("d.old/f", "d/f")
    with pytest.raises(PathEscapeError):
        root.chmod("d/inner.txt", 0o777)


def test_held_child_root_survives_rename_of_its_path(env):
    layout, root = env
    root.mkdir("w")
    child = root.open_root("w")
    os.rename(layout.ws / "w", layout.ws / "w2")
    os.symlink("../outside", layout.ws / "w")
    child.write_bytes("new", b"ok")  # still the original directory
    child.close()
    assert (layout.ws / "w2" / "new").read_bytes() == b"ok"


def test_no_symlinks_root_refuses_inside_links_too(layout, resolver):
    os.makedirs(layout.ws / "real")
    os.symlink("real", layout.ws / "alias")
    with open_root(layout.ws, no_symlinks=True) as r:
        with pytest.raises(SymlinkRefusedError):
            r.write_bytes("alias/f", b"x")
        with pytest.raises(SymlinkRefusedError):
            r.stat("alias/.")
        r.write_bytes("real/f", b"x")
    assert not stat.S_ISLNK(os.lstat(layout.ws / "real" / "f").st_mode)
