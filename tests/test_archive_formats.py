"""Format coverage: GNU/PAX sparse members, ZIP64 records, non-seekable zip sources."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import zipfile

import pytest
from test_archive_builders import extract_ws, zip_bytes

from sandbox_fs.archive import ArchiveFormatError, ArchiveLimitError, ArchiveLimits

GNU_TAR = shutil.which("tar")


def _gnu_tar_is_gnu() -> bool:
    if not GNU_TAR:
        return False
    out = subprocess.run([GNU_TAR, "--version"], capture_output=True, text=True)
    return "GNU tar" in out.stdout


needs_gnu_tar = pytest.mark.skipif(not _gnu_tar_is_gnu(), reason="GNU tar is needed to build sparse archives")


def _sparse_tar(tmp_path, size_bytes: int, fmt: str) -> bytes:
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "sparse.img", "wb") as fh:
        fh.write(b"head")
        fh.truncate(size_bytes)
        fh.seek(size_bytes - 4)
        fh.write(b"tail")
    out = tmp_path / f"s-{fmt}.tar"
    subprocess.run([GNU_TAR, "--sparse", f"--format={fmt}", "-cf", str(out), "-C", str(src), "sparse.img"],
                   check=True)
    return out.read_bytes()


@needs_gnu_tar
@pytest.mark.parametrize("fmt", ["gnu", "posix"])
def test_sparse_member_expands_to_real_size(layout, tmp_path, fmt):
    data = _sparse_tar(tmp_path, 1 << 20, fmt)
    assert len(data) < 64 << 10
    rep = extract_ws(layout, data)
    out = (layout.ws / "dest" / "sparse.img").read_bytes()
    assert len(out) == 1 << 20 and out[:4] == b"head" and out[-4:] == b"tail"
    assert rep.bytes_written == 1 << 20


@needs_gnu_tar
@pytest.mark.parametrize("fmt", ["gnu", "posix"])
def test_sparse_member_bounded_by_real_size(layout, tmp_path, fmt):
    data = _sparse_tar(tmp_path, 64 << 20, fmt)
    before = layout.snapshot()
    with pytest.raises(ArchiveLimitError) as ei:
        extract_ws(layout, data, limits=ArchiveLimits(max_member_bytes=32 << 20))
    assert ei.value.limit == "max_member_bytes" and ei.value.observed >= 32 << 20
    with pytest.raises(ArchiveLimitError) as ei:  # the expansion ratio sees the expanded bytes
        extract_ws(layout, data, limits=ArchiveLimits(ratio_grace_bytes=1 << 20))
    assert ei.value.limit == "max_expansion_ratio"
    layout.assert_outside_unchanged(before)
    assert os.listdir(layout.ws) == []


def test_zip64_end_records_checked_before_parsing(layout, monkeypatch):
    monkeypatch.setattr(zipfile, "ZIP_FILECOUNT_LIMIT", 5)
    data = zip_bytes([{"name": f"f{i}", "data": b"x"} for i in range(20)])
    assert b"PK\x06\x06" in data and b"PK\x06\x07" in data
    monkeypatch.undo()
    with pytest.raises(ArchiveLimitError) as ei:
        extract_ws(layout, data, limits=ArchiveLimits(max_members=10))
    assert ei.value.observed == 20
    rep = extract_ws(layout, data)
    assert rep.files == 20


def test_zip64_entry_extracts(layout):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        with zf.open("big", "w", force_zip64=True) as fh:
            fh.write(b"y" * 1000)
    rep = extract_ws(layout, buf.getvalue())
    assert rep.files == 1 and (layout.ws / "dest" / "big").read_bytes() == b"y" * 1000


def test_zip_central_directory_size_bound(layout):
    data = zip_bytes([{"name": "n" * 200 + str(i), "data": b""} for i in range(20)])
    with pytest.raises(ArchiveLimitError) as ei:
        extract_ws(layout, data, limits=ArchiveLimits(max_central_directory_bytes=1000))
    assert ei.value.limit == "max_central_directory_bytes"


def test_zip_needs_seekable_source(layout):
    data = zip_bytes([{"name": "a", "data": b"1"}])

    class Pipe(io.RawIOBase):
        def __init__(self):
            self._b = io.BytesIO(data)

        def readable(self):
            return True

        def readinto(self, b):
            c = self._b.read(len(b))
            b[: len(c)] = c
            return len(c)

    with pytest.raises(ArchiveFormatError):
        extract_ws(layout, Pipe())
    with pytest.raises(ArchiveFormatError):
        extract_ws(layout, Pipe(), format="zip")


def test_host_path_tar_uses_kernel_copy_and_checks_truncation(layout, tmp_path):
    """A plain tar given as a host path is copied with sendfile: content, limits and truncation still hold."""
    from sandbox_fs import open_root
    from sandbox_fs.archive import extract
    from test_archive_builders import raw_tar_header, tar_bytes, ti

    big = bytes(range(256)) * (12 * 1024)  # 3 MiB, several 1 MiB chunks
    p = tmp_path / "a.tar"
    p.write_bytes(tar_bytes([ti("small", data=b"s"), ti("big", data=big), ti("tiny", data=b"t" * 513)]))
    with open_root(layout.ws) as root:
        rep = extract(root, "ok", p)
    assert (layout.ws / "ok" / "big").read_bytes() == big
    assert (layout.ws / "ok" / "tiny").read_bytes() == b"t" * 513
    assert rep.bytes_written == len(big) + 1 + 513
    assert p.stat().st_size - 10240 < rep.input_bytes <= p.stat().st_size  # the end-of-archive padding is not read
    cut = tmp_path / "cut.tar"
    cut.write_bytes(raw_tar_header("big", 3 << 20) + big[: 1 << 20])
    with open_root(layout.ws) as root:
        with pytest.raises(ArchiveFormatError):
            extract(root, "cut", cut)
        with pytest.raises(ArchiveLimitError) as ei:
            extract(root, "lim", p, limits=ArchiveLimits(max_total_bytes=2 << 20))
    assert ei.value.limit == "max_total_bytes"
    assert sorted(os.listdir(layout.ws)) == ["ok"]
