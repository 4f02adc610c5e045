"""Forced look-then-open races: the source changes exactly between the first look and the real open.

Each case swaps the source at the library's own hook point
(:mod:`sandbox_fs._hooks`) for one of the attacker's moves (another inode at
the name, a symlink to the outside secret, a parent directory moved away or
replaced by a symlink) and expects the retryable refusal
(``SourceChangedError`` / ``SnapshotSourceChangedError``), nothing of the
outside in the workspace or the store, and the outside sentinel unchanged.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Callable

import pytest
import trio

from sandbox_fs import _hooks, open_root
from sandbox_fs.manifest import load_manifest
from sandbox_fs.materialize import MaterializeOptions, SourceChangedError, materialize
from sandbox_fs.snapshot import LocalSnapshotStore, SnapshotSourceChangedError, persist


def _once(point: str, path: str, move: Callable[[], None]) -> Callable[[str, dict[str, Any]], None]:
    """A hook that makes ``move`` at ``point`` for ``path``, the first time only."""
    done = []

    def hook(name: str, ctx: dict[str, Any]) -> None:
        if name == point and ctx.get("path") == path and not done:
            done.append(True)
            move()
    return hook


def _materialize(ws_dir: Path, entries: dict[str, Any], base: Path) -> None:
    async def go() -> None:
        with open_root(ws_dir) as ws:
            await materialize(ws, load_manifest({"entries": entries}), MaterializeOptions(base_dir=str(base)))
    trio.run(go)


def _no_secret_in(layout, top: Path) -> None:
    for dirpath, _dirs, files in os.walk(top):
        for name in files:
            p = Path(dirpath, name)
            if not p.is_symlink():
                assert layout.secret.encode() not in p.read_bytes(), f"outside data reached {p}"


def _other_inode(path: Path) -> Callable[[], None]:
    def move() -> None:
        tmp = path.with_name(path.name + ".new")
        tmp.write_text("another file\n")
        os.rename(tmp, path)
    return move


def _fifo(path: Path) -> Callable[[], None]:
    def move() -> None:
        os.unlink(path)
        os.mkfifo(path)
    return move


def _link_to_secret(layout, path: Path) -> Callable[[], None]:
    def move() -> None:
        os.unlink(path)
        os.symlink(layout.outside / "secret.txt", path)
    return move


# ------------------------------------------------------------------ local_file


@pytest.fixture
def base(layout) -> Path:
    b = layout.base / "base"
    (b / "tree").mkdir(parents=True)
    (b / "src.txt").write_text("inside\n")
    (b / "tree" / "f.txt").write_text("inside\n")
    return b


@pytest.mark.parametrize("swap", ["other_inode", "symlink_to_outside", "fifo"])
def test_local_file_swapped_between_look_and_open(layout, resolver, base, swap):
    move = {"other_inode": _other_inode, "fifo": _fifo}.get(swap, lambda p: _link_to_secret(layout, p))(
        base / "src.txt")
    before = layout.snapshot()
    with _hooks.installed(_once("materialize.local_file", "src.txt", move)), pytest.raises(SourceChangedError) as ei:
        _materialize(layout.ws, {"a.txt": {"type": "local_file", "src": "src.txt"}}, base)
    assert ei.value.retryable and ei.value.sandbox_path == "a.txt"
    assert not (layout.ws / "a.txt").exists()
    _no_secret_in(layout, layout.ws)
    layout.assert_outside_unchanged(before)


# ------------------------------------------------------------------ local_dir, per-file path


def _per_file(layout) -> None:
    """A directory where the file goes: the batched copy leaves f.txt to the per-file path (it repairs it)."""
    (layout.ws / "c" / "f.txt").mkdir(parents=True)


@pytest.mark.parametrize("swap", ["other_inode", "symlink_to_outside", "parent_is_symlink", "fifo"])
def test_local_dir_file_swapped_on_the_per_file_path(layout, resolver, base, swap):
    _per_file(layout)
    tree = base / "tree"
    if swap == "other_inode":
        move = _other_inode(tree / "f.txt")
    elif swap == "fifo":
        move = _fifo(tree / "f.txt")
    elif swap == "symlink_to_outside":
        move = _link_to_secret(layout, tree / "f.txt")
    else:
        def move() -> None:  # the file's directory is now a link to outside, which holds a same-named file
            os.rename(tree / "sub", tree / "sub.old")
            os.symlink(layout.outside, tree / "sub")
        (tree / "sub").mkdir()
        (tree / "sub" / "secret.txt").write_text("inside\n")
    hook_path = "sub/secret.txt" if swap == "parent_is_symlink" else "f.txt"
    before = layout.snapshot()
    with _hooks.installed(_once("materialize.local_dir_file", hook_path, move)), \
            pytest.raises(SourceChangedError) as ei:
        if swap == "parent_is_symlink":
            (layout.ws / "c" / "sub" / "secret.txt").mkdir(parents=True)  # that file on the per-file path too
        _materialize(layout.ws, {"c": {"type": "local_dir", "src": "tree"}}, base)
    assert ei.value.retryable
    _no_secret_in(layout, layout.ws)
    layout.assert_outside_unchanged(before)


@pytest.mark.parametrize("mode, expect", [(0o640, 0o640), (0o4755, 0o755), (0o2711, 0o711)])
def test_local_dir_per_file_control(layout, resolver, base, mode, expect):
    """Without a swap the per-file path copies the file (the hook fired: the race was at the window),
    with its permission bits and never a set-id bit."""
    _per_file(layout)
    os.chmod(base / "tree" / "f.txt", mode)
    fired = []
    with _hooks.installed(_once("materialize.local_dir_file", "f.txt", lambda: fired.append(1))):
        _materialize(layout.ws, {"c": {"type": "local_dir", "src": "tree"}}, base)
    assert fired == [1] and (layout.ws / "c" / "f.txt").read_text() == "inside\n"
    assert stat.S_IMODE(os.lstat(layout.ws / "c" / "f.txt").st_mode) == expect


# ------------------------------------------------------------------ persist: an entry's parent


@pytest.mark.parametrize("swap", ["parent_moved_away", "parent_is_symlink", "parent_is_relative_symlink",
                                  "parent_is_inside_symlink", "entry_other_inode", "symlink_other_inode",
                                  "dangling_link_parent_moved_away", "parent_is_a_file"])
def test_persist_entry_parent_swapped_before_open(layout, resolver, tmp_path, swap):
    (layout.ws / "d").mkdir()
    (layout.ws / "d" / "f").write_text("inside\n")
    os.symlink("f", layout.ws / "d" / "l")
    os.symlink("missing", layout.ws / "d" / "m")  # still listed in the moved directory, though dangling
    away = tmp_path / "away"
    away.mkdir()

    def move() -> None:
        if swap == "parent_is_a_file":  # ENOTDIR on the path
            os.rename(layout.ws / "d", away / "d")
            (layout.ws / "d").write_text("a file now\n")
            return
        if swap == "entry_other_inode":
            _other_inode(layout.ws / "d" / "f")()
            return
        if swap == "symlink_other_inode":  # another link at the name, read by readlink after the look
            os.symlink("g", layout.ws / "d" / "l.new")
            os.rename(layout.ws / "d" / "l.new", layout.ws / "d" / "l")
            return
        if swap == "parent_is_inside_symlink":  # the same inode, now reached through a link inside
            os.rename(layout.ws / "d", layout.ws / "e")
            os.symlink("e", layout.ws / "d")
            return
        os.rename(layout.ws / "d", away / "d")
        if swap == "parent_is_symlink":
            os.symlink(layout.outside, layout.ws / "d")
        elif swap == "parent_is_relative_symlink":
            os.symlink(os.path.relpath(away / "d", layout.ws), layout.ws / "d")
        (away / "d" / "f").write_text(layout.secret + "\n")  # written after it left the workspace

    (layout.outside / "f").write_text(layout.secret + "\n")
    before = layout.snapshot()
    with LocalSnapshotStore(tmp_path / "store") as store, open_root(layout.ws) as ws:
        entry = {"symlink_other_inode": "d/l", "dangling_link_parent_moved_away": "d/m"}.get(swap, "d/f")
        with _hooks.installed(_once("persist.open_entry", entry, move)), \
                pytest.raises(SnapshotSourceChangedError) as ei:
            persist(ws, store, "s")
        assert ei.value.retryable and ei.value.sandbox_path == entry
        assert [i.name for i in store.list()] == [], "a snapshot was written"
    _no_secret_in(layout, tmp_path / "store")
    layout.assert_outside_unchanged(before)


def test_persist_skips_an_entry_deleted_at_the_window(layout, resolver, tmp_path):
    """Gone from its path and from the listed directory: vanished (skipped), not moved (refused)."""
    (layout.ws / "d").mkdir()
    (layout.ws / "d" / "f").write_text("inside\n")
    (layout.ws / "d" / "g").write_text("kept\n")
    with LocalSnapshotStore(tmp_path / "store") as store, open_root(layout.ws) as ws:
        with _hooks.installed(_once("persist.open_entry", "d/f", lambda: os.unlink(layout.ws / "d" / "f"))):
            persist(ws, store, "s")
        assert [i.name for i in store.list()] == ["s"]


def test_persist_control(layout, resolver, tmp_path):
    (layout.ws / "d").mkdir()
    (layout.ws / "d" / "f").write_text("inside\n")
    fired = []
    with LocalSnapshotStore(tmp_path / "store") as store, open_root(layout.ws) as ws:
        with _hooks.installed(_once("persist.open_entry", "d/f", lambda: fired.append(1))):
            persist(ws, store, "s")
    assert fired == [1]
