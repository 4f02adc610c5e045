#!/usr/bin/env python3
"""Benchmark: the ``sandbox-fs`` command line, start-up included, against ``python -c pass``,
GNU tar and ``cp -a``, everything on tmpfs (``/dev/shm``).

Each case runs ``--rounds`` times (at least 9), the tools alternating, each
run a fresh process writing into a fresh empty directory; printed per case:
the median wall time of each tool (and its CPU time, user + sys of the child,
steadier on a shared machine), the ratio to the reference, and the goal.

Cases (goals from issue 12):

* ``--version``: ``sandbox-fs --version`` vs ``python -c pass`` (goal <= 80 ms);
* ``extract 1 file``: ``sandbox-fs extract`` of a one-file tar vs ``tar -xf`` (goal <= 150 ms);
* ``extract stdlib``: this Python's standard library folder without
  site-packages (~8k members), tarred with GNU tar (goal <= 2.5x GNU tar);
* ``extract stdlib+site``: the whole folder with site-packages (~50k members)
  (goal <= 2.5x GNU tar);
* ``apply local_dir``: ``sandbox-fs apply`` of a manifest with one
  ``local_dir`` of the whole folder (digests on, the default) vs ``cp -a``
  (goal <= 1.5x).

Usage: ``python bench/bench_cli.py [--rounds N] [--dir /dev/shm] [--only NAME[,NAME]] [--quick]``
(NAME: version, one, stdlib, site, apply).  Run it with the venv's python, so
``sandbox-fs`` is the console script next to it.
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

from _rows import emit_row


def sandbox_fs_cmd() -> list[str]:
    """The ``sandbox-fs`` console script next to this Python, else ``python -m sandbox_fs``."""
    script = os.path.join(os.path.dirname(sys.executable), "sandbox-fs")
    return [script] if os.access(script, os.X_OK) else [sys.executable, "-m", "sandbox_fs"]


# As installed: byte code is written and then read (PYTHONDONTWRITEBYTECODE would make every
# run compile the package's modules again, ~40 ms); each tool runs once unmeasured first.
CHILD_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def timed(argv: list[str]) -> tuple[float, float]:
    """Run ``argv`` (output discarded; a failure stops the bench): (wall s, child cpu s)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=CHILD_ENV)
    _pid, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read() if proc.stderr else b""
    if proc.returncode != 0:
        raise SystemExit(f"bench: {argv} failed ({proc.returncode}): {err.decode(errors='replace')[-400:]}")
    return wall, usage.ru_utime + usage.ru_stime


class Case:
    """One comparison: tools run alternately, each run given a fresh empty output directory."""

    def __init__(self, name: str, tools: dict[str, list[str]], reference: str, goal: str,
                 goal_ratio: float | None = None, goal_s: float | None = None) -> None:
        self.name, self.tools, self.reference = name, tools, reference
        self.goal, self.goal_ratio, self.goal_s = goal, goal_ratio, goal_s

    def run(self, rounds: int, scratch: str) -> None:
        walls: dict[str, list[float]] = {t: [] for t in self.tools}
        cpus: dict[str, list[float]] = {t: [] for t in self.tools}
        for i in range(-1, rounds):  # round -1 warms up (byte code, page cache), not counted
            for tool, argv in self.tools.items():
                out = os.path.join(scratch, "out-" + "".join(c if c.isalnum() else "-" for c in tool) + f"-{i}")
                wall, cpu = timed([a.replace("{out}", out) for a in argv])
                if i >= 0:
                    walls[tool].append(wall)
                    cpus[tool].append(cpu)
                shutil.rmtree(out, ignore_errors=True)
        ref = statistics.median(walls[self.reference])
        print(f"{self.name} ({rounds} runs, medians; goal {self.goal})")
        for tool in self.tools:
            w, c = statistics.median(walls[tool]), statistics.median(cpus[tool])
            print(f"  {tool:<22} wall {w * 1000:9.1f} ms  cpu {c * 1000:9.1f} ms  "
                  f"x{w / ref:5.2f} of {self.reference}")
        ours = next(iter(self.tools))
        main = statistics.median(walls[ours])
        met = ((self.goal_ratio is None or main / ref <= self.goal_ratio)
               and (self.goal_s is None or main <= self.goal_s))
        print(f"  goal {'met' if met else 'NOT met'}")
        emit_row("cli", self.name, ours, self.reference, main / ref, ours=main * 1000, anchor_value=ref * 1000,
                 unit="ms", goal=self.goal_ratio, goal_text=self.goal, met=met)


def make_tar(tar: str, parent: str, name: str, *, exclude: str | None = None) -> int:
    """GNU-tar ``parent/name`` into ``tar``; returns its member count."""
    argv = ["tar", "-cf", tar, "-C", parent]
    if exclude:
        argv += [f"--exclude={exclude}"]
    subprocess.run([*argv, name], check=True, stderr=subprocess.DEVNULL)
    return int(subprocess.run(f"tar -tf {tar} | wc -l", shell=True, check=True,
                              capture_output=True).stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--dir", default="/dev/shm", help="tmpfs directory for the archives and outputs")
    ap.add_argument("--only", default="version,one,stdlib,site,apply")
    ap.add_argument("--quick", action="store_true", help="a short run: version, one, stdlib (9 rounds)")
    opts = ap.parse_args()
    if opts.quick:
        opts.rounds, opts.only = 9, "version,one,stdlib"
    if opts.rounds < 9:
        ap.error("--rounds must be at least 9 (medians of at least 9 runs)")
    only = set(opts.only.split(","))
    sfs = sandbox_fs_cmd()
    stdlib = sysconfig.get_paths()["stdlib"]
    parent, name = os.path.split(stdlib.rstrip("/"))
    print(f"python {sys.version.split()[0]}  sandbox-fs: {' '.join(sfs)}  stdlib: {stdlib}")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(dir=opts.dir, prefix="bench-cli-") as tmp:
        cases = []
        if "version" in only:
            cases.append(Case("sandbox-fs --version", {"sandbox-fs --version": [*sfs, "--version"],
                                                       "python -c pass": [sys.executable, "-c", "pass"]},
                              "python -c pass", "<= 80 ms", goal_s=0.080))
        if "one" in only:
            one = os.path.join(tmp, "one")
            os.mkdir(one)
            with open(os.path.join(one, "hello.txt"), "w") as f:
                f.write("hello\n")
            make_tar(os.path.join(tmp, "one.tar"), tmp, "one")
            cases.append(Case("extract a one-file tar",
                              {"sandbox-fs extract": [*sfs, "extract", f"{tmp}/one.tar", "--into", "{out}"],
                               "gnu tar": ["sh", "-c", f"mkdir {{out}} && tar -xf {tmp}/one.tar -C {{out}}"]},
                              "gnu tar", "<= 150 ms", goal_s=0.150))
        for key, label, exclude in (("stdlib", "stdlib", "site-packages"), ("site", "stdlib+site-packages", None)):
            if key not in only:
                continue
            tar = os.path.join(tmp, f"{key}.tar")
            members = make_tar(tar, parent, name, exclude=exclude)
            print(f"{label}: {members} members, {os.path.getsize(tar) >> 20} MiB")
            cases.append(Case(f"extract {label} ({members} members)",
                              {"sandbox-fs extract": [*sfs, "extract", tar, "--into", "{out}"],
                               "gnu tar": ["sh", "-c", f"mkdir {{out}} && tar -xf {tar} -C {{out}}"]},
                              "gnu tar", "<= 2.5x GNU tar", goal_ratio=2.5))
        if "apply" in only:
            src = os.path.join(tmp, "src")
            os.mkdir(src)
            subprocess.run(["tar", "-xf", make_tar_cached(tmp, parent, name), "-C", src], check=True)
            files = sum(len(f) for _d, _s, f in os.walk(src))
            manifest = os.path.join(tmp, "apply.json")
            with open(manifest, "w") as f:
                json.dump({"entries": {"tree": {"type": "local_dir", "src": name, "symlinks": "skip",
                                                "special_files": "skip"}}}, f)
            cases.append(Case(f"apply local_dir ({files} files)",
                              {"sandbox-fs apply": [*sfs, "apply", manifest, "--base", src, "--root", "{out}"],
                               "cp -a": ["cp", "-a", f"{src}/{name}", "{out}"]},
                              "cp -a", "<= 1.5x cp -a", goal_ratio=1.5))
        for case in cases:
            case.run(opts.rounds, tmp)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


def make_tar_cached(tmp: str, parent: str, name: str) -> str:
    """The tar of the whole folder (made for ``site`` already, or now)."""
    tar = os.path.join(tmp, "site.tar")
    if not os.path.exists(tar):
        make_tar(tar, parent, name)
    return tar


if __name__ == "__main__":
    sys.exit(main())
