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


# ---------------------------------------------------------------- merging into an existing destination

_MERGE_ARCHIVE = {"a.txt": b"new a\n", "b.txt": b"new b\n", "d/old.txt": b"new old\n", "d/new.txt": b"new\n",
                  "e/x.txt": b"x\n", "l": b"a file over a symlink\n", "z.txt": b"z\n"}


def _merge_dest(ws, pre=("a.txt", "d/old.txt", "l")):
    """``ws/dest`` with a kept file and the archive names in ``pre`` already there (old content)."""
    dest = ws / "dest"
    dest.mkdir(parents=True)
    (dest / "kept.txt").write_bytes(b"kept\n")
    for name in pre:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        if name == "l":
            os.symlink("kept.txt", dest / "l")
        else:
            (dest / name).write_bytes(b"old " + name.encode() + b"\n")
    return dest


def _view(top):
    """The tree under ``top``, minus the library's leftovers directly in it (``.sfs-*``, swept by the next run)."""
    return [e for e in _snapshot(top) if not e[0].split("/")[0].startswith(".sfs-")]


class _RenameFaults:
    """EIO at the nth rename the library makes (``Root.rename``'s and the checked removal's renameat2)."""

    def __init__(self, monkeypatch, nth: int) -> None:
        import errno

        from sandbox_fs import _native

        self.calls, real_raw, real = 0, _native.renameat2_raw, _native.renameat2

        def raw(*a):
            self.calls += 1
            return -errno.EIO if self.calls == nth else real_raw(*a)

        def checked(*a):
            self.calls += 1
            if self.calls == nth:
                raise OSError(errno.EIO, "injected")
            return real(*a)

        monkeypatch.setattr(_native, "renameat2_raw", raw)
        monkeypatch.setattr(_native, "renameat2", checked)


def _reset(ws, pre=("a.txt", "d/old.txt", "l")):
    import shutil

    shutil.rmtree(ws / "dest")
    return _merge_dest(ws, pre)


def test_an_error_mid_merge_moves_back_what_was_moved(tmp_path, monkeypatch):
    """Regression (found by the fault suite): an EIO on the third move into an existing destination left the
    first two in place, one of them over a pre-existing file whose old content was then lost."""
    import errno

    import pytest

    ws = tmp_path / "ws"
    dest = _merge_dest(ws)
    before = _snapshot(dest)
    data = _tar(_MERGE_ARCHIVE)
    with open_root(ws) as root:
        faults = _RenameFaults(monkeypatch, 0)
        extract(root, "dest", io.BytesIO(data))
        assert faults.calls >= 6  # the merge's moves (a.txt, b.txt, d/new.txt ...), then the staging's removal
        _reset(ws)
        _RenameFaults(monkeypatch, 3)
        with pytest.raises(OSError) as ei:
            extract(root, "dest", io.BytesIO(data))
        assert ei.value.errno == errno.EIO
        assert _view(dest) == before  # the old a.txt, no b.txt, the symlink l
        assert (dest / "a.txt").read_bytes() == b"old a.txt\n"
        monkeypatch.undo()
        extract(root, "dest", io.BytesIO(data))  # the repair
    assert not [n for n in os.listdir(dest) if n.startswith(".sfs-")]
    assert (dest / "a.txt").read_bytes() == b"new a\n" and (dest / "kept.txt").read_bytes() == b"kept\n"


def test_a_directory_swapped_in_over_a_file_being_replaced_is_a_conflict_and_kept(tmp_path, monkeypatch):
    """The replacing move exchanges names: a directory put where a file was planned comes back out, never into
    the staging tree that is removed (and the merge so far is undone)."""
    import pytest

    from sandbox_fs import Root
    from sandbox_fs.archive import UnsafeArchiveMemberError

    ws = tmp_path / "ws"
    dest = _merge_dest(ws)
    real = Root.rename
    swapped: list[bool] = []

    def rename(self, src, dst, **kw):
        if kw.get("exchange") and dst == "d/old.txt" and not swapped:
            swapped.append(True)  # another process, between the plan and the move
            os.unlink(dest / "d" / "old.txt")
            (dest / "d" / "old.txt").mkdir()
            (dest / "d" / "old.txt" / "theirs").write_bytes(b"theirs\n")
        return real(self, src, dst, **kw)

    monkeypatch.setattr(Root, "rename", rename)
    with open_root(ws) as root:
        with pytest.raises(UnsafeArchiveMemberError) as ei:
            extract(root, "dest", io.BytesIO(_tar(_MERGE_ARCHIVE)))
    assert swapped and ei.value.rule == "conflict"
    assert (dest / "d" / "old.txt" / "theirs").read_bytes() == b"theirs\n"
    assert (dest / "a.txt").read_bytes() == b"old a.txt\n" and not (dest / "b.txt").exists()
    assert not [n for n in os.listdir(dest) if n.startswith(".sfs-")]


def _extract_with_eio(root, data, monkeypatch, kind: str, nth: int) -> tuple[bool, int]:
    """Extract ``data`` into ``dest`` with an EIO at the nth ``kind`` call (0: none); (succeeded, calls made)."""
    import errno
    import types

    from sandbox_fs import _root_remove

    with monkeypatch.context() as m:
        if kind == "rename":
            faults = _RenameFaults(m, nth)
        else:
            faults = types.SimpleNamespace(calls=0)

            def failing(name, *a, _fn=getattr(os, kind), **kw):
                faults.calls += 1
                if faults.calls == nth:
                    raise OSError(errno.EIO, "injected")
                return _fn(name, *a, **kw)

            m.setattr(_root_remove, "os", types.SimpleNamespace(**{**vars(os), kind: failing}))
        try:
            extract(root, "dest", io.BytesIO(data))
        except OSError:
            return False, faults.calls
        return True, faults.calls


def test_an_eio_at_any_rename_or_removal_step_of_an_extraction_leaves_the_old_tree_or_the_new_one(tmp_path,
                                                                                                  monkeypatch):
    """Property over the fault point: an EIO at each rename, then at each mkdir / rmdir of the checked removal,
    in turn, over several destination layouts.  A failure leaves the destination as it was, a success the
    archive's tree, apart from unlocked ``.sfs-*`` leftovers directly in it; extracting again gives exactly the
    archive's tree with no ``.sfs-*`` left."""
    data = _tar(_MERGE_ARCHIVE)
    points = 0
    for i, pre in enumerate([("a.txt", "d/old.txt", "l"), (), ("a.txt", "b.txt", "z.txt"), ("d/new.txt", "l")]):
        ws = tmp_path / f"ws{i}"
        dest = _merge_dest(ws, pre)
        before = _snapshot(dest)
        with open_root(ws) as root:
            for kind in ("rename", "mkdir", "rmdir"):
                _reset(ws, pre)
                ok, calls = _extract_with_eio(root, data, monkeypatch, kind, 0)
                assert ok and calls >= 1
                after = _snapshot(dest)
                for nth in range(1, calls + 1):
                    _reset(ws, pre)
                    ok, _ = _extract_with_eio(root, data, monkeypatch, kind, nth)
                    assert _view(dest) == ([e for e in after if not e[0].startswith(".sfs-")] if ok else before), \
                        (pre, kind, nth, ok)
                    extract(root, "dest", io.BytesIO(data))  # the repair
                    assert _snapshot(dest) == after, (pre, kind, nth)
                    points += 1
    assert points >= 40


def test_a_filesystem_without_rename_exchange_still_replaces_files(tmp_path, monkeypatch):
    """EINVAL from RENAME_EXCHANGE (NFS): the replacing move falls back to a plain rename."""
    import errno

    from sandbox_fs import _native

    real = _native.renameat2_raw
    exchanges: list[int] = []

    def raw(a, b, c, d, flags):
        if flags & _native.RENAME_EXCHANGE:
            exchanges.append(flags)
            return -errno.EINVAL
        return real(a, b, c, d, flags)

    monkeypatch.setattr(_native, "renameat2_raw", raw)
    ws = tmp_path / "ws"
    dest = _merge_dest(ws)
    with open_root(ws) as root:
        extract(root, "dest", io.BytesIO(_tar(_MERGE_ARCHIVE)))
    assert len(exchanges) == 3  # a.txt, d/old.txt, l
    assert (dest / "a.txt").read_bytes() == b"new a\n" and not (dest / "l").is_symlink()
    assert not [n for n in os.listdir(dest) if n.startswith(".sfs-")]
