"""Fuzz target ``manifest``: manifest parse + materialize against a host tree with planted traps.

The trusted base directory ``host/`` holds ordinary files and directories,
a symlink to the outside secret, an absolute symlink to the outside, a
symlinked directory, a FIFO, a socket, a hard link to the outside secret,
a set-uid file and a small tar; a read-only grant ``granted/`` beside it.
An input is manifest JSON in which ``@GRANT@`` and ``@OUT@`` stand for the
grant's and the outside's host paths.  It is loaded untrusted and
materialized into a fresh workspace.  Checked, besides the common invariant:
the host tree and the grant are unchanged (sources are only read), and no
FIFO was opened (a hang is a libFuzzer timeout).  A refusal of an input
that names a host path through a placeholder may echo it (the input's own
text); no other refusal may show a host path.
"""

from __future__ import annotations

import io
import json
import os
import socket
import tarfile

from .._sentinel import OutsideSentinel
from ._target import Finding, Scene, Target

__all__ = ["MANIFEST"]


def _plant(scene: Scene) -> None:
    host = os.path.join(scene.base, "host")
    # host-access: the fuzz scene's own host tree, built by the harness before the input runs
    os.makedirs(os.path.join(host, "src", "sub"))
    # host-access: the fuzz scene's own host tree, built by the harness before the input runs
    os.makedirs(os.path.join(scene.base, "granted"))
    for rel, data in (("src/a.txt", b"a\n"), ("src/sub/b.txt", b"b\n"), ("plain", b"plain\n"),
                      ("setuid", b"#!/bin/sh\n")):
        # host-access: the fuzz scene's own host tree, built by the harness before the input runs
        with open(os.path.join(host, rel), "wb") as fh:
            fh.write(data)
    # host-access: the fuzz scene's own host tree, built by the harness before the input runs
    with open(os.path.join(scene.base, "granted", "g.txt"), "wb") as fh:
        fh.write(b"granted\n")
    os.chmod(os.path.join(host, "setuid"), 0o4755)
    for name, target in (("src/to_secret", "../../outside/secret.txt"), ("src/abs_out", scene.outside),
                         ("src/in_link", "a.txt"), ("dirlink", "../outside"), ("src/up", "..")):
        os.symlink(target, os.path.join(host, name))
    os.mkfifo(os.path.join(host, "src", "fifo"))
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(os.path.join(host, "src", "sock"))
    sock.close()
    os.link(os.path.join(scene.outside, "secret.txt"), os.path.join(host, "src", "hard_secret"))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, typ, link in (("ok", tarfile.REGTYPE, ""), ("l", tarfile.SYMTYPE, "../outside"),
                                ("h", tarfile.LNKTYPE, "../outside/secret.txt")):
            ti = tarfile.TarInfo(name)
            ti.type, ti.linkname = typ, link
            tf.addfile(ti, io.BytesIO(b"") if typ == tarfile.REGTYPE else None)
    with open(os.path.join(host, "a.tar"), "wb") as fh:
        fh.write(buf.getvalue())


class _Env:
    def __init__(self) -> None:
        self.scene = Scene("manifest", prepare=_plant)
        self.host = os.path.join(self.scene.base, "host")
        self.grant = os.path.join(self.scene.base, "granted")
        self.guards = [OutsideSentinel(self.host), OutsideSentinel(self.grant)]
        self.inodes = set().union(*(g.inodes for g in self.guards))


_env: _Env | None = None


def one_input(data: bytes) -> None:
    """Load ``data`` as an untrusted manifest and materialize it; raise a Finding if the invariant breaks."""
    import trio  # noqa: PLC0415

    from ... import Grant, open_root  # noqa: PLC0415
    from ...manifest import load_manifest  # noqa: PLC0415
    from ...materialize import MaterializeOptions, materialize  # noqa: PLC0415

    global _env
    if _env is None:
        _env = _Env()
    env = _env
    text = data.replace(b"@GRANT@", env.grant.encode()).replace(b"@OUT@", env.scene.outside.encode())
    env.scene.reset()

    def step() -> None:
        manifest = load_manifest(text)
        options = MaterializeOptions(base_dir=env.host, extra_path_grants=[Grant(env.grant, read_only=True)],
                                     max_file_bytes=1 << 20, max_total_bytes=4 << 20, max_files=500)
        with open_root(env.scene.ws) as ws:
            trio.run(materialize, ws, manifest, options)

    # An input that names a host path (through a placeholder) may see it echoed in a refusal:
    # that is its own text, not a leak.  Other inputs must never see one.
    env.scene.run(step, host_paths=() if env.scene.base.encode() in text else None)
    try:
        for g in env.guards:
            g.check()
        from .._sentinel import check_destination  # noqa: PLC0415

        check_destination(env.scene.ws, outside_inodes=env.inodes)
    except AssertionError as exc:
        raise Finding(str(exc)) from None


def _m(entries: dict[str, object]) -> bytes:
    return json.dumps({"version": 1, "entries": entries}).encode()


def seeds() -> list[bytes]:
    """One manifest per entry type and trap: each source kind, escaping links, special files, the grant."""
    return [
        _m({"f": {"type": "file", "content": "hello", "mode": 420}, "d": {"type": "dir", "children": {
            "x": {"type": "file", "content": "x"}}}, "s": {"type": "symlink", "target": "f"}}),
        _m({"c": {"type": "local_file", "src": "src/a.txt"}, "t": {"type": "local_dir", "src": "src",
                                                                   "symlinks": "skip", "special_files": "skip"}}),
        _m({"t": {"type": "local_dir", "src": "src"}}),
        _m({"x": {"type": "local_file", "src": "src/to_secret"}, "y": {"type": "local_file", "src": "dirlink/secret.txt"}}),
        _m({"x": {"type": "local_file", "src": "src/fifo"}, "y": {"type": "local_file", "src": "src/hard_secret"}}),
        _m({"g": {"type": "local_file", "src": "@GRANT@/g.txt"}, "o": {"type": "local_file", "src": "@OUT@/secret.txt"}}),
        _m({"a": {"type": "archive", "src": "a.tar"}, "u": {"type": "local_file", "src": "setuid"}}),
        _m({"s": {"type": "symlink", "target": "../outside"}, "s/x": {"type": "file", "content": "x"}}),
        _m({"l": {"type": "local_dir", "src": "src/up", "include": ["*.txt"], "exclude": ["sub"]}}),
    ]


TOKENS = (b'"type"', b'"file"', b'"dir"', b'"symlink"', b'"local_file"', b'"local_dir"', b'"archive"',
          b'"src"', b'"content"', b'"target"', b'"mode"', b'"children"', b'"include"', b'"exclude"',
          b'"symlinks"', b'"special_files"', b'"skip"', b'"entries"', b"@GRANT@", b"@OUT@", b'"../"',
          b'"src/fifo"', b'"src/sock"', b'"src/hard_secret"', b'"dirlink"', b'"src/up"', b'"a.tar"', b"2559")

MANIFEST = Target("manifest", one_input, seeds, TOKENS)
