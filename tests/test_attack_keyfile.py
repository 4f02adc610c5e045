"""Hostile-review attacks on the installation key file ``.state-key`` (the review of 2026-12-03).

A snapshot store directory another user can write is hostile.  Before the
fix, a ``.state-key`` planted there (or left readable by others) was taken
as the installation key: its author could forge session states and, with the
baseline MAC key derived from it, a baseline that makes persist record a
changed file's previous content.  Each test checks an outside sentinel: what
a restore of the next persist gives back, or that nothing of a planted key
was used.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sandbox_fs import open_root
from sandbox_fs.cli import main
from sandbox_fs.client import ClientOptions, LocalSandboxClient, UnsafeKeyFileError
from sandbox_fs.snapshot import DirectorySnapshotStore, hydrate, persist
from sandbox_fs.snapshot import _hydrate
from sandbox_fs.snapshot._baseline import Baseline, baseline_key_of, write_baseline

EVIL = b"e" * 64  # the key the other user knows
OTHER_UID = 54321

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="planting a file as another user needs root")


def _plant_as_other_user(directory: Path, name: str, data: bytes) -> None:
    """Create ``directory/name`` holding ``data`` as another uid and gid, in a child process.

    The directory is opened before the child drops privileges, so only its
    own permission bits decide (pytest's base directory is 0700).
    """
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dfd)
            os.write(fd, data)
            os.close(fd)
            code = 0
        finally:
            os._exit(code)
    os.close(dfd)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert os.stat(directory / name).st_uid == OTHER_UID


def _forge_baseline(sdir: Path, ws: Path, key: bytes) -> None:
    """What the planted key's author does: a baseline saying the changed file ``f`` is unchanged."""
    with DirectorySnapshotStore(sdir) as st:
        info = st.info("n")
        assert info is not None
        with open_root(ws) as r:  # the changed file's new inode and times, "taken" in the future
            listings = _hydrate._baseline_listings(r, time.time_ns() + 10**12, 1000)
        write_baseline(st.objects, "n", Baseline(info.generation, info.digest, "", listings=listings),
                       baseline_key_of(key))


@needs_root
def test_a_key_planted_in_a_shared_store_never_makes_persist_commit_a_files_old_content(tmp_path: Path) -> None:
    """Another user who can write the store plants ``.state-key`` before its first use, then forges the
    baseline of a restore; the next persist (a new process) must still record the workspace's change."""
    sdir, w, out = tmp_path / "store", tmp_path / "w", tmp_path / "out"
    sdir.mkdir()
    os.chmod(sdir, 0o777)  # a store directory another tenant can write
    w.mkdir()
    _plant_as_other_user(sdir, ".state-key", EVIL + b"\n")
    (w / "f").write_text("one\n")
    with DirectorySnapshotStore(sdir) as st, open_root(w) as r:
        persist(r, st, "n")
    with DirectorySnapshotStore(sdir) as st, open_root(w) as r:
        hydrate(r, st, "n")
    time.sleep(0.025)
    (w / "f").write_text("TWO\n")
    _forge_baseline(sdir, w, EVIL)
    with DirectorySnapshotStore(sdir) as st, open_root(w) as r, open_root(out, create=True) as o:
        persist(r, st, "n")
        hydrate(o, st, "n")
    assert (out / "f").read_text() == "TWO\n"  # the sentinel: the change was committed
    with DirectorySnapshotStore(sdir) as st:
        assert st.baseline_key is None  # nothing is derived from a key another user wrote
    with pytest.raises(UnsafeKeyFileError) as ei:  # and no session state is signed with that key
        LocalSandboxClient(ClientOptions(workspaces_dir=str(tmp_path / "ws"), snapshot_dir=str(sdir)))
    assert ei.value.context["reason"] == "its directory is writable by group or others (they could replace the key)"


@needs_root
def test_a_key_of_another_user_in_a_sticky_shared_directory_is_refused(tmp_path: Path) -> None:
    """A sticky directory keeps others from replacing this user's key, not from making it first."""
    wsd = tmp_path / "ws"
    wsd.mkdir()
    os.chmod(wsd, 0o1777)
    _plant_as_other_user(wsd, ".state-key", EVIL + b"\n")
    with pytest.raises(UnsafeKeyFileError) as ei:
        LocalSandboxClient(ClientOptions(workspaces_dir=str(wsd)))
    assert ei.value.context["reason"] == "owned by another user"


def _plant(sdir: Path, kind: str, mode: int, dir_mode: int) -> None:
    key = sdir / ".state-key"
    if kind == "file":
        key.write_bytes(EVIL + b"\n")
        os.chmod(key, mode)
    elif kind == "hardlink":  # a second name of a file the other party can read or write
        (sdir.parent / "elsewhere").write_bytes(EVIL + b"\n")
        os.chmod(sdir.parent / "elsewhere", 0o600)
        os.link(sdir.parent / "elsewhere", key)
    elif kind == "symlink":  # within the store: followed, it would read a file of the writer's choosing
        (sdir / "k").write_bytes(EVIL + b"\n")
        os.chmod(sdir / "k", 0o600)
        os.symlink("k", key)
    elif kind == "fifo":
        os.mkfifo(key, 0o600)
    os.chmod(sdir, dir_mode)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["file", "hardlink", "symlink", "fifo"]),
       mode=st.integers(0o400, 0o777).map(lambda m: m | 0o600),
       dir_mode=st.sampled_from([0o700, 0o755, 0o770, 0o777, 0o1777, 0o1770, 0o707]))
@example(kind="file", mode=0o600, dir_mode=0o700)  # the safe case: the key is used
@example(kind="file", mode=0o600, dir_mode=0o1777)  # sticky: others cannot replace this user's key
@example(kind="file", mode=0o644, dir_mode=0o700)  # readable by others
@example(kind="file", mode=0o600, dir_mode=0o777)  # replaceable by others
def test_property_a_key_another_user_could_write_or_read_is_never_used(tmp_path_factory: pytest.TempPathFactory,
                                                                       kind: str, mode: int, dir_mode: int) -> None:
    """Every key file/directory combination: the key is used iff it is a 0600 regular file with one link in a
    directory no one else may change; otherwise the store derives no baseline key and the client refuses."""
    sdir = tmp_path_factory.mktemp("k") / "store"
    sdir.mkdir()
    _plant(sdir, kind, mode, dir_mode)
    safe = kind == "file" and (mode & 0o077) == 0 and ((dir_mode & 0o022) == 0 or bool(dir_mode & stat.S_ISVTX))
    try:
        with DirectorySnapshotStore(sdir) as st:
            assert (st.baseline_key == baseline_key_of(EVIL)) is safe
            assert safe or st.baseline_key is None
        if safe:
            client = LocalSandboxClient(ClientOptions(workspaces_dir=str(sdir.parent / "w"), snapshot_dir=str(sdir)))
            client.close()
        else:
            with pytest.raises(UnsafeKeyFileError):
                LocalSandboxClient(ClientOptions(workspaces_dir=str(sdir.parent / "w"), snapshot_dir=str(sdir)))
    finally:
        os.chmod(sdir, 0o700)
    assert (sdir.parent / "elsewhere").exists() is (kind == "hardlink")  # nothing outside the store was touched


def test_cli_refuses_a_shared_store_key_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``session create`` over a group/other-writable store: one error line, no traceback, no host path."""
    sdir = tmp_path / "store"
    sdir.mkdir()
    os.chmod(sdir, 0o777)
    try:
        rc = main(["session", "create", "--workspaces-dir", str(tmp_path / "ws"), "--store", str(sdir),
                   "--state", str(tmp_path / "s.json")])
    finally:
        os.chmod(sdir, 0o700)
    _out, err = capsys.readouterr()
    assert rc == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "unsafe_key_file" in lines[0] and str(tmp_path) not in lines[0]
    assert not (tmp_path / "s.json").exists()
