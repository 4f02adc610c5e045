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
from sandbox_fs.exec import _helper
from sandbox_fs.client import ClientOptions, LocalSandboxClient
from sandbox_fs.errors import InvalidArgumentError, InvalidPathError, PathEscapeError, ReadOnlyError
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

# The mount-layer tests run the command as uid 0 (identity "host"): the worst case, a child
# that owns every root-owned file, so only the mount can refuse; a root host also refuses a
# read-write grant (root-owned here) that a leased identity does not own.
UID0 = sfs_exec.ConfinementPolicy(identity="host")


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


def _ro_layer() -> bool:
    return os.access(sfs_exec.helper_path(), os.X_OK) and _helper.ro_mounts_available(sfs_exec.helper_path())


needs_ro_layer = pytest.mark.skipif(not _ro_layer(), reason="the read-only mount layer is unavailable here "
                                    "(not root, and user namespaces are disabled)")

_WRITES = "echo PWNED > {ro}/keep.txt; echo x > {ro}/new.txt; mkdir {ro}/d; chmod 777 {ro}/keep.txt; " \
          "ln -s x {ro}/l; mv {ro}/keep.txt {ro}/moved; cat {ro}/keep.txt; echo w > {rw}/w.txt; echo end"


def _assert_ro_intact(ro, before):
    assert (ro / "keep.txt").read_text() == "keep\n"
    assert sorted(os.listdir(ro)) == before
    assert oct(os.stat(ro / "keep.txt").st_mode & 0o777) != oct(0o777)


@needs_landlock
@needs_helper
@needs_ro_layer
@pytest.mark.parametrize("held", [True, False], ids=["held-namespace", "per-process"])
async def test_confined_child_cannot_write_a_ro_grant_nested_in_a_rw_grant(layout, held):
    """Regression: the child wrote into the nested read-only grant (Landlock unions the rw rule).
    Now a read-only bind of the grant in the child's mount namespace refuses every write (EROFS)."""
    rw, ro = _nested(layout)
    before = sorted(os.listdir(ro))
    sup = sfs_exec.ProcessSupervisor(hold_mount_ns=held)
    try:
        with open_root(layout.ws) as wsr, PathPolicy(wsr, str(layout.ws), [
                Grant(str(rw), read_only=False), Grant(str(ro), read_only=True)]) as pol:
            for cwd in ("", str(ro)):  # also with the working directory inside the bound grant
                r = await run_confined(["/bin/sh", "-c", _WRITES.format(ro=ro, rw=rw)], workspace=wsr,
                                       workspace_host_path=str(layout.ws), grants=pol, cwd=cwd, supervisor=sup,
                                       policy=UID0)
                assert r.read_only_mounts and r.stdout == b"keep\nend\n", r.stderr
                assert r.stderr.count(b"Read-only file system") >= 5, r.stderr
                _assert_ro_intact(ro, before)
    finally:
        await sup.aclose()
    assert (rw / "w.txt").read_text() == "w\n"  # the read-write grant stays writable


@needs_landlock
@needs_helper
async def test_nested_ro_grant_refused_without_the_mount_layer(layout):
    rw, ro = _nested(layout)
    before = sorted(os.listdir(ro))
    with open_root(layout.ws) as wsr, PathPolicy(wsr, str(layout.ws), [
            Grant(str(rw), read_only=False), Grant(str(ro), read_only=True)]) as pol:
        with pytest.raises(ConfinementError, match="mount layer is off"):
            await run_confined(["/bin/sh", "-c", _WRITES.format(ro=ro, rw=rw)], workspace=wsr,
                               workspace_host_path=str(layout.ws), grants=pol,
                               policy=sfs_exec.ConfinementPolicy(read_only_mounts=False, identity="host"))
    _assert_ro_intact(ro, before)
    assert not (rw / "w.txt").exists()  # refused before the command ran


@needs_landlock
@needs_helper
@needs_ro_layer
async def test_ro_grant_in_the_workspace_is_bound_read_only(layout, ws):
    ws.mkdir("inner")
    ws.write_bytes("inner/keep.txt", b"keep\n")
    with ws.open_root("inner", read_only=True) as inner:
        r = await run_confined(["/bin/sh", "-c", "cat inner/keep.txt; echo x > inner/keep.txt; touch inner/n; "
                                "echo ok > top.txt"], workspace=ws, workspace_host_path=str(layout.ws),
                               grants=[(inner, True)])
        assert r.stdout == b"keep\n" and r.stderr.count(b"Read-only file system") == 2, r.stderr
        with pytest.raises(ConfinementError, match="workspace"):
            await run_confined(["true"], workspace=ws, workspace_host_path=str(layout.ws), grants=[(inner, True)],
                               policy=sfs_exec.ConfinementPolicy(read_only_mounts=False))
    assert ws.read_bytes("inner/keep.txt") == b"keep\n" and ws.listdir("inner") == ["keep.txt"]
    assert ws.read_bytes("top.txt") == b"ok\n"


@needs_landlock
@needs_helper
async def test_nestings_no_bind_can_enforce_are_refused(layout, ws):
    rw, ro = _nested(layout)
    (ro / "inner_rw").mkdir()
    with open_root(rw) as g_rw, open_root(ro, read_only=True) as g_ro, open_root(ro / "inner_rw") as g_in:
        # rw inside ro inside rw: the recursive read-only bind would cover the inner rw grant
        with pytest.raises(ConfinementError, match="inside a read-only grant"):
            build_ruleset(ws, [(g_rw, False), (g_ro, True), (g_in, False)], read_only_binds=True).close()
        with open_root(rw, read_only=True) as same:  # one directory, two modes
            with pytest.raises(ConfinementError, match="one mode"):
                build_ruleset(ws, [(g_rw, False), (same, True)], read_only_binds=True).close()
        build_ruleset(ws, [(g_rw, False), (g_ro, True)], read_only_binds=True).close()


@needs_landlock
@needs_helper
@needs_ro_layer
@pytest.mark.parametrize("held", [True, False], ids=["held-namespace", "per-process"])
async def test_child_cannot_move_a_nested_ro_grant_out_from_under_its_path(layout, held):
    """Renaming the grant's parent would leave its contents writable under a new name next session:
    every directory between the writable tree and the grant is a mount point for the child (EBUSY)."""
    rw = layout.base / "rw"
    ro = rw / "a" / "b" / "ro"
    ro.mkdir(parents=True)
    (ro / "keep.txt").write_text("keep\n")
    ident = (os.stat(ro).st_dev, os.stat(ro).st_ino)
    grants = [Grant(str(rw), read_only=False), Grant(str(ro), read_only=True)]
    moves = (f"mv -T {rw}/a {rw}/z; mv -T {rw}/a/b {rw}/y; mv -T {ro} {rw}/x; rmdir {rw}/a/b; "
             f"echo w > {rw}/a/w.txt; echo end")
    sup = sfs_exec.ProcessSupervisor(hold_mount_ns=held)
    try:
        with open_root(layout.ws) as wsr, PathPolicy(wsr, str(layout.ws), grants) as pol:
            r = await run_confined(["/bin/sh", "-c", moves], workspace=wsr, workspace_host_path=str(layout.ws),
                                   grants=pol, supervisor=sup, policy=UID0)
            assert r.stdout == b"end\n" and r.stderr.count(b"busy") >= 2, r.stderr
    finally:
        await sup.aclose()
    assert (os.stat(ro).st_dev, os.stat(ro).st_ino) == ident  # the grant path still names the grant
    assert (ro / "keep.txt").read_text() == "keep\n" and os.listdir(ro) == ["keep.txt"]
    assert (rw / "a" / "w.txt").read_text() == "w\n"  # the pinned parents stay writable
    assert not (rw / "z").exists()


def test_an_unknown_mode_suffix_is_refused_not_read_as_the_path():
    """':xx' after the last ':' is a typo of the mode, not a directory name; a ':' path takes an explicit mode."""
    for spec in ("/srv/data:xx", "/srv/data:RO", "n=/srv/data:r0", "/srv/a:b"):
        with pytest.raises(InvalidArgumentError) as info:
            Grant.parse(spec)
        assert "/srv" not in str(info.value) and info.value.sandbox_path in ("grant", "grant n")
    assert Grant.parse("/srv/a:b:ro") == Grant("/srv/a:b")
    assert Grant.parse("/srv/a:b/c") == Grant("/srv/a:b/c")  # a ':' in a directory name before the last '/'
    with pytest.raises(InvalidPathError) as info:
        Grant("/srv/../etc", name="n")
    assert info.value.sandbox_path == "grant n" and "/srv" not in str(info.value)
