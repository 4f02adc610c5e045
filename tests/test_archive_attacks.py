"""The attack families of issue 3; each checks the outside sentinel tree, not just the error."""

from __future__ import annotations

import gzip
import io
import os
import subprocess
import sys
import tarfile
import textwrap

import pytest
from test_archive_builders import (extract_ws, raw_tar_header, tar_bytes, ti, ws_escapes, zip_bytes,
                                   zip_name_mismatch, zip_overlapping)

from sandbox_fs import SandboxError
from sandbox_fs.archive import ArchiveLimitError, ArchiveLimits, UnsafeArchiveMemberError


def _attack(layout, data, exc=SandboxError, **kw):
    before = layout.snapshot()
    with pytest.raises(exc) as ei:
        extract_ws(layout, data, **kw)
    layout.assert_outside_unchanged(before)
    layout.assert_secret_absent()
    assert ws_escapes(layout.ws) == []
    assert not (layout.outside / "pwned.txt").exists()
    assert os.listdir(layout.ws) == [], "atomic mode: nothing new may remain"
    return ei.value


def test_deep_symlink_chain_past_path_max_then_file_through_it(layout, resolver):
    # CVE-2025-4517 shape: each link is short, the resolved path passes PATH_MAX,
    # and a last link climbs out through the chain.
    comp = "d" * 247
    members = []
    path = ""
    steps = "abcdefghijklmnop"
    for i, step in enumerate(steps):
        members.append(ti(os.path.join(path, comp), "dir"))
        members.append(ti(os.path.join(path, step), "symlink", linkname=comp))
        path = os.path.join(path, comp)
    members.append(ti("l", "symlink", linkname="/".join(steps) + "/" + "../" * len(steps) + "../outside"))
    members.append(ti("escape", "symlink", linkname="/".join(steps) + "/" + "../" * 254))
    members.append(ti("escape/pwned.txt", data=b"pwned"))
    _attack(layout, tar_bytes(members), UnsafeArchiveMemberError)


def test_symlink_then_hardlink_through_it(layout, resolver):
    data = tar_bytes([ti("l", "symlink", linkname="../outside/secret.txt"),
                      ti("h", "hardlink", linkname="l")])
    _attack(layout, data, UnsafeArchiveMemberError)
    data = tar_bytes([ti("f", data=b"1"), ti("l", "symlink", linkname="f"), ti("h", "hardlink", linkname="l")])
    err = _attack(layout, data, UnsafeArchiveMemberError)
    assert err.rule == "hardlink_target"


def test_dir_then_same_named_symlink_then_file_under_it(layout, resolver):
    # node-tar CVE-2021-32803
    data = tar_bytes([ti("d", "dir"), ti("d", "symlink", linkname="../../outside"), ti("d/pwned.txt", data=b"x")])
    _attack(layout, data, UnsafeArchiveMemberError)
    data = tar_bytes([ti("d", "dir"), ti("d", "symlink", linkname="sub"), ti("d/pwned.txt", data=b"x")])
    _attack(layout, data, UnsafeArchiveMemberError)


def test_zip_slip(layout):
    err = _attack(layout, zip_bytes([{"name": "../outside/pwned.txt", "data": b"x"}]), UnsafeArchiveMemberError)
    assert err.rule == "dotdot"
    err = _attack(layout, zip_bytes([{"name": "a/../../outside/pwned.txt", "data": b"x"}]), UnsafeArchiveMemberError)
    assert err.rule == "dotdot"


def test_absolute_names(layout):
    target = str(layout.outside / "pwned.txt")
    err = _attack(layout, tar_bytes([ti(target, data=b"x")]), UnsafeArchiveMemberError)
    assert err.rule == "absolute_name"
    err = _attack(layout, zip_bytes([{"name": target, "data": b"x"}]), UnsafeArchiveMemberError)
    assert err.rule == "absolute_name"


def test_overlapping_entry_zip(layout):
    err = _attack(layout, zip_overlapping(), UnsafeArchiveMemberError)
    assert err.rule == "overlapping_entries"


def test_local_central_name_mismatch(layout):
    err = _attack(layout, zip_name_mismatch(), UnsafeArchiveMemberError)
    assert err.rule == "name_mismatch"


def test_tar_member_declaring_10_gib_with_tiny_payload(layout):
    data = raw_tar_header("huge.bin", 10 << 30) + b"\0" * 4096
    err = _attack(layout, data, ArchiveLimitError)
    assert err.limit == "max_member_bytes" and err.observed == 10 << 30
    # under the limit but still a lie: the stream ends early -> format error, nothing remains
    data = raw_tar_header("lie.bin", 100 << 20) + b"x" * 4096
    _attack(layout, data, SandboxError)


def test_200k_empty_members_hit_member_limit(layout):
    # 200,000 empty members; most repeat one directory name so the test measures our
    # member accounting, not ext4 inode creation (~150 us each on this machine).
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        info = tarfile.TarInfo()
        for i in range(1000):
            info.name = f"e{i}"
            tf.addfile(info)
    info.type = tarfile.DIRTYPE
    info.name = "d"
    body = buf.getvalue()[: 512 * 1000] + info.tobuf(tarfile.USTAR_FORMAT) * 199_000 + b"\0" * 1024
    err = _attack(layout, body, ArchiveLimitError)
    assert err.limit == "max_members" and err.allowed == 100_000 and err.observed == 100_001


def test_5000_deep_directory_chain(layout, resolver):
    data = tar_bytes([ti("d/" * i + "d", "dir") for i in range(5000)], fmt=tarfile.GNU_FORMAT, compression="gz")
    err = _attack(layout, data, ArchiveLimitError)
    assert err.limit == "max_depth"


def test_10_mib_pax_header_bounded_before_reading(layout):
    hdr = tarfile.TarInfo("x")
    hdr.type = tarfile.XHDTYPE
    hdr.size = 10 << 20
    record = b"comment=" + b"A" * ((10 << 20) - 20)
    body = f"{len(record) + 2 + 8}".encode()
    rec = b" " + record + b"\n"
    rec = str(len(rec) + len(str(len(rec)))).encode() + rec
    body = rec.ljust(10 << 20, b"\n")
    data = hdr.tobuf(tarfile.USTAR_FORMAT) + body + raw_tar_header("after", 0, fmt=tarfile.USTAR_FORMAT) + b"\0" * 1024
    err = _attack(layout, data, ArchiveLimitError)
    assert err.limit == "max_header_bytes" and err.observed == 10 << 20


def test_10_mib_pax_header_memory_stays_bounded(tmp_path):
    """Run in a child so its peak RSS is its own: a 10 MiB PAX header must not be read into memory."""
    script = textwrap.dedent("""
        import io, os, resource, sys, tarfile
        from sandbox_fs import open_root
        from sandbox_fs.archive import extract, ArchiveLimitError
        hdr = tarfile.TarInfo("x"); hdr.type = tarfile.XHDTYPE; hdr.size = 200 << 20
        class Src(io.RawIOBase):
            def __init__(self):
                self.head = hdr.tobuf(tarfile.USTAR_FORMAT); self.left = 200 << 20
            def readable(self): return True
            def readinto(self, b):
                if self.head:
                    n = min(len(b), len(self.head)); b[:n] = self.head[:n]; self.head = self.head[n:]; return n
                n = min(len(b), self.left); b[:n] = b"a" * n; self.left -= n; return n
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with open_root(sys.argv[1]) as root:
            try:
                extract(root, "d", Src())
            except ArchiveLimitError as e:
                assert e.limit == "max_header_bytes", e
            else:
                raise SystemExit("not refused")
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)
    """)
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, check=True)
    grew_kib = int(out.stdout.strip())
    assert grew_kib < 20 * 1024, f"peak RSS grew by {grew_kib} KiB for a 200 MiB PAX header"


def test_gnu_long_name_bomb(layout):
    hdr = tarfile.TarInfo("././@LongLink")
    hdr.type = tarfile.GNUTYPE_LONGNAME
    hdr.size = 5 << 20
    data = hdr.tobuf(tarfile.USTAR_FORMAT) + b"a" * (5 << 20) + raw_tar_header("f", 0) + b"\0" * 1024
    err = _attack(layout, data, ArchiveLimitError)
    assert err.limit == "max_header_bytes"


def test_gzip_bomb_ratio_measured_while_streaming(layout):
    inner = raw_tar_header("zeros", 600 << 20, fmt=tarfile.USTAR_FORMAT)
    gz = io.BytesIO()
    with gzip.GzipFile(fileobj=gz, mode="wb", compresslevel=9) as g:
        g.write(inner)
        chunk = b"\0" * (1 << 20)
        for _ in range(40):  # the ratio trips after ratio_grace_bytes (16 MiB), long before the end
            g.write(chunk)
    err = _attack(layout, gz.getvalue(), ArchiveLimitError)
    assert err.limit == "max_expansion_ratio"


def test_total_bytes_limit_measured(layout):
    data = tar_bytes([ti(f"f{i}", data=b"x" * 1000) for i in range(10)])
    err = _attack(layout, data, ArchiveLimitError, limits=ArchiveLimits(max_total_bytes=5500))
    assert err.limit == "max_total_bytes" and err.observed > 5500


def test_input_bytes_limit(layout):
    data = tar_bytes([ti(f"f{i}", data=b"x" * 1000) for i in range(10)])
    err = _attack(layout, data, ArchiveLimitError, limits=ArchiveLimits(max_input_bytes=4000))
    assert err.limit == "max_input_bytes"


def test_zip_eocd_entry_count_checked_before_parsing(layout, monkeypatch):
    import zipfile

    data = zip_bytes([{"name": f"f{i}", "data": b""} for i in range(20)])
    built = []
    orig = zipfile.ZipFile._RealGetContents
    monkeypatch.setattr(zipfile.ZipFile, "_RealGetContents", lambda self: (built.append(1), orig(self)))
    err = _attack(layout, data, ArchiveLimitError, limits=ArchiveLimits(max_members=10))
    assert err.limit == "max_members" and err.observed == 20
    assert built == [], "the entry list must not be built before the EOCD counts are checked"


def test_symlink_race_swap_cannot_redirect(layout, resolver):
    """A racing process swaps an extracted directory for a symlink to outside between members."""
    import threading

    from sandbox_fs import open_root
    from sandbox_fs.archive import extract

    (layout.ws / "dest").mkdir()
    members = [ti("d", "dir")] + [ti(f"d/f{i}", data=b"x" * 100) for i in range(3000)]
    data = tar_bytes(members)
    before = layout.snapshot()
    stop = threading.Event()

    def attacker():
        d = layout.ws / "dest" / "d"
        while not stop.is_set():
            try:
                os.rename(d, layout.ws / "dest" / "moved")
                os.symlink(str(layout.outside), d)
            except OSError:
                pass

    t = threading.Thread(target=attacker)
    t.start()
    try:
        with open_root(layout.ws) as root:
            try:
                extract(root, "dest", io.BytesIO(data), policy=__import__("sandbox_fs.archive", fromlist=["x"])
                        .ExtractPolicy(in_place=True))
            except (SandboxError, OSError):
                pass
    finally:
        stop.set()
        t.join()
    layout.assert_outside_unchanged(before)
    assert not any(n.startswith("f") for n in os.listdir(layout.outside))
