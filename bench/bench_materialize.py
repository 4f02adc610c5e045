#!/usr/bin/env python3
"""Benchmark: a ``local_dir`` manifest entry vs ``cp -a`` vs ``shutil.copytree``.

The tree is this Python's standard library without ``site-packages``
(``sysconfig.get_paths()["stdlib"]``, about 7,700 files), first staged once
on the filesystem under test, then copied into an empty destination by each
tool in turn, alternating the order every round, on ext4 ``/tmp`` and on
tmpfs ``/dev/shm``.  Prints per-tool medians (seconds) and ratios against
``cp -a``, of wall time and of CPU time (user + sys: ``getrusage`` of the
child for ``cp -a``, of this process for the in-process tools, worker
threads included).  On a shared, loaded machine the CPU ratio is the steadier
figure; the goals are wall ratios.  Goals (issue 4): <= 1.25x ``cp -a`` on
ext4, <= 1.5x on tmpfs.

Tools:
  cp -a                      GNU coreutils, one process.
  shutil.copytree            ``copytree(src, dst, symlinks=True)`` (copy2: data, mode, mtime).
  sandbox-fs                 ``materialize()`` in-process (default options: sha256 of every file;
                             the walk runs on one thread, the copy on up to ``cpu_count`` worker
                             threads, so on 2 cores it uses both while cp -a uses one).
  sandbox-fs --no-digest     same with ``digest=False`` (fd-to-fd copy_file_range, no hashing).
  sandbox-fs --owner         (with ``--owner``) ``sandbox-fs`` into a workspace Root opened with
                             ``owner=(4000123, 4000123)``: one ``fchown`` per entry made (needs root).

Usage: python bench/bench_materialize.py [--rounds N] [--fs /tmp,/dev/shm] [--owner] [--quick]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sysconfig
import tempfile
import time

import trio
from _rows import emit_row

from sandbox_fs import open_root
from sandbox_fs.manifest import load_manifest
from sandbox_fs.materialize import MaterializeOptions, materialize


def stage(parent: str) -> tuple[str, int, int]:
    """Copy the stdlib (minus site-packages) under ``parent``; returns (base dir, files, bytes)."""
    src = sysconfig.get_paths()["stdlib"]
    base = tempfile.mkdtemp(prefix="sfs-bench-src-", dir=parent)
    shutil.copytree(src, os.path.join(base, "stdlib"), symlinks=True,
                    ignore=lambda d, names: ["site-packages"] if "site-packages" in names else [])
    files = nbytes = 0
    for dirpath, _dirs, fnames in os.walk(os.path.join(base, "stdlib")):
        for n in fnames:
            st = os.lstat(os.path.join(dirpath, n))
            files += 1
            nbytes += st.st_size
    return base, files, nbytes


def run_cp(src: str, dst: str) -> None:
    subprocess.run(["cp", "-a", src, dst], check=True)


def run_copytree(src: str, dst: str) -> None:
    shutil.copytree(src, dst, symlinks=True)


def make_sfs(base: str, digest: bool, owner: tuple[int, int] | None = None):
    manifest = load_manifest({"entries": {"stdlib": {"type": "local_dir", "src": "stdlib"}}})

    def run(_src: str, dst: str) -> None:
        os.mkdir(dst, 0o700)

        async def go() -> None:
            ws = open_root(dst, owner=owner)
            try:
                await materialize(ws, manifest, MaterializeOptions(base_dir=base, digest=digest))
            finally:
                ws.close()

        trio.run(go)

    return run


def _cpu_s() -> float:
    """User + sys seconds of this process and of its waited-for children so far."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def bench_fs(parent: str, rounds: int, owner: bool = False) -> None:
    base, files, nbytes = stage(parent)
    src = os.path.join(base, "stdlib")
    out = tempfile.mkdtemp(prefix="sfs-bench-dst-", dir=parent)
    tools = [("cp -a", run_cp), ("shutil.copytree", run_copytree),
             ("sandbox-fs", make_sfs(base, True)), ("sandbox-fs --no-digest", make_sfs(base, False))]
    if owner:
        tools.append(("sandbox-fs --owner", make_sfs(base, True, (4000123, 4000123))))
    times: dict[str, list[float]] = {name: [] for name, _ in tools}
    cpus: dict[str, list[float]] = {name: [] for name, _ in tools}
    try:
        for r in range(rounds + 1):  # round 0 warms the caches and is not counted
            order = tools[r % len(tools):] + tools[:r % len(tools)]
            for name, fn in order:
                dst = os.path.join(out, "d")
                if os.path.lexists(dst):
                    shutil.rmtree(dst)
                os.sync()
                c0 = _cpu_s()
                t0 = time.perf_counter()
                fn(src, dst)
                dt = time.perf_counter() - t0
                dc = _cpu_s() - c0
                if r:
                    times[name].append(dt)
                    cpus[name].append(dc)
        print(f"\n{parent}: {files} files, {nbytes / 2**20:.1f} MiB, {rounds} rounds (medians, seconds)")
        ref = statistics.median(times["cp -a"])
        ref_cpu = statistics.median(cpus["cp -a"])
        for name, _ in tools:
            med = statistics.median(times[name])
            cpu = statistics.median(cpus[name])
            spread = f"{min(times[name]):.3f}-{max(times[name]):.3f}"
            print(f"  {name:24s} {med:8.3f} s  ({spread})  {med / ref:5.2f}x cp -a"
                  f"   cpu {cpu:6.3f} s  {cpu / ref_cpu:5.2f}x")
            if name.startswith("sandbox-fs"):
                goal = 1.5 if parent.startswith("/dev/shm") else 1.25
                emit_row("materialize", f"local_dir of stdlib ({files} files) on {parent}, wall", name, "cp -a",
                         med / ref, ours=med, anchor_value=ref, goal=goal if name == "sandbox-fs" else None,
                         goal_text=f"<= {goal}x cp -a" if name == "sandbox-fs" else "")
    finally:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fs", default="/tmp,/dev/shm", help="comma separated parent directories")
    ap.add_argument("--owner", action="store_true", help="add a run into a Root with an owner (needs root)")
    ap.add_argument("--quick", action="store_true", help="a short run: 3 rounds on /dev/shm")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.fs = 3, "/dev/shm"
    print(f"load average before: {os.getloadavg()[0]:.2f}, cpus: {os.cpu_count()}")
    for parent in args.fs.split(","):
        if os.path.isdir(parent):
            bench_fs(parent, args.rounds, args.owner)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
