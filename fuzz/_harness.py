"""Shared body of the archive fuzz harnesses (atheris when installed, else a replay+mutation loop).

Each input is extracted (from memory or, by a bit of its first byte, from a host file: the
batched path; another bit applies owners) into a fresh workspace next to a sentinel ``outside/``
tree.  A finding is: any exception that is not a ``SandboxError`` (a crash or
an unexpected error type), a change under ``outside/``, a symlink in the
workspace resolving outside it, or a special / setuid node in it.
"""

from __future__ import annotations

import atexit
import io
import os
import random
import shutil
import stat
import sys
import tempfile
import time

from sandbox_fs import SandboxError, open_root
from sandbox_fs.archive import ArchiveLimits, ExtractPolicy, extract

LIMITS = ArchiveLimits(max_members=2000, max_total_bytes=8 << 20, max_member_bytes=4 << 20,
                       max_header_bytes=64 << 10, max_input_bytes=16 << 20, ratio_grace_bytes=1 << 20)
_BASE = tempfile.mkdtemp(prefix="sfs-fuzz-")
atexit.register(shutil.rmtree, _BASE, True)
WS = os.path.join(_BASE, "ws")
OUTSIDE = os.path.join(_BASE, "outside")
SRC = os.path.join(_BASE, "input.bin")  # the input as a host file, beside (not in) the workspace
os.makedirs(os.path.join(OUTSIDE, "sub"))
with open(os.path.join(OUTSIDE, "secret.txt"), "w") as _fh:
    _fh.write("SECRET\n")


def _outside_state() -> list[tuple]:
    out = []
    for dirpath, dirs, files in os.walk(OUTSIDE):
        for n in sorted(dirs + files):
            st = os.lstat(os.path.join(dirpath, n))
            out.append((dirpath, n, st.st_mode, st.st_size, st.st_mtime_ns, st.st_nlink))
    return out


_BEFORE = _outside_state()


def _check_ws() -> None:
    real = os.path.realpath(WS)
    for dirpath, dirs, files in os.walk(WS):
        for n in dirs + files:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                r = os.path.realpath(p)
                if len(p) < 3800 and not (r == real or r.startswith(real + os.sep)):
                    raise AssertionError(f"symlink escapes: {p} -> {os.readlink(p)}")
            elif not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                raise AssertionError(f"special node {p}")
            elif st.st_mode & stat.S_ISUID:
                raise AssertionError(f"setuid {p}")
            elif stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                pass  # hard links inside the workspace are fine


def one_input(data: bytes, fmt: str) -> None:
    shutil.rmtree(WS, ignore_errors=True)
    os.mkdir(WS)
    flags = data[0] if data else 0
    in_place = flags & 1 == 1 and fmt == "tar"
    # bit 1: read from a regular file (the batched kernel-side copy path for plain tar);
    # bit 2: apply owners (as root), so header uid/gid numbers reach fchown
    source: object = io.BytesIO(data)
    if flags & 2:
        with open(SRC, "wb") as fh:
            fh.write(data)
        source = SRC
    try:
        with open_root(WS) as root:
            extract(root, "dest" if len(data) % 2 else ".", source, format=fmt, limits=LIMITS,
                    policy=ExtractPolicy(in_place=in_place, preserve_owner=bool(flags & 4)))
    except SandboxError:
        pass
    if _outside_state() != _BEFORE:
        raise AssertionError("the outside tree changed")
    _check_ws()


def _fallback(fmt: str, corpus: str, seconds: float) -> None:
    seeds = [open(os.path.join(corpus, n), "rb").read() for n in sorted(os.listdir(corpus))]
    for s in seeds:
        one_input(s, fmt)
    rng = random.Random(1234)
    end = time.monotonic() + seconds
    runs = len(seeds)
    while time.monotonic() < end:
        d = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 8)):
            op = rng.random()
            if op < 0.5 and d:
                d[rng.randrange(len(d))] = rng.randrange(256)
            elif op < 0.7 and d:
                i = rng.randrange(len(d))
                del d[i:i + rng.randint(1, 64)]
            elif op < 0.9:
                i = rng.randrange(len(d) + 1)
                d[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
            else:
                other = rng.choice(seeds)
                i = rng.randrange(len(d) + 1)
                d[i:] = other[rng.randrange(len(other) + 1):]
        one_input(bytes(d), fmt)
        runs += 1
    print(f"fallback fuzzer ({fmt}): {runs} inputs, no finding (atheris not installed: replay + random mutations)")


def main(fmt: str) -> None:
    args = sys.argv[1:]
    try:
        import atheris  # type: ignore[import-not-found]
    except ImportError:
        atheris = None
    if atheris is None:
        corpus = next((a for a in args if not a.startswith("-")), None)
        seconds = next((float(a.split("=", 1)[1]) for a in args if a.startswith("-max_total_time=")), 10.0)
        if corpus is None:
            raise SystemExit("usage: fuzz_X.py CORPUS_DIR [-max_total_time=SECONDS]")
        _fallback(fmt, corpus, seconds)
        return
    atheris.Setup([sys.argv[0]] + args, lambda data: one_input(data, fmt))
    atheris.Fuzz()
