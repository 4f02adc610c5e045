#!/usr/bin/env python3
"""Run every benchmark script and print one table of ratios against the anchors.

Each ``bench/bench_*.py`` is run in turn, in a child process with this
interpreter (so ``sandbox-fs`` and the package are the ones of this venv),
with ``--quick`` passed on when this script has it.  Every script prints,
besides its own report, one ``BENCH-ROW`` JSON line per comparison it makes
(``bench/_rows.py``: ours, the anchor, their medians, the ratio, the goal);
this script collects whatever rows each script prints, so a script adds a
row by printing it, and a new ``bench_*.py`` is picked up by its name.

The anchors are the tools a user would otherwise pick, measured side by side
in the same run by each script: GNU tar (extract), ``tar -c | tar -x``
(snapshot round trip), ``cp -a`` (materialize), tarfile's data filter
(extract), ``os.open`` (``Root.open_fd``), unconfined exec
(``trio.run_process``) and direct access (the FUSE overlay).  A ratio is
ours / anchor: below 1 is faster than the anchor.

Outputs:

* the table on stdout (one row per comparison; scripts that failed or were
  skipped are listed under it with their last line of stderr);
* ``--json`` (default ``bench/results.json``): the rows, each script's exit
  status, wall time and the machine (cpus, load average, kernel, Python);
* ``--chart`` (default ``bench/results.png``): a bar chart of the ratios
  (log scale, 1x marked; green where the goal is met, red where not, grey
  without a goal).  It needs matplotlib, the ``bench`` extra
  (``pip install -e '.[bench]'``); without it the chart is skipped with a
  note and everything else is written.

Usage::

    .venv/bin/python bench/run_all.py [--quick] [--only NAME[,NAME]] [--timeout S]
                                      [--json PATH] [--chart PATH] [--from-json PATH]

``NAME`` is a script's short name (``extract`` for ``bench_extract.py``).
``--from-json`` prints the table and redraws the chart of an earlier run
without running anything.  A script exits with status 77 when this machine
cannot run it (the automake convention for "skipped": no audit, no FUSE);
it is listed as skipped.  Exit status: 0 when every script ran or was
skipped, 1 when one failed or timed out (its rows, if any, are kept).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _rows import parse_rows  # noqa: E402

#: the exit status of a script this machine cannot run (automake's "skipped")
SKIPPED = 77


def scripts(only: set[str]) -> list[tuple[str, str]]:
    """(short name, path) of every ``bench_*.py`` beside this file, sorted; ``only`` filters by short name."""
    out = []
    for path in sorted(glob.glob(os.path.join(HERE, "bench_*.py"))):
        name = os.path.basename(path)[len("bench_"):-len(".py")]
        if not only or name in only:
            out.append((name, path))
    return out


def run_script(name: str, path: str, quick: bool, timeout_s: float) -> dict[str, Any]:
    """Run one script; its stdout and stderr pass through to ours, prefixed; return its record and rows."""
    argv = [sys.executable, path] + (["--quick"] if quick else [])
    print(f"== {name}: {' '.join(os.path.relpath(a) if a == path else a for a in argv)}", flush=True)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=os.path.dirname(HERE))
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc = None
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or ""))
        err += f"\ntimed out after {timeout_s:g} s"
    seconds = time.monotonic() - t0
    for line in out.splitlines():
        if not line.startswith("BENCH-ROW "):
            print(f"   {line}")
    rows = parse_rows(out)
    last_err = next((ln for ln in reversed(err.splitlines()) if ln.strip()), "")
    state = "skipped" if rc == SKIPPED else f"exit {rc}"
    print(f"   -> {state}, {seconds:.0f} s, {len(rows)} rows" + (f"; stderr: {last_err}" if rc else ""),
          flush=True)
    return {"name": name, "argv": [os.path.relpath(path, os.path.dirname(HERE))] + argv[2:], "exit_status": rc, "seconds": round(seconds, 1), "rows": rows,
            "last_stderr_line": last_err if rc else ""}


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()],
            "kernel": platform.release(), "python": platform.python_version()}


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "s":
        return f"{value:.3f} s"
    return f"{value:.1f} {unit}" if value < 1e5 else f"{value:.3g} {unit}"


def table(results: dict[str, Any]) -> str:
    """The one table: a row per comparison, then the scripts that gave none or failed."""
    head = ("bench", "case", "ours", "anchor", "ours median", "anchor median", "ratio", "goal", "met")
    lines: list[tuple[str, ...]] = []
    for rec in results["scripts"]:
        for r in rec["rows"]:
            ratio = f"{r['ratio']:.2f}x" if r.get("ratio") is not None else "-"
            met = {True: "yes", False: "NO", None: "-"}[r.get("met")]
            lines.append((r["bench"], r["case"], r["tool"], r["anchor"], fmt(r.get("ours"), r.get("unit", "s")),
                          fmt(r.get("anchor_value"), r.get("unit", "s")), ratio, r.get("goal_text") or "-", met))
    widths = [max(len(h), *(len(ln[i]) for ln in lines)) if lines else len(h) for i, h in enumerate(head)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(ln, widths)) for ln in lines]
    for rec in results["scripts"]:
        if rec["exit_status"] != 0 or not rec["rows"]:
            why = rec["last_stderr_line"] or ("no BENCH-ROW lines" if rec["exit_status"] == 0 else "")
            state = "skipped" if rec["exit_status"] == SKIPPED else f"exit {rec['exit_status']}"
            out.append(f"({rec['name']}: {state}, {len(rec['rows'])} rows: {why})")
    out.append(f"mode: {results['mode']}; {results['machine']['cpus']} cpus, load average at start "
               f"{results['machine']['load_average'][0]}; ratio = ours / anchor, medians measured side by side")
    return "\n".join(out)


def chart(results: dict[str, Any], path: str) -> str:
    """Draw the ratios as horizontal bars into ``path``; return a note saying what was done."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return "chart skipped: matplotlib is not installed (pip install -e '.[bench]')"
    rows = [r for rec in results["scripts"] for r in rec["rows"] if r.get("ratio")]
    if not rows:
        return "chart skipped: no rows"
    labels = [f"{r['bench']}: {r['case']} — {r['tool']} vs {r['anchor']}" for r in rows]
    colors = ["#2e7d32" if r.get("met") else "#c62828" if r.get("met") is False else "#757575" for r in rows]
    fig, ax = plt.subplots(figsize=(15, 0.32 * len(rows) + 1.6))
    y = list(range(len(rows)))[::-1]
    ax.barh(y, [r["ratio"] for r in rows], color=colors)
    ax.set_yticks(y, labels, fontsize=7)
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linewidth=0.8)
    for yi, r in zip(y, rows):
        ax.text(r["ratio"], yi, f" {r['ratio']:.2f}x", va="center", fontsize=6)
    ax.set_xlabel("ratio ours / anchor (log scale; < 1 is faster than the anchor)")
    ax.set_title(f"sandbox-fs benchmarks ({results['mode']} run, {results['generated'][:16]} UTC): "
                 "green goal met, red not met, grey no goal", fontsize=9)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return f"chart written to {os.path.relpath(path)}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="pass --quick to every script (a short run)")
    ap.add_argument("--only", default="", help="comma-separated short names (extract, snapshot, ...)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per script before it is stopped")
    ap.add_argument("--json", default=os.path.join(HERE, "results.json"), help="where the results go")
    ap.add_argument("--chart", default=os.path.join(HERE, "results.png"), help="where the PNG goes ('' for none)")
    ap.add_argument("--from-json", help="print the table and draw the chart of an earlier results file")
    args = ap.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)
    else:
        only = {w for w in args.only.split(",") if w}
        found = scripts(only)
        if only - {n for n, _ in found}:
            ap.error(f"no bench script named {sorted(only - {n for n, _ in found})}")
        results = {"generated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "mode": "quick" if args.quick else "full", "machine": machine(), "scripts": []}
        for name, path in found:
            results["scripts"].append(run_script(name, path, args.quick, args.timeout))
        results["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")
    print()
    print(table(results))
    if args.chart:
        print(chart(results, args.chart))
    return 0 if all(rec["exit_status"] in (0, SKIPPED) for rec in results["scripts"]) else 1


if __name__ == "__main__":
    sys.exit(main())
