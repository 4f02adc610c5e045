"""The object contract (sandbox_fs/snapshot/_objects.py), run against every implementation.

Each test gets a fresh, empty store from the ``objects`` fixture, parametrized
over the implementations: ``local`` (LocalObjects on a temp directory) and
``s3`` (S3Objects on a fresh bucket of the SeaweedFS server from
tests/_seaweed.py, skipped with its reason where the server cannot start).
Tests specific to one implementation are at the end.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandbox_fs.snapshot import SnapshotConflictError, SnapshotLimitError, SnapshotNotFoundError, SnapshotStoreError
from sandbox_fs.snapshot import LocalObjects
from sandbox_fs.snapshot._objects_local import validate_key

MIN_PART = 5 << 20  # S3's smallest part: the S3 store under test uses it, so a few MiB are multipart

IMPLEMENTATIONS = ["local", "s3"]
_BUCKET = "sfs-contract"
_counter = itertools.count()
_clients: dict[Any, Any] = {}


def make_s3(endpoint: str, prefix: str, **options: Any) -> Any:
    """S3Objects on the test server's bucket ``sfs-contract`` (made when missing) under ``prefix``."""
    from sandbox_fs.snapshot._s3 import S3Objects, S3Options

    import _seaweed

    opts = S3Options(endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=_seaweed.ACCESS_KEY,
                     aws_secret_access_key=_seaweed.SECRET_KEY, part_size=MIN_PART, **options)
    cache_key = (endpoint, tuple(sorted(options.items())))
    client = _clients.get(cache_key)
    store = S3Objects(_BUCKET, prefix, options=opts, client=client)
    if client is None:  # a boto3 client costs ~0.5 s to make: one per endpoint and options
        with contextlib.suppress(Exception):
            store._client.create_bucket(Bucket=_BUCKET)
        _clients[cache_key] = store._client
    store.close = lambda: None  # the client is shared by the tests
    return store


@pytest.fixture(params=IMPLEMENTATIONS)
def objects(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Any]:
    if request.param == "local":
        store: Any = LocalObjects(tmp_path / "store")
    else:
        pytest.importorskip("boto3", reason="boto3 (the s3 extra) is not installed")
        server = request.getfixturevalue("s3_server")

        def fresh() -> Any:
            return make_s3(server.endpoint, f"contract/{os.getpid()}-{next(_counter)}", max_attempts=2)

        store = fresh()
        store.fresh = fresh  # for _reruns
    yield store
    store.abort_stale_uploads(0)
    store.close()


def _reruns(test: Callable[..., None]) -> Callable[..., None]:
    """Run a contract test on S3 again, on a fresh store, when the run's one server fails it transiently.

    At most ``_seaweed.TRANSIENT_RUNS`` runs (see ``_seaweed.rerun_transient``);
    a failure that is not a retryable ``snapshot_store_unavailable`` fails the
    test at once.  Local stores run once.
    """

    @functools.wraps(test)
    def run(*args: Any, objects: Any, **kw: Any) -> None:
        fresh = getattr(objects, "fresh", None)
        if fresh is None:
            return test(*args, objects=objects, **kw)
        import _seaweed

        def once(attempt: int) -> None:
            store = objects if attempt == 0 else fresh()
            try:
                test(*args, objects=store, **kw)
            finally:
                if store is not objects:
                    with contextlib.suppress(Exception):
                        store.abort_stale_uploads(0)

        _seaweed.rerun_transient(once)

    return run


def _keys(store: Any, prefix: str = "") -> list[str]:
    return [info.key for info in store.list(prefix)]


# -- reading and writing


@_reruns
def test_put_bytes_round_trip(objects: Any) -> None:
    info = objects.put_bytes("gens/a/pointer", b"hello")
    assert info.key == "gens/a/pointer" and info.size == 5 and info.etag
    assert objects.get_bytes("gens/a/pointer", 5) == b"hello"
    head = objects.head("gens/a/pointer")
    assert head is not None and head.size == 5 and head.etag == info.etag


@_reruns
def test_missing_object(objects: Any) -> None:
    assert objects.head("nope") is None
    with pytest.raises(SnapshotNotFoundError):
        objects.get_bytes("nope", 10)
    with pytest.raises(SnapshotNotFoundError):
        objects.open_range("nope")
    objects.delete("nope")  # no error


@_reruns
def test_get_bytes_limit(objects: Any) -> None:
    objects.put_bytes("k", b"x" * 100)
    assert objects.get_bytes("k", 100) == b"x" * 100
    with pytest.raises(SnapshotLimitError):
        objects.get_bytes("k", 99)


@_reruns
def test_etag_changes_with_content(objects: Any) -> None:
    a = objects.put_bytes("k", b"one")
    b = objects.put_bytes("k", b"two")
    assert a.etag != b.etag
    head = objects.head("k")
    assert head is not None and head.etag == b.etag


@_reruns
def test_stream_visible_only_at_commit(objects: Any) -> None:
    writer = objects.put_stream("data/big")
    for i in range(8):
        assert writer.write(bytes([i]) * 65536) == 65536
    assert objects.head("data/big") is None
    assert _keys(objects) == []
    info = writer.commit()
    assert info.size == 8 * 65536
    with objects.open_range("data/big") as f:
        data = f.read()
    assert data == b"".join(bytes([i]) * 65536 for i in range(8))
    head = objects.head("data/big")
    assert head is not None and head.etag == info.etag and head.size == info.size


@_reruns
def test_stream_abort_and_abandon_leave_nothing(objects: Any) -> None:
    objects.put_bytes("data/x", b"old")
    writer = objects.put_stream("data/x")
    writer.write(b"new content")
    writer.abort()
    writer.abort()  # idempotent
    assert objects.get_bytes("data/x", 100) == b"old"
    abandoned = objects.put_stream("data/y")
    abandoned.write(b"never committed")
    assert _keys(objects) == ["data/x"]


@_reruns
def test_stream_replaces_at_commit(objects: Any) -> None:
    objects.put_bytes("data/x", b"old")
    writer = objects.put_stream("data/x")
    writer.write(b"new")
    assert objects.get_bytes("data/x", 10) == b"old"
    writer.commit()
    assert objects.get_bytes("data/x", 10) == b"new"


@_reruns
def test_multipart_stream(objects: Any) -> None:
    # 2.5 parts, written in odd-sized chunks: parts are cut at the part size, not at write boundaries
    blob = os.urandom(MIN_PART // 2) * 5
    writer = objects.put_stream("data/multi")
    for off in range(0, len(blob), 777_777):
        writer.write(memoryview(blob)[off:off + 777_777])
    assert objects.head("data/multi") is None
    info = writer.commit()
    assert info.size == len(blob)
    with objects.open_range("data/multi") as f:
        assert f.read() == blob
    with objects.open_range("data/multi", MIN_PART - 3, MIN_PART + 6) as f:
        assert f.read() == blob[MIN_PART - 3:2 * MIN_PART + 3]
    head = objects.head("data/multi")
    assert head is not None and head.etag == info.etag


@_reruns
def test_open_range(objects: Any) -> None:
    payload = bytes(range(256)) * 40
    objects.put_bytes("r", payload)
    cases = [(0, None), (0, 10), (100, 1000), (10000, None), (10230, 100), (len(payload), None), (len(payload) + 5, 3)]
    for start, length in cases:
        with objects.open_range("r", start, length) as f:
            got = f.read()
        end = len(payload) if length is None else start + length
        assert got == payload[start:end], (start, length)


@_reruns
def test_list_prefix_and_order(objects: Any) -> None:
    keys = ["b/2", "a/1", "a/10/x", "a/1x", "a.b", "c", "a/2/deep/key"]
    for k in keys:
        objects.put_bytes(k, k.encode())
    assert _keys(objects) == sorted(keys)
    assert _keys(objects, "a/") == sorted(k for k in keys if k.startswith("a/"))
    assert _keys(objects, "a/1") == ["a/1", "a/10/x", "a/1x"]
    assert _keys(objects, "a/2/de") == ["a/2/deep/key"]
    assert _keys(objects, "zz") == []
    sizes = {i.key: i.size for i in objects.list("")}
    assert sizes == {k: len(k) for k in keys}


@_reruns
def test_delete(objects: Any) -> None:
    objects.put_bytes("g/1/a", b"1")
    objects.put_bytes("g/1/b", b"2")
    objects.delete("g/1/a")
    assert _keys(objects) == ["g/1/b"]
    objects.delete("g/1/b")
    assert _keys(objects) == []
    objects.put_bytes("g", b"a key where a directory was")  # a deleted prefix leaves no obstacle
    assert objects.get_bytes("g", 100) == b"a key where a directory was"


# -- conditional writes


@_reruns
def test_if_none_match(objects: Any) -> None:
    objects.put_bytes("p", b"1", if_none_match=True)
    with pytest.raises(SnapshotConflictError):
        objects.put_bytes("p", b"2", if_none_match=True)
    assert objects.get_bytes("p", 10) == b"1"


@_reruns
def test_if_match(objects: Any) -> None:
    first = objects.put_bytes("p", b"gen 1")
    second = objects.put_bytes("p", b"gen 2", if_match=first.etag)
    with pytest.raises(SnapshotConflictError) as err:
        objects.put_bytes("p", b"gen 3 (stale)", if_match=first.etag)
    assert not err.value.retryable
    assert objects.get_bytes("p", 100) == b"gen 2"
    objects.put_bytes("p", b"gen 3", if_match=second.etag)
    assert objects.get_bytes("p", 100) == b"gen 3"


@_reruns
def test_if_match_missing_object(objects: Any) -> None:
    with pytest.raises(SnapshotConflictError):
        objects.put_bytes("p", b"x", if_match="0123456789abcdef")
    assert objects.head("p") is None


@_reruns
def test_two_writers_exactly_one_wins(objects: Any) -> None:
    base = objects.put_bytes("ptr", b"gen 0")
    rounds, writers = 2, 5
    for r in range(rounds):
        expect = objects.head("ptr")
        assert expect is not None
        barrier = threading.Barrier(writers)
        results: list[str] = []

        def attempt(i: int, etag: str = expect.etag, r: int = r) -> None:
            barrier.wait()
            try:
                objects.put_bytes("ptr", f"gen {r + 1} by {i}".encode(), if_match=etag)
                results.append(f"won {i}")
            except SnapshotConflictError:
                results.append("lost")

        threads = [threading.Thread(target=attempt, args=(i,)) for i in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [x for x in results if x.startswith("won")]
        assert len(results) == writers and len(winners) == 1, results
        assert objects.get_bytes("ptr", 100) == f"gen {r + 1} by {winners[0][4:]}".encode()
    assert base.etag != objects.head("ptr").etag


# -- keys


BAD_KEYS = ["", "/a", "a/", "a//b", "..", "../x", "a/../b", "a/./b", ".hidden", "a/.partial", "a b", "a\x00b",
            "é", "a\\b", "x" * 256, "/".join(["a"] * 600)]


@pytest.mark.parametrize("key", BAD_KEYS)
@_reruns
def test_bad_keys_refused(objects: Any, key: str) -> None:
    with pytest.raises(ValueError):
        objects.put_bytes(key, b"x")
    with pytest.raises(ValueError):
        objects.put_stream(key)
    with pytest.raises(ValueError):
        objects.head(key)
    with pytest.raises(ValueError):
        objects.get_bytes(key, 10)
    with pytest.raises(ValueError):
        objects.delete(key)
    assert _keys(objects) == []


@_reruns
def test_abort_stale_uploads(objects: Any) -> None:
    writer = objects.put_stream("k")
    writer.write(b"p" * (MIN_PART + 1))  # past one part: an S3 multipart upload has begun
    assert objects.abort_stale_uploads(3600) == 0
    assert objects.abort_stale_uploads(0) == 1
    with pytest.raises(SnapshotStoreError) as err:
        writer.commit()
    assert not err.value.retryable
    assert objects.head("k") is None
    assert objects.abort_stale_uploads(0) == 0


# -- the model property: any sequence of operations leaves the store as a dict would


_key = st.sampled_from(["a", "b", "g/1", "g/2", "g/1x", "h/i/j"])
_op = st.one_of(
    st.tuples(st.just("put"), _key, st.binary(max_size=64)),
    st.tuples(st.just("stream"), _key, st.binary(max_size=64)),
    st.tuples(st.just("abandon"), _key, st.binary(max_size=64)),
    st.tuples(st.just("delete"), _key, st.just(b"")),
    st.tuples(st.just("cas"), _key, st.binary(max_size=64)),
    st.tuples(st.just("create"), _key, st.binary(max_size=64)),
)


_HEALTH = [HealthCheck.function_scoped_fixture]


# every example costs S3 a few dozen requests: fewer examples there
@pytest.mark.parametrize("objects", ["local"], indirect=True)
@settings(max_examples=25, deadline=None, suppress_health_check=_HEALTH)
@given(ops=st.lists(_op, max_size=12))
def test_operations_match_a_dict_local(objects: Any, ops: list[tuple[str, str, bytes]]) -> None:
    _operations_match_a_dict(objects, ops)


@pytest.mark.parametrize("objects", ["s3"], indirect=True)
@settings(max_examples=6, deadline=None, suppress_health_check=_HEALTH)
@given(ops=st.lists(_op, max_size=12))
def test_operations_match_a_dict_s3(objects: Any, ops: list[tuple[str, str, bytes]]) -> None:
    import _seaweed

    _seaweed.rerun_transient(lambda attempt: _operations_match_a_dict(objects if not attempt else objects.fresh(), ops))


def _operations_match_a_dict(objects: Any, ops: list[tuple[str, str, bytes]]) -> None:
    for info in list(objects.list("")):
        objects.delete(info.key)
    # "g/1" and "g/1/..." never coexist here (a local directory cannot be a file too), as snapshot keys never do
    model: dict[str, bytes] = {}
    etags: dict[str, str] = {}
    for op, key, data in ops:
        if op == "put":
            etags[key] = objects.put_bytes(key, data).etag
            model[key] = data
        elif op == "stream":
            w = objects.put_stream(key)
            w.write(data)
            etags[key] = w.commit().etag
            model[key] = data
        elif op == "abandon":
            objects.put_stream(key).write(data)
        elif op == "delete":
            objects.delete(key)
            model.pop(key, None)
        elif op == "cas":
            stale = key not in model
            try:
                etags[key] = objects.put_bytes(key, data, if_match=etags.get(key, "0" * 32)).etag
                assert not stale
                model[key] = data
            except SnapshotConflictError:
                assert stale
        elif op == "create":
            try:
                etags[key] = objects.put_bytes(key, data, if_none_match=True).etag
                assert key not in model
                model[key] = data
            except SnapshotConflictError:
                assert key in model
        if key not in model:
            etags.pop(key, None)
    assert _keys(objects) == sorted(model)
    for key, data in model.items():
        assert objects.get_bytes(key, 1000) == data
    assert objects.abort_stale_uploads(0) >= 0


# -- LocalObjects only


def test_local_validate_key_components() -> None:
    assert validate_key("gens/abc/3.tar") == ["gens", "abc", "3.tar"]


def test_local_files_private_and_in_place(tmp_path: Any) -> None:
    store = LocalObjects(tmp_path / "s")
    try:
        store.put_bytes("x/y", b"data")
        w = store.put_stream("x/z")
        w.write(b"z")
        w.commit()
    finally:
        store.close()
    assert (tmp_path / "s" / "x" / "y").read_bytes() == b"data"
    assert os.stat(tmp_path / "s" / "x" / "y").st_mode & 0o777 == 0o600
    assert os.stat(tmp_path / "s" / "x").st_mode & 0o777 == 0o700
    assert os.listdir(tmp_path / "s" / ".partial") == []


def test_local_symlinked_directory_refused(tmp_path: Any) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "sentinel").write_bytes(b"untouched")
    store = LocalObjects(tmp_path / "s")
    try:
        store.put_bytes("g/a", b"1")
        # something with write access to the store directory swaps a directory for a symlink
        os.rename(tmp_path / "s" / "g", tmp_path / "s" / "g.old")
        os.symlink(outside, tmp_path / "s" / "g")
        for attempt in (lambda: store.put_bytes("g/sentinel", b"overwritten"),
                        lambda: store.get_bytes("g/sentinel", 100),
                        lambda: store.delete("g/sentinel")):
            with pytest.raises(SnapshotStoreError) as err:
                attempt()
            assert str(tmp_path) not in str(err.value)
        w = store.put_stream("g/new")
        w.write(b"x")
        with pytest.raises(SnapshotStoreError):
            w.commit()
        with pytest.raises(SnapshotStoreError) as err:
            store.head("g/sentinel")
        assert err.value.context["error"] == "symlink_refused"
        assert _keys(store) == ["g.old/a"]  # the symlink is no object, nothing beyond it is listed
    finally:
        store.close()
    assert sorted(os.listdir(outside)) == ["sentinel"]
    assert (outside / "sentinel").read_bytes() == b"untouched"


def test_local_large_object_identity_etag(tmp_path: Any) -> None:
    store = LocalObjects(tmp_path / "s")
    try:
        w = store.put_stream("big")
        chunk = b"\0" * (1 << 20)
        for _ in range(2):
            w.write(chunk)
        info = w.commit()
        assert store.head("big") == info
        again = store.put_stream("big")
        for _ in range(2):
            again.write(chunk)
        info2 = again.commit()
        assert info2.etag != info.etag  # same content, another version
        with pytest.raises(SnapshotConflictError):
            store.put_bytes("big", b"small", if_match=info.etag)
        store.put_bytes("big", b"small", if_match=info2.etag)
    finally:
        store.close()


def test_local_two_processes_one_wins(tmp_path: Any) -> None:
    store = LocalObjects(tmp_path / "s")
    first = store.put_bytes("ptr", b"gen 1")
    store.close()
    r, w = os.pipe()
    pids = []
    for i in range(2):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            code = 3
            try:
                os.close(w)
                os.read(r, 1)  # both start together
                s = LocalObjects(tmp_path / "s")
                try:
                    s.put_bytes("ptr", f"gen 2 by {i}".encode(), if_match=first.etag)
                    code = 0
                except SnapshotConflictError:
                    code = 1
            finally:
                os._exit(code)
        pids.append(pid)
    os.close(r)
    os.write(w, b"go")
    os.close(w)
    codes = sorted(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids)
    assert codes == [0, 1]


# -- S3Objects only


@pytest.fixture
def s3_endpoint(s3_server: Any) -> str:
    pytest.importorskip("boto3", reason="boto3 (the s3 extra) is not installed")
    return str(s3_server.endpoint)


def _s3(endpoint: str, bucket: str = _BUCKET, **kw: Any) -> Any:
    from sandbox_fs.snapshot._s3 import S3Objects, S3Options

    import _seaweed

    opts = {"endpoint_url": endpoint, "region_name": "us-east-1", "aws_access_key_id": _seaweed.ACCESS_KEY,
            "aws_secret_access_key": _seaweed.SECRET_KEY, "max_attempts": 1, "connect_timeout": 2,
            "read_timeout": 5}
    opts.update(kw)
    return S3Objects(bucket, "errors", options=S3Options(**opts))


def test_s3_wrong_secret_not_retryable_names_no_secret(s3_endpoint: str) -> None:
    wrong = "WRONG-secret-" + "9" * 20
    store = _s3(s3_endpoint, aws_secret_access_key=wrong)
    try:
        for attempt in (store.check, lambda: store.put_bytes("k", b"x"), lambda: store.get_bytes("k", 10),
                        lambda: list(store.list(""))):
            with pytest.raises(SnapshotStoreError) as err:
                attempt()
            assert not err.value.retryable
            assert wrong not in str(err.value) and wrong not in repr(err.value.to_dict())
    finally:
        store.close()


def test_s3_unknown_access_key_not_retryable(s3_endpoint: str) -> None:
    store = _s3(s3_endpoint, aws_access_key_id="nobody-knows-me")
    try:
        with pytest.raises(SnapshotStoreError) as err:
            store.put_bytes("k", b"x")
        assert not err.value.retryable
        assert err.value.context["error"] in ("InvalidAccessKeyId", "AccessDenied", "SignatureDoesNotMatch")
    finally:
        store.close()


def test_s3_missing_bucket_not_retryable(s3_endpoint: str) -> None:
    store = _s3(s3_endpoint, bucket="sfs-no-such-bucket")
    try:
        with pytest.raises(SnapshotStoreError) as err:
            store.check()
        assert not err.value.retryable and "bucket does not exist" in err.value.reason
        with pytest.raises(SnapshotStoreError) as err:
            store.get_bytes("k", 10)
        assert not err.value.retryable
    finally:
        store.close()


def test_s3_unreachable_endpoint_retryable(s3_endpoint: str) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = _s3(f"http://127.0.0.1:{port}")
    try:
        for attempt in (store.check, lambda: store.put_bytes("k", b"x"), lambda: store.head("k")):
            with pytest.raises(SnapshotStoreError) as err:
                attempt()
            assert err.value.retryable and err.value.code == "snapshot_store_unavailable"
    finally:
        store.close()


def test_s3_part_sizes_fit_the_part_limit() -> None:
    from sandbox_fs.snapshot._s3 import MAX_PARTS, MIN_PART_SIZE, part_size_for

    total = sum(part_size_for(n, MIN_PART_SIZE) for n in range(1, MAX_PARTS + 1))
    assert total >= 5 << 40  # S3's largest object fits in 10,000 parts of unknown-size growth
    assert part_size_for(1, MIN_PART_SIZE) == MIN_PART_SIZE == part_size_for(900, MIN_PART_SIZE)
    assert part_size_for(901, MIN_PART_SIZE) == 2 * MIN_PART_SIZE
    assert max(part_size_for(n, 8 << 20) for n in range(1, MAX_PARTS + 1)) <= 5 << 30


def test_s3_writer_memory_bounded_by_parts(s3_endpoint: str) -> None:
    import tracemalloc

    import _seaweed

    store = make_s3(s3_endpoint, f"mem/{os.getpid()}")
    chunk = b"m" * (1 << 20)

    def upload(_attempt: int) -> int:
        tracemalloc.start()
        try:
            writer = store.put_stream("big")
            for _ in range(40):  # 40 MiB through 5 MiB parts
                writer.write(chunk)
            writer.commit()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    peak = _seaweed.rerun_transient(upload)
    head = store.head("big")
    assert head is not None and head.size == 40 << 20
    store.delete("big")
    assert peak < 4 * MIN_PART + (2 << 20), peak  # (upload_threads + 2) parts, not the object


class _ListingClient:
    """A stand-in boto3 client whose listing also returns keys outside the prefix asked for."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys

    def get_paginator(self, name: str) -> Any:
        assert name == "list_objects_v2"
        keys = self.keys

        class _Pages:
            def paginate(self, **kw: Any) -> Iterator[dict[str, Any]]:
                yield {"Contents": [{"Key": k, "Size": 1, "ETag": '"e"'} for k in keys]}

        return _Pages()


def test_s3_listing_leaves_out_keys_outside_the_prefix_asked_for() -> None:
    """A store that lists foreign keys (misbehaving or hostile) never gets them cut to look like ours."""
    pytest.importorskip("boto3", reason="boto3 (the s3 extra) is not installed")
    from sandbox_fs.snapshot._s3 import S3Objects

    foreign = ["sessX/gen-1", "other/sessA/gen-1", "sess", "sessA"]
    store = S3Objects("bucket", "sess", client=_ListingClient(["sess/a/1", *foreign, "sess/b"]))
    assert [o.key for o in store.list("")] == ["a/1", "b"]
    store2 = S3Objects("bucket", "sess", client=_ListingClient(["sess/a/1", "sess/ab", "xsess/a/2"]))
    assert [o.key for o in store2.list("a/")] == ["a/1"]


# -- a connection dropped while a body is read (S3Objects resumes it from the byte it reached)


class _CuttingProxy:
    """A TCP proxy in front of the S3 server that drops a GET's connection part way through its body.

    Each client connection is relayed over one upstream connection of its
    own.  The requests (GETs only: the tests read through it, and write
    directly) are parsed for their ``Range`` and ``If-Match``; the responses
    for their ``Content-Length``.  A response body longer than ``after``
    bytes gets exactly ``after`` bytes through, then both sockets are closed,
    ``cuts`` times (-1: every time).  ``requests`` and ``dropped`` record what
    passed: ``(first byte asked for, If-Match sent)`` per request, and
    ``(first byte asked for, body bytes let through)`` per dropped connection.
    """

    def __init__(self, endpoint: str, after: int, cuts: int) -> None:
        import socket
        import urllib.parse

        up = urllib.parse.urlsplit(endpoint)
        self.upstream = (up.hostname or "127.0.0.1", up.port or 80)
        self.after, self.cuts = after, cuts
        self.requests: list[tuple[int, bool]] = []
        self.dropped: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def __enter__(self) -> "_CuttingProxy":
        return self

    def __exit__(self, *exc: object) -> None:
        self._listener.close()

    def _accept(self) -> None:
        import collections
        import socket

        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            asked: collections.deque[int] = collections.deque()
            threading.Thread(target=self._requests, args=(client, server, asked), daemon=True).start()
            threading.Thread(target=self._responses, args=(server, client, asked), daemon=True).start()

    @staticmethod
    def _head(sock: Any, buf: bytearray) -> bytes | None:
        """The next header block from ``sock`` (``buf`` keeps what was read past it); None at the end."""
        while b"\r\n\r\n" not in buf:
            data = sock.recv(65536)
            if not data:
                return None
            buf += data
        end = buf.index(b"\r\n\r\n") + 4
        head = bytes(buf[:end])
        del buf[:end]
        return head

    @staticmethod
    def _header(head: bytes, name: bytes) -> bytes | None:
        for line in head.split(b"\r\n")[1:]:
            key, _, value = line.partition(b":")
            if key.strip().lower() == name:
                return value.strip()
        return None

    def _requests(self, client: Any, server: Any, asked: Any) -> None:
        buf = bytearray()
        with contextlib.suppress(OSError):
            while (head := self._head(client, buf)) is not None:  # GETs: a header block each, no body
                rng = self._header(head, b"range")
                first = int(rng.split(b"=")[1].split(b"-")[0]) if rng else 0
                with self._lock:
                    self.requests.append((first, self._header(head, b"if-match") is not None))
                asked.append(first)
                server.sendall(head)

    def _responses(self, server: Any, client: Any, asked: Any) -> None:
        buf = bytearray()
        try:
            while (head := self._head(server, buf)) is not None:
                length = int(self._header(head, b"content-length") or 0)
                first = asked.popleft() if asked else -1
                with self._lock:
                    cut = length > self.after and self.cuts != 0
                    if cut:
                        self.cuts -= 1
                        self.dropped.append((first, self.after))
                keep = self.after if cut else length
                client.sendall(head)
                while keep:
                    if not buf:
                        buf += server.recv(65536)
                        if not buf:
                            return
                    take = min(keep, len(buf))
                    client.sendall(bytes(buf[:take]))
                    del buf[:take]
                    keep -= take
                if cut:
                    return
        except OSError:
            pass
        finally:
            for s in (client, server):
                with contextlib.suppress(OSError):
                    s.shutdown(2)
                s.close()


def _through(endpoint: str, prefix: str, **kw: Any) -> Any:
    """An S3Objects on the contract bucket reaching the server at ``endpoint`` (a proxy), one attempt per request."""
    from sandbox_fs.snapshot._s3 import S3Objects, S3Options

    import _seaweed

    opts = S3Options(endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=_seaweed.ACCESS_KEY,
                     aws_secret_access_key=_seaweed.SECRET_KEY, part_size=MIN_PART, max_attempts=1,
                     connect_timeout=2, read_timeout=10, **kw)
    return S3Objects(_BUCKET, prefix, options=opts)


def test_s3_read_resumes_a_body_the_connection_dropped(s3_endpoint: str) -> None:
    """A GET's connection dropped part way: the read goes on from the byte it reached, nothing twice or skipped."""
    prefix = f"drop/{os.getpid()}-{next(_counter)}"
    direct = make_s3(s3_endpoint, prefix)
    blob = os.urandom(2 * MIN_PART + 333_333)  # three ranges of a reader
    writer = direct.put_stream("big")
    writer.write(blob)
    etag = writer.commit().etag
    small = os.urandom(300_000)
    direct.put_bytes("small", small)
    cases: list[tuple[str, Any, bytes]] = [
        ("open_range", lambda s: s.open_range("big").read(), blob),
        ("open_range from an offset", lambda s: s.open_range("big", 777, MIN_PART + 10).read(),
         blob[777:777 + MIN_PART + 10]),
        ("get_bytes", lambda s: s.get_bytes("small", 1 << 20), small),
    ]
    import _seaweed

    def through_a_drop(read: Any) -> tuple[bytes, _CuttingProxy]:
        with _CuttingProxy(s3_endpoint, after=123_457, cuts=1) as proxy:
            store = _through(proxy.endpoint, prefix, read_threads=2)
            try:
                return read(store), proxy
            finally:
                store.close()

    for what, read, want in cases:
        got, proxy = _seaweed.rerun_transient(lambda _attempt: through_a_drop(read))
        assert got == want, what  # exactly the object's bytes
        assert len(proxy.dropped) == 1, what
        first, through = proxy.dropped[0]
        # the resumed request asks for the byte after the last one that got through, of the same version
        assert (first + through, True) in proxy.requests, (what, proxy.requests)
    assert direct.head("big").etag == etag


def test_s3_read_of_a_connection_that_keeps_dropping_is_retryable(s3_endpoint: str) -> None:
    """A body whose connection drops every time: snapshot_store_unavailable, retryable, no secret or host detail."""
    import _seaweed
    from sandbox_fs.snapshot._s3 import BODY_RESUMES

    prefix = f"drop/{os.getpid()}-{next(_counter)}"
    direct = make_s3(s3_endpoint, prefix)
    after = 65_536
    direct.put_bytes("small", os.urandom((BODY_RESUMES + 2) * after))  # more than the resumes can get through
    writer = direct.put_stream("big")
    writer.write(os.urandom(MIN_PART + 1))
    writer.commit()
    with _CuttingProxy(s3_endpoint, after=after, cuts=-1) as proxy:
        store = _through(proxy.endpoint, prefix)
        try:
            for read in (lambda: store.get_bytes("small", 1 << 20), lambda: store.open_range("big").read()):
                with pytest.raises(SnapshotStoreError) as err:
                    read()
                exc = err.value
                assert exc.code == "snapshot_store_unavailable" and exc.retryable
                shown = f"{exc} {exc.to_dict()}"
                for secret in (_seaweed.SECRET_KEY, proxy.endpoint, "127.0.0.1", os.getcwd(), "/tmp"):
                    assert secret not in shown, secret
        finally:
            store.close()
    assert len(proxy.dropped) >= 2 * (BODY_RESUMES + 1)  # each read was resumed BODY_RESUMES times, then gave up


class _Body:
    """A response body that ends (as a dropped connection does) after ``cut`` of its bytes."""

    def __init__(self, data: bytes, cut: int) -> None:
        self.data, self.cut, self.pos = data, cut, 0

    def readinto(self, b: Any) -> int:
        from botocore.exceptions import ResponseStreamingError

        if self.pos >= self.cut and self.cut < len(self.data):
            raise ResponseStreamingError(error="connection broken")
        n = min(len(b), min(self.cut, len(self.data)) - self.pos)
        b[:n] = self.data[self.pos:self.pos + n]
        self.pos += n
        return n

    def close(self) -> None:
        pass


class _ShiftingClient:
    """A stand-in boto3 client whose answer to a resumed GET starts ``shift`` bytes from the byte asked for."""

    def __init__(self, obj: bytes, shift: int) -> None:
        self.obj, self.shift, self.asked = obj, shift, []

    def get_object(self, **kw: Any) -> dict[str, Any]:
        first = int(kw["Range"].split("=")[1].split("-")[0]) if "Range" in kw else 0
        self.asked.append(first)
        if first == 0:  # the first answer: the whole object, its connection dropped half way
            return {"Body": _Body(self.obj, len(self.obj) // 2), "ContentLength": len(self.obj), "ETag": '"e1"',
                    "ResponseMetadata": {"HTTPStatusCode": 200}}
        start = first + self.shift
        return {"Body": _Body(self.obj[start:], len(self.obj)), "ContentLength": len(self.obj) - start,
                "ContentRange": f"bytes {start}-{len(self.obj) - 1}/{len(self.obj)}", "ETag": '"e1"',
                "ResponseMetadata": {"HTTPStatusCode": 206}}


@pytest.mark.parametrize("shift", [0, -1, 1])
def test_s3_resumed_read_takes_only_the_byte_it_asked_for(shift: int) -> None:
    """A resumed answer that starts elsewhere (a byte twice, a byte skipped) is refused, not spliced in."""
    pytest.importorskip("boto3", reason="boto3 (the s3 extra) is not installed")
    from sandbox_fs.snapshot._s3 import S3Objects

    obj = bytes(range(256)) * 40
    client = _ShiftingClient(obj, shift)
    store = S3Objects("bucket", "p", client=client)
    if shift == 0:
        assert store.get_bytes("k", 1 << 20) == obj
    else:
        with pytest.raises(SnapshotStoreError) as err:
            store.get_bytes("k", 1 << 20)
        assert not err.value.retryable and "other bytes than asked for" in str(err.value)
    assert client.asked == [0, len(obj) // 2]


class _SwappingClient:
    """A stand-in boto3 client that ignores ``If-Match``: its answers after the first are of another version
    (``etag2``, ``obj2``), or carry no ETag (``etag1`` None: none at all)."""

    def __init__(self, obj: bytes, obj2: bytes, etag1: str | None, etag2: str | None, cut: bool) -> None:
        self.obj, self.obj2, self.etag1, self.etag2, self.cut = obj, obj2, etag1, etag2, cut
        self.calls: list[dict[str, Any]] = []

    def get_object(self, **kw: Any) -> dict[str, Any]:
        self.calls.append(kw)
        rng = kw.get("Range")
        first, data, etag = (0, self.obj, self.etag1) if len(self.calls) == 1 else (0, self.obj2, self.etag2)
        last = len(data) - 1
        if rng:
            a, b = rng.split("=")[1].split("-")
            first, last = int(a), min(int(b), last) if b else last
        resp: dict[str, Any] = {"Body": _Body(data[first:last + 1], (last + 1 - first) // 2 if self.cut and
                                              len(self.calls) == 1 else last + 1 - first),
                                "ContentLength": last + 1 - first, "ResponseMetadata": {"HTTPStatusCode": 206}}
        if rng:
            resp["ContentRange"] = f"bytes {first}-{last}/{len(data)}"
        else:
            resp["ResponseMetadata"]["HTTPStatusCode"] = 200
        if etag is not None:
            resp["ETag"] = f'"{etag}"'
        return resp


@pytest.mark.parametrize("etag1,etag2,size2", [("e1", "e2", 0), ("e1", None, 0), (None, None, 0),
                                               ("e1", "e1", 0), ("e1", "e1", 512)])
def test_s3_a_read_never_splices_bytes_of_another_version(etag1: str | None, etag2: str | None, size2: int) -> None:
    """A store that ignores ``If-Match``: a resumed body (get_bytes) and the later ranges of a ranged read
    (open_range) come from another version.  Before the check their bytes were taken as the rest of the
    first version's.  Refused (retryable) unless the answer is of the first version (same ETag and size)."""
    pytest.importorskip("boto3", reason="boto3 (the s3 extra) is not installed")
    from sandbox_fs.snapshot._s3 import S3Objects, S3Options

    obj = bytes(range(256)) * 40
    obj2 = bytes(255 - b for b in obj) + b"x" * size2
    same = etag1 is not None and etag1 == etag2 and not size2
    for ranged in (False, True):
        client = _SwappingClient(obj, obj2 if not same else obj, etag1, etag2, cut=not ranged)
        opts = S3Options()
        opts.part_size = 4096  # ranges of 4 KiB (below what S3 allows for parts: only the reads use it here)
        store = S3Objects("bucket", "p", client=client, options=opts)
        try:
            if same:
                got = store.get_bytes("k", 1 << 20) if not ranged else store.open_range("k").read()
                assert got == obj
                continue
            with pytest.raises(SnapshotStoreError) as err:
                got = store.get_bytes("k", 1 << 20) if not ranged else store.open_range("k").read()
            assert err.value.retryable and "changed while it was read" in str(err.value)
        finally:
            store.close()
