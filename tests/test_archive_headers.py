"""Odd but valid (and truncated or garbage) tar shapes extract the same tree, report or error
whether members are staged (created relative to a kept parent-directory fd) or written in
place; and the member-name fast path matches the name rules written plainly.
"""

from __future__ import annotations

import gzip
import io
import os
import tarfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_archive_builders import tar_bytes, ti

from sandbox_fs import SandboxError, open_root
from sandbox_fs.archive import ExtractPolicy, extract


def _header(name: str, kind: bytes = tarfile.REGTYPE, *, fmt: int = tarfile.USTAR_FORMAT, size: int = 0,
            linkname: str = "", mode: int = 0o644, uid: int = 1000, mtime: int = 1_700_000_000) -> bytes:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.linkname, info.mode, info.uid, info.mtime = kind, size, linkname, mode, uid, mtime
    return info.tobuf(fmt, "utf-8", "surrogateescape")[-512:]


def _with_checksum(block: bytearray) -> bytes:
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % (sum(block) & 0o777777)
    return bytes(block)


_PLAIN = [
    _header("a.txt", size=5),
    _header("dir/", tarfile.DIRTYPE),
    _header("dir//", tarfile.DIRTYPE),
    _header("lnk", tarfile.SYMTYPE, linkname="a.txt"),
    _header("hard", tarfile.LNKTYPE, linkname="a.txt"),
    _header("p" * 90 + "/" + "q" * 90),  # ustar prefix field
    _header("p" * 90 + "/" + "d" * 90, tarfile.DIRTYPE),
    _header("caf\u00e9/\udcff-not-utf8", size=3, fmt=tarfile.GNU_FORMAT),
    _header("big", size=(8 << 30) - 1, fmt=tarfile.GNU_FORMAT),  # 11 octal digits
    _header("huge", size=8 << 30, fmt=tarfile.GNU_FORMAT),  # base-256: tarfile's
    _header("gnu.txt", fmt=tarfile.GNU_FORMAT, mode=0o4777, mtime=0),
    _header("neg-mtime", fmt=tarfile.GNU_FORMAT, mtime=-5),  # base-256: tarfile's
    _header("v7dir/", tarfile.AREGTYPE),  # old V7 directory
    _header("v7file", tarfile.AREGTYPE, size=7),
]


_FIELDS = [(0, 100), (100, 8), (108, 8), (116, 8), (124, 12), (136, 12), (148, 8), (156, 1), (157, 100),
           (329, 8), (337, 8), (345, 155)]
_BYTES = st.lists(st.sampled_from(list(b"0178 \0\x80\xff\x1c\t_+-/.a\xc3\xa9x5")), min_size=0, max_size=14)


# ---------------------------------------------------------------- whole archives

def _blocks(*parts: bytes) -> bytes:
    return b"".join(p + b"\0" * (-len(p) % 512) for p in parts)


def _archives() -> dict[str, bytes]:
    files = [ti("top", "dir"), ti("top/a.txt", data=b"hello"), ti("top/sub", "dir", mode=0o700),
             ti("top/sub/x", data=b"x" * 1000, mode=0o751), ti("top/l", "symlink", linkname="a.txt"),
             ti("top/h", "hardlink", linkname="top/a.txt"), ti("p" * 90 + "/" + "q" * 90, data=b"prefix"),
             ti("top/a.txt", data=b"replaced")]
    out = {f"fmt{fmt}": tar_bytes(files, fmt=fmt) for fmt in (tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT,
                                                               tarfile.PAX_FORMAT)}
    out["pax-path"] = tar_bytes([ti("plain", data=b"1"), ti("short", data=b"2", pax={"path": "from/pax"}),
                                 ti("after", data=b"3")])
    out["gnu-long"] = tar_bytes([ti("n" * 150, data=b"long"), ti("next", data=b"n")], fmt=tarfile.GNU_FORMAT)
    glob = tarfile.TarInfo("g")
    glob.type = tarfile.XGLTYPE
    out["global-pax"] = _blocks(_header("one", size=1), b"1",
                                tarfile.TarInfo.create_pax_global_header({"mtime": "5"}),
                                _header("two", size=1), b"2") + b"\0" * 1024
    out["v7-dir"] = _blocks(_header("v7/", tarfile.AREGTYPE), _header("v7/f", size=2), b"ok") + b"\0" * 1024
    out["dir-with-size"] = _blocks(_header("d", tarfile.DIRTYPE, size=512), _header("d/f", size=1), b"z")
    out["no-eof-blocks"] = _blocks(_header("f", size=3), b"abc")
    out["truncated-padding"] = _header("f", size=3) + b"abc" + b"\0" * 10
    out["truncated-data"] = _header("f", size=3000) + b"abc"
    out["truncated-header"] = _blocks(_header("f", size=3), b"abc") + _header("g")[:100]
    out["garbage-after"] = _blocks(_header("f", size=3), b"abc") + b"\x01" * 512 + _blocks(_header("g", size=1), b"g")
    out["bad-second-checksum"] = _blocks(_header("f", size=1), b"f") + b"X" + _header("g")[1:]
    out["special"] = tar_bytes([ti("fifo", "fifo"), ti("after", data=b"a")])
    unknown = tarfile.TarInfo("unknown")
    unknown.type, unknown.size = b"Z", 10_000  # tarfile skips its data blocks
    out["unknown-with-data"] = _blocks(unknown.tobuf(tarfile.USTAR_FORMAT), b"u" * 10_000,
                                       _header("after", size=1), b"a") + b"\0" * 1024
    out["unknown-truncated"] = _blocks(unknown.tobuf(tarfile.USTAR_FORMAT), b"u" * 5_000)
    out["interleaved"] = tar_bytes([ti("a/1", data=b"1"), ti("b/1", data=b"2"), ti("a/2", data=b"3"),
                                    ti("top", data=b"4"), ti("a/c/1", data=b"5"), ti("a/3", data=b"6"),
                                    ti("b", "dir", mode=0o750), ti("b/2", data=b"7"), ti("a/1", data=b"8")])
    out["escape"] = tar_bytes([ti("ok", data=b"1"), ti("../evil", data=b"x")])
    out["through-link"] = tar_bytes([ti("l", "symlink", linkname="."), ti("l/f", data=b"x")])
    return out


def _tree(top: str) -> list[tuple]:
    rows = []
    for dirpath, dirnames, filenames in os.walk(top):
        for n in sorted(dirnames + filenames):
            p = os.path.join(dirpath, n)
            st_ = os.lstat(p)
            body = os.readlink(p) if os.path.islink(p) else (Path(p).read_bytes() if os.path.isfile(p) else None)
            rel = os.path.relpath(p, top)
            mtime = st_.st_mtime_ns
            if os.path.isdir(p) and not os.path.islink(p) and mtime > 1_750_000_000 * 10**9:
                mtime = "now"  # the destination or an implicit parent: not from the archive
            rows.append((rel, st_.st_mode, mtime,
                         st_.st_nlink if os.path.isfile(p) else 0, body))
    return sorted(rows)


def _outcome(tmp_path, data: bytes, how: str, in_place: bool):
    dest = tmp_path / f"d{len(list(tmp_path.iterdir()))}"
    dest.mkdir()
    src = tmp_path / "a.tar"
    src.write_bytes(data)
    source = {"file": str(src), "stream": io.BytesIO(data), "gz": io.BytesIO(gzip.compress(data))}[how]
    try:
        with open_root(dest) as root:
            rep = extract(root, "out", source, policy=ExtractPolicy(in_place=in_place, special_files="skip"))
        result = ("ok", rep.members, rep.files, rep.dirs, rep.symlinks, rep.hardlinks, rep.bytes_written,
                  [(s.member, s.rule) for s in rep.skipped])
    except SandboxError as exc:
        result = ("error", type(exc).__name__, getattr(exc, "rule", None), str(exc))
    return result, _tree(str(dest))


@pytest.mark.parametrize("name", sorted(_archives()))
@pytest.mark.parametrize("how", ["file", "stream", "gz"])
def test_staging_and_in_place_extract_the_same(tmp_path, name, how):
    data = _archives()[name]
    seen = [_outcome(tmp_path, data, how, in_place) for in_place in (False, True)]
    if seen[0][0][0] == "ok":
        # staging (creates relative to a kept parent-directory fd) and in place (Root.open_fd) agree
        assert seen[0] == seen[1], name


# ---------------------------------------------------------------- member names

def _normalize_reference(raw: bytes, limits) -> tuple:
    """The name rules written plainly (no fast path): ('ok', path) or ('refused', rule)."""
    import re

    from sandbox_fs.archive._names import NAME_MAX
    if b"\0" in raw:
        return ("refused", "nul_in_name")
    if raw.startswith((b"/", b"\\")):
        return ("refused", "absolute_name")
    if re.match(rb"^[A-Za-z]:", raw):
        return ("refused", "drive_letter")
    if b".." in re.split(rb"[/\\]", raw):
        return ("refused", "dotdot")
    comps = [c for c in raw.split(b"/") if c and c != b"."]
    if any(len(c) > NAME_MAX for c in comps):
        return ("refused", "name_too_long")
    if len(comps) > limits.max_depth:
        return ("refused", "max_depth")
    path = b"/".join(comps)
    if len(path) > limits.max_path_bytes:
        return ("refused", "max_path_bytes")
    return ("ok", path)


_NAME_PARTS = st.sampled_from([b".", b"./", b"/", b"..", b"a", b"bc", b"C:", b"\\", b"\0", b"x" * 256, b":"])


@settings(max_examples=1500, deadline=None)
@given(parts=st.lists(_NAME_PARTS, max_size=8), depth=st.integers(1, 4), path_bytes=st.integers(1, 300))
def test_member_name_fast_path_matches_the_rules(parts, depth, path_bytes):
    from sandbox_fs.archive import ArchiveLimits
    from sandbox_fs.archive._errors import ArchiveLimitError, UnsafeArchiveMemberError
    from sandbox_fs.archive._names import normalize_member
    limits = ArchiveLimits(max_depth=depth, max_path_bytes=path_bytes)
    raw = b"".join(parts)
    try:
        got = ("ok", normalize_member(raw, limits))
    except UnsafeArchiveMemberError as exc:
        got = ("refused", exc.rule)
    except ArchiveLimitError as exc:
        got = ("refused", exc.limit)
    assert got == _normalize_reference(raw, limits)
