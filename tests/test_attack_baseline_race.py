"""A process racing hydrate: a file rewritten (same size, same mtime) after the swap, before the baseline scan.

The baseline hydrate leaves for the next persist takes each restored file's
stat from a scan made after the swap.  A change made between the swap and
that scan is in the scan's stat; unless the baseline's time is read before
the swap, that change's ctime is older than the baseline's time, and the next
persist takes the file as unchanged (the restored content's SHA-256): the
change is lost from the snapshot.  The sentinel is the content a restore of
the next snapshot gives.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandbox_fs import open_root
from sandbox_fs.snapshot import DirectorySnapshotStore, hydrate, persist
from sandbox_fs.snapshot import _hydrate as hydrate_mod


def _race_after_swap(monkeypatch, w: Path, rel: str, new: bytes, pause_s: float) -> None:
    """Rewrite ``w/rel`` (size and mtime kept) when the baseline scan is about to run, then let time pass."""
    real = hydrate_mod._baseline_listings

    def racing(ws, *args, **kwargs):
        p = w / rel
        before = os.lstat(p)
        assert len(new) == before.st_size
        p.write_bytes(new)
        os.utime(p, ns=(before.st_atime_ns, before.st_mtime_ns))
        time.sleep(pause_s)  # past the coarse clock's tick: the change's ctime is before a clock read now
        return real(ws, *args, **kwargs)

    monkeypatch.setattr(hydrate_mod, "_baseline_listings", racing)


def _round(tmp_path: Path, monkeypatch, rel: str, old: bytes, new: bytes, pause_s: float) -> bytes:
    sdir, w, out = tmp_path / "store", tmp_path / "w", tmp_path / "out"
    (w / rel).parent.mkdir(parents=True, exist_ok=True)
    (w / rel).write_bytes(old)
    (w / "other").write_bytes(b"x" * 100)
    with DirectorySnapshotStore(sdir) as s, open_root(w) as r:
        persist(r, s, "n")
    time.sleep(0.025)
    _race_after_swap(monkeypatch, w, rel, new, pause_s)
    with DirectorySnapshotStore(sdir) as s, open_root(w) as r:
        hydrate(r, s, "n")
    monkeypatch.undo()
    with DirectorySnapshotStore(sdir) as s, open_root(w) as r, open_root(out, create=True) as o:
        persist(r, s, "n")
        hydrate(o, s, "n")
    return (out / rel).read_bytes()


def test_a_file_changed_after_the_swap_before_the_baseline_scan_is_in_the_next_snapshot(tmp_path, monkeypatch):
    assert _round(tmp_path, monkeypatch, "d/f", b"one\n", b"TWO\n", 0.03) == b"TWO\n"  # the sentinel


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(depth=st.integers(0, 3), old=st.binary(min_size=1, max_size=64), flip=st.integers(0, 63),
       pause_ms=st.sampled_from([0, 5, 30]))
def test_property_any_same_size_change_racing_the_baseline_is_persisted(tmp_path_factory, monkeypatch,
                                                                        depth, old, flip, pause_ms):
    rel = "/".join(["d"] * depth + ["f"])
    new = bytearray(old)
    new[flip % len(old)] ^= 0xFF
    tmp = tmp_path_factory.mktemp("race")
    assert _round(tmp, monkeypatch, rel, old, bytes(new), pause_ms / 1000) == bytes(new)
