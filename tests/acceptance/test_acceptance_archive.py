"""Archive cases from public reports that the shared corpus and the rule tests do not reach.

Each test names its report and the attack in its docstring; each checks the
outside sentinel tree (``contained``), whatever the extractor answered.
"""

from __future__ import annotations

import io
import os
import stat
import struct
import tarfile
import zipfile
import zlib
from pathlib import Path

import pytest
from _acceptance import run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandbox_fs import SandboxError, open_root
from sandbox_fs.archive import ArchiveLimits, ExtractPolicy, extract

MTIME = 1_600_000_000


def member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", *, link: str = "", mode: int = 0o644,
           mtime: int = MTIME, pax: dict[str, str] | None = None) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode, info.mtime = kind, link, mode, mtime
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    if pax:
        info.pax_headers = dict(pax)
    return info, data


def tar_of(members: list[tuple[tarfile.TarInfo, bytes]], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for info, data in members:
            tf.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buf.getvalue()


def pax_records(fields: list[tuple[str, str]]) -> bytes:
    """A PAX extended header body (IEEE 1003.1 pax: ``"<len> <key>=<value>\\n"``, len counting itself)."""
    out = b""
    for key, value in fields:
        rec = f" {key}={value}\n".encode()
        n = len(rec) + 1
        while len(str(n)) + len(rec) != n:
            n += 1
        out += str(n).encode() + rec
    return out


def header_block(name: str, size: int, kind: bytes = tarfile.REGTYPE) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.type, info.mode, info.mtime = size, kind, 0o644, MTIME
    return info.tobuf(tarfile.USTAR_FORMAT)


def padded(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % 512)


def attempt(layout, data: bytes, dest: str = "dest", **kw):
    """Extract ``data`` into ``layout.ws/dest``; return the report or the SandboxError raised."""
    with open_root(layout.ws) as root:
        try:
            return extract(root, dest, io.BytesIO(data), **kw)
        except SandboxError as e:
            return e


def names_under(top: Path) -> set[str]:
    return {str(p.relative_to(top)) for p in top.rglob("*")} if top.exists() else set()


# ---------------------------------------------------------------- tar: links and metadata

@pytest.mark.parametrize("in_place", [False, True])
def test_cve_2024_12718_metadata_never_applied_through_planted_links(layout, contained, resolver, in_place):
    """CVE-2024-12718 (tarfile): mode and mtime of a member were applied to the file outside that an
    existing symlink of the destination named, so a "safe" extraction changed outside metadata."""
    dest = layout.ws / "dest"
    dest.mkdir()
    planted = [dest / "d", dest / "f"]
    os.symlink("../../outside/subdir", planted[0])
    os.symlink("../../outside/sentinel.txt", planted[1])
    data = tar_of([member("d", tarfile.DIRTYPE, mode=0o777, mtime=0),
                   member("f", data=b"x", mode=0o777, mtime=0)])
    attempt(layout, data, policy=ExtractPolicy(in_place=in_place))
    contained.check(planted=[p for p in planted if p.is_symlink()])
    for p in planted:
        if not p.is_symlink():
            assert stat.S_IMODE(p.lstat().st_mode) & 0o022 == 0, "group/other write must be cleared"


def test_cve_2025_4435_skipped_members_are_never_extracted(layout, contained, resolver):
    """CVE-2025-4435 (tarfile, errorlevel=0): a member the filter refused was extracted anyway; here a
    skipped symlink, FIFO and device must leave nothing a later member can write or link through."""
    data = tar_of([member("l", tarfile.SYMTYPE, link="../../outside"),
                   member("p", tarfile.FIFOTYPE),
                   member("c", tarfile.CHRTYPE),
                   member("h", tarfile.LNKTYPE, link="l"),
                   member("l/pwned.txt", data=b"pwned"),
                   member("ok", data=b"ok")])
    rep = attempt(layout, data, policy=ExtractPolicy(symlinks="skip", special_files="skip", hardlinks="skip"))
    contained.check()
    assert not isinstance(rep, SandboxError), rep
    assert {s.member for s in rep.skipped} >= {"l", "p", "c", "h"}
    dest = layout.ws / "dest"
    assert (dest / "ok").read_bytes() == b"ok"
    assert not (dest / "l").is_symlink() and not (dest / "p").exists() and not (dest / "c").exists()
    assert not (layout.outside / "pwned.txt").exists()


@pytest.mark.parametrize("links", [
    [("current", "."), ("parent", "current/..")],
    [("a", "b/c"), ("b", "."), ("c", "..")],
    [("x", "./"), ("y", "x/../outside")],
])
def test_cve_2025_4138_link_target_through_a_member_symlink(layout, contained, resolver, links):
    """CVE-2025-4138 / CVE-2025-4330 (tarfile data filter bypass): a symlink whose target is inside when
    read as text (``current/..``) leaves the destination once an earlier member symlink is followed."""
    members = [member(name, tarfile.SYMTYPE, link=target) for name, target in links]
    members.append(member(links[-1][0] + "/pwned.txt", data=b"pwned"))
    rep = attempt(layout, tar_of(members))
    assert isinstance(rep, SandboxError), "a member under a member symlink must be refused"
    contained.check()
    rep = attempt(layout, tar_of(members[:-1]), dest="dest2")
    contained.check()
    assert not (layout.outside / "pwned.txt").exists()


def test_cve_2025_4138_target_through_a_planted_symlink_of_the_destination(layout, contained, resolver):
    """CVE-2025-4138, on-disk form: ``cur -> .`` already in the destination turns the member target
    ``cur/../outside`` (lexically inside) into one that climbs out of it."""
    dest = layout.ws / "dest"
    dest.mkdir()
    os.symlink(".", dest / "cur")
    rep = attempt(layout, tar_of([member("up", tarfile.SYMTYPE, link="cur/.."),
                                  member("out", tarfile.SYMTYPE, link="cur/../../outside/secret.txt")]))
    contained.check()
    assert isinstance(rep, SandboxError), rep


@pytest.mark.parametrize("name", [
    "/../outside/pwned.txt",
    "//../outside/pwned.txt",
    "./../outside/pwned.txt",
    ".//..//outside/pwned.txt",
    "d/./../../outside/pwned.txt",
    "d/../d/../../outside/pwned.txt",
    "d/..//../outside/pwned.txt",
])
def test_cve_2001_1267_and_2016_6321_dotdot_spellings(layout, contained, resolver, name):
    """CVE-2001-1267 and CVE-2016-6321 (GNU tar, "POINTYFEATHER"): tar stripped a leading ``/`` or
    ``../`` and kept a ``..`` further in, so ``d/../../x`` or ``/../x`` still climbed out."""
    rep = attempt(layout, tar_of([member("ok", data=b"1"), member(name, data=b"pwned")], tarfile.GNU_FORMAT))
    assert isinstance(rep, SandboxError), rep
    contained.check()
    assert not (layout.outside / "pwned.txt").exists() and not (layout.ws / "dest").exists()


def test_cve_2016_6321_through_the_cli(layout, contained, tmp_path):
    """CVE-2016-6321 (GNU tar): ``etc/../../x`` survives tar's prefix stripping; the command line refuses it."""
    arc = tmp_path / "pointy.tar"
    arc.write_bytes(tar_of([member("etc/../../outside/pwned.txt", data=b"pwned")], tarfile.GNU_FORMAT))
    out = run_cli("extract", str(arc), "--into", str(layout.ws / "dest"))
    assert out.returncode != 0
    contained.check()
    assert not (layout.outside / "pwned.txt").exists()


def test_cve_2015_2304_absolute_link_targets_in_gnu_long_links(layout, contained, resolver):
    """CVE-2015-2304 (libarchive bsdcpio): a full pathname in the archive wrote anywhere; here the full
    pathname is the target of a hard link and of a symlink, carried in GNU ``././@LongLink`` records."""
    pad = "/" + "p" * 120 + "/.."
    secret = str(layout.outside / "secret.txt")
    for kind in (tarfile.LNKTYPE, tarfile.SYMTYPE):
        data = tar_of([member("h", kind, link=pad + secret), member("h2", kind, link=secret)], tarfile.GNU_FORMAT)
        with tarfile.open(fileobj=io.BytesIO(data)) as tf:
            assert tf.getmembers()[0].linkname == pad + secret, "the builder must use a long link record"
        rep = attempt(layout, data)
        assert isinstance(rep, SandboxError), rep
        contained.check()
        assert not (layout.ws / "dest").exists()


@pytest.mark.parametrize("in_place", [False, True])
def test_cve_2014_6407_planted_links_in_the_destination_are_replaced_not_written_through(
        layout, contained, resolver, in_place):
    """CVE-2014-6407 (Docker archive load): a hard link or symlink already at a member's name made the
    extractor write the member's data into the file outside it named."""
    dest = layout.ws / "dest"
    dest.mkdir()
    os.link(layout.outside / "secret.txt", dest / "hard")
    os.symlink("../../outside/sentinel.txt", dest / "soft")
    data = tar_of([member("hard", data=b"pwned-hard", mode=0o600), member("soft", data=b"pwned-soft")])
    attempt(layout, data, policy=ExtractPolicy(in_place=in_place))
    contained.check(planted=[p for p in (dest / "hard", dest / "soft")
                             if p.is_symlink() or p.stat().st_nlink > 1])
    assert layout.secret in (layout.outside / "secret.txt").read_text()


# ---------------------------------------------------------------- tar: header parsing

def _tarmageddon(pax_size: int, ustar_size: int, inner: bytes, outer_name: str = "payload.bin") -> bytes:
    body = pax_records([("size", str(pax_size))])
    return (header_block("PaxHeader/x", len(body), tarfile.XHDTYPE) + padded(body)
            + header_block(outer_name, ustar_size) + padded(inner) + b"\0" * 1024)


@pytest.mark.parametrize("order", ["pax-size-larger", "pax-size-zero"])
@pytest.mark.parametrize("how", ["stream", "host-path", "cli"])
def test_cve_2025_62518_pax_size_override_agrees_with_tarfile(layout, contained, tmp_path, order, how):
    """CVE-2025-62518 ("TARmageddon", tokio-tar): a PAX ``size`` that overrides the ustar size was
    ignored, so a file's data was parsed as further headers and smuggled members in. Whatever the
    override says, the extractor must see exactly the members tarfile sees, and none escapes."""
    inner = tar_of([member("smuggled.txt", data=b"smuggled"), member("../outside/pwned.txt", data=b"pwned")],
                   tarfile.USTAR_FORMAT)[:-1024]
    if order == "pax-size-larger":
        data = _tarmageddon(len(inner), 0, inner)
    else:
        data = _tarmageddon(0, len(inner), inner)
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        seen = [(m.name, m.size) for m in tf]
    arc = tmp_path / "mageddon.tar"
    arc.write_bytes(data)
    dest = layout.ws / "dest"
    if how == "cli":
        ok = run_cli("extract", str(arc), "--into", str(dest)).returncode == 0
    else:
        with open_root(layout.ws) as root:
            try:
                extract(root, "dest", io.BytesIO(data) if how == "stream" else str(arc))
                ok = True
            except SandboxError:
                ok = False
    contained.check()
    assert not (layout.outside / "pwned.txt").exists()
    if any(name.startswith("..") for name, _ in seen):
        assert not ok and not dest.exists(), "tarfile sees a climbing member: the archive must be refused"
    else:
        assert ok
        assert names_under(dest) == {name for name, _ in seen}
        assert (dest / "payload.bin").read_bytes() == inner


@pytest.mark.parametrize("kind", [tarfile.XHDTYPE, tarfile.XGLTYPE])
def test_cve_2019_20907_zero_length_pax_record_is_refused_promptly(layout, contained, tmp_path, kind):
    """CVE-2019-20907 (tarfile): a PAX record declaring length 0 made the header parser loop forever."""
    body = b"0 path=x\n" + pax_records([("path", "y")])
    data = header_block("PaxHeader/x", len(body), kind) + padded(body) + header_block("f", 1) + padded(b"1")
    arc = tmp_path / "loop.tar"
    arc.write_bytes(data + b"\0" * 1024)
    out = run_cli("extract", str(arc), "--into", str(layout.ws / "dest"), timeout_s=30)
    assert out.returncode != 0
    contained.check()
    assert not (layout.ws / "dest").exists()


@pytest.mark.parametrize("fields,data", [
    ([("GNU.sparse.size", "100"), ("GNU.sparse.numblocks", "1"), ("GNU.sparse.offset", "0")], b"x" * 10),
    ([("GNU.sparse.size", "100"), ("GNU.sparse.numblocks", "2"), ("GNU.sparse.offset", "0"),
      ("GNU.sparse.numbytes", "5"), ("GNU.sparse.offset", "1"), ("GNU.sparse.numbytes", "5")], b"x" * 10),
    ([("GNU.sparse.size", "100"), ("GNU.sparse.map", "0,10,20")], b"x" * 10),
    ([("GNU.sparse.size", "100"), ("GNU.sparse.map", "a,b")], b"x" * 10),
    ([("GNU.sparse.size", "x"), ("GNU.sparse.map", "0,10")], b"x" * 10),
    ([("GNU.sparse.realsize", str(1 << 50)), ("GNU.sparse.map", f"{(1 << 50) - 10},10")], b"x" * 10),
    ([("GNU.sparse.realsize", "100"), ("GNU.sparse.map", "200,10")], b"x" * 10),
    ([("GNU.sparse.major", "1"), ("GNU.sparse.minor", "0"), ("GNU.sparse.realsize", "100"),
      ("GNU.sparse.name", "../outside/pwned.txt")], b"1\n0\n10\n".ljust(512, b"\0") + b"x" * 10),
    ([("GNU.sparse.major", "1"), ("GNU.sparse.minor", "0"), ("GNU.sparse.realsize", "100")],
     b"99999999999999999999\n".ljust(512, b"\0")),
    ([("GNU.sparse.major", "1"), ("GNU.sparse.minor", "0"), ("GNU.sparse.realsize", "100")], b"2\n0\n"),
])
def test_cve_2019_9923_malformed_sparse_headers_fail_as_sandbox_errors(layout, contained, resolver, fields, data):
    """CVE-2019-9923 (GNU tar): malformed GNU sparse records in a PAX header crashed the reader. Every
    malformed map must end as a SandboxError (or a file bounded by the limits), nothing else."""
    body = pax_records(fields)
    raw = (header_block("PaxHeader/s", len(body), tarfile.XHDTYPE) + padded(body)
           + header_block("s", len(data)) + padded(data) + b"\0" * 1024)
    limits = ArchiveLimits(max_member_bytes=1 << 20, max_total_bytes=1 << 20)
    with open_root(layout.ws) as root:
        try:
            extract(root, "dest", io.BytesIO(raw), limits=limits)
        except SandboxError:
            assert not (layout.ws / "dest").exists()
    contained.check()
    assert not (layout.outside / "pwned.txt").exists()
    for p in (layout.ws / "dest").rglob("*") if (layout.ws / "dest").exists() else []:
        assert p.lstat().st_size <= 1 << 20


# ---------------------------------------------------------------- zip

@pytest.mark.parametrize("name", [
    "..\\outside\\pwned.txt",
    "a\\..\\..\\outside\\pwned.txt",
    "../outside/newdir/",
    "a/b/../../../outside/pwned.txt",
    "\\..\\outside\\pwned.txt",
])
def test_cve_2018_1002200_zip_slip_spellings(layout, contained, name):
    """CVE-2018-1002200 family (zip slip in plexus-archiver and others): backslash-separated and
    directory-entry forms of ``..`` that a check for ``../`` alone missed."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("ok", b"1")
        zf.writestr(zipfile.ZipInfo(name, (2020, 1, 1, 0, 0, 0)), b"" if name.endswith("/") else b"pwned")
    rep = attempt(layout, buf.getvalue())
    assert isinstance(rep, SandboxError), rep
    contained.check()
    assert not (layout.outside / "pwned.txt").exists() and not (layout.outside / "newdir").exists()


def _deflated_zip_declaring(name: str, declared: int, real: bytes) -> bytes:
    """A one-entry zip whose headers declare ``declared`` uncompressed bytes while the deflate stream
    inflates to ``real`` (and the CRC-32 is of ``real``)."""
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    body = comp.compress(real) + comp.flush()
    crc = zlib.crc32(real)
    fname = name.encode()
    local = struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, 8, 0, 0x21, crc, len(body), declared, len(fname), 0)
    central = struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 20, 20, 0, 8, 0, 0x21, crc, len(body), declared,
                          len(fname), 0, 0, 0, 0, 0, 0)
    cd_offset = len(local) + len(fname) + len(body)
    eocd = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 1, 1, len(central) + len(fname), cd_offset, 0)
    return local + fname + body + central + fname + eocd


def test_cve_2019_9674_zip_size_lie_writes_no_more_than_declared(layout, contained):
    """CVE-2019-9674 (zipfile decompression bomb): the declared uncompressed size is 1 KiB, the deflate
    stream holds 64 MiB of zeros; no more than what was declared (and checked) may reach the disk."""
    data = _deflated_zip_declaring("bomb.bin", 1024, b"\0" * (64 << 20))
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        assert zf.infolist()[0].file_size == 1024
    rep = attempt(layout, data)
    contained.check()
    bomb = layout.ws / "dest" / "bomb.bin"
    if isinstance(rep, SandboxError):
        assert not (layout.ws / "dest").exists()
    else:
        assert bomb.stat().st_size <= 1024


def test_cve_2018_20685_dot_members_leave_an_existing_destination_alone(layout, contained, tmp_path):
    """CVE-2018-20685 (scp): a server-sent name ``.`` or empty changed the mode of the client's target
    directory itself; ``.``/``./`` members must not change the destination's mode or times."""
    dest = layout.ws / "dest"
    dest.mkdir(mode=0o700)
    os.chmod(dest, 0o700)
    os.utime(dest, ns=(10**18, 10**18))
    tar = tmp_path / "dot.tar"
    tar.write_bytes(tar_of([member(".", tarfile.DIRTYPE, mode=0o777, mtime=0),
                            member("./", tarfile.DIRTYPE, mode=0o777, mtime=0), member("a", data=b"1")]))
    zbuf = io.BytesIO()
    with zipfile.ZipFile(zbuf, "w") as zf:
        info = zipfile.ZipInfo("./", (1980, 1, 1, 0, 0, 0))
        info.external_attr = (stat.S_IFDIR | 0o777) << 16 | 0x10
        zf.writestr(info, b"")
        zf.writestr("b", b"2")
    zpath = tmp_path / "dot.zip"
    zpath.write_bytes(zbuf.getvalue())
    for arc in (tar, zpath):
        for flags in ([], ["--in-place"]):
            run_cli("extract", str(arc), "--into", str(dest), *flags)
            after = dest.lstat()
            assert stat.S_IMODE(after.st_mode) == 0o700
            assert after.st_mtime_ns != 0, "the member's mtime 0 was applied to the destination"
    contained.check()


# ---------------------------------------------------------------- zip: ZIP64 locator

def _local(name: bytes, data: bytes) -> bytes:
    return struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 0, 0, 0x21, zlib.crc32(data), len(data), len(data),
                       len(name), 0) + name + data


def _central(name: bytes, data: bytes, offset: int) -> bytes:
    return struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 0, 0, 0x21, zlib.crc32(data), len(data), len(data),
                       len(name), 0, 0, 0, 0, 0, offset) + name


def _zip64_end(entries: int, cd_size: int, cd_off: int) -> bytes:
    return struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, entries, entries, cd_size, cd_off)


def zip64_two_directories(locator_offset: int | None = None) -> tuple[bytes, int, int]:
    """A zip with two ZIP64 end records: the one right before the locator lists ``ok``; an earlier one
    lists ``../outside/pwned.txt``.  The locator's offset names the honest record unless
    ``locator_offset`` says otherwise.  Returns (archive, honest record offset, hidden record offset)."""
    ok, evil = b"ok", b"../outside/pwned.txt"
    out = _local(ok, b"ok")
    evil_at = len(out)
    out += _local(evil, b"pwned")
    hidden_cd_at = len(out)
    hidden_cd = _central(evil, b"pwned", evil_at)
    out += hidden_cd
    hidden_rec = len(out)
    out += _zip64_end(1, len(hidden_cd), hidden_cd_at)
    cd_at = len(out)
    cd = _central(ok, b"ok", 0)
    out += cd
    honest_rec = len(out)
    out += _zip64_end(1, len(cd), cd_at)
    out += struct.pack("<4sLQL", b"PK\x06\x07", 0, honest_rec if locator_offset is None else locator_offset, 1)
    out += struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    return out, honest_rec, hidden_rec


def test_cve_2025_8291_zip64_locator_naming_another_record_is_refused(layout, contained):
    """CVE-2025-8291 (zipfile): the ZIP64 end-of-central-directory locator's offset was not checked;
    zipfile read the record right before it while other readers follow the offset, so one archive
    listed different members to different tools (here ``ok`` to zipfile, ``../outside/pwned.txt``
    to an offset-following reader). Such an archive is refused; the honest form extracts."""
    honest, _, hidden_at = zip64_two_directories()
    with zipfile.ZipFile(io.BytesIO(honest)) as zf:
        assert zf.namelist() == ["ok"], "the builder's honest form must be what zipfile reads"
    rep = attempt(layout, honest)
    assert not isinstance(rep, SandboxError), rep
    assert (layout.ws / "dest" / "ok").read_bytes() == b"ok"
    forked, _, _ = zip64_two_directories(locator_offset=hidden_at)
    rep = attempt(layout, forked, dest="dest2")
    assert isinstance(rep, SandboxError) and rep.code == "archive_format", rep
    assert not (layout.ws / "dest2").exists()
    contained.check()
    assert not (layout.outside / "pwned.txt").exists()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 1 << 12) | st.integers(0, (1 << 64) - 1))
def test_property_zip64_locator_accepted_only_where_it_points(layout, offset):
    """For any locator offset, the archive is extracted only when the offset names the record used."""
    data, honest_at, _ = zip64_two_directories(locator_offset=offset)
    with open_root(layout.ws) as root:
        if root.exists("d"):
            root.rmtree("d")
        try:
            extract(root, "d", io.BytesIO(data))
            accepted = True
        except SandboxError:
            accepted = False
    assert accepted == (offset == honest_at)
    assert not (layout.outside / "pwned.txt").exists()
