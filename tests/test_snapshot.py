"""Snapshots: persist/hydrate round trip, one policy for both, verification, races, crash safety."""

from __future__ import annotations

import io
import os
import signal
import stat
import subprocess
import sys
import tarfile
import textwrap
import threading
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandbox_fs import open_root
from sandbox_fs.snapshot import (
    LocalSnapshotStore,
    NoSnapshot,
    SnapshotCorruptError,
    SnapshotInfo,
    SnapshotLimitError,
    SnapshotLimits,
    SnapshotNotFoundError,
    SnapshotSourceChangedError,
    UnrestorableEntryError,
    hydrate,
    persist,
    tree_digest,
    validate_name,
)
from tests.conftest import tree_digest as host_tree


def _host_view(top: Path) -> dict:
    """Type, mode, size, content/target of every node (mtimes and nlink left out)."""
    return {k: (v[0], v[1], v[2], v[5]) for k, v in host_tree(top).items() if k != "."}


def _race_after_listing(monkeypatch, change) -> None:
    """Call ``change(names)`` right after each directory's listing (every entry lstat-ed), before any open."""
    import sandbox_fs.snapshot as snap

    real = snap._walk._list_dir

    def racing(dfd):
        out = real(dfd)
        change([name for name, _st in out])
        return out

    monkeypatch.setattr(snap._walk, "_list_dir", racing)


def _fill(ws: Path) -> None:
    (ws / "a" / "b").mkdir(parents=True)
    (ws / "a" / "f.txt").write_bytes(b"hello\n")
    (ws / "empty").write_bytes(b"")
    (ws / "exec.sh").write_bytes(b"#!/bin/sh\n")
    os.chmod(ws / "exec.sh", 0o755)
    os.chmod(ws / "a" / "f.txt", 0o600)
    (ws / "a" / "link").symlink_to("f.txt")
    (ws / "uplink").symlink_to("a/b")
    os.link(ws / "a" / "f.txt", ws / "hard")
    (ws / "bin.dat").write_bytes(bytes(range(256)) * 5000)
    (ws / os.fsdecode(b"caf\xe9-latin1")).write_bytes(b"x")
    os.chmod(ws / "a" / "b", 0o500)


@pytest.fixture
def store(tmp_path):
    s = LocalSnapshotStore(tmp_path / "store")
    yield s
    s.close()


def _sfs_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("sfs-")]


@pytest.fixture(autouse=True)
def no_thread_left_running():
    """After every test, success or failure: no persist writer or hydrate checker thread is still alive."""
    assert _sfs_threads() == []
    yield
    assert _sfs_threads() == []


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_round_trip_restores_exactly(layout, store, resolver, tmp_path):
    _fill(layout.ws)
    before = layout.snapshot()
    with open_root(layout.ws) as ws:
        rep = persist(ws, store, "s1", manifest_digest="m1")
    assert rep.info is not None and rep.info.entries == 10
    dst = tmp_path / "restored"
    dst.mkdir()
    (dst / "stale").write_text("gone after hydrate")
    with open_root(dst) as r:
        hydrate(r, store, "s1")
        assert tree_digest(r) == rep.info.tree_digest
    assert _host_view(dst) == _host_view(layout.ws)
    assert os.stat(dst / "hard").st_ino == os.stat(dst / "a" / "f.txt").st_ino
    assert stat.S_IMODE(os.stat(dst / "a" / "b").st_mode) == 0o500
    layout.assert_outside_unchanged(before)


def test_store_files_are_private_and_member_names_relative(layout, store, tmp_path):
    _fill(layout.ws)
    with open_root(layout.ws) as ws:
        info = persist(ws, store, "s1").info
    sdir = tmp_path / "store"
    assert stat.S_IMODE(sdir.stat().st_mode) == 0o700
    for p in sdir.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p.name
    with tarfile.open(sdir / info.archive) as tar:
        for m in tar.getmembers():
            assert not m.name.startswith("/") and ".." not in m.name.split("/")
            assert m.uid == 0 and m.uname == ""


@pytest.mark.parametrize("kind", ["abs_symlink", "escaping_symlink", "fifo", "socket"])
def test_unrestorable_entries_refused_at_persist(layout, store, kind):
    (layout.ws / "ok.txt").write_text("ok")
    (layout.ws / "d").mkdir()
    bad = layout.ws / "d" / "bad"
    if kind == "abs_symlink":
        bad.symlink_to(layout.outside / "secret.txt")
    elif kind == "escaping_symlink":
        bad.symlink_to("../../outside/secret.txt")
    elif kind == "fifo":
        os.mkfifo(bad)
    else:
        import socket

        s = socket.socket(socket.AF_UNIX)
        s.bind(str(bad))
        s.close()
    with open_root(layout.ws) as ws:
        with pytest.raises(UnrestorableEntryError) as ei:
            persist(ws, store, "s1")
        assert ei.value.sandbox_path == "d/bad"
        assert str(layout.base) not in str(ei.value)
        assert store.info("s1") is None  # nothing committed
        rep = persist(ws, store, "s1", on_unrestorable="skip")
        assert ("d/bad", rep.skipped[0][1]) == rep.skipped[0]
    dst = layout.base / "restored"
    dst.mkdir()
    with open_root(dst) as r:
        hydrate(r, store, "s1")
    assert sorted(os.listdir(dst)) == ["d", "ok.txt"] and os.listdir(dst / "d") == []
    layout.assert_secret_absent()


def test_absolute_symlink_fifo_hardlink_workspace_refused_or_exact(layout, store):
    """Issue case: absolute symlink + FIFO + hard link: refused at persist, or (skip) restores the rest exactly."""
    (layout.ws / "f").write_text("data")
    os.link(layout.ws / "f", layout.ws / "h")
    (layout.ws / "abs").symlink_to("/etc/passwd")
    os.mkfifo(layout.ws / "p")
    with open_root(layout.ws) as ws:
        with pytest.raises(UnrestorableEntryError):
            persist(ws, store, "x")
        rep = persist(ws, store, "x", on_unrestorable="skip")
    assert sorted(p for p, _ in rep.skipped) == ["abs", "p"]
    dst = layout.base / "r"
    dst.mkdir()
    with open_root(dst) as r:
        hydrate(r, store, "x")
    assert sorted(os.listdir(dst)) == ["f", "h"]
    assert os.stat(dst / "h").st_ino == os.stat(dst / "f").st_ino and (dst / "h").read_text() == "data"


def test_excluded_mount_and_tmp_entries_not_persisted(layout, store):
    (layout.ws / "keep").write_text("k")
    (layout.ws / "cache" / "deep").mkdir(parents=True)
    (layout.ws / "cache" / "deep" / "x").write_text("x")
    (layout.ws / "mnt").mkdir()
    (layout.ws / "mnt" / "y").write_text("y")
    (layout.ws / ".sfs-tmp-0123").write_text("in flight")
    with open_root(layout.ws) as ws:
        rep = persist(ws, store, "s", excluded=["cache"], mount_points=["mnt"])
    assert set(rep.info.excluded) == {"cache"}
    with tarfile.open(layout.base / "store" / rep.info.archive) as tar:
        assert tar.getnames() == ["keep"]


def test_file_swapped_for_symlink_mid_walk_is_never_read_through(layout, store, monkeypatch):
    (layout.ws / "victim").write_text("harmless")
    with open_root(layout.ws) as ws:
        def swap(names):
            if "victim" in names:
                os.unlink(layout.ws / "victim")
                os.symlink(layout.outside / "secret.txt", layout.ws / "victim")

        # The listing said "file"; the open finds a symlink.
        _race_after_listing(monkeypatch, swap)
        with pytest.raises(SnapshotSourceChangedError) as ei:
            persist(ws, store, "s")
        assert ei.value.retryable
    assert store.info("s") is None
    for p in (layout.base / "store").iterdir():
        assert layout.secret.encode() not in p.read_bytes()


def test_file_swapped_for_fifo_mid_walk_does_not_block(layout, store, monkeypatch):
    (layout.ws / "victim").write_text("harmless")
    with open_root(layout.ws) as ws:
        def swap(names):
            os.unlink(layout.ws / "victim")
            os.mkfifo(layout.ws / "victim")

        _race_after_listing(monkeypatch, swap)
        with pytest.raises(SnapshotSourceChangedError):
            persist(ws, store, "s")


def test_corrupted_or_truncated_snapshot_refused_previous_stays_valid(layout, store, tmp_path):
    (layout.ws / "v").write_text("one")
    with open_root(layout.ws) as ws:
        good = persist(ws, store, "s").info
        (layout.ws / "v").write_text("two, longer")
        newer = persist(ws, store, "s").info
    assert store.info("s") == newer
    assert not (tmp_path / "store" / good.archive).exists()  # superseded archive removed
    arch = tmp_path / "store" / newer.archive
    data = arch.read_bytes()
    dst = tmp_path / "r"
    dst.mkdir()
    (dst / "precious").write_text("untouched on refusal")
    for bad in (data[: len(data) // 2], data[:600] + b"X" + data[601:]):
        arch.write_bytes(bad)
        with open_root(dst) as r, pytest.raises(SnapshotCorruptError):
            hydrate(r, store, "s")
        assert (dst / "precious").read_text() == "untouched on refusal"
    arch.write_bytes(data)
    with open_root(dst) as r:
        hydrate(r, store, "s")
    assert (dst / "v").read_text() == "two, longer" and not (dst / "precious").exists()


def _tar_member_offset(data: bytes, name: str) -> int:
    """Offset of member ``name``'s header in an uncompressed tar."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return tar.getmember(name).offset


@pytest.mark.parametrize("corruption", ["file_data", "member_name"])
def test_corruption_caught_by_the_concurrent_crc_leaves_workspace_unchanged(layout, store, tmp_path,
                                                                            monkeypatch, corruption):
    """The CRC-32 is checked while/after extracting into staging, always before the swap.

    ``file_data``: a flipped content byte the extractor cannot notice; only the
    CRC-32 catches it, after extraction (it ran concurrently, not first).
    ``member_name``: a header rewritten to ``../f`` with a valid header checksum:
    the extractor refuses it (unsafe member); since the CRC-32 does not match,
    it is reported as SnapshotCorruptError.  Either way the workspace, the fd
    count and the thread list are as before.
    """
    import sandbox_fs.snapshot as snap

    (layout.ws / "aa").mkdir()
    (layout.ws / "aa" / "f").write_bytes(b"A" * 5000)
    (layout.ws / "big").write_bytes(os.urandom(3 << 20))
    with open_root(layout.ws) as ws:
        info = persist(ws, store, "s").info
    arch = tmp_path / "store" / info.archive
    data = bytearray(arch.read_bytes())
    off = _tar_member_offset(bytes(data), "aa/f")
    if corruption == "file_data":
        data[off + 512 + 100] ^= 0x01
    else:
        data[off:off + 4] = b"../f"
        data[off + 148:off + 156] = b"        "
        data[off + 148:off + 156] = b"%06o\0 " % tarfile.calc_chksums(bytes(data[off:off + 512]))[0]
    arch.write_bytes(bytes(data))
    dst = tmp_path / "dst"
    dst.mkdir()
    _previous_workspace(dst)
    before = _live(dst)
    extracted = []
    real = snap._hydrate.extract_stream

    def recording(*a, **kw):
        extracted.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(snap._hydrate, "extract_stream", recording)
    with open_root(dst) as d:
        fds = _open_fds()
        with pytest.raises(SnapshotCorruptError) as ei:
            hydrate(d, store, "s")
        assert _open_fds() == fds
    assert "CRC-32" in str(ei.value) and extracted == [1]
    assert _live(dst) == before and _staging_dirs(dst) == []


def test_corrupt_metadata_and_missing_snapshot(store, tmp_path):
    with pytest.raises(SnapshotNotFoundError):
        store.open_archive("nope", SnapshotLimits())
    (tmp_path / "store" / "bad.json").write_text("{not json")
    with pytest.raises(SnapshotCorruptError):
        store.info("bad")
    other = SnapshotInfo(name="other", archive="../../etc/passwd", archive_bytes=1, archive_crc32="0" * 8,
                         fingerprint="0" * 64, tree_digest="0" * 64, entries=0, content_bytes=0)
    (tmp_path / "store" / "evil.json").write_text(other.model_dump_json())
    with pytest.raises(SnapshotCorruptError):
        store.info("evil")
    assert store.list() == []


@pytest.mark.parametrize("name", ["", "../x", "a/b", ".hidden", "a.b", "x" * 129, "a\0b"])
def test_snapshot_names_are_plain_tokens(name, store):
    with pytest.raises(Exception) as ei:
        validate_name(name)
    assert getattr(ei.value, "code", None) == "invalid_path"


def _malicious_tar(members) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for kind, name, extra in members:
            ti = tarfile.TarInfo(name)
            if kind == "file":
                ti.size = len(extra)
                tar.addfile(ti, io.BytesIO(extra))
            elif kind == "sym":
                ti.type, ti.linkname = tarfile.SYMTYPE, extra
                tar.addfile(ti)
            elif kind == "lnk":
                ti.type, ti.linkname = tarfile.LNKTYPE, extra
                tar.addfile(ti)
            elif kind == "chr":
                ti.type = tarfile.CHRTYPE
                tar.addfile(ti)
    return buf.getvalue()


def _forge(store_dir: Path, name: str, data: bytes) -> None:
    """Write an archive + matching metadata, as someone with write access to the store could."""
    from sandbox_fs.snapshot import SnapshotInfo

    info = SnapshotInfo(name=name, archive=f"{name}.forged.tar", archive_bytes=len(data),
                        archive_crc32=f"{zlib.crc32(data):08x}", fingerprint="0" * 64,
                        tree_digest="0" * 64, entries=1, content_bytes=0)
    (store_dir / info.archive).write_bytes(data)
    (store_dir / f"{name}.json").write_text(info.model_dump_json())


@pytest.mark.parametrize("members", [
    [("file", "../outside/evil", b"pwn")],
    [("file", "/abs/evil", b"pwn")],
    [("sym", "esc", "../outside"), ("file", "esc/evil", b"pwn")],
    [("sym", "abs", "/tmp"), ("file", "abs/evil", b"pwn")],
    [("lnk", "hl", "../outside/secret.txt")],
    [("chr", "dev", "")],
])
def test_hydrate_of_forged_snapshot_refuses_zip_slip(layout, members, resolver, store, tmp_path):
    """A forged store entry (valid metadata) still cannot escape: zip slip, CVE-2007-4559."""
    before = layout.snapshot()
    _forge(tmp_path / "store", "forged", _malicious_tar(members))
    with open_root(layout.ws) as ws:
        with pytest.raises(Exception) as ei:
            hydrate(ws, store, "forged")
    assert hasattr(ei.value, "code"), repr(ei.value)
    layout.assert_outside_unchanged(before)
    assert not (layout.outside / "evil").exists()


def test_limits_apply_at_persist(layout, store):
    for i in range(5):
        (layout.ws / f"f{i}").write_bytes(b"x" * 100)
    with open_root(layout.ws) as ws:
        with pytest.raises(SnapshotLimitError):
            persist(ws, store, "s", limits=SnapshotLimits(max_entries=3))
        with pytest.raises(SnapshotLimitError):
            persist(ws, store, "s", limits=SnapshotLimits(max_total_bytes=250))
        with pytest.raises(SnapshotLimitError):
            persist(ws, store, "s", limits=SnapshotLimits(max_file_bytes=99))
    assert store.info("s") is None


def test_no_snapshot_store_is_a_noop(layout):
    with open_root(layout.ws) as ws:
        assert persist(ws, NoSnapshot(), "s").info is None
        with pytest.raises(SnapshotNotFoundError):
            hydrate(ws, NoSnapshot(), "s")


def test_fingerprint_tracks_content_mode_and_manifest(layout):
    (layout.ws / "f").write_text("a")
    with open_root(layout.ws) as ws:
        d1 = tree_digest(ws)
        (layout.ws / "f").write_text("b")
        d2 = tree_digest(ws)
        os.chmod(layout.ws / "f", 0o600)
        d3 = tree_digest(ws)
        os.utime(layout.ws / "f", ns=(1, 1))
        d4 = tree_digest(ws)
    assert len({d1, d2, d3}) == 3 and d3 == d4  # mtime is not part of it


_names = st.text(alphabet="abcxyz019_-.", min_size=1, max_size=8).filter(lambda s: s not in (".", ".."))


@st.composite
def _trees(draw):
    nodes = {}
    dirs = [""]
    for _ in range(draw(st.integers(0, 14))):
        parent = draw(st.sampled_from(dirs))
        name = draw(_names)
        path = f"{parent}/{name}" if parent else name
        if path in nodes or any(path.startswith(p + "/") for p, v in nodes.items() if v[0] != "dir"):
            continue
        kind = draw(st.sampled_from(["file", "file", "dir", "symlink"]))
        if kind == "file":
            nodes[path] = ("file", draw(st.binary(max_size=300)), draw(st.sampled_from([0o644, 0o600, 0o755, 0o400])))
        elif kind == "dir":
            nodes[path] = ("dir", None, draw(st.sampled_from([0o755, 0o700, 0o555])))
            dirs.append(path)
        else:
            ups = draw(st.integers(0, path.count("/")))
            nodes[path] = ("symlink", "../" * ups + draw(_names), None)
    return nodes


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=_trees())
def test_property_persist_then_hydrate_is_identity(tree, tmp_path_factory):
    """Whatever persist keeps hydrates back to the same types, modes, sizes and contents.

    Entries it leaves out (``skip``: link cycles, links through links) are
    exactly the reported ones.
    """
    base = tmp_path_factory.mktemp("prop")
    ws, dst = base / "ws", base / "dst"
    ws.mkdir()
    dst.mkdir()
    for path, (kind, data, mode) in sorted(tree.items()):
        p = ws / path
        if kind == "dir":
            p.mkdir()
        elif kind == "file":
            p.write_bytes(data)
            os.chmod(p, mode)
        else:
            p.symlink_to(data)
    for path, (kind, _d, mode) in sorted(tree.items(), reverse=True):
        if kind == "dir":
            os.chmod(ws / path, mode)
    s = LocalSnapshotStore(base / "store")
    with s, open_root(ws) as w, open_root(dst) as d:
        rep = persist(w, s, "p", on_unrestorable="skip")
        hydrate(d, s, "p")
        assert tree_digest(d) == rep.info.tree_digest
    skipped = {p for p, _ in rep.skipped}
    assert all(tree[p][0] == "symlink" for p in skipped)
    assert _host_view(dst) == {k: v for k, v in _host_view(ws).items() if k not in skipped}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 10_000), flip=st.integers(0, 10_000), mode=st.sampled_from(["truncate", "flip"]))
def test_fuzz_damaged_archive_always_refused(cut, flip, mode, tmp_path_factory):
    base = tmp_path_factory.mktemp("fz")
    ws = base / "ws"
    ws.mkdir()
    (ws / "a").write_bytes(os.urandom(3000))
    (ws / "d").mkdir()
    (ws / "d" / "b").write_text("b" * 4000)
    s = LocalSnapshotStore(base / "store")
    with s, open_root(ws) as w:
        info = persist(w, s, "z").info
        arch = base / "store" / info.archive
        data = bytearray(arch.read_bytes())
        if mode == "truncate":
            data = data[: cut % len(data)]
        else:
            data[flip % len(data)] ^= 0x01
        arch.write_bytes(bytes(data))
        dst = base / "dst"
        dst.mkdir()
        with open_root(dst) as d, pytest.raises(SnapshotCorruptError):
            hydrate(d, s, "z")


_KILL_SCRIPT = textwrap.dedent("""
    import sys
    from sandbox_fs import open_root
    from sandbox_fs.snapshot import LocalSnapshotStore, persist
    ws, store = sys.argv[1], sys.argv[2]
    def progress(entries, nbytes):
        if nbytes > (8 << 20):
            print("mid", flush=True)
            sys.stdin.read()  # parent SIGKILLs us here, mid-persist
    with open_root(ws) as w:
        persist(w, LocalSnapshotStore(store), "s", progress=progress)
""")


def test_sigkill_mid_persist_leaves_previous_snapshot_intact(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "small").write_text("previous")
    s = LocalSnapshotStore(tmp_path / "store")
    with open_root(ws) as w:
        prev = persist(w, s, "s").info
    for i in range(40):
        (ws / f"big{i}").write_bytes(os.urandom(1 << 20))
    script = tmp_path / "kill_me.py"
    script.write_text(_KILL_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen([sys.executable, str(script), str(ws), str(tmp_path / "store")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.readline().strip() == b"mid"
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdin.close()
        proc.stdout.close()
    assert s.info("s") == prev
    leftovers = sorted(os.listdir(tmp_path / "store"))
    assert leftovers == sorted([prev.archive, "s.json", "s.lock"])  # O_TMPFILE: nothing half-written stays
    dst = tmp_path / "dst"
    dst.mkdir()
    with open_root(dst) as d:
        hydrate(d, s, "s")
    assert os.listdir(dst) == ["small"] and (dst / "small").read_text() == "previous"
    s.close()


def test_persist_memory_does_not_buffer_workspace(layout, store):
    """Structural O(1) check: the sink is written while files are read (not at the end)."""
    from sandbox_fs.snapshot import _tar

    for i in range(_tar._MAX_BUFFERS + 6):
        (layout.ws / f"f{i}").write_bytes(os.urandom(1 << 20))
    seen = []
    with open_root(layout.ws) as ws:
        orig_begin = store.begin

        def begin(name):
            pending = orig_begin(name)
            seen.append(pending)
            return pending

        store.begin = begin

        def progress(entries, nbytes):
            seen.append(seen[0].sink.count)

        persist(ws, store, "s", progress=progress)
    # by the final progress call nearly everything already reached the file: at most _MAX_BUFFERS
    # buffers of 1 MiB (one being filled, the others queued for the writer thread) are not written yet
    assert seen[-1] >= 6 << 20


@pytest.mark.parametrize("case", ["through_symlink", "through_symlink_below_a_directory", "backslash_dotdot",
                                  "drive_letter", "cycle"])
def test_names_and_links_the_extractor_refuses_are_refused_at_persist(layout, store, case):
    """One policy: persist uses the extractor's own name/target rules (CVE-2021-37713, CVE-2025-4517)."""
    (layout.ws / "real").mkdir()
    if case == "through_symlink":
        (layout.ws / "l1").symlink_to("real")
        (layout.ws / "bad").symlink_to("l1/x")
        bad = "bad"
    elif case == "through_symlink_below_a_directory":  # the check goes on past a real directory
        (layout.ws / "real" / "l1").symlink_to(".")
        (layout.ws / "bad").symlink_to("real/l1/x")
        bad = "bad"
    elif case == "cycle":
        (layout.ws / "real" / "a").symlink_to("b")
        (layout.ws / "real" / "b").symlink_to("a")
        bad = "real/a"
    elif case == "backslash_dotdot":
        bad = "..\\evil"
        (layout.ws / bad).write_text("x")
    else:
        bad = "C:evil"
        (layout.ws / bad).write_text("x")
    with open_root(layout.ws) as ws:
        with pytest.raises(UnrestorableEntryError) as ei:
            persist(ws, store, "s")
        assert ei.value.sandbox_path == bad
        rep = persist(ws, store, "s", on_unrestorable="skip")
    assert [p for p, _ in rep.skipped][:1] == [bad]
    dst = layout.base / "dst"
    dst.mkdir()
    with open_root(dst) as d:
        hydrate(d, store, "s")  # what was saved restores
        assert tree_digest(d) == rep.info.tree_digest


@pytest.mark.parametrize("links,refused", [(40, False), (41, True)])
def test_a_link_chain_is_followed_up_to_40_links(layout, store, links, refused):
    """The kernel's ELOOP bound, exactly: ``c0 -> c1 -> ... -> f`` with ``links`` links."""
    (layout.ws / "f").write_text("x")
    for i in range(links):
        (layout.ws / f"c{i}").symlink_to(f"c{i + 1}" if i + 1 < links else "f")
    with open_root(layout.ws) as ws:
        if refused:
            with pytest.raises(UnrestorableEntryError, match="longer than 40") as ei:
                persist(ws, store, "s")
            assert ei.value.sandbox_path == "c0"
        else:
            persist(ws, store, "s")


def test_named_partial_fallback_commits_and_aborts_cleanly(layout, store, monkeypatch, tmp_path):
    import sandbox_fs.snapshot as snapmod

    monkeypatch.setattr(snapmod._store, "_proc_fd_available", lambda: False)
    (layout.ws / "f").write_text("v1")
    with open_root(layout.ws) as ws:
        info = persist(ws, store, "s").info
        os.mkfifo(layout.ws / "p")
        with pytest.raises(UnrestorableEntryError):
            persist(ws, store, "s")
    assert sorted(os.listdir(tmp_path / "store")) == sorted([info.archive, "s.json", "s.lock"])
    dst = tmp_path / "dst"
    dst.mkdir()
    with open_root(dst) as d:
        hydrate(d, store, "s")
    assert (dst / "f").read_text() == "v1"


# ------------------------------------------------------- the persist writer thread


@pytest.mark.parametrize("fail_at", [1, 3])
def test_writer_thread_write_error_commits_nothing_and_previous_snapshot_still_hydrates(
        layout, store, monkeypatch, tmp_path, fail_at):
    """ENOSPC in the writer thread surfaces in persist; the archive is never committed; no thread, no fd left."""
    import errno

    import sandbox_fs.snapshot as snap

    (layout.ws / "keep").write_text("previous snapshot")
    with open_root(layout.ws) as ws:
        first = persist(ws, store, "s").info
    for i in range(5):  # several 1 MiB buffers, so the error can come from a later one
        (layout.ws / f"big{i}").write_bytes(os.urandom(1 << 20))
    real_write = snap._store._HashingSink.write
    calls = []

    def failing_write(self, b):
        calls.append(threading.current_thread().name)
        if len(calls) == fail_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, b)

    monkeypatch.setattr(snap._store._HashingSink, "write", failing_write)
    with open_root(layout.ws) as ws:
        fds = _open_fds()
        with pytest.raises(OSError) as ei:
            persist(ws, store, "s")
        assert _open_fds() == fds
    assert ei.value.errno == errno.ENOSPC
    assert set(calls) == {"sfs-persist-writer"} and len(calls) == fail_at  # nothing written after the error
    assert store.info("s") == first
    assert sorted(os.listdir(tmp_path / "store")) == sorted(["s.json", "s.lock", first.archive])
    monkeypatch.setattr(snap._store._HashingSink, "write", real_write)
    dst = tmp_path / "dst"
    dst.mkdir()
    with open_root(dst) as d:
        hydrate(d, store, "s")
    assert os.listdir(dst) == ["keep"] and (dst / "keep").read_text() == "previous snapshot"


@pytest.mark.parametrize("fail", [False, True])
def test_an_archive_of_one_buffer_is_written_at_close_without_a_writer_thread(layout, store, monkeypatch, tmp_path,
                                                                            fail):
    """An archive that fits one buffer is written by the persisting thread at close (no writer thread); a write
    error there surfaces the same way: nothing committed, no fd left, the previous snapshot still restores."""
    import errno

    import sandbox_fs.snapshot as snap

    (layout.ws / "keep").write_text("previous snapshot")
    with open_root(layout.ws) as ws:
        first = persist(ws, store, "s").info
    (layout.ws / "more").write_text("more")
    real_write = snap._store._HashingSink.write
    calls = []

    def write(self, b):
        calls.append(threading.current_thread())
        if fail:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, b)

    monkeypatch.setattr(snap._store._HashingSink, "write", write)
    threads = threading.active_count()
    with open_root(layout.ws) as ws:
        fds = _open_fds()
        if fail:
            with pytest.raises(OSError) as ei:
                persist(ws, store, "s")
            assert ei.value.errno == errno.ENOSPC and store.info("s") == first
        else:
            assert persist(ws, store, "s").info.entries == 2
        assert _open_fds() == fds
    assert calls == [threading.current_thread()] and threading.active_count() == threads
    monkeypatch.setattr(snap._store._HashingSink, "write", real_write)
    dst = tmp_path / "dst"
    dst.mkdir()
    with open_root(dst) as d:
        hydrate(d, store, "s")
    assert sorted(os.listdir(dst)) == (["keep"] if fail else ["keep", "more"])


def test_tiny_writer_buffers_round_trip_headers_longer_than_a_buffer(layout, store, monkeypatch, tmp_path):
    """With 1 KiB buffers, PAX headers longer than a buffer and many buffer swaps still round-trip exactly."""
    import sandbox_fs.snapshot as snap

    monkeypatch.setattr(snap._tar, "_WRITE_BUF_BYTES", 1024)
    long_dir = layout.ws / ("d" * 200) / ("e" * 200) / ("f" * 200)
    long_dir.mkdir(parents=True)
    (long_dir / ("g" * 250)).write_bytes(os.urandom(5000))
    for i in range(20):
        (layout.ws / f"s{i}").write_bytes(os.urandom(i * 300))
    # a large file and its hard link across many buffer swaps
    (layout.ws / "big").write_bytes(os.urandom(200_000))
    os.link(layout.ws / "big", layout.ws / "s5-big-link")
    (layout.ws / "big2").write_bytes(os.urandom(70_000))
    (layout.ws / "zlink").symlink_to("big2")
    with open_root(layout.ws) as ws:
        info = persist(ws, store, "s").info
        assert tree_digest(ws) == info.tree_digest  # the inline-hashing walk agrees
    with tarfile.open(tmp_path / "store" / info.archive) as tar:
        assert len(tar.getmembers()) == 28  # 3 directories, 23 files, a hard link, a symlink
    dst = tmp_path / "dst"
    dst.mkdir()
    with open_root(dst) as d:
        fds = _open_fds()
        hydrate(d, store, "s")
        assert _open_fds() == fds  # the CRC-32 thread and the archive fd are gone too
    assert _host_view(dst) == _host_view(layout.ws)


def test_interrupt_mid_persist_joins_the_writer_and_commits_nothing(layout, store, monkeypatch):
    """A KeyboardInterrupt in the walking thread: the writer thread is joined, no fd left, nothing committed."""
    import sandbox_fs.snapshot as snap

    (layout.ws / "keep").write_text("previous snapshot")
    with open_root(layout.ws) as ws:
        first = persist(ws, store, "s").info
    for i in range(40):
        (layout.ws / f"f{i:02d}").write_bytes(os.urandom(256 << 10))
    real = snap._walk.MemberOpener.open  # (opens, fstat-checks: the walk's one call per file)
    seen = []

    def interrupted(self, src, item, dfd, probe):
        seen.append(item.path)
        if len(seen) == 20:  # several buffers already handed to the writer thread
            raise KeyboardInterrupt
        return real(self, src, item, dfd, probe)

    monkeypatch.setattr(snap._walk.MemberOpener, "open", interrupted)
    with open_root(layout.ws) as ws:
        fds = _open_fds()
        with pytest.raises(KeyboardInterrupt):
            persist(ws, store, "s")
        assert _open_fds() == fds
    assert store.info("s") == first


def test_persist_leaves_fd_count_unchanged_on_success_and_on_a_refusal(layout, store):
    """The walk's directory fds, member fds and the writer thread are all released, whatever the outcome."""
    for d in ("a/b/c", "a/d", "e"):
        (layout.ws / d).mkdir(parents=True, exist_ok=True)
        (layout.ws / d / "f").write_bytes(os.urandom(3000))
    with open_root(layout.ws) as ws:
        fds = _open_fds()
        persist(ws, store, "s")
        assert _open_fds() == fds
        os.mkfifo(layout.ws / "a" / "b" / "fifo")  # refused midway through the walk
        with pytest.raises(UnrestorableEntryError):
            persist(ws, store, "s")
        assert _open_fds() == fds


def test_walk_holds_fds_by_depth_not_by_width(layout, store, monkeypatch):
    """A directory with many subdirectories does not hold one fd per subdirectory open at once."""
    import sandbox_fs.snapshot as snap

    for i in range(300):
        (layout.ws / "wide" / f"d{i:03d}").mkdir(parents=True)
    real = snap._walk._list_dir
    peak = []

    def counting(dfd):
        peak.append(_open_fds())
        return real(dfd)

    monkeypatch.setattr(snap._walk, "_list_dir", counting)
    with open_root(layout.ws) as ws:
        fds = _open_fds()
        persist(ws, store, "s")
    assert max(peak) - fds < 20


def test_directory_replaced_by_another_directory_after_listing_is_not_entered(layout, store, monkeypatch):
    """A directory renamed over a listed one (e.g. an extra path grant moved in) is refused, never walked."""
    (layout.ws / "d").mkdir()
    (layout.ws / "d" / "mine.txt").write_text("mine")
    (layout.ws / "other").mkdir()
    (layout.ws / "other" / "theirs.txt").write_text("not listed")

    def swap(names):
        if "d" in names and (layout.ws / "other").exists():
            os.rename(layout.ws / "d", layout.ws / "d.old")
            os.rename(layout.ws / "other", layout.ws / "d")
    _race_after_listing(monkeypatch, swap)
    with open_root(layout.ws) as ws:
        with pytest.raises(SnapshotSourceChangedError) as ei:
            persist(ws, store, "s")
    assert ei.value.retryable and ei.value.sandbox_path == "d" and store.info("s") is None


# ------------------------------------------------------- a member must match its header


@pytest.mark.parametrize("change", ["grow", "shrink", "grow_large", "grow_empty"])
def test_file_that_changes_size_while_persisted_is_refused_not_truncated(layout, store, monkeypatch, change):
    """The header's size comes from fstat; a file that then grows or shrinks is refused (retryable).

    ``grow_large`` spans several 1 MiB buffers, so the extra byte is detected by the
    read past the last full buffer, not by the small-file over-read.
    """
    import sandbox_fs.snapshot as snap

    size = {"grow_large": (3 << 20) + 512, "grow_empty": 0}.get(change, 1000)
    (layout.ws / "keep").write_text("previous snapshot")
    with open_root(layout.ws) as ws:
        first = persist(ws, store, "s").info
    (layout.ws / "victim").write_bytes(b"v" * size)
    real = snap._walk.MemberOpener.open  # (opens, fstat-checks: the walk's one call per file)
    raced = []

    def racing_stat(self, src, item, dfd, probe):
        got = real(self, src, item, dfd, probe)
        if item.path == "victim":  # after the header's size is taken, before the data is read
            raced.append(1)
            if change == "shrink":
                os.truncate(layout.ws / "victim", size // 2)
            else:
                with open(layout.ws / "victim", "ab") as fh:
                    fh.write(b"more")
        return got

    monkeypatch.setattr(snap._walk.MemberOpener, "open", racing_stat)
    with open_root(layout.ws) as ws:
        with pytest.raises(SnapshotSourceChangedError) as ei:
            persist(ws, store, "s")
    assert raced
    assert ei.value.retryable and ei.value.sandbox_path == "victim"
    assert ("shrank" if change == "shrink" else "grew") in str(ei.value)
    assert store.info("s") == first  # the previous snapshot stays current
    monkeypatch.setattr(snap._walk.MemberOpener, "open", real)
    with open_root(layout.ws) as ws:  # a retry succeeds and stores the file as it is now
        info = persist(ws, store, "s").info
    with tarfile.open(layout.base / "store" / info.archive) as tar:
        assert tar.extractfile("victim").read() == (layout.ws / "victim").read_bytes()


def test_file_replaced_by_another_file_between_listing_and_open_is_refused(layout, store, monkeypatch):
    """The opened fd must be the inode the listing's lstat saw (not just any regular file)."""
    (layout.ws / "victim").write_text("listed")

    def swap(names):
        (layout.ws / "other").write_text("swapped in")
        os.replace(layout.ws / "other", layout.ws / "victim")  # a new inode at the same name

    _race_after_listing(monkeypatch, swap)
    with open_root(layout.ws) as ws:
        with pytest.raises(SnapshotSourceChangedError) as ei:
            persist(ws, store, "s")
    assert ei.value.sandbox_path == "victim" and store.info("s") is None


def test_symlink_swapped_in_after_listing_is_never_read_even_for_large_files(layout, store, monkeypatch):
    """A multi-buffer file swapped for a symlink to a host secret: refused, secret never in the store."""
    (layout.ws / "big").write_bytes(os.urandom(3 << 20))

    def swap(names):
        os.unlink(layout.ws / "big")
        os.symlink(layout.outside / "secret.txt", layout.ws / "big")

    _race_after_listing(monkeypatch, swap)
    with open_root(layout.ws) as ws:
        with pytest.raises(SnapshotSourceChangedError):
            persist(ws, store, "s")
    for p in (layout.base / "store").iterdir():
        assert layout.secret.encode() not in p.read_bytes()


def test_archive_layout_matches_tarfile(layout, store):
    """Members, sizes, data and record padding are what tarfile itself writes and reads."""
    _fill(layout.ws)
    (layout.ws / "big").write_bytes(os.urandom((2 << 20) + 3))
    with open_root(layout.ws) as ws:
        info = persist(ws, store, "s").info
    path = layout.base / "store" / info.archive
    assert path.stat().st_size % tarfile.RECORDSIZE == 0 and path.stat().st_size == info.archive_bytes
    assert f"{zlib.crc32(path.read_bytes()):08x}" == info.archive_crc32
    with tarfile.open(path) as tar:
        for m in tar.getmembers():
            if m.isfile():
                assert tar.extractfile(m).read() == (layout.ws / m.name).read_bytes()
        assert "big" in tar.getnames() and tar.getmember("big").size == (2 << 20) + 3


# ------------------------------------------- hydrate: verify and stage first, then swap


def _live(top: Path) -> dict:
    """Every node under ``top`` with type, mode, size, mtime, nlink and content (the root's own mtime left out)."""
    return {k: v for k, v in host_tree(top).items() if k != "."}


def _staging_dirs(top: Path) -> list[str]:
    return [n for n in os.listdir(top) if n.startswith(".sfs-")]


def _previous_workspace(ws: Path) -> None:
    (ws / "work" / "deep").mkdir(parents=True)
    (ws / "work" / "deep" / "notes.txt").write_text("unsaved work\n")
    (ws / "work" / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(ws / "work" / "run.sh", 0o700)
    (ws / "lnk").symlink_to("work/run.sh")


@pytest.mark.parametrize("failure", ["refused_last_member", "limit_mid_restore", "interrupt", "mode_restore"])
def test_failed_restore_leaves_previous_workspace_intact(layout, store, tmp_path, monkeypatch, failure):
    """Any failure after verification leaves the previous contents exactly as they were (data loss, atomicity)."""
    import sandbox_fs.snapshot as snap

    _previous_workspace(layout.ws)
    before = _live(layout.ws)
    limits = None
    if failure == "refused_last_member":
        many = [("file", f"ok{i}", b"x" * 100) for i in range(20)] + [("file", "../outside/evil", b"pwn")]
        _forge(tmp_path / "store", "s", _malicious_tar(many))
    else:
        src = tmp_path / "src"
        (src / "d").mkdir(parents=True)
        for i in range(20):
            (src / "d" / f"f{i}").write_bytes(b"y" * 1000)
        os.chmod(src / "d" / "f0", 0o600)
        with open_root(src) as r:
            persist(r, store, "s")
        if failure == "limit_mid_restore":
            limits = SnapshotLimits(max_entries=10)
        elif failure == "interrupt":
            real = snap._hydrate.extract_stream

            def cancelled(*a, **kw):
                real(*a, **kw)
                raise KeyboardInterrupt  # a cancel/interrupt once everything was staged
            monkeypatch.setattr(snap._hydrate, "extract_stream", cancelled)
        else:
            def failing(*a, **kw):
                raise OSError(28, "No space left on device")
            # modes are set through fds (fchmod), by the extractor and when the staging moves
            monkeypatch.setattr(os, "fchmod", failing)
    with open_root(layout.ws) as ws:
        with pytest.raises(BaseException) as ei:
            hydrate(ws, store, "s", limits=limits)
    assert not isinstance(ei.value, AssertionError)
    assert _live(layout.ws) == before
    assert _staging_dirs(layout.ws) == []
    assert not (layout.outside / "evil").exists()


def test_successful_restore_replaces_contents_and_leaves_no_staging(layout, store, tmp_path):
    _fill(layout.ws)
    with open_root(layout.ws) as ws:
        rep = persist(ws, store, "s")
    expected = _host_view(layout.ws)
    dst = tmp_path / "dst"
    _previous_workspace(dst)
    (dst / "a").mkdir()  # same name as a snapshot directory: replaced, not merged
    (dst / "a" / "stale").write_text("stale")
    with open_root(dst) as r:
        hydrate(r, store, "s")
        assert tree_digest(r) == rep.info.tree_digest
    assert _staging_dirs(dst) == []
    assert _host_view(dst) == expected


def test_leftover_staging_dir_of_a_killed_hydrate_is_ignored_then_removed(layout, store, tmp_path):
    (layout.ws / "f").write_text("content")
    with open_root(layout.ws) as ws:
        clean = tree_digest(ws)
        ws.mkdir(".sfs-hydrate-0123456789abcdef", 0o700)
        ws.write_bytes(".sfs-hydrate-0123456789abcdef/half", b"half-restored")
        assert tree_digest(ws) == clean
        rep = persist(ws, store, "s")
        assert rep.info.tree_digest == clean
        with tarfile.open(tmp_path / "store" / rep.info.archive) as tar:
            assert tar.getnames() == ["f"]
        hydrate(ws, store, "s")
    assert sorted(os.listdir(layout.ws)) == ["f"]


def test_restore_keeps_mount_points_and_merges_into_their_parents(layout, store, tmp_path):
    """A kept mount point (and the directory holding it) stays; snapshot entries are merged around it."""
    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    (src / "a" / "b" / "f").write_text("from snapshot")
    (src / "top").write_text("t")
    os.chmod(src / "a", 0o750)
    with open_root(src) as r:
        persist(r, store, "s")
    (layout.ws / "a" / "m").mkdir(parents=True)
    (layout.ws / "a" / "m" / "mounted").write_text("keep me")
    (layout.ws / "a" / "old").write_text("gone")
    with open_root(layout.ws) as ws:
        hydrate(ws, store, "s", mount_points=["a/m"])
    assert (layout.ws / "a" / "m" / "mounted").read_text() == "keep me"
    assert (layout.ws / "a" / "b" / "f").read_text() == "from snapshot"
    assert not (layout.ws / "a" / "old").exists()
    assert stat.S_IMODE(os.stat(layout.ws / "a").st_mode) == 0o750
    assert sorted(os.listdir(layout.ws)) == ["a", "top"]


# ------------------------------------- hard links: only inodes whose every link is inside


def _archive_bytes(store_dir: Path) -> bytes:
    return b"".join(p.read_bytes() for p in store_dir.iterdir() if p.suffix == ".tar")


def test_hard_link_to_an_outside_file_is_never_archived(layout, store, tmp_path):
    """A workspace name hard-linked to an outside inode: its content never reaches the store."""
    (layout.ws / "ok.txt").write_text("fine")
    os.link(layout.outside / "secret.txt", layout.ws / "innocent")
    with open_root(layout.ws) as ws:
        with pytest.raises(UnrestorableEntryError) as ei:
            persist(ws, store, "s")
        assert ei.value.sandbox_path == "innocent" and "hard link" in str(ei.value)
        assert store.info("s") is None
        rep = persist(ws, store, "s", on_unrestorable="skip")
        assert [p for p, _ in rep.skipped] == ["innocent"]
        assert tree_digest(ws) == rep.info.tree_digest
    data = _archive_bytes(tmp_path / "store")
    assert layout.secret.encode() not in data and b"fine" in data
    with tarfile.open(tmp_path / "store" / rep.info.archive) as tar:
        assert tar.getnames() == ["ok.txt"]


def test_hard_links_inside_round_trip_and_a_partly_outside_group_is_refused(layout, store, tmp_path):
    (layout.ws / "a").mkdir()
    (layout.ws / "a" / "one").write_text("shared inside")
    os.link(layout.ws / "a" / "one", layout.ws / "two")
    os.link(layout.ws / "a" / "one", layout.ws / "three")
    (layout.ws / "mixed").write_text(layout.secret)
    os.link(layout.ws / "mixed", layout.ws / "a" / "mixed2")
    os.link(layout.ws / "mixed", layout.outside / "planted")  # a third link, outside
    with open_root(layout.ws) as ws:
        rep = persist(ws, store, "s", on_unrestorable="skip")
    assert sorted(p for p, _ in rep.skipped) == ["a/mixed2", "mixed"]
    assert layout.secret.encode() not in _archive_bytes(tmp_path / "store")
    dst = tmp_path / "dst"
    dst.mkdir()
    with open_root(dst) as r:
        hydrate(r, store, "s")
    ino = {os.stat(dst / p).st_ino for p in ("a/one", "two", "three")}
    assert len(ino) == 1 and os.stat(dst / "two").st_nlink == 3
    assert (dst / "three").read_text() == "shared inside"
    assert not (dst / "mixed").exists()


def test_hard_link_planted_after_the_listing_is_refused_as_changed(layout, store, monkeypatch, tmp_path):
    (layout.ws / "x").write_text("mine")
    os.link(layout.ws / "x", layout.ws / "y")

    def plant(names):
        if "x" in names:
            os.link(layout.ws / "x", layout.outside / "late")  # link count changes after listing
    _race_after_listing(monkeypatch, plant)
    with open_root(layout.ws) as ws:
        with pytest.raises(SnapshotSourceChangedError) as ei:
            persist(ws, store, "s")
    assert ei.value.retryable and store.info("s") is None


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(groups=st.lists(st.tuples(st.integers(1, 4), st.booleans()), min_size=1, max_size=6))
def test_property_hard_link_groups(groups, tmp_path_factory):
    """Groups of in-workspace links round-trip as one inode; a group with an outside link never reaches the store."""
    base = tmp_path_factory.mktemp("hl")
    ws, out, dst = base / "ws", base / "out", base / "dst"
    for d in (ws, out, dst):
        d.mkdir()
    (ws / "sub").mkdir()
    for g, (n, outside) in enumerate(groups):
        first = ws / f"g{g}_0"
        first.write_bytes(f"GROUP-{g}-{'OUT' if outside else 'IN'}-{os.urandom(4).hex()}".encode())
        for i in range(1, n):
            os.link(first, ws / ("sub" if i % 2 else ".") / f"g{g}_{i}")
        if outside:
            os.link(first, out / f"g{g}")
    s = LocalSnapshotStore(base / "store")
    with s, open_root(ws) as w, open_root(dst) as d:
        persist(w, s, "p", on_unrestorable="skip")
        hydrate(d, s, "p")
    data = _archive_bytes(base / "store")
    assert b"-OUT-" not in data
    for g, (n, outside) in enumerate(groups):
        names = [p for p in dst.rglob(f"g{g}_*")]
        if outside:
            assert names == []
        else:
            assert len(names) == n and len({p.stat().st_ino for p in names}) == 1
            assert names[0].stat().st_nlink == n


# ------------------------------------- robustness: PATH_MAX paths, a tree changing under the walk


def _deep_dir(ws: Path, total_bytes: int) -> str:
    fd = os.open(ws, os.O_RDONLY)
    parts = []
    try:
        while sum(len(p) + 1 for p in parts) < total_bytes:
            name = f"d{len(parts):02d}" + "x" * 247
            os.mkdir(name, dir_fd=fd)
            nfd = os.open(name, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = nfd
            parts.append(name)
        with open(os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "w") as f:
            f.write("deep")
        os.symlink("leaf", "leaflink", dir_fd=fd)
    finally:
        os.close(fd)
    return "/".join(parts)


def test_path_over_path_max_is_refused_or_skipped_like_other_unrestorable_entries(layout, store):
    """A process cannot block every snapshot with a > 4095-byte path: it is an unrestorable entry."""
    (layout.ws / "ok.txt").write_text("ok")
    _deep_dir(layout.ws, 5000)
    with open_root(layout.ws) as ws:
        with pytest.raises(UnrestorableEntryError) as ei:
            persist(ws, store, "s")
        assert ei.value.code == "snapshot_unrestorable_entry"
        rep = persist(ws, store, "s", on_unrestorable="skip")
        assert tree_digest(ws) == rep.info.tree_digest
    assert len(rep.skipped) == 1 and "max_path_bytes" in rep.skipped[0][1]
    assert len(rep.skipped[0][0].encode()) > 4095
    assert rep.info.entries >= 2  # ok.txt and the directories up to the limit


def test_symlink_swapped_back_to_a_dir_is_retryable(layout, store, monkeypatch):
    """readlink EINVAL on a name listed as a symlink: the tree changed, retry (never os_error)."""
    (layout.ws / "d").mkdir()
    (layout.ws / "s").symlink_to("d")

    def swap(names):
        if "s" in names:
            os.unlink(layout.ws / "s")
            os.mkdir(layout.ws / "s")
    _race_after_listing(monkeypatch, swap)
    with open_root(layout.ws) as ws:
        with pytest.raises(SnapshotSourceChangedError) as ei:
            persist(ws, store, "s", on_unrestorable="skip")
    assert ei.value.retryable


@pytest.mark.parametrize("when", ["before_entering", "after_entering"])
def test_parent_swapped_for_outside_symlink_mid_walk_is_never_followed(layout, store, monkeypatch, tmp_path, when):
    """A parent swapped for a symlink to outside: never followed, nothing outside read.

    Swapped after its listing but before the walk enters it, or after the
    walk entered it: every entry is opened by its path beneath the
    workspace Root with no symlink allowed on the path, so the swapped
    parent is refused either way (retryable), never followed, and the
    walk's held fd of the old directory (now ``d.away``) is not trusted.
    """
    (layout.ws / "d" / "subdir").mkdir(parents=True)
    (layout.ws / "d" / "subdir" / "inner.txt").write_text("mine")
    trigger = "d" if when == "before_entering" else "inner.txt"

    def swap(names):
        if trigger in names and not (layout.ws / "d.away").exists():
            os.rename(layout.ws / "d", layout.ws / "d.away")
            os.symlink(layout.outside, layout.ws / "d")
    _race_after_listing(monkeypatch, swap)
    with open_root(layout.ws) as ws:
        with pytest.raises(SnapshotSourceChangedError) as ei:
            persist(ws, store, "s", on_unrestorable="skip")
        assert ei.value.retryable and store.info("s") is None
    assert layout.secret.encode() not in _archive_bytes(tmp_path / "store")


class _InterruptAfter(io.RawIOBase):
    """A reader that raises KeyboardInterrupt once ``limit`` bytes were read (an interrupt mid-extraction)."""

    def __init__(self, f, limit: int) -> None:
        self.f, self.left = f, limit

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        if self.left <= 0:
            raise KeyboardInterrupt
        n = self.f.readinto(memoryview(b)[:self.left])
        self.left -= n
        return n


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 50_000))
def test_property_interrupt_anywhere_in_restore_keeps_previous_workspace(cut, tmp_path_factory):
    """Wherever an interrupt lands while the snapshot is extracted, the previous workspace is untouched."""
    import sandbox_fs.snapshot as snap

    base = tmp_path_factory.mktemp("cut")
    src, ws = base / "src", base / "ws"
    (src / "d" / "e").mkdir(parents=True)
    for i in range(12):
        (src / "d" / f"f{i}").write_bytes(bytes([i]) * 2500)
    (src / "d" / "e" / "link").symlink_to("../f1")
    _previous_workspace(ws)
    before = _live(ws)
    real = snap._hydrate.extract_stream
    s = LocalSnapshotStore(base / "store")
    with s, open_root(src) as r, open_root(ws) as w:
        persist(r, s, "s")
        snap._hydrate.extract_stream = lambda *, source, **kw: real(source=_InterruptAfter(source, cut), **kw)
        try:
            hydrate(w, s, "s")
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
        finally:
            snap._hydrate.extract_stream = real
    assert _staging_dirs(ws) == []
    if interrupted:
        assert _live(ws) == before
    else:
        assert sorted(os.listdir(ws)) == ["d"]


# ------------------------------------------- a held directory is never trusted (issue 5)


def _store_bytes(store_dir: Path) -> bytes:
    """Every byte of every file in the store (archives, metadata, partials)."""
    return b"".join(p.read_bytes() for p in store_dir.iterdir() if p.is_file())


def _move_out_and_plant(src: Path, dst: Path, secret: str) -> None:
    """The racing process: move ``src`` out of the workspace, then write outside content into it."""
    os.rename(src, dst)
    (dst / "AAA-SECRET").write_text(secret)  # sorts first: the walk meets it before the listed files
    (dst / "zzz-SECRET").write_text(secret)
    (dst / "secret-dir").mkdir()
    (dst / "secret-dir" / "f").write_text(secret)
    (dst / "secret-link").symlink_to("zzz-SECRET")
    os.link(dst / "zzz-SECRET", dst / "zzz-SECRET-2")


@pytest.mark.parametrize("op", ["persist", "tree_digest"])
@pytest.mark.parametrize("when", ["before_listing", "after_listing"])
def test_directory_moved_out_while_the_walk_holds_it_contributes_nothing(layout, store, tmp_path, monkeypatch,
                                                                        resolver, op, when):
    """Review PoC poc_persist_moved_dir: a held directory renamed out of the workspace, a secret written in.

    The walk holds ``d``'s fd; right before (or right after) it lists it, ``d``
    is moved to the outside and outside content appears in it.  Every entry
    is opened by its path beneath the workspace Root and identity-checked,
    so nothing of it is read: the retryable SnapshotSourceChangedError, the
    previous snapshot stays current, and the outside bytes never reach the
    store.
    """
    import sandbox_fs.snapshot as snap

    (layout.ws / "d" / "sub").mkdir(parents=True)
    (layout.ws / "d" / "ok.txt").write_text("ws content\n")
    (layout.ws / "d" / "sub" / "inner.txt").write_text("ws inner\n")
    (layout.ws / "top.txt").write_text("top\n")
    with open_root(layout.ws) as ws:
        first = persist(ws, store, "s").info
    d_id = (os.stat(layout.ws / "d").st_dev, os.stat(layout.ws / "d").st_ino)
    real = snap._walk._list_dir
    moved = []

    def racing(dfd):
        st_ = os.fstat(dfd)
        hit = (st_.st_dev, st_.st_ino) == d_id and not moved
        if hit and when == "before_listing":
            _move_out_and_plant(layout.ws / "d", layout.outside / "d", layout.secret)
            moved.append(1)
        out = real(dfd)
        if hit and when == "after_listing":
            _move_out_and_plant(layout.ws / "d", layout.outside / "d", layout.secret)
            moved.append(1)
        return out

    monkeypatch.setattr(snap._walk, "_list_dir", racing)
    with open_root(layout.ws) as ws:
        fds = _open_fds()
        with pytest.raises(SnapshotSourceChangedError) as ei:
            if op == "persist":
                persist(ws, store, "s")
            else:
                tree_digest(ws)
        assert _open_fds() == fds
    assert moved == [1] and ei.value.retryable
    assert ei.value.sandbox_path.startswith("d/")
    assert store.info("s") == first
    assert layout.secret.encode() not in _store_bytes(tmp_path / "store")


def test_subdirectory_and_symlink_of_a_moved_directory_are_never_entered_or_read(layout, store, tmp_path,
                                                                                monkeypatch):
    """Only a subdirectory and a symlink left in the listing of a moved directory: neither is used."""
    import sandbox_fs.snapshot as snap

    (layout.ws / "d" / "sub").mkdir(parents=True)
    (layout.ws / "d" / "sub" / "f").write_text("mine")
    (layout.ws / "d" / "lnk").symlink_to("sub/f")
    d_ino = os.stat(layout.ws / "d").st_ino
    real = snap._walk._list_dir

    def racing(dfd):
        out = real(dfd)
        if os.fstat(dfd).st_ino == d_ino and (layout.ws / "d").exists():
            os.rename(layout.ws / "d", layout.outside / "d")
            (layout.outside / "d" / "sub" / "f").write_text(layout.secret)
            os.unlink(layout.outside / "d" / "lnk")
            os.symlink(layout.secret, layout.outside / "d" / "lnk")  # a target text is content too
        return out

    monkeypatch.setattr(snap._walk, "_list_dir", racing)
    with open_root(layout.ws) as ws:
        with pytest.raises(SnapshotSourceChangedError):
            persist(ws, store, "s", on_unrestorable="skip")
    assert store.info("s") is None
    assert layout.secret.encode() not in _store_bytes(tmp_path / "store")


def _tree_strategy():
    """Directory paths (nested up to depth 3) and a file count for each."""
    name = st.sampled_from(["a", "b", "c"])
    return st.lists(st.lists(name, min_size=1, max_size=3).map("/".join), min_size=1, max_size=6, unique=True)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dirs=_tree_strategy(), at=st.integers(0, 50), pick=st.integers(0, 50),
       which=st.sampled_from(["listed", "ancestor", "any"]),
       when=st.sampled_from(["before_listing", "after_listing"]), op=st.sampled_from(["persist", "tree_digest"]))
def test_property_a_directory_moved_out_at_any_point_of_the_walk_leaks_nothing(dirs, at, pick, which, when, op,
                                                                               tmp_path_factory):
    """Whatever directory is moved out of the workspace, at whatever listing of the walk, before or
    after it: persist and tree_digest raise the retryable error or finish without a single outside
    entry (no name, no content, no link target of what was planted outside) in what they digest,
    and the outside bytes never reach the store.  (A digest of a tree that changed mid-walk need not
    match either state of it; only outside content is ruled out.)"""
    import hashlib

    import sandbox_fs.snapshot as snap

    base = tmp_path_factory.mktemp("moved")
    ws_p, out_p = base / "ws", base / "outside"
    out_p.mkdir()
    secret = "OUTSIDE-" + os.urandom(8).hex()
    for d in dirs:
        (ws_p / d).mkdir(parents=True, exist_ok=True)
    for i, d in enumerate(sorted({str(p.relative_to(ws_p)) for p in ws_p.rglob("*")})):
        (ws_p / d / f"f{i}").write_text(f"ws file {i}\n")
    listings = 1 + sum(1 for p in ws_p.rglob("*") if p.is_dir())
    at %= listings  # the walk lists every directory once: the move lands at one of them
    real, real_add = snap._walk._list_dir, snap._entries._Digest.add
    calls = []
    records = []

    def racing(dfd):
        calls.append(1)
        hit = len(calls) == at + 1
        if hit and when == "before_listing":
            _move_random(ws_p, out_p, pick, secret, which, os.fstat(dfd))
        out = real(dfd)
        if hit and when == "after_listing":
            _move_random(ws_p, out_p, pick, secret, which, os.fstat(dfd))
        return out

    def recording(self, path, kind, size, mode, content):
        records.append((path, content))
        return real_add(self, path, kind, size, mode, content)

    s = LocalSnapshotStore(base / "store")
    snap._walk._list_dir, snap._entries._Digest.add = racing, recording
    try:
        with s, open_root(ws_p) as ws:
            try:
                if op == "persist":
                    info = persist(ws, s, "s").info
                    with tarfile.open(base / "store" / info.archive) as tar:
                        assert not any("SECRET" in m.name for m in tar.getmembers())
                else:
                    tree_digest(ws)
            except SnapshotSourceChangedError as exc:
                assert exc.retryable
    finally:
        snap._walk._list_dir, snap._entries._Digest.add = real, real_add
    assert len(calls) > at  # the move did happen
    outside = {hashlib.sha256(secret.encode()).hexdigest(), "zzz-SECRET"}
    assert not [r for r in records if "SECRET" in r[0] or r[1] in outside]
    assert secret.encode() not in _store_bytes(base / "store")


def _move_random(ws_p: Path, out_p: Path, pick: int, secret: str, which: str, listed: os.stat_result) -> None:
    """Move a directory of the workspace out: the one being listed, one of its ancestors, or any."""
    present = sorted(str(p.relative_to(ws_p)) for p in ws_p.rglob("*") if p.is_dir() and not p.is_symlink())
    if not present:
        return
    victim = present[pick % len(present)]
    here = [d for d in present if os.stat(ws_p / d).st_ino == listed.st_ino]
    if here and which != "any":
        parts = here[0].split("/")
        victim = here[0] if which == "listed" else "/".join(parts[:1 + pick % len(parts)])
    _move_out_and_plant(ws_p / victim, out_p / f"moved{len(list(out_p.iterdir()))}", secret)


# ------------------------------------------- reads bounded by the validated size (issue 5)


def _grown_archive_reads(monkeypatch) -> list[int]:
    """Record the byte count of every CRC-32 pass over an archive."""
    import sandbox_fs.snapshot as snap

    totals: list[int] = []
    real = snap._store._archive_crc

    def recording(fd, limit, stop=None):
        res = real(fd, limit, stop)
        totals.append(res[0])
        return res

    monkeypatch.setattr(snap._store, "_archive_crc", recording)
    return totals


@pytest.mark.parametrize("grow_bytes", [1, 256 << 20])
def test_archive_grown_after_the_size_check_fails_fast_and_leaves_the_workspace(layout, store, tmp_path,
                                                                               monkeypatch, grow_bytes):
    """Review PoC poc_crc_unbounded: the store file grows (sparse) right after hydrate checked its size.

    The concurrent CRC-32 reads the recorded size and one byte more, never
    to the file's current end: the extra byte is a size mismatch
    (SnapshotCorruptError), the workspace is as before, no staging is left.
    """
    import sandbox_fs.snapshot as snap

    (layout.ws / "f").write_bytes(os.urandom(200_000))
    with open_root(layout.ws) as ws:
        info = persist(ws, store, "s").info
    arch = tmp_path / "store" / info.archive
    totals = _grown_archive_reads(monkeypatch)

    class GrowingCheck(snap._hydrate._CrcCheck):
        def __init__(self, fd, limit):
            os.truncate(arch, info.archive_bytes + grow_bytes)  # the racing writer, after the size check
            super().__init__(fd, limit)

    monkeypatch.setattr(snap._hydrate, "_CrcCheck", GrowingCheck)
    dst = tmp_path / "dst"
    dst.mkdir()
    _previous_workspace(dst)
    before = _live(dst)
    with open_root(dst) as d:
        fds = _open_fds()
        with pytest.raises(SnapshotCorruptError):
            hydrate(d, store, "s")
        assert _open_fds() == fds
    assert totals == [info.archive_bytes + 1]
    assert _live(dst) == before and _staging_dirs(dst) == []


def test_open_archive_verification_is_bounded_by_the_recorded_size(store, layout, tmp_path, monkeypatch):
    """open_archive's own CRC-32 pass: same bound, same refusal, for a file grown after its size check."""
    (layout.ws / "f").write_bytes(b"x" * 5000)
    with open_root(layout.ws) as ws:
        info = persist(ws, store, "s").info
    arch = tmp_path / "store" / info.archive
    totals = _grown_archive_reads(monkeypatch)
    real = store.open_archive_unverified

    def growing(name, limits):
        res = real(name, limits)
        os.truncate(arch, info.archive_bytes + (256 << 20))
        return res

    monkeypatch.setattr(store, "open_archive_unverified", growing)
    fds = _open_fds()
    with pytest.raises(SnapshotCorruptError):
        store.open_archive("s", SnapshotLimits())
    assert _open_fds() == fds and totals == [info.archive_bytes + 1]


# The extractor applies mtimes only within +-2**62 ns of the epoch; a file dated past that was
# persisted with its mtime and hydrated with the time of the restore (found by the stateful suite).
_MTIME_EDGE_S = (1 << 62) // 10**9  # 4611686018: the last whole second hydrate applies


@pytest.mark.parametrize("kind", ["file", "dir", "symlink"])
@pytest.mark.parametrize("secs", [_MTIME_EDGE_S + 1, -_MTIME_EDGE_S - 1])
def test_an_mtime_hydrate_would_not_restore_is_unrestorable_at_persist(layout, store, kind, secs):
    (layout.ws / "ok.txt").write_text("ok")
    entry = layout.ws / "far"
    if kind == "file":
        entry.write_text("x")
    elif kind == "dir":
        entry.mkdir()
    else:
        entry.symlink_to("ok.txt")
    os.utime(entry, ns=(0, secs * 10**9), follow_symlinks=False)
    if -(1 << 62) < os.lstat(entry).st_mtime_ns < (1 << 62):
        pytest.skip("this file system clamps the mtime into the range hydrate restores")
    with open_root(layout.ws) as ws:
        with pytest.raises(UnrestorableEntryError) as ei:
            persist(ws, store, "s1")
        assert ei.value.sandbox_path == "far" and "mtime" in str(ei.value)
        assert store.info("s1") is None
        rep = persist(ws, store, "s1", on_unrestorable="skip")
        assert [p for p, _why in rep.skipped] == ["far"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(secs=st.one_of(st.integers(-(1 << 40), 1 << 40),
                      st.integers(_MTIME_EDGE_S - 3, _MTIME_EDGE_S + 3),
                      st.integers(-_MTIME_EDGE_S - 3, -_MTIME_EDGE_S + 3)))
def test_property_persist_refuses_or_hydrate_restores_the_mtime(tmp_path_factory, secs):
    """Property: for any whole-second mtime the kernel takes, persist either refuses the entry or
    hydrate restores exactly that mtime (never the time of the restore)."""
    base = tmp_path_factory.mktemp("mt")
    ws, dst = base / "ws", base / "dst"
    ws.mkdir()
    dst.mkdir()
    (ws / "f").write_text("x")
    try:
        os.utime(ws / "f", ns=(0, secs * 10**9))
    except (OverflowError, OSError):
        return  # not a time this kernel and file system take
    recorded = os.stat(ws / "f").st_mtime_ns
    with LocalSnapshotStore(base / "store") as s, open_root(ws) as w:
        try:
            persist(w, s, "s")
        except UnrestorableEntryError:
            assert not -(1 << 62) < recorded < (1 << 62)
            return
        with open_root(dst) as d:
            hydrate(d, s, "s")
    assert os.stat(dst / "f").st_mtime_ns == recorded
