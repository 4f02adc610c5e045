"""No confined command can create, or leave behind, a set-id file (issue 11, part A1).

* every syscall that sets a mode refuses S_ISUID/S_ISGID with EPERM (all
  4096 modes through fchmodat and openat(O_CREAT); each syscall of the
  table with set-id, sticky and plain modes), open/openat only when they
  create (O_CREAT, O_TMPFILE);
* the everyday tools (chmod, install -m, cp -p, mkdir -m, chmod g+s) leave
  nothing set-id behind;
* every mount in the child's namespace is nosuid;
* a hard link to a host set-id binary cannot be made in the workspace;
* file capabilities (security.capability) cannot be set, not even from a
  new user namespace (where the child would hold CAP_SETFCAP).

The sentinel of each attack is the workspace itself, walked from the host
after the child exited: no entry with a set-id bit or a capability xattr.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

import sandbox_fs
from sandbox_fs import exec as sfs_exec
from sandbox_fs.exec import ConfinementPolicy, ProcessSupervisor, run_confined

ABI = sandbox_fs.features()["landlock_abi"]
HELPER = os.access(sfs_exec.helper_path(), os.X_OK)
ROOT = os.geteuid() == 0
PYTHON = os.path.join(os.sys.base_prefix, "bin", "python3")
SETID = stat.S_ISUID | stat.S_ISGID

pytestmark = [
    pytest.mark.skipif(not HELPER, reason="sandbox_fs/sfs-exec is not built (pip install -e . builds it)"),
    pytest.mark.skipif(ABI == 0, reason="the kernel has no Landlock (the filter comes with confinement)"),
]
needs_root = pytest.mark.skipif(not ROOT, reason="needs root (the read-only mount layer is made directly)")

# name -> (x86_64 nr, aarch64 nr or None, argument builder name)
_TABLE = {
    "chmod": (90, None), "fchmod": (91, 52), "fchmodat": (268, 53), "fchmodat2": (452, 452),
    "open": (2, None), "openat": (257, 56), "open_tmpfile": (257, 56), "creat": (85, None),
    "mkdir": (83, None), "mkdirat": (258, 34), "mknod": (133, None), "mknodat": (259, 33),
}
_ARCH = {"x86_64": 0, "aarch64": 1}.get(platform.machine())
needs_nr = pytest.mark.skipif(_ARCH is None, reason="syscall numbers are known here for x86_64/aarch64 only")


def setid_entries(top: Path) -> list[str]:
    """Every entry beneath top (not following symlinks) with a set-id bit."""
    out = []
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            if p.lstat().st_mode & SETID:
                out.append(str(p.relative_to(top)))
    return out


async def run(layout, ws, argv, **kw):
    return await run_confined(argv, workspace=ws, workspace_host_path=str(layout.ws), **kw)


# ------------------------------------------------------------- every mode syscall

MODE_CALLS = r"""
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
table, modes = json.loads(sys.argv[1]), json.loads(sys.argv[2])
AT = -100
def call(nr, *args):
    ctypes.set_errno(0)
    rc = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    return rc, (0 if rc >= 0 else ctypes.get_errno())
out = {}
for name, nr in table.items():
    for mode in modes:
        tag = f"{name}:{mode:o}"
        path = f"t-{name}-{mode:o}".encode()
        if name in ("chmod", "fchmod", "fchmodat", "fchmodat2"):
            with open(path, "w"):
                pass
            os.chmod(path, 0o644)
        if name == "chmod":
            rc, e = call(nr, path, mode)
        elif name == "fchmod":
            fd = os.open(path, os.O_RDONLY); rc, e = call(nr, fd, mode); os.close(fd)
        elif name == "fchmodat":
            rc, e = call(nr, AT, path, mode)
        elif name == "fchmodat2":
            rc, e = call(nr, AT, path, mode, 0)
        elif name == "open":
            rc, e = call(nr, path, os.O_CREAT | os.O_WRONLY, mode)
        elif name == "openat":
            rc, e = call(nr, AT, path, os.O_CREAT | os.O_WRONLY, mode)
        elif name == "open_tmpfile":
            rc, e = call(nr, AT, b".", os.O_TMPFILE | os.O_WRONLY, mode)
            if rc >= 0 and os.fstat(rc).st_mode & 0o6000:
                e = -1     # an unnamed set-id file (linkat could name it)
        elif name == "creat":
            rc, e = call(nr, path, mode)
        elif name == "mkdir":
            rc, e = call(nr, path, mode)
        elif name == "mkdirat":
            rc, e = call(nr, AT, path, mode)
        elif name == "mknod":
            rc, e = call(nr, path, 0o100000 | mode, 0)
        elif name == "mknodat":
            rc, e = call(nr, AT, path, 0o100000 | mode, 0)
        if rc >= 0 and name in ("open", "openat", "open_tmpfile", "creat"):
            os.close(rc)
        out[tag] = e
print(json.dumps(out))
"""


@needs_nr
async def test_every_mode_syscall_refuses_setid_modes(layout, ws, pygrant):
    table = {name: nrs[_ARCH] for name, nrs in _TABLE.items() if nrs[_ARCH] is not None}
    modes = [0o4755, 0o2755, 0o6755, 0o2775, 0o4000, 0o1755, 0o755, 0o644]
    r = await run(layout, ws, [PYTHON, "-c", MODE_CALLS, json.dumps(table), json.dumps(modes)], grants=pygrant)
    assert r.exit_code == 0, r.stderr
    got = json.loads(r.stdout)
    wrong = {k: v for k, v in got.items()
             if v != (errno.EPERM if int(k.split(":")[1], 8) & SETID else 0)}
    assert not wrong, wrong
    assert setid_entries(layout.ws) == []
    # The sticky bit grants nothing and stays allowed.
    assert (layout.ws / "t-fchmodat-1755").stat().st_mode & 0o7777 == 0o1755


EXHAUSTIVE = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
nr_fchmodat, nr_openat = int(sys.argv[1]), int(sys.argv[2])
os.umask(0)
open("f", "w").close()
bad = []
for mode in range(0o10000):
    ctypes.set_errno(0)
    rc = libc.syscall(ctypes.c_long(nr_fchmodat), ctypes.c_long(-100), b"f", ctypes.c_long(mode))
    if (rc == 0) == bool(mode & 0o6000) or (rc < 0 and ctypes.get_errno() != 1):
        bad.append(("fchmodat", mode, rc, ctypes.get_errno()))
    ctypes.set_errno(0)
    rc = libc.syscall(ctypes.c_long(nr_openat), ctypes.c_long(-100), b"g",
                      ctypes.c_long(os.O_CREAT | os.O_EXCL | os.O_WRONLY), ctypes.c_long(mode))
    if (rc >= 0) == bool(mode & 0o6000) or (rc < 0 and ctypes.get_errno() != 1):
        bad.append(("openat", mode, rc, ctypes.get_errno()))
    if rc >= 0:
        os.close(rc); os.unlink("g")
    # Without O_CREAT/O_TMPFILE the mode is not used: opening stays allowed.
    os.chmod("f", 0o644)
    rc = libc.syscall(ctypes.c_long(nr_openat), ctypes.c_long(-100), b"f", ctypes.c_long(os.O_RDONLY),
                      ctypes.c_long(mode))
    if rc < 0:
        bad.append(("openat-nocreat", mode, rc, ctypes.get_errno()))
    else:
        os.close(rc)
print(len(bad), bad[:5])
"""


@needs_nr
async def test_all_4096_modes_fchmodat_and_openat(layout, ws, pygrant):
    """The class, exhaustively: refused exactly when S_ISUID or S_ISGID is in the mode."""
    nrs = (_TABLE["fchmodat"][_ARCH], _TABLE["openat"][_ARCH])
    r = await run(layout, ws, [PYTHON, "-c", EXHAUSTIVE, *map(str, nrs)], grants=pygrant, timeout_s=60)
    assert r.stdout == b"0 []\n", r.stdout + r.stderr
    assert setid_entries(layout.ws) == []


TOOLS = r"""
cp /bin/true t1; chmod 4755 t1; echo "chmod=$?"
chmod u+s,g+s t1; echo "chmod-sym=$?"
install -m 4755 /bin/true t2; echo "install=$?"
mkdir -m 2755 d1; echo "mkdir=$?"
mkdir d2 && chmod g+s d2; echo "chmod-dir=$?"
cp -p host-suid t3; echo "cp-p=$?"
cp -a host-suid t4; echo "cp-a=$?"
chmod 0755 .; echo "ws-0755=$?"
"""


async def test_everyday_tools_leave_no_setid_file(layout, ws):
    """chmod 4755, install -m, mkdir -m 2755, chmod g+s, cp -p/-a of a set-id file."""
    host = layout.ws / "host-suid"
    shutil.copy("/bin/true", host)
    os.chmod(host, 0o4755)                  # placed by the host: allowed, and nosuid for the child
    r = await run(layout, ws, ["/bin/sh", "-c", TOOLS])
    lines = dict(line.split("=") for line in r.stdout.decode().split())
    assert lines["ws-0755"] == "0", r.stdout
    assert all(v != "0" for k, v in lines.items() if k not in ("ws-0755", "cp-p", "cp-a")), r.stdout
    # On a root host the workspace is re-owned to the confined identity before the run, and
    # chown clears the host's set-id bit too; otherwise the host's file keeps it.
    assert setid_entries(layout.ws) == ([] if r.identity else ["host-suid"]), r.stdout + r.stderr
    # Positive control: unconfined the same script leaves set-id files.
    r0 = await run(layout, ws, ["/bin/sh", "-c", "rm -rf t1 t2 t3 t4 d1 d2;" + TOOLS], confinement="none")
    assert len(setid_entries(layout.ws)) > 1, r0.stdout


# ------------------------------------------------------------- nosuid mounts

MOUNTINFO = r"""
import sys
bad = []
for line in open("/proc/self/mountinfo"):
    f = line.split()
    if "nosuid" not in f[5].split(","):
        bad.append(f[4])
print("ws", [l.split()[5] for l in open("/proc/self/mountinfo") if l.split()[4] == sys.argv[1]])
print("without-nosuid", bad)
"""


@needs_root
@pytest.mark.parametrize("supervised", [False, True])
async def test_every_mount_is_nosuid_in_the_child(layout, ws, pygrant, supervised):
    ws_path = str(layout.ws)
    argv = [PYTHON, "-c", MOUNTINFO, ws_path]
    if supervised:
        async with ProcessSupervisor() as sup:
            r = await run(layout, ws, argv, grants=pygrant, supervisor=sup)
    else:
        r = await run(layout, ws, argv, grants=pygrant)
    assert r.read_only_mounts, "the read-only mount layer did not apply"
    out = r.stdout.decode().splitlines()
    assert out[0].startswith("ws [") and "nosuid" in out[0], r.stdout + r.stderr
    assert out[1] == "without-nosuid []", out


# ------------------------------------------------------------- hard links

@pytest.fixture
def host_suid():
    """A set-id copy of /bin/true in a /tmp directory outside the workspace (same filesystem)."""
    d = Path(tempfile.mkdtemp(prefix="sfs-setid-"))
    (d / "ro").mkdir()
    (d / "rw").mkdir()
    for sub in ("ro", "rw", "."):
        shutil.copy("/bin/true", d / sub / "suid")
        os.chmod(d / sub / "suid", 0o4755)
    yield d
    shutil.rmtree(d)


@pytest.mark.parametrize("read_only_mounts", [True, False])
async def test_no_hard_link_to_a_host_setid_binary(layout, ws, host_suid, read_only_mounts):
    """From an ungranted dir, a read-only grant, a read-write grant, and /usr/bin's own set-id programs.

    Landlock gives ``REFER`` (linking across directories) only beneath the
    workspace and the read-write grants, so a link from anywhere else fails
    (EXDEV) with or without the mount layer.  A read-write grant on the
    workspace's filesystem is the case only the mount layer closes: each
    writable tree is its own mount in the child's namespace, and link(2)
    never crosses mounts.
    """
    if layout.ws.stat().st_dev != host_suid.stat().st_dev:
        pytest.skip("the workspace and /tmp are on different filesystems here (a link is EXDEV anyway)")
    ro = sandbox_fs.open_root(host_suid / "ro", read_only=True)
    rw = sandbox_fs.open_root(host_suid / "rw")
    sources = [host_suid / "suid", host_suid / "ro" / "suid"]
    if read_only_mounts:
        sources.append(host_suid / "rw" / "suid")
    sources += [Path(p) for p in ("/usr/bin/passwd", "/usr/bin/su", "/usr/bin/mount")
                if os.path.exists(p) and os.stat(p).st_mode & stat.S_ISUID
                and os.stat(p).st_dev == layout.ws.stat().st_dev]
    script = "".join(f"ln '{src}' link{i}; echo $?\n" for i, src in enumerate(sources))
    import contextlib

    from sandbox_fs.exec import _identity

    # A root host runs the command as a leased identity, which must own the read-write grant.
    with (_identity.lease() if os.geteuid() == 0 else contextlib.nullcontext()) as lease:
        policy = ConfinementPolicy(read_only_mounts=read_only_mounts)
        if lease is not None:
            os.chown(host_suid / "rw", lease.uid, lease.gid)
            policy = ConfinementPolicy(read_only_mounts=read_only_mounts, identity=lease.ids)
        try:
            r = await run(layout, ws, ["/bin/sh", "-c", script], grants=[(ro, True), (rw, False)], policy=policy)
        finally:
            ro.close()
            rw.close()
    assert "0" not in r.stdout.decode().split(), r.stdout + r.stderr
    assert not [p for p in os.listdir(layout.ws) if p.startswith("link")]
    assert setid_entries(layout.ws) == []
    assert all(os.stat(host_suid / sub / "suid").st_nlink == 1 for sub in (".", "ro", "rw"))


# ------------------------------------------------------------- file capabilities

CAPS = r"""
cp /bin/true capfile
setcap cap_setuid+ep capfile; echo "setcap=$?"
unshare -Ur setcap cap_setuid+ep capfile; echo "userns-setcap=$?"
unshare -Ur true; echo "unshare=$?"
"""


async def test_file_capabilities_cannot_be_set(layout, ws):
    """CAP_SETFCAP stays dropped, and no user namespace can give it back."""
    missing = [t for t in ("setcap", "unshare") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"tools missing on this machine: {missing}")
    r = await run(layout, ws, ["/bin/sh", "-c", CAPS])
    assert r.stdout == b"setcap=1\nuserns-setcap=1\nunshare=1\n", r.stdout + r.stderr
    with pytest.raises(OSError) as e:
        os.getxattr(layout.ws / "capfile", "security.capability")
    assert e.value.errno == errno.ENODATA


PYXATTR = r"""
import os
v3 = bytes.fromhex("01000003" + "80000000" * 2 + "00000000" * 2 + "00000000")   # cap_setuid, rootid 0
open("x", "w").close()
try:
    os.setxattr("x", "security.capability", v3); print("set")
except OSError as e:
    print("errno", e.errno)
"""


async def test_security_capability_xattr_refused(layout, ws, pygrant):
    r = await run(layout, ws, [PYTHON, "-c", PYXATTR], grants=pygrant)
    assert r.stdout == b"errno 1\n", r.stdout + r.stderr
    with pytest.raises(OSError):
        os.getxattr(layout.ws / "x", "security.capability")
