"""The seccomp allow-list of confined commands (issue 11, part C).

* socket families: every ``AF_*`` number the kernel knows (and some it does
  not yet) x the socket types, through ``socket()`` and ``socketpair()``:
  only the policy's triples are created, everything else gets
  ``EAFNOSUPPORT``;
* the reproductions: ``socketpair(AF_UNIX, SOCK_RAW)`` + ``sendto()`` a host
  datagram socket (which must receive nothing), and a VM-wide vsock listener;
* syscalls: unknown and newer ones get ``ENOSYS`` (``openat2`` and ``clone3``
  included, and a real program falls back), privileged ones ``EPERM``;
* a realistic toolchain (sh, coreutils, tar, gcc, git, python with threads
  and subprocess) works under the filter.

Attack tests check an outside sentinel (the host socket) and have a positive
control showing the same child reaches it when the policy allows it.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import sys
import tempfile

import pytest
import trio

import sandbox_fs
from sandbox_fs import exec as sfs_exec
from sandbox_fs.exec import ConfinementPolicy, ProcessSupervisor, run_confined

ABI = sandbox_fs.features()["landlock_abi"]
HELPER = os.access(sfs_exec.helper_path(), os.X_OK)
PYTHON = os.path.join(sys.base_prefix, "bin", "python3")

pytestmark = [
    pytest.mark.skipif(not HELPER, reason="sandbox_fs/sfs-exec is not built (pip install -e . builds it)"),
    pytest.mark.skipif(ABI == 0, reason="the kernel has no Landlock (the filter comes with confinement)"),
]

_NR = {"x86_64": {"openat2": 437, "clone3": 435, "io_uring_setup": 425, "unshare": 272, "mount": 165,
                  "keyctl": 250, "bpf": 321, "personality": 135, "unknown": 499, "fchmodat2": 452},
       "aarch64": {"openat2": 437, "clone3": 435, "io_uring_setup": 425, "unshare": 97, "mount": 40,
                   "keyctl": 219, "bpf": 280, "personality": 92, "unknown": 499, "fchmodat2": 452},
       }.get(platform.machine())
needs_nr = pytest.mark.skipif(_NR is None, reason="syscall numbers are known here for x86_64/aarch64 only")

AF_UNIX, AF_INET, AF_INET6, AF_NETLINK, AF_VSOCK = 1, 2, 10, 16, 40
STREAM, DGRAM, RAW, RDM, SEQPACKET, DCCP, PACKET = 1, 2, 3, 4, 5, 6, 10
TYPES = (STREAM, DGRAM, RAW, RDM, SEQPACKET, DCCP, PACKET)
#: AF_MAX is 46 on Linux 6.x; the numbers above it must be refused too.
FAMILIES = range(0, 64)
FLAGS = socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC


async def run(layout, ws, argv, **kw):
    return await run_confined(argv, workspace=ws, workspace_host_path=str(layout.ws), **kw)


async def py(layout, ws, pygrant, code, *args, **kw):
    return await run(layout, ws, [PYTHON, "-c", code, *map(str, args)], grants=pygrant, **kw)


# ------------------------------------------------------------- socket families

SOCKET_TABLE = """
import json, socket, sys
families, types, flags = json.loads(sys.argv[1])
out = {}
for fam in families:
    for typ in types:
        for extra in (0, flags):
            for call in ("s", "p"):
                try:
                    if call == "s":
                        socket.socket(fam, typ | extra, 0).close()
                    else:
                        a, b = socket.socketpair(fam, typ | extra, 0); a.close(); b.close()
                    res = 0
                except OSError as e:
                    res = e.errno
                out[f"{call}:{fam}:{typ}:{extra}"] = res
print(json.dumps(out))
"""


def allowed_pairs(policy: ConfinementPolicy) -> set[tuple[str, int, int]]:
    """The (call, family, type) pairs the policy documents as allowed (protocol 0)."""
    out = {("p", AF_UNIX, STREAM), ("p", AF_UNIX, SEQPACKET)}
    if policy.allow_tcp_connect or policy.allow_tcp_bind or policy.unrestricted_tcp:
        out |= {("s", AF_INET, STREAM), ("s", AF_INET6, STREAM)}
    if policy.allow_unix_sockets:
        out |= {("s", AF_UNIX, t) for t in (STREAM, DGRAM, SEQPACKET)} | {("p", AF_UNIX, DGRAM)}
    if policy.allow_udp:
        out |= {("s", AF_INET, DGRAM), ("s", AF_INET6, DGRAM)}
    for fam, typ, proto in policy.extra_sockets:
        if proto in (None, 0):
            out.add(("s", fam, typ))
    return out


POLICIES = {
    "default": {},
    "tcp": {"allow_tcp_connect": frozenset({1})},
    "unix+udp": {"allow_unix_sockets": True, "allow_udp": True},
    "vsock": {"extra_sockets": frozenset({(AF_VSOCK, STREAM, None)})},
}


@pytest.mark.parametrize("name", sorted(POLICIES))
async def test_every_family_outside_the_allow_list_gets_eafnosupport(layout, ws, pygrant, name):
    """Every AF_* number x type x {no flags, NONBLOCK|CLOEXEC}, for socket() and socketpair()."""
    policy = ConfinementPolicy(**POLICIES[name])
    spec = json.dumps([list(FAMILIES), list(TYPES), FLAGS])
    r = await py(layout, ws, pygrant, SOCKET_TABLE, spec, policy=policy)
    assert r.exit_code == 0, r.stderr
    got = json.loads(r.stdout)
    allowed = allowed_pairs(policy)
    wrong = {}
    for key, res in got.items():
        call, fam, typ, _extra = key.split(":")
        if (call, int(fam), int(typ)) in allowed:
            continue            # the kernel decides (0, or its own error for an odd pair)
        if res != 97:                   # EAFNOSUPPORT
            wrong[key] = res
    assert not wrong, f"created or refused with another errno than EAFNOSUPPORT: {sorted(wrong.items())[:20]}"
    # Each allowed pair works (or fails in the kernel, never in the filter).
    for call, fam, typ in allowed:
        assert got[f"{call}:{fam}:{typ}:0"] != 97, (call, fam, typ)
    assert got[f"p:{AF_UNIX}:{STREAM}:0"] == 0 and got[f"p:{AF_UNIX}:{SEQPACKET}:{FLAGS}"] == 0


RAW_PAIR = """
import array, os, socket, sys
path = sys.argv[1]
for label, make in (("raw-pair", lambda: socket.socketpair(socket.AF_UNIX, socket.SOCK_RAW)[0]),
                    ("dgram-pair", lambda: socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)[0]),
                    ("dgram", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM))):
    try:
        s = make()
    except OSError as e:
        print(label, "errno", e.errno)
        continue
    r, w = os.pipe()
    s.sendmsg([label.encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r]))], 0, path)
    print(label, "sent")
"""


async def test_unix_raw_socketpair_cannot_reach_a_host_socket(layout, ws, pygrant):
    """socketpair(AF_UNIX, SOCK_RAW) is a datagram pair in the kernel; sendto() reached any path."""
    d = tempfile.mkdtemp(prefix="sfs-seccomp-")
    os.chmod(d, 0o755)  # reachable by the confined identity (a root host's command is not uid 0)
    try:
        path = os.path.join(d, "host.sock")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as host:
            host.bind(path)
            os.chmod(path, 0o777)  # only seccomp stands between the child and the socket
            host.setblocking(False)
            r = await py(layout, ws, pygrant, RAW_PAIR, path)
            assert r.stdout == b"raw-pair errno 97\ndgram-pair errno 97\ndgram errno 97\n", r.stdout + r.stderr
            with pytest.raises(BlockingIOError):
                host.recv(100)          # the sentinel received nothing
            # Positive control: with unix sockets allowed the same child reaches it, fd included.
            r2 = await py(layout, ws, pygrant, RAW_PAIR, path, policy=ConfinementPolicy(allow_unix_sockets=True))
            assert b"dgram-pair sent" in r2.stdout, r2.stdout + r2.stderr
            msg, anc, _flags, _addr = host.recvmsg(100, socket.CMSG_SPACE(4))
            assert msg in (b"raw-pair", b"dgram-pair") and anc and anc[0][1] == socket.SCM_RIGHTS
            for _lvl, _typ, data in anc:
                os.close(int.from_bytes(data[:4], sys.byteorder))
    finally:
        shutil.rmtree(d)


VSOCK = """
import socket, sys
try:
    s = socket.socket(40, socket.SOCK_STREAM)
    s.bind((0xFFFFFFFF, int(sys.argv[1])))   # VMADDR_CID_ANY: every CID of this VM
    s.listen(1)
    print("listening")
except OSError as e:
    print("errno", e.errno)
"""


async def test_vsock_listen_fails(layout, ws, pygrant):
    """AF_VSOCK is not network-namespaced: a listener would be VM-wide."""
    r = await py(layout, ws, pygrant, VSOCK, 50123)
    assert r.stdout == b"errno 97\n", r.stdout + r.stderr
    # Positive control: the policy field opens it (when this kernel has vsock at all).
    r2 = await py(layout, ws, pygrant, VSOCK, 50123,
                  policy=ConfinementPolicy(extra_sockets=frozenset({(AF_VSOCK, STREAM, None)})))
    assert r2.stdout == b"listening\n" or r2.stdout.startswith(b"errno") and r2.stdout != b"errno 97\n", r2.stdout


PROTO = """
import socket, sys
for proto in (0, 6, 262, 132):   # TCP, TCP, MPTCP, SCTP
    try:
        socket.socket(socket.AF_INET, socket.SOCK_STREAM, proto).close(); print(proto, "ok")
    except OSError as e:
        print(proto, e.errno)
"""


async def test_tcp_stream_only_with_tcp_protocols(layout, ws, pygrant):
    """With a TCP port allowed: protocol 0/TCP only; MPTCP and SCTP get EPROTONOSUPPORT (93)."""
    r = await py(layout, ws, pygrant, PROTO, policy=ConfinementPolicy(allow_tcp_connect=frozenset({1})))
    assert r.stdout == b"0 ok\n6 ok\n262 93\n132 93\n", r.stdout + r.stderr
    r = await py(layout, ws, pygrant, PROTO)
    assert r.stdout == b"0 97\n6 97\n262 97\n132 97\n", r.stdout + r.stderr


def test_socket_args_validation():
    with pytest.raises(ValueError):
        ConfinementPolicy(extra_sockets=frozenset({(1, 2)})).socket_args()
    with pytest.raises(ValueError):
        ConfinementPolicy(extra_sockets=frozenset({(1, 2, -1)})).socket_args()
    with pytest.raises(ValueError):
        ConfinementPolicy(extra_sockets=frozenset((40, t, p) for t in range(8) for p in range(5))).socket_args()
    assert ConfinementPolicy().socket_args() == ["--socket", "p:1:1:*", "--socket", "p:1:5:*"]


# ------------------------------------------------------------- syscalls

SYSCALLS = """
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
nr, names = json.loads(sys.argv[1]), sys.argv[2].split(",")
buf = ctypes.create_string_buffer(512)
calls = {
    "openat2": (nr["openat2"], -100, b"/", ctypes.addressof(buf), 24),
    "clone3": (nr["clone3"], ctypes.addressof(buf), 0),      # size 0: EINVAL if it ran
    "io_uring_setup": (nr["io_uring_setup"], 1, ctypes.addressof(buf)),
    "unshare": (nr["unshare"], 0x10000000),                   # CLONE_NEWUSER
    "mount": (nr["mount"], b"none", b"/", b"tmpfs", 0, 0),
    "keyctl": (nr["keyctl"], 0, -3, 0),                      # KEYCTL_GET_KEYRING_ID
    "bpf": (nr["bpf"], 0, 0, 0),
    "personality": (nr["personality"], 0x0040000),             # ADDR_NO_RANDOMIZE
    "unknown": (nr["unknown"],),
}
out = {}
for name in names:
    args = calls[name]
    ctypes.set_errno(0)
    rc = libc.syscall(*[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    out[name] = 0 if rc >= 0 else ctypes.get_errno()
print(json.dumps(out))
"""


@needs_nr
async def test_unknown_and_unseen_syscalls_enosys_privileged_eperm(layout, ws, pygrant):
    names = "openat2,clone3,io_uring_setup,unshare,mount,keyctl,bpf,personality,unknown"
    r = await py(layout, ws, pygrant, SYSCALLS, json.dumps(_NR), names)
    assert r.exit_code == 0, r.stderr
    got = json.loads(r.stdout)
    assert got == {"openat2": 38, "clone3": 38, "io_uring_setup": 38, "unshare": 1, "mount": 1,
                   "keyctl": 1, "bpf": 1, "personality": 1, "unknown": 38}, got
    # Positive control: unconfined, clone3 and openat2 reach the kernel (not ENOSYS).
    r0 = await py(layout, ws, pygrant, SYSCALLS, json.dumps(_NR), "openat2,clone3", confinement="none")
    got0 = json.loads(r0.stdout)
    assert got0["clone3"] != 38 and got0["openat2"] != 38, got0


FALLBACK = """
import sandbox_fs
print(sandbox_fs.features()["openat2"], sandbox_fs._native.choose_resolver())
with sandbox_fs.open_root(".") as r:
    r.write_bytes("made-by-fallback", b"ok")
    print(r.read_bytes("made-by-fallback").decode())
"""


async def test_openat2_enosys_and_a_real_program_falls_back(layout, ws, pygrant):
    """sandbox_fs itself probes openat2 and falls back on the component walker on ENOSYS."""
    import sandbox_fs as pkg

    src = os.path.dirname(os.path.dirname(os.path.abspath(pkg.__file__)))
    site = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]
    grants = list(pygrant)
    roots = [sandbox_fs.open_root(p, read_only=True) for p in [src, *site]]
    try:
        grants += [(r, True) for r in roots]
        env = {"PYTHONPATH": os.pathsep.join([src, *site])}
        r = await run(layout, ws, [PYTHON, "-c", FALLBACK], grants=grants, env=env)
        assert r.stdout == b"False fallback\nok\n", r.stdout + r.stderr
        assert (layout.ws / "made-by-fallback").read_bytes() == b"ok"
        r0 = await run(layout, ws, [PYTHON, "-c", FALLBACK], grants=grants, env=env, confinement="none")
        assert r0.stdout.startswith(b"True openat2\n"), r0.stdout + r0.stderr
    finally:
        for root in roots:
            root.close()


# ------------------------------------------------------------- real programs

TOOLCHAIN = r"""
set -e
cd "$HOME"
mkdir -p src/sub && echo hello > src/sub/a.txt && ln -s sub/a.txt src/link
cp -a src copy && test -L copy/link && cat copy/sub/a.txt
install -m 0755 copy/sub/a.txt inst.txt && test -x inst.txt
tar -cf t.tar src && mkdir x && tar -xf t.tar -C x && cat x/src/sub/a.txt
printf '#include <stdio.h>\n#include <pthread.h>\nstatic void *f(void *a){return a;}\nint main(void){pthread_t t;pthread_create(&t,0,f,0);pthread_join(t,0);puts("compiled-ok");return 0;}\n' > c.c
gcc -O1 -pthread -o c c.c && ./c
git init -q repo && cd repo && echo data > f && git add f
git -c user.name=t -c user.email=t@example.invalid commit -q -m init && git log --oneline | wc -l
cd .. && "$PY" -c 'import threading, subprocess, concurrent.futures as cf
with cf.ThreadPoolExecutor(4) as ex: print(sum(ex.map(lambda i: i, range(10))))
print(subprocess.run(["sh", "-c", "echo sub-ok"], capture_output=True, text=True).stdout.strip())'
"""


async def test_realistic_toolchain_under_the_filter(layout, ws, pygrant):
    missing = [t for t in ("sh", "cp", "install", "tar", "gcc", "git") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"tools missing on this machine: {missing}")
    r = await run(layout, ws, ["/bin/sh", "-c", TOOLCHAIN], grants=pygrant, env={"PY": PYTHON},
                  timeout_s=120)
    assert r.exit_code == 0, r.stdout + r.stderr
    assert r.stdout == b"hello\nhello\ncompiled-ok\n1\n45\nsub-ok\n", r.stdout + r.stderr


async def test_filter_also_under_a_supervisor(layout, ws, pygrant):
    """The held namespaces of a supervisor take the same filter (and its socket rules)."""
    async with ProcessSupervisor() as sup:
        r = await py(layout, ws, pygrant, VSOCK, 50124, supervisor=sup)
        assert r.stdout == b"errno 97\n", r.stdout + r.stderr
        r = await run(layout, ws, ["/bin/sh", "-c", "echo ok"], supervisor=sup)
        assert r.stdout == b"ok\n"
    await trio.lowlevel.checkpoint()


# ------------------------------------------------------------- the filter itself

_X86 = {"arch": 0xC000003E, "openat": 257, "open": 2, "creat": 85, "mkdir": 83, "mkdirat": 258,
        "mknod": 133, "mknodat": 259, "chmod": 90, "fchmod": 91, "fchmodat": 268, "fchmodat2": 452,
        "socket": 41, "socketpair": 53, "clone": 56, "clone3": 435, "openat2": 437, "read": 0}
#: (syscall, index of the mode argument, index of the flags argument or None)
_MODE_ARGS = [("openat", 3, 2), ("open", 2, 1), ("creat", 1, None), ("mkdir", 1, None),
              ("mkdirat", 2, None), ("mknod", 1, None), ("mknodat", 2, None), ("chmod", 1, None),
              ("fchmod", 1, None), ("fchmodat", 2, None), ("fchmodat2", 2, None)]
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000


def _read_filter(argv: list[str]) -> list[tuple[int, int, int, int]]:
    """Start the helper on a sleeping target and read its filter back (PTRACE_SECCOMP_GET_FILTER)."""
    import ctypes
    import struct
    import subprocess
    import time

    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    p = subprocess.Popen([sfs_exec.helper_path(), *argv, "--", "/bin/sleep", "10"])
    try:
        for _ in range(200):            # until the target runs (its comm is "sleep")
            with open(f"/proc/{p.pid}/comm") as f:
                if f.read().strip() == "sleep":
                    break
            time.sleep(0.01)
        if libc.ptrace(16, p.pid, None, None) < 0:                      # PTRACE_ATTACH
            pytest.skip(f"ptrace attach refused ({os.strerror(ctypes.get_errno())})")
        os.waitpid(p.pid, 0)
        n = libc.ptrace(0x420C, p.pid, None, None)                       # PTRACE_SECCOMP_GET_FILTER
        assert n > 0, os.strerror(ctypes.get_errno())
        buf = ctypes.create_string_buffer(8 * n)
        assert libc.ptrace(0x420C, p.pid, None, buf) == n
        return [struct.unpack_from("HBBI", buf.raw, 8 * i) for i in range(n)]
    finally:
        p.kill()
        p.wait()


def _decide(prog, nr: int, args=(0,) * 6, arch: int = _X86["arch"]) -> int:
    """Run a classic-BPF seccomp program on one seccomp_data (the subset the helper emits)."""
    import struct

    data = struct.pack("IIQ6Q", nr, arch, 0, *[a & (2**64 - 1) for a in args])
    acc = pc = 0
    for _ in range(10_000):
        code, jt, jf, k = prog[pc]
        cls, op = code & 7, code & 0xF0
        if cls == 0:                            # BPF_LD | BPF_W | BPF_ABS
            acc, pc = struct.unpack_from("I", data, k)[0], pc + 1
        elif cls == 4 and op == 0x50:           # BPF_ALU | BPF_AND | BPF_K
            acc, pc = acc & k, pc + 1
        elif cls == 5 and op == 0:              # BPF_JA
            pc += 1 + k
        elif cls == 5:
            cond = {0x10: acc == k, 0x20: acc > k, 0x30: acc >= k, 0x40: bool(acc & k)}[op]
            pc += 1 + (jt if cond else jf)
        elif cls == 6:
            return k
        else:
            raise AssertionError(f"unexpected BPF instruction {code:#x}")
    raise AssertionError("the filter did not return")


@pytest.mark.skipif(platform.machine() != "x86_64", reason="syscall numbers of this check are x86_64's")
@pytest.mark.skipif(os.geteuid() != 0, reason="PTRACE_SECCOMP_GET_FILTER needs CAP_SYS_ADMIN (root)")
def test_the_installed_filter_decides_every_number_mode_and_family():
    """The filter the kernel holds, emulated: the whole class, not samples.

    Every syscall number >= 470 (newer than the list) and every other ABI get
    ENOSYS; every mode 0..07777 of every mode-setting syscall is refused
    exactly when S_ISUID/S_ISGID is set (open/openat only when creating);
    every family 0..255 x type 0..15 of socket/socketpair is refused with
    EAFNOSUPPORT but the --socket triples.
    """
    prog = _read_filter(["--seccomp", "1", "--socket", "p:1:1:*", "--socket", "s:2:1:6"])
    enosys, eperm = _ERRNO | 38, _ERRNO | 1
    assert all(_decide(prog, nr) == enosys for nr in range(470, 1100))
    assert _decide(prog, 0x40000000 | _X86["read"]) == enosys                      # x32
    assert _decide(prog, 3, arch=0x40000003) == enosys                              # i386
    assert _decide(prog, _X86["clone3"]) == enosys and _decide(prog, _X86["openat2"]) == enosys
    assert _decide(prog, _X86["read"]) == _ALLOW
    creating = os.O_CREAT | os.O_WRONLY
    for name, mode_i, flags_i in _MODE_ARGS:
        for mode in range(0o10000):
            for flags in ((creating, os.O_TMPFILE | os.O_WRONLY, os.O_RDONLY) if flags_i is not None else (0,)):
                args = [0] * 6
                args[mode_i] = mode
                if flags_i is not None:
                    args[flags_i] = flags
                creates = flags_i is None or flags != os.O_RDONLY
                want = eperm if mode & 0o6000 and creates else _ALLOW
                assert _decide(prog, _X86[name], args) == want, (name, oct(mode), flags)
    for fam in range(256):
        for typ in range(16):
            for extra in (0, FLAGS, 0x100):
                s = _decide(prog, _X86["socket"], [fam, typ | extra, 6, 0, 0, 0])
                p = _decide(prog, _X86["socketpair"], [fam, typ | extra, 0, 0, 0, 0])
                assert s == (_ALLOW if (fam, typ, extra) in ((2, 1, 0), (2, 1, FLAGS)) else _ERRNO | 97)
                assert p == (_ALLOW if (fam, typ, extra) in ((1, 1, 0), (1, 1, FLAGS)) else _ERRNO | 97)
    assert _decide(prog, _X86["socket"], [2, 1, 262, 0, 0, 0]) == _ERRNO | 93                   # MPTCP
    assert _decide(prog, _X86["clone"], [0x10000000 | 17, 0, 0, 0, 0, 0]) == eperm           # CLONE_NEWUSER
    assert _decide(prog, _X86["clone"], [0x3D0F00, 0, 0, 0, 0, 0]) == _ALLOW                 # pthread flags
