"""Process-count bounds (issue 11, A2): a fork bomb is bounded on every host, or "required" refuses.

Linux never enforces ``RLIMIT_NPROC`` for uid 0, and a host may have cgroup
v2 without the ``pids`` controller (this machine: v2 at
``/sys/fs/cgroup/unified`` with only hugetlb, ``pids`` on a v1 hierarchy).
The attack tests count the command's processes from the host, and check
that they no longer exist after the supervisor closes.
"""

from __future__ import annotations

import os

import pytest
import trio

import sandbox_fs
from sandbox_fs import exec as sfs_exec
from sandbox_fs.exec import _bounds, _cgroups, _prepare
from sandbox_fs.exec import ConfinementError, ConfinementPolicy, ProcessSupervisor, run_confined

ABI = sandbox_fs.features()["landlock_abi"]
HELPER = os.access(sfs_exec.helper_path(), os.X_OK)
ROOT = os.geteuid() == 0
V1 = _cgroups._find_pids_v1()

pytestmark = pytest.mark.skipif(not HELPER, reason="sandbox_fs/sfs-exec is not built (pip install -e . builds it)")
needs_v1 = pytest.mark.skipif(not ROOT or V1 is None,
                              reason="needs root and a cgroup v1 pids hierarchy (/proc/self/cgroup has no pids line)")


def _sleepers(tag: str) -> list[int]:
    """Host pids of live processes running ``sleep <tag>``."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{name}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if argv[:2] == [b"sleep", tag.encode()] and state != "Z":
            out.append(int(name))
    return out


def _bomb(tag: str, n: int) -> list[str]:
    # dash gives up at the first failed fork ("Cannot fork"), here in a
    # subshell; the outer shell then says so in the file "bombed" (a builtin
    # redirection: no fork left) and spins on builtins until the host, having
    # counted the sleepers, makes "counted".  Its background processes end
    # with it (its PID namespace), so they are counted while it runs.
    return ["/bin/sh", "-c", f"(i=0; while [ $i -lt {n} ]; do sleep {tag} >/dev/null 2>&1 & i=$((i+1)); done; "
                             "echo started $i); : > bombed; while [ ! -e counted ]; do :; done"]


async def _run_bomb(tmp_path, policy, tag, n=200, confinement="required"):
    ws_dir = tmp_path / "ws"
    ws_dir.mkdir()
    ws = sandbox_fs.open_root(str(ws_dir))
    sup = ProcessSupervisor(pids_max=policy.pids_max)
    alive: list[int] = []

    async def count() -> None:
        while not (ws_dir / "bombed").exists():
            await trio.sleep(0.01)
        alive.extend(_sleepers(tag))
        (ws_dir / "counted").touch()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(count)
            r = await run_confined(_bomb(tag, n), workspace=ws, workspace_host_path=str(ws_dir), supervisor=sup,
                                   policy=policy, confinement=confinement, timeout_s=20)
            nursery.cancel_scope.cancel()
    finally:
        await sup.aclose()
        ws.close()
    return r, alive


@needs_v1
async def test_fork_bomb_bounded_by_cgroup_v1_pids(tmp_path, monkeypatch):
    """A root command forking 200 sleepers gets at most pids_max tasks (the v1 pids leaf), and none survive."""
    monkeypatch.setattr(_bounds, "_nproc_enforced", lambda: False)  # uid 0: RLIMIT_NPROC binds nothing
    tag = f"7.{os.getpid()}{int.from_bytes(os.urandom(2), 'big')}"  # a unique `sleep` argument (~7 s)
    pol = ConfinementPolicy(pids_max=64, processes=64, identity="host")  # a uid-0 command
    r, alive = await _run_bomb(tmp_path, pol, tag)
    has_v2_pids = any(b.startswith("cgroup2.") for b in r.process_bounds)
    if not has_v2_pids:
        assert r.process_bounds == ("cgroup1.pids.max=64",)
    # 64 tasks in the leaf: the command's shell and its subshell are two of them
    assert 0 < len(alive) <= 62, (len(alive), r.stdout, r.stderr)
    assert b"started" not in r.stdout  # the 64th fork failed and stopped the loop
    with trio.move_on_after(3):
        while _sleepers(tag):
            await trio.sleep(0.02)
    assert _sleepers(tag) == []  # killed by the supervisor (v2 cgroup.kill or the v1 pidfd kill)
    assert not [n for n in os.listdir(V1) if n.startswith(f"sandbox-fs-{os.getpid()}-")]  # leaves removed


@needs_v1
async def test_v1_only_kill_ends_a_setsid_background_process(tmp_path, monkeypatch):
    """Without a cgroup v2 leaf, the supervisor kills what the v1 pids leaf lists (setsid'd ones too)."""
    monkeypatch.setattr(_bounds, "_nproc_enforced", lambda: False)
    monkeypatch.setattr(_cgroups, "_find_cgroup2", lambda: None)
    ws_dir = tmp_path / "ws"
    ws_dir.mkdir()
    ws = sandbox_fs.open_root(str(ws_dir))
    sup = ProcessSupervisor()
    try:
        assert not sup.uses_cgroup and sup._v1 is not None
        tag = f"9.{os.getpid()}{int.from_bytes(os.urandom(2), 'big')}"
        r = None
        async with trio.open_nursery() as nursery:
            async def go() -> None:
                nonlocal r
                r = await run_confined(["/bin/sh", "-c", f"setsid sleep {tag} >/dev/null 2>&1 & "
                                                         "while :; do :; done"],
                                       workspace=ws, workspace_host_path=str(ws_dir), supervisor=sup,
                                       policy=ConfinementPolicy(identity="host"))  # a uid-0 command

            nursery.start_soon(go)
            with trio.fail_after(10):
                while not _sleepers(tag):
                    await trio.sleep(0.01)
            await sup.kill_all()  # the command and its setsid'd sleeper, still running
        assert r is not None and r.process_bounds == ("cgroup1.pids.max=4096",)
        tree = sup._v1.dir
    finally:
        await sup.aclose()
        ws.close()
    with trio.move_on_after(3):
        while _sleepers(tag):
            await trio.sleep(0.02)
    assert _sleepers(tag) == []
    assert not os.path.exists(tree)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _no_bound_here(monkeypatch):
    """Make this host look like one with no pids controller and uid 0 (RLIMIT_NPROC not enforced)."""
    monkeypatch.setattr(_cgroups, "_read_pids_max", lambda leaf: None)
    monkeypatch.setattr(_cgroups, "_find_pids_v1", lambda: None)
    monkeypatch.setattr(_bounds, "_nproc_enforced", lambda: False)


async def test_required_refuses_without_any_process_bound(tmp_path, monkeypatch):
    _no_bound_here(monkeypatch)
    host = ConfinementPolicy(identity="host")  # a uid-0 command (a leased identity is bound by RLIMIT_NPROC)
    ws = sandbox_fs.open_root(str(tmp_path))
    try:
        with pytest.raises(ConfinementError) as info:
            await run_confined(["true"], workspace=ws, workspace_host_path=str(tmp_path), policy=host)
        assert info.value.code == "confinement_unavailable"
        assert "process-count bound" in str(info.value)
        # best_effort runs, and says that no bound held
        r = await run_confined(["true"], workspace=ws, workspace_host_path=str(tmp_path),
                               confinement="best_effort", policy=host)
        assert r.exit_code == 0 and r.process_bounds == ()
        # a policy that asks for no bound is not refused
        r = await run_confined(["true"], workspace=ws, workspace_host_path=str(tmp_path),
                               policy=ConfinementPolicy(pids_max=None, processes=None, identity="host"))
        assert r.exit_code == 0 and r.process_bounds == ()
    finally:
        ws.close()


async def test_process_bounds_reported_on_this_host(tmp_path):
    """Whatever this host offers, a required run reports at least one bound, read back from the kernel."""
    ws = sandbox_fs.open_root(str(tmp_path))
    try:
        try:
            r = await run_confined(["true"], workspace=ws, workspace_host_path=str(tmp_path),
                                   policy=ConfinementPolicy(pids_max=123, processes=123))
        except ConfinementError as exc:
            pytest.skip(f"this host enforces no process-count bound: {exc}")
        assert r.process_bounds
        assert set(r.process_bounds) <= {"cgroup2.pids.max=123", "cgroup1.pids.max=123", "rlimit.nproc=123"}
        assert r.confinement in ("landlock", "none")  # ExecResult.confinement keeps its meaning
    finally:
        ws.close()


class _FakeSupervisor:
    def __init__(self, v1_leaf):
        self.v1_leaf = v1_leaf
        self.asked = []

    def _new_pids_leaf(self, pids_max):
        self.asked.append(pids_max)
        return self.v1_leaf


def _leaf(path, pids_max):
    path.mkdir()
    (path / "pids.max").write_text(f"{pids_max}\n")
    (path / "cgroup.procs").write_text("")
    return str(path)


# (v2 leaf pids.max, RLIMIT_NPROC enforced, v1 available, confinement, policy) -> bounds or "refused"
CASES = [
    ("64", False, True, "required", dict(pids_max=64, processes=64), ("cgroup2.pids.max=64",)),
    ("64", True, True, "required", dict(pids_max=64, processes=32), ("cgroup2.pids.max=64", "rlimit.nproc=32")),
    (None, True, True, "required", dict(pids_max=64, processes=32), ("rlimit.nproc=32",)),
    (None, False, True, "required", dict(pids_max=64, processes=64), ("cgroup1.pids.max=64",)),
    ("max", False, True, "required", dict(pids_max=64, processes=64), ("cgroup1.pids.max=64",)),
    (None, False, False, "required", dict(pids_max=64, processes=64), "refused"),
    (None, False, False, "best_effort", dict(pids_max=64, processes=64), ()),
    (None, False, False, "none", dict(pids_max=64, processes=64), ()),
    (None, False, False, "required", dict(pids_max=None, processes=None), ()),
    (None, False, True, "required", dict(pids_max=None, processes=64), "refused"),
    (None, True, False, "required", dict(pids_max=None, processes=64), ("rlimit.nproc=64",)),
    (None, False, True, "required", dict(pids_max=64, processes=64, use_cgroup=False), "refused"),
]


@pytest.mark.parametrize("v2, nproc, v1, confinement, pol, expected", CASES)
def test_bound_selection_table(tmp_path, monkeypatch, v2, nproc, v1, confinement, pol, expected):
    monkeypatch.setattr(_bounds, "_nproc_enforced", lambda: nproc)
    policy = ConfinementPolicy(**pol)
    v1_leaf = _leaf(tmp_path / "v1", policy.pids_max) if v1 and policy.pids_max is not None else None
    prep = _prepare.Prepared([], {}, [], -1, "none", 0, None, (), ".")
    if v2 is not None:
        prep.leaf = str(tmp_path / "v2")
        (tmp_path / "v2").mkdir()
        (tmp_path / "v2" / "pids.max").write_text(v2 + "\n")
    sup = _FakeSupervisor(v1_leaf)
    try:
        if expected == "refused":
            with pytest.raises(ConfinementError) as info:
                _bounds.read_process_bounds(prep, sup, policy, confinement)
            assert info.value.code == "confinement_unavailable"
            return
        args = _bounds.read_process_bounds(prep, sup, policy, confinement)
        assert prep.process_bounds == expected
        uses_v1 = any(b.startswith("cgroup1.") for b in expected)
        assert (args[:1] == ["--pids-procs"]) == uses_v1
        assert (prep.pids_leaf is not None) == uses_v1
        if uses_v1:  # the helper gets the leaf's cgroup.procs opened for writing, nothing else
            fd = int(args[1])
            assert fd in prep.pass_fds
            assert os.readlink(f"/proc/self/fd/{fd}") == f"{v1_leaf}/cgroup.procs"
    finally:
        prep.close_all()
