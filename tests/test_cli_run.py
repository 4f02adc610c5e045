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
