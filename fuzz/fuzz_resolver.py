"""atheris harness: the two resolvers must agree, and never open outside the root.

A fixed tree holds the interesting shapes (in-root symlinks, links to ``..``,
to ``/etc``, absolute links, loops, dangling links, a file used as a
directory).  Each input is split into open flags and a path; both
``openat2(RESOLVE_BENEATH|RESOLVE_NO_MAGICLINKS)`` and the fallback walker
must return the same object (dev, ino) or the same errno, and any object
returned must be one of the tree's own inodes.

    python fuzz/fuzz_resolver.py [libFuzzer flags, e.g. -max_total_time=60] [corpus dir]
"""

from __future__ import annotations

import os
import sys
import tempfile

import atheris

with atheris.instrument_imports():
    from sandbox_fs import _native

FLAG_SETS = [os.O_PATH, os.O_PATH | os.O_NOFOLLOW, os.O_RDONLY, os.O_RDONLY | os.O_DIRECTORY,
             os.O_RDONLY | os.O_NOFOLLOW, os.O_PATH | os.O_DIRECTORY]
RESOLVES = [0, _native.RESOLVE_NO_SYMLINKS]

BASE = tempfile.mkdtemp(prefix="sfs-fuzz-resolver-")
TOP = os.path.join(BASE, "root")
os.makedirs(os.path.join(TOP, "a", "b", "c"))
os.makedirs(os.path.join(BASE, "outside"))
with open(os.path.join(TOP, "a", "f"), "w") as f:
    f.write("f")
for name, target in [("a/up", ".."), ("a/b/upup", "../.."), ("esc", "../outside"), ("etc", "/etc"),
                     ("abs", TOP), ("loop1", "loop2"), ("loop2", "loop1"), ("dangling", "nope"),
                     ("a/b/c/self", "."), ("cb", "a/b"), ("ff", "a/f"), ("a/deep", "b/c/../../up/b")]:
    os.symlink(target, os.path.join(TOP, name))
INSIDE = set()
for dirpath, dirs, files in os.walk(TOP):
    for n in dirs + files + ["."]:
        st = os.lstat(os.path.join(dirpath, n))
        INSIDE.add((st.st_dev, st.st_ino))
ROOTFD = os.open(TOP, os.O_PATH | os.O_DIRECTORY)
ALPHABET = [b"a", b"b", b"c", b"f", b"up", b"upup", b"esc", b"etc", b"abs", b"loop1", b"dangling",
            b"self", b"cb", b"ff", b"deep", b"..", b".", b"", b"nope"]


@atheris.instrument_func
def outcome(fn, path: bytes, flags: int, resolve: int):
    ret = fn(ROOTFD, path, flags, 0, resolve | _native.RESOLVE_BENEATH | _native.RESOLVE_NO_MAGICLINKS)
    if ret < 0:
        return ("err", -ret)
    try:
        st = os.fstat(ret)
        return ("ok", st.st_dev, st.st_ino)
    finally:
        os.close(ret)


@atheris.instrument_func
def test_one(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    flags = FLAG_SETS[fdp.ConsumeIntInRange(0, len(FLAG_SETS) - 1)]
    resolve = RESOLVES[fdp.ConsumeIntInRange(0, 1)]
    if fdp.ConsumeBool():
        path = b"/".join(ALPHABET[fdp.ConsumeIntInRange(0, len(ALPHABET) - 1)]
                         for _ in range(fdp.ConsumeIntInRange(1, 12)))
    else:
        path = fdp.ConsumeBytes(200).replace(b"\0", b"")
    if not path:
        return
    a = outcome(_native.lib.sfs_openat2, path, flags, resolve)
    b = outcome(_native.lib.sfs_open_fallback, path, flags, resolve)
    if a != b:
        raise AssertionError(f"resolvers disagree on {path!r} flags={flags:#o} resolve={resolve}: {a} vs {b}")
    if a[0] == "ok" and (a[1], a[2]) not in INSIDE:
        raise AssertionError(f"{path!r} opened an object outside the root")


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one)
    atheris.Fuzz()
