"""``sandbox_fs.testing``: the hostile strategies parse and are refused safely; each attacker rule does its move.

The strategy cases extract every drawn archive into a workspace and check
the outside sentinel and the destination invariant; the attacker cases
check each rule's effect on disk, what it records as touched, that its own
moves never change the sentinel, and that a rule armed at a hook point runs
in the window from the attacker's thread.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
import threading
import zipfile

import pytest
from hypothesis import HealthCheck, given, settings

from sandbox_fs import open_root
from sandbox_fs.archive import extract
from sandbox_fs.testing import (
    ATTACK_RULES,
    Attacker,
    OutsideSentinel,
    check_destination,
    classify_failure,
    hostile_host_trees,
    hostile_tar_archives,
    hostile_zip_archives,
    sandbox_path_names,
)

_FAST = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture
def area(tmp_path):
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    ws.mkdir()
    outside.mkdir()
    (outside / "secret.txt").write_text("SECRET\n")
    (tmp_path / "bait").mkdir()  # the hard links' target: outside, but not in the sentinel (a link changes its ctime)
    (tmp_path / "bait" / "bait.txt").write_text("BAIT\n")
    return tmp_path


def _extract_checked(area, data: bytes, fmt: str) -> None:
    sentinel = OutsideSentinel(area / "outside")
    dest = area / "ws" / "dest"
    with open_root(area / "ws") as ws:
        try:
            extract(ws, "dest", io.BytesIO(data), format=fmt)
        except Exception as exc:  # noqa: BLE001 - classified below
            assert classify_failure(exc, host_paths=[str(area)]), repr(exc)
    sentinel.check()
    if dest.exists():
        check_destination(dest, sentinel=sentinel)
        ws_root = open_root(area / "ws")
        ws_root.rmtree("dest")
        ws_root.close()


@_FAST
@given(data=hostile_tar_archives())
def test_hostile_tar_archives_parse_and_stay_inside(area, data):
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert tar.getmembers()
    _extract_checked(area, data, "tar")


@_FAST
@given(data=hostile_zip_archives())
def test_hostile_zip_archives_parse_and_stay_inside(area, data):
    assert zipfile.ZipFile(io.BytesIO(data)).infolist()
    _extract_checked(area, data, "zip")


@_FAST
@given(path=sandbox_path_names())
def test_sandbox_path_names_never_escape_a_root(area, path):
    sentinel = OutsideSentinel(area / "outside")
    with open_root(area / "ws") as ws:
        try:
            ws.write_bytes(path, b"x")
        except Exception as exc:  # noqa: BLE001 - classified below
            assert classify_failure(exc, host_paths=[str(area)]), repr(exc)
    sentinel.check()


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(plan=hostile_host_trees())
def test_host_tree_plan_builds_every_kind(tmp_path_factory, plan):
    top = tmp_path_factory.mktemp("tree")
    out = tmp_path_factory.mktemp("out")
    (out / "f").write_text("outside")
    plan.build(top, out, out / "f")
    want = {"file": stat.S_ISREG, "dir": stat.S_ISDIR, "symlink": stat.S_ISLNK, "fifo": stat.S_ISFIFO,
            "hardlink_outside": stat.S_ISREG}
    for node in plan.nodes:
        st = os.lstat(top / node.path)
        assert want[node.kind](st.st_mode), node
        if node.kind == "hardlink_outside":
            assert st.st_ino == os.stat(out / "f").st_ino
    assert set(plan.files()) | set(plan.hostile()) == {n.path for n in plan.nodes if n.kind != "dir"}


def test_each_rule_moves_and_records(area):
    ws = area / "ws"
    (ws / "d" / "e").mkdir(parents=True)
    (ws / "d" / "f").write_text("f")
    (ws / "g").write_text("g")
    (ws / "h").mkdir()
    (ws / "m").mkdir()
    sentinel = OutsideSentinel(area / "outside")
    with Attacker(ws, area / "outside", area / "bait" / "bait.txt", area / "attic") as atk:
        assert atk.plant_symlink("d/f")
        assert os.readlink(ws / "d" / "f") == str(area / "outside")
        assert atk.exchange_with_symlink("h")
        assert os.path.islink(ws / "h")
        assert atk.replace_with_fifo("g")
        assert stat.S_ISFIFO(os.lstat(ws / "g").st_mode)
        (ws / "k").write_text("k")
        assert atk.replace_with_hardlink("k")
        assert os.stat(ws / "k").st_ino == os.stat(area / "bait" / "bait.txt").st_ino
        assert atk.move_out("m")
        assert not (ws / "m").exists() and len(os.listdir(area / "attic")) == 1
        assert atk.chmod("d/e", 0o500)
        assert stat.S_IMODE(os.stat(ws / "d" / "e").st_mode) == 0o500
        # the attacker never follows a link itself: "d/f" is a symlink to outside now
        assert not atk.plant_symlink("d/f/secret.txt")
        assert not atk.chmod("h/secret.txt")
        assert {"d/f", "h", "g", "k", "m", "d/e"} <= atk.touched
        assert [r.rule for r in atk.log if r.done] == ["plant_symlink", "exchange_with_symlink",
                                                        "replace_with_fifo", "replace_with_hardlink",
                                                        "move_out", "chmod"]
    sentinel.check()


def test_rule_armed_at_hook_runs_in_the_window_from_its_thread(area, resolver):
    ws = area / "ws"
    (ws / "d").mkdir()
    ran_on: list[str] = []
    with Attacker(ws, area / "outside", area / "bait" / "bait.txt", area / "attic") as atk, \
            open_root(ws) as root:
        orig = atk.apply

        def spy(rule: str, path: str, *, point: str | None = None) -> bool:
            ran_on.append(threading.current_thread().name)
            return orig(rule, path, point=point)

        atk.apply = spy  # type: ignore[method-assign]
        atk.at_hook("root.parent", "exchange_with_symlink", "d", when=lambda c: c["op"] == "write")
        with atk.armed():
            root.write_bytes("d/x", b"inside")  # the parent fd was resolved before the exchange
        assert atk.pending() == 0
    assert ran_on == ["attacker-at-hook"]
    assert [r.point for r in atk.log] == ["root.parent"]
    assert not (area / "outside" / "x").exists()
    moved = [n for n in os.listdir(ws) if n.startswith(".atk-")]
    assert len(moved) == 1 and (ws / moved[0] / "x").read_bytes() == b"inside"


def test_unknown_rule_and_point_are_refused(area):
    with Attacker(area / "ws", area / "outside", area / "bait" / "bait.txt", area / "attic") as atk:
        with pytest.raises(ValueError):
            atk.apply("nope", "x")
        with pytest.raises(ValueError):
            atk.at_hook("nope", ATTACK_RULES[0], "x")
