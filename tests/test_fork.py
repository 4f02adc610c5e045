"""Fork (issue 16 item 4): a new session seeded from another's snapshot, sharing its stored objects.

Isolation both ways; the source's retention, gc and removal never break a
fork's restore (and a fork's own pruning and removal never break the
source's); the hold protocol against a source that prunes mid-fork; stale
and unreadable holds; forged pointers; tampered states; the version-1
directory store (copied); the command line; and S3 with two machines.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_snapshot_generations import DictObjects

from sandbox_fs import open_root
from sandbox_fs.client import ClientOptions, LocalSandboxClient, SessionStateTamperedError
from sandbox_fs.errors import InvalidPathError
from sandbox_fs.session import SessionError, SnapshotGenerationError
from sandbox_fs.snapshot import (
    GenerationStore,
    LocalObjects,
    LocalSnapshotStore,
    SnapshotConflictError,
    SnapshotCorruptError,
    SnapshotNotFoundError,
    fork_snapshot,
    hydrate,
    persist,
    tree_digest,
)

KEY = b"k" * 32
BIG = 256 * 1024  # a rewrite of the big file is more than half the base: the next persist is a full generation


def _client(tmp_path: Path, which: str, store: Any = None, **kw: Any) -> LocalSandboxClient:
    if store is None:
        store = GenerationStore(LocalObjects(tmp_path / "objects"), keep=2)
    return LocalSandboxClient(ClientOptions(workspaces_dir=str(tmp_path / f"ws-{which}"), snapshot_store=store,
                                            state_key=KEY, **kw))


def _keys(store: GenerationStore, prefix: str) -> list[str]:
    return [o.key for o in store.objects.list(prefix)]


def _gen_dirs(store: GenerationStore, name: str) -> set[str]:
    return {k.split("/")[2] for k in _keys(store, f"{name}/gen/")}


async def _source(client: LocalSandboxClient, files: dict[str, bytes]) -> tuple[Any, dict[str, Any]]:
    async with client.create() as s:
        for path, data in files.items():
            await s.write(path, data)
    return s, client.serialize_state(s)


async def _read_all(client: LocalSandboxClient, state: dict[str, Any], *paths: str) -> dict[str, bytes | None]:
    """Resume ``state`` (rebuilding its workspace from the store when it is gone), read ``paths``, close.

    The state is updated in place (closing persisted a new generation).
    """
    out: dict[str, bytes | None] = {}
    async with client.resume(state) as s:
        for p in paths:
            out[p] = await s.read(p) if p in {e.name for e in await s.ls()} else None
    state.update(client.serialize_state(s))
    return out


# ------------------------------------------------------------- sessions over a local object directory


async def test_fork_shares_objects_and_changes_never_cross(tmp_path: Path) -> None:
    with _client(tmp_path, "a") as a, _client(tmp_path, "b") as b:
        src, s1 = await _source(a, {"f": b"base", "keep": b"k"})
        src_pointer = a.store.objects.head(f"{src.id}/current")
        f1 = await a.fork(s1)
        assert f1["session_id"] != s1["session_id"] and f1["workspace_id"] != s1["workspace_id"]
        assert f1["generation"] == s1["generation"] and f1["snapshot_digest"] == s1["snapshot_digest"]
        fid = f1["session_id"]
        store = a.store
        # nothing copied: the fork has a pointer only, and a hold beside the source's objects
        assert _keys(store, f"{fid}/") == [f"{fid}/current"]
        assert _keys(store, f"{src.id}/holds/") == [f"{src.id}/holds/{fid}"]
        assert not (tmp_path / "ws-a" / fid).exists()  # the workspace comes with the first resume

        async with b.resume(f1) as r:  # another machine
            assert r.start_mode == "restored" and await r.read("f") == b"base"
            await r.write("f", b"fork")
            await r.write("only-fork", b"x")
        f1 = b.serialize_state(r)
        assert f1["generation"] == s1["generation"] + 1
        assert store.objects.head(f"{src.id}/current") == src_pointer  # the fork never wrote the source's pointer
        assert len(_gen_dirs(store, fid)) == 1  # its own layer, under its own name

        async with a.resume(s1) as s:
            assert await s.read("f") == b"base" and "only-fork" not in {e.name for e in await s.ls()}
            await s.write("f", b"source 2")
        s2 = a.serialize_state(s)
        f2 = await b.fork(s2)  # a second fork, of the changed source
        assert (await _read_all(b, f2, "f", "only-fork")) == {"f": b"source 2", "only-fork": None}
        assert (await _read_all(a, f1, "f", "keep")) == {"f": b"fork", "keep": b"k"}  # rebuilt on machine a
        assert (await _read_all(a, a.serialize_state(s), "f", "only-fork")) == {"f": b"source 2", "only-fork": None}


def _churn(store: GenerationStore, name: str, ws_dir: Path, rounds: int, *, big: bool = True) -> None:
    """Persist ``name`` ``rounds`` times; ``big``: each rewrites the big file.

    From a full generation, two big rounds make a layer as large as the base
    and then a full generation (compaction), so with ``keep`` 2 a third
    round drops the first two from the pointer.
    """
    ws_dir.mkdir(exist_ok=True)
    with open_root(ws_dir) as ws:
        for i in range(rounds):
            if big:
                (ws_dir / "big").write_bytes(os.urandom(BIG))
            (ws_dir / "n").write_text(str(i))
            time.sleep(0.025)  # a coarse clock tick: no file is racy (re-read) in the next persist's walk
            persist(ws, store, name)


async def test_source_retention_gc_and_removal_never_break_the_fork(tmp_path: Path) -> None:
    with _client(tmp_path, "a") as a, _client(tmp_path, "b") as b:
        src, s1 = await _source(a, {"f": b"base", "big": os.urandom(BIG)})
        store = a.store
        f1 = await a.fork(s1)
        forked_dir = _gen_dirs(store, src.id)
        assert len(forked_dir) == 1
        # the source moves on past its retention: generation 1 leaves its pointer, its objects stay (held)
        _churn(store, src.id, tmp_path / "src-ws", 3)
        assert store.kept(src.id) == [4, 3] and 1 not in [e.generation for e in store._pointer(src.id)[0].generations]
        assert forked_dir <= _gen_dirs(store, src.id)
        rep = store.gc(now=time.time() + 7200)
        assert rep.holds == 0 and not any(k.split("/")[2] in forked_dir for k in rep.objects)
        assert (await _read_all(b, f1, "f")) == {"f": b"base"}
        # the source is deleted (pointer and unheld objects), then gc again: the fork still restores
        await a.delete(src, snapshot=True)
        assert store.info(src.id) is None and _gen_dirs(store, src.id) == forked_dir
        store.gc(now=time.time() + 7200)
        shutil.rmtree(tmp_path / "ws-b" / f1["session_id"])  # a rebuild from the store
        assert (await _read_all(b, f1, "f")) == {"f": b"base"}
        # the fork moves on past its retention too: the source's last objects and the hold go
        _churn(store, f1["session_id"], tmp_path / "fork-ws", 3)
        assert _keys(store, f"{src.id}/") == []


def test_fork_of_a_fork_and_removals_in_any_order(tmp_path: Path) -> None:
    store = GenerationStore(LocalObjects(tmp_path / "objects"), keep=2)
    ws_dir, out_dir = tmp_path / "ws", tmp_path / "out"
    out_dir.mkdir()
    with store, open_root(out_dir) as out:
        _churn(store, "src", ws_dir, 1)
        _churn(store, "src", ws_dir, 1, big=False)  # generation 2: a small layer over 1
        info = store.fork("src", "f1")
        assert info.name == "f1" and info.generation == 2
        _churn(store, "f1", tmp_path / "f1-ws", 1, big=False)  # f1's generation 3: its own layer over src's chain
        second = store.fork("f1", "f2")
        assert second.generation == 3
        assert {k.rsplit("/", 1)[1] for k in _keys(store, "src/holds/")} == {"f1", "f2"}
        assert _keys(store, "f1/holds/") == ["f1/holds/f2"]
        want = tree_digest(open_root(tmp_path / "f1-ws"))
        store.remove("f1")
        store.remove("src")
        store.gc(now=time.time() + 7200)
        assert hydrate(out, store, "f2").generation == 3 and tree_digest(out) == want
        store.remove("f2")
        assert _keys(store, "") == []  # the last holder removed: every shared object went with it


def test_a_source_that_prunes_mid_fork_is_a_conflict_and_loses_nothing(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    store = GenerationStore(LocalObjects(tmp_path / "objects"), keep=1)
    _churn(store, "src", tmp_path / "ws", 1)
    real = store._new_hold

    def hold_then_prune(owner: str, holder: str, dirs: set[str], ctx: dict[str, Any]) -> None:
        real(owner, holder, dirs, ctx)
        _churn(store, "src", tmp_path / "ws", 2)  # a layer, then a full one: with keep=1, 1 and 2 are dropped

    monkeypatch.setattr(store, "_new_hold", hold_then_prune)
    with store:
        with pytest.raises(SnapshotConflictError):
            store.fork("src", "f")
        assert store.objects.head("f/current") is None and _keys(store, "src/holds/") == []
        assert len(_gen_dirs(store, "src")) == 2  # 1 was held when the source pruned it (now an orphan), and 3
        store.gc(now=time.time() + 7200)
        assert len(_gen_dirs(store, "src")) == 1


def test_stale_and_unreadable_holds(tmp_path: Path) -> None:
    from sandbox_fs.snapshot._holds import hold_key, write_hold

    store = GenerationStore(LocalObjects(tmp_path / "objects"), keep=1)
    with store:
        _churn(store, "src", tmp_path / "ws", 1)
        (old,) = _gen_dirs(store, "src")
        # a holder that crashed between its hold and its pointer (or never released it)
        write_hold(store.objects, "src", "gone", {old})
        _churn(store, "src", tmp_path / "ws", 2)  # 1 leaves the pointer: kept for the hold
        assert store.gc().holds == 0 and old in _gen_dirs(store, "src")  # young: maybe a fork under way
        store.objects.put_bytes(hold_key("src", "junk"), b"{not json")
        assert store.gc(now=time.time() + 7200).objects == [] and old in _gen_dirs(store, "src")  # keeps all
        store.objects.delete(hold_key("src", "junk"))
        rep = store.gc(now=time.time() + 7200)
        assert rep.holds == 1 and old not in _gen_dirs(store, "src") and _keys(store, "src/holds/") == []


@pytest.mark.parametrize("change", ["origin-self", "origin-v1", "dup-dir"])
def test_forged_fork_pointers_are_corrupt(tmp_path: Path, change: str) -> None:
    store = GenerationStore(LocalObjects(tmp_path / "objects"))
    with store:
        _churn(store, "src", tmp_path / "ws", 1)
        store.fork("src", "f")
        ptr = json.loads(store.objects.get_bytes("f/current", 1 << 20))
        assert ptr["version"] == 2 and ptr["generations"][0]["origin"] == "src"
        if change == "origin-self":
            ptr["generations"][0]["origin"] = "f"
        elif change == "origin-v1":
            ptr["version"] = 1
        else:
            ptr["generations"].append(dict(ptr["generations"][0], generation=0))
        store.objects.put_bytes("f/current", json.dumps(ptr).encode())
        with pytest.raises(SnapshotCorruptError):
            store.info("f")


def test_fork_names_are_checked(tmp_path: Path) -> None:
    store = GenerationStore(LocalObjects(tmp_path / "objects"))
    with store:
        _churn(store, "src", tmp_path / "ws", 1)
        store.fork("src", "f")
        for target in ("src", "f"):
            with pytest.raises(SnapshotConflictError):
                store.fork("src", target)
        with pytest.raises(SnapshotConflictError):  # a fork of f can never be named after its origin
            store.fork("f", "src")
        with pytest.raises(InvalidPathError):
            store.fork("src", "../x")
        with pytest.raises(SnapshotCorruptError):
            store.fork("src", "g", digest="0" * 64)
        assert sorted(i.name for i in store.list()) == ["f", "src"]


# ------------------------------------------------------------- the state: MAC, binding, refusals


async def test_tampered_stale_and_foreign_states_are_refused(tmp_path: Path) -> None:
    from sandbox_fs.client import SessionStateError

    with _client(tmp_path, "a") as a:
        src, s1 = await _source(a, {"f": b"base"})
        for field, value in (("session_id", "other"), ("snapshot_digest", "0" * 64), ("generation", 7)):
            with pytest.raises(SessionStateTamperedError):
                await a.fork({**s1, field: value})
        other = LocalSandboxClient(ClientOptions(workspaces_dir=str(tmp_path / "ws-o"), state_key=b"o" * 32,
                                                 snapshot_store=a.store))
        with other, pytest.raises(SessionStateTamperedError):
            await other.fork(s1)
        with pytest.raises(SessionStateError):  # authority fields stay refused, also under a valid MAC
            await a.fork(a.sign_state({**s1, "root": "/"}))
        for sid in (src.id, "../x", "a/b"):
            with pytest.raises((SessionError, InvalidPathError)):
                await a.fork(s1, session_id=sid)
        f1 = await a.fork(s1, session_id="mine")
        assert f1["session_id"] == "mine"
        with pytest.raises(SessionStateTamperedError):  # the fork's state is bound by the MAC like any
            a.resume({**f1, "session_id": src.id})
        async with a.resume(s1) as s:
            await s.write("f", b"newer")
        with pytest.raises(SnapshotGenerationError):  # a stale state of the source
            await a.fork(s1)
        assert len([k for k in _keys(a.store, "") if k.endswith("/current")]) == 2  # nothing was made


async def test_no_store_is_a_clear_refusal(tmp_path: Path) -> None:
    from sandbox_fs.snapshot import NoSnapshot

    with _client(tmp_path, "a", store=NoSnapshot()) as a:
        _src, s1 = await _source(a, {"f": b"x"})
        with pytest.raises(SessionError, match="snapshot store"):
            await a.fork(s1)


async def test_version_1_directory_store_copies_through_the_store(tmp_path: Path) -> None:
    with LocalSnapshotStore(tmp_path / "snaps") as store, _client(tmp_path, "a", store=store) as a:
        src, s1 = await _source(a, {"f": b"base"})
        f1 = await a.fork(s1)
        assert f1["generation"] == 1 and f1["snapshot_digest"] != s1["snapshot_digest"]
        assert (tmp_path / "snaps" / f"{f1['session_id']}.json").exists()
        async with a.resume(f1) as r:
            assert await r.read("f") == b"base"
            await r.write("f", b"fork")
        await a.delete(src, snapshot=True)  # the copy does not need the source
        shutil.rmtree(tmp_path / "ws-a" / f1["session_id"])
        assert (await _read_all(a, a.serialize_state(r), "f")) == {"f": b"fork"}
        with pytest.raises(SnapshotConflictError):
            fork_snapshot(a.store, f1["session_id"], f1["session_id"])


# ------------------------------------------------------------- the command line


def _cli(capsys: Any, *argv: str) -> tuple[int, str, str]:
    from sandbox_fs.cli import main

    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_session_fork_and_one_line_refusals(tmp_path: Path, capsys: Any) -> None:
    key = tmp_path / "key"
    key.write_bytes(KEY)
    state, forked = tmp_path / "s.json", tmp_path / "f.json"
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps({"entries": {"hello.txt": {"type": "file", "content": "hi"}}}))
    common = ["--workspaces-dir", str(tmp_path / "wsd"), "--store", str(tmp_path / "store"),
              "--state-key-file", str(key)]
    rc, out, err = _cli(capsys, "session", "create", *common, "--manifest", str(manifest), "--state", str(state))
    assert rc == 0, err
    rc, out, err = _cli(capsys, "session", "fork", *common, "--state", str(state), "--state-out", str(forked),
                        "--json")
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["action"] == "fork" and rep["session_id"] == json.loads(forked.read_text())["session_id"]
    rc, out, err = _cli(capsys, "session", "resume", *common, "--state", str(forked), "--json")
    assert rc == 0 and json.loads(out)["start_mode"] == "restored", err
    assert (tmp_path / "wsd" / rep["session_id"] / "hello.txt").read_text() == "hi"
    for dirpath, _dirs, files in os.walk(tmp_path / "store"):  # two hours old: past any grace
        for name in files:
            os.utime(os.path.join(dirpath, name), (time.time() - 7200,) * 2)
    rc, out, err = _cli(capsys, "snapshot", "gc", "--store", str(tmp_path / "store"), "--json")
    assert rc == 0 and json.loads(out)["holds"] == 0, err  # the directory store shares: the fork holds the source
    assert len(list((tmp_path / "store" / json.loads(state.read_text())["session_id"] / "holds").iterdir())) == 1

    tampered = tmp_path / "t.json"
    tampered.write_text(json.dumps({**json.loads(state.read_text()), "session_id": "evil"}))
    source_id = json.loads(state.read_text())["session_id"]
    cases = [
        (["--state", str(tampered)], common, "session_state_tampered"),
        (["--state", str(state), "--session-id", source_id], common, "session"),
        (["--state", str(state), "--session-id", "../up"], common, "invalid_path"),
        (["--state", str(state)], [c for c in common if c not in ("--store", str(tmp_path / "store"))], "needs --store"),
    ]
    for extra, args, want in cases:
        rc, out, err = _cli(capsys, "session", "fork", *args, *extra, "--state-out", str(tmp_path / "x.json"))
        lines = err.strip().splitlines()
        assert rc != 0 and len(lines) == 1 and want in lines[0] and "Traceback" not in err, err
        assert not (tmp_path / "x.json").exists()


# ------------------------------------------------------------- S3: two machines, one bucket


async def test_fork_on_s3_between_two_machines(tmp_path: Path, s3_server: Any) -> None:
    pytest.importorskip("boto3", reason="boto3 (the s3 extra) is not installed")
    import _seaweed

    from sandbox_fs.snapshot import S3Objects, S3Options, S3SnapshotStore

    opts = S3Options(endpoint_url=s3_server.endpoint, region_name="us-east-1", aws_access_key_id=_seaweed.ACCESS_KEY,
                     aws_secret_access_key=_seaweed.SECRET_KEY)
    bucket, prefix = "sfs-fork-tests", f"fork-{os.getpid()}-{time.time_ns()}"
    objs = S3Objects(bucket, options=opts)
    try:
        objs._client.create_bucket(Bucket=bucket)
    except Exception as exc:
        if "BucketAlreadyOwnedByYou" not in repr(exc) and "BucketAlreadyExists" not in repr(exc):
            raise
    finally:
        objs.close()

    async def two_machines(attempt: int) -> None:
        # a run the shared server failed transiently is run again from scratch (_seaweed.arerun_transient)
        top, where = tmp_path / f"run{attempt}", f"{prefix}-{attempt}"
        top.mkdir()

        def machine(which: str) -> LocalSandboxClient:
            return _client(top, which, store=S3SnapshotStore(bucket, where, options=opts, check=True))

        with machine("a") as a, machine("b") as b:
            src, s1 = await _source(a, {"f": b"base", "big": os.urandom(BIG)})
            f1 = await a.fork(s1)
            assert _keys(a.store, f"{f1['session_id']}/") == [f"{f1['session_id']}/current"]
            async with b.resume(f1) as r:
                assert await r.read("f") == b"base"
                await r.write("f", b"fork on b")
            f1 = b.serialize_state(r)
            _churn(a.store, src.id, top / "src-ws", 3)  # the source's retention drops the forked generation
            a.store.gc(now=time.time() + 7200)
            await a.delete(src, snapshot=True)
            shutil.rmtree(top / "ws-b" / f1["session_id"])
            got = await _read_all(a, f1, "f", "big")  # machine a rebuilds the fork from the bucket
            assert got["f"] == b"fork on b" and len(got["big"] or b"") == BIG

    await _seaweed.arerun_transient(two_machines)


def test_holds_name_generation_directories_as_the_store_does() -> None:
    from sandbox_fs.snapshot import _generations, _holds

    assert _holds.HOLD_DIR == _generations._GEN_DIR


# ------------------------------------------------------------- a model check of the reference tracking

_NAMES = ("a", "b")
_OPS = st.lists(st.one_of(
    st.tuples(st.just("persist"), st.sampled_from(_NAMES), st.booleans()),
    st.tuples(st.just("fork"), st.sampled_from(_NAMES), st.sampled_from(_NAMES)),
    st.tuples(st.just("remove"), st.sampled_from(_NAMES), st.just(False)),
    st.tuples(st.just("gc"), st.just(""), st.just(False)),
), min_size=1, max_size=14)


def _restore_points_verify(store: GenerationStore) -> None:
    from sandbox_fs.snapshot import SnapshotLimits

    for name in _NAMES:
        for generation in store.kept(name):
            chain = store.open_chain(name, SnapshotLimits(), generation=generation)
            try:
                for reader, info in zip(chain.readers, chain.infos):
                    while reader.read(1 << 16):
                        pass
                    reader.verify(info)
            finally:
                chain.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
@example(ops=[("persist", "a", True), ("fork", "a", "b"), ("persist", "a", True), ("persist", "a", True),
              ("gc", "", False), ("persist", "b", False), ("remove", "a", False), ("persist", "b", True),
              ("persist", "b", True)])
@example(ops=[("persist", "a", True), ("fork", "a", "b"), ("persist", "b", False), ("remove", "a", False),
              ("fork", "b", "a"), ("remove", "b", False), ("persist", "a", True), ("persist", "a", True)])
def test_property_every_restore_point_stays_readable_and_nothing_leaks(tmp_path_factory: Any, ops: list) -> None:
    """Persists, forks, removals and gc in any order: every kept restore point of every name reads back and
    verifies after each step, and once every name is removed (and gc ran) the store is empty."""
    top = tmp_path_factory.mktemp("model")
    objects = DictObjects()
    store = GenerationStore(objects, keep=1)
    for i, (op, name, arg) in enumerate(ops):
        if op == "persist":
            ws_dir = top / name
            ws_dir.mkdir(exist_ok=True)
            (ws_dir / "f").write_text(f"{name} {i}")
            # as large as the rest: a layer of it, then a full generation (compaction), which prunes
            (ws_dir / ("big" if arg else "big2")).write_bytes(os.urandom(4096))
            with open_root(ws_dir) as ws:
                persist(ws, store, name)
        elif op == "fork":
            with contextlib.suppress(SnapshotConflictError, SnapshotNotFoundError):
                store.fork(name, arg)
        elif op == "remove":
            store.remove(name)
        else:
            store.gc(now=time.time() + 7200)
        _restore_points_verify(store)
    for name in _NAMES:
        store.remove(name)
    store.gc(now=time.time() + 7200)
    assert sorted(objects.objs) == []
