"""Session.aclose ends every process (and the overlay) before the stop-time persist.

A confined command, and time, are hostile: a command still running while its
workspace is persisted can change files under the walk so that every save
fails, or time its writes so that the snapshot holds a state the workspace
never had at one instant.  On the code before, aclose persisted first and
shut down after.
"""

from __future__ import annotations

import dataclasses
import itertools
import os

import pytest
import trio

import sandbox_fs
import sandbox_fs.snapshot as snapmod
from sandbox_fs import _features
from sandbox_fs.client import LocalSandboxClient
from sandbox_fs.session import PersistDisabledError

# Writes i to a, then to b, forever: at every instant a == b or a == b + 1 (or one is mid-write).
_WRITER = "readlink /proc/self/ns/pid > ns; i=0; while :; do i=$((i+1)); echo $i > a; echo $i > b; done"


def _in_ns(ns: str) -> list[str]:
    """Every host process (zombies too: not yet reaped) in PID namespace ``ns``."""
    out = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and os.readlink(f"/proc/{name}/ns/pid") == ns:
                out.append(name)
        except OSError:
            pass
    return out


def _overlay_unusable() -> str | None:
    if os.geteuid() != 0:
        return "the overlay needs root here (fsopen of a FUSE mount)"
    usable, reason = _features.fuse_status()
    return None if usable else f"FUSE is not usable here: {reason}"


def _watch_persist(monkeypatch, seen: list, daemon: list[int]):
    """Make every persist record what of the session still ran when it began: its processes, the overlay daemon."""
    real = snapmod.persist

    def persist(ws, *args, **kwargs):
        ns = ws.read_bytes("ns").decode().strip()
        seen.append(_in_ns(ns) + [f"overlay daemon {pid}" for pid in daemon if os.path.exists(f"/proc/{pid}")])
        return real(ws, *args, **kwargs)

    monkeypatch.setattr(snapmod, "persist", persist)


async def _wait_for_writes(s) -> None:
    with trio.fail_after(30):
        while True:
            try:
                if int(await s.read("b") or b"0") > 20:
                    return
            except FileNotFoundError:
                pass
            await trio.sleep(0.01)


@pytest.mark.skipif(sandbox_fs.features()["landlock_abi"] == 0,
                    reason="kernel has no Landlock (features()['landlock_abi'] == 0): no confined commands")
@pytest.mark.parametrize("how", ["pty", "exec", "exec-on-overlay"])
async def test_a_command_still_writing_is_dead_before_the_close_persists(client, opts, monkeypatch, request, how):
    """The writer is killed and reaped (and the overlay daemon gone) before persist begins.

    The snapshot is then the workspace at rest: what a restore gives back is
    byte for byte what the workspace held after the close.
    """
    from sandbox_fs import exec as sx

    if how == "exec-on-overlay":
        if (why := _overlay_unusable()) is not None:
            pytest.skip(why)
        client = LocalSandboxClient(dataclasses.replace(opts, overlay=True))
        request.addfinalizer(client.close)
    seen: list[list[str]] = []
    daemon: list[int] = []
    _watch_persist(monkeypatch, seen, daemon)
    s = client.create()
    await s.start()
    if how == "exec-on-overlay":
        assert s.overlay is not None, s.overlay_unavailable_reason
        daemon.append(s.overlay.pid)
    try:
        async with trio.open_nursery() as nursery:
            if how == "pty":
                await s.pty_exec_start(["/bin/sh", "-c", _WRITER])
            else:
                async def run() -> None:
                    await s.exec(["/bin/sh", "-c", _WRITER], timeout_s=60)  # killed by the close
                nursery.start_soon(run)
            await _wait_for_writes(s)
            await s.aclose()  # raises on a failed persist (SnapshotSourceChangedError on the code before)
    except sx.ConfinementError as exc:
        pytest.skip(f"confined exec unavailable here: {exc}")
    ns = (await trio.Path(opts.workspaces_dir, s.id, "ns").read_text()).strip()
    assert ns.startswith("pid:[")
    assert seen == [[]]  # one persist, and not one process of the command was left when it began
    assert s.last_persist is not None and s.last_persist.info is not None
    ws = trio.Path(opts.workspaces_dir, s.id)
    at_rest = (await (ws / "a").read_bytes(), await (ws / "b").read_bytes())
    await client.delete(s)
    async with client.resume(client.serialize_state(s)) as r:  # restored from the stored snapshot
        assert r.start_mode == "restored"
        assert (await r.read("a"), await r.read("b")) == at_rest
    await client.delete(r, snapshot=True)


class _Boom(Exception):
    pass


class _LoggingSupervisor:
    def __init__(self, events: list[str], fail: bool) -> None:
        self.events, self.fail = events, fail

    async def kill_all(self) -> None:
        await trio.lowlevel.checkpoint()
        self.events.append("kill")
        if self.fail:
            raise _Boom("kill")


@pytest.mark.parametrize("pre_fails, kill_fails, hook_fails, persist_fails",
                         list(itertools.product([False, True], repeat=4)))
async def test_close_order_for_every_combination_of_failures(client, monkeypatch, pre_fails, kill_fails,
                                                             hook_fails, persist_fails):
    """Every step combination: persist only after kill, shutdown hooks and overlay, and never after a failure."""
    events: list[str] = []

    def step(name: str, fails: bool):
        async def fn(_sess) -> None:
            await trio.lowlevel.checkpoint()
            events.append(name)
            if fails:
                raise _Boom(name)
        return fn

    def persist(*_args, **_kwargs):
        events.append("persist")
        if persist_fails:
            raise _Boom("persist")
        return real(*_args, **_kwargs)

    real = snapmod.persist
    monkeypatch.setattr(snapmod, "persist", persist)
    s = client.create()
    await s.start()
    close_overlay = s._close_overlay

    async def logged_close_overlay() -> None:
        events.append("overlay")
        await close_overlay()

    monkeypatch.setattr(s, "_close_overlay", logged_close_overlay)
    s.attach_supervisor(_LoggingSupervisor(events, kill_fails))
    s.register_pre_stop_hook(step("pre-stop", pre_fails))
    s.register_shutdown_hook(step("shutdown-hook", hook_fails))
    s.register_transient_cleanup(step("cleanup", False))
    raised: list[BaseException] = []
    try:
        await s.aclose()
    except ExceptionGroup as eg:
        raised = list(eg.exceptions)
    except _Boom as exc:
        raised = [exc]
    blocked = pre_fails or kill_fails or hook_fails
    expected = ["pre-stop", "kill", "shutdown-hook", "overlay"] + ([] if blocked else ["cleanup", "persist"])
    assert events == expected
    shutdown_error = "kill" if kill_fails else "shutdown-hook"  # shutdown raises its first error
    failed = [n for n, f in (("pre-stop", pre_fails), (shutdown_error, kill_fails or hook_fails),
                             ("persist", persist_fails and not blocked)) if f]
    assert [str(e) for e in raised] == failed  # one error per failing step, in step order
    assert s.closed and (client.store.info(s.id) is not None) == (not blocked and not persist_fails)
    if blocked:
        with pytest.raises(PersistDisabledError):
            await s.stop()
    await client.delete(s, snapshot=True)
