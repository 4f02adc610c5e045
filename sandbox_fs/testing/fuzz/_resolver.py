"""Fuzz target ``resolver``: the two resolvers must agree, and never open outside the root.

A fixed tree holds the interesting shapes (in-root symlinks, links to
``..``, to the outside sentinel, to ``/etc``, absolute links, loops,
dangling links, a file used as a directory).  Each input is split into
open flags, resolve flags and a path (from an alphabet of the tree's names,
or raw bytes); ``openat2(RESOLVE_BENEATH|RESOLVE_NO_MAGICLINKS)`` and the
fallback walker must return the same object ``(st_dev, st_ino)`` or the
same errno, any object returned must be one of the tree's own inodes, and
the outside sentinel must be unchanged.
"""

from __future__ import annotations

import os
import struct

from ._target import Finding, Scene, Target

__all__ = ["RESOLVER"]

FLAG_SETS = (os.O_PATH, os.O_PATH | os.O_NOFOLLOW, os.O_RDONLY, os.O_RDONLY | os.O_DIRECTORY,
             os.O_RDONLY | os.O_NOFOLLOW, os.O_PATH | os.O_DIRECTORY)
ALPHABET = (b"a", b"b", b"c", b"f", b"up", b"upup", b"esc", b"etc", b"abs", b"loop1", b"dangling",
            b"self", b"cb", b"ff", b"deep", b"..", b".", b"", b"nope", b"secret.txt")
LINKS = (("a/up", ".."), ("a/b/upup", "../.."), ("esc", "../outside"), ("etc", "/etc"),
         ("loop1", "loop2"), ("loop2", "loop1"), ("dangling", "nope"), ("a/b/c/self", "."),
         ("cb", "a/b"), ("ff", "a/f"), ("a/deep", "b/c/../../up/b"), ("sec", "../outside/secret.txt"))


class _Tree:
    def __init__(self) -> None:
        self.scene = Scene("resolver")
        self.scene.reset()
        top = self.scene.ws
        # host-access: the harness's own mkdtemp scratch tree, built while no input runs; never a name from an input
        os.makedirs(os.path.join(top, "a", "b", "c"))
        # host-access: the harness's own mkdtemp scratch tree, built while no input runs; never a name from an input
        with open(os.path.join(top, "a", "f"), "w") as fh:
            fh.write("f")
        for name, target in LINKS + (("abs", top),):
            # host-access: the harness's own mkdtemp scratch tree, built while no input runs; never a name from an input
            os.symlink(target, os.path.join(top, name))
        self.inside = set()
        # host-access: the harness's own mkdtemp scratch tree, built while no input runs; never a name from an input
        for dirpath, dirs, files in os.walk(top):
            for n in dirs + files + ["."]:
                # host-access: the harness's own mkdtemp scratch tree, built while no input runs; never a name from an input
                st = os.lstat(os.path.join(dirpath, n))
                self.inside.add((st.st_dev, st.st_ino))
        # host-access: the harness's own mkdtemp scratch tree, built while no input runs; never a name from an input
        self.fd = os.open(top, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


_tree: _Tree | None = None


def _outcome(resolver: str, rootfd: int, path: bytes, flags: int, resolve: int) -> tuple[object, ...]:
    """One resolver's answer through _native's named contract (the compiled module is reached only there)."""
    from ... import _native  # noqa: PLC0415

    resolve |= _native.RESOLVE_BENEATH | _native.RESOLVE_NO_MAGICLINKS
    if resolver == "openat2":
        ret = _native.openat2_raw(rootfd, path, flags, 0, resolve)
    else:
        ret = _native.open_beneath_ret("fallback", rootfd, path, flags, 0, resolve)
    if ret < 0:
        return ("err", -ret)
    try:
        st = os.fstat(ret)
        return ("ok", st.st_dev, st.st_ino)
    finally:
        os.close(ret)


def one_input(data: bytes) -> None:
    """Resolve the path coded in ``data`` with both resolvers; raise a Finding on any disagreement or escape."""
    from ... import _native  # noqa: PLC0415

    global _tree
    if _tree is None:
        _tree = _Tree()
    head = data[:3].ljust(3, b"\0")
    flags = FLAG_SETS[head[0] % len(FLAG_SETS)]
    resolve = _native.RESOLVE_NO_SYMLINKS if head[1] & 1 else 0
    body = data[3:]
    if head[2] & 1:
        path = b"/".join(ALPHABET[b % len(ALPHABET)] for b in body[:12])
    else:
        path = body[:200].replace(b"\0", b"")
    if not path:
        return
    a = _outcome("openat2", _tree.fd, path, flags, resolve)
    b = _outcome("fallback", _tree.fd, path, flags, resolve)
    if a != b:
        raise Finding(f"resolvers disagree on {path!r} flags={flags:#o} resolve={resolve}: {a} vs {b}")
    if a[0] == "ok" and (a[1], a[2]) not in _tree.inside:
        raise Finding(f"{path!r} opened an object outside the root")
    _tree.scene.sentinel.check()


def seeds() -> list[bytes]:
    """Seeds: alphabet paths through each link shape, and a raw path or two."""
    out = [bytes([0, 0, 1]) + bytes([ALPHABET.index(n) for n in p])
           for p in ((b"a", b"up", b"a", b"f"), (b"esc", b"secret.txt"), (b"cb", b"upup", b"etc"),
                     (b"a", b"deep", b"c", b"self", b"self"), (b"loop1",), (b"ff", b".."))]
    out += [bytes([2, 1, 0]) + b"a/b/../../a/f", bytes([3, 0, 0]) + b"cb/c/../../..", struct.pack("3B", 4, 0, 0) + b"sec"]
    return out


TOKENS = tuple(b"/" + n for n in ALPHABET if n) + (b"/../", b"//", b"/./")

RESOLVER = Target("resolver", one_input, seeds, TOKENS, native=True)
