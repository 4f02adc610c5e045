"""Fuzz targets ``tar`` and ``zip``: archives through :func:`sandbox_fs.archive.extract`.

Each input is extracted into a fresh workspace beside the outside
sentinel.  Bits of the first byte choose the path taken: bit 0 extracts in
place (tar only), bit 1 reads the archive from a host file beside the
workspace (the batched kernel-side copy for plain tar) instead of memory,
bit 2 applies owners (header uid/gid reach fchown when run as root).  An
odd input length extracts into ``dest/`` rather than the workspace's top.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
import zipfile
from functools import partial

from ._target import Scene, Target

__all__ = ["TAR", "ZIP"]

_scene: Scene | None = None


def _get_scene() -> Scene:
    global _scene
    if _scene is None:
        _scene = Scene("archive")
    return _scene


def one_input(data: bytes, fmt: str) -> None:
    """Extract ``data`` as a ``fmt`` archive (``"tar"`` or ``"zip"``); raise a Finding if the invariant breaks."""
    from ... import open_root  # noqa: PLC0415
    from ...archive import ArchiveLimits, ExtractPolicy, extract  # noqa: PLC0415

    scene = _get_scene()
    scene.reset()
    flags = data[0] if data else 0
    source: object = io.BytesIO(data)
    if flags & 2:
        path = os.path.join(scene.base, "input.bin")
        # host-access: writes the fuzz input to the harness's own scratch file beside (not in) the workspace
        with open(path, "wb") as fh:
            fh.write(data)
        source = path
    limits = ArchiveLimits(max_members=2000, max_total_bytes=8 << 20, max_member_bytes=4 << 20,
                           max_header_bytes=64 << 10, max_input_bytes=16 << 20, ratio_grace_bytes=1 << 20)
    policy = ExtractPolicy(in_place=bool(flags & 1) and fmt == "tar", preserve_owner=bool(flags & 4))

    def step() -> None:
        with open_root(scene.ws) as root:
            extract(root, "dest" if len(data) % 2 else ".", source, format=fmt, limits=limits, policy=policy)

    scene.run(step)


def _tar(members: list[tuple[str, bytes, bytes, str]], fmt: int = tarfile.PAX_FORMAT, comp: str = "") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=f"w:{comp}" if comp else "w", format=fmt) as tf:
        for name, typ, data, link in members:
            ti = tarfile.TarInfo(name)
            ti.type, ti.linkname, ti.mode, ti.mtime = typ, link, 0o644, 1_600_000_000
            ti.size = len(data) if typ == tarfile.REGTYPE else 0
            tf.addfile(ti, io.BytesIO(data) if typ == tarfile.REGTYPE else None)
    return buf.getvalue()


def tar_seeds() -> list[bytes]:
    """Small tar seeds: plain, GNU long names, each compression, links that aim outside, duplicates."""
    r, d, s, h = tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE
    basic = [("d", d, b"", ""), ("d/f", r, b"hello\n", ""), ("d/l", s, b"", "f"), ("h", h, b"", "d/f")]
    return [
        _tar(basic), _tar(basic, comp="gz"), _tar(basic, comp="xz"),
        _tar(basic + [("x" * 150 + "/y" * 20, r, b"long", "")], fmt=tarfile.GNU_FORMAT),
        _tar([("a", s, b"", "."), ("c", s, b"", "a/.."), ("c/x", r, b"x", ""),
              ("h", h, b"", "../outside/secret.txt"), ("e", s, b"", "../outside")]),
        _tar([("x", r, b"1", ""), ("x", r, b"2", ""), ("x", d, b"", ""), ("y", s, b"", "x")]),
    ]


def _zip(entries: list[tuple[str, int, bytes]], comp: int = zipfile.ZIP_DEFLATED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=comp) as zf:
        for name, mode, data in entries:
            zi = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            zi.create_system, zi.external_attr, zi.compress_type = 3, mode << 16, comp
            zf.writestr(zi, data)
    return buf.getvalue()


def zip_seeds() -> list[bytes]:
    """Small zip seeds: directories, a symlink, stored and deflated members, a zip slip."""
    reg, lnk = stat.S_IFREG | 0o644, stat.S_IFLNK | 0o777
    return [
        _zip([("d/", stat.S_IFDIR | 0o755, b""), ("d/f", reg, b"hello\n"), ("l", lnk, b"d/f")]),
        _zip([("a", reg, b"A" * 100), ("b", stat.S_IFREG | 0o4755, b"B")], comp=zipfile.ZIP_STORED),
        _zip([("../outside/x", reg, b"x"), ("l", lnk, b"../outside"), ("l/y", reg, b"y")]),
    ]


TAR_TOKENS = (b"ustar\x00", b"ustar  \x00", b"00", b"path=", b"linkpath=", b"size=", b"uid=", b"gid=",
              b"mtime=", b"GNU.sparse.", b"././@LongLink", b"../", b"/etc/", b"outside/secret.txt",
              b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00", b"0000644\x00", b"0000755\x00", b"0004755\x00")
ZIP_TOKENS = (b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06", b"PK\x06\x06", b"PK\x06\x07", b"PK\x07\x08",
              b"\x01\x00", b"\x75\x70", b"../", b"outside/secret.txt", b"\xa4\x81", b"\xff\xa1", b"\xed\x41")

TAR = Target("tar", partial(one_input, fmt="tar"), tar_seeds, TAR_TOKENS, native=True)
ZIP = Target("zip", partial(one_input, fmt="zip"), zip_seeds, ZIP_TOKENS)
