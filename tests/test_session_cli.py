"""``sandbox-fs session create|resume|rm`` with state in JSON files."""

from __future__ import annotations

import json
import os

from sandbox_fs.cli import main


def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_create_resume_rm(tmp_path, capsys):
    wsd, store, state = tmp_path / "wsd", tmp_path / "store", tmp_path / "state.json"
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps({"entries": {"hello.txt": {"type": "file", "content": "hi"}}}))
    common = ["--workspaces-dir", str(wsd), "--store", str(store)]
    rc, out, err = _run(capsys, "session", "create", *common, "--manifest", str(manifest), "--state", str(state),
                        "--json")
    assert rc == 0, err
    rep = json.loads(out)
    sid = rep["session_id"]
    assert rep["start_mode"] == "materialized" and rep["snapshot"] == sid
    saved = json.loads(state.read_text())
    assert saved["session_id"] == sid and oct(os.stat(state).st_mode & 0o777) == "0o600"
    assert (wsd / sid / "hello.txt").read_text() == "hi"

    rc, out, err = _run(capsys, "session", "resume", *common, "--state", str(state), "--json")
    assert rc == 0 and json.loads(out)["start_mode"] == "reattached"

    rc, out, err = _run(capsys, "session", "rm", *common, "--state", str(state), "--json")
    assert rc == 0 and json.loads(out)["workspace_removed"] is True
    assert not (wsd / sid).exists()

    rc, out, err = _run(capsys, "session", "resume", *common, "--state", str(state), "--json")
    assert rc == 0 and json.loads(out)["start_mode"] == "restored"
    assert (wsd / sid / "hello.txt").read_text() == "hi"


def test_tampered_state_file_refused_in_one_line(tmp_path, capsys):
    wsd, state = tmp_path / "wsd", tmp_path / "state.json"
    common = ["--workspaces-dir", str(wsd)]
    assert _run(capsys, "session", "create", *common, "--state", str(state))[0] == 0
    data = json.loads(state.read_text())
    for bad in (dict(data, root="/"), dict(data, version=9), dict(data, session_id="../../etc")):
        state.write_text(json.dumps(bad))
        rc, out, err = _run(capsys, "session", "rm", *common, "--state", str(state))
        assert rc == 1 and len(err.strip().splitlines()) == 1 and err.startswith("sandbox-fs: error: session_state")
    state.write_text("{not json")
    rc, out, err = _run(capsys, "session", "resume", *common, "--state", str(state))
    assert rc == 1 and "cli_input" in err
    assert os.path.isdir(wsd) and len([n for n in os.listdir(wsd) if n != ".state-key"]) == 1  # nothing removed


def test_state_key_file_protects_state(tmp_path, capsys):
    wsd, state, key = tmp_path / "wsd", tmp_path / "state.json", tmp_path / "key"
    key.write_bytes(os.urandom(32).hex().encode())
    common = ["--workspaces-dir", str(wsd), "--state-key-file", str(key)]
    assert _run(capsys, "session", "create", *common, "--state", str(state))[0] == 0
    data = json.loads(state.read_text())
    assert len(data["mac"]) == 64
    state.write_text(json.dumps(dict(data, workspace_root_ready=False)))
    rc, _out, err = _run(capsys, "session", "rm", *common, "--state", str(state))
    assert rc == 1 and "session_state_tampered" in err


def test_stale_state_refused_in_one_line_then_allow_rollback(tmp_path, capsys):
    wsd, store, state, old = tmp_path / "wsd", tmp_path / "store", tmp_path / "state.json", tmp_path / "old.json"
    common = ["--workspaces-dir", str(wsd), "--store", str(store)]
    assert _run(capsys, "session", "create", *common, "--state", str(state))[0] == 0
    old.write_text(state.read_text())
    assert _run(capsys, "session", "resume", *common, "--state", str(state))[0] == 0  # generation 2
    rc, out, err = _run(capsys, "session", "resume", *common, "--state", str(old))
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "snapshot_generation_mismatch" in err
    assert "Traceback" not in err
    rc, out, err = _run(capsys, "session", "resume", *common, "--state", str(old), "--allow-rollback", "--json")
    assert rc == 0, err
    assert json.loads(old.read_text())["generation"] == 3


def test_swapped_state_refused_in_one_line(tmp_path, capsys):
    wsd, store = tmp_path / "wsd", tmp_path / "store"
    ws_a, ws_b = tmp_path / "wsA", tmp_path / "wsB"
    sa, sb = tmp_path / "a.json", tmp_path / "b.json"
    common = ["--workspaces-dir", str(wsd), "--store", str(store)]
    for ws, st in ((ws_a, sa), (ws_b, sb)):
        ws.mkdir()
        assert _run(capsys, "session", "create", *common, "--root", str(ws), "--state", str(st))[0] == 0
    (ws_a / "unsaved.txt").write_text("A's unsaved work")
    sa.write_text(sb.read_text())  # B's state copied over A's
    rc, out, err = _run(capsys, "session", "resume", *common, "--root", str(ws_a), "--state", str(sa))
    assert rc == 1 and "workspace_mismatch" in err and len(err.strip().splitlines()) == 1
    assert (ws_a / "unsaved.txt").read_text() == "A's unsaved work"


def _tree(path):
    """Every name under ``path`` (the host side of 'nothing was made')."""
    return sorted(os.path.relpath(os.path.join(d, n), path) for d, ds, fs in os.walk(path) for n in ds + fs)


def test_reading_commands_make_no_store_and_no_key(tmp_path, capsys):
    """resume / fork / rm / run --resume / snapshot restore|ls|gc read existing state: a wrong or missing
    store or key is refused by name (never as tampering) and nothing is made; a wrong key is still refused."""
    wsd, store, state = tmp_path / "wsd", tmp_path / "store", tmp_path / "state.json"
    assert _run(capsys, "session", "create", "--workspaces-dir", str(wsd), "--store", str(store),
                "--state", str(state))[0] == 0
    empty, other = tmp_path / "empty", tmp_path / "other"
    empty.mkdir()
    other.mkdir()
    (other / ".state-key").write_text("k" * 64)
    os.chmod(other / ".state-key", 0o600)
    out = str(tmp_path / "out.json")
    reading = [(["session", "resume"], ["--state", str(state), "--state-out", out]),
               (["session", "fork"], ["--state", str(state), "--state-out", out]),
               (["session", "rm"], ["--state", str(state)]),
               (["run"], ["--resume", str(state), "--state", out, "--", "true"])]
    before = _tree(tmp_path)
    for cmd, rest in reading:
        for where, code in ((tmp_path / "nostore", "snapshot_store_unavailable"),
                            (empty, "session_state_key_missing"), (other, "session_state_tampered")):
            rc, _, err = _run(capsys, *cmd, "--workspaces-dir", str(tmp_path / "nowsd"), "--store", str(where), *rest)
            assert rc == 1 and err.startswith(f"sandbox-fs: error: {code}: "), (cmd, where, err)
        if cmd[-1] != "fork":  # no --store: the key would live in the workspaces directory, which has none
            rc, _, err = _run(capsys, *cmd, "--workspaces-dir", str(empty), *rest)
            assert rc == 1 and "session_state_key_missing" in err, (cmd, err)
    rc, _, err = _run(capsys, "session", "fork", "--workspaces-dir", str(wsd), "--state", str(state),
                      "--state-out", out)
    assert rc == 1 and "fork needs --store" in err
    for argv in (["ls"], ["gc"], ["restore", "--name", "x", "--workspace", str(empty)]):
        rc, _, err = _run(capsys, "snapshot", argv[0], "--store", str(tmp_path / "nostore"), *argv[1:])
        assert rc == 1 and "snapshot_store_unavailable" in err, (argv, err)
    assert _tree(tmp_path) == before  # no store, no key, no workspaces directory, no state made


def test_state_without_a_version_says_missing(tmp_path, capsys):
    state, key = tmp_path / "s.json", tmp_path / "k"
    key.write_text("k" * 32)
    for data, want in (({"x": 1}, "has no version"), ({"version": "2" * 5000}, "version is not supported"),
                       ({"version": 7}, "version 7 is not supported")):
        state.write_text(json.dumps(data))
        rc, _, err = _run(capsys, "session", "resume", "--workspaces-dir", str(tmp_path / "w"), "--state",
                          str(state), "--state-key-file", str(key))
        assert rc == 1 and f"session_state_version: session state {want}" in err and len(err) < 200, err
