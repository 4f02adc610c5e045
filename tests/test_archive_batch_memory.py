"""Batched new files whose bytes are held in memory (snapshot hydrate: its source is a stream).

``extract_stream`` / ``extract_streams`` (archive's contract with snapshot)
queue a new plain file read from a stream with its bytes
(``BatchedFiles.add_new_file_data``): the helper thread creates and writes it
in the native batch (``write`` from the batch's buffer).  The tree, the
report and every error must be those of the source-file batches and of the
one-by-one path; the public :func:`extract` of a stream is unchanged (one by
one).  Also: the native call's memory mode.
"""

from __future__ import annotations

import errno
import io
import os
import tarfile
from array import array

import pytest
from test_archive_batch import _many, _tree, _write, race_first_queued_name
from test_archive_builders import tar_bytes, ti

from sandbox_fs import open_root
from sandbox_fs.archive import (ArchiveFormatError, ArchiveLimitError, ArchiveLimits, ExtractPolicy,
                                extract, extract_stream, extract_streams)
from sandbox_fs.archive import _batch, _writer


def _held_batches(monkeypatch) -> list[int]:
    """Patch the native call: the file counts of the batches run with their bytes in memory."""
    held: list[int] = []
    real = _writer._native.extract_files

    def counted(*a):
        if len(a) > 7 and a[7] is not None:
            held.append(a[5])
        return real(*a)
    monkeypatch.setattr(_writer._native, "extract_files", counted)
    return held


def _stream(root, dest, data: bytes, **lim):
    return extract_stream(root=root, dest=dest, source=io.BytesIO(data), limits=ArchiveLimits(**lim),
                          policy=ExtractPolicy())


def test_stream_members_are_batched_in_memory_and_match_the_file_batches(layout, tmp_path, monkeypatch):
    big = os.urandom(_batch.MEMORY_FILE_BYTES + 1)  # over the memory bound: one by one
    members = [ti("top", "dir")] + _many(300) + [ti("top/a", data=b"A" * 513), ti("top/big", data=big),
                                                 ti("l", "symlink", linkname="top/a"),
                                                 ti("h", "hardlink", linkname="top/a"), ti("e", data=b"")]
    data = tar_bytes(members, fmt=tarfile.GNU_FORMAT)
    held = _held_batches(monkeypatch)
    with open_root(layout.ws) as root:
        rep_mem = _stream(root, "mem", data)
        assert sum(held) == 302 and max(held) <= _batch.BATCH_FILES  # all but the big one, in memory
        rep_file = extract(root, "file", _write(tmp_path, data))
        held.clear()
        rep_one = extract(root, "one", io.BytesIO(data))  # the public extract of a stream: one by one
        assert held == []
    assert rep_mem == rep_file == rep_one
    assert _tree(layout.ws / "mem") == _tree(layout.ws / "file") == _tree(layout.ws / "one")


@pytest.mark.parametrize("cut", ["data", "padding"])
def test_a_truncated_member_gives_the_one_by_one_error(layout, tmp_path, cut):
    data = tar_bytes(_many(100) + [ti("last", data=b"z" * 1000)], fmt=tarfile.GNU_FORMAT)
    end = data.rindex(b"z" * 1000) + 1000
    data = data[:end - 10] if cut == "data" else data[:end + 3]
    with open_root(layout.ws) as root:
        with pytest.raises(ArchiveFormatError) as ei_mem:
            _stream(root, "dest", data)
        with pytest.raises(ArchiveFormatError) as ei_one:
            extract(root, "dest", io.BytesIO(data))
    assert str(ei_mem.value) == str(ei_one.value) and ei_mem.value.member == "last"
    assert os.listdir(layout.ws) == []


@pytest.mark.parametrize("kept, error", [(10_000, ArchiveFormatError), (30_000, ArchiveLimitError)])
def test_a_truncated_member_over_a_limit_gives_the_same_error(layout, kept, error):
    data = tar_bytes([ti("a", data=b"a" * 100), ti("f1", data=b"f" * 70_000)], fmt=tarfile.GNU_FORMAT)
    data = data[:data.index(b"f" * 70_000) + kept]
    with open_root(layout.ws) as root:
        with pytest.raises(error) as ei_mem:
            _stream(root, "dest", data, max_total_bytes=20_000)
        with pytest.raises(error) as ei_one:
            extract(root, "dest", io.BytesIO(data), limits=ArchiveLimits(max_total_bytes=20_000))
    assert str(ei_mem.value) == str(ei_one.value) and ei_mem.value.member == "f1"
    assert os.listdir(layout.ws) == []


def test_limits_count_the_held_bytes_before_they_are_written(layout):
    data = tar_bytes(_many(50, size=1000))
    total = sum(1000 + i % 600 for i in range(50))
    with open_root(layout.ws) as root:
        with pytest.raises(ArchiveLimitError) as ei:
            _stream(root, "dest", data, max_total_bytes=total - 1)
        assert ei.value.limit == "max_total_bytes"
        assert _stream(root, "dest", data, max_total_bytes=total).bytes_written == total
    assert os.listdir(layout.ws) == ["dest"]


def test_an_earlier_held_batch_error_wins_over_a_later_member_error(layout, monkeypatch):
    def full(*a):
        return 0, errno.ENOSPC, _writer._native.XF_STAGE_COPY

    monkeypatch.setattr(_writer._native, "extract_files", full)
    data = tar_bytes([ti("ok", data=b"1"), ti("../evil", data=b"2")])
    with open_root(layout.ws) as root, pytest.raises(OSError) as ei:
        _stream(root, "dest", data)
    assert ei.value.errno == errno.ENOSPC  # "ok" comes first in the archive, as one by one
    assert os.listdir(layout.ws) == []


def test_a_name_appearing_in_staging_is_replaced_with_the_held_bytes(layout, monkeypatch):
    race_first_queued_name(monkeypatch)
    data = tar_bytes([ti("d/a", data=b"archive"), ti("d/b", data=b"bbb"), ti("d/c", data=b"ccc")])
    with open_root(layout.ws) as root:
        assert _stream(root, "dest", data).files == 3
    assert {n: (layout.ws / "dest/d" / n).read_bytes() for n in "abc"} == {"a": b"archive", "b": b"bbb", "c": b"ccc"}


def test_layered_streams_take_their_members_from_memory(layout, monkeypatch):
    held = _held_batches(monkeypatch)
    base = tar_bytes([ti("a", data=b"base-a"), ti("b", data=b"base-b")])
    layer = tar_bytes([ti("b", data=b"layer-b"), ti("c", data=b"layer-c")])
    final = {b"a": 0, b"b": 1, b"c": 1}
    with open_root(layout.ws) as root:
        extract_streams(root=root, dest="dest", sources=[io.BytesIO(base), io.BytesIO(layer)],
                        take=lambda i, name, kind: final.get(name) == i, limits=ArchiveLimits(),
                        policy=ExtractPolicy())
    assert {n: (layout.ws / "dest" / n).read_bytes() for n in "abc"} == \
        {"a": b"base-a", "b": b"layer-b", "c": b"layer-c"}
    assert sum(held) == 3


@pytest.mark.parametrize("resolver_name", ["openat2", "fallback"])
def test_native_memory_mode_writes_the_buffer_and_refuses_entries_past_it(tmp_path, resolver_name):
    stage = tmp_path / "stage"
    stage.mkdir()
    dfd = os.open(stage, os.O_PATH | os.O_DIRECTORY)
    try:
        buf = b"hello, world"
        nums = array("q", [0, 5, -1, 0o644, 0, 0, 7, 5, -1, 0o600, 0, 0, 8, 5, -1, 0o644, 0, 0])
        res = _writer._native.extract_files(-1, dfd, resolver_name, nums, bytearray(b"a\0b\0c\0"), 3, None, buf)
        assert res == (2, errno.ENODATA, _writer._native.XF_STAGE_SHORT)  # c: 8 + 5 > 12
        assert sorted(os.listdir(stage)) == ["a", "b"]  # the failed one removed
        assert (stage / "a").read_bytes() == b"hello" and (stage / "b").read_bytes() == b"world"
        probe = array("q", [0, 1, len(buf), 0o644, 0, 0])  # a probe byte must lie within the buffer
        assert _writer._native.extract_files(-1, dfd, resolver_name, probe, bytearray(b"p\0"), 1, None, buf) == \
            (0, errno.ENODATA, _writer._native.XF_STAGE_SHORT)
        assert _writer._native.extract_files(-1, dfd, resolver_name, array("q", [12, 0, -1, 0o644, 0, 0]),
                                             bytearray(b"z\0"), 1, None, buf)[0] == 1  # empty, at the end
    finally:
        os.close(dfd)
