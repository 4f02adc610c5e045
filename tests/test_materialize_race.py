"""Races and properties for local_dir copying.

* A thread swaps a source subdirectory for a symlink to the outside tree
  while a local_dir copies (docker cp CVE-2018-15664 / CVE-2017-1002101
  class).  Each outside file carries a unique marker; whatever the timing,
  the marker must never appear in the workspace and the outside tree must
  not change.  A run may succeed or fail with a retryable SourceChangedError
  (or a symlink refusal), never leak.
* Property: random source trees with random symlinks (targets built from
  ``..``, names and ``.``) copied with the ``skip`` policy leave no symlink
  in the workspace that resolves outside it, and read nothing outside.
"""

from __future__ import annotations

import os
import shutil
import stat
import threading
import time
from pathlib import Path

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandbox_fs import open_root
from sandbox_fs.errors import SandboxError
from sandbox_fs.manifest import load_manifest
from sandbox_fs.materialize import MaterializeOptions, SourceChangedError, materialize


class Swapper(threading.Thread):
    def __init__(self, path: Path, target: Path) -> None:
        super().__init__(daemon=True)
        self.path, self.target = path, target
        self.hidden = path.with_name(".real-" + path.name)
        self.halt = threading.Event()
        self.swaps = 0

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                os.rename(self.path, self.hidden)
                os.symlink(self.target, self.path)
                self.swaps += 1
                time.sleep(0.0003)
                os.unlink(self.path)
                os.rename(self.hidden, self.path)
                time.sleep(0.0003)
            except OSError:
                time.sleep(0.0003)

    def stop(self) -> None:
        self.halt.set()
        self.join()
        if self.path.is_symlink():
            self.path.unlink()
        if self.hidden.exists() and not self.path.exists():
            os.rename(self.hidden, self.path)


async def test_swap_source_subdir_for_symlink_during_copy(layout, resolver):
    base = layout.base / "base"
    sub = base / "proj" / "sub"
    sub.mkdir(parents=True)
    marker = layout.secret
    leak_dir = layout.outside / "leak"
    leak_dir.mkdir()
    for i in range(150):
        (sub / f"f{i:03}.txt").write_text(f"inside {i}\n")
        (leak_dir / f"f{i:03}.txt").write_text(f"{marker} outside {i}\n")
    for i in range(30):
        (base / "proj" / f"top{i}.txt").write_text("top\n")
    before = layout.snapshot()
    sw = Swapper(sub, leak_dir)
    outcomes = {"ok": 0, "refused": 0}
    sw.start()
    try:
        for _ in range(12):
            ws = open_root(layout.ws)
            try:
                await materialize(ws, load_manifest({"entries": {"p": {"type": "local_dir", "src": "proj",
                                                                      "symlinks": "skip"}}}),
                                  MaterializeOptions(base_dir=str(base), batch_files=16))
                outcomes["ok"] += 1
            except SandboxError as exc:
                assert exc.code in ("source_changed", "symlink_refused", "path_escape", "materialize_failed"), exc
                if isinstance(exc, SourceChangedError):
                    assert exc.retryable
                outcomes["refused"] += 1
            finally:
                ws.close()
            layout.assert_secret_absent()
    finally:
        sw.stop()
    print("race outcomes", outcomes, "swaps", sw.swaps)
    assert sw.swaps > 0, "the attacker thread never swapped"
    assert sum(outcomes.values()) == 12
    layout.assert_secret_absent()
    # nothing in the workspace is a link leading out
    for dirpath, dirs, files in os.walk(layout.ws):
        for n in dirs + files:
            p = Path(dirpath, n)
            if p.is_symlink():
                assert os.path.realpath(p).startswith(os.path.realpath(layout.ws) + "/")
    layout.assert_outside_unchanged(before)


_NAMES = ["a", "b", "c"]
_TARGET = st.lists(st.sampled_from(["..", "a", "b", "c", ".", "l0", "l1"]), min_size=1, max_size=5).map("/".join)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(dirs=st.lists(st.lists(st.sampled_from(_NAMES), min_size=1, max_size=3).map("/".join), max_size=4),
       links=st.lists(st.tuples(st.sampled_from(["", "a", "a/b", "b"]), st.sampled_from(["l0", "l1", "l2"]),
                                _TARGET), max_size=6))
def test_property_copied_symlinks_stay_inside(tmp_path_factory, dirs, links):
    tmp = tmp_path_factory.mktemp("prop")
    base, ws_dir, outside = tmp / "base", tmp / "ws", tmp / "outside"
    tree = base / "t"
    for d in dirs + ["a/b", "b"]:
        (tree / d).mkdir(parents=True, exist_ok=True)
    outside.mkdir()
    (outside / "secret").write_text("OUTSIDE-MARKER")
    for d in ["", "a", "a/b", "b"]:
        (tree / d / "secret").write_text("inside")
    for where, name, target in links:
        p = tree / where / name
        if not os.path.lexists(p):
            os.symlink(target, p)
    ws_dir.mkdir()

    async def run():
        ws = open_root(ws_dir)
        try:
            return await materialize(ws, load_manifest({"entries": {"c": {"type": "local_dir", "src": "t",
                                                                          "symlinks": "skip"}}}),
                                     MaterializeOptions(base_dir=str(base)))
        finally:
            ws.close()

    trio.run(run)
    real_ws = os.path.realpath(ws_dir)
    dest = os.path.realpath(ws_dir / "c")
    for dirpath, dnames, fnames in os.walk(ws_dir):
        for n in dnames + fnames:
            p = Path(dirpath, n)
            st_ = p.lstat()
            if stat.S_ISLNK(st_.st_mode):
                r = os.path.realpath(p)
                assert r == dest or r.startswith(dest + "/"), f"{p} -> {os.readlink(p)} resolves to {r}"
                assert r.startswith(real_ws + "/")
            elif stat.S_ISREG(st_.st_mode):
                assert b"OUTSIDE-MARKER" not in p.read_bytes()
    shutil.rmtree(tmp)


@pytest.mark.parametrize("n", [3])
async def test_repeated_apply_is_idempotent(layout, n):
    base = layout.base / "b2"
    (base / "t" / "x").mkdir(parents=True)
    (base / "t" / "x" / "f").write_text("f")
    os.symlink("x/f", base / "t" / "lf")
    digests = []
    for _ in range(n):
        ws = open_root(layout.ws)
        try:
            res = await materialize(ws, load_manifest({"entries": {"t": {"type": "local_dir", "src": "t"}}}),
                                    MaterializeOptions(base_dir=str(base)))
        finally:
            ws.close()
        digests.append([(f.sandbox_path, f.sha256, f.mode) for f in res.files] + [s.sandbox_path for s in res.symlinks])
    assert all(d == digests[0] for d in digests)


@pytest.mark.parametrize("kind", ["local_dir", "dir"])
def test_directory_modes_never_reach_a_hard_link_swapped_in(tmp_path, kind, monkeypatch):
    """Directory modes (and a local_dir's mtimes) are set through the directory's own fd: a
    directory swapped for a hard link to an outside file just before is refused, never changed."""
    import sandbox_fs.materialize as mat

    base, ws_dir, outside = tmp_path / "base", tmp_path / "ws", tmp_path / "outside"
    for d in (base / "t" / "sub", ws_dir, outside):
        d.mkdir(parents=True)
    (base / "t" / "sub" / "f").write_text("x")
    os.chmod(base / "t" / "sub", 0o777)
    secret = outside / "secret"
    secret.write_text("s")
    os.chmod(secret, 0o600)
    before = os.stat(secret)
    os.link(secret, ws_dir / "planted")
    target = "t/sub" if kind == "local_dir" else "d/sub"
    fn = "_finish_local_dir" if kind == "local_dir" else "_finish_dirs"
    real = getattr(mat, fn)

    def swap_then_finish(run, arg):
        os.rename(ws_dir / target, tmp_path / "moved")
        os.rename(ws_dir / "planted", ws_dir / target)
        return real(run, arg)

    monkeypatch.setattr(mat, fn, swap_then_finish)
    entries = ({"t": {"type": "local_dir", "src": "t"}} if kind == "local_dir" else
               {"d": {"type": "dir", "children": {"sub": {"type": "dir", "mode": 0o777}}}})

    async def main():
        with open_root(ws_dir) as ws:
            await materialize(ws, load_manifest({"entries": entries}), MaterializeOptions(base_dir=str(base)))

    with pytest.raises((SandboxError, OSError)):
        trio.run(main)
    after = os.stat(secret)
    assert (stat.S_IMODE(after.st_mode), after.st_mtime_ns, after.st_uid) == \
        (stat.S_IMODE(before.st_mode), before.st_mtime_ns, before.st_uid)
