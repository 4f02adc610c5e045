"""Session lifecycle: start modes, ephemeral entries, hooks, failures, cleanup, concurrency."""

from __future__ import annotations

import errno
import io
import os
import stat
import tarfile

import pytest
import trio

import sandbox_fs.snapshot as snapmod
from sandbox_fs import Grant
from sandbox_fs.client import ClientOptions, LocalSandboxClient
from sandbox_fs.errors import InvalidPathError, PathEscapeError, ReadOnlyError
from sandbox_fs.manifest import load_manifest
from sandbox_fs.session import (
    CrossRootError,
    MountOverlapError,
    PersistDisabledError,
    SessionBusyError,
    SessionNotStartedError,
)
from sandbox_fs.snapshot import SnapshotNotFoundError, UnrestorableEntryError

MANIFEST = {
    "entries": {
        "README.md": {"type": "file", "content": "hello\n"},
        "src": {"type": "dir", "children": {"main.py": {"type": "file", "content": "print(1)\n", "mode": 0o755}}},
        "scratch": {"type": "dir", "ephemeral": True, "children": {"seed.txt": {"type": "file", "content": "seed"}}},
    }
}


class FakeSupervisor:
    def __init__(self) -> None:
        self.kills = 0

    async def kill_all(self) -> None:
        self.kills += 1
        await trio.lowlevel.checkpoint()


def _ws(opts, session) -> str:
    return os.path.join(opts.workspaces_dir, session.id)


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_fresh_session_materializes_private_workspace(client, opts):
    m = load_manifest(MANIFEST)
    async with client.create(manifest=m) as s:
        assert s.start_mode == "materialized" and s.owned
        assert await s.read("README.md") == b"hello\n"
        assert stat.S_IMODE(os.stat(_ws(opts, s)).st_mode) == 0o700
        assert stat.S_IMODE((await s.stat("src/main.py")).st_mode) == 0o755
        assert "README.md" in s.describe() and "ephemeral" in s.describe()
    assert s.closed and s.fingerprint is not None
    assert await client.delete(s) is True
    assert not os.path.exists(_ws(opts, s))


async def test_resume_alive_deleted_drifted(client, opts, monkeypatch):
    m = load_manifest(MANIFEST)
    async with client.create(manifest=m) as s:
        await s.write("work.txt", b"v1")
    state = client.serialize_state(s)
    ino = os.stat(os.path.join(_ws(opts, s), "work.txt")).st_ino

    calls = []
    real = snapmod.hydrate
    monkeypatch.setattr(snapmod, "hydrate", lambda *a, **k: (calls.append(1), real(*a, **k))[1])

    # alive: the live tree matches the fingerprint -> no restore
    async with client.resume(state) as s2:
        assert s2.start_mode == "reattached" and calls == []
        assert os.stat(os.path.join(_ws(opts, s), "work.txt")).st_ino == ino
    # drifted: a file changed behind our back -> restored
    with open(os.path.join(_ws(opts, s), "work.txt"), "wb") as fh:
        fh.write(b"drift")
    async with client.resume(client.serialize_state(s2)) as s3:
        assert s3.start_mode == "restored" and calls == [1]
        assert await s3.read("work.txt") == b"v1"
    # deleted: rebuilt from the snapshot
    await client.delete(s3)
    async with client.resume(client.serialize_state(s3)) as s4:
        assert s4.start_mode == "restored" and calls == [1, 1]
        assert await s4.read("work.txt") == b"v1" and await s4.read("README.md") == b"hello\n"
    await client.delete(s4)


async def test_ephemeral_entries_reapplied_and_never_persisted(client, opts):
    m = load_manifest(MANIFEST)
    async with client.create(manifest=m) as s:
        await s.write("scratch/seed.txt", b"changed")
        await s.write("scratch/junk", b"junk")
    info = client.store.info(s.id)
    assert info.excluded == ["scratch", "scratch/seed.txt"]
    with tarfile.open(os.path.join(opts.snapshot_dir, info.archive)) as tar:
        assert not [n for n in tar.getnames() if n.startswith("scratch")]
    await client.delete(s)
    async with client.resume(client.serialize_state(s)) as s2:
        assert s2.start_mode == "restored"
        assert await s2.read("scratch/seed.txt") == b"seed"
        assert [e.name for e in await s2.ls("scratch")] == ["seed.txt"]
    await client.delete(s2)


async def test_snapshot_seeded_fresh_session(client):
    async with client.create() as a:
        await a.write("from-seed.txt", b"seed")
    async with client.create(snapshot=a.id) as b:
        assert b.start_mode == "restored" and await b.read("from-seed.txt") == b"seed"
    for s in (a, b):
        await client.delete(s, snapshot=True)
    assert client.store.list() == []


async def test_start_failure_cleans_up_what_start_created(client, opts):
    before = _fd_count()
    s = client.create(snapshot="doesnotexist")
    with pytest.raises(SnapshotNotFoundError):
        await s.start()
    bad = load_manifest({"entries": {"x": {"type": "local_file", "src": "nope.txt"}}})
    s2 = client.create(manifest=bad)
    with pytest.raises(Exception) as ei:
        await s2.start()
    assert hasattr(ei.value, "code")
    assert os.listdir(opts.workspaces_dir) == []
    assert _fd_count() == before
    with pytest.raises(SessionNotStartedError):
        s2.workspace


async def test_caller_owned_root_is_never_deleted(client, layout):
    (layout.ws / "mine.txt").write_text("caller data")
    s = client.create(root=layout.ws)
    async with s:
        assert not s.owned
        await s.write("new.txt", b"n")
    assert await client.delete(s, snapshot=True) is False
    assert (layout.ws / "mine.txt").read_text() == "caller data" and (layout.ws / "new.txt").exists()


async def test_failed_pre_stop_hook_disables_persistence_for_good_and_shutdown_still_runs(client):
    """A hook that fails means the workspace is not what the hook was to leave: never persisted.

    On the code before, aclose still persisted the workspace the hook had not finished.
    """
    sup = FakeSupervisor()
    calls = []

    async def hook(sess):
        calls.append(sess.id)
        await sess.write("half-done", b"the hook did not finish")
        raise RuntimeError("hook failed")

    s = client.create()
    await s.start()
    await s.write("f", b"saved")
    first = await s.stop()  # an explicit persist before the close: generation 1
    s.attach_supervisor(sup)
    s.register_pre_stop_hook(hook)
    before = _fd_count()
    with pytest.raises(RuntimeError, match="hook failed"):
        await s.aclose()
    assert calls == [s.id] and sup.kills == 1 and s.closed
    assert client.store.info(s.id) == first.info  # no persist was attempted
    assert s.persist_disabled and s.generation == first.info.generation
    assert _fd_count() < before  # the workspace Roots were closed
    await s.aclose()  # idempotent: no second hook, no second kill, no error
    assert calls == [s.id] and sup.kills == 1
    with pytest.raises(PersistDisabledError) as ei:  # an explicit stop afterwards refuses, clearly
        await s.stop()
    assert ei.value.code == "persist_disabled" and "pre-stop hook failed" in str(ei.value)
    await client.delete(s)


@pytest.mark.parametrize("how", ["timeout", "cancel_while_running", "cancelled_before_close"])
async def test_cancelled_or_timed_out_pre_stop_hook_never_persists_and_cancel_propagates(client, how):
    sup = FakeSupervisor()
    s = client.create()
    await s.start()
    await s.write("f", b"x")
    s.attach_supervisor(sup)
    if how == "timeout":
        s.config.hook_timeout_s = 0.05

    async def hook(sess):
        await sess.write("half-done", b"x")
        await trio.sleep_forever()

    s.register_pre_stop_hook(hook)
    outcome = "returned"
    with trio.move_on_after(0.2 if how == "cancel_while_running" else 5) as scope:
        if how == "cancelled_before_close":
            scope.cancel()  # e.g. ``async with session`` left by a cancellation
        try:
            await s.aclose()
        except trio.TooSlowError:
            outcome = "timeout"
        except trio.Cancelled:
            outcome = "cancelled"
            raise
    if how == "timeout":
        assert outcome == "timeout" and not scope.cancelled_caught
    else:
        assert outcome == "cancelled" and scope.cancelled_caught
    assert s.closed and sup.kills == 1
    assert client.store.info(s.id) is None  # never persisted
    with pytest.raises(PersistDisabledError):
        await s.stop()
    await client.delete(s)


async def test_persist_failure_shutdown_still_runs_and_nothing_left_open(client, opts):
    sup = FakeSupervisor()
    before = _fd_count()
    s = client.create()
    await s.start()
    s.attach_supervisor(sup)
    os.mkfifo(os.path.join(_ws(opts, s), "fifo"))
    with pytest.raises(UnrestorableEntryError):
        await s.aclose()
    assert sup.kills == 1 and s.closed
    with pytest.raises(SessionNotStartedError):
        s.workspace
    assert _fd_count() == before
    assert client.store.info(s.id) is None


async def test_several_failures_raise_an_exception_group(client, opts):
    async def hook(sess):
        raise RuntimeError("hook")

    class BadSup:
        async def kill_all(self):
            raise OSError("kill failed")

    s = client.create()
    await s.start()
    s.register_pre_stop_hook(hook)
    s.attach_supervisor(BadSup())
    os.mkfifo(os.path.join(_ws(opts, s), "fifo"))
    with pytest.raises(ExceptionGroup) as ei:
        await s.aclose()
    kinds = [type(e) for e in ei.value.exceptions]
    assert kinds == [RuntimeError, OSError]  # the failed hook disabled the persist (it never ran)
    assert s.closed


async def test_aclose_is_shielded_from_cancellation(client):
    sup = FakeSupervisor()
    s = client.create()
    await s.start()
    s.attach_supervisor(sup)
    await s.write("f", b"x")
    with trio.CancelScope() as cs:
        cs.cancel()
        await s.aclose()
    assert s.closed and sup.kills == 1 and client.store.info(s.id) is not None


async def test_run_guard_is_exclusive_and_released(client):
    s = client.create()
    await s.start()
    with s.bind_run("run-1"):
        with pytest.raises(SessionBusyError):
            with s.bind_run("run-2"):
                pass
    with s.bind_run("run-2"):
        assert s.bound_run == "run-2"
    assert s.bound_run is None
    await s.aclose()


async def test_file_operations_go_through_the_policy(tmp_path, layout):
    grant_ro = tmp_path / "ro"
    grant_ro.mkdir()
    (grant_ro / "data.txt").write_text("granted")
    grant_rw = tmp_path / "rw"
    grant_rw.mkdir()
    opts = ClientOptions(workspaces_dir=str(tmp_path / "w"), snapshot_dir=str(tmp_path / "st"),
                         extra_path_grants=(Grant(str(grant_ro), read_only=True), Grant(str(grant_rw), read_only=False)),
                         max_read_bytes=100)
    before = layout.snapshot()
    with LocalSandboxClient(opts) as client:
        async with client.create() as s:
            await s.mkdir("a/b", parents=True)
            await s.write("a/b/f.txt", b"1")
            await s.rename("a/b/f.txt", "a/g.txt")
            assert [e.name for e in await s.ls("a")] == ["b", "g.txt"]
            assert await s.read("/workspace/a/g.txt") == b"1"
            assert await s.read(str(grant_ro / "data.txt")) == b"granted"
            with pytest.raises(ReadOnlyError):
                await s.write(str(grant_ro / "x"), b"no")
            with pytest.raises(CrossRootError):
                await s.rename("a/g.txt", str(grant_rw / "moved"))
            with pytest.raises(InvalidPathError):
                await s.read("../outside/secret.txt")
            with pytest.raises(PathEscapeError):
                await s.read(str(layout.outside / "secret.txt"))
            os.symlink(layout.outside / "secret.txt", os.path.join(opts.workspaces_dir, s.id, "esc"))
            with pytest.raises(PathEscapeError):
                await s.read("esc")
            await s.rm("esc")
            await s.write("big", b"x" * 101)
            with pytest.raises(OSError) as ei:
                await s.read("big")
            assert ei.value.errno == 27  # EFBIG
            chunks = [c async for c in s.read_chunks("big", chunk_bytes=40, max_bytes=200)]
            assert b"".join(chunks) == b"x" * 101 and len(chunks) == 3
            await s.rm("a", recursive=True)
            with pytest.raises(InvalidPathError):
                await s.rm(".", recursive=True)
            assert [e.name for e in await s.ls()] == [".sfs-workspace-id", "big"]
        await client.delete(s)
    layout.assert_outside_unchanged(before)
    assert (grant_ro / "data.txt").read_text() == "granted" and os.listdir(grant_ro) == ["data.txt"]


async def test_write_with_parents_creates_the_missing_directories(tmp_path, layout):
    grant_ro = tmp_path / "ro"
    grant_ro.mkdir()
    opts = ClientOptions(workspaces_dir=str(tmp_path / "w"), snapshot_dir=str(tmp_path / "st"),
                         extra_path_grants=(Grant(str(grant_ro), read_only=True),))
    before = layout.snapshot()
    with LocalSandboxClient(opts) as client:
        async with client.create() as s:
            with pytest.raises(FileNotFoundError):
                await s.write("a/b/c.txt", b"no parents")
            assert [e.name for e in await s.ls()] == [".sfs-workspace-id"]
            assert await s.write("a/b/c.txt", b"made", parents=True) == 4
            assert await s.read("a/b/c.txt") == b"made"
            for d in ("a", "a/b"):
                st = await s.stat(d)
                assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o755
            assert await s.write("a/b/c.txt", b"again", parents=True) == 5  # existing parents are fine
            assert await s.write("/workspace/top.txt", b"t", parents=True) == 1
            await s.write("a/file", b"f")
            with pytest.raises(NotADirectoryError):
                await s.write("a/file/x", b"x", parents=True)
            with pytest.raises(ReadOnlyError):
                await s.write(str(grant_ro / "new" / "x"), b"no", parents=True)
            os.symlink(layout.outside, os.path.join(opts.workspaces_dir, s.id, "esc"))
            with pytest.raises(PathEscapeError):
                await s.write("esc/made/x", b"no", parents=True)
            with pytest.raises(InvalidPathError):
                await s.write("../outside/made/x", b"no", parents=True)
            await s.rm("esc")
        await client.delete(s)
    layout.assert_outside_unchanged(before)
    assert os.listdir(grant_ro) == []


async def test_rm_removes_an_empty_directory_and_refuses_a_full_one(tmp_path, layout):
    opts = ClientOptions(workspaces_dir=str(tmp_path / "w"), snapshot_dir=str(tmp_path / "st"))
    before = layout.snapshot()
    with LocalSandboxClient(opts) as client:
        async with client.create() as s:
            await s.mkdir("empty")
            await s.rm("empty")
            assert [e.name for e in await s.ls()] == [".sfs-workspace-id"]
            await s.write("full/f", b"x", parents=True)
            with pytest.raises(OSError) as ei:
                await s.rm("full")
            assert ei.value.errno == errno.ENOTEMPTY
            assert await s.read("full/f") == b"x"
            await s.rm("full/f")
            await s.rm("full")
            with pytest.raises(FileNotFoundError):
                await s.rm("full")
            await s.rm("full", missing_ok=True)
            await s.mkdir("target")
            os.symlink("target", os.path.join(opts.workspaces_dir, s.id, "link"))
            await s.rm("link")  # the symlink goes, never the directory it names
            assert [e.name for e in await s.ls()] == [".sfs-workspace-id", "target"]
            os.symlink(layout.outside / "subdir", os.path.join(opts.workspaces_dir, s.id, "esc"))
            await s.rm("esc")
        await client.delete(s)
    layout.assert_outside_unchanged(before)


async def test_grant_nested_in_workspace_is_never_persisted(tmp_path):
    ws = tmp_path / "caller-ws"
    (ws / "granted").mkdir(parents=True)
    (ws / "granted" / "host.txt").write_text("host data")
    (ws / "own.txt").write_text("own")
    opts = ClientOptions(workspaces_dir=str(tmp_path / "w"), snapshot_dir=str(tmp_path / "st"),
                         extra_path_grants=(Grant(str(ws / "granted"), read_only=True),))
    with LocalSandboxClient(opts) as client:
        async with client.create(root=ws) as s:
            pass
        info = client.store.info(s.id)
        with tarfile.open(os.path.join(opts.snapshot_dir, info.archive)) as tar:
            assert tar.getnames() == ["own.txt"]


@pytest.mark.parametrize("grant_mode", [0o755, 0o555])
async def test_restore_keeps_a_read_only_grant_nested_in_the_workspace(tmp_path, grant_mode):
    """A session restored from a snapshot over a workspace holding a read-only grant: the clear
    keeps the grant (never entered, never made writable), the rest is restored."""
    ws = tmp_path / "caller-ws"
    (ws / "granted").mkdir(parents=True)
    (ws / "granted" / "host.txt").write_text("host data")
    (ws / "own.txt").write_text("own")
    os.chmod(ws / "granted", grant_mode)
    opts = ClientOptions(workspaces_dir=str(tmp_path / "w"), snapshot_dir=str(tmp_path / "st"),
                         extra_path_grants=(Grant(str(ws / "granted"), read_only=True),))
    try:
        with LocalSandboxClient(opts) as client:
            async with client.create(root=ws) as s:
                pass
            (ws / "own.txt").write_text("changed")  # so the restore is not skipped
            async with client.create(root=ws, snapshot=s.id):
                pass
        assert (ws / "own.txt").read_text() == "own"
        assert (ws / "granted" / "host.txt").read_text() == "host data"
        assert stat.S_IMODE(os.stat(ws / "granted").st_mode) == grant_mode
    finally:
        os.chmod(ws / "granted", 0o755)


async def test_persist_skip_path_and_mount_overlap(client, opts):
    async with client.create() as s:
        await s.mkdir("cache/x", parents=True)
        await s.write("cache/x/blob", b"b")
        await s.write("keep", b"k")
        s.register_mount("/workspace/mnt")
        s.register_persist_skip_path("cache")
        for bad in ("mnt", "mnt/sub", "/workspace"):
            with pytest.raises((MountOverlapError, InvalidPathError)):
                s.register_persist_skip_path(bad)
        with pytest.raises(MountOverlapError):
            s.register_persist_skip_path("/workspace/mnt")
    info = client.store.info(s.id)
    with tarfile.open(os.path.join(opts.snapshot_dir, info.archive)) as tar:
        assert tar.getnames() == ["keep"]
    await client.delete(s)


async def test_extract_uses_the_archive_extractor(client, layout):
    def tar_of(members):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for name, data in members:
                ti = tarfile.TarInfo(name)
                ti.size = len(data)
                tar.addfile(ti, io.BytesIO(data))
        buf.seek(0)
        return buf

    before = layout.snapshot()
    async with client.create() as s:
        await s.mkdir("in")
        await s.extract(tar_of([("a.txt", b"A")]), "in")
        assert await s.read("in/a.txt") == b"A"
        with pytest.raises(Exception) as ei:
            await s.extract(tar_of([("../../../outside/evil", b"pwn")]), "in")
        assert getattr(ei.value, "code", None) == "unsafe_member"
    await client.delete(s)
    layout.assert_outside_unchanged(before)


async def test_hundred_concurrent_sessions_no_fd_or_dir_leak(client, opts):
    before = _fd_count()
    m = load_manifest(MANIFEST)

    async def one(i: int) -> None:
        async with client.create(manifest=m) as s:
            await s.write(f"n{i}.txt", str(i).encode())
            assert await s.read(f"n{i}.txt") == str(i).encode()
        await client.delete(s, snapshot=(i % 2 == 0))

    async with trio.open_nursery() as n:
        for i in range(100):
            n.start_soon(one, i)
    assert os.listdir(opts.workspaces_dir) == []
    left = os.listdir(opts.snapshot_dir)  # the directory store: one object directory per kept snapshot
    assert not [f for f in left if f.startswith(".") and f not in (".state-key", ".partial", ".lock")]
    assert os.listdir(os.path.join(opts.snapshot_dir, ".partial")) == []  # no upload left behind
    assert len([f for f in left if os.path.exists(os.path.join(opts.snapshot_dir, f, "current"))]) == 50
    assert _fd_count() == before


async def test_exec_delegates_and_shutdown_kills_leftover_processes(client, opts):
    from sandbox_fs import exec as sx

    async with client.create() as s:
        try:
            res = await s.exec(["/bin/sh", "-c", "echo hi > out.txt; sleep 300 & readlink /proc/self/ns/pid > ns"],
                               timeout_s=30)
        except sx.ConfinementError as exc:
            pytest.skip(f"confined exec unavailable here: {exc}")
        assert res.exit_code == 0
        assert await s.read("out.txt") == b"hi\n"
        ns = (await s.read("ns")).decode().strip()
        assert ns.startswith("pid:[") and ns != os.readlink("/proc/self/ns/pid")
    # The background sleep ended with the command (its PID namespace); nothing of it is left.
    left = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and os.readlink(f"/proc/{name}/ns/pid") == ns:
                with open(f"/proc/{name}/stat") as fh:
                    if fh.read().rsplit(")", 1)[1].split()[0] != "Z":
                        left.append(name)
        except OSError:
            pass
    assert left == []
    await client.delete(s)


async def test_restore_never_clears_a_registered_mount_point(client, opts):
    async with client.create() as s:
        await s.write("f", b"snap")
    await s.aclose()
    ws = os.path.join(opts.workspaces_dir, s.id)
    os.mkdir(os.path.join(ws, "mnt"))
    with open(os.path.join(ws, "mnt", "host-data"), "w") as fh:
        fh.write("bind-mounted content")
    with open(os.path.join(ws, "f"), "w") as fh:
        fh.write("drift")
    r = client.resume(client.serialize_state(s))
    r.register_mount("mnt")  # e.g. a bind mount the host set up before start
    async with r:
        assert r.start_mode == "restored" and await r.read("f") == b"snap"
        assert await r.read("mnt/host-data") == b"bind-mounted content"
    await client.delete(r)


async def test_guard_released_when_shutdown_fails_in_open_session(client):
    from sandbox_fs.client import open_session

    class BadSup:
        async def kill_all(self):
            raise OSError("cannot kill")

    with pytest.raises(OSError, match="cannot kill"):
        async with open_session(client, key="k") as s:
            s.attach_supervisor(BadSup())
    assert s.bound_run is None and s.closed
