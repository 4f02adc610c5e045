"""The baseline a restore leaves for the next persist of its name, kept in memory and in the store.

After a hydrate, the restored tree's directory listings with this
workspace's new inodes and times (the *baseline*) let the first persist
after it write a layer: files whose inode, size, mtime and ctime still
match are not read again.  :class:`~sandbox_fs.snapshot.GenerationStore`
keeps it in memory and writes it to the object ``NAME/baseline``, so a new
process (a session resumed by another client object, ``snapshot restore``
then ``snapshot save``) finds it.

What it holds (version 2): the metadata digest of the generation restored,
the clock read before the restore's staging directory (inside the
workspace) was made (its ``time_ns``, see ``_hydrate._baseline_listings``),
the workspace's device, and one native scan (:func:`sandbox_fs._native.scan_dir`: per entry its
``lstat`` and name) of each directory of the restored tree, taken after the
swap.  Not an index: the next persist that chains onto that generation
applies the listings to the generation's *own* index, read through the
SHA-256 chain the session's MAC-protected state binds
(:func:`index_with_listings`: a file takes its inode and times from the
listing of its directory when it is there as restored, a regular file with
one link and the recorded size; else it is marked to be read again).  So
hydrate neither decodes nor re-encodes an index for it (version 1 stored a
whole second index, ~60 ms of hydrate's critical path for the stdlib
tree), and the content SHA-256 persist takes over is always the verified
index's own.  A version-1 object is still read for its header (``instead_of``)
and its index is ignored: the next persist reads more, never less.

What a baseline is trusted for, and why it is authenticated: its stats tell
persist which files it need not read, so a lying one makes persist record
a file's previous content for a changed file (the change is lost,
silently).  A baseline is written after the restore, outside the chain the
state binds.  So its listings are used only when its HMAC-SHA256 verifies
under the store's ``baseline_key`` (a key the object store does not hold; a
:class:`~sandbox_fs.snapshot.DirectorySnapshotStore` derives it from the
installation key kept in that directory), for exactly the generation it
names (metadata digest), with the scan record layout of this build (the
header names it: a build whose native records differ ignores it).  Without
a key, or when the MAC, the name, the digest, the layout or the body does
not match, or the body does not parse, the listings are ignored (never an
error: persist then compares against the parent's own index, or reads
everything).  A listing can only ever make persist *read* a file (marked
changed), never skip one: a file is skipped only when its live ``lstat``
equals the recorded one and is strictly older than ``time_ns`` (the racy
rule of :mod:`._index`).

The header also says which generation was restored *instead of* the current
one (a fallback past a generation that failed verification, or an older
generation restored on purpose).  That part is used even unauthenticated,
but only to make the next persist not chain onto the generation that was
passed over: it writes a full generation, or (with authenticated listings)
a layer over the generation restored.  A forged header can so only cost a
full generation, never skip a read.

Object layout: one line of ASCII JSON (at most 4 KiB: format, version,
name, generation, digest, instead_of, time_ns, dev, scan, body_bytes,
body_sha256, mac), ``\\n``, then the body (nothing without a key): a zlib
stream (stored blocks for a local directory, deflated for a remote store)
of, per directory, its path's byte length and its records' byte length
(two little-endian u32), the path (UTF-8, ``""`` for the workspace) and the
records as the scan gave them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import stat as _stat
import struct
import sys
import zlib
from dataclasses import dataclass, field
from typing import NamedTuple

from .._json import loads_untrusted
from ._errors import SnapshotError
from ._index import Index, IndexEntry, gc_paused
from ._models import SnapshotPolicy
from ._objects import ObjectStore
from ._objects_local import LocalObjects
from ._walk import SCAN_HEADER

__all__ = ["Baseline", "Listings", "write_baseline", "read_baseline", "baseline_listings", "baseline_key_of",
           "index_with_listings"]

_FORMAT = "sandbox-fs-baseline"
_VERSION = 2
_DOMAIN = b"sandbox-fs/baseline/v1\0"  # (the version is a MAC'd field of the header)
_MAX_HEADER = 4096
_HEX64 = re.compile(r"[0-9a-f]{64}")
_MAX_U64 = (1 << 64) - 1
_MAX_I64 = (1 << 63) - 1
#: the layout of the records a body holds: a build whose native scan records differ ignores the body
SCAN_LAYOUT = f"{SCAN_HEADER.format}/pad8/{sys.byteorder}"
_DIR_HEAD = struct.Struct("<II")
#: most body bytes per allowed entry: a record (header, a name of NAME_MAX padded) and a directory's
#: path (PATH_MAX) with its two lengths (every entry may be a directory)
_BYTES_PER_ENTRY = SCAN_HEADER.size + 256 + 4096 + _DIR_HEAD.size


@dataclass(frozen=True)
class Listings:
    """The restored tree's directory scans, taken after a hydrate's swap.

    Attributes:
        time_ns: the coarse clock read before the restore's staging
            directory was made in the workspace (nanoseconds): the
            baseline's time for the racy rule.
        dev: ``st_dev`` of the workspace.
        dirs: sandbox path of each directory scanned (``""``: the workspace)
            -> its :func:`sandbox_fs._native.scan_dir` records.  A directory
            not here (not listable, another device, past the walk's bound)
            has its files read again.
    """

    time_ns: int
    dev: int
    dirs: dict[str, bytes] = field(default_factory=dict)


class _Body(NamedTuple):
    """Where a stored baseline's authenticated listings are, and the header fields that go with them."""

    offset: int
    size: int
    sha256: str
    time_ns: int
    dev: int


@dataclass
class Baseline:
    """What the last restore of a name left for its next persist.

    Attributes:
        generation: the generation restored.
        digest: its metadata digest (:attr:`SnapshotInfo.digest`).
        instead_of: the metadata digest of the generation that was current
            when it was restored, when that was another one ("" otherwise).
        index: the restored tree's index with this workspace's inodes (None:
            not known yet, or not trusted): a commit's own index, or the one
            :func:`index_with_listings` made from ``listings``.
        body: where authenticated listings are in the stored object, not read
            yet (read by :func:`baseline_listings`).
        listings: the restored tree's listings (None: not known, or not trusted).
        source: the generation's verified index, when the restore decoded it
            (a layered chain): the next persist need not read it again.
        written: the index this store object's commit of the generation
            wrote, kept in memory (its stored bytes are that object's
            encoding), also across a restore of that generation; None otherwise.
    """

    generation: int
    digest: str
    instead_of: str = ""
    index: Index | None = None
    body: _Body | None = None
    listings: Listings | None = None
    source: Index | None = None
    written: Index | None = None

    @property
    def trusted(self) -> bool:
        """It has (or may have, once its body is read) stats this workspace's persist may compare against."""
        return self.index is not None or self.listings is not None or self.body is not None


def baseline_key_of(secret: bytes) -> bytes:
    """The baseline MAC key derived from a host secret (the installation or state key): never the secret itself."""
    return hmac.new(secret, b"sandbox-fs/baseline-key/v1", hashlib.sha256).digest()


def _key(name: str) -> str:
    return f"{name}/baseline"


def _mac(key: bytes, head: dict[str, object]) -> str:
    fields = {k: v for k, v in head.items() if k != "mac"}
    return hmac.new(key, _DOMAIN + json.dumps(fields, sort_keys=True, separators=(",", ":")).encode(),
                    hashlib.sha256).hexdigest()


def _encode(listings: Listings, level: int) -> bytes:
    parts = []
    for path, raw in listings.dirs.items():
        p = path.encode("utf-8", "surrogateescape")
        parts += (_DIR_HEAD.pack(len(p), len(raw)), p, raw)
    return zlib.compress(b"".join(parts), level)


def write_baseline(objects: ObjectStore, name: str, base: Baseline, key: bytes | None) -> None:
    """Store ``base`` as ``NAME/baseline`` (its listings only with a ``key``); best effort, never raises.

    A :class:`LocalObjects` directory keeps the body in stored zlib blocks
    (no deflate in hydrate); a remote store's is deflated (level 1).
    """
    listings = base.listings if key is not None else None
    body = _encode(listings, 0 if isinstance(objects, LocalObjects) else 1) if listings is not None else b""
    head: dict[str, object] = {"format": _FORMAT, "version": _VERSION, "name": name, "generation": base.generation,
                               "digest": base.digest, "instead_of": base.instead_of,
                               "time_ns": listings.time_ns if listings is not None else 0,
                               "dev": listings.dev if listings is not None else 0, "scan": SCAN_LAYOUT,
                               "body_bytes": len(body), "body_sha256": hashlib.sha256(body).hexdigest()}
    head["mac"] = _mac(key, head) if key is not None else ""
    line = json.dumps(head, sort_keys=True, separators=(",", ":")).encode()
    try:
        objects.put_bytes(_key(name), line + b"\n" + body)
    except (SnapshotError, ValueError, OSError):
        pass  # an optimization only: the next persist then reads more


def _int(v: object, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= hi


def read_baseline(objects: ObjectStore, name: str, key: bytes | None) -> Baseline | None:
    """The stored baseline's header (None: none, unreadable, or failing its MAC under ``key``).

    Reads at most 4 KiB.  With ``key``, the header must carry a valid MAC
    (else None); without one, only its generation and ``instead_of`` are
    returned (no listings).  A version-1 header (a whole index for a body)
    is read the same way, its body never.  Never raises.
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
        if not isinstance(head, dict) or head.get("format") != _FORMAT or head.get("version") not in (1, _VERSION) \
                or head.get("name") != name:
            return None
        gen, digest, instead = head["generation"], head["digest"], head["instead_of"]
        size, sha, mac = head["body_bytes"], head["body_sha256"], head["mac"]
        if not (isinstance(gen, int) and isinstance(size, int) and gen >= 1 and size >= 0
                and isinstance(digest, str) and _HEX64.fullmatch(digest) and isinstance(instead, str)
                and (instead == "" or _HEX64.fullmatch(instead)) and isinstance(sha, str) and isinstance(mac, str)
                and (mac == "" or _HEX64.fullmatch(mac))):  # ("": written without a key; hex before
            return None                                          # compare_digest, which raises for non-ASCII)
    except (SnapshotError, ValueError, KeyError, TypeError, OSError):
        return None
    base = Baseline(gen, digest, instead)
    if key is None:
        return base
    if not hmac.compare_digest(mac, _mac(key, head)):
        return None
    if head["version"] == _VERSION and head.get("scan") == SCAN_LAYOUT and _int(head.get("time_ns"), _MAX_I64) \
            and _int(head.get("dev"), _MAX_U64) and size > 0 and _HEX64.fullmatch(sha):
        base.body = _Body(nl + 1, size, sha, head["time_ns"], head["dev"])
    return base


def max_body_bytes(policy: SnapshotPolicy) -> int:
    """The most bytes a baseline body may decompress to under ``policy`` (its stored form: 5 more per 16 KiB)."""
    return (policy.limits.max_entries + 2) * _BYTES_PER_ENTRY


def baseline_listings(objects: ObjectStore, name: str, base: Baseline, policy: SnapshotPolicy) -> Listings | None:
    """The listings of ``base`` (read and checked once, then kept on it), or None when it has none or fails a check.

    The body must have the authenticated size and SHA-256, fit what
    ``policy`` bounds, decompress, and parse into directories of unique
    paths.  Never raises.
    """
    if base.listings is not None or base.body is None:
        return base.listings
    offset, size, sha, time_ns, dev = base.body
    base.body = None  # one attempt
    text = max_body_bytes(policy)
    if size > text + 5 * (text // 16384 + 1) + 6:
        return None
    try:
        with objects.open_range(_key(name), offset, size + 1) as f:
            raw = b""
            while len(raw) <= size and (chunk := f.read(size + 1 - len(raw))):
                raw += chunk
        if len(raw) != size or hashlib.sha256(raw).hexdigest() != sha:
            return None  # replaced since its header was read
        dec = zlib.decompressobj()
        flat = dec.decompress(raw, text)
        if dec.unconsumed_tail or not dec.eof:
            return None
        base.listings = Listings(time_ns, dev, _decode(flat))
    except (SnapshotError, ValueError, OSError, zlib.error):
        return None
    return base.listings


def _decode(flat: bytes) -> dict[str, bytes]:
    """The directories of a body.

    Raises:
        ValueError: truncated, or a path twice.
    """
    dirs: dict[str, bytes] = {}
    unpack, head = _DIR_HEAD.unpack_from, _DIR_HEAD.size
    off, end = 0, len(flat)
    while off < end:
        if off + head > end:
            raise ValueError("truncated")
        plen, rlen = unpack(flat, off)
        start = off + head
        off = start + plen + rlen
        if off > end:
            raise ValueError("truncated")
        path = flat[start:start + plen].decode("utf-8", "surrogateescape")
        if path in dirs:
            raise ValueError("a directory twice")
        dirs[path] = flat[start + plen:off]
    return dirs


def _records(raw: bytes | None) -> dict[bytes, tuple[int, ...]]:
    """``name -> (ino, dev, size, mtime_ns, ctime_ns, nlink, mode, name length)`` of one directory's records.

    Records that do not parse (a length past the end) end it: nothing after them is used.
    """
    out: dict[bytes, tuple[int, ...]] = {}
    if not raw:
        return out
    unpack, head = SCAN_HEADER.unpack_from, SCAN_HEADER.size
    off, end = 0, len(raw)
    while off + head <= end:
        rec = unpack(raw, off)
        start = off + head
        if start + rec[7] > end:
            break
        out[raw[start:start + rec[7]]] = rec
        off = start + ((rec[7] + 7) & ~7)
    return out


def index_with_listings(index: Index, listings: Listings) -> Index:
    """``index`` (a generation's verified index) with the inodes and times of the restored tree: the baseline index.

    A regular file listed in its directory's scan, with the index's size,
    one link, on the listings' device and a ctime at or after the listings'
    time, takes the scan's inode, mtime and ctime; any other file (not
    listed, its directory not scanned, another size, type or link count) is
    marked to be read again (link count 0).  So is one whose ctime is older
    than the listings' time: the restore did not make it (a directory moved
    into the restored tree keeps its files' ctimes, and the staged tree is
    reachable by other processes in the workspace), so its stat says
    nothing about the index's content.  (A file the restore made has a ctime
    at or after that time, which the next persist's racy rule reads again:
    nothing a process in the workspace sets up during the restore is
    skipped.)
    Every other field (content, layer, mode), and every directory and
    symlink entry, is the index's.  Its time is the listings' (the clock
    read before the restore staged anything), its device theirs.
    """
    with gc_paused():  # one tuple per entry, alive until the index is (see gc_paused)
        dirs = listings.dirs
        dev, time_ns = listings.dev, listings.time_ns
        parsed: dict[str, dict[bytes, tuple[int, ...]]] = {}
        out: list[IndexEntry] = []
        append, new = out.append, tuple.__new__
        for e in index.entries:
            path, kind, ino, size, mtime_ns, ctime_ns, mode, content, nlink, layer = e
            if kind != "file":
                append(e)
                continue
            parent, _, leaf = path.rpartition("/")
            in_dir = parsed[parent] if parent in parsed else parsed.setdefault(parent, _records(dirs.get(parent)))
            st = in_dir.get(leaf.encode("utf-8", "surrogateescape"))
            # st: the scan's (ino, dev, size, mtime_ns, ctime_ns, nlink, mode, name length)
            if st is None or not _stat.S_ISREG(st[6]) or st[2] != size or st[5] != 1 or st[1] != dev \
                    or st[4] < time_ns:
                append(new(IndexEntry, (path, kind, ino, size, mtime_ns, ctime_ns, mode, content, 0, layer)))
            else:
                append(new(IndexEntry, (path, kind, st[0], size, st[3], st[4], mode, content, nlink, layer)))
        return Index(listings.time_ns, dev, out, [])
