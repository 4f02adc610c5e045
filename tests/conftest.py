"""Shared fixtures.

* ``resolver``: parametrized over ``openat2`` and ``fallback``; sets
  ``SANDBOX_FS_RESOLVER`` for the test so every Root it opens uses it.
* ``layout``: a temp dir with ``ws/`` (the workspace) and ``outside/``
  (a sentinel tree with a unique secret marker), plus ``snapshot()`` to hash
  every node under ``outside/`` (type, mode, size, mtime, content, link
  target) so attack tests can assert that nothing outside changed.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

import pytest

import sandbox_fs


@pytest.fixture(params=["openat2", "fallback"])
def resolver(request, monkeypatch):
    if request.param == "openat2" and not sandbox_fs.features()["openat2"]:
        pytest.skip("kernel has no openat2 (features()['openat2'] is False)")
    monkeypatch.setenv("SANDBOX_FS_RESOLVER", request.param)
    return request.param


def tree_digest(top: Path) -> dict[str, tuple]:
    """lstat + content digest of every node under ``top`` (never follows symlinks)."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = p.lstat()
            rel = str(p.relative_to(top))
            if stat.S_ISLNK(st.st_mode):
                extra = os.readlink(p)
            elif stat.S_ISREG(st.st_mode):
                extra = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                extra = None
            out[rel] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_size, st.st_mtime_ns,
                        st.st_nlink, extra)
    st = top.lstat()
    out["."] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_mtime_ns, st.st_nlink)
    return out


@dataclass
class Layout:
    base: Path
    ws: Path
    outside: Path
    secret: str

    def snapshot(self) -> dict[str, tuple]:
        return tree_digest(self.outside)

    def assert_outside_unchanged(self, before: dict[str, tuple]) -> None:
        after = self.snapshot()
        assert after == before, "the outside sentinel tree changed"

    def assert_secret_absent(self) -> None:
        for dirpath, _dirs, files in os.walk(self.ws, followlinks=False):
            for name in files:
                p = Path(dirpath, name)
                if p.is_symlink() or not p.is_file():
                    continue
                assert self.secret.encode() not in p.read_bytes(), f"secret leaked into {p}"


@pytest.fixture
def layout(tmp_path) -> Layout:
    ws = tmp_path / "ws"
    outside = tmp_path / "outside"
    ws.mkdir()
    (outside / "subdir").mkdir(parents=True)
    secret = "SECRET-" + secrets.token_hex(16)
    (outside / "secret.txt").write_text(secret + "\n")
    (outside / "sentinel.txt").write_text("sentinel\n")
    (outside / "subdir" / "inner.txt").write_text("inner " + secret + "\n")
    for p in [outside / "secret.txt", outside / "sentinel.txt", outside / "subdir" / "inner.txt"]:
        os.utime(p, ns=(10**18, 10**18))
    return Layout(tmp_path, ws, outside, secret)


@pytest.fixture
def ws(layout):
    """A Root on ``layout.ws`` (the exec tests' workspace)."""
    root = sandbox_fs.open_root(layout.ws)
    yield root
    root.close()


@pytest.fixture
def pygrant():
    """Python lives under /root/.pyenv here: an explicit read-only grant of its prefix."""
    import sys

    root = sandbox_fs.open_root(sys.base_prefix, read_only=True)
    yield [(root, True)]
    root.close()


@pytest.fixture
def opts(tmp_path):
    """ClientOptions with a private workspaces dir and snapshot store under tmp_path."""
    from sandbox_fs.client import ClientOptions

    return ClientOptions(workspaces_dir=str(tmp_path / "workspaces"), snapshot_dir=str(tmp_path / "store"))


@pytest.fixture
def client(opts):
    from sandbox_fs.client import LocalSandboxClient

    with LocalSandboxClient(opts) as c:
        yield c


_WATCHED_HOST_DIRS = ("/", "/etc", "/usr", "/root")


def _host_names() -> dict[str, set[str]]:
    out = {}
    for d in _WATCHED_HOST_DIRS:
        try:
            out[d] = set(os.listdir(d))
        except OSError:
            out[d] = set()
    return out


_WATCHED_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty")


def _host_devices() -> dict[str, tuple[int, int] | None]:
    """(file type and mode, device number) of each watched device node, not following links."""
    out: dict[str, tuple[int, int] | None] = {}
    for d in _WATCHED_DEVICES:
        try:
            st = os.lstat(d)
        except OSError:
            out[d] = None
        else:
            out[d] = (st.st_mode, st.st_rdev)
    return out


@pytest.fixture(scope="session", autouse=True)
def host_devices_untouched():
    """Suite-wide sentinel: no test may replace, remove or chmod a host device node.

    A write through a planted link, or an extractor writing outside its
    destination, can replace a node such as /dev/null with a file or a
    symlink; every later command that writes to it then writes elsewhere.
    """
    before = _host_devices()
    yield
    after = _host_devices()
    changed = {d: (before[d], after[d]) for d in before if after[d] != before[d]}
    assert not changed, f"the test run changed host device nodes: {changed}"


@pytest.fixture(scope="session", autouse=True)
def host_system_dirs_untouched():
    """Suite-wide sentinel: no test may create or delete names in /, /etc, /usr or /root.

    Tests build hostile trees (links to /, /etc, ..); a test helper that
    follows one of them by accident writes on the host.  This catches that
    whole class, whichever test does it.
    """
    before = _host_names()
    yield
    after = _host_names()
    changed = {d: sorted(after[d] ^ before[d]) for d in before if after[d] != before[d]}
    assert not changed, f"the test run changed host system directories: {changed}"


@pytest.fixture(scope="session")
def s3_server():
    """The SeaweedFS S3 server of tests/_seaweed.py: SFS_S3_ENDPOINT's, or one started for this session.

    Skips (with the reason, the tail of the server's log) only where none can start.
    """
    import _seaweed

    try:
        srv = _seaweed.server()
    except RuntimeError as exc:
        pytest.skip(f"no S3 server could start: {exc}")
    yield srv
    srv.stop()


# -- running beside each other (scripts/test.sh runs the suite with pytest-xdist: -n 2 --dist loadgroup)
#
# Tests that change or count something the whole machine shares go in a named xdist group: all the
# tests of a group run on one worker, one after the other, in collection order (loadgroup).


def _serial_group(item: pytest.Item) -> str | None:
    """The xdist group ``item`` must run in, or None where it may run beside anything."""
    path = item.path.name
    # the S3 server is one for the run: tests SIGSTOP it, SIGKILL and restart it (a new pid), and the
    # other S3 tests would see those faults as theirs
    if path == "test_snapshot_s3.py" or "s3_server" in getattr(item, "fixturenames", ()):
        return "s3"
    # Landlock denials reach the host through the kernel's one audit queue, whose backlog drops records
    # under a burst: two workers' denials at once made a count of exactly 20 come out 19
    if path == "test_exec_violations.py":
        return "audit"
    callspec = getattr(item, "callspec", None)
    if path == "test_snapshot_objects.py" and callspec is not None and callspec.params.get("objects") == "s3":
        return "s3"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        group = _serial_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
