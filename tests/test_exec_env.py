"""The exec helper's own environment and the command's (issue 11, B).

The helper starts as root with every capability and confines itself in
main(); a dynamically linked helper runs the loader before that.  So the
helper always runs with an empty environment, and the command's
environment reaches it as data (a memfd, ``--env-fd``), applied only at the
command's execve.  The regression tests force a *dynamic* helper build
(setup.py's ``SFS_EXEC_DYNAMIC=1`` switch) and check an outside sentinel.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sandbox_fs
from sandbox_fs import exec as sfs_exec
from sandbox_fs.exec import _helper
from sandbox_fs.exec import CommandNotFoundError, ConfinementPolicy, InvalidEnvError, ProcessSupervisor, run_confined

REPO = Path(__file__).resolve().parents[1]
ABI = sandbox_fs.features()["landlock_abi"]
HELPER = os.access(sfs_exec.helper_path(), os.X_OK)
CC = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")

pytestmark = pytest.mark.skipif(not HELPER, reason="sandbox_fs/sfs-exec is not built (pip install -e . builds it)")
needs_landlock = pytest.mark.skipif(ABI == 0, reason="features()['landlock_abi'] is 0: the kernel has no Landlock")
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler (cc/gcc) to build a dynamic helper and evil.so")

EVIL_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
/* Runs in every process that loads it, before main(). */
__attribute__((constructor)) static void evil(void)
{
    char line[256], status[4096];
    int s = open("/proc/self/status", O_RDONLY);
    ssize_t n = s >= 0 ? read(s, status, sizeof status - 1) : -1;
    status[n > 0 ? n : 0] = '\0';
    const char *cap = strstr(status, "CapEff:");
    int len = snprintf(line, sizeof line, "pid %d euid %d %.24s\n", getpid(), geteuid(), cap ? cap : "-");
    int fd = open(SENTINEL, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
        if (write(fd, line, (size_t)len) < 0) {}
        close(fd);
    }
    fd = open(MARKER, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
        if (write(fd, line, (size_t)len) < 0) {}
        close(fd);
    }
}
"""


def _load_setup():
    spec = importlib.util.spec_from_file_location("sfs_setup_for_tests", REPO / "setup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # not __main__: setup() is not called
    return mod


def _has_interp(path: str) -> bool:
    """True when the ELF file has a PT_INTERP program header (it is dynamically linked)."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b"\x7fELF" and data[4] == 2, "a 64-bit ELF"
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    return any(struct.unpack_from("<I", data, phoff + i * phentsize)[0] == 3 for i in range(phnum))


@pytest.fixture(scope="module")
def dynamic_helper(tmp_path_factory):
    """The helper built by setup.py's own compile step with SFS_EXEC_DYNAMIC=1."""
    if CC is None:
        pytest.skip("no C compiler")
    out = str(tmp_path_factory.mktemp("dynhelper") / "sfs-exec")
    _load_setup().compile_exec_helper(out, dict(os.environ, SFS_EXEC_DYNAMIC="1"))
    assert _has_interp(out), "SFS_EXEC_DYNAMIC=1 must give a dynamically linked helper"
    return out


@pytest.fixture
def evil(tmp_path):
    """evil.so in the workspace (readable by the command) and outside it; its sentinel is outside."""
    if CC is None:
        pytest.skip("no C compiler")
    outside = tmp_path / "outside"
    ws = tmp_path / "ws"
    outside.mkdir()
    ws.mkdir()
    sentinel = outside / "ran-as-helper"
    marker = ws / "evil-ran"
    src = tmp_path / "evil.c"
    src.write_text(EVIL_C)
    so = outside / "evil.so"
    subprocess.run([CC, "-shared", "-fPIC", "-o", str(so), f'-DSENTINEL="{sentinel}"', f'-DMARKER="{marker}"',
                    str(src)], check=True)
    shutil.copy(so, ws / "evil.so")
    # positive control: the library does write the sentinel when preloaded unconfined
    subprocess.run(["/bin/true"], env={"LD_PRELOAD": str(so)}, check=True)
    assert sentinel.read_text().startswith("pid ")
    sentinel.unlink()
    marker.unlink()
    return {"ws": ws, "outside": outside, "sentinel": sentinel, "marker": marker,
            "so_outside": str(so), "so_inside": str(ws / "evil.so")}


@needs_cc
@needs_landlock
@pytest.mark.parametrize("where", ["so_outside", "so_inside"])
async def test_ld_preload_never_reaches_a_dynamic_helper(dynamic_helper, evil, monkeypatch, where):
    """LD_PRELOAD in the command's environment ran code as unconfined root in a dynamic helper."""
    monkeypatch.setattr(_helper, "helper_path", lambda: dynamic_helper)
    ws = sandbox_fs.open_root(str(evil["ws"]))
    try:
        async with ProcessSupervisor() as sup:
            for _ in range(2):  # the held-namespace helper and the command's helper
                r = await run_confined(["/bin/true"], workspace=ws, workspace_host_path=str(evil["ws"]),
                                       env={"LD_PRELOAD": evil[where]}, supervisor=sup)
                assert r.exit_code == 0
        r = await run_confined(["/bin/true"], workspace=ws, workspace_host_path=str(evil["ws"]),
                               env={"LD_PRELOAD": evil[where], "GLIBC_TUNABLES": "glibc.malloc.check=3"})
    finally:
        ws.close()
    assert not evil["sentinel"].exists(), evil["sentinel"].read_text()
    if where == "so_inside" and evil["marker"].exists():
        # it reached the command only, after confinement: no capability left
        for line in evil["marker"].read_text().splitlines():
            assert line.endswith("CapEff:\t0000000000000000"), line


@needs_cc
async def test_dynamic_helper_gets_an_empty_environment_even_unconfined(dynamic_helper, evil, monkeypatch):
    """confinement='none' too: the helper's own loader never sees the caller's environment."""
    monkeypatch.setattr(_helper, "helper_path", lambda: dynamic_helper)
    ws = sandbox_fs.open_root(str(evil["ws"]))
    try:
        r = await run_confined(["/bin/sh", "-c", "echo $LD_PRELOAD"], workspace=ws,
                               workspace_host_path=str(evil["ws"]), env={"LD_PRELOAD": evil["so_outside"]},
                               confinement="none", policy=ConfinementPolicy(read_only_mounts=False))
    finally:
        ws.close()
    assert r.stdout.decode().strip() == evil["so_outside"]  # the command got it ...
    # ... and ran it (unconfined, as asked: once for sh, as the command), but the helper never did
    lines = evil["sentinel"].read_text().splitlines() if evil["sentinel"].exists() else []
    assert all("CapEff:\t0000000000000000" in ln for ln in lines), lines


class _Spawns:
    """Records every process sandbox_fs.exec starts through trio (argv and env)."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[list[str], object]] = []
        real = trio.lowlevel.open_process

        async def spy(args, **kw):
            self.calls.append((list(args), kw.get("env", "<inherited>")))
            return await real(args, **kw)

        monkeypatch.setattr(trio.lowlevel, "open_process", spy)


@needs_landlock
async def test_secret_values_reach_the_command_by_fd_never_argv_or_helper_env(tmp_path, monkeypatch):
    token = "tok-" + os.urandom(8).hex()
    spawns = _Spawns(monkeypatch)
    ws = sandbox_fs.open_root(str(tmp_path))
    try:
        async with ProcessSupervisor() as sup:
            r = await run_confined(["/bin/sh", "-c", 'printf %s "$TOKEN"'], workspace=ws,
                                   workspace_host_path=str(tmp_path), env={"TOKEN": token},
                                   secret_env={"TOKEN"}, supervisor=sup)
    finally:
        ws.close()
    assert r.stdout.decode() == token
    assert spawns.calls
    for argv, env in spawns.calls:
        assert env == {}, "the helper's own environment is fixed and empty"
        assert not any(token in a for a in argv)
        assert "--env-fd" in argv or "--hold-ns" in argv


async def test_default_path_is_fixed_not_the_hosts(tmp_path, monkeypatch):
    evil_bin = tmp_path / "evilbin"
    evil_bin.mkdir()
    monkeypatch.setenv("PATH", f"{evil_bin}:{os.environ.get('PATH', '')}")
    fixed = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"
    assert sfs_exec.build_env({}, workspace_host_path="/w", host_env={"PATH": "/evil"})["PATH"] == fixed
    ws = sandbox_fs.open_root(str(tmp_path))
    try:
        r = await run_confined(["printenv", "PATH"], workspace=ws, workspace_host_path=str(tmp_path),
                               confinement="best_effort")
        assert r.stdout.decode().strip() == fixed == sfs_exec.DEFAULT_PATH
        r = await run_confined(["printenv", "PATH"], workspace=ws, workspace_host_path=str(tmp_path),
                               env={"PATH": "/usr/bin:/bin"}, confinement="best_effort")
        assert r.stdout.decode().strip() == "/usr/bin:/bin"  # the caller may still set it
    finally:
        ws.close()


async def test_program_is_searched_on_the_commands_path(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    tool = bindir / "mytool"
    tool.write_text("#!/bin/sh\necho tool-ran \"$@\"\n")
    tool.chmod(0o755)
    bare = bindir / "noshebang"
    bare.write_text("echo bare-ran\n")  # execve says ENOEXEC: run by /bin/sh, as execvp does
    bare.chmod(0o755)
    ws = sandbox_fs.open_root(str(tmp_path))
    try:
        env = {"PATH": f"/nonexistent::{bindir}:/usr/bin:/bin"}
        r = await run_confined(["mytool", "a b"], workspace=ws, workspace_host_path=str(tmp_path), env=env,
                               confinement="best_effort")
        assert r.stdout == b"tool-ran a b\n"
        r = await run_confined(["noshebang"], workspace=ws, workspace_host_path=str(tmp_path), env=env,
                               confinement="best_effort")
        assert r.stdout == b"bare-ran\n"
        with pytest.raises(CommandNotFoundError):  # on the host's PATH, not on the command's
            await run_confined(["true"], workspace=ws, workspace_host_path=str(tmp_path),
                               env={"PATH": "/nonexistent"}, confinement="best_effort")
    finally:
        ws.close()


async def test_oversize_environment_refused_without_its_value(tmp_path):
    secret = "S" * (sfs_exec.MAX_ENV_BYTES + 1)
    ws = sandbox_fs.open_root(str(tmp_path))
    try:
        with pytest.raises(InvalidEnvError) as info:
            await run_confined(["true"], workspace=ws, workspace_host_path=str(tmp_path), env={"BIG": secret},
                               secret_env={"BIG"})
        assert "SSSS" not in str(info.value) and "SSSS" not in repr(info.value.to_dict())
        with pytest.raises(InvalidEnvError):
            await run_confined(["true"], workspace=ws, workspace_host_path=str(tmp_path),
                               env={f"V{i}": "x" for i in range(sfs_exec.MAX_ENV_ENTRIES + 1)})
    finally:
        ws.close()


def _helper_with_blob(blob: bytes) -> tuple[int, str, str]:
    """Run the installed helper with --env-fd on a memfd holding ``blob``; (rc, status line, stdout)."""
    fd = os.memfd_create("t", 0)
    os.write(fd, blob)
    r, w = os.pipe()
    try:
        p = subprocess.run([sfs_exec.helper_path(), "--status", str(w), "--env-fd", str(fd), "--", "env"],
                           pass_fds=(fd, w), env={}, capture_output=True, timeout=10)
        os.close(w)
        w = -1
        status = os.read(r, 256).decode()
    finally:
        os.close(fd)
        os.close(r)
        if w >= 0:
            os.close(w)
    return p.returncode, status.strip(), p.stdout.decode()


@pytest.mark.parametrize("blob, stage", [
    (b"A=1\0B=2\0PATH=/usr/bin:/bin\0", None),
    (b"", None),
    (b"A=1", "env 22"),             # not NUL-terminated
    (b"NOEQUALS\0", "env 22"),
    (b"=value\0", "env 22"),        # empty name
    (b"A=" + b"x" * (1 << 20) + b"\0", "env 7"),  # over SFS_MAX_ENV: E2BIG
    (b"A=1\0" * 4097, "env 7"),     # over SFS_MAX_ENV_ENTRIES
])
def test_helper_env_blob_rules(blob, stage):
    rc, status, out = _helper_with_blob(blob)
    if stage is None:
        assert rc == 0 and status == ""
        assert sorted(out.splitlines()) == sorted(x.decode() for x in blob.split(b"\0") if x)
    else:
        assert rc == 127 and status == stage


_NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True).filter(
    lambda n: n not in ("PATH", "HOME", "TMPDIR", "PWD", "SHLVL", "_", "LD_PRELOAD") and not n.startswith("LD_"))
_VALUES = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=40)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(env=st.dictionaries(_NAMES, _VALUES, max_size=6))
def test_environment_round_trips_exactly(tmp_path, env):
    """Whatever names and values (=, newlines, unicode, empty), the command sees exactly them."""
    async def main():
        ws = sandbox_fs.open_root(str(tmp_path))
        try:
            return await run_confined(["env", "-0"], workspace=ws, workspace_host_path=str(tmp_path), env=env,
                                      confinement="best_effort")
        finally:
            ws.close()

    r = trio.run(main)
    seen = dict(x.split("=", 1) for x in r.stdout.decode("utf-8", "surrogateescape").split("\0") if x)
    for k, v in env.items():
        assert seen[k] == v


@needs_cc
def test_cli_refuses_a_manifest_setting_ld_preload(tmp_path, evil):
    """`sandbox-fs run --manifest` with LD_PRELOAD: one line naming the key, non-zero exit, nothing ran."""
    token = "secret-" + os.urandom(6).hex()
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps({"environment": {"LD_PRELOAD": {"value": evil["so_outside"] + token,
                                                                   "secret": True}}}))
    (tmp_path / "wsdir").mkdir()
    r = subprocess.run([sys.executable, "-m", "sandbox_fs", "run", "--manifest", str(manifest),
                        "--workspaces-dir", str(tmp_path / "wsdir"), "--", "/bin/true"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "LD_PRELOAD" in r.stderr and token not in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not evil["sentinel"].exists() and not evil["marker"].exists()


def test_home_and_tmp_names_still_import_from_sandbox_fs_exec():
    """``sandbox_fs.exec.HOME_DIR`` / ``TMP_DIR`` (the workspace-relative HOME and TMPDIR of a
    command) were importable from the exec module before it became a package, and still are."""
    from sandbox_fs.exec import HOME_DIR, TMP_DIR

    env = sfs_exec.build_env({}, workspace_host_path="/w")
    assert (env["HOME"], env["TMPDIR"]) == (f"/w/{HOME_DIR}", f"/w/{TMP_DIR}") == ("/w/.home", "/w/.tmp")
