"""Confined commands on a root host run as a leased unprivileged identity (issue 11, part A).

Each attack test checks an outside sentinel (a file's owner, mode or
content, a lock that is free again) and has a positive control: the same
command with ``identity="host"`` (uid 0, capabilities dropped: the old
behaviour) succeeds, so the tests fail on the code before the change.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import sandbox_fs
from sandbox_fs import open_root
from sandbox_fs import exec as sfs_exec
from sandbox_fs.exec import _cgroups, _identity
from sandbox_fs.exec import ConfinementError, ConfinementPolicy, ExecError, ProcessSupervisor, run_confined

ABI = sandbox_fs.features()["landlock_abi"]
PYTHON = os.path.join(sys.base_prefix, "bin", "python3")

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="identities are leased only on a root host"),
    pytest.mark.skipif(not os.access(sfs_exec.helper_path(), os.X_OK), reason="sandbox_fs/sfs-exec is not built"),
    pytest.mark.skipif(ABI == 0, reason="features()['landlock_abi'] is 0: the kernel has no Landlock"),
]

HOST = ConfinementPolicy(identity="host")


def lock_is_free(uid: int) -> bool:
    """True when no lease holds ``uid``'s lock file (we take and drop the lock to see)."""
    fd = os.open(f"{_identity.LOCK_DIR}/{uid}", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _ancestry(pid: int) -> list[int]:
    """``pid`` and its parents up to the init of this pid namespace (what /proc shows)."""
    out = []
    while pid > 0 and pid not in out:
        out.append(pid)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:  # host-access: /proc of the test's own processes
                pid = int(f.read().rpartition(b")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


def lock_holders(uid: int) -> set[int]:
    """The pids holding an flock on ``uid``'s lock file (from /proc/locks; empty when none)."""
    st = os.stat(f"{_identity.LOCK_DIR}/{uid}")
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    pids = set()
    with open("/proc/locks") as f:  # host-access: the kernel's lock table, read only
        for line in f:
            parts = [p for p in line.split() if p != "->"]  # "->": a waiter's line
            if len(parts) < 6 or parts[1] != "FLOCK":
                continue
            maj, mnr, ino = parts[5].split(":")
            if (int(maj, 16), int(mnr, 16), int(ino)) == want:
                pids.add(int(parts[4]))
    return pids


def released_by(uid: int, pid: int) -> bool:
    """True when neither ``pid`` nor any process descended from it holds ``uid``'s lock.

    "Released" as a test can see it on a shared machine: another process
    (another test run, another host) may lease the freed id at once, so
    :func:`lock_is_free` after a release is racy; this is not.
    """
    return not any(pid in _ancestry(holder) for holder in lock_holders(uid))


@pytest.fixture
def open_tmp():
    """A temp dir every uid may search (pytest's tmp_path sits under a 0700 directory)."""
    d = Path(tempfile.mkdtemp(prefix="sfs-ident-"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d)


@pytest.fixture
def wsr(open_tmp):
    (open_tmp / "ws").mkdir()
    root = open_root(open_tmp / "ws")
    yield open_tmp, root
    root.close()


async def run(base: Path, ws, argv, **kw):
    return await run_confined(argv, workspace=ws, workspace_host_path=str(base / "ws"), **kw)


def sh(script: str) -> list[str]:
    return ["/bin/sh", "-c", script]


# ------------------------------------------------------------------ who the child is

async def test_child_runs_as_the_leased_identity(wsr):
    base, ws = wsr
    r = await run(base, ws, sh("id -u; id -g; id -G"))
    uid, gid, groups = r.stdout.decode().splitlines()
    caps = (await run(base, ws, ["grep", "CapEff", "/proc/self/status"])).stdout.decode()
    assert r.identity == (int(uid), int(gid)) and uid == gid and groups == gid
    assert int(uid) != 0 and int(uid) not in {p.pw_uid for p in pwd.getpwall()}
    assert _identity.DEFAULT_ID_BASE <= int(uid) < _identity.DEFAULT_ID_BASE + _identity.DEFAULT_ID_COUNT
    assert caps.split()[-1] == "0000000000000000"
    # positive control: the opt-out keeps uid 0
    r0 = await run(base, ws, sh("id -u"), policy=HOST)
    assert r0.stdout == b"0\n" and r0.identity is None


async def test_files_the_child_makes_are_owned_by_the_identity(wsr):
    base, ws = wsr
    ws.write_bytes("by-host.txt", b"host")  # made by the library (root): re-owned before the run
    r = await run(base, ws, sh("echo x > made.txt && mkdir d && echo more >> by-host.txt && echo ok"))
    assert r.stdout == b"ok\n", r.stderr
    uid, gid = r.identity
    for name in ("made.txt", "d", "by-host.txt", ".", ".home", ".tmp"):
        st = os.lstat(base / "ws" / name)
        assert (st.st_uid, st.st_gid) == (uid, gid), name
    assert (base / "ws" / "by-host.txt").read_bytes() == b"hostmore\n"


async def test_explicit_identity_and_bad_values(wsr):
    base, ws = wsr
    with _identity.lease() as lease:
        r = await run(base, ws, sh("id -u"), policy=ConfinementPolicy(identity=lease.ids))
        assert r.stdout == f"{lease.uid}\n".encode() and r.identity == lease.ids
    for bad in [(0, 0), (1, 0), ("1", 2), (1, 2, 3), "root", (True, 5)]:
        with pytest.raises(ExecError, match="identity must be"):
            await run(base, ws, ["true"], policy=ConfinementPolicy(identity=bad))


# ------------------------------------------------------------------ leases

async def test_two_concurrent_sessions_get_different_ids(client):
    async with client.create() as a, client.create() as b:
        assert a.identity is not None and b.identity is not None and a.identity != b.identity
        ra, rb = await a.exec(["id", "-u"]), await b.exec(["id", "-u"])
        assert int(ra.stdout) == a.identity[0] and int(rb.stdout) == b.identity[0]
        assert not lock_is_free(a.identity[0]) and not lock_is_free(b.identity[0])
        assert not released_by(a.identity[0], os.getpid()) and not released_by(b.identity[0], os.getpid())
        ids = (a.identity[0], b.identity[0])
    assert all(released_by(u, os.getpid()) for u in ids)  # released at close
    await client.delete(a)
    await client.delete(b)


async def test_supervisor_lease_released_at_close(wsr):
    base, ws = wsr
    sup = ProcessSupervisor()
    r1 = await run(base, ws, ["true"], supervisor=sup)
    r2 = await run(base, ws, ["true"], supervisor=sup)
    assert r1.identity == r2.identity  # one identity per supervisor (session)
    assert not lock_is_free(r1.identity[0])
    await sup.aclose()
    assert released_by(r1.identity[0], os.getpid())
    r3 = await run(base, ws, ["true"])  # a private supervisor: leased and given back per call
    assert released_by(r3.identity[0], os.getpid())


def test_lease_freed_when_its_host_is_sigkilled():
    code = ("import sys, time; from sandbox_fs.exec import _identity; l = _identity.lease(); "
            "print(l.uid, flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        uid = int(p.stdout.readline())
        assert not lock_is_free(uid)
        with _identity.lease() as mine:
            assert mine.uid != uid  # held by the other process
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stdout.close()
    assert released_by(uid, p.pid)


def test_ids_in_use_are_never_leased(monkeypatch):
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv to start a process under a given uid")
    with _identity.lease() as probe:
        target = probe.uid
    # a running process of that uid (a leftover of a crashed host): the id is skipped
    p = subprocess.Popen(["setpriv", f"--reuid={target}", f"--regid={target}", "--clear-groups", "sleep", "30"])
    try:
        for _ in range(200):
            if target in _identity._ids_with_processes():
                break
            time.sleep(0.01)
        with _identity.lease() as got:
            assert got.uid != target
        with pytest.raises(_identity.IdentityUnavailableError):
            _identity.lease(target, 1)
    finally:
        p.kill()
        p.wait()
    # a name in the user database: skipped too
    real = pwd.getpwuid
    monkeypatch.setattr(_identity.pwd, "getpwuid", lambda u: real(0) if u == target else real(u))
    with pytest.raises(_identity.IdentityUnavailableError):
        _identity.lease(target, 1)
    monkeypatch.undo()
    with _identity.lease(target, 1) as got:
        assert got.uid == target


@pytest.mark.parametrize("base,count", [(0, 10), (1000, 5), (65535, 2), (0x7FFFFFFF, 2), (0x70010000, 0)])
def test_identity_range_must_avoid_system_and_signed_ids(base, count):
    with pytest.raises(ValueError):
        _identity.lease(base, count)


def test_lock_directory_must_be_root_only(open_tmp):
    lock = open_tmp / "ids"
    lock.mkdir(mode=0o755)
    os.chmod(lock, 0o755)
    with pytest.raises(PermissionError):
        _identity.lease(lock_dir=str(lock))
    (open_tmp / "link").symlink_to(lock)
    with pytest.raises(OSError):
        _identity.lease(lock_dir=str(open_tmp / "link"))  # never followed


# ------------------------------------------------------------------ ownership as the guarantee

async def test_root_only_file_added_later_to_a_granted_tree_is_unreadable(open_tmp, wsr):
    """The /etc example: a directory rule covers files added after the ruleset was built;
    a root-only 0600 file added between two runs in one host process stays unreadable (DAC)."""
    base, ws = wsr
    etc = open_tmp / "etc"
    etc.mkdir()
    os.chmod(etc, 0o755)
    (etc / "public.conf").write_text("public\n")
    os.chmod(etc / "public.conf", 0o644)
    grant = open_root(etc, read_only=True)
    sup = ProcessSupervisor()
    try:
        r1 = await run(base, ws, ["cat", f"{etc}/public.conf"], grants=[(grant, True)], supervisor=sup)
        assert r1.stdout == b"public\n", r1.stderr
        secret = "ETC-SECRET-" + os.urandom(8).hex()
        fd = os.open(etc / "shadow-like", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, secret.encode())
        os.close(fd)
        r2 = await run(base, ws, sh(f"cat {etc}/shadow-like; cp {etc}/shadow-like stolen; echo end"),
                       grants=[(grant, True)], supervisor=sup)
        assert secret.encode() not in r2.stdout + r2.stderr and b"Permission denied" in r2.stderr
        assert not ws.exists("stolen")
        # positive control: as uid 0 (the opt-out) the same read succeeds
        r0 = await run(base, ws, ["cat", f"{etc}/shadow-like"], grants=[(grant, True)], supervisor=sup, policy=HOST)
        assert r0.stdout == secret.encode()
    finally:
        await sup.aclose()
        grant.close()


async def test_child_cannot_chmod_or_chown_outside_or_give_files_away(open_tmp, wsr):
    base, ws = wsr
    out = open_tmp / "outside"
    out.mkdir()
    os.chmod(out, 0o755)
    (out / "tool").write_bytes(b"#!/bin/sh\n")
    os.chmod(out / "tool", 0o755)
    before = os.stat(out / "tool")
    grant = open_root(out, read_only=True)
    try:
        r = await run(base, ws, sh(f"chmod 4755 {out}/tool; chown 1:1 {out}/tool; touch -d 2001-01-01 {out}/tool; "
                                   f"echo x > mine; chown 0:0 mine; chmod 4755 mine; echo end"),
                      grants=[(grant, True)])
    finally:
        grant.close()
    assert r.stdout == b"end\n"
    after = os.stat(out / "tool")
    assert (after.st_mode, after.st_uid, after.st_mtime_ns) == (before.st_mode, before.st_uid, before.st_mtime_ns)
    mine = os.stat(base / "ws" / "mine")
    assert mine.st_uid == r.identity[0]  # never given to root
    assert b"Operation not permitted" in r.stderr


async def test_rlimit_nproc_bounds_a_fork_loop_under_the_identity(wsr, pygrant):
    base, ws = wsr
    code = ("import os, time\npids = []\nfor _ in range(40):\n    try:\n        pid = os.fork()\n"
            "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(5)\n        os._exit(0)\n"
            "    pids.append(pid)\nprint(len(pids))\nfor p in pids:\n    os.kill(p, 9)\n")
    policy = ConfinementPolicy(processes=8, pids_max=None)
    r = await run(base, ws, [PYTHON, "-c", code], grants=pygrant, policy=policy)
    assert r.exit_code == 0, r.stderr
    assert int(r.stdout) <= 7  # the python process itself counts
    assert "rlimit.nproc=8" in r.process_bounds
    # positive control: uid 0 is never bound by RLIMIT_NPROC (no bound: only best_effort runs it)
    r0 = await run(base, ws, [PYTHON, "-c", code], grants=pygrant, confinement="best_effort",
                   policy=ConfinementPolicy(processes=8, pids_max=None, identity="host"))
    assert int(r0.stdout) == 40 and r0.process_bounds == ()


# ------------------------------------------------------------------ re-owning the workspace

async def test_reown_leaves_hard_links_symlinks_and_nested_grants_alone(open_tmp, wsr):
    base, ws = wsr
    outside = open_tmp / "outside.txt"
    outside.write_text("outside\n")
    os.link(outside, base / "ws" / "hardlink")  # a hard link to an inode outside the workspace
    (base / "ws" / "sym").symlink_to("/etc/passwd")
    (base / "ws" / "granted").mkdir()
    (base / "ws" / "granted" / "g.txt").write_text("g")
    (base / "ws" / "sub").mkdir()
    (base / "ws" / "sub" / "f").write_text("f")
    os.chown(base / "ws" / "sub" / "f", 4242, 4242)  # a previous identity's file (resume)
    inner = ws.open_root("granted", read_only=True)
    try:
        _identity.reown_tree(ws, (4245, 4245), skip_identities=frozenset({inner.identity}))  # a nested grant
    finally:
        inner.close()
    assert os.stat(base / "ws" / "sub").st_uid == 4245
    assert os.stat(base / "ws" / "granted").st_uid == 0 and os.stat(base / "ws" / "granted" / "g.txt").st_uid == 0
    r = await run(base, ws, sh("echo again >> hardlink; echo y >> sub/f; echo end"))
    uid = r.identity[0]
    assert os.stat(outside).st_uid == 0 and outside.read_text() == "outside\n"
    assert os.lstat(base / "ws" / "sym").st_uid == 0
    assert os.stat(base / "ws" / "sub" / "f").st_uid == uid and (base / "ws" / "sub" / "f").read_text() == "fy\n"
    assert b"Permission denied" in r.stderr  # the hard link stayed root's


def test_reown_never_crosses_a_mount(open_tmp):
    ws = open_tmp / "ws"
    (ws / "mnt").mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(ws / "mnt")]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        (ws / "mnt" / "f").write_text("other fs")
        (ws / "own").write_text("own")
        root = open_root(ws)
        try:
            _identity.reown_tree(root, (4243, 4243))
        finally:
            root.close()
        assert os.stat(ws / "own").st_uid == 4243
        assert os.stat(ws / "mnt").st_uid == 0 and os.stat(ws / "mnt" / "f").st_uid == 0
    finally:
        subprocess.run(["umount", str(ws / "mnt")])


def test_reown_clears_set_id_bits_and_skips_devices(open_tmp):
    ws = open_tmp / "ws"
    ws.mkdir()
    (ws / "suid").write_bytes(b"x")
    os.chmod(ws / "suid", 0o4755)
    os.mknod(ws / "null", 0o666 | 0o020000, os.makedev(1, 3))
    root = open_root(ws)
    try:
        assert _identity.reown_tree(root, (4244, 4244)) == 2  # the root and suid
    finally:
        root.close()
    st = os.stat(ws / "suid")
    assert st.st_uid == 4244 and not st.st_mode & 0o6000
    assert os.lstat(ws / "null").st_uid == 0


async def test_read_write_grant_not_owned_by_the_identity_is_refused(open_tmp, wsr):
    base, ws = wsr
    rw = open_tmp / "rw"
    rw.mkdir()
    g = open_root(rw)
    try:
        with pytest.raises(ConfinementError) as info:
            await run(base, ws, sh(f"echo x > {rw}/f"), grants=[(g, False)])
        assert info.value.code == "confinement_unavailable" and str(rw) not in str(info.value)
        assert os.listdir(rw) == []
        r0 = await run(base, ws, sh(f"echo x > {rw}/f"), grants=[(g, False)], policy=HOST)  # positive control
        assert r0.exit_code == 0 and (rw / "f").read_text() == "x\n"
    finally:
        g.close()


async def test_tool_under_an_unsearchable_ancestor_is_reachable_and_the_rest_hidden(open_tmp, wsr):
    base, ws = wsr
    hidden = open_tmp / "private"
    (hidden / "tools").mkdir(parents=True)
    os.chmod(hidden, 0o700)
    os.chmod(hidden / "tools", 0o755)
    (hidden / "tools" / "hello").write_bytes(b"#!/bin/sh\necho hello\n")
    os.chmod(hidden / "tools" / "hello", 0o755)
    (hidden / "secret.txt").write_text("private secret\n")
    os.chmod(hidden / "secret.txt", 0o644)
    grant = open_root(hidden / "tools", read_only=True)
    try:
        r = await run(base, ws, sh(f"{hidden}/tools/hello; ls -a {hidden}; cat {hidden}/secret.txt; "
                                   f"touch {hidden}/x; echo end"), grants=[(grant, True)])
    finally:
        grant.close()
    assert r.stdout.startswith(b"hello\n") and r.stdout.endswith(b"end\n"), r.stderr
    listing = r.stdout.split(b"\n")[1:-2]
    assert b"secret.txt" not in r.stdout and set(listing) <= {b".", b"..", b"tools"}
    assert not (hidden / "x").exists() and os.stat(hidden).st_mode & 0o777 == 0o700


@pytest.mark.parametrize("use_cgroup", [True, False])
async def test_release_skips_the_next_process_scan_only_when_every_process_was_in_a_killed_leaf(wsr, use_cgroup):
    base, ws = wsr
    sup = ProcessSupervisor(use_cgroup=use_cgroup)
    r = await run(base, ws, ["true"], supervisor=sup, policy=ConfinementPolicy(use_cgroup=use_cgroup))
    clean = sup.uses_cgroup
    await sup.aclose()
    with open(f"{_identity.LOCK_DIR}/{r.identity[0]}", "rb") as f:
        assert f.read() == (b"clean\n" if clean else b"held\n")


async def test_client_identity_option_reaches_the_session(tmp_path):
    from sandbox_fs.client import ClientOptions, LocalSandboxClient

    opts = ClientOptions(workspaces_dir=str(tmp_path / "w"), snapshot_dir=str(tmp_path / "s"), identity="host")
    with LocalSandboxClient(opts) as c:
        async with c.create() as s:
            assert s.identity is None
            r = await s.exec(["id", "-u"])
            assert r.stdout == b"0\n" and r.identity is None
        await c.delete(s)


async def test_identity_is_a_process_bound_where_no_pids_controller_is(wsr, monkeypatch):
    """RLIMIT_NPROC binds the leased identity, so 'required' runs even without any cgroup pids controller."""
    base, ws = wsr
    monkeypatch.setattr(_cgroups, "_read_pids_max", lambda leaf: None)
    monkeypatch.setattr(_cgroups, "_find_pids_v1", lambda: None)
    r = await run(base, ws, ["true"])
    assert r.exit_code == 0 and r.process_bounds == ("rlimit.nproc=4096",)
    with pytest.raises(ConfinementError, match="process-count bound"):
        await run(base, ws, ["true"], policy=HOST)  # positive control: uid 0 has no bound here


async def test_host_run_after_an_identity_run_can_write_and_leaves_other_owners_alone(wsr):
    base, ws = wsr
    ws.write_bytes("theirs", b"t")
    r = await run(base, ws, sh("echo a > mine"))
    assert os.stat(base / "ws" / "mine").st_uid == r.identity[0]
    os.chown(base / "ws" / "theirs", 1234, 1234)  # some other owner (a caller-owned workspace)
    r0 = await run(base, ws, sh("echo b >> mine && mkdir d && echo ok"), policy=HOST)
    assert r0.stdout == b"ok\n", r0.stderr  # the identity's entries went back to uid 0 for it
    assert os.stat(base / "ws" / "mine").st_uid == 0 and os.stat(base / "ws" / "theirs").st_uid == 1234


async def test_session_creates_entries_owned_by_its_identity(client):
    """The session's workspace Root carries the leased identity as owner: no re-own needed."""
    async with client.create() as s:
        await s.mkdir("d/e", parents=True)
        await s.write("d/e/f.txt", b"x")
        ws = os.path.join(client.options.workspaces_dir, s.id)
        for rel in ("d", "d/e", "d/e/f.txt"):
            st = os.lstat(os.path.join(ws, rel))
            assert (st.st_uid, st.st_gid) == s.identity, rel
    await client.delete(s)


# ------------------------------------------------------------------ sticky ids (issue 16: layers stay small)


#: 16 ids per test process, above the default range's low end where other tests lease (a parallel run
#: of this file in another process takes other ids)
_PRIVATE = 0x70030000 + (os.getpid() % 4096) * 16


async def test_a_resumed_session_keeps_its_id_so_its_next_layer_stays_small(tmp_path):
    """A session that got the second id (the first was held) keeps it on resume, though the first is free again.

    Before the fix the resume leased the lowest free id, the next command re-owned
    every entry (a new ctime each) and the persist wrote the whole tree again.
    """
    from sandbox_fs.client import ClientOptions, LocalSandboxClient

    base = _PRIVATE
    opts = ClientOptions(workspaces_dir=str(tmp_path / "w"), snapshot_dir=str(tmp_path / "s"),
                         identity_range=(base, 2))
    tree = {f"d{i % 4}/f{i}": os.urandom(8192) for i in range(32)}  # 256 KiB of incompressible content
    with LocalSandboxClient(opts) as c:
        with _identity.lease(base, 1) as other:  # another session holds the lowest id
            async with c.create() as s:
                for path, data in tree.items():
                    await s.write(path, data, parents=True)
                assert (await s.exec(["true"])).exit_code == 0
                assert s.identity == (base + 1, base + 1) and other.held
        state = c.serialize_state(s)
        sizes = []
        for run in range(2):  # the lowest id is free now: the session still takes its own
            time.sleep(0.012)  # past the coarse clock's tick (the racy rule re-reads same-tick files)
            async with c.resume(state) as s:
                assert s.identity == (base + 1, base + 1), run
                await s.write(f"new{run}", b"x" * 100)
                assert (await s.exec(["true"])).exit_code == 0
            state = c.serialize_state(s)
            info = c.store.info(s.id)
            sizes.append((info.chain_length, info.archive_bytes))
        await c.delete(s)
    assert all(length >= 2 and size < 64 * 1024 for length, size in sizes), sizes  # layers, not the tree


_HELD, _BELOW, _ABOVE = "held", "below", "above"


@pytest.mark.parametrize("prefer", [0, 65534, _BELOW, _ABOVE, _HELD, "free-second", 0x7FFFFFFF, -1, None])
def test_a_preferred_id_never_breaks_exclusivity_or_the_range(prefer):
    """Whatever id the caller prefers (a workspace's owner: hostile), the lease is in range and exclusive."""
    base = _PRIVATE + 3
    with _identity.lease(base, 1) as other:  # a live lease of the lowest id
        want = {_HELD: base, _BELOW: base - 1, _ABOVE: base + 3, "free-second": base + 2}.get(prefer, prefer)
        with _identity.lease(base, 3, prefer=want) as got:
            assert base <= got.uid < base + 3 and got.uid != other.uid and other.held
            assert not lock_is_free(got.uid)
            # the preferred id when it is free and in range; else the lowest free one
            assert got.uid == (base + 2 if prefer == "free-second" else base + 1)
            with _identity.lease(base, 3, prefer=got.uid) as third:  # held by us now: never shared
                assert third.uid == base + 2 - (prefer == "free-second") and third.uid not in (got.uid, other.uid)
    with pytest.raises(_identity.IdentityUnavailableError), _identity.lease(base, 1):
        _identity.lease(base, 1, prefer=base)  # the only id, held: preferring it does not share it


async def test_a_workspace_chowned_to_a_held_outside_or_root_id_gets_an_exclusive_in_range_id(tmp_path):
    """The workspace's owner is only a hint: chowned to a held id, an id outside the range or 0, the lease is still fresh."""
    from sandbox_fs.client import ClientOptions, LocalSandboxClient

    base = _PRIVATE + 6
    opts = ClientOptions(workspaces_dir=str(tmp_path / "w"), snapshot_dir=str(tmp_path / "s"),
                         identity_range=(base, 2))
    with LocalSandboxClient(opts) as c:
        async with c.create() as s:
            await s.write("f", b"x")
        state = c.serialize_state(s)
        ws = os.path.join(opts.workspaces_dir, s.id)
        assert os.stat(ws).st_uid == base
        with _identity.lease(base + 1, 1) as other:
            for owner in (base + 1, base + 2, 0):  # held by another; outside the range; root
                os.chown(ws, owner, owner)
                async with c.resume(state) as r:
                    assert r.identity == (base, base) and r.identity[0] != other.uid, owner
                    assert not lock_is_free(base) and other.held
                    assert await r.read("f") == b"x"
                state = c.serialize_state(r)
        await c.delete(r)
