"""Staging directories left behind by a failed removal are swept by the next extraction; live ones are not.

An atomic extraction's staging directory (``.sfs-extract-*``) is removed best
effort; an I/O error, fd exhaustion or a kill during that removal left it in
the destination for good (found by the fault suite).  Each extraction now
holds a ``flock`` on its own staging directory, and the next extraction into
that directory removes every one whose lock it can take.
"""

from __future__ import annotations

import fcntl
import io
import os
import tarfile

from sandbox_fs import open_root
from sandbox_fs.archive import extract


def _tar(names: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in names.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def _snapshot(top):
    return sorted((str(p.relative_to(top)), p.is_symlink(), p.read_bytes() if p.is_file() and not p.is_symlink() else None)
                  for p in top.rglob("*"))


def test_a_stale_staging_directory_is_swept_and_a_held_one_kept(tmp_path):
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    (ws / "dest").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret").write_bytes(b"SECRET\n")
    before_outside = _snapshot(outside)
    stale = ws / "dest" / ".sfs-extract-0123456789abcdef"
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "half.txt").write_bytes(b"left by a failed removal\n")
    held = ws / "dest" / ".sfs-extract-fedcba9876543210"
    held.mkdir()
    (held / "inflight.txt").write_bytes(b"another extraction's member\n")
    os.symlink(outside, ws / "dest" / ".sfs-extract-1111111111111111")  # never followed, never removed through
    fd = os.open(held, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a live extraction holds it
    try:
        with open_root(ws) as root:
            extract(root, "dest", io.BytesIO(_tar({"new.txt": b"new\n"})))
        names = sorted(os.listdir(ws / "dest"))
    finally:
        os.close(fd)
    assert names == [".sfs-extract-1111111111111111", ".sfs-extract-fedcba9876543210", "new.txt"]
    assert (held / "inflight.txt").read_bytes() == b"another extraction's member\n"
    assert _snapshot(outside) == before_outside


def test_a_missing_destinations_parent_is_swept_too(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    stale = ws / ".sfs-extract-00000000000000aa"
    stale.mkdir()
    (stale / "x").write_bytes(b"x")
    with open_root(ws) as root:
        extract(root, "fresh", io.BytesIO(_tar({"a.txt": b"a\n"})))
    assert sorted(os.listdir(ws)) == ["fresh"]
    assert (ws / "fresh" / "a.txt").read_bytes() == b"a\n"


def test_the_extractions_own_staging_directory_is_locked_while_it_runs(tmp_path, monkeypatch):
    """While members are written, the staging directory cannot be locked by anyone else (a sweep skips it)."""
    from sandbox_fs.archive import _writer

    ws = tmp_path / "ws"
    (ws / "dest").mkdir(parents=True)
    seen: list[bool] = []
    real_finish = _writer.Extractor.finish

    def finish(self):
        stage = ws / "dest" / self._staging
        fd = os.open(stage, os.O_RDONLY | os.O_DIRECTORY)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                seen.append(False)
            except BlockingIOError:
                seen.append(True)
        finally:
            os.close(fd)
        return real_finish(self)

    monkeypatch.setattr(_writer.Extractor, "finish", finish)
    with open_root(ws) as root:
        extract(root, "dest", io.BytesIO(_tar({"a.txt": b"a\n"})))
    assert seen == [True]
    assert sorted(os.listdir(ws / "dest")) == ["a.txt"]


def test_a_staging_directory_a_sweep_removed_before_its_lock_is_a_conflict(tmp_path, monkeypatch):
    """A concurrent sweep that locks, empties and removes the new directory between its open and its lock.

    The extraction's flock then succeeds on the removed directory; it must see
    that the name no longer holds it and fail with ``conflict`` (as when the
    sweep still holds the lock), not go on as if it held a staging directory.
    """
    import pytest

    from sandbox_fs.archive import UnsafeArchiveMemberError, _staging

    ws = tmp_path / "ws"
    ws.mkdir()
    real_flock = _staging.fcntl.flock
    swept: list[int] = []

    class _Fcntl:
        LOCK_EX, LOCK_NB = fcntl.LOCK_EX, fcntl.LOCK_NB

        @staticmethod
        def flock(fd, op):
            if not swept:
                swept.append(-1)
                with open_root(ws) as other:  # another extraction's sweep, at the worst moment
                    swept[0] = _staging.sweep_stale(other)
            return real_flock(fd, op)

    monkeypatch.setattr(_staging, "fcntl", _Fcntl)
    with open_root(ws) as root:
        with pytest.raises(UnsafeArchiveMemberError) as ei:
            _staging.make_staging(root)
    assert swept == [1]  # the sweep did remove the new directory first
    assert ei.value.rule == "conflict"
    assert os.listdir(ws) == []


def _sweep_at(ws, point, monkeypatch):
    """make_staging in ``ws`` with another extraction's sweep run once just before step ``point``."""
    from sandbox_fs.archive import _staging

    real_flock = _staging.fcntl.flock
    done: list[bool] = []

    def sweep_once():
        if not done:
            done.append(True)
            with open_root(ws) as other:
                _staging.sweep_stale(other)

    class _Owner:
        def __init__(self, root, calls):
            self._root, self._calls = root, calls

        def __getattr__(self, attr):
            fn = getattr(self._root, attr)

            def call(*a, **kw):
                self._calls.append(attr)
                if f"{attr}#{self._calls.count(attr)}" == point:
                    sweep_once()
                return fn(*a, **kw)
            return call

    class _Fcntl:
        LOCK_EX, LOCK_NB = fcntl.LOCK_EX, fcntl.LOCK_NB

        @staticmethod
        def flock(fd, op):
            if point == "flock" and not done:
                sweep_once()
            return real_flock(fd, op)

    monkeypatch.setattr(_staging, "fcntl", _Fcntl)
    with open_root(ws) as root:
        return _staging.make_staging(_Owner(root, []))


def test_a_sweep_at_any_step_of_making_a_staging_directory_leaves_it_held_or_refused(tmp_path, monkeypatch):
    """At every step of make_staging a concurrent sweep either finds it locked or the extraction fails with conflict."""
    import pytest

    from sandbox_fs.archive import UnsafeArchiveMemberError

    outcomes = {}
    for i, point in enumerate(("lstat#1", "open_dir_fd#1", "flock", "lstat#2")):
        ws = tmp_path / f"ws{i}"
        ws.mkdir()
        try:
            name, made, fd = _sweep_at(ws, point, monkeypatch)
        except UnsafeArchiveMemberError as e:
            assert e.rule == "conflict"
            assert os.listdir(ws) == []
            outcomes[point] = "conflict"
            continue
        try:
            st = os.lstat(ws / name)
            assert (st.st_dev, st.st_ino) == made
            probe = os.open(ws / name, os.O_RDONLY | os.O_DIRECTORY)
            try:
                with pytest.raises(BlockingIOError):
                    fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            finally:
                os.close(probe)
        finally:
            os.close(fd)
        outcomes[point] = "held"
    assert outcomes == {"lstat#1": "conflict", "open_dir_fd#1": "conflict", "flock": "conflict", "lstat#2": "held"}
