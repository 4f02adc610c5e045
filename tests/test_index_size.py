"""An index object is never read past what its entry limit could decode.

Regression: the metadata's ``index_bytes`` (chosen by the store) was the read
limit for the index object, so a forged generation whose metadata recorded
a terabyte made hydrate ask the store for a terabyte into memory (and a
local store's ``pread`` fail with MemoryError, not a refusal).
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox_fs.root import open_root
from sandbox_fs.snapshot import GenerationStore, SnapshotCorruptError, SnapshotLimits, SnapshotPolicy, hydrate, persist
from sandbox_fs.snapshot._index import max_index_bytes
from sandbox_fs.snapshot._objects_local import LocalObjects


def _forge_index_bytes(store: GenerationStore, name: str, index_bytes: int) -> None:
    """Rewrite the current generation's metadata to record ``index_bytes`` and re-point the pointer at it."""
    objects = store.objects
    ptr = json.loads(objects.get_bytes(f"{name}/current", 1 << 20))
    entry = ptr["generations"][0]
    meta_key = f"{name}/gen/{entry['dir']}/meta.json"
    meta = json.loads(objects.get_bytes(meta_key, 1 << 20))
    meta["index_bytes"] = index_bytes
    raw = json.dumps(meta).encode()
    objects.put_bytes(meta_key, raw)
    entry["meta_sha256"] = hashlib.sha256(raw).hexdigest()
    objects.put_bytes(f"{name}/current", json.dumps(ptr).encode())


@pytest.fixture
def saved(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "f").write_bytes(b"data")
    store = GenerationStore(LocalObjects(tmp_path / "store"))
    with open_root(str(ws)) as root:
        persist(root, store, "n")
        (ws / "f").write_bytes(b"data, changed")
        assert persist(root, store, "n").info.chain_length == 2  # a layer: hydrate reads its index
    with store:
        yield store, tmp_path


@pytest.mark.parametrize("index_bytes", [1 << 40, max_index_bytes(SnapshotPolicy(SnapshotLimits(max_entries=10))) + 1])
def test_forged_index_size_is_refused_before_the_read(saved, monkeypatch, index_bytes):
    store, tmp_path = saved
    _forge_index_bytes(store, "n", index_bytes)
    limits = SnapshotLimits(max_entries=10)
    bound = max_index_bytes(SnapshotPolicy(limits))
    real = store.objects.get_bytes
    asked: list[int] = []

    def get_bytes(key: str, limit: int) -> bytes:
        if key.endswith("/index"):
            asked.append(limit)
        assert not key.endswith("/index") or limit <= bound, f"asked the store for {limit} bytes of {key}"
        return real(key, limit)

    monkeypatch.setattr(store.objects, "get_bytes", get_bytes)
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "keep").write_bytes(b"k")
    with open_root(str(dest)) as root, pytest.raises(SnapshotCorruptError):
        hydrate(root, store, "n", limits=limits)
    assert os.listdir(dest) == ["keep"]
    # the persist that chains onto it reads it with the same bound, and writes a full generation instead
    with open_root(str(tmp_path / "ws")) as root:
        assert persist(root, store, "n", limits=limits).info.chain_length == 1
    assert len(asked) == 0  # (the bound refuses it before any read)


def test_a_real_index_fits_the_bound(saved):
    store, tmp_path = saved
    dest = tmp_path / "dest"
    dest.mkdir()
    with open_root(str(dest)) as root:  # the chain's two archives hold "f" twice; its index names it once
        hydrate(root, store, "n", limits=SnapshotLimits(max_entries=2))
    assert (dest / "f").read_bytes() == b"data, changed"
    ptr, _etag = store._pointer("n")  # and as the persist that chains onto it reads it
    info = store.info("n")
    index = store._index("n", ptr.generations[0], info, SnapshotPolicy(SnapshotLimits(max_entries=1)),
                         frozenset({1, 2}))
    assert [e.path for e in index.entries] == ["f"]


@settings(max_examples=25, deadline=None)
@given(max_entries=st.integers(1, 4), fill=st.floats(0.0, 1.0), seed=st.binary(min_size=16, max_size=16))
def test_bound_never_refuses_what_could_decode(max_entries, fill, seed):
    """Incompressible text of up to the decode bound compresses (level 1, as encode_index) within the bound."""
    policy = SnapshotPolicy(SnapshotLimits(max_entries=max_entries))
    text_bound = (max_entries + 1) * 4608
    n = int(text_bound * fill)
    data = b"".join(hashlib.sha256(seed + i.to_bytes(4, "big")).digest() for i in range(n // 32 + 1))[:n]
    assert len(zlib.compress(data, 1)) <= max_index_bytes(policy)
