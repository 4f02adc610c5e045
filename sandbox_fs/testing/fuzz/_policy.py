"""Fuzz target ``policy``: extra path grants + sandbox paths against a reference model, both resolvers.

The host layout (rebuilt for each input): a workspace holding files,
in-root and escaping symlinks and a nested read-only grant
(``ws/nested``); a read-only grant ``g_ro`` and a read-write grant
``g_rw`` beside it; the outside sentinel.  The workspace's sandbox
location is ``/workspace``; grants sit at their host paths (so error
texts naming a grant's sandbox path show it: that is not a leak).  An input is one op byte and a path, in which
``@WS@``, ``@RO@``, ``@RW@``, ``@NEST@`` and ``@OUT@`` stand for those host
directories.

Checked after each input:

* ``PathPolicy.resolve`` agrees with a reference model (lexical
  normalization and longest whole-component prefix match, restated here):
  the same refusal class, or the same grant, relative path and access;
* a read or stat through the policy's Root gives the same answer with
  the openat2 resolver and the fallback walker;
* a write (through one resolver, chosen by a bit) never changes the outside,
  ``g_ro`` or ``ws/nested`` (sentinels over each), whatever path led there.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from .._sentinel import OutsideSentinel, classify_failure
from ._target import Finding, Scene, Target

__all__ = ["POLICY"]

MAX_PATH, MAX_NAME = 4096, 255
WS_PATH = "/workspace"


class _Layout:
    def __init__(self) -> None:
        self.scene = Scene("policy")
        self.ro = os.path.join(self.scene.base, "g_ro")
        self.rw = os.path.join(self.scene.base, "g_rw")
        self.nest = os.path.join(self.scene.ws, "nested")

    def build(self) -> list[OutsideSentinel]:
        self.scene.reset()
        for d in (self.ro, self.rw):
            if os.path.lexists(d):
                # host-access: the harness's own grant dirs, removed while no input runs (rmtree walks by fd, follows no symlink)
                shutil.rmtree(d)
        ws = self.scene.ws
        for d in (self.ro, self.rw, self.nest, os.path.join(ws, "d")):
            # host-access: the harness's own mkdtemp scratch tree, built while no input runs; never a name from an input
            os.mkdir(d)
        for d in (ws, self.ro, self.rw, self.nest):
            # host-access: the harness's own mkdtemp scratch tree, built while no input runs; never a name from an input
            with open(os.path.join(d, "f"), "wb") as fh:
                fh.write(b"data of " + os.path.basename(d).encode())
        for name, target in (("in", "d"), ("esc", "../outside"), ("abs", self.scene.outside),
                             ("toro", self.ro), ("tonest", "nested"), ("up", "..")):
            # host-access: the harness's own mkdtemp scratch tree, built while no input runs; never a name from an input
            os.symlink(target, os.path.join(ws, name))
        # host-access: the harness's own mkdtemp scratch tree, built while no input runs; never a name from an input
        os.symlink("..", os.path.join(self.rw, "up"))
        # host-access: the harness's own mkdtemp scratch tree, built while no input runs; never a name from an input
        os.symlink("../ws/nested", os.path.join(self.rw, "nest"))
        return [OutsideSentinel(self.ro), OutsideSentinel(self.nest)]

    def substitute(self, raw: bytes) -> bytes:
        for key, value in ((b"@WS@", WS_PATH), (b"@RO@", self.ro), (b"@RW@", self.rw),
                           (b"@NEST@", self.nest), (b"@OUT@", self.scene.outside)):
            raw = raw.replace(key, value.encode())
        return raw


_layout: _Layout | None = None


def model(path: str, bases: list[tuple[str, bool]]) -> tuple[str, Any]:
    """The reference answer: ``("invalid", None)``, ``("escape", None)``, or ``("ok", (base, rel, read_only))``.

    ``bases`` are ``(absolute sandbox location, read_only)``, the workspace first.
    """
    raw = path.encode("utf-8", "surrogateescape")
    if not path or "\0" in path or len(raw) > MAX_PATH:
        return ("invalid", None)
    comps: list[str] = []
    for comp in path.split("/"):
        if comp in ("", "."):
            continue
        if len(comp.encode("utf-8", "surrogateescape")) > MAX_NAME:
            return ("invalid", None)
        if comp == "..":
            if not comps:
                return ("invalid", None)
            comps.pop()
        elif "\\" in comp and ".." in comp.split("\\"):
            return ("invalid", None)
        else:
            comps.append(comp)
    if path.startswith("/"):
        full = ["", *comps]
    else:
        full = bases[0][0].split("/") + comps
    best = None
    for base, ro in bases:
        parts = base.split("/")
        if full[:len(parts)] == parts and (best is None or len(parts) > len(best[0].split("/"))):
            best = (base, "/".join(full[len(parts):]), ro)
    return ("escape", None) if best is None else ("ok", best)


def _kind(exc: BaseException) -> str:
    from ...errors import InvalidPathError, PathEscapeError, ReadOnlyError  # noqa: PLC0415

    for cls, name in ((InvalidPathError, "invalid"), (PathEscapeError, "escape"), (ReadOnlyError, "read_only")):
        if isinstance(exc, cls):
            return name
    return type(exc).__name__


def _policy(lay: _Layout, resolver: str) -> Any:
    from ... import Grant, PathPolicy, open_root  # noqa: PLC0415

    old = os.environ.get("SANDBOX_FS_RESOLVER")
    os.environ["SANDBOX_FS_RESOLVER"] = resolver
    try:
        ws = open_root(lay.scene.ws)
        return ws, PathPolicy(ws, WS_PATH, [Grant(lay.ro, read_only=True), Grant(lay.rw, read_only=False),
                                                 Grant(lay.nest, read_only=True)])
    finally:
        if old is None:
            del os.environ["SANDBOX_FS_RESOLVER"]
        else:
            os.environ["SANDBOX_FS_RESOLVER"] = old


def _observe(policy: Any, path: str, op: int) -> tuple[Any, ...]:
    try:
        r = policy.resolve(path)
        if op == 0:
            return ("read", r.root.read_bytes(r.rel or ".", max_bytes=1 << 16))
        st = r.root.stat(r.rel or ".")
        return ("stat", st.st_dev, st.st_ino)
    except Exception as exc:  # noqa: BLE001  (classified below)
        return ("error", type(exc).__name__, getattr(exc, "errno", None), classify_failure(exc, host_paths=()))


def _check_resolve(policy: Any, lay: _Layout, path: str) -> None:
    bases = [(WS_PATH, False), (lay.ro, True), (lay.rw, False), (lay.nest, True)]
    hosts = {WS_PATH: lay.scene.ws}
    want = model(path, bases)
    try:
        r = policy.resolve(path)
    except Exception as exc:  # noqa: BLE001
        got: tuple[str, Any] = (_kind(exc), None)
    else:
        base = next((b for b, ro in bases if r.root.identity == _identity(hosts.get(b, b))), None)
        got = ("ok", (base, r.rel, r.read_only))
    if got != want:
        raise Finding(f"PathPolicy.resolve({path!r}) gave {got}, the model {want}")


def _identity(path: str) -> tuple[int, int]:
    # host-access: the identity of a grant base the harness made (its own scratch tree)
    st = os.stat(path)
    return (st.st_dev, st.st_ino)


def one_input(data: bytes) -> None:
    """Run the op and path coded in ``data`` through both resolvers; raise a Finding on a disagreement or a write that lands where it must not."""
    global _layout
    if _layout is None:
        _layout = _Layout()
    lay = _layout
    guards = lay.build()
    op = data[0] % 3 if data else 0
    path = lay.substitute(data[1:1 + 600]).decode("utf-8", "surrogateescape")
    a_ws, a = _policy(lay, "openat2")
    b_ws, b = _policy(lay, "fallback")
    try:
        _check_resolve(a, lay, path)
        if op < 2:
            oa, ob = _observe(a, path, op), _observe(b, path, op)
            if oa != ob:
                raise Finding(f"resolvers disagree on {path!r}: {oa} vs {ob}")
            if oa[0] == "error" and not oa[3]:
                raise Finding(f"{path!r}: unexpected failure {oa[1]}")
        else:
            policy = a if data[0] & 4 else b

            def write() -> None:
                r = policy.resolve(path, for_write=True)
                r.root.write_bytes(r.rel, b"written")

            lay.scene.run(write, destination=os.path.join(lay.scene.ws, "d"), host_paths=())
        lay.scene.sentinel.check()
        for g in guards:
            g.check()
    except AssertionError as exc:
        raise Finding(str(exc)) from None
    finally:
        for p in (a, b):
            p.close()
        a_ws.close()
        b_ws.close()


def seeds() -> list[bytes]:
    """Reads, stats and writes through each grant, nested grant, escaping link and traversal."""
    paths = [b"f", b"d/../f", b"in/../f", b"esc/secret.txt", b"abs/secret.txt", b"toro/f", b"tonest/f",
             b"nested/f", b"@NEST@/f", b"@RO@/f", b"@RW@/f", b"@RW@/up/outside/secret.txt", b"@RW@/nest/f",
             b"@OUT@/secret.txt", b"@WS@/../outside/secret.txt", b"../x", b"@RO@/../g_rw/f", b"up/outside/x",
             b"@WS@/nested/../f", b"a\\..\\b", b"//@RO@//f/"]
    return [bytes([op]) + p for p in paths for op in (0, 1, 2, 6)]


TOKENS = (b"@WS@", b"@RO@", b"@RW@", b"@NEST@", b"@OUT@", b"/..", b"../", b"/./", b"//", b"esc", b"abs",
          b"toro", b"tonest", b"nested", b"in", b"up", b"nest", b"secret.txt", b"\\..", b"\x00")

POLICY = Target("policy", one_input, seeds, TOKENS, native=True)
