"""Cost of violation reports (ConfinementPolicy.report_violations).

    python bench/bench_violations.py [N] [--quick]   (N = 10, 3 with --quick)

Root, Landlock ABI >= 7 and audit enabled (``auditctl -e 1``, or
``sandbox_fs.exec._violations.enable_audit()``).  Alternates, N rounds:

  true            run_confined(["true"]) without and with reporting
  denied-10k      a shell loop of 10,000 opens of a file outside the workspace
                  (each refused by Landlock), without and with reporting

The runs use identity="host" without the mount layer (Landlock is then the
refusing layer, as in tests/test_exec_violations.py).  Prints the medians and
what the reporting run kept/dropped.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import trio
from _rows import emit_row

from sandbox_fs import open_root
from sandbox_fs.exec import ConfinementPolicy, ProcessSupervisor, run_confined
from sandbox_fs.exec._violations import audit_enabled


async def main(n: int) -> None:
    if not audit_enabled():
        print("audit is off: enable it first (auditctl -e 1); this bench never does", file=sys.stderr)
        sys.exit(77)  # skipped (bench/run_all.py lists it as such)
    with tempfile.TemporaryDirectory(prefix="bench-viol-") as tmp:
        ws_path = os.path.join(tmp, "ws")
        os.mkdir(ws_path)
        secret = os.path.join(tmp, "secret")
        with open(secret, "w") as f:
            f.write("s")
        ws = open_root(ws_path)
        sup = ProcessSupervisor()
        off = ConfinementPolicy(identity="host", read_only_mounts=False)
        on = ConfinementPolicy(identity="host", read_only_mounts=False, report_violations=True)
        loop = f"i=0; while [ $i -lt 10000 ]; do true < {secret}; i=$((i+1)); done 2>/dev/null"
        times: dict[str, list[float]] = {}
        last = None
        for _ in range(n):
            for name, argv, pol in (("true/off", ["true"], off), ("true/on", ["true"], on),
                                    ("denied-10k/off", ["sh", "-c", loop], off),
                                    ("denied-10k/on", ["sh", "-c", loop], on)):
                t = time.perf_counter()
                r = await run_confined(argv, workspace=ws, workspace_host_path=ws_path, supervisor=sup, policy=pol)
                times.setdefault(name, []).append(time.perf_counter() - t)
                if name == "denied-10k/on":
                    last = r
        await sup.aclose()
        ws.close()
    print(f"violation reports, n={n} per variant, alternating; load avg {os.getloadavg()[0]:.2f}")
    for name, ts in times.items():
        print(f"  {name:16s} median {statistics.median(ts) * 1e3:8.2f} ms  min {min(ts) * 1e3:8.2f} ms")
    for name in ("true", "denied-10k"):
        on_s, off_s = statistics.median(times[name + "/on"]), statistics.median(times[name + "/off"])
        emit_row("violations", f"run_confined {name}", "report_violations=True", "reporting off", on_s / off_s,
                 ours=on_s * 1e3, anchor_value=off_s * 1e3, unit="ms")
    if last is not None:
        print(f"  denied-10k/on kept {len(last.violations)} dropped {last.violations_dropped}")


if __name__ == "__main__":
    numbers = [int(a) for a in sys.argv[1:] if a.isdigit()]
    trio.run(main, numbers[0] if numbers else 3 if "--quick" in sys.argv[1:] else 10)
