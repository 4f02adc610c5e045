"""The overlay daemon end to end: Overlay.start on a tmp workspace, requests through the detached mount.

Needs root, /dev/fuse and pyfuse3 (skipped with the reason otherwise).  The
daemon is another process, so blocking host-side calls on the mount are fine;
plain ``os.*(..., dir_fd=mount_fd)`` calls run in a worker thread anyway.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import signal
import stat

import pytest
import trio

from sandbox_fs import _native
from sandbox_fs.fuse import FaultRule, Overlay, OverlayError, OverlayPolicy
from sandbox_fs.fuse._quota import NAME_ENTRY_BYTES
from sandbox_fs.root import open_root

if not os.path.exists("/dev/fuse"):
    pytest.skip("the FUSE overlay needs /dev/fuse", allow_module_level=True)
if os.geteuid() != 0:
    pytest.skip("the FUSE overlay daemon needs root (fsopen needs CAP_SYS_ADMIN)", allow_module_level=True)
if importlib.util.find_spec("pyfuse3") is None:
    pytest.skip("the FUSE overlay needs pyfuse3 (the fuse extra)", allow_module_level=True)


@pytest.fixture
def ws_dir(tmp_path):
    d = tmp_path / "ws"
    d.mkdir()
    (d / "hello.txt").write_bytes(b"hello\n")
    (d / "sub").mkdir()
    (d / "sub" / "inner").write_bytes(b"x" * 100)
    return d


@pytest.fixture
async def overlay(ws_dir):
    ws = open_root(ws_dir)
    ov = await Overlay.start(ws, policy=OverlayPolicy())
    try:
        yield ov
    finally:
        await ov.aclose()
        ws.close()


def fuse_mounts(pid: int | str = "self") -> list[str]:
    with open(f"/proc/{pid}/mountinfo") as f:
        return [line for line in f if " - fuse" in line]


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "State:\tZ" not in f.read()
    except FileNotFoundError:
        return False


async def in_thread(fn, *args):
    return await trio.to_thread.run_sync(fn, *args)


async def test_start_reports_usage_and_serves_the_workspace(overlay):
    assert overlay.alive
    # file bytes, plus each name (hello.txt, sub, inner) at its length + NAME_ENTRY_BYTES
    assert overlay.initial_usage == {"bytes": 106 + 17 + 3 * NAME_ENTRY_BYTES, "inodes": 3}
    assert sorted(overlay.root.listdir(".")) == ["hello.txt", "sub"]
    assert overlay.root.read_bytes("hello.txt") == b"hello\n"
    st = overlay.root.stat("sub/inner")
    assert stat.S_ISREG(st.st_mode) and st.st_size == 100


async def test_basic_ops_through_root(overlay, ws_dir):
    r = overlay.root
    r.write_bytes("new.txt", b"abc")
    r.mkdir("d/e", parents=True)
    r.write_bytes("d/e/f", b"123456")
    r.rename("new.txt", "d/moved.txt")
    r.symlink("e/f", "d/link")
    r.link("d/e/f", "hard")
    r.chmod("hard", 0o600)
    r.utime("hard", ns=(1_000_000_000, 2_000_000_000))
    assert r.read_bytes("d/link") == b"123456"
    assert (ws_dir / "d" / "moved.txt").read_bytes() == b"abc"
    assert os.stat(ws_dir / "hard").st_ino == os.stat(ws_dir / "d" / "e" / "f").st_ino
    st = r.lstat("hard")
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_mtime_ns == 2_000_000_000 and st.st_nlink == 2
    r.remove("d/moved.txt")
    assert not (ws_dir / "d" / "moved.txt").exists()
    r.rmtree("d")
    assert sorted(os.listdir(ws_dir)) == ["hard", "hello.txt", "sub"]
    # the workspace's files and names as at start, plus "hard" (6 bytes) and its name
    assert await overlay.usage() == {"bytes": 106 + 17 + 3 * NAME_ENTRY_BYTES + 6 + 4 + NAME_ENTRY_BYTES,
                                     "inodes": 4}


def plain_os_ops(mfd: int) -> dict:
    out = {}
    fd = os.open("plain", os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o640, dir_fd=mfd)
    os.write(fd, b"0123456789")
    os.ftruncate(fd, 4)
    os.close(fd)
    fd = os.open("plain", os.O_WRONLY | os.O_APPEND, dir_fd=mfd)
    os.write(fd, b"++")
    os.close(fd)
    fd = os.open("plain", os.O_RDONLY, dir_fd=mfd)
    out["read"] = os.read(fd, 100)
    os.close(fd)
    os.mkdir("pd", 0o750, dir_fd=mfd)
    os.symlink("../plain", "pd/ln", dir_fd=mfd)
    out["readlink"] = os.readlink("pd/ln", dir_fd=mfd)
    os.rename("plain", "pd/plain2", src_dir_fd=mfd, dst_dir_fd=mfd)
    out["listdir"] = sorted(os.listdir(os.open("pd", os.O_RDONLY | os.O_DIRECTORY, dir_fd=mfd)))
    out["mode"] = stat.S_IMODE(os.stat("pd/plain2", dir_fd=mfd).st_mode)
    os.chmod("pd/plain2", 0o604, dir_fd=mfd)
    out["mode2"] = stat.S_IMODE(os.stat("pd/plain2", dir_fd=mfd).st_mode)
    os.unlink("pd/ln", dir_fd=mfd)
    try:
        os.stat("pd/ln", dir_fd=mfd, follow_symlinks=False)
    except FileNotFoundError:
        out["gone"] = True
    return out


async def test_basic_ops_through_plain_os_calls_on_the_mount_fd(overlay, ws_dir):
    out = await in_thread(plain_os_ops, overlay.mount_fd)
    assert out == {"read": b"0123++", "readlink": "../plain", "listdir": ["ln", "plain2"], "mode": 0o640,
                   "mode2": 0o604, "gone": True}
    assert (ws_dir / "pd" / "plain2").read_bytes() == b"0123++"


async def test_statfs_and_root_stat(overlay):
    sv = await in_thread(os.statvfs, f"/proc/self/fd/{overlay.mount_fd}")
    assert sv.f_bsize > 0 and sv.f_blocks > 0
    assert stat.S_ISDIR(os.fstat(overlay.mount_fd).st_mode)


async def test_fault_rule_fires_only_where_it_says_and_the_mount_survives(overlay):
    await overlay.set_faults([FaultRule(ops=frozenset({"open"}), path="sub", errno=errno.EIO)])
    with pytest.raises(OSError) as info:
        overlay.root.read_bytes("sub/inner")
    assert info.value.errno == errno.EIO
    assert overlay.root.read_bytes("hello.txt") == b"hello\n"
    await overlay.set_faults([])
    assert overlay.root.read_bytes("sub/inner") == b"x" * 100
    events, dropped = await overlay.audit_events()
    assert dropped == 0
    assert ("open", "sub/inner", errno.EIO) in [(e.op, e.path, e.errno) for e in events]
    assert overlay.alive


async def test_fault_rules_fire_by_path_while_the_audit_buffer_is_full(ws_dir):
    """The daemon skips deriving a request's path only when no rule and no audit room needs it."""
    ws = open_root(ws_dir)
    try:
        async with await Overlay.start(ws, policy=OverlayPolicy(audit_capacity=0)) as ov:
            assert ov.root.read_bytes("sub/inner") == b"x" * 100  # sub and inner known, nothing audited
            await ov.set_faults([FaultRule(ops=frozenset({"open", "lookup"}), path="sub", errno=errno.EIO)])
            with pytest.raises(OSError) as info:
                ov.root.read_bytes("sub/inner")
            assert info.value.errno == errno.EIO
            with pytest.raises(OSError) as info:
                ov.root.stat("sub/new")
            assert info.value.errno == errno.EIO
            assert ov.root.read_bytes("hello.txt") == b"hello\n"
            await ov.set_faults([])
            assert ov.root.read_bytes("sub/inner") == b"x" * 100
            events, dropped = await ov.audit_events()
            assert events == [] and dropped > 0
    finally:
        ws.close()


async def test_a_bad_request_gets_an_errno_and_the_mount_survives(overlay):
    # RENAME_WHITEOUT (4) is not supported by the overlay: EINVAL from the daemon, not a dead mount
    ret = await in_thread(_native.renameat2_raw, overlay.mount_fd, b"hello.txt", overlay.mount_fd, b"w", 4)
    assert ret == -errno.EINVAL
    assert overlay.root.read_bytes("hello.txt") == b"hello\n"
    assert overlay.alive


async def test_forget_releases_the_daemons_fds(overlay):
    for i in range(300):
        overlay.root.write_bytes(f"f{i}", b"")
    before = fd_count(overlay.pid)
    await overlay.invalidate(None)  # the kernel drops its dentries, then forgets the inodes
    for _ in range(100):
        if fd_count(overlay.pid) < before - 250:
            break
        await trio.sleep(0.05)
    assert fd_count(overlay.pid) < before - 250
    assert overlay.root.read_bytes("hello.txt") == b"hello\n"


async def test_invalidate_makes_a_backing_change_visible_at_once(overlay, ws_dir):
    assert overlay.root.read_bytes("hello.txt") == b"hello\n"
    assert overlay.root.stat("hello.txt").st_size == 6
    (ws_dir / "hello.txt").write_bytes(b"changed behind the mount\n")
    (ws_dir / "sub" / "inner").unlink()
    await overlay.invalidate(["hello.txt", "sub/inner"])
    assert overlay.root.stat("hello.txt").st_size == 25
    assert overlay.root.read_bytes("hello.txt") == b"changed behind the mount\n"
    assert not overlay.root.exists("sub/inner")


async def test_quota_refuses_a_write_past_the_limit(overlay):
    # names are charged (length + NAME_ENTRY_BYTES, also the write's temporary name): 100 bytes
    # of room once q (90 bytes) and its name are in, which q2's 50 bytes and name exceed
    limit = (await overlay.usage())["bytes"] + 90 + 1 + NAME_ENTRY_BYTES + 100
    await overlay.set_quota(limit, 10)
    overlay.root.write_bytes("q", b"a" * 90)
    with pytest.raises(OSError) as info:
        overlay.root.write_bytes("q2", b"b" * 50)
    assert info.value.errno == errno.EDQUOT
    usage = await overlay.usage()
    assert usage["bytes"] <= limit
    mfd = overlay.mount_fd

    def grow(name, size):
        fd = os.open(name, os.O_WRONLY, dir_fd=mfd)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)

    with pytest.raises(OSError) as info:
        await in_thread(grow, "q", 10_000)
    assert info.value.errno == errno.EDQUOT
    await in_thread(grow, "q", 10)  # shrinking is always allowed and gives the bytes back
    assert (await overlay.usage())["bytes"] == usage["bytes"] - 80
    await overlay.set_quota(None, usage["inodes"])
    with pytest.raises(OSError) as info:
        overlay.root.mkdir("one-too-many")
    assert info.value.errno == errno.EDQUOT
    await overlay.set_quota(None, None)
    overlay.root.mkdir("one-too-many")


async def test_a_large_write_is_split_into_1_mib_requests_and_returns_short_at_the_quota(overlay):
    """SECURITY.md's quota text: write requests are at most max_write = 1 MiB, each checked whole."""
    mib = 1 << 20
    mfd = overlay.mount_fd
    fd = await in_thread(lambda: os.open("big", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=mfd))
    try:
        await overlay.audit_events()
        # room for the name and 1.5 MiB: of one 3 MiB write(2), the first 1 MiB request fits, the next does not
        await overlay.set_quota((await overlay.usage())["bytes"] + mib + mib // 2, None)
        assert await in_thread(os.write, fd, b"q" * (3 * mib)) == mib
        with pytest.raises(OSError) as info:
            await in_thread(os.write, fd, b"q" * mib)
        assert info.value.errno == errno.EDQUOT
        await overlay.set_quota(None, None)
        assert await in_thread(os.write, fd, b"r" * (4 * mib)) == 4 * mib
    finally:
        await in_thread(os.close, fd)
    events, _ = await overlay.audit_events()
    writes = [e.errno for e in events if e.op == "write"]
    assert writes == [0, errno.EDQUOT, errno.EDQUOT, 0, 0, 0, 0]
    assert os.stat("big", dir_fd=mfd).st_size == 5 * mib


async def test_sigkill_of_the_daemon_leaves_nothing_and_a_new_overlay_starts(ws_dir):
    host_mounts = fuse_mounts()
    ws = open_root(ws_dir)
    try:
        ov = await Overlay.start(ws, policy=OverlayPolicy())
        try:
            assert ov.root.read_bytes("hello.txt") == b"hello\n"
            assert fuse_mounts(ov.pid) == fuse_mounts() == host_mounts
            os.kill(ov.pid, signal.SIGKILL)
            for _ in range(200):
                if not is_running(ov.pid):
                    break
                await trio.sleep(0.02)
            with pytest.raises(OSError):
                ov.root.read_bytes("sub/inner")
            with pytest.raises(OverlayError):
                await ov.usage()
            assert not ov.alive
        finally:
            await ov.aclose()
        assert ov.mount_fd == -1
        assert fuse_mounts() == host_mounts
        async with await Overlay.start(ws, policy=OverlayPolicy()) as ov2:
            assert ov2.root.read_bytes("hello.txt") == b"hello\n"
    finally:
        ws.close()


async def test_readdir_of_10k_entries_lists_each_once_and_counts_lookups(ws_dir):
    big = ws_dir / "big"
    big.mkdir()
    for i in range(10_000):
        (big / f"e{i:05d}").write_bytes(b"")
    ws = open_root(ws_dir)
    try:
        async with await Overlay.start(ws, policy=OverlayPolicy()) as ov:
            before = fd_count(ov.pid)
            names = await in_thread(ov.root.listdir, "big")
            # every name exactly once
            assert len(names) == len(set(names)) == 10_000
            assert sorted(names) == sorted(os.listdir(big))
            # what is guaranteed of fds: at most one per entry (readdirplus entries, lookups) plus a
            # few; the kernel may answer a batch with plain readdir under load, so no lower bound
            assert fd_count(ov.pid) <= before + 10_000 + 16
            await ov.invalidate(None)
            for _ in range(100):
                if fd_count(ov.pid) < before + 1_000:
                    break
                await trio.sleep(0.05)
            assert fd_count(ov.pid) < before + 1_000  # forget released them
    finally:
        ws.close()


async def test_rename_flags_and_hard_links(overlay, ws_dir):
    r = overlay.root
    r.write_bytes("a", b"A")
    r.write_bytes("b", b"B")
    mfd = overlay.mount_fd
    assert await in_thread(_native.renameat2_raw, mfd, b"a", mfd, b"b", _native.RENAME_NOREPLACE) == -errno.EEXIST
    assert await in_thread(_native.renameat2_raw, mfd, b"a", mfd, b"b", _native.RENAME_EXCHANGE) == 0
    assert r.read_bytes("a") == b"B" and r.read_bytes("b") == b"A"
    assert (ws_dir / "a").read_bytes() == b"B"
    r.link("a", "a2")
    r.rename("b", "a")  # over a name of a two-link inode: the other link keeps it
    assert r.read_bytes("a") == b"A" and r.read_bytes("a2") == b"B"
    assert r.lstat("a2").st_nlink == 1


async def test_unlinked_open_file_keeps_its_quota_until_the_last_release(overlay):
    base = (await overlay.usage())["bytes"]

    def scenario(mfd):
        fd = os.open("big", os.O_CREAT | os.O_RDWR, 0o644, dir_fd=mfd)
        os.write(fd, b"z" * 5000)
        os.unlink("big", dir_fd=mfd)
        return fd

    fd = await in_thread(scenario, overlay.mount_fd)
    try:
        assert (await overlay.usage())["bytes"] == base + 5000
        assert os.pread(fd, 4, 0) == b"zzzz"
    finally:
        await in_thread(os.close, fd)
    for _ in range(50):
        if (await overlay.usage())["bytes"] == base:
            break
        await trio.sleep(0.02)
    assert (await overlay.usage())["bytes"] == base


async def test_policy_refusals_through_the_mount(overlay, ws_dir):
    mfd = overlay.mount_fd

    def attempt(fn, *args, **kw):
        try:
            fn(*args, **kw)
        except OSError as e:
            return e.errno
        return 0

    assert await in_thread(lambda: attempt(os.mkfifo, "fifo", dir_fd=mfd)) == errno.EPERM
    assert await in_thread(lambda: attempt(os.symlink, "/etc/hostname", "abs", dir_fd=mfd)) == errno.EPERM
    assert await in_thread(lambda: attempt(os.symlink, "../../x", "sub/up", dir_fd=mfd)) == errno.EPERM
    assert await in_thread(lambda: attempt(os.chmod, "hello.txt", 0o4755, dir_fd=mfd)) == errno.EPERM
    # mkdir(2) ignores S_ISGID in its mode; one inherited from a set-group-ID parent is removed
    os.chmod(ws_dir / "sub", 0o2755)
    assert await in_thread(lambda: attempt(os.mkdir, "sub/sg", 0o2755, dir_fd=mfd)) == 0
    assert stat.S_IMODE((ws_dir / "sub" / "sg").stat().st_mode) == 0o755
    assert await in_thread(lambda: attempt(os.symlink, "../hello.txt", "sub/ok", dir_fd=mfd)) == 0
    assert not (ws_dir / "fifo").exists() and not (ws_dir / "abs").is_symlink()
    assert stat.S_IMODE((ws_dir / "hello.txt").stat().st_mode) & 0o7000 == 0


async def test_read_only_policy_gives_erofs(ws_dir):
    ws = open_root(ws_dir)
    try:
        async with await Overlay.start(ws, policy=OverlayPolicy(read_only=True)) as ov:
            assert ov.root.read_bytes("hello.txt") == b"hello\n"
            for fn, args in ((os.mkdir, ("d",)), (os.unlink, ("hello.txt",)),
                             (os.open, ("hello.txt", os.O_WRONLY))):
                with pytest.raises(OSError) as info:
                    await in_thread(lambda: fn(*args, dir_fd=ov.mount_fd))
                assert info.value.errno == errno.EROFS
    finally:
        ws.close()
    assert sorted(os.listdir(ws_dir)) == ["hello.txt", "sub"]


async def test_a_read_only_host_mount_is_served_at_its_path(ws_dir, tmp_path):
    host = tmp_path / "host"
    host.mkdir()
    (host / "data").write_bytes(b"from the host")
    (ws_dir / "sub" / "mnt").mkdir()  # the placeholder
    ws, hroot = open_root(ws_dir), open_root(host)
    try:
        from sandbox_fs.fuse import OverlayMount
        async with await Overlay.start(ws, policy=OverlayPolicy(),
                                       mounts=[OverlayMount("sub/mnt", hroot, read_only=True)]) as ov:
            assert ov.root.read_bytes("sub/mnt/data") == b"from the host"
            assert "mnt" in ov.root.listdir("sub")
            with pytest.raises(OSError) as info:
                ov.root.write_bytes("sub/mnt/new", b"x")
            assert info.value.errno == errno.EROFS
            with pytest.raises(OSError) as info:  # a hard link out of the read-only tree
                ov.root.link("sub/mnt/data", "stolen")
            assert info.value.errno in (errno.EXDEV, errno.EROFS)
            with pytest.raises(OSError) as info:
                ov.root.rmdir("sub/mnt")
            assert info.value.errno in (errno.EBUSY, errno.EROFS)
            # shared tree: a host-side change shows once its short timeout expired
            (host / "data").write_bytes(b"changed on the host")
            await ov.invalidate(["sub/mnt/data"])
            assert ov.root.read_bytes("sub/mnt/data") == b"changed on the host"
            events, _ = await ov.audit_events()
            assert ("open", "sub/mnt/data", 0) in [(e.op, e.path, e.errno) for e in events]
    finally:
        ws.close()
        hroot.close()
    assert sorted(os.listdir(host)) == ["data"]


async def test_creates_belong_to_the_requesting_uid(overlay, ws_dir):
    (ws_dir / "open").mkdir(mode=0o777)
    os.chmod(ws_dir / "open", 0o777)
    code = ("import os,sys; m=int(sys.argv[1]); fd=os.open('open/mine', os.O_CREAT|os.O_WRONLY, 0o644, dir_fd=m);"
            "os.close(fd); os.mkdir('open/dir', dir_fd=m)")
    import sys
    proc = await trio.run_process(
        ["setpriv", "--reuid=4242", "--regid=4242", "--clear-groups", sys.executable, "-c", code,
         str(overlay.mount_fd)], pass_fds=(overlay.mount_fd,), check=False)
    assert proc.returncode == 0
    for name in ("mine", "dir"):
        st = (ws_dir / "open" / name).lstat()
        assert (st.st_uid, st.st_gid) == (4242, 4242)


async def test_sigkill_of_the_host_ends_the_daemon(ws_dir):
    import sys
    code = ("import sys, os, trio\n"
            "from sandbox_fs.root import open_root\n"
            "from sandbox_fs.fuse import Overlay, OverlayPolicy\n"
            "async def main():\n"
            "    ov = await Overlay.start(open_root(sys.argv[1]), policy=OverlayPolicy())\n"
            "    print(ov.pid, flush=True)\n"
            "    await trio.sleep(600)\n"
            "trio.run(main)\n")
    async with trio.open_nursery() as nursery:
        proc = await nursery.start(lambda task_status: trio.run_process(
            [sys.executable, "-c", code, str(ws_dir)], stdout=-1, check=False, task_status=task_status))
        line = b""
        while not line.endswith(b"\n"):
            chunk = await proc.stdout.receive_some(100)
            assert chunk, "the host exited early"
            line += chunk
        daemon_pid = int(line)
        proc.kill()
    try:
        for _ in range(250):
            if not is_running(daemon_pid):
                break
            await trio.sleep(0.02)
        assert not is_running(daemon_pid)
    finally:
        if is_running(daemon_pid):
            os.kill(daemon_pid, signal.SIGKILL)


async def test_special_files_allowed_by_the_policy(ws_dir):
    ws = open_root(ws_dir)
    try:
        async with await Overlay.start(ws, policy=OverlayPolicy(allow_special=frozenset({"fifo"}))) as ov:
            await in_thread(lambda: os.mkfifo("fifo", 0o600, dir_fd=ov.mount_fd))
            with pytest.raises(OSError) as info:
                await in_thread(lambda: os.mknod("null", 0o600 | stat.S_IFCHR, os.makedev(1, 3), dir_fd=ov.mount_fd))
            assert info.value.errno == errno.EPERM
    finally:
        ws.close()
    assert stat.S_ISFIFO((ws_dir / "fifo").lstat().st_mode)
    assert not (ws_dir / "null").exists()


def posix_script(d: int) -> list:
    """The same operations on directory fd ``d``; each step's result or errno, in order."""
    out: list = []

    def step(fn, *args, **kw):
        try:
            r = fn(*args, **kw)
        except OSError as e:
            out.append(("err", errno.errorcode[e.errno]))
            return None
        out.append(("ok", r if isinstance(r, (bytes, str, int, list, tuple, type(None))) else None))
        return r

    def rd(name):
        fd = os.open(name, os.O_RDONLY, dir_fd=d)
        try:
            return os.read(fd, 1 << 16)
        finally:
            os.close(fd)

    def wr(name, data, flags=os.O_WRONLY | os.O_CREAT | os.O_TRUNC):
        fd = os.open(name, flags, 0o644, dir_fd=d)
        try:
            return os.write(fd, data)
        finally:
            os.close(fd)

    def trunc(name, size):
        fd = os.open(name, os.O_WRONLY, dir_fd=d)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)

    def lst(name="."):
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=d)
        try:
            return sorted(os.listdir(fd))
        finally:
            os.close(fd)

    def mode(name):
        st = os.stat(name, dir_fd=d, follow_symlinks=False)
        return (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_size, st.st_nlink)

    step(wr, "f", b"hello")
    step(wr, "f", b" world", os.O_WRONLY | os.O_APPEND)
    step(rd, "f")
    step(wr, "f", b"x", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    step(trunc, "f", 3)
    step(rd, "f")
    step(mode, "f")
    step(wr, "g", b"G")
    step(os.rename, "g", "f", src_dir_fd=d, dst_dir_fd=d)
    step(rd, "f")
    step(wr, "g", b"again")
    step(_native.renameat2_raw, d, b"g", d, b"f", _native.RENAME_NOREPLACE)
    step(_native.renameat2_raw, d, b"g", d, b"f", _native.RENAME_EXCHANGE)
    step(rd, "f")
    step(rd, "g")
    step(os.mkdir, "dir", 0o750, dir_fd=d)
    step(os.mkdir, "dir", dir_fd=d)
    step(wr, "dir/inner", b"i")
    step(os.rmdir, "dir", dir_fd=d)
    step(os.unlink, "dir", dir_fd=d)
    step(os.rmdir, "f", dir_fd=d)
    step(os.rename, "dir", "dir/sub", src_dir_fd=d, dst_dir_fd=d)
    step(os.open, "missing", os.O_RDONLY, dir_fd=d)
    step(os.symlink, "f", "ln", dir_fd=d)
    step(os.readlink, "ln", dir_fd=d)
    step(rd, "ln")
    step(os.open, "ln", os.O_RDONLY | os.O_NOFOLLOW, dir_fd=d)
    step(os.link, "f", "hard", src_dir_fd=d, dst_dir_fd=d)
    step(mode, "f")
    step(os.chmod, "f", 0o600, dir_fd=d)
    step(mode, "hard")
    step(os.utime, "f", ns=(5_000_000_000, 6_000_000_000), dir_fd=d)
    step(lambda: os.stat("hard", dir_fd=d).st_mtime_ns)
    fd = os.open("hard", os.O_RDONLY, dir_fd=d)
    step(os.unlink, "hard", dir_fd=d)
    step(os.unlink, "f", dir_fd=d)
    step(os.pread, fd, 100, 0)
    step(lambda: os.fstat(fd).st_nlink)
    os.close(fd)
    step(os.rename, "dir", "dir2", src_dir_fd=d, dst_dir_fd=d)
    step(rd, "dir2/inner")
    step(lst)
    step(lst, "dir2")
    step(os.unlink, "dir2/inner", dir_fd=d)
    step(os.rmdir, "dir2", dir_fd=d)
    step(lst)
    return out


async def test_posix_behaviour_matches_a_plain_directory(overlay, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    overlay.root.mkdir("cmp")
    pfd = os.open(plain, os.O_RDONLY | os.O_DIRECTORY)
    mfd = os.open("cmp", os.O_RDONLY | os.O_DIRECTORY, dir_fd=overlay.mount_fd)
    try:
        expected = await in_thread(posix_script, pfd)
        got = await in_thread(posix_script, mfd)
        assert ("err", "ENOTEMPTY") in expected and ("err", "EEXIST") in expected  # the script does fail steps
    finally:
        os.close(pfd)
        await in_thread(os.close, mfd)
    assert got == expected


async def test_no_mount_privilege_is_overlay_unavailable(ws_dir):
    import sys
    code = ("import sys, trio\n"
            "from sandbox_fs.root import open_root\n"
            "from sandbox_fs.fuse import Overlay, OverlayPolicy, OverlayUnavailableError\n"
            "async def main():\n"
            "    try:\n"
            "        ov = await Overlay.start(open_root(sys.argv[1]), policy=OverlayPolicy())\n"
            "    except OverlayUnavailableError as e:\n"
            "        print(e.code, e.context.get('errno'))\n"
            "    else:\n"
            "        await ov.aclose()\n"
            "        print('mounted')\n"
            "trio.run(main)\n")
    proc = await trio.run_process(
        ["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin", sys.executable, "-c", code, str(ws_dir)],
        capture_stdout=True, check=False)
    assert proc.returncode == 0
    assert proc.stdout.decode().split() == ["overlay_unavailable", str(errno.EPERM)]


async def test_invalidating_everything_while_requests_run_neither_deadlocks_nor_breaks(overlay):
    stop = False

    def churn(worker: int) -> int:
        mfd, n = overlay.mount_fd, 0
        os.mkdir(f"w{worker}", dir_fd=mfd)
        while not stop:
            name = f"w{worker}/f{n % 50}"
            fd = os.open(name, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o644, dir_fd=mfd)
            os.write(fd, b"data")
            os.close(fd)
            os.stat(name, dir_fd=mfd)
            dfd = os.open(f"w{worker}", os.O_RDONLY | os.O_DIRECTORY, dir_fd=mfd)
            os.listdir(dfd)
            os.close(dfd)
            if n % 7 == 0:
                os.unlink(name, dir_fd=mfd)
            n += 1
        return n

    counts: list[int] = []

    async def run(worker: int) -> None:
        counts.append(await trio.to_thread.run_sync(churn, worker))

    with trio.fail_after(300):  # a guard against a deadlock, not a speed check
        async with trio.open_nursery() as nursery:
            for w in range(3):
                nursery.start_soon(run, w)
            for _ in range(30):
                await overlay.invalidate(None)
                await overlay.invalidate(["w0", "w1/f3", "w2"])
            stop = True
    assert len(counts) == 3 and all(c > 0 for c in counts)
    assert overlay.alive
    assert overlay.root.read_bytes("hello.txt") == b"hello\n"
