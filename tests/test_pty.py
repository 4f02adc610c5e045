"""PTY sessions (issue 6, section 4): echo round trip, confinement, bounded buffer, cap, unknown ids."""

from __future__ import annotations

import os

import pytest
import trio

import sandbox_fs
from sandbox_fs import open_root
from sandbox_fs import exec as sfs_exec
from sandbox_fs.exec import ProcessSupervisor, PtyManager, PtyNotFoundError

ABI = sandbox_fs.features()["landlock_abi"]
pytestmark = pytest.mark.skipif(not os.access(sfs_exec.helper_path(), os.X_OK),
                                reason="sandbox_fs/sfs-exec is not built (pip install -e . builds it)")
needs_landlock = pytest.mark.skipif(ABI == 0, reason="features()['landlock_abi'] is 0: the kernel has no Landlock")


@pytest.fixture
async def ptys(layout):
    ws = open_root(layout.ws)
    sup = ProcessSupervisor()
    mgr = PtyManager(sup, max_live=3, max_buffer_bytes=4096)
    try:
        yield mgr, ws
    finally:
        await mgr.pty_terminate_all()
        await sup.aclose()
        ws.close()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def read_until(mgr, pty_id, needle: bytes, timeout_s: float = 5.0, got: bytes = b"") -> bytes:
    with trio.move_on_after(timeout_s):
        while needle not in got:
            got += await mgr.pty_read(pty_id, timeout_s=0.2)
    return got


async def start(mgr, ws, layout, argv, **kw):
    return await mgr.pty_exec_start(argv, workspace=ws, workspace_host_path=str(layout.ws), **kw)


async def test_pty_echo_round_trip(ptys, layout):
    mgr, ws = ptys
    pty_id, first = await start(mgr, ws, layout, ["cat"], first_output_timeout_s=0.05)
    assert first == b""
    await mgr.pty_write_stdin(pty_id, b"hello-pty\n")
    got = await read_until(mgr, pty_id, b"hello-pty\r\nhello-pty\r\n")
    # the terminal echoes the input line, then cat prints it back
    assert got.count(b"hello-pty") == 2, got
    code = await mgr.pty_terminate(pty_id)
    assert code < 0
    with pytest.raises(PtyNotFoundError):
        await mgr.pty_read(pty_id)


async def test_pty_is_controlling_terminal_and_confined(ptys, layout):
    mgr, ws = ptys
    script = f"tty; test -t 0 && echo is-a-tty; cat {layout.outside}/secret.txt; echo done"
    pty_id, first = await start(mgr, ws, layout, ["sh", "-c", script], first_output_timeout_s=2.0)
    out = await read_until(mgr, pty_id, b"done", got=first)
    assert b"/dev/pts/" in out and b"is-a-tty" in out
    if ABI:
        assert layout.secret.encode() not in out
        # denied: Landlock, or hidden (the identity's mount namespace stubs the 0700 tmp_path ancestor)
        assert b"Permission denied" in out or b"No such file or directory" in out
    assert b"done" in out


async def test_pty_first_output_and_exit(ptys, layout):
    mgr, ws = ptys
    pty_id, first = await start(mgr, ws, layout, ["sh", "-c", "echo ready; exit 3"], first_output_timeout_s=2.0)
    assert first.startswith(b"ready")
    with trio.fail_after(5):
        while mgr.pty_info(pty_id)["exit_code"] is None:
            await trio.sleep(0.02)
            await mgr.pty_read(pty_id, timeout_s=0.01)
    assert mgr.pty_info(pty_id)["exit_code"] == 3
    assert await mgr.pty_terminate(pty_id) == 3


async def test_pty_buffer_is_bounded(ptys, layout):
    mgr, ws = ptys
    pty_id, first = await start(mgr, ws, layout, ["sh", "-c", "head -c 200000 /dev/zero | tr '\\0' x; echo END"],
                                first_output_timeout_s=0.01)
    assert len(first) <= mgr.max_buffer_bytes
    total = len(first)
    with trio.move_on_after(10):
        while True:
            chunk = await mgr.pty_read(pty_id, timeout_s=0.5, max_bytes=1 << 20)
            assert len(chunk) <= mgr.max_buffer_bytes
            total += len(chunk)
            if b"END" in chunk or not chunk:
                break
    info = mgr.pty_info(pty_id)
    assert total + info["dropped_bytes"] >= 200000
    assert total <= 200000 + 100


async def test_pty_cap_prunes_oldest_idle(ptys, layout):
    mgr, ws = ptys
    ids = []
    for _ in range(3):
        pty_id, _ = await start(mgr, ws, layout, ["cat"], first_output_timeout_s=0.01)
        ids.append(pty_id)
        await trio.sleep(0.01)
    pids = {i: mgr.pty_info(i)["pid"] for i in ids}
    await mgr.pty_write_stdin(ids[0], b"x\n")  # ids[0] is now the most recently used; ids[1] the oldest idle
    new_id, _ = await start(mgr, ws, layout, ["cat"], first_output_timeout_s=0.01)
    assert len(mgr) == 3
    with pytest.raises(PtyNotFoundError):
        mgr.pty_info(ids[1])
    assert not alive(pids[ids[1]])
    for keep in (ids[0], ids[2], new_id):
        assert mgr.pty_info(keep)["exit_code"] is None


async def test_unknown_pty_id_is_a_clear_error(ptys):
    mgr, _ = ptys
    for call in (mgr.pty_read("nope"), mgr.pty_write_stdin("nope", b"x"), mgr.pty_terminate("nope")):
        with pytest.raises(PtyNotFoundError) as info:
            await call
        assert info.value.code == "pty_not_found"
        assert "nope" not in str(info.value) or "pty_not_found" in str(info.value)


async def test_terminate_all_and_supervisor_kill(ptys, layout):
    mgr, ws = ptys
    a, first = await start(mgr, ws, layout, ["sh", "-c", "sleep 1000 & readlink /proc/self/ns/pid; wait"],
                           first_output_timeout_s=1.0)
    first = await read_until(mgr, a, b"\n", got=first)
    b, _ = await start(mgr, ws, layout, ["cat"], first_output_timeout_s=0.01)
    ns = first.split()[0].decode()  # the command's PID namespace (the grandchild's too)

    def in_ns() -> list[str]:
        out = []
        for p in os.listdir("/proc"):
            try:
                if p.isdigit() and os.readlink(f"/proc/{p}/ns/pid") == ns and alive(int(p)):
                    out.append(p)
            except OSError:
                pass
        return out

    pids = [mgr.pty_info(a)["pid"], mgr.pty_info(b)["pid"]]
    assert len(in_ns()) >= 2  # sh and its background sleep
    await mgr.pty_terminate_all()
    assert len(mgr) == 0
    with trio.fail_after(3):
        while any(alive(pid) for pid in pids) or in_ns():
            await trio.sleep(0.02)
