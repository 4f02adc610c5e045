"""The main job, ``sandbox-fs run``, end to end through the command line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

import sandbox_fs

SFS = [sys.executable, "-m", "sandbox_fs"]
needs_landlock = pytest.mark.skipif(sandbox_fs.features()["landlock_abi"] == 0,
                                    reason="kernel has no Landlock (features()['landlock_abi'] == 0)")


def run(*args, **kw):
    return subprocess.run([*SFS, *args], capture_output=True, text=True, timeout=120, **kw)


@pytest.fixture
def job(layout):
    base = layout.base / "base"
    (base / "proj" / "pkg").mkdir(parents=True)
    (base / "proj" / "pkg" / "mod.py").write_text("X = 1\n")
    manifest = {
        "entries": {
            "proj": {"type": "local_dir", "src": "proj"},
            "hello.txt": {"type": "file", "content": "hello\n"},
        },
        "environment": {"TOKEN": {"value": "s3cr3t-value", "secret": True}, "PLAIN": "visible"},
    }
    mpath = layout.base / "manifest.json"
    mpath.write_text(json.dumps(manifest))
    common = ["--base", str(base), "--workspaces-dir", str(layout.base / "wsdir"),
              "--snapshot-dir", str(layout.base / "snaps")]
    (layout.base / "wsdir").mkdir()
    return layout, mpath, common


@needs_landlock
def test_run_persist_and_resume_from_snapshot(job):
    layout, mpath, common = job
    before = layout.snapshot()
    state = layout.base / "state.json"
    r = run("run", "--manifest", str(mpath), *common, "--state", str(state), "--",
            "/bin/sh", "-c", f"cat hello.txt; echo $PLAIN; echo made > out.txt; "
                             f"cat {layout.outside}/secret.txt; exit 7")
    assert r.returncode == 7, r.stderr
    assert "hello\nvisible\n" in r.stdout
    assert layout.secret not in r.stdout + r.stderr, "the confined command read outside"
    assert "Traceback" not in r.stderr
    data = json.loads(state.read_text())
    assert "s3cr3t-value" not in state.read_text()
    assert data["snapshot"]
    # the workspace is lost; a new session resumes from the snapshot
    shutil.rmtree(layout.base / "wsdir")
    (layout.base / "wsdir").mkdir()
    r = run("run", "--resume", str(state), *common, "--json", "--", "/bin/cat", "out.txt", "proj/pkg/mod.py")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["start_mode"] == "restored" and rep["stdout"] == "made\nX = 1\n"
    assert rep["confinement"] == "landlock"
    layout.assert_outside_unchanged(before)


def test_run_refusals_are_one_line(job, tmp_path):
    layout, mpath, common = job
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"entries": {"../escape": {"type": "file", "content": "x"}}}))
    for args in (["run", "--manifest", str(bad), *common, "--", "/bin/true"],
                 ["run", *common, "--", "/bin/true"],
                 ["run", "--manifest", str(mpath), *common],
                 ["run", "--resume", str(tmp_path / "missing.json"), *common, "--", "/bin/true"]):
        r = run(*args)
        assert r.returncode != 0
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("sandbox-fs: error:"), r.stderr
        assert "Traceback" not in r.stderr
    assert not (layout.base / "escape").exists()


def test_run_required_confinement_fails_closed_without_landlock(job, monkeypatch):
    if sandbox_fs.features()["landlock_abi"] != 0:
        pytest.skip("this machine has Landlock; the fail-closed path is covered in tests/test_exec*.py")
    layout, mpath, common = job
    r = run("run", "--manifest", str(mpath), *common, "--", "/bin/true")
    assert r.returncode != 0 and "Traceback" not in r.stderr


@pytest.mark.parametrize("args", [["bogus"], ["extract"], ["snapshot", "restore", "--store", "s"],
                                  ["run", "--timeout", "soon", "--", "true"]])
def test_usage_errors_are_one_line(args):
    r = run(*args)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("sandbox-fs: error: usage:"), r.stderr


def test_bad_limit_is_a_usage_error(tmp_path):
    """A limit outside ArchiveLimits' bounds is refused by the parser (exit 2), before any work."""
    (tmp_path / "a.tar").write_bytes(b"")
    r = run("extract", str(tmp_path / "a.tar"), "--into", str(tmp_path / "d"), "--max-members", "-1")
    assert r.returncode == 2
    assert r.stderr.startswith("sandbox-fs: error: usage: argument --max-members: '-1' is out of range")
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "d").exists()


# ------------------------------------------------------------------ supervision of `run` itself

def _tagged(tag: str) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if tag.encode() in f.read():
                        with open(f"/proc/{name}/stat") as s:
                            if s.read().rsplit(")", 1)[1].split()[0] != "Z":
                                out.append(int(name))
            except OSError:
                pass
    return out


def _start_run(job, tag, *extra):
    """`sandbox-fs run` of a 2 s loop that then writes `marker`; returns (proc, workspace, deadline)."""
    import time

    layout, mpath, common = job
    ws = layout.base / "cli-ws"
    script = ("touch started; i=0; while [ $i -lt 20 ]; do sleep 0.1; i=$((i+1)); done; echo x > marker")
    proc = subprocess.Popen([*SFS, "run", "--manifest", str(mpath), *common, "--root", str(ws), *extra, "--",
                             "/bin/sh", "-c", script, tag], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    t0 = time.monotonic()
    while not (ws / "started").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() - t0 < 60, "the command never started"
        time.sleep(0.02)
    return proc, ws, time.monotonic() + 2.0


def _wait_no_tag(tag: str, timeout_s: float = 5.0) -> list[int]:
    import time

    end = time.monotonic() + timeout_s
    while _tagged(tag) and time.monotonic() < end:
        time.sleep(0.02)
    return _tagged(tag)


@needs_landlock
def test_run_killed_leaves_no_command_behind(job):
    """SIGKILL of `run` ends the confined command (its init's lifeline closes): it never writes again."""
    import signal
    import time

    tag = "sfs-cli-kill-" + os.urandom(4).hex()
    proc, ws, loop_end = _start_run(job, tag)
    assert _tagged(tag), "the command's shell should be running"
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert _wait_no_tag(tag) == [], "the confined command outlived `sandbox-fs run`"
    time.sleep(max(0.0, loop_end - time.monotonic()) + 0.3)
    assert not (ws / "marker").exists(), "the confined command wrote into the workspace after run was killed"


@needs_landlock
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_run_signalled_stops_persists_and_exits_128_plus_n(job, signame):
    import signal

    layout, _, _ = job
    sig = getattr(signal, signame)
    tag = "sfs-cli-term-" + os.urandom(4).hex()
    state = layout.base / "state.json"
    proc, ws, _ = _start_run(job, tag, "--state", str(state))
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert f"{signame} received: the command was stopped" in err, err
    assert "Traceback" not in err
    assert _tagged(tag) == []
    assert not (ws / "marker").exists()
    data = json.loads(state.read_text())
    assert data["snapshot"], "the run stopped by a signal persisted no snapshot"
    # The persisted snapshot holds what the command made before it was stopped.
    shutil.rmtree(ws)
    r = run("run", "--resume", str(state), *job[2], "--json", "--", "/bin/ls", "started")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["stdout"] == "started\n"
