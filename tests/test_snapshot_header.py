r"""Persist's own tar header writer (``sandbox_fs.snapshot._header``) against tarfile, GNU tar and bsdtar.

Persist builds its member headers itself instead of with
:meth:`tarfile.TarInfo.tobuf`; the condition (issue 16, "the decision on
parsing and writing") is that every header it writes reads back the same in
three independent readers.  So:

* **bytes**: for every field value the writer accepts, its bytes are exactly
  ``tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")``.  It accepts
  less than tobuf, on purpose: mtime is an ``int`` (persist records whole
  seconds; tobuf writes a float as a decimal PAX ``mtime`` record), no
  ``uname``/``gname`` (persist records no owner names), and only the four
  typeflags persist writes (tobuf also fills device numbers for device
  members), and no name persist cannot have (empty, holding NUL, or a
  non-directory's ending in ``/``, which tarfile reads back without the
  ``/`` from a PAX path but with it from a ustar name).  These are refused with ``TypeError``/``ValueError``, never
  written differently.
* **readers**: for generated batches of entries, the decoded (name bytes,
  type, size, mode, mtime, link target, uid, gid) tuples from tarfile,
  from GNU tar's listing and from bsdtar's are identical.  The batches cover
  names of any bytes but NUL (``/`` separates components; not UTF-8,
  control characters, quotes, backslashes, the listing separators
  ``" -> "`` and ``" link to "``) up to the staged path limit, link targets
  of any bytes, sizes past 8 GiB (the archive is a sparse file: each
  member's data is a hole, so a 64 GiB member costs nothing), mtimes from
  year 1 through year 33658 (negative, zero, past ``8 ** 11``), every mode
  ``0..0o7777`` (set-id and sticky bits) and uid/gid up to ``2 ** 32 - 1``
  (GNU tar refuses larger ones: uid_t is 32 bits).

How each tool's listing is read back (escaping normalized to bytes):

* GNU tar: ``LC_ALL=C tar --list --verbose --full-time --numeric-owner
  --utc --quoting-style=c``: every name and target is a C string literal
  (octal escapes for every byte outside printable ASCII; a ``??`` trigraph
  is split into two adjacent literals), so ``" -> "`` and ``" link to "``
  are unambiguous; the time is printed to the second.  GNU tar 1.34 warns
  that it does not know ``hdrcharset`` and reads the record's bytes as they
  are, which is what the keyword asks for; that warning is the only
  stderr allowed.
* bsdtar (``LC_ALL=C.UTF-8``: in the C locale libarchive refuses to
  convert UTF-8 names): ``bsdtar -tv`` over the archive gives kind, mode,
  uid, gid and size exactly, the name and link target with its escaping
  (``\\``, C letter escapes, ``\ooo``; it does not quote, so the line is
  compared with the expected entry as bsdtar would print it, never split at
  a guessed ``" -> "``) and the time only as a date (to the day, or the
  minute within six months of now); ``bsdtar -cf - --format=mtree @archive``
  (libarchive reads the archive and describes it: names and targets in
  octal escapes, mtime to the nanosecond, mode, type, uid, gid) gives the
  exact mtimes.  bsdtar copies every member's data into that description,
  so it reads a header-only twin of the archive whose regular members have
  size 0 (mtime, names, targets, modes and ids encoded exactly as in the
  archive; sizes are checked by ``-tv``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandbox_fs.archive import STAGED_PATH_MAX
from sandbox_fs.snapshot._header import MemberHeader, encode_header

GNU_TAR = shutil.which("tar")
BSDTAR = shutil.which("bsdtar")
_KIND_OF = {tarfile.REGTYPE: "file", tarfile.DIRTYPE: "dir", tarfile.SYMTYPE: "symlink", tarfile.LNKTYPE: "hardlink"}
_KIND_CHAR = {"-": "file", "d": "dir", "l": "symlink", "h": "hardlink"}
YEAR_1 = -62135596800  # 0001-01-01T00:00:00Z
FAR_FUTURE = 10 ** 12  # year 33658
Entry = tuple[bytes, str, int, int, int, bytes, int, int]  # name, kind, size, mode, mtime, link, uid, gid


def _is_gnu_tar() -> bool:
    if GNU_TAR is None:
        return False
    out = subprocess.run([GNU_TAR, "--version"], capture_output=True, text=True, check=False).stdout
    return "GNU tar" in out


needs_gnu_tar = pytest.mark.skipif(not _is_gnu_tar(), reason="GNU tar is not installed (scripts/setup.sh installs it)")
needs_bsdtar = pytest.mark.skipif(BSDTAR is None,
                                  reason="bsdtar is not installed (libarchive-tools; scripts/setup.sh installs it)")


# ---------------------------------------------------------------------------------------------
# Generated entries


_FRAGMENTS = [b" -> ", b" link to ", b"\\", b"\\012", b"\n", b"\t", b"\r", b'"', b"??/", b"??", b"\xc3\xa9",
              b"\xe2\x80\x8b", b"\xef\xbf\xbe", b"\xff", b"\xed\xa0\x80", b"\xc0\xaf", b"\x7f", b"\x01", b"=",
              b"#", b" ", b"%", b"-", b"*"]


def _clean(raw: bytes) -> bytes:
    """One path component: no NUL, no ``/``, at most NAME_MAX (255) bytes, never ``.`` or ``..``."""
    comp = raw.replace(b"\0", b"_").replace(b"/", b"_")[:255]
    return b"_" + comp if comp in (b".", b"..") else comp


_component = st.one_of(
    st.lists(st.one_of(st.binary(min_size=1, max_size=12), st.sampled_from(_FRAGMENTS)),
             min_size=1, max_size=5).map(b"".join),
    st.binary(min_size=240, max_size=255),
).map(_clean)
_path = st.lists(_component, min_size=1, max_size=24)
_mtime = st.one_of(st.sampled_from([YEAR_1, -(8 ** 11), -1, 0, 1, 8 ** 11 - 1, 8 ** 11, 253402300799, FAR_FUTURE]),
                   st.integers(YEAR_1, FAR_FUTURE))
_size = st.one_of(st.integers(0, 2048), st.sampled_from([8 ** 11 - 1, 8 ** 11, 8 ** 11 + 1]),
                  st.integers(8 ** 11, 1 << 36))
_id = st.one_of(st.just(0), st.sampled_from([8 ** 7 - 1, 8 ** 7, 2 ** 32 - 1]), st.integers(0, 2 ** 32 - 1))
_link_text = st.binary(min_size=1, max_size=300).map(lambda b: b.replace(b"\0", b"_"))


def _join(parts: list[bytes], limit: int) -> bytes:
    """``parts`` joined by ``/``, cut at a component boundary to at most ``limit`` bytes (one component at least)."""
    out = parts[0][:limit]
    for p in parts[1:]:
        if len(out) + 1 + len(p) > limit:
            break
        out += b"/" + p
    return out


@st.composite
def _member(draw: st.DrawFn, index: int) -> MemberHeader:
    """One entry; ``e<index>-`` starts its first component, so names in a batch never collide."""
    kind = draw(st.sampled_from(list(_KIND_OF)))
    parts = draw(_path)
    parts[0] = (b"e%d-" % index + parts[0])[:255]
    limit = STAGED_PATH_MAX - (1 if kind == tarfile.DIRTYPE else 0)
    name = _join(parts, limit)
    link = b""
    if kind == tarfile.SYMTYPE:
        link = draw(st.one_of(_link_text, _path.map(lambda p: _join(p, STAGED_PATH_MAX))))
    elif kind == tarfile.LNKTYPE:
        link = _join(draw(_path), STAGED_PATH_MAX)
    return MemberHeader(
        name=os.fsdecode(name), kind=kind, mode=draw(st.integers(0, 0o7777)), mtime=draw(_mtime),
        size=draw(_size) if kind == tarfile.REGTYPE else 0, linkname=os.fsdecode(link),
        uid=draw(_id), gid=draw(_id))


@st.composite
def _batch(draw: st.DrawFn, max_size: int = 40) -> list[MemberHeader]:
    n = draw(st.integers(1, max_size))
    return [draw(_member(i)) for i in range(n)]


def _expected(m: MemberHeader) -> Entry:
    return (os.fsencode(m.name).rstrip(b"/"), _KIND_OF[m.kind], m.size, m.mode & 0o7777, m.mtime,
            os.fsencode(m.linkname), m.uid, m.gid)


def _write_archive(path: Path, members: list[MemberHeader]) -> None:
    """Headers from the writer; each regular member's data is a hole (a sparse file, not real data)."""
    with open(path, "wb") as fh:
        for m in members:
            fh.write(encode_header(m))
            if m.size:
                fh.seek(m.size + (-m.size % 512), os.SEEK_CUR)
        fh.write(bytes(1024))


# ---------------------------------------------------------------------------------------------
# Readers


def _read_tarfile(path: Path) -> list[Entry]:
    out = []
    with tarfile.open(path, encoding="utf-8", errors="surrogateescape") as tf:
        for ti in tf:
            assert ti.type in _KIND_OF, ti.type
            assert float(ti.mtime).is_integer(), ti.mtime
            out.append((os.fsencode(ti.name), _KIND_OF[ti.type], ti.size, ti.mode, int(ti.mtime),
                        os.fsencode(ti.linkname), ti.uid, ti.gid))
    return out


def _mode_bits(s: bytes) -> int:
    """Permission bits of an ``ls -l`` mode string's last nine characters (``rwsr-S--t`` ...)."""
    text = s.decode("ascii")
    bits = 0
    for i, special, letters in ((0, 0o4000, "sS"), (3, 0o2000, "sS"), (6, 0o1000, "tT")):
        r, w, x = text[i:i + 3]
        shift = 6 - i
        assert r in "r-" and w in "w-" and x in "x-" + letters, text
        bits |= (4 << shift if r == "r" else 0) | (2 << shift if w == "w" else 0)
        if x in ("x", letters[0]):
            bits |= 1 << shift
        if x in letters:
            bits |= special
    return bits


def _days_from_civil(y: int, m: int, d: int) -> int:
    """Days from 1970-01-01 to a proleptic Gregorian date (any year; the civil-from-days algorithm, inverted)."""
    y -= m <= 2
    era = y // 400
    yoe = y - era * 400
    doy = (153 * (m + (-3 if m > 2 else 9)) + 2) // 5 + d - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


_C_ESCAPES = {ord("a"): 7, ord("b"): 8, ord("f"): 12, ord("n"): 10, ord("r"): 13, ord("t"): 9, ord("v"): 11}


def _c_literals(line: bytes, i: int) -> tuple[bytes, int]:
    """Decode the adjacent C string literals starting at ``line[i]`` (a ``"``); returns (bytes, end index)."""
    out = bytearray()
    assert line[i:i + 1] == b'"', line[i:]
    while line[i:i + 1] == b'"':
        i += 1
        while line[i:i + 1] != b'"':
            assert i < len(line), line
            c = line[i]
            if c != 0x5C:  # backslash
                out.append(c)
                i += 1
                continue
            e = line[i + 1]
            m = re.match(rb"[0-7]{1,3}", line[i + 1:i + 4])
            if m:
                out.append(int(m.group(), 8))
                i += 1 + len(m.group())
            else:
                out.append(_C_ESCAPES.get(e, e))
                i += 2
        i += 1
    return bytes(out), i


_GNU_LINE = re.compile(rb'([-dlh])([-rwxsStT]{9}) (\d+)/(\d+) +(\d+) '
                       rb'(?:(-?\d+)-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)|(-?\d+)) +(?=")')


def _read_gnu_tar(path: Path) -> list[Entry]:
    p = subprocess.run([GNU_TAR or "tar", "--list", "--verbose", "--full-time", "--numeric-owner", "--utc",
                        "--quoting-style=c", "-f", str(path)], capture_output=True, check=False,
                       env={**os.environ, "LC_ALL": "C", "TZ": "UTC"})
    noise = [ln for ln in p.stderr.decode(errors="replace").splitlines()
             if not ln.endswith("tar: Ignoring unknown extended header keyword 'hdrcharset'")]
    assert p.returncode == 0 and not noise, (p.returncode, noise)
    out = []
    for line in p.stdout.splitlines():
        m = _GNU_LINE.match(line)
        assert m, line
        kind, uid, gid, size = _KIND_CHAR[m.group(1).decode()], int(m.group(3)), int(m.group(4)), int(m.group(5))
        if m.group(12) is not None:
            mtime = int(m.group(12))  # GNU tar prints seconds when it cannot print a date
        else:
            y, mo, d, hh, mm, ss = (int(g) for g in m.group(6, 7, 8, 9, 10, 11))
            mtime = _days_from_civil(y, mo, d) * 86400 + hh * 3600 + mm * 60 + ss
        name, i = _c_literals(line, m.end())
        link = b""
        sep = {"symlink": b" -> ", "hardlink": b" link to "}.get(kind)
        if sep is not None:
            assert line[i:i + len(sep)] == sep, line
            link, i = _c_literals(line, i + len(sep))
        assert i == len(line), line
        out.append((name.rstrip(b"/"), kind, size, _mode_bits(m.group(2)), mtime, link, uid, gid))
    return out


def _unescape_octal(s: bytes) -> bytes:
    """mtree's escaping: ``\\ooo`` (exactly three octal digits) for a byte; nothing else is escaped."""
    return re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), s)


def _unescape_bsdtar(s: bytes) -> bytes:
    """bsdtar -tv's escaping: ``\\\\``, C letter escapes and ``\\ooo``; other bytes as they are."""
    def one(m: re.Match[bytes]) -> bytes:
        g = m.group(1)
        return bytes([int(g, 8)]) if g[:1].isdigit() else bytes([_C_ESCAPES.get(g[0], g[0])])
    return re.sub(rb"\\([0-7]{3}|.)", one, s, flags=re.S)


_BSD_LINE = re.compile(rb"([-dlh])([-rwxsStT]{9}) +\d+ +(\d+) +(\d+) +(\d+) +(\w{3}) +(\d+) +(?:(\d+)|(\d\d):(\d\d)) (.*)")
_MTREE_TYPES = {b"file": "file", b"dir": "dir", b"link": "symlink"}
_MONTHS = b"Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec".split()


def _civil(mtime: int) -> tuple[int, int, int, int, int]:
    """(year, month, day, hour, minute) in UTC of ``mtime`` (proleptic Gregorian, any year)."""
    days, secs = divmod(mtime, 86400)
    z = days + 719468
    era = z // 146097
    doe = z - era * 146097
    yoe = (doe - doe // 1460 + doe // 36524 - doe // 146096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    day = doy - (153 * mp + 2) // 5 + 1
    month = mp + 3 if mp < 10 else mp - 9
    return yoe + era * 400 + (month <= 2), month, day, secs // 3600, secs % 3600 // 60


def _bsdtar(args: list[str]) -> bytes:
    p = subprocess.run([BSDTAR or "bsdtar", *args], capture_output=True, check=False,
                       env={**os.environ, "LC_ALL": "C.UTF-8", "TZ": "UTC"})
    assert p.returncode == 0 and not p.stderr, (p.returncode, p.stderr)
    return p.stdout


def _read_bsdtar_mtree(path: Path) -> list[Entry]:
    """Entries as libarchive reads them, from bsdtar's mtree description of the archive (name order).

    bsdtar reads every member's data to copy it into the description, so
    this is given the archive's header-only twin (see :func:`_check_all_readers`):
    its sizes are 0 and :func:`_read_bsdtar_list` checks them instead.
    Hard links are described as plain files (mtree has no hard-link
    target); the list says which they are.
    """
    out = []
    for line in _bsdtar(["-cf", "-", "--format=mtree", "--options", "!all,type,mode,time,size,link,uid,gid",
                         f"@{path}"]).splitlines():
        if line.startswith(b"#"):
            continue
        assert line.startswith(b"./"), line  # no "/set" defaults: every line names an entry
        words = line.split(b" ")
        kv = dict(w.split(b"=", 1) for w in words[1:])
        sec, _, frac = kv[b"time"].partition(b".")
        assert frac.strip(b"0") == b"", kv  # whole seconds
        out.append((_unescape_octal(words[0][2:]), _MTREE_TYPES[kv[b"type"]], int(kv.get(b"size", b"0")),
                    int(kv[b"mode"], 8), int(sec), _unescape_octal(kv.get(b"link", b"")), int(kv[b"uid"]),
                    int(kv[b"gid"])))
    return sorted(out)


def _read_bsdtar_list(path: Path, expected: list[Entry]) -> None:
    """Check ``bsdtar -tv``'s lines (archive order) against ``expected``, at the precision it prints.

    Kind, mode, uid, gid and size are exact; the name and link target are
    compared as the bytes bsdtar prints (after its escaping); the time as
    the date it prints (``Mon DD  YYYY``, or ``Mon DD HH:MM`` within six
    months of now).
    """
    lines = _bsdtar(["-tvf", str(path)]).splitlines()
    assert len(lines) == len(expected), lines
    for line, (name, kind, size, mode, mtime, link, uid, gid) in zip(lines, expected):
        m = _BSD_LINE.fullmatch(line)
        assert m, line
        assert (_KIND_CHAR[m.group(1).decode()], _mode_bits(m.group(2)), int(m.group(3)), int(m.group(4)),
                int(m.group(5))) == (kind, mode, uid, gid, size), line
        year, month, day, hour, minute = _civil(mtime)
        assert (_MONTHS.index(m.group(6)) + 1, int(m.group(7))) == (month, day), (line, mtime)
        if m.group(8) is not None:
            assert int(m.group(8)) == year, (line, mtime)
        else:
            assert (int(m.group(9)), int(m.group(10))) == (hour, minute), (line, mtime)
        shown = name + b"/" if kind == "dir" else name
        shown += {"symlink": b" -> " + link, "hardlink": b" link to " + link}.get(kind, b"")
        assert _unescape_bsdtar(m.group(11)) == shown, line


def _check_all_readers(tmp_path: Path, members: list[MemberHeader]) -> None:
    """tarfile, GNU tar and bsdtar read every header of ``members`` back as written.

    bsdtar is read twice: ``-tv`` over the archive itself, and its mtree
    description (exact mtime, names and targets) over a header-only twin
    whose regular members have size 0 (their data is then not copied; the
    mtime, name and link fields are encoded exactly as in the archive).
    """
    path, twin = tmp_path / "headers.tar", tmp_path / "twin.tar"
    _write_archive(path, members)
    _write_archive(twin, [m._replace(size=0) for m in members])
    expected = [_expected(m) for m in members]
    assert _read_tarfile(path) == expected
    assert _read_gnu_tar(path) == expected
    _read_bsdtar_list(path, expected)
    as_mtree = sorted((e[0], "file" if e[1] == "hardlink" else e[1], 0, *e[3:5],
                       e[5] if e[1] == "symlink" else b"", *e[6:]) for e in expected)
    assert _read_bsdtar_mtree(twin) == as_mtree


# ---------------------------------------------------------------------------------------------
# Tests


def _tobuf(m: MemberHeader) -> bytes:
    ti = tarfile.TarInfo(m.name)
    ti.type, ti.mode, ti.mtime, ti.size, ti.linkname, ti.uid, ti.gid = m.kind, m.mode, m.mtime, m.size, \
        m.linkname, m.uid, m.gid
    ti.uname = ti.gname = ""
    return ti.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=_member(0), mode_high=st.integers(0, 0o7), uid=st.integers(0, 1 << 70))
def test_bytes_equal_tarfile_pax(m, mode_high, uid):
    """Every header the writer accepts is byte for byte tarfile's PAX ``tobuf`` (also uid/gid past 32 bits)."""
    for one in (m, m._replace(mode=m.mode | mode_high << 12, uid=uid)):  # file-type bits in mode are dropped
        assert encode_header(one) == _tobuf(one)


def test_bytes_equal_tarfile_pax_at_field_edges():
    """Every ustar/PAX boundary: 100-byte names and targets, 8 ** 11 sizes and mtimes, 8 ** 7 ids, PAX lengths."""
    cases = []
    for n in (1, 99, 100, 101, 255, 4000):
        for kind in _KIND_OF:
            cases.append(MemberHeader("a" * n, kind, 0o644, 0, linkname="t" * n if kind in (b"1", b"2") else ""))
    # PAX record lengths whose digit count changes once the digits are counted (98+ -> 101 ...).
    cases += [MemberHeader("p" * n, b"0", 0o644, 0) for n in range(85, 110)]
    cases += [MemberHeader("p" * n, b"0", 0o644, 0) for n in range(985, 1000)]
    for size in (0, 8 ** 11 - 1, 8 ** 11, 1 << 40):
        cases.append(MemberHeader("s", b"0", 0o644, 0, size=size))
    for mtime in (YEAR_1, -1, 0, 8 ** 11 - 1, 8 ** 11, FAR_FUTURE):
        cases.append(MemberHeader("m", b"0", 0o644, mtime))
    for ident in (8 ** 7 - 1, 8 ** 7, 2 ** 32 - 1):
        cases.append(MemberHeader("u", b"0", 0o644, 0, uid=ident, gid=ident))
    cases.append(MemberHeader("d", b"5", 0o7777, 0))
    cases.append(MemberHeader("d/", b"5", 0o7777, 0))
    cases.append(MemberHeader(os.fsdecode(b"caf\xc3\xa9/\xff\xfe"), b"2", 0o777, 0, linkname=os.fsdecode(b"\xc3\xa9")))
    cases.append(MemberHeader(os.fsdecode(b"caf\xc3\xa9"), b"2", 0o777, 0, linkname=os.fsdecode(b"x\x80")))
    for m in cases:
        assert encode_header(m) == _tobuf(m), m


def test_refuses_what_it_does_not_write():
    """Fields tobuf would write differently (float mtime, device members, NUL in a name, a non-directory name ending in /) are refused, never written."""
    with pytest.raises(TypeError):
        encode_header(MemberHeader("f", b"0", 0o644, 1.5))  # type: ignore[arg-type]
    for kind in (b"3", b"4", b"6", b"7", b"x", b"", b"00", "0"):
        with pytest.raises(ValueError):
            encode_header(MemberHeader("f", kind, 0o644, 0))  # type: ignore[arg-type]
    for bad in ({"size": -1}, {"uid": -1}, {"gid": -1}):
        with pytest.raises(ValueError):
            encode_header(MemberHeader("f", b"0", 0o644, 0)._replace(**bad))
    for nul in ({"name": "a\0b"}, {"linkname": "\0"}, {"name": ""}, {"name": "f/"}):
        with pytest.raises(ValueError):
            encode_header(MemberHeader("f", b"2", 0o777, 0)._replace(**nul))
    with pytest.raises(UnicodeEncodeError):
        encode_header(MemberHeader("\ud800", b"0", 0o644, 0))  # a surrogate os.fsdecode never makes


def _edge_batch() -> list[MemberHeader]:
    """Hand-picked entries: every listing separator, every escape, every number boundary, each kind."""
    raw = [b"plain", b"sp ace -> x\\b\n\"q", b"bad\xff\xfe\x01", b"\xc3\xa9/\xc3\xbc" + b"n" * 150, b"tri??/gr??=aph",
           b"t\tab\rcr\x7f", b"x link to y", b"-rw-r--r-- 0/0 x", b"%s%d", b"\\012", b"a" * 100, b"b" * 101,
           b"/" + b"/".join([b"c" * 255] * 15)]
    out = []
    kinds = list(_KIND_OF)
    for i, r in enumerate(raw):
        kind = kinds[i % 4]
        name = os.fsdecode((b"e%d-" % i + r)[:STAGED_PATH_MAX - 1])
        link = os.fsdecode(raw[(i + 1) % len(raw)].lstrip(b"/")) if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE) else ""
        out.append(MemberHeader(name, kind, (0o7777, 0o4755, 0o2000, 0o1777, 0)[i % 5],
                                (YEAR_1, -1, 0, 8 ** 11, FAR_FUTURE, 1_700_000_000)[i % 6],
                                size=(8 ** 11, 9 << 30, 1)[i % 3] if kind == tarfile.REGTYPE else 0, linkname=link,
                                uid=(0, 2 ** 32 - 1, 8 ** 7)[i % 3], gid=(8 ** 7 - 1, 0)[i % 2]))
    return out


@needs_gnu_tar
@needs_bsdtar
def test_edge_entries_read_the_same_in_all_three(tmp_path):
    """The hand-picked batch reads back identically in tarfile, GNU tar and bsdtar."""
    _check_all_readers(tmp_path, _edge_batch())


@needs_gnu_tar
@needs_bsdtar
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                 HealthCheck.function_scoped_fixture])
@given(members=_batch())
def test_generated_entries_read_the_same_in_all_three(tmp_path, members):
    """Generated batches: tarfile, GNU tar and bsdtar decode every header the writer makes to the same tuple."""
    _check_all_readers(tmp_path, members)


def test_readers_see_a_wrong_header(tmp_path):
    """The comparison can fail: a header whose mtime field is 40 days off (checksum fixed up) reads differently."""
    m = MemberHeader("e0-f", tarfile.REGTYPE, 0o644, 5)
    hdr = bytearray(encode_header(m))
    hdr[136:148] = b"%011o\0" % (5 + 40 * 86400)
    hdr[148:156] = b" " * 8
    hdr[148:156] = b"%06o\0 " % sum(hdr)
    path = tmp_path / "wrong.tar"
    path.write_bytes(bytes(hdr) + bytes(1024))
    assert _read_tarfile(path) != [_expected(m)]
    if _is_gnu_tar():
        assert _read_gnu_tar(path) != [_expected(m)]
    if BSDTAR is not None:
        with pytest.raises(AssertionError):
            _read_bsdtar_list(path, [_expected(m)])
        assert _read_bsdtar_mtree(path) != [_expected(m)]

