"""Every tar and zip case of the shared attack corpus, through the CLI, one test each.

The corpus lives beside the repository (``../shared/cases``; in CI a read-only
copy beside the clone).  Each test runs the corpus' own ``run_cases.py`` with
``--only <id>`` so the runner's checks (outside tree unchanged, no escaping
symlink, no special/setuid node, no secret in dest) are the ones applied.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CORPUS = (REPO.parent / "shared" / "cases").resolve()
RUNNER = CORPUS / "run_cases.py"


def _cases() -> list[str]:
    try:
        index = json.loads((CORPUS / "index.json").read_text())
    except OSError:
        return []
    return [c["id"] for c in index if c["kind"] in ("tar", "zip")]


CASES = _cases()
pytestmark = pytest.mark.skipif(not RUNNER.exists(), reason=f"shared attack corpus not found at {CORPUS}")


def _cli() -> str:
    exe = Path(sys.executable).with_name("sandbox-fs")
    if exe.exists():
        return shlex.quote(str(exe))
    return f"{shlex.quote(sys.executable)} -m sandbox_fs"


def test_corpus_has_the_13_archive_cases():
    assert len(CASES) == 13, CASES


@pytest.mark.parametrize("case", CASES or ["<none>"])
def test_case(case, tmp_path):
    if case == "<none>":
        pytest.skip("no cases")
    cmd = [sys.executable, str(RUNNER), str(CORPUS), "--extract-cmd", f"{_cli()} extract {{archive}} --into {{dest}}",
           "--only", case, "--work-dir", str(tmp_path), "--timeout", "120"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": ""})
    lines = out.stdout.strip().splitlines()
    assert any(line.startswith(f"PASS {case}") for line in lines), out.stdout + out.stderr
    assert lines[-1] == "1 passed, 0 failed", out.stdout
