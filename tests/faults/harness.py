"""Test-side harness of the fault suite: the shim's build, the worker process, the tally.

The shim (``shim.c``) is compiled once per session with ``gcc -Wall -Wextra
-Werror`` into a temporary directory; :class:`WorkerProcess` starts
``worker.py`` with it in ``LD_PRELOAD`` and sends it JSON commands.
:data:`TALLY` counts, per fault kind, the faults injected and the ones the
library survived (every invariant held); the test modules print it at the
end of the session.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SHIM_CLASSES = {"read": 1, "write": 2, "fsync": 4, "rename": 8, "open": 16, "names": 32}
ALL_CLASSES = 63

TALLY: dict[str, list[int]] = {}
"""fault kind -> [injected, survived]."""


def record(kind: str, injected: int, survived: int) -> None:
    t = TALLY.setdefault(kind, [0, 0])
    t[0] += injected
    t[1] += survived


def summary() -> str:
    inj = sum(v[0] for v in TALLY.values())
    ok = sum(v[1] for v in TALLY.values())
    parts = ", ".join(f"{k} {v[1]}/{v[0]}" for k, v in sorted(TALLY.items()))
    return f"fault suite: {ok} of {inj} injected faults survived ({parts})"


def print_summary(config: Any) -> None:
    """Print :func:`summary` past pytest's output capture (shown with ``-q`` too)."""
    capman = config.pluginmanager.getplugin("capturemanager")
    with capman.global_and_fixture_disabled():
        print(f"\n{summary()}")


def mount_tmpfs(where: Path, size: str, nr_inodes: int | None = None) -> str | None:
    """Mount a fresh tmpfs of ``size`` (``mount -o size=``) on ``where``; None, or why it cannot be (a skip reason)."""
    if os.geteuid() != 0:
        return "mounting a small tmpfs needs root"
    where.mkdir(parents=True, exist_ok=True)
    opts = f"size={size},mode=0755" + (f",nr_inodes={nr_inodes}" if nr_inodes else "")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "sfs-faults", str(where)], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"cannot mount a tmpfs here: {proc.stderr.strip()}"
    return None


def remount_tmpfs(where: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(where)], check=True)


def unmount(where: Path) -> None:
    subprocess.run(["umount", str(where)], check=True)


def build_shim(out_dir: Path) -> Path | str:
    """Compile the shim; its path, or why it could not be built (a skip reason)."""
    cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("gcc")
    if cc is None:
        return "no C compiler (gcc) to build the LD_PRELOAD fault shim"
    so = out_dir / "sfs_fault_shim.so"
    proc = subprocess.run([cc, "-Wall", "-Wextra", "-Werror", "-O2", "-shared", "-fPIC", "-o", str(so),
                           str(HERE / "shim.c"), "-ldl"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the fault shim does not compile:\n{proc.stderr}")
    return so


class WorkerProcess:
    """One long-lived ``worker.py`` with the shim preloaded; commands go in and replies come back as JSON lines."""

    def __init__(self, shim: Path) -> None:
        env = dict(os.environ, LD_PRELOAD=str(shim))
        self.proc = subprocess.Popen([sys.executable, str(HERE / "worker.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, text=True)

    def call(self, op: str, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fault worker died (status {self.proc.wait()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"the fault worker failed: {reply['error']}")
        return reply

    def children(self) -> list[int]:
        """Pids of the worker's live children (every fork must be reaped)."""
        out = []
        for task in os.listdir(f"/proc/{self.proc.pid}/task"):
            with open(f"/proc/{self.proc.pid}/task/{task}/children") as f:
                out += [int(p) for p in f.read().split()]
        return out

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
