"""One policy for persist and hydrate: whatever persist commits, hydrate restores; generations; read-back."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sandbox_fs.archive._tar as tarmod
from sandbox_fs import open_root
from sandbox_fs.snapshot import (
    LocalSnapshotStore,
    SnapshotLimitError,
    SnapshotLimits,
    SnapshotPolicy,
    SnapshotVerifyError,
    UnrestorableEntryError,
    hydrate,
    persist,
)


@pytest.fixture
def store(tmp_path):
    s = LocalSnapshotStore(tmp_path / "store")
    yield s
    s.close()


def _view(top: Path) -> dict:
    out = {}
    for dirpath, dirs, files in os.walk(top):
        for name in dirs + files:
            p = Path(dirpath, name)
            st_ = p.lstat()
            rel = os.fsencode(p.relative_to(top))
            data = p.read_bytes() if stat.S_ISREG(st_.st_mode) else (os.readlink(p) if p.is_symlink() else None)
            out[rel] = (stat.S_IFMT(st_.st_mode), stat.S_IMODE(st_.st_mode), data)
    return out


def _digit_names(ws: Path, n: int) -> None:
    for i in range(n):
        (ws / f"{i:0255d}").write_bytes(b"")


# ------------------------------------------------------------ the reproduction


def test_digit_names_past_the_pax_budget_are_refused_before_commit_and_precious_restores(layout, store):
    """600 empty files with 255-digit names: their PAX headers exceed hydrate's CVE-2024-6232 budget.

    On the code before the policy was shared, persist committed that archive (deleting the previous one) and
    hydrate refused it, so precious.txt was lost.  Now persist refuses first and the previous generation stays.
    """
    (layout.ws / "precious.txt").write_bytes(b"precious")
    with open_root(layout.ws) as ws:
        first = persist(ws, store, "s1").info
        _digit_names(layout.ws, 600)
        with pytest.raises(UnrestorableEntryError, match="CVE-2024-6232") as ei:
            persist(ws, store, "s1")
        assert ei.value.code == "snapshot_unrestorable_entry" and ei.value.sandbox_path.isdigit()
        assert store.info("s1") == first  # nothing committed
        for p in layout.ws.iterdir():
            if p.name != "precious.txt":
                p.unlink()
        (layout.ws / "precious.txt").write_bytes(b"overwritten")
        hydrate(ws, store, "s1")
    assert (layout.ws / "precious.txt").read_bytes() == b"precious"


def test_digit_names_with_skip_commit_a_snapshot_that_restores(layout, store):
    _digit_names(layout.ws, 600)
    with open_root(layout.ws) as ws:
        rep = persist(ws, store, "s1", on_unrestorable="skip")
        reasons = {r for _p, r in rep.skipped}
        assert rep.skipped and all("CVE-2024-6232" in r for r in reasons)
        kept = sorted(p.name for p in layout.ws.iterdir() if p.name not in {q for q, _r in rep.skipped})
        hydrate(ws, store, "s1")
    assert sorted(p.name for p in layout.ws.iterdir()) == kept
    assert rep.info.entries == len(kept)


def test_symlink_with_a_long_digit_target_is_refused_and_a_long_component_target_restores(layout, store):
    os.symlink("7" * 3000, layout.ws / "digits")  # one digit run: over the per-header budget
    with open_root(layout.ws) as ws:
        with pytest.raises(UnrestorableEntryError, match="CVE-2024-6232"):
            persist(ws, store, "s1")
        (layout.ws / "digits").unlink()
        os.symlink("a" * 3000, layout.ws / "long")  # dangles (no name can be that long); hydrate takes it
        persist(ws, store, "s1")
        (layout.ws / "long").unlink()
        hydrate(ws, store, "s1")
    assert os.readlink(layout.ws / "long") == "a" * 3000


def test_archive_larger_than_max_archive_bytes_is_refused_at_persist(layout, store):
    (layout.ws / "a").write_bytes(b"x" * 20000)
    with open_root(layout.ws) as ws:
        with pytest.raises(SnapshotLimitError, match="max_archive_bytes"):
            persist(ws, store, "s1", limits=SnapshotLimits(max_archive_bytes=16384))
    assert store.info("s1") is None and not [n for n in store.root.listdir(".") if n.endswith(".tar")]


# ------------------------------------------------------------------ set-id bits


def test_set_id_bits_are_never_recorded_nor_restored(layout, store, tmp_path):
    f = layout.ws / "tool"
    f.write_bytes(b"#!/bin/sh\n")
    os.chmod(f, 0o6755)
    d = layout.ws / "d"
    d.mkdir()
    os.chmod(d, 0o3775)
    with open_root(layout.ws) as ws:
        info = persist(ws, store, "s1").info
        hydrate(ws, store, "s1")
    assert stat.S_IMODE(f.stat().st_mode) == 0o755 and stat.S_IMODE(d.stat().st_mode) == 0o775
    assert all(m & ~0o777 == 0 for _p, m in info.mode_fixups)


def test_forged_snapshot_with_set_id_modes_restores_without_them(layout, store, tmp_path):
    (layout.ws / "seed").write_bytes(b"s")
    with open_root(layout.ws) as ws:
        info = persist(ws, store, "s1").info
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            ti = tarfile.TarInfo("suid")
            ti.mode, ti.size = 0o4755, 2
            tar.addfile(ti, io.BytesIO(b"hi"))
        data = buf.getvalue()
        import zlib

        forged = info.model_copy(update={"archive_bytes": len(data), "archive_crc32": f"{zlib.crc32(data):08x}",
                                         "mode_fixups": [("suid", 0o6755)], "entries": 1})
        store.root.atomic_write(info.archive, data, mode=0o600)
        store.root.atomic_write("s1.json", forged.model_dump_json().encode(), mode=0o600)
        hydrate(ws, store, "s1")
    assert stat.S_IMODE((layout.ws / "suid").stat().st_mode) == 0o755


# ------------------------------------------------------------------ generations


def test_generations_grow_and_the_previous_archive_goes_only_after_the_new_one_reads_back(layout, store):
    (layout.ws / "a").write_bytes(b"1")
    with open_root(layout.ws) as ws:
        gens = []
        for i in range(3):
            (layout.ws / "a").write_bytes(b"%d" % i)
            gens.append(persist(ws, store, "s1").info)
    assert [g.generation for g in gens] == [1, 2, 3]
    assert store.info("s1") == gens[-1]
    tars = sorted(n for n in store.root.listdir(".") if n.endswith(".tar"))
    assert tars == [gens[-1].archive] and gens[-1].archive.startswith("s1.g3.")


def test_failed_read_back_falls_back_to_the_previous_generation_and_says_so(layout, store, monkeypatch):
    (layout.ws / "precious.txt").write_bytes(b"precious")
    with open_root(layout.ws) as ws:
        first = persist(ws, store, "s1").info
        real = LocalSnapshotStore._verify_committed

        def corrupt_then_verify(self, info):
            fd = self.root.open_fd(info.archive, os.O_WRONLY)
            try:
                os.pwrite(fd, b"\xff", 100)  # a byte altered between the write and the read-back
            finally:
                os.close(fd)
            return real(self, info)

        monkeypatch.setattr(LocalSnapshotStore, "_verify_committed", corrupt_then_verify)
        (layout.ws / "precious.txt").write_bytes(b"newer")
        with pytest.raises(SnapshotVerifyError) as ei:
            persist(ws, store, "s1")
        assert ei.value.context["generation"] == 1 and ei.value.context["failed_generation"] == 2
        assert ei.value.retryable
        assert store.info("s1") == first
        assert sorted(n for n in store.root.listdir(".") if n.endswith(".tar")) == [first.archive]
        monkeypatch.undo()
        hydrate(ws, store, "s1")
        assert (layout.ws / "precious.txt").read_bytes() == b"precious"
        assert persist(ws, store, "s1").info.generation == 2  # the next one committed follows the current one


def test_metadata_read_back_failure_restores_the_previous_metadata(layout, store, monkeypatch):
    (layout.ws / "a").write_bytes(b"1")
    with open_root(layout.ws) as ws:
        first = persist(ws, store, "s1").info
        real_info = LocalSnapshotStore.info
        calls = []

        def bad_info(self, name):
            got = real_info(self, name)
            calls.append(got)
            return got.model_copy(update={"entries": got.entries + 1}) if got and got.generation == 2 else got

        monkeypatch.setattr(LocalSnapshotStore, "info", bad_info)
        with pytest.raises(SnapshotVerifyError, match="fell back"):
            persist(ws, store, "s1")
        monkeypatch.undo()
    assert store.info("s1") == first
    assert sorted(n for n in store.root.listdir(".") if n.endswith(".tar")) == [first.archive]


def test_old_metadata_without_a_generation_loads_as_generation_zero(layout, store):
    (layout.ws / "a").write_bytes(b"1")
    with open_root(layout.ws) as ws:
        info = persist(ws, store, "s1").info
        raw = info.model_dump(mode="json")
        raw.pop("generation")
        store.root.atomic_write("s1.json", __import__("json").dumps(raw).encode(), mode=0o600)
        assert store.info("s1").generation == 0
        hydrate(ws, store, "s1")
        assert persist(ws, store, "s1").info.generation == 2  # above the archive still named g1


# ------------------------------------------------------------------ the property

_NAME_CHARS = st.sampled_from([b"0", b"9", b"a", b"Z", b" ", b"-", b".", b"\\", b":", b"\n", b"\xc3\xa9",
                               b"\xff", b"\x01", b"=", b"%"])


@st.composite
def _names(draw):
    kind = draw(st.sampled_from(["digits", "mixed", "short"]))
    if kind == "digits":
        n = draw(st.integers(90, 255))
        return b"1" * n
    parts = draw(st.lists(_NAME_CHARS, min_size=1, max_size=40))
    name = b"".join(parts)
    if kind == "mixed":
        name = (name * (1 + 255 // max(1, len(name))))[:draw(st.integers(1, 255))]
    name = name[:255]
    if name in (b".", b"..") or name.startswith(b".sfs-"):
        name = b"x" + name[:254]
    return name


@st.composite
def _workspaces(draw):
    names = draw(st.lists(_names(), min_size=1, max_size=14, unique=True))
    entries = []
    for name in names:
        kind = draw(st.sampled_from(["file", "file", "dir", "link"]))
        mode = draw(st.integers(0, 0o7777))
        size = draw(st.sampled_from([0, 1, 511, 512, 4097]))
        entries.append((name, kind, mode, size))
    return entries


@settings(max_examples=int(os.environ.get("PROP_N", "30")), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(tree=_workspaces(), budget=st.sampled_from([1 << 25, 3 * 255 * 255, 255 * 255 + 90 * 90]),
       skip=st.booleans())
def test_property_whatever_persist_commits_hydrate_restores(tree, budget, skip, tmp_path_factory):
    """Generated names (digits, backslashes, ':', newlines, non-UTF-8), modes (set-id included) and sizes.

    The PAX digit budget is lowered on both sides at once (persist and the extractor read the same
    constants), so a handful of names reaches what 600 did in the reproduction.
    """
    base = tmp_path_factory.mktemp("p")
    ws_p = base / "ws"
    ws_p.mkdir()
    bws = os.fsencode(ws_p)
    sub = bws + b"/sub"
    os.mkdir(sub)
    for name, kind, mode, size in tree:
        for parent in (bws, sub):
            p = parent + b"/" + name
            if kind == "file":
                with open(p, "wb") as fh:
                    fh.write(b"\x00x" * (size // 2) + b"y" * (size % 2))
                os.chmod(p, mode)
            elif kind == "dir":
                os.mkdir(p)
                os.chmod(p, mode | 0o700)  # (the walk reads it as root anyway; keep the test's cleanup simple)
            else:
                os.symlink(b"../" + name if parent == sub else name, p)
    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(tarmod, "PAX_DIGIT_COST_ARCHIVE", budget))
        ws = stack.enter_context(open_root(ws_p))
        store = stack.enter_context(LocalSnapshotStore(base / "store"))
        try:
            rep = persist(ws, store, "s", on_unrestorable="skip" if skip else "refuse")
        except UnrestorableEntryError:
            assert not skip
            assert store.info("s") is None
            return
        expected = _view(ws_p)
        skipped = {os.fsencode(p) for p, _r in rep.skipped}
        expected = {k: v for k, v in expected.items()
                    if not any(k == s_ or k.startswith(s_ + b"/") for s_ in skipped)}
        expected = {k: (t, m & 0o777, d) for k, (t, m, d) in expected.items()}
        for k, (t, m, d) in list(expected.items()):
            if stat.S_ISLNK(t):
                expected[k] = (t, 0o777, d)
        hydrate(ws, store, "s")  # must not raise: persist committed it
        got = _view(ws_p)
        got = {k: ((t, 0o777, d) if stat.S_ISLNK(t) else (t, m, d)) for k, (t, m, d) in got.items()}
        assert got == expected


def test_policy_object_is_what_hydrate_extracts_with():
    pol = SnapshotPolicy(SnapshotLimits(max_entries=7, max_file_bytes=9, max_total_bytes=11,
                                        max_archive_bytes=13))
    al = pol.archive_limits(5)
    assert (al.max_members, al.max_member_bytes, al.max_total_bytes, al.max_input_bytes) == (7, 9, 11, 5)
    assert pol.extract_policy().special_files == "refuse" and not pol.extract_policy().preserve_owner
    assert pol.mode(0o106755) == 0o755
