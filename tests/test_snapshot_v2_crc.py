"""Version-2 generations record no CRC-32 (their SHA-256 is checked); version 1 and older generations keep theirs.

A generation persisted or copied into a :class:`GenerationStore` records
``archive_crc32 == ""``: every read checks ``archive_sha256``, which the
pointer's and a session state's metadata digest pin, so the CRC-32 persist's
writer thread used to compute caught nothing more.  A generation
an older build wrote carries a CRC-32: it still restores, forks, layers and survives
gc.  Version-1 metadata must carry its CRC-32 (it is all that checks it).
"""

from __future__ import annotations

import hashlib
import json
import time
import zlib
from pathlib import Path
from typing import Any

import blake3
import pytest
from pydantic import ValidationError

from _copy_source import ServedSource, one_file_tar

from sandbox_fs import open_root
from sandbox_fs.snapshot import (
    MIN_GC_AGE_S,
    DirectorySnapshotStore,
    LocalSnapshotStore,
    SnapshotCorruptError,
    SnapshotInfo,
    SnapshotLimits,
    hydrate,
    persist,
)
from sandbox_fs.snapshot._fork import copy_snapshot

_T = "ab" * 32


def _tree(ws: Path, text: str) -> None:
    (ws / "d").mkdir(exist_ok=True)
    (ws / "d" / "a.txt").write_text(text)
    (ws / "big").write_bytes(bytes(range(256)) * 600)  # >= 64 KiB: hashed by the writer thread


def _view(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _restore(store: Any, name: str, dst: Path) -> dict[str, bytes]:
    dst.mkdir(exist_ok=True)
    with open_root(dst) as d:
        hydrate(d, store, name)
    return _view(dst)


def _persisted(tmp_path: Path, text: str) -> tuple[Path, Path, SnapshotInfo]:
    """A workspace with :func:`_tree` of ``text`` persisted as "s" into a new directory store: (ws, store dir, info)."""
    ws, sdir = tmp_path / "ws", tmp_path / "store"
    ws.mkdir()
    _tree(ws, text)
    with DirectorySnapshotStore(sdir) as store, open_root(ws) as w:
        info = persist(w, store, "s").info
    assert info is not None
    return ws, sdir, info


def _meta_path(sdir: Path, info: SnapshotInfo) -> Path:
    return sdir / info.archive.replace("archive.tar", "meta.json")


def test_a_new_generation_records_no_crc_and_restores_forks_and_survives_gc(tmp_path: Path) -> None:
    ws, sdir, info = _persisted(tmp_path, "one")
    with DirectorySnapshotStore(sdir) as store:
        assert info.version == 2 and info.archive_crc32 == ""
        raw = json.loads(_meta_path(sdir, info).read_bytes())
        archive = (sdir / info.archive).read_bytes()
        assert raw["archive_crc32"] == "" and raw["archive_sha256"] == ""
        assert raw["archive_blake3"] == blake3.blake3(archive).hexdigest()
        assert _restore(store, "s", tmp_path / "r1") == _view(ws)
        forked = store.fork("s", "f")
        assert forked.archive_crc32 == ""
        _tree(ws, "two")
        with open_root(ws) as w:  # a layer over a generation without a CRC-32
            layer = persist(w, store, "s").info
        assert layer is not None and layer.chain_length == 2 and layer.archive_crc32 == ""
        store.gc(older_than=MIN_GC_AGE_S, now=time.time() + 2 * MIN_GC_AGE_S)
        assert _restore(store, "s", tmp_path / "r2") == _view(ws)
        assert _restore(store, "f", tmp_path / "r3")["d/a.txt"] == b"one"


def test_an_older_generation_with_a_crc_still_restores_forks_and_layers(tmp_path: Path) -> None:
    """The metadata of an older generation (with the archive's CRC-32), made by editing the JSON and re-pinning
    the pointer's digest, as the fuzz targets forge: hydrate, fork, a layer over it and gc all take it."""
    ws, sdir, info = _persisted(tmp_path, "old")
    # the stored objects, edited as the fuzz targets forge
    meta = json.loads(_meta_path(sdir, info).read_bytes())
    meta["archive_crc32"] = f"{zlib.crc32((sdir / info.archive).read_bytes()):08x}"
    mraw = json.dumps(meta, indent=1).encode()
    _meta_path(sdir, info).write_bytes(mraw)
    ptr = json.loads((sdir / "s" / "current").read_bytes())
    ptr["generations"][0]["meta_sha256"] = hashlib.sha256(mraw).hexdigest()
    (sdir / "s" / "current").write_text(json.dumps(ptr))
    with DirectorySnapshotStore(sdir) as store:  # a new store: no remembered metadata
        old = store.info("s")
        assert old is not None and old.archive_crc32 == meta["archive_crc32"]
        assert old.digest == hashlib.sha256(mraw).hexdigest()
        assert _restore(store, "s", tmp_path / "r1") == _view(ws)
        assert store.fork("s", "f").archive_crc32 == meta["archive_crc32"]  # shared: the same metadata
        _tree(ws, "new")
        with open_root(ws) as w:
            layer = persist(w, store, "s").info
        assert layer is not None and layer.chain_length == 2 and layer.parent_digest == old.digest
        assert layer.archive_crc32 == ""
        store.gc(older_than=MIN_GC_AGE_S, now=time.time() + 2 * MIN_GC_AGE_S)
        assert _restore(store, "s", tmp_path / "r2") == _view(ws)
        assert _restore(store, "f", tmp_path / "r3")["d/a.txt"] == b"old"


@pytest.mark.parametrize(("fields", "ok"), [
    ({"version": 1, "archive_crc32": "0123abcd"}, True),
    ({"version": 1, "archive_crc32": ""}, False),  # version 1 is checked by its CRC-32 alone
    ({"version": 1}, False),
    ({"version": 2, "archive_crc32": ""}, True),
    ({"version": 2}, True),
    ({"version": 2, "archive_crc32": "0123abcd"}, True),  # an older generation
    ({"version": 2, "archive_crc32": "0123ABCD"}, False),
    ({"version": 2, "archive_crc32": "0123abc"}, False),
    ({"version": 2, "archive_crc32": "0123abcd "}, False),
    ({"version": 2, "archive_crc32": None}, False),
    ({"version": 2, "archive_crc": "0123abcd"}, False),  # extra fields stay forbidden
])
def test_metadata_crc_rule_is_strict(fields: dict[str, Any], ok: bool) -> None:
    data = {"name": "s", "archive": "x", "archive_bytes": 0, "fingerprint": _T, "tree_digest": _T, "entries": 0,
            "content_bytes": 0, **fields}
    if ok:
        assert SnapshotInfo.model_validate(data).archive_crc32 == fields.get("archive_crc32", "")
    else:
        with pytest.raises(ValidationError):
            SnapshotInfo.model_validate(data)






_COPIES = [(s, t, c) for s in ("v1", "v2", "v2-old", "v2-nosha") for t in ("directory", "local") for c in (False, True)
           if (s, t, c) != ("v2", "local", False)]  # a version-1 store commits only metadata with a CRC-32


@pytest.mark.parametrize(("source", "target", "changed"), _COPIES)
def test_a_copy_checks_what_it_wrote_against_the_sources_strongest_digest(tmp_path: Path, source: str, target: str,
                                                                          changed: bool) -> None:
    """copy_snapshot compares the chunks it wrote with the source's archive digest, or with its CRC-32 for a
    version-1 source.  A byte changed mid-copy is refused and nothing is made; version-2 metadata with no archive
    digest is refused before anything is copied (its CRC-32 is never relied on, as hydrate refuses it too)."""
    data = one_file_tar()
    crc, sha = f"{zlib.crc32(data):08x}", hashlib.sha256(data).hexdigest()
    fields = {"v1": {"version": 1, "archive_crc32": crc}, "v2": {"version": 2, "archive_sha256": sha},
              "v2-old": {"version": 2, "archive_sha256": sha, "archive_crc32": crc},
              "v2-nosha": {"version": 2, "archive_sha256": "", "archive_crc32": crc}}[source]
    info = SnapshotInfo(name="a", archive="x", archive_bytes=len(data), fingerprint=_T, tree_digest=_T, entries=1,
                        content_bytes=5, **fields)
    served = bytearray(data)
    if changed:
        served[len(data) // 3] ^= 1  # same size: only a digest tells
    store = DirectorySnapshotStore(tmp_path / "s") if target == "directory" else LocalSnapshotStore(tmp_path / "s")
    with store:
        if source == "v2-nosha":
            with pytest.raises(SnapshotCorruptError, match="records no archive digest"):
                copy_snapshot(ServedSource(bytes(served), info), store, "a", "b", None, None, SnapshotLimits())
            assert store.info("b") is None and store.list() == []
            return
        if changed:
            with pytest.raises(SnapshotCorruptError, match="changed while it was copied"):
                copy_snapshot(ServedSource(bytes(served), info), store, "a", "b", None, None, SnapshotLimits())
            assert store.info("b") is None and store.list() == []
            return
        got = copy_snapshot(ServedSource(data, info), store, "a", "b", None, None, SnapshotLimits())
        assert got.archive_crc32 == ("" if target == "directory" else crc)
        assert _restore(store, "b", tmp_path / "r") == {"f": b"hello"}
