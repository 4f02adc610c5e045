"""The names a generation's index may hold: exactly the normalized paths of entries below the workspace.

Regression: an index entry (or deletion) named ``""`` (the workspace
itself, what ``./`` normalizes to) was accepted, though the extractor never
restores a file or symlink there and persist never records it.
"""

from __future__ import annotations

import json
import re
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox_fs.snapshot import SnapshotCorruptError, SnapshotPolicy
from sandbox_fs.snapshot._index import decode_index

SHA = "0" * 64


def _index(entries: list[list[object]], deleted: list[str]) -> bytes:
    doc = {"format": "sandbox-fs-index", "version": 1, "time_ns": 1, "dev": 1, "entries": entries,
           "deleted": deleted}
    return zlib.compress(json.dumps(doc).encode())


def _entry(path: str, kind: str = "file") -> list[object]:
    content = SHA if kind == "file" else ("" if kind == "dir" else "target")
    return [path, kind, 1, 0, 0, 0, 0o644, content, 1, 1]


def _decode(raw: bytes) -> None:
    decode_index(raw, SnapshotPolicy(), frozenset({1}), "n")


@pytest.mark.parametrize("kind", ["file", "dir", "symlink"])
def test_entry_naming_the_workspace_is_refused(kind):
    with pytest.raises(SnapshotCorruptError):
        _decode(_index([_entry("", kind)], []))


def test_deletion_naming_the_workspace_is_refused():
    with pytest.raises(SnapshotCorruptError):
        _decode(_index([_entry("a")], [""]))


def _model_accepts(name: str) -> bool:
    """The rule restated: non-empty, no NUL, not absolute (``/`` or ``\\``), no ``..`` even split at ``\\``,
    components (at ``/``) non-empty and not ``.``."""
    if not name or "\0" in name or name[0] in "/\\":
        return False
    if ".." in re.split(r"[/\\]", name):
        return False
    return all(part not in ("", ".") for part in name.split("/"))


@settings(max_examples=300, deadline=None)
@given(name=st.text(alphabet="./a\0\\", max_size=12), as_deletion=st.booleans())
def test_index_names_follow_the_rule(name, as_deletion):
    raw = _index([_entry("keep")], [name]) if as_deletion else _index([_entry(name)], [])
    if as_deletion and name == "keep":
        return  # a path both kept and deleted: refused by another rule
    try:
        _decode(raw)
    except SnapshotCorruptError:
        assert not _model_accepts(name), name
        return
    assert _model_accepts(name), name
