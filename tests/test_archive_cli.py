"""``sandbox-fs extract``: exit status, one-line summary / JSON, one-line refusals, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_archive_builders import tar_bytes, ti, zip_bytes

from sandbox_fs.cli import main


def _run(args, capsys):
    rc = main(args)
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_success_summary_and_json(tmp_path, capsys):
    a = tmp_path / "a.tar.gz"
    a.write_bytes(tar_bytes([ti("d/f", data=b"hello")], compression="gz"))
    rc, out, err = _run(["extract", str(a), "--into", str(tmp_path / "out")], capsys)
    assert rc == 0 and err == ""
    assert out.count("\n") == 1 and "1 files" in out
    assert (tmp_path / "out" / "d" / "f").read_bytes() == b"hello"
    rc, out, err = _run(["extract", str(a), "--into", str(tmp_path / "out2"), "--json"], capsys)
    rep = json.loads(out)
    assert rc == 0 and rep["files"] == 1 and rep["format"] == "tar.gz" and rep["bytes_written"] == 5


def test_cli_refusal_one_line(tmp_path, layout, capsys):
    a = tmp_path / "evil.zip"
    a.write_bytes(zip_bytes([{"name": "../outside/pwned.txt", "data": b"x"}]))
    before = layout.snapshot()
    rc, out, err = _run(["extract", str(a), "--into", str(layout.ws)], capsys)
    assert rc == 1 and out == ""
    assert err.count("\n") == 1 and "unsafe_member" in err and "dotdot" in err and "pwned.txt" in err
    assert "Traceback" not in err and str(tmp_path) not in err.replace(str(a), "")
    layout.assert_outside_unchanged(before)


def test_cli_limits_flags(tmp_path, capsys):
    a = tmp_path / "a.tar"
    a.write_bytes(tar_bytes([ti(f"f{i}", data=b"x") for i in range(5)]))
    rc, out, err = _run(["extract", str(a), "--into", str(tmp_path / "o"), "--max-members", "3"], capsys)
    assert rc == 1 and "archive_limit" in err and "max_members" in err
    with pytest.raises(SystemExit) as ei:  # below ArchiveLimits' bound: a usage error
        main(["extract", str(a), "--into", str(tmp_path / "o"), "--max-ratio", "0.5"])
    err = capsys.readouterr().err
    assert ei.value.code == 2 and err.count("\n") == 1 and "--max-ratio" in err and "Traceback" not in err


@pytest.mark.parametrize("payload", [b"", b"garbage" * 100, b"PK\x05\x06" + b"\0" * 10, b"\x1f\x8b\x08" + b"\0" * 50])
def test_cli_garbage_never_traceback(tmp_path, payload):
    a = tmp_path / "x"
    a.write_bytes(payload)
    out = subprocess.run([sys.executable, "-m", "sandbox_fs", "extract", str(a), "--into", str(tmp_path / "o")],
                         capture_output=True, text=True)
    assert out.returncode == 1, out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert not os.path.exists(tmp_path / "o")


def test_cli_stdin(tmp_path):
    data = tar_bytes([ti("f", data=b"1")], compression="xz")
    out = subprocess.run([sys.executable, "-m", "sandbox_fs", "extract", "-", "--into", str(tmp_path / "o")],
                         input=data, capture_output=True)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "o" / "f").read_bytes() == b"1"


def test_cli_empty_zip_is_an_empty_directory(tmp_path, capsys):
    a = tmp_path / "e.zip"
    a.write_bytes(b"PK\x05\x06" + b"\0" * 18)
    rc, out, err = _run(["extract", str(a), "--into", str(tmp_path / "o")], capsys)
    assert rc == 0 and os.listdir(tmp_path / "o") == []
