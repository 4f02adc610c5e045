"""S3SnapshotStore against a real S3 server (SeaweedFS, tests/_seaweed.py): issue 16 part 3.

Two machines sharing one bucket and a state key; two writers of one session;
metadata and data replaced together in the bucket; the server paused
(SIGSTOP) and killed (SIGKILL) in the middle of a persist.  The object
contract itself is tested in tests/test_snapshot_objects.py.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import tempfile
import time
from typing import Any

import pytest

from sandbox_fs import open_root
from sandbox_fs.snapshot import (
    GenerationStore,
    S3Objects,
    S3Options,
    S3SnapshotStore,
    SnapshotConflictError,
    SnapshotStoreError,
    hydrate,
    persist,
    tree_digest,
)

pytest.importorskip("boto3", reason="boto3 (the s3 extra) is not installed")

import _seaweed  # noqa: E402

BUCKET = "sfs-s3-tests"
PART = 5 << 20
_n = itertools.count()


def _options(endpoint: str, **kw: Any) -> S3Options:
    args: dict[str, Any] = {"endpoint_url": endpoint, "region_name": "us-east-1",
                            "aws_access_key_id": _seaweed.ACCESS_KEY, "aws_secret_access_key": _seaweed.SECRET_KEY,
                            "part_size": PART}
    args.update(kw)
    return S3Options(**args)


@pytest.fixture(scope="module")
def endpoint(s3_server: Any) -> str:
    objs = S3Objects(BUCKET, options=_options(s3_server.endpoint))
    try:
        objs._client.create_bucket(Bucket=BUCKET)
    except Exception as exc:  # the bucket of an earlier run on the same server
        if "BucketAlreadyOwnedByYou" not in repr(exc) and "BucketAlreadyExists" not in repr(exc):
            raise
    finally:
        objs.close()
    return str(s3_server.endpoint)


@pytest.fixture
def prefix() -> str:
    return f"run-{os.getpid()}-{next(_n)}"


def _store(endpoint: str, prefix: str, **kw: Any) -> S3SnapshotStore:
    return S3SnapshotStore(BUCKET, prefix, options=_options(endpoint, **kw), check=True)


def _fill(path: Any, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)


def test_persist_and_hydrate_round_trip(tmp_path: Any, endpoint: str, prefix: str) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    _fill(src, {"a.txt": b"hello", "d/big.bin": os.urandom(PART) * 2 + b"tail", "d/e/empty": b""})
    with _store(endpoint, prefix) as store, open_root(src) as ws, open_root(dst) as out:
        rep = persist(ws, store, "sess")
        assert rep.info.generation == 1
        back = hydrate(out, store, "sess")
        assert back.generation == 1
        assert tree_digest(out) == tree_digest(ws)
        (src / "a.txt").write_bytes(b"changed")
        assert persist(ws, store, "sess").info.generation == 2
        hydrate(out, store, "sess")
        assert (dst / "a.txt").read_bytes() == b"changed"
        assert store.kept("sess") == [2, 1]
        keys = [o.key for o in store.objects.list("sess/")]
        assert "sess/current" in keys and len({k.split("/")[2] for k in keys if k.startswith("sess/gen/")}) == 2


def _machine(tmp_path: Any, endpoint: str, prefix: str, which: str) -> Any:
    from sandbox_fs.client import ClientOptions, LocalSandboxClient

    return LocalSandboxClient(ClientOptions(workspaces_dir=str(tmp_path / f"ws-{which}"),
                                            snapshot_store=_store(endpoint, prefix), state_key=b"k" * 32))


async def test_a_session_stopped_on_one_machine_resumes_on_another(tmp_path: Any, endpoint: str,
                                                                    prefix: str) -> None:
    with _machine(tmp_path, endpoint, prefix, "a") as a, _machine(tmp_path, endpoint, prefix, "b") as b:
        async with a.create() as s:
            await s.write("notes.txt", b"from A")
            await s.mkdir("sub")
            await s.write("sub/data.bin", b"\x00\xff" * 1000)
        state = a.serialize_state(s)
        shutil.rmtree(tmp_path / "ws-a" / s.id)  # of the session, only the bucket and the state are left
        r = b.resume(state)
        async with r:
            assert r.start_mode == "restored"
            assert await r.read("notes.txt") == b"from A"
            assert await r.read("sub/data.bin") == b"\x00\xff" * 1000
            # B restored into its own workspaces_dir, from the bucket alone
            assert (tmp_path / "ws-b" / s.id / "notes.txt").read_bytes() == b"from A"
            await r.write("notes.txt", b"from B")
        async with a.resume(b.serialize_state(r)) as again:
            assert await again.read("notes.txt") == b"from B"


async def test_two_machines_resuming_one_state_cannot_both_commit(tmp_path: Any, endpoint: str,
                                                                  prefix: str) -> None:
    with _machine(tmp_path, endpoint, prefix, "a") as a, _machine(tmp_path, endpoint, prefix, "b") as b:
        async with a.create() as s:
            await s.write("f", b"base")
        state = a.serialize_state(s)
        ra, rb = a.resume(state), b.resume(state)
        await ra.start()
        await rb.start()
        await ra.write("f", b"A wins")
        await rb.write("f", b"B loses")
        await ra.aclose()
        with pytest.raises(SnapshotConflictError) as err:
            await rb.aclose()
        assert not err.value.retryable
        assert GenerationStore(S3Objects(BUCKET, prefix, options=_options(endpoint))).kept(s.id) == [2, 1]
        async with b.resume(a.serialize_state(ra)) as c:
            assert await c.read("f") == b"A wins"


async def test_metadata_and_data_replaced_together_are_refused(tmp_path: Any, endpoint: str, prefix: str) -> None:
    """The bucket's operator swaps in another valid generation (pointer, metadata and archive): refused."""
    from sandbox_fs.session import SnapshotDigestMismatchError

    evil = prefix + "-evil"
    with _machine(tmp_path, endpoint, prefix, "a") as a, _machine(tmp_path, endpoint, evil, "e") as e:
        async with a.create(session_id="victim") as s:
            await s.write("f", b"genuine")
        state = a.serialize_state(s)
        async with e.create(session_id="victim") as forged:
            await forged.write("f", b"forged")
        objs = S3Objects(BUCKET, prefix, options=_options(endpoint))
        client = objs._client
        for o in list(objs.list("victim/")):
            objs.delete(o.key)
        for o in list(S3Objects(BUCKET, evil, client=client).list("victim/")):
            client.copy_object(Bucket=BUCKET, Key=f"{prefix}/{o.key}", CopySource={"Bucket": BUCKET,
                                                                                   "Key": f"{evil}/{o.key}"})
        assert objs.get_bytes("victim/current", 1 << 20)  # the forged pointer is in place
        r = a.resume(state)
        with pytest.raises(SnapshotDigestMismatchError):
            await r.start()
        assert (tmp_path / "ws-a" / "victim" / "f").read_bytes() == b"genuine"


class _Tripwire:
    """An object store that calls ``trip()`` once after ``after`` bytes of one upload went through it."""

    def __init__(self, objects: S3Objects, after: int, trip: Any) -> None:
        self._objects = objects
        self._after = after
        self._trip = trip
        self.tripped = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._objects, name)

    def put_stream(self, key: str) -> Any:
        writer = self._objects.put_stream(key)
        outer = self

        class Writer:
            written = 0

            def write(self, data: Any) -> int:
                n = writer.write(data)
                self.written += n
                if self.written >= outer._after and not outer.tripped:
                    outer.tripped = True
                    outer._trip()
                return n

            def commit(self) -> Any:
                return writer.commit()

            def abort(self) -> None:
                writer.abort()

        return Writer()


def _two_generations(tmp_path: Any, store: Any) -> tuple[Any, dict[str, bytes]]:
    src = tmp_path / "src"
    src.mkdir()
    first = {"keep.txt": b"generation 1", "x.bin": os.urandom(1000)}
    _fill(src, first)
    with open_root(src) as ws:
        assert persist(ws, store, "sess").info.generation == 1
    # the next persist is large enough (4 parts) that the server goes away with parts in flight
    _fill(src, {"keep.txt": b"generation 2", "big.bin": os.urandom(4 * PART)})
    return src, first


def _restores_generation_1(tmp_path: Any, store: Any, first: dict[str, bytes]) -> None:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    with open_root(out) as o:
        rep = hydrate(o, store, "sess")
    assert rep.generation == 1 and store.kept("sess") == [1]
    assert sorted(os.listdir(out)) == sorted(first) and (out / "keep.txt").read_bytes() == first["keep.txt"]


def _retry(fn: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            fn()
            return
        except SnapshotStoreError as exc:
            if not exc.retryable or time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def _kept_dirs(store: Any) -> set[str]:
    ptr, _etag = store._pointer("sess")
    return {e.dir for e in ptr.generations} if ptr is not None else set()


# -- the command line: --store s3://BUCKET/PREFIX, --store-endpoint or the AWS environment


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    for var in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", _seaweed.ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", _seaweed.SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


_TRANSIENT = ("the store could not be reached", "the connection broke", "the store is unavailable")


def _cli(capsys: Any, *argv: str, attempts: int = 3) -> tuple[int, str, str]:
    """Run the CLI; a refusal naming a transient store failure is run again (at most ``attempts`` runs).

    The one SeaweedFS of the run is paused and killed by other tests of this
    file and shares two cores with the suite, and it occasionally drops a
    connection.  The CLI reports that as ``snapshot_store_unavailable``
    (retryable), and retrying is what a host does with it; these tests are
    about what a successful run stores and restores.
    """
    from sandbox_fs.cli import main

    for attempt in range(attempts):
        rc = main(list(argv))
        out, err = capsys.readouterr()
        if rc == 0 or attempt == attempts - 1 or not any(t in err for t in _TRANSIENT):
            return rc, out, err
        time.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")


def test_cli_snapshot_save_ls_restore_s3(tmp_path: Any, capsys: Any, endpoint: str, prefix: str,
                                         aws_env: None) -> None:
    import json

    ws, dst = tmp_path / "ws", tmp_path / "dst"
    _fill(ws, {"d/f": b"content", "g": b"x" * 100})
    dst.mkdir()
    url = f"s3://{BUCKET}/{prefix}"
    rc, out, err = _cli(capsys, "snapshot", "save", "--workspace", str(ws), "--store", url,
                        "--store-endpoint", endpoint, "--name", "s1", "--json")
    assert rc == 0, err
    assert json.loads(out)["entries"] == 3
    rc, out, err = _cli(capsys, "snapshot", "ls", "--store", url, "--store-endpoint", endpoint, "--json")
    assert rc == 0, err
    assert [row["name"] for row in json.loads(out)] == ["s1"]
    rc, out, err = _cli(capsys, "snapshot", "restore", "--workspace", str(dst), "--store", url,
                        "--store-endpoint", endpoint, "--name", "s1", "--json")
    assert rc == 0, err
    assert (dst / "d" / "f").read_bytes() == b"content" and (dst / "g").read_bytes() == b"x" * 100


def test_cli_session_moves_between_machines_with_env_endpoint(tmp_path: Any, capsys: Any, endpoint: str,
                                                              prefix: str, aws_env: None,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)  # the standard variable instead of --store-endpoint
    key = tmp_path / "key"
    key.write_bytes(b"k" * 32)
    url = f"s3://{BUCKET}/{prefix}"
    common = ["--store", url, "--state-key-file", str(key), "--json"]
    state = tmp_path / "state.json"
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps({"entries": {"made-on-a.txt": {"type": "file", "content": "from A"}}}))
    rc, _, err = _cli(capsys, "session", "create", "--workspaces-dir", str(tmp_path / "a"), "--session-id", "mv",
                      "--manifest", str(manifest), "--state", str(state), *common)
    assert rc == 0, err
    assert json.loads(state.read_text())["generation"] == 1
    shutil.rmtree(tmp_path / "a")  # machine A is gone: the bucket and the state file are all there is
    rc, _, err = _cli(capsys, "session", "resume", "--workspaces-dir", str(tmp_path / "b"), "--state", str(state),
                      *common)
    assert rc == 0, err
    assert (tmp_path / "b" / "mv" / "made-on-a.txt").read_bytes() == b"from A"


def test_cli_s3_refusals_are_one_line(tmp_path: Any, capsys: Any, endpoint: str, prefix: str, aws_env: None,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    ws = tmp_path / "ws"
    _fill(ws, {"f": b"x"})
    wrong = "WRONG-secret-" + "7" * 24
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    cases = [
        (["--store", f"s3://{BUCKET}/{prefix}", "--store-endpoint", endpoint], "snapshot_store_unavailable"),
        (["--store", str(tmp_path / "dir"), "--store-endpoint", endpoint], "cli_input"),
        (["--store", "s3://Not_A_Bucket/x", "--store-endpoint", endpoint], "cli_input"),
    ]
    for store_args, code in cases:
        rc, out, err = _cli(capsys, "snapshot", "save", "--workspace", str(ws), "--name", "s", *store_args,
                            attempts=1)
        assert rc != 0
        lines = err.strip().splitlines()
        assert len(lines) == 1 and code in lines[0] and "Traceback" not in err, err
        assert wrong not in err and wrong not in out


def test_gc_and_upload_cleanup_measure_age_on_the_servers_clock(endpoint: str, prefix: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A local clock two hours ahead of the server's: a persist's fresh object and its upload under way stay."""
    store = _store(endpoint, prefix)
    key = "s/gen/000000000009-00000000000000aa/archive.tar"
    try:
        store.objects.put_bytes(key.replace("archive.tar", "index"), b"a persist under way")
        writer = store.objects.put_stream(key)
        writer.write(b"x" * (PART + 1))  # a multipart upload: initiated, one part sent
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 7200)
        try:
            report = store.gc()  # the default grace, one hour
        finally:
            monkeypatch.setattr(time, "time", real)
        assert report.objects == [] and report.uploads == 0
        assert writer.commit().size == PART + 1  # the upload still completes (the sentinel)
        assert store.objects.head(key.replace("archive.tar", "index")) is not None
        assert [o.key for o in store.objects.list("") if o.key.startswith("sandbox-fs.")] == []  # no marker left
        report = store.gc(now=time.time() + 7200)  # two hours on, by the store's clock: both are orphans
        assert sorted(report.objects) == sorted([key, key.replace("archive.tar", "index")])
    finally:
        store.close()


def test_server_killed_mid_persist_leaves_previous_generation(tmp_path: Any, s3_server: Any, endpoint: str,
                                                              prefix: str) -> None:
    """SIGKILL mid-upload, then the server restarts on its data (a server of its own: see :func:`_own_server`)."""
    server, data = _own_server("kill")
    endpoint = server.endpoint
    store = _store(endpoint, prefix, max_attempts=1, read_timeout=5, connect_timeout=2)
    try:
        killing = GenerationStore(_Tripwire(store.objects, 2 * PART, lambda: server.kill(signal.SIGKILL)))
        src, first = _two_generations(tmp_path, store)
        with open_root(src) as ws, pytest.raises(SnapshotStoreError) as err:
            persist(ws, killing, "sess")
        assert err.value.retryable
        server.restart_killed()  # the same endpoint and data, after the crash
        # its volumes rejoin a moment after the gateway answers: until then reads fail as retryable, and a
        # host retries them as this does
        _retry(lambda: _restores_generation_1(tmp_path, store, first))
        store.gc(now=time.time() + 7200)  # the dead persist's objects go (the server's clock is this one)
        store.objects.abort_stale_uploads(0)  # and its upload (gc's grace is measured on the server's clock)
        assert all(o.key.split("/")[2] in _kept_dirs(store) for o in store.objects.list("sess/gen/"))
        assert not store.objects._client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads")
        with open_root(src) as ws:
            assert persist(ws, store, "sess").info.generation == 2
    finally:
        store.close()
        server.stop()
        shutil.rmtree(data, ignore_errors=True)


def test_server_paused_mid_persist_leaves_previous_generation(tmp_path: Any, s3_server: Any, endpoint: str,
                                                              prefix: str) -> None:
    """SIGSTOP mid-upload, then SIGCONT (a server of its own: see :func:`_own_server`)."""
    s3_server, data = _own_server("pause")
    endpoint = s3_server.endpoint
    store = _store(endpoint, prefix)
    # only the persist that meets the paused server has short timeouts (one attempt of 1 s each)
    hasty = S3Objects(BUCKET, prefix, options=_options(endpoint, max_attempts=1, read_timeout=1, connect_timeout=1))
    paused = GenerationStore(_Tripwire(hasty, 2 * PART, lambda: s3_server.kill(signal.SIGSTOP)))
    try:
        src, first = _two_generations(tmp_path, store)
        try:
            with open_root(src) as ws, pytest.raises(SnapshotStoreError) as err:
                persist(ws, paused, "sess")
        finally:
            s3_server.kill(signal.SIGCONT)
        assert err.value.retryable
        _restores_generation_1(tmp_path, store, first)
        with open_root(src) as ws:
            assert persist(ws, store, "sess").info.generation == 2  # and the store works again
    finally:
        s3_server.kill(signal.SIGCONT)
        hasty.close()
        store.close()
        s3_server.stop()
        shutil.rmtree(data, ignore_errors=True)


def _own_server(what: str) -> tuple[Any, str]:
    """A SeaweedFS of the test's own, to pause or kill: ``(server, data dir)``; skips where none starts.

    The run's shared server, once SIGSTOPped and continued or SIGKILLed and
    restarted, refused connections to later tests in clean-clone runs, so no
    test disrupts it.
    """
    data = tempfile.mkdtemp(prefix=f"sfs-seaweed-{what}-")
    try:
        server = _seaweed.start(data)
    except RuntimeError as exc:
        shutil.rmtree(data, ignore_errors=True)
        pytest.skip(f"no S3 server of the test's own could start: {exc}")
    server.data_dir = data
    with contextlib.suppress(Exception):
        S3Objects(BUCKET, options=_options(server.endpoint))._client.create_bucket(Bucket=BUCKET)
    return server, data
