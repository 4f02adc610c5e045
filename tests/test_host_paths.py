"""Trusted host paths are never walked through a symlink a sandboxed party could plant (issue 11, E).

A confined command can write its workspace, so it can plant ``ws/data ->
../outside``.  Every entry point that takes a host path (library and CLI:
grants, ``--root``, ``--base``, ``--into``, ``--workspace``, ``--store``,
``workspaces_dir``, ``snapshot_dir``, input and output files) is tried with
a path through that link; each case checks the outside sentinel tree (not
only an error): unchanged, nothing read into the workspace or the output.
"""

from __future__ import annotations

import io
import json
import os
import stat
import sys
import tarfile
from pathlib import Path

import pytest

import sandbox_fs
from sandbox_fs import cli
from sandbox_fs.client import ClientOptions, LocalSandboxClient
from sandbox_fs.errors import SymlinkRefusedError
from sandbox_fs.paths import Grant, PathPolicy
from sandbox_fs import root as sfs_root
from sandbox_fs.root import SpecialFileError, open_root
from sandbox_fs.snapshot import LocalSnapshotStore, hydrate, persist

needs_landlock = pytest.mark.skipif(sandbox_fs.features()["landlock_abi"] == 0,
                                    reason="kernel has no Landlock (features()['landlock_abi'] == 0)")


@pytest.fixture
def planted(layout):
    """``ws/data`` and ``ws/vendor`` -> ``../outside``, as a confined command could leave them."""
    os.symlink("../outside", layout.ws / "data")
    os.symlink("../outside", layout.ws / "vendor")
    return layout


def _tar_bytes(name: str = "x.txt", data: bytes = b"from-archive\n") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _refused(exc: BaseException) -> None:
    assert isinstance(exc, SymlinkRefusedError), repr(exc)
    assert exc.code == "symlink_refused"


# --------------------------------------------------------------- the rule itself

@pytest.mark.parametrize("rel", ["data", "data/subdir", "data/subdir/", "./data/../data/subdir", "vendor//subdir"])
def test_open_root_refuses_a_symlink_on_any_component(planted, resolver, rel):
    before = planted.snapshot()
    with pytest.raises(SymlinkRefusedError) as info:
        open_root(f"{planted.ws}/{rel}", label="grant")
    _refused(info.value)
    assert str(planted.base) not in str(info.value), "a host path leaked into str()"
    assert "[grant]" in str(info.value)
    planted.assert_outside_unchanged(before)


def test_relative_host_paths_resolve_from_an_fd_of_the_cwd(planted, resolver, monkeypatch):
    monkeypatch.chdir(planted.ws)
    with pytest.raises(SymlinkRefusedError):
        open_root("data/subdir")
    with open_root("../outside/subdir") as r:  # leading '..' climb physically from the cwd fd
        assert r.listdir() == ["inner.txt"]
    with open_root(".") as r:
        assert r.identity == open_root(str(planted.ws)).identity


def test_dotdot_is_lexical_so_a_symlink_before_it_is_not_walked(planted, resolver):
    # /ws/data/../outside would be /outside/../outside physically through the link: lexically it
    # is ws/outside (missing) and the link itself is never entered
    with pytest.raises(FileNotFoundError):
        open_root(f"{planted.ws}/data/../outside")
    with open_root(f"{planted.ws}/../outside") as r:
        assert "secret.txt" in r.listdir()


def test_create_never_follows_a_planted_symlink(planted, resolver):
    before = planted.snapshot()
    with pytest.raises(SymlinkRefusedError):
        open_root(f"{planted.ws}/data/new/deeper", create=True)
    planted.assert_outside_unchanged(before)
    with open_root(f"{planted.ws}/made/deeper", create=True) as r:
        assert r.listdir() == []
    assert stat.S_IMODE(os.stat(planted.ws / "made").st_mode) & 0o077 == 0


def test_follow_symlinks_is_the_explicit_opt_in(planted, resolver):
    with open_root(f"{planted.ws}/data/subdir", follow_symlinks=True, read_only=True) as r:
        assert r.listdir() == ["inner.txt"]
    fd = sfs_root.open_host_dir_fd(f"{planted.ws}/data", follow_symlinks=True)
    os.close(fd)


def test_magic_links_and_proc_self_are_refused(resolver):
    with pytest.raises(SymlinkRefusedError):
        open_root("/proc/self/root/tmp")
    with pytest.raises(SymlinkRefusedError):
        open_root(f"/proc/self/fd/{0}")


def test_this_machines_trusted_paths_have_no_symlink():
    """The suite and scripts/main.sh pass these: with a symlink on them the refusal would be the cause."""
    import tempfile

    for p in (sys.base_prefix, tempfile.gettempdir(), os.getcwd()):
        assert os.path.realpath(p) == os.path.abspath(p), f"{p} holds a symlink: use its realpath"
        open_root(p).close()


# --------------------------------------------------------------- library entry points

def test_library_grant_through_a_symlink_is_refused(planted, resolver):
    with open_root(planted.ws) as ws:
        for ro in (True, False):
            with pytest.raises(SymlinkRefusedError):
                PathPolicy(ws, str(planted.ws), [Grant(f"{planted.ws}/data/subdir", read_only=ro)])


def test_library_workspaces_dir_and_snapshot_dir(planted, resolver):
    before = planted.snapshot()
    with pytest.raises(SymlinkRefusedError):
        LocalSandboxClient(ClientOptions(workspaces_dir=f"{planted.ws}/data/wsdir"))
    with pytest.raises(SymlinkRefusedError):
        LocalSandboxClient(ClientOptions(workspaces_dir=str(planted.base / "w"),
                                         snapshot_dir=f"{planted.ws}/data/store"))
    with pytest.raises(SymlinkRefusedError):
        LocalSnapshotStore(f"{planted.ws}/vendor/store")
    planted.assert_outside_unchanged(before)


async def test_library_caller_root_through_a_symlink(planted, resolver):
    before = planted.snapshot()
    opts = ClientOptions(workspaces_dir=str(planted.base / "w"))
    with LocalSandboxClient(opts) as client:
        session = client.create(root=f"{planted.ws}/vendor/subdir")
        with pytest.raises(SymlinkRefusedError):
            await session.start()
    planted.assert_outside_unchanged(before)


async def test_library_base_dir_through_a_symlink(planted, resolver):
    from sandbox_fs.manifest import load_manifest
    from sandbox_fs.materialize import MaterializeOptions, materialize

    before = planted.snapshot()
    m = load_manifest(json.dumps({"entries": {"copy.txt": {"type": "local_file", "src": "secret.txt"}}}),
                      trust="untrusted")
    (planted.ws / "target").mkdir()
    with open_root(planted.ws / "target") as ws:
        with pytest.raises(SymlinkRefusedError):
            await materialize(ws, m, MaterializeOptions(base_dir=f"{planted.ws}/data"))
    planted.assert_outside_unchanged(before)
    planted.assert_secret_absent()


def test_library_extract_source_path(planted, resolver):
    from sandbox_fs.archive import extract

    (planted.outside / "evil.tar").write_bytes(_tar_bytes(data=planted.secret.encode()))
    before = planted.snapshot()
    (planted.ws / "into").mkdir()
    with open_root(planted.ws / "into") as into:
        with pytest.raises(SymlinkRefusedError):
            extract(into, ".", f"{planted.ws}/data/evil.tar")
    planted.assert_outside_unchanged(before)
    planted.assert_secret_absent()


def test_library_persist_and_hydrate_through_a_symlink(planted, resolver, tmp_path):
    before = planted.snapshot()
    with LocalSnapshotStore(tmp_path / "store") as store:
        with pytest.raises(SymlinkRefusedError):
            with open_root(f"{planted.ws}/data/subdir", read_only=True) as ws:
                persist(ws, store, "s")
        assert store.info("s") is None
        (tmp_path / "good").mkdir()
        with open_root(tmp_path / "good") as ws:
            persist(ws, store, "s")
        with pytest.raises(SymlinkRefusedError):
            with open_root(f"{planted.ws}/vendor/subdir") as ws:
                hydrate(ws, store, "s")
    planted.assert_outside_unchanged(before)


# --------------------------------------------------------------- CLI entry points

@pytest.fixture
def cli_env(planted, tmp_path):
    """A manifest, a snapshot of an empty tree in a store, and an archive, all outside the workspace."""
    m = tmp_path / "m.json"
    m.write_text(json.dumps({"entries": {"made.txt": {"type": "file", "content": "made\n"}}}))
    arc = tmp_path / "a.tar"
    arc.write_bytes(_tar_bytes())
    (tmp_path / "empty").mkdir()
    assert cli.main(["snapshot", "save", "--workspace", str(tmp_path / "empty"), "--store",
                     str(tmp_path / "store"), "--name", "s"]) == 0
    (planted.outside / "evil.tar").write_bytes(_tar_bytes(data=planted.secret.encode()))
    (planted.outside / "m.json").write_text(m.read_text())
    return planted, m, arc, tmp_path


def _cli_cases():
    W = "{ws}"
    return {
        "run --root": ["run", "--manifest", "{m}", "--workspaces-dir", "{t}/wd", "--root", W + "/vendor/r",
                       "--confinement", "none", "--", "true"],
        "run --workspaces-dir": ["run", "--manifest", "{m}", "--workspaces-dir", W + "/data/wd",
                                 "--confinement", "none", "--", "true"],
        "run --snapshot-dir": ["run", "--manifest", "{m}", "--workspaces-dir", "{t}/wd", "--snapshot-dir",
                               W + "/data/snaps", "--confinement", "none", "--", "true"],
        "run --base": ["run", "--manifest", "{t}/src.json", "--workspaces-dir", "{t}/wd", "--base", W + "/data/subdir",
                       "--confinement", "none", "--", "true"],
        "run --manifest": ["run", "--manifest", W + "/data/m.json", "--workspaces-dir", "{t}/wd",
                           "--confinement", "none", "--", "true"],
        "run --state": ["run", "--manifest", "{m}", "--workspaces-dir", "{t}/wd", "--state",
                        W + "/data/state.json", "--confinement", "none", "--", "true"],
        "session create --workspaces-dir": ["session", "create", "--workspaces-dir", W + "/data/wd",
                                            "--state", "{t}/st.json"],
        "session create --store": ["session", "create", "--workspaces-dir", "{t}/wd", "--store",
                                   W + "/data/store", "--state", "{t}/st.json"],
        "session create --root": ["session", "create", "--workspaces-dir", "{t}/wd", "--root",
                                  W + "/vendor/subdir", "--manifest", "{m}", "--state", "{t}/st.json"],
        "session create --state": ["session", "create", "--workspaces-dir", "{t}/wd", "--manifest", "{m}",
                                   "--state", W + "/data/st.json"],
        "snapshot save --workspace": ["snapshot", "save", "--workspace", W + "/data/subdir", "--store",
                                      "{t}/store", "--name", "leak"],
        "snapshot save --store": ["snapshot", "save", "--workspace", "{t}/empty", "--store",
                                  W + "/data/store", "--name", "s"],
        "snapshot restore --workspace": ["snapshot", "restore", "--workspace", W + "/vendor/subdir",
                                         "--store", "{t}/store", "--name", "s"],
        "snapshot ls --store": ["snapshot", "ls", "--store", W + "/data/subdir"],
        "apply --root": ["apply", "{m}", "--root", W + "/vendor/subdir/x"],
        "apply --root (existing)": ["apply", "{m}", "--root", W + "/vendor/subdir"],
        "apply --base": ["apply", "{t}/src.json", "--root", "{t}/ap", "--base", W + "/data/subdir"],
        "apply --grant": ["apply", "{t}/grant.json", "--root", "{t}/ap",
                          "--grant", W + "/data/subdir"],
        "apply MANIFEST": ["apply", W + "/data/m.json", "--root", "{t}/ap"],
        "extract --into (new)": ["extract", "{arc}", "--into", W + "/vendor/subdir/x"],
        "extract --into (existing)": ["extract", "{arc}", "--into", W + "/vendor/subdir"],
        "extract --into --in-place": ["extract", "{arc}", "--into", W + "/vendor/subdir", "--in-place"],
        "extract ARCHIVE": ["extract", W + "/data/evil.tar", "--into", "{t}/ex"],
    }


CLI_CASES = _cli_cases()


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_cli_entry_point_through_a_planted_symlink(cli_env, capsys, case):
    layout, m, arc, t = cli_env
    (t / "src.json").write_text(json.dumps({"entries": {"c.txt": {"type": "local_file", "src": "inner.txt"}}}))
    (t / "grant.json").write_text(json.dumps({"entries": {"c.txt": {
        "type": "local_file", "src": f"{layout.ws}/data/subdir/inner.txt"}}}))
    argv = [a.format(ws=layout.ws, m=m, t=t, arc=arc) for a in CLI_CASES[case]]
    before = layout.snapshot()
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    assert rc != 0, f"{case}: accepted a path through a planted symlink"
    assert "symlink_refused" in err or "symlink" in err, err
    errors = [ln for ln in err.splitlines() if ln.startswith("sandbox-fs: error")]
    assert len(errors) == 1 and "Traceback" not in err, err  # (run may print its note on the command first)
    assert layout.secret not in out + err
    layout.assert_outside_unchanged(before)
    for d in (t / "ex", t / "ap", t / "store"):
        if d.exists():
            for dirpath, _dirs, files in os.walk(d):
                for f in files:
                    assert layout.secret.encode() not in Path(dirpath, f).read_bytes(), f"{case}: secret stored"


@needs_landlock
@pytest.mark.parametrize("mode", ["rw", "ro"])
def test_cli_run_grant_through_a_planted_symlink(cli_env, capsys, mode):
    layout, m, _arc, t = cli_env
    g = f"{layout.ws}/data/subdir"
    before = layout.snapshot()
    rc = cli.main(["run", "--manifest", str(m), "--workspaces-dir", str(t / "wd"), "--grant", f"{g}:{mode}",
                   "--", "/bin/sh", "-c", f"cat {g}/inner.txt; echo pwned > {g}/w.txt"])
    out, err = capsys.readouterr()
    assert rc == 1 and "symlink_refused" in err, err
    assert layout.secret not in out + err
    layout.assert_outside_unchanged(before)


def test_cli_follow_host_symlinks_opt_in(cli_env, capsys):
    layout, _m, arc, _t = cli_env
    rc = cli.main(["extract", str(arc), "--into", f"{layout.ws}/vendor/subdir/x", "--follow-host-symlinks"])
    capsys.readouterr()
    assert rc == 0
    assert (layout.outside / "subdir" / "x" / "x.txt").read_bytes() == b"from-archive\n"


# --------------------------------------------------------------- operator output files

@pytest.fixture
def device(tmp_path):
    """A character device node like /dev/full, made in a throw-away directory (needs root)."""
    if os.geteuid() != 0:
        pytest.skip("making a device node needs root")
    p = tmp_path / "full"
    os.mknod(p, 0o666 | stat.S_IFCHR, os.makedev(1, 7))
    return p


def test_state_never_replaces_a_special_file(tmp_path, device, capsys):
    st = os.lstat(device)
    rc = cli.main(["session", "create", "--workspaces-dir", str(tmp_path / "wd"), "--state", str(device)])
    _out, err = capsys.readouterr()
    assert rc == 1 and "special_file" in err, err
    now = os.lstat(device)
    assert stat.S_ISCHR(now.st_mode) and now.st_ino == st.st_ino and now.st_rdev == st.st_rdev
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".sfs-")] == []


@pytest.mark.parametrize("kind", ["device", "fifo", "symlink", "directory"])
def test_write_host_file_atomic_refuses_non_regular_targets(tmp_path, kind):
    target = tmp_path / "out"
    if kind == "device":
        if os.geteuid() != 0:
            pytest.skip("making a device node needs root")
        os.mknod(target, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    elif kind == "fifo":
        os.mkfifo(target)
    elif kind == "symlink":
        (tmp_path / "victim").write_text("keep\n")
        os.symlink("victim", target)
    else:
        target.mkdir()
    before = os.lstat(target)
    with pytest.raises(SpecialFileError) as info:
        sfs_root.write_host_file_atomic(target, b"data", label="state")
    assert str(tmp_path) not in str(info.value)
    after = os.lstat(target)
    assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino)
    if kind == "symlink":
        assert (tmp_path / "victim").read_text() == "keep\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out"] + (["victim"] if kind == "symlink" else []))


def test_write_host_file_atomic_replaces_a_regular_file(tmp_path):
    target = tmp_path / "state.json"
    sfs_root.write_host_file_atomic(target, b"one")
    old_ino = os.stat(target).st_ino
    sfs_root.write_host_file_atomic(target, b"two", mode=0o640)
    assert target.read_bytes() == b"two" and os.stat(target).st_ino != old_ino
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o640
    assert sorted(os.listdir(tmp_path)) == ["state.json"]


def test_input_files_must_be_regular_and_unlinked(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "real").write_text("x")
    os.symlink("real", tmp_path / "link")
    with pytest.raises(SpecialFileError):
        sfs_root.open_host_file_fd(tmp_path / "fifo")  # never blocks on a FIFO
    with pytest.raises(SymlinkRefusedError):
        sfs_root.open_host_file_fd(tmp_path / "link")
    fd = sfs_root.open_host_file_fd(tmp_path / "real")
    try:
        assert os.read(fd, 4) == b"x"
    finally:
        os.close(fd)


def test_state_write_race_exchange_back(tmp_path, monkeypatch):
    """A special file put at the name between the look and the exchange is exchanged back, never replaced."""
    target = tmp_path / "state.json"
    target.write_text("old")
    real_stat = os.stat
    swapped = []

    def racing_stat(path, *a, **kw):
        st = real_stat(path, *a, **kw)
        if path == b"state.json" and not swapped:
            swapped.append(True)
            os.unlink(target)
            os.mkfifo(target)  # the racer's special file
        return st

    monkeypatch.setattr(sfs_root.os, "stat", racing_stat)
    with pytest.raises(SpecialFileError):
        sfs_root.write_host_file_atomic(target, b"new")
    monkeypatch.undo()
    assert stat.S_ISFIFO(os.lstat(target).st_mode)
    assert sorted(os.listdir(tmp_path)) == ["state.json"]


@pytest.mark.parametrize("kind", ["fifo", "symlink-parent"])
def test_run_refuses_an_unwritable_state_before_the_command_runs(tmp_path, kind, capsys):
    """A --state that could not be written is refused first: the command never runs, nothing is made."""
    (tmp_path / "base").mkdir()
    manifest = tmp_path / "m.json"
    manifest.write_text('{"entries": {}}')
    if kind == "fifo":
        os.mkfifo(tmp_path / "st")
        state = tmp_path / "st"
    else:
        (tmp_path / "real").mkdir()
        os.symlink("real", tmp_path / "lnk")
        state = tmp_path / "lnk" / "st.json"
    marker = tmp_path / "ran"
    rc = cli.main(["run", "--manifest", str(manifest), "--base", str(tmp_path / "base"),
                   "--root", str(tmp_path / "ws"), "--state", str(state), "--confinement", "none",
                   "--", "/bin/sh", "-c", f"echo x > {marker}"])
    _out, err = capsys.readouterr()
    assert rc != 0 and ("special_file" in err or "symlink_refused" in err), err
    assert not marker.exists() and not (tmp_path / "ws").exists()
    assert os.listdir(tmp_path / "real") == [] if kind != "fifo" else stat.S_ISFIFO(os.lstat(state).st_mode)
