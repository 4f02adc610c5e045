"""Granted device nodes of a confined command (issue 14, "Devices"): ``ConfinementPolicy.devices``.

The nodes are made here with ``mknod`` in a temp directory on a filesystem
without ``nodev`` (the real ``/dev`` is never touched): ``null1`` has
/dev/null's numbers (1, 3), ``zero1`` /dev/zero's (1, 5).  Everything runs
as the leased non-root identity of this root host.  Each denial has a
positive control (the same command with the node granted), so the test can
fail.  The private-root cases use a detached tmpfs as the stand-in overlay
(as tests/test_exec_private_root.py does), and one case the FUSE overlay
itself through a Session.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

import sandbox_fs
from sandbox_fs import open_root
from sandbox_fs.errors import SandboxError
from sandbox_fs.exec import ConfinementPolicy, PrivateRoot, run_confined
from sandbox_fs.exec import _devices
from sandbox_fs.exec import helper_path
from sandbox_fs.root import Root

ABI = sandbox_fs.features()["landlock_abi"]

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="mknod of test device nodes needs a root host"),
    pytest.mark.skipif(not os.access(helper_path(), os.X_OK), reason="sandbox_fs/sfs-exec is not built"),
    pytest.mark.skipif(ABI < 5, reason="Landlock ABI < 5: no IOCTL_DEV right (features()['landlock_abi'])"),
]

_libc = ctypes.CDLL(None, use_errno=True)


def _syscall(*args: object) -> int:
    ret = _libc.syscall(*args)
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(ret)


def _detached_tmpfs() -> int:
    """A detached tmpfs mount (fsopen, fsconfig, fsmount): the stand-in overlay's mount fd."""
    fs = _syscall(430, b"tmpfs", 1)
    try:
        _syscall(431, fs, 1, b"mode", b"0755", 0)
        _syscall(431, fs, 6, None, None, 0)
        return _syscall(432, fs, 1, 0)
    finally:
        os.close(fs)


def _nodev(path: str) -> bool:
    return bool(os.statvfs(path).f_flag & os.ST_NODEV)


@pytest.fixture
def base():
    """A temp dir every uid may search, on a filesystem that allows device nodes, with the nodes and a workspace."""
    parent = "/var/tmp" if not _nodev("/var/tmp") else "/tmp"
    if _nodev(parent):
        pytest.skip("no temp filesystem without nodev (/var/tmp and /tmp are nodev)")
    d = Path(tempfile.mkdtemp(prefix="sfs-devices-", dir=parent))
    os.chmod(d, 0o755)
    (d / "devs").mkdir(mode=0o755)
    os.mknod(d / "devs" / "null1", 0o020666, os.makedev(1, 3))
    os.mknod(d / "devs" / "zero1", 0o020666, os.makedev(1, 5))
    os.chmod(d / "devs" / "null1", 0o666)
    os.chmod(d / "devs" / "zero1", 0o666)
    (d / "ws").mkdir()
    (d / "plain").write_text("not a device\n")
    yield d
    shutil.rmtree(d)


@pytest.fixture
def ws(base):
    root = open_root(base / "ws")
    yield root
    root.close()


@pytest.fixture
def tmpfs_ws():
    mfd = _detached_tmpfs()
    root = Root(os.dup(mfd), read_only=False, no_symlinks=False, resolver=sandbox_fs.features()["resolver"], label="")
    yield mfd, root
    root.close()
    os.close(mfd)


def sh(script: str) -> list[str]:
    return ["/bin/sh", "-c", script]


def _probe(d: Path) -> str:
    """Write then read null1, read zero1; one line each: ok/denied."""
    n, z = d / "devs" / "null1", d / "devs" / "zero1"
    return (f"if echo hi > {n}; then echo w-ok; else echo w-denied; fi; "
            f"if head -c 4 {n} > /dev/null; then echo rn-ok; else echo rn-denied; fi; "
            f"if [ $(head -c 4 {z} | wc -c) = 4 ]; then echo rz-ok; else echo rz-denied; fi; id -u")


async def _run(ws, base: Path, devices: tuple[str, ...], script: str, **kw):
    pol = ConfinementPolicy(devices=devices)
    return await run_confined(sh(script), workspace=ws, workspace_host_path=str(base / "ws"), policy=pol, **kw)


# ---- without a private root: the read-only mount layer -------------------------------------------


async def test_granted_node_is_usable_and_the_other_is_denied(ws, base):
    r = await _run(ws, base, (str(base / "devs" / "null1"),), _probe(base))
    out = r.stdout.decode().split()
    assert out[:3] == ["w-ok", "rn-ok", "rz-denied"], r.stderr
    assert r.identity is not None and int(out[3]) == r.identity[0] != 0
    assert r.read_only_mounts and r.confinement == "landlock"
    # positive control: granted too, the second node is readable, so the denial above was the grant's
    r2 = await _run(ws, base, (str(base / "devs" / "null1"), str(base / "devs" / "zero1")), _probe(base))
    assert r2.stdout.decode().split()[:3] == ["w-ok", "rn-ok", "rz-ok"], r2.stderr


async def test_without_a_grant_no_node_is_usable(ws, base):
    r = await _run(ws, base, (), _probe(base))
    assert r.stdout.decode().split()[:3] == ["w-denied", "rn-denied", "rz-denied"]


async def test_ioctl_on_the_granted_node(ws, base):
    """IOCTL_DEV: stty's TCGETS reaches the null driver (ENOTTY from it), not a Landlock EACCES."""
    if not os.path.exists("/usr/bin/stty"):
        pytest.skip("no /usr/bin/stty to issue the ioctl")
    r = await _run(ws, base, (str(base / "devs" / "null1"),),
                   f"LC_ALL=C /usr/bin/stty -F {base / 'devs' / 'null1'} 2>&1; echo rc=$?")
    out = r.stdout.decode()
    assert "Inappropriate ioctl" in out and "Permission denied" not in out, out


async def test_a_node_on_a_nodev_mount_is_usable_through_its_bind(base):
    """The bind of a granted node clears nodev: a node on a nodev tmpfs (made here, in the temp dir) opens."""
    mnt = base / "nodevfs"
    mnt.mkdir(mode=0o755)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "nodev,mode=0755,size=64k", "tmpfs", str(mnt)], check=True)
    try:
        os.mknod(mnt / "zero2", 0o020666, os.makedev(1, 5))
        os.chmod(mnt / "zero2", 0o666)
        root = open_root(base / "ws")
        try:
            script = f"if [ $(head -c 4 {mnt}/zero2 | wc -c) = 4 ]; then echo ok; else echo denied; fi"
            r = await _run(root, base, (str(mnt / "zero2"),), script)
            assert r.stdout.decode().strip() == "ok", r.stderr
            # control: without the mount layer (read_only_mounts=False) the host's nodev mount refuses it
            pol = ConfinementPolicy(devices=(str(mnt / "zero2"),), read_only_mounts=False)
            r2 = await run_confined(sh(script), workspace=root, workspace_host_path=str(base / "ws"), policy=pol)
            assert r2.stdout.decode().strip() == "denied"
        finally:
            root.close()
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


async def test_with_a_supervisor_the_run_gets_a_mount_namespace_of_its_own(ws, base):
    """A supervisor's held namespace has no device binds: a run with devices makes its own, the next one not."""
    from sandbox_fs.exec import ProcessSupervisor

    async with ProcessSupervisor() as sup:
        r = await _run(ws, base, (str(base / "devs" / "null1"),), _probe(base), supervisor=sup)
        assert r.stdout.decode().split()[:3] == ["w-ok", "rn-ok", "rz-denied"], r.stderr
        r2 = await _run(ws, base, (), _probe(base), supervisor=sup)
        assert r2.stdout.decode().split()[:3] == ["w-denied", "rn-denied", "rz-denied"], r2.stderr


# ---- refusals (before anything is spawned) -------------------------------------------------------


@pytest.mark.parametrize("kind", ["leaf-symlink", "parent-symlink", "regular-file", "directory", "missing",
                                  "relative", "dotdot"])
async def test_refused_device_paths(ws, base, kind):
    if kind == "leaf-symlink":
        os.symlink("null1", base / "devs" / "link")
        path = str(base / "devs" / "link")
    elif kind == "parent-symlink":
        os.symlink("devs", base / "devlink")
        path = str(base / "devlink" / "null1")
    elif kind == "regular-file":
        path = str(base / "plain")
    elif kind == "directory":
        path = str(base / "devs")
    elif kind == "missing":
        path = str(base / "devs" / "nothing")
    elif kind == "relative":
        path = "devs/null1"
    else:
        path = str(base / "devs" / ".." / "devs" / "null1")
    sentinel = base / "ws" / "ran"
    with pytest.raises(_devices.DeviceError) as info:
        await _run(ws, base, (path,), f"touch {sentinel}")
    assert info.value.code == "device_refused" and isinstance(info.value, SandboxError)
    assert str(base) not in str(info.value)  # the text names the grant, never the host path
    assert not sentinel.exists()


async def test_unknown_and_absent_families_are_refused(ws, base):
    with pytest.raises(_devices.DeviceError, match="unknown driver family"):
        await run_confined(["true"], workspace=ws, workspace_host_path=str(base / "ws"),
                           policy=ConfinementPolicy(device_families=("voodoo",)))
    if os.path.lexists("/dev/nvidiactl"):
        pytest.skip("this host has the nvidia driver: the absent-family refusal cannot be shown")
    with pytest.raises(_devices.DeviceError, match="not present"):
        await run_confined(["true"], workspace=ws, workspace_host_path=str(base / "ws"),
                           policy=ConfinementPolicy(device_families=("nvidia",)))


@pytest.fixture
def fake_family(base, monkeypatch):
    """A driver family made of this test's nodes: zero1 as its control node, two kernel paths read-only."""
    fam = _devices.DeviceFamily("testfam", str(base / "devs" / "null1"), devices=(str(base / "devs" / "zero1"),),
                                read_paths=("/sys/class/net", "/proc/sys/kernel", "/sys/no-such-path"))
    monkeypatch.setitem(_devices.DEVICE_FAMILIES, "testfam", fam)
    return fam


_FAMILY_PROBE = ("if [ $(head -c 4 {z} | wc -c) = 4 ]; then echo node-ok; else echo node-denied; fi; "
                 "if ls /sys/class/net > /dev/null; then echo sys-ok; else echo sys-denied; fi; "
                 "if cat /proc/sys/kernel/ostype > /dev/null; then echo proc-ok; else echo proc-denied; fi; "
                 "if echo x > {z}; then echo write-ok; else echo write-denied; fi")


@pytest.mark.parametrize("private", [False, True], ids=["ro-mounts", "private-root"])
async def test_a_family_adds_its_nodes_and_read_only_paths(fake_family, base, private):
    """The family mechanism with this test's nodes (no GPU here): its node and paths, and nothing without it."""
    probe = sh(_FAMILY_PROBE.format(z=base / "devs" / "zero1"))
    mfd = _detached_tmpfs() if private else -1
    root = (Root(os.dup(mfd), read_only=False, no_symlinks=False, resolver=sandbox_fs.features()["resolver"], label="")
            if private else open_root(base / "ws"))
    kw = {"private_root": PrivateRoot(mfd)} if private else {}
    try:
        r = await run_confined(probe, workspace=root, workspace_host_path=str(base / "ws"),
                               policy=ConfinementPolicy(device_families=("testfam",)), **kw)
        assert r.stdout.decode().split() == ["node-ok", "sys-ok", "proc-ok", "write-ok"], r.stderr
        # control: without the family none of it is reachable
        r2 = await run_confined(probe, workspace=root, workspace_host_path=str(base / "ws"),
                                policy=ConfinementPolicy(), **kw)
        assert r2.stdout.decode().split() == ["node-denied", "sys-denied", "proc-denied", "write-denied"]
    finally:
        root.close()
        if mfd >= 0:
            os.close(mfd)


async def test_a_family_whose_marker_is_missing_is_refused(fake_family, base, ws, monkeypatch):
    monkeypatch.setitem(_devices.DEVICE_FAMILIES, "testfam",
                        _devices.DeviceFamily("testfam", str(base / "devs" / "gone")))
    with pytest.raises(_devices.DeviceError, match="not present"):
        await run_confined(["true"], workspace=ws, workspace_host_path=str(base / "ws"),
                           policy=ConfinementPolicy(device_families=("testfam",)))


def test_family_paths_are_plain_and_documented():
    security = (Path(__file__).resolve().parent.parent / "SECURITY.md").read_text()
    for fam in _devices.DEVICE_FAMILIES.values():
        for p in (fam.present, *fam.devices, *fam.read_paths, *(d for d, _ in fam.device_globs)):
            assert _devices.check_device_path(p, "x") == p
            assert p.startswith(("/dev/", "/sys/", "/proc/")), p
            assert f"`{p}" in security, f"{fam.name}: {p} is not listed in SECURITY.md"
        for p in fam.read_paths:
            assert not p.startswith("/dev/"), p


# ---- creating device nodes stays denied -----------------------------------------------------------


async def test_mknod_inside_the_sandbox_fails(ws, base):
    target = base / "ws" / "made"
    script = f"mknod {target} c 1 3 && echo made || echo refused; mknod {target}p p && echo fifo-ok"
    r = await _run(ws, base, (str(base / "devs" / "null1"),), script)
    assert r.stdout.decode().split()[0] == "refused"
    assert not target.exists()  # the outside sentinel: no node in the workspace
    assert "fifo-ok" in r.stdout.decode()  # control: the command can make entries there


@pytest.mark.parametrize("identity", ["auto", "host"])
async def test_seccomp_refuses_device_mknod_first(ws, base, identity):
    """mknod(S_IFCHR) fails with seccomp's EPERM (not Landlock's EACCES), the 0:0 whiteout too; a FIFO is made."""
    if not os.path.exists("/usr/bin/python3"):
        pytest.skip("no /usr/bin/python3 in the system set to call mknod directly")
    prog = ("import os, stat, errno, sys\n"
            "for name, mode, dev in (('c13', stat.S_IFCHR, (1, 3)), ('wh', stat.S_IFCHR, (0, 0)),"
            " ('b', stat.S_IFBLK, (7, 0)), ('fifo', stat.S_IFIFO, (0, 0))):\n"
            "    try:\n        os.mknod(name, mode | 0o600, os.makedev(*dev)); print(name, 'made')\n"
            "    except OSError as e:\n        print(name, errno.errorcode[e.errno])\n")
    pol = ConfinementPolicy(devices=(str(base / "devs" / "null1"),), identity=identity)
    r = await run_confined(["/usr/bin/python3", "-c", prog], workspace=ws, workspace_host_path=str(base / "ws"),
                           policy=pol)
    assert r.stdout.decode().splitlines() == ["c13 EPERM", "wh EPERM", "b EPERM", "fifo made"], r.stderr
    assert not any(n in os.listdir(base / "ws") for n in ("c13", "wh", "b"))


# ---- in a private root ------------------------------------------------------------------------------


async def test_private_root_binds_the_granted_node_only(tmpfs_ws, base):
    mfd, root = tmpfs_ws
    d = base / "devs"
    r = await run_confined(sh(_probe(base) + f"; for n in null1 zero1; do [ -e {d}/$n ] && echo $n; done"),
                           workspace=root,
                           workspace_host_path=str(base / "not-used"), private_root=PrivateRoot(mfd),
                           policy=ConfinementPolicy(devices=(str(base / "devs" / "null1"),)))
    out = r.stdout.decode().split()
    assert r.overlay
    assert out[:3] == ["w-ok", "rn-ok", "rz-denied"], r.stderr
    assert int(out[3]) != 0
    assert out[4:] == ["null1"]  # the ungranted node is not in the private root at all
    r2 = await run_confined(sh(_probe(base)), workspace=root, workspace_host_path=str(base / "not-used"),
                            private_root=PrivateRoot(mfd),
                            policy=ConfinementPolicy(devices=(str(base / "devs" / "null1"),
                                                              str(base / "devs" / "zero1"))))
    assert r2.stdout.decode().split()[:3] == ["w-ok", "rn-ok", "rz-ok"], r2.stderr


async def test_private_root_mknod_fails(tmpfs_ws, base):
    mfd, root = tmpfs_ws
    r = await run_confined(sh("mknod /workspace/made c 1 3 && echo made || echo refused; ls /workspace"),
                           workspace=root, workspace_host_path=str(base / "not-used"), private_root=PrivateRoot(mfd),
                           policy=ConfinementPolicy(devices=(str(base / "devs" / "null1"),)))
    assert r.stdout.decode().split() == ["refused"]
    assert "made" not in os.listdir(f"/proc/self/fd/{mfd}")


async def test_fuse_overlay_session_grants_the_node(base):
    from sandbox_fs import _features
    from sandbox_fs.client import ClientOptions, LocalSandboxClient

    usable, reason = _features.fuse_status()
    if not usable:
        pytest.skip(f"FUSE is not usable here ({reason}): no overlay session to run the command in")
    client = LocalSandboxClient(ClientOptions(workspaces_dir=str(base / "wsdir"), overlay=True))
    try:
        async with client.create() as session:
            r = await session.exec(sh(_probe(base)), timeout_s=60,
                                   policy=ConfinementPolicy(devices=(str(base / "devs" / "null1"),)))
            assert r.overlay is True
            assert r.stdout.decode().split()[:3] == ["w-ok", "rn-ok", "rz-denied"], r.stderr
    finally:
        client.close()


# ---- the command line -------------------------------------------------------------------------------


def _cli(base: Path, *args: str) -> subprocess.CompletedProcess:
    import json
    import sys

    (base / "m.json").write_text(json.dumps({"version": 1, "entries": {"a.txt": {"type": "file", "content": "a"}}}))
    wsdir = base / "wsdir"
    wsdir.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-m", "sandbox_fs", "run", "--manifest", str(base / "m.json"),
                           "--workspaces-dir", str(wsdir), *args], capture_output=True, text=True, timeout=120)


def test_cli_device_grants_the_node(base):
    r = _cli(base, "--device", str(base / "devs" / "null1"), "--", "/bin/sh", "-c", _probe(base))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[:3] == ["w-ok", "rn-ok", "rz-denied"]


def test_cli_refuses_a_regular_file_as_a_device_in_one_line(base):
    r = _cli(base, "--device", str(base / "plain"), "--", "/bin/true")
    assert r.returncode == 1
    assert "Traceback" not in r.stderr and "devices[0]" in r.stderr and str(base) not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
