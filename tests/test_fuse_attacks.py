"""Attacks through the overlay's mount: each test checks an outside sentinel, not only an errno.

The ``layout`` fixture (conftest) gives ``ws/`` (the workspace the overlay
serves) beside ``outside/`` (a sentinel tree with a secret); a test that
also serves a host directory through an :class:`OverlayMount` keeps its own
sentinel (``granted/``).  The attacker acts through the detached mount
(``os.*(..., dir_fd=overlay.mount_fd)``, in a worker thread); the host acts
on the backing directory and then invalidates, as a host-side restore would.

Needs root, /dev/fuse and pyfuse3 (skipped with the reason otherwise).
"""

from __future__ import annotations

import ctypes
import errno
import importlib.util
import os
import socket
import stat
import threading
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from sandbox_fs import _native
from sandbox_fs.fuse import Overlay, OverlayMount, OverlayPolicy
from sandbox_fs.fuse._quota import Quota
from sandbox_fs.root import open_root

from tests.conftest import tree_digest

if not os.path.exists("/dev/fuse"):
    pytest.skip("the FUSE overlay needs /dev/fuse", allow_module_level=True)
if os.geteuid() != 0:
    pytest.skip("the FUSE overlay daemon needs root (fsopen needs CAP_SYS_ADMIN)", allow_module_level=True)
if importlib.util.find_spec("pyfuse3") is None:
    pytest.skip("the FUSE overlay needs pyfuse3 (the fuse extra)", allow_module_level=True)

AT_EMPTY_PATH = 0x1000
AT_SYMLINK_FOLLOW = 0x400


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    return await trio.to_thread.run_sync(fn, *args)


def errno_of(fn: Callable[..., Any], *args: Any, **kw: Any) -> int:
    """0 if ``fn(*args, **kw)`` succeeded, else its errno (the fd it returned, if any, is closed)."""
    try:
        ret = fn(*args, **kw)
    except OSError as exc:
        return exc.errno or -1
    if fn is os.open and isinstance(ret, int):
        os.close(ret)
    return 0


@asynccontextmanager
async def mounted(ws_dir: Path, policy: OverlayPolicy | None = None,
                  mounts: Sequence[tuple[str, Path, bool]] = ()):
    """An overlay on ``ws_dir`` (plus host directories ``(path, dir, read_only)``), always closed after."""
    ws = open_root(ws_dir)
    roots = [open_root(d) for _, d, _ in mounts]
    try:
        ov = await Overlay.start(ws, policy=policy or OverlayPolicy(),
                                 mounts=[OverlayMount(p, r, read_only=ro)
                                         for (p, _, ro), r in zip(mounts, roots)])
        try:
            yield ov
        finally:
            await ov.aclose()
    finally:
        ws.close()
        for r in roots:
            r.close()


def libc_linkat(olddirfd: int, old: bytes, newdirfd: int, new: bytes, flags: int) -> int:
    """linkat(2) with flags Python's os.link cannot pass (AT_EMPTY_PATH); 0 or the errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    ret = libc.linkat(olddirfd, old, newdirfd, new, flags)
    return 0 if ret == 0 else ctypes.get_errno()


# ---------------------------------------------------------------- symlinks


@pytest.mark.parametrize("target", [
    "/etc/hostname",
    "ABS",                       # replaced by the absolute path of the outside secret
    "..",
    "../outside/secret.txt",
    "sub/../../outside",
    "sub/../../../../../../etc/passwd",
    "./../outside",
])
async def test_symlink_out_of_the_workspace_is_refused_at_creation(layout, target):
    if target == "ABS":
        target = str(layout.outside / "secret.txt")
    (layout.ws / "sub").mkdir()
    before = layout.snapshot()
    async with mounted(layout.ws) as ov:
        mfd = ov.mount_fd
        assert await in_thread(lambda: errno_of(os.symlink, target, "evil", dir_fd=mfd)) == errno.EPERM
        # One level down, the same escape needs one more "..".
        deeper = target if target.startswith("/") else "../" + target
        assert await in_thread(lambda: errno_of(os.symlink, deeper, "sub/evil", dir_fd=mfd)) == errno.EPERM
        # Then the attacker writes where the link would have led: no link, so a plain file in the workspace.
        def write_through() -> None:
            fd = os.open("evil", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=mfd)
            os.write(fd, b"pwned")
            os.close(fd)
        await in_thread(write_through)
        assert ov.alive
    assert not (layout.ws / "sub" / "evil").is_symlink() and not (layout.ws / "sub" / "evil").exists()
    assert not (layout.ws / "evil").is_symlink()
    layout.assert_outside_unchanged(before)


async def test_symlink_inside_the_workspace_is_allowed(layout):
    """The control: the same mechanism lets an inner link through, so the refusals above can fail."""
    (layout.ws / "sub").mkdir()
    async with mounted(layout.ws) as ov:
        mfd = ov.mount_fd
        assert await in_thread(lambda: errno_of(os.symlink, "../x", "sub/up", dir_fd=mfd)) == 0
        assert await in_thread(lambda: errno_of(os.symlink, "sub", "s", dir_fd=mfd)) == 0
    assert os.readlink(layout.ws / "sub" / "up") == "../x"


async def test_a_host_planted_link_to_the_outside_is_not_a_door_for_links_or_renames(layout):
    """A link planted host-side in the workspace (the overlay would refuse to create it): hard links
    and renames through it end at the mount's edge (EXDEV), never in the outside tree."""
    os.symlink(layout.outside, layout.ws / "out")                   # absolute, to the outside dir
    os.symlink(layout.outside / "secret.txt", layout.ws / "sec")    # absolute, to the secret
    os.symlink("../outside", layout.ws / "rel")                     # relative: leaves the workspace
    (layout.ws / "mine").write_bytes(b"mine")
    before = layout.snapshot()
    nlink = (layout.outside / "secret.txt").stat().st_nlink
    async with mounted(layout.ws) as ov:
        mfd = ov.mount_fd

        def attacks() -> dict[str, int]:
            return {
                "link out/secret": errno_of(os.link, "out/secret.txt", "stolen", src_dir_fd=mfd, dst_dir_fd=mfd),
                "link sec follow": libc_linkat(mfd, b"sec", mfd, b"stolen2", AT_SYMLINK_FOLLOW),
                "link into out": errno_of(os.link, "mine", "out/planted", src_dir_fd=mfd, dst_dir_fd=mfd),
                "rename into out": errno_of(os.rename, "mine", "out/moved", src_dir_fd=mfd, dst_dir_fd=mfd),
                "rename out of out": errno_of(os.rename, "out/sentinel.txt", "got", src_dir_fd=mfd,
                                              dst_dir_fd=mfd),
                "rename via rel": errno_of(os.rename, "mine", "rel/moved", src_dir_fd=mfd, dst_dir_fd=mfd),
                "link via rel": errno_of(os.link, "rel/secret.txt", "stolen3", src_dir_fd=mfd, dst_dir_fd=mfd),
            }

        got = await in_thread(attacks)
        assert ov.alive
    assert got["link out/secret"] == errno.EXDEV
    assert got["link sec follow"] == errno.EXDEV
    assert got["link into out"] == errno.EXDEV
    assert got["rename into out"] == errno.EXDEV
    assert got["rename out of out"] == errno.EXDEV
    # "../outside" seen from the root of a detached mount is the mount's own root: nothing there.
    assert got["rename via rel"] == errno.ENOENT
    assert got["link via rel"] == errno.ENOENT
    layout.assert_outside_unchanged(before)
    assert (layout.outside / "secret.txt").stat().st_nlink == nlink
    assert sorted(os.listdir(layout.ws)) == ["mine", "out", "rel", "sec"]


# ---------------------------------------------------------------- set-id bits, special files


async def test_set_id_bits_are_never_set(layout):
    (layout.ws / "f").write_bytes(b"#!/bin/sh\n")
    os.chmod(layout.ws / "f", 0o755)
    (layout.ws / "sgid").mkdir()
    os.chmod(layout.ws / "sgid", 0o2775)                            # planted host-side
    os.symlink("f", layout.ws / "lf")
    before = layout.snapshot()
    async with mounted(layout.ws) as ov:
        mfd = ov.mount_fd

        def attacks() -> dict[str, int]:
            out = {}
            for bits in (stat.S_ISUID, stat.S_ISGID, stat.S_ISUID | stat.S_ISGID):
                out[f"chmod {bits:o}"] = errno_of(os.chmod, "f", 0o755 | bits, dir_fd=mfd)
                out[f"chmod link {bits:o}"] = errno_of(os.chmod, "lf", 0o755 | bits, dir_fd=mfd)
                out[f"create {bits:o}"] = errno_of(os.open, f"c{bits:o}", os.O_WRONLY | os.O_CREAT, 0o755 | bits,
                                                   dir_fd=mfd)
                out[f"mknod {bits:o}"] = errno_of(os.mknod, f"n{bits:o}", stat.S_IFREG | 0o755 | bits, dir_fd=mfd)
                out[f"mkdir {bits:o}"] = errno_of(os.mkdir, f"d{bits:o}", 0o755 | bits, dir_fd=mfd)
                out[f"mkdir in sgid {bits:o}"] = errno_of(os.mkdir, f"sgid/d{bits:o}", 0o755 | bits, dir_fd=mfd)
            fd = os.open("f", os.O_RDONLY, dir_fd=mfd)
            try:
                out["fchmod"] = errno_of(os.fchmod, fd, 0o4755)
            finally:
                os.close(fd)
            return out

        got = await in_thread(attacks)
        assert ov.alive
    for bits in ("4000", "2000", "6000"):
        assert got[f"chmod {bits}"] == errno.EPERM
        assert got[f"chmod link {bits}"] == errno.EPERM
        assert got[f"create {bits}"] == errno.EPERM
        assert got[f"mknod {bits}"] == errno.EPERM
        # mkdir(2) drops S_ISUID/S_ISGID from its mode in the VFS, before the daemon sees it:
        # refused or stripped, never set (checked on the backing dir below).
        assert got[f"mkdir {bits}"] in (0, errno.EPERM)
        assert got[f"mkdir in sgid {bits}"] in (0, errno.EPERM)
    assert got["fchmod"] == errno.EPERM
    for dirpath, dirnames, filenames in os.walk(layout.ws):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            mode = p.lstat().st_mode
            if p != layout.ws / "sgid" and not stat.S_ISLNK(mode):
                assert mode & (stat.S_ISUID | stat.S_ISGID) == 0, (p, oct(mode))
    assert stat.S_IMODE((layout.ws / "f").stat().st_mode) == 0o755
    layout.assert_outside_unchanged(before)


async def test_the_mount_is_nosuid_and_nodev(layout):
    """A set-id file or a device node planted host-side gives nothing when used through the mount."""
    (layout.ws / "suid").write_bytes(b"x")
    os.chmod(layout.ws / "suid", 0o4755)
    async with mounted(layout.ws) as ov:
        st = await in_thread(os.statvfs, ov.mount_fd)
        seen = await in_thread(lambda: os.stat("suid", dir_fd=ov.mount_fd).st_mode)
    assert st.f_flag & os.ST_NOSUID
    assert st.f_flag & os.ST_NODEV
    assert seen & stat.S_ISUID          # the bit is shown as it is, and ignored by exec on this mount


def _bind_unix(mount_fd: int, name: str) -> int:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # The mount is attached nowhere: reach it by its fd's magic link (a test-only convenience).
        s.bind(f"/proc/self/fd/{mount_fd}/{name}")
    except OSError as exc:
        return exc.errno or -1
    finally:
        s.close()
    return 0


async def test_device_nodes_fifos_and_sockets_are_refused_by_default(layout):
    before = layout.snapshot()
    async with mounted(layout.ws) as ov:
        mfd = ov.mount_fd

        def attacks() -> dict[str, int]:
            return {
                "chr": errno_of(os.mknod, "null", stat.S_IFCHR | 0o666, os.makedev(1, 3), dir_fd=mfd),
                "blk": errno_of(os.mknod, "disk", stat.S_IFBLK | 0o660, os.makedev(7, 0), dir_fd=mfd),
                "fifo": errno_of(os.mkfifo, "fifo", 0o644, dir_fd=mfd),
                "sock-mknod": errno_of(os.mknod, "sock", stat.S_IFSOCK | 0o644, dir_fd=mfd),
                "sock-bind": _bind_unix(mfd, "bound"),
            }

        got = await in_thread(attacks)
        assert ov.alive
    assert got == {"chr": errno.EPERM, "blk": errno.EPERM, "fifo": errno.EPERM, "sock-mknod": errno.EPERM,
                   "sock-bind": errno.EPERM}
    assert os.listdir(layout.ws) == []
    layout.assert_outside_unchanged(before)


async def test_allowed_special_kinds_are_created_and_only_those(layout):
    """The control for the refusals: the policy, not something else, refuses them."""
    async with mounted(layout.ws, OverlayPolicy(allow_special=frozenset({"fifo", "socket"}))) as ov:
        mfd = ov.mount_fd
        fifo = await in_thread(lambda: errno_of(os.mkfifo, "fifo", 0o644, dir_fd=mfd))
        sock = await in_thread(_bind_unix, mfd, "bound")
        chr_ = await in_thread(lambda: errno_of(os.mknod, "null", stat.S_IFCHR | 0o666, os.makedev(1, 3),
                                                dir_fd=mfd))
    assert (fifo, sock, chr_) == (0, 0, errno.EPERM)
    assert stat.S_ISFIFO((layout.ws / "fifo").lstat().st_mode)
    assert stat.S_ISSOCK((layout.ws / "bound").lstat().st_mode)
    assert not (layout.ws / "null").exists()


# ---------------------------------------------------------------- read-only mounts


@pytest.fixture
def granted(tmp_path):
    """A host directory served read-only at ``ro/`` (its own sentinel); ``ws/ro`` is the placeholder."""
    g = tmp_path / "granted"
    g.mkdir()
    (g / "file").write_bytes(b"granted content\n")
    (g / "dir").mkdir()
    (g / "dir" / "inner").write_bytes(b"inner\n")
    os.utime(g / "file", ns=(10**18, 10**18))
    return g


async def test_a_read_only_mount_is_not_written_through_a_link_or_a_rename(layout, granted):
    (layout.ws / "ro").mkdir()
    (layout.ws / "mine").write_bytes(b"mine\n")
    os.link(granted / "file", layout.ws / "alias")    # a host-side hard link: the same inode, workspace name
    before_out, before_granted = layout.snapshot(), tree_digest(granted)
    async with mounted(layout.ws, mounts=[("ro", granted, True)]) as ov:
        mfd = ov.mount_fd

        def attacks() -> dict[str, int]:
            os.stat("alias", dir_fd=mfd)                # the workspace name is known to the daemon first
            return {
                "link out of ro": errno_of(os.link, "ro/file", "stolen", src_dir_fd=mfd, dst_dir_fd=mfd),
                "link into ro": errno_of(os.link, "mine", "ro/planted", src_dir_fd=mfd, dst_dir_fd=mfd),
                "rename out of ro": errno_of(os.rename, "ro/file", "moved", src_dir_fd=mfd, dst_dir_fd=mfd),
                "rename into ro": errno_of(os.rename, "mine", "ro/file", src_dir_fd=mfd, dst_dir_fd=mfd),
                "rename dir out": errno_of(os.rename, "ro/dir", "d", src_dir_fd=mfd, dst_dir_fd=mfd),
                "exchange": _native.renameat2_raw(mfd, b"mine", mfd, b"ro/file", _native.RENAME_EXCHANGE),
                "noreplace": _native.renameat2_raw(mfd, b"mine", mfd, b"ro/new", _native.RENAME_NOREPLACE),
                "rename the mount": errno_of(os.rename, "ro", "ro2", src_dir_fd=mfd, dst_dir_fd=mfd),
                "write ro/file": errno_of(os.open, "ro/file", os.O_WRONLY, dir_fd=mfd),
                "rdwr ro/file": errno_of(os.open, "ro/file", os.O_RDWR, dir_fd=mfd),
                "trunc ro/file": errno_of(os.open, "ro/file", os.O_RDONLY | os.O_TRUNC, dir_fd=mfd),
                "append ro/file": errno_of(os.open, "ro/file", os.O_WRONLY | os.O_APPEND, dir_fd=mfd),
                "chmod ro/file": errno_of(os.chmod, "ro/file", 0o777, dir_fd=mfd),
                "utime ro/file": errno_of(os.utime, "ro/file", ns=(1, 1), dir_fd=mfd),
                "unlink ro/file": errno_of(os.unlink, "ro/file", dir_fd=mfd),
                "create in ro": errno_of(os.open, "ro/dir/new", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=mfd),
                "mkdir in ro": errno_of(os.mkdir, "ro/dir/sub", dir_fd=mfd),
                "symlink in ro": errno_of(os.symlink, "file", "ro/l", dir_fd=mfd),
            }

        got = await in_thread(attacks)
        ro_content = await in_thread(lambda: ov.root.read_bytes("ro/file"))
        assert ov.alive
    assert ro_content == b"granted content\n"
    for what, err in got.items():
        err = -err if err < 0 else err
        assert err in (errno.EROFS, errno.EXDEV, errno.EBUSY), (what, errno.errorcode.get(err, err))
    assert tree_digest(granted) == before_granted
    layout.assert_outside_unchanged(before_out)
    assert sorted(os.listdir(layout.ws)) == ["alias", "mine", "ro"]
    assert os.listdir(layout.ws / "ro") == []
    assert (layout.ws / "mine").read_bytes() == b"mine\n"


async def test_a_writable_mount_is_another_tree_renames_and_links_across_give_exdev(layout, granted):
    (layout.ws / "rw").mkdir()
    (layout.ws / "mine").write_bytes(b"mine\n")
    before_granted = tree_digest(granted)
    async with mounted(layout.ws, mounts=[("rw", granted, False)]) as ov:
        mfd = ov.mount_fd

        def attacks() -> dict[str, int]:
            return {
                "link out": errno_of(os.link, "rw/file", "stolen", src_dir_fd=mfd, dst_dir_fd=mfd),
                "link in": errno_of(os.link, "mine", "rw/planted", src_dir_fd=mfd, dst_dir_fd=mfd),
                "rename out": errno_of(os.rename, "rw/file", "moved", src_dir_fd=mfd, dst_dir_fd=mfd),
                "rename in": errno_of(os.rename, "mine", "rw/moved", src_dir_fd=mfd, dst_dir_fd=mfd),
                "exchange": -_native.renameat2_raw(mfd, b"mine", mfd, b"rw/file", _native.RENAME_EXCHANGE),
            }

        got = await in_thread(attacks)
        within = await in_thread(lambda: errno_of(os.rename, "rw/dir/inner", "rw/inner", src_dir_fd=mfd,
                                                  dst_dir_fd=mfd))
    assert got == dict.fromkeys(got, errno.EXDEV)
    assert within == 0                              # the control: a rename inside the mount works
    assert (granted / "inner").read_bytes() == b"inner\n"
    assert sorted(os.listdir(granted)) == ["dir", "file", "inner"] and os.listdir(granted / "dir") == []
    assert tree_digest(granted)["file"] == before_granted["file"]
    assert sorted(os.listdir(layout.ws)) == ["mine", "rw"] and os.listdir(layout.ws / "rw") == []
    assert (layout.ws / "mine").read_bytes() == b"mine\n"


# ---------------------------------------------------------------- races with host-side changes


async def test_renames_racing_with_host_side_swaps_to_symlinks_stay_inside(layout):
    """A thread renames a directory back and forth through the mount while the host replaces the
    destination directory in the backing dir with a symlink to the outside (absolute or relative)
    and invalidates.  The outside sentinel stays untouched, the moved tree is never lost, and the
    mount stays alive."""
    ws = layout.ws
    (ws / "d1" / "sub").mkdir(parents=True)
    (ws / "d1" / "sub" / "payload").write_bytes(b"payload")
    (ws / "d2").mkdir()
    before = layout.snapshot()
    stop = threading.Event()
    outcomes: dict[str, int] = {}

    def renamer(mfd: int) -> None:
        pairs = [("d1/sub", "d2/sub"), ("d2/sub", "d1/sub")]
        i = 0
        while not stop.is_set():
            src, dst = pairs[i % 2]
            err = errno_of(os.rename, src, dst, src_dir_fd=mfd, dst_dir_fd=mfd)
            i += 1
            name = errno.errorcode.get(err, str(err)) if err else "ok"
            outcomes[name] = outcomes.get(name, 0) + 1

    async with mounted(ws) as ov:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, renamer, ov.mount_fd)
            try:
                for round_ in range(60):
                    aside = ws / f"d2.aside-{round_}"
                    target = str(layout.outside) if round_ % 2 else "../outside"
                    try:
                        os.rename(ws / "d2", aside)
                    except FileNotFoundError:
                        continue
                    os.symlink(target, ws / "d2")
                    await ov.invalidate(["d2", f"d2.aside-{round_}"])
                    await trio.sleep(0.005)
                    os.unlink(ws / "d2")
                    os.rename(aside, ws / "d2")
                    await ov.invalidate(["d2", f"d2.aside-{round_}"])
                    await trio.sleep(0.002)
            finally:
                stop.set()
        assert ov.alive
        assert sorted(await in_thread(ov.root.listdir, ".")) == ["d1", "d2"]
    layout.assert_outside_unchanged(before)
    assert outcomes.get("ok", 0) > 0, outcomes
    assert sorted(os.listdir(ws)) == ["d1", "d2"]
    payloads = [p for p in (ws / "d1" / "sub" / "payload", ws / "d2" / "sub" / "payload") if p.exists()]
    assert len(payloads) == 1 and payloads[0].read_bytes() == b"payload", outcomes


# ---------------------------------------------------------------- odd requests


def _getdents_then_seek_far(mfd: int) -> int:
    """Read a directory in small getdents64 chunks, seek the dir fd far past its end, read again."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open("many", os.O_RDONLY | os.O_DIRECTORY, dir_fd=mfd)
    try:
        buf = ctypes.create_string_buffer(256)
        n = libc.syscall(217, fd, buf, 256)            # SYS_getdents64 on x86_64
        for name in list(os.listdir(fd))[:50]:
            os.unlink(f"many/{name}", dir_fd=mfd)
        n2 = libc.syscall(217, fd, buf, 256)
        os.lseek(fd, 1 << 40, os.SEEK_SET)
        n3 = libc.syscall(217, fd, buf, 256)
        return min(n, n2, n3)
    finally:
        os.close(fd)


def list_at(mfd: int, path: str) -> list[str]:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY, dir_fd=mfd)
    try:
        return os.listdir(fd)
    finally:
        os.close(fd)


def read_at(mfd: int, path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY, dir_fd=mfd)
    try:
        return os.read(fd, 10)
    finally:
        os.close(fd)


def _odd_requests(mfd: int) -> dict[str, int]:
    out: dict[str, int] = {}
    bad = b"\xff\xfe-not-utf8-" + b"\x80" * 10
    out["create non-utf8"] = errno_of(lambda: os.close(os.open(bad, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=mfd)))
    out["stat non-utf8"] = errno_of(os.stat, bad, dir_fd=mfd)
    out["rename non-utf8"] = errno_of(os.rename, bad, bad + b"2", src_dir_fd=mfd, dst_dir_fd=mfd)
    out["mkdir non-utf8"] = errno_of(os.mkdir, b"\xc3(" + bad, dir_fd=mfd)
    out["symlink non-utf8"] = errno_of(os.symlink, bad + b"2", b"l\xff", dir_fd=mfd)
    out["name 255"] = errno_of(lambda: os.close(os.open(b"n" * 255, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=mfd)))
    out["name 256"] = errno_of(os.open, b"n" * 256, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=mfd)
    out["whiteout"] = -_native.renameat2_raw(mfd, b"f", mfd, b"w", 4)
    out["rename flags junk"] = -_native.renameat2_raw(mfd, b"f", mfd, b"w", 1 << 20)
    out["tmpfile"] = errno_of(os.open, ".", os.O_TMPFILE | os.O_RDWR, 0o600, dir_fd=mfd)
    out["getdents seek"] = 0 if _getdents_then_seek_far(mfd) >= 0 else -1
    fd = os.open("f", os.O_RDWR, dir_fd=mfd)
    try:
        out["pwrite far"] = errno_of(os.pwrite, fd, b"x", 1 << 62)
        out["ftruncate far"] = errno_of(os.ftruncate, fd, 1 << 62)
        out["fallocate"] = errno_of(os.posix_fallocate, fd, 0, 1 << 20)
        out["seek data"] = errno_of(os.lseek, fd, 0, os.SEEK_DATA)
        out["seek hole"] = errno_of(os.lseek, fd, 0, os.SEEK_HOLE)
        out["setxattr"] = errno_of(os.setxattr, fd, "user.x", b"v")
        out["getxattr"] = errno_of(os.getxattr, fd, "user.x")
        out["listxattr"] = errno_of(os.listxattr, fd)
        out["copy_file_range"] = errno_of(os.copy_file_range, fd, fd, 10, 0, 100)
        out["utime huge"] = errno_of(os.utime, fd, ns=((1 << 62), -(1 << 62)))
        out["fsync"] = errno_of(os.fsync, fd)
        out["fdatasync"] = errno_of(os.fdatasync, fd)
        import fcntl
        out["flock"] = errno_of(fcntl.flock, fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        out["lockf"] = errno_of(fcntl.lockf, fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    out["read a dir"] = errno_of(read_at, mfd, "many")
    out["statvfs"] = errno_of(os.statvfs, mfd)
    return out


async def test_odd_and_malformed_requests_keep_the_mount_alive(layout):
    """Requests a handler may not expect (non-UTF-8 names, unsupported flags and ops, offsets past
    every limit, a directory listing read after a seek far past its end): each gets an errno or
    works, the daemon keeps serving, and nothing outside changes."""
    (layout.ws / "f").write_bytes(b"0123456789")
    (layout.ws / "many").mkdir()
    for i in range(300):
        (layout.ws / "many" / f"entry-{i:04d}").write_bytes(b"")
    before = layout.snapshot()
    async with mounted(layout.ws) as ov:
        got = await in_thread(_odd_requests, ov.mount_fd)
        assert ov.alive, got
        # Still serving: a normal request after all of them, and the audit stream answers.
        # (posix_fallocate may have grown "f" with zeros: the kernel emulates it when the daemon has no fallocate.)
        assert (await in_thread(lambda: ov.root.read_bytes("f")))[:10] == b"0123456789"
        await in_thread(lambda: ov.root.write_bytes("after", b"still alive"))
        events, _dropped = await ov.audit_events()
        assert events
        # The failed writes past every limit charged nothing: usage is what the backing tree holds.
        usage = await ov.usage()
        assert ov.alive
    with open_root(layout.ws) as root, root.handle() as h:
        on_disk = Quota().measure(h)  # file bytes, symlink targets and names, measured afresh
    assert (usage["bytes"], usage["inodes"]) == on_disk, (usage, on_disk)
    assert (layout.ws / "after").read_bytes() == b"still alive"
    assert got["create non-utf8"] == 0 and got["stat non-utf8"] == 0 and got["rename non-utf8"] == 0
    assert got["name 255"] == 0 and got["name 256"] == errno.ENAMETOOLONG
    assert got["whiteout"] != 0 and got["rename flags junk"] != 0
    layout.assert_outside_unchanged(before)


async def test_a_request_the_daemon_cannot_complete_does_not_end_the_mount(layout):
    """A request that fails inside the handler with no errno of its own (the backing entry replaced by
    another kind behind the daemon's back, without an invalidation) gets an errno; the mount lives."""
    ws = layout.ws
    (ws / "f").write_bytes(b"file")
    (ws / "d").mkdir()
    before = layout.snapshot()
    async with mounted(ws) as ov:
        mfd = ov.mount_fd
        await in_thread(lambda: (os.stat("f", dir_fd=mfd), os.stat("d", dir_fd=mfd)))
        # Behind the daemon: swap the kinds of the two names, no invalidation.
        os.rename(ws / "f", ws / "tmp")
        os.rename(ws / "d", ws / "f")
        os.rename(ws / "tmp", ws / "d")

        def stale() -> dict[str, int]:
            return {
                "open f": errno_of(os.open, "f", os.O_RDONLY, dir_fd=mfd),
                "listdir d": errno_of(list_at, mfd, "d"),
                "write f": errno_of(os.open, "f", os.O_WRONLY | os.O_TRUNC, dir_fd=mfd),
                "rmdir d": errno_of(os.rmdir, "d", dir_fd=mfd),
                "unlink f": errno_of(os.unlink, "f", dir_fd=mfd),
            }

        await in_thread(stale)
        assert ov.alive
        await ov.invalidate(None)
        assert await in_thread(lambda: ov.root.read_bytes("d")) == b"file"
        assert ov.alive
    layout.assert_outside_unchanged(before)
