"""Fault suite, part 3: I/O faults through the FUSE overlay's fault rules during materialize, persist and hydrate.

The workspace is served by an overlay daemon (:class:`sandbox_fs.fuse.Overlay`)
and each operation works on ``overlay.root`` while a :class:`FaultRule` makes
chosen FUSE operations fail (EIO, ENOSPC, EACCES; once, or every time).  After
each case the rules are cleared and the same checks as the rest of the suite
run: the last good snapshot restores (into a plain directory), the operation
applied again repairs the workspace, no ``.sfs-*`` temporary is left in the
backing directory, this process keeps no extra fd, and the daemon is alive;
after the overlay closes, its mount and process are gone.

Needs root, /dev/fuse and pyfuse3 (skipped with the reason otherwise).
"""

from __future__ import annotations

import errno
import importlib.util
import os

import pytest
import trio

from sandbox_fs import open_root
from sandbox_fs.errors import SandboxError
from sandbox_fs.manifest import load_manifest
from sandbox_fs.materialize import MaterializeOptions, materialize
from sandbox_fs.snapshot import LocalSnapshotStore, hydrate, persist
from tests.faults.harness import print_summary, record
from tests.faults.worker import empty_dir, fill_tree, host_view, leftovers

if not os.path.exists("/dev/fuse"):
    pytest.skip("the FUSE overlay needs /dev/fuse", allow_module_level=True)
if os.geteuid() != 0:
    pytest.skip("the FUSE overlay daemon needs root (fsopen needs CAP_SYS_ADMIN)", allow_module_level=True)
if importlib.util.find_spec("pyfuse3") is None:
    pytest.skip("the FUSE overlay needs pyfuse3 (the fuse extra)", allow_module_level=True)

from sandbox_fs.fuse import FaultRule, Overlay, OverlayPolicy  # noqa: E402

E = {"EIO": errno.EIO, "ENOSPC": errno.ENOSPC, "EACCES": errno.EACCES}
# (ops, errno name, times): each rule applies to the whole workspace ("")
WRITE_RULES = [({"create"}, "EIO", 1), ({"write"}, "ENOSPC", 1), ({"mkdir"}, "EIO", 1), ({"rename"}, "EIO", 1),
               ({"setattr"}, "EACCES", 1), ({"write"}, "EIO", None), ({"unlink", "rmdir"}, "EIO", 1),
               ({"symlink", "link"}, "EIO", 1)]
READ_RULES = [({"open"}, "EIO", 1), ({"read"}, "EIO", 1), ({"readdir"}, "EIO", 1), ({"lookup"}, "EIO", 1),
              ({"getattr"}, "EIO", 3), ({"read"}, "EIO", None), ({"opendir"}, "EACCES", 1)]


OUTCOMES: list[str] = []


def _fds() -> dict[int, str]:
    """This process's open fds and what each one refers to."""
    out = {}
    for n in os.listdir("/proc/self/fd"):
        try:
            out[int(n)] = os.readlink(f"/proc/self/fd/{n}")
        except OSError:  # the listing's own fd, closed by now
            pass
    return out


@pytest.fixture(scope="module", autouse=True)
def print_tally(request):
    yield
    print_summary(request.config)


@pytest.fixture
async def served(tmp_path):
    ws_dir = tmp_path / "ws"
    ws_dir.mkdir()
    ws = open_root(ws_dir)
    ov = await Overlay.start(ws, policy=OverlayPolicy())
    try:
        yield ws_dir, ov
    finally:
        pid = ov.pid
        await ov.aclose()
        ws.close()
        assert not os.path.exists(f"/proc/{pid}/status") or "State:\tZ" in open(f"/proc/{pid}/status").read()
        with open("/proc/self/mountinfo") as f:
            assert str(ws_dir) not in f.read()


async def _case(ov, rules, op, check) -> list[str]:
    """Run ``op`` under ``rules``, clear them, then ``check(outcome)``: the problems found."""
    fds = _fds()
    await ov.set_faults([FaultRule(ops=frozenset(o), path="", errno=E[e], times=t) for o, e, t in rules])
    problems = []
    try:
        await op()
        outcome = "ok"
    except (SandboxError, OSError) as exc:
        outcome = "error"
        if isinstance(exc, OSError) and not isinstance(exc, SandboxError) and exc.errno not in set(E.values()) \
                | {errno.ENOENT, errno.ENOTEMPTY}:
            problems.append(f"unexpected error {exc!r}")
    finally:
        await ov.set_faults([])
    problems += await check(outcome)
    now = _fds()
    if now != fds:
        problems.append(f"{rules}: an fd was left open: {sorted(set(now.items()) - set(fds.items()))}, "
                        f"closed: {sorted(set(fds.items()) - set(now.items()))}")
    if not ov.alive:
        problems.append("the overlay daemon died")
    OUTCOMES.append(outcome)
    return problems


def _tally(kind: str, results: list[list[str]]) -> None:
    record(f"overlay {kind}", len(results), sum(1 for r in results if not r))
    errors = OUTCOMES.count("error")
    OUTCOMES.clear()
    # the rules did fire: most cases end in an error (a few faults land where a retry or a
    # best-effort step absorbs them)
    assert errors >= len(results) // 2, (kind, errors, len(results))


async def test_overlay_faults_during_persist_keep_the_last_snapshot_and_leak_nothing(served, tmp_path):
    ws_dir, ov = served
    store_dir, check_dir = tmp_path / "store", tmp_path / "check"
    check_dir.mkdir()
    fill_tree(ws_dir, "ws", files=20)
    run = lambda: trio.to_thread.run_sync(_persist, ov.root, store_dir)  # noqa: E731
    await run()
    results = []
    for i, rule in enumerate(READ_RULES):
        old = host_view(ws_dir)
        (ws_dir / "src" / "counter.txt").write_text(f"{i}\n")
        new = host_view(ws_dir)

        async def check(outcome, old=old, new=new):
            problems = []
            restored = await trio.to_thread.run_sync(_restore, store_dir, check_dir)
            if restored not in (old, new) or (outcome == "ok" and restored != new):
                problems.append(f"{rule}: the current snapshot restores to another tree")
            await run()  # the repair
            if await trio.to_thread.run_sync(_restore, store_dir, check_dir) != new:
                problems.append(f"{rule}: persisting again did not save the workspace")
            if leftovers(ws_dir) or [n for n in os.listdir(store_dir) if n.startswith(".")]:
                problems.append(f"{rule}: temporaries left")
            return problems

        results.append(await _case(ov, [rule], run, check))
    _tally("persist", results)
    assert [p for r in results for p in r] == []


async def test_overlay_faults_during_hydrate_leave_a_repairable_workspace(served, tmp_path):
    ws_dir, ov = served
    store_dir = tmp_path / "store"
    fill_tree(ws_dir, "target", files=20)
    await trio.to_thread.run_sync(_persist, ov.root, store_dir, "snap")
    target = host_view(ws_dir)
    empty_dir(ws_dir)
    fill_tree(ws_dir, "before", files=6)
    await trio.to_thread.run_sync(_persist, ov.root, store_dir, "before")
    before = host_view(ws_dir)
    run = lambda name="snap": trio.to_thread.run_sync(_hydrate, ov.root, store_dir, name)  # noqa: E731
    results = []
    for rule in WRITE_RULES:
        async def check(outcome, rule=rule):
            problems = []
            if outcome == "ok" and {k: v for k, v in host_view(ws_dir).items() if ".sfs-" not in k} != target:
                problems.append(f"{rule}: hydrate succeeded with another tree")
            await run()  # the repair
            if host_view(ws_dir) != target or leftovers(ws_dir):
                problems.append(f"{rule}: hydrating again did not repair the workspace")
            await run("before")
            if host_view(ws_dir) != before:
                problems.append(f"{rule}: the previous snapshot did not restore")
            return problems

        results.append(await _case(ov, [rule], run, check))
    _tally("hydrate", results)
    assert [p for r in results for p in r] == []


async def test_overlay_faults_during_materialize_leave_a_repairable_workspace(served, tmp_path):
    ws_dir, ov = served
    base = tmp_path / "base"
    fill_tree(base / "proj", "base", files=20)
    manifest = load_manifest({"entries": {"proj": {"type": "local_dir", "src": "proj"},
                                          "one.bin": {"type": "local_file", "src": "proj/data/big.bin"},
                                          "notes/readme.txt": {"type": "file", "content": "hello\n"}}})

    async def run():
        await materialize(ov.root, manifest, MaterializeOptions(base_dir=str(base)))

    await run()
    after = host_view(ws_dir)
    empty_dir(ws_dir)
    results = []
    for rule in WRITE_RULES:
        async def check(outcome, rule=rule):
            problems = []
            if outcome == "ok" and host_view(ws_dir) != after:
                problems.append(f"{rule}: materialize succeeded with another tree")
            await run()  # the repair: applying again over what the fault left
            if host_view(ws_dir) != after or leftovers(ws_dir):
                problems.append(f"{rule}: applying again did not repair the workspace")
            empty_dir(ws_dir)
            return problems

        results.append(await _case(ov, [rule], run, check))
    _tally("materialize", results)
    assert [p for r in results for p in r] == []


def _persist(root, store_dir, name="snap"):
    with LocalSnapshotStore(store_dir) as store:
        persist(root, store, name)


def _hydrate(root, store_dir, name):
    with LocalSnapshotStore(store_dir, create=False) as store:
        hydrate(root, store, name)


def _restore(store_dir, check_dir):
    empty_dir(check_dir)
    with open_root(check_dir) as ck, LocalSnapshotStore(store_dir, create=False) as store:
        hydrate(ck, store, "snap")
    return host_view(check_dir)
