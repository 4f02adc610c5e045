"""``sandbox-fs run --overlay [--audit FILE] [--quota-bytes N] [--quota-inodes N]`` through the command line."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys

import pytest

import sandbox_fs
from sandbox_fs import _features
from sandbox_fs.cli import main

SFS = [sys.executable, "-m", "sandbox_fs"]


def run(*args, **kw):
    return subprocess.run([*SFS, *args], capture_output=True, text=True, timeout=180, **kw)


def _overlay_run_unusable() -> str | None:
    if os.geteuid() != 0:
        return "the overlay needs root here (fsopen of a FUSE mount)"
    usable, reason = _features.fuse_status()
    if not usable:
        return f"FUSE is not usable here: {reason}"
    import sandbox_fs.fuse as fuse
    from sandbox_fs import exec as sfs_exec

    if not hasattr(fuse, "Overlay"):
        return "this build has no sandbox_fs.fuse.Overlay"
    if not hasattr(sfs_exec, "PrivateRoot"):
        return "this build's exec has no PrivateRoot (a command cannot run on the overlay)"
    if sandbox_fs.features()["landlock_abi"] == 0:
        return "kernel has no Landlock (confinement=required is refused)"
    return None


_WHY = _overlay_run_unusable()
needs_overlay_run = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")


@pytest.fixture
def job(tmp_path):
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"entries": {"hello.txt": {"type": "file", "content": "hello\n"}}}))
    wsdir = tmp_path / "wsdir"
    wsdir.mkdir()
    return manifest, ["--manifest", str(manifest), "--workspaces-dir", str(wsdir),
                      "--snapshot-dir", str(tmp_path / "snaps")], wsdir


def _one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


@pytest.mark.parametrize("kind", ["fifo", "chr"])
def test_audit_onto_a_special_file_is_refused_before_anything_runs(job, tmp_path, kind):
    _manifest, common, wsdir = job
    target = tmp_path / "audit.out"
    if kind == "fifo":
        os.mkfifo(target, 0o600)
    else:
        if os.geteuid() != 0:
            pytest.skip("mknod of a character device needs root")
        os.mknod(target, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # a /dev/null twin, in tmp_path
    before = os.lstat(target)
    r = run("run", *common, "--overlay", "--confinement", "best_effort", "--audit", str(target), "--",
            "sh", "-c", "echo ran")
    assert r.returncode == 1 and "ran" not in r.stdout
    line = _one_error_line(r.stderr)
    assert "special_file" in line and str(tmp_path) not in line
    after = os.lstat(target)
    assert (stat.S_IFMT(after.st_mode), after.st_ino, after.st_rdev) == \
        (stat.S_IFMT(before.st_mode), before.st_ino, before.st_rdev), "the special file was replaced"
    assert os.listdir(wsdir) == [], "a workspace was made before the refusal"


@pytest.mark.parametrize("flags", [["--audit", "a.jsonl"], ["--quota-bytes", "10"], ["--quota-inodes", "3"]])
def test_overlay_options_need_overlay(job, flags):
    _manifest, common, wsdir = job
    r = run("run", *common, *flags, "--", "true")
    assert r.returncode == 1
    line = _one_error_line(r.stderr)
    assert "cli_input" in line and f"{flags[0]} needs --overlay" in line
    assert os.listdir(wsdir) == []


def test_quota_options_are_checked_numbers(job):
    _manifest, common, _wsdir = job
    r = run("run", *common, "--overlay", "--quota-bytes", "-1", "--", "true")
    assert r.returncode == 2 and "--quota-bytes" in r.stderr


def test_overlay_unavailable_fails_closed_with_required(job, monkeypatch, capsys):
    _manifest, common, wsdir = job
    monkeypatch.setattr(_features, "fuse_status", lambda: (False, "no FUSE in this test"))
    rc = main(["run", *common, "--overlay", "--confinement", "required", "--", "sh", "-c", "echo ran"])
    out = capsys.readouterr()
    assert rc == 1 and "ran" not in out.out
    line = _one_error_line(out.err)
    assert "overlay_unavailable" in line and "no FUSE in this test" in line
    assert os.listdir(wsdir) == [], "a workspace was made before the refusal"


def test_overlay_unavailable_runs_without_it_with_best_effort(job, monkeypatch, capsys, tmp_path):
    if sandbox_fs.features()["landlock_abi"] == 0:
        pytest.skip("kernel has no Landlock")
    _manifest, common, _wsdir = job
    audit = tmp_path / "audit.jsonl"
    audit.write_text("stale\n")
    monkeypatch.setattr(_features, "fuse_status", lambda: (False, "no FUSE in this test"))
    rc = main(["run", *common, "--overlay", "--confinement", "best_effort", "--audit", str(audit), "--json", "--",
               "cat", "hello.txt"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    report = json.loads(out.out)
    assert report["stdout"] == "hello\n"
    assert report["overlay"] is False and report["overlay_reason"] == "no FUSE in this test"
    assert report["audit"] == {"events": 0, "dropped": 0}
    assert audit.read_bytes() == b""  # no stale events left to mislead


@needs_overlay_run
def test_run_overlay_with_audit_end_to_end(job, tmp_path):
    _manifest, common, _wsdir = job
    audit = tmp_path / "audit.jsonl"
    r = run("run", *common, "--overlay", "--quota-bytes", "10000000", "--audit", str(audit), "--",
            "sh", "-c", "cat hello.txt; echo made > out.txt; cat missing.txt 2>/dev/null; exit 3")
    assert r.returncode == 3, r.stderr
    assert r.stdout == "hello\n"
    assert "overlay: on" in r.stderr and "audit events written" in r.stderr
    assert stat.S_IMODE(audit.stat().st_mode) == 0o600
    events = [json.loads(line) for line in audit.read_text().splitlines()]
    assert events and all(set(e) == {"time_s", "op", "path", "result", "errno"} for e in events)
    assert any(e["path"] == "out.txt" and e["result"] == "ok" for e in events)
    assert any(e["path"] == "missing.txt" and e["errno"] == errno.ENOENT and e["result"] == "ENOENT"
               for e in events)
    # --json says the same
    r = run("run", *common, "--overlay", "--audit", str(audit), "--json", "--", "cat", "hello.txt")
    report = json.loads(r.stdout)
    assert r.returncode == 0 and report["overlay"] is True and report["overlay_reason"] is None
    assert report["audit"]["events"] == len(audit.read_text().splitlines()) > 0


@needs_overlay_run
def test_run_overlay_quota_stops_a_command_filling_the_workspace(job):
    _manifest, common, _wsdir = job
    r = run("run", *common, "--overlay", "--quota-bytes", "1000000", "--",
            "sh", "-c", "head -c 2000000 /dev/zero > big; echo rc=$?; wc -c < big")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split()
    assert lines[0] != "rc=0" and int(lines[1]) <= 1000000
