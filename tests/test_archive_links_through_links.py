"""The extractor's rule "a symlink target never passes through another symlink", on its own.

Both parts of ``PendingSymlinks._check_through`` are reached here by
archives no earlier rule refuses (targets with no ``..`` at all, or only
names inside the destination): the in-archive part (a prefix of the target
is a symlink member of the same archive) and the on-disk part (a prefix is a
symlink already in an existing destination, planted by whoever could write
there).  The property case builds random link trees over a destination with
planted links and checks the rule on what was created.
"""

from __future__ import annotations

import io
import os
import shutil

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_archive_builders import tar_bytes, ti

from sandbox_fs import SandboxError, open_root
from sandbox_fs.archive import ExtractPolicy, UnsafeArchiveMemberError, extract


def _extract(layout, data: bytes, **kw):
    with open_root(layout.ws) as root:
        return extract(root, "dest", io.BytesIO(data), **kw)


def test_in_archive_link_through_link_without_dotdot(layout, resolver):
    """``s -> d``, ``l -> s/x``: lexically inside, but ``l``'s target passes through the link ``s``."""
    data = tar_bytes([ti("d", "dir"), ti("d/x", data=b"x"), ti("s", "symlink", linkname="d"),
                      ti("l", "symlink", linkname="s/x")])
    with pytest.raises(UnsafeArchiveMemberError) as ei:
        _extract(layout, data)
    assert ei.value.rule == "symlink_target" and "passes through another symlink" in str(ei.value)
    assert not (layout.ws / "dest").exists(), "atomic mode: nothing new may remain"
    # the control: the same tree with l pointing at d/x directly is fine
    ok = tar_bytes([ti("d", "dir"), ti("d/x", data=b"x"), ti("s", "symlink", linkname="d"),
                    ti("l", "symlink", linkname="d/x")])
    assert _extract(layout, ok).symlinks == 2 and os.readlink(layout.ws / "dest" / "l") == "d/x"


def test_in_archive_link_through_link_declared_later(layout, resolver):
    """The order of members does not matter: links are checked after every member is known."""
    data = tar_bytes([ti("l", "symlink", linkname="s/x"), ti("d", "dir"), ti("s", "symlink", linkname="d")])
    with pytest.raises(UnsafeArchiveMemberError) as ei:
        _extract(layout, data)
    assert ei.value.rule == "symlink_target"


@pytest.mark.parametrize("mode", ["staged", "in_place"])
def test_on_disk_planted_link_in_existing_destination(layout, resolver, mode):
    """An existing destination holds ``ext -> <outside>``; member ``l -> ext/secret.txt`` is refused."""
    dest = layout.ws / "dest"
    dest.mkdir()
    os.symlink(str(layout.outside), dest / "ext")
    before = layout.snapshot()
    data = tar_bytes([ti("l", "symlink", linkname="ext/secret.txt"), ti("f", data=b"1")])
    policy = ExtractPolicy(in_place=(mode == "in_place"))
    with pytest.raises(UnsafeArchiveMemberError) as ei:
        _extract(layout, data, policy=policy)
    assert ei.value.rule == "symlink_target"
    assert not os.path.lexists(dest / "l"), "a link reading the outside secret was created"
    layout.assert_outside_unchanged(before)
    layout.assert_secret_absent()
    # a link through a planted *relative* link that stays inside is refused the same way
    os.mkdir(dest / "real")
    os.symlink("real", dest / "rel")
    with pytest.raises(UnsafeArchiveMemberError):
        _extract(layout, tar_bytes([ti("l2", "symlink", linkname="rel/y")]), policy=policy)
    assert not os.path.lexists(dest / "l2")


@pytest.mark.parametrize("mode", ["staged", "in_place"])
def test_link_to_a_planted_link_in_existing_destination(layout, resolver, mode):
    """An existing destination holds ``ext -> <outside>``; member ``b -> ext`` (the planted link itself) is refused.

    The target has no prefix to pass through: its last component is the planted
    link, so ``b`` would resolve outside exactly as ``ext`` does (tarfile's data
    filter refuses it by ``realpath``).  A link to a member of the same archive
    that is a link stays allowed (each member link is checked on its own).
    """
    dest = layout.ws / "dest"
    dest.mkdir()
    os.symlink(str(layout.outside), dest / "ext")
    os.mkdir(dest / "sub")
    os.symlink("../ext", dest / "sub" / "up")
    before = layout.snapshot()
    policy = ExtractPolicy(in_place=(mode == "in_place"))
    for name, target in [("b", "ext"), ("sub/c", "up"), ("d", "sub/up")]:
        with pytest.raises(UnsafeArchiveMemberError) as ei:
            _extract(layout, tar_bytes([ti(name, "symlink", linkname=target)]), policy=policy)
        assert ei.value.rule == "symlink_target"
        assert not os.path.lexists(dest / name), f"{name} -> {target} was created"
    layout.assert_outside_unchanged(before)
    # the control: links to links of the same archive, and to a planted regular file
    (dest / "plain").write_bytes(b"p")
    _extract(layout, tar_bytes([ti("m", "symlink", linkname="plain"), ti("n", "symlink", linkname="m")]),
             policy=policy)
    assert os.readlink(dest / "n") == "m" and (dest / "n").read_bytes() == b"p"


# ----------------------------------------------------------------- property: the rule holds for any tree

_NAMES = ["a", "b", "c", "d"]
_targets = st.lists(st.sampled_from(_NAMES + ["ext"]), min_size=1, max_size=3).map("/".join)
_members = st.lists(st.tuples(st.sampled_from(["dir", "symlink", "file"]),
                              st.lists(st.sampled_from(_NAMES), min_size=1, max_size=2).map("/".join),
                              _targets), max_size=8)


def _passes_through_link(top: str, link: str) -> bool:
    """Does the (relative) target of ``link`` pass through a symlink on disk, lexically from its directory?"""
    target = os.readlink(link)
    cur = os.path.dirname(link)
    for comp in target.split("/")[:-1]:
        if comp in ("", "."):
            continue
        cur = os.path.dirname(cur) if comp == ".." else os.path.join(cur, comp)
        if os.path.islink(cur):
            return True
    return False


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(members=_members, planted=st.booleans())
@example(members=[("symlink", "b", "ext")], planted=True)
def test_no_created_link_passes_through_a_link(layout, members, planted):
    dest = layout.ws / "dest"
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir()
    if planted:
        os.symlink(str(layout.outside), dest / "ext")
    before = layout.snapshot()
    built = [ti(name, kind, linkname=target) if kind == "symlink" else
             ti(name, kind, data=b"x") if kind == "file" else ti(name, "dir") for kind, name, target in members]
    try:
        _extract(layout, tar_bytes(built), policy=ExtractPolicy(in_place=True))
    except SandboxError:
        pass
    layout.assert_outside_unchanged(before)
    for dirpath, dirs, files in os.walk(dest):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p) or p == str(dest / "ext"):
                continue
            assert not _passes_through_link(str(dest), p), f"{p} -> {os.readlink(p)} passes through a link"
            real, top = os.path.realpath(p), os.path.realpath(dest)
            assert real == top or real.startswith(top + os.sep), f"{p} resolves outside the destination"
