"""FUSE overlay benchmark: direct access vs the overlay's mount, side by side in one run.

The tree: ``--files`` x 1 KiB files (100 per directory) plus one ``--big-mib``
MiB file, made once in a workspace under ``--dir`` (ext4 ``/tmp`` by
default).  The *direct* arm works on that directory itself, the *overlay*
arm on an :class:`~sandbox_fs.fuse.Overlay` serving it (default
:class:`~sandbox_fs.fuse.OverlayPolicy`: 3600 s entry/attr timeouts,
``keep_cache``).  Each measure alternates direct / overlay ``--repeat`` times
(>= 5) and prints the medians, their ratio (overlay / direct), the goal from
issue 13 ("Goals") and whether the overlay met it.

"Cold" passes start after ``sync; echo 3 > /proc/sys/vm/drop_caches`` (root
only; without root they are marked "not cold"), made twice around a wait
for the FUSE daemons to close the fds of the inodes the kernel forgot (see
:func:`drop_caches`: with one drop, the inodes the overlay held stayed warm
for the arm after it).  Dropping caches also makes
the kernel forget the FUSE inodes, so the daemon's handles go too.  Under
each row the report also gives each daemon's CPU seconds per pass (user +
system, from ``/proc/PID/stat``): on a loaded machine the wall times of a
request-per-round-trip workload follow the scheduler more than the work.

Measures: cold ``find | xargs stat``; cold lstat of every path by name;
warm ``find | xargs stat``; repeated lstat by name; cold ``ls -lR``;
sequential read of the big file from the page cache, through the daemon
(the mount's page cache dropped with ``POSIX_FADV_DONTNEED``, the backing
file warm) and cold; write of a big file (1 MiB writes, no fsync); create
of ``--files`` 1 KiB files; cold ``tar -cf - . | cat``; invalidation of every
path (and of everything); and the main job (scripts/main.sh's first
``sandbox-fs run``, with and without ``--overlay``; skipped with a note
where the CLI has no ``--overlay``).

``--floor`` adds two more arms to the rows a plain passthrough can serve
(every row but invalidation and the main job), mounted at temporary
directories over the same tree: a minimal pyfuse3 passthrough
(``bench/_floor_ptfs.py``: no policy, no audit, no ``Root``, the daemon's
pyfuse3 tuning) and libfuse's own ``passthrough_ll`` example in C (built
from ``/usr/share/doc/libfuse3-dev/examples`` with ``gcc``; ``-s``, one
thread like the daemon; ``cache=always``, ``timeout=3600``).  They show the
floor of the stack: what any pyfuse3 daemon, and what the kernel's round
trip itself, cost on this machine in the same run.

External tools reach the mount through ``sh -c 'cd /proc/self/fd/N && ...'``
with the fd passed by ``pass_fds``.  That is a benchmark-only convenience
(the mount is attached nowhere, and product code never walks a magic
link); the direct arm is reached the same way, so both pay the same.

Usage (as root, on an otherwise idle machine)::

    .venv/bin/python bench/bench_fuse.py [--repeat 5] [--files 10000] [--big-mib 256] [--dir /tmp]
                                        [--skip-main] [--only NAME[,NAME...]] [--quick] [--floor]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio
from _rows import emit_row

from sandbox_fs import open_root
from sandbox_fs.fuse import Overlay, OverlayError, OverlayPolicy

MIB = 1 << 20
GIB = 1 << 30
PER_DIR = 100
INVALIDATE_BATCH = 2000
"""Paths per ``invalidate`` call in the batched row (one control message must stay under 256 KiB)."""


# ---------------------------------------------------------------- goals


@dataclass
class Goal:
    """What issue 13 asks of the overlay arm (any bound left None is not asked)."""

    text: str
    max_s: float | None = None
    max_ratio: float | None = None
    min_gibps: float | None = None
    max_ms_per_path: float | None = None

    def check(self, overlay_s: float, ratio: float | None, nbytes: int, npaths: int) -> bool:
        ok = True
        if self.max_s is not None:
            ok &= overlay_s <= self.max_s
        if self.max_ratio is not None and ratio is not None:
            ok &= ratio <= self.max_ratio
        if self.min_gibps is not None:
            ok &= nbytes / GIB / overlay_s >= self.min_gibps
        if self.max_ms_per_path is not None:
            ok &= overlay_s * 1000 / npaths <= self.max_ms_per_path
        return ok


@dataclass
class Row:
    name: str
    goal: Goal
    direct: list[float] = field(default_factory=list)
    overlay: list[float] = field(default_factory=list)
    nbytes: int = 0          # bytes moved per pass (throughput rows)
    npaths: int = 0          # paths per pass (invalidation rows)
    note: str = ""
    floors: dict[str, list[float]] = field(default_factory=dict)   # --floor arms: name -> seconds
    cpu: dict[str, list[float]] = field(default_factory=dict)      # daemon arms: name -> daemon CPU seconds per pass


# ---------------------------------------------------------------- helpers


def drop_caches(daemons: list[int] | tuple[int, ...] = ()) -> bool:
    """sync + drop the page, dentry and inode caches; False when not permitted (not root).

    With FUSE ``daemons`` (pids) that hold an fd per inode the kernel knows
    (the overlay, libfuse's passthrough_ll), one drop is not enough: the
    drop makes the kernel forget the FUSE inodes, but the daemon closes its
    fds only afterwards, so the backing inodes it held survive that drop,
    warm for whichever arm runs next.  So: drop, wait until each daemon's
    fd count has settled (:func:`settle`), drop again.
    """
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        if daemons:
            for pid in daemons:
                settle(pid)
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
    except OSError:
        return False
    return True


def cpu_s(pid: int) -> float:
    """User + system CPU seconds ``pid`` has used so far (0.0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fd_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def settle(pid: int, timeout_s: float = 5.0) -> None:
    """Wait until ``pid``'s open fd count is the same over 50 ms (it processed the kernel's forgets)."""
    deadline = time.monotonic() + timeout_s
    last = fd_count(pid)
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = fd_count(pid)
        if now == last:
            return
        last = now


def sh(dir_fd: int, subdir: str, script: str) -> float:
    """Run ``script`` with ``sh`` in ``subdir`` of the directory ``dir_fd`` is on; wall seconds.

    Benchmark-only: the child reaches the directory through the magic link
    ``/proc/self/fd/N`` of the fd passed to it (the overlay's mount is
    attached nowhere).  Product code never does this.
    """
    t0 = time.perf_counter()
    subprocess.run(["sh", "-c", f"cd /proc/self/fd/{dir_fd}/{subdir} && {script}"], pass_fds=(dir_fd,),
                   check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def file_paths(n: int) -> list[str]:
    return [f"data/files/d{i // PER_DIR:03d}/f{i % PER_DIR:03d}" for i in range(n)]


def lstat_all(dir_fd: int, paths: list[str]) -> float:
    t0 = time.perf_counter()
    for p in paths:
        os.stat(p, dir_fd=dir_fd, follow_symlinks=False)
    return time.perf_counter() - t0


def read_file(dir_fd: int, path: str, fadvise_drop: bool = False) -> float:
    """Read ``path`` sequentially in 1 MiB chunks; wall seconds (from open to close)."""
    buf = bytearray(MIB)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        if fadvise_drop:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        while os.readv(fd, [buf]):
            pass
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def write_file(dir_fd: int, path: str, nbytes: int) -> float:
    chunk = os.urandom(MIB)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, chunk[:min(MIB, left)])
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def create_files(dir_fd: int, top: str, n: int) -> float:
    data = b"c" * 1024
    t0 = time.perf_counter()
    os.mkdir(top, dir_fd=dir_fd)
    for i in range(n):
        fd = os.open(f"{top}/f{i:05d}", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
        os.write(fd, data)
        os.close(fd)
    return time.perf_counter() - t0


def make_tree(ws: str, nfiles: int, big_mib: int) -> None:
    data = b"x" * 1024
    os.makedirs(os.path.join(ws, "data", "files"))
    os.mkdir(os.path.join(ws, "scratch"))
    for i in range(0, nfiles, PER_DIR):
        d = os.path.join(ws, "data", "files", f"d{i // PER_DIR:03d}")
        os.mkdir(d)
        for j in range(min(PER_DIR, nfiles - i)):
            with open(os.path.join(d, f"f{j:03d}"), "wb") as f:
                f.write(data)
    chunk = os.urandom(MIB)
    with open(os.path.join(ws, "data", "big"), "wb") as f:
        for _ in range(big_mib):
            f.write(chunk)


def gibps(nbytes: int, s: float) -> str:
    return f"{nbytes / GIB / s:.2f} GiB/s"


# ---------------------------------------------------------------- the runner


class Bench:
    def __init__(self, args: argparse.Namespace, ws_dir: str, direct_fd: int, overlay: Overlay,
                 floor_fds: dict[str, int] | None = None, floor_pids: dict[str, int] | None = None) -> None:
        self.args = args
        self.ws_dir = ws_dir
        self.fds = {"direct": direct_fd, "overlay": overlay.mount_fd, **(floor_fds or {})}
        self.daemons: list[int] = [overlay.pid, *(floor_pids or {}).values()]
        self.pids: dict[str, int] = {"overlay": overlay.pid, **(floor_pids or {})}
        """The daemon serving each FUSE arm, whose CPU time per pass is reported (robust where wall time is not)."""
        self.overlay = overlay
        self.paths = file_paths(args.files)
        self.big_bytes = args.big_mib * MIB
        self.rows: list[Row] = []
        self.cold_ok = True
        self.seq = 0
        self.failures = 0

    def wanted(self, name: str) -> bool:
        return not self.args.only or any(w in name for w in self.args.only)

    async def pair(self, row: Row, measure: Callable[[int, str], float], *, cold: bool = False,
                   before: Callable[[int, str], object] | None = None, floors: bool = True) -> None:
        """``--repeat`` rounds of (direct, overlay): optional untimed ``before``, optional cache drop, ``measure``.

        ``floors=False`` leaves the ``--floor`` arms out of a row.
        """
        for _ in range(self.args.repeat):
            for arm, fd in self.fds.items():
                if not floors and arm not in ("direct", "overlay"):
                    continue
                if before is not None:
                    await trio.to_thread.run_sync(before, fd, arm)
                if cold and not drop_caches(self.daemons):
                    self.cold_ok = False
                pid = self.pids.get(arm)
                c0 = cpu_s(pid) if pid else 0.0
                s = await trio.to_thread.run_sync(measure, fd, arm)
                if pid:
                    row.cpu.setdefault(arm, []).append(cpu_s(pid) - c0)
                if arm == "direct":
                    row.direct.append(s)
                elif arm == "overlay":
                    row.overlay.append(s)
                else:
                    row.floors.setdefault(arm, []).append(s)
        self.rows.append(row)
        print(f"  {row.name}: direct {statistics.median(row.direct):.4f} s, "
              f"overlay {statistics.median(row.overlay):.4f} s"
              + "".join(f", {k} {statistics.median(v):.4f} s" for k, v in row.floors.items()),
              file=sys.stderr, flush=True)

    def nextname(self, prefix: str, arm: str) -> str:
        self.seq += 1
        return f"scratch/{prefix}-{arm}-{self.seq}"

    async def run(self) -> None:
        a, paths = self.args, self.paths
        n = len(paths)
        find_stat = "find . -type f -print0 | xargs -0 stat > /dev/null"
        if self.wanted("find"):
            await self.pair(Row(f"cold find | xargs stat, {n} files", Goal("<= 0.6 s and <= 3x", 0.6, 3.0)),
                            lambda fd, arm: sh(fd, "data", find_stat), cold=True)
        if self.wanted("lstat"):
            await self.pair(Row(f"cold lstat of {n} paths by name", Goal("<= 1.6 s and <= 6.5x", 1.6, 6.5)),
                            lambda fd, arm: lstat_all(fd, paths), cold=True)
        if self.wanted("find"):
            await self.pair(Row("warm find | xargs stat", Goal("<= 4x", max_ratio=4.0)),
                            lambda fd, arm: sh(fd, "data", find_stat),
                            before=lambda fd, arm: sh(fd, "data", find_stat))
        if self.wanted("lstat"):
            await self.pair(Row("repeated lstat by name", Goal("<= 1.3x", max_ratio=1.3)),
                            lambda fd, arm: lstat_all(fd, paths), before=lambda fd, arm: lstat_all(fd, paths))
        if self.wanted("ls"):
            await self.pair(Row("cold ls -lR", Goal("<= 2.5x", max_ratio=2.5)),
                            lambda fd, arm: sh(fd, "data", "ls -lR . > /dev/null"), cold=True)
        await self.run_data()
        if self.wanted("tar"):
            await self.pair(Row("tar -cf - . | cat, cold", Goal("<= 7.5x", max_ratio=7.5)),
                            lambda fd, arm: sh(fd, "data", "tar -cf - . | cat > /dev/null"), cold=True)
        if self.wanted("invalid"):
            await self.run_invalidation()
        if self.wanted("main") and not a.skip_main:
            await run_main_job(self)
        if self.wanted("invalid"):
            await self.run_invalidation_one_call()

    async def run_data(self) -> None:
        nb = self.big_bytes
        mib = self.args.big_mib
        if self.wanted("read"):
            warm = Row(f"read {mib} MiB, page cache", Goal(">= 2 GiB/s", min_gibps=2.0), nbytes=nb)
            await self.pair(warm, lambda fd, arm: read_file(fd, "data/big"),
                            before=lambda fd, arm: read_file(fd, "data/big"))
            daemon = Row(f"read {mib} MiB, through the daemon", Goal(">= 1 GiB/s", min_gibps=1.0), nbytes=nb,
                         note="overlay: the mount's page cache dropped (fadvise), backing warm; direct: warm")
            await self.pair(daemon, lambda fd, arm: read_file(fd, "data/big", fadvise_drop=arm != "direct"),
                            before=lambda fd, arm: read_file(fd, "data/big"))
            await self.pair(Row(f"read {mib} MiB, cold", Goal("<= 1.6x", max_ratio=1.6), nbytes=nb),
                            lambda fd, arm: read_file(fd, "data/big"), cold=True)
        if self.wanted("write"):
            names: dict[str, str] = {}

            def write(fd: int, arm: str) -> float:
                names[arm] = self.nextname("big", arm)
                s = write_file(fd, names[arm], nb)
                # untimed clean-up (libfuse's passthrough_ll cannot unlink: the floors' files go behind them)
                os.unlink(names[arm], dir_fd=fd if arm in ("direct", "overlay") else self.fds["direct"])
                return s

            await self.pair(Row(f"write {mib} MiB", Goal(">= 0.35 GiB/s and <= 2.5x", max_ratio=2.5,
                                                        min_gibps=0.35), nbytes=nb),
                            write, before=lambda fd, arm: os.sync())
        if self.wanted("create"):
            def create(fd: int, arm: str) -> float:
                top = self.nextname("c", arm)
                s = create_files(fd, top, self.args.files)
                # Untimed: remove them behind the mount and invalidate, so the kernel forgets them and
                # the daemon closes their handles (it holds one fd per inode the kernel knows).
                shutil.rmtree(os.path.join(self.ws_dir, top))
                if arm == "overlay":
                    trio.from_thread.run(self.overlay.invalidate, [top])
                return s

            # no floors: their files are removed behind their mounts, which they cannot be told about
            # (passthrough_ll then failed a close with EBADF)
            await self.pair(Row(f"create {self.args.files} files (1 KiB each)", Goal("<= 9x", max_ratio=9.0)),
                            create, before=lambda fd, arm: os.sync(), floors=False)

    async def run_invalidation(self) -> None:
        # overlay only: the floors have nothing to invalidate
        ov = self.overlay
        fd = self.fds["overlay"]
        calls = -(-len(self.paths) // INVALIDATE_BATCH)
        per_path = Row(f"invalidate {len(self.paths)} paths ({calls} calls)",
                       Goal("<= 1 ms per path; <= 1.5 s for 10k", max_s=1.5 * len(self.paths) / 10_000,
                            max_ms_per_path=1.0), npaths=len(self.paths))
        everything = Row("invalidate everything (all=true)", Goal("(none; for reference)"))
        one = Row("invalidate 1 path x 100 calls, per call", Goal("<= 1 ms per path", max_ms_per_path=1.0),
                  npaths=1)
        for _ in range(self.args.repeat):
            await trio.to_thread.run_sync(lstat_all, fd, self.paths)      # every path known to the daemon
            t0 = time.perf_counter()
            for i in range(0, len(self.paths), INVALIDATE_BATCH):
                await ov.invalidate(self.paths[i:i + INVALIDATE_BATCH])
            per_path.overlay.append(time.perf_counter() - t0)
            await trio.to_thread.run_sync(lstat_all, fd, self.paths)
            t0 = time.perf_counter()
            await ov.invalidate(None)
            everything.overlay.append(time.perf_counter() - t0)
            await trio.to_thread.run_sync(lstat_all, fd, self.paths[:100])
            t0 = time.perf_counter()
            for p in self.paths[:100]:
                await ov.invalidate([p])
            one.overlay.append((time.perf_counter() - t0) / 100)
        self.rows += [per_path, everything, one]

    async def run_invalidation_one_call(self) -> None:
        """All paths in one ``invalidate`` call (last: a failure here may leave the client unusable)."""
        ov = self.overlay
        row = Row(f"invalidate {len(self.paths)} paths (one call)",
                  Goal("<= 1.5 s for 10k", max_s=1.5 * len(self.paths) / 10_000), npaths=len(self.paths))
        await trio.to_thread.run_sync(lstat_all, self.fds["overlay"], self.paths)
        t0 = time.perf_counter()
        try:
            await ov.invalidate(self.paths)
        except OverlayError as exc:
            row.note = f"FAILED after {time.perf_counter() - t0:.3f} s: {exc} (alive={ov.alive})"
            self.failures += 1
        else:
            row.overlay.append(time.perf_counter() - t0)
        self.rows.append(row)


# ---------------------------------------------------------------- the main job


def has_overlay_flag(sfs: str) -> bool:
    out = subprocess.run([sfs, "run", "--help"], capture_output=True, text=True)
    return "--overlay" in out.stdout


def six_sdist(cache: str) -> str | None:
    """scripts/main.sh's sdist (six 1.16.0), downloaded once into ``cache`` by pip; None if unreachable."""
    os.makedirs(cache, exist_ok=True)
    for name in os.listdir(cache):
        if name.startswith("six-") and name.endswith(".tar.gz"):
            return os.path.join(cache, name)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
                    "--no-binary", ":all:", "--no-deps", "-d", cache, "six==1.16.0"],
                   capture_output=True)
    for name in os.listdir(cache):
        if name.startswith("six-") and name.endswith(".tar.gz"):
            return os.path.join(cache, name)
    return None


async def run_main_job(bench: Bench) -> None:
    """scripts/main.sh step 1 (materialize trio + the six sdist, compileall confined, persist), +/- --overlay."""
    row = Row("main job: sandbox-fs run (+ --overlay)", Goal("<= 2x", max_ratio=2.0))
    sfs = os.path.join(os.path.dirname(sys.executable), "sandbox-fs")
    if not os.path.exists(sfs) or not has_overlay_flag(sfs):
        row.note = "skipped: this sandbox-fs has no `run --overlay`"
        bench.rows.append(row)
        return
    base = tempfile.mkdtemp(prefix="main-", dir=bench.args.dir)
    try:
        site = sysconfig.get_paths()["purelib"]
        entries: dict[str, object] = {
            "src/trio": {"type": "local_dir", "src": "trio", "exclude": ["**/__pycache__/**"]},
            "README.txt": {"type": "file", "content": "built by sandbox-fs run\n"},
            "tmp": {"type": "dir", "ephemeral": True},
        }
        grants = ["--grant", f"{sys.base_prefix}:ro"]
        sdist = six_sdist(os.path.join(bench.args.dir, "sfs-bench-cache"))
        if sdist is not None:
            entries["src/six"] = {"type": "archive", "src": sdist, "format": "tar"}
            grants += ["--grant", f"{os.path.dirname(sdist)}:ro"]
        else:
            row.note = "six sdist unavailable (no index): the manifest has no archive entry"
        manifest = os.path.join(base, "manifest.json")
        with open(manifest, "w") as f:
            json.dump({"entries": entries}, f)
        pybin = os.path.realpath(sys.executable)

        def once(arm: str) -> float:
            bench.seq += 1
            run_dir = os.path.join(base, f"{arm}-{bench.seq}")
            os.mkdir(run_dir)
            cmd = [sfs, "run", "--manifest", manifest, "--base", site, *grants,
                   "--workspaces-dir", os.path.join(run_dir, "workspaces"),
                   "--snapshot-dir", os.path.join(run_dir, "snapshots"),
                   "--state", os.path.join(run_dir, "state.json"), "--timeout", "300"]
            if arm == "overlay":
                cmd.append("--overlay")
            cmd += ["--", pybin, "-m", "compileall", "-q", "."]
            t0 = time.perf_counter()
            done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            s = time.perf_counter() - t0
            if done.returncode != 0:
                raise RuntimeError(f"sandbox-fs run ({arm}) exited {done.returncode}: {done.stderr.strip()[-300:]}")
            shutil.rmtree(run_dir, ignore_errors=True)
            return s

        try:
            for _ in range(bench.args.repeat):
                for arm in ("direct", "overlay"):
                    s = await trio.to_thread.run_sync(once, arm)
                    (row.direct if arm == "direct" else row.overlay).append(s)
        except RuntimeError as exc:
            row.direct.clear()
            row.overlay.clear()
            row.note = f"FAILED: {exc}"
            bench.failures += 1
        bench.rows.append(row)
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------- report


def report(rows: list[Row], cold_ok: bool, args: argparse.Namespace) -> int:
    head = f"{'measure':<44} {'direct':>21} {'overlay':>21} {'ratio':>7}  {'goal':<34} result"
    print(head)
    print("-" * len(head))
    failed = 0
    for r in rows:
        if not r.overlay:
            print(f"{r.name:<44} {'-':>21} {'-':>21} {'-':>7}  {r.goal.text:<34} "
                  + ("FAIL" if r.note.startswith("FAILED") else "n/a") + f"  {r.note}")
            continue
        ov = statistics.median(r.overlay)
        di = statistics.median(r.direct) if r.direct else None
        ratio = ov / di if di else None

        def cell(s: float | None) -> str:
            if s is None:
                return "-"
            return f"{s:.3f} s ({gibps(r.nbytes, s)})" if r.nbytes else f"{s * 1000:.3f} ms" if s < 0.01 \
                else f"{s:.3f} s"

        ok = r.goal.check(ov, ratio, r.nbytes, r.npaths or 1)
        has_bound = any(v is not None for v in (r.goal.max_s, r.goal.max_ratio, r.goal.min_gibps,
                                                 r.goal.max_ms_per_path))
        verdict = ("pass" if ok else "FAIL") if has_bound else "-"
        failed += has_bound and not ok
        rat = f"{ratio:.2f}x" if ratio is not None else "-"
        print(f"{r.name:<44} {cell(di):>21} {cell(ov):>21} {rat:>7}  {r.goal.text:<34} {verdict}"
              + (f"  ({r.note})" if r.note else ""))
        for arm, times in r.floors.items():
            fl = statistics.median(times)
            print(f"  {'floor: ' + FLOOR_TEXT.get(arm, arm):<42} {'':>21} {cell(fl):>21} "
                  f"{(f'{fl / di:.2f}x' if di else '-'):>7}  overlay / this floor: {ov / fl:.2f}")
        if r.cpu:
            print(f"  {'daemon CPU per pass (medians)':<42} "
                  + ", ".join(f"{arm} {statistics.median(v):.3f} s" for arm, v in r.cpu.items()))
        if ratio is not None:
            emit_row("fuse", r.name, "overlay", "direct access", ratio, ours=ov, anchor_value=di,
                     goal=r.goal.max_ratio, goal_text=r.goal.text, met=ok if has_bound else None)
    print()
    print(f"medians of {args.repeat}; {args.files} x 1 KiB files + {args.big_mib} MiB under {args.dir}; "
          f"cold = after drop_caches" + ("" if cold_ok else " (NOT cold: drop_caches refused, not root)"))
    return failed


# ---------------------------------------------------------------- floors (--floor)


FLOOR_TEXT = {"floor-py": "minimal pyfuse3 passthrough", "floor-c": "libfuse passthrough_ll (C)"}
LIBFUSE_EXAMPLES = "/usr/share/doc/libfuse3-dev/examples"


def build_passthrough_ll(workdir: str) -> str | None:
    """libfuse's passthrough_ll example compiled into ``workdir``; None (with a note on stderr) when it cannot be."""
    src = os.path.join(LIBFUSE_EXAMPLES, "passthrough_ll.c")
    if not (os.path.exists(src) and shutil.which("gcc") and shutil.which("pkg-config")):
        print("--floor: no libfuse passthrough_ll source or no gcc/pkg-config: C floor skipped", file=sys.stderr)
        return None
    for name in ("passthrough_ll.c", "passthrough_helpers.h"):
        shutil.copy(os.path.join(LIBFUSE_EXAMPLES, name), workdir)
    flags = subprocess.run(["pkg-config", "fuse3", "--cflags", "--libs"], capture_output=True, text=True)
    out = os.path.join(workdir, "passthrough_ll")
    done = subprocess.run(["gcc", "-O2", os.path.join(workdir, "passthrough_ll.c"), *flags.stdout.split(),
                           "-o", out], capture_output=True, text=True)
    if done.returncode != 0:
        print(f"--floor: passthrough_ll did not build: {done.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    return out


def wait_mounted(path: str, proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.ismount(path):
            return True
        time.sleep(0.05)
    return os.path.ismount(path)


class Floors:
    """The ``--floor`` passthroughs of ``ws_dir``, mounted under ``base``; :attr:`fds` holds an O_PATH fd per arm."""

    def __init__(self, ws_dir: str, base: str) -> None:
        self.ws_dir, self.base = ws_dir, base
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.fds: dict[str, int] = {}
        self.pids: dict[str, int] = {}
        """Each floor's daemon pid."""

    def start(self) -> None:
        here = os.path.dirname(os.path.abspath(__file__))
        mnt = os.path.join(self.base, "floor-py")
        os.mkdir(mnt)
        self._start("floor-py", mnt, [sys.executable, os.path.join(here, "_floor_ptfs.py"), self.ws_dir, mnt])
        exe = build_passthrough_ll(self.base)
        if exe is not None:
            mnt = os.path.join(self.base, "floor-c")
            os.mkdir(mnt)
            self._start("floor-c", mnt, [exe, "-f", "-s", "-o", f"source={self.ws_dir},cache=always,"
                                         "timeout=3600,default_permissions,allow_other", mnt])

    def _start(self, arm: str, mnt: str, cmd: list[str]) -> None:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        self.procs.append((mnt, proc))
        if not wait_mounted(mnt, proc):
            print(f"--floor: {arm} did not mount: skipped", file=sys.stderr)
            return
        self.fds[arm] = os.open(mnt, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self.pids[arm] = proc.pid

    def stop(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        for mnt, proc in self.procs:
            if os.path.ismount(mnt):
                if subprocess.run(["umount", mnt], capture_output=True).returncode != 0:
                    subprocess.run(["umount", "-l", mnt], capture_output=True)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()


def daemon_nofile(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/limits") as f:
            for line in f:
                if line.startswith("Max open files"):
                    return line.split()[3]
    except OSError:
        pass
    return "?"


async def amain(args: argparse.Namespace) -> int:
    base = tempfile.mkdtemp(prefix="bench-fuse-", dir=args.dir)
    ws_dir = os.path.join(base, "ws")
    try:
        t0 = time.perf_counter()
        make_tree(ws_dir, args.files, args.big_mib)
        print(f"tree made in {time.perf_counter() - t0:.1f} s", flush=True)
        ws = open_root(ws_dir)
        direct_fd = os.open(ws_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        floors = Floors(ws_dir, base)
        try:
            if args.floor:
                floors.start()
            async with await Overlay.start(ws, policy=OverlayPolicy()) as ov:
                nofile = daemon_nofile(ov.pid)
                bench = Bench(args, ws_dir, direct_fd, ov, floors.fds, floors.pids)
                await bench.run()
                alive = ov.alive
        finally:
            floors.stop()
            os.close(direct_fd)
            ws.close()
        failed = report(bench.rows, bench.cold_ok, args) + bench.failures
        print(f"the daemon's RLIMIT_NOFILE: {nofile} (it holds one O_PATH fd per inode the kernel knows)")
        if not alive:
            print("Overlay.alive is False at the end of the run (after a failed request the client calls the "
                  "daemon gone, see the rows marked FAILED)")
            return 2
        return 1 if failed else 0
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=5, help="rounds per measure (>= 5 for the report)")
    p.add_argument("--files", type=int, default=10_000, help="number of 1 KiB files")
    p.add_argument("--big-mib", type=int, default=256, help="size of the big file, MiB")
    p.add_argument("--dir", default="/tmp", help="where the trees go (default /tmp)")
    p.add_argument("--skip-main", action="store_true", help="skip the main-job row")
    p.add_argument("--only", type=lambda s: [w for w in s.split(",") if w], default=[],
                   help="comma-separated substrings of measure names (find, lstat, ls, read, write, "
                        "create, tar, invalid, main)")
    p.add_argument("--floor", action="store_true",
                   help="also measure a minimal pyfuse3 passthrough and libfuse's passthrough_ll (C) side by side")
    p.add_argument("--quick", action="store_true",
                   help="a short run: 3 rounds, 2,000 files, a 64 MiB big file, no main-job row")
    args = p.parse_args()
    if args.quick:
        args.repeat, args.files, args.big_mib, args.skip_main = 3, 2000, 64, True
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    return trio.run(amain, args)


if __name__ == "__main__":
    sys.exit(main())
