"""The index of a generation: every entry of the tree it restores, for change detection and layered hydrate.

Written beside each generation of a :class:`~sandbox_fs.snapshot.GenerationStore`
(``index``: zlib-compressed JSON, its SHA-256 in the generation's metadata).
For every entry persist kept, in walk order: its sandbox path, kind
(``file``, ``dir``, ``symlink``), inode number, size, ``mtime_ns``,
``ctime_ns``, permission bits, content (a file's SHA-256; a symlink's
target), link count, and the *layer*: the generation whose archive holds
its member.  Plus the time the walk began (``time_ns``, the kernel's coarse
real-time clock, the one file timestamps come from), the workspace's device
and the *deletion list* (paths the parent generation had and this one does
not).

Change detection: a regular file with one link whose inode, size, mtime and
ctime match its parent-index entry, and whose mtime and ctime are both
strictly older than the parent index's ``time_ns``, is not read again (its
SHA-256 and layer are taken over); so is a directory whose inode, link
count, mode, mtime and ctime match (its member stays in the layer that has
it).  A regular file with one link whose inode, size, mtime and mode match
but not its ctime (a re-own by another identity changes only that), or that
is racy, is read and hashed: when its SHA-256 is the entry's, its ``fstat``
did not change during the read and nothing has it open for writing (the
read-lease probe), it is recorded with its new stat and the entry's layer,
and not written again.  Anything changed at or after the moment the parent walk began carries
a timestamp at or after ``time_ns`` and is read again (the racy-git rule: a
write in the same clock tick as the walk is never missed).  The ctime is
compared as the latest moment it may stand for (:func:`stamp_latest_ns`):
a file system that keeps whole seconds truncates a change made after the
walk began to a time before it (every change sets the ctime; an mtime in
whole seconds is as often one a restore or tar set, and is compared as it is).  Symlinks and
multi-linked files are always written to the layer (whether a symlink
restores depends on other entries; a hard-link group is always whole in one
layer).  What this trusts: ``ctime`` cannot be set by an
unprivileged process (see SECURITY.md).

Hydrate trusts no index it did not verify: it is read only through the
generation's metadata (SHA-256), and :func:`decode` refuses names the
extractor would refuse (``..``, absolute, non-normalized, the empty name:
the workspace itself), duplicates, an
entry below a non-directory (a directory replaced by a symlink in a later
layer keeps nothing below it), layers outside the chain, and more entries
or deletions than ``max_entries``.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import zlib
from dataclasses import dataclass, field
from typing import NamedTuple

from .._json import loads_untrusted
from ..archive import ArchiveLimitError, UnsafeArchiveMemberError, normalize_member_name
from ._errors import SnapshotCorruptError
from ._models import SnapshotPolicy

__all__ = ["IndexEntry", "Index", "encode_index", "decode_index", "coarse_now_ns", "stamp_latest_ns",
           "index_digest", "max_index_bytes"]

_FORMAT = "sandbox-fs-index"
_KINDS = ("file", "dir", "symlink")
_SHA = re.compile(r"[0-9a-f]{64}")
_MAX_U64 = (1 << 64) - 1
_MAX_I64 = (1 << 63) - 1
#: most bytes an index may decompress to per allowed entry (a path of PATH_MAX plus its fields)
_BYTES_PER_ENTRY = 4096 + 512


class IndexEntry(NamedTuple):
    """One entry of an index (see the module docstring)."""

    path: str
    kind: str
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    mode: int
    content: str
    nlink: int
    layer: int


@dataclass
class Index:
    """A generation's index.

    Attributes:
        time_ns: when its walk began (``CLOCK_REALTIME_COARSE``, nanoseconds).
        dev: ``st_dev`` of the workspace it was taken in (inode numbers are per device).
        entries: every kept entry, in walk order.
        deleted: paths the parent generation had and this one does not.
        encoded: its object's bytes, when the walk that made it encoded it already (see
            :mod:`._layers`; :func:`encode_index` returns them).  Never read from a store.
        walk_cache: what the walk that made it keeps for the next layered walk over it (in
            memory only, see :mod:`._layers`); None for an index read from a store or a baseline.
    """

    time_ns: int
    dev: int
    entries: list[IndexEntry] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    encoded: bytes | None = field(default=None, repr=False, compare=False)
    walk_cache: object | None = field(default=None, repr=False, compare=False)

    def by_path(self) -> dict[str, IndexEntry]:
        return {e.path: e for e in self.entries}


#: Linux's CLOCK_REALTIME_COARSE (linux/time.h); :mod:`time` does not name it
_CLOCK_REALTIME_COARSE = 5


def coarse_now_ns() -> int:
    """The kernel's coarse real-time clock, in nanoseconds: never ahead of a timestamp written after it.

    File timestamps come from this clock (or a finer one never behind it),
    so a file changed after this call has an mtime and ctime at or after it.
    """
    return time.clock_gettime_ns(_CLOCK_REALTIME_COARSE)


def stamp_latest_ns(ts_ns: int) -> int:
    """The latest moment a file timestamp may stand for, given the file system may have truncated it.

    A file system keeps timestamps in steps of its own (ext4 with 128-byte
    inodes, NFS, FUSE and others: whole seconds; FAT: 2 s), truncated down,
    so a change made after a clock reading can carry a timestamp before it.
    The step is not exposed; it is read off the timestamp: whole seconds
    stand for up to 2 s after them, a multiple of 10**k ns (the largest k,
    up to 8) for up to 10**k ns after it, anything else for itself (a
    nanosecond timestamp that happens to end in zeros is only taken as a
    little later than it is, never earlier).

    Args:
        ts_ns: an ``st_mtime_ns`` or ``st_ctime_ns``.

    Returns:
        Nanoseconds since the epoch, ``>= ts_ns``.
    """
    ns = ts_ns % 1_000_000_000
    if ns % 10:
        return ts_ns
    if not ns:
        return ts_ns + 1_999_999_999
    step = 10
    while step < 100_000_000 and not ns % (step * 10):
        step *= 10
    return ts_ns + step - 1


def index_digest(entries: list[IndexEntry]) -> str:
    """The tree digest of an index (as :func:`~sandbox_fs.snapshot.tree_digest` computes it from a walk)."""
    sha = hashlib.sha256()
    for e in entries:
        size = e.size if e.kind == "file" else 0
        sha.update(f"{e.path}\0{e.kind}\0{size}\0{e.mode:o}\0{e.content}\n".encode("utf-8", "surrogateescape"))
    return sha.hexdigest()


def encode_index(index: Index) -> bytes:
    """The index object's bytes (zlib-compressed ASCII JSON; non-UTF-8 names keep their ``\\udcXX`` escapes).

    ``index.encoded`` when set (the walk's own encoding of the same document, see :mod:`._layers`).
    """
    if index.encoded is not None:
        return index.encoded
    doc = {"format": _FORMAT, "version": 1, "time_ns": index.time_ns, "dev": index.dev,
           "entries": [list(e) for e in index.entries], "deleted": index.deleted}
    return zlib.compress(json.dumps(doc, ensure_ascii=True, separators=(",", ":")).encode(), 1)


def max_index_bytes(policy: SnapshotPolicy) -> int:
    """The most bytes an index object may have under ``policy``: what :func:`decode_index` could accept.

    The decompressed text is bounded by ``max_entries`` (see ``_BYTES_PER_ENTRY``);
    zlib's output is never longer than its input plus 5 bytes per 16 KiB
    stored block and its 6-byte framing, so a larger object cannot decode and
    is refused before it is read (its recorded size comes from the store).
    """
    text = (policy.limits.max_entries + 1) * _BYTES_PER_ENTRY
    return text + 5 * (text // 16384 + 1) + 6


def decode_index(raw: bytes, policy: SnapshotPolicy, layers: frozenset[int], name: str) -> Index:
    """Parse and check an index object (see the module docstring for every rule).

    Args:
        raw: the object's bytes (already checked against the metadata's SHA-256).
        policy: the limits and the extractor's name rule.
        layers: the generations of the chain it may name as layers.
        name: the snapshot name (for errors).

    Raises:
        SnapshotCorruptError: not a valid index, or one breaking a rule.
    """
    limit = policy.limits.max_entries
    ctx = {"snapshot": name}
    try:
        dec = zlib.decompressobj()
        text = dec.decompress(raw, (limit + 1) * _BYTES_PER_ENTRY)
        if dec.unconsumed_tail or not dec.eof:
            raise ValueError("too large, or truncated")
        doc = loads_untrusted(text, max_depth=None)  # every field's type is checked below
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT or doc.get("version") != 1:
            raise ValueError("not an index")
        entries, deleted = doc["entries"], doc["deleted"]
        if not isinstance(entries, list) or not isinstance(deleted, list):
            raise ValueError("entries and deleted must be lists")
        if len(entries) > limit or len(deleted) > limit:
            raise ValueError("more entries or deletions than max_entries")
        index = Index(_int(doc["time_ns"], _MAX_I64), _int(doc["dev"], _MAX_U64),
                      [_entry(e, layers) for e in entries], [_str(p) for p in deleted])
    except (ValueError, KeyError, TypeError, zlib.error) as exc:
        raise SnapshotCorruptError("a generation's index is not valid", sandbox_path=None, context=ctx,
                                   diagnostic=str(exc)) from None
    _check_names(index, policy, ctx)
    return index


def _int(v: object, hi: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= hi:
        raise ValueError("a number is out of range")
    return v


def _str(v: object) -> str:
    if not isinstance(v, str):
        raise ValueError("a name must be a string")
    return v


def _entry(e: object, layers: frozenset[int]) -> IndexEntry:
    if not isinstance(e, list) or len(e) != 10:
        raise ValueError("an entry must have 10 fields")
    ent = IndexEntry(_str(e[0]), _str(e[1]), _int(e[2], _MAX_U64), _int(e[3], _MAX_I64), _int(e[4], _MAX_I64),
                     _int(e[5], _MAX_I64), _int(e[6], 0o777), _str(e[7]), _int(e[8], _MAX_U64),
                     _int(e[9], _MAX_I64))
    if ent.kind not in _KINDS:
        raise ValueError("unknown entry kind")
    if ent.kind == "file" and not _SHA.fullmatch(ent.content) or ent.kind == "dir" and ent.content:
        raise ValueError("a file's content must be its SHA-256; a directory has none")
    if ent.layer not in layers:
        raise ValueError("an entry names a layer outside the chain")
    return ent


def _check_names(index: Index, policy: SnapshotPolicy, ctx: dict[str, object]) -> None:
    """Every name is one the extractor accepts, normalized, not the workspace itself, unique, below directories only.

    Raises:
        SnapshotCorruptError: a name breaks one of these rules.
    """
    kinds: dict[str, str] = {}
    for path in [e.path for e in index.entries] + index.deleted:
        raw = path.encode("utf-8", "surrogateescape")
        try:
            norm = normalize_member_name(name=raw, limits=policy.archive)
        except (UnsafeArchiveMemberError, ArchiveLimitError) as exc:
            raise SnapshotCorruptError("a generation's index names a path the extractor refuses", sandbox_path=None,
                                       context={**ctx, "rule": getattr(exc, "rule", "limit")}) from None
        if not norm:  # the destination itself: no entry of the tree (the extractor skips or refuses it)
            raise SnapshotCorruptError("a generation's index names the workspace itself", sandbox_path=None,
                                       context={**ctx, "rule": "names_destination"})
        if norm != raw:
            raise SnapshotCorruptError("a generation's index names a path that is not normalized",
                                       sandbox_path=None, context=ctx)
    for e in index.entries:
        if e.path in kinds:
            raise SnapshotCorruptError("a generation's index names a path twice", sandbox_path=None, context=ctx)
        kinds[e.path] = e.kind
    for e in index.entries:
        i = e.path.find("/")
        while i > 0:
            if kinds.get(e.path[:i], "dir") != "dir":
                raise SnapshotCorruptError("a generation's index has an entry below a non-directory",
                                           sandbox_path=None, context=ctx)
            i = e.path.find("/", i + 1)
    if any(p in kinds for p in index.deleted):
        raise SnapshotCorruptError("a generation's index deletes a path it also keeps", sandbox_path=None,
                                   context=ctx)
