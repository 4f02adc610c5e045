"""PTY sessions through Session: same confinement, ids, and all terminated at shutdown."""

from __future__ import annotations

import os

import pytest
import trio

import sandbox_fs
from sandbox_fs.client import ClientOptions, LocalSandboxClient

pytestmark = pytest.mark.skipif(sandbox_fs.features()["landlock_abi"] == 0,
                                reason="kernel has no Landlock (features()['landlock_abi'] == 0)")


def _in_ns(ns: str) -> list[str]:
    """Live host processes in PID namespace ``ns``."""
    out = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and os.readlink(f"/proc/{name}/ns/pid") == ns:
                with open(f"/proc/{name}/stat") as fh:
                    if fh.read().rsplit(")", 1)[1].split()[0] != "Z":
                        out.append(name)
        except OSError:
            pass
    return out


async def test_session_pty_round_trip_and_shutdown_terminates(tmp_path, layout):
    opts = ClientOptions(workspaces_dir=str(tmp_path / "w"))
    with LocalSandboxClient(opts) as client:
        async with client.create() as s:
            pty_id, _first = await s.pty_exec_start(
                ["/bin/sh", "-c", f"readlink /proc/self/ns/pid > ns.txt; cat {layout.outside}/secret.txt; exec cat"])
            await s.pty_write_stdin(pty_id, b"hello-pty\n")
            out = b""
            with trio.move_on_after(10):
                while b"hello-pty" not in out.replace(b"\r", b""):
                    out += await s.pty_read(pty_id, timeout_s=0.2)
            assert b"hello-pty" in out
            assert layout.secret.encode() not in out  # same confinement as exec
            ns = (await s.read("ns.txt")).decode().strip()  # the PTY command's own PID namespace
            assert ns.startswith("pid:[") and _in_ns(ns)
            with pytest.raises(sandbox_fs.SandboxError):
                await s.pty_read("no-such-pty")
        # aclose ran shutdown: nothing of the PTY's command is left
        assert _in_ns(ns) == []
        await client.delete(s)
