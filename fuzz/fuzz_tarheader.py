"""atheris harness: persist's tar header writer (``sandbox_fs.snapshot._header``) read back by tarfile.

Each input is decoded into header fields (:func:`decode`): a typeflag
selector, mode, mtime (48 bits signed: tarfile reads a PAX mtime as a float,
exact to 2 ** 53), size (64 bits), uid and gid (up to 40 bits, past
ustar's 7 octal digits and uid_t), a member name and a link target of any
bytes (``os.fsdecode``: ``surrogateescape`` for bytes that are not UTF-8).
A finding is:

* the writer raising for fields it must accept, or accepting fields it
  must refuse (a NUL in a name, an empty name, a non-directory name ending
  in ``/``, another typeflag, a negative size or id);
* bytes that differ from ``TarInfo.tobuf(PAX_FORMAT, "utf-8", "surrogateescape")``;
* a header that is not whole 512-byte blocks, or that tarfile reads back
  with any field (name bytes, type, size, mode, mtime, link target, uid,
  gid) other than the one written.

Run: ``fuzz/run.sh tarheader SECONDS`` (or ``python fuzz/fuzz_tarheader.py fuzz/corpus/tarheader
-max_total_time=60 -dict=fuzz/dict/tarheader.dict``).  ``--write-seeds DIR`` writes the seed corpus.
Without atheris it replays the corpus and mutates it for the given time.
"""

from __future__ import annotations

import io
import os
import random
import sys
import tarfile
import time

from sandbox_fs.snapshot._header import MemberHeader, encode_header

HERE = os.path.dirname(os.path.abspath(__file__))
# Typeflag selector: the four persist writes, then ones the writer must refuse.
KINDS = [tarfile.REGTYPE, tarfile.LNKTYPE, tarfile.SYMTYPE, tarfile.DIRTYPE, tarfile.CHRTYPE, tarfile.FIFOTYPE,
         tarfile.XHDTYPE, b""]
_VALID_KINDS = KINDS[:4]
_REFUSED = 0xF0  # a first byte from here on asks for fields the writer must refuse (1/16 of inputs)


def decode(data: bytes) -> MemberHeader:
    """Fields from fuzz bytes: flags(1) mode(2) mtime(6, signed) size(8) uid(5) gid(5) namelen(2) name, link.

    The first byte's low two bits pick one of the four typeflags; from
    ``0xF0`` on it picks another typeflag or makes size, uid or gid negative
    instead (inputs the writer must refuse).  Numbers are big-endian.
    """
    head = data[:29].ljust(29, b"\0")
    flags = head[0]
    n = int.from_bytes(head[27:29], "big") % 4200
    rest = data[29:]
    size, uid, gid = (int.from_bytes(head[a:b], "big") for a, b in ((9, 17), (17, 22), (22, 27)))
    kind = KINDS[flags & 3]
    if flags >= _REFUSED:
        bad = flags & 0xF
        if bad < 4:
            kind = KINDS[4 + bad]
        elif bad < 8:
            size = -1 - size
        elif bad < 12:
            uid = -1 - uid
        else:
            gid = -1 - gid
    return MemberHeader(
        name=os.fsdecode(rest[:n]), kind=kind, mode=int.from_bytes(head[1:3], "big"),
        mtime=int.from_bytes(head[3:9], "big", signed=True), size=size, linkname=os.fsdecode(rest[n:]),
        uid=uid, gid=gid)


def encode(m: MemberHeader) -> bytes:
    """The fuzz input that :func:`decode` turns into ``m`` (for seeds; the four typeflags, numbers >= 0)."""
    name = os.fsencode(m.name)
    return bytes([KINDS.index(m.kind)]) + m.mode.to_bytes(2, "big") + m.mtime.to_bytes(6, "big", signed=True) \
        + m.size.to_bytes(8, "big") + m.uid.to_bytes(5, "big") + m.gid.to_bytes(5, "big") \
        + len(name).to_bytes(2, "big") + name + os.fsencode(m.linkname)


def _tobuf(m: MemberHeader) -> bytes:
    ti = tarfile.TarInfo(m.name)
    ti.type, ti.mode, ti.mtime, ti.size, ti.linkname, ti.uid, ti.gid = m.kind, m.mode, m.mtime, m.size, \
        m.linkname, m.uid, m.gid
    ti.uname = ti.gname = ""
    return ti.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def one_input(data: bytes) -> None:
    m = decode(data)
    valid = m.kind in _VALID_KINDS and m.size >= 0 and m.uid >= 0 and m.gid >= 0 \
        and "\0" not in m.name and "\0" not in m.linkname and m.name.rstrip("/") != "" \
        and (m.kind == tarfile.DIRTYPE or not m.name.endswith("/"))
    try:
        hdr = encode_header(m)
    except ValueError:
        if valid:
            raise
        return
    if not valid:
        raise AssertionError(f"the writer accepted fields it must refuse: {m!r}")
    if hdr != _tobuf(m):
        raise AssertionError(f"bytes differ from tarfile's PAX tobuf: {m!r}")
    if len(hdr) % 512:
        raise AssertionError(f"header of {len(hdr)} bytes is not whole blocks")
    with tarfile.open(fileobj=io.BytesIO(hdr + bytes(1024)), mode="r:", encoding="utf-8",
                      errors="surrogateescape") as tf:
        ti = tf.next()
    assert ti is not None
    got = (os.fsencode(ti.name), ti.type, ti.size, ti.mode, ti.mtime, os.fsencode(ti.linkname), ti.uid, ti.gid)
    name = os.fsencode(m.name)
    want = (name.rstrip(b"/") if m.kind == tarfile.DIRTYPE else name, m.kind, m.size, m.mode & 0o7777, m.mtime,
            os.fsencode(m.linkname), m.uid, m.gid)
    if got != want:
        raise AssertionError(f"tarfile reads back {got!r}, written {want!r}")


SEEDS = {
    "plain": MemberHeader("usr/lib/a.py", tarfile.REGTYPE, 0o644, 1_700_000_000, 1234),
    "dir": MemberHeader("d", tarfile.DIRTYPE, 0o7755, 0),
    "symlink-long": MemberHeader("l" * 120, tarfile.SYMTYPE, 0o777, -1, 0, "t/" * 80),
    "hardlink": MemberHeader("h", tarfile.LNKTYPE, 0o4755, 8 ** 11, 0, "usr/lib/a.py"),
    "binary-name": MemberHeader(os.fsdecode(b"caf\xc3\xa9/\xff\xfe \n\\"), tarfile.REGTYPE, 0o600, 5, 8 ** 11,
                                os.fsdecode(b"\x80"), 2 ** 32 - 1, 8 ** 7),
    "pax-length-edge": MemberHeader("p" * 90, tarfile.REGTYPE, 0o644, -(10 ** 12), 1 << 36),
    "nul": MemberHeader("a\0b", tarfile.REGTYPE, 0o644, 0),
}


def _fallback(corpus: str, seconds: float) -> None:
    seeds = [open(os.path.join(corpus, n), "rb").read() for n in sorted(os.listdir(corpus))]
    for s in seeds:
        one_input(s)
    rng = random.Random(1234)
    end = time.monotonic() + seconds
    runs = len(seeds)
    while time.monotonic() < end:
        d = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 8)):
            op = rng.random()
            if op < 0.6 and d:
                d[rng.randrange(len(d))] = rng.randrange(256)
            elif op < 0.8:
                i = rng.randrange(len(d) + 1)
                d[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
            elif d:
                i = rng.randrange(len(d))
                del d[i:i + rng.randint(1, 64)]
        one_input(bytes(d))
        runs += 1
    print(f"fallback fuzzer (tarheader): {runs} inputs, no finding (atheris not installed: replay + random mutations)")


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--write-seeds"]:
        os.makedirs(args[1], exist_ok=True)
        for name, m in SEEDS.items():
            with open(os.path.join(args[1], name), "wb") as fh:
                fh.write(encode(m))
        return
    try:
        import atheris  # type: ignore[import-not-found]
    except ImportError:
        atheris = None
    if atheris is None:
        corpus = next((a for a in args if not a.startswith("-")), None)
        seconds = next((float(a.split("=", 1)[1]) for a in args if a.startswith("-max_total_time=")), 10.0)
        if corpus is None:
            raise SystemExit("usage: fuzz_tarheader.py CORPUS_DIR [-max_total_time=SECONDS]")
        _fallback(corpus, seconds)
        return
    dictionary = os.path.join(HERE, "dict", "tarheader.dict")
    if not any(a.startswith("-dict=") for a in args) and os.path.exists(dictionary):
        args.append(f"-dict={dictionary}")
    # Coverage of the writer guides the mutations (instrumenting every loaded function, tarfile's
    # reader included, takes about a minute on this machine: more than the whole run in test.sh).
    import sandbox_fs.snapshot._header as header_module
    for fname in ("encode_header", "ustar_fits", "_ustar", "_pax", "_record"):
        setattr(header_module, fname, atheris.instrument_func(getattr(header_module, fname)))
    global encode_header
    encode_header = header_module.encode_header
    atheris.Setup([sys.argv[0]] + args, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
