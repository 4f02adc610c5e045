"""Spawn cost of a confined command vs the unconfined ``trio.run_process`` a user would use.

Runs ``true`` N times per variant, alternating the variants in every round
so machine load hits them alike, and prints medians, the delta to the
baseline in ms and the ratio.  Goal: confined <= baseline + 5 ms.
Pass 1 alternates only baseline and confined (the goal's pair); pass 2
alternates the breakdown variants with the baseline.

Variants:
  baseline        trio.run_process(["true"])
  baseline-capture trio.run_process(["true"], capture_stdout=True, capture_stderr=True):
                  what a caller who wants the output (as ExecResult has it) would run
  confined        run_confined(["true"]) with a session's ProcessSupervisor
                  (Landlock + cgroup leaf + read-only mounts when root + rlimits +
                  IPC/cgroup namespaces, the held network namespace, seccomp)
  confined-egress the same with ConfinementPolicy(allow_hosts=("localhost",)):
                  a network namespace of its own, the proxy's listener made
                  in it and served by an EgressProxy for the run (goal:
                  baseline + 15 ms)
  confined-nomnt  the same without the read-only mount layer
  confined-none   confinement="none" (helper: setsid, rlimits, fds, cgroup)
  one-shot        run_confined without a supervisor (makes and removes a
                  private cgroup tree per call)
  confined-protected  confined with ConfinementPolicy(protected=DEFAULT_PROTECTED) in an
                  empty workspace (every entry a placeholder made and removed; a mount
                  namespace of its own per run instead of the held one)

Proxy row (goal: through the proxy <= 1.2x direct): a 64 MiB download with
curl (its own ``time_total``, so process start is not counted) from a local
HTTP server in another process (``socket.sendfile``), direct vs through an
:class:`~sandbox_fs.exec.EgressProxy` in this process on a listening socket
made here, as plain HTTP (``-x``), CONNECT (``-p -x``) and SOCKS5
(``--socks5-hostname``), and CONNECT through one with ``max_bulk_streams=0``
(``nobulk-connect``: splice only, the relay before bulk mode); the name is resolved by a resolver hook to
127.0.0.1 (the test-only ``allow_private``).  ``floor-relay`` is the floor
of a naive relay that holds a second TCP connection: blocking ``splice`` in
threads in another process, no parsing, no checks (the proxy's bulk mode
can beat it: see SECURITY.md).  Alternating, medians; "host cpu" is this
process's CPU per download (the proxy, plus starting curl: see the direct
row), "curl cpu" the client's (the relay's write pattern changes it).  On 2
shared cores the CPU columns move less with the load than the times.

Usage: python bench/bench_exec.py [N] [--proxy-only] [--quick]   (default N = 200, 30 with --quick; the proxy
row runs max(3, N // 10) rounds)
"""

from __future__ import annotations

import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import trio
from _rows import emit_row

from sandbox_fs import open_root
from sandbox_fs.exec import (ConfinementPolicy, EgressLog, EgressProxy, HostRule, ProcessSupervisor, ProxyLimits,
                             run_confined)
from sandbox_fs.exec import DEFAULT_PROTECTED

DOWNLOAD_BYTES = 64 * 1024 * 1024

# A minimal HTTP/1.0 server for one file: one request per connection, headers then sendfile.
_SERVER = r"""
import os, socket, sys
path = sys.argv[1]
size = os.path.getsize(path)
srv = socket.create_server(("127.0.0.1", 0), backlog=64)
print(srv.getsockname()[1], flush=True)
while True:
    conn, _ = srv.accept()
    with conn:
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = conn.recv(65536)
            if not chunk:
                break
            head += chunk
        conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % size)
        with open(path, "rb") as f:
            conn.sendfile(f)
"""

# The floor of any relay holding a second TCP connection: blocking splice in threads, in another process,
# no parsing and no checks (every connection goes to the server).
_FLOOR_RELAY = r"""
import os, socket, sys, threading
target = int(sys.argv[1])
srv = socket.create_server(("127.0.0.1", 0), backlog=64)
print(srv.getsockname()[1], flush=True)
def pump(a, b):
    r, w = os.pipe()
    try:
        while n := os.splice(a.fileno(), w, 1 << 20, flags=os.SPLICE_F_MOVE):
            while n:
                n -= os.splice(r, b.fileno(), n, flags=os.SPLICE_F_MOVE)
        b.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    finally:
        os.close(r), os.close(w)
def handle(c):
    with c, socket.create_connection(("127.0.0.1", target)) as u:
        t = threading.Thread(target=pump, args=(u, c))
        t.start()
        pump(c, u)
        t.join()
while True:
    threading.Thread(target=handle, args=(srv.accept()[0],), daemon=True).start()
"""


def _start(script: str, *args: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


async def proxy_download(rounds: int) -> None:
    """Print the proxy row: medians of curl's time_total, direct vs each proxy protocol."""
    if shutil.which("curl") is None:
        print("proxy row skipped: no curl")
        return
    with tempfile.TemporaryDirectory(prefix="bench-proxy-") as tmp:
        blob = os.path.join(tmp, "blob")
        with open(blob, "wb") as f:
            f.truncate(DOWNLOAD_BYTES)  # sparse: the server's page cache, not a disk, feeds it
        server, port = _start(_SERVER, blob)
        floor, floor_port = _start(_FLOOR_RELAY, str(port))
        try:
            await _proxy_rounds(rounds, port, floor_port)
        finally:
            for proc in (server, floor):
                proc.kill()
                proc.wait()


async def _proxy_rounds(rounds: int, port: int, floor_port: int) -> None:
    async def resolve(host: str, port: int) -> list[str]:
        return ["127.0.0.1"]

    lsock = socket.create_server(("127.0.0.1", 0), backlog=64)
    pport = lsock.getsockname()[1]
    log = EgressLog(100_000)
    proxy = EgressProxy([HostRule("bench.test")], allow_private=True, events=log, resolve=resolve)
    proxies = f"http://127.0.0.1:{pport}"
    # the same proxy without bulk mode (splice only, as before it): its CONNECT row shows what bulk mode buys
    nsock = socket.create_server(("127.0.0.1", 0), backlog=64)
    nport = nsock.getsockname()[1]
    nobulk = EgressProxy([HostRule("bench.test")], allow_private=True, events=log, resolve=resolve,
                         limits=ProxyLimits(max_bulk_streams=0))
    variants = {
        "direct": [f"http://127.0.0.1:{port}/blob"],
        "floor-relay": [f"http://127.0.0.1:{floor_port}/blob"],
        "proxy-http": ["-x", proxies, f"http://bench.test:{port}/blob"],
        "proxy-connect": ["-p", "-x", proxies, f"http://bench.test:{port}/blob"],
        "proxy-socks5": ["--socks5-hostname", f"127.0.0.1:{pport}", f"http://bench.test:{port}/blob"],
        "nobulk-connect": ["-p", "-x", f"http://127.0.0.1:{nport}", f"http://bench.test:{port}/blob"],
    }

    async def fetch(args: list[str]) -> float:
        out = await trio.run_process(["curl", "-sS", "--noproxy", "", "-o", "/dev/null", "-w",
                                      "%{time_total} %{size_download}", *args], capture_stdout=True)
        total, size = out.stdout.decode().split()
        assert int(size) == DOWNLOAD_BYTES, (args, size)
        return float(total)

    times: dict[str, list[float]] = {k: [] for k in variants}
    async with trio.open_nursery() as nursery:
        await nursery.start(proxy.serve, lsock.detach())
        await nursery.start(nobulk.serve, nsock.detach())
        for args in variants.values():  # warm-up
            await fetch(args)
        cpu: dict[str, list[float]] = {k: [0.0, 0.0, 0.0] for k in variants}  # this process: user, system; curl
        for _ in range(rounds):
            for name, args in variants.items():
                r0 = resource.getrusage(resource.RUSAGE_SELF)
                c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
                times[name].append(await fetch(args))
                r1 = resource.getrusage(resource.RUSAGE_SELF)
                c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu[name][0] += r1.ru_utime - r0.ru_utime
                cpu[name][1] += r1.ru_stime - r0.ru_stime
                cpu[name][2] += c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime
        nursery.cancel_scope.cancel()
    events, dropped = log.drain()
    assert dropped == 0 and all(ev.allowed and ev.bytes_down >= DOWNLOAD_BYTES for ev in events), events[:3]
    base = statistics.median(times["direct"])
    print(f"proxy row: {DOWNLOAD_BYTES >> 20} MiB download (curl time_total), n={rounds} per variant, alternating; "
          f"load avg {os.getloadavg()[0]:.2f}")
    print(f"  {'variant':16} {'median ms':>10} {'MiB/s':>8} {'ratio':>6} {'host cpu ms (user+sys)':>24} "
          f"{'curl cpu ms':>12}")
    for name, ts in times.items():
        med = statistics.median(ts)
        user, system, client = (c / rounds * 1e3 for c in cpu[name])
        print(f"  {name:16} {med * 1e3:10.2f} {DOWNLOAD_BYTES / 2**20 / med:8.0f} {med / base:6.2f} "
              f"{user:12.1f} + {system:6.1f} {client:15.1f}")
    worst = max(statistics.median(ts) for name, ts in times.items() if name.startswith("proxy")) / base
    floor = statistics.median(times["floor-relay"]) / base
    for name, ts in times.items():
        if name != "direct":
            emit_row("exec", f"{DOWNLOAD_BYTES >> 20} MiB download, curl time_total", name, "direct (no proxy)",
                     statistics.median(ts) / base, ours=statistics.median(ts) * 1e3, anchor_value=base * 1e3,
                     unit="ms", goal=1.2 if name.startswith("proxy") else None,
                     goal_text="<= 1.2x direct" if name.startswith("proxy") else "")
    print(f"goal proxy <= 1.2x direct: {'met' if worst <= 1.2 else 'NOT met'} (worst {worst:.2f}x; "
          f"the floor relay {floor:.2f}x, so the proxy's own share is {worst / floor:.2f}x)")


async def main(n: int) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-exec-") as tmp:
        ws = open_root(tmp)
        sup = ProcessSupervisor()
        nomnt = ConfinementPolicy(read_only_mounts=False)
        egress = ConfinementPolicy(allow_hosts=("localhost",))

        async def baseline() -> None:
            await trio.run_process(["true"])

        async def baseline_capture() -> None:
            await trio.run_process(["true"], capture_stdout=True, capture_stderr=True)

        async def confined() -> None:
            await run_confined(["true"], workspace=ws, workspace_host_path=tmp, supervisor=sup)

        async def confined_egress() -> None:
            await run_confined(["true"], workspace=ws, workspace_host_path=tmp, supervisor=sup, policy=egress)

        async def confined_nomnt() -> None:
            await run_confined(["true"], workspace=ws, workspace_host_path=tmp, supervisor=sup, policy=nomnt)

        async def confined_none() -> None:
            await run_confined(["true"], workspace=ws, workspace_host_path=tmp, supervisor=sup, confinement="none")

        async def one_shot() -> None:
            await run_confined(["true"], workspace=ws, workspace_host_path=tmp)

        protected = ConfinementPolicy(protected=DEFAULT_PROTECTED)

        async def confined_protected() -> None:
            await run_confined(["true"], workspace=ws, workspace_host_path=tmp, supervisor=sup, policy=protected)

        async def measure(variants: dict) -> dict[str, list[float]]:
            times: dict[str, list[float]] = {k: [] for k in variants}
            for fn in variants.values():  # warm-up
                await fn()
            for _ in range(n):
                for name, fn in variants.items():
                    t0 = time.perf_counter()
                    await fn()
                    times[name].append(time.perf_counter() - t0)
            return times

        load = os.getloadavg()[0]
        main_pair = await measure({"baseline": baseline, "baseline-capture": baseline_capture,
                                   "confined": confined, "confined-egress": confined_egress})
        breakdown = await measure({"baseline": baseline, "confined-nomnt": confined_nomnt,
                                   "confined-none": confined_none, "one-shot": one_shot,
                                   "confined-protected": confined_protected})
        await sup.aclose()
        ws.close()

    print(f"spawn of `true`, n={n} per variant, alternating; load avg {load:.2f}, {os.cpu_count()} cpus")
    for title, times in (("pass 1 (goal pair)", main_pair), ("pass 2 (breakdown)", breakdown)):
        base = statistics.median(times["baseline"])
        print(title)
        print(f"  {'variant':16} {'median ms':>10} {'p10 ms':>8} {'p90 ms':>8} {'delta ms':>9} {'ratio':>6}")
        for name, ts in times.items():
            ts.sort()
            med = statistics.median(ts)
            p10, p90 = ts[len(ts) // 10], ts[(len(ts) * 9) // 10]
            print(f"  {name:16} {med * 1e3:10.2f} {p10 * 1e3:8.2f} {p90 * 1e3:8.2f} {(med - base) * 1e3:+9.2f} "
                  f"{med / base:6.2f}")
            if name != "baseline":
                limit_ms = {"confined": 5.0, "confined-egress": 15.0}.get(name)
                emit_row("exec", "spawn of `true`", name, "unconfined trio.run_process", med / base, ours=med * 1e3,
                         anchor_value=base * 1e3, unit="ms",
                         goal_text=f"<= baseline + {limit_ms:g} ms" if limit_ms is not None else "",
                         met=(med - base) * 1e3 <= limit_ms if limit_ms is not None else None)
    conf = statistics.median(main_pair["confined"])
    for base_name in ("baseline", "baseline-capture"):
        delta = (conf - statistics.median(main_pair[base_name])) * 1e3
        print(f"goal confined <= {base_name} + 5 ms: {'met' if delta <= 5 else 'NOT met'} ({delta:+.2f} ms)")
    delta = (statistics.median(main_pair["confined-egress"]) - statistics.median(main_pair["baseline"])) * 1e3
    print(f"goal confined-egress <= baseline + 15 ms: {'met' if delta <= 15 else 'NOT met'} ({delta:+.2f} ms)")


async def run_all(n: int, proxy_only: bool) -> None:
    if not proxy_only:
        await main(n)
    await proxy_download(max(3, n // 10))


if __name__ == "__main__":
    numbers = [int(a) for a in sys.argv[1:] if a.isdigit()]
    default_n = 30 if "--quick" in sys.argv[1:] else 200
    trio.run(run_all, numbers[0] if numbers else default_n, "--proxy-only" in sys.argv[1:])
