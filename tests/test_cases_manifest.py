"""The shared attack corpus (../shared/cases), manifest kind, through ``sandbox-fs apply``.

Each case of kind ``manifest`` is one test: the corpus runner builds the
trusted base (planted symlinks, FIFOs, hard links), the outside sentinel
tree and the payload, runs the command, and checks that nothing outside
``dest/`` changed, nothing escaped or leaked into ``dest/``, and that a
``reject`` case exited non-zero with a message and without a traceback.
Each case also runs with ``--no-precreate-dest`` (the workspace directory
is created by ``apply``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CORPUS = (REPO / ".." / "shared" / "cases").resolve()
RUNNER = CORPUS / "run_cases.py"


def _manifest_cases() -> list[str]:
    if not (CORPUS / "index.json").is_file() or not RUNNER.is_file():
        return []
    return sorted(c["id"] for c in json.loads((CORPUS / "index.json").read_text()) if c.get("kind") == "manifest")


CASES = _manifest_cases()
APPLY = f"{sys.executable} -m sandbox_fs apply {{manifest}} --base {{base}}"


@pytest.mark.skipif(not CASES, reason=f"attack corpus not found at {CORPUS} (needs ../shared/cases next to the repo)")
@pytest.mark.parametrize("precreate", [True, False], ids=["dest", "no-dest"])
@pytest.mark.parametrize("case_id", CASES or ["none"])
def test_manifest_attack_case(case_id, precreate, tmp_path):
    cmd = [sys.executable, str(RUNNER), str(CORPUS), "--apply-cmd", APPLY, "--kinds", "manifest",
           "--only", case_id, "--work-dir", str(tmp_path), "--timeout", "60"]
    if not precreate:
        cmd.append("--no-precreate-dest")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert f"PASS {case_id}" in out, out[-3000:]
    assert "1 passed, 0 failed" in out, out[-3000:]
    assert proc.returncode == 0, out[-3000:]


def test_corpus_lists_the_manifest_cases():
    if not CASES:
        pytest.skip(f"attack corpus not found at {CORPUS}")
    assert len(CASES) >= 5
