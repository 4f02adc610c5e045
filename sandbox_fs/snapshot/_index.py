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

import contextlib
import gc
import hashlib
import json
import re
import threading
import time
import zlib
from dataclasses import dataclass, field
from itertools import compress, repeat
from typing import Iterator, NamedTuple

from .._json import loads_untrusted
from ..archive import ArchiveLimitError, ArchiveLimits, UnsafeArchiveMemberError, normalize_member_name
from ._errors import SnapshotCorruptError
from ._models import SnapshotPolicy

__all__ = ["IndexEntry", "Index", "encode_index", "decode_index", "coarse_now_ns", "stamp_latest_ns",
           "index_digest", "max_index_bytes", "gc_paused"]

_FORMAT = "sandbox-fs-index"
_KINDS = ("file", "dir", "symlink")
_SHA = re.compile(r"[0-9a-f]{64}")
_MAX_U64 = (1 << 64) - 1
_MAX_I64 = (1 << 63) - 1
#: most bytes an index may decompress to per allowed entry (a path of PATH_MAX plus its fields)
_BYTES_PER_ENTRY = 4096 + 512
_KIND_SET = frozenset(_KINDS)
_FILE, _DIR, _SYMLINK = "file", "dir", "symlink"
#: (field, largest value) of the number fields of an entry, as :func:`_entry` checks them
_INT_FIELDS = ((2, _MAX_U64), (3, _MAX_I64), (4, _MAX_I64), (5, _MAX_I64), (6, 0o777), (8, _MAX_U64), (9, _MAX_I64))
#: the archive's longest name component (NAME_MAX; ``normalize_member_name`` refuses a longer one)
_NAME_MAX = 255
#: in ASCII names each set between NULs, what :func:`normalize_member_name` refuses or changes,
#: found by substring once every NUL is a '/' (three searches, not nine: '//' is an empty name, a
#: leading '/', an empty inner or a trailing component; '/./' a '.' component) and in the names as
#: they are: an absolute one by '\\'
_NOT_NORMALIZED_SLASHED = ("//", "/./")
_NOT_NORMALIZED_PART = "\0\\"  # (NUL, backslash)
#: ... and by regex, once a ':' or '..' is in them: a drive letter, a '..' component (split at '/' or '\\')
_DRIVE = re.compile(r"\x00[A-Za-z]:")
_DOTDOT = re.compile(r"[\x00/\\]\.\.[\x00/\\]")


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


def encode_index(index: Index, *, level: int = 1) -> bytes:
    """The index object's bytes (zlib-compressed ASCII JSON; non-UTF-8 names keep their ``\\udcXX`` escapes).

    ``index.encoded`` when set (the walk's own encoding of the same document, see :mod:`._layers`).

    Args:
        index: the index.
        level: the zlib level (0 to 9): 1 by default; 0 (stored blocks, no
            deflate: ~0.5 ms instead of ~10 ms for the stdlib tree's index, and
            3.5 times the bytes) for an object a local directory keeps.  Any
            level decodes the same way (:func:`decode_index`).
    """
    if index.encoded is not None:
        return index.encoded
    # the entries as they are: json writes a tuple as an array (no list per entry for the collector to chase)
    doc = {"format": _FORMAT, "version": 1, "time_ns": index.time_ns, "dev": index.dev,
           "entries": index.entries, "deleted": index.deleted}
    return zlib.compress(json.dumps(doc, ensure_ascii=True, separators=(",", ":")).encode(), level)


def max_index_bytes(policy: SnapshotPolicy) -> int:
    """The most bytes an index object may have under ``policy``: what :func:`decode_index` could accept.

    The decompressed text is bounded by ``max_entries`` (see ``_BYTES_PER_ENTRY``);
    zlib's output is never longer than its input plus 5 bytes per 16 KiB
    stored block and its 6-byte framing, so a larger object cannot decode and
    is refused before it is read (its recorded size comes from the store).
    """
    text = (policy.limits.max_entries + 1) * _BYTES_PER_ENTRY
    return text + 5 * (text // 16384 + 1) + 6


#: pauses in progress in any thread, and whether the collector was enabled when the first began
#: (reentrant: a signal handler that pauses may run in the thread holding it, see gc_paused)
_GC_PAUSE_LOCK = threading.RLock()
_GC_PAUSE = {"depth": 0, "was": True}


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a large acyclic structure is built and checked.

    Decoding an index allocates a list per entry (the JSON) that lives
    until its entry is checked; with the collector on, thousands of them
    survive young collections, are promoted, and trigger full collections
    of the whole process heap (measured in hydrate: ~25 ms a decode, and
    ~12 ms in its baseline).  Paused, the first collection after finds them
    gone (refcounting freed them) and the entries made untracked.

    The collector is process-wide and hydrates may run in several threads
    at once: pauses are counted under a lock, the first one records whether
    the collector was enabled and the last one to end restores exactly
    that.  (A plain "was it enabled?" per pause loses the caller's setting
    when two pauses overlap: the second sees it disabled by the first and
    leaves it disabled for good.)  A host that calls ``gc.disable()`` or
    ``gc.enable()`` itself while a pause is in progress gets the state from
    before the pause when the last pause ends.

    Only for work whose length is bounded by an entry count the snapshot's
    limits already bound (``max_entries``): an index's entries, and the
    baseline index made from a restore's directory listings (one entry per
    index entry; no file content read).  Never across reads of file
    content, whose length the workspace decides (a persist's walk reads
    every file; pausing over it stopped the host's own cyclic collections
    for as long as the largest file took to read).

    A Python signal handler runs between any two bytecodes of the thread
    it interrupts, so one that pauses (a host's handler that persists) may
    run inside the lock's section: the lock is reentrant (a plain one
    deadlocked there), and each step leaves a state a balanced nested pause
    keeps: the count goes up before the first pause records and disables,
    and the last one reads what to restore before the count goes down (a
    nested pause after it records the collector as disabled).
    """
    with _GC_PAUSE_LOCK:
        _GC_PAUSE["depth"] += 1
        if _GC_PAUSE["depth"] == 1:
            _GC_PAUSE["was"] = gc.isenabled()
            gc.disable()
    try:
        yield
    finally:
        with _GC_PAUSE_LOCK:
            was = _GC_PAUSE["was"]
            _GC_PAUSE["depth"] -= 1
            if not _GC_PAUSE["depth"] and was:
                gc.enable()


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
    with gc_paused():
        return _decode(raw, policy, layers, name)


def _decode(raw: bytes, policy: SnapshotPolicy, layers: frozenset[int], name: str) -> Index:
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
                      _entries(entries, layers), [_str(p) for p in deleted])
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


def _entries(raw: list[object], layers: frozenset[int]) -> list[IndexEntry]:
    """The entries of a decoded document: checked a column at a time (:func:`_entries_ok`), else one by one.

    Raises:
        ValueError: an entry breaks a rule of :func:`_entry` (the first one, in order).
    """
    if _entries_ok(raw, layers):
        return list(map(IndexEntry._make, raw))  # type: ignore[arg-type]  # each checked to be a 10-list
    return [_entry(e, layers) for e in raw]


def _entries_ok(raw: list[object], layers: frozenset[int]) -> bool:
    """True only when :func:`_entry` accepts every one of ``raw`` (C-level passes over each field; no call per entry).

    False says nothing (the caller then checks one by one, for the precise
    error).  ``type(v) is int`` is :func:`_int`'s test for what JSON yields
    (``bool`` is its own type).  ``tests/test_index_fast.py`` checks the
    two agree over generated hostile entries.
    """
    if not raw:
        return True
    if set(map(type, raw)) != {list} or set(map(len, raw)) != {10}:  # type: ignore[arg-type]
        return False
    cols = list(zip(*raw))  # type: ignore[call-overload]
    for i in (0, 1, 7):
        if set(map(type, cols[i])) != {str}:
            return False
    for i, hi in _INT_FIELDS:
        col = cols[i]
        if set(map(type, col)) != {int} or min(col) < 0 or max(col) > hi:
            return False
    kinds, contents = cols[1], cols[7]
    if not set(kinds) <= _KIND_SET or not set(cols[9]) <= layers \
            or any(compress(contents, map(_DIR.__eq__, kinds))):
        return False
    shas = list(compress(contents, map(_FILE.__eq__, kinds)))  # each must be 64 lowercase hex digits
    if not set(map(len, shas)) <= {64}:
        return False
    targets = "".join(compress(contents, map(_SYMLINK.__eq__, kinds)))  # each a file name (see _entry)
    try:
        if not targets.isascii():
            targets.encode("utf-8", "surrogateescape")
        return not "".join(shas).encode("ascii").translate(None, b"0123456789abcdef")
    except UnicodeEncodeError:
        return False


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
    if ent.kind == _SYMLINK:  # its target is hashed into the tree digest as a file name (index_digest)
        ent.content.encode("utf-8", "surrogateescape")  # a lone surrogate a JSON escape made: UnicodeEncodeError
    return ent


def _names_ok(paths: list[str], limits: ArchiveLimits) -> bool:
    """True only when :func:`normalize_member_name` accepts every one of ``paths`` and returns it unchanged, not empty.

    For ASCII names (their UTF-8 bytes are their characters), joined with
    a NUL before and after each (a byte no accepted name holds: one in a
    name sends the whole list to the per-name check): substring tests, a
    regex only when a ':' or '..' occurs, and C-level passes for the
    limits.  Any other name is left to :func:`normalize_member_name`.
    False says nothing (the caller then checks one by one, for the precise
    error).  ``tests/test_index_fast.py`` checks the agreement over hostile
    generated names (a property test).
    """
    if not paths:
        return True
    joined = "\0" + "\0".join(paths) + "\0"
    if joined.count("\0") != len(paths) + 1:
        return False
    if not joined.isascii():
        return _names_ok([p for p in paths if p.isascii()], limits) and all(
            _normalized(p, limits) for p in paths if not p.isascii())
    longest = max(map(len, paths))
    slashed = joined.replace("\0", "/")
    if longest > limits.max_path_bytes or _NOT_NORMALIZED_PART in joined \
            or any(part in slashed for part in _NOT_NORMALIZED_SLASHED):
        return False
    if ":" in joined and _DRIVE.search(joined) or ".." in joined and _DOTDOT.search(joined):
        return False
    if longest > _NAME_MAX and max(map(len, slashed.split("/"))) > _NAME_MAX:
        return False
    return max(map(str.count, paths, repeat("/"))) < limits.max_depth


def _normalized(path: str, limits: ArchiveLimits) -> bool:
    """:func:`normalize_member_name` accepts ``path``, unchanged and not empty."""
    try:
        raw = path.encode("utf-8", "surrogateescape")
        return normalize_member_name(name=raw, limits=limits) == raw != b""
    except (UnsafeArchiveMemberError, ArchiveLimitError, UnicodeEncodeError):
        return False


def _check_names(index: Index, policy: SnapshotPolicy, ctx: dict[str, object]) -> None:
    """Every name is one the extractor accepts, normalized, not the workspace itself, unique, below directories only.

    Raises:
        SnapshotCorruptError: a name breaks one of these rules.
    """
    paths = [e.path for e in index.entries]
    if not _names_ok(paths + index.deleted, policy.archive):
        _check_each_name(paths + index.deleted, policy, ctx)
    kinds = dict(zip(paths, [e.kind for e in index.entries]))
    if len(kinds) != len(paths):
        raise SnapshotCorruptError("a generation's index names a path twice", sandbox_path=None, context=ctx)
    # Every ancestor of an entry that is itself an entry must be a directory.  The nearest one
    # that is an entry is checked here; the ones above it, by that entry's own check.
    nondirs = {p for p, k in kinds.items() if k != "dir"}
    for parent in {p.rpartition("/")[0] for p in paths} - {""}:
        while parent not in kinds and "/" in parent:
            parent = parent.rpartition("/")[0]
        if parent in nondirs:
            raise SnapshotCorruptError("a generation's index has an entry below a non-directory",
                                       sandbox_path=None, context=ctx)
    if not kinds.keys().isdisjoint(index.deleted):
        raise SnapshotCorruptError("a generation's index deletes a path it also keeps", sandbox_path=None,
                                   context=ctx)


def _check_each_name(names: list[str], policy: SnapshotPolicy, ctx: dict[str, object]) -> None:
    """The name rules of :func:`_check_names`, one name at a time, in order.

    Raises:
        SnapshotCorruptError: the first name breaking one.
    """
    for path in names:
        try:
            raw = path.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a lone surrogate a JSON escape made: no file name is one
            raise SnapshotCorruptError("a generation's index names a path that is no file name", sandbox_path=None,
                                       context={**ctx, "rule": "not_a_file_name"}) from None
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
