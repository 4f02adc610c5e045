"""Batched new files: an uncompressed tar read from a regular file (a host path) in atomic mode.

New plain file members are queued and made by one native call per batch in a
helper thread (see ``sandbox_fs.archive._writer``).  These tests check that a
file source gives exactly what a stream source (one by one, no batching) gives,
and the ordering rules: hard links and repeated names after queued files, errors
in archive order, truncated data, cancellation with a batch in flight, no fd or
thread left behind.
"""

from __future__ import annotations

import errno
import io
import os
import shutil
import stat
import tarfile
import threading

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_archive_builders import cancel_once_started, tar_bytes, ti

from sandbox_fs import SandboxError, open_root
from sandbox_fs.archive import (ArchiveFormatError, ArchiveLimitError, ArchiveLimits, ExtractPolicy,
                                UnsafeArchiveMemberError, extract)
from sandbox_fs.archive import _batch, _writer

_THREAD = "sandbox-fs-extract-copy"


def _nfds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _copy_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == _THREAD)


def _tree(top) -> dict[str, tuple]:
    """Every entry under ``top``: type, permission bits, file mtime, content or link target
    (not directory mtimes: a directory made for a member's parent gets the current time)."""
    out: dict[str, tuple] = {}
    for dirpath, dirs, files in os.walk(top):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            st_ = os.lstat(p)
            rel = os.path.relpath(p, top)
            if stat.S_ISLNK(st_.st_mode):
                out[rel] = ("l", os.readlink(p))
            elif stat.S_ISDIR(st_.st_mode):
                out[rel] = ("d", stat.S_IMODE(st_.st_mode))
            else:
                with open(p, "rb") as fh:
                    out[rel] = ("f", stat.S_IMODE(st_.st_mode), st_.st_mtime_ns, st_.st_nlink, fh.read())
    return out


def _write(tmp_path, data: bytes, name: str = "a.tar"):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def _many(n: int, size: int = 100, prefix: str = "d") -> list:
    return [ti(f"{prefix}{i % 7}/f{i:05d}", data=bytes([i % 251]) * (size + i % 600)) for i in range(n)]


def test_file_source_is_batched_and_matches_stream(layout, tmp_path, monkeypatch):
    members = [ti("top", "dir")] + _many(300) + [ti("top/a", data=b"A" * 513), ti("l", "symlink", linkname="top/a"),
                                                 ti("h", "hardlink", linkname="top/a")]
    data = tar_bytes(members, fmt=tarfile.GNU_FORMAT)
    calls = []
    real = _writer._native.extract_files
    monkeypatch.setattr(_writer._native, "extract_files", lambda *a: calls.append(a[5]) or real(*a))
    with open_root(layout.ws) as root:
        rep_file = extract(root, "from_file", _write(tmp_path, data))
        assert calls and sum(calls) == 301 and max(calls) <= _batch.BATCH_FILES
        calls.clear()
        rep_stream = extract(root, "from_stream", io.BytesIO(data))
        assert calls == []  # a stream source is never batched
    assert rep_file == rep_stream
    assert _tree(layout.ws / "from_file") == _tree(layout.ws / "from_stream")
    assert os.stat(layout.ws / "from_file/h").st_ino == os.stat(layout.ws / "from_file/top/a").st_ino


def test_hard_link_to_a_queued_file(layout, tmp_path):
    data = tar_bytes([ti("d/a", data=b"payload"), ti("d/b", "hardlink", linkname="d/a"),
                      ti("c", "hardlink", linkname="d/a")])
    with open_root(layout.ws) as root:
        rep = extract(root, "dest", _write(tmp_path, data))
    assert rep.files == 1 and rep.hardlinks == 2
    st_a = os.stat(layout.ws / "dest/d/a")
    assert st_a.st_nlink == 3 and os.stat(layout.ws / "dest/c").st_ino == st_a.st_ino
    assert (layout.ws / "dest/d/b").read_bytes() == b"payload"


def test_repeated_name_after_a_queued_file(layout, tmp_path):
    data = tar_bytes([ti("d/a", data=b"first"), ti("d/x", data=b"x"), ti("d/a", data=b"second", mode=0o755)])
    with open_root(layout.ws) as root:
        rep = extract(root, "dest", _write(tmp_path, data))
    assert rep.files == 3
    assert (layout.ws / "dest/d/a").read_bytes() == b"second"
    assert stat.S_IMODE(os.stat(layout.ws / "dest/d/a").st_mode) == 0o755


def test_directory_over_a_queued_file_is_a_conflict(layout, tmp_path):
    data = tar_bytes([ti("a", data=b"1"), ti("a", "dir")])
    with open_root(layout.ws) as root, pytest.raises(UnsafeArchiveMemberError) as ei:
        extract(root, "dest", _write(tmp_path, data))
    assert ei.value.rule == "conflict"
    assert os.listdir(layout.ws) == []


@pytest.mark.parametrize("cut", ["data", "padding"])
def test_truncated_last_member(layout, tmp_path, cut):
    data = tar_bytes(_many(100) + [ti("last", data=b"z" * 1000)], fmt=tarfile.GNU_FORMAT)
    end = data.rindex(b"z" * 1000) + 1000  # end of the last member's data
    data = data[:end - 10] if cut == "data" else data[:end + 3]
    base = _nfds()
    with open_root(layout.ws) as root:
        with pytest.raises(ArchiveFormatError) as ei:
            extract(root, "dest", _write(tmp_path, data))
        with pytest.raises(ArchiveFormatError) as ei_stream:  # the stream path refuses it the same way
            extract(root, "dest", io.BytesIO(data))
    assert str(ei.value) == str(ei_stream.value)
    if cut == "data":
        assert "unexpected end of data" in str(ei.value)
    assert ei.value.member == "last"
    assert os.listdir(layout.ws) == []
    assert _nfds() == base


def test_limits_are_checked_before_queued_files_are_made(layout, tmp_path):
    data = tar_bytes(_many(50, size=1000))
    total = sum(1000 + i % 600 for i in range(50))
    with open_root(layout.ws) as root:
        with pytest.raises(ArchiveLimitError) as ei:
            extract(root, "dest", _write(tmp_path, data), limits=ArchiveLimits(max_total_bytes=total - 1))
        assert ei.value.limit == "max_total_bytes"
        with pytest.raises(ArchiveLimitError) as ei:
            extract(root, "dest", _write(tmp_path, data), limits=ArchiveLimits(max_input_bytes=len(data) // 2))
        assert ei.value.limit == "max_input_bytes"
        rep = extract(root, "dest", _write(tmp_path, data), limits=ArchiveLimits(max_total_bytes=total))
        rep_stream = extract(root, "dest2", io.BytesIO(data), limits=ArchiveLimits(max_total_bytes=total))
    assert rep.bytes_written == total and rep == rep_stream
    shutil.rmtree(layout.ws / "dest2")
    assert sorted(os.listdir(layout.ws)) == ["dest"]


def test_batch_error_is_raised_with_the_member_and_nothing_remains(layout, tmp_path, monkeypatch):
    def full(src_fd, stage_fd, resolver, nums, names, n, owner=None):
        return 3, errno.ENOSPC, _writer._native.XF_STAGE_COPY

    monkeypatch.setattr(_writer._native, "extract_files", full)
    data = tar_bytes(_many(10))
    base = _nfds()
    with open_root(layout.ws) as root, pytest.raises(OSError) as ei:
        extract(root, "dest", _write(tmp_path, data))
    assert ei.value.errno == errno.ENOSPC
    assert str(tmp_path) not in str(ei.value)  # sandbox paths only
    assert os.listdir(layout.ws) == []
    assert _nfds() == base


def test_earlier_batch_error_wins_over_a_later_member_error(layout, tmp_path, monkeypatch):
    def full(src_fd, stage_fd, resolver, nums, names, n, owner=None):
        return 0, errno.ENOSPC, _writer._native.XF_STAGE_COPY

    monkeypatch.setattr(_writer._native, "extract_files", full)
    data = tar_bytes([ti("ok", data=b"1"), ti("../evil", data=b"2")])
    with open_root(layout.ws) as root, pytest.raises(OSError) as ei:
        extract(root, "dest", _write(tmp_path, data))
    assert ei.value.errno == errno.ENOSPC  # "ok" comes first in the archive, as one by one
    assert os.listdir(layout.ws) == []


def race_first_queued_name(monkeypatch) -> None:
    """Make every batch find its first queued name already made in staging ("raced") when it runs."""
    real_run = _batch.FileBatch.run

    def run(self, src_fd):
        assert self.n
        name = bytes(self.names).split(b"\0")[0]  # a path relative to the staging directory
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=self.stage_fd)
        os.write(fd, b"raced")
        os.close(fd)
        real_run(self, src_fd)

    monkeypatch.setattr(_batch.FileBatch, "run", run)


def test_name_appearing_in_staging_is_replaced_like_one_by_one(layout, tmp_path, monkeypatch):
    """A queued name that exists when the batch runs (a racing process, a case-folding filesystem)
    is replaced atomically, as the one-by-one path does; the rest of the batch is still made."""
    race_first_queued_name(monkeypatch)
    data = tar_bytes([ti("d/a", data=b"archive"), ti("d/b", data=b"bbb"), ti("d/c", data=b"ccc")])
    with open_root(layout.ws) as root:
        rep = extract(root, "dest", _write(tmp_path, data))
    assert rep.files == 3
    assert {n: (layout.ws / "dest/d" / n).read_bytes() for n in "abc"} == {"a": b"archive", "b": b"bbb", "c": b"ccc"}
    assert not [n for n in os.listdir(layout.ws / "dest/d") if n.startswith(".sfs")]


@pytest.mark.parametrize("fail", [False, True])
def test_no_fd_or_thread_left(layout, tmp_path, fail):
    members = _many(500) + ([ti("x/../../evil", data=b"!")] if fail else [])
    path = _write(tmp_path, tar_bytes(members))
    with open_root(layout.ws) as root:
        extract(root, "warm", io.BytesIO(tar_bytes([ti("a", data=b"1")])))
        base, threads = _nfds(), _copy_threads()
        for i in range(3):
            try:
                extract(root, f"dest{i}", path)
            except SandboxError:
                assert fail
        assert _nfds() == base and _copy_threads() == threads == 0
    assert sorted(os.listdir(layout.ws)) == (["warm"] if fail else ["dest0", "dest1", "dest2", "warm"])


def test_cpu_limit_runs_batches_in_the_calling_thread(layout, tmp_path, monkeypatch):
    seen = set()
    real_run = _batch.FileBatch.run

    def run(self, src_fd):
        seen.add(threading.get_ident())
        real_run(self, src_fd)

    monkeypatch.setattr(_batch.FileBatch, "run", run)
    data = tar_bytes(_many(200))
    with open_root(layout.ws) as root:
        extract(root, "dest", _write(tmp_path, data), limits=ArchiveLimits(max_cpu_seconds=60))
    assert seen == {threading.get_ident()}
    with open_root(layout.ws) as root:
        extract(root, "dest2", io.BytesIO(data))
    assert _tree(layout.ws / "dest") == _tree(layout.ws / "dest2")


async def test_cancel_with_a_batch_in_flight(layout, tmp_path, monkeypatch):
    started = threading.Event()
    real_run = _batch.FileBatch.run

    def slow_run(self, src_fd):
        started.set()
        threading.Event().wait(0.05)
        real_run(self, src_fd)

    monkeypatch.setattr(_batch.FileBatch, "run", slow_run)
    path = _write(tmp_path, tar_bytes(_many(3000, size=10)))
    with open_root(layout.ws) as root:
        await cancel_once_started(root, path, started, timeout=30, settle=0.02)
    assert os.listdir(layout.ws) == []
    assert _copy_threads() == 0


# --- property: a file source (batched) and a stream source (one by one) agree ---------------

_NAMES = st.lists(st.sampled_from(["a", "b", "c", ".", "..", "", "x" * 260]), min_size=1, max_size=3).map("/".join)
_SIZES = st.sampled_from([0, 1, 511, 512, 513, 5000])
_MEMBER = st.tuples(st.sampled_from(["file", "file", "file", "dir", "symlink", "hardlink"]), _NAMES, _NAMES, _SIZES,
                    st.integers(0, 0o7777))


def _outcome(layout, dest, source):
    try:
        with open_root(layout.ws) as root:
            rep = extract(root, dest, source, limits=ArchiveLimits(max_depth=4),
                          policy=ExtractPolicy(special_files="skip"))
    except SandboxError as exc:
        return ("error", type(exc).__name__, getattr(exc, "rule", None), getattr(exc, "limit", None),
                os.listdir(layout.ws / dest) if (layout.ws / dest).is_dir() else None)
    return ("ok", rep, _tree(layout.ws / dest))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(members=st.lists(_MEMBER, min_size=1, max_size=10), existing=st.booleans())
def test_file_and_stream_sources_agree(layout, tmp_path, members, existing):
    out = []
    for i, (kind, name, target, size, mode) in enumerate(members):
        if kind == "file":
            out.append(ti(name, data=bytes([65 + i]) * size, mode=mode, mtime=1_600_000_000 + i))
        elif kind == "dir":
            out.append(ti(name, "dir", mode=mode))
        else:
            out.append(ti(name, kind, linkname=target))
    data = tar_bytes(out, fmt=tarfile.GNU_FORMAT)
    path = _write(tmp_path, data, "p.tar")
    results = []
    for source in (io.BytesIO(data), path):
        for name in os.listdir(layout.ws):
            shutil.rmtree(layout.ws / name)
        if existing:
            (layout.ws / "dest").mkdir()
            (layout.ws / "dest" / "keep").write_bytes(b"k")
            os.utime(layout.ws / "dest" / "keep", ns=(1, 1))
        results.append(_outcome(layout, "dest", source))
    assert results[0] == results[1]


# --- directories in the staging tree: mkdir relative to the kept parent fd ---------------------

def test_staged_mkdir_never_follows_a_planted_symlink(layout):
    from sandbox_fs.archive._models import ArchiveLimits as Limits
    from sandbox_fs.archive._streams import Meter

    before = layout.snapshot()
    with open_root(layout.ws) as root:
        ex = _writer.Extractor(root, "dest", Limits(), ExtractPolicy(), Meter(Limits()))
        try:
            staging = layout.ws / ex._staging
            os.symlink(str(layout.outside), staging / "d")  # a racing process plants a link
            (staging / "e").mkdir()                            # ... and a directory
            with pytest.raises(UnsafeArchiveMemberError) as ei:
                ex.add_dir("d", 0o755, None)
            assert ei.value.rule == "conflict"
            with pytest.raises(UnsafeArchiveMemberError) as ei:
                ex.add_dir("d/sub", 0o755, None)
            assert ei.value.rule == "conflict"
            ex.add_dir("e", 0o755, None)  # an existing directory is fine (exist_ok)
            ex.add_dir("e/f/g", 0o755, None)
            assert (staging / "e/f/g").is_dir()
            layout.assert_outside_unchanged(before)
        finally:
            ex.abort()
            ex.close()
    assert os.listdir(layout.ws) == []


def test_staged_directories_get_exact_modes_whatever_the_umask(layout):
    data = tar_bytes([ti("a/b/c/f", data=b"1"), ti("a/b/d", "dir", mode=0o750)])
    old = os.umask(0o077)
    try:
        with open_root(layout.ws) as root:
            extract(root, "dest", io.BytesIO(data))
    finally:
        os.umask(old)
    modes = {p: stat.S_IMODE(os.stat(layout.ws / "dest" / p).st_mode) for p in ("a", "a/b", "a/b/c", "a/b/d")}
    assert modes == {"a": 0o755, "a/b": 0o755, "a/b/c": 0o755, "a/b/d": 0o750}


def test_caller_fileio_at_an_offset_is_batched_correctly(layout, tmp_path):
    data = tar_bytes(_many(100) + [ti("d0/last", data=b"L" * 700)])
    p = tmp_path / "prefixed.bin"
    p.write_bytes(b"J" * 1000 + data)
    with open(p, "rb", buffering=0) as fh, open_root(layout.ws) as root:
        assert fh.read(1000) == b"J" * 1000
        rep = extract(root, "from_fileio", fh)
        rep_stream = extract(root, "from_stream", io.BytesIO(data))
    assert rep == rep_stream
    assert _tree(layout.ws / "from_fileio") == _tree(layout.ws / "from_stream")


# --- header numbers are never trusted to be non-negative (review 8, finding 1) -----------------

def _set_size_field(block: bytearray, size: int) -> None:
    """Write ``size`` into a header block's size field (octal, or GNU base-256 when it does not fit
    or is negative: tarfile decodes a 0xff-prefixed field as a negative number) and fix the checksum."""
    if 0 <= size < 8 ** 11:
        block[124:136] = b"%011o\0" % size
    else:
        block[124:136] = (b"\xff" if size < 0 else b"\x80") + (size % (1 << 88)).to_bytes(11, "big")
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block[:512])


def _gnu_member(name: str, data: bytes = b"", *, size_field: int | None = None, kind: bytes = tarfile.REGTYPE,
                linkname: str = "", mode: int = 0o644) -> bytes:
    """One GNU-format member (header blocks, data, padding); ``size_field`` overrides the declared size."""
    info = tarfile.TarInfo(name)
    info.size, info.type, info.linkname, info.mode, info.mtime = len(data), kind, linkname, mode, 1_600_000_000
    if kind != tarfile.REGTYPE:
        info.size = 0
    buf = bytearray(info.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape"))
    if size_field is not None:
        head = bytearray(buf[-512:])
        _set_size_field(head, size_field)
        buf[-512:] = head
    return bytes(buf) + data + b"\0" * (-len(data) % 512)


def _old_gnu_sparse(name: str, data: bytes, offset: int, numbytes: int, realsize: int) -> bytes:
    """An old-GNU sparse member (type ``S``) with one map entry, fields in base-256 when negative."""
    head = bytearray(_gnu_member(name, data)[:512])
    head[156:157] = tarfile.GNUTYPE_SPARSE

    def num(v: int) -> bytes:
        return b"%011o\0" % v if v >= 0 else b"\xff" + (v % (1 << 88)).to_bytes(11, "big")

    head[386:398], head[398:410], head[482:483], head[483:495] = num(offset), num(numbytes), b"\0", num(realsize)
    _set_size_field(head, len(data))
    return bytes(head) + data + b"\0" * (-len(data) % 512)


def _disk_bytes(top) -> int:
    """Bytes of the regular files under ``top``, each inode once (hard links share their bytes)."""
    seen, total = set(), 0
    for dirpath, _dirs, files in os.walk(top):
        for name in files:
            st_ = os.lstat(os.path.join(dirpath, name))
            if stat.S_ISREG(st_.st_mode) and st_.st_ino not in seen:
                seen.add(st_.st_ino)
                total += st_.st_size
    return total


_NEG = [-1, -511, -512, -513, -1000, -(1 << 40), -(1 << 87)]


@pytest.mark.parametrize("how", ["file", "stream", "in_place"])
@pytest.mark.parametrize("neg", _NEG)
def test_negative_size_is_refused_before_anything_is_counted(layout, tmp_path, how, neg):
    """The review's PoC: members with a negative size lowered the written-bytes total (the batched
    path counted them), so later members wrote past max_total_bytes.  Refused on every path."""
    data = _gnu_member("first", b"x" * 10) + b"".join(_gnu_member(f"n{i}", size_field=neg) for i in range(50))
    data += b"".join(_gnu_member(f"big{i}", bytes([i]) * 4096) for i in range(8)) + b"\0" * 1024
    src = io.BytesIO(data) if how == "stream" else _write(tmp_path, data)
    with open_root(layout.ws) as root, pytest.raises(ArchiveFormatError) as ei:
        extract(root, "dest", src, limits=ArchiveLimits(max_total_bytes=8192),
                policy=ExtractPolicy(in_place=how == "in_place"))
    assert ei.value.member == "n0"
    assert "negative" in str(ei.value)
    if how == "in_place":
        assert sorted(os.listdir(layout.ws / "dest")) == ["first"]
    else:
        assert os.listdir(layout.ws) == []


@pytest.mark.parametrize("pax", [
    {"size": "-512"},                                       # a PAX size record overrides the header
    {"GNU.sparse.map": "-512,10", "GNU.sparse.realsize": "10"},  # sparse 0.1: negative map offset
    {"GNU.sparse.map": "0,-10", "GNU.sparse.realsize": "10"},    # ... negative map size
    {"GNU.sparse.map": "0,10", "GNU.sparse.realsize": "-10"},    # negative real size
])
@pytest.mark.parametrize("how", ["file", "stream"])
def test_negative_pax_size_or_sparse_map_is_refused(layout, tmp_path, pax, how):
    data = tar_bytes([ti("ok", data=b"1"), ti("neg", data=b"0123456789", pax=pax), ti("after", data=b"2" * 600)])
    src = io.BytesIO(data) if how == "stream" else _write(tmp_path, data)
    with open_root(layout.ws) as root, pytest.raises(ArchiveFormatError) as ei:
        extract(root, "dest", src)
    assert "negative" in str(ei.value)
    assert os.listdir(layout.ws) == []


@pytest.mark.parametrize("fields", [(-512, 10, 10), (0, -10, 10), (0, 10, -10), (-(1 << 80), 10, 10)])
@pytest.mark.parametrize("how", ["file", "stream"])
def test_negative_old_gnu_sparse_numbers_are_refused(layout, tmp_path, fields, how):
    data = _gnu_member("ok", b"1") + _old_gnu_sparse("sp", b"0123456789", *fields) + b"\0" * 1024
    src = io.BytesIO(data) if how == "stream" else _write(tmp_path, data)
    with open_root(layout.ws) as root, pytest.raises(ArchiveFormatError) as ei:
        extract(root, "dest", src)
    assert "negative" in str(ei.value) and ei.value.member == "sp"
    assert os.listdir(layout.ws) == []


def test_meter_counts_never_go_down():
    from sandbox_fs.archive._streams import Meter

    meter = Meter(ArchiveLimits())
    for call in (lambda: meter.add_input(-1), lambda: meter.add_stream(-1), lambda: meter.add_written(-1),
                 lambda: meter.add_skipped(-512, 0), lambda: meter.add_skipped(512, -1),
                 lambda: meter.add_skipped(0, 1)):
        with pytest.raises(ValueError):
            call()
    assert (meter.input_bytes, meter.stream_bytes, meter.written_bytes) == (0, 0, 0)
    meter.add_skipped(512, 511)
    assert (meter.input_bytes, meter.stream_bytes, meter.written_bytes) == (512, 512, 511)


@pytest.mark.parametrize("resolver_name", ["openat2", "fallback"])
@pytest.mark.parametrize("entry", [(-1, 10, -1), (0, -1, -1), (1, (1 << 63) - 1, -1), (0, 10, -2)])
def test_native_extract_files_refuses_negative_offsets_and_sizes(tmp_path, resolver_name, entry):
    from array import array

    src = tmp_path / "src"
    src.write_bytes(b"s" * 4096)
    stage = tmp_path / "stage"
    stage.mkdir()
    sfd = os.open(src, os.O_RDONLY)
    dfd = os.open(stage, os.O_PATH | os.O_DIRECTORY)
    try:
        off, size, probe = entry
        nums = array("q", [0, 5, -1, 0o644, 0, 0, off, size, probe, 0o644, 0, 0])
        done, err, stage_no = _writer._native.extract_files(sfd, dfd, resolver_name, nums,
                                                            bytearray(b"ok\0bad\0"), 2)
        assert (done, err, stage_no) == (1, errno.EINVAL, _writer._native.XF_STAGE_CREATE)
        assert sorted(os.listdir(stage)) == ["ok"]  # entries before the bad one are complete
        with pytest.raises(ValueError):
            _writer._native.extract_files(sfd, dfd, resolver_name, nums, bytearray(b"a\0b\0c\0"), 3)
    finally:
        os.close(sfd)
        os.close(dfd)


# --- files are created by path beneath staging, never through a kept fd (finding 2) -------------

def test_staging_subdirectory_moved_out_before_the_batch(layout, tmp_path, monkeypatch, resolver):
    """The review's race, made deterministic: just before the batch runs, a racing process renames a
    staging subdirectory out of the workspace.  No queued file may land there."""
    data = tar_bytes([ti("a/x1", data=b"payload 1"), ti("a/x2", data=b"payload 2"), ti("a/x3", data=b"payload 3")])
    moved = layout.outside / "moved"
    real_run = _batch.FileBatch.run

    def run(self, src_fd):
        for name in os.listdir(layout.ws / "dest"):
            if name.startswith(_writer.STAGING_PREFIX) and not moved.exists():
                os.rename(layout.ws / "dest" / name / "a", moved)
        real_run(self, src_fd)

    monkeypatch.setattr(_batch.FileBatch, "run", run)
    (layout.ws / "dest").mkdir()
    before = layout.snapshot()
    base = _nfds()
    with open_root(layout.ws) as root, pytest.raises(OSError) as ei:
        extract(root, "dest", _write(tmp_path, data))
    assert ei.value.errno == errno.ENOENT
    assert str(tmp_path) not in str(ei.value)  # sandbox paths only
    assert moved.is_dir() and os.listdir(moved) == []  # nothing was written into the moved directory
    after = layout.snapshot()
    del after["moved"]
    after["."], before["."] = None, None  # the rename itself changed outside's mtime
    assert after == before
    assert os.listdir(layout.ws / "dest") == []  # the staging tree is gone
    assert _nfds() == base


def test_staged_members_never_follow_a_moved_directory(layout, resolver):
    """One by one (a stream source): a directory made earlier and then moved out of staging is looked up
    again by path for each later member: files and subdirectories are refused, never made outside."""
    from sandbox_fs.archive._streams import Meter

    moved = layout.outside / "moved"
    with open_root(layout.ws) as root:
        ex = _writer.Extractor(root, "dest", ArchiveLimits(), ExtractPolicy(), Meter(ArchiveLimits()))
        try:
            ex.add_dir("a", 0o755, None)
            ex.add_file("b/c/f", lambda n, it=iter([b"ok"]): next(it, b""), 0o644, None)
            os.rename(layout.ws / ex._staging / "a", moved)
            os.rename(layout.ws / ex._staging / "b" / "c", layout.outside / "c")
            for call in (lambda: ex.add_file("a/f", lambda n: b"", 0o644, None),
                         lambda: ex.add_dir("a/sub", 0o755, None),
                         lambda: ex.add_file("a/sub2/f", lambda n: b"", 0o644, None),
                         lambda: ex.add_file("b/c/g", lambda n: b"", 0o644, None)):
                with pytest.raises(OSError):
                    call()
            assert os.listdir(moved) == [] and os.listdir(layout.outside / "c") == ["f"]
        finally:
            ex.abort()
            ex.close()
    assert os.listdir(layout.ws) == []


# --- a truncated archive over a limit: the same error on both paths (finding 3) -----------------

@pytest.mark.parametrize("kept, error", [(10_000, ArchiveFormatError), (30_000, ArchiveLimitError)])
def test_truncated_member_over_a_limit_gives_the_same_error(layout, tmp_path, kept, error):
    """Declared sizes are counted only for data the source holds: a member cut short is read one by one,
    which writes what exists (a limit then applies to those bytes) and reports the short data."""
    data = tar_bytes([ti("a", data=b"a" * 100), ti("f1", data=b"f" * 70_000)], fmt=tarfile.GNU_FORMAT)
    data = data[:data.index(b"f" * 70_000) + kept]
    lim = ArchiveLimits(max_total_bytes=20_000)
    with open_root(layout.ws) as root:
        with pytest.raises(error) as ei_file:
            extract(root, "dest", _write(tmp_path, data), limits=lim)
        with pytest.raises(error) as ei_stream:
            extract(root, "dest", io.BytesIO(data), limits=lim)
    assert str(ei_file.value) == str(ei_stream.value) and ei_file.value.member == "f1"
    assert os.listdir(layout.ws) == []


# --- property: hostile sizes, truncation and limits; both sources agree, limits hold -----------

_SIZE_FIELDS = st.one_of(st.none(), st.none(), st.none(), st.sampled_from(
    _NEG + [0, 600, 5000, 70_000, 1 << 33, 1 << 40, (1 << 87) - 1]))
_HOSTILE = st.tuples(st.sampled_from(["file", "file", "file", "dir", "hardlink"]),
                     st.sampled_from(["a", "b", "a/b", "a/c", "c/d/e"]), st.sampled_from([0, 1, 511, 512, 513, 5000]),
                     _SIZE_FIELDS)
_LIMITS = st.one_of(st.just({}), st.builds(lambda n: {"max_total_bytes": n}, st.integers(0, 8_000)),
                    st.builds(lambda n: {"max_members": n}, st.integers(1, 12)),
                    st.builds(lambda n: {"max_member_bytes": n}, st.integers(0, 6000)),
                    st.builds(lambda n: {"max_input_bytes": n}, st.integers(1, 40_000)))


def _hostile_outcome(layout, source, limits: ArchiveLimits, in_place: bool):
    for name in os.listdir(layout.ws):
        shutil.rmtree(layout.ws / name)
    try:
        with open_root(layout.ws) as root:
            rep = extract(root, "dest", source, format="tar", limits=limits,
                          policy=ExtractPolicy(in_place=in_place, hardlinks="create"))
        res = ("ok", rep, _tree(layout.ws / "dest"))
    except SandboxError as exc:
        res = ("error", type(exc).__name__, getattr(exc, "rule", None), getattr(exc, "limit", None),
               str(getattr(exc, "member", None)), os.listdir(layout.ws))
    return res, _disk_bytes(layout.ws)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(members=st.lists(_HOSTILE, min_size=1, max_size=12), cut=st.one_of(st.none(), st.floats(0, 1)),
       lim=_LIMITS)
# the review's shapes: cut inside a member's data that declares more than the limit left
# (the batched path counted the declared size: a limit error instead of the format error) ...
@example(members=[("file", "a", 5000, None)], cut=0.5, lim={"max_total_bytes": 4000})
@example(members=[("file", "a", 1, None), ("file", "b", 0, 70_000)], cut=None, lim={"max_total_bytes": 8000})
# ... and negative sizes lowering the written total
@example(members=[("file", "a", 0, -511)] * 3 + [("file", "b", 5000, None)], cut=None,
         lim={"max_total_bytes": 4000})
def test_hostile_sizes_file_and_stream_agree_and_limits_hold(layout, tmp_path, members, cut, lim):
    """Members may declare negative, huge or wrong sizes (GNU base-256), the archive may be cut anywhere,
    one limit may be low: a file source (batched) and a stream source (one by one) give the same result,
    in place gives the same error class, and the bytes on disk never exceed max_total_bytes."""
    out = []
    names: list[str] = []
    for i, (kind, name, size, size_field) in enumerate(members):
        if kind == "dir":
            out.append(_gnu_member(name, kind=tarfile.DIRTYPE, size_field=size_field))
        elif kind == "hardlink":
            out.append(_gnu_member(name, kind=tarfile.LNKTYPE, linkname=names[-1] if names else "zz",
                                   size_field=size_field))
        else:
            out.append(_gnu_member(name, bytes([65 + i]) * size, size_field=size_field))
        names.append(name)
    data = b"".join(out) + b"\0" * 1024
    if cut is not None:
        data = data[:int(len(data) * cut)]
    if not data:
        return
    limits = ArchiveLimits(**lim)
    path = _write(tmp_path, data, "h.tar")
    stream, stream_bytes = _hostile_outcome(layout, io.BytesIO(data), limits, False)
    batched, batched_bytes = _hostile_outcome(layout, path, limits, False)
    in_place, in_place_bytes = _hostile_outcome(layout, path, limits, True)
    assert batched == stream
    assert in_place[:2] == stream[:2] if stream[0] == "error" else in_place[0] == "ok"
    for n in (stream_bytes, batched_bytes, in_place_bytes):
        assert n <= limits.max_total_bytes


# -- several regular-file sources in one pass (extract_streams: a snapshot chain read from files)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(st.integers(0, 70_000), min_size=1, max_size=6), min_size=2, max_size=3))
def test_files_of_several_file_sources_are_copied_from_their_own(tmp_path_factory, sizes):
    """Queued files of one source are never copied from another's fd (a batch holds one source's
    offsets and runs with that source's fd): each file's bytes are those of the archive that holds it.
    Before, every batch ran with the first source's fd and the last source seen was recorded for all."""
    from sandbox_fs.archive import extract_streams

    base = tmp_path_factory.mktemp("multi")
    want: dict[str, bytes] = {}
    paths = []
    for s, members in enumerate(sizes):
        entries = [(f"s{s}/f{i}", bytes([65 + s]) * n + os.urandom(min(n, 16))) for i, n in enumerate(members)]
        want.update(entries)
        paths.append(base / f"{s}.tar")
        paths[-1].write_bytes(tar_bytes([ti(name, data=data) for name, data in entries]))
    (base / "out").mkdir()
    sources = [open(p, "rb", buffering=0) for p in paths]  # unbuffered regular files: the batch path
    try:
        with open_root(base / "out") as root:
            extract_streams(root=root, dest="x", sources=sources, take=lambda i, name, kind: True,
                            limits=ArchiveLimits(), policy=ExtractPolicy())
    finally:
        for f in sources:
            f.close()
    out = base / "out" / "x"
    assert {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()} == want
