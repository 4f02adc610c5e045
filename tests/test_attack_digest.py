"""Attacks on what a generation's metadata records about its own objects (the review of 8ede598, BLAKE3).

A hostile store directory (it can write the store's files, it holds none of
the host's keys) edits a version-1 snapshot's metadata before a fork copies
it into a generation.  Whatever the source metadata says, the generation
the copy commits records only what its own commit computed about its own
objects: its archive's digest (BLAKE3 of the bytes written), no index it
did not write, no parent it is not a layer over.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import blake3
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandbox_fs import open_root
from sandbox_fs.snapshot import (
    DirectorySnapshotStore,
    LocalSnapshotStore,
    SnapshotCorruptError,
    SnapshotInfo,
    hydrate,
    persist,
)

_HEX = st.text("0123456789abcdef", min_size=64, max_size=64)
#: the fields a version-2 generation's commit owns (besides the archive's), as forged into the source metadata
_FORGED = st.fixed_dictionaries({}, optional={
    "index_sha256": _HEX, "index_bytes": st.integers(1, 1 << 40), "deleted": st.integers(1, 1 << 20),
    "parent_generation": st.integers(1, 1 << 40), "parent_digest": _HEX,
    "archive_sha256": _HEX,  # (a version-1 metadata may name one: the model allows it)
})


def _v1_source(tmp: Path) -> tuple[Path, Path]:
    """A store directory holding version-1 snapshot "s" (LocalSnapshotStore) of a small tree: (dir, workspace)."""
    sdir, ws = tmp / "store", tmp / "ws"
    ws.mkdir()
    (ws / "f").write_bytes(b"source content\n")
    (ws / "d").mkdir()
    (ws / "d" / "g").write_bytes(bytes(range(256)) * 64)
    with LocalSnapshotStore(sdir) as local, open_root(ws) as w:
        info = persist(w, local, "s").info
    assert info is not None and info.version == 1
    return sdir, ws


def _forge(sdir: Path, fields: dict[str, Any]) -> None:
    """Rewrite the version-1 metadata of "s" with ``fields`` (what a store directory's writer can do)."""
    meta = json.loads((sdir / "s.json").read_bytes())
    meta.update(fields)
    SnapshotInfo.model_validate(meta)  # still valid metadata: only what checks it can refuse it
    (sdir / "s.json").write_text(json.dumps(meta))


def _view(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _fork_and_check(sdir: Path, ws: Path, target: str, out: Path) -> None:
    """Fork "s" (a copy: it is version 1) and check the committed generation records only its own objects."""
    with DirectorySnapshotStore(sdir) as store:
        store.fork("s", target)
        got = store.info(target)
        assert got is not None and got.version == 2
        archive = (sdir / got.archive).read_bytes()
        assert got.archive_blake3 == blake3.blake3(archive).hexdigest() and got.archive_sha256 == ""
        assert (got.index_sha256, got.index_bytes, got.deleted) == ("", 0, 0)  # no index was written
        assert (got.parent_generation, got.parent_digest, got.chain_length) == (0, "", 1)  # a full generation
        out.mkdir()
        with open_root(out) as r:
            rep = hydrate(r, store, target, digest=got.digest)
        assert rep.generation == got.generation
    assert _view(out) == _view(ws)


def test_a_copy_never_commits_the_sources_index_or_parent(tmp_path: Path) -> None:
    """Source metadata naming an index (and a parent) the copy never wrote: before the fix the copied generation
    carried them, so its restore read ``TARGET/gen/<dir>/index``, an object only the store's writer could put
    there (here: missing, so the fork never restored)."""
    sdir, ws = _v1_source(tmp_path)
    planted = b"an index the store's writer chose"
    _forge(sdir, {"index_sha256": hashlib.sha256(planted).hexdigest(), "index_bytes": len(planted),
                  "parent_generation": 7, "parent_digest": "ab" * 32, "deleted": 3})
    _fork_and_check(sdir, ws, "t", tmp_path / "out")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=_FORGED, true_sha=st.booleans())
def test_property_a_copy_records_only_what_its_commit_computed(source: tuple[Path, Path, bytes],
                                                               fields: dict[str, Any], true_sha: bool) -> None:
    """Any subset of the commit-owned fields forged into the source: the copy records none of them.  A forged
    ``archive_sha256`` is what the copy checks the bytes it wrote against (the CRC-32 otherwise): a wrong one
    refuses the copy, nothing is made."""
    sdir, ws, original = source
    (sdir / "s.json").write_bytes(original)
    if "archive_sha256" in fields and true_sha:
        fields["archive_sha256"] = hashlib.sha256((sdir / _archive_of(sdir)).read_bytes()).hexdigest()
    _forge(sdir, fields)
    out = sdir.parent / "out"
    shutil.rmtree(out, ignore_errors=True)
    try:
        if "archive_sha256" in fields and not true_sha:
            with DirectorySnapshotStore(sdir) as store:
                with pytest.raises(SnapshotCorruptError, match="changed while it was copied"):
                    store.fork("s", "t")
                assert store.info("t") is None
            return
        _fork_and_check(sdir, ws, "t", out)
    finally:
        with DirectorySnapshotStore(sdir) as store:
            store.remove("t")


def _archive_of(sdir: Path) -> str:
    return str(json.loads((sdir / "s.json").read_bytes())["archive"])


@pytest.fixture(scope="module")
def source(tmp_path_factory: Any) -> tuple[Path, Path, bytes]:
    """One version-1 source for every example: (store dir, workspace, its metadata as written)."""
    sdir, ws = _v1_source(tmp_path_factory.mktemp("copy"))
    return sdir, ws, (sdir / "s.json").read_bytes()


@pytest.mark.parametrize("path", ["f\ud800", "\udc00", "d/\udfff"])
def test_metadata_naming_a_mode_fixup_that_is_no_file_name_is_corrupt(tmp_path: Path, path: str) -> None:
    """A store's writer puts a lone surrogate (a JSON escape outside surrogateescape's range) in ``mode_fixups``:
    before the fix hydrate's encoding of it raised a bare UnicodeEncodeError (no SandboxError, no fallback);
    now the metadata is refused as not valid, and the workspace is unchanged (the sentinel)."""
    sdir, _ws = _v1_source(tmp_path)
    meta = json.loads((sdir / "s.json").read_bytes())
    meta["mode_fixups"] = [["f", 0o600], [path, 0o644]]
    (sdir / "s.json").write_text(json.dumps(meta))
    out = tmp_path / "out"
    out.mkdir()
    (out / "sentinel").write_bytes(b"kept\n")
    with LocalSnapshotStore(sdir) as local, open_root(out) as r, pytest.raises(SnapshotCorruptError):
        hydrate(r, local, "s")
    assert _view(out) == {"sentinel": b"kept\n"}


@settings(max_examples=200, deadline=None)
@given(paths=st.lists(st.text(alphabet="a/.\udc80\udcff\ud800\udc00\udfff\u00e9", max_size=6), max_size=4))
def test_property_valid_metadata_has_only_encodable_mode_fixups(paths: list[str]) -> None:
    """Metadata parses only when every ``mode_fixups`` path encodes as hydrate encodes it (else ValueError)."""
    meta = {"name": "s", "archive": "s.tar", "archive_bytes": 1, "fingerprint": "0" * 64, "tree_digest": "0" * 64,
            "entries": 1, "content_bytes": 1, "version": 2, "archive_blake3": "0" * 64,
            "mode_fixups": [[p, 0o644] for p in paths]}
    parsed = json.loads(json.dumps(paths))  # (the JSON text joins an escaped surrogate pair into one character)
    try:
        info = SnapshotInfo.model_validate(json.loads(json.dumps(meta)))
    except ValueError:
        with pytest.raises(UnicodeEncodeError):
            for p in parsed:
                p.encode("utf-8", "surrogateescape")
        return
    assert [p.encode("utf-8", "surrogateescape").decode("utf-8", "surrogateescape") for p, _m in info.mode_fixups] \
        == parsed


def _forge_archive(sdir: Path, archive: str) -> None:
    """Rewrite the version-1 metadata of "s" to name ``archive`` (JSON-escaped, as the store's writer can)."""
    meta = json.loads((sdir / "s.json").read_bytes())
    meta["archive"] = archive
    (sdir / "s.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("archive", ["s.\ud800", "s.\udc00.tar", "s.\udfff"])
@pytest.mark.parametrize("action", ["restore", "save", "fork"])
def test_metadata_naming_an_archive_that_is_no_file_name_is_corrupt(tmp_path: Path, archive: str, action: str) -> None:
    """A store's writer names a version-1 archive with a lone surrogate (``s.\\ud800``: it starts with ``s.`` and
    holds no ``/``, all the store checked): before the fix the Root's encoding of it raised a bare
    UnicodeEncodeError in restore, fork and the save that replaces the version-1 files; now the metadata is
    refused as not valid, and the workspace (the sentinel) is unchanged."""
    sdir, ws = _v1_source(tmp_path)
    _forge_archive(sdir, archive)
    out = tmp_path / "out"
    out.mkdir()
    (out / "sentinel").write_bytes(b"kept\n")
    with DirectorySnapshotStore(sdir) as store, open_root(out) as r, pytest.raises(SnapshotCorruptError):
        if action == "restore":
            hydrate(r, store, "s")
        elif action == "save":
            persist(r, store, "s")
        else:
            store.fork("s", "t")
    assert _view(out) == {"sentinel": b"kept\n"}
    with DirectorySnapshotStore(sdir) as store:
        assert store.info("t") is None  # no fork was made


def test_cli_restore_of_an_archive_that_is_no_file_name_is_one_line(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The command line: one ``snapshot_corrupt`` line (exit 1), not the internal error (exit 70), no host path."""
    from sandbox_fs.cli import main

    sdir, ws = _v1_source(tmp_path)
    _forge_archive(sdir, "s.\ud800")
    capsys.readouterr()
    rc = main(["snapshot", "restore", "--store", str(sdir), "--workspace", str(ws), "--name", "s"])
    err = capsys.readouterr().err
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "snapshot_corrupt" in err, err
    assert str(tmp_path) not in err and "Traceback" not in err
    assert (ws / "f").read_bytes() == b"source content\n"


_NAMES = st.text(alphabet="s./a\udc80\udcff\ud800\udc00\udfff\u00e9", max_size=6)


@settings(max_examples=200, deadline=None)
@given(name=_NAMES, archive=_NAMES, excluded=st.lists(_NAMES, max_size=3), fixups=st.lists(_NAMES, max_size=3))
def test_property_valid_metadata_has_only_encodable_names(name: str, archive: str, excluded: list[str],
                                                          fixups: list[str]) -> None:
    """Metadata parses only when its name, archive, excluded and mode_fixups paths all encode as a Root encodes
    them (``surrogateescape``; else ValueError), and then they are what the JSON text holds."""
    meta = {"name": name, "archive": archive, "archive_bytes": 1, "fingerprint": "0" * 64,
            "tree_digest": "0" * 64, "entries": 1, "content_bytes": 1, "version": 2, "archive_blake3": "0" * 64,
            "excluded": excluded, "mode_fixups": [[p, 0o644] for p in fixups]}
    parsed = json.loads(json.dumps([name, archive, *excluded, *fixups]))  # (an escaped pair joins into one)
    try:
        info = SnapshotInfo.model_validate(json.loads(json.dumps(meta)))
    except ValueError:
        with pytest.raises(UnicodeEncodeError):
            for p in parsed:
                p.encode("utf-8", "surrogateescape")
        return
    got = [info.name, info.archive, *info.excluded, *(p for p, _m in info.mode_fixups)]
    assert [p.encode("utf-8", "surrogateescape").decode("utf-8", "surrogateescape") for p in got] == parsed
