"""Confined execution (issue 6, sections 1-3 and 6): what a confined child can and cannot do.

Attack tests check the outside sentinel tree (``layout``), not only exit
codes, and each denial has a positive control showing the same command
works when allowed, so the tests can fail.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys

import pytest
import trio

import sandbox_fs
from sandbox_fs import open_root
from sandbox_fs.exec import _landlock
from sandbox_fs import exec as sfs_exec
from sandbox_fs.exec import _helper, _output
from sandbox_fs.errors import PathEscapeError
from sandbox_fs.exec import (
    CommandNotFoundError,
    ConfinementError,
    ConfinementPolicy,
    ExecFailedError,
    ExecTimeoutError,
    ProcessSupervisor,
    run_confined,
)

ABI = sandbox_fs.features()["landlock_abi"]
HELPER = os.access(sfs_exec.helper_path(), os.X_OK)

pytestmark = pytest.mark.skipif(not HELPER, reason="sandbox_fs/sfs-exec is not built (pip install -e . builds it)")
needs_landlock = pytest.mark.skipif(ABI == 0, reason="features()['landlock_abi'] is 0: the kernel has no Landlock")
needs_net = pytest.mark.skipif(ABI < 4, reason="Landlock ABI < 4: no TCP rules")
needs_scope = pytest.mark.skipif(ABI < 6, reason="Landlock ABI < 6: no signal scoping")

PYTHON = os.path.join(sys.base_prefix, "bin", "python3")


async def run(layout, ws, argv, **kw):
    return await run_confined(argv, workspace=ws, workspace_host_path=str(layout.ws), **kw)


def sh(script):
    return ["/bin/sh", "-c", script]


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


async def wait_gone(pid: int, timeout_s: float = 3.0) -> bool:
    with trio.move_on_after(timeout_s):
        while pid_alive(pid):
            await trio.sleep(0.02)
        return True
    return False


# Every command runs in a PID namespace of its own: it prints that namespace
# (pids inside mean nothing to the host) and the host checks that no process
# of it is left.
NS = "readlink /proc/self/ns/pid; "


def ns_members(ns: str) -> list[int]:
    """Host pids of live processes in PID namespace ``ns`` ("pid:[inode]")."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.readlink(f"/proc/{name}/ns/pid") == ns and pid_alive(int(name)):
                    out.append(int(name))
            except OSError:
                pass
    return out


async def wait_ns_empty(ns: str, timeout_s: float = 3.0) -> bool:
    assert ns.startswith("pid:["), ns
    with trio.move_on_after(timeout_s):
        while ns_members(ns):
            await trio.sleep(0.02)
        return True
    return False


# ------------------------------------------------------------------ filesystem

@needs_landlock
async def test_cannot_read_root_or_host_home(layout, ws):
    home = os.path.expanduser("~")
    r = await run(layout, ws, sh(f"ls /root; cat /root/.bashrc; ls {home}; echo done"))
    assert r.confinement == "landlock"
    assert r.stdout == b"done\n"
    assert r.stderr.count(b"Permission denied") == 3
    # positive control: unconfined the same listing works
    r2 = await run(layout, ws, sh("ls /root >/dev/null && echo ok"), confinement="none")
    assert r2.stdout == b"ok\n"


@needs_landlock
async def test_cannot_read_outside_sentinel(layout, ws):
    before = layout.snapshot()
    out = layout.outside
    argv = sh(f"cat {out}/secret.txt; cat {out}/subdir/inner.txt; ls {out}; cp {out}/secret.txt stolen; echo end")
    r = await run(layout, ws, argv)
    assert layout.secret.encode() not in r.stdout + r.stderr
    assert b"sentinel.txt" not in r.stdout
    assert r.stdout.endswith(b"end\n")
    layout.assert_secret_absent()
    layout.assert_outside_unchanged(before)
    # positive control: without Landlock the secret is readable, so the test can fail
    r2 = await run(layout, ws, ["cat", f"{out}/secret.txt"], confinement="none")
    assert layout.secret.encode() in r2.stdout


@needs_landlock
async def test_proc_self_root_magic_link_does_not_escape(layout, ws):
    before = layout.snapshot()
    r = await run(layout, ws, ["cat", f"/proc/self/root{layout.outside}/secret.txt"])
    assert r.exit_code != 0
    assert layout.secret.encode() not in r.stdout
    # /proc/self itself is granted to the started process
    r2 = await run(layout, ws, ["grep", "-c", "CapEff", "/proc/self/status"])
    assert r2.stdout == b"1\n"
    layout.assert_outside_unchanged(before)


@needs_landlock
async def test_cannot_write_outside(layout, ws):
    before = layout.snapshot()
    out = layout.outside
    script = "; ".join([
        f"echo x > {out}/new.txt", f"echo x >> {out}/sentinel.txt", f"mkdir {out}/d", f"rm {out}/sentinel.txt",
        f"mv {out}/sentinel.txt moved", f"ln {out}/sentinel.txt hardlink", f"touch {out}/subdir/t",
        "echo x > /tmp/sfs-exec-escape-$$", f"chmod 777 {out}/secret.txt", "echo end",
    ])
    r = await run(layout, ws, sh(script))
    assert r.stdout == b"end\n"
    assert not any(n.startswith("sfs-exec-escape-") for n in os.listdir("/tmp"))
    assert not ws.exists("moved") and not ws.exists("hardlink")
    layout.assert_outside_unchanged(before)


@pytest.fixture
def wlayout(world_tmp):
    """``layout`` in a directory every uid may search, with its workspace Root.

    pytest's tmp_path sits under a 0700 directory, which the child's mount
    namespace hides from an unprivileged identity; tests of the read-only
    mount layer need the outside tree visible to the child.
    """
    from tests import conftest  # not "import conftest": tests/acceptance has a conftest of its own

    base = world_tmp / "l"
    (base / "ws").mkdir(parents=True)
    (base / "outside" / "subdir").mkdir(parents=True)
    secret = "SECRET-" + os.urandom(16).hex()
    (base / "outside" / "secret.txt").write_text(secret + "\n")
    (base / "outside" / "sentinel.txt").write_text("sentinel\n")
    (base / "outside" / "subdir" / "inner.txt").write_text("inner " + secret + "\n")
    for p in (base, base / "outside", base / "outside" / "subdir"):
        os.chmod(p, 0o755)
    lay = conftest.Layout(base, base / "ws", base / "outside", secret)
    root = open_root(lay.ws)
    yield lay, root
    root.close()


@needs_landlock
@pytest.mark.parametrize("identity", ["auto", "host"])
async def test_metadata_changes_outside_refused(wlayout, identity):
    """Landlock does not cover chmod/chown/utime/xattr: the read-only mount layer must (root host),
    whether the child runs as the leased identity or as uid 0."""
    if os.geteuid() != 0:
        pytest.skip("read-only mounts are applied only when the host runs as root (documented residual)")
    layout, ws = wlayout
    policy = ConfinementPolicy(identity=identity)
    before = layout.snapshot()
    out = layout.outside
    r = await run(layout, ws, sh(f"chmod 777 {out}/secret.txt; chown 1:1 {out}/sentinel.txt; "
                                 f"touch -d 2001-01-01 {out}/subdir/inner.txt; touch -h -d 2001-01-01 {out}; "
                                 f"echo in > f; chmod 700 f; touch -d 2001-01-01 f; echo end"), policy=policy)
    assert r.stdout == b"end\n" and r.read_only_mounts
    assert r.stderr.count(b"Read-only file system") >= 3, r.stderr
    layout.assert_outside_unchanged(before)
    st = ws.stat("f")
    assert st.st_mode & 0o777 == 0o700 and st.st_mtime < 1e9 + 1e7  # inside: metadata changes work


@needs_landlock
async def test_metadata_refused_in_the_supervisors_held_mount_namespace(wlayout):
    """A supervisor makes the read-only mount namespace once and every process joins it."""
    if os.geteuid() != 0:
        pytest.skip("read-only mounts are tested as root here")
    layout, ws = wlayout
    before = layout.snapshot()
    out = layout.outside
    sup = ProcessSupervisor()
    try:
        for i in range(3):
            ws.mkdir(f"d{i}")
            r = await run(layout, ws, sh(f"chmod 4777 {out}/secret.txt; touch -d 2001-01-01 {out}/sentinel.txt; "
                                         f"echo in > f{i} && chmod 600 f{i} && echo ok; pwd"),
                          supervisor=sup, cwd=f"d{i}")
            assert r.read_only_mounts and r.stdout == f"ok\n{layout.ws}/d{i}\n".encode(), r.stderr
            assert ws.stat(f"d{i}/f{i}").st_mode & 0o777 == 0o600
        assert len(sup._ns_fds) == 1
    finally:
        await sup.aclose()
    assert sup._ns_fds == {}
    layout.assert_outside_unchanged(before)


@needs_landlock
async def test_write_inside_works(layout, ws):
    r = await run(layout, ws, sh("mkdir -p a/b && echo data > a/b/f && ln -s b/f a/l && cat a/l && mv a/b/f a/g"))
    assert r.exit_code == 0, r.stderr
    assert r.stdout == b"data\n"
    assert ws.read_bytes("a/g") == b"data\n"


@needs_landlock
async def test_symlink_to_outside_cannot_be_followed(layout, ws):
    before = layout.snapshot()
    out = layout.outside
    r = await run(layout, ws, sh(f"ln -s {out}/secret.txt link && ln -s {out} dirlink && echo made; "
                                 f"cat link; cat dirlink/subdir/inner.txt; echo pwn > link; echo pwn > dirlink/n; echo end"))
    assert r.stdout == b"made\nend\n"
    assert layout.secret.encode() not in r.stdout + r.stderr
    assert ws.lstat("link") and ws.readlink("link").endswith("secret.txt")
    layout.assert_secret_absent()
    layout.assert_outside_unchanged(before)


@needs_landlock
async def test_no_device_nodes_and_no_capabilities(layout, ws):
    r = await run(layout, ws, sh("mknod dev c 1 3; grep CapEff /proc/$$/status; echo end"))
    assert not ws.exists("dev")
    # no capabilities left even though we are root
    r2 = await run(layout, ws, ["grep", "CapEff", "/proc/self/status"])
    assert r2.stdout.split()[-1] == b"0000000000000000"
    assert r.stdout.endswith(b"end\n")


@needs_landlock
async def test_read_only_workspace_is_read_only_for_the_child(layout, ws):
    ws.write_bytes("f", b"old")
    ro = ws.with_options(read_only=True)
    try:
        r = await run_confined(sh("cat f; echo new > f; echo end"), workspace=ro, workspace_host_path=str(layout.ws))
    finally:
        ro.close()
    assert r.stdout == b"oldend\n"
    assert ws.read_bytes("f") == b"old"


@needs_landlock
async def test_python_needs_an_explicit_read_only_grant(layout, ws, pygrant):
    with pytest.raises(CommandNotFoundError) as info:
        await run(layout, ws, [PYTHON, "-c", "print(1)"])
    assert info.value.code == "command_not_found"
    r = await run(layout, ws, [PYTHON, "-c", "open('made.txt','w').write('py')"], grants=pygrant)
    assert r.exit_code == 0, r.stderr
    assert ws.read_bytes("made.txt") == b"py"
    # the grant is read-only for the child
    r = await run(layout, ws, sh(f"touch {sys.base_prefix}/sfs-exec-probe; echo end"), grants=pygrant)
    assert not os.path.exists(f"{sys.base_prefix}/sfs-exec-probe")


@needs_landlock
async def test_read_write_grant_and_nested_read_only_grant(layout, ws):
    """A read-write grant works for the identity that owns it; one it does not own is refused
    (root host: the child could not write it; SECURITY.md, confined commands' identity)."""
    from sandbox_fs.exec import _identity

    sub = layout.outside / "subdir"
    g = open_root(sub)
    try:
        if os.geteuid() == 0:
            with pytest.raises(ConfinementError, match="not owned by the confined identity"):
                await run(layout, ws, ["sh", "-c", f"echo w > {sub}/w.txt"], grants=[(g, False)])
            assert not (sub / "w.txt").exists()
            with _identity.lease() as lease:
                os.chown(sub, lease.uid, lease.gid)
                r = await run(layout, ws, ["sh", "-c", f"echo w > {sub}/w.txt"], grants=[(g, False)],
                              policy=ConfinementPolicy(identity=lease.ids))
                assert r.identity == lease.ids and (sub / "w.txt").stat().st_uid == lease.uid
        else:
            r = await run(layout, ws, ["sh", "-c", f"echo w > {sub}/w.txt"], grants=[(g, False)])
        assert r.exit_code == 0, r.stderr
        assert (sub / "w.txt").read_text() == "w\n"
    finally:
        g.close()
    ws.mkdir("ro")
    inner = ws.open_root("ro", read_only=True)
    try:
        with pytest.raises(ConfinementError, match="cannot be enforced"):  # bound read-only with the mount
            await run(layout, ws, ["true"], grants=[(inner, True)],  # layer: tests/test_grants.py
                      policy=ConfinementPolicy(read_only_mounts=False))
    finally:
        inner.close()


def test_system_set_never_covers_the_workspace_or_root(layout, tmp_path):
    """Regression: a stray symlink /etc/b -> .. once granted all of / (a test elsewhere created it)."""
    for rule in _landlock.system_rules():
        real = os.path.realpath(rule.host_path)
        assert real not in ("/", "/tmp", "/root", "/home", "/proc", "/sys"), rule
        assert not str(layout.base).startswith(real.rstrip("/") + "/"), rule
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "conf").write_text("x")
    (etc / "shadow").write_text("x")
    (etc / "private").write_text("x")
    os.chmod(etc / "private", 0o600)
    os.symlink("..", etc / "up")
    os.symlink("/", etc / "root")
    os.symlink("/usr/bin", etc / "bin")
    names = {os.path.basename(r.host_path) for r in _landlock._etc_rules(str(etc))}
    assert names == {"conf", "bin"}


def _outside_ops():
    from hypothesis import strategies as st
    targets = st.sampled_from(["OUT/secret.txt", "OUT/subdir/inner.txt", "OUT/subdir", "OUT", "/root/.bashrc",
                               "/root", "/etc/shadow", "/tmp/sfs-exec-prop", "/home", "/var/tmp/sfs-exec-prop"])
    ops = st.sampled_from(["cat {t}", "ls {t}", "echo x > {t}", "echo x >> {t}", "mkdir {t}/n", "rm -rf {t}",
                           "touch {t}", "ln -s {t} l$$ && cat l$$", "cp {t} c$$", "mv {t} m$$", "chmod 777 {t}",
                           "ln {t} h$$", "cat ../../{t}", "truncate -s 0 {t}",
                           "touch -d 2001-01-01 {t}", "chown 1 {t}", "chmod 4755 {t}"])
    return st.lists(st.tuples(ops, targets), min_size=1, max_size=12)


@needs_landlock
def test_property_no_operation_reaches_outside(layout):
    """Any mix of read/write/link/rename operations on paths outside the workspace stays inside."""
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(_outside_ops())
    def prop(ops):
        before = layout.snapshot()
        script = "; ".join(op.format(t=t.replace("OUT", str(layout.outside))) for op, t in ops) + "; echo end"

        async def main():
            root = open_root(layout.ws)
            try:
                return await run_confined(sh(script), workspace=root, workspace_host_path=str(layout.ws))
            finally:
                root.close()

        r = trio.run(main)
        assert r.stdout.endswith(b"end\n")
        assert layout.secret.encode() not in r.stdout + r.stderr
        layout.assert_secret_absent()
        layout.assert_outside_unchanged(before)
        assert not os.path.exists("/tmp/sfs-exec-prop") and not os.path.exists("/var/tmp/sfs-exec-prop")
        assert os.path.exists("/root/.bashrc") or not os.path.exists("/root")

    prop()


# ------------------------------------------------------------------ network and signals

@needs_net
async def test_tcp_connect_to_loopback_denied_unless_allowed(layout, ws):
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(4)
        port = srv.getsockname()[1]
        argv = ["bash", "-c", f"echo hi > /dev/tcp/127.0.0.1/{port} && echo connected"]
        r = await run(layout, ws, argv)
        assert b"connected" not in r.stdout
        assert b"Address family not supported" in r.stderr      # no TCP port allowed: no inet socket
        r1 = await run(layout, ws, argv, policy=ConfinementPolicy(allow_tcp_connect=frozenset({1})))
        assert b"connected" not in r1.stdout
        assert b"Permission denied" in r1.stderr                # another port allowed: Landlock
        r2 = await run(layout, ws, argv, policy=ConfinementPolicy(allow_tcp_connect=frozenset({port})))
        assert r2.stdout == b"connected\n", r2.stderr


@needs_net
async def test_tcp_bind_denied(layout, ws, pygrant):
    code = "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); print('bound')"
    r = await run(layout, ws, [PYTHON, "-c", code], grants=pygrant)
    assert b"bound" not in r.stdout and b"Errno 97" in r.stderr       # seccomp: no inet socket
    r = await run(layout, ws, [PYTHON, "-c", code], grants=pygrant,
                  policy=ConfinementPolicy(allow_tcp_connect=frozenset({1})))
    assert b"bound" not in r.stdout and b"PermissionError" in r.stderr  # Landlock: no bind rule


@needs_scope
async def test_signal_to_parent_denied(layout, ws):
    # The host is outside the command's PID namespace: its pid names nothing there.
    r0 = await run(layout, ws, sh(f"kill -0 {os.getpid()} && echo signalled"), confinement="none")
    assert b"signalled" not in r0.stdout and b"No such process" in r0.stderr
    # The helper's init (pid 1 there) is outside the Landlock domain: signal scoping refuses it.
    argv = sh("kill -0 1 && echo signalled")
    r = await run(layout, ws, argv)
    assert b"signalled" not in r.stdout
    assert b"not permitted" in r.stderr
    r2 = await run(layout, ws, argv, confinement="none")
    assert r2.stdout == b"signalled\n"


@needs_scope
async def test_abstract_unix_socket_outside_denied(layout, ws, pygrant):
    name = "\0sfs-exec-test-" + os.urandom(6).hex()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        srv.bind(name)
        srv.listen(1)
        code = f"import socket; s=socket.socket(socket.AF_UNIX); s.connect({name!r}); print('connected')"
        # Landlock's scope alone (AF_UNIX sockets allowed, host network namespace).
        open_unix = ConfinementPolicy(allow_unix_sockets=True, isolate_network=False)
        r = await run(layout, ws, [PYTHON, "-c", code], grants=pygrant, policy=open_unix)
        assert b"connected" not in r.stdout and b"PermissionError" in r.stderr, r.stderr
        r2 = await run(layout, ws, [PYTHON, "-c", code], grants=pygrant,
                       policy=ConfinementPolicy(scope_abstract_unix=False, allow_unix_sockets=True,
                                                isolate_network=False))
        assert r2.stdout == b"connected\n", r2.stderr


# ------------------------------------------------------------------ environment

async def test_host_env_secrets_invisible(layout, ws, monkeypatch):
    host_secret = "HOSTSECRET-" + os.urandom(8).hex()
    monkeypatch.setenv("SFS_TEST_HOST_SECRET", host_secret)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", host_secret)
    r = await run(layout, ws, ["env"], env={"VISIBLE": "yes"}, confinement="best_effort")
    lines = r.stdout.decode().splitlines()
    assert host_secret not in r.stdout.decode()
    assert "VISIBLE=yes" in lines
    assert f"HOME={layout.ws}/.home" in lines and f"TMPDIR={layout.ws}/.tmp" in lines
    assert ws.stat(".home") and ws.stat(".tmp")
    names = {ln.split("=", 1)[0] for ln in lines}
    allowed = set(sfs_exec.ENV_ALLOWLIST) | {"PATH", "HOME", "TMPDIR", "VISIBLE", "PWD", "SHLVL", "_"}
    assert {n for n in names if not n.startswith("LC_")} <= allowed


async def test_secret_env_values_never_in_errors(layout, ws):
    token = "tok-" + os.urandom(8).hex()
    with pytest.raises(CommandNotFoundError) as info:
        await run(layout, ws, [f"/nonexistent/{token}"], env={"API_TOKEN": token}, secret_env={"API_TOKEN"})
    err = info.value
    assert token not in str(err) and token not in repr(err) and token not in str(err.to_dict())
    with pytest.raises(ExecFailedError) as info2:
        await run(layout, ws, sh(f"echo {token} >&2; exit 3"), env={"API_TOKEN": token}, secret_env={"API_TOKEN"},
                  check=True)
    assert info2.value.result.exit_code == 3
    assert token not in str(info2.value)
    assert token.encode() in info2.value.result.stderr  # the output itself is the caller's to handle


# ------------------------------------------------------------------ basics

async def test_stdin_cwd_exit_code_and_shell(layout, ws):
    ws.mkdir("sub")
    r = await run(layout, ws, ["cat"], stdin=b"abc" * 1000)
    assert r.stdout == b"abc" * 1000 and r.exit_code == 0
    r = await run(layout, ws, ["pwd"], cwd="sub", confinement="best_effort")
    assert r.stdout.decode().strip() == f"{layout.ws}/sub"
    r = await run(layout, ws, ["echo $((6*7)); exit 5"], shell=True)
    assert (r.exit_code, r.stdout) == (5, b"42\n")
    r = await run(layout, ws, ["echo", "a b", "c"], shell=["bash", "-c"])
    assert r.stdout == b"a b c\n"


async def test_child_starts_with_only_stdin_stdout_stderr(layout, ws):
    extra = os.open("/dev/null", os.O_RDONLY)  # inheritable in the parent: must not reach the child
    os.set_inheritable(extra, True)
    try:
        for confinement in ("best_effort", "none"):
            r = await run(layout, ws, ["ls", "/proc/self/fd"], confinement=confinement)
            # 3 is the directory ls itself opened to list /proc/self/fd
            assert r.stdout.split() == [b"0", b"1", b"2", b"3"], (confinement, r.stdout, r.stderr)
    finally:
        os.close(extra)


async def test_cwd_is_resolved_through_the_root(layout, ws):
    os.symlink(layout.outside, layout.ws / "out")
    with pytest.raises(PathEscapeError):
        await run(layout, ws, ["pwd"], cwd="out")
    with pytest.raises(PathEscapeError):
        await run(layout, ws, ["pwd"], cwd="../outside")


async def test_rlimits_applied(layout, ws):
    pol = ConfinementPolicy(open_files=77, file_size_bytes=4096, cpu_time_s=5)
    r = await run(layout, ws, sh("ulimit -n; ulimit -H -n; ulimit -t; head -c 10000 /dev/zero > big; echo $?"),
                  policy=pol, confinement="best_effort")
    lines = r.stdout.split()
    assert lines[:3] == [b"77", b"77", b"5"]
    assert ws.stat("big").st_size == 4096


async def test_required_fails_closed_without_landlock(layout, ws, monkeypatch):
    monkeypatch.setattr(_landlock, "abi", lambda: 0)
    with pytest.raises(ConfinementError) as info:
        await run(layout, ws, ["true"])
    assert info.value.code == "confinement_unavailable"
    r = await run(layout, ws, ["echo", "ran"], confinement="best_effort")
    assert (r.stdout, r.confinement, r.landlock_abi) == (b"ran\n", "none", 0)


@needs_landlock
async def test_best_effort_reports_landlock(layout, ws):
    r = await run(layout, ws, ["true"], confinement="best_effort")
    assert (r.confinement, r.landlock_abi) == ("landlock", ABI)


async def test_missing_helper_fails_closed(layout, ws, monkeypatch):
    monkeypatch.setattr(_helper, "helper_path", lambda: "/nonexistent/sfs-exec")
    with pytest.raises(ConfinementError, match="helper"):
        await run(layout, ws, ["true"], confinement="none")


async def test_bad_arguments(layout, ws):
    with pytest.raises(sfs_exec.ExecError):
        await run(layout, ws, [])
    with pytest.raises(sfs_exec.ExecError):
        await run(layout, ws, ["true"], confinement="maybe")
    with pytest.raises(sfs_exec.InvalidEnvError):
        await run(layout, ws, ["true"], env={"A=B": "x"})
    with pytest.raises(CommandNotFoundError):
        await run(layout, ws, ["definitely-not-a-program-sfs"])



@pytest.mark.parametrize("timeout_s", [0, 0.0, -1, -0.5, float("nan"), float("inf"), float("-inf"), True, "5"])
async def test_timeout_must_be_a_finite_number_above_zero(layout, ws, timeout_s):
    """timeout_s is checked where the call starts: 0 or less would end the command at once, the rest fail in trio."""
    with pytest.raises(sfs_exec.ExecError, match="timeout_s") as info:
        await run(layout, ws, ["true"], timeout_s=timeout_s)
    assert info.value.code == "exec_error"


@pytest.mark.parametrize("timeout_s", [10 ** 400, -(10 ** 400)], ids=["huge", "minus_huge"])
async def test_timeout_too_large_for_a_float_is_an_exec_error(layout, ws, timeout_s):
    """An int no float can hold is refused like any other bad timeout_s (ExecError), not an OverflowError."""
    with pytest.raises(sfs_exec.ExecError, match="timeout_s") as info:
        await run(layout, ws, ["true"], timeout_s=timeout_s)
    assert info.value.code == "exec_error"


@needs_landlock
async def test_bad_arguments_are_refused_before_anything_starts(layout, ws):
    """The request is validated once, before a namespace, identity or process exists."""
    async with ProcessSupervisor() as sup:
        for kw in (dict(confinement="maybe"), dict(timeout_s=0), dict(shell=[]),
                   dict(policy=ConfinementPolicy(namespaces=frozenset({"bogus"}))),
                   dict(policy=ConfinementPolicy(identity=(0, 0)))):
            with pytest.raises(sfs_exec.ExecError):
                await run(layout, ws, ["true"], supervisor=sup, **kw)
        assert len(sup) == 0 and sup._ns_fds == {} and sup._leases == []
        r = await run(layout, ws, ["true"], supervisor=sup, timeout_s=30)
        assert r.exit_code == 0


def test_the_request_never_shows_secret_values(layout, ws):
    """The one request object passed down holds the environment; its repr shows none of it."""
    from sandbox_fs.exec._models import ExecRequest

    token = "tok-" + os.urandom(6).hex()
    req = ExecRequest.build(["/bin/echo", token], workspace=ws, workspace_host_path=str(layout.ws), grants=None,
                            cwd="", env={"TOKEN": token}, secret_env={"TOKEN"}, shell=False,
                            confinement="required", policy=ConfinementPolicy())
    assert req.secrets == (token,) and req.child_env["TOKEN"] == token and req.argv0 == "/bin/echo"
    assert token not in repr(req)
    with pytest.raises(AttributeError):
        req.cwd = "elsewhere"  # frozen

# ------------------------------------------------------------------ timeouts, output, supervision

async def test_timeout_kills_child_and_grandchildren(layout, ws):
    script = NS + "sleep 1000 & echo $!; (trap '' TERM; sleep 1000) & echo $!; trap '' TERM; sleep 1000"
    with pytest.raises(ExecTimeoutError) as info:
        await run(layout, ws, sh(script), timeout_s=0.5, policy=ConfinementPolicy(kill_grace_s=0.2))
    res = info.value.result
    ns, *pids = res.stdout.decode().split()
    assert len(pids) == 2
    assert res.exit_code == -signal.SIGKILL
    assert await wait_ns_empty(ns), "a grandchild survived the timeout"
    assert info.value.code == "exec_timeout"


async def test_one_gib_output_keeps_memory_bounded(layout, ws):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM (peak RSS)

    def hwm_kib() -> int:
        with open("/proc/self/status") as f:
            return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1))

    base = hwm_kib()
    gib = 1 << 30
    r = await run(layout, ws, sh(f"head -c {gib} /dev/zero; echo tail-marker"), max_output_bytes=1 << 16,
                  confinement="best_effort")
    grown_mib = (hwm_kib() - base) / 1024
    assert r.stdout_truncated and not r.stderr_truncated
    assert r.stdout_bytes == gib + len(b"tail-marker\n")
    assert len(r.stdout) == 1 << 16
    assert r.stdout.endswith(b"tail-marker\n") and r.stdout.startswith(b"\0" * 1000)
    assert grown_mib < 64, f"peak RSS grew by {grown_mib:.1f} MiB while reading 1 GiB"


async def test_nohup_background_gone_after_kill_all(layout, ws):
    """A background process ends with the command that started it (its init ends the namespace)."""
    sup = ProcessSupervisor()
    try:
        r = await run(layout, ws, sh(NS + "nohup sleep 1000 >/dev/null 2>&1 &"), supervisor=sup)
        assert await wait_ns_empty(r.stdout.decode().strip())
        await sup.kill_all()
        assert len(sup) == 0
    finally:
        await sup.aclose()


async def test_setsid_escapee_gone_with_cgroup(layout, ws):
    sup = ProcessSupervisor()
    try:
        if not sup.uses_cgroup:
            pytest.skip("no writable cgroup v2 hierarchy: a setsid escapee is out of reach (documented)")
        script = (NS + "setsid sh -c 'echo $$ > escapee.pid; exec sleep 1000' >/dev/null 2>&1 </dev/null & "
                  "while [ ! -s escapee.pid ]; do sleep 0.01; done")
        r = await run(layout, ws, sh(script), supervisor=sup, confinement="best_effort")
        assert await wait_ns_empty(r.stdout.decode().strip())
        await sup.kill_all()
    finally:
        await sup.aclose()


async def test_private_supervisor_leaves_nothing_behind(layout, ws):
    r = await run(layout, ws, sh(NS + "sleep 1000 >/dev/null 2>&1 &"))
    assert await wait_ns_empty(r.stdout.decode().strip())


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _children() -> list[int]:
    out: list[int] = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/children") as f:
            out += [int(x) for x in f.read().split()]
    return out


async def test_no_zombies_no_leaked_fds(layout, ws):
    await run(layout, ws, ["true"])  # warm-up: trio's own lazily created fds
    before = _fd_count()
    sup = ProcessSupervisor()
    for _ in range(3):
        await run(layout, ws, sh("echo x; sleep 1000 >/dev/null 2>&1 &"), supervisor=sup)
        with pytest.raises(ExecTimeoutError):
            await run(layout, ws, ["sleep", "1000"], timeout_s=0.05, supervisor=sup,
                      policy=ConfinementPolicy(kill_grace_s=0.05))
        with pytest.raises(CommandNotFoundError):
            await run(layout, ws, ["no-such-program-sfs"], supervisor=sup)
    with trio.move_on_after(0.1):
        await run(layout, ws, ["sleep", "1000"], supervisor=sup)
    ws.mkdir("ro")
    inner = ws.open_root("ro", read_only=True)
    with pytest.raises(ConfinementError):  # a nested read-only grant without the mount layer
        await run(layout, ws, ["true"], grants=[(inner, True)], supervisor=sup,
                  policy=ConfinementPolicy(read_only_mounts=False))
    await run(layout, ws, ["true"], grants=[(inner, True)], supervisor=sup)  # bound read-only
    inner.close()
    await sup.aclose()
    assert _fd_count() == before
    assert _children() == []


async def test_cancellation_kills_the_group(layout, ws):
    pid_holder = []

    async def go():
        await run(layout, ws, sh("readlink /proc/self/ns/pid > ns; sleep 1000"))

    with trio.move_on_after(0.5):
        await go()
    ns = ws.read_bytes("ns").decode().strip()
    pid_holder.append(ns)
    assert await wait_ns_empty(ns)


async def test_optional_net_namespace(layout, ws):
    if os.geteuid() != 0:
        pytest.skip("namespaces are only offered when running as root")
    r = await run(layout, ws, ["cat", "/proc/self/net/dev"], policy=ConfinementPolicy(namespaces=frozenset({"net"})))
    names = {ln.split(":")[0].strip() for ln in r.stdout.decode().splitlines()[2:]}
    assert names == {"lo"}, r.stderr


def test_property_head_tail_buffer():
    """The bounded buffer keeps exactly the first and last bytes, whatever the chunking."""
    from hypothesis import given, settings, strategies as st

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.binary(max_size=64), max_size=40), st.integers(min_value=0, max_value=100))
    def prop(chunks, max_bytes):
        buf = _output._HeadTail(max_bytes)
        for c in chunks:
            buf.append(c)
            assert len(buf.head) + len(buf.tail) <= max_bytes + max_bytes // 2 + 64 + 1
        data = b"".join(chunks)
        assert buf.total == len(data)
        if len(data) <= max_bytes:
            assert (buf.value(), buf.truncated) == (data, False)
        else:
            tail = max_bytes // 2
            head = max_bytes - tail
            assert buf.truncated
            assert buf.value() == data[:head] + (data[-tail:] if tail else b"")

    prop()


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


def test_read_only_mounts_for_an_unprivileged_host(world_tmp):
    """The helper's mount layer also works unprivileged (user namespace mapping only our ids)."""
    import shutil
    import subprocess

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root to switch to an unprivileged uid with setpriv")
    base = world_tmp / "nb"
    (base / "ws").mkdir(parents=True)
    (base / "owned.txt").write_text("orig\n")
    for p in (base, base / "ws", base / "owned.txt"):
        os.chown(p, 65534, 65534)
    os.utime(base / "owned.txt", ns=(10**18, 10**18))
    before = os.stat(base / "owned.txt")
    script = (f"echo in > f && chmod 600 f && echo inside-ok; chmod 777 {base}/owned.txt; "
              f"touch -d 2001-01-01 {base}/owned.txt; echo x >> {base}/owned.txt; echo end")
    inner = (f"exec 7<{base}/ws; cd /; exec {sfs_exec.helper_path()} --ro-mounts --rw-tree 7 --cwd 7 -- "
             f"sh -c '{script}'")
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash", "-c", inner],
                       capture_output=True, timeout=30)
    if b"sfs-exec: mounts:" in r.stderr and r.returncode == 127:
        pytest.skip("user namespaces are not available to unprivileged users here")
    assert r.stdout == b"inside-ok\nend\n", r.stderr
    after = os.stat(base / "owned.txt")
    assert (after.st_mode, after.st_mtime_ns, after.st_size) == (before.st_mode, before.st_mtime_ns, before.st_size)
    assert os.stat(base / "ws" / "f").st_mode & 0o777 == 0o600


async def test_background_holding_stdout_does_not_hang_the_call(layout, ws):
    sup = ProcessSupervisor()
    try:
        with trio.fail_after(5):
            r = await run(layout, ws, sh("sleep 1000 & echo started"), supervisor=sup,
                          policy=ConfinementPolicy(eof_grace_s=0.2))
        assert (r.exit_code, r.stdout) == (0, b"started\n")
    finally:
        await sup.aclose()
    assert len(sup) == 0


async def test_without_cgroup_process_groups_still_end_everything(layout, ws):
    # best_effort: without a cgroup a root host may have no process-count bound left
    pol = ConfinementPolicy(use_cgroup=False, kill_grace_s=0.1)
    with pytest.raises(ExecTimeoutError) as info:
        await run(layout, ws, sh(NS + "setsid sleep 1000 & sleep 1000"), timeout_s=0.3, policy=pol,
                  confinement="best_effort")
    assert await wait_ns_empty(info.value.result.stdout.decode().strip())
    r = await run(layout, ws, ["echo", "plain"], policy=pol, confinement="best_effort")
    assert r.stdout == b"plain\n"


async def test_stdin_from_an_async_stream(layout, ws):
    async def chunks():
        for i in range(50):
            yield f"line {i}\n".encode()
            await trio.sleep(0)

    r = await run(layout, ws, ["wc", "-l"], stdin=chunks())
    assert r.stdout.strip() == b"50"
