"""Container-escape reports against the confined command, replayed with the sandbox as the container.

Each test names its report and the attack in its docstring and checks host
state afterwards (the outside sentinel tree, a binary's digest, the host's
mount table), not only the command's exit status.  A positive control in each
shows the same step works where it is allowed, so the test can fail.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time

import pytest

import sandbox_fs
from sandbox_fs import open_root
from sandbox_fs import exec as sfs_exec
from sandbox_fs.exec import run_confined

ABI = sandbox_fs.features()["landlock_abi"]
pytestmark = [
    pytest.mark.skipif(not os.access(sfs_exec.helper_path(), os.X_OK),
                       reason="sandbox_fs/sfs-exec is not built (pip install -e . builds it)"),
    pytest.mark.skipif(ABI == 0, reason="features()['landlock_abi'] is 0: the kernel has no Landlock"),
]


def sha256(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


# The command may not list /proc; it probes its own entries and the first pid numbers (its namespace's,
# and the host's own pid and parent pid, which mean other processes or nothing there).
PIDS = f"pids='/proc/self /proc/thread-self $(seq -f /proc/%g 1 64) /proc/{os.getpid()} /proc/{os.getppid()}'\n"


async def run(layout, ws, script: str, **kw):
    return await run_confined(["/bin/sh", "-c", script], workspace=ws, workspace_host_path=str(layout.ws), **kw)


async def test_cve_2019_5736_binary_reopened_through_proc_self_exe_stays_unchanged(layout, ws, contained, tmp_path):
    """CVE-2019-5736 (runc): the container kept a descriptor of the runtime's own binary from
    ``/proc/self/exe`` and, once that binary stopped running, reopened it for writing through
    ``/proc/self/fd/N``; here the binary is a read-only granted copy of the shell."""
    tools = tmp_path / "tools"
    tools.mkdir()
    shutil.copy2("/usr/bin/dash", tools / "sh")
    digest = sha256(tools / "sh")
    helper = sha256(sfs_exec.helper_path())
    (layout.ws / "control.txt").write_text("before\n")
    script = ("exec 3</proc/self/exe 4<control.txt; "
              "exec /bin/sh -c '(echo pwned >/proc/self/fd/3) 2>/dev/null && echo WROTE-EXE; "
              "(echo pwned >>/proc/self/exe) 2>/dev/null && echo WROTE-SELF; "
              "(echo after >/proc/self/fd/4) && echo WROTE-CONTROL'")
    with open_root(tools, read_only=True) as granted:
        r = await run_confined([str(tools / "sh"), "-c", script], workspace=ws,
                               workspace_host_path=str(layout.ws), grants=[(granted, True)])
    assert b"WROTE-EXE" not in r.stdout and b"WROTE-SELF" not in r.stdout, r.stdout
    assert sha256(tools / "sh") == digest, "the granted binary was overwritten"
    assert sha256(sfs_exec.helper_path()) == helper
    # positive control: the same reopen through /proc/self/fd works on a workspace file
    assert b"WROTE-CONTROL" in r.stdout, (r.stdout, r.stderr)
    assert (layout.ws / "control.txt").read_text() == "after\n"
    contained.check()


async def test_cve_2024_21626_no_host_directory_through_any_visible_proc_link(layout, ws, contained):
    """CVE-2024-21626 (runc "Leaky Vessels"): a host directory descriptor left open in a process the
    container could see let it ``cd /proc/<pid>/fd/N`` (or ``cwd``/``root``) and walk the host. Every
    magic link the command can see must lead into its own view only."""
    (layout.ws / "marker-inside").write_text("in\n")
    script = PIDS + r"""
for l in $(for p in $pids; do echo $p/fd/* $p/cwd $p/root $p/task/*/cwd; done); do
  [ -d "$l" ] || continue
  (cd "$l" 2>/dev/null && d=$(pwd -P) && echo "DIR $l $d" &&
   for t in secret.txt outside/secret.txt ../outside/secret.txt ../../outside/secret.txt; do
     cat "$t" 2>/dev/null
   done;
   (echo pwned > ../outside/pwned.txt) 2>/dev/null; (echo pwned > ../../outside/pwned.txt) 2>/dev/null)
done
echo end
"""
    r = await run(layout, ws, script)
    assert r.stdout.endswith(b"end\n"), (r.stdout, r.stderr)
    assert layout.secret.encode() not in r.stdout + r.stderr
    dirs = [line.split()[2] for line in r.stdout.decode().splitlines() if line.startswith("DIR ")]
    assert dirs, "the command saw no directory at all: the walk did not run"
    for d in dirs:
        assert not d.startswith(str(layout.outside)), d
    contained.check()
    assert not (layout.outside / "pwned.txt").exists()


async def test_cve_2016_9962_host_process_memory_and_environment_unreadable(layout, ws, contained, monkeypatch):
    """CVE-2016-9962 (runc): the runtime's process joining the container could be ptraced or read
    through ``/proc/<pid>/mem`` by the container before it dropped its secrets. No process the command
    can see may yield the host's environment or memory."""
    secret = "HOSTSECRET-" + os.urandom(8).hex()
    monkeypatch.setenv("SFS_ACCEPTANCE_HOST_SECRET", secret)
    script = PIDS + r"""
for p in $pids; do
  cat "$p/environ" "$p/cmdline" 2>/dev/null | tr '\0' '\n'
  dd if="$p/mem" bs=4096 count=64 skip=16 2>/dev/null | tr -c '[:print:]' '\n'
done
echo end
"""
    probe = "probe-" + secret[::-1]
    r = await run(layout, ws, script, env={"SFS_PROBE": probe})
    assert r.stdout.endswith(b"end\n"), r.stderr
    assert secret.encode() not in r.stdout + r.stderr
    # control: without Landlock the same script reads the environ of its own processes (so the reads
    # work), and the host's secret stays out of reach (the host process is another user's)
    r2 = await run(layout, ws, script, env={"SFS_PROBE": probe}, confinement="none")
    assert probe.encode() in r2.stdout, r2.stderr[-300:]
    assert secret.encode() not in r2.stdout + r2.stderr
    contained.check()


def _mounts() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return sorted(line.split(" - ")[0].split(" ", 4)[4] for line in f)


async def test_cve_2022_0492_no_cgroup_mount_through_a_new_user_namespace(layout, ws, contained):
    """CVE-2022-0492 (cgroup v1 ``release_agent``): a container process made a user and mount namespace
    of its own, mounted a cgroup v1 hierarchy there and set a ``release_agent`` the host ran as root."""
    before = _mounts()
    agent = layout.outside / "pwned.txt"
    script = f"""
mkdir -p cg
unshare -Urm sh -c 'mount -t cgroup -o rdma cgroup cg && echo MOUNTED &&
  echo 1 > cg/notify_on_release && echo "#!/bin/sh
echo pwned > {agent}" > cg/agent && echo $PWD/cg/agent > cg/release_agent && echo AGENT' 2>/dev/null
mount -t cgroup -o rdma cgroup cg 2>/dev/null && echo MOUNTED-DIRECT
unshare -U true 2>/dev/null && echo USERNS
echo end
"""
    r = await run(layout, ws, script)
    assert r.stdout.endswith(b"end\n"), r.stderr
    for word in (b"MOUNTED", b"AGENT", b"USERNS"):
        assert word not in r.stdout, r.stdout
    assert _mounts() == before
    # positive controls: the workspace write of the same script worked, and unconfined the same
    # user namespace is made (so the refusal above is the sandbox's)
    assert (layout.ws / "cg").is_dir()
    r2 = await run(layout, ws, "unshare -U true && echo USERNS", confinement="none")
    assert r2.stdout == b"USERNS\n", r2.stderr
    contained.check()
    assert not agent.exists()


async def test_cve_2021_30465_protected_path_placeholders_never_follow_a_swapped_in_symlink(layout, ws):
    """CVE-2021-30465 (runc mount destinations): the runtime created a mount's missing destination by
    name while the container swapped a directory on its path for a symlink, so it created (and
    mounted) on the host. Here a racing process keeps turning ``.git`` into a symlink to a host
    directory while runs make their missing protected placeholders (``.git/config``, ``.git/hooks/``)."""
    from sandbox_fs import _native
    from sandbox_fs.exec import ConfinementPolicy

    host_dir = layout.outside / "gitdir"
    host_dir.mkdir()
    before = layout.snapshot()
    stop = threading.Event()
    swaps = [0]

    def attacker() -> None:
        dirfd = os.open(layout.ws, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            while not stop.is_set():
                try:
                    os.symlink(host_dir, layout.ws / ".gitlink")
                except FileExistsError:
                    pass
                # a real .git made by the run is exchanged for the symlink; a missing one is the symlink
                if _native.renameat2_raw(dirfd, b".gitlink", dirfd, b".git", _native.RENAME_EXCHANGE) == 0:
                    swaps[0] += 1
                else:
                    try:
                        os.rename(layout.ws / ".gitlink", layout.ws / ".git")
                        swaps[0] += 1
                    except OSError:
                        pass
                time.sleep(0.0005)
        finally:
            os.close(dirfd)

    policy = ConfinementPolicy(protected=(".git/config", ".git/hooks/"))
    t = threading.Thread(target=attacker, daemon=True)
    t.start()
    outcomes: list[str] = []
    try:
        for _ in range(15):
            try:
                r = await run(layout, ws, "(echo evil > .git/config) 2>/dev/null && echo WROTE; echo end",
                              policy=policy)
                outcomes.append("ran" if r.stdout.endswith(b"end\n") else "odd")
            except (sandbox_fs.SandboxError, OSError) as e:
                outcomes.append(f"{type(e).__name__}: {e}")
    finally:
        stop.set()
        t.join()
    assert swaps[0] > 10, f"the attacker barely ran ({swaps[0]} swaps)"
    assert "odd" not in outcomes, outcomes  # every run either ran to its end or was refused (fail closed)
    assert os.listdir(host_dir) == [], "a placeholder was made in the host directory"
    layout.assert_outside_unchanged(before)
    layout.assert_secret_absent()
