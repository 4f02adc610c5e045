"""The CLI as a surface: what reaches the operator's terminal, numeric options, a failed persist.

* Names chosen by a confined command (or an archive, a snapshot) never put a
  raw control byte on the terminal: text output escapes them (``\\xNN``,
  ``\\\\``), JSON output carries them ``\\u``-escaped and parses back to the name.
* Every numeric option of every subcommand refuses nan, inf, negatives and
  out-of-range values as a usage error (exit 2, one line), never exit 70.
* ``run`` prints the command's output even when the persist after it fails.

The ``sandbox_fs.cli._output`` / ``_args`` imports sit inside the tests so
the end-to-end regressions also run (and fail) against the code before them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandbox_fs import cli

SFS = [sys.executable, "-m", "sandbox_fs"]

# ESC]0;pwned BEL retitles the terminal, ESC[2J clears it (the examples of issue 11 H).
TITLE = b"\x1b]0;pwned\x07"
CLEAR = b"\x1b[2J"
HOSTILE = b"x" + TITLE + CLEAR + b"y"

_PIECES = [b"\x1b", b"\x07", b"\x01", b"\n", b"\r", b"\t", b"\x7f", b"\x9b", b"\xc2\x9b",
           b"\xc2\x85", b"\xff", b"\xfe", b"\xc3", b"\\", b"\\x1b", b"a", b" ", b"\xe2\x80\xae",
           b"\xe2\x80\xa8", b"\xed\xa0\x80", b"\xf0\x9f\x98\x80", "é".encode(), TITLE, CLEAR]

names = (st.lists(st.sampled_from(_PIECES) | st.binary(min_size=1, max_size=3), min_size=1, max_size=12)
         .map(b"".join)
         .map(lambda b: b.replace(b"/", b"_").replace(b"\0", b"_")[:200])
         .filter(lambda b: b not in (b".", b"..")))


def assert_terminal_safe(data: bytes, allow: str = "") -> None:
    """Valid UTF-8 with no C0 control but line ends (and ``allow``), no DEL, no C1 control, no surrogate."""
    text = data.decode("utf-8")  # strict: no invalid UTF-8 reaches the terminal either
    for line in text.split("\n"):
        bad = [c for c in line
               if (ord(c) < 0x20 and c not in allow) or 0x7F <= ord(c) <= 0x9F or 0xD800 <= ord(c) <= 0xDFFF]
        assert not bad, f"raw control characters {bad!r} in {line!r}"


def unescape(text: str) -> bytes:
    """The inverse of escape_text (names): ``\\\\`` -> ``\\``, ``\\xNN`` -> byte NN, the rest UTF-8."""
    out = bytearray()
    for m in re.finditer(r"\\\\|\\x([0-9a-f]{2})|[^\\]+", text, re.S):
        tok = m.group(0)
        out += b"\\" if tok == "\\\\" else bytes.fromhex(m.group(1)) if m.group(1) else tok.encode()
    assert "".join(m.group(0) for m in re.finditer(r"\\\\|\\x([0-9a-f]{2})|[^\\]+", text, re.S)) == text
    return bytes(out)


# ------------------------------------------------------------------ the escaping function


@settings(max_examples=200, deadline=None)
@given(names)
def test_escape_text_is_safe_and_unambiguous(raw):
    from sandbox_fs.cli._output import escape_text

    shown = escape_text(os.fsdecode(raw))
    assert_terminal_safe(shown.encode("utf-8"))
    assert "\n" not in shown
    assert unescape(shown) == raw, "the escaped form must give back the exact name"
    assert escape_text(raw) == shown  # bytes and fsdecode'd str agree
    free = escape_text(os.fsdecode(raw), keep_backslash=True)
    assert_terminal_safe(free.encode("utf-8"))


def test_escape_text_examples():
    from sandbox_fs.cli._output import escape_text

    assert escape_text(os.fsdecode(HOSTILE)) == "x\\x1b]0;pwned\\x07\\x1b[2Jy"
    assert escape_text("a\\b") == "a\\\\b" and escape_text("a\\b", keep_backslash=True) == "a\\b"
    assert escape_text("\u009b") == "\\xc2\\x9b"  # C1 CSI, by its UTF-8 bytes
    assert escape_text(b"\x9b") == "\\x9b"  # an undecodable byte, as that byte
    assert escape_text("\u202e") == "\\xe2\\x80\\xae"  # bidi override (CVE-2021-42574)
    assert escape_text("é 日本 ok") == "é 日本 ok"
    assert escape_text("l1\nl2\t\r", keep="\n\t") == "l1\nl2\t\\x0d"
    with pytest.raises(ValueError):
        escape_text("x", keep="\r")


@settings(max_examples=150, deadline=None)
@given(names, names)
def test_every_text_path_is_terminal_safe_and_json_round_trips(raw, raw2):
    """Each text output helper the subcommands use, fed a hostile name, and the JSON form."""
    from sandbox_fs.cli._output import error_line, json_text, report_lines
    from sandbox_fs.archive import UnsafeArchiveMemberError
    from sandbox_fs.snapshot import UnrestorableEntryError

    name, other = os.fsdecode(raw), os.fsdecode(raw2)
    errors = [UnrestorableEntryError(f"reason naming {other}", sandbox_path=name),
              UnsafeArchiveMemberError("dotdot", raw, f"bad {other}", sandbox_path=name),
              FileNotFoundError(2, "No such file", name), OSError(5, "x", raw)]
    lines = [error_line(e) for e in errors]
    lines += report_lines({"action": "save", "name": name, "skipped": [{"path": name, "reason": other}]})
    for line in lines:
        assert_terminal_safe(line.encode("utf-8"))
        assert "\n" not in line
    assert unescape_path(lines[0]) == raw
    doc = json_text({"path": name, "error": errors[0].to_dict()})
    assert doc.isascii() and all(0x20 <= ord(c) < 0x7F for c in doc)
    back = json.loads(doc)
    assert back["path"] == name and os.fsencode(back["error"]["sandbox_path"]) == raw


def unescape_path(line: str) -> bytes:
    """The bytes of the ``[sandbox path]`` of an error line (the first ``[``, the last ``]:``)."""
    start, end = line.index(" [") + 2, line.rindex("]: ")
    return unescape(line[start:end])


def test_command_output_is_escaped_on_a_terminal_only():
    import io

    from sandbox_fs.cli._output import write_command_output

    class Stream(io.TextIOWrapper):
        def __init__(self, tty):
            super().__init__(io.BytesIO(), encoding="utf-8")
            self.tty = tty

        def isatty(self):
            return self.tty

    out = b"line " + TITLE + b"\n\tnext \x9b\\ \xff\n"
    tty, pipe = Stream(True), Stream(False)
    write_command_output(out, tty)
    write_command_output(out, pipe)
    assert pipe.buffer.getvalue() == out, "a pipe gets the command's bytes unchanged"
    shown = tty.buffer.getvalue()
    assert_terminal_safe(shown, allow="\t")
    assert shown == b"line \\x1b]0;pwned\\x07\n\tnext \\x9b\\ \\xff\n"


# ------------------------------------------------------------------ end to end: names from the workspace


def _ws_with_link(tmp_path, raw: bytes, target: bytes = b"/etc/passwd"):
    ws = tmp_path / "ws"
    ws.mkdir(exist_ok=True)
    link = os.path.join(os.fsencode(ws), raw)
    if os.path.lexists(link):
        os.unlink(link)
    os.symlink(target, link)  # an absolute symlink: persist refuses (or skips) it by name
    return ws


def _main(argv, capsysbinary):
    try:
        rc = cli.main([str(a) for a in argv])
    except SystemExit as exc:
        rc = exc.code
    out, err = capsysbinary.readouterr()
    return rc, out, err


@pytest.mark.parametrize("raw", [HOSTILE, b"\x9b31m\xffname", b"a\\x1bb", "\u202egnp.exe".encode()])
def test_snapshot_save_refusal_line_is_escaped(tmp_path, capsysbinary, raw):
    ws = _ws_with_link(tmp_path, raw)
    rc, out, err = _main(["snapshot", "save", "--workspace", ws, "--store", tmp_path / "st", "--name", "n"],
                         capsysbinary)
    assert rc == 1 and b"snapshot_unrestorable_entry" in err, err
    assert b"\x1b" not in err and b"\x07" not in err
    assert_terminal_safe(err)
    assert len(err.splitlines()) == 1
    assert unescape_path(err.decode().rstrip("\n")) == raw, "the path shown is the exact name"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=names)
def test_snapshot_save_skip_report_text_and_json(tmp_path, capsysbinary, raw):
    import tempfile

    here = tempfile.mkdtemp(dir=tmp_path)  # hypothesis shares tmp_path between examples
    ws = _ws_with_link(Path(here), raw)
    common = ["snapshot", "save", "--workspace", ws, "--store", Path(here) / "st", "--name", "n",
              "--skip-unrestorable"]
    rc, out, err = _main(common, capsysbinary)
    assert rc == 0, err
    assert_terminal_safe(out)
    assert_terminal_safe(err)
    lines = out.decode().splitlines()
    assert "skipped=1" in lines[0].split() and lines[1].startswith("skipped [")
    assert unescape_path(lines[1]) == raw
    rc, out, err = _main([*common, "--json"], capsysbinary)
    assert rc == 0, err
    assert all(0x20 <= b < 0x7F for b in out.rstrip(b"\n")), "JSON output is printable ASCII"
    assert os.fsencode(json.loads(out)["skipped"][0]["path"]) == raw


def test_apply_skipped_and_json_error_are_escaped(tmp_path, capsysbinary):
    base = tmp_path / "base"
    base.mkdir()
    raw = b"d" + TITLE
    m = tmp_path / "m.json"
    m.write_text(json.dumps({"entries": {os.fsdecode(raw): {"type": "file", "content": "x"},
                                         "../" + os.fsdecode(CLEAR): {"type": "file", "content": "x"}}}))
    rc, out, err = _main(["apply", m, "--root", tmp_path / "ws", "--base", base, "--json"], capsysbinary)
    assert rc == 1
    assert_terminal_safe(out)
    assert_terminal_safe(err)
    assert b"\x1b" not in out + err and b"\x07" not in out + err
    json.loads(out)


# ------------------------------------------------------------------ end to end: sandbox-fs run


def _run(*args, **kw):
    return subprocess.run([*SFS, *map(str, args)], capture_output=True, timeout=120, **kw)


@pytest.fixture
def runjob(tmp_path):
    m = tmp_path / "m.json"
    m.write_text(json.dumps({"entries": {"a.txt": {"type": "file", "content": "hi\n"}}}))
    (tmp_path / "wsdir").mkdir()
    return ["--manifest", m, "--workspaces-dir", tmp_path / "wsdir", "--snapshot-dir", tmp_path / "snaps",
            "--confinement", "best_effort"]


_CHILD = ("echo command-output; echo command-stderr >&2; "
          "ln -s /etc/passwd \"$(printf 'x\\033]0;pwned\\007\\033[2Jy')\"; exit 3")


def test_run_persist_failure_prints_output_then_escaped_error(tmp_path, runjob):
    """The child names a file ESC]0;pwned BEL ESC[2J and makes it unrestorable: persist refuses it.

    Before: stdout was empty (the command's output lost), and the error line carried the raw
    escapes to the terminal.
    """
    state = tmp_path / "state.json"
    r = _run("run", *runjob, "--state", state, "--", "/bin/sh", "-c", _CHILD)
    assert r.returncode == 1, r.stderr
    assert r.stdout == b"command-output\n", "the command ran: its output is printed"
    assert b"command-stderr\n" in r.stderr
    assert b"\x1b" not in r.stderr and b"\x07" not in r.stderr, r.stderr
    assert_terminal_safe(r.stderr)
    lines = r.stderr.decode().splitlines()
    assert lines[0] == "command-stderr"
    assert "command exited 3" in lines[1] and "nothing new persisted" in lines[1]
    assert lines[2].startswith("sandbox-fs: error: snapshot_unrestorable_entry [")
    assert unescape_path(lines[2]) == HOSTILE and len(lines) == 3
    assert json.loads(state.read_text())["snapshot"] is None, "the state names the last good snapshot (none)"
    assert b"Traceback" not in r.stderr


def test_run_persist_failure_json_carries_output_and_error(runjob):
    r = _run("run", *runjob, "--json", "--", "/bin/sh", "-c", _CHILD)
    assert r.returncode == 1, r.stderr
    assert b"\x1b" not in r.stdout + r.stderr and b"\x07" not in r.stdout + r.stderr
    rep = json.loads(r.stdout)
    assert rep["stdout"] == "command-output\n" and rep["exit_code"] == 3
    assert rep["error"]["code"] == "snapshot_unrestorable_entry"
    assert os.fsencode(rep["error"]["sandbox_path"]) == HOSTILE
    assert r.stderr.decode().startswith("sandbox-fs: error: snapshot_unrestorable_entry [")


def test_run_persist_failure_store_full(tmp_path, runjob):
    """A store the persist cannot write (a 64 KiB tmpfs, the child writes 1 MiB): the output still appears."""
    store = tmp_path / "snaps"
    store.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(store)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs for the store (needs root): {mounted.stderr.decode().strip()}")
    try:
        r = _run("run", *runjob, "--", "/bin/sh", "-c",
                 "head -c 1048576 /dev/urandom > big; echo still-here; echo err-here >&2; exit 0")
    finally:
        subprocess.run(["umount", "-l", str(store)], check=False)
    assert r.returncode == 1, r.stderr
    assert r.stdout == b"still-here\n", "the command ran: its output is printed"
    lines = r.stderr.decode().splitlines()
    assert lines[0] == "err-here" and "nothing new persisted" in lines[1]
    assert lines[-1].startswith("sandbox-fs: error:") and len(lines) == 3, r.stderr
    assert b"Traceback" not in r.stderr


# ------------------------------------------------------------------ numeric options


def _numeric_actions():
    """(argv prefix, flag, action) for every option of every subcommand that takes a number."""
    found = []

    def walk(parser, prefix):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*prefix, name])
            elif action.option_strings and action.type is not None:
                found.append((prefix, action.option_strings[-1], action))
            elif action.option_strings and action.nargs != 0 and action.default is not None \
                    and isinstance(action.default, (int, float)) and not isinstance(action.default, bool):
                found.append((prefix, action.option_strings[-1], action))  # an untyped numeric default

    walk(cli.build_parser(), [])
    return found


def test_every_numeric_option_uses_a_checked_type():
    from sandbox_fs.cli._args import NumericType

    acts = _numeric_actions()
    flags = {(" ".join(p), f) for p, f, _a in acts}
    for expected in [("run", "--timeout"), ("run", "--max-output-bytes"), ("extract", "--max-members"),
                     ("extract", "--max-ratio"), ("extract", "--max-cpu-seconds"), ("schema", "--indent")]:
        assert expected in flags
    unchecked = [(p, f) for p, f, a in acts if not isinstance(a.type, NumericType) and a.type is not str]
    assert not unchecked, f"numeric options without a checked type: {unchecked}"


def _bad_values(t):
    bad = ["nan", "NaN", "inf", "-inf", "+inf", "1e400", "-1e400", "", "x", "1" * 80, str(2**64), "9" * 40, "1e19"]
    if t.kind is int:
        bad += [str(2**63), "1.5", "1e3"]
    bad.append(str(int(t.high) + 1) if t.kind is int else repr(float(t.high) * 2))
    if t.low >= 0:
        bad += ["-1", "-0.5" if t.kind is float else "-9223372036854775809"]
    if t.low_open:
        bad.append(repr(float(t.low)))
    return bad


def _cases():
    cases = []
    for prefix, flag, action in _numeric_actions():
        if not hasattr(action.type, "kind"):
            continue
        for value in _bad_values(action.type):
            cases.append(pytest.param(prefix, flag, value, id=f"{' '.join(prefix)} {flag}={value[:12]}"))
    return cases


@pytest.mark.parametrize("prefix,flag,value", _cases())
def test_numeric_option_refuses_bad_values(capsysbinary, prefix, flag, value):
    rc, out, err = _main([*prefix, f"{flag}={value}"], capsysbinary)
    assert rc == 2, (rc, err)
    lines = err.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sandbox-fs: error: usage: argument " + flag), err
    assert not out


@pytest.mark.parametrize("prefix,flag,action", [pytest.param(p, f, a, id=f"{' '.join(p)} {f}")
                                                for p, f, a in _numeric_actions() if hasattr(a.type, "kind")])
def test_numeric_option_takes_its_bounds(prefix, flag, action):
    t = action.type
    if not t.low_open:
        assert t(str(t.low if t.kind is int else float(t.low))) == t.low
    assert t(str(t.high if t.kind is int else float(t.high))) == t.high


def test_timeout_nan_is_a_usage_error_not_internal(tmp_path, runjob):
    """Issue 11 H: ``--timeout nan`` ended in exit 70 (an internal error)."""
    for value in ("nan", "inf"):  # the in-process table covers every other bad value
        r = _run("run", "--timeout", value, *runjob, "--", "/bin/true")
        assert r.returncode == 2, (value, r.returncode, r.stderr)
        assert r.stderr.decode().startswith("sandbox-fs: error: usage: argument --timeout")
        assert len(r.stderr.splitlines()) == 1
    assert not (tmp_path / "snaps").exists(), "refused before any work"


def test_run_on_a_terminal_escapes_the_commands_output(runjob):
    """A hostile command's own output, and every line after it, reach a real terminal (a pty) escaped."""
    import pty
    import select
    import tty

    master, slave = pty.openpty()
    tty.setraw(slave)  # no \n -> \r\n translation: the bytes read are the bytes written
    try:
        child = ("printf 'out \\033]0;pwned\\007\\033[2J\\n'; printf 'err \\033[2J\\n' >&2; "
                 "ln -s /etc/passwd \"$(printf 'x\\033]0;pwned\\007')\"")
        proc = subprocess.Popen([*SFS, "run", *map(str, runjob), "--", "/bin/sh", "-c", child],
                                stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
        os.close(slave)
        seen = bytearray()
        while True:
            ready, _, _ = select.select([master], [], [], 60)
            if not ready:
                break
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not chunk:
                break
            seen += chunk
        assert proc.wait(timeout=60) == 1
    finally:
        os.close(master)
    assert b"\x1b" not in seen and b"\x07" not in seen, bytes(seen)
    assert_terminal_safe(bytes(seen))
    text = seen.decode()
    assert "out \\x1b]0;pwned\\x07\\x1b[2J\n" in text and "err \\x1b[2J\n" in text
    assert "sandbox-fs: error: snapshot_unrestorable_entry [x\\x1b]0;pwned\\x07]" in text
