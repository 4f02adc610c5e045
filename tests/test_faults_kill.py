"""Fault suite, part 1: SIGKILL at seeded points of persist and of hydrate; EIO at chosen syscalls.

Both run in one long-lived worker (``tests/faults/worker.py``) with the
``LD_PRELOAD`` shim (``tests/faults/shim.c``): the worker forks a child per
point from its warmed interpreter, and the child dies by SIGKILL (or gets EIO)
at the Nth intercepted libc call (read, write, fsync, rename, open, link,
unlink, mkdir; the C module's openat2 and renameat2 through ``syscall``).
The points are drawn by a seed from the calls one clean run makes (counted
first by the shim).  After each point a second child checks that the last
good snapshot restores, that the workspace is the old one or is repaired by
re-applying, and that no temporary, fd or thread is left (see the worker's
docstring for the exact checks per operation).

Set ``SFS_FAULT_SEED`` to replay another seed (the default is fixed so a
failure replays).
"""

from __future__ import annotations

import errno
import os
import random

import pytest

from tests.faults.harness import ALL_CLASSES, SHIM_CLASSES, WorkerProcess, build_shim, mount_tmpfs, print_summary, record, unmount

SEED = int(os.environ.get("SFS_FAULT_SEED", "15"))
KILL_POINTS = 200


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    built = build_shim(tmp_path_factory.mktemp("shim"))
    if isinstance(built, str):
        pytest.skip(built)
    return built


@pytest.fixture(scope="module", autouse=True)
def print_tally(request):
    yield
    print_summary(request.config)


@pytest.fixture
def top(tmp_path):
    """A tmpfs for the scenario (fsync is free there: 200 points stay in the time budget), else tmp_path."""
    fs = tmp_path / "fs"
    if mount_tmpfs(fs, "256m") is not None:
        yield tmp_path
        return
    try:
        yield fs
    finally:
        unmount(fs)


@pytest.fixture
def worker(shim):
    w = WorkerProcess(shim)
    yield w
    assert w.children() == [], "the worker left a child process"
    w.close()


def _mounts(top) -> list[str]:
    """Mount points under ``top`` (other tests on this machine mount elsewhere meanwhile)."""
    with open("/proc/self/mountinfo") as f:
        return sorted(p for p in (line.split()[4] for line in f) if p.startswith(str(top)))


def run_points(worker: WorkerProcess, kind: str, top, action: str, mask: int, points: list[int],
               err: int = errno.EIO) -> dict:
    mounts = _mounts(top)
    res = worker.call("batch", action=action, mask=mask, points=points, err=err)
    assert _mounts(top) == mounts, "a mount was left behind"
    survived = len(points) - len({p.split(":")[0] for p in res["problems"]})
    record(f"{action} {kind}", len(points), max(survived, 0))
    return res


@pytest.mark.parametrize("kind", ["persist", "hydrate"])
def test_sigkill_at_seeded_points_leaves_the_snapshot_restorable_and_the_workspace_repairable(
        worker, top, kind):
    assert worker.call("setup", kind=kind, top=str(top))["ok"]
    counted = worker.call("count", mask=ALL_CLASSES)
    assert counted["outcome"] == "ok" and counted["problems"] == []
    calls = counted["calls"]
    assert calls >= KILL_POINTS, f"{kind} of the test tree makes only {calls} intercepted calls"
    points = sorted(random.Random(f"{SEED}:{kind}").sample(range(1, calls + 1), KILL_POINTS))
    res = run_points(worker, kind, top, "kill", ALL_CLASSES, points)
    assert res["problems"] == []
    # Points near the end can land in a helper thread's calls after the last one counted:
    # nearly every point must have killed the operation.
    assert res["tally"].get("killed", 0) >= KILL_POINTS * 85 // 100, res["tally"]
    if kind == "hydrate":
        print(f"hydrate kills that left a half-swapped workspace (repaired by re-hydrating): {res['mixed']}")


EIO_CLASSES = ["read", "write", "fsync", "rename", "open", "names"]
# (an EIO inside Root's checked removal left its '.sfs-rm-*', and one mid-merge into an existing
# destination a partial merge: both cases were xfails until the removal's private directories were
# locked and swept, and the merge undone on an error; see test_archive_staging.py)
EIO_CASES = [(kind, cls) for kind in ("persist", "hydrate", "extract", "materialize") for cls in EIO_CLASSES]
#: materialize's classes whose failing calls are few among calls it redoes (see below)
_REDONE = {("materialize", "rename"), ("materialize", "open"), ("materialize", "names")}


@pytest.mark.parametrize(("kind", "cls"), EIO_CASES)
def test_eio_at_chosen_syscalls_is_an_error_with_nothing_lost_or_leaked(worker, top, kind, cls):
    assert worker.call("setup", kind=kind, top=str(top))["ok"]
    rng = random.Random(f"{SEED}:eio:{kind}:{cls}")
    mask = SHIM_CLASSES[cls]
    counted = worker.call("count", mask=mask)
    assert counted["outcome"] == "ok" and counted["problems"] == []
    calls = counted["calls"]
    if calls == 0:
        pytest.skip(f"{kind} makes no {cls} call here")
    # the first and last call of the class, and a few drawn between them
    points = sorted({1, calls} | set(rng.sample(range(1, calls + 1), min(calls, 2))))
    res = run_points(worker, kind, top, "fail", mask, points)
    assert res["problems"] == []
    assert set(res["tally"]) <= {"ok", "error"}, res["tally"]
    # An injected error surfaces as an error, except where the library retries or the call is
    # best effort (the removal of a temporary after success): at least one of the points fails.
    # Not for materialize's renames, opens and namespace changes: its copier threads order the
    # calls differently between runs, and its per-file path redoes what a batched copy could not,
    # so every point drawn may land on such a call (the few that fail it, such as two atomic
    # writes and the archive's moves, fall anywhere among the copies' calls); what each point
    # left is checked above all the same.
    if (kind, cls) in _REDONE:
        return
    # Which call a point's number lands on depends on thread order (materialize's copiers, the
    # writer threads): under load every drawn point of materialize's writes sometimes hit a call its
    # per-file path redoes (point 1 failed it in 7 of 25 runs, points 14 and 24 in none).  So more
    # points are drawn, in a seeded order, until one fails, at most every call: a library that
    # absorbs every injected error of the class still fails here.  Each extra point is checked as above.
    if res["tally"].get("error", 0) == 0:
        rest = [p for p in rng.sample(range(1, calls + 1), calls) if p not in points]
        for p in rest:
            more = run_points(worker, kind, top, "fail", mask, [p])
            assert more["problems"] == [], more["problems"]
            if more["tally"].get("error", 0):
                break
        else:
            pytest.fail(f"no {cls} call of {kind} made it fail: {res['tally']} and {len(rest)} more points ok")


def test_a_commit_killed_while_writing_the_metadata_leaves_nothing_the_next_commit_keeps(tmp_path):
    """Regression (found by the SIGKILL batch): the metadata's temporary had a random name nothing removed."""
    import signal

    from sandbox_fs import open_root
    from sandbox_fs.snapshot import LocalSnapshotStore, persist

    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "f").write_bytes(b"one")
    store_dir = tmp_path / "store"
    with open_root(tmp_path / "ws") as ws, LocalSnapshotStore(store_dir) as store:
        persist(ws, store, "snap")
    (tmp_path / "ws" / "f").write_bytes(b"two")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child dies at its third fsync: the new metadata's temporary
        calls = [0]
        real = os.fsync

        def fsync(fd):
            calls[0] += 1
            if calls[0] == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            real(fd)

        os.fsync = fsync
        with open_root(tmp_path / "ws") as ws, LocalSnapshotStore(store_dir) as store:
            persist(ws, store, "snap")
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    with open_root(tmp_path / "ws") as ws, LocalSnapshotStore(store_dir) as store:
        assert store.info("snap").generation == 1  # killed before the commit point
        info = persist(ws, store, "snap").info
    assert sorted(os.listdir(store_dir)) == sorted(["snap.json", "snap.lock", info.archive])


def test_a_checked_rmdir_whose_move_fails_leaves_no_private_directory(tmp_path, monkeypatch):
    """Regression (found by the EIO batch): an EIO on the move into ``.sfs-rm-*`` left that directory for good."""
    from sandbox_fs import _native, _root_remove, open_root

    (tmp_path / "d").mkdir()
    real = _native.renameat2

    def failing(*a, **k):
        raise OSError(errno.EIO, "injected")

    with open_root(tmp_path) as root:
        ident = root.lstat("d")
        monkeypatch.setattr(_root_remove._native, "renameat2", failing)
        with pytest.raises(OSError) as ei:
            root.rmdir("d", expect=(ident.st_dev, ident.st_ino))
        assert ei.value.errno == errno.EIO
        monkeypatch.setattr(_root_remove._native, "renameat2", real)
        assert sorted(os.listdir(tmp_path)) == ["d"]  # the directory kept, no .sfs-rm-* beside it
        root.rmdir("d", expect=(ident.st_dev, ident.st_ino))
    assert os.listdir(tmp_path) == []
