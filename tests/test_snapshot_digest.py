"""The archive digest of version-2 generations: BLAKE3 for what persist and copies write, SHA-256 for older ones.

A generation persisted or copied into a :class:`GenerationStore` records
``archive_blake3`` (the BLAKE3 of the stored archive) and ``archive_sha256 ==
""``; an older generation records only ``archive_sha256`` and is checked by
it.  Each generation is checked by the one digest its metadata records
(``_digest.archive_check``): a byte changed in the store is refused with the
workspace unchanged, whichever kind; metadata recording both, neither, or one
digest in the other's field never verifies.  Older generations are made here
by editing the stored metadata and re-pinning the pointer's metadata digest,
as the tests of forged generations do (``test_snapshot_layers``,
``test_snapshot_generations``).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import zlib
from pathlib import Path
from typing import Any, Callable

import blake3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from _copy_source import ServedSource, one_file_tar

from sandbox_fs import open_root
from sandbox_fs.snapshot import (
    DirectorySnapshotStore,
    LocalSnapshotStore,
    SnapshotCorruptError,
    SnapshotInfo,
    SnapshotLimits,
    hydrate,
    persist,
)
from sandbox_fs.snapshot._fork import copy_snapshot
from sandbox_fs.snapshot._reader import VerifyingReader

_T = "ab" * 32
_BIG = bytes(range(256)) * 600  # a file's content in the archive: a byte flipped in it leaves a valid tar


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _b3(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def _tree(ws: Path, text: str) -> None:
    (ws / "d").mkdir(exist_ok=True)
    (ws / "d" / "a.txt").write_text(text)
    (ws / "big").write_bytes(_BIG)


def _view(root: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every entry below ``root``: its mode and (a file's) bytes, so a changed or left-over name shows."""
    out: dict[str, tuple[int, bytes | None]] = {}
    for p in sorted(root.rglob("*")):
        st_ = p.lstat()
        out[str(p.relative_to(root))] = (st_.st_mode, p.read_bytes() if p.is_file() and not p.is_symlink() else None)
    return out


def _files(root: Path) -> dict[str, bytes]:
    return {k: v for k, (_m, v) in _view(root).items() if v is not None}


def _restore(store: Any, name: str, dst: Path) -> dict[str, bytes]:
    dst.mkdir(exist_ok=True)
    with open_root(dst) as d:
        hydrate(d, store, name)
    return _files(dst)


def _persisted(tmp_path: Path, text: str = "one") -> tuple[Path, Path, SnapshotInfo]:
    """A workspace with :func:`_tree` persisted as "s" into a new directory store: (ws, store dir, info)."""
    ws, sdir = tmp_path / "ws", tmp_path / "store"
    ws.mkdir()
    _tree(ws, text)
    with DirectorySnapshotStore(sdir) as store, open_root(ws) as w:
        info = persist(w, store, "s").info
    assert info is not None
    return ws, sdir, info


def _meta_path(sdir: Path, info: SnapshotInfo) -> Path:
    return sdir / info.archive.replace("archive.tar", "meta.json")


def _rewrite_meta(sdir: Path, info: SnapshotInfo, edit: Callable[[dict[str, Any]], None]) -> str:
    """Edit the stored metadata of ``info`` and re-pin the pointer's digest of it (a forged or older generation).

    Returns the new metadata digest.
    """
    meta = json.loads(_meta_path(sdir, info).read_bytes())
    edit(meta)
    mraw = json.dumps(meta, indent=1).encode()
    _meta_path(sdir, info).write_bytes(mraw)
    ptr = json.loads((sdir / "s" / "current").read_bytes())
    entry = next(e for e in ptr["generations"] if e["generation"] == info.generation)
    entry["meta_sha256"] = _sha(mraw)
    (sdir / "s" / "current").write_text(json.dumps(ptr))
    return _sha(mraw)


def _as_older(sdir: Path, info: SnapshotInfo) -> str:
    """Make ``info``'s stored generation an older-format one: the archive's SHA-256 only (no BLAKE3)."""
    archive = (sdir / info.archive).read_bytes()
    return _rewrite_meta(sdir, info, lambda m: m.update(archive_sha256=_sha(archive), archive_blake3=""))


def _workspace_with_content(tmp_path: Path) -> Path:
    dst = tmp_path / "dst"
    (dst / "mydir").mkdir(parents=True)
    (dst / "mine").write_bytes(b"the workspace's own file\n")
    (dst / "mydir" / "x").write_bytes(b"x\n")
    os.chmod(dst / "mine", 0o640)
    return dst


def _refused_unchanged(store: Any, dst: Path, match: str | None = None) -> None:
    """Hydrate "s" into ``dst``: SnapshotCorruptError, and every entry of ``dst`` exactly as before."""
    before = _view(dst)
    with open_root(dst) as d, pytest.raises(SnapshotCorruptError, match=match):
        hydrate(d, store, "s")
    assert _view(dst) == before  # same names (no staging left), modes and bytes


# -------------------------------------------------------------------- what is recorded


def test_a_new_generation_records_the_blake3_of_its_stored_archive_and_no_sha256(tmp_path: Path) -> None:
    ws, sdir, info = _persisted(tmp_path)
    archive = (sdir / info.archive).read_bytes()
    assert info.version == 2 and info.archive_sha256 == "" and info.archive_blake3 == _b3(archive)
    assert info.archive_blake3 != _sha(archive)
    raw = json.loads(_meta_path(sdir, info).read_bytes())
    assert raw["archive_blake3"] == _b3(archive) and raw["archive_sha256"] == ""
    with DirectorySnapshotStore(sdir) as store:  # as another process reads it back
        again = store.info("s")
        assert again is not None and again.archive_blake3 == _b3(archive) and again.archive_sha256 == ""
        assert _restore(store, "s", tmp_path / "r") == _files(ws)






@pytest.mark.parametrize("kind", ["sha256", "sha256+crc32"])
def test_a_copy_of_a_sha256_only_source_records_blake3_and_no_sha256(tmp_path: Path, kind: str) -> None:
    """copy_snapshot into a GenerationStore from an older source (its SHA-256 only): the copy's metadata records
    the BLAKE3 of what was stored and clears the SHA-256 the source's metadata carried."""
    data = one_file_tar()
    fields: dict[str, Any] = {"archive_sha256": _sha(data)}
    if kind == "sha256+crc32":
        fields["archive_crc32"] = f"{zlib.crc32(data):08x}"
    info = SnapshotInfo(name="a", archive="x", archive_bytes=len(data), fingerprint=_T, tree_digest=_T, entries=1,
                        content_bytes=5, version=2, **fields)
    with DirectorySnapshotStore(tmp_path / "s") as store:
        got = copy_snapshot(ServedSource(data, info), store, "a", "b", None, None, SnapshotLimits())
        stored = (tmp_path / "s" / got.archive).read_bytes()
        assert stored == data and got.archive_sha256 == "" and got.archive_blake3 == _b3(data)
        raw = json.loads((tmp_path / "s" / got.archive.replace("archive.tar", "meta.json")).read_bytes())
        assert raw["archive_sha256"] == "" and raw["archive_blake3"] == _b3(data)
        assert _restore(store, "b", tmp_path / "r") == {"f": b"hello"}


def test_a_fork_of_a_version_1_snapshot_records_blake3(tmp_path: Path) -> None:
    """A directory still holding a version-1 snapshot forks it by a copy: the copy is a BLAKE3 generation."""
    ws, sdir = tmp_path / "ws", tmp_path / "store"
    ws.mkdir()
    _tree(ws, "v1")
    with LocalSnapshotStore(sdir) as old, open_root(ws) as w:
        v1 = persist(w, old, "s").info
    assert v1 is not None and v1.version == 1 and v1.archive_blake3 == "" and v1.archive_sha256 == ""
    with DirectorySnapshotStore(sdir) as store:
        forked = store.fork("s", "f")
        stored = (sdir / forked.archive).read_bytes()
        assert forked.version == 2 and forked.archive_sha256 == "" and forked.archive_blake3 == _b3(stored)
        assert _restore(store, "f", tmp_path / "r") == _files(ws)


# -------------------------------------------------------------------- a changed byte, either kind


def _flip_content_byte(sdir: Path, info: SnapshotInfo) -> None:
    """Flip one byte of a file's content in the stored archive: same size, still a valid tar."""
    path = sdir / info.archive
    data = bytearray(path.read_bytes())
    at = bytes(data).find(_BIG[:1024]) + 700
    assert at > 700
    data[at] ^= 0x20
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("kind", ["blake3", "sha256"])
def test_a_byte_changed_in_the_store_is_refused_and_the_workspace_is_unchanged(tmp_path: Path, kind: str) -> None:
    _ws, sdir, info = _persisted(tmp_path)
    if kind == "sha256":
        _as_older(sdir, info)
    dst = _workspace_with_content(tmp_path)
    with DirectorySnapshotStore(sdir) as store:
        assert _restore(store, "s", tmp_path / "good")["big"] == _BIG  # it verifies before the change
    _flip_content_byte(sdir, info)
    with DirectorySnapshotStore(sdir) as store:
        _refused_unchanged(store, dst, match="digest")
        with pytest.raises(SnapshotCorruptError):  # a copy reads it through the same check
            store.open_archive("s", SnapshotLimits())[0].read()


@pytest.mark.parametrize("kind", ["blake3", "sha256"])
def test_a_changed_layer_of_either_kind_is_refused(tmp_path: Path, kind: str) -> None:
    """A chain whose base is an older (SHA-256) or new generation and whose layer is BLAKE3: a byte changed in
    the base is refused, with the workspace unchanged."""
    ws, sdir, info = _persisted(tmp_path)
    if kind == "sha256":
        _as_older(sdir, info)
    _tree(ws, "two")
    with DirectorySnapshotStore(sdir) as store, open_root(ws) as w:
        layer = persist(w, store, "s").info
    assert layer is not None and layer.chain_length == 2 and layer.archive_blake3
    _flip_content_byte(sdir, info)  # "big" is unchanged: the base holds it
    with DirectorySnapshotStore(sdir) as store:
        _refused_unchanged(store, _workspace_with_content(tmp_path), match="digest")


# -------------------------------------------------------------------- older generations still work


def test_an_older_sha256_generation_restores_forks_and_takes_a_blake3_layer(tmp_path: Path) -> None:
    ws, sdir, info = _persisted(tmp_path, "old")
    digest = _as_older(sdir, info)
    with DirectorySnapshotStore(sdir) as store:
        old = store.info("s")
        assert old is not None and old.archive_blake3 == "" and old.archive_sha256 and old.digest == digest
        assert _restore(store, "s", tmp_path / "r1") == _files(ws)
        forked = store.fork("s", "f")  # shared: the very metadata, SHA-256 and all
        assert forked.archive_sha256 == old.archive_sha256 and forked.archive_blake3 == ""
        _tree(ws, "new")
        with open_root(ws) as w:
            layer = persist(w, store, "s").info
        assert layer is not None and layer.chain_length == 2 and layer.parent_digest == digest
        assert layer.archive_sha256 == "" and layer.archive_blake3 == _b3((sdir / layer.archive).read_bytes())
        assert _restore(store, "s", tmp_path / "r2") == _files(ws)
        assert _restore(store, "f", tmp_path / "r3")["d/a.txt"] == b"old"


# -------------------------------------------------------------------- digest confusion


_DIGEST_FIELDS = [
    ({"version": 2, "archive_blake3": "1" * 64}, True),
    ({"version": 2, "archive_sha256": "1" * 64}, True),
    ({"version": 2, "archive_sha256": "1" * 64, "archive_blake3": "1" * 64}, False),  # one digest
    ({"version": 2, "archive_sha256": "1" * 64, "archive_blake3": "2" * 64}, False),
    ({"version": 1, "archive_crc32": "0123abcd", "archive_blake3": "1" * 64}, False),  # version 1: CRC-32 only
    ({"version": 1, "archive_crc32": "0123abcd"}, True),
    ({"version": 2, "archive_blake3": "1" * 63}, False),
    ({"version": 2, "archive_blake3": "A" * 64}, False),
    ({"version": 2, "archive_blake3": None}, False),
]


@pytest.mark.parametrize(("fields", "ok"), _DIGEST_FIELDS)
def test_metadata_records_at_most_one_archive_digest(fields: dict[str, Any], ok: bool) -> None:
    data = {"name": "s", "archive": "x", "archive_bytes": 0, "fingerprint": _T, "tree_digest": _T, "entries": 0,
            "content_bytes": 0, **fields}
    if ok:
        got = SnapshotInfo.model_validate(data)
        assert (got.archive_blake3, got.archive_sha256) == (fields.get("archive_blake3", ""),
                                                            fields.get("archive_sha256", ""))
    else:
        with pytest.raises(ValidationError):
            SnapshotInfo.model_validate(data)


def _both(archive: bytes) -> Callable[[dict[str, Any]], None]:
    return lambda m: m.update(archive_sha256=_sha(archive), archive_blake3=_b3(archive))


def _swapped(archive: bytes) -> Callable[[dict[str, Any]], None]:  # the BLAKE3 field holds the SHA-256
    return lambda m: m.update(archive_sha256="", archive_blake3=_sha(archive))


def _swapped_back(archive: bytes) -> Callable[[dict[str, Any]], None]:  # the SHA-256 field holds the BLAKE3
    return lambda m: m.update(archive_sha256=_b3(archive), archive_blake3="")


def _neither(archive: bytes) -> Callable[[dict[str, Any]], None]:
    return lambda m: m.update(archive_sha256="", archive_blake3="", archive_crc32=f"{zlib.crc32(archive):08x}")


@pytest.mark.parametrize("forge", [_both, _swapped, _swapped_back, _neither])
def test_stored_metadata_with_a_confused_archive_digest_is_refused(tmp_path: Path, forge: Any) -> None:
    """Metadata re-pinned by the pointer (a store writing both objects) that records both digests, one digest in the
    other's field, or neither (a CRC-32 at most, never relied on in version 2): hydrate and copies refuse it."""
    _ws, sdir, info = _persisted(tmp_path)
    _rewrite_meta(sdir, info, forge((sdir / info.archive).read_bytes()))
    with DirectorySnapshotStore(sdir) as store:
        _refused_unchanged(store, _workspace_with_content(tmp_path))
        with pytest.raises(SnapshotCorruptError):
            store.open_archive("s", SnapshotLimits())[0].read()
        with pytest.raises(SnapshotCorruptError):
            copy_snapshot(store, store, "s", "f", None, None, SnapshotLimits())
        assert store.info("f") is None


def test_version_1_metadata_with_a_blake3_is_refused_on_read(tmp_path: Path) -> None:
    ws, sdir = tmp_path / "ws", tmp_path / "store"
    ws.mkdir()
    _tree(ws, "v1")
    with LocalSnapshotStore(sdir) as old, open_root(ws) as w:
        v1 = persist(w, old, "s").info
    assert v1 is not None
    meta = json.loads((sdir / "s.json").read_bytes())
    meta["archive_blake3"] = _b3((sdir / v1.archive).read_bytes())
    (sdir / "s.json").write_text(json.dumps(meta))
    with LocalSnapshotStore(sdir) as old, pytest.raises(SnapshotCorruptError):
        old.info("s")


def test_the_reader_refuses_metadata_naming_another_kind_than_it_hashed() -> None:
    """verify() with metadata of the other kind (its field holding the digest the reader did compute) is refused:
    a digest is compared only with the one computed by its own algorithm."""
    data = one_file_tar() * 3
    common = {"name": "s", "archive": "x", "archive_bytes": len(data), "fingerprint": _T, "tree_digest": _T,
              "entries": 0, "content_bytes": 0, "version": 2}
    for hashed, claimed in ((SnapshotInfo(archive_blake3=_b3(data), **common),
                             SnapshotInfo(archive_sha256=_b3(data), **common)),
                            (SnapshotInfo(archive_sha256=_sha(data), **common),
                             SnapshotInfo(archive_blake3=_sha(data), **common))):
        reader = VerifyingReader(io.BufferedReader(io.BytesIO(data)), hashed)
        assert reader.read() == data
        with pytest.raises(SnapshotCorruptError):
            reader.verify(claimed)
        reader = VerifyingReader(io.BufferedReader(io.BytesIO(data)), hashed)
        assert reader.read() == data
        reader.verify(hashed)  # the same reader and bytes verify under the metadata it hashed for


# -------------------------------------------------------------------- the verifying reader, both kinds


@settings(max_examples=50, deadline=None)
@given(chunk=st.binary(max_size=700), repeat=st.integers(1, 3000), kind=st.sampled_from(["blake3", "sha256"]),
       change=st.sampled_from(["none", "flip", "truncate", "append", "other_kind"]), where=st.integers(0, 1 << 30),
       xor=st.integers(1, 255))
def test_verifying_reader_accepts_exactly_the_recorded_size_and_digest(chunk: bytes, repeat: int, kind: str,
                                                                       change: str, where: int, xor: int) -> None:
    """Read to the end and verify: accepted iff the store's bytes have the recorded size and the recorded digest
    of the recorded kind (up to ~2 MiB: across the reader's 1 MiB blocks)."""
    data = chunk * repeat
    digest = _b3(data) if kind == "blake3" else _sha(data)
    if change == "other_kind":  # the field holds the other algorithm's digest of the very bytes
        digest = _sha(data) if kind == "blake3" else _b3(data)
    info = SnapshotInfo(name="s", archive="x", archive_bytes=len(data), fingerprint=_T, tree_digest=_T, entries=0,
                        content_bytes=0, version=2, **{f"archive_{kind}": digest})
    served = bytearray(data)
    if change == "flip" and data:
        served[where % len(data)] ^= xor
    elif change == "truncate" and data:
        del served[where % len(data):]
    elif change == "append":
        served += bytes([xor]) * (1 + where % 3)
    reader = VerifyingReader(io.BufferedReader(io.BytesIO(bytes(served)), 1 << 20), info)
    got = bytearray()
    while block := reader.read(1 << 19):
        got += block
    assert bytes(got) == bytes(served[:len(data)])
    if change == "none" or (not data and change in ("flip", "truncate")):
        reader.verify(info)
    else:
        with pytest.raises(SnapshotCorruptError):
            reader.verify(info)
    reader.close()


# -------------------------------------------------------------------- the hydrate fuzz target, both kinds


def test_the_hydrate_fuzz_target_serves_generations_of_both_digest_kinds() -> None:
    """The forged stores of the ``hydrate`` fuzz target verify (their seeds restore) with BLAKE3 and with SHA-256
    archive digests: a real chain mixes both, and a plain archive is served as either kind of generation."""
    from sandbox_fs.testing.fuzz import _hydrate as target
    from sandbox_fs.testing.fuzz._layers import decode_chain, forged_store

    env = target._get_env()
    chain = decode_chain(env.chains[0])
    assert chain is not None
    store = forged_store(target.NAME, *chain, env.layer_info)
    kinds = set()
    for key in sorted(store.objects.objs):
        if key.endswith("meta.json"):
            meta = json.loads(store.objects.objs[key][0])
            assert bool(meta["archive_blake3"]) != bool(meta["archive_sha256"])
            kinds.add("blake3" if meta["archive_blake3"] else "sha256")
    assert kinds == {"blake3", "sha256"}
    served = set()
    for data in target.seeds():
        env.scene.reset()
        store = target._store_for(data, env)
        if decode_chain(data) is None and hasattr(store, "objects"):
            info = store.info(target.NAME)
            served.add("blake3" if info.archive_blake3 else "sha256")
            with open_root(env.scene.ws) as ws:
                assert hydrate(ws, store, target.NAME, limits=env.limits).generation == 1
    assert served == {"blake3", "sha256"}
