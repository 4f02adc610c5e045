"""Confinement escapes found by review (issue 6 follow-up): each closed as a class.

Every test checks the outside effect (the host listener, segment, key, cgroup
or file) and has a positive control showing the same child does reach it
when the layer under test is off, so the test can fail.  Only loopback
addresses are used; every process, segment, key and socket made here is
removed.
"""

from __future__ import annotations

import ctypes
import os
import platform
import socket
import stat
import sys
import threading

import pytest
import trio

import sandbox_fs
from sandbox_fs.exec import _landlock
from sandbox_fs import exec as sfs_exec
from sandbox_fs.exec import ConfinementPolicy, ProcessSupervisor, run_confined

ABI = sandbox_fs.features()["landlock_abi"]
HELPER = os.access(sfs_exec.helper_path(), os.X_OK)
ROOT = os.geteuid() == 0
PYTHON = os.path.join(sys.base_prefix, "bin", "python3")

pytestmark = [
    pytest.mark.skipif(not HELPER, reason="sandbox_fs/sfs-exec is not built (pip install -e . builds it)"),
    pytest.mark.skipif(ABI == 0, reason="the kernel has no Landlock"),
]
needs_root = pytest.mark.skipif(not ROOT, reason="needs root (namespaces and cgroup leaves are made as root)")

_SYSCALLS = {"x86_64": {"add_key": 248, "keyctl": 250, "clone3": 435},
             "aarch64": {"add_key": 217, "keyctl": 219, "clone3": 435}}.get(platform.machine())
needs_syscall_table = pytest.mark.skipif(_SYSCALLS is None, reason="syscall numbers known for x86_64/aarch64 only")


async def run(layout, ws, argv, **kw):
    return await run_confined(argv, workspace=ws, workspace_host_path=str(layout.ws), **kw)


async def py(layout, ws, pygrant, code, *args, **kw):
    return await run(layout, ws, [PYTHON, "-c", code, *map(str, args)], grants=pygrant, **kw)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def wait_gone(pid: int, timeout_s: float = 3.0) -> bool:
    with trio.move_on_after(timeout_s):
        while pid_alive(pid):
            await trio.sleep(0.02)
    return not pid_alive(pid)


class Listener:
    """Loopback TCP + UDP listeners on one port, recording what arrives."""

    def __init__(self) -> None:
        self.tcp = socket.socket()
        self.tcp.bind(("127.0.0.1", 0))
        self.tcp.listen(8)
        self.port = self.tcp.getsockname()[1]
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", self.port))
        self.udp.settimeout(0.2)
        self.got: list[bytes] = []
        self._t = threading.Thread(target=self._accept, daemon=True)
        self._t.start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.tcp.accept()
            except OSError:
                return
            with c:
                c.settimeout(1)
                data = b""
                try:
                    while chunk := c.recv(100):
                        data += chunk
                except OSError:
                    pass
                self.got.append(data)

    def udp_got(self) -> list[bytes]:
        out = []
        try:
            while True:
                out.append(self.udp.recv(100))
        except OSError:
            return out

    def close(self) -> None:
        self.tcp.close()
        self.udp.close()
        self._t.join(2)


@pytest.fixture
def world_tmp():
    """A temp dir an unprivileged uid can traverse (pytest's tmp_path is 0700 root)."""
    import shutil
    import tempfile
    from pathlib import Path

    d = tempfile.mkdtemp(prefix="sfs-exec-nb-")
    os.chmod(d, 0o755)
    yield Path(d)
    shutil.rmtree(d)


@pytest.fixture
def listener():
    lis = Listener()
    yield lis
    lis.close()


# ------------------------------------------------------------- 1. leaving the cgroup

def _cgroup2_mount() -> str | None:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            sep = parts.index("-")
            if parts[sep + 1] == "cgroup2":
                return parts[4]
    return None


ESCAPE = """
import ctypes, os, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
try:
    fd = os.open(sys.argv[1], os.O_PATH | os.O_DIRECTORY)
except OSError as e:
    print("open-errno", e.errno); sys.exit(0)
args = struct.pack("11Q", 0x200000000, 0, 0, 0, 17, 0, 0, 0, 0, 0, fd)
buf = ctypes.create_string_buffer(args)
pid = libc.syscall(int(sys.argv[2]), buf, len(args))
if pid == 0:
    os.setsid()
    os.execv("/bin/sleep", ["sleep", "997"])
if pid < 0:
    print("clone3-errno", ctypes.get_errno()); sys.exit(0)
print("escaped", pid, os.readlink("/proc/self/ns/pid"))
"""


@needs_root
@needs_syscall_table
async def test_clone_into_the_root_cgroup_is_refused(layout, ws, pygrant):
    """clone3(CLONE_INTO_CGROUP) on an O_PATH fd of the cgroup2 root once left the leaf (and kill_all)."""
    mnt = _cgroup2_mount()
    if mnt is None:
        pytest.skip("no cgroup2 mount")
    escaped: list[int] = []
    try:
        async with ProcessSupervisor() as sup:
            if not sup.uses_cgroup:
                pytest.skip("no writable cgroup v2 hierarchy")
            # Positive control: unconfined, the same child leaves its leaf (but not
            # its PID namespace, which ends with the command).
            r0 = await py(layout, ws, pygrant, ESCAPE, mnt, _SYSCALLS["clone3"], confinement="none", supervisor=sup)
            assert r0.stdout.startswith(b"escaped"), r0.stdout + r0.stderr
            await sup.kill_all()
            ns = r0.stdout.split()[2].decode()
            with trio.fail_after(3):
                while any(os.readlink(f"/proc/{p}/ns/pid") == ns and pid_alive(int(p))
                          for p in os.listdir("/proc") if p.isdigit() and os.path.exists(f"/proc/{p}/ns/pid")):
                    await trio.sleep(0.02)
            # Confined: cgroupfs is hidden, and the child's cgroup namespace is rooted at its leaf.
            r = await py(layout, ws, pygrant, ESCAPE, mnt, _SYSCALLS["clone3"], supervisor=sup)
            assert not r.stdout.startswith(b"escaped"), r.stdout
            assert r.stdout.strip() == b"open-errno 2", r.stdout + r.stderr
            r2 = await run(layout, ws, ["cat", "/proc/self/cgroup"], supervisor=sup)
            lines = r2.stdout.decode().splitlines()
            assert "0::/" in lines and all(ln.endswith(":/") for ln in lines), r2.stdout + r2.stderr
            r3 = await run(layout, ws, ["sh", "-c", "ls -A /sys/fs/cgroup | wc -l"], supervisor=sup)
            assert r3.stdout == b"0\n", r3.stdout + r3.stderr
        # Without a supervisor (a fresh mount namespace per process) the mask is there too.
        r4 = await run(layout, ws, ["sh", "-c", "ls -A /sys/fs/cgroup | wc -l"])
        assert r4.stdout == b"0\n", r4.stdout + r4.stderr
    finally:
        for pid in escaped:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


# ------------------------------------------------------------- 2. network

TCP_TRICKS = """
import socket, sys
port = int(sys.argv[1])
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
try:
    s.sendto(b"TFO", 0x20000000, ("127.0.0.1", port)); s.sendall(b"-more"); print("tfo-ok")
except OSError as e:
    print("tfo-errno", e.errno)
s.close()
try:
    m = socket.socket(socket.AF_INET, socket.SOCK_STREAM, 262)
    m.connect(("127.0.0.1", port)); m.sendall(b"MPTCP"); m.close(); print("mptcp-ok")
except OSError as e:
    print("mptcp-errno", e.errno)
try:
    t = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    t.setsockopt(6, 30, 1); print("tfo-connect-opt-ok")
except OSError as e:
    print("tfo-connect-opt-errno", e.errno)
"""

UDP = """
import socket, sys
try:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.sendto(b"UDP", ("127.0.0.1", int(sys.argv[1]))); print("udp-sent")
except OSError as e:
    print("udp-errno", e.errno)
"""


@pytest.mark.skipif(ABI < 4, reason="Landlock ABI < 4: no TCP rules")
async def test_tcp_fastopen_and_mptcp_do_not_bypass_the_connect_rule(layout, ws, pygrant, listener):
    """With some port allowed (host network), TFO sendto and MPTCP sockets once reached a denied port."""
    other = ConfinementPolicy(allow_tcp_connect=frozenset({1}))  # a port is allowed: host network + seccomp
    r = await py(layout, ws, pygrant, TCP_TRICKS, listener.port, policy=other)
    assert not r.network_isolated
    out = r.stdout.decode()
    assert "tfo-errno 95" in out and "tfo-connect-opt-errno 95" in out, out + r.stderr.decode()
    assert "mptcp-errno 93" in out, out
    await trio.sleep(0.3)
    assert listener.got == []
    # Positive control: without TCP handling the same child gets through.
    r2 = await py(layout, ws, pygrant, TCP_TRICKS, listener.port, policy=ConfinementPolicy(unrestricted_tcp=True))
    assert "tfo-ok" in r2.stdout.decode(), r2.stdout + r2.stderr
    for _ in range(50):
        if any(g.startswith(b"TFO") for g in listener.got):
            break
        await trio.sleep(0.02)
    assert any(g.startswith(b"TFO") for g in listener.got), listener.got


@needs_root
async def test_no_allowed_port_means_no_network_at_all(layout, ws, pygrant, listener):
    """UDP (which Landlock does not cover) reached the host; without allowed ports the child has no network."""
    r = await py(layout, ws, pygrant, UDP, listener.port)
    assert r.network_isolated
    assert r.stdout.startswith(b"udp-errno"), r.stdout + r.stderr
    assert listener.udp_got() == []
    # The host network without allow_udp: seccomp refuses the UDP socket itself.
    r1 = await py(layout, ws, pygrant, UDP, listener.port, policy=ConfinementPolicy(isolate_network=False))
    assert not r1.network_isolated and r1.stdout == b"udp-errno 97\n", r1.stdout + r1.stderr
    assert listener.udp_got() == []
    r2 = await py(layout, ws, pygrant, UDP, listener.port,
                  policy=ConfinementPolicy(isolate_network=False, allow_udp=True))
    assert not r2.network_isolated and r2.stdout == b"udp-sent\n", r2.stderr
    assert listener.udp_got() == [b"UDP"]
    # The supervisor's held network namespace is used too (and nothing leaks between policies).
    async with ProcessSupervisor() as sup:
        r3 = await py(layout, ws, pygrant, UDP, listener.port, supervisor=sup)
        assert r3.network_isolated and r3.stdout.startswith(b"udp-errno"), r3.stdout
        r4 = await py(layout, ws, pygrant, UDP, listener.port, supervisor=sup,
                      policy=ConfinementPolicy(allow_tcp_connect=frozenset({1}), allow_udp=True))
        assert not r4.network_isolated and r4.stdout == b"udp-sent\n", r4.stderr
    assert listener.udp_got() == [b"UDP"]


# ------------------------------------------------------------- 3. unix sockets

UNIX = """
import socket, sys
try:
    s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); s.sendall(b"UNIX"); s.close(); print("unix-ok")
except OSError as e:
    print("unix-errno", e.errno)
try:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    a.connect(sys.argv[1]); print("dgram-pair-ok")
except OSError as e:
    print("dgram-pair-errno", e.errno)
a, b = socket.socketpair(); a.sendall(b"x"); print("stream-pair", b.recv(1).decode())
"""


async def test_pathname_unix_sockets_outside_are_unreachable(layout, ws, pygrant):
    """Landlock (ABI <= 7) does not govern connect() on a socket path: docker.sock, D-Bus ..."""
    import tempfile

    # A socket every uid can reach and connect to (tmp_path sits under a 0700 directory,
    # which the confined identity's mount namespace hides): only seccomp refuses it.
    host = tempfile.mkdtemp(prefix="sfs-sock-")
    os.chmod(host, 0o755)
    path = os.path.join(host, "host.sock")
    got: list[bytes] = []
    with socket.socket(socket.AF_UNIX) as srv:
        srv.bind(path)
        os.chmod(path, 0o777)
        srv.listen(4)
        srv.settimeout(0.3)
        r = await py(layout, ws, pygrant, UNIX, path)
        assert r.stdout == b"unix-errno 97\ndgram-pair-errno 97\nstream-pair x\n", r.stdout + r.stderr
        with pytest.raises(OSError):
            srv.accept()
        # Positive control: with unix sockets allowed the host socket is reached.
        r2 = await py(layout, ws, pygrant, UNIX, path, policy=ConfinementPolicy(allow_unix_sockets=True))
        assert r2.stdout.startswith(b"unix-ok\n"), r2.stdout + r2.stderr
        c, _ = srv.accept()
        with c:
            got.append(c.recv(10))
    os.unlink(path)
    os.rmdir(host)
    assert got == [b"UNIX"]


# ------------------------------------------------------------- 4. System V IPC

SHM = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
i = libc.shmget(int(sys.argv[1]), 0, 0)
print("shm-found" if i >= 0 else f"shm-errno {ctypes.get_errno()}")
"""


@needs_root
async def test_host_system_v_ipc_is_not_shared(layout, ws, pygrant):
    libc = ctypes.CDLL(None, use_errno=True)
    key = int.from_bytes(os.urandom(3), "big") | 0x5F000000
    shmid = libc.shmget(key, 4096, 0o1000 | 0o600)  # IPC_CREAT, owner only
    assert shmid >= 0, ctypes.get_errno()
    try:
        r0 = await py(layout, ws, pygrant, SHM, key, confinement="none")
        assert r0.stdout == b"shm-found\n", r0.stderr  # positive control
        r = await py(layout, ws, pygrant, SHM, key)
        assert r.stdout == b"shm-errno 2\n", r.stdout + r.stderr
        async with ProcessSupervisor() as sup:  # the supervisor's held IPC namespace
            r2 = await py(layout, ws, pygrant, SHM, key, supervisor=sup)
            assert r2.stdout == b"shm-errno 2\n", r2.stdout + r2.stderr
    finally:
        libc.shmctl(shmid, 0, None)  # IPC_RMID


# ------------------------------------------------------------- 5. kernel keyrings

KEY = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
kid = libc.syscall(int(sys.argv[1]), 10, -4, b"user", sys.argv[2].encode(), 0)  # KEYCTL_SEARCH @u
if kid < 0:
    print("search-errno", ctypes.get_errno()); sys.exit(0)
buf = ctypes.create_string_buffer(64)
n = libc.syscall(int(sys.argv[1]), 11, kid, buf, 64)  # KEYCTL_READ
print("read", buf.raw[:max(n, 0)].decode())
"""


@needs_root
@needs_syscall_table
async def test_host_keyrings_are_unreachable(layout, ws, pygrant):
    libc = ctypes.CDLL(None, use_errno=True)
    desc = "sfs-test-" + os.urandom(4).hex()
    secret = b"KEY-" + os.urandom(6).hex().encode()
    kid = libc.syscall(_SYSCALLS["add_key"], b"user", desc.encode(), secret, len(secret), -4)
    if kid < 0:
        pytest.skip(f"add_key failed (errno {ctypes.get_errno()}): no keyrings here")
    try:
        r0 = await py(layout, ws, pygrant, KEY, _SYSCALLS["keyctl"], desc, confinement="none")
        assert r0.stdout == b"read " + secret + b"\n", r0.stdout + r0.stderr  # positive control
        r = await py(layout, ws, pygrant, KEY, _SYSCALLS["keyctl"], desc)
        assert r.stdout == b"search-errno 1\n", r.stdout + r.stderr
    finally:
        libc.syscall(_SYSCALLS["keyctl"], 21, kid)  # KEYCTL_INVALIDATE


# ------------------------------------------------------------- 6. private files nested in /etc

def _covered(path: str, rules) -> bool:
    return any(path == r.host_path or path.startswith(r.host_path.rstrip("/") + "/") for r in rules)


def test_etc_rules_grant_only_world_readable_files_at_any_depth(tmp_path, monkeypatch):
    etc = tmp_path / "etc"
    (etc / "a" / "deep").mkdir(parents=True)
    (etc / "a" / "pub.conf").write_text("x")
    (etc / "a" / "deep" / "priv").write_text("x")
    os.chmod(etc / "a" / "deep" / "priv", 0o600)
    (etc / "a" / "deep" / "ok").write_text("x")
    (etc / "b").mkdir(mode=0o700)
    (etc / "b" / "inner").write_text("x")
    (etc / "c" / "sub").mkdir(parents=True)
    (etc / "c" / "sub" / "f").write_text("x")
    os.symlink("a/deep/priv", etc / "to-priv")
    os.symlink("a/pub.conf", etc / "to-pub")
    os.chmod(etc / "b", 0o700)
    rules = _landlock._etc_rules(str(etc))
    names = {os.path.relpath(r.host_path, etc) for r in rules}
    assert names == {"a/pub.conf", "a/deep/ok", "c", "to-pub"}
    # Bounded: a tiny budget gives fewer rules, never a private one.
    monkeypatch.setattr(_landlock, "ETC_MAX_ENTRIES", 3)
    small = _landlock._etc_rules(str(etc))
    assert len(small) < len(rules)
    assert not _covered(str(etc / "a" / "deep" / "priv"), small)


def test_real_etc_rules_cover_no_private_file():
    """Every file the /etc rules cover is world-readable (walks what the rules grant)."""
    rules = _landlock._etc_rules()
    assert len(rules) <= _landlock.ETC_MAX_RULES
    for r in rules:
        st = os.stat(r.host_path)
        if not stat.S_ISDIR(st.st_mode):
            assert st.st_mode & 0o004, r
            continue
        for dirpath, dirnames, filenames in os.walk(r.host_path):
            for n in filenames + dirnames:
                p = os.path.join(dirpath, n)
                lst = os.lstat(p)
                if stat.S_ISLNK(lst.st_mode):
                    continue
                want = 0o005 if stat.S_ISDIR(lst.st_mode) else 0o004
                assert lst.st_mode & want == want, p


def _private_nested_etc_file() -> tuple[str, str] | None:
    """A non-world-readable regular file two levels down in /etc, and a readable sibling."""
    for dirpath, _dirs, files in os.walk("/etc"):
        if dirpath == "/etc" or os.stat(dirpath).st_mode & 0o005 != 0o005:
            continue
        priv = pub = None
        for n in files:
            p = os.path.join(dirpath, n)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                if st.st_mode & 0o004:
                    pub = pub or p
                else:
                    priv = priv or p
        if priv and pub and "/ssl/private" not in priv:
            return priv, pub
    return None


@needs_root
async def test_private_file_nested_in_etc_unreadable(layout, ws):
    """/etc/default/cacerts (0600) was readable: world-readability was checked on top-level entries only."""
    found = _private_nested_etc_file()
    if found is None:
        pytest.skip("no non-world-readable file nested in a readable /etc directory here")
    priv, pub = found
    r = await run(layout, ws, ["sh", "-c", f"cat '{pub}' >/dev/null && echo pub-ok; cat '{priv}' >/dev/null"])
    assert r.stdout == b"pub-ok\n", r.stderr
    assert b"Permission denied" in r.stderr
    r0 = await run(layout, ws, ["sh", "-c", f"cat '{priv}' >/dev/null && echo priv-ok"], confinement="none")
    assert r0.stdout == b"priv-ok\n"  # positive control: uid 0 passes the owner check


# ------------------------------------------------------------- unprivileged host

def test_helper_layers_work_unprivileged(world_tmp):
    """Masks, IPC/net namespaces and the seccomp filter also apply inside the user namespace."""
    import shutil
    import subprocess

    if not ROOT or shutil.which("setpriv") is None:
        pytest.skip("needs root to switch to an unprivileged uid with setpriv")
    base = world_tmp / "nb"
    (base / "ws").mkdir(parents=True)
    os.chown(base / "ws", 65534, 65534)
    flags = 0x40000000 | 0x08000000
    script = "ls -A /sys/fs/cgroup | wc -l; grep -c : /proc/self/net/dev; grep -c lo: /proc/self/net/dev; echo ok > f && cat f"
    inner = (f"exec 7<{base}/ws; cd /; exec {sfs_exec.helper_path()} --ro-mounts --rw-tree 7 --cwd 7 "
             f"--mask /sys/fs/cgroup --unshare {flags} --seccomp 3 -- sh -c '{script}'")
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash", "-c", inner],
                       capture_output=True, timeout=30)
    if b"sfs-exec: mounts:" in r.stderr and r.returncode == 127:
        pytest.skip("user namespaces are not available to unprivileged users here")
    assert r.stdout == b"0\n1\n1\nok\n", r.stdout + r.stderr
