"""``sandbox-fs snapshot save|restore|ls``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


def _listing(top):
    """Every entry beneath ``top`` (and ``top`` itself): path, mode, size, mtime, content of files."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in ["."] if dirpath == str(top) else []:
            st = os.lstat(dirpath)
            out[name] = (st.st_mode, st.st_mtime_ns)
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            data = Path(p).read_bytes() if os.path.isfile(p) and not os.path.islink(p) else None
            out[os.path.relpath(p, top)] = (st.st_mode, st.st_size, st.st_mtime_ns, data)
    return out


def test_ls_leaves_the_store_byte_for_byte_unchanged(tmp_path, capsys):
    """A read makes nothing: no .state-key, no .partial/, no .lock (an empty store, then one with a snapshot)."""
    ws, store = tmp_path / "ws", tmp_path / "store"
    ws.mkdir()
    (ws / "f").write_text("content")
    store.mkdir()
    before = _listing(store)
    rc, out, err = _run(capsys, "snapshot", "ls", "--store", str(store), "--json")
    assert rc == 0 and json.loads(out) == [], err
    assert _listing(store) == before == {".": before["."]}
    rc, _out, err = _run(capsys, "snapshot", "save", "--workspace", str(ws), "--store", str(store), "--name", "s")
    assert rc == 0, err
    before = _listing(store)
    rc, out, err = _run(capsys, "snapshot", "ls", "--store", str(store), "--json")
    assert rc == 0 and [r["name"] for r in json.loads(out)] == ["s"], err
    assert _listing(store) == before and ".state-key" not in before


def test_read_actions_on_a_missing_store_are_one_error_line_and_make_nothing(tmp_path, capsys):
    ws, store = tmp_path / "ws", tmp_path / "no" / "store"
    ws.mkdir()
    for argv in (["ls"], ["restore", "--workspace", str(ws), "--name", "s"], ["gc"]):
        rc, out, err = _run(capsys, "snapshot", *argv, "--store", str(store))
        assert rc == 1 and out == "", err
        assert err.startswith("sandbox-fs: error: snapshot_store_unavailable: the snapshot store directory does not "
                              "exist") and err.count("\n") == 1 and str(tmp_path) not in err, err
        assert not (tmp_path / "no").exists()


def test_save_of_a_missing_workspace_names_it_and_makes_no_store(tmp_path, capsys):
    """The workspace is opened before the store: a missing one is '[WORKSPACE]' and no store directory is left."""
    store = tmp_path / "bad" / "sv"
    for ws in (tmp_path / "nows", tmp_path / "afile"):
        if ws.name == "afile":
            ws.write_text("x")
        rc, out, err = _run(capsys, "snapshot", "save", "--store", str(store), "--name", "x", "--workspace", str(ws))
        assert rc == 1 and err.startswith("sandbox-fs: error: os_error [WORKSPACE]: "), err
        assert str(tmp_path) not in err
    assert not (tmp_path / "bad").exists()


def test_s3_store_inputs_refused_clearly_without_echo(tmp_path, capsys):
    """A non-http(s) endpoint and an over-long prefix are refused up front by what is wrong, not echoed."""
    for endpoint in ("ftp://x", "file:///etc/passwd", "http://[::1", "http://h:99999", "https://:80", "http://h\tx"):
        rc, _, err = _run(capsys, "snapshot", "ls", "--store", "s3://bkt/p", "--store-endpoint", endpoint)
        assert rc == 1 and "must be an http:// or https:// URL" in err, (endpoint, err)
        assert endpoint not in err and "passwd" not in err
    rc, _, err = _run(capsys, "snapshot", "ls", "--store", "s3://bkt/" + "a" * 2000)
    assert rc == 1 and "too long" in err and "a" * 100 not in err


def test_ls_of_an_empty_store_says_so_on_stderr_only(tmp_path, capsys):
    (tmp_path / "st").mkdir()
    assert _run(capsys, "snapshot", "ls", "--store", str(tmp_path / "st")) == (
        0, "", "sandbox-fs: no snapshots in the store\n")
    assert _run(capsys, "snapshot", "ls", "--store", str(tmp_path / "st"), "--json") == (0, "[]\n", "")
