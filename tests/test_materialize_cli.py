"""``sandbox-fs apply`` and ``sandbox-fs schema`` at the command line."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox_fs.manifest import Manifest


def cli(*args: str, cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sandbox_fs", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def write(p: Path, data) -> Path:
    p.write_text(json.dumps(data))
    return p


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 1, proc
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture
def tree(tmp_path):
    base = tmp_path / "base"
    (base / "proj").mkdir(parents=True)
    (base / "proj" / "a.txt").write_text("alpha\n")
    os.mkfifo(base / "pipe")
    (tmp_path / "ws").mkdir()  # an existing, empty workspace directory
    return tmp_path


def test_apply_summary_and_root_creation(tree):
    ws = tree / "created"
    m = write(tree / "m.json", {"root": str(ws), "entries": {"p": {"type": "local_dir", "src": "proj"},
                                                             "r": {"type": "file", "content": "r"}},
                                "environment": {"T": {"value": "TOPSECRET", "secret": True}}})
    # a manifest's own root is only used when it names an existing empty directory
    assert_one_line_error(cli("apply", str(m), "--base", str(tree / "base")), "--root")
    assert not ws.exists()
    proc = cli("apply", str(m), "--base", str(tree / "base"), "--root", str(ws))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("materialized 2 files")
    assert "TOPSECRET" not in proc.stdout + proc.stderr
    assert stat.S_IMODE(ws.stat().st_mode) == 0o700
    assert (ws / "p" / "a.txt").read_text() == "alpha\n"


def test_manifest_root_never_writes_into_an_existing_tree(tree):
    """Where the workspace lives is authority: an untrusted manifest's root may
    not name a directory that already holds files (an ~/.ssh, say)."""
    victim = tree / "victim"
    victim.mkdir()
    (victim / "authorized_keys").write_text("legit-key\n")
    m = write(tree / "m.json", {"root": str(victim),
                                "entries": {"authorized_keys": {"type": "file", "content": "attacker-key\n"}}})
    assert_one_line_error(cli("apply", str(m)), "empty")
    assert (victim / "authorized_keys").read_text() == "legit-key\n"
    proc = cli("apply", str(m), "--root", str(tree / "ws"))  # the operator's choice is honoured
    assert proc.returncode == 0 and (tree / "ws" / "authorized_keys").read_text() == "attacker-key\n"


def test_apply_json_and_root_override(tree):
    m = write(tree / "m.json", {"root": str(tree / "ignored"), "entries": {"r": {"type": "file", "content": "r"}}})
    proc = cli("apply", str(m), "--root", "chosen", "--json", cwd=tree)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["ok"] is True and out["result"]["files"][0]["sandbox_path"] == "r"
    assert out["result"]["files"][0]["sha256"] == "454349e422f05297191ead13e21d3db520e5abef52055e4964b82fb213f593a1"
    assert proc.stderr == ""  # no progress display in JSON mode
    assert (tree / "chosen" / "r").read_text() == "r" and not (tree / "ignored").exists()


@pytest.mark.parametrize("manifest,needles", [
    ({"root": "@WS@", "entries": {"../x": {"type": "file"}}}, ["invalid_manifest", "entries['../x']"]),
    ({"root": "@WS@", "entries": {"x": {"type": "file", "mode": 2541}}}, ["entries['x'].mode", "0o4755"]),
    ({"root": "@WS@", "extra_path_grants": [{"path": "/etc"}], "entries": {}}, ["extra_path_grants"]),
    ({"root": "@WS@", "entries": {"x": {"type": "local_file", "src": "pipe"}}}, ["source_refused", "[x]", "fifo"]),
    ({"root": "@WS@", "entries": {"x": {"type": "local_file", "src": "/etc/passwd"}}}, ["source_refused", "grant"]),
    ({"root": "relative/ws", "entries": {}}, ["root", "absolute"]),
    ({"entries": {}}, ["root"]),
])
def test_apply_refusals_are_one_line(tree, manifest, needles):
    text = json.dumps(manifest).replace("@WS@", str(tree / "ws"))
    (tree / "m.json").write_text(text)
    proc = cli("apply", str(tree / "m.json"), "--base", str(tree / "base"), timeout=30)
    assert_one_line_error(proc, *needles)
    assert str(tree) not in proc.stderr  # never a host path
    pj = cli("apply", str(tree / "m.json"), "--base", str(tree / "base"), "--json", timeout=30)
    assert pj.returncode == 1 and "Traceback" not in pj.stderr
    err = json.loads(pj.stdout)
    assert err["ok"] is False and err["error"]["code"]


def test_apply_bad_json_and_missing_file(tree):
    (tree / "bad.json").write_text("{not json")
    assert_one_line_error(cli("apply", str(tree / "bad.json"), "--root", str(tree / "ws")), "not valid JSON")
    assert_one_line_error(cli("apply", str(tree / "missing.json"), "--root", str(tree / "ws")), "MANIFEST")


def test_apply_grant(tree):
    g = tree / "grant"
    g.mkdir()
    (g / "f").write_text("granted")
    m = write(tree / "m.json", {"root": str(tree / "ws"), "entries": {"f": {"type": "local_file", "src": f"{g}/f"}}})
    assert cli("apply", str(m)).returncode == 1
    proc = cli("apply", str(m), "--grant", f"{g}:ro")
    assert proc.returncode == 0, proc.stderr
    assert (tree / "ws" / "f").read_text() == "granted"


def test_schema_command():
    proc = cli("schema")
    assert proc.returncode == 0
    assert json.loads(proc.stdout) == json.loads(json.dumps(Manifest.model_json_schema()))
    compact = cli("schema", "manifest", "--indent", "0")
    assert json.loads(compact.stdout) == json.loads(proc.stdout) and "\n" not in compact.stdout.strip()
