"""Violation reports: ExecResult.violations from Landlock ABI 7 denial logging (audit).

The confined tests need root (the audit multicast group needs CAP_AUDIT_READ),
Landlock ABI >= 7 and a kernel with audit.  When audit is off they turn it on
for the module and back off afterwards (a host-wide switch: see SECURITY.md,
"Violation reports"; tests here run as root on throwaway machines).

They run with ``identity="host"`` and without the read-only mount layer so
that Landlock is the layer that refuses: under the mount layer a write outside
fails with EROFS, and under a leased identity many reads fail on permissions,
before Landlock is asked; those refusals are not reported (documented).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import subprocess
import sys
import tempfile

import pytest
import trio

import sandbox_fs
from sandbox_fs.exec import ConfinementPolicy, Violation, ViolationLog, run_confined, violation_summary
from sandbox_fs.exec import _violations

ABI = sandbox_fs.features()["landlock_abi"]
SFS = [sys.executable, "-m", "sandbox_fs"]
POLICY = ConfinementPolicy(report_violations=True, identity="host", read_only_mounts=False)
PY = "/usr/bin/python3"

needs_audit = [
    pytest.mark.skipif(os.geteuid() != 0, reason="reading audit records needs root (CAP_AUDIT_READ)"),
    pytest.mark.skipif(ABI < 7, reason=f"Landlock ABI {ABI} < 7: no denial logging (landlock_restrict_self flags)"),
    pytest.mark.skipif(not os.path.exists(PY), reason="the confined commands here use /usr/bin/python3"),
]


@pytest.fixture(scope="module")
def audit():
    """Audit on while this module runs, and turned off again by the last test run that needs it.

    ``audit_enabled`` is the whole machine's: other test runs here (other checkouts, CI) turn it on
    and off too, and one that turned it off mid-way left another's runs with no denial at all.  Each
    run holds a shared lock on a file in the temp directory while it needs audit; the file says
    whether a test turned audit on, and only a run that takes the lock alone turns it off.
    """
    with open(os.path.join(tempfile.gettempdir(), "sfs-test-audit.lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
        if not _violations.audit_enabled():
            if not _violations.enable_audit(True):
                pytest.skip("the kernel's audit subsystem cannot be enabled (no CONFIG_AUDIT, or AUDIT_SET refused)")
            lock.write("on\n")
            lock.flush()
        yield
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # another run still needs it: the last one out turns it off
        lock.seek(0)
        if "on" in lock.read():
            _violations.enable_audit(False)
            lock.truncate(0)


async def _run(layout, argv, policy=POLICY, **kw):
    ws = sandbox_fs.open_root(layout.ws)
    try:
        return await run_confined(argv, workspace=ws, workspace_host_path=str(layout.ws), policy=policy, **kw)
    finally:
        ws.close()


def _py(code: str) -> list[str]:
    """A python3 command that prints its host pid (/proc is the host's here), then runs ``code``."""
    return [PY, "-S", "-c", "import os, sys\nprint(os.readlink('/proc/self'), flush=True)\n" + code]


def _mine(result, target):
    return [v for v in result.violations if v.target == target]


# --- confined runs ------------------------------------------------------------

def _skip_without_audit():
    for m in needs_audit:
        if m.args[0]:
            pytest.skip(m.kwargs["reason"])


@pytest.fixture
def confined(audit):
    _skip_without_audit()


def test_denied_write_outside_is_reported(layout, confined):
    before = layout.snapshot()
    target = str(layout.outside / "sentinel.txt")
    r = trio.run(_run, layout, _py(f"open({target!r}, 'w')"))
    layout.assert_outside_unchanged(before)
    assert r.violations_observed
    pid = int(r.stdout.split()[0])
    assert _mine(r, target) == [Violation("write", target, errno.EACCES, pid)], r.violations


def test_denied_create_outside_reports_the_directory(layout, confined):
    r = trio.run(_run, layout, _py(f"open({str(layout.outside / 'new.txt')!r}, 'x')"))
    assert not (layout.outside / "new.txt").exists()
    pid = int(r.stdout.split()[0])
    # Landlock refuses making a file in a directory: the record names the directory
    assert Violation("create", str(layout.outside), errno.EACCES, pid) in r.violations, r.violations


def test_denied_read_outside_is_reported(layout, confined):
    target = str(layout.outside / "secret.txt")
    r = trio.run(_run, layout, _py(f"open({target!r}).read()"))
    assert layout.secret not in (r.stdout + r.stderr).decode()
    pid = int(r.stdout.split()[0])
    assert _mine(r, target) == [Violation("read", target, errno.EACCES, pid)], r.violations


def test_denied_connect_is_reported(layout, confined):
    with trio_socket_port() as port:  # a port nothing listens on (Landlock refuses before any packet)
        policy = ConfinementPolicy(report_violations=True, identity="host", read_only_mounts=False,
                                   allow_tcp_connect=frozenset({port + 1 if port < 65535 else port - 1}))
        code = f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=5)\nexcept OSError as e:\n    print(e.errno)"
        r = trio.run(_run, layout, _py(code), policy)
    pid = int(r.stdout.split()[0])
    assert int(r.stdout.split()[1]) == errno.EACCES
    assert _mine(r, f"127.0.0.1:{port}") == [Violation("connect", f"127.0.0.1:{port}", errno.EACCES, pid)]


class trio_socket_port:
    """A free TCP port on 127.0.0.1 (bound while the block runs, never listening)."""

    def __enter__(self) -> int:
        import socket
        self.s = socket.socket()
        self.s.bind(("127.0.0.1", 0))
        return self.s.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self.s.close()


def test_allowed_run_reports_nothing(layout, confined):
    (layout.ws / "in.txt").write_text("x")
    r = trio.run(_run, layout, ["/bin/sh", "-c", "cat in.txt > out.txt"])
    assert r.exit_code == 0, r.stderr
    assert r.violations_observed
    assert r.violations == () and r.violations_dropped == 0


def test_bound_and_drop_count(layout, confined):
    policy = ConfinementPolicy(report_violations=True, identity="host", read_only_mounts=False, max_violations=5)
    target = str(layout.outside / "secret.txt")
    r = trio.run(_run, layout, _py(f"for _ in range(50):\n    try:\n        open({target!r})\n"
                                   "    except PermissionError:\n        pass"), policy)
    assert r.exit_code == 0, r.stderr
    assert len(r.violations) == 5
    mine = _mine(r, target)
    assert len(mine) == 5
    # the kernel's count (the domain's deallocation record) covers every denial
    assert r.violations_dropped >= 45
    assert len(r.violations) + r.violations_dropped == 50 + len(r.violations) - len(mine)


def test_concurrent_commands_see_only_their_own(layout, confined):
    a, b = layout.outside / "a.txt", layout.outside / "b.txt"
    a.write_text("a")
    b.write_text("b")
    results = {}

    async def one(name, path):
        code = f"import time\nfor _ in range(20):\n    try:\n        open({str(path)!r})\n    except OSError:\n        pass\n    time.sleep(0.005)"
        results[name] = await _run(layout, _py(code))

    async def both():
        async with trio.open_nursery() as n:
            n.start_soon(one, "a", a)
            n.start_soon(one, "b", b)

    trio.run(both)
    for name, own, other in (("a", a, b), ("b", b, a)):
        r = results[name]
        # every denial is reported, or counted as lost: the audit backlog is the whole machine's, and
        # other processes' records in it make it drop one now and then (the kernel's count is exact)
        assert len(_mine(r, str(own))) + r.violations_dropped == 20, (r.violations_dropped, r.violations)
        assert _mine(r, str(other)) == [], f"{name} saw the other command's denials"
        pid = int(r.stdout.split()[0])
        assert {v.pid for v in _mine(r, str(own))} == {pid}


def test_unobserved_when_audit_is_off(layout, monkeypatch, confined):
    monkeypatch.setattr(_violations, "audit_enabled", lambda: False)
    r = trio.run(_run, layout, _py(f"open({str(layout.outside / 'secret.txt')!r})"))
    assert r.violations_observed is False and r.violations == ()


def test_off_by_default(layout, confined):
    r = trio.run(_run, layout, _py(f"open({str(layout.outside / 'secret.txt')!r})"),
                 ConfinementPolicy(identity="host", read_only_mounts=False))
    assert r.violations_observed is False and r.violations == ()


# --- the command line -----------------------------------------------------------

@pytest.fixture
def world_dir():
    """A directory the leased identity may search (0755 up to /), outside every workspace."""
    d = tempfile.mkdtemp(prefix="sfs-violations-")
    os.chmod(d, 0o755)
    p = os.path.dirname(d)
    while p != "/":
        if not os.stat(p).st_mode & 0o001:
            os.rmdir(d)
            pytest.skip(f"the temp directory's parent {p} is not searchable by others")
        p = os.path.dirname(p)
    yield d
    for name in os.listdir(d):
        os.unlink(os.path.join(d, name))
    os.rmdir(d)


def test_cli_summary_line_escapes_names_and_json_lists_all(layout, confined, world_dir):
    names = ["a\nb", "c\x1b[31md", "e, write etc-passwd", "f", "g", "h", "i"]
    for name in names:
        with open(os.path.join(world_dir, name), "w") as f:
            f.write("x")
        os.chmod(os.path.join(world_dir, name), 0o644)
    mpath = layout.base / "manifest.json"
    mpath.write_text(json.dumps({"entries": {}}))
    (layout.base / "wsdir").mkdir()
    code = "import os, sys\nfor n in sys.argv[2:]:\n    try:\n        open(os.path.join(sys.argv[1], n))\n    except OSError:\n        pass"
    cmd = ["run", "--manifest", str(mpath), "--workspaces-dir", str(layout.base / "wsdir"), "--",
           PY, "-S", "-c", code, world_dir, *names]
    r = subprocess.run([*SFS, *cmd], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "denials:" in ln]
    assert len(lines) == 1, r.stderr
    line = lines[0]
    assert line.startswith("sandbox-fs: 7 denials: read ")
    assert "a\\x0ab" in line or "a\\nb" in line
    assert "\x1b" not in line and "\\x1b" in line
    assert "e\\x2c write etc-passwd" in line  # a name cannot fake a second entry
    assert line.endswith(" and 2 more")
    j = subprocess.run([*SFS, *cmd[:1], "--json", *cmd[1:]], capture_output=True, text=True, timeout=120)
    report = json.loads(j.stdout)
    assert report["violations_observed"] is True
    got = sorted(v["target"] for v in report["violations"] if v["target"].startswith(world_dir))
    assert got == sorted(os.path.join(world_dir, n) for n in names)
    assert {v["op"] for v in report["violations"] if v["target"].startswith(world_dir)} == {"read"}
    assert all(v["error"] == "EACCES" and v["pid"] > 0 for v in report["violations"])


# --- pure parts -------------------------------------------------------------------

def test_violation_log_bound():
    log = ViolationLog(2)
    for i in range(5):
        log.add("connect", f"h{i}:443", errno.EACCES)
    log.count_dropped(4)
    assert log.violations == (Violation("connect", "h0:443", 13, 0), Violation("connect", "h1:443", 13, 0))
    assert log.dropped == 7
    with pytest.raises(ValueError):
        ViolationLog(-1)


def test_summary_line():
    v = [Violation("write", "/etc/hosts", 13, 1), Violation("connect", "10.0.0.1:443", 13, 2)]
    assert violation_summary(tuple(v)) == "2 denials: write /etc/hosts, connect 10.0.0.1:443"
    assert violation_summary(()) == ""
    assert violation_summary((), 3) == "3 denials: and 3 more"
    many = tuple(Violation("read", f"/x{i}", 13, 1) for i in range(8))
    assert violation_summary(many, 2).endswith("read /x4 and 5 more")
    assert violation_summary((Violation("read", "a\nb\\c", 13, 1),)) == "1 denial: read a\\nb\\\\c"


def test_audit_record_parsing():
    w = _violations.AuditWatch.__new__(_violations.AuditWatch)
    _violations.AuditWatch.__init__(w, None, 10)  # type: ignore[arg-type]
    hexpath = "/tmp/a b\n".encode().hex().upper()
    recs = [
        (1423, f"audit(1.2:7): domain=1abc blockers=fs.read_file path={hexpath} dev=\"vda\" ino=5"),
        (1424, f"audit(1.2:7): domain=1abc status=allocated mode=enforcing pid=9 uid=0 exe=\"/x\" comm=\"{w.tag}\""),
        (1300, "audit(1.2:7): arch=c000003e syscall=257 success=no exit=-13 ppid=1 pid=42 comm=\"cat\""),
        (1320, "audit(1.2:7): "),
        (1423, "audit(1.3:8): domain=ffff blockers=fs.write_file path=\"/other\" dev=\"vda\" ino=6"),
        (1320, "audit(1.3:8): "),
        (1423, "audit(1.4:9): domain=1abc blockers=net.connect_tcp daddr=10.0.0.1 dest=443"),
        (1320, "audit(1.4:9): "),
        (1424, "audit(1.5:10): domain=1abc status=deallocated denials=4"),
    ]
    for t, text in recs:
        w._record(t, text)
    assert w.log.violations == (Violation("read", "/tmp/a b\n", 13, 42), Violation("connect", "10.0.0.1:443", 13, 0))
    assert w._reported == {"1abc": 4}


def test_add_proxy_refusals_bounds_and_formats():
    from types import SimpleNamespace as E
    kernel = (Violation("read", "/x", 13, 7),)
    events = [E(host="pypi.org", port=443, allowed=True), E(host="evil.org", port=443, allowed=False),
              E(host="::1", port=80, allowed=False), E(host="a.org", port=1, allowed=False)]
    got, dropped = _violations.add_proxy_refusals(kernel, 2, events, 3)
    assert got == (kernel[0], Violation("connect", "evil.org:443", 0, 0), Violation("connect", "[::1]:80", 0, 0))
    assert dropped == 3


_PROXY_CONNECT = """
import os, socket, urllib.parse
u = urllib.parse.urlsplit(os.environ["HTTPS_PROXY"])
s = socket.create_connection((u.hostname, u.port), timeout=10)
s.sendall(b"CONNECT not-allowed.example:443 HTTP/1.1\\r\\nHost: not-allowed.example:443\\r\\n\\r\\n")
print(s.recv(200).split(b"\\r\\n")[0].decode())
"""


@pytest.mark.skipif(not os.path.exists(PY), reason="the confined command here uses /usr/bin/python3")
def test_proxy_refusal_is_a_violation(layout):
    try:
        policy = ConfinementPolicy(allow_hosts=("allowed.example",))
    except Exception as exc:  # pragma: no cover - a host without the egress feature
        pytest.skip(f"egress by host name unavailable: {exc}")
    try:
        r = trio.run(_run, layout, [PY, "-S", "-c", _PROXY_CONNECT], policy)
    except sandbox_fs.exec.ConfinementError as exc:
        pytest.skip(f"no network namespace for the command here: {exc}")
    assert r.exit_code == 0, r.stderr
    assert " 200 " not in r.stdout.decode() + " "
    assert Violation("connect", "not-allowed.example:443", 0, 0) in r.violations, (r.violations, r.egress)


def test_no_domain_no_watch_and_no_fd_left(layout, confined):
    r = trio.run(lambda: _run(layout, ["true"], confinement="none"))
    assert r.violations_observed is False
    trio.run(_run, layout, ["true"])  # warms the process-wide caches (system rule fds)
    before = sorted(os.listdir("/proc/self/fd"))
    r = trio.run(_run, layout, _py(f"open({str(layout.outside / 'secret.txt')!r})"))
    assert r.violations_observed and r.violations
    r = trio.run(lambda: _run(layout, ["true"], confinement="none"))
    assert sorted(os.listdir("/proc/self/fd")) == before, "a run left an fd open (the audit socket?)"


def test_malformed_records_are_ignored():
    w = _violations.AuditWatch.__new__(_violations.AuditWatch)
    _violations.AuditWatch.__init__(w, None, 10)  # type: ignore[arg-type]
    for t, text in [(1423, "garbage"), (1424, "audit(x): domain= status=deallocated denials=zz"),
                    (1300, "audit(1.1:3): pid=abc exit=-x"), (1320, ""), (1423, "audit(1.1:4): blockers=")]:
        w._record(t, text)
    assert w.log.violations == ()
    assert list(_violations._records(b"\x05\x00\x00\x00" + b"\x00" * 12)) == []  # a length below the header
