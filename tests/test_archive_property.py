"""Property: random archives of random members never change anything outside the
destination, and either succeed or raise a SandboxError (never anything else)."""

from __future__ import annotations

import io
import os
import shutil
import stat
import tarfile
import zipfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_archive_builders import tar_bytes, ti, ws_escapes, zip_bytes

from sandbox_fs import SandboxError, open_root
from sandbox_fs.archive import ArchiveLimits, ExtractPolicy, extract

_COMPS = st.sampled_from(["a", "b", "..", ".", "", "c" * 300, "d" * 100, "\\..", "C:", "/"])
_NAMES = st.lists(_COMPS, min_size=1, max_size=6).map("/".join)
_TARGETS = st.one_of(_NAMES, st.sampled_from(["/etc/passwd", "../outside", "../../outside/secret.txt",
                                              "a/../..", "a/a/a/../../..", "."]))
_MEMBER = st.tuples(st.sampled_from(["file", "dir", "symlink", "hardlink"]), _NAMES, _TARGETS,
                    st.integers(0, 0o7777))


def _build_tar(members):
    out = []
    for kind, name, target, mode in members:
        if kind == "file":
            out.append(ti(name, data=b"payload", mode=mode))
        elif kind == "dir":
            out.append(ti(name, "dir", mode=mode))
        else:
            out.append(ti(name, kind, linkname=target))
    return tar_bytes(out, fmt=tarfile.GNU_FORMAT)


def _build_zip(members):
    entries = []
    for kind, name, target, mode in members:
        if kind == "file" or kind == "hardlink":
            entries.append({"name": name, "data": b"payload", "mode": stat.S_IFREG | (mode & 0o7777)})
        elif kind == "dir":
            entries.append({"name": name.rstrip("/") + "/", "mode": stat.S_IFDIR | (mode & 0o7777)})
        else:
            entries.append({"name": name, "data": target.encode(), "mode": stat.S_IFLNK | 0o777})
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns on duplicate names
        return zip_bytes(entries)


def _reset(layout):
    for name in os.listdir(layout.ws):
        p = layout.ws / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(members=st.lists(_MEMBER, min_size=1, max_size=12), kind=st.sampled_from(["tar", "zip"]),
       in_place=st.booleans(), into_root=st.booleans())
def test_random_archives_stay_inside(layout, members, kind, in_place, into_root):
    _reset(layout)
    before = layout.snapshot()
    data = _build_tar(members) if kind == "tar" else _build_zip(members)
    dest = "." if into_root else "dest"
    try:
        with open_root(layout.ws) as root:
            extract(root, dest, io.BytesIO(data), policy=ExtractPolicy(in_place=in_place, special_files="skip"),
                    limits=ArchiveLimits(max_depth=8))
        ok = True
    except SandboxError:
        ok = False
    layout.assert_outside_unchanged(before)
    layout.assert_secret_absent()
    assert ws_escapes(layout.ws) == []
    if not ok and not in_place:
        assert os.listdir(layout.ws) == [], "atomic mode left something behind"
    assert not any(n.startswith(".sfs-") for n in os.listdir(layout.ws))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=4096), prefix=st.sampled_from([b"", b"PK\x03\x04", b"\x1f\x8b", b"BZh", b"ustar"]))
def test_garbage_input_is_sandbox_error(layout, data, prefix):
    _reset(layout)
    try:
        with open_root(layout.ws) as root:
            extract(root, "dest", io.BytesIO(prefix + data))
    except SandboxError:
        pass
    assert ws_escapes(layout.ws) == []


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(members=st.lists(_MEMBER, min_size=1, max_size=6), cut=st.integers(0, 5000), flip=st.integers(0, 5000))
def test_mutated_archives_stay_inside(layout, members, cut, flip):
    _reset(layout)
    before = layout.snapshot()
    data = bytearray(_build_tar(members))
    if data:
        data[flip % len(data)] ^= 0xFF
    data = bytes(data[: max(cut, 512)])
    try:
        with open_root(layout.ws) as root:
            extract(root, "dest", io.BytesIO(data))
    except SandboxError:
        pass
    layout.assert_outside_unchanged(before)
    assert ws_escapes(layout.ws) == []
    _ = zipfile  # zip mutations are covered by the fuzz harness
