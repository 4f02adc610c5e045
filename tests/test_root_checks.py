"""Root's own checks, each pinned on its own (mutants of root.py that the attack tests did not kill).

See mutants/survivors.md: every test here fails with one recorded mutant applied.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path, PurePosixPath

import pytest

from sandbox_fs import _hooks
from sandbox_fs.errors import InvalidPathError, PathEscapeError, ReadOnlyError, SymlinkRefusedError
from sandbox_fs.paths import Grant, PathPolicy
from sandbox_fs.root import SpecialFileError, open_host_file_fd, open_root


def test_relative_paths_of_every_type(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"x")
    with open_root(tmp_path) as root:
        assert root.read_bytes(PurePosixPath("d/f")) == b"x"  # os.PathLike takes the slow path
        assert root.read_bytes(b"d/f") == b"x"
        with pytest.raises(InvalidPathError):
            root.read_bytes(b"d/f\0junk")  # never handed to C, where it would name "d/f"
        with pytest.raises(PathEscapeError, match="absolute paths are not beneath the root"):
            root.read_bytes(b"/etc/passwd")  # refused before any syscall, not by the kernel's EXDEV


def test_write_open_refuses_a_fifo_and_restores_blocking_mode(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "f").write_bytes(b"x")
    with open_root(tmp_path) as root:
        with pytest.raises(SpecialFileError):
            root.open_fd("fifo", os.O_RDWR)  # O_RDWR|O_NONBLOCK opens a FIFO: only the fstat check refuses it
        fd = root.open_fd("f", os.O_RDWR)
        try:
            assert os.get_blocking(fd)  # opened O_NONBLOCK, handed back blocking
        finally:
            os.close(fd)
        fd = root.open_fd("f", os.O_RDWR | os.O_NONBLOCK)
        try:
            assert not os.get_blocking(fd)  # the caller asked for it
        finally:
            os.close(fd)


def test_the_parent_hook_fires_only_when_installed(tmp_path):
    seen: list[tuple[str, bytes]] = []
    with open_root(tmp_path) as root:
        with _hooks.installed(lambda name, ctx: seen.append((name, ctx["path"]))):
            root.mkdir("d")
        root.mkdir("e")
    assert seen == [("root.parent", b"d")]


@pytest.fixture
def nested(tmp_path):
    """A workspace inside a read-only grant, a read-only grant inside the workspace, and a plain file."""
    ws = tmp_path / "ws"
    (ws / "ro").mkdir(parents=True)
    (ws / "f").write_bytes(b"x")
    os.symlink("ro", ws / "alias")
    with open_root(ws) as root, PathPolicy(root, str(ws), [Grant(str(tmp_path), True),
                                                           Grant(str(ws / "ro"), True)]) as pol:
        yield ws, pol.workspace


def test_read_only_grant_checks_stop_at_the_roots_own_directory(nested):
    ws, w = nested
    w.write_bytes("new", b"ok")  # the read-only grant above the workspace does not reach into it
    w.chmod("f", 0o600)  # in place, one link: allowed
    w.remove("alias")  # a link to a read-only grant is not the grant
    assert (ws / "new").read_bytes() == b"ok" and not os.path.lexists(ws / "alias")
    with pytest.raises(ReadOnlyError) as ei:
        w.write_bytes("ro/x", b"no")
    assert ei.value.sandbox_path == "ro/x"
    os.link(ws / "f", ws / "f2")
    with pytest.raises(ReadOnlyError):
        w.chmod("f", 0o644)  # in place, two links: it could be a hard link into a grant


def test_symlink_target_rules(tmp_path):
    with open_root(tmp_path) as root:
        root.symlink("a/" * 2047 + "a", "long")  # 4095 bytes: PATH_MAX - 1
        assert len(os.readlink(tmp_path / "long")) == 4095
        for bad in ("", "a\0b", "a/" * 2048):
            with pytest.raises(InvalidPathError):
                root.symlink(bad, "l")
    with open_root(tmp_path, read_only=True) as ro:
        with pytest.raises(ReadOnlyError):
            ro.symlink("x", "l2")
    assert not os.path.lexists(tmp_path / "l") and not os.path.lexists(tmp_path / "l2")


def test_host_path_errors_keep_their_errno_and_label(tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink("real", tmp_path / "link")
    with open_root(tmp_path / "link", follow_symlinks=True, create=True):
        pass  # an existing directory through a trusted link
    with pytest.raises(FileNotFoundError):
        open_root(tmp_path / "missing", follow_symlinks=True)
    with pytest.raises(FileNotFoundError):
        open_root("/proc/sfs-no-such-dir", create=True)  # mkdirat's own errno (ENOENT on /proc)
    with pytest.raises(FileNotFoundError) as ei:
        open_host_file_fd(tmp_path / "missing.txt", label="cfg")
    assert ei.value.errno == errno.ENOENT and ei.value.filename == "cfg"


def test_host_file_fd_is_read_only_blocking_and_never_follows(tmp_path: Path):
    (tmp_path / "f").write_bytes(b"data")
    os.symlink("f", tmp_path / "l")
    for follow in (False, True):
        fd = open_host_file_fd(tmp_path / "f", follow_symlinks=follow)
        try:
            assert os.read(fd, 10) == b"data" and os.get_blocking(fd)
        finally:
            os.close(fd)
    with pytest.raises(SymlinkRefusedError):
        open_host_file_fd(tmp_path / "l")
