"""The contract bench/run_all.py relies on: every bench script takes --quick and prints BENCH-ROW lines.

No benchmark is run here (speed targets live in bench/, never in timed tests);
the scripts are checked as text, and the row format round-trips.
"""

from __future__ import annotations

import ast
import contextlib
import io
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(BENCH.glob("bench_*.py"))


@pytest.fixture
def rows_module(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import _rows

    return _rows


def test_there_are_bench_scripts():
    assert len(SCRIPTS) >= 9, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_each_script_takes_quick_and_emits_rows(script):
    text = script.read_text()
    ast.parse(text)
    assert "--quick" in text, f"{script.name}: run_all.py passes --quick to every script"
    assert "emit_row(" in text, f"{script.name}: prints no BENCH-ROW line, so run_all.py shows none of it"


def test_emit_then_parse_round_trips(rows_module):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print("a human line")
        rows_module.emit_row("x", "case", "ours", "GNU tar", 1.5, ours=3.0, anchor_value=2.0, goal=2.0)
        rows_module.emit_row("x", "nan", "ours", "cp -a", float("nan"))
        print("BENCH-ROW {not json")
    rows = rows_module.parse_rows(out.getvalue())
    assert [r["case"] for r in rows] == ["case", "nan"]
    assert rows[0]["met"] is True and rows[0]["ratio"] == 1.5 and rows[0]["anchor"] == "GNU tar"
    assert rows[1]["ratio"] is None and rows[1]["met"] is None


def test_run_all_table_lists_rows_and_skipped_scripts(rows_module, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import run_all

    results = {"mode": "quick", "machine": {"cpus": 2, "load_average": [1.0]}, "scripts": [
        {"name": "a", "exit_status": 0, "last_stderr_line": "", "rows": [
            {"bench": "a", "case": "c1", "tool": "t", "anchor": "os.open", "ratio": 2.0, "ours": 2.0,
             "anchor_value": 1.0, "unit": "ns", "goal": 1.5, "goal_text": "<= 1.5x", "met": False}]},
        {"name": "b", "exit_status": run_all.SKIPPED, "last_stderr_line": "audit is off", "rows": []}]}
    text = run_all.table(results)
    assert "c1" in text and "2.00x" in text and "NO" in text
    assert "(b: skipped, 0 rows: audit is off)" in text
