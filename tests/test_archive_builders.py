"""In-memory builders of hostile tar and zip archives, shared by the archive tests.

Imported by the other ``test_archive*.py`` files (``tests/`` is on sys.path
under pytest's default import mode); the tests here check the builders
themselves produce what they claim.
"""

from __future__ import annotations

import io
import os
import stat
import struct
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest

from sandbox_fs import open_root


def ti(name: str, kind: str = "file", data: bytes = b"", *, linkname: str = "", mode: int | None = None,
       mtime: int = 1_600_000_000, pax: dict[str, str] | None = None) -> dict[str, Any]:
    """Describe one tar member for :func:`tar_bytes`."""
    return {"name": name, "kind": kind, "data": data, "linkname": linkname, "mode": mode, "mtime": mtime,
            "pax": pax or {}}


_TYPES = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
          "hardlink": tarfile.LNKTYPE, "fifo": tarfile.FIFOTYPE, "chr": tarfile.CHRTYPE,
          "blk": tarfile.BLKTYPE, "unknown": b"Z"}


def tar_bytes(members: list[dict[str, Any]], *, fmt: int = tarfile.PAX_FORMAT, compression: str = "") -> bytes:
    """Build a tar archive (optionally ``gz``/``bz2``/``xz``) from member descriptions."""
    buf = io.BytesIO()
    mode = "w:" + compression if compression else "w"
    with tarfile.open(fileobj=buf, mode=mode, format=fmt) as tf:
        for m in members:
            info = tarfile.TarInfo(m["name"])
            info.type = _TYPES[m["kind"]]
            info.mtime = m["mtime"]
            info.linkname = m["linkname"]
            if m["mode"] is not None:
                info.mode = m["mode"]
            else:
                info.mode = 0o755 if m["kind"] == "dir" else 0o644
            if m["pax"]:
                info.pax_headers = dict(m["pax"])
            if m["kind"] == "chr":
                info.devmajor, info.devminor = 1, 3
            if m["kind"] == "file":
                info.size = len(m["data"])
                tf.addfile(info, io.BytesIO(m["data"]))
            else:
                tf.addfile(info)
    return buf.getvalue()


def raw_tar_header(name: str, size: int, kind: bytes = tarfile.REGTYPE, fmt: int = tarfile.GNU_FORMAT) -> bytes:
    """One 512-byte header block (plus any extension headers) declaring ``size`` bytes."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.type = kind
    info.mode = 0o644
    return info.tobuf(fmt, "utf-8", "surrogateescape")


def zip_bytes(entries: list[dict[str, Any]], *, compression: int = zipfile.ZIP_DEFLATED) -> bytes:
    """Build a zip from ``{"name", "data", "mode" (Unix st_mode incl. type) }`` dicts."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=compression) as zf:
        for e in entries:
            zi = zipfile.ZipInfo(e["name"], date_time=(2020, 1, 2, 3, 4, 6))
            zi.compress_type = e.get("compression", compression)
            if e.get("dos"):
                zi.create_system = 0
            if "mode" in e:
                zi.create_system = 3
                zi.external_attr = (e["mode"] & 0xFFFF) << 16
                if stat.S_ISDIR(e["mode"]):
                    zi.external_attr |= 0x10
            zf.writestr(zi, e.get("data", b""))
            if e.get("dos"):
                zf.filelist[-1].external_attr = 0
    return buf.getvalue()


def zip_central_records(data: bytes) -> list[int]:
    """Offsets of each central-directory record in ``data``."""
    out, pos = [], 0
    while True:
        pos = data.find(b"PK\x01\x02", pos)
        if pos < 0:
            return out
        out.append(pos)
        pos += 4


def patch(data: bytes, offset: int, new: bytes) -> bytes:
    return data[:offset] + new + data[offset + len(new):]


def zip_overlapping(payload_a: bytes = b"A" * 100, payload_b: bytes = b"B" * 100) -> bytes:
    """Two stored entries where ``a``'s declared compressed size covers ``b`` (an overlap bomb shape)."""
    data = zip_bytes([{"name": "a", "data": payload_a}, {"name": "b", "data": payload_b}],
                     compression=zipfile.ZIP_STORED)
    cds = zip_central_records(data)
    # central record: compressed size at +20, uncompressed at +24; local header at +18/+22
    grown = len(payload_a) + 30 + 1 + len(payload_b)
    data = patch(data, cds[0] + 20, struct.pack("<LL", grown, grown))
    data = patch(data, 18, struct.pack("<LL", grown, grown))
    return data


def zip_name_mismatch() -> bytes:
    """Local header says ``evil``, the central directory says ``good``."""
    data = zip_bytes([{"name": "good", "data": b"hello"}])
    return patch(data, 30, b"evil")


def extract_ws(layout, data: bytes | io.BytesIO, dest: str = "dest", **kw):
    """Extract ``data`` into ``layout.ws/dest`` through a workspace Root; return the report."""
    from sandbox_fs.archive import extract

    src = data if isinstance(data, io.IOBase) else io.BytesIO(data)
    with open_root(layout.ws) as root:
        return extract(root, dest, src, **kw)


def ws_escapes(ws: Path) -> list[str]:
    """Symlinks under ``ws`` that resolve outside it, and special / setuid nodes."""
    bad = []
    real_ws = os.path.realpath(ws)
    for dirpath, dirs, files in os.walk(ws):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                r = os.path.realpath(p)
                if not (r == real_ws or r.startswith(real_ws + os.sep)):
                    bad.append(f"symlink {p} -> {r}")
            elif not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                bad.append(f"special {p}")
            elif st.st_mode & (stat.S_ISUID | stat.S_ISGID) and not stat.S_ISDIR(st.st_mode):
                bad.append(f"setid {p}")
    return bad


# ------------------------------------------------------------ builder checks

def test_tar_builder_roundtrip():
    data = tar_bytes([ti("d", "dir"), ti("d/f", data=b"x"), ti("l", "symlink", linkname="d/f")])
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        assert [(m.name, m.type) for m in tf] == [("d", tarfile.DIRTYPE), ("d/f", tarfile.REGTYPE),
                                                  ("l", tarfile.SYMTYPE)]


def test_overlap_builder_overlaps():
    data = zip_overlapping()
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        a, b = zf.infolist()
        assert a.header_offset + 30 + 1 + a.compress_size > b.header_offset


def test_mismatch_builder():
    data = zip_name_mismatch()
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        with pytest.raises(zipfile.BadZipFile):
            zf.read("good")


async def cancel_once_started(root: Any, source: Any, started: Any, *, timeout: float, settle: float,
                              **kw: Any) -> None:
    """Run ``extract_async(root, "dest", source, **kw)``, cancel it ``settle`` seconds after ``started``
    (a ``threading.Event``) is set, and assert the cancel was honoured within ``timeout`` seconds."""
    import trio

    from sandbox_fs.archive import extract_async

    with trio.move_on_after(timeout) as outer:
        async with trio.open_nursery() as nursery:
            async def run() -> None:
                await extract_async(root, "dest", source, **kw)
                raise AssertionError("extraction should have been cancelled")

            nursery.start_soon(run)
            while not started.is_set():
                await trio.sleep(0.005)
            await trio.sleep(settle)
            nursery.cancel_scope.cancel()
    assert not outer.cancelled_caught, "cancel was not honoured"
