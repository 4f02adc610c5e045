"""A member over BATCH_BYTES: a batch of its own when the extraction cannot be cancelled, else one by one.

Without ``check_cancel`` (a synchronous :func:`extract`, snapshot hydrate)
nothing waits on a MiB-by-MiB cancel check, so a large new file is copied by
the helper thread like a small one, beside the parsing of the headers after
it; :func:`extract_async` still writes it one by one, cancellable once a MiB.
Either way the tree is the one a stream source (never batched) gives.
"""

from __future__ import annotations

import io
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_archive_batch import _tree, _write
from test_archive_builders import tar_bytes, ti

from sandbox_fs import open_root
from sandbox_fs.archive import ArchiveFormatError, ArchiveLimitError, ArchiveLimits, extract, extract_async
from sandbox_fs.archive import _batching, _writer

_SMALL_BATCH = 4096


def _members() -> list:
    return [ti("d/small", data=b"s" * 100), ti("d/big", data=os.urandom(3 * _SMALL_BATCH + 7), mode=0o640),
            ti("d/after", data=b"a" * 10), ti("d/link", "hardlink", linkname="d/big")]


def _count_batched(monkeypatch) -> list[int]:
    sizes: list[int] = []
    real = _writer._native.extract_files

    def counted(src_fd, stage_fd, resolver, nums, names, n, owner):
        sizes.extend(nums[i * _writer._native.XF_FIELDS + 1] for i in range(n))
        return real(src_fd, stage_fd, resolver, nums, names, n, owner)

    monkeypatch.setattr(_writer._native, "extract_files", counted)
    return sizes


def test_large_member_is_batched_without_cancellation(layout, tmp_path, monkeypatch):
    monkeypatch.setattr(_batching, "BATCH_BYTES", _SMALL_BATCH)
    sizes = _count_batched(monkeypatch)
    data = tar_bytes(_members())
    with open_root(layout.ws) as root:
        rep_file = extract(root, "from_file", _write(tmp_path, data))
        assert 3 * _SMALL_BATCH + 7 in sizes  # the large member went to the helper thread
        rep_stream = extract(root, "from_stream", io.BytesIO(data))
    assert rep_file == rep_stream
    assert _tree(layout.ws / "from_file") == _tree(layout.ws / "from_stream")


async def test_large_member_is_written_one_by_one_when_cancellable(layout, tmp_path, monkeypatch):
    monkeypatch.setattr(_batching, "BATCH_BYTES", _SMALL_BATCH)
    sizes = _count_batched(monkeypatch)
    data = tar_bytes(_members())
    with open_root(layout.ws) as root:
        await extract_async(root, "from_file", _write(tmp_path, data))
        assert sizes and 3 * _SMALL_BATCH + 7 not in sizes  # small ones batched, the large one not
        extract(root, "from_stream", io.BytesIO(data))
    assert _tree(layout.ws / "from_file") == _tree(layout.ws / "from_stream")


def test_large_member_limits_and_truncation_match_one_by_one(layout, tmp_path, monkeypatch):
    """Its declared size counts before any byte is copied, and a short source is the same format error."""
    monkeypatch.setattr(_batching, "BATCH_BYTES", _SMALL_BATCH)
    data = tar_bytes(_members())
    with open_root(layout.ws) as root:
        for name, src in (("f", lambda: _write(tmp_path, data)), ("s", lambda: io.BytesIO(data))):
            try:
                extract(root, name, src(), limits=ArchiveLimits(max_total_bytes=2 * _SMALL_BATCH))
                raise AssertionError("the limit was not applied")
            except ArchiveLimitError as exc:
                assert exc.limit == "max_total_bytes"
        cut = data[:1024 + 512 + _SMALL_BATCH]  # inside the large member's data
        for name, src in (("f2", lambda: _write(tmp_path, cut, "cut.tar")), ("s2", lambda: io.BytesIO(cut))):
            try:
                extract(root, name, src())
                raise AssertionError("a truncated archive was accepted")
            except ArchiveFormatError as exc:
                assert "unexpected end of data" in str(exc)
    assert sorted(os.listdir(layout.ws)) == []


_NAMES = ["a", "a/b", "a/b/c", "b", "a/c", "./a", "a//b", "A"]


def _outcome(root, dest: str, src, limits: ArchiveLimits, top) -> tuple:
    try:
        extract(root, dest, src, limits=limits)
    except Exception as exc:  # the error's kind, rule and limit, and what was left (nothing, atomic)
        return ("err", type(exc).__name__, getattr(exc, "rule", None), getattr(exc, "limit", None),
                os.path.exists(top / dest))
    return ("ok", _tree(top / dest))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=st.lists(st.tuples(st.sampled_from(_NAMES), st.sampled_from(["f", "F", "F", "d", "l", "s"]),
                               st.sampled_from(_NAMES + ["../x"])), min_size=1, max_size=7),
       total=st.sampled_from([None, 3 * _SMALL_BATCH]))
def test_property_large_members_in_batches_give_what_one_by_one_gives(layout, tmp_path_factory, spec, total):
    """Attacks that held (review of 2026-12-03): names repeated, a hard link to a large queued file, a parent
    later named as a file, a symlink or a directory, a large member under a symlink member, ``max_total_bytes``
    reached by a queued large member.  A file source (large members batched) gives the same tree, or the same
    error with nothing left, as a stream source (every member one by one)."""
    members = []
    for name, kind, other in spec:
        if kind in "fF":
            members.append(ti(name, data=os.urandom(10 if kind == "f" else _SMALL_BATCH + 100 + len(members))))
        elif kind == "d":
            members.append(ti(name, "dir"))
        else:
            members.append(ti(name, "hardlink" if kind == "l" else "symlink", linkname=other))
    data = tar_bytes(members)
    limits = ArchiveLimits() if total is None else ArchiveLimits(max_total_bytes=total)
    tmp = tmp_path_factory.mktemp("big")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_batching, "BATCH_BYTES", _SMALL_BATCH)
        with open_root(layout.ws) as root:
            got = _outcome(root, f"f{tmp.name}", _write(tmp, data), limits, layout.ws)
            want = _outcome(root, f"s{tmp.name}", io.BytesIO(data), limits, layout.ws)
    assert got == want
