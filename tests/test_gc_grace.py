"""gc's grace period: never shorter than a fork or persist in progress needs, and measured on the store's clock.

Regressions: ``gc(older_than=0)`` (``snapshot gc --older-than 0``) run
between a fork's hold and its pointer deleted the hold as stale, so the
source's next pruning deleted the generation the fork lists; and gc
compared object mtimes (the store's clock: S3's ``LastModified``) with the
local ``time.time()``, so a local clock ahead of the store's by more than the
grace deleted a persist's objects before its pointer named them.  Each test
checks what a restore gives back.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import pytest

from sandbox_fs import open_root
from sandbox_fs.cli import main
from sandbox_fs.snapshot import DirectorySnapshotStore, GenerationStore, LocalObjects, hydrate, persist
from sandbox_fs.snapshot import _generations


def _save(store: GenerationStore, name: str, ws: Path, text: str) -> None:
    ws.mkdir(exist_ok=True)
    (ws / "f").write_text(text)
    with open_root(ws) as w:
        persist(w, store, name)


def _restored(store: GenerationStore, name: str, out: Path) -> str:
    out.mkdir()
    with open_root(out) as o:
        hydrate(o, store, name)
    return (out / "f").read_text()


def test_the_most_eager_gc_allowed_during_a_fork_never_loses_what_the_fork_lists(tmp_path: Path) -> None:
    store = GenerationStore(LocalObjects(tmp_path / "objects"), keep=1)
    _save(store, "src", tmp_path / "ws", "forked content")
    put = store.objects.put_bytes

    def put_then_gc(key: str, data: bytes, **kw: Any) -> Any:
        if key == "tgt/current":  # the fork's holds are written, its pointer not yet
            for age in (0.0, 1.0, getattr(_generations, "MIN_GC_AGE_S", 900.0)):
                with contextlib.suppress(ValueError):  # an age below the floor is refused
                    store.gc(older_than=age)
        return put(key, data, **kw)

    store.objects.put_bytes = put_then_gc  # type: ignore[method-assign]
    with store:
        store.fork("src", "tgt")
        store.objects.put_bytes = put  # type: ignore[method-assign]
        for i in range(2):  # each rewrite is larger than its base: a layer, then a full one, which (keep=1)
            _save(store, "src", tmp_path / "ws", f"the source moved on {i} " * 1000)  # releases generation 1
        assert store.kept("src") == [3] and store.info("src").chain_length == 1  # type: ignore[union-attr]
        assert _restored(store, "tgt", tmp_path / "out") == "forked content"  # the sentinel


def test_gc_refuses_a_grace_below_the_floor(tmp_path: Path, capsys: Any) -> None:
    with GenerationStore(LocalObjects(tmp_path / "objects")) as store:
        for age in (0.0, -1.0, float("nan"), _generations.MIN_GC_AGE_S - 1):
            with pytest.raises(ValueError):
                store.gc(older_than=age)
        assert store.gc(older_than=_generations.MIN_GC_AGE_S).objects == []
    with pytest.raises(SystemExit) as ei:  # a usage error
        main(["snapshot", "gc", "--store", str(tmp_path / "objects"), "--older-than", "0"])
    err = capsys.readouterr().err
    assert ei.value.code == 2 and err.count("\n") == 1 and "--older-than" in err and "900" in err


def test_gc_measures_ages_on_the_stores_clock_not_the_local_one(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A local clock two hours ahead of the store's: a persist's fresh archive is not two hours old."""
    with DirectorySnapshotStore(tmp_path / "store", keep=1) as store:
        _save(store, "s", tmp_path / "ws", "one")
        head = store.objects.head
        reports: list[Any] = []

        def head_then_gc(key: str) -> Any:
            if key.startswith("s/gen/") and key.endswith("/archive.tar") and not reports:
                reports.append(None)  # once: the persist's archive is visible, its pointer not swapped yet
                real = time.time
                monkeypatch.setattr(time, "time", lambda: real() + 7200)
                try:
                    reports[0] = store.gc()  # the default grace, one hour
                finally:
                    monkeypatch.setattr(time, "time", real)
            return head(key)

        store.objects.head = head_then_gc  # type: ignore[method-assign]
        _save(store, "s", tmp_path / "ws", "two")  # its commit checks the archive right after it is visible
        store.objects.head = head  # type: ignore[method-assign]
        assert reports and reports[0].objects == []
        assert _restored(store, "s", tmp_path / "out") == "two"  # the sentinel
        assert [o.key for o in store.objects.list("") if o.key.startswith("sandbox-fs.")] == []  # no marker left
