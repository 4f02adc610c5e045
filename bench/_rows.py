"""The machine-readable result line every bench script prints, read by ``bench/run_all.py``.

A bench script keeps its human-readable output and, for each comparison it
makes, also calls :func:`emit_row`, which prints one line::

    BENCH-ROW {"bench": "extract", "case": "...", "tool": "...", "anchor": "GNU tar", ...}

``run_all.py`` collects every such line from every script's stdout, so a new
row is added by calling :func:`emit_row` in the script (no table to edit).

Fields (JSON object on one line):

* ``bench``: the script's short name (``extract`` for ``bench_extract.py``);
* ``case``: what was measured (``"stdlib on /dev/shm, wall"``);
* ``tool``: our side (``"sandbox-fs extract"``); ``anchor``: the tool it is
  compared with (``"GNU tar"``, ``"cp -a"``, ``"os.open"``, ``"direct"``);
* ``ours``, ``anchor_value``: the two medians, in ``unit`` (``"s"``, ``"ms"``,
  ``"ns"``, ``"MiB"``); either may be ``null`` when the script only has a ratio;
* ``ratio``: ours / anchor (lower is better for times);
* ``goal``: the goal as a ratio where there is one (``null`` otherwise), and
  ``goal_text`` the goal as the script states it; ``met``: true, false or null.
"""

from __future__ import annotations

import json
import math
from typing import Any

PREFIX = "BENCH-ROW "


def emit_row(bench: str, case: str, tool: str, anchor: str, ratio: float, *, ours: float | None = None,
             anchor_value: float | None = None, unit: str = "s", goal: float | None = None, goal_text: str = "",
             met: bool | None = None) -> dict[str, Any]:
    """Print one ``BENCH-ROW`` line on stdout (flushed) and return the row.

    Args:
        bench: the script's short name; case: what was measured; tool: our side; anchor: the reference.
        ratio: ours / anchor (a float; nan or inf are written as ``null``).
        ours, anchor_value: the medians compared, in ``unit``.
        goal: the goal as a ratio (``ratio <= goal`` is met), or None; goal_text: the goal in words.
        met: whether the goal was met; None computes it from ``goal`` (None without a goal).
    """
    if met is None and goal is not None and math.isfinite(ratio):
        met = ratio <= goal

    def num(x: float | None) -> float | None:
        return float(x) if x is not None and math.isfinite(x) else None

    row = {"bench": bench, "case": case, "tool": tool, "anchor": anchor, "ratio": num(ratio), "ours": num(ours),
           "anchor_value": num(anchor_value), "unit": unit, "goal": goal, "goal_text": goal_text, "met": met}
    print(PREFIX + json.dumps(row), flush=True)
    return row


def parse_rows(text: str) -> list[dict[str, Any]]:
    """Every ``BENCH-ROW`` object in ``text`` (a script's stdout); other lines are ignored."""
    out = []
    for line in text.splitlines():
        if line.startswith(PREFIX):
            try:
                row = json.loads(line[len(PREFIX):])
            except ValueError:
                continue
            if isinstance(row, dict):
                out.append(row)
    return out
