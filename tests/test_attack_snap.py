"""Hostile-review attacks on forks, holds, baselines and the generation pointer (the review of 2026-12-02).

Each test plays one hostile party (a misbehaving store, a second client
racing this one) against throw-away directories and checks an outside
sentinel: what a fork or a source must still restore, or that nothing
outside the store changed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandbox_fs import open_root
from sandbox_fs.snapshot import (
    GenerationStore,
    LocalObjects,
    hydrate,
    persist,
)


def _persist(store: GenerationStore, name: str, ws_dir: Path, content: bytes) -> None:
    ws_dir.mkdir(exist_ok=True)
    (ws_dir / "f").write_bytes(content)
    with open_root(ws_dir) as ws:
        persist(ws, store, name)


class _Hooked(LocalObjects):
    """LocalObjects that runs ``hook`` once, the first time ``head(key)`` is called after arming."""

    key = ""
    hook: Any = None

    def head(self, key: str) -> Any:
        got = super().head(key)
        if key == self.key and self.hook is not None:
            hook, self.hook = self.hook, None
            hook()
        return got


# ------------------------------------------------------------- gc racing a fork onto a stale holder's name
def test_gc_never_removes_a_hold_a_fork_wrote_after_gc_read_the_stale_one(tmp_path: Path) -> None:
    """gc shrinks a stale hold to nothing; meanwhile another gc removed it and a fork of that name wrote its own.

    The stale hold's removal must be conditional on the very hold gc read
    (and a new fork's hold must never look like the old one), or the fork's
    shared generation loses its hold and the source's pruning deletes it.
    """
    objects = _Hooked(tmp_path / "objects")
    store = GenerationStore(objects, keep=1)
    with store, open_root(tmp_path / "out", create=True) as out:
        _persist(store, "src", tmp_path / "ws", b"shared")
        store.fork("src", "f")
        objects.delete("f/current")  # f went away without releasing its hold (a crash): the hold is stale

        def other_gc_then_fork() -> None:
            objects.delete("src/holds/f")  # a second gc removed the stale hold first
            store.fork("src", "f")  # a new fork of that name: its hold, then its pointer

        objects.key, objects.hook = "f/current", other_gc_then_fork
        store.gc(now=time.time() + 7200)  # reads the stale hold, then f's (not yet re-made) pointer
        assert objects.head("src/holds/f") is not None
        time.sleep(0.025)
        for i in range(2):  # a layer (as large as its base), then a full one: with keep=1, 1 and 2 are dropped
            _persist(store, "src", tmp_path / "ws", b"moved on %d" % i)
            time.sleep(0.025)
        hydrate(out, store, "f")
        assert (tmp_path / "out" / "f").read_bytes() == b"shared"  # the sentinel: the fork still restores


_DIRS = [f"{g:012d}-{g:016x}" for g in range(1, 6)]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dirs=st.lists(st.sampled_from(_DIRS), min_size=1, unique=True),
       shrunk=st.lists(st.sampled_from(_DIRS), unique=True))
def test_property_a_hold_changes_only_under_the_etag_it_had(tmp_path: Path, dirs: list[str],
                                                            shrunk: list[str]) -> None:
    """Rewritten with the very same directories, a hold gets a new etag; a write (or removal) under an old one fails."""
    from sandbox_fs.snapshot import SnapshotConflictError
    from sandbox_fs.snapshot._holds import held_dirs, write_hold

    with LocalObjects(tmp_path / os.urandom(8).hex()) as objects:
        write_hold(objects, "src", "f", set(dirs))
        first = objects.head("src/holds/f")
        write_hold(objects, "src", "f", set(dirs))  # removed and written again by a new fork of that name
        second = objects.head("src/holds/f")
        assert first is not None and second is not None and first.etag != second.etag
        with pytest.raises(SnapshotConflictError):
            write_hold(objects, "src", "f", set(shrunk), if_match=first.etag)
        assert held_dirs(objects, "src") == frozenset(dirs)
        write_hold(objects, "src", "f", set(shrunk), if_match=second.etag)
        assert held_dirs(objects, "src") == frozenset(shrunk)
        assert (objects.head("src/holds/f") is None) == (not shrunk)  # shrunk to nothing: gone, no tombstone left
