"""The baseline a restore leaves for the next persist of its name, kept in memory and in the store.

After a hydrate, the restored tree's index with this workspace's new inodes
and times (the *baseline*) lets the first persist after it write a layer:
files whose inode, size, mtime and ctime still match are not read again.
:class:`~sandbox_fs.snapshot.GenerationStore` keeps it in memory and writes
it to the object ``NAME/baseline``, so a new process (a session resumed by
another client object, ``snapshot restore`` then ``snapshot save``) finds it.

What a baseline is trusted for, and why it is authenticated: an index tells
persist which files it need not read, so a lying one makes persist record a
file's previous content for a changed file (the change is lost, silently).
A generation's own index is read through the SHA-256 chain the session's
MAC-protected state binds; a baseline is written after the restore, outside
that chain.  So its index is used only when its HMAC-SHA256 verifies under
the store's ``baseline_key`` (a key the object store does not hold; a
:class:`~sandbox_fs.snapshot.DirectorySnapshotStore` derives it from the
installation key kept in that directory).  Without a key, or when the MAC,
the name, the digest or the body does not match, the index part is ignored
(never an error: persist then compares against the parent's own index, or
reads everything).

The header also says which generation was restored *instead of* the current
one (a fallback past a generation that failed verification, or an older
generation restored on purpose).  That part is used even unauthenticated,
but only to make the next persist not chain onto the generation that was
passed over: it writes a full generation, or (with an authenticated index)
a layer over the generation restored.  A forged header can so only cost a
full generation, never skip a read.

Object layout: one line of ASCII JSON (at most 4 KiB: format, version,
name, generation, digest, instead_of, body_bytes, body_sha256, mac), ``\\n``,
then the body (an encoded index, or nothing without a key).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import dataclass

from .._json import loads_untrusted
from ._errors import SnapshotCorruptError, SnapshotError
from ._index import Index, decode_index, encode_index, max_index_bytes
from ._models import SnapshotPolicy
from ._objects import ObjectStore
from ._objects_local import LocalObjects

__all__ = ["Baseline", "write_baseline", "read_baseline", "baseline_index", "baseline_key_of"]

_FORMAT = "sandbox-fs-baseline"
_DOMAIN = b"sandbox-fs/baseline/v1\0"
_MAX_HEADER = 4096
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass
class Baseline:
    """What the last restore of a name left for its next persist.

    Attributes:
        generation: the generation restored.
        digest: its metadata digest (:attr:`SnapshotInfo.digest`).
        instead_of: the metadata digest of the generation that was current
            when it was restored, when that was another one ("" otherwise).
        index: the restored tree's index with this workspace's inodes (None:
            not known, or not trusted).
        body: ``(offset, bytes, sha256)`` of an authenticated index in the
            stored object, not read yet (read by :func:`baseline_index`).
    """

    generation: int
    digest: str
    instead_of: str = ""
    index: Index | None = None
    body: tuple[int, int, str] | None = None


def baseline_key_of(secret: bytes) -> bytes:
    """The baseline MAC key derived from a host secret (the installation or state key): never the secret itself."""
    return hmac.new(secret, b"sandbox-fs/baseline-key/v1", hashlib.sha256).digest()


def _key(name: str) -> str:
    return f"{name}/baseline"


def _mac(key: bytes, head: dict[str, object]) -> str:
    fields = {k: v for k, v in head.items() if k != "mac"}
    return hmac.new(key, _DOMAIN + json.dumps(fields, sort_keys=True, separators=(",", ":")).encode(),
                    hashlib.sha256).hexdigest()


def write_baseline(objects: ObjectStore, name: str, base: Baseline, key: bytes | None) -> None:
    """Store ``base`` as ``NAME/baseline`` (its index only with a ``key``); best effort, never raises.

    The index is deflated for a remote store; a :class:`LocalObjects`
    directory keeps it in stored zlib blocks (the same format, decoded the
    same way): deflating the stdlib tree's index costs ~10 ms of hydrate,
    writing its 1.1 MB more to a local file a fraction of that.
    """
    # a local directory stores the body undeflated: writing 1.5 MB costs less than deflating it to 0.4 MB
    level = 0 if isinstance(objects, LocalObjects) else 1
    body = encode_index(base.index, level=level) if key is not None and base.index is not None else b""
    head: dict[str, object] = {"format": _FORMAT, "version": 1, "name": name, "generation": base.generation,
                               "digest": base.digest, "instead_of": base.instead_of, "body_bytes": len(body),
                               "body_sha256": hashlib.sha256(body).hexdigest()}
    head["mac"] = _mac(key, head) if key is not None else ""
    line = json.dumps(head, sort_keys=True, separators=(",", ":")).encode()
    try:
        objects.put_bytes(_key(name), line + b"\n" + body)
    except (SnapshotError, ValueError, OSError):
        pass  # an optimization only: the next persist then reads more


def read_baseline(objects: ObjectStore, name: str, key: bytes | None) -> Baseline | None:
    """The stored baseline's header (None: none, unreadable, or failing its MAC under ``key``).

    Reads at most 4 KiB.  With ``key``, the header must carry a valid MAC
    (else None); without one, only its generation and ``instead_of`` are
    returned (no index).  Never raises.
    """
    try:
        with objects.open_range(_key(name), 0, _MAX_HEADER) as f:
            raw = b""
            while len(raw) < _MAX_HEADER and (chunk := f.read(_MAX_HEADER - len(raw))):
                raw += chunk
        nl = raw.find(b"\n")
        if nl < 0:
            return None
        head = loads_untrusted(raw[:nl])
        if not isinstance(head, dict) or head.get("format") != _FORMAT or head.get("version") != 1 \
                or head.get("name") != name:
            return None
        gen, digest, instead = head["generation"], head["digest"], head["instead_of"]
        size, sha, mac = head["body_bytes"], head["body_sha256"], head["mac"]
        if not (isinstance(gen, int) and isinstance(size, int) and gen >= 1 and size >= 0
                and isinstance(digest, str) and _HEX64.fullmatch(digest) and isinstance(instead, str)
                and (instead == "" or _HEX64.fullmatch(instead)) and isinstance(sha, str) and isinstance(mac, str)):
            return None
    except (SnapshotError, ValueError, KeyError, TypeError, OSError):
        return None
    base = Baseline(gen, digest, instead)
    if key is None:
        return base
    if not hmac.compare_digest(mac, _mac(key, head)):
        return None
    if size > 0 and _HEX64.fullmatch(sha):
        base.body = (nl + 1, size, sha)
    return base


def baseline_index(objects: ObjectStore, name: str, base: Baseline, policy: SnapshotPolicy,
                   layers: frozenset[int]) -> Index | None:
    """The index of ``base`` (read and checked once, then kept on it), or None when it has none or fails a check.

    The body must have the authenticated size and SHA-256, fit what
    ``policy`` could decode, and pass every rule of the index
    (:func:`~sandbox_fs.snapshot._index.decode_index`, layers within the chain).  Never raises.
    """
    if base.index is not None or base.body is None:
        return base.index
    offset, size, sha = base.body
    base.body = None  # one attempt
    if size > max_index_bytes(policy):
        return None
    try:
        with objects.open_range(_key(name), offset, size + 1) as f:
            raw = b""
            while len(raw) <= size and (chunk := f.read(size + 1 - len(raw))):
                raw += chunk
        if len(raw) != size or hashlib.sha256(raw).hexdigest() != sha:
            return None  # replaced since its header was read
        base.index = decode_index(raw, policy, layers, name)
    except (SnapshotCorruptError, SnapshotError, ValueError, OSError):
        return None
    return base.index
