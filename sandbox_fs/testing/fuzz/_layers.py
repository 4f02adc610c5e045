"""The layered half of the ``hydrate`` fuzz target: a chain of layer tars and its final index, served by a forged store.

An input that starts with :data:`MAGIC` is a *chain*: sections
``--tar LENGTH\\n<bytes>\\n`` (one per generation, base first, at most 8)
and one ``--index LENGTH\\n<JSON>\\n`` (the final index as its uncompressed
JSON text, so byte mutations act on names, kinds, layers and the deletion
list directly).  :func:`forged_store` serves it through a real
:class:`~sandbox_fs.snapshot.GenerationStore` over an in-memory object store
whose pointer, metadata, archive and index digests are all recomputed over
the input (and the final tree digest over the index's entries, when they
parse; each archive's digest is BLAKE3 or, as older generations record it,
SHA-256, chosen per generation by :func:`archive_digest_fields`), so the
input passes every store-side check and meets hydrate's own:
the chain rules, the index rules (names the extractor accepts, normalized,
unique, nothing below a non-directory, layers within the chain, bounded
entries and deletions) and the one-pass layered extraction.

The seeds are real chains: small workspaces persisted into that in-memory
store as a base and layers (changed and deleted files, a directory replaced
by a symlink, a hard link across layers), plus structured mutations of them
(deletion lists with ``..``, absolute and non-normalized names, a list past
``max_entries``, an entry below a symlink, a layer outside the chain, a
kind the layer does not hold, an escaping member added to a layer tar).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tarfile
import threading
import time
import zlib
from typing import IO, Any, Iterator

import blake3

__all__ = ["MAGIC", "encode_chain", "decode_chain", "forged_store", "archive_digest_fields", "layered_seeds",
           "MemoryObjects", "TOKENS"]

MAGIC = b"SFS-LAYERS\n"
_MAX_LAYERS = 8  # GenerationStore's MAX_CHAIN
_SECTION = re.compile(rb"--(tar|index) ([0-9]{1,9})\n")


def encode_chain(tars: list[bytes], index_json: bytes) -> bytes:
    """The input for a chain (see the module docstring)."""
    out = [MAGIC]
    for t in tars:
        out += [b"--tar %d\n" % len(t), t, b"\n"]
    out += [b"--index %d\n" % len(index_json), index_json, b"\n"]
    return b"".join(out)


def decode_chain(data: bytes) -> tuple[list[bytes], bytes] | None:
    """``(tars, index JSON)`` of a chain input, leniently (a section's length is cut at the input's end); None: not one."""
    if not data.startswith(MAGIC):
        return None
    pos, tars, index = len(MAGIC), [], b""
    while pos < len(data):
        m = _SECTION.match(data, pos)
        if m is None:
            break
        start = m.end()
        body = data[start:start + int(m.group(2))]
        pos = start + len(body) + 1
        if m.group(1) == b"tar":
            tars.append(body)
        else:
            index = body
    if not tars or len(tars) > _MAX_LAYERS:
        return None
    return tars, index


class _Writer:
    def __init__(self, store: "MemoryObjects", key: str) -> None:
        self.store, self.key, self.buf = store, key, bytearray()

    def write(self, data: Any) -> int:
        self.buf += bytes(data)
        return len(data)

    def commit(self) -> Any:
        return self.store.put_bytes(self.key, bytes(self.buf))

    def abort(self) -> None:
        pass


class MemoryObjects:
    """A small in-memory :class:`~sandbox_fs.snapshot.ObjectStore` (etags count writes; conditions under a lock)."""

    def __init__(self) -> None:
        self.objs: dict[str, tuple[bytes, str]] = {}
        self._lock = threading.Lock()
        self._n = 0

    def put_stream(self, key: str) -> _Writer:
        return _Writer(self, key)

    def put_bytes(self, key: str, data: bytes, *, if_match: str | None = None, if_none_match: bool = False) -> Any:
        from ...snapshot import ObjectInfo, SnapshotConflictError  # noqa: PLC0415

        with self._lock:
            cur = self.objs.get(key)
            if if_none_match and cur is not None or if_match is not None and (cur is None or cur[1] != if_match):
                raise SnapshotConflictError("precondition failed", sandbox_path=None)
            self._n += 1
            self.objs[key] = (bytes(data), f"e{self._n}")
            return ObjectInfo(key, len(data), f"e{self._n}", 0.0)

    def _get(self, key: str) -> tuple[bytes, str]:
        from ...snapshot import SnapshotNotFoundError  # noqa: PLC0415

        cur = self.objs.get(key)
        if cur is None:
            raise SnapshotNotFoundError("no such object", sandbox_path=None)
        return cur

    def open_range(self, key: str, start: int = 0, length: int | None = None) -> IO[bytes]:
        data = self._get(key)[0]
        return io.BytesIO(data[start:] if length is None else data[start:start + length])

    def get_bytes(self, key: str, limit: int) -> bytes:
        from ...snapshot import SnapshotLimitError  # noqa: PLC0415

        data = self._get(key)[0]
        if len(data) > limit:
            raise SnapshotLimitError("too large", sandbox_path=None)
        return data

    def head(self, key: str) -> Any:
        from ...snapshot import ObjectInfo  # noqa: PLC0415

        cur = self.objs.get(key)
        return None if cur is None else ObjectInfo(key, len(cur[0]), cur[1], 0.0)

    def list(self, prefix: str) -> Iterator[Any]:
        for key in sorted(self.objs):
            if key.startswith(prefix):
                yield self.head(key)

    def delete(self, key: str) -> None:
        self.objs.pop(key, None)

    def abort_stale_uploads(self, older_than: float) -> int:
        return 0

    def close(self) -> None:
        pass


def _tree_digest(index_json: bytes) -> str | None:
    """The tree digest of the index's entries, as the store records it (None: they do not parse)."""
    try:
        sha = hashlib.sha256()
        for e in json.loads(index_json)["entries"]:
            path, kind, size, mode, content = e[0], e[1], e[3], e[6], e[7]
            line = f"{path}\0{kind}\0{size if kind == 'file' else 0}\0{mode:o}\0{content}\n"
            sha.update(line.encode("utf-8", "surrogateescape"))
        return sha.hexdigest()
    except (ValueError, KeyError, TypeError, IndexError, UnicodeError):
        return None


def archive_digest_fields(tar: bytes, generation: int) -> dict[str, str]:
    """The archive digest of generation ``generation`` of a forged chain: ``archive_blake3`` or ``archive_sha256``.

    Both kinds a version-2 generation may record are covered (what persist
    writes now, and what older generations carry), chosen by the low bit of
    the tar's last byte (the end-of-archive zeros in a seed, which tarfile
    never reads: a mutation flips the kind without changing the members)
    and the generation's parity, so every real chain mixes both kinds.  The
    other field is "" (metadata records one).
    """
    blake = ((tar[-1] if tar else 0) ^ generation) & 1
    if blake:
        return {"archive_blake3": blake3.blake3(tar).hexdigest(), "archive_sha256": ""}
    return {"archive_sha256": hashlib.sha256(tar).hexdigest(), "archive_blake3": ""}


def forged_store(name: str, tars: list[bytes], index_json: bytes | None, template: Any) -> Any:
    """A GenerationStore over :class:`MemoryObjects` holding the chain, every digest recomputed to verify.

    ``index_json``: the final index (None: the final generation has none, as a plain archive).
    ``template``: a real generation's :class:`~sandbox_fs.snapshot.SnapshotInfo` (the fields not recomputed).
    The archive digests are of both kinds (:func:`archive_digest_fields`).
    """
    from ...snapshot import GenerationStore  # noqa: PLC0415

    objects = MemoryObjects()
    index = zlib.compress(index_json or b"", 1)
    entries: list[dict[str, Any]] = []
    parent_digest, parent_dir = "", ""
    for g, tar in enumerate(tars, start=1):
        gen_dir = f"{g:012d}-{g:016x}"
        base = f"{name}/gen/{gen_dir}"
        final = g == len(tars)
        update: dict[str, Any] = {
            "version": 2, "name": name, "generation": g, "archive": f"{base}/archive.tar",
            "archive_bytes": len(tar), "archive_crc32": "",  # version 2: no CRC-32, the archive digest is checked
            **archive_digest_fields(tar, g), "parent_generation": g - 1,
            "parent_digest": parent_digest, "chain_length": g, "index_sha256": "", "index_bytes": 0}
        if final and index_json is not None:
            update.update(index_sha256=hashlib.sha256(index).hexdigest(), index_bytes=len(index),
                          tree_digest=_tree_digest(index_json) or template.tree_digest)
            objects.put_bytes(f"{base}/index", index)
        meta = json.dumps(template.model_copy(update=update).model_dump(mode="python"), ensure_ascii=True).encode()
        objects.put_bytes(f"{base}/archive.tar", tar)
        objects.put_bytes(f"{base}/meta.json", meta)
        parent_digest = hashlib.sha256(meta).hexdigest()
        entries.insert(0, {"generation": g, "dir": gen_dir, "meta_sha256": parent_digest, "parent": parent_dir})
        parent_dir = gen_dir
    pointer = {"format": "sandbox-fs-generations", "version": 1, "name": name, "generations": entries,
               "restore_points": 1}
    objects.put_bytes(f"{name}/current", json.dumps(pointer).encode())
    return GenerationStore(objects, keep=1)


def _chain_of(store: Any, objects: MemoryObjects, name: str) -> tuple[list[bytes], bytes, Any]:
    """``(tars, index JSON, final info)`` of the current chain a real persist left in ``objects``."""
    infos = []
    info = store.info(name)
    while True:
        infos.insert(0, info)
        if not info.parent_generation:
            break
        info = next(i for i in _all_infos(objects, name) if i.generation == info.parent_generation)
    tars = [_trimmed(objects.get_bytes(i.archive, 1 << 30)) for i in infos]
    index_json = zlib.decompress(objects.get_bytes(infos[-1].archive.rsplit("/", 1)[0] + "/index", 1 << 30))
    return tars, index_json, infos[-1]


def _trimmed(tar: bytes) -> bytes:
    """``tar`` without its record padding (the end-of-archive blocks kept): smaller seeds, the same members."""
    end = len(tar)
    while end >= 512 and not tar[end - 512:end].strip(b"\0"):
        end -= 512
    return tar[:end] + bytes(1024)


def _small_base(tars: list[bytes], index_json: bytes, path: str, data: bytes) -> tuple[list[bytes], bytes]:
    """The chain with the base's ``path`` (kept large only so that persist layered) holding ``data`` instead."""
    src, dst = io.BytesIO(tars[0]), io.BytesIO()
    with tarfile.open(fileobj=src) as tin, tarfile.open(fileobj=dst, mode="w", format=tarfile.PAX_FORMAT) as tout:
        for m in tin.getmembers():
            if m.name == path:
                m.size = len(data)
                tout.addfile(m, io.BytesIO(data))
            else:
                tout.addfile(m, tin.extractfile(m) if m.isfile() else None)
    doc = json.loads(index_json)
    doc["entries"] = [[e[0], e[1], e[2], len(data), *e[4:7], hashlib.sha256(data).hexdigest(), *e[8:]]
                      if e[0] == path else e for e in doc["entries"]]
    return [_trimmed(dst.getvalue())] + tars[1:], json.dumps(doc, separators=(",", ":")).encode()


def _all_infos(objects: MemoryObjects, name: str) -> list[Any]:
    from ...snapshot import SnapshotInfo  # noqa: PLC0415

    return [SnapshotInfo.model_validate(json.loads(objects.get_bytes(k, 1 << 30)))
            for k in list(objects.objs) if k.startswith(f"{name}/gen/") and k.endswith("/meta.json")]


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as fh:  # host-access: the fuzz scene's own workspace, built before the input runs
        fh.write(data)


def _real_chain(ws: str, limits: Any, name: str) -> tuple[list[bytes], bytes, Any]:
    """Persist a base and three layers of a small tree into memory: what a real chain looks like."""
    from ... import open_root  # noqa: PLC0415
    from ...snapshot import GenerationStore, persist  # noqa: PLC0415

    objects = MemoryObjects()
    store = GenerationStore(objects, keep=1)
    # host-access: the fuzz scene's own workspace (the test harness builds it)
    os.makedirs(os.path.join(ws, "d", "e"))
    for rel, data in (("a", b"alpha\n"), ("d/b", b"beta\n"), ("d/e/c", b"c\n"), ("big", bytes(range(256)) * 256)):
        _write(os.path.join(ws, rel), data)
    os.symlink("d/b", os.path.join(ws, "l"))
    steps = [
        lambda: None,  # the base
        lambda: (_write(os.path.join(ws, "d", "b"), b"beta, changed\n"), os.unlink(os.path.join(ws, "a")),
                 _write(os.path.join(ws, "new"), b"new\n")),  # a change, a deletion, an addition
        lambda: (os.unlink(os.path.join(ws, "d", "e", "c")), os.rmdir(os.path.join(ws, "d", "e")),
                 os.symlink("..", os.path.join(ws, "d", "e"))),  # a directory replaced by a symlink
        lambda: os.link(os.path.join(ws, "new"), os.path.join(ws, "d", "hl")),  # a hard link to an older layer's file
    ]
    for step in steps:
        step()
        time.sleep(0.012)  # past the coarse clock's tick: unchanged files are not racy, so these are layers
        with open_root(ws) as root:
            persist(root, store, name, limits=limits)
    return _chain_of(store, objects, name)


def _mutations(tars: list[bytes], index_json: bytes) -> list[bytes]:
    """Structured mutations of a real chain: the layer attacks of issue 16, as inputs."""
    doc = json.loads(index_json)
    out = []

    def with_doc(**change: Any) -> bytes:
        return encode_chain(tars, json.dumps({**doc, **change}).encode())

    for bad in ("../escape", "/etc/passwd", "d/./b", "d//b", "d/../../x", ""):
        out.append(with_doc(deleted=doc["deleted"] + [bad]))
    out.append(with_doc(deleted=[f"x{i}" for i in range(2001)]))  # past max_entries
    out.append(with_doc(deleted=[f"gone/{i}" for i in range(300)]))  # within it: never acts on a path
    first = doc["entries"][0]
    out.append(with_doc(entries=doc["entries"] + [["d/e/under", "file", *first[2:7], "0" * 64, 1, 1]]))
    out.append(with_doc(entries=[e[:9] + [9] for e in doc["entries"]]))  # a layer outside the chain
    out.append(with_doc(entries=[[*e[:1], "symlink" if e[1] == "file" else e[1], *e[2:]] for e in doc["entries"]]))
    out.append(with_doc(entries=[["../" + e[0], *e[1:]] for e in doc["entries"]]))
    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for member, target in (("../evil", ""), ("d/e/x", ""), ("lnk", "/etc")):
            ti = tarfile.TarInfo(member)
            if target:
                ti.type, ti.linkname = tarfile.SYMTYPE, target
                tf.addfile(ti)
            else:
                ti.size = 4
                tf.addfile(ti, io.BytesIO(b"pwn\n"))
    out.append(encode_chain(tars[:-1] + [evil.getvalue()], index_json))
    out.append(encode_chain(tars[:-1] + [tars[-1][: len(tars[-1]) // 2]], index_json))  # a truncated layer
    return out


def layered_seeds(reset: Any, ws: str, limits: Any, name: str) -> tuple[list[bytes], Any]:
    """The real chain's input and its structured mutations, and the final generation's info (the template)."""
    reset()
    tars, index_json, info = _real_chain(ws, limits, name)
    tars, index_json = _small_base(tars, index_json, "big", b"big\n")
    return [encode_chain(tars, index_json)] + _mutations(tars, index_json), info


TOKENS = (MAGIC, b"--tar ", b"--index ", b'"deleted":[', b'"entries":[', b'"file"', b'"dir"', b'"symlink"',
          b'"../', b'"/', b"/./", b"//", b'"sandbox-fs-index"')
