"""Denial-of-service and consistency findings of the second attacker review, each as a class.

Work is bounded by *counting* (regex input, lstat calls, ZipInfo objects built), never by a
timed assert; :func:`_within` is only a hang detector (20 s) around payloads that used to
take minutes.
"""

from __future__ import annotations

import gzip
import io
import os
import posixpath
import re
import signal
import struct
import subprocess
import sys
import tarfile
import threading
import time
import zipfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_archive_builders import tar_bytes, ti

from sandbox_fs import SandboxError, open_root
from sandbox_fs.archive import ArchiveFormatError, ArchiveLimitError, ArchiveLimits, UnsafeArchiveMemberError, extract
from sandbox_fs.archive import _tar as tarmod
from sandbox_fs.archive import _writer as writermod
from sandbox_fs.archive._names import symlink_walk, target_parts
from sandbox_fs.errors import PathEscapeError

HANG_GUARD_S = 20.0


def _within(fn, timeout_s: float = HANG_GUARD_S):
    """Run ``fn`` in a thread; fail (hang detector, not a speed claim) if it has not ended in time."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), "extraction did not finish: hang detector fired"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _extract_bytes(tmp_path, data: bytes, **kw):
    ws = tmp_path / "ws"
    ws.mkdir(exist_ok=True)
    with open_root(ws) as root:
        return extract(root, "out", io.BytesIO(data), **kw)


# --------------------------------------------------------------------------- 1. PAX ReDoS

def _hdr(name: str, typ: bytes, size: int) -> bytes:
    t = tarfile.TarInfo(name)
    t.type = typ
    t.size = size
    return t.tobuf(format=tarfile.USTAR_FORMAT)


def _pax_tar(body: bytes, size: int | None = None, padding: bytes | None = None) -> bytes:
    size = len(body) if size is None else size
    pad = padding if padding is not None else b"\0" * (-len(body) % 512)
    return (_hdr("././@PaxHeader", tarfile.XHDTYPE, size) + body + pad
            + _hdr("f", tarfile.REGTYPE, 0) + b"\0" * 1024)


def _rec(key: bytes, value: bytes) -> bytes:
    body = b" " + key + b"=" + value + b"\n"
    n = len(body) + 1
    while len(str(n)) + len(body) != n:
        n += 1
    return str(n).encode() + body


def _digit_cost(buf: bytes) -> int:
    return sum(len(m) ** 2 for m in re.findall(rb"[0-9]+", buf) if len(m) > tarmod.FREE_DIGIT_RUN)


class _CountingRe:
    """Stands in for ``tarfile.re``: records the digit-run cost of every buffer tarfile searches."""

    def __init__(self):
        self.max_cost = 0
        self.calls = 0

    def _see(self, buf):
        self.calls += 1
        self.max_cost = max(self.max_cost, _digit_cost(bytes(buf)))

    def search(self, pattern, buf, *a):
        self._see(buf)
        return re.search(pattern, buf, *a)

    def finditer(self, pattern, buf, *a):
        self._see(buf)
        return re.finditer(pattern, buf, *a)

    def __getattr__(self, name):
        return getattr(re, name)


@pytest.mark.parametrize("n", [64_000, 1 << 20])
def test_pax_digit_run_body_refused_before_tarfile(tmp_path, monkeypatch, n):
    """The review's payload (a PAX body of n digits, CVE-2024-6232): refused by our parser."""
    spy = _CountingRe()
    monkeypatch.setattr(tarfile, "re", spy)
    data = gzip.compress(_pax_tar(b"1" * n), 9)
    with pytest.raises(ArchiveFormatError, match="malformed PAX record"):
        _within(lambda: _extract_bytes(tmp_path, data))
    assert spy.max_cost <= tarmod.PAX_DIGIT_COST_HEADER


def test_pax_well_formed_long_digit_value_refused(tmp_path, monkeypatch):
    """Well-formed records whose value is a long digit run: the regex never sees it."""
    spy = _CountingRe()
    monkeypatch.setattr(tarfile, "re", spy)
    data = _pax_tar(_rec(b"comment", b"7" * 64_000))
    with pytest.raises(ArchiveFormatError, match="CVE-2024-6232"):
        _within(lambda: _extract_bytes(tmp_path, data))
    assert spy.max_cost <= tarmod.PAX_DIGIT_COST_HEADER
    # a modest run (a 2,000-digit value) is still read, and costs what we counted
    rep = _extract_bytes(tmp_path, _pax_tar(_rec(b"comment", b"7" * 2000)))
    assert rep.files == 1 and spy.calls >= 1 and spy.max_cost <= tarmod.PAX_DIGIT_COST_HEADER


def test_pax_digit_cost_bounded_per_archive(tmp_path, monkeypatch):
    """Many headers each under the per-header bound: the archive total stops them."""
    per = _rec(b"comment", b"7" * 2000)
    one = _hdr("././@PaxHeader", tarfile.XHDTYPE, len(per)) + per + b"\0" * (-len(per) % 512) \
        + _hdr("f", tarfile.REGTYPE, 0)
    data = one * 40 + b"\0" * 1024
    with pytest.raises(ArchiveFormatError, match="CVE-2024-6232"):
        _within(lambda: _extract_bytes(tmp_path, data))


@pytest.mark.parametrize("body,size,padding,what", [
    (_rec(b"path", b"a") + b"junk", None, None, "length"),              # records do not tile
    (b"99 path=a\n", None, None, "length"),                              # length past the header
    (b"4 x=\n", None, None, "length"),                                   # below the 5-byte minimum
    (b"10 path=ab\n", None, None, "newline"),                            # wrong length: no newline there
    (b"9 patha\n\n", None, None, "keyword"),                             # no '='
    (b"6 =ab\n", None, None, "keyword"),                                 # empty keyword
    (_rec(b"path", b"a"), None,                                          # a record hidden in the padding
     _rec(b"path", b"evil") + b"\0" * 400, "padding"),
    (b"x" * 30, None, None, "decimal length"),
])
def test_pax_malformed_records_refused(tmp_path, body, size, padding, what):
    if padding is not None:
        padding = padding + b"\0" * (-(len(body) + len(padding)) % 512)
    with pytest.raises(ArchiveFormatError, match="PAX"):
        _extract_bytes(tmp_path, _pax_tar(body, size, padding))
    assert not (tmp_path / "ws" / "out").exists()


_KEYS = st.sampled_from([b"comment", b"x.k", b"x.k2", b"mtime"])
_VALS = st.binary(max_size=40).filter(lambda v: b"\0" not in v) | st.text("0123456789", max_size=40).map(str.encode)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(_KEYS, _VALS), min_size=1, max_size=5), st.integers(0, 60), st.binary(max_size=3))
def test_property_pax_parser_agrees_with_tarfile(recs, cut, junk):
    """Whatever body we accept, tarfile reads exactly our records; the cost is the squared long runs."""
    body = b"".join(_rec(k, v if k != b"mtime" else b"1") for k, v in recs)
    mutated = body[:len(body) - cut] + junk if cut else body
    buf = mutated + b"\0" * (-len(mutated) % 512)
    try:
        cost = tarmod.check_pax_body(buf, len(mutated), None)
    except ArchiveFormatError:
        return
    assert cost == _digit_cost(buf)
    tf = tarfile.open(fileobj=io.BytesIO(_pax_tar(mutated)))
    member = tf.next()
    expected: dict = {}
    pos = 0
    while pos < len(mutated):
        n = int(mutated[pos:mutated.index(b" ", pos)])
        key, _, value = mutated[mutated.index(b" ", pos) + 1:pos + n - 1].partition(b"=")
        expected[key.decode("utf-8", "surrogateescape")] = value
        pos += n
    got = {k: v for k, v in member.pax_headers.items()}
    assert set(got) == set(expected)


# ----------------------------------------------------------------------- 2. deep symlinks

def test_deep_symlink_target_refused_by_depth(tmp_path):
    """The review's shape: targets of ~2,000 components are refused by max_depth.

    (2,000 rather than the review's 2,047: a 4,093-byte target is now over the
    staged path bound first, STAGED_PATH_MAX, and refused by max_path_bytes.)
    """
    for n, limit in ((2000, "max_depth"), (2047, "max_path_bytes")):
        target = "/".join(["a"] * n)
        data = tar_bytes([ti(f"l{i}", "symlink", linkname=target) for i in range(100)], compression="gz")
        with pytest.raises(ArchiveLimitError) as ei:
            _within(lambda: _extract_bytes(tmp_path, data))
        assert ei.value.limit == limit


def test_symlink_target_bytes_of_named_path_bounded():
    lim = ArchiveLimits(max_path_bytes=100)
    with pytest.raises(ArchiveLimitError) as ei:
        target_parts(b"d" * 60 + b"/l", "t" * 60, lim, "l")
    assert ei.value.limit == "max_path_bytes"


def test_deep_symlinks_into_existing_destination_linear(tmp_path, monkeypatch):
    """Links at the depth limit into an existing tree: one lstat per link and root, not one per prefix."""
    calls = {"n": 0}
    orig = writermod.Extractor._is_link_on_disk

    def counting(self, root, path):
        calls["n"] += 1
        return orig(self, root, path)

    monkeypatch.setattr(writermod.Extractor, "_is_link_on_disk", counting)
    target = "/".join(["a"] * 64)
    n_links = 200
    data = tar_bytes([ti(f"l{i}", "symlink", linkname=target) for i in range(n_links)])
    ws = tmp_path / "ws"
    (ws / "dest").mkdir(parents=True)
    with open_root(ws) as root:
        rep = _within(lambda: extract(root, "dest", io.BytesIO(data)))
    assert rep.symlinks == n_links
    assert calls["n"] <= n_links * 2
    through, final = symlink_walk(b"l0", target, ArchiveLimits(), "l0")
    assert len(through) == 63 and final == target.encode()


# -------------------------------------------------------------------- 5. one link predicate

def test_dotdot_after_name_refused_like_root_symlink(tmp_path):
    data = tar_bytes([ti("d", "dir"), ti("f", data=b"x"), ti("l", "symlink", linkname="d/../f")])
    with pytest.raises(UnsafeArchiveMemberError) as ei:
        _extract_bytes(tmp_path, data)
    assert ei.value.rule == "symlink_target"
    with pytest.raises(UnsafeArchiveMemberError):
        symlink_walk(b"l", "d/../f", ArchiveLimits(), "l")


_TCOMP = st.sampled_from(["a", "b", "..", ".", ""])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(["x", "y"]), min_size=0, max_size=3),
       st.lists(_TCOMP, min_size=1, max_size=6).map("/".join))
def test_property_link_predicate_equals_root_symlink(tmp_path, linkdir, target):
    """Extractor/snapshot predicate accepts a target iff Root.symlink does; final is the lexical path."""
    link = "/".join(linkdir + ["l"])
    ws = tmp_path / "p"
    if ws.exists():
        import shutil
        shutil.rmtree(ws)
    (ws / "/".join(linkdir)).mkdir(parents=True, exist_ok=True) if linkdir else ws.mkdir()
    try:
        _through, final = symlink_walk(link.encode(), target, ArchiveLimits(), link)
        ours = True
    except (UnsafeArchiveMemberError, ArchiveLimitError):
        ours = False
    with open_root(ws) as root:
        try:
            root.symlink(target, link)
            theirs = True
        except (PathEscapeError, SandboxError, ValueError):
            theirs = False
    assert ours == theirs, (link, target)
    if ours:
        want = posixpath.normpath(posixpath.join(posixpath.dirname(link), target))
        assert final.decode() == ("" if want == "." else want)


# ---------------------------------------------------------------------------- 3./4. zip

_NAME = b"a"
_LOCAL = struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 0, 0, 0, 0, 0, 0, len(_NAME), 0) + _NAME
_ENT = struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 0, 0, 0, 0, 0, 0, len(_NAME), 0, 0, 0, 0, 0, 0) + _NAME


def _zip64_hidden(n: int, *, junk: bool) -> bytes:
    """The review's mk_zip64_hidden shape: a 32-bit EOCD (1 entry) over a ZIP64 record (n entries)."""
    cd = _ENT * n
    out = _LOCAL + cd
    cd_off = len(_LOCAL)
    out += struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, n, n, len(cd), cd_off)
    out += struct.pack("<4sLQL", b"PK\x06\x07", 0, cd_off + len(cd), 1)
    if junk:
        out += struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 1, 1, 46, cd_off, 0) + b"\0" * 65536
    else:  # the same records, honest framing: a 65,535-byte comment
        out += struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 1, 1, 46, cd_off, 65535) + b"c" * 65535
    return out


def _count_zipinfos(monkeypatch) -> dict:
    seen = {"n": 0}
    orig = zipfile.ZipInfo.__init__

    def init(self, *a, **k):
        seen["n"] += 1
        orig(self, *a, **k)

    monkeypatch.setattr(zipfile.ZipInfo, "__init__", init)
    return seen


def test_zip64_hidden_past_window_refused(tmp_path, monkeypatch):
    seen = _count_zipinfos(monkeypatch)
    with pytest.raises(ArchiveFormatError, match="after the end-of-central-directory"):
        _extract_bytes(tmp_path, _zip64_hidden(50_000, junk=True), limits=ArchiveLimits(max_members=10))
    assert seen["n"] == 0


def test_zip64_values_are_the_checked_ones(tmp_path, monkeypatch):
    seen = _count_zipinfos(monkeypatch)
    with pytest.raises(ArchiveLimitError) as ei:
        _extract_bytes(tmp_path, _zip64_hidden(50_000, junk=False), limits=ArchiveLimits(max_members=10))
    assert ei.value.limit == "max_members" and ei.value.observed == 50_000
    with pytest.raises(ArchiveLimitError) as ei:
        _extract_bytes(tmp_path, _zip64_hidden(50_000, junk=False),
                       limits=ArchiveLimits(max_central_directory_bytes=4096))
    assert ei.value.limit == "max_central_directory_bytes"
    assert seen["n"] == 0


def test_zip_declared_count_not_trusted(tmp_path, monkeypatch):
    """EOCD declares 1 entry over 5,000 headers: the walk stops at max_members + 1, zipfile never runs."""
    seen = _count_zipinfos(monkeypatch)
    cd = _ENT * 5000
    data = _LOCAL + cd + struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 1, 1, len(cd), len(_LOCAL), 0)
    with pytest.raises(ArchiveLimitError) as ei:
        _extract_bytes(tmp_path, data, limits=ArchiveLimits(max_members=10))
    assert ei.value.limit == "max_members" and ei.value.observed == 11
    assert seen["n"] == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 6), st.binary(max_size=300), st.integers(0, 3), st.binary(max_size=40))
def test_property_zip_locator_agrees_with_zipfile(tmp_path, n, comment, cut, tail):
    """Our EOCD/central-directory walk and zipfile agree on every archive we accept."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for i in range(n):
            zf.writestr(f"f{i}", b"x" * i)
        zf.comment = comment
    data = buf.getvalue()
    data = data[:len(data) - cut] + tail if cut or tail else data
    from sandbox_fs.archive._streams import Meter, SeekCounter
    from sandbox_fs.archive._zip import locate_central_directory
    f = SeekCounter(io.BytesIO(data), Meter(ArchiveLimits()))
    try:
        cd = locate_central_directory(f, ArchiveLimits())
    except (ArchiveFormatError, ArchiveLimitError):
        return
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        assert zf.start_dir == cd.start and len(zf.infolist()) == cd.entries


def test_zip_with_comment_still_extracts(tmp_path):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("f", b"hello")
        zf.comment = b"a comment " + b"z" * 1000
    rep = _extract_bytes(tmp_path, buf.getvalue())
    assert rep.files == 1 and (tmp_path / "ws" / "out" / "f").read_bytes() == b"hello"


# ------------------------------------------------------------------------ 6. CLI SIGTERM

def test_cli_sigterm_removes_staging(tmp_path):
    """SIGTERM mid-extraction: exit 143, and no ``.sfs-extract-*`` staging directory remains."""
    head = tar_bytes([ti("d", "dir"), ti("d/big", data=b"x" * (1 << 20))])
    cut = head[:len(head) // 2]  # stdin then stalls in the middle of d/big
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "sandbox_fs.cli", "extract", "-", "--into", str(out)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        proc.stdin.write(cut)
        proc.stdin.flush()
        deadline = time.monotonic() + HANG_GUARD_S
        staged = []
        while time.monotonic() < deadline:  # wait for the staging tree to hold the member
            staged = [p for p in tmp_path.iterdir() if p.name.startswith(".sfs-extract-")]
            if staged and (staged[0] / "d" / "big").exists():
                break
            time.sleep(0.02)
        assert staged, "extraction never started"
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdin.close()
    err = proc.stderr.read().decode()
    proc.stdout.close()
    proc.stderr.close()
    assert rc == 143, err
    assert "Traceback" not in err
    assert [p.name for p in tmp_path.iterdir()] == []


# ------------------------------------------------------------- defence in depth: CPU budget

def test_cpu_budget_off_by_default_and_enforced(tmp_path):
    assert ArchiveLimits().max_cpu_seconds is None
    data = tar_bytes([ti(f"f{i}", data=b"x") for i in range(2000)])
    with pytest.raises(ArchiveLimitError) as ei:
        _extract_bytes(tmp_path, data, limits=ArchiveLimits(max_cpu_seconds=1e-6))
    assert ei.value.limit == "max_cpu_seconds"
    assert sorted(p.name for p in (tmp_path / "ws").iterdir()) == []  # staging removed
    rep = _extract_bytes(tmp_path, data, limits=ArchiveLimits(max_cpu_seconds=600))
    assert rep.files == 2000


def test_zip_reads_capped_to_checked_directory(tmp_path, monkeypatch):
    """zipfile may read only what was checked; a locator that disagreed with zipfile is refused."""
    from sandbox_fs.archive import _zip as zipmod
    from sandbox_fs.archive._streams import Meter, SeekCounter

    f = SeekCounter(io.BytesIO(b"x" * 100), Meter(ArchiveLimits()))
    f.read_budget = 10
    with pytest.raises(ArchiveLimitError) as ei:
        f.read(11)
    assert ei.value.limit == "max_central_directory_bytes" and f.tell() == 0  # refused before reading
    assert f.read(10) == b"x" * 10
    with pytest.raises(ArchiveLimitError):
        f.read()  # "to EOF" past the budget
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("f", b"hello")
    real = zipmod.locate_central_directory
    monkeypatch.setattr(zipmod, "locate_central_directory",
                        lambda f, lim: zipmod.CentralDirectory((c := real(f, lim)).start, c.size, c.entries + 1))
    with pytest.raises(ArchiveFormatError, match="disagree"):
        _extract_bytes(tmp_path, buf.getvalue())


def test_snapshot_persist_refuses_what_extract_refuses(tmp_path, capsys):
    """The review's poc_dotdot_link: persist (same predicate) refuses l -> d/../f instead of saving it."""
    from sandbox_fs.cli import main

    ws = tmp_path / "ws"
    (ws / "d").mkdir(parents=True)
    (ws / "f").write_text("f")
    os.symlink("d/../f", ws / "l")
    rc = main(["snapshot", "save", "--workspace", str(ws), "--store", str(tmp_path / "store"), "--name", "s1"])
    err = capsys.readouterr().err
    assert rc == 1 and "unrestorable" in err and "[l]" in err
