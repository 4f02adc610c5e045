"""Helpers of the acceptance cases (imported by the test modules beside it)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path


def cli() -> list[str]:
    """The ``sandbox-fs`` command of this environment."""
    exe = Path(sys.executable).with_name("sandbox-fs")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "sandbox_fs"]


def run_cli(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """Run ``sandbox-fs ARGS``; assert the command-line contract (no traceback, one line on refusal)."""
    out = subprocess.run(cli() + list(args), capture_output=True, text=True, timeout=timeout_s)
    assert "Traceback" not in out.stderr, out.stderr
    if out.returncode != 0:
        assert len(out.stderr.strip().splitlines()) == 1, f"{shlex.join(args)}: {out.stderr!r}"
    return out
