"""Every ``openat2`` the library makes carries ``RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS``.

On today's kernels ``RESOLVE_BENEATH`` alone also refuses procfs magic links
(openat2(2): "this may change in the future"), so no behaviour tells the
two apart: the flags are read from the system calls themselves.  A child
process does a bit of everything (Root's methods, the fast open path,
clear/rmtree, a batched extraction in C, persist and hydrate, materialize)
under ``strace -f``, which decodes each ``struct open_how``.  The only call
allowed without them is the availability probe, ``openat2(AT_FDCWD, "/")``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

import sandbox_fs

WORKLOAD = r"""
import io, os, sys, tarfile, trio
from sandbox_fs import open_root
from sandbox_fs.archive import extract
from sandbox_fs.manifest import load_manifest
from sandbox_fs.materialize import MaterializeOptions, materialize
from sandbox_fs.snapshot import LocalSnapshotStore, hydrate, persist

top = sys.argv[1]
ws_dir, base, store_dir = (os.path.join(top, n) for n in ("ws", "base", "store"))
for d in (ws_dir, base):
    os.mkdir(d)
with open(os.path.join(base, "src.txt"), "w") as f:
    f.write("src\n")
tar_path = os.path.join(top, "a.tar")
with tarfile.open(tar_path, "w") as tf:
    for i in range(5):
        data = b"x" * (i + 1)
        ti = tarfile.TarInfo(f"t/f{i}")
        ti.size = len(data)
        tf.addfile(ti, io.BytesIO(data))
with open_root(ws_dir) as ws:
    ws.mkdir("d")
    ws.write_bytes("d/f", b"1")
    ws.atomic_write("d/g", b"2")
    ws.read_bytes("d/f")
    ws.symlink("f", "d/l")
    ws.link("d/f", "d/h")
    ws.chmod("d/f", 0o600)
    ws.rename("d/g", "d/g2")
    ws.listdir("d")
    ws.lstat("d/l")
    ws.mkdir("r/s", parents=True)
    ws.rmtree("r")
    extract(ws, "x", tar_path)
    with LocalSnapshotStore(store_dir) as store:
        persist(ws, store, "s")
        hydrate(ws, store, "s")
    async def go():
        await materialize(ws, load_manifest({"entries": {"m.txt": {"type": "local_file", "src": "src.txt"}}}),
                          MaterializeOptions(base_dir=base))
    trio.run(go)
    ws.clear()
print("done")
"""

_CALL = re.compile(r'openat2\((?P<dirfd>[^,]+), "(?P<path>[^"]*)"[^{]*\{(?P<how>[^}]*)\}')


def _why_not() -> str | None:
    if not sandbox_fs.features()["openat2"]:
        return "the kernel has no openat2 (the fallback walker makes none)"
    if shutil.which("strace") is None:
        return "needs strace(1) (scripts/setup.sh installs it)"
    r = subprocess.run(["strace", "-qq", "-e", "trace=none", "true"], capture_output=True, timeout=30)
    return None if r.returncode == 0 else "ptrace is not permitted here"


@pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))
def test_every_openat2_carries_beneath_and_no_magiclinks(tmp_path):
    trace = tmp_path / "trace.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("SANDBOX_FS_RESOLVER", "SANDBOX_FS_DEGRADE")}
    r = subprocess.run(["strace", "-f", "-qq", "-s", "256", "-e", "trace=openat2", "-o", str(trace),
                        sys.executable, "-c", WORKLOAD, str(tmp_path)], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "done", r.stderr[-2000:]
    calls = [m.groupdict() for m in _CALL.finditer(trace.read_text())]
    probes = [c for c in calls if c["dirfd"].endswith("AT_FDCWD") and c["path"] == "/"]
    checked = [c for c in calls if c not in probes]
    assert len(probes) <= 1 and len(checked) >= 50, (len(probes), len(checked))
    bad = [c for c in checked
           if "RESOLVE_BENEATH" not in c["how"] or "RESOLVE_NO_MAGICLINKS" not in c["how"]]
    assert bad == [], f"{len(bad)} openat2 calls without RESOLVE_BENEATH|RESOLVE_NO_MAGICLINKS, e.g. {bad[:3]}"
    # the trace reached the C batch path of the extractor too (its creates carry O_EXCL|O_CREAT)
    assert any("O_CREAT" in c["how"] and "O_EXCL" in c["how"] for c in checked)
