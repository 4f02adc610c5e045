"""Sessions with the FUSE overlay (``SessionConfig.overlay``): the session side of issue 13.

The tests that mount skip, each with its reason, where the overlay cannot run
(not root, no ``/dev/fuse``, no pyfuse3, no ``sandbox_fs.fuse.Overlay``); the
fail-closed / best-effort tests run everywhere (the probe is replaced).
Every session a test starts is closed by the test (``async with`` or
``aclose`` in ``finally``), so no mount outlives it; the detached mount
dissolves with its last fd in any case.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys

import pytest
import trio

import sandbox_fs
from sandbox_fs import _features
from sandbox_fs.client import ClientOptions, LocalSandboxClient
from sandbox_fs.fuse._quota import NAME_ENTRY_BYTES


def _overlay_unusable() -> str | None:
    if os.geteuid() != 0:
        return "the overlay needs root here (fsopen of a FUSE mount)"
    usable, reason = _features.fuse_status()
    if not usable:
        return f"FUSE is not usable here: {reason}"
    import sandbox_fs.fuse as fuse

    if not hasattr(fuse, "Overlay"):
        return "this build has no sandbox_fs.fuse.Overlay"
    return None


_WHY = _overlay_unusable()
needs_overlay = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")


def _private_root_missing() -> str | None:
    from sandbox_fs import exec as sfs_exec

    if not hasattr(sfs_exec, "PrivateRoot"):
        return "this build's exec has no PrivateRoot (a confined command cannot run on the overlay)"
    if sandbox_fs.features()["landlock_abi"] == 0:
        return "kernel has no Landlock (a confined command with confinement=required is refused)"
    return None


_NO_PRIVATE_ROOT = _private_root_missing()
needs_private_root = pytest.mark.skipif(_NO_PRIVATE_ROOT is not None, reason=_NO_PRIVATE_ROOT or "")


def _daemon_pids() -> list[int]:
    """Live overlay daemons among this process's children (from /proc/self/task/*/children)."""
    pids: list[int] = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                children = f.read().split()
        except OSError:
            continue
        for pid in children:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if b"sandbox_fs.fuse._daemon" in cmd:
                pids.append(int(pid))
    return pids


def _fds() -> set[str]:
    """This process's open fds (the listing's own fd left out)."""
    dfd = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return set(os.listdir(dfd)) - {str(dfd)}
    finally:
        os.close(dfd)


def _read_at(dirfd: int, name: str) -> bytes:
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dirfd)
    try:
        out = b""
        while chunk := os.read(fd, 1 << 16):
            out += chunk
        return out
    finally:
        os.close(fd)


def _write_at(dirfd: int, name: str, data: bytes) -> None:
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644, dir_fd=dirfd)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _exists_at(dirfd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


@pytest.fixture
def make_client(tmp_path):
    clients: list[LocalSandboxClient] = []

    def make(**kw) -> LocalSandboxClient:
        kw.setdefault("overlay", True)
        opts = ClientOptions(workspaces_dir=str(tmp_path / "wsdir"), snapshot_dir=str(tmp_path / "snaps"), **kw)
        client = LocalSandboxClient(opts)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


# ------------------------------------------------------------- without FUSE (the probe is replaced)


@pytest.fixture
def no_fuse(monkeypatch):
    monkeypatch.setattr(_features, "fuse_status", lambda: (False, "no FUSE in this test"))


def test_importing_the_session_layers_needs_no_fuse():
    code = ("import sys, sandbox_fs.session, sandbox_fs.client, sandbox_fs.cli._run; "
            "bad = [m for m in ('pyfuse3', 'sandbox_fs.fuse') if m in sys.modules]; "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


async def test_required_fails_closed_before_the_workspace_is_touched(make_client, no_fuse, tmp_path):
    from sandbox_fs.fuse import OverlayUnavailableError

    client = make_client(confinement="required")
    session = client.create()
    with pytest.raises(OverlayUnavailableError) as ei:
        await session.start()
    assert ei.value.code == "overlay_unavailable" and "no FUSE in this test" in str(ei.value)
    assert not session.started and not session.overlay_active
    assert not (tmp_path / "wsdir" / session.id).exists(), "the workspace was made before the refusal"


async def test_best_effort_runs_without_the_overlay_and_says_so(make_client, no_fuse):
    from sandbox_fs.fuse import OverlayUnavailableError

    client = make_client(confinement="best_effort")
    async with client.create() as session:
        assert session.started and not session.overlay_active and session.overlay is None
        assert session.overlay_unavailable_reason == "no FUSE in this test"
        assert "overlay: off" in session.describe() and "no FUSE in this test" in session.describe()
        await session.write("a.txt", b"direct")  # the backing workspace, directly
        assert await session.read("a.txt") == b"direct"
        with pytest.raises(OverlayUnavailableError):
            await session.audit_events()
        with pytest.raises(OverlayUnavailableError):
            await session.set_quota(10, None)
        with pytest.raises(OverlayUnavailableError):  # a command that insists on full confinement
            await session.exec(["true"], confinement="required")
        if sandbox_fs.features()["landlock_abi"]:
            result = await session.exec(["cat", "a.txt"], timeout_s=30)
            assert result.exit_code == 0 and result.stdout == b"direct" and result.overlay is False


async def test_a_mount_entry_without_a_running_overlay_is_refused_before_anything(make_client, no_fuse, tmp_path):
    from sandbox_fs.manifest import load_manifest
    from sandbox_fs.paths import Grant

    ref = tmp_path / "ref"
    ref.mkdir()
    client = make_client(confinement="best_effort", extra_path_grants=(Grant(str(ref), read_only=True, name="ref"),))
    session = client.create(manifest=load_manifest({"entries": {"mnt": {"type": "mount", "grant": "ref"}}}))
    with pytest.raises(sandbox_fs.SandboxError) as ei:
        await session.start()
    assert ei.value.code == "mount_needs_overlay" and str(ref) not in str(ei.value)
    assert not (tmp_path / "wsdir" / session.id).exists()


async def test_describe_says_nothing_of_an_overlay_not_asked_for(make_client):
    client = make_client(overlay=False)
    async with client.create() as session:
        assert "overlay" not in session.describe()
        assert not session.overlay_active and session.overlay_unavailable_reason is None


async def test_overlay_unavailable_at_start_cleans_up_under_required(make_client, monkeypatch, tmp_path):
    """The probe passes but the daemon reports the overlay cannot run: start undoes itself."""
    import sandbox_fs.fuse as fuse

    async def refuse(*a, **k):
        await trio.lowlevel.checkpoint()
        raise fuse.OverlayUnavailableError("fsopen refused (test)", sandbox_path=None)

    monkeypatch.setattr(_features, "fuse_status", lambda: (True, None))
    monkeypatch.setattr(fuse, "Overlay", type("Overlay", (), {"start": staticmethod(refuse)}), raising=False)
    if not hasattr(fuse, "OverlayPolicy"):  # a build before the policy landed
        monkeypatch.setattr(fuse, "OverlayPolicy", dict, raising=False)
    client = make_client(confinement="required")
    before = _fds()
    session = client.create()
    with pytest.raises(fuse.OverlayUnavailableError):
        await session.start()
    assert not (tmp_path / "wsdir" / session.id).exists()
    assert _fds() == before
    async with make_client(confinement="best_effort").create() as s2:
        assert not s2.overlay_active and "fsopen refused (test)" in s2.describe()


# ------------------------------------------------------------------------------ through FUSE


@needs_overlay
async def test_changes_are_visible_through_the_mount_at_once_both_ways(make_client, tmp_path):
    async with make_client().create() as session:
        ov = session.overlay
        assert ov is not None and session.overlay_active and "overlay: on" in session.describe()
        mfd = ov.mount_fd
        backing = tmp_path / "wsdir" / session.id
        # session -> mount
        await session.write("a.txt", b"one")
        assert await trio.to_thread.run_sync(_read_at, mfd, "a.txt") == b"one"
        await session.write("a.txt", b"two, longer")  # an atomic replace: no stale page or attribute
        assert await trio.to_thread.run_sync(_read_at, mfd, "a.txt") == b"two, longer"
        assert (backing / "a.txt").read_bytes() == b"two, longer"
        await session.mkdir("d")
        await session.rename("a.txt", "d/b.txt")
        assert not await trio.to_thread.run_sync(_exists_at, mfd, "a.txt")
        assert await trio.to_thread.run_sync(_read_at, mfd, "d/b.txt") == b"two, longer"
        await session.rm("d", recursive=True)
        assert not await trio.to_thread.run_sync(_exists_at, mfd, "d")
        # mount -> session
        await trio.to_thread.run_sync(_write_at, mfd, "m.txt", b"from the mount")
        assert await session.read("m.txt") == b"from the mount"
        assert (await session.stat("m.txt")).st_size == len(b"from the mount")
        await trio.to_thread.run_sync(lambda: os.rename("m.txt", "n.txt", src_dir_fd=mfd, dst_dir_fd=mfd))
        assert [e.name for e in await session.ls(".") if e.name.endswith(".txt")] == ["n.txt"]
        await trio.to_thread.run_sync(lambda: os.unlink("n.txt", dir_fd=mfd))
        with pytest.raises(FileNotFoundError):
            await session.read("n.txt")
        assert not (backing / "n.txt").exists()


@needs_overlay
@needs_private_root
async def test_a_confined_command_sees_session_writes_and_the_session_sees_its_writes(make_client):
    async with make_client().create() as session:
        await session.write("in.txt", b"to the command")
        result = await session.exec(["sh", "-c", "cat in.txt; printf back > out.txt"], timeout_s=60)
        assert result.exit_code == 0, result.stderr
        assert result.stdout == b"to the command" and result.overlay is True
        assert await session.read("out.txt") == b"back"
        await session.write("out.txt", b"changed by the host")
        again = await session.exec(["cat", "out.txt"], timeout_s=60)
        assert again.stdout == b"changed by the host"


@needs_overlay
@needs_private_root
async def test_a_pty_command_runs_on_the_overlay_too(make_client):
    async with make_client().create() as session:
        await session.write("in.txt", b"pty-sees-this")
        pty_id, out = await session.pty_exec_start(["sh", "-c", "cat in.txt; printf done > out.txt"],
                                                   first_output_timeout_s=2.0)
        for _ in range(100):  # until the command's output arrives (bounded; nothing timed is asserted)
            if b"pty-sees-this" in out:
                break
            out += await session.pty_read(pty_id, timeout_s=0.2)
        assert b"pty-sees-this" in out
        for _ in range(100):
            try:
                if await session.read("out.txt") == b"done":
                    break
            except FileNotFoundError:
                pass
            await trio.sleep(0.05)
        assert await session.read("out.txt") == b"done"


@needs_overlay
async def test_quota_at_the_limit_through_the_session(make_client, tmp_path):
    from sandbox_fs.fuse import OverlayPolicy

    limit = 8192
    async with make_client(overlay_policy=OverlayPolicy(max_bytes=limit)).create() as session:
        used = (await session.overlay_usage())["bytes"]  # the workspace id file counts
        # names are charged too (length + NAME_ENTRY_BYTES); the write goes through a 25-byte
        # temporary name renamed onto "fill", so a 25-byte "fill" name keeps the usage at its peak
        fill = "f" * 25
        await session.write(fill, b"x" * (limit - used - len(fill) - NAME_ENTRY_BYTES))
        assert (await session.overlay_usage())["bytes"] == limit
        with pytest.raises(OSError) as ei:
            await session.write("more", b"y")
        assert ei.value.errno == errno.EDQUOT
        assert not (tmp_path / "wsdir" / session.id / "more").exists(), "a refused write left its file"
        assert (await session.overlay_usage())["bytes"] == limit
        await session.rm(fill)
        await session.write("more", b"y" * 100)  # room again
        # limits set at run time: inodes
        inodes = (await session.overlay_usage())["inodes"]
        await session.set_quota(None, inodes)
        with pytest.raises(OSError) as ei:
            await session.mkdir("d")
        assert ei.value.errno == errno.EDQUOT
        await session.set_quota(None, None)
        await session.mkdir("d")
        await session.write("d/big", b"z" * (2 * limit))  # unlimited now


@needs_overlay
async def test_the_manifest_is_applied_before_the_mount_and_counted_by_the_quota(make_client):
    from sandbox_fs.fuse import OverlayPolicy
    from sandbox_fs.manifest import load_manifest

    manifest = load_manifest({"entries": {"m.txt": {"type": "file", "content": "m" * 1000}}})
    async with make_client(overlay_policy=OverlayPolicy(max_bytes=500)).create(manifest=manifest) as session:
        events, _ = await session.audit_events()
        assert not [e for e in events if e.path == "m.txt"], "the manifest went through the mount"
        assert (await session.overlay_usage())["bytes"] >= 1000  # measured at mount: over the limit
        with pytest.raises(OSError) as ei:
            await session.write("new.txt", b"n")
        assert ei.value.errno == errno.EDQUOT
        await session.rm("m.txt")
        await session.write("new.txt", b"n")  # under the limit again


@needs_overlay
async def test_audit_events_record_host_side_operations(make_client):
    async with make_client().create() as session:
        await session.audit_events()  # what start did
        await session.mkdir("d")
        await session.write("d/f", b"x")
        assert await session.read("d/f") == b"x"
        events, dropped = await session.audit_events()
        assert dropped == 0
        assert ("mkdir", "d", 0) in {(e.op, e.path, e.errno) for e in events}
        assert any(e.path.startswith("d/") and e.op in {"create", "write", "rename"} for e in events)
        assert all(isinstance(e.time_s, float) and e.result in ("ok", errno.errorcode.get(e.errno)) for e in events)
        times = [e.time_s for e in events]
        assert times == sorted(times)
        later, _ = await session.audit_events()  # each event is returned once
        assert ("mkdir", "d", 0) not in {(e.op, e.path, e.errno) for e in later}


@needs_overlay
async def test_fault_rules_set_and_cleared_through_the_session(make_client):
    from sandbox_fs.fuse import FaultRule

    async with make_client().create() as session:
        await session.write("f", b"data")
        await session.write("g", b"other")
        await session.set_faults([FaultRule(ops=frozenset({"open"}), path="f", errno=errno.EIO)])
        with pytest.raises(OSError) as ei:
            await session.read("f")
        assert ei.value.errno == errno.EIO
        assert await session.read("g") == b"other"  # only where the rule says
        events, _ = await session.audit_events()
        assert any(e.path == "f" and e.op == "open" and e.errno == errno.EIO for e in events)
        await session.clear_faults()
        assert await session.read("f") == b"data"


@needs_overlay
async def test_persist_reads_the_backing_workspace_and_resumes_without_the_overlay(make_client):
    client = make_client()
    async with client.create() as session:
        await session.write("a/b.txt", b"kept", parents=True)
    state = client.serialize_state(session)
    await client.delete(session)
    plain_client = make_client(overlay=False)
    async with plain_client.resume(state) as plain:
        assert await plain.read("a/b.txt") == b"kept"
    state = plain_client.serialize_state(plain)  # its close persisted the next generation
    await plain_client.delete(plain)
    async with client.resume(json.loads(json.dumps(state))) as again:  # hydrated into the backing, served
        assert again.start_mode == "restored" and again.overlay_active
        assert await trio.to_thread.run_sync(_read_at, again.overlay.mount_fd, "a/b.txt") == b"kept"


@needs_overlay
async def test_cancel_during_start_leaves_no_daemon_and_no_fd(make_client, monkeypatch):
    from sandbox_fs.manifest import load_manifest

    scope = trio.CancelScope()

    async def cancelled_materialize(*a, **k):
        scope.cancel()
        await trio.sleep_forever()

    client, cancelling = make_client(), make_client(materialize=cancelled_materialize)
    await trio.to_thread.run_sync(sandbox_fs.features)
    before = _fds()
    # at points fixed by the code: while the manifest is applied (before the mount) ...
    session = cancelling.create(manifest=load_manifest({"entries": {}}))
    with scope:
        await session.start()
    assert scope.cancelled_caught and not session.started
    assert _daemon_pids() == [] and _fds() == before
    # ... and the moment the overlay is mounted, before the session took it
    import sandbox_fs.fuse as fuse

    real_start = fuse.Overlay.start
    scope = trio.CancelScope()

    async def start_then_cancel(*a, **k):
        ov = await real_start(*a, **k)
        scope.cancel()
        return ov

    monkeypatch.setattr(fuse.Overlay, "start", start_then_cancel)
    session = client.create()
    with scope:
        await session.start()
    assert scope.cancelled_caught and not session.started
    assert _daemon_pids() == [] and _fds() == before
    monkeypatch.setattr(fuse.Overlay, "start", real_start)
    # at points set by the clock: wherever start happens to be
    for delay in (0, 0.001, 0.005, 0.02, 0.05, 0.1, 0.2, 0.5):
        session = client.create()
        with trio.move_on_after(delay):
            await session.start()
        if session.started:
            await session.aclose()
        assert _daemon_pids() == [], f"a daemon outlived a start cancelled after {delay} s"
        assert _fds() == before, f"an fd outlived a start cancelled after {delay} s"


@needs_overlay
async def test_daemon_killed_then_shutdown_works_and_a_new_session_starts(make_client, tmp_path):
    client = make_client()
    await trio.to_thread.run_sync(sandbox_fs.features)
    before = _fds()
    session = client.create()
    await session.start()
    try:
        await session.write("keep.txt", b"written before the kill")
        pids = _daemon_pids()
        assert len(pids) == 1
        ov = session.overlay
        os.kill(pids[0], signal.SIGKILL)
        for _ in range(400):  # until the session's overlay sees it (bounded; no timing asserted)
            if not ov.alive:
                break
            await trio.sleep(0.025)
        assert not ov.alive
        from sandbox_fs.fuse import OverlayError

        with pytest.raises(OverlayError):
            await session.audit_events()
        if _NO_PRIVATE_ROOT is None:
            with pytest.raises(OverlayError):  # never run on the backing workspace behind the overlay's back
                await session.exec(["true"], timeout_s=30)
    finally:
        await session.aclose()
    assert session.closed and not session.overlay_active
    assert _daemon_pids() == [] and _fds() == before
    assert (tmp_path / "wsdir" / session.id / "keep.txt").read_bytes() == b"written before the kill"
    async with client.create() as fresh:
        assert fresh.overlay_active
        await fresh.write("x", b"1")
        assert await trio.to_thread.run_sync(_read_at, fresh.overlay.mount_fd, "x") == b"1"
    assert _daemon_pids() == []


@needs_overlay
async def test_a_mount_entry_serves_its_grant_and_is_never_persisted(make_client, tmp_path):
    from sandbox_fs.manifest import load_manifest
    from sandbox_fs.paths import Grant

    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "data.txt").write_text("from the host")
    client = make_client(extra_path_grants=(Grant(str(ref), read_only=True, name="ref"),))
    manifest = load_manifest({"entries": {"mnt": {"type": "mount", "grant": "ref"},
                                          "own.txt": {"type": "file", "content": "mine"}}})
    async with client.create(manifest=manifest) as session:
        assert await session.read("mnt/data.txt") == b"from the host"
        assert await trio.to_thread.run_sync(_read_at, session.overlay.mount_fd, "mnt/data.txt") == b"from the host"
        with pytest.raises(OSError) as ei:  # a read-only mount
            await session.write("mnt/new.txt", b"x")
        assert ei.value.errno == errno.EROFS
        assert sorted(os.listdir(ref)) == ["data.txt"]
        backing = tmp_path / "wsdir" / session.id
        assert (backing / "mnt").is_dir() and os.listdir(backing / "mnt") == []  # the placeholder
    import tarfile

    info = client.store.info(session.id)
    with tarfile.open(tmp_path / "snaps" / info.archive) as tar:
        names = tar.getnames()
    assert "own.txt" in names and not [n for n in names if n.startswith("mnt")], names


@needs_overlay
@needs_private_root
async def test_a_cancel_while_a_command_runs_still_closes_the_overlay(make_client):
    client = make_client()
    async with client.create() as warm:  # the exec layer keeps a process-wide set of fds (the system set)
        await warm.exec(["true"], timeout_s=60)
    before = _fds()
    with trio.CancelScope() as scope:
        async with client.create() as session:
            await session.write("started", b"")

            async def cancel_once_running() -> None:
                await trio.sleep(0.3)
                scope.cancel()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancel_once_running)
                await session.exec(["sleep", "30"], timeout_s=60)
    assert scope.cancelled_caught and session.closed and not session.overlay_active
    assert _daemon_pids() == [] and _fds() == before


_HOST = """
import json, sys, trio
from sandbox_fs.client import ClientOptions, LocalSandboxClient

async def main():
    with LocalSandboxClient(ClientOptions(workspaces_dir=sys.argv[1], snapshot_dir=sys.argv[2], overlay=True)) as c:
        s = c.create()
        await s.start()
        await s.write("before-kill.txt", b"kept")
        print(json.dumps({"pid": s.overlay.pid, "state": c.serialize_state(s)}), flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


@needs_overlay
async def test_host_killed_leaves_no_daemon_and_the_session_resumes(make_client, tmp_path):
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-c", _HOST, str(tmp_path / "wsdir"), str(tmp_path / "snaps")],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        line = b""
        with trio.fail_after(60):  # a bound on a hung child, not a timing assertion
            while not line.endswith(b"\n"):
                chunk = await proc.stdout.receive_some(4096)
                assert chunk, "the host process exited before it was ready"
                line += chunk
        info = json.loads(line)
        proc.kill()  # SIGKILL: no shutdown runs
        await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    for _ in range(400):  # the daemon ends on its parent's death (bounded wait)
        if not os.path.exists(f"/proc/{info['pid']}"):
            break
        await trio.sleep(0.025)
    try:
        with open(f"/proc/{info['pid']}/cmdline", "rb") as f:
            still = b"sandbox_fs.fuse._daemon" in f.read()
    except OSError:
        still = False
    assert not still, "the overlay daemon outlived its host"
    async with make_client().resume(info["state"]) as session:  # nothing to clean: the next start works
        assert session.start_mode == "reattached" and session.overlay_active
        assert await session.read("before-kill.txt") == b"kept"
