"""Each confinement layer on its own: the refusal holds with every other layer turned off.

The layers of a confined command (SECURITY.md, "Confined commands"):
Landlock, the seccomp allow-list, dropped capabilities, the leased
identity, the read-only mount layer and the network namespace.  A test
here turns all but one off (seccomp by replacing the helper's
``--seccomp`` arguments, Landlock with ``SANDBOX_FS_DEGRADE=landlock=0``
and ``best_effort``, the others by policy) and checks that the one left
refuses, and a control with that one off too shows the operation then
succeeds, so the refusal really is that layer's.  Every target is in a
throw-away directory; the outside sentinel is checked, not the exit code.
"""

from __future__ import annotations

import os
import socket
import stat

import pytest

import sandbox_fs
from sandbox_fs import _features, open_root
from sandbox_fs import exec as sfs_exec
from sandbox_fs.exec import ConfinementPolicy, _landlock, _prepare, run_confined

ABI = sandbox_fs.features()["landlock_abi"]
pytestmark = [
    pytest.mark.skipif(not os.access(sfs_exec.helper_path(), os.X_OK), reason="sandbox_fs/sfs-exec is not built"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the layers are told apart only as root (uid 0 with capabilities)"),
]
needs_landlock = pytest.mark.skipif(ABI == 0, reason="the kernel has no Landlock")

#: Every layer but the named ones off: uid 0 keeping its capabilities, no mount layer.
ALL_OFF = {"identity": "host", "drop_capabilities": False, "read_only_mounts": False}


@pytest.fixture
def no_seccomp(monkeypatch):
    monkeypatch.setattr(_prepare, "_seccomp_args", lambda prep, request: [])


@pytest.fixture
def no_landlock(monkeypatch):
    monkeypatch.setenv(_features.DEGRADE_ENV, "landlock=0")


async def _sh(layout, script: str, confinement: str = "best_effort", **policy):
    with open_root(layout.ws) as ws:
        return await run_confined(["/bin/sh", "-c", script], workspace=ws, workspace_host_path=str(layout.ws),
                                  confinement=confinement, policy=ConfinementPolicy(**policy), timeout_s=60)


MKNOD = "mknod node c 1 3; echo rc=$?"


def _node_made(layout) -> bool:
    p = layout.ws / "node"
    made = os.path.lexists(p) and stat.S_ISCHR(os.lstat(p).st_mode)
    if os.path.lexists(p):
        os.unlink(p)
    return made


# ------------------------------------------------------------------ device nodes


async def test_control_mknod_succeeds_with_every_layer_off(layout, no_seccomp):
    r = await _sh(layout, MKNOD, "none", **ALL_OFF)
    assert r.stdout == b"rc=0\n" and _node_made(layout), "the layers are not all off: the tests below prove nothing"


@needs_landlock
async def test_landlock_alone_refuses_device_nodes(layout, no_seccomp):
    """Capabilities kept (CAP_MKNOD), uid 0, no seccomp, no mount layer: only Landlock's MAKE_CHAR stops it."""
    r = await _sh(layout, MKNOD, "required", **ALL_OFF)
    assert r.confinement == "landlock" and r.stdout == b"rc=1\n" and b"Permission denied" in r.stderr
    assert not _node_made(layout)
    assert not _landlock.fs_read_write(ABI) & (_landlock.FS_MAKE_CHAR | _landlock.FS_MAKE_BLOCK)


async def test_seccomp_alone_refuses_device_nodes(layout, no_landlock):
    r = await _sh(layout, MKNOD, **ALL_OFF)
    assert r.confinement == "none" and r.stdout == b"rc=1\n" and b"Operation not permitted" in r.stderr
    assert not _node_made(layout)


async def test_dropped_capabilities_alone_refuse_device_nodes(layout, no_landlock, no_seccomp):
    r = await _sh(layout, MKNOD, **{**ALL_OFF, "drop_capabilities": True})
    assert r.stdout == b"rc=1\n" and b"Operation not permitted" in r.stderr and not _node_made(layout)


async def test_leased_identity_alone_refuses_device_nodes(layout, no_landlock, no_seccomp):
    r = await _sh(layout, MKNOD, **{**ALL_OFF, "identity": "auto"})
    assert r.identity is not None and r.identity[0] != 0
    assert r.stdout == b"rc=1\n" and not _node_made(layout)


# ------------------------------------------------------------------ writing outside


async def test_control_outside_write_succeeds_with_every_layer_off(layout, no_seccomp):
    target = layout.outside / "sentinel.txt"
    await _sh(layout, f"echo changed > '{target}'", "none", **ALL_OFF)
    assert target.read_text() == "changed\n", "the layers are not all off"


@needs_landlock
async def test_landlock_alone_refuses_writing_outside(layout, no_seccomp):
    before = layout.snapshot()
    target = layout.outside / "sentinel.txt"
    # chmod is not a Landlock right (SECURITY.md: the mount layer covers it), so it is not tried here
    r = await _sh(layout, f"echo changed > '{target}'; rm -f '{target}'; mkdir '{layout.outside}/new'", "required",
                  **ALL_OFF)
    assert r.confinement == "landlock" and r.stderr.count(b"Permission denied") == 3
    layout.assert_outside_unchanged(before)


async def test_mount_layer_alone_refuses_changing_outside(layout, no_landlock, no_seccomp):
    """uid 0 with capabilities, no Landlock, no seccomp: only the read-only mounts stop chmod and writes."""
    before = layout.snapshot()
    target = layout.outside / "sentinel.txt"
    r = await _sh(layout, f"chmod 600 '{target}'; echo changed > '{target}'; echo done",
                  **{**ALL_OFF, "read_only_mounts": True})
    # the private temp dir above the sentinel is hidden under a read-only tmpfs, or (reachable) read-only
    assert r.read_only_mounts and r.stdout == b"done\n"
    assert b"Read-only file system" in r.stderr or b"No such file or directory" in r.stderr
    layout.assert_outside_unchanged(before)


async def test_leased_identity_alone_refuses_writing_root_files(layout, no_landlock, no_seccomp):
    before = layout.snapshot()
    os.chmod(layout.base, 0o755)  # reachable, so the refusal is the file's owner and mode, not the path
    target = layout.outside / "sentinel.txt"
    r = await _sh(layout, f"echo changed > '{target}'; chmod 666 '{target}'", **{**ALL_OFF, "identity": "auto"})
    assert r.identity is not None and b"Permission denied" in r.stderr
    layout.assert_outside_unchanged(before)


# ------------------------------------------------------------------ network


async def test_network_namespace_alone_refuses_host_loopback(layout, no_landlock, no_seccomp):
    """No Landlock TCP rules, no seccomp socket filter: only the command's own network namespace."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    srv.setblocking(False)
    port = srv.getsockname()[1]
    probe = f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected"
    try:
        for isolate, expect in ((False, True), (True, False)):
            r = await _sh(layout, f"bash -c '{probe}'", **{**ALL_OFF, "isolate_network": isolate})
            try:
                conn, _ = srv.accept()
                conn.close()
                accepted = True
            except BlockingIOError:
                accepted = False
            assert (b"connected" in r.stdout, accepted, r.network_isolated) == (expect, expect, isolate), r.stderr
    finally:
        srv.close()
