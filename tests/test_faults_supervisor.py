"""Fault suite, part 4: the host process SIGKILLed during a confined run leaves no process and no cgroup.

A child interpreter starts a supervised run (``run_confined`` of a shell that
marks the workspace, then sleeps), and is SIGKILLed while the command runs.
Then: the command's processes are gone (its pid namespace dies with its
supervisor), and once the next supervisor starts in this process, no
``sandbox-fs-<dead pid>-*`` cgroup tree is left (v2 or the v1 pids hierarchy).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import trio

import sandbox_fs
from sandbox_fs import exec as sfs_exec
from sandbox_fs.exec import ConfinementPolicy, ProcessSupervisor, _cgroups, run_confined
from tests.faults.harness import record

pytestmark = pytest.mark.skipif(not os.access(sfs_exec.helper_path(), os.X_OK),
                                reason="sandbox_fs/sfs-exec is not built (pip install -e . builds it)")

CHILD = textwrap.dedent("""
    import sys, trio, sandbox_fs
    from sandbox_fs.exec import ConfinementPolicy, ProcessSupervisor, run_confined
    ws_dir, tag = sys.argv[1], sys.argv[2]
    async def main():
        ws = sandbox_fs.open_root(ws_dir)
        sup = ProcessSupervisor(pids_max=16)
        await run_confined(["/bin/sh", "-c", f": > started; exec sleep {tag}"], workspace=ws,
                           workspace_host_path=ws_dir, supervisor=sup, policy=ConfinementPolicy(pids_max=16),
                           confinement="best_effort", timeout_s=60)
    trio.run(main)
""")


def _sleepers(tag: str) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
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


def _populated(trees: list[str]) -> bool:
    """True while a process is still in one of ``trees`` (a killed task leaves its cgroup only once it has exited)."""
    for tree in trees:
        for d, _, _ in os.walk(tree):
            try:
                with open(f"{d}/cgroup.procs") as f:
                    if f.read().strip():
                        return True
            except OSError:
                continue
    return False


def _trees_of(pid: int) -> list[str]:
    out = []
    for base in (_cgroups._find_cgroup2(), _cgroups._find_pids_v1()):
        if base and os.path.isdir(base):
            out += [f"{base}/{n}" for n in os.listdir(base) if n.startswith(f"sandbox-fs-{pid}-")]
    return out


async def test_a_host_killed_mid_run_leaves_no_process_and_the_next_supervisor_sweeps_its_cgroup(tmp_path):
    ws_dir = tmp_path / "ws"
    ws_dir.mkdir()
    tag = f"9{os.getpid()}.{int.from_bytes(os.urandom(2), 'big')}"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(ws_dir), tag])
    try:
        deadline = time.monotonic() + 30
        while not _sleepers(tag) and time.monotonic() < deadline and child.poll() is None:
            await trio.sleep(0.02)
        assert _sleepers(tag), "the confined command did not start"
        made = _trees_of(child.pid)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    with trio.move_on_after(5):
        while _sleepers(tag):
            await trio.sleep(0.02)
    assert _sleepers(tag) == [], "the confined command outlived the killed host process"
    # The sweep leaves a tree that still holds a process; a killed task can stay in its cgroup a
    # moment after /proc shows it gone (under load: seen once in a full run at load 6).
    with trio.move_on_after(10):
        while _populated(made):
            await trio.sleep(0.02)
    assert not _populated(made), "a process of the killed run is still in its cgroup tree"
    ws = sandbox_fs.open_root(str(ws_dir))
    sup = ProcessSupervisor(pids_max=16)
    try:  # the next supervisor start (its first run makes its cgroup tree and sweeps dead owners' trees)
        r = await run_confined(["/bin/true"], workspace=ws, workspace_host_path=str(ws_dir), supervisor=sup,
                               policy=ConfinementPolicy(pids_max=16), confinement="best_effort", timeout_s=20)
        assert r.exit_code == 0
    finally:
        await sup.aclose()
        ws.close()
    if _cgroups._find_cgroup2() or _cgroups._find_pids_v1():
        assert made, "the killed run had made no cgroup tree: the sweep check would be vacuous"
    left = _trees_of(child.pid)
    record("sigkill run", 1, int(not left))
    assert left == [], left
