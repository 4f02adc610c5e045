#!/usr/bin/env python3
"""Benchmark: per-member cost of ``sandbox_fs.archive.extract``, in process, against GNU tar.

The archive is a tar of this Python's whole standard-library folder, with
``site-packages`` (``sysconfig.get_paths()["stdlib"]``: about 50,000 members
and 800 MB here), written once to the filesystem under test (tmpfs
``/dev/shm`` by default).  Each round extracts it into a fresh empty
directory with each tool in turn, rotating the order every round:

* ``gnutar``: ``tar -xf ARCHIVE -C DIR`` in a child process (wall and CPU
  from ``wait4``);
* ``sandbox``: ``extract(root, "x", ARCHIVE)`` in this process (atomic mode,
  the default; a host path, so new plain files go in batches to one helper
  thread): wall, process CPU (``getrusage``, both threads) and the calling
  thread's CPU (``time.thread_time``: the Python steps per member);
* ``sandbox-stream`` (with ``--stream``): the same archive given as a
  buffered file object, so every member takes the one-by-one path;
* ``tarfile-headers``: tarfile alone walking the same headers (``next()``,
  no extraction): the share of the calling thread's time that is tarfile's
  header parsing, which stays.

No interpreter start-up is included (``bench/bench_cli.py`` measures the
whole command line).  Printed: medians of wall and CPU seconds, the ratio of
each to GNU tar's median, and microseconds per member.  On a shared, loaded
machine the CPU figures are the steadier ones.

Usage: ``python bench/bench_extract_members.py [--rounds N] [--fs /dev/shm] [--stream] [--archive PATH] [--quick]``
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time

from _rows import emit_row

from sandbox_fs import open_root
from sandbox_fs.archive import extract


def build_archive(workdir: str) -> str:
    """Write the tar of this Python's stdlib folder (site-packages included) into ``workdir``."""
    out = os.path.join(workdir, "stdlib-full.tar")
    subprocess.run(["tar", "-cf", out, "-C", sysconfig.get_paths()["stdlib"], "."], check=True,
                   stderr=subprocess.DEVNULL)
    return out


def count_members(archive: str) -> int:
    with tarfile.open(archive) as tf:
        return sum(1 for _ in tf)


def run_gnutar(archive: str, dest: str) -> tuple[float, float, float]:
    """(wall s, cpu s, cpu s) of ``tar -xf`` in a child (single-threaded: its only thread's CPU is its CPU)."""
    t = time.perf_counter()
    proc = subprocess.Popen(["tar", "-xf", archive, "-C", dest])
    _pid, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit("GNU tar failed")
    cpu = ru.ru_utime + ru.ru_stime
    return wall, cpu, cpu


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def run_sandbox(archive: str, dest: str, stream: bool) -> tuple[float, float, float]:
    """(wall s, process cpu s, calling thread's cpu s) of one in-process extraction."""
    c0, t0, w0 = _cpu(), time.thread_time(), time.perf_counter()
    with open_root(dest) as root:
        if stream:
            with open(archive, "rb") as fh:  # buffered: not an io.FileIO, so no batches
                extract(root, "x", fh)
        else:
            extract(root, "x", archive)
    return time.perf_counter() - w0, _cpu() - c0, time.thread_time() - t0


def run_headers(archive: str, _dest: str) -> tuple[float, float, float]:
    """tarfile's own walk of the headers (the part of the calling thread's time that stays)."""
    c0, t0, w0 = _cpu(), time.thread_time(), time.perf_counter()
    with open(archive, "rb", buffering=0) as fh:
        tf = tarfile.open(fileobj=fh, mode="r:")
        while tf.next() is not None:
            tf.members.clear()
    return time.perf_counter() - w0, _cpu() - c0, time.thread_time() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fs", default="/dev/shm", help="filesystem for the archive and the destinations")
    ap.add_argument("--stream", action="store_true", help="also the one-by-one path (a buffered file object)")
    ap.add_argument("--archive", help="an existing tar to use instead of building one")
    ap.add_argument("--quick", action="store_true", help="a short run: 3 rounds")
    args = ap.parse_args()
    if args.quick:
        args.rounds = 3
    tools = ["gnutar", "sandbox"] + (["sandbox-stream"] if args.stream else []) + ["tarfile-headers"]
    runners = {"gnutar": run_gnutar, "sandbox": lambda a, d: run_sandbox(a, d, False),
               "sandbox-stream": lambda a, d: run_sandbox(a, d, True), "tarfile-headers": run_headers}
    with tempfile.TemporaryDirectory(prefix="bench-members-", dir=args.fs) as work:
        archive = args.archive or build_archive(work)
        members = count_members(archive)
        print(f"archive: {members} members, {os.path.getsize(archive) / 1e6:.0f} MB on {args.fs} "
              f"(Python {sys.version.split()[0]} stdlib folder with site-packages); rounds={args.rounds}; "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
        res: dict[str, list[tuple[float, float, float]]] = {t: [] for t in tools}
        for r in range(args.rounds):
            for tool in tools[r % len(tools):] + tools[:r % len(tools)]:
                dest = tempfile.mkdtemp(prefix="dest-", dir=work)
                try:
                    res[tool].append(runners[tool](archive, dest))
                finally:
                    shutil.rmtree(dest)
    base = [statistics.median(x[i] for x in res["gnutar"]) for i in range(2)]
    print(f"\n  {'tool':16s} {'wall s':>7s} {'x tar':>6s} {'cpu s':>7s} {'x tar':>6s} {'thread cpu s':>13s} "
          f"{'us/member':>10s}")
    for tool in tools:
        wall, cpu, thread = (statistics.median(x[i] for x in res[tool]) for i in range(3))
        print(f"  {tool:16s} {wall:7.2f} {wall / base[0]:6.2f} {cpu:7.2f} {cpu / base[1]:6.2f} {thread:13.2f} "
              f"{thread / members * 1e6:10.1f}")
        if tool.startswith("sandbox"):
            for what, ours, ref in (("wall", wall, base[0]), ("cpu", cpu, base[1])):
                emit_row("extract_members", f"in-process extract, {members} members on {args.fs}, {what}", tool,
                         "GNU tar", ours / ref, ours=ours, anchor_value=ref)
    print("\n  (wall and cpu: medians; cpu: user + sys of both threads; thread cpu: the calling thread's;"
          " us/member: thread cpu / members)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
