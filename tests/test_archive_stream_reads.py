"""The tar stream's direct reads: a bare uncompressed source read without the InputCounter layer.

``StreamCounter`` reads the source beneath an uncompressed ``InputCounter``
straight once the sniffed prefix is consumed (``_direct_source``), counting
each read as the layers did (``Meter.add_read`` = ``add_input`` then
``add_stream``), and a member queued with its bytes in memory is read with
its block padding in one go (``read_member_into``).  Hydrate's source is the
verifying reader, whose 1 MiB blocks members straddle.  Every tree, error
and count must be those of the source-file path (its own, independent code:
``pread`` and ``Meter.add_skipped``, which counts a member's data and padding
before its written bytes, as the in-memory path now does).
"""

from __future__ import annotations

import hashlib
import io
import tarfile
import zlib
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_archive_batch import _tree, _write
from test_archive_builders import tar_bytes, ti

from sandbox_fs import open_root
from sandbox_fs.archive import ArchiveFormatError, ArchiveLimitError, ArchiveLimits, ExtractPolicy, extract, \
    extract_stream
from sandbox_fs.archive import _batching
from sandbox_fs.archive._streams import Meter
from sandbox_fs.snapshot import _reader
from sandbox_fs.snapshot._models import SnapshotInfo


class _Trickle(io.RawIOBase):
    """A pipe-like source: every read returns at most ``step`` bytes."""

    def __init__(self, data: bytes, step: int) -> None:
        self._data, self._pos, self._step = data, 0, step

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[no-untyped-def]
        n = min(len(b), self._step, len(self._data) - self._pos)
        b[:n] = self._data[self._pos:self._pos + n]
        self._pos += n
        return n


def _info(data: bytes) -> SnapshotInfo:
    t = "0" * 64
    return SnapshotInfo(name="s", archive="x", archive_bytes=len(data), archive_crc32=f"{zlib.crc32(data):08x}",
                        archive_sha256=hashlib.sha256(data).hexdigest(), fingerprint=t, tree_digest=t, entries=0,
                        content_bytes=len(data))


def _source(kind: str, data: bytes):
    if kind == "bytesio":
        return io.BytesIO(data)
    if kind == "trickle":
        return _Trickle(data, 97)
    return _reader.VerifyingReader(io.BufferedReader(io.BytesIO(data), 1 << 20), _info(data))


def _members() -> list:
    sizes = [0, 1, 511, 512, 513, 699, 700, 701, 1023, 1024, 1400, 2047, 3000, 5000]
    return [ti("top", "dir")] + [ti(f"top/d{i % 3}/f{i:03d}", data=bytes([i % 251 + 1]) * s)
                                 for i, s in enumerate(sizes * 3)] + \
        [ti("l", "symlink", linkname="top/d1/f001"), ti("h", "hardlink", linkname="top/d2/f002")]


@pytest.mark.parametrize("one_by_one", [False, True])
@pytest.mark.parametrize("source", ["verifying", "bytesio", "trickle"])
def test_members_straddling_the_readers_blocks_extract_exactly(layout, tmp_path, monkeypatch, source, one_by_one):
    """700-byte reader blocks (headers, data and padding all straddle them) and a source that reads short:
    the tree and the counts are the source-file path's, and the verifying reader still verifies.
    ``one_by_one``: members over 1000 bytes are written one by one (as hydrate's over 1 MiB), from views of
    the reader's blocks (``StreamCounter.read_chunk``)."""
    monkeypatch.setattr(_reader, "_READ_CHUNK", 700)
    if one_by_one:
        monkeypatch.setattr(_batching, "MEMORY_FILE_BYTES", 1000)
    data = tar_bytes(_members(), fmt=tarfile.GNU_FORMAT)
    src = _source(source, data)
    with open_root(layout.ws) as root:
        rep = extract_stream(root=root, dest="mem", source=src, limits=ArchiveLimits(), policy=ExtractPolicy())
        ref = extract(root, "file", _write(tmp_path, data))
    assert (rep.files, rep.bytes_written, rep.members, rep.input_bytes) == \
        (ref.files, ref.bytes_written, ref.members, ref.input_bytes)
    assert _tree(layout.ws / "mem") == _tree(layout.ws / "file")
    if isinstance(src, _reader.VerifyingReader):
        src.verify(_info(data))
        src.close()


def _outcome(fn, dest: str, exact: bool = True) -> tuple:
    try:
        rep = fn(dest)
    except ArchiveLimitError as exc:  # a short-reading source counts once a read: its observed input differs
        return ("limit", exc.limit, exc.observed if exact or exc.limit != "max_input_bytes" else None, exc.member)
    except ArchiveFormatError as exc:
        return ("format", str(exc).replace(dest, "DEST"), exc.member)
    return ("ok", rep.files, rep.bytes_written, rep.input_bytes)


@pytest.mark.parametrize("one_by_one", [False, True])
@pytest.mark.parametrize("source", ["verifying", "bytesio", "trickle"])
def test_limits_and_truncation_through_the_direct_reads_match_the_file_path(layout, tmp_path, monkeypatch, source,
                                                                           one_by_one):
    """``max_input_bytes`` reached in a member's data, at its end, in its padding; ``max_total_bytes`` with it;
    the archive cut in the data, in the padding, in the next header: the same error, count and member as the
    source-file path (``one_by_one``: f1 is written one by one from the stream, counting its padding after its
    written bytes, as tarfile's step over it did: only the limits it reaches first may differ)."""
    monkeypatch.setattr(_reader, "_READ_CHUNK", 700)
    if one_by_one:
        monkeypatch.setattr(_batching, "MEMORY_FILE_BYTES", 999)
    data = tar_bytes([ti("a", data=b"a" * 100), ti("f1", data=b"f" * 1000), ti("z", data=b"z" * 10)],
                     fmt=tarfile.GNU_FORMAT)
    end = data.index(b"f" * 1000) + 1000  # f1's data ends here; its padding to 2560, z's header after it
    assert end == 2536
    cases = [dict(max_input_bytes=n) for n in (end - 1, end, end + 1, 2559, 2560, 2561)] + \
        [dict(max_input_bytes=2550, max_total_bytes=1099), dict(max_total_bytes=1099)]
    cuts = [end - 10, end, end + 3, 2560, 2560 + 100]
    with open_root(layout.ws) as root:
        exact = source != "trickle"
        for i, lim in enumerate(cases):
            got = _outcome(lambda d: extract_stream(root=root, dest=d, source=_source(source, data),
                                                    limits=ArchiveLimits(**lim), policy=ExtractPolicy()), f"m{i}", exact)
            want = _outcome(lambda d: extract(root, d, _write(tmp_path, data), limits=ArchiveLimits(**lim)), f"f{i}",
                            exact)
            if one_by_one and got[0] == "limit":  # the same refusal of the same member; the limit and count may differ
                got, want = (got[0], got[-1]), (want[0], want[-1])
            assert got == want, lim
        for cut in cuts:
            part = data[:cut]
            got = _outcome(lambda d: extract_stream(root=root, dest=d, source=_source(source, part),
                                                    limits=ArchiveLimits(), policy=ExtractPolicy()), f"mc{cut}")
            want = _outcome(lambda d: extract(root, d, _write(tmp_path, part, "cut.tar")), f"fc{cut}")
            assert got == want and got[0] == ("ok" if cut >= 2560 else "format"), cut  # tarfile ends at a header cut


_OPS = st.lists(st.tuples(st.sampled_from(["read", "stream", "written"]), st.integers(0, 5000)), max_size=30)


@settings(max_examples=200, deadline=None)
@example(ops=[("stream", 5), ("read", 10)], max_input=100, max_total=100, ratio=1.5, grace=10)  # at the ratio
@example(ops=[("stream", 1), ("read", 10)], max_input=100, max_total=100, ratio=1.0, grace=10)  # one past it
@example(ops=[("written", 12), ("read", 8)], max_input=100, max_total=100, ratio=1.5, grace=10)
@example(ops=[("read", 10), ("read", 1)], max_input=10, max_total=100, ratio=1.0, grace=0)
@given(ops=_OPS, max_input=st.integers(1, 40_000), max_total=st.integers(1, 40_000),
       ratio=st.sampled_from([1.0, 1.5, 3.0]), grace=st.integers(0, 20_000))
def test_add_read_counts_and_checks_as_add_input_then_add_stream(ops, max_input, max_total, ratio, grace):
    """Meter.add_read(n) is add_input(n) then add_stream(n): the same totals and the same error, whatever came
    before (stream bytes past the input, written bytes, the ratio's grace)."""
    limits = ArchiveLimits(max_input_bytes=max_input, max_total_bytes=max_total, max_expansion_ratio=ratio,
                           ratio_grace_bytes=grace)
    fused, layered = Meter(limits), Meter(limits)

    def run(meter: Meter, op: str, n: int, fuse: bool):
        try:
            if op == "read" and fuse:
                meter.add_read(n)
            elif op == "read":
                meter.add_input(n)
                meter.add_stream(n)
            elif op == "stream":
                meter.add_stream(n)
            else:
                meter.add_written(n)
        except ArchiveLimitError as exc:
            return (exc.limit, exc.observed, str(exc))
        return None

    for op, n in ops:
        a, b = run(fused, op, n, True), run(layered, op, n, False)
        assert a == b
        assert (fused.input_bytes, fused.stream_bytes, fused.written_bytes) == \
            (layered.input_bytes, layered.stream_bytes, layered.written_bytes)
        if a is not None:
            break


class _RatioModel:
    """The archive limits as written out in ArchiveLimits' docstring, one increment at a time: the reference the
    Meter (whose ratio test is one method, _check_ratio, called from four places) must refuse at the same byte as."""

    def __init__(self, limits: ArchiveLimits) -> None:
        self.limits, self.input, self.stream, self.written = limits, 0, 0, 0

    def _ratio(self) -> None:
        produced = max(self.stream, self.written)
        if produced > self.limits.ratio_grace_bytes and \
                produced > self.limits.max_expansion_ratio * max(self.input, 1):
            raise ArchiveLimitError("max_expansion_ratio", self.limits.max_expansion_ratio,
                                    round(produced / max(self.input, 1), 1))

    def add_input(self, n: int) -> None:
        self.input += n
        if self.input > self.limits.max_input_bytes:
            raise ArchiveLimitError("max_input_bytes", self.limits.max_input_bytes, self.input)

    def add_stream(self, n: int) -> None:
        self.stream += n
        if self.stream > self.limits.ratio_grace_bytes:
            self._ratio()

    def add_written(self, n: int) -> None:
        self.written += n
        if self.written > self.limits.max_total_bytes:
            raise ArchiveLimitError("max_total_bytes", self.limits.max_total_bytes, self.written)
        if self.written > self.limits.ratio_grace_bytes:
            self._ratio()

    def add_read(self, n: int) -> None:
        self.add_input(n)
        self.add_stream(n)

    def add_skipped(self, n: int, written: int) -> None:
        self.add_input(n)
        self.add_stream(n)
        self.add_written(written)


@settings(max_examples=200, deadline=None)
@example(ops=[("input", 10, 0), ("stream", 15, 0), ("written", 1, 0)], max_input=100, max_total=100,
         ratio=1.5, grace=10)  # at the ratio: allowed
@example(ops=[("input", 10, 0), ("written", 16, 0)], max_input=100, max_total=100, ratio=1.5, grace=10)
@example(ops=[("stream", 3, 0)], max_input=100, max_total=100, ratio=1.0, grace=0)  # no input read: ratio to 1 byte
@example(ops=[("skipped", 10, 10), ("written", 1, 0)], max_input=100, max_total=100, ratio=1.0, grace=10)
@given(ops=st.lists(st.tuples(st.sampled_from(["input", "stream", "read", "written", "skipped"]),
                              st.integers(0, 5000), st.integers(0, 5000)), max_size=30),
       max_input=st.integers(1, 40_000), max_total=st.integers(0, 40_000),
       ratio=st.sampled_from([1.0, 1.5, 3.0, 7.3]), grace=st.integers(0, 20_000))
def test_meter_refuses_at_the_same_byte_as_the_written_out_limits(ops, max_input, max_total, ratio, grace):
    """Every Meter count raises the limit the reference model raises, at the same call, with the same figures
    (the expansion ratio: max(stream, written) above the grace and above ratio * max(input, 1))."""
    limits = ArchiveLimits(max_input_bytes=max_input, max_total_bytes=max_total, max_expansion_ratio=ratio,
                           ratio_grace_bytes=grace)
    meter, model = Meter(limits), _RatioModel(limits)

    def run(counter: Any, op: str, n: int, m: int):
        try:
            if op == "skipped":
                counter.add_skipped(n, min(m, n))
            else:
                getattr(counter, f"add_{op}")(n)
        except ArchiveLimitError as exc:
            return (exc.limit, exc.allowed, exc.observed)
        return None

    for op, n, m in ops:
        got, want = run(meter, op, n, m), run(model, op, n, m)
        assert got == want, (op, n, m)
        assert (meter.input_bytes, meter.stream_bytes, meter.written_bytes) == \
            (model.input, model.stream, model.written)
        if got is not None:
            break
