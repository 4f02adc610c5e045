"""Fuzz target ``hydrate``: arbitrary bytes and mutated real snapshots through :func:`sandbox_fs.snapshot.hydrate`.

The seeds are real snapshots: small workspaces (files, directories,
in-root symlinks, hard links, odd modes) persisted into a
:class:`~sandbox_fs.snapshot.LocalSnapshotStore` and read back.  An input is
an archive served by a *forged store* (:class:`ForgedStore`, the
:class:`~sandbox_fs.snapshot.SnapshotStore` protocol) whose metadata is the
real snapshot's with size and checksums recomputed over the input, so the
input passes the store's verification and meets hydrate's own rules: the
threat of a store an attacker writes to.  The workspace starts with
content of its own.  Checked, besides the common invariant: a hydrate that
fails leaves that content exactly as it was (bytes and metadata).

A plain archive can also be served as a version-2 generation (one
archive, no index) through a forged
:class:`~sandbox_fs.snapshot.GenerationStore`, its archive digest BLAKE3 or
SHA-256, chosen by the input's last byte (see :func:`_store_for`): the
verifying reader hydrate reads a generation through is fuzzed with both
digest kinds.

An input starting with ``SFS-LAYERS`` is a chain of layer tars and its final
index (deletion list included), served by a forged
:class:`~sandbox_fs.snapshot.GenerationStore` whose digests all match it
(see ``_layers``): the same invariant holds for layers, deletion lists and
the index.
"""

from __future__ import annotations

import hashlib
import io
import os
import zlib
from typing import IO, Any

import blake3

from .._sentinel import OutsideSentinel
from ._layers import TOKENS as LAYER_TOKENS
from ._layers import decode_chain, forged_store, layered_seeds
from ._target import Finding, Scene, Target

__all__ = ["HYDRATE", "ForgedStore"]

NAME = "fuzz"


class ForgedStore:
    """A store serving one archive (``bytes``) under ``info``'s metadata, checksums recomputed to match it."""

    enabled = True

    def __init__(self, archive: bytes, info: Any) -> None:
        update: dict[str, Any] = {"archive_bytes": len(archive)}
        if getattr(info, "archive_crc32", ""):  # version 1 (a version-2 generation records none)
            update["archive_crc32"] = f"{zlib.crc32(archive) & 0xFFFFFFFF:08x}"
        if getattr(info, "archive_sha256", ""):
            update["archive_sha256"] = hashlib.sha256(archive).hexdigest()
        if getattr(info, "archive_blake3", ""):
            update["archive_blake3"] = blake3.blake3(archive).hexdigest()
        self._archive = archive
        self._info = info.model_copy(update=update)

    def info(self, name: str) -> Any:
        return self._info if name == NAME else None

    def open_archive(self, name: str, limits: Any) -> tuple[IO[bytes], Any]:
        from ...snapshot import SnapshotNotFoundError  # noqa: PLC0415

        if name != NAME:
            raise SnapshotNotFoundError("no such snapshot", sandbox_path=None)
        return io.BytesIO(self._archive), self._info

    def list(self) -> list[Any]:
        return [self._info]

    def begin(self, name: str) -> Any:
        raise NotImplementedError("a forged store is read-only")

    commit = abort = remove = begin

    def close(self) -> None:
        pass


def _fill(ws: str, variant: int) -> None:
    # host-access: the fuzz scene's own workspace, built by the harness before the input runs
    os.makedirs(os.path.join(ws, "d", "e"))
    for rel, data in (("a", b"alpha\n"), ("d/b", b"beta" * (1 + variant * 100)), ("d/e/c", b"")):
        # host-access: the fuzz scene's own workspace, built by the harness before the input runs
        with open(os.path.join(ws, rel), "wb") as fh:
            fh.write(data)
    # host-access: the fuzz scene's own workspace, built by the harness before the input runs
    os.symlink("d/b", os.path.join(ws, "l"))
    # host-access: the fuzz scene's own workspace, built by the harness before the input runs
    os.symlink("../a", os.path.join(ws, "d", "up"))
    # host-access: the fuzz scene's own workspace, built by the harness before the input runs
    os.link(os.path.join(ws, "a"), os.path.join(ws, "h"))
    # host-access: the fuzz scene's own workspace, built by the harness before the input runs
    os.chmod(os.path.join(ws, "d", "b"), 0o600 if variant else 0o755)
    if variant == 2:
        # host-access: the fuzz scene's own workspace, built by the harness before the input runs
        os.mkdir(os.path.join(ws, "empty"), 0o700)
        # host-access: the fuzz scene's own workspace, built by the harness before the input runs
        os.chmod(os.path.join(ws, "d", "e"), 0o555)


class _Env:
    def __init__(self) -> None:
        from ... import open_root  # noqa: PLC0415
        from ...snapshot import LocalSnapshotStore, SnapshotLimits, persist  # noqa: PLC0415

        self.scene = Scene("hydrate")
        self.limits = SnapshotLimits(max_entries=2000, max_file_bytes=1 << 20, max_total_bytes=8 << 20,
                                     max_archive_bytes=16 << 20)
        store = LocalSnapshotStore(os.path.join(self.scene.base, "store"))
        self.real: list[bytes] = []
        self.info: Any = None
        for variant in range(3):
            self.scene.reset()
            _fill(self.scene.ws, variant)
            with open_root(self.scene.ws) as ws:
                persist(ws, store, NAME, limits=self.limits)
            f, info = store.open_archive(NAME, self.limits)
            with f:
                self.real.append(f.read())
            self.info = info
        store.close()
        self.chains, self.layer_info = layered_seeds(self.scene.reset, self.scene.ws, self.limits, NAME)


_env: _Env | None = None


def _get_env() -> _Env:
    global _env
    if _env is None:
        _env = _Env()
    return _env


def _store_for(data: bytes, env: _Env) -> Any:
    """The forged store serving ``data``: a chain (``SFS-LAYERS``), else one archive, as version 1 or 2.

    A plain archive whose last byte has bit 1 set (a byte of the
    end-of-archive zeros in a seed, which tarfile never reads) is served as
    a one-generation :class:`~sandbox_fs.snapshot.GenerationStore` snapshot
    with no index, its archive digest BLAKE3 or SHA-256 by that byte's low
    bit (:func:`~._layers.archive_digest_fields`); else as the version-1
    store's snapshot it was persisted as (:class:`ForgedStore`).
    """
    chain = decode_chain(data)
    if chain is not None:
        return forged_store(NAME, *chain, env.layer_info)
    if data and data[-1] & 2:
        return forged_store(NAME, [data], None, env.layer_info)
    return ForgedStore(data, env.info)


def one_input(data: bytes) -> None:
    """Hydrate ``data`` as a forged snapshot into a workspace with content; raise a Finding if the invariant breaks."""
    from ... import open_root  # noqa: PLC0415
    from ...snapshot import hydrate  # noqa: PLC0415

    env = _get_env()
    scene = env.scene
    scene.reset()
    # host-access: the fuzz scene's own workspace, built by the harness before the input runs
    with open(os.path.join(scene.ws, "mine"), "wb") as fh:
        fh.write(b"the workspace's own file\n")
    # host-access: the fuzz scene's own workspace, built by the harness before the input runs
    os.mkdir(os.path.join(scene.ws, "mydir"))
    before = OutsideSentinel(scene.ws)
    store = _store_for(data, env)
    failed = []

    def step() -> None:
        try:
            with open_root(scene.ws) as ws:
                hydrate(ws, store, NAME, limits=env.limits)  # type: ignore[arg-type]
        except BaseException:
            failed.append(True)
            raise

    scene.run(step)
    if failed:
        changed = [c for c in before.changes() if not c.startswith(".:")]  # the staging dir came and went
        if changed:
            raise Finding("a failed hydrate changed the workspace: " + "; ".join(changed[:10]))


def seeds() -> list[bytes]:
    """The real snapshots (persisted workspaces), one truncated, two served as version-2 generations, and the
    layered chains (see ``_layers``)."""
    env = _get_env()
    real = list(env.real)
    as_v2 = [real[0][:-1] + b"\x02", real[1][:-1] + b"\x03"]  # a BLAKE3 and a SHA-256 generation (_store_for)
    return real + [real[0][: len(real[0]) // 2]] + as_v2 + env.chains


TOKENS = LAYER_TOKENS + (b"ustar\x00", b"00", b"path=", b"linkpath=", b"size=", b"mode=", b"../", b"/", b".sfs-hydrate-",
          b"0000755\x00", b"0004755\x00", b"0000644\x00", b"outside/secret.txt", b"mine", b"mydir")

HYDRATE = Target("hydrate", one_input, seeds, TOKENS)
