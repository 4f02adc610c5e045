"""Fault suite, part 2: a full disk (ENOSPC on a small tmpfs) and too many open files (EMFILE).

Same worker and checks as ``test_faults_kill.py`` (see ``tests/faults/worker.py``):

* ENOSPC: the scenario lives on a tmpfs this test mounts; before each run the
  worker shrinks it (``mount -o remount,size=``) to what is in use plus a
  chosen number of free bytes (0 to 512 KiB), so the disk fills at a different
  point of extract, materialize, persist (the store is full) and hydrate (the
  workspace is), then grows it back for the checks and the repair.
* EMFILE: the fault child lowers ``RLIMIT_NOFILE`` to its highest open fd plus
  0..N before the operation (the limit is the child's own, gone with it).

Skipped with the reason where a tmpfs cannot be mounted (not root) or the
shim cannot be built.
"""

from __future__ import annotations

import pytest

from tests.faults.harness import WorkerProcess, build_shim, mount_tmpfs, print_summary, record, unmount

FREE_BYTES = [0, 4096, 16384, 65536, 131072, 524288]
EXTRA_FDS = [0, 1, 2, 4, 6, 8]


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
def fs(tmp_path):
    where = tmp_path / "fs"
    reason = mount_tmpfs(where, "256m")
    if reason is not None:
        pytest.skip(reason)
    try:
        yield where
    finally:
        unmount(where)


@pytest.fixture
def worker(shim):
    w = WorkerProcess(shim)
    yield w
    assert w.children() == [], "the worker left a child process"
    w.close()


def _survived(points: int, problems: list[str]) -> int:
    return max(points - len({p.split(":")[0] for p in problems}), 0)


@pytest.mark.parametrize("kind", ["persist", "hydrate", "extract", "materialize"])
def test_a_full_disk_is_an_error_that_loses_and_leaks_nothing(worker, fs, kind):
    assert worker.call("setup", kind=kind, top=str(fs))["ok"]
    res = worker.call("batch", action="none", mask=0, points=FREE_BYTES, shrink=str(fs))
    record(f"enospc {kind}", res["tally"].get("error", 0), _survived(res["tally"].get("error", 0), res["problems"]))
    assert res["problems"] == []
    assert set(res["tally"]) <= {"ok", "error"}, res["tally"]
    assert res["tally"].get("error", 0) >= 3, res  # the disk did fill at several points


@pytest.mark.parametrize("kind", ["persist", "hydrate", "extract", "materialize"])
def test_too_many_open_files_is_an_error_that_loses_and_leaks_nothing(worker, fs, kind):
    assert worker.call("setup", kind=kind, top=str(fs))["ok"]
    res = worker.call("batch", action="none", mask=0, points=[], nofile=EXTRA_FDS)
    record(f"emfile {kind}", res["tally"].get("error", 0), _survived(res["tally"].get("error", 0), res["problems"]))
    assert res["problems"] == []
    assert set(res["tally"]) <= {"ok", "error"}, res["tally"]
    assert res["tally"].get("error", 0) >= 1, res  # the limit was reached at least once
