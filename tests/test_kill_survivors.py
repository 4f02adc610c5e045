"""A kill that cannot prove a command's tree gone disables the stop-time persist.

Session.aclose persists only after shutdown killed every process (81e5f81).
Before this, ``ProcessSupervisor._kill_one`` waited about a second for a
killed tree's cgroup leaf to empty and then went on as if it had (and a
subreaper init without a PID namespace or leaf that had to be SIGKILLed
orphaned what it had not killed yet, unnoticed): ``kill_all`` returned, and
the persist walked a workspace something of the command could still write.
Now such a kill is reported (``ConfinementError``, sticky), so shutdown fails
and persistence is disabled.
"""

from __future__ import annotations

import os
import signal

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from test_exec_escapes import pid_alive

import sandbox_fs
from sandbox_fs.exec import ConfinementError, ConfinementPolicy, ProcessSupervisor, run_confined
from sandbox_fs.exec import _prepare, _supervisor
from sandbox_fs.exec._cgroups import CgroupTree
from sandbox_fs.session import PersistDisabledError

_WRITER = "i=0; while :; do i=$((i+1)); echo $i > a; done"


@pytest.mark.skipif(sandbox_fs.features()["landlock_abi"] == 0,
                    reason="kernel has no Landlock (features()['landlock_abi'] == 0): no confined commands")
async def test_a_leaf_that_stays_populated_disables_the_persist(client, monkeypatch):
    """The store (outside the workspace) gets no snapshot when the killed writer's leaf never empties."""
    s = client.create()
    await s.start()
    try:
        async with trio.open_nursery() as nursery:
            async def run() -> None:
                await s.exec(["/bin/sh", "-c", _WRITER], timeout_s=60)  # killed by the close
            nursery.start_soon(run)
            with trio.fail_after(30):
                while not await trio.Path(client.options.workspaces_dir, s.id, "a").exists():
                    await trio.sleep(0.01)
            if not s._supervisor.uses_cgroup:
                await s.aclose()
                pytest.skip("no cgroup v2 leaf per command here (the supervisor needs a writable cgroup2 mount)")

            class Stuck(CgroupTree):  # a process stuck in the kernel after cgroup.kill
                @staticmethod
                def populated(leaf: str) -> bool:
                    return True

            monkeypatch.setattr(_supervisor, "CgroupTree", Stuck)
            monkeypatch.setattr(_supervisor, "_LEAF_EMPTY_WAIT_S", 0.05, raising=False)
            with pytest.raises((ConfinementError, ExceptionGroup)) as raised:
                await s.aclose()
            monkeypatch.undo()
    except ConfinementError as exc:
        if "outlived the kill" in str(exc):
            raise
        pytest.skip(f"confined exec unavailable here: {exc}")
    errors = raised.value.exceptions if isinstance(raised.value, ExceptionGroup) else [raised.value]
    assert any(isinstance(e, ConfinementError) and "outlived the kill" in str(e) for e in errors)
    assert client.store.info(s.id) is None  # nothing was persisted (the store lies outside the workspace)
    with pytest.raises(PersistDisabledError):
        await s.stop()
    await client.delete(s, snapshot=True)


# The command kills its own init (same uid, no Landlock signal scoping: what best_effort allows on an old
# kernel), leaving a child that outlives the whole run; it writes its pid for the check below.
_KILLS_ITS_INIT = "sleep 30 </dev/null >/dev/null 2>&1 & echo $! > orphan; kill -KILL $PPID; sleep 0.5"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (the command runs as the host's uid to signal its init)")
async def test_an_init_its_command_killed_makes_kill_all_raise(layout, ws, monkeypatch):
    """A subreaper init without a cgroup leaf, SIGKILLed by its own command, ended nothing: kill_all says so.

    Outside sentinel: the orphan is a live host process after ``kill_all``;
    before the fix ``kill_all`` returned and a session persisted with it running.
    """
    real = _prepare._prepare

    def prepare(*a, **kw):  # the subreaper fallback (no PID namespace), as an unprivileged host without userns
        prep = real(*a, **kw)
        prep.helper_argv[prep.helper_argv.index("--init")] = "--no-pid-ns"
        return prep

    monkeypatch.setattr(_prepare, "_prepare", prepare)
    sup = ProcessSupervisor(use_cgroup=False, pids_max=None)  # no leaf names the tree
    orphan = None
    try:
        await run_confined(["/bin/sh", "-c", _KILLS_ITS_INIT], workspace=ws, workspace_host_path=str(layout.ws),
                           confinement="none", policy=ConfinementPolicy(identity="host"), supervisor=sup)
        orphan = int(ws.read_bytes("orphan"))
        pidfd = os.pidfd_open(orphan)  # before the check: the pid cannot name another process after it
        try:
            assert pid_alive(orphan), "the attack did not leave an orphan (nothing to check)"
            with pytest.raises(ConfinementError, match="outlived the kill"):
                await sup.kill_all()
            with pytest.raises(ConfinementError):  # sticky
                await sup.aclose()
        finally:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            os.close(pidfd)
    finally:
        with trio.CancelScope(shield=True):
            try:
                await sup.aclose()
            except ConfinementError:
                pass


class _FakeInit:
    """A command's init: exits on SIGKILL, or on SIGUSR1 when it ends its tree itself."""

    def __init__(self, pid_ns: bool, ends_tree: bool, killed_early: bool = False) -> None:
        self.pid, self.pid_ns, self.ends_tree = 0, pid_ns, ends_tree
        self.returncode: int | None = None
        self.init_signalled = False  # as _ForeignChild: the init itself died of a signal
        self._done = trio.Event()
        if killed_early:  # its command SIGKILLed it before any kill_all
            self.returncode, self.init_signalled = -signal.SIGKILL, True
            self._done.set()

    def signal(self, sig: int) -> None:
        if self.returncode is None and (sig == signal.SIGKILL or (sig == signal.SIGUSR1 and self.ends_tree)):
            self.returncode = -sig
            self._done.set()

    async def wait(self) -> int:
        await self._done.wait()
        assert self.returncode is not None
        return self.returncode


_TREE = st.tuples(st.booleans(), st.sampled_from(["none", "v2", "v1"]), st.booleans(), st.booleans(), st.booleans())


@settings(max_examples=60, deadline=None)
@given(trees=st.lists(_TREE, min_size=1, max_size=4))
def test_kill_all_raises_exactly_when_a_tree_may_have_survived(trees):
    """(pid_ns, leaf kind, leaf stays populated, init ends its tree on SIGUSR1, init killed by its command
    before the kill, seen by _release_if_done or not), any mix of them."""
    stuck = {f"leaf{i}" for i, (_ns, kind, full, _ends, _early) in enumerate(trees) if kind != "none" and full}

    class Leaves:
        @staticmethod
        def populated(leaf: str) -> bool:
            return leaf in stuck

        @staticmethod
        def kill(leaf: str) -> None:
            pass

        @staticmethod
        def remove(leaf: str) -> None:
            pass

    survived = any((kind != "none" and full) or (kind == "none" and not ns and (early or not ends))
                   for ns, kind, full, ends, early in trees)

    async def main() -> None:
        sup = _supervisor.ProcessSupervisor.__new__(_supervisor.ProcessSupervisor)
        sup._tracked, sup._survivors = [], False
        for i, (ns, kind, _full, ends, early) in enumerate(trees):
            init = _FakeInit(ns, ends, early)
            sup._tracked.append(_supervisor._Tracked(init, -1, f"leaf{i}" if kind == "v2" else None, "cmd",
                                                     f"leaf{i}" if kind == "v1" else None, pid_ns=ns))
            if early and i % 2:  # as _end_run: the run's end forgets a tree whose init is reaped
                sup._release_if_done(sup._tracked[-1])
        raised = False
        try:
            await sup.kill_all()
        except ConfinementError:
            raised = True
        assert raised == survived
        assert all(t.process.returncode is not None for t in sup._tracked)  # every init was still killed
        assert [t.leaf or t.pids_leaf for t in sup._tracked] == sorted(stuck, key=lambda x: int(x[4:]))
        if survived:  # sticky: a later kill_all cannot prove it either
            with pytest.raises(ConfinementError):
                await sup.kill_all()

    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(_supervisor, "CgroupTree", Leaves)
        mp.setattr(_supervisor, "PidsV1Tree", Leaves)
        mp.setattr(_supervisor.ProcessSupervisor, "_signal", staticmethod(lambda t, sig: t.process.signal(sig)))
        trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        mp.undo()
