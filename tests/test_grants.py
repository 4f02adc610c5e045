"""Grants are validated as a whole (issue 11, F).

* A grant path is absolute; ``/``, empty, ``//``-prefixed and ``..``-holding
  paths are refused; a trailing ``/`` (and ``.``, repeated ``/``) is
  normalized away.  A property test checks the mapping of sandbox paths
  under any accepted grant.
* One nesting rule against every writable tree (the workspace and each
  read-write grant): a read-only grant inside one is enforced physically by
  the session's Roots and refused by the exec layer (Landlock unions rules).
"""

from __future__ import annotations

import os
import posixpath

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sandbox_fs
from sandbox_fs import exec as sfs_exec
from sandbox_fs.client import ClientOptions, LocalSandboxClient
from sandbox_fs.errors import InvalidPathError, PathEscapeError, ReadOnlyError
from sandbox_fs.exec import ConfinementError, build_ruleset, run_confined
from sandbox_fs.paths import Grant, PathPolicy
from sandbox_fs.root import open_root

ABI = sandbox_fs.features()["landlock_abi"]
needs_landlock = pytest.mark.skipif(ABI == 0, reason="kernel has no Landlock (features()['landlock_abi'] == 0)")
needs_helper = pytest.mark.skipif(not os.access(sfs_exec.helper_path(), os.X_OK),
                                  reason="sandbox_fs/sfs-exec is not built (pip install -e . builds it)")


# --------------------------------------------------------------- the path of a grant

@pytest.mark.parametrize("path, why", [
    ("/", "whole host"),
    ("/.", "whole host"),
    ("/./", "whole host"),
    ("//", "'//'"),
    ("//etc", "'//'"),
    ("///etc", "'//'"),
    ("/a/../b", "'..'"),
    ("/a/..", "'..'"),
    ("/..", "'..'"),
    ("", "empty"),
    ("relative/dir", "absolute"),
    ("/a\0b", "NUL"),
])
def test_refused_grant_paths(path, why):
    with pytest.raises(InvalidPathError, match=why) as info:
        Grant(path)
    assert info.value.code == "invalid_path"
    with pytest.raises(InvalidPathError):
        Grant(path, read_only=False)


def test_refused_through_parse_and_client_options(tmp_path):
    for spec in ("/:rw", "//:ro", "/a/../b", "//tmp"):
        with pytest.raises(InvalidPathError):
            Grant.parse(spec)
    with pytest.raises(InvalidPathError):
        Grant.parse("../up", relative_to=str(tmp_path))
    with pytest.raises(InvalidPathError):
        ClientOptions(workspaces_dir=str(tmp_path), extra_path_grants=(Grant("/"),))


@pytest.mark.parametrize("path, normal", [
    ("/srv/data/", "/srv/data"),
    ("/srv//data", "/srv/data"),
    ("/srv/./data/.", "/srv/data"),
    ("/srv/data", "/srv/data"),
])
def test_normalized_grant_paths(path, normal):
    assert Grant(path).path == normal
    assert Grant.parse(path + ":rw") == Grant(normal, read_only=False)


_COMPONENT = st.sampled_from(["", ".", "..", "a", "b", "dir", "x.y"])


@settings(max_examples=300, deadline=None)
@given(st.lists(_COMPONENT, min_size=0, max_size=6), st.integers(min_value=0, max_value=3))
def test_grant_path_property(comps, leading):
    """Accepted grant paths are canonical; every other one is refused, never silently rewritten."""
    raw = "/" * leading + "/".join(comps)
    parts = [c for c in raw.split("/") if c not in ("", ".")]
    try:
        g = Grant(raw)
    except InvalidPathError:
        assert (not raw.startswith("/") or raw.startswith("//") or ".." in parts or not parts)
        return
    assert raw.startswith("/") and not raw.startswith("//") and ".." not in parts and parts
    assert g.path == "/" + "/".join(parts)
    assert g.path == posixpath.normpath(g.path) and "//" not in g.path and g.path != "/"


def test_slash_grant_cannot_open_the_host(tmp_path):
    """Regression: Grant("/") let Session.read("/etc/hostname") work."""
    with pytest.raises(InvalidPathError):
        LocalSandboxClient(ClientOptions(workspaces_dir=str(tmp_path / "w"), extra_path_grants=(Grant("/"),)))


def test_double_slash_grant_mapping(layout):
    """Regression: a //-prefixed grant dropped a character or matched nothing; now it is refused,
    and the accepted spelling maps every path under it."""
    g = layout.outside
    with pytest.raises(InvalidPathError):
        Grant("/" + str(g))
    with open_root(layout.ws) as ws, PathPolicy(ws, "/workspace", [Grant(str(g) + "/")]) as pol:
        r = pol.resolve(f"{g}/subdir/inner.txt")
        assert r.rel == "subdir/inner.txt" and r.read_only
        assert r.root.read_bytes(r.rel).startswith(b"inner ")
        with pytest.raises(PathEscapeError):
            pol.resolve(f"{g}x/secret.txt")  # a sibling sharing the prefix is not under the grant


# --------------------------------------------------------------- one nesting rule

def _nested(layout):
    rw = layout.base / "rw"
    (rw / "ro").mkdir(parents=True)
    (rw / "ro" / "keep.txt").write_text("keep\n")
    os.symlink("ro", rw / "alias")
    return rw, rw / "ro"


def test_session_writes_through_a_rw_grant_into_a_nested_ro_grant_are_refused(layout, resolver):
    rw, ro = _nested(layout)
    with open_root(layout.ws) as ws, PathPolicy(ws, "/workspace", [
            Grant(str(rw), read_only=False), Grant(str(ro), read_only=True)]) as pol:
        for p in (f"{rw}/alias/keep.txt", f"{rw}/alias/new.txt"):
            r = pol.resolve(p)
            with pytest.raises(ReadOnlyError):
                r.root.write_bytes(r.rel, b"PWNED")
        r = pol.resolve(f"{rw}/ok.txt")
        r.root.write_bytes(r.rel, b"ok")
        with pytest.raises(ReadOnlyError):
            pol.resolve(f"{ro}/keep.txt", for_write=True)
    assert (ro / "keep.txt").read_text() == "keep\n"
    assert sorted(os.listdir(ro)) == ["keep.txt"]


@needs_landlock
def test_exec_refuses_a_ro_grant_nested_in_a_rw_grant(layout, ws):
    rw, ro = _nested(layout)
    with open_root(rw) as g_rw, open_root(ro, read_only=True) as g_ro:
        with pytest.raises(ConfinementError, match="read-write grant"):
            build_ruleset(ws, [(g_rw, False), (g_ro, True)]).close()
        with pytest.raises(ConfinementError, match="read-write grant"):  # order does not matter
            build_ruleset(ws, [(g_ro, True), (g_rw, False)]).close()
        with pytest.raises(ConfinementError, match="read-write grant"):  # the same directory both ways
            with open_root(rw, read_only=True) as again:
                build_ruleset(ws, [(g_rw, False), (again, True)]).close()
        # positive controls: a ro grant outside every writable tree, and rw inside ro
        build_ruleset(ws, [(g_rw, False)]).close()
        with open_root(layout.outside, read_only=True) as other:
            build_ruleset(ws, [(g_rw, False), (other, True)]).close()
        with open_root(layout.base, read_only=True) as outer:
            build_ruleset(ws, [(outer, True), (g_rw, False)]).close()


@needs_landlock
@needs_helper
async def test_confined_child_cannot_write_a_ro_grant_nested_in_a_rw_grant(layout, ws):
    """Regression: the child wrote into the nested read-only grant (Landlock unions the rw rule)."""
    rw, ro = _nested(layout)
    before = sorted(os.listdir(ro))
    with open_root(layout.base / "ws") as wsr, PathPolicy(wsr, str(layout.ws), [
            Grant(str(rw), read_only=False), Grant(str(ro), read_only=True)]) as pol:
        with pytest.raises(ConfinementError):
            await run_confined(["/bin/sh", "-c", f"echo PWNED > {ro}/keep.txt; echo x > {ro}/new.txt"],
                               workspace=wsr, workspace_host_path=str(layout.ws), grants=pol)
        # the same grants without the nesting run, and the rw grant is writable
        r = await run_confined(["/bin/sh", "-c", f"echo w > {rw}/w.txt"], workspace=wsr,
                               workspace_host_path=str(layout.ws), grants=[(pol.resolve(str(rw)).root, False)])
        assert r.exit_code == 0, r.stderr
    assert (ro / "keep.txt").read_text() == "keep\n"
    assert sorted(os.listdir(ro)) == before
    assert (rw / "w.txt").read_text() == "w\n"


@needs_landlock
@needs_helper
async def test_ro_grant_in_the_workspace_still_refused(layout, ws):
    ws.mkdir("inner")
    with ws.open_root("inner", read_only=True) as inner:
        with pytest.raises(ConfinementError, match="workspace"):
            await run_confined(["true"], workspace=ws, workspace_host_path=str(layout.ws), grants=[(inner, True)])
