"""Hostile-review attacks on the timestamp rules of persist (the review of 2026-12-03).

Persist compares file timestamps with a clock reading taken before a walk
or a check ("changed at or after it": the racy-git rule).  A file system
that keeps whole-second timestamps (ext4 made with 128-byte inodes, NFS,
FUSE, FAT's 2 s) truncates a change made after the reading to a time
before it.  Before the fix, on such a file system, (1) the hard-link check
of :mod:`sandbox_fs.snapshot._entries` could not see a confined command
move a name while it looked the names up again (its directories' ctimes
did not move within the second), so a file also linked to a host file was
read into the snapshot; (2) a file rewritten (same size) in the second a
layered persist began was taken as unchanged at the next persist, which
kept the old content.  The sentinels: the host file's content is in no
stored object; the restored file holds the last content.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandbox_fs import _hooks, open_root
from sandbox_fs.snapshot import DirectorySnapshotStore, SnapshotSourceChangedError, hydrate, persist
from sandbox_fs.snapshot._index import stamp_latest_ns
from test_attack_links import _Mover, _store_holds_secret, _workspace


@pytest.fixture(scope="module")
def coarse_fs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A throw-away ext4 with 128-byte inodes (whole-second timestamps), loop-mounted under the temp dir."""
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None or shutil.which("mount") is None:
        pytest.skip("needs root and mkfs.ext4 to loop-mount a file system with whole-second timestamps")
    base = tmp_path_factory.mktemp("coarse")
    img, mnt = base / "fs.img", base / "mnt"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(16 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-I", "128", "-O", "^has_journal", str(img)], check=True,
                   capture_output=True)
    done = subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True)
    if done.returncode:
        pytest.skip("cannot loop-mount here (" + done.stderr.decode(errors="replace").strip()[:80] + ")")
    try:
        probe = mnt / "probe"
        probe.write_bytes(b"")
        if os.stat(probe).st_ctime_ns % 1_000_000_000:
            pytest.skip("this ext4 keeps sub-second timestamps even with 128-byte inodes")
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False, capture_output=True)


def _at_a_second_start() -> None:
    """Sleep to just after the next whole second, so the steps that follow share one second."""
    time.sleep(1.0 - time.time() % 1.0 + 0.01)


def test_a_name_moved_under_the_link_check_is_seen_on_a_whole_second_file_system(
        coarse_fs: Path, tmp_path: Path) -> None:
    """The _Mover of test_attack_links, chasing each lookup: the directories' ctimes stay the same within
    the second, so before the fix the check passed and the host file's content was stored (every time)."""
    (coarse_fs / "links").mkdir()
    w, _secret = _workspace(coarse_fs / "links", ["a", "b"])
    sdir = tmp_path / "store"
    mover = _Mover(w, "b", chase=True)
    with DirectorySnapshotStore(sdir) as store, open_root(w) as r, _hooks.installed(mover):
        with pytest.raises(SnapshotSourceChangedError):
            persist(r, store, "n")
    assert mover.moved
    assert not _store_holds_secret(sdir)  # the sentinel


def test_a_same_size_rewrite_in_the_second_a_persist_began_is_persisted_next_time(
        coarse_fs: Path, tmp_path: Path) -> None:
    """Write, persist, rewrite (same size) in one second, persist over the first: the second persist must
    read the file again (before the fix its index entry matched and the old content was kept)."""
    w = coarse_fs / "rewrite"
    w.mkdir()
    sdir = tmp_path / "store"
    for _ in range(3):  # the three steps must share one second: try again if a boundary fell between them
        _at_a_second_start()
        start = int(time.time())
        (w / "f").write_bytes(b"AAAA")
        with DirectorySnapshotStore(sdir) as store, open_root(w) as r:
            persist(r, store, "n")
            (w / "f").write_bytes(b"BBBB")
            if int(time.time()) != start:
                continue
            persist(r, store, "n")
        break
    else:
        pytest.skip("no three steps within one second on this machine")
    back = tmp_path / "back"
    back.mkdir()
    with DirectorySnapshotStore(sdir) as store, open_root(back) as r:
        hydrate(r, store, "n")
    assert (back / "f").read_bytes() == b"BBBB"  # the sentinel: the last content


_STEPS = [2_000_000_000, 1_000_000_000, 100_000_000, 10_000_000, 1_000_000, 1000, 100, 10, 1]


@given(t=st.integers(0, 1 << 62), step=st.sampled_from(_STEPS))
def test_property_a_truncated_timestamp_never_stands_for_a_moment_before_the_change(t: int, step: int) -> None:
    """A change at ``t`` on a file system with timestamp step ``step`` (truncated down) is at or before the
    latest moment its timestamp stands for; a nanosecond timestamp stands for at most 2 s after it."""
    ts = t - t % step
    latest = stamp_latest_ns(ts)
    assert latest >= t
    assert ts <= latest < ts + 2_000_000_000
