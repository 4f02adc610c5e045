"""Sandbox path normalization and PathPolicy (workspace + extra path grants)."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox_fs import (Grant, InvalidPathError, PathEscapeError, PathPolicy, ReadOnlyError,
                        normalize, open_root)


@pytest.mark.parametrize("raw,expected", [
    ("a/b", "a/b"), ("./a//b/", "a/b"), ("a/./b/../c", "a/c"), (".", ""), ("a/..", ""),
])
def test_normalize_ok(raw, expected):
    assert normalize(raw) == expected


@pytest.mark.parametrize("raw", ["", "..", "../a", "a/../..", "a\0b", "x" * 256, "a/" * 2100,
                                 "/abs", "a\\..\\..\\b"])
def test_normalize_refuses(raw):
    with pytest.raises(InvalidPathError):
        normalize(raw)


def test_normalize_limits_are_exact():
    """NAME_MAX (255) and PATH_MAX - 1 (4095) bytes are accepted; one byte more is refused."""
    assert normalize("x" * 255) == "x" * 255
    assert normalize("a/" * 2047 + "a") == "a/" * 2047 + "a"  # 4095 bytes
    with pytest.raises(InvalidPathError):
        normalize("a/" * 2048)  # 4096 bytes, the trailing slash counts


def test_normalize_bytes_and_backslash_names():
    assert normalize(b"d/\xff") == "d/\udcff"  # bytes decode with surrogateescape
    assert normalize("a\\b/c\\") == "a\\b/c\\"  # a backslash alone is a legal name character


def test_normalize_error_paths_are_bounded():
    """A hostile path is cut in the error: 200 characters, or 64 and "..." when over PATH_MAX."""
    with pytest.raises(InvalidPathError) as ei:
        normalize("a" * 300 + "\0")
    assert ei.value.sandbox_path == "a" * 200
    with pytest.raises(InvalidPathError) as ei:
        normalize("a/" * 2100)
    assert ei.value.sandbox_path == "a/" * 32 + "..."


def test_normalize_absolute():
    assert normalize("/w/./x/../y/", allow_absolute=True) == "/w/y"
    assert normalize("//w", allow_absolute=True) == "/w"
    with pytest.raises(InvalidPathError):
        normalize("/..", allow_absolute=True)


@pytest.fixture
def policy_env(layout, resolver):
    (layout.ws / "ro_grant").mkdir()
    (layout.ws / "ro_grant" / "data.txt").write_text("data")
    extra = layout.base / "extra"
    extra.mkdir()
    (extra / "e.txt").write_text("e")
    ws_root = open_root(layout.ws)
    pol = PathPolicy(ws_root, str(layout.ws), [Grant(str(layout.ws / "ro_grant"), read_only=True),
                                                Grant(str(extra), read_only=False)])
    yield layout, pol, extra
    pol.close()
    ws_root.close()


def test_policy_resolution(policy_env):
    layout, pol, extra = policy_env
    r = pol.resolve("x/y")
    assert r.root is pol.workspace and r.rel == "x/y" and not r.read_only
    r = pol.resolve(str(layout.ws / "x"))
    assert r.rel == "x" and not r.read_only
    r = pol.resolve("ro_grant/data.txt")  # nested read-only grant wins
    assert r.read_only and r.rel == "data.txt" and r.root.read_bytes(r.rel) == b"data"
    r = pol.resolve(str(extra / "e.txt"))
    assert not r.read_only and r.root.read_bytes(r.rel) == b"e"
    with pytest.raises(PathEscapeError):
        pol.resolve("/etc/passwd")
    with pytest.raises(PathEscapeError):
        pol.resolve(str(layout.outside / "secret.txt"))
    with pytest.raises(InvalidPathError):
        pol.resolve("../outside/secret.txt")
    with pytest.raises(ReadOnlyError):
        pol.resolve("ro_grant/new", for_write=True)


def test_nested_read_only_grant_enforced_physically(policy_env):
    layout, pol, _ = policy_env
    before = (layout.ws / "ro_grant" / "data.txt").read_text()
    os.symlink("ro_grant", layout.ws / "alias")
    (layout.ws / "sub").mkdir()
    for path in ("alias/data.txt", "sub/../ro_grant/data.txt", "alias/new.txt"):
        r = pol.resolve(path)  # lexically in the workspace...
        with pytest.raises(ReadOnlyError):  # ...but physically in the read-only grant
            r.root.write_bytes(r.rel, b"pwned")
    with pytest.raises(ReadOnlyError):
        pol.workspace.mkdir("alias/d")
    with pytest.raises(ReadOnlyError):
        pol.workspace.remove("alias/data.txt")
    with pytest.raises(ReadOnlyError):
        pol.workspace.open("alias/data.txt", "w")
    pol.workspace.write_bytes("sub/ok", b"fine")
    assert (layout.ws / "ro_grant" / "data.txt").read_text() == before
    assert sorted(os.listdir(layout.ws / "ro_grant")) == ["data.txt"]


def test_grant_parse():
    assert Grant.parse("/x:ro") == Grant("/x", True)
    assert Grant.parse("/x:rw") == Grant("/x", False)
    assert Grant.parse("/x") == Grant("/x", True)
    with pytest.raises(InvalidPathError):
        Grant.parse("rel:rw")
    assert Grant.parse("rel/x:rw", relative_to="/base") == Grant("/base/rel/x", False)
    assert Grant.parse("/abs", relative_to="/base") == Grant("/abs", True)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["a", "..", ".", "", "b", "ws", "tmp"]), min_size=1, max_size=10).map("/".join),
       st.booleans())
def test_policy_never_resolves_outside_workspace_or_grants(raw, absolute):
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        ws = os.path.join(d, "ws")
        os.mkdir(ws)
        with open_root(ws) as root, PathPolicy(root, ws) as pol:
            text = (ws + "/" + raw) if absolute else raw
            try:
                r = pol.resolve(text)
            except (InvalidPathError, PathEscapeError):
                return
            assert r.root is pol.workspace
            assert ".." not in r.rel.split("/") and not r.rel.startswith("/")
