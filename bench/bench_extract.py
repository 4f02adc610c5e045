#!/usr/bin/env python3
"""Benchmark: extract a tarball of this Python's standard library (no site-packages).

Compares, alternating in one run on each filesystem (ext4 ``/tmp`` and tmpfs
``/dev/shm``):

* ``gnutar``  — ``tar -xf ARCHIVE -C DIR`` (GNU tar), the tool a user would use;
* ``sandbox`` — ``sandbox_fs.archive.extract`` (atomic mode, the default; from a
  host path it makes new files in batches in one helper thread while the calling
  thread parses headers, so it may use the second core: its cpu s counts both
  threads, GNU tar and cp are single-threaded);
* ``sandbox-inplace`` — the same with ``ExtractPolicy(in_place=True)``;
* ``tarfile-data`` — ``tarfile.open(ARCHIVE).extractall(DIR, filter="data")``;
* ``sandbox-owner``, ``sandbox-inplace-owner`` (only when listed in ``--tools``) —
  ``sandbox`` / ``sandbox-inplace`` into a Root opened with ``owner=(4000123, 4000123)``
  (one ``fchown`` per entry made; needs root).

Each run is a fresh child process extracting into a fresh empty directory;
the parent reads the child's peak RSS from ``wait4`` (``ru_maxrss``).
Printed per tool: median wall time of the child (includes interpreter start
and imports for the Python tools), median in-process extraction time (the
Python tools time themselves; for GNU tar it equals the wall time), median
CPU time (user + sys, from ``wait4``; steadier than wall time on a shared
machine), the ratio of each to GNU tar, and median peak RSS.

Then the peak RSS of ``sandbox-fs extract -`` fed generated tar streams of
growing size (64 MiB, 2 GiB, 90,000 members) shows memory does not grow with
the archive.

Usage: ``python bench/bench_extract.py [--rounds N] [--fs /tmp,/dev/shm] [--rss-fs /dev/shm]
[--only ext4|tmpfs] [--quick]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

from _rows import emit_row

CHILD = {
    "sandbox": (
        "import sys, time\n"
        "from sandbox_fs import open_root\n"
        "from sandbox_fs.archive import extract, ExtractPolicy\n"
        "t = time.perf_counter()\n"
        "owner = (4000123, 4000123) if sys.argv[4] == '1' else None\n"
        "with open_root(sys.argv[2], owner=owner) as root:\n"
        "    extract(root, '.', sys.argv[1], policy=ExtractPolicy(in_place=sys.argv[3] == '1'))\n"
        "print(time.perf_counter() - t)\n"
    ),
    "tarfile-data": (
        "import sys, tarfile, time\n"
        "t = time.perf_counter()\n"
        "with tarfile.open(sys.argv[1]) as tf:\n"
        "    tf.extractall(sys.argv[2], filter='data')\n"
        "print(time.perf_counter() - t)\n"
    ),
}


def build_archive(workdir: str) -> tuple[str, int]:
    stdlib = sysconfig.get_paths()["stdlib"]
    out = os.path.join(workdir, "stdlib.tar")
    subprocess.run(["tar", "-cf", out, "-C", stdlib, "--exclude=./site-packages", "."], check=True)
    n = int(subprocess.run(f"tar -tf {out} | wc -l", shell=True, capture_output=True, text=True).stdout)
    return out, n


def run_one(tool: str, archive: str, dest: str) -> tuple[float, float, int, float]:
    """Return (wall_s, inproc_s, maxrss_kib, cpu_s) of one child run (cpu: user + sys from wait4)."""
    if tool == "gnutar":
        argv = ["tar", "-xf", archive, "-C", dest]
    elif tool.startswith("sandbox"):
        argv = [sys.executable, "-c", CHILD["sandbox"], archive, dest, "1" if "inplace" in tool else "0",
                "1" if tool.endswith("-owner") else "0"]
    else:
        argv = [sys.executable, "-c", CHILD["tarfile-data"], archive, dest]
    t = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = proc.stdout.read()  # type: ignore[union-attr]
    err = proc.stderr.read()  # type: ignore[union-attr]
    _pid, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{tool} failed: {err.decode(errors='replace')[-500:]}")
    inproc = float(out.decode().strip().splitlines()[-1]) if tool != "gnutar" else wall
    return wall, inproc, ru.ru_maxrss, ru.ru_utime + ru.ru_stime


GEN = (
    "import sys, tarfile\n"
    "n_big, big, n_small = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])\n"
    "out = sys.stdout.buffer\n"
    "chunk = bytes(range(256)) * 4096\n"
    "for i in range(n_big):\n"
    "    ti = tarfile.TarInfo(f'big/{i}.bin'); ti.size = big\n"
    "    out.write(ti.tobuf(tarfile.GNU_FORMAT))\n"
    "    left = big\n"
    "    while left:\n"
    "        n = min(left, len(chunk)); out.write(chunk[:n]); left -= n\n"
    "    out.write(b'\\0' * (-big % 512))\n"
    "for i in range(n_small):\n"
    "    ti = tarfile.TarInfo('small/' + 'n' * 200 + f'/{i:07d}'); ti.size = 0\n"
    "    out.write(ti.tobuf(tarfile.GNU_FORMAT))\n"
    "out.write(b'\\0' * 1024)\n"
)


def rss_scenarios(fs: str) -> None:
    """Peak RSS of ``sandbox-fs extract -`` fed a generated tar stream (never stored) of growing size."""
    print(f"\npeak RSS whatever the archive size (tar streamed through a pipe into {fs}):")
    print(f"  {'archive':44s} {'peak RSS MiB':>13s} {'wall s':>8s}")
    for n_big, big, n_small in [(1, 64 << 20, 0), (2, 1 << 30, 0), (0, 0, 90_000)]:
        dest = tempfile.mkdtemp(prefix="bx-", dir=fs)
        try:
            t = time.perf_counter()
            gen = subprocess.Popen([sys.executable, "-c", GEN, str(n_big), str(big), str(n_small)],
                                   stdout=subprocess.PIPE)
            ext = subprocess.Popen([sys.executable, "-m", "sandbox_fs", "extract", "-", "--into",
                                    os.path.join(dest, "x")], stdin=gen.stdout, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE)
            gen.stdout.close()  # type: ignore[union-attr]
            err = ext.stderr.read()  # type: ignore[union-attr]
            _pid, status, ru = os.wait4(ext.pid, 0)
            gen.wait()
            wall = time.perf_counter() - t
            if os.waitstatus_to_exitcode(status) != 0:
                raise SystemExit(f"rss scenario failed: {err.decode(errors='replace')[-300:]}")
            label = (f"{n_big} x {big >> 20} MiB members" if n_big else f"{n_small} empty members, 200-byte dirs")
            print(f"  {label:44s} {ru.ru_maxrss / 1024:13.1f} {wall:8.2f}")
        finally:
            shutil.rmtree(dest)


def _emit_rows(fs: str, members: int, res: dict[str, list[tuple[float, float, int, float]]]) -> None:
    """One BENCH-ROW per sandbox tool against GNU tar (wall, child start-up included), and the
    default sandbox tool against tarfile's data filter (the in-process extraction times)."""
    case = f"extract stdlib ({members} members) on {fs}"
    med = {t: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)) for t, rs in res.items()}
    for tool, (wall, inproc) in med.items():
        if tool.startswith("sandbox") and "gnutar" in med:
            emit_row("extract", case + ", wall", tool, "GNU tar", wall / med["gnutar"][0], ours=wall,
                     anchor_value=med["gnutar"][0])
    if "sandbox" in med and "tarfile-data" in med:
        emit_row("extract", case + ", in-process", "sandbox", "tarfile data filter",
                 med["sandbox"][1] / med["tarfile-data"][1], ours=med["sandbox"][1],
                 anchor_value=med["tarfile-data"][1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fs", default="/tmp,/dev/shm")
    ap.add_argument("--tools", default="gnutar,sandbox,sandbox-inplace,tarfile-data")
    ap.add_argument("--rss-fs", default="/dev/shm", help="filesystem for the peak-RSS scenarios ('' to skip)")
    ap.add_argument("--only", choices=["ext4", "tmpfs"],
                    help="quick iteration: one filesystem (/tmp or /dev/shm), GNU tar and sandbox only, no RSS runs")
    ap.add_argument("--quick", action="store_true",
                    help="a short run: 3 rounds on /dev/shm of GNU tar, sandbox and tarfile-data, no RSS runs")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.fs, args.tools, args.rss_fs = 3, "/dev/shm", "gnutar,sandbox,tarfile-data", ""
    if args.only:
        args.fs = "/tmp" if args.only == "ext4" else "/dev/shm"
        args.tools = "gnutar,sandbox"
        args.rss_fs = ""
    tools = args.tools.split(",")
    with tempfile.TemporaryDirectory(prefix="bench-extract-") as work:
        archive, members = build_archive(work)
        size = os.path.getsize(archive)
        print(f"archive: {members} members, {size / 2**20:.1f} MiB (stdlib of {sys.version.split()[0]}, "
              f"no site-packages); rounds={args.rounds}")
        for fs in args.fs.split(","):
            res: dict[str, list[tuple[float, float, int, float]]] = {t: [] for t in tools}
            for r in range(args.rounds):
                order = tools[r % len(tools):] + tools[: r % len(tools)]  # rotate to alternate
                for tool in order:
                    dest = tempfile.mkdtemp(prefix="bx-", dir=fs)
                    try:
                        subprocess.run(["sync"], check=False)
                        res[tool].append(run_one(tool, archive, dest))
                    finally:
                        shutil.rmtree(dest)
            has_tar = "gnutar" in res
            base_wall = statistics.median(r[0] for r in res["gnutar"]) if has_tar else None
            base_cpu = statistics.median(r[3] for r in res["gnutar"]) if has_tar else None
            print(f"\n{fs}:  (x tar = ratio to GNU tar's median; 'extract' excludes interpreter start-up)")
            print(f"  {'tool':16s} {'wall s':>8s} {'x tar':>6s} {'extract s':>10s} {'x tar':>6s} "
                  f"{'cpu s':>7s} {'x tar':>6s} {'peak RSS MiB':>13s}")
            for tool in tools:
                wall = statistics.median(r[0] for r in res[tool])
                inproc = statistics.median(r[1] for r in res[tool])
                rss = statistics.median(r[2] for r in res[tool]) / 1024
                cpu = statistics.median(r[3] for r in res[tool])
                rw = f"{wall / base_wall:.2f}" if base_wall else "-"
                ri = f"{inproc / base_wall:.2f}" if base_wall else "-"
                rc = f"{cpu / base_cpu:.2f}" if base_cpu else "-"
                print(f"  {tool:16s} {wall:8.3f} {rw:>6s} {inproc:10.3f} {ri:>6s} {cpu:7.3f} {rc:>6s} {rss:13.1f}")
            _emit_rows(fs, members, res)
    if args.rss_fs:
        rss_scenarios(args.rss_fs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
