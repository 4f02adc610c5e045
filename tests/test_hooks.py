"""``sandbox_fs._hooks``: every named point fires where its docstring says, and a hook can race the window.

Each case installs a recording hook, runs the one operation that reaches a
point and checks the point fired with its documented context; so moving or
dropping a call site fails here.  The race cases change the tree from the
hook (the window between the look and the use) and check the library's
answer and the outside sentinel.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import trio

from sandbox_fs import _hooks, open_root
from sandbox_fs.manifest import load_manifest
from sandbox_fs.materialize import MaterializeOptions, SourceChangedError, materialize
from sandbox_fs.snapshot import LocalSnapshotStore, hydrate, persist


class Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, point: str, context: dict[str, Any]) -> None:
        assert point in _hooks.HOOK_POINTS, point
        self.seen.append((point, dict(context)))

    def points(self) -> set[str]:
        return {p for p, _ in self.seen}


def test_no_hook_by_default_and_installed_restores():
    assert _hooks.current is None
    rec = Recorder()
    with _hooks.installed(rec):
        assert _hooks.current is rec
        _hooks.fire("root.parent", root=None)
    assert _hooks.current is None
    _hooks.fire("root.parent", root=None)  # nothing installed: nothing called
    assert rec.seen == [("root.parent", {"root": None})]


def test_root_points(layout, resolver):
    rec = Recorder()
    with open_root(layout.ws) as ws:
        ws.mkdir("d")
        ws.write_bytes("d/f", b"x")
        with _hooks.installed(rec):
            ws.chmod("d/f", 0o600)
            ws.rename("d/f", "d/g")
            ws.rmtree("d")
        assert not ws.exists("d")
    ops = [c["op"] for p, c in rec.seen if p == "root.parent"]
    assert ops[:3] == ["chmod", "rename", "rename"]
    assert ("root.rename", {"root": rec.seen[0][1]["root"], "src": b"d/f", "dst": b"d/g"}) in rec.seen
    assert "remove.enter_dir" not in rec.points()  # d had no subdirectory
    rec.seen.clear()
    with open_root(layout.ws) as ws:
        ws.mkdir("t/u/v", parents=True)
        with _hooks.installed(rec):
            ws.clear()
    assert [c["name"] for p, c in rec.seen if p == "remove.enter_dir"] == [b"t", b"u", b"v"]


def test_parent_hook_race_is_refused(layout, resolver):
    """Swapping the parent for a symlink to outside after it was resolved changes nothing outside."""
    before = layout.snapshot()

    def swap(point: str, ctx: dict[str, Any]) -> None:
        if point == "root.parent" and ctx["op"] == "write":
            os.rename(layout.ws / "d", layout.ws / "d.old")
            os.symlink(layout.outside, layout.ws / "d")

    with open_root(layout.ws) as ws:
        ws.mkdir("d")
        with _hooks.installed(swap):
            ws.write_bytes("d/secret.txt", b"overwritten")
    # the write went to the directory fd resolved before the swap, never through the link
    assert (layout.ws / "d.old" / "secret.txt").read_bytes() == b"overwritten"
    layout.assert_outside_unchanged(before)


def _materialize(ws_dir: Path, manifest: dict[str, Any], base: Path) -> None:
    async def go() -> None:
        with open_root(ws_dir) as ws:
            await materialize(ws, load_manifest(manifest), MaterializeOptions(base_dir=str(base)))
    trio.run(go)


def test_materialize_local_file_point_and_race(layout, resolver):
    base = layout.base / "base"
    base.mkdir()
    (base / "src.txt").write_text("inside\n")
    rec = Recorder()
    with _hooks.installed(rec):
        _materialize(layout.ws, {"entries": {"a.txt": {"type": "local_file", "src": "src.txt"}}}, base)
    assert [c["path"] for p, c in rec.seen if p == "materialize.local_file"] == ["src.txt"]
    before = layout.snapshot()

    def swap(point: str, ctx: dict[str, Any]) -> None:
        if point == "materialize.local_file":
            (base / "other.txt").write_text("another file\n")
            os.rename(base / "other.txt", base / "src.txt")  # another inode at the name

    with _hooks.installed(swap), pytest.raises(SourceChangedError):
        _materialize(layout.ws, {"entries": {"b.txt": {"type": "local_file", "src": "src.txt"}}}, base)
    assert not (layout.ws / "b.txt").exists()
    layout.assert_outside_unchanged(before)


def test_materialize_local_dir_per_file_point(layout, resolver):
    base = layout.base / "base"
    (base / "tree").mkdir(parents=True)
    (base / "tree" / "f.txt").write_text("inside\n")
    (layout.ws / "c" / "f.txt").mkdir(parents=True)  # a directory where the file goes: the per-file path repairs it
    rec = Recorder()
    with _hooks.installed(rec):
        _materialize(layout.ws, {"entries": {"c": {"type": "local_dir", "src": "tree"}}}, base)
    assert [(c["path"], c["dest"]) for p, c in rec.seen if p == "materialize.local_dir_file"] == [("f.txt", "c/f.txt")]
    assert (layout.ws / "c" / "f.txt").read_text() == "inside\n"


def test_persist_and_hydrate_points(layout, resolver, tmp_path):
    (layout.ws / "d").mkdir()
    (layout.ws / "d" / "f").write_text("x")
    rec = Recorder()
    with LocalSnapshotStore(tmp_path / "store") as store, open_root(layout.ws) as ws:
        with _hooks.installed(rec):
            persist(ws, store, "s")
        assert {c["path"] for p, c in rec.seen if p == "persist.open_entry"} >= {"d", "d/f"}
        rec.seen.clear()
        with _hooks.installed(rec):
            hydrate(ws, store, "s")
    swaps = [c["staging"] for p, c in rec.seen if p == "hydrate.swap"]
    assert len(swaps) == 1 and swaps[0].startswith(".sfs-hydrate-")
    assert [c["dst"] for p, c in rec.seen if p == "hydrate.move_up"] == ["d"]
    assert (layout.ws / "d" / "f").read_text() == "x"
