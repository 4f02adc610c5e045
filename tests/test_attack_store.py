"""Hostile-review attacks on a store directory whose entries another party planted (the review of 2026-12-03).

These attacks held when they were tried; they stay as cheap tests so they
keep holding.  Each checks an outside sentinel (a host file's content,
mode and link count), never only an exit code.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from sandbox_fs import open_root
from sandbox_fs.snapshot import DirectorySnapshotStore, SnapshotError, hydrate, persist


def _state(p: Path) -> tuple[str, int, int]:
    st = os.stat(p)
    return hashlib.sha256(p.read_bytes()).hexdigest(), st.st_mode, st.st_size


def test_planted_hard_links_and_fifos_never_change_an_outside_file_or_hang(tmp_path: Path) -> None:
    """Hard links of a host file at keys persist replaces or deletes (the baseline, a hold), FIFOs at another
    name's pointer and at a hold: every store operation runs to its end (no open blocks) and the host file
    keeps its content and mode (a rename replaces the name, a delete unlinks only the name)."""
    sdir, w, outside = tmp_path / "store", tmp_path / "w", tmp_path / "outside"
    outside.mkdir()
    w.mkdir()
    sentinel = outside / "sentinel"
    sentinel.write_bytes(b"SENTINEL\n")
    (w / "f").write_text("one\n")
    with DirectorySnapshotStore(sdir) as st, open_root(w) as r:
        persist(r, st, "n")
    os.link(sentinel, sdir / "n" / "baseline")
    (sdir / "n" / "holds").mkdir()
    os.link(sentinel, sdir / "n" / "holds" / "y")
    os.mkfifo(sdir / "n" / "holds" / "x")
    (sdir / "v").mkdir()
    os.mkfifo(sdir / "v" / "current")
    before = _state(sentinel)
    hung = threading.Timer(60, lambda: os._exit(3))  # an open that blocks on a FIFO would hang the run
    hung.start()
    try:
        (w / "f").write_text("two\n")
        with DirectorySnapshotStore(sdir) as st, open_root(w) as r:
            for _ in range(3):  # the pointer prunes generations: deletes beside the planted names
                persist(r, st, "n")
            hydrate(r, st, "n")
            assert [i.name for i in st.list()] == ["n"]
            st.gc(older_than=900)
            with pytest.raises(SnapshotError):
                st.info("v")
            st.remove("n")
    finally:
        hung.cancel()
    assert _state(sentinel) == before  # the sentinel
    assert (w / "f").read_text() == "two\n"
