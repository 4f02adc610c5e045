"""``sandbox-fs features``: each value agrees with an independent read of the kernel's interfaces."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

import sandbox_fs
from sandbox_fs import _features, _native

SFS = [sys.executable, "-m", "sandbox_fs"]
KEYS = {"version", "native_abi", "openat2", "resolver", "landlock_abi", "seccomp", "user_namespace",
        "pid_namespace", "mount_namespace", "processes", "fuse", "fuse_reason", "identity", "lowered"}


@pytest.fixture(scope="module")
def found():
    r = subprocess.run([*SFS, "features", "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == ""
    return json.loads(r.stdout)


def test_json_is_a_stable_object(found):
    assert set(found) == KEYS
    assert set(found["processes"]) == {"cgroup2_pids", "cgroup1_pids", "rlimit_nproc", "bound", "cgroup2_dir",
                                       "cgroup1_pids_dir"}
    assert set(found["identity"]) == {"root", "leasable", "base", "count", "runs_as"}
    assert found["version"] == sandbox_fs.__version__ and found["native_abi"] == _native.EXPECTED_ABI
    for key in ("openat2", "seccomp", "user_namespace", "pid_namespace", "mount_namespace", "fuse"):
        assert isinstance(found[key], bool), key


def test_human_output_is_one_line_per_feature(found):
    r = subprocess.run([*SFS, "features"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == ""
    lines = r.stdout.splitlines()
    names = [line.split(":", 1)[0] for line in lines]
    assert names == ["version", "openat2", "resolver", "landlock", "seccomp", "user namespace", "pid namespace",
                     "mount namespace", "cgroup v2 pids", "cgroup v1 pids", "RLIMIT_NPROC binds", "process bound",
                     "fuse", "identity"]
    assert f"process bound: {found['processes']['bound']}" in lines
    fuse_line = "fuse: yes" if found["fuse"] else \
        f"fuse: no ({found['fuse_reason']}; run --overlay is refused under --confinement required)"
    assert fuse_line in lines
    abi = found["landlock_abi"]
    assert any(line.startswith(f"landlock: ABI {abi}" if abi else "landlock: no") for line in lines)


def test_kernel_values_match_the_library_probe(found):
    lib = sandbox_fs.features()
    assert (found["openat2"], found["landlock_abi"], found["resolver"]) == \
        (lib["openat2"], lib["landlock_abi"], lib["resolver"])


def test_landlock_matches_the_lsm_list(found):
    try:
        with open("/sys/kernel/security/lsm") as f:
            lsms = f.read().strip().split(",")
    except OSError:
        pytest.skip("/sys/kernel/security/lsm is not readable here")
    assert (found["landlock_abi"] > 0) == ("landlock" in lsms)


def _fsopen_fuse_permitted() -> bool:
    """fsopen("fuse", FSOPEN_CLOEXEC) by a raw syscall (an independent read of the kernel's answer)."""
    import ctypes
    import platform

    nr = {"x86_64": 430, "aarch64": 430}.get(platform.machine())
    if nr is None:
        pytest.skip(f"no fsopen syscall number known for {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(nr, b"fuse", 1)
    if fd < 0:
        return False
    os.close(fd)
    return True


def test_fuse_matches_dev_fuse_pyfuse3_and_fsopen(found):
    import importlib.util

    try:
        os.close(os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC))
        dev = True
    except OSError:
        dev = False
    built = hasattr(_native, "fsopen")  # the native mount calls are in this build
    usable = dev and importlib.util.find_spec("pyfuse3") is not None and built and _fsopen_fuse_permitted()
    assert found["fuse"] == usable
    assert (found["fuse_reason"] is None) == usable
    if not usable:
        assert isinstance(found["fuse_reason"], str) and found["fuse_reason"]
        assert found["fuse_reason"].startswith("/dev/fuse") or dev


def test_seccomp_matches_proc(found):
    try:
        with open("/proc/sys/kernel/seccomp/actions_avail") as f:
            actions = f.read().split()
    except OSError:
        actions = []
    assert found["seccomp"] == ("errno" in actions)


def test_identity_matches_the_euid(found):
    ident = found["identity"]
    root = os.geteuid() == 0
    assert ident["root"] == root and ident["leasable"] == root
    assert ident["runs_as"] == ("leased" if root else "host")
    from sandbox_fs.exec import ConfinementPolicy

    assert (ident["base"], ident["count"]) == ConfinementPolicy().identity_range


def _cgroup_lines() -> list[tuple[str, str, str]]:
    with open("/proc/self/cgroup") as f:
        return [tuple(line.rstrip("\n").split(":", 2)) for line in f]  # type: ignore[misc]


def _mounts(fstype: str) -> list[list[str]]:
    with open("/proc/self/mountinfo") as f:
        rows = [line.split() for line in f]
    return [r for r in rows if r[r.index("-") + 1] == fstype]


def test_process_bounds_match_cgroupfs(found):
    procs = found["processes"]
    v2_mounts, v1_mounts = _mounts("cgroup2"), [m for m in _mounts("cgroup") if "pids" in m[m.index("-") + 3]]
    assert (procs["cgroup2_dir"] is not None) == bool(v2_mounts and any(h == "0" for h, _c, _p in _cgroup_lines()))
    assert (procs["cgroup1_pids_dir"] is not None) == bool(
        v1_mounts and any("pids" in c.split(",") for _h, c, _p in _cgroup_lines()))
    if procs["cgroup2_dir"] is not None:
        assert os.path.isfile(os.path.join(procs["cgroup2_dir"], "cgroup.procs"))
        with open(os.path.join(procs["cgroup2_dir"], "cgroup.subtree_control")) as f:
            enabled = "pids" in f.read().split()
        assert procs["cgroup2_pids"] == (enabled and os.access(procs["cgroup2_dir"], os.W_OK))
    else:
        assert procs["cgroup2_pids"] is False
    if procs["cgroup1_pids_dir"] is not None:
        assert os.path.isfile(os.path.join(procs["cgroup1_pids_dir"], "cgroup.procs"))
        assert procs["cgroup1_pids"] == os.access(procs["cgroup1_pids_dir"], os.W_OK)
    assert procs["rlimit_nproc"] == (os.geteuid() != 0 or found["identity"]["runs_as"] == "leased")
    expected = ("cgroup2.pids" if procs["cgroup2_pids"] else "rlimit.nproc" if procs["rlimit_nproc"]
                else "cgroup1.pids" if procs["cgroup1_pids"] else "none")
    assert procs["bound"] == expected


@pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare(1) not installed")
def test_namespaces_match_unshare_1(found):
    root = os.geteuid() == 0
    user = [] if root else ["--user"]

    def works(*flags: str) -> bool:
        return subprocess.run(["unshare", *flags, "true"], capture_output=True, timeout=30).returncode == 0

    assert found["user_namespace"] == works("--user")
    assert found["pid_namespace"] == works(*user, "--pid", "--fork")
    assert found["mount_namespace"] == works(*user, "--mount")


def test_can_unshare_changes_nothing_here():
    before = os.readlink("/proc/self/ns/mnt"), os.readlink("/proc/self/ns/user"), os.readlink("/proc/self/ns/pid")
    _features.can_unshare(_features.CLONE_NEWUSER)
    _features.can_unshare(_features.CLONE_NEWNS | (0 if os.geteuid() == 0 else _features.CLONE_NEWUSER))
    after = os.readlink("/proc/self/ns/mnt"), os.readlink("/proc/self/ns/user"), os.readlink("/proc/self/ns/pid")
    assert before == after
