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
  confined-nomnt  the same without the read-only mount layer
  confined-none   confinement="none" (helper: setsid, rlimits, fds, cgroup)
  one-shot        run_confined without a supervisor (makes and removes a
                  private cgroup tree per call)

Usage: python bench/bench_exec.py [N]   (default N = 200)
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import trio

from sandbox_fs import open_root
from sandbox_fs.exec import ConfinementPolicy, ProcessSupervisor, run_confined


async def main(n: int) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-exec-") as tmp:
        ws = open_root(tmp)
        sup = ProcessSupervisor()
        nomnt = ConfinementPolicy(read_only_mounts=False)

        async def baseline() -> None:
            await trio.run_process(["true"])

        async def baseline_capture() -> None:
            await trio.run_process(["true"], capture_stdout=True, capture_stderr=True)

        async def confined() -> None:
            await run_confined(["true"], workspace=ws, workspace_host_path=tmp, supervisor=sup)

        async def confined_nomnt() -> None:
            await run_confined(["true"], workspace=ws, workspace_host_path=tmp, supervisor=sup, policy=nomnt)

        async def confined_none() -> None:
            await run_confined(["true"], workspace=ws, workspace_host_path=tmp, supervisor=sup, confinement="none")

        async def one_shot() -> None:
            await run_confined(["true"], workspace=ws, workspace_host_path=tmp)

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
                                   "confined": confined})
        breakdown = await measure({"baseline": baseline, "confined-nomnt": confined_nomnt,
                                   "confined-none": confined_none, "one-shot": one_shot})
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
    conf = statistics.median(main_pair["confined"])
    for base_name in ("baseline", "baseline-capture"):
        delta = (conf - statistics.median(main_pair[base_name])) * 1e3
        print(f"goal confined <= {base_name} + 5 ms: {'met' if delta <= 5 else 'NOT met'} ({delta:+.2f} ms)")


if __name__ == "__main__":
    trio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 200)
