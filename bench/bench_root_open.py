"""ns per Root.open_fd + close of a 3-deep path vs os.open + close of the same
absolute host path, alternating in one run, medians over rounds.

    python bench/bench_root_open.py [--n 2000] [--rounds 101] [--quick]

Rounds are short and alternate (plain, ours, plain, ours ...) so both sides
share the machine's noise; prints one line per resolver: the median ns of
each side and the median of the per-round ratios (goal: <= 1.5x for openat2).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _rows import emit_row  # noqa: E402

import sandbox_fs  # noqa: E402


def per_op_ns(fn, n: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - t0) / n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=101)
    ap.add_argument("--quick", action="store_true", help="a short run: 21 rounds of 1000")
    args = ap.parse_args()
    if args.quick:
        args.n, args.rounds = 1000, 21
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        os.makedirs(os.path.join(d, "a", "b"))
        target = os.path.join(d, "a", "b", "c.txt")
        with open(target, "w") as f:
            f.write("x")
        for resolver in ("openat2", "fallback"):
            os.environ["SANDBOX_FS_RESOLVER"] = resolver
            with sandbox_fs.open_root(d) as root:
                def ours():
                    os.close(root.open_fd("a/b/c.txt"))

                def plain():
                    os.close(os.open(target, os.O_RDONLY | os.O_CLOEXEC))

                from sandbox_fs import _native

                lib, rootfd, fb = _native.lib, root.fileno_dup(), int(resolver == "fallback")
                res = _native.RESOLVE_BENEATH | _native.RESOLVE_NO_MAGICLINKS

                def floor():  # the native call alone: resolution + special-file check, no Python layer
                    os.close(lib.sfs_open_file(rootfd, b"a/b/c.txt", os.O_RDONLY, 0, res, fb, 0))

                ours_t, plain_t, floor_t = [], [], []
                for _ in range(args.rounds):  # alternate to share the machine's noise
                    plain_t.append(per_op_ns(plain, args.n))
                    ours_t.append(per_op_ns(ours, args.n))
                    floor_t.append(per_op_ns(floor, args.n))
                os.close(rootfd)
                mo, mp = statistics.median(ours_t), statistics.median(plain_t)
                ratio = statistics.median(o / p for o, p in zip(ours_t, plain_t))
                print(f"{resolver:9s} Root.open_fd+close {mo:8.0f} ns   os.open+close {mp:8.0f} ns   "
                      f"ratio {ratio:.2f}x  (median of {args.rounds} alternating rounds x {args.n}); "
                      f"native call alone {statistics.median(f / p for f, p in zip(floor_t, plain_t)):.2f}x",
                      flush=True)
                emit_row("root_open", f"open+close of a 3-deep path ({resolver})", "Root.open_fd", "os.open", ratio,
                         ours=mo, anchor_value=mp, unit="ns", goal=1.5 if resolver == "openat2" else None,
                         goal_text="<= 1.5x" if resolver == "openat2" else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
