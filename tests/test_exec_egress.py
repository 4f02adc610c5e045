"""Egress by host name (issue 14, part 1): ``ConfinementPolicy.allow_hosts`` through the egress proxy.

Every server here is one the test starts on 127.0.0.1, and every policy that
lets the proxy reach it sets the test-only ``allow_private_egress=True``: no
traffic leaves the machine.  Each server counts the connections it accepted:
that count, outside the sandbox, is the sentinel a refusal is checked
against (a refused name must leave it at zero).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import base64
import http.server
import io
import json
import os
import subprocess
import sys
import threading
import zipfile
from pathlib import Path
from typing import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sandbox_fs
from sandbox_fs import _hosts, open_root
from sandbox_fs import exec as sfs_exec
from sandbox_fs.exec import ConfinementPolicy, ExecError, ProcessSupervisor, PtyManager, run_confined
from sandbox_fs.exec._egress import PROXY_PORT
from sandbox_fs.exec._proxy import HostRule

PY = "/usr/bin/python3"  # in the system set (the test venv is not)

pytestmark = [
    pytest.mark.skipif(not os.access(sfs_exec.helper_path(), os.X_OK), reason="sandbox_fs/sfs-exec is not built"),
    pytest.mark.skipif(sandbox_fs.features()["landlock_abi"] == 0, reason="the kernel has no Landlock"),
    pytest.mark.skipif(not os.access(PY, os.X_OK), reason=f"{PY} is needed inside the sandbox"),
]


class _Server:
    """A ThreadingHTTPServer on 127.0.0.1 serving ``top``; ``hits`` counts accepted connections."""

    def __init__(self, top: Path) -> None:
        outer = self
        self.hits = 0

        class Handler(http.server.SimpleHTTPRequestHandler):
            def setup(self) -> None:
                outer.hits += 1
                super().setup()

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(top)))
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


@pytest.fixture
def servers(tmp_path) -> Iterator[tuple[_Server, _Server]]:
    """Two servers: ``allowed`` serves ``a/hello`` ("from a"), ``other`` serves ``b/hello``."""
    made = []
    for name in ("a", "b"):
        top = tmp_path / "srv" / name
        top.mkdir(parents=True)
        (top / "hello").write_text(f"from {name}\n")
        made.append(_Server(top))
    yield made[0], made[1]
    for s in made:
        s.close()


@pytest.fixture
def workspace(tmp_path):
    d = tmp_path / "ws"
    d.mkdir()
    root = open_root(str(d))
    yield root, str(d)
    root.close()


def _policy(*hosts: str) -> ConfinementPolicy:
    return ConfinementPolicy(allow_hosts=hosts, allow_private_egress=True)


async def _py(workspace, code: str, policy: ConfinementPolicy, **kw):
    root, path = workspace
    return await run_confined([PY, "-c", code], workspace=root, workspace_host_path=path, policy=policy,
                              timeout_s=60, **kw)


_CONNECT = """
import os, socket, sys
host, port = sys.argv[1], sys.argv[2]
s = socket.create_connection(("127.0.0.1", int(os.environ["HTTPS_PROXY"].rsplit(":", 1)[1])))
s.sendall(f"CONNECT {host}:{port} HTTP/1.1\\r\\nHost: {host}:{port}\\r\\n\\r\\n".encode())
head = b""
while b"\\r\\n\\r\\n" not in head:
    chunk = s.recv(1)
    if not chunk:
        break
    head += chunk
print(head.split(b"\\r\\n")[0].decode())
if b" 200 " in head.split(b"\\r\\n")[0] + b" ":
    s.sendall(f"GET /hello HTTP/1.0\\r\\nHost: {host}\\r\\n\\r\\n".encode())
    body = b""
    while chunk := s.recv(65536):
        body += chunk
    print(body.rsplit(b"\\r\\n\\r\\n", 1)[-1].decode().strip())
"""


# ---- the policy -------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["", "*", "*.org", "a..b", "-a.org", "a.org:0", "a.org:65536", "a.org:x",
                                 "a.org:", " a.org", "*.1.2.3.4", "1.2.3", "a_b.org", "x" * 64 + ".org"])
def test_bad_entries_are_refused(bad):
    with pytest.raises(ExecError):
        ConfinementPolicy(allow_hosts=(bad,))


def test_a_single_string_is_refused_not_split():
    with pytest.raises(ExecError):
        ConfinementPolicy(allow_hosts="pypi.org")  # type: ignore[arg-type]


@pytest.mark.parametrize("other", [{"allow_tcp_connect": frozenset({443})}, {"allow_tcp_bind": frozenset({80})},
                                   {"unrestricted_tcp": True}, {"isolate_network": False}])
def test_hosts_need_the_commands_own_network(other):
    with pytest.raises(ExecError, match="own network namespace"):
        ConfinementPolicy(allow_hosts=("pypi.org",), **other)


def test_entries_parse_and_merge():
    entries = _hosts.parse_hosts(["PyPI.org", "pypi.org:443", "*.pythonhosted.org:443", "*.pythonhosted.org:80",
                                  "bücher.example", "127.0.0.1:8080"])
    assert [(e.pattern, e.ports) for e in entries] == [
        ("pypi.org", None), ("*.pythonhosted.org", frozenset({80, 443})),
        ("xn--bcher-kva.example", None), ("127.0.0.1", frozenset({8080}))]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.from_regex(r"[a-z0-9](?:[a-z0-9-]{0,8}[a-z0-9])?", fullmatch=True), min_size=1, max_size=4),
       st.sampled_from(["", "*."]), st.sampled_from(["", ":1", ":443", ":65535"]), st.sampled_from(["com", "example"]))
def test_every_accepted_entry_is_a_proxy_rule(labels, prefix, port, tld):
    """What the policy accepts the proxy takes unchanged (no refusal at run time)."""
    text = prefix + ".".join([*labels, tld]) + port
    (entry,) = _hosts.parse_hosts([text])
    rule = HostRule(entry.pattern, entry.ports)
    assert rule.pattern == entry.pattern and rule.ports == entry.ports
    assert ConfinementPolicy(allow_hosts=(text,)).allow_hosts == (text,)


def test_covering():
    assert _hosts.outside(["files.pythonhosted.org:443", "*.a.pythonhosted.org", "pypi.org:443"],
                          ["*.pythonhosted.org", "pypi.org"]) == []
    # the bare domain, another port, a wider pattern, another name: each outside
    assert _hosts.outside(["pythonhosted.org", "pypi.org:80", "*.hosted.org", "evil.org"],
                          ["*.pythonhosted.org", "pypi.org:443"]) == ["pythonhosted.org", "pypi.org:80",
                                                                      "*.hosted.org", "evil.org"]


# ---- confined runs ------------------------------------------------------------------------------

_NO_PROXY = importlib.util.find_spec("sandbox_fs.exec._proxy") is None
needs_proxy = pytest.mark.skipif(_NO_PROXY, reason="sandbox_fs.exec._proxy (the egress proxy) is not installed")


@needs_proxy
async def test_allowed_host_is_reached_and_others_are_refused(workspace, servers):
    allowed, other = servers
    policy = _policy(f"localhost:{allowed.port}")
    ok = await _py(workspace, _CONNECT.replace("sys.argv[1], sys.argv[2]", f"'localhost', {allowed.port}"), policy)
    assert ok.exit_code == 0, ok.stderr
    assert ok.stdout.decode().splitlines() == ["HTTP/1.1 200 Connection established", "from a"]
    assert allowed.hits == 1 and ok.network_isolated
    assert [(e.host, e.port, e.allowed) for e in ok.egress] == [("localhost", allowed.port, True)]
    assert ok.egress[0].bytes_down > 0

    refused = await _py(workspace, _CONNECT.replace("sys.argv[1], sys.argv[2]", f"'localhost', {other.port}"),
                        policy)
    assert refused.exit_code == 0, refused.stderr
    assert " 200 " not in refused.stdout.decode().splitlines()[0] + " "
    assert other.hits == 0
    assert [(e.host, e.port, e.allowed) for e in refused.egress] == [("localhost", other.port, False)]


@needs_proxy
async def test_urllib_through_https_proxy_env(workspace, servers):
    """A stock client (urllib, which reads HTTP_PROXY) reaches the allowed server by name."""
    allowed, _ = servers
    code = ("import os, urllib.request\n"
            "print(os.environ['HTTP_PROXY'], os.environ['ALL_PROXY'])\n"
            f"print(urllib.request.urlopen('http://localhost:{allowed.port}/hello', timeout=30).read().decode())")
    r = await _py(workspace, code, _policy("localhost"))
    assert r.exit_code == 0, r.stderr
    assert r.stdout.decode().split() == [f"http://127.0.0.1:{PROXY_PORT}",
                                         f"socks5h://127.0.0.1:{PROXY_PORT}", "from", "a"]
    assert allowed.hits == 1


@needs_proxy
async def test_nothing_else_leaves_the_namespace(workspace, servers):
    """A direct connect to the allowed server's own port fails: only the proxy is reachable."""
    allowed, _ = servers
    code = ("import socket, sys\n"
            f"for host in ('127.0.0.1', 'localhost'):\n"
            f"    try:\n"
            f"        socket.create_connection((host, {allowed.port}), timeout=10)\n"
            f"    except OSError as exc:\n"
            f"        print(type(exc).__name__)\n"
            f"    else:\n"
            f"        print('connected')\n")
    r = await _py(workspace, code, _policy(f"localhost:{allowed.port}"))
    assert r.exit_code == 0, r.stderr
    assert "connected" not in r.stdout.decode()
    assert allowed.hits == 0 and r.egress == ()


@needs_proxy
async def test_without_hosts_nothing_changes(workspace):
    """No allow_hosts: no proxy variables, no listener (the proxy's port is refused), no loopback up."""
    code = ("import os, socket\n"
            "print(sorted(k for k in os.environ if k.lower().endswith('_proxy')))\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {PROXY_PORT}), timeout=5)\n"
            "except OSError as exc:\n"
            "    print(type(exc).__name__)\n"
            "else:\n"
            "    print('connected')\n")
    r = await _py(workspace, code, ConfinementPolicy())
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.decode().splitlines()
    assert lines[0] == "[]" and lines[1] != "connected"
    assert r.network_isolated and r.egress == () and r.egress_dropped == 0


@needs_proxy
async def test_a_supervisor_runs_egress_again_and_again(workspace, servers):
    """Under one supervisor (held mount namespace) every run gets its listener and proxy."""
    allowed, _ = servers
    code = f"import urllib.request; print(urllib.request.urlopen('http://localhost:{allowed.port}/hello').read())"
    await _py(workspace, "pass", ConfinementPolicy())  # the first run caches the system set's fds
    fds_before = len(os.listdir("/proc/self/fd"))
    async with ProcessSupervisor() as sup:
        for _ in range(2):
            r = await _py(workspace, code, _policy("localhost"), supervisor=sup)
            assert r.exit_code == 0, r.stderr
        plain = await _py(workspace, "print(1)", ConfinementPolicy(), supervisor=sup)
        assert plain.exit_code == 0 and plain.egress == ()
    assert allowed.hits == 2
    assert len(os.listdir("/proc/self/fd")) == fds_before  # the socketpair, listener and proxy fds are all closed


@needs_proxy
async def test_egress_is_refused_on_a_pty(workspace):
    root, path = workspace
    async with ProcessSupervisor() as sup:
        mgr = PtyManager(supervisor=sup)
        with pytest.raises(ExecError, match="PTY"):
            await mgr.pty_exec_start([PY], workspace=root, workspace_host_path=path, policy=_policy("localhost"))


# ---- the goal: pip download from a local PEP 503 index ------------------------------------------


def _wheel(dest: Path, name: str = "tinypkg", version: str = "0.1") -> Path:
    """A minimal pure-Python wheel (a module, METADATA, WHEEL, RECORD)."""
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}.py": b"VALUE = 1\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = io.StringIO()
    for arc, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.write(f"{arc},sha256={digest},{len(data)}\n")
    record.write(f"{dist}/RECORD,,\n")
    path = dest / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for arc, data in files.items():
            z.writestr(arc, data)
        z.writestr(f"{dist}/RECORD", record.getvalue())
    return path


@pytest.fixture
def index(tmp_path) -> Iterator[_Server]:
    """A PEP 503 simple index on 127.0.0.1 serving one wheel of ``tinypkg``."""
    top = tmp_path / "index"
    (top / "simple" / "tinypkg").mkdir(parents=True)
    wheel = _wheel(top)
    (top / "simple" / "index.html").write_text('<a href="tinypkg/">tinypkg</a>\n')
    (top / "simple" / "tinypkg" / "index.html").write_text(f'<a href="../../{wheel.name}">{wheel.name}</a>\n')
    server = _Server(top)
    yield server
    server.close()


def _pip_download(port: int) -> list[str]:
    return [PY, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--disable-pip-version-check",
            "--retries", "0", "--timeout", "20", "--index-url", f"http://localhost:{port}/simple/", "-d", "dl",
            "tinypkg"]


@pytest.mark.skipif(os.system(f"{PY} -m pip --version >/dev/null 2>&1") != 0, reason=f"{PY} has no pip")
@needs_proxy
async def test_pip_download_through_the_proxy(workspace, index):
    root, path = workspace
    r = await run_confined(_pip_download(index.port), workspace=root, workspace_host_path=path,
                           policy=_policy("localhost"), timeout_s=120)
    assert r.exit_code == 0, r.stderr[-2000:]
    assert (Path(path) / "dl" / "tinypkg-0.1-py3-none-any.whl").is_file()
    assert r.egress and all(e.allowed and e.host == "localhost" for e in r.egress)


@pytest.mark.skipif(os.system(f"{PY} -m pip --version >/dev/null 2>&1") != 0, reason=f"{PY} has no pip")
@needs_proxy
async def test_pip_download_fails_when_the_name_is_not_allowed(workspace, index):
    root, path = workspace
    r = await run_confined(_pip_download(index.port), workspace=root, workspace_host_path=path,
                           policy=_policy("pypi.org"), timeout_s=120)
    assert r.exit_code != 0
    assert not (Path(path) / "dl").exists() or not list((Path(path) / "dl").iterdir())
    assert index.hits == 0
    assert r.egress and not any(e.allowed for e in r.egress)
    assert {(e.host, e.port) for e in r.egress} == {("localhost", index.port)}
    assert ("connect", f"localhost:{index.port}") in {(v.op, v.target) for v in r.violations}  # reported



# ---- manifest and command line ------------------------------------------------------------------


def test_a_manifest_asks_only_within_the_applications_list():
    from sandbox_fs.manifest import ManifestError, ManifestTrustError, load_manifest

    m = load_manifest({"network": {"allow_hosts": ["files.pythonhosted.org:443"]}})
    assert m.egress_hosts(["*.pythonhosted.org", "pypi.org"]) == ("files.pythonhosted.org:443",)
    assert load_manifest({}).egress_hosts(["pypi.org"]) == ("pypi.org",)  # no request: the application's list
    for permitted in ([], ["pypi.org"], ["*.pythonhosted.org:80"], ["pythonhosted.org"]):
        with pytest.raises(ManifestTrustError) as info:
            m.egress_hosts(permitted)
        assert info.value.context["hosts"] == ["files.pythonhosted.org:443"]
    with pytest.raises(ManifestError):
        load_manifest({"network": {"allow_hosts": ["*"]}})
    with pytest.raises(ManifestError):
        load_manifest({"network": {"allow_hosts": ["a.org"], "dns": True}})


def _cli(tmp_path, manifest: dict, *args: str) -> subprocess.CompletedProcess[str]:
    mpath = tmp_path / "manifest.json"
    mpath.write_text(json.dumps(manifest))
    (tmp_path / "wsdir").mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-m", "sandbox_fs", "run", "--manifest", str(mpath), "--workspaces-dir",
                           str(tmp_path / "wsdir"), *args], capture_output=True, text=True, timeout=120)


def test_cli_refuses_a_manifest_asking_for_more(tmp_path):
    proc = _cli(tmp_path, {"network": {"allow_hosts": ["evil.example"]}}, "--allow-host", "pypi.org",
                "--", "true")
    assert proc.returncode != 0
    assert "manifest_untrusted_field" in proc.stderr and "evil.example" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_cli_refuses_a_malformed_host(tmp_path):
    proc = _cli(tmp_path, {}, "--allow-host", "*", "--", "true")
    assert proc.returncode != 0 and "allow_hosts" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@needs_proxy
def test_cli_allow_host_goes_through_the_proxy_which_refuses_loopback(tmp_path, servers):
    """The command line has no test-only knob: the allowed name resolves to loopback and is refused there."""
    allowed, other = servers
    code = ("import urllib.request\n"
            f"for port in ({allowed.port}, {other.port}):\n"
            "    try:\n"
            "        urllib.request.urlopen(f'http://localhost:{port}/hello')\n"
            "    except OSError as exc:\n"
            "        print('refused', type(exc).__name__)\n")
    proc = _cli(tmp_path, {"network": {"allow_hosts": [f"localhost:{allowed.port}"]}},
                "--allow-host", "localhost", "--json", "--", PY, "-c", code)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["stdout"].split() == ["refused", "HTTPError"] * 2
    events = {e["port"]: e for e in report["egress"]}
    assert set(events) == {allowed.port, other.port} and not any(e["allowed"] for e in events.values())
    assert events[other.port]["reason"] == "port not allowed"  # the manifest narrowed the operator's list
    assert events[allowed.port]["reason"] != "port not allowed"  # allowed by name; its loopback answer refused
    assert sorted(v["target"] for v in report["violations"]) == sorted(
        f"localhost:{p}" for p in (allowed.port, other.port))  # each refusal is a violation too
    assert allowed.hits == 0 and other.hits == 0


def _detached_clone(path: Path) -> int:
    """A detached clone of the directory at ``path`` (open_tree OPEN_TREE_CLONE), standing in for the overlay."""
    import ctypes  # noqa: PLC0415

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        ret = libc.syscall(428, fd, b"", 1 | 0x1000 | 0x8000 | os.O_CLOEXEC)  # open_tree CLONE|EMPTY_PATH|RECURSIVE
        if ret < 0:
            raise OSError(ctypes.get_errno(), "open_tree")
        return int(ret)
    finally:
        os.close(fd)


@needs_proxy
@pytest.mark.skipif(os.geteuid() != 0, reason="the private root is built on a root host only")
async def test_egress_from_a_private_root(tmp_path, servers):
    from sandbox_fs.exec import PrivateRoot  # noqa: PLC0415

    allowed, _ = servers
    backing = tmp_path / "backing"
    backing.mkdir()
    mfd = _detached_clone(backing)
    root = open_root(str(backing))
    try:
        code = f"import urllib.request; print(urllib.request.urlopen('http://localhost:{allowed.port}/hello').read())"
        r = await run_confined([PY, "-c", code], workspace=root, workspace_host_path=str(backing),
                               private_root=PrivateRoot(mfd), policy=_policy("localhost"), timeout_s=60)
    finally:
        root.close()
        os.close(mfd)
    assert r.exit_code == 0, r.stderr
    assert r.overlay and r.stdout.strip() == b"b'from a\\n'" and allowed.hits == 1


@needs_proxy
async def test_a_failed_start_leaves_no_fd_behind(workspace):
    from sandbox_fs.exec import CommandNotFoundError  # noqa: PLC0415

    root, path = workspace
    await _py(workspace, "pass", ConfinementPolicy())  # the first run caches the system set's fds
    fds_before = len(os.listdir("/proc/self/fd"))
    for _ in range(2):
        with pytest.raises(CommandNotFoundError):
            await run_confined(["/nonexistent/prog"], workspace=root, workspace_host_path=path,
                               policy=_policy("localhost"))
    assert len(os.listdir("/proc/self/fd")) == fds_before


@needs_proxy
async def test_there_is_no_resolver_inside(workspace):
    """Names resolve only through the proxy: a lookup inside the namespace (not in /etc/hosts) fails."""
    code = ("import socket\n"
            "try:\n"
            "    socket.getaddrinfo('index.test', 443)\n"
            "except socket.gaierror:\n"
            "    print('no resolver')\n"
            "else:\n"
            "    print('resolved')\n")
    r = await _py(workspace, code, _policy("index.test"))
    assert r.exit_code == 0, r.stderr
    assert r.stdout.decode().strip() == "no resolver"


def test_the_helper_refuses_a_listener_outside_a_namespace_of_its_own():
    """--egress-sock without --unshare CLONE_NEWNET or --netns is a usage error: never the host's loopback."""
    import socket  # noqa: PLC0415

    a, b = socket.socketpair()
    status_r, status_w = os.pipe()
    try:
        proc = subprocess.run([sfs_exec.helper_path(), "--status", str(status_w), "--egress-listen", "3128",
                               "--egress-sock", str(b.fileno()), "--", "true"],
                              pass_fds=(status_w, b.fileno()), capture_output=True, timeout=30, env={})
        os.close(status_w)
        status_w = -1
        assert proc.returncode == 127
        assert os.read(status_r, 100).split()[0] == b"usage"
    finally:
        for fd in (status_r, status_w):
            if fd >= 0:
                os.close(fd)
        a.close()
        b.close()


async def test_the_received_listener_is_close_on_exec():
    """The host's copy of the listener is never inheritable (a concurrent spawn must not get it)."""
    import fcntl  # noqa: PLC0415
    import socket  # noqa: PLC0415

    from sandbox_fs.exec._egress import EgressChannel  # noqa: PLC0415

    channel = EgressChannel(ConfinementPolicy(allow_hosts=("a.example",)))
    child = socket.socket(fileno=channel.child_fd)
    listener = socket.socket()
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        socket.send_fds(child, [b"L"], [listener.fileno()])
        fd = await channel._receive()
        assert fd is not None
        try:
            assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
            assert os.fstat(fd).st_ino == os.fstat(listener.fileno()).st_ino
        finally:
            os.close(fd)
    finally:
        listener.close()
        child.close()
        channel.close()
