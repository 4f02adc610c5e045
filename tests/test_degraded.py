"""Degraded platforms: Landlock ABI 1, 3 and 5, no openat2, no FUSE, no cgroup v2, no user namespaces.

``SANDBOX_FS_DEGRADE`` (:func:`sandbox_fs._features.lowered`) makes the
library take this full kernel as offering less.  For each lowering:
``confinement="required"`` refuses a run that needs what is missing (a
``ConfinementError`` naming it), ``"best_effort"`` runs and lists it in
``ExecResult.missing``, and ``sandbox-fs features`` shows the lowered value.
Each case checks the lowering reached the kernel (the ruleset's ABI, the
helper's PID namespace, the resolver's syscalls), not only the report.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sandbox_fs
from sandbox_fs import _features, _native, open_root
from sandbox_fs import exec as sfs_exec
from sandbox_fs.cli._features import feature_lines
from sandbox_fs.errors import InvalidArgumentError, NativeUnavailableError, PathEscapeError
from sandbox_fs.exec import ConfinementError, ConfinementPolicy, run_confined

REAL = dict(sandbox_fs.features()) if not os.environ.get(_features.DEGRADE_ENV) else {}
REAL_ABI = int(REAL.get("landlock_abi", 0))  # type: ignore[call-overload]
HELPER = os.access(sfs_exec.helper_path(), os.X_OK)

pytestmark = [
    pytest.mark.skipif(not REAL, reason="SANDBOX_FS_DEGRADE is already set for the whole run"),
    pytest.mark.skipif(not HELPER, reason="sandbox_fs/sfs-exec is not built (pip install -e . builds it)"),
]
needs_abi = pytest.mark.skipif(REAL_ABI < 6, reason="needs a kernel with Landlock ABI >= 6 to lower from")


@pytest.fixture
def degrade(monkeypatch):
    def set_(value: str) -> None:
        monkeypatch.setenv(_features.DEGRADE_ENV, value)
    return set_


@pytest.fixture
def ws(tmp_path):
    top = tmp_path / "ws"
    top.mkdir()
    with open_root(str(top)) as root:
        yield root, str(top)


async def _run(ws, script: str, confinement: str = "required", **policy):
    root, host = ws
    return await run_confined(["/bin/sh", "-c", script], workspace=root, workspace_host_path=host,
                              confinement=confinement, policy=ConfinementPolicy(**policy), timeout_s=60)


def _report() -> list[str]:
    return feature_lines({"version": "x", "native_abi": 0, **_features.host_features()})


# ------------------------------------------------------------------ the seam itself


def test_an_unknown_entry_is_refused(degrade):
    degrade("landlock=3,seccomp")
    with pytest.raises(InvalidArgumentError, match="seccomp"):
        sandbox_fs.features()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(["openat2", "fuse", "cgroup2", "cgroup1", "userns", "landlock=0",
                                 "landlock=1", "landlock=3", "landlock=5", "landlock=99"]), max_size=6))
def test_lowering_never_claims_more_than_the_kernel(tokens):
    """Whatever is removed, no value rises above the kernel's (landlock=99 stays at the real ABI)."""
    old = os.environ.get(_features.DEGRADE_ENV)
    os.environ[_features.DEGRADE_ENV] = ",".join(tokens)
    try:
        got = sandbox_fs.features()
    finally:
        if old is None:
            del os.environ[_features.DEGRADE_ENV]
        else:
            os.environ[_features.DEGRADE_ENV] = old
    caps = [int(t.split("=")[1]) for t in tokens if t.startswith("landlock=")]
    assert got["landlock_abi"] == min([REAL_ABI, *caps])
    assert got["openat2"] == (REAL["openat2"] and "openat2" not in tokens)
    assert got["fuse"] == (REAL["fuse"] and "fuse" not in tokens)
    assert got["resolver"] == ("openat2" if got["openat2"] else "fallback")


# ------------------------------------------------------------------ Landlock ABI 1, 3, 5

#: For each lowered ABI: a policy needing a right that ABI lacks, and the missing entry.
ABI_CASES = {
    1: ({"read_only_mounts": False}, "landlock.truncate"),
    3: ({"allow_tcp_connect": frozenset({9})}, "landlock.tcp"),
    5: ({"isolate_network": False}, "landlock.scope_abstract_unix"),
}


@needs_abi
@pytest.mark.parametrize("abi", sorted(ABI_CASES))
async def test_lower_landlock_abi(abi, degrade, ws):
    policy, entry = ABI_CASES[abi]
    control = await _run(ws, "true", **policy)  # the kernel's own ABI gives it
    assert control.exit_code == 0 and control.missing == () and control.landlock_abi == REAL_ABI
    degrade(f"landlock={abi}")
    with pytest.raises(ConfinementError) as ei:
        await _run(ws, "true", **policy)
    assert ei.value.code == "confinement_unavailable" and "fails closed" in str(ei.value)
    assert entry in ei.value.context["missing"].split(",")
    result = await _run(ws, "true", "best_effort", **policy)
    assert result.exit_code == 0 and result.landlock_abi == abi and entry in result.missing
    first = {1: 3, 3: 4, 5: 6}[abi]  # the first ABI with the right (landlock.h)
    for level in range(abi + 1, first + 1):
        degrade(f"landlock={level}")
        got = await _run(ws, "true", "best_effort", **policy)
        assert (entry in got.missing) == (level < first), (level, got.missing)
    degrade(f"landlock={abi}")
    default = await _run(ws, "true")  # the default policy: the namespaces stand in for the lower ABI
    assert default.exit_code == 0 and default.landlock_abi == abi and default.missing == ()
    assert f"landlock: ABI {abi}" in _report() and any(line.startswith("lowered: landlock=") for line in _report())


@needs_abi
async def test_abi_1_ruleset_reaches_the_kernel(degrade, ws):
    """ABI 1 has no REFER right: the kernel refuses every cross-directory link (EXDEV), ABI >= 2 allows it."""
    script = "mkdir -p a b && echo x > a/f && ln a/f b/g && echo linked"
    assert (await _run(ws, script)).stdout == b"linked\n"
    degrade("landlock=1")
    result = await _run(ws, "rm -rf a b; " + script)
    assert result.landlock_abi == 1 and result.stdout == b"" and result.exit_code != 0
    assert not os.path.exists(os.path.join(ws[1], "b", "g"))


async def test_no_landlock(degrade, ws):
    degrade("landlock=0")
    with pytest.raises(ConfinementError, match="Landlock is not available"):
        await _run(ws, "true")
    result = await _run(ws, "true", "best_effort")
    assert result.confinement == "none" and result.missing[0] == "landlock"
    assert "landlock: no (confinement=required is refused)" in _report()


# ------------------------------------------------------------------ openat2


def test_no_openat2_uses_the_fallback_walker_only(degrade, monkeypatch, tmp_path):
    """With openat2 removed no Root operation reaches sfs_openat2; escapes are still refused."""
    degrade("openat2")
    (tmp_path / "out").mkdir()
    (tmp_path / "ws").mkdir()
    os.symlink("../out", tmp_path / "ws" / "esc")
    calls = []

    class Lib:
        def __getattr__(self, name):
            if name == "sfs_openat2":
                calls.append(name)
            return getattr(real_lib, name)

    real_lib = _native.lib
    monkeypatch.setattr(_native, "lib", Lib())
    with open_root(str(tmp_path / "ws")) as root:
        assert root.resolver == "fallback"
        root.mkdir("d")
        root.write_bytes("d/f", b"x")
        assert root.read_bytes("d/f") == b"x"
        with pytest.raises(PathEscapeError):
            root.write_bytes("esc/pwned", b"x")
    assert calls == [] and not (tmp_path / "out" / "pwned").exists()
    monkeypatch.setenv("SANDBOX_FS_RESOLVER", "openat2")
    with pytest.raises(NativeUnavailableError):
        open_root(str(tmp_path / "ws"))
    monkeypatch.delenv("SANDBOX_FS_RESOLVER")
    lines = _report()
    assert "openat2: no" in lines and "resolver: fallback" in lines


async def test_no_openat2_confined_run_still_required(degrade, ws):
    """openat2 is the resolver, not a confinement layer: a required run goes on (nothing missing)."""
    degrade("openat2")
    result = await _run(ws, "echo ok > f && cat f")
    assert result.stdout == b"ok\n" and result.missing == ()


# ------------------------------------------------------------------ FUSE


@pytest.fixture
def make_client(tmp_path):
    from sandbox_fs.client import ClientOptions, LocalSandboxClient

    clients = []

    def make(**kw):
        client = LocalSandboxClient(ClientOptions(workspaces_dir=str(tmp_path / "wsdir"),
                                                  snapshot_dir=str(tmp_path / "snaps"), overlay=True, **kw))
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


async def test_no_fuse(degrade, make_client, tmp_path):
    from sandbox_fs.fuse import OverlayUnavailableError

    degrade("fuse")
    assert sandbox_fs.features()["fuse"] is False
    session = make_client(confinement="required").create()
    with pytest.raises(OverlayUnavailableError, match="SANDBOX_FS_DEGRADE"):
        await session.start()
    assert not (tmp_path / "wsdir" / session.id).exists()
    async with make_client(confinement="best_effort").create() as session:
        assert not session.overlay_active and "SANDBOX_FS_DEGRADE" in session.describe()
    assert any(line.startswith("fuse: no (FUSE is removed by SANDBOX_FS_DEGRADE") for line in _report())


# ------------------------------------------------------------------ cgroup v2 (and v1)


@pytest.mark.skipif(os.geteuid() != 0, reason="RLIMIT_NPROC binds a non-root command: no bound is ever missing")
async def test_no_cgroup_v2(degrade, ws):
    """Running as uid 0 ("host" identity) only a cgroup bounds processes: v2, else v1, else required refuses."""
    policy = {"identity": "host", "pids_max": 64}
    degrade("cgroup2")
    found = _features.host_features()["processes"]
    assert found["cgroup2_pids"] is False and found["cgroup2_dir"] is None
    result = await _run(ws, "true", **policy)
    if found["cgroup1_pids"]:
        assert result.process_bounds == ("cgroup1.pids.max=64",) and result.missing == ()
    else:  # without v1 either, required refused above
        pytest.fail("unreachable: a required run without any cgroup pids controller was accepted")
    degrade("cgroup2,cgroup1")
    with pytest.raises(ConfinementError, match="process-count bound"):
        await _run(ws, "true", **policy)
    result = await _run(ws, "true", "best_effort", **policy)
    assert result.process_bounds == () and "process_bound" in result.missing
    assert "cgroup v1 pids: no" in _report() and "cgroup v2 pids: no" in _report()


# ------------------------------------------------------------------ user namespaces

_AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
_NOBODY_RUN = """
import json, sys, trio
from sandbox_fs import open_root
from sandbox_fs.exec import run_confined, ConfinementPolicy, ConfinementError
async def main():
    out = []
    with open_root(sys.argv[1]) as ws:
        for conf, pol in [("required", {}), ("best_effort", {}), ("required", {"protected": (".bashrc",)})]:
            try:
                r = await run_confined(["readlink", "/proc/self/ns/pid"], workspace=ws, workspace_host_path=sys.argv[1],
                                       policy=ConfinementPolicy(**pol), confinement=conf, timeout_s=60)
                out.append({"ok": True, "ro": r.read_only_mounts, "missing": list(r.missing),
                            "pidns": r.stdout.decode().strip()})
            except ConfinementError as e:
                out.append({"ok": False, "error": str(e)})
    print(json.dumps(out))
trio.run(main)
"""


def _nobody_why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root to switch to user nobody"
    if shutil.which("setpriv") is None:
        return "needs setpriv(1) (util-linux)"
    probe = subprocess.run(_AS_NOBODY + [sys.executable, "-c", "import sandbox_fs"], capture_output=True, cwd="/",
                           timeout=60)
    return None if probe.returncode == 0 else "user nobody cannot import sandbox_fs from this checkout"


@pytest.fixture
def nobody_dir():
    """A directory user nobody owns and can reach (pytest's base temp is private to root)."""
    top = tempfile.mkdtemp(prefix="sfs-degraded-")
    os.chmod(top, 0o755)
    yield Path(top)
    shutil.rmtree(top)


def _as_nobody(base: Path, lowered: str) -> list[dict]:
    top = base / f"nb{len(lowered)}"
    top.mkdir()
    os.chown(top, 65534, 65534)
    env = {k: v for k, v in os.environ.items() if k != _features.DEGRADE_ENV}
    if lowered:
        env[_features.DEGRADE_ENV] = lowered
    r = subprocess.run(_AS_NOBODY + [sys.executable, "-c", _NOBODY_RUN, str(top)], capture_output=True, text=True,
                       cwd="/", env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def test_no_user_namespaces_as_root_changes_nothing_but_the_report(degrade):
    """A root host needs no user namespace (it makes its namespaces directly)."""
    degrade("userns")
    found = _features.host_features()
    assert found["user_namespace"] is False
    assert "user namespace: no" in _report()
    if os.geteuid() == 0:
        assert found["pid_namespace"] and found["mount_namespace"]


@needs_abi
def test_no_user_namespaces_unprivileged(nobody_dir):
    """An unprivileged host without user namespaces: no mount layer, no PID namespace of the command's own.

    With ABI 6+ Landlock's scoping stands in (required runs, mount_layer
    reported); with ABI 5 nothing scopes abstract sockets and signals, so
    required refuses; protected paths always need the mount layer.
    """
    why = _nobody_why_not()
    if why:
        pytest.skip(why)
    host_ns = os.readlink("/proc/self/ns/pid")
    full = _as_nobody(nobody_dir, "")
    assert [c["ok"] for c in full] == [True, True, True] and full[0]["ro"] and full[0]["pidns"] != host_ns
    no_userns = _as_nobody(nobody_dir, "userns")
    assert no_userns[0]["ok"] and no_userns[0]["missing"] == ["mount_layer"] and not no_userns[0]["ro"]
    assert no_userns[0]["pidns"] == host_ns  # the helper made no PID namespace: the lowering reached it
    assert not no_userns[2]["ok"] and "protected paths need the mount layer" in no_userns[2]["error"]
    old = _as_nobody(nobody_dir, "userns,landlock=5")
    assert not old[0]["ok"] and "fails closed" in old[0]["error"]
    assert old[1]["ok"] and set(old[1]["missing"]) == {"landlock.scope_abstract_unix", "landlock.scope_signals",
                                                       "mount_layer"}


# ------------------------------------------------------------------ the command line


def test_cli_features_says_what_is_lowered():
    env = dict(os.environ, SANDBOX_FS_DEGRADE="landlock=3,openat2,fuse,cgroup2,userns")
    r = subprocess.run([sys.executable, "-m", "sandbox_fs", "features", "--json"], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout)
    assert found["lowered"] == ["cgroup2", "fuse", "openat2", "userns", "landlock=3"]
    assert (found["landlock_abi"], found["openat2"], found["resolver"], found["fuse"], found["user_namespace"],
            found["processes"]["cgroup2_pids"]) == (min(3, REAL_ABI), False, "fallback", False, False, False)
    r = subprocess.run([sys.executable, "-m", "sandbox_fs", "features"], capture_output=True, text=True,
                       env=dict(os.environ, SANDBOX_FS_DEGRADE="bogus"), timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "SANDBOX_FS_DEGRADE" in r.stderr

