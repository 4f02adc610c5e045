"""The private root of a confined command (issue 13, part 5): ``run_confined(private_root=...)``.

Most tests stand the workspace overlay in with a detached mount of the same
kind: ``fsopen("tmpfs")``/``fsmount`` filled with files (its root inode is
not the workspace directory's, as with FUSE, so the Landlock workspace rule
must be on the mount), or ``open_tree(OPEN_TREE_CLONE)`` of a backing
directory (writes land in that directory); the syscalls are made with ctypes
here, in the test only.  The last test uses the FUSE overlay itself.

Each test that a host object is out of reach has a positive control: the
same command without the private root (or without Landlock) reaches it, so
the test can fail.  Everything runs as the leased non-root identity unless
said otherwise.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

import sandbox_fs
from sandbox_fs import exec as sfs_exec
from sandbox_fs import Grant, PathPolicy, open_root
from sandbox_fs.exec import ConfinementPolicy, ExecError, PrivateRoot, PtyManager, ProcessSupervisor, run_confined
from sandbox_fs.root import Root

ABI = sandbox_fs.features()["landlock_abi"]

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the private root is built on a root host only"),
    pytest.mark.skipif(not os.access(sfs_exec.helper_path(), os.X_OK), reason="sandbox_fs/sfs-exec is not built"),
    pytest.mark.skipif(ABI == 0, reason="features()['landlock_abi'] is 0: the kernel has no Landlock"),
]

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_OPEN_TREE, _SYS_FSOPEN, _SYS_FSCONFIG, _SYS_FSMOUNT = 428, 430, 431, 432
_OPEN_TREE_CLONE, _AT_EMPTY_PATH, _AT_RECURSIVE = 1, 0x1000, 0x8000
_FSCONFIG_SET_STRING, _FSCONFIG_CMD_CREATE = 1, 6

#: What the private root holds at its top, and in /dev (without a PTY).
ROOT_NAMES = {"bin", "dev", "etc", "lib", "lib64", "proc", "sbin", "tmp", "usr", "workspace"}
DEV_NAMES = {"fd", "full", "null", "random", "stderr", "stdin", "stdout", "urandom", "zero"}


def _syscall(*args: object) -> int:
    ret = _libc.syscall(*args)
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret


def detached_tmpfs() -> int:
    """A detached tmpfs mount (fsopen/fsconfig/fsmount): its O_PATH fd, the mount's last reference."""
    fs = _syscall(_SYS_FSOPEN, b"tmpfs", 1)
    try:
        _syscall(_SYS_FSCONFIG, fs, _FSCONFIG_SET_STRING, b"mode", b"0755", 0)
        _syscall(_SYS_FSCONFIG, fs, _FSCONFIG_CMD_CREATE, None, None, 0)
        return _syscall(_SYS_FSMOUNT, fs, 1, 0)
    finally:
        os.close(fs)


def detached_clone(path: Path) -> int:
    """A detached clone of the directory at ``path`` (open_tree OPEN_TREE_CLONE): its O_PATH fd."""
    fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return _syscall(_SYS_OPEN_TREE, fd, b"", _OPEN_TREE_CLONE | _AT_EMPTY_PATH | _AT_RECURSIVE | os.O_CLOEXEC)
    finally:
        os.close(fd)


def sh(script: str) -> list[str]:
    return ["/bin/sh", "-c", script]


@pytest.fixture
def base():
    """A temp dir under /tmp every uid may search (pytest's tmp_path sits under a 0700 directory)."""
    d = Path(tempfile.mkdtemp(prefix="sfs-privroot-"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d)


@pytest.fixture
def tmpfs_ws():
    """The stand-in overlay: a detached tmpfs with hello.txt and sub/, and a Root on it.

    Yields ``(mount_fd, root)``; both are closed after the test (the mount dissolves with them).
    """
    mfd = detached_tmpfs()
    fd = os.open("hello.txt", os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644, dir_fd=mfd)
    os.write(fd, b"hello from the overlay\n")
    os.close(fd)
    os.mkdir("sub", 0o755, dir_fd=mfd)
    root = Root(os.dup(mfd), read_only=False, no_symlinks=False, resolver=sandbox_fs.features()["resolver"],
                label="")
    yield mfd, root
    root.close()
    os.close(mfd)


@pytest.fixture
def cloned_ws(base):
    """A backing workspace directory and a detached clone of it (the stand-in overlay).

    Yields ``(backing_path, mount_fd, backing_root)``.
    """
    backing = base / "backing"
    backing.mkdir()
    (backing / "hello.txt").write_text("hello from the backing dir\n")
    mfd = detached_clone(backing)
    root = open_root(backing)
    yield backing, mfd, root
    root.close()
    os.close(mfd)


async def test_the_command_sees_the_overlay_at_workspace_path(tmpfs_ws, base):
    mfd, ws = tmpfs_ws
    r = await run_confined(sh("pwd; id -u; cat /workspace/hello.txt; echo written > /workspace/sub/new.txt; "
                              "echo HOME=$HOME TMPDIR=$TMPDIR"),
                           workspace=ws, workspace_host_path=str(base / "not-used"), cwd="sub",
                           private_root=PrivateRoot(mfd), check=True)
    lines = r.stdout.decode().splitlines()
    assert lines[0] == "/workspace/sub"
    assert lines[2] == "hello from the overlay"
    assert lines[3] == "HOME=/workspace/.home TMPDIR=/workspace/.tmp"
    assert r.overlay and r.confinement == "landlock" and r.read_only_mounts
    # As the leased identity, writing through the mount (the Landlock rule is on the mount's root).
    assert r.identity is not None and int(lines[1]) == r.identity[0] != 0
    fd = os.open("sub/new.txt", os.O_RDONLY | os.O_CLOEXEC, dir_fd=mfd)
    try:
        assert os.read(fd, 100) == b"written\n"
        assert os.fstat(fd).st_uid == r.identity[0]
    finally:
        os.close(fd)


async def test_writes_land_in_the_backing_directory(cloned_ws):
    backing, mfd, ws = cloned_ws
    r = await run_confined(sh("cat hello.txt; echo made-inside > made.txt; mkdir d && echo x > d/f"),
                           workspace=ws, workspace_host_path=str(backing), private_root=PrivateRoot(mfd), check=True)
    assert r.stdout == b"hello from the backing dir\n"
    assert (backing / "made.txt").read_text() == "made-inside\n"
    assert (backing / "d" / "f").read_text() == "x\n"
    assert r.identity is not None and (backing / "made.txt").stat().st_uid == r.identity[0]


async def test_nothing_else_of_the_host_is_there(cloned_ws, base):
    backing, mfd, ws = cloned_ws
    host_tmp = Path(tempfile.mkdtemp(prefix="sfs-privroot-host-tmp-"))  # the host's /tmp
    try:
        names = {"root": "/root", "backing": str(backing), "host_tmp": str(host_tmp), "fuse": "/dev/fuse",
                 "pts": "/dev/pts", "shm": "/dev/shm", "sys": "/sys", "home": "/home", "var": "/var"}
        script = "; ".join(f"[ -e {p} ] && echo {k}" for k, p in names.items()) + "; true"
        seen = await run_confined(sh(script), workspace=ws, workspace_host_path=str(backing),
                                  private_root=PrivateRoot(mfd), check=True)
        assert seen.stdout == b"", seen.stdout
        # Control: with the host's root, the same checks see every one of them.
        control = await run_confined(sh(script), workspace=ws, workspace_host_path=str(backing), check=True)
        assert set(control.stdout.decode().split()) >= {"root", "backing", "host_tmp", "fuse", "sys"}
    finally:
        host_tmp.rmdir()


async def test_root_dev_and_tmp_listings_are_the_private_ones(cloned_ws):
    """Without Landlock (which refuses these listings) the directories show exactly what was built."""
    backing, mfd, ws = cloned_ws
    r = await run_confined(sh("ls -A /; echo --; ls -A /dev; echo --; ls -A /tmp; echo --; echo t > /tmp/t && "
                              "cat /tmp/t"),
                           workspace=ws, workspace_host_path=str(backing), private_root=PrivateRoot(mfd),
                           confinement="none", check=True)
    top, dev, tmp, wrote = r.stdout.decode().split("--\n")
    assert set(top.split()) == ROOT_NAMES | ({"lib32", "libx32"} & set(top.split()))
    assert set(dev.split()) == DEV_NAMES
    assert tmp.split() == []
    assert wrote == "t\n"
    assert r.overlay


async def test_proc_shows_only_the_commands_own_pid_namespace(cloned_ws):
    backing, mfd, ws = cloned_ws
    marker = f"sfs-privroot-marker-{os.getpid()}"
    host = subprocess.Popen([marker, "60"], executable=shutil.which("sleep"))
    try:
        script = "for d in /proc/[0-9]*; do echo ${d#/proc/} $(tr '\\0' ' ' < $d/cmdline); done"
        r = await run_confined(sh(script), workspace=ws, workspace_host_path=str(backing),
                               private_root=PrivateRoot(mfd), confinement="none", check=True)
        # Command lines are arbitrary bytes (any host process's argv): compare bytes, never decode.
        pids = [int(line.split()[0]) for line in r.stdout.splitlines()]
        assert marker.encode() not in r.stdout
        assert max(pids) < 20, pids  # a fresh namespace: init, the shell, its children
        # Control: the host's /proc lists the marker process.
        control = await run_confined(sh(script), workspace=ws, workspace_host_path=str(backing),
                                     confinement="none", check=True)
        assert marker.encode() in control.stdout
    finally:
        host.kill()
        host.wait()


async def test_an_absolute_symlink_planted_in_the_workspace_reads_the_private_view(base):
    """A link to the sentinel's host path resolves in the private root: here to the overlay's file of that name."""
    outside = base / "outside"
    outside.mkdir()
    sentinel = outside / "sentinel.txt"
    sentinel.write_text("HOST SENTINEL\n")
    os.utime(sentinel, (1000, 2000))  # atime < mtime: a read would move atime (relatime)
    backing = base / "backing"
    backing.mkdir()
    (backing / "sentinel.txt").write_text("private view\n")
    os.symlink(str(sentinel), backing / "link")  # planted host-side (the overlay refuses to make one)
    mfd = detached_clone(backing)
    ws = open_root(backing)
    try:
        # The workspace is mounted at the sentinel's own directory path (under /tmp, mounted last).
        r = await run_confined(sh("cat link; echo overwritten > link"),
                               workspace=ws, workspace_host_path=str(backing), cwd="",
                               private_root=PrivateRoot(mfd, workspace_path=str(outside)))
    finally:
        ws.close()
        os.close(mfd)
    assert r.overlay
    assert r.stdout == b"private view\n"
    st = sentinel.stat()  # before this test reads it
    assert (st.st_atime_ns, st.st_mtime_ns) == (1000 * 10**9, 2000 * 10**9), "the host sentinel was touched"
    assert sentinel.read_bytes() == b"HOST SENTINEL\n"
    assert (backing / "sentinel.txt").read_text() == "overwritten\n"
    # Control: a read of the sentinel (the one just above) does move its atime.
    assert sentinel.stat().st_atime_ns != 1000 * 10**9


async def test_a_link_to_a_host_path_missing_from_the_private_root_finds_nothing(cloned_ws, base):
    backing, mfd, ws = cloned_ws
    secret = base / "secret.txt"
    secret.write_text("HOST SECRET\n")
    os.symlink(str(secret), backing / "to-secret")
    os.symlink("/root", backing / "to-root")
    r = await run_confined(sh("cat to-secret; ls to-root; echo gone > to-secret; echo rc=$?"), workspace=ws,
                           workspace_host_path=str(backing), private_root=PrivateRoot(mfd))
    assert b"HOST SECRET" not in r.stdout + r.stderr
    assert r.stdout.endswith(b"rc=2\n")
    assert secret.read_text() == "HOST SECRET\n"
    # Control: with the host's root, Landlock alone is what keeps the command out.
    control = await run_confined(sh("cat to-secret"), workspace=ws, workspace_host_path=str(backing),
                                 confinement="none")
    assert control.stdout == b"HOST SECRET\n"


async def test_landlock_stays_on_inside_the_private_root(tmpfs_ws, base):
    """The workspace rule is on the overlay's root (here a tmpfs, not the backing directory's inode)."""
    mfd, _overlay_root = tmpfs_ws
    ids = (0x6F00_3456, 0x6F00_3456)
    os.chown(f"/proc/self/fd/{mfd}", *ids)  # the identity owns the overlay root (only the backing is re-owned)
    (base / "backing").mkdir()
    ws = open_root(base / "backing")
    script = ("head -c4 /proc/1/status && echo; echo ok > /workspace/w && echo ws-written; "
              "echo renamed > /proc/self/comm && echo comm-written; true")
    try:
        r = await run_confined(sh(script), workspace=ws, workspace_host_path=str(base),
                               policy=ConfinementPolicy(identity=ids), private_root=PrivateRoot(mfd))
        control = await run_confined(sh(script), workspace=ws, workspace_host_path=str(base),
                                     policy=ConfinementPolicy(identity=ids), private_root=PrivateRoot(mfd),
                                     confinement="none")
    finally:
        ws.close()
    assert r.confinement == "landlock"
    # Landlock grants no other process's /proc entries; /proc is mounted read-only either way.
    assert r.stdout == b"ws-written\n", r.stderr
    assert control.stdout == b"Name\nws-written\n", control.stderr


async def test_grants_appear_at_their_host_paths_and_nothing_beside_them(tmpfs_ws, base):
    mfd, ws = tmpfs_ws
    ids = (0x6F00_2345, 0x6F00_2345)
    rw_dir, ro_dir, beside = base / "rw", base / "ro", base / "beside"
    for d in (rw_dir, ro_dir, beside):
        d.mkdir()
    os.chown(rw_dir, *ids)
    (ro_dir / "data.txt").write_text("read me\n")
    rw, ro = open_root(rw_dir), open_root(ro_dir, read_only=True)
    try:
        script = (f"echo w > {rw_dir}/made && echo rw-ok; cat {ro_dir}/data.txt; echo x > {ro_dir}/data.txt || "
                  f"echo ro-refused; [ -e {beside} ] && echo beside-seen; true")
        r = await run_confined(sh(script), workspace=ws, workspace_host_path=str(base), grants=[(rw, False), (ro, True)],
                               policy=ConfinementPolicy(identity=ids), private_root=PrivateRoot(mfd))
    finally:
        rw.close()
        ro.close()
    assert r.stdout == b"rw-ok\nread me\nro-refused\n", r.stderr
    assert (rw_dir / "made").read_text() == "w\n" and (rw_dir / "made").stat().st_uid == ids[0]
    assert (ro_dir / "data.txt").read_text() == "read me\n"


async def test_the_host_mount_table_is_left_alone(tmpfs_ws, base):
    mfd, ws = tmpfs_ws
    with open("/proc/self/mountinfo") as f:
        before = [line.split()[4] for line in f]
    await run_confined(sh("true"), workspace=ws, workspace_host_path=str(base), private_root=PrivateRoot(mfd),
                       check=True)
    with open("/proc/self/mountinfo") as f:
        after = [line.split()[4] for line in f]
    assert "/workspace" not in after and not any(p.startswith(str(base)) for p in after)
    assert [p for p in after if p not in before] == []


async def test_a_pty_command_gets_its_terminal_in_the_private_dev(tmpfs_ws, base):
    mfd, ws = tmpfs_ws
    sup = ProcessSupervisor()
    ptys = PtyManager(sup)
    try:
        pty_id, out = await ptys.pty_exec_start(
            sh("tty; [ -c $(tty) ] && echo has-pts; [ -c /dev/tty ] && echo has-tty; echo done"), workspace=ws,
            workspace_host_path=str(base), private_root=PrivateRoot(mfd), first_output_timeout_s=5)
        while b"done" not in out:
            more = await ptys.pty_read(pty_id, timeout_s=5)
            if not more:
                break
            out += more
    finally:
        await ptys.aclose()
        await sup.aclose()
    lines = out.decode().replace("\r", "").split("\n")
    assert lines[0].startswith("/dev/pts/"), out
    assert lines[1:3] == ["has-pts", "has-tty"], out


def test_private_root_paths_are_checked():
    assert PrivateRoot(3).workspace_path == "/workspace"
    assert PrivateRoot(3, "/tmp/ws").workspace_path == "/tmp/ws"
    for bad in ("/", "workspace", "/a/../b", "/a//b", "/proc", "/proc/x", "/dev/ws", "/usr/ws", "/etc", "/bin/x"):
        with pytest.raises(ExecError):
            PrivateRoot(3, bad)
    for fd in (-1, "3", True):
        with pytest.raises(ExecError):
            PrivateRoot(fd)  # type: ignore[arg-type]


def test_the_helper_refuses_paths_that_leave_the_new_root(tmpfs_ws):
    """Paths are placed beneath the new root only; the helper refuses any with '.' or '..'."""
    mfd, _ws = tmpfs_ws
    helper = sfs_exec.helper_path()
    cases = [["--workspace-path", "/a/../etc"], ["--workspace-path", "relative"], ["--workspace-path", "/"],
             ["--workspace-path", "/w", "--sys-link", "/x/../y=z"]]
    for extra in cases:
        r = subprocess.run([helper, "--private-root", str(mfd), *extra, "--", "true"], pass_fds=(mfd,),
                           capture_output=True, env={})
        assert r.returncode == 127, extra
        assert b"usage" in r.stderr, (extra, r.stderr)
    # Without --init the command has no PID namespace of its own: no private root (its /proc would be the host's).
    r = subprocess.run([helper, "--private-root", str(mfd), "--workspace-path", "/w", "--", "true"],
                       pass_fds=(mfd,), capture_output=True, env={})
    assert r.returncode == 127 and b"privroot" in r.stderr


def test_the_system_devices_are_the_landlock_set():
    """The private /dev binds exactly the devices the Landlock system set grants."""
    from sandbox_fs.exec import _landlock

    assert {os.path.basename(p) for p, _a in _landlock.SYSTEM_DEVICES} == DEV_NAMES - {
        "fd", "stdin", "stdout", "stderr"}
    assert all(stat.S_ISCHR(os.stat(p).st_mode) for p, _a in _landlock.SYSTEM_DEVICES)


_FUSE_MISSING = ("/dev/fuse is missing" if not os.path.exists("/dev/fuse")
                 else "pyfuse3 (the fuse extra) is not installed" if importlib.util.find_spec("pyfuse3") is None
                 else None)


@pytest.mark.skipif(_FUSE_MISSING is not None, reason=f"the FUSE overlay cannot run: {_FUSE_MISSING}")
async def test_the_real_overlay_as_the_private_roots_workspace(base):
    """The FUSE overlay itself: its mount at workspace_path, writes in the backing dir, a planted link kept inside."""
    from sandbox_fs.fuse import Overlay, OverlayPolicy

    outside = base / "outside"
    outside.mkdir()
    sentinel = outside / "sentinel.txt"
    sentinel.write_text("HOST SENTINEL\n")
    os.utime(sentinel, (1000, 2000))  # atime < mtime: a read would move atime (relatime)
    backing = base / "backing"
    backing.mkdir()
    (backing / "hello.txt").write_text("hello through FUSE\n")
    (backing / "sentinel.txt").write_text("private view\n")
    os.symlink(str(sentinel), backing / "link")  # planted host-side: the overlay refuses to make one
    backing_root = open_root(backing)
    ov = await Overlay.start(backing_root, policy=OverlayPolicy())
    try:
        script = (f"pwd; cat hello.txt; echo made > made.txt; cat link; [ -e {backing} ] && echo backing-seen; "
                  "[ -e /root ] && echo root-seen; true")
        r = await run_confined(sh(script), workspace=ov.root, workspace_host_path=str(backing),
                               private_root=PrivateRoot(ov.mount_fd, workspace_path=str(outside)), check=True)
        st = sentinel.stat()
        assert (st.st_atime_ns, st.st_mtime_ns) == (1000 * 10**9, 2000 * 10**9), "the host sentinel was touched"
        assert r.identity is not None and (backing / "made.txt").stat().st_uid == r.identity[0] != 0
        # Control (which gives the workspace back to uid 0): with the host's root (and no Landlock) the kernel follows the link to the host's file.
        control = await run_confined(sh("cat link"), workspace=ov.root, workspace_host_path=str(backing),
                                     confinement="none")
    finally:
        await ov.aclose()
        backing_root.close()
    assert r.overlay and r.confinement == "landlock"
    assert r.stdout.decode().splitlines() == [str(outside), "hello through FUSE", "private view"], r.stderr
    assert (backing / "made.txt").read_text() == "made\n"
    assert sentinel.read_text() == "HOST SENTINEL\n"
    assert control.stdout == b"HOST SENTINEL\n" and not control.overlay


def test_a_private_root_needs_a_root_host(monkeypatch, tmpfs_ws):
    from sandbox_fs.exec import ConfinementError
    from sandbox_fs.exec._models import ExecRequest

    _mfd, ws = tmpfs_ws
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ConfinementError, match="root host"):
        ExecRequest.build(["true"], workspace=ws, workspace_host_path="/w", grants=None, cwd="", env=None,
                          secret_env=(), shell=False, confinement="required", policy=ConfinementPolicy(),
                          private_root=PrivateRoot(3))
    with pytest.raises(ExecError, match="PrivateRoot"):
        ExecRequest.build(["true"], workspace=ws, workspace_host_path="/w", grants=None, cwd="", env=None,
                          secret_env=(), shell=False, confinement="required", policy=ConfinementPolicy(),
                          private_root=3)  # type: ignore[arg-type]


async def test_a_read_only_grant_nested_in_a_read_write_grant_and_a_cwd_in_a_grant(tmpfs_ws, base):
    """A PathPolicy: the cwd is a grant's directory at its host path; the nested read-only grant stays read-only."""
    mfd, ws = tmpfs_ws
    ids = (0x6F00_4567, 0x6F00_4567)
    outer = base / "outer"
    inner = outer / "mid" / "inner"
    inner.mkdir(parents=True)
    (inner / "data.txt").write_text("inner data\n")
    for d in (outer, outer / "mid"):
        os.chown(d, *ids)
    policy = PathPolicy(ws, "/workspace", [Grant(str(outer), read_only=False), Grant(str(inner), read_only=True)])
    try:
        script = ("pwd; echo w > made && echo outer-ok; cat mid/inner/data.txt; "
                  "echo x > mid/inner/data.txt || echo inner-refused; mv mid mid2 || echo pinned")
        r = await run_confined(sh(script), workspace=ws, workspace_host_path=str(base), grants=policy,
                               cwd=str(outer), policy=ConfinementPolicy(identity=ids),
                               private_root=PrivateRoot(mfd))
    finally:
        policy.close()
    assert r.stdout.decode().splitlines() == [str(outer), "outer-ok", "inner data", "inner-refused", "pinned"], r.stderr
    assert (outer / "made").read_text() == "w\n"
    assert (inner / "data.txt").read_text() == "inner data\n" and (outer / "mid").is_dir()


async def test_a_read_only_grant_inside_the_workspace_is_refused(cloned_ws):
    from sandbox_fs.exec import ConfinementError

    backing, mfd, ws = cloned_ws
    (backing / "ro").mkdir()
    ro = open_root(backing / "ro", read_only=True)
    try:
        with pytest.raises(ConfinementError, match="inside the workspace"):
            await run_confined(sh("true"), workspace=ws, workspace_host_path=str(backing), grants=[(ro, True)],
                               private_root=PrivateRoot(mfd))
    finally:
        ro.close()
