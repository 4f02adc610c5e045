"""Test helpers shared by the copy_snapshot tests: a one-member tar and a source store that serves given bytes."""

from __future__ import annotations

import io
import tarfile
from typing import IO, Any

from sandbox_fs.snapshot import SnapshotInfo


def one_file_tar() -> bytes:
    """A PAX tar holding the one file ``f`` (``hello``)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        ti = tarfile.TarInfo("f")
        ti.size = 5
        tar.addfile(ti, io.BytesIO(b"hello"))
    return buf.getvalue()


class ServedSource:
    """A source store whose ``open_archive`` serves ``served`` under ``info`` (which may describe other bytes)."""

    def __init__(self, served: bytes, info: SnapshotInfo) -> None:
        self.served, self._info = served, info

    def open_archive(self, name: str, limits: Any) -> tuple[IO[bytes], SnapshotInfo]:
        return io.BytesIO(self.served), self._info
