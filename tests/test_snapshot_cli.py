"""``sandbox-fs snapshot save|restore|ls``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from sandbox_fs.cli import main


def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_save_ls_restore_round_trip(tmp_path, capsys):
    ws, dst, store = tmp_path / "ws", tmp_path / "dst", tmp_path / "store"
    (ws / "d").mkdir(parents=True)
    (ws / "d" / "f").write_text("content")
    (ws / "skipme").write_text("x")
    dst.mkdir()
    rc, out, err = _run(capsys, "snapshot", "save", "--workspace", str(ws), "--store", str(store), "--name", "s1",
                        "--exclude", "skipme", "--json")
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["entries"] == 2 and rep["content_bytes"] == 7
    rc, out, _ = _run(capsys, "snapshot", "ls", "--store", str(store), "--json")
    assert [r["name"] for r in json.loads(out)] == ["s1"]
    rc, out, err = _run(capsys, "snapshot", "restore", "--workspace", str(dst), "--store", str(store), "--name", "s1")
    assert rc == 0, err
    assert (dst / "d" / "f").read_text() == "content" and not (dst / "skipme").exists()
    assert "name=s1" in out


def test_refusals_are_one_line_without_traceback_or_host_path(tmp_path, layout):
    (layout.ws / "abs").symlink_to(layout.outside / "secret.txt")
    store = tmp_path / "store"
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for argv in (["save", "--workspace", str(layout.ws), "--store", str(store), "--name", "s"],
                 ["save", "--workspace", str(layout.ws), "--store", str(store), "--name", "../evil"],
                 ["restore", "--workspace", str(layout.ws), "--store", str(store), "--name", "missing"]):
        p = subprocess.run([sys.executable, "-m", "sandbox_fs", "snapshot", *argv], capture_output=True, text=True,
                           env=env, timeout=60)
        assert p.returncode == 1, p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("sandbox-fs: error:"), p.stderr
        assert "Traceback" not in p.stderr and str(layout.base) not in p.stderr
    assert os.path.islink(layout.ws / "abs")  # nothing was changed
