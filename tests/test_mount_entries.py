"""Mount entries: named grants, the ``mount`` manifest entry, its placeholder, never persisted or cleared.

A ``{"type": "mount", "grant": NAME}`` entry exposes an application grant
(``Grant(path, read_only, name=NAME)``, ``--grant NAME=PATH:ro``) at a
workspace path through the FUSE overlay.  Here: names are validated and
unique; an untrusted manifest can only name a grant the application gave, and
only read-only unless the grant is read-write; without the overlay the entry
is refused; with it, materialize makes an empty placeholder directory and
lists the mount; a registered mount is left out of every snapshot and kept by
every restore.  (Serving the grant through the overlay is the daemon's and
the session's: tests/test_fuse_*.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox_fs.cli._hostpath import parse_grant
from sandbox_fs.errors import InvalidArgumentError, InvalidPathError, ReadOnlyError
from sandbox_fs.manifest import ManifestError, ManifestTrustError, Mount, load_manifest
from sandbox_fs.materialize import (
    MaterializeOptions,
    MountNeedsOverlayError,
    MountRequest,
    make_mount_points,
    materialize,
    plan_mounts,
)
from sandbox_fs.paths import GRANT_NAME_PATTERN, Grant, PathPolicy
from sandbox_fs.root import open_root

NAME = re.compile(GRANT_NAME_PATTERN)


@pytest.fixture
def hostdirs(tmp_path):
    """A read-only source tree and a read-write one, outside the workspace, each holding a file."""
    ro, rw, ws = tmp_path / "host-ref", tmp_path / "host-out", tmp_path / "ws"
    for d in (ro, rw, ws):
        d.mkdir()
    (ro / "data.txt").write_text("reference data\n")
    (rw / "old.txt").write_text("old\n")
    return argparse.Namespace(ro=ro, rw=rw, ws=ws, tmp=tmp_path,
                              grants=[Grant(str(ro), True, name="ref"), Grant(str(rw), False, name="out")])


def _mount_manifest(**entries):
    return load_manifest({"entries": {"README": {"type": "file", "content": "hi"}, **entries}})


def _names(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


# --------------------------------------------------------------------- grant names


@pytest.mark.parametrize("name", ["a", "ref", "Ref_data-1.2", "x" * 64, ".", "..", "-", "_"])
def test_a_valid_grant_name_is_kept(name):
    assert Grant("/srv/x", name=name).name == name
    assert Grant("/srv/x").name is None  # the name is optional


@pytest.mark.parametrize("name", ["", "x" * 65, "a/b", "a b", "a=b", "a:b", "a\0b", "é", "a\n", 7, b"ab"])
def test_an_invalid_grant_name_is_refused(name):
    with pytest.raises(InvalidArgumentError) as ei:
        Grant("/srv/x", True, name=name)
    assert ei.value.code == "invalid_argument" and "/srv/x" not in str(ei.value)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=70))
def test_the_same_name_rule_for_grants_cli_and_manifests(name):
    valid = bool(NAME.fullmatch(name))
    try:
        Grant("/srv/x", name=name)
        grant_ok = True
    except InvalidArgumentError:
        grant_ok = False
    try:
        load_manifest({"entries": {"m": {"type": "mount", "grant": name}}})
        manifest_ok = True
    except ManifestError:
        manifest_ok = False
    assert grant_ok is valid and manifest_ok is valid
    if valid:
        assert Grant.parse(f"{name}=/srv/x:rw") == Grant("/srv/x", False, name=name)


def test_grant_names_are_unique_among_a_sessions_grants(hostdirs):
    dup = [Grant(str(hostdirs.ro), name="same"), Grant(str(hostdirs.rw), False, name="same")]
    with pytest.raises(InvalidArgumentError, match="unique"):
        MaterializeOptions(extra_path_grants=dup)
    ws = open_root(str(hostdirs.ws))
    try:
        with pytest.raises(InvalidArgumentError, match="unique"):
            PathPolicy(ws, "/workspace", dup)
        # unnamed grants are never compared, and one name per grant is fine
        with PathPolicy(ws, "/workspace", [Grant(str(hostdirs.ro)), Grant(str(hostdirs.rw)), *hostdirs.grants]):
            pass
    finally:
        ws.close()


def test_the_policy_opens_a_named_grant_read_only_unless_both_say_rw(hostdirs):
    ws = open_root(str(hostdirs.ws))
    try:
        with PathPolicy(ws, "/workspace", hostdirs.grants) as policy:
            with policy.open_grant_root("ref") as r:
                assert r.read_only and r.read_bytes("data.txt") == b"reference data\n"
            with pytest.raises(ReadOnlyError):
                policy.open_grant_root("ref", read_only=False)
            with policy.open_grant_root("out") as r:
                assert r.read_only  # read-only by default, even on a read-write grant
            with policy.open_grant_root("out", read_only=False) as r:
                r.write_bytes("new.txt", b"n")
            assert (hostdirs.rw / "new.txt").read_bytes() == b"n"
            with pytest.raises(InvalidArgumentError) as ei:
                policy.open_grant_root("nope")
            assert str(hostdirs.tmp) not in str(ei.value)
    finally:
        ws.close()


# ---------------------------------------------------------------------- the CLI form


@pytest.mark.parametrize("spec,want", [
    ("ref=/srv/data:ro", Grant("/srv/data", True, name="ref")),
    ("ref=/srv/data:rw", Grant("/srv/data", False, name="ref")),
    ("ref=/srv/data", Grant("/srv/data", True, name="ref")),
    ("/srv/data:rw", Grant("/srv/data", False)),  # the existing forms keep working
    ("/srv/data", Grant("/srv/data", True)),
    ("/srv/a=b:rw", Grant("/srv/a=b", False)),  # '=' in an absolute path: no name (a name holds no '/')
    ("x=/srv/a=b", Grant("/srv/a=b", True, name="x")),
])
def test_cli_grant_forms(spec, want):
    assert parse_grant(spec) == want


def test_cli_grant_relative_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_grant("ref=sub:rw") == Grant(f"{tmp_path}/sub", False, name="ref")
    assert parse_grant("./a=b") == Grant(f"{tmp_path}/a=b", True)
    with pytest.raises(InvalidArgumentError, match="names no path"):
        parse_grant("ref=")
    with pytest.raises(InvalidPathError):
        parse_grant("ref=/")


def test_cli_follow_host_symlinks_keeps_the_name(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to("real")
    g = parse_grant(f"ref={tmp_path}/link:rw", argparse.Namespace(follow_host_symlinks=True))
    assert g == Grant(f"{tmp_path}/real", False, name="ref")


def test_cli_apply_refuses_a_mount_entry_in_one_line(hostdirs):
    m = hostdirs.tmp / "m.json"
    m.write_text(json.dumps({"entries": {"ref": {"type": "mount", "grant": "ref"}}}))
    proc = subprocess.run([sys.executable, "-m", "sandbox_fs", "apply", str(m), "--root", str(hostdirs.ws),
                           "--grant", f"ref={hostdirs.ro}:ro"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "mount_needs_overlay" in lines[0] and "--overlay" in lines[0], proc.stderr
    assert str(hostdirs.ro) not in proc.stderr
    assert _names(hostdirs.ws) == []


# ----------------------------------------------------------------- the manifest entry


def test_a_mount_entry_loads_read_only_by_default():
    m = load_manifest({"entries": {"a/ref": {"type": "mount", "grant": "ref"}}})
    ent = m.entries["a/ref"]
    assert isinstance(ent, Mount) and ent.grant == "ref" and ent.read_only is True
    assert m.mount_paths() == ["a/ref"]
    assert load_manifest(m.to_json()) == m


@pytest.mark.parametrize("entry,field", [
    ({"type": "mount"}, "grant"),
    ({"type": "mount", "grant": "/etc"}, "grant"),  # a host path is no grant name
    ({"type": "mount", "grant": "ref", "read_only": "false"}, "read_only"),
    ({"type": "mount", "grant": "ref", "read_only": 0}, "read_only"),
    ({"type": "mount", "grant": "ref", "src": "/etc"}, "src"),
    ({"type": "mount", "grant": "ref", "path": "/etc"}, "path"),
])
def test_a_malformed_mount_entry_is_refused(entry, field):
    with pytest.raises(ManifestError) as ei:
        load_manifest({"entries": {"m": entry}})
    assert ei.value.field == f"entries['m'].{field}"


def test_nothing_may_lie_beneath_a_mount_entry():
    with pytest.raises(ManifestError, match="beneath a mount entry"):
        load_manifest({"entries": {"m": {"type": "mount", "grant": "ref"}, "m/f": {"type": "file"}}})


def test_an_untrusted_manifest_can_only_name_a_grant_the_application_gave(hostdirs):
    m = _mount_manifest(mnt={"type": "mount", "grant": "etc"})
    for grants in ([], hostdirs.grants, [Grant("/etc")]):  # an unnamed grant is never mountable
        with pytest.raises(ManifestTrustError) as ei:
            plan_mounts(m, grants)
        err = ei.value
        assert err.code == "manifest_untrusted_field" and err.field == "entries['mnt'].grant"
        assert err.context["grant"] == "etc" and err.sandbox_path == "mnt"
        assert str(hostdirs.tmp) not in str(err) + repr(err.to_dict())


def test_read_write_is_only_for_a_read_write_grant(hostdirs):
    m = _mount_manifest(mnt={"type": "mount", "grant": "ref", "read_only": False})
    with pytest.raises(ManifestTrustError) as ei:
        plan_mounts(m, hostdirs.grants)
    assert ei.value.field == "entries['mnt'].read_only" and str(hostdirs.ro) not in str(ei.value)
    m = _mount_manifest(b={"type": "mount", "grant": "out", "read_only": False},
                        a={"type": "dir", "children": {"ref": {"type": "mount", "grant": "ref"}}},
                        c={"type": "mount", "grant": "out"})
    assert plan_mounts(m, hostdirs.grants) == [MountRequest("a/ref", "ref", True), MountRequest("b", "out", False),
                                               MountRequest("c", "out", True)]


# ---------------------------------------------------------------------- materialize


async def test_without_the_overlay_a_mount_entry_is_refused_before_anything_is_written(hostdirs):
    m = _mount_manifest(mnt={"type": "mount", "grant": "ref"})
    with open_root(str(hostdirs.ws)) as ws:
        with pytest.raises(MountNeedsOverlayError) as ei:
            await materialize(ws, m, MaterializeOptions(extra_path_grants=hostdirs.grants))
    err = ei.value
    assert err.code == "mount_needs_overlay" and err.retryable is False and err.sandbox_path == "mnt"
    assert "overlay=True" in str(err) and str(hostdirs.ro) not in str(err)
    assert _names(hostdirs.ws) == []


def test_plan_mounts_without_the_overlay_refuses_first(hostdirs):
    m = _mount_manifest(mnt={"type": "mount", "grant": "nope"})
    with pytest.raises(MountNeedsOverlayError):
        plan_mounts(m, hostdirs.grants, overlay=False)
    assert plan_mounts(_mount_manifest(), [], overlay=False) == []  # no mount entry: nothing to refuse


async def test_an_unknown_grant_is_refused_before_anything_is_written(hostdirs):
    m = _mount_manifest(mnt={"type": "mount", "grant": "nope"})
    with open_root(str(hostdirs.ws)) as ws:
        with pytest.raises(ManifestTrustError):
            await materialize(ws, m, MaterializeOptions(extra_path_grants=hostdirs.grants, overlay=True))
    assert _names(hostdirs.ws) == []


@pytest.mark.parametrize("only_ephemeral", [False, True])
async def test_with_the_overlay_a_mount_entry_gets_an_empty_placeholder(hostdirs, only_ephemeral):
    m = _mount_manifest(mnt={"type": "mount", "grant": "ref"},
                        d={"type": "dir", "mode": 0o555, "children": {"out": {"type": "mount", "grant": "out",
                                                                               "read_only": False}}})
    opts = MaterializeOptions(extra_path_grants=hostdirs.grants, overlay=True)
    with open_root(str(hostdirs.ws)) as ws:
        res = await materialize(ws, m, opts, only_ephemeral=only_ephemeral)
    assert res.mounts == [MountRequest("d/out", "out", False), MountRequest("mnt", "ref", True)]
    assert res.to_dict()["mounts"][0] == {"path": "d/out", "grant": "out", "read_only": False}
    for p in ("mnt", "d/out"):
        st_ = os.lstat(hostdirs.ws / p)
        assert stat.S_ISDIR(st_.st_mode) and stat.S_IMODE(st_.st_mode) == 0o755
        assert os.listdir(hostdirs.ws / p) == []  # nothing of the grant is copied
    assert (hostdirs.ws / "README").exists() is (not only_ephemeral)
    assert stat.S_IMODE(os.lstat(hostdirs.ws / "d").st_mode) == (0o755 if only_ephemeral else 0o555)
    assert "mnt" not in res.dirs and all(f.sandbox_path != "mnt" for f in res.files)
    assert _names(hostdirs.ro) == ["data.txt"] and _names(hostdirs.rw) == ["old.txt"]  # grants untouched


async def test_a_placeholder_repairs_what_stands_in_its_way_and_keeps_an_existing_dir(hostdirs):
    (hostdirs.ws / "mnt").write_text("a file where the mount goes")
    (hostdirs.ws / "keep").mkdir(mode=0o700)
    m = _mount_manifest(mnt={"type": "mount", "grant": "ref"}, keep={"type": "mount", "grant": "out"})
    with open_root(str(hostdirs.ws)) as ws:
        res = await materialize(ws, m, MaterializeOptions(extra_path_grants=hostdirs.grants, overlay=True))
    assert [r.path for r in res.mounts] == ["keep", "mnt"]
    assert (hostdirs.ws / "mnt").is_dir() and stat.S_IMODE(os.lstat(hostdirs.ws / "keep").st_mode) == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="giving entries an owner needs root (CAP_CHOWN)")
async def test_a_placeholder_is_owned_like_every_other_entry(hostdirs):
    m = _mount_manifest(mnt={"type": "mount", "grant": "ref"})
    with open_root(str(hostdirs.ws)) as base, base.with_options(owner=(54321, 54322)) as ws:
        await materialize(ws, m, MaterializeOptions(extra_path_grants=hostdirs.grants, overlay=True))
    for p in ("mnt", "README"):
        st_ = os.lstat(hostdirs.ws / p)
        assert (st_.st_uid, st_.st_gid) == (54321, 54322), p


def test_make_mount_points_never_follows_a_planted_symlink(hostdirs):
    outside = hostdirs.tmp / "outside"
    outside.mkdir()
    (hostdirs.ws / "a").symlink_to(outside)
    with open_root(str(hostdirs.ws)) as ws:
        make_mount_points(ws, [MountRequest("a/b", "ref", True), MountRequest("c/d", "out", True)])
    assert _names(outside) == []  # the sentinel directory outside stays empty
    assert (hostdirs.ws / "a").is_dir() and not (hostdirs.ws / "a").is_symlink()
    assert (hostdirs.ws / "a" / "b").is_dir() and (hostdirs.ws / "c" / "d").is_dir()


# ------------------------------------------------------- never persisted, never cleared


def _overlay_materialize(calls):
    """A materialize hook standing in for the overlay session: options.overlay=True, mounts recorded."""
    async def run(root, manifest, options, *, only_ephemeral=False):
        options.overlay = True
        res = await materialize(root, manifest, options, only_ephemeral=only_ephemeral)
        calls.append((only_ephemeral, [m.path for m in res.mounts]))
        return res
    return run


def _archive_names(opts, client, sid) -> list[str]:
    info = client.store.info(sid)
    with tarfile.open(os.path.join(opts.snapshot_dir, info.archive)) as tar:
        return sorted(tar.getnames())


async def test_a_mount_is_never_persisted_and_never_cleared_by_a_restore(hostdirs):
    from sandbox_fs.client import ClientOptions, LocalSandboxClient

    calls: list = []
    opts = ClientOptions(workspaces_dir=str(hostdirs.tmp / "workspaces"), snapshot_dir=str(hostdirs.tmp / "store"),
                         extra_path_grants=tuple(hostdirs.grants), materialize=_overlay_materialize(calls))
    m = _mount_manifest(mnt={"type": "mount", "grant": "ref"},
                        d={"type": "dir", "children": {"out": {"type": "mount", "grant": "out"}}})
    with LocalSandboxClient(opts) as client:
        s = client.create(manifest=m)
        for p in m.mount_paths():
            s.register_mount(p)  # what the overlay session does with the manifest's mount paths
        async with s:
            ws = Path(opts.workspaces_dir) / s.id
            assert calls == [(False, ["d/out", "mnt"])]
            assert (ws / "mnt").is_dir() and (ws / "d" / "out").is_dir()
            # whatever shows in a placeholder (here written straight into the backing directory)
            await trio.to_thread.run_sync((ws / "mnt" / "behind.txt").write_text, "mounted content")
            await s.write("d/own.txt", b"workspace content")
        names = _archive_names(opts, client, s.id)
        assert "README" in names and "d/own.txt" in names
        assert not [n for n in names if n.startswith(("mnt", "d/out"))], names  # not even the placeholder

        # restore onto the live workspace (it drifted): the mount and what is in it are kept
        (ws / "README").write_text("drift")
        r = client.resume(client.serialize_state(s))
        for p in m.mount_paths():
            r.register_mount(p)
        async with r:
            assert r.start_mode == "restored"
            assert await r.read("README") == b"hi" and await r.read("d/own.txt") == b"workspace content"
            assert (ws / "mnt" / "behind.txt").read_text() == "mounted content"
        assert calls[-1] == (True, ["d/out", "mnt"])  # placeholders are made after a restore too

        state = client.serialize_state(r)
    # restore onto a new machine (no workspace there): the placeholders come back, empty
    opts2 = ClientOptions(workspaces_dir=str(hostdirs.tmp / "workspaces2"), snapshot_dir=opts.snapshot_dir,
                          extra_path_grants=tuple(hostdirs.grants), materialize=_overlay_materialize(calls))
    with LocalSandboxClient(opts2) as client2:
        r2 = client2.resume(state)
        async with r2:
            ws2 = Path(opts2.workspaces_dir) / r2.id
            assert r2.start_mode == "restored"
            assert os.listdir(ws2 / "mnt") == [] and os.listdir(ws2 / "d" / "out") == []
        await client2.delete(r2)


async def test_a_live_workspace_with_its_mounts_registered_is_reattached(hostdirs):
    """The placeholder is left out of the live fingerprint too, so an unchanged workspace is not restored."""
    from sandbox_fs.client import ClientOptions, LocalSandboxClient

    calls: list = []
    opts = ClientOptions(workspaces_dir=str(hostdirs.tmp / "workspaces"), snapshot_dir=str(hostdirs.tmp / "store"),
                         extra_path_grants=tuple(hostdirs.grants), materialize=_overlay_materialize(calls))
    m = _mount_manifest(mnt={"type": "mount", "grant": "ref"})
    with LocalSandboxClient(opts) as client:
        s = client.create(manifest=m)
        s.register_mount("mnt")
        async with s:
            pass
        r = client.resume(client.serialize_state(s))
        r.register_mount("/workspace/mnt")
        async with r:
            assert r.start_mode == "reattached"
        await client.delete(r, snapshot=True)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40))
def test_parsing_any_grant_text_gives_a_grant_or_a_clear_error(spec):
    try:
        g = Grant.parse(spec, relative_to="/base")
    except (InvalidPathError, InvalidArgumentError):
        return
    assert g.path.startswith("/") and ".." not in g.path.split("/")
    assert g.name is None or (NAME.fullmatch(g.name) and spec.startswith(g.name + "="))
