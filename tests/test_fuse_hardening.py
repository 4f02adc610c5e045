"""Hardening of the FUSE overlay (issue 13 follow-ups), each gap checked as a class.

* device nodes: the mount is ``nodev`` and ``nosuid`` whatever the policy,
  so a device node a policy allows is an entry, never a device (from the
  host through the mount fd, from the host's Root on it, and from a
  confined command through its private root's clone);
* symlinks are checked against the tree they are made in (a host-directory
  mount's own root), and again when renamed or hard-linked to a new place;
* a mount whose host directory overlaps the workspace is refused before the
  overlay starts;
* the daemon keeps only the capabilities serving needs.

Needs root, /dev/fuse and pyfuse3 (skipped with the reason otherwise).
"""

from __future__ import annotations

import errno
import importlib.util
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandbox_fs.fuse import Overlay, OverlayPolicy
from sandbox_fs.root import SpecialFileError, open_root

if not os.path.exists("/dev/fuse"):
    pytest.skip("the FUSE overlay needs /dev/fuse", allow_module_level=True)
if os.geteuid() != 0:
    pytest.skip("the FUSE overlay daemon needs root (fsopen needs CAP_SYS_ADMIN)", allow_module_level=True)
if importlib.util.find_spec("pyfuse3") is None:
    pytest.skip("the FUSE overlay needs pyfuse3 (the fuse extra)", allow_module_level=True)

#: Device numbers safe to make in a test: char devices whose driver does nothing harmful
#: (null, zero, full, urandom), block majors 60-63 (reserved for local use: no driver).
SAFE_CHR = [(1, 3), (1, 5), (1, 7), (1, 9)]
SAFE_BLK_MAJORS = [60, 61, 62, 63]


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    return await trio.to_thread.run_sync(fn, *args)


def errno_of(fn: Callable[..., Any], *args: Any, **kw: Any) -> int:
    """0 if ``fn(*args, **kw)`` succeeded, else its errno (an fd it returned is closed)."""
    try:
        ret = fn(*args, **kw)
    except OSError as exc:
        return exc.errno or -1
    if fn is os.open and isinstance(ret, int):
        os.close(ret)
    return 0


@pytest.fixture
def base():
    """A temp dir under /tmp every uid may search (pytest's tmp_path sits under a 0700 directory)."""
    d = Path(tempfile.mkdtemp(prefix="sfs-harden-"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d)


# ---------------------------------------------------------------- device nodes


async def test_an_allowed_device_node_is_an_entry_never_a_device(base):
    from sandbox_fs.exec import PrivateRoot, run_confined

    ws = base / "ws"
    ws.mkdir(mode=0o755)
    backing = open_root(ws)
    ov = await Overlay.start(backing, policy=OverlayPolicy(allow_special=frozenset({"chr", "blk"})))
    try:
        mfd = ov.mount_fd

        def make_and_open() -> dict[str, Any]:
            os.mknod("null", stat.S_IFCHR | 0o666, os.makedev(1, 3), dir_fd=mfd)
            os.chmod("null", 0o666, dir_fd=mfd)
            os.mknod("blk", stat.S_IFBLK | 0o666, os.makedev(60, 0), dir_fd=mfd)
            st_ = os.stat("null", dir_fd=mfd, follow_symlinks=False)
            return {
                "kind": (stat.S_ISCHR(st_.st_mode), st_.st_rdev),
                "flags": os.statvfs(mfd).f_flag & (os.ST_NODEV | os.ST_NOSUID),
                "read": errno_of(os.open, "null", os.O_RDONLY | os.O_NONBLOCK, dir_fd=mfd),
                "write": errno_of(os.open, "null", os.O_WRONLY | os.O_NONBLOCK, dir_fd=mfd),
                "blk": errno_of(os.open, "blk", os.O_RDONLY | os.O_NONBLOCK, dir_fd=mfd),
            }

        got = await in_thread(make_and_open)
        # The host's Root on the mount: its open of a special file fails (nodev refuses the open
        # itself, before the Root's own fstat check could), and with allow_special too.
        with pytest.raises((SpecialFileError, PermissionError)):
            ov.root.open("null", "rb")
        with pytest.raises(PermissionError) as exc:
            os.close(ov.root.open_fd("null", os.O_RDONLY, allow_special=True))
        assert exc.value.errno == errno.EACCES
        # A confined command, through its private root's clone of the mount.
        script = ("import os, errno\n"
                  "f = os.statvfs('/workspace').f_flag\n"
                  "print(bool(f & os.ST_NODEV), bool(f & os.ST_NOSUID))\n"
                  "for p in ('/workspace/null', '/workspace/blk'):\n"
                  "    try:\n"
                  "        os.close(os.open(p, os.O_RDONLY | os.O_NONBLOCK)); print('opened')\n"
                  "    except OSError as e:\n"
                  "        print(errno.errorcode[e.errno])\n")
        r = await run_confined(["/usr/bin/python3", "-c", script], workspace=ov.root,
                               workspace_host_path=str(ws), private_root=PrivateRoot(mfd))
        assert ov.alive
    finally:
        await ov.aclose()
        backing.close()
    assert got["kind"] == (True, os.makedev(1, 3))          # it is an entry, with its numbers
    assert got["flags"] == os.ST_NODEV | os.ST_NOSUID
    assert (got["read"], got["write"], got["blk"]) == (errno.EACCES, errno.EACCES, errno.EACCES)
    assert r.overlay and r.stdout.decode().split() == ["True", "True", "EACCES", "EACCES"], r.stderr
    # Control: the same node in the backing directory is a real device (so nodev is what refused).
    assert stat.S_ISCHR(os.lstat(ws / "null").st_mode)
    assert errno_of(os.open, ws / "null", os.O_RDONLY) == 0


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(allow=st.frozensets(st.sampled_from(["fifo", "socket", "chr", "blk"])),
       nodes=st.lists(st.tuples(st.sampled_from(["chr", "blk"]), st.integers(0, 3), st.integers(0, 255)),
                      min_size=1, max_size=4))
def test_property_every_policy_mounts_nodev_nosuid_and_no_node_opens(base, allow, nodes):
    """Whatever the policy: the mount is nodev+nosuid, a node is made iff allowed, and none opens."""

    async def run() -> None:
        ws = Path(tempfile.mkdtemp(dir=base))
        backing = open_root(ws)
        ov = await Overlay.start(backing, policy=OverlayPolicy(allow_special=allow))
        try:
            mfd = ov.mount_fd

            def attack() -> list[tuple[int, int]]:
                out = []
                for i, (kind, which, minor) in enumerate(nodes):
                    if kind == "chr":
                        mode, dev = stat.S_IFCHR | 0o666, os.makedev(*SAFE_CHR[which])
                    else:
                        mode, dev = stat.S_IFBLK | 0o666, os.makedev(SAFE_BLK_MAJORS[which], minor)
                    made = errno_of(os.mknod, f"n{i}", mode, dev, dir_fd=mfd)
                    opened = errno_of(os.open, f"n{i}", os.O_RDONLY | os.O_NONBLOCK, dir_fd=mfd) if made == 0 else -1
                    out.append((made, opened))
                return out

            flags = (await in_thread(os.statvfs, mfd)).f_flag
            results = await in_thread(attack)
        finally:
            await ov.aclose()
            backing.close()
        assert flags & os.ST_NODEV and flags & os.ST_NOSUID
        for (kind, _, _), (made, opened) in zip(nodes, results):
            if kind in allow:
                assert (made, opened) == (0, errno.EACCES)
            else:
                assert made == errno.EPERM

    trio.run(run)


# ---------------------------------------------------------------- symlinks, judged in their own tree


async def start_with_mount(base: Path, granted: Path, read_only: bool = False) -> tuple[Overlay, list[Any]]:
    """An overlay on ``base/ws`` serving ``granted`` writable at ``m``; returns it and the Roots to close."""
    from sandbox_fs.fuse import OverlayMount

    ws = base / "ws"
    ws.mkdir(exist_ok=True)
    (ws / "m").mkdir(exist_ok=True)
    wsr, gr = open_root(ws), open_root(granted)
    try:
        ov = await Overlay.start(wsr, policy=OverlayPolicy(), mounts=[OverlayMount("m", gr, read_only=read_only)])
    except BaseException:
        wsr.close()
        gr.close()
        raise
    return ov, [wsr, gr]


@pytest.fixture
def granted(base):
    """A host directory (``granted/``, served at ``m``) beside a sentinel the host would reach through a bad link."""
    g = base / "granted"
    (g / "sub").mkdir(parents=True)
    (g / "inner").write_text("inner\n")
    (base / "secret").write_text("HOST SECRET\n")
    return g


async def test_a_link_in_a_host_directory_mount_is_judged_against_that_directory(base, granted):
    """``m/up -> ../secret`` stays in the workspace counted from the workspace, but in the host
    directory it names the host's ``secret`` beside it: refused (the old check used the sandbox path).
    In a host-directory mount no target may hold ``..`` at all (``ok-sub``), even one that stays inside:
    a later rename of its directory, by us or the host, could make it climb out."""
    ov, roots = await start_with_mount(base, granted)
    try:
        mfd = ov.mount_fd

        def attacks() -> dict[str, int]:
            return {
                "up": errno_of(os.symlink, "../secret", "m/up", dir_fd=mfd),
                "sub-up": errno_of(os.symlink, "../../secret", "m/sub/up", dir_fd=mfd),
                "ok": errno_of(os.symlink, "inner", "m/ok", dir_fd=mfd),
                "ok-sub": errno_of(os.symlink, "../inner", "m/sub/ok", dir_fd=mfd),
                "ws": errno_of(os.symlink, "m/inner", "wslink", dir_fd=mfd),
            }

        got = await in_thread(attacks)
        assert ov.alive
    finally:
        await ov.aclose()
        for r in roots:
            r.close()
    assert got == {"up": errno.EPERM, "sub-up": errno.EPERM, "ok": 0, "ok-sub": errno.EPERM, "ws": 0}
    assert sorted(os.listdir(granted)) == ["inner", "ok", "sub"]
    assert os.listdir(granted / "sub") == []
    assert (base / "secret").read_text() == "HOST SECRET\n"


async def test_a_symlink_renamed_or_hard_linked_to_a_shallower_place_is_refused(base, granted):
    """``a/b/l -> ../../x`` is fine where it is; renamed, exchanged or hard-linked to the root it would climb out."""
    ov, roots = await start_with_mount(base, granted)
    ws = base / "ws"
    try:
        mfd = ov.mount_fd

        def attacks() -> dict[str, int]:
            for d in ("a", "a/b", "a/c", "m/sub/deeper"):
                os.mkdir(d, dir_fd=mfd)
            os.symlink("../../x", "a/b/l", dir_fd=mfd)
            mount_dotdot = errno_of(os.symlink, "../../inner", "m/sub/deeper/l", dir_fd=mfd)
            os.symlink("inner", "m/sub/deeper/l", dir_fd=mfd)  # no '..': fine at any depth
            fd = os.open("f", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=mfd)
            os.close(fd)
            return {
                "mount-dotdot": mount_dotdot,
                "rename-up": errno_of(os.rename, "a/b/l", "l2", src_dir_fd=mfd, dst_dir_fd=mfd),
                "link-up": errno_of(os.link, "a/b/l", "l3", src_dir_fd=mfd, dst_dir_fd=mfd,
                                    follow_symlinks=False),
                "exchange-up": _exchange(mfd, "a/b/l", "f"),
                "rename-same-depth": errno_of(os.rename, "a/b/l", "a/c/l", src_dir_fd=mfd, dst_dir_fd=mfd),
                "link-same-depth": errno_of(os.link, "a/c/l", "a/b/l", src_dir_fd=mfd, dst_dir_fd=mfd,
                                            follow_symlinks=False),
                "mount-rename-up": errno_of(os.rename, "m/sub/deeper/l", "m/l", src_dir_fd=mfd, dst_dir_fd=mfd),
                "mount-link-up": errno_of(os.link, "m/l", "m/sub/l", src_dir_fd=mfd, dst_dir_fd=mfd,
                                          follow_symlinks=False),
            }

        got = await in_thread(attacks)
        assert ov.alive
    finally:
        await ov.aclose()
        for r in roots:
            r.close()
    assert got == {"rename-up": errno.EPERM, "link-up": errno.EPERM, "exchange-up": errno.EPERM,
                   "rename-same-depth": 0, "link-same-depth": 0,
                   "mount-dotdot": errno.EPERM, "mount-rename-up": 0, "mount-link-up": 0}
    assert sorted(os.listdir(ws)) == ["a", "f", "m"] and stat.S_ISREG(os.lstat(ws / "f").st_mode)
    assert os.readlink(ws / "a" / "c" / "l") == "../../x"
    assert sorted(os.listdir(granted / "sub")) == ["deeper", "l"] and sorted(os.listdir(granted)) == ["inner", "l", "sub"]
    assert os.readlink(granted / "l") == "inner" and os.listdir(granted / "sub" / "deeper") == []


def _exchange(mfd: int, a: str, b: str) -> int:
    """renameat2(RENAME_EXCHANGE) of ``a`` and ``b`` beneath ``mfd``; 0 or the errno."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    ret = libc.renameat2(mfd, a.encode(), mfd, b.encode(), 2)
    return 0 if ret == 0 else ctypes.get_errno()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(in_mount=st.booleans(), depth=st.integers(0, 3), ups=st.integers(0, 4), new_depth=st.integers(0, 3),
       how=st.sampled_from(["rename", "link"]))
def test_property_a_link_is_accepted_where_its_target_stays_in_its_tree(base, in_mount, depth, ups, new_depth, how):
    """In the workspace, a link ``'../' * ups + 'x'`` at directory depth ``depth`` exists iff
    ``ups <= depth``, and moving it to depth ``new_depth`` succeeds iff ``ups <= new_depth``; in a
    host-directory mount it exists iff ``ups == 0`` (no ``..`` there), and then moves anywhere."""

    async def run() -> None:
        case = Path(tempfile.mkdtemp(dir=base))
        g = case / "granted"
        g.mkdir()
        ov, roots = await start_with_mount(case, g)
        try:
            mfd = ov.mount_fd
            top = "m/" if in_mount else ""

            def attempt() -> tuple[int, int]:
                for d in range(1, 4):
                    os.mkdir(top + "/".join(["d"] * d), dir_fd=mfd)
                    os.mkdir(top + "/".join(["e"] * d), dir_fd=mfd)
                src = top + "/".join(["d"] * depth + ["l"])
                dst = top + "/".join(["e"] * new_depth + ["k"])
                made = errno_of(os.symlink, "../" * ups + "x", src, dir_fd=mfd)
                if made:
                    return made, -1
                if how == "rename":
                    return 0, errno_of(os.rename, src, dst, src_dir_fd=mfd, dst_dir_fd=mfd)
                return 0, errno_of(os.link, src, dst, src_dir_fd=mfd, dst_dir_fd=mfd, follow_symlinks=False)

            made, moved = await in_thread(attempt)
        finally:
            await ov.aclose()
            for r in roots:
                r.close()
        if in_mount:
            assert (made, moved) == ((0, 0) if ups == 0 else (errno.EPERM, -1))
        elif ups > depth:
            assert made == errno.EPERM
        else:
            assert (made, moved) == (0, 0 if ups <= new_depth else errno.EPERM)

    trio.run(run)


# ---------------------------------------------------------------- mounts overlapping the workspace


@pytest.fixture
def no_daemon(monkeypatch):
    """Fail the test if anything tries to start a daemon (the refusal must come first)."""

    async def refuse(*a: Any, **kw: Any) -> Any:
        raise AssertionError("a daemon was started for an overlapping mount")

    monkeypatch.setattr(trio.lowlevel, "open_process", refuse)


@pytest.mark.parametrize("where,expected", [
    ("ws", "same"), ("ws/sub", "inside"), ("ws/sub/deep", "inside"), ("", "contains"),
    ("alias", "inside"),          # a symlink to ws/sub: its path string names no part of the workspace
    ("moved", "contains"),        # the workspace's directory renamed beneath it after its Root was opened
])
async def test_a_mount_overlapping_the_workspace_is_refused_before_the_daemon_starts(base, no_daemon, where,
                                                                                       expected):
    from sandbox_fs.fuse import OverlayError, OverlayMount

    (base / "ws" / "sub" / "deep").mkdir(parents=True)
    os.symlink(base / "ws" / "sub", base / "alias")
    ws = open_root(base / "ws")
    if where == "moved":
        (base / "moved").mkdir()
        os.rename(base / "ws", base / "moved" / "ws")
    before = sorted(p.name for p in (base / ("moved/ws" if where == "moved" else "ws")).iterdir())
    grant = open_root(base / where if where else base, follow_symlinks=(where == "alias"))
    try:
        with pytest.raises(OverlayError) as ei:
            await Overlay.start(ws, policy=OverlayPolicy(), mounts=[OverlayMount("m", grant)])
    finally:
        ws.close()
        grant.close()
    assert ei.value.code == "overlay_error"
    assert ei.value.context == {"mount": "m", "overlap": expected}
    assert str(base) not in str(ei.value)
    assert sorted(p.name for p in (base / ("moved/ws" if where == "moved" else "ws")).iterdir()) == before


async def test_a_sibling_mount_is_not_an_overlap(base):
    """The control: a directory beside the workspace (same parent) is served."""
    from sandbox_fs.fuse import OverlayMount

    (base / "ws" / "m").mkdir(parents=True)
    (base / "ws2").mkdir()
    (base / "ws2" / "f").write_text("beside\n")
    ws, grant = open_root(base / "ws"), open_root(base / "ws2")
    try:
        async with await Overlay.start(ws, policy=OverlayPolicy(), mounts=[OverlayMount("m", grant)]) as ov:
            got = await in_thread(lambda: os.stat("m/f", dir_fd=ov.mount_fd).st_size)
    finally:
        ws.close()
        grant.close()
    assert got == len("beside\n")


_names = st.lists(st.sampled_from(["a", "b"]), max_size=3)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ws_at=_names, mount_at=_names)
def test_property_mount_overlap_is_the_ancestry_relation(base, ws_at, mount_at):
    """For any two directories of a tree: "same", "inside", "contains" or None, as their component lists say."""
    from sandbox_fs.fuse import mount_overlap

    top = Path(tempfile.mkdtemp(dir=base))
    for p in (ws_at, mount_at):
        (top / "t" / Path(*p) if p else top / "t").mkdir(parents=True, exist_ok=True)
    ws = open_root(top / "t" / Path(*ws_at) if ws_at else top / "t")
    mount = open_root(top / "t" / Path(*mount_at) if mount_at else top / "t")
    try:
        got = mount_overlap(ws, mount)
    finally:
        ws.close()
        mount.close()
    if ws_at == mount_at:
        assert got == "same"
    elif mount_at[:len(ws_at)] == ws_at:
        assert got == "inside"
    elif ws_at[:len(mount_at)] == mount_at:
        assert got == "contains"
    else:
        assert got is None


def _overlay_unusable() -> str | None:
    from sandbox_fs import _features

    usable, reason = _features.fuse_status()
    return None if usable else f"FUSE is not usable here: {reason}"


@pytest.mark.skipif(_overlay_unusable() is not None, reason=_overlay_unusable() or "")
async def test_a_session_mount_entry_whose_grant_contains_the_workspace_is_refused(tmp_path, no_daemon):
    from sandbox_fs.client import ClientOptions, LocalSandboxClient
    from sandbox_fs.manifest import load_manifest
    from sandbox_fs.paths import Grant
    from sandbox_fs.session import MountOverlapError

    wsdir = tmp_path / "wsdir"
    wsdir.mkdir()
    client = LocalSandboxClient(ClientOptions(
        workspaces_dir=str(wsdir), snapshot_dir=str(tmp_path / "snaps"), overlay=True,
        extra_path_grants=(Grant(str(tmp_path), read_only=True, name="up"),)))
    try:
        manifest = load_manifest({"entries": {"mnt": {"type": "mount", "grant": "up"}}})
        with pytest.raises(MountOverlapError) as ei:
            async with client.create(manifest=manifest):
                pass
    finally:
        client.close()
    assert ei.value.code == "mount_overlap"
    assert ei.value.context == {"mount": "mnt", "overlap": "contains"}
    assert str(tmp_path) not in str(ei.value)
    assert all(not (d / "mnt").exists() for d in wsdir.iterdir()), "a placeholder was made"


# ---------------------------------------------------------------- the daemon's own capabilities


def _cap_sets(pid: int) -> dict[str, set[int]]:
    """Each capability set of every thread of ``pid``: ``{"tid:CapEff": {bits}, ...}``."""
    out: dict[str, set[int]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
                    mask = int(value.strip(), 16)
                    out[f"{tid}:{key}"] = {b for b in range(64) if mask >> b & 1}
    return out


CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER, CAP_MKNOD, CAP_SYS_ADMIN = 0, 1, 2, 3, 27, 21


@pytest.mark.parametrize("allow,kept", [
    (frozenset(), {CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER}),
    (frozenset({"fifo", "socket"}), {CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER}),
    (frozenset({"chr"}), {CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER, CAP_MKNOD}),
])
async def test_the_daemon_keeps_only_the_capabilities_serving_needs(base, allow, kept):
    """Measured in /proc/<daemon>/task/*/status: every thread, every set, bounding included; and it still serves."""
    ws = base / "ws"
    ws.mkdir()
    (ws / "theirs").write_text("x")
    os.chown(ws / "theirs", 4242, 4242)
    mine = _cap_sets(os.getpid())
    assert CAP_SYS_ADMIN in mine[f"{os.getpid()}:CapEff"], "the control: the host itself has CAP_SYS_ADMIN"
    backing = open_root(ws)
    try:
        async with await Overlay.start(backing, policy=OverlayPolicy(allow_special=allow)) as ov:
            mfd = ov.mount_fd

            def serve_some() -> tuple[int, int, int]:
                # Needs CAP_CHOWN (the new file is chowned), CAP_FOWNER (chmod of another's file),
                # CAP_DAC_READ_SEARCH (linkat AT_EMPTY_PATH from the daemon's O_PATH fd).
                os.close(os.open("new", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=mfd))
                os.chmod("theirs", 0o600, dir_fd=mfd)
                os.link("theirs", "hard", src_dir_fd=mfd, dst_dir_fd=mfd)
                return (os.stat("new", dir_fd=mfd).st_uid, stat.S_IMODE(os.stat("theirs", dir_fd=mfd).st_mode),
                        os.stat("hard", dir_fd=mfd).st_nlink)

            served = await in_thread(serve_some)
            sets = _cap_sets(ov.pid)
            assert ov.alive
    finally:
        backing.close()
    assert served == (0, 0o600, 2)
    threads = {k.split(":")[0] for k in sets}
    assert len(threads) >= 2, "the invalidation thread is measured too"
    for key, bits in sets.items():
        want = set() if key.endswith(("CapInh", "CapAmb")) else kept
        assert bits == want, (key, sorted(bits))
