"""A store directory's shape is the store writer's: listing it (``snapshot ls``, ``gc``, ``list``) never fails on it.

``LocalObjects.list`` walked the directory recursively and gave every
file's path to ``head``: a directory chain deeper than Python's recursion
limit raised RecursionError, and a path longer than any key (1024 bytes)
raised ValueError from the key check, so ``snapshot ls`` and ``snapshot gc``
ended in "internal error" (exit 70) and ``store.list()`` raised a
non-SandboxError.  What cannot be a key is left out now, as
``S3Objects.list`` leaves out what the server lists that is not a key.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandbox_fs import open_root
from sandbox_fs.snapshot import MIN_GC_AGE_S, DirectorySnapshotStore, hydrate, persist


#: a chain deeper than the stack :func:`_shallow_stack` leaves (which the recursive walk needed, one frame a
#: level), and shallow enough for shutil.rmtree and pytest's cleanup of its temporary directories
_DEPTH = 300


@contextlib.contextmanager
def _shallow_stack() -> Iterator[None]:
    """Python's recursion limit at 150 frames above the caller's: what a deeper directory exhausted before
    (a real stack has ~1000; planting 1000 levels works as well, but leaves a tree that recursive
    deleters, shutil.rmtree and pytest's cleanup among them, cannot remove)."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack(0)) + 150)
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


def _deep(top: Path, depth: int, name: str = "a") -> None:
    """A chain of ``depth`` directories below ``top`` (made relative to an fd: no path limit)."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir(name, dir_fd=fd)
            nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
    finally:
        os.close(fd)


def _long(top: Path, parts: int) -> None:
    """A path of ``parts`` components of 250 characters below ``top``, with a file at its end."""
    p = top.joinpath(*[c * 250 for c in "bcdefgh"[:parts]])
    p.mkdir(parents=True, exist_ok=True)
    (p / "g").write_text("x")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A store directory with snapshot "n" of a one-file workspace: (store dir, workspace)."""
    top = tmp_path_factory.mktemp("listing")
    sdir, w = top / "store", top / "w"
    w.mkdir()
    (w / "f").write_text("kept\n")
    with DirectorySnapshotStore(sdir) as st_, open_root(w) as r:
        persist(r, st_, "n")
    return sdir, w


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.sampled_from(["", "n/", "n/gen/", "j/"]), depth=st.sampled_from([0, 3, _DEPTH]),
       long_parts=st.integers(0, 6))
def test_property_a_planted_tree_never_breaks_the_listing(store: tuple[Path, Path], where: str, depth: int,
                                                          long_parts: int) -> None:
    """A deep chain and a long path planted at the top, in the snapshot's own directory or its generations:
    ``list``, ``generations``, ``gc`` and ``remove`` of another name run, and "n" is listed and restores."""
    sdir, w = store
    junk = sdir / where / "junk"
    junk.mkdir(parents=True)
    try:
        _deep(junk, depth)
        _long(junk, long_parts)
        with DirectorySnapshotStore(sdir) as s:
            with _shallow_stack():
                assert [i.name for i in s.list()] == ["n"]
                assert [i.generation for i in s.generations("n")] == [1]
                s.gc(older_than=MIN_GC_AGE_S)  # nothing is old enough: only the walk is exercised
                s.remove("other")
            out = sdir.parent / "out"
            out.mkdir(exist_ok=True)
            with open_root(out) as r:
                hydrate(r, s, "n")
            assert (out / "f").read_text() == "kept\n"  # the sentinel: the snapshot is intact
    finally:
        shutil.rmtree(junk)


def test_cli_ls_and_gc_of_a_store_with_a_long_path(tmp_path: Path) -> None:
    """Before the fix: "internal error: ValueError", exit 70 (a 1,100-level chain gave "RecursionError"
    the same way: the property above covers it in-process)."""
    sdir, w = tmp_path / "store", tmp_path / "w"
    w.mkdir()
    (w / "f").write_text("kept\n")
    with DirectorySnapshotStore(sdir) as s, open_root(w) as r:
        persist(r, s, "n")
    (sdir / "x").mkdir()
    _long(sdir / "x", 5)
    _long(sdir / "n", 5)
    for args in (["ls", "--json"], ["gc", "--older-than", "900", "--json"]):
        r = subprocess.run([sys.executable, "-m", "sandbox_fs", "snapshot", *args, "--store", str(sdir)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stderr == "", r.stderr
        if args[0] == "ls":
            assert [row["name"] for row in json.loads(r.stdout)] == ["n"]
