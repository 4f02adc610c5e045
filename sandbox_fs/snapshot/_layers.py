"""Layered persist: the index a persist records, and change detection against its parent's index.

See :mod:`._index` for the index and the rule that decides that an entry is
unchanged (inode, size, mtime, ctime and mode equal; mtime and ctime strictly
older than the parent index's walk).  A persist into a
:class:`~sandbox_fs.snapshot.GenerationStore` records an index for every
generation; over a parent index taken on the same device it writes a layer
(only what changed, and the deletion list), else a full generation.

*Whole directories.*  The walk that makes an index also keeps, in memory
with it (``Index.walk_cache``), one :class:`_Chunk` per directory: what that
directory's listing added to the walk (its index entries, tree-digest
records, mode fix-ups, content bytes, the subdirectories it admitted, and
its index entries already encoded).  The next layered persist over that
index (the same store object: see ``GenerationStore.remember_baseline``),
with the same options, takes a directory over whole when its listing is
byte for byte the one recorded (names and each entry's inode, device, size,
mtime, ctime, link count and mode: the native scan's
records, see :func:`sandbox_fs._native.scan_dir`, compared whole), every entry of it was
admitted plainly (a regular file with one link or a directory; no symlink,
nothing skipped, excluded or deferred) and strictly older than the walk that
recorded it (the racy rule).  Nothing of such a directory is decoded, opened
or read (nor searched for a repeated name again: the same bytes as a listing
the walk before checked hold the same names): its records are appended as
they are.  Its subdirectories are still
entered one by one, each opened by its path beneath the workspace Root and
identity-checked (:func:`._walk._walk`).  A directory that differs is walked
entry by entry, and each entry the parent's chunk proves unchanged is taken
over without the name rule (the same options ran it on the same path).

*The index object* of such a walk is encoded per directory: each chunk's
entries as JSON text in segments of :data:`_SEG` entries, each deflated on
its own and flushed to a byte boundary with no reference to what came
before (``Z_FULL_FLUSH``, see :class:`_Deflater`); a taken-over directory's
whole piece is reused, and a directory with a few changed entries
re-encodes only their segments.  The pieces, between a zlib header and the
final block with the Adler-32 of the whole text, make one ordinary zlib
stream of the document :func:`._index.encode_index` writes (:func:`_pack`).
"""

from __future__ import annotations

import json
import stat as _stat
import struct
import zlib
from array import array
from operator import attrgetter
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..archive import extracted_dir_mode, extracted_file_mode
from ..root import Root, kind_of
from ._entries import _WalkState
from ._index import _FORMAT, Index, IndexEntry, coarse_now_ns, stamp_latest_ns
from ._models import SnapshotPolicy
from ._walk import (
    SCAN_HEADER,
    WORKSPACE_ID_NAME,
    StatLike,
    _classify,
    _ListedEntry,
    _Listing,
    _Prune,
    _scan_entry,
    _Stat,
)

__all__ = ["Layering"]

#: most entries an index keeps its walk cache for: the cache costs about 680 bytes an entry in memory
#: (measured on the stdlib tree; 500 before it kept each directory's raw listing, for the in-place
#: comparison, and its index piece whole); a larger tree is walked entry by entry
_CACHE_MAX_ENTRIES = 100_000


@dataclass
class _Chunk:
    """What one directory's listing added to a walk (see the module docstring).

    The per-entry lists (in walk order, beside ``entries``) are kept for a
    ``plain`` chunk, else they are empty.

    Attributes:
        key: the directory's scan records, as listed (None: not from a scan).
        entries: its index entries, in walk order, with their final layers.
        dparts: its tree-digest records, one per entry.
        fixups: its ``(path, mode)`` mode fix-ups.
        content: bytes of regular-file content it holds.
        subdirs: the subdirectories it admitted, as listed (entered after it; first in ``entries``).
        plain: every listed entry was admitted plainly, one index entry each (a regular file with one
            link or a directory; no symlink, nothing skipped, excluded or deferred): the next walk
            may take it over whole, or all but the entries that changed.
        racy: positions of entries changed in or after the tick this walk began (the next walk
            walks them again, see the racy rule).
        names: each entry's name in the directory (bytes).
        recs: each entry's scan record.
        sizes: each entry's content bytes (0 but for a file).
        fix: each entry's mode fix-up, or None.
        segs: its entries as JSON text in segments of :data:`_SEG` entries, each
            ``(raw-deflated and sync-flushed text, its length, its Adler-32)`` (None: not encoded yet).
        offs: where each record starts in ``key``, in listed order, then ``len(key)`` (an array of
            8-byte numbers: a list of ints took 36 bytes an entry; None: not known).
        packed: ``segs`` as one piece (the segments' pieces with commas between them), its text's
            length and Adler-32 (None: not packed yet).
    """

    key: bytes | None
    entries: list[IndexEntry]
    dparts: list[bytes]
    fixups: list[tuple[str, int]]
    content: int
    subdirs: list[_ListedEntry]
    plain: bool
    racy: list[int] = field(default_factory=list)
    names: list[bytes] = field(default_factory=list)
    recs: list[bytes] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    fix: list[tuple[str, int] | None] = field(default_factory=list)
    segs: list[tuple[bytes, int, int]] | None = None
    offs: Sequence[int] | None = None
    packed: tuple[bytes, int, int] | None = None


@dataclass
class _WalkCache:
    """The chunks of one walk by directory path, and the options they hold for.

    ``order``: the chunks in walk order; ``sha``: a copy of the tree digest's
    SHA-256 state after the last of them (before the multi-linked files hashed
    after the walk), or None.
    """

    config: tuple[object, ...]
    chunks: dict[str, _Chunk]
    complete: bool  # every entry of the index is in a chunk (none deferred to the end)
    order: list[_Chunk] = field(default_factory=list)
    sha: Any = None


@dataclass
class _Open:
    """The directory a walk is recording: where its records start, what it admitted, what it changed.

    ``old`` and ``changed``: the parent's chunk and the positions of the
    entries that differ from it, when the directory is recorded by taking
    the others over (:meth:`Layering._take_aligned`); ``recs``: the scan
    record of each of those; ``offs``: the listing's record offsets when
    its layout is ``old``'s (see :attr:`_Chunk.offs`).
    """

    path: str
    key: bytes | None
    listing: Sequence[tuple[str, StatLike]]
    records: int
    fixups: int
    content: int
    entries: int
    skipped: int
    subdirs: list[_ListedEntry] = field(default_factory=list)
    old: _Chunk | None = None
    changed: list[int] = field(default_factory=list)
    recs: dict[int, bytes] = field(default_factory=dict)
    offs: Sequence[int] | None = None


@dataclass
class _Built:
    """A directory walked entry by entry: its records are ``records[start:end]`` of this walk."""

    start: int
    end: int
    chunk: _Chunk
    old: _Chunk | None = None  # the parent's chunk it took all but ``changed`` over from
    changed: list[int] = field(default_factory=list)


_PATH, _MTIME, _CTIME = (attrgetter(f) for f in ("path", "mtime_ns", "ctime_ns"))
#: the latest a timestamp may stand for past itself (see :func:`._index.stamp_latest_ns`: whole seconds, 2 s)
_STAMP_STEP_MAX_NS = 2_000_000_000


def _fix_list(entries: list[IndexEntry], fixups: list[tuple[str, int]]) -> list[tuple[str, int] | None]:
    """:func:`_fixup` of each of a plain chunk's ``entries``, from the fix-ups its walk recorded for them.

    The walk recorded ``(path, mode)`` of exactly the entries :func:`_fixup`
    gives one for (the same condition on the same mode), so only those are
    placed; a fix-up of no entry here (never, for a plain chunk) falls back
    to asking :func:`_fixup` of each.
    """
    fix: list[tuple[str, int] | None] = [None] * len(entries)
    if fixups:
        at = {e.path: k for k, e in enumerate(entries)}
        for f in fixups:
            k = at.get(f[0])
            if k is None or _fixup(entries[k]) != f:
                return [_fixup(e) for e in entries]
            fix[k] = f
    return fix


def _fixup(e: IndexEntry) -> tuple[str, int] | None:
    """The mode fix-up the walk records for an entry (see ``_WalkState``), or None."""
    if e.kind == "file":
        return (e.path, e.mode) if e.mode != extracted_file_mode(mode=e.mode) else None
    if e.kind == "dir":
        return (e.path, e.mode) if e.mode != extracted_dir_mode(mode=e.mode) else None
    return None


class Layering:
    """The index of one persist, and its change detection over ``parent`` (None: a full generation).

    Args:
        ws: the workspace Root (its device is recorded; inode numbers are per device).
        parent: the parent generation's index (or the baseline hydrate left), or None.
        generation: the generation being written, when known before the walk: the walk
            records its entries with it as their layer (0: :meth:`index` sets it).
        stored: the index object goes to a local directory: its segments are kept in stored
            deflate blocks, not deflated (see :class:`_Deflater`); an object store's stays deflated.

    Attributes:
        layered: True when a layer is written (``parent`` was taken on this device).
        time_ns: when the walk began (the coarse real-time clock file timestamps come from).
    """

    def __init__(self, ws: Root, parent: Index | None, generation: int = 0, stored: bool = False) -> None:
        self.generation = generation
        self.stored = stored
        self.time_ns = coarse_now_ns()  # before the walk: a change during it is at or after this
        self.dev = ws.stat(".").st_dev
        self.parent = parent if parent is not None and parent.dev == self.dev else None
        self.layered = self.parent is not None
        self._old_by_path: dict[str, IndexEntry] | None = None
        self.records: list[IndexEntry] = []
        self._state: _WalkState | None = None
        self._cache: _WalkCache | None = None
        self._config: tuple[object, ...] = ()
        self._chunks: list[_Chunk | _Built] = []
        self._paths: list[str] = []  # the directory of each of _chunks
        self._open: _Open | None = None
        self._fast: dict[str, IndexEntry] | None = None
        #: digest records of the directories taken over whole so far, not hashed yet: while every directory
        #: is the parent walk's chunk at the same place, the digest may jump to the parent's state at the end
        #: (:meth:`_end_dirs`); None once one is not (everything after is hashed as it is recorded)
        self._deferred: list[_Chunk] | None = []
        self._sha_end: Any = None  # the digest's state after the last directory (for the next walk's jump)
        #: the last :func:`_diff_in_place` known_listing made: (parent chunk, listing, its result)
        self._in_place: tuple[_Chunk, bytes, dict[int, bytes] | None] | None = None

    def setup(self, state: _WalkState) -> None:
        """Make the walk record index entries, and (for a layer) skip unchanged entries."""
        self._state = state
        state.records = self.records
        state.layer = self.generation
        state.begin_dir = self.begin_dir
        state.end_dirs = self._end_dirs
        self._config = (state.prune, state.limits, state.on_unrestorable, self.dev)
        if self.parent is not None:
            state.reuse = self.reuse
            state.same_file = self.same_file
            state.taken_over = self.taken_over
            cache = self.parent.walk_cache
            if isinstance(cache, _WalkCache) and cache.config == self._config:
                self._cache = cache
                state.known_listing = self.known_listing

    def known_listing(self, dpath: str, raw: bytes) -> bool:
        """True when ``raw`` holds the names of the listing the parent walk recorded for ``dpath``, in its places.

        Every chunk's key is a listing its walk checked for a repeated name
        (or one holding the same names, from the walk before: see
        ``_walk.KnownListing``).  So is ``raw`` when it is that key, or laid
        out as it with the same name in every place (:func:`_diff_in_place`:
        each record's name length sits where the key's does, so the records
        parse at the key's offsets); the in-place changes are kept for
        :meth:`_align`.
        """
        old = self._cache.chunks.get(dpath) if self._cache is not None else None
        if old is None or old.key is None:
            return False
        if old.key == raw:
            return True
        found = _diff_in_place(old, raw, not dpath)
        self._in_place = (old, raw, found)
        return found is not None

    def _old(self) -> dict[str, IndexEntry]:
        if self._old_by_path is None:
            self._old_by_path = self.parent.by_path() if self.parent is not None else {}
        return self._old_by_path

    def reuse(self, item: _ListedEntry, st: StatLike | None = None) -> IndexEntry | None:
        """The parent entry of a regular file with one link, or a directory, that is provably unchanged, else None.

        ``st``: the entry's ``lstat`` (default: the listing's).
        """
        fast = self._fast
        old = fast.get(item.path) if fast is not None and item.path in fast else self._old().get(item.path)
        return self._unchanged(old, st if st is not None else item.st)

    def _unchanged(self, old: IndexEntry | None, st: StatLike) -> IndexEntry | None:
        if old is None:
            return None
        if old.kind == "file":
            if old.nlink != 1 or st.st_nlink != 1 or not _stat.S_ISREG(st.st_mode) or st.st_size != old.size:
                return None
        elif old.kind != "dir" or not _stat.S_ISDIR(st.st_mode) or st.st_nlink != old.nlink:
            return None
        if st.st_ino != old.ino or st.st_mtime_ns != old.mtime_ns or st.st_ctime_ns != old.ctime_ns \
                or SnapshotPolicy.mode(st.st_mode) != old.mode:
            return None
        assert self.parent is not None
        began = self.parent.time_ns
        # (ctime as the latest moment it may stand for: any change sets it, and only the file system
        # truncates it; an mtime in whole seconds is as often one set by a restore or by tar)
        if st.st_mtime_ns >= began or stamp_latest_ns(st.st_ctime_ns) >= began:
            return None  # racy: written in or after the tick the parent's walk began; read it again
        return old

    def same_file(self, item: _ListedEntry) -> IndexEntry | None:
        """The parent entry of a one-link regular file with the recorded inode, size, mtime and mode, else None.

        Its ctime differs (else :meth:`reuse` took it), or is racy: the walk
        compares its content with the entry's SHA-256 before it writes it
        again (``_WalkState._same_content``).
        """
        fast = self._fast
        old = fast.get(item.path) if fast is not None and item.path in fast else self._old().get(item.path)
        st = item.st
        if old is None or old.kind != "file" or old.nlink != 1 or st.st_nlink != 1 or not _stat.S_ISREG(st.st_mode):
            return None
        if (st.st_ino, st.st_size, st.st_mtime_ns, SnapshotPolicy.mode(st.st_mode)) != \
                (old.ino, old.size, old.mtime_ns, old.mode):
            return None
        return old

    def taken_over(self, item: _ListedEntry) -> IndexEntry | None:
        """The parent entry of ``item`` from its directory's chunk when unchanged (no name rule needed), else None."""
        if self._fast is None:
            return None
        return self._unchanged(self._fast.get(item.path), item.st)

    # -- whole directories

    def begin_dir(self, dpath: str, listing: Sequence[tuple[str, StatLike]], dfd: int) -> list[_ListedEntry] | None:
        """Record directory ``dpath`` from the parent's walk if it can (its subdirectories to enter), else None.

        Called by the walk for each directory before it is split (see
        :func:`._walk._walk`): closes the previous directory's chunk and opens
        this one's.  A directory whose listing is the one recorded is taken
        over whole; one whose names are the recorded ones, some with other
        records, has the others taken over and those walked (in walk order)
        here; any other is left to the walk (None).

        Raises:
            What the walk of a changed entry raises (see ``_WalkState``).
        """
        self._close()
        state = self._state
        assert state is not None
        key = listing.raw if isinstance(listing, _Listing) else None
        old = self._cache.chunks.get(dpath) if self._cache is not None else None
        if old is not None and key is not None and old.plain:
            if old.key == key and not old.racy and self._fits_whole(old):
                cache, deferred, at = self._cache, self._deferred, len(self._chunks)
                if deferred is not None and cache is not None and at < len(cache.order) and cache.order[at] is old:
                    deferred.append(old)  # its records are hashed later, or never (see _end_dirs)
                    state.take_chunk(old.entries, None, old.fixups, old.content)
                else:
                    self._undefer()
                    state.take_chunk(old.entries, b"".join(old.dparts), old.fixups, old.content)
                self._chunks.append(old)
                self._paths.append(dpath)
                return old.subdirs
            assert isinstance(listing, _Listing)
            aligned = self._align(old, listing, dpath)
            if aligned is not None:
                plan, recs, offs = aligned
                self._start(dpath, key, listing, old, [k for k, _e in plan])
                assert self._open is not None
                self._open.recs, self._open.offs = recs, offs
                self._fast = {old.entries[k].path: old.entries[k] for k, _e in plan}
                self._take_aligned(old, plan, dfd)
                return list(state.admitted or ())
        self._fast = {e.path: e for e in old.entries} if old is not None else None
        self._start(dpath, key, listing, None, [])
        return None

    def _undefer(self) -> None:
        """Hash the deferred digest records (in walk order); from now on everything is hashed as recorded."""
        deferred, state = self._deferred, self._state
        assert state is not None
        self._deferred = None
        for chunk in deferred or ():
            state.digest.add_records(b"".join(chunk.dparts))

    def _end_dirs(self) -> None:
        """After the last directory: close its chunk, settle the digest (see ``_deferred``) and keep its state.

        When every directory was taken over whole from the parent walk's
        chunk at the same place (a tree with nothing changed), the digest
        input so far is the parent walk's, so its state is the parent's
        saved one: the records are not hashed again.
        """
        self._close()
        state, cache = self._state, self._cache
        assert state is not None
        if self._deferred is not None and cache is not None and cache.sha is not None \
                and len(self._chunks) == len(cache.order):
            state.digest.resume(cache.sha)
            self._deferred = None
        else:
            self._undefer()
        self._sha_end = state.digest.state()

    def _start(self, dpath: str, key: bytes | None, listing: Sequence[tuple[str, StatLike]], old: _Chunk | None,
               changed: list[int]) -> None:
        state = self._state
        assert state is not None
        self._undefer()  # this directory's records are hashed as they are recorded
        self._open = _Open(dpath, key, listing, len(self.records), len(state.fixups or ()), state.content,
                           state.entries, len(state.skipped), old=old, changed=changed)
        state.admitted = self._open.subdirs
        state.digest.parts = []

    def _fits_whole(self, old: _Chunk) -> bool:
        """:meth:`_fits` for all of ``old`` (its ``content`` is the sum of its ``sizes``)."""
        state = self._state
        assert state is not None
        return state.entries + len(old.entries) <= state.limits.max_entries and \
            state.content + old.content <= state.limits.max_total_bytes

    def _fits(self, old: _Chunk, i: int, j: int) -> bool:
        state = self._state
        assert state is not None
        return state.entries + (j - i) <= state.limits.max_entries and \
            state.content + sum(old.sizes[i:j]) <= state.limits.max_total_bytes

    def _align(self, old: _Chunk, listing: _Listing,
               dpath: str) -> tuple[list[tuple[int, _ListedEntry]], dict[int, bytes], Sequence[int] | None] | None:
        """The entries of ``listing`` that differ from ``old``'s, by position, when its names are the same; else None.

        Returns ``(plan, records, offsets)``: each changed entry's position
        and listed entry (in walk order), its scan record by position, and
        the listing's record offsets when they are ``old``'s.  Each changed
        entry must keep its place in walk order (a directory stays a
        directory, anything else stays not one).
        """
        kept, self._in_place = self._in_place, None
        if kept is not None and kept[0] is old and kept[1] is listing.raw:
            found = kept[2]  # (computed for known_listing already)
        else:
            found = _diff_in_place(old, listing.raw, not dpath)
        offs = old.offs if found is not None else None
        if found is None:
            found = _diff_by_name(old, listing, dpath)
            if found is None:
                return None
        changed = sorted(set(found).union(old.racy)) if old.racy else sorted(found)
        # (racy: changed in the tick the parent's walk began: walked again though listed the same)
        if len(changed) * 2 > len(old.names):
            return None  # mostly changed: walked entry by entry
        plan = []
        recs = {}
        prefix = dpath + "/" if dpath else ""
        for k in changed:
            rec = found.get(k, old.recs[k])
            recs[k] = rec
            name, st = _scan_entry(rec)
            if _stat.S_ISDIR(st.st_mode) != (old.entries[k].kind == "dir"):
                return None
            plan.append((k, _ListedEntry(prefix + name, "dir" if _stat.S_ISDIR(st.st_mode) else kind_of(st.st_mode),
                                         st, name)))
        return plan, recs, offs

    def _take_aligned(self, old: _Chunk, plan: list[tuple[int, _ListedEntry]], dfd: int) -> None:
        """Take ``old``'s entries over but those in ``plan``, which are walked in their place."""
        state, opened = self._state, self._open
        assert state is not None and opened is not None
        prefix = opened.path + "/" if opened.path else ""
        i = 0
        for k, item in plan + [(len(old.entries), None)]:
            self._take_run(old, i, k)
            i = k + 1
            if item is None:
                break
            entry = _classify(prefix, item.name, item.st, self.dev, state.prune or _Prune(), state.skipped)
            if entry is None:
                continue
            if entry.kind == "dir":
                state.admit_dir(entry, dfd)
            else:
                state.add_nondir(entry, dfd)

    def _take_run(self, old: _Chunk, i: int, j: int) -> None:
        """Take ``old``'s entries ``i`` to ``j`` (excluded) over as they are."""
        if i >= j:
            return
        state = self._state
        assert state is not None
        if not self._fits(old, i, j):  # one by one: the limit error names the entry past it
            for k in range(i, j):
                e = old.entries[k]
                state.take_over(_ListedEntry(e.path, e.kind, _Stat(0, 0, 0, 0, 0, 0, 0)), e)
            return
        fixups = [f for f in old.fix[i:j] if f is not None]
        state.take_chunk(old.entries[i:j], b"".join(old.dparts[i:j]), fixups, sum(old.sizes[i:j]))
        if state.digest.parts is not None:
            state.digest.parts.extend(old.dparts[i:j])
        if state.admitted is not None and i < len(old.subdirs):
            state.admitted.extend(old.subdirs[i:min(j, len(old.subdirs))])

    def _close(self) -> None:
        """End the chunk of the directory walked entry by entry, if one is open."""
        opened, state = self._open, self._state
        if opened is None or state is None:
            return
        self._open = None
        self._fast = None
        state.admitted = None
        parts, state.digest.parts = state.digest.parts or [], None
        end = len(self.records)
        fixups = state.fixups[opened.fixups:] if state.fixups is not None else []
        chunk = _Chunk(opened.key, [], parts, fixups, state.content - opened.content, opened.subdirs,
                       len(parts) == end - opened.records and self._plain(opened, end))
        if chunk.plain:
            self._per_entry(chunk, opened, end)
        self._chunks.append(_Built(opened.records, end, chunk, opened.old if chunk.plain else None, opened.changed))
        self._paths.append(opened.path)

    def _plain(self, opened: _Open, end: int) -> bool:
        """True when every entry listed in ``opened`` was admitted plainly, one index entry each."""
        state = self._state
        assert state is not None
        if opened.key is None or len(state.skipped) != opened.skipped or \
                state.entries - opened.entries != end - opened.records:
            return False  # something skipped or excluded, or a multi-linked file deferred
        if opened.old is not None:  # taken over but the changed ones: those decide
            if end - opened.records != len(opened.old.entries):
                return False
            return all(self.records[opened.records + k].kind != "symlink" for k in opened.changed)
        listed = len(opened.listing)
        if not opened.path and any(name == WORKSPACE_ID_NAME for name, _st in opened.listing):
            listed -= 1
        return listed == end - opened.records and all(e.kind != "symlink" for e in self.records[opened.records:end])

    def _per_entry(self, chunk: _Chunk, opened: _Open, end: int) -> None:
        """Fill a plain chunk's per-entry lists and racy positions (from the parent's chunk and the changed
        entries, when aligned)."""
        entries = self.records[opened.records:end]
        now = self.time_ns
        if opened.old is None and entries and max(map(_MTIME, entries)) < now and \
                max(map(_CTIME, entries)) + _STAMP_STEP_MAX_NS < now:
            chunk.racy = []  # (no timestamp stands for a moment as late as the walk's start)
        else:
            chunk.racy = [k for k in (opened.changed if opened.old is not None else range(len(entries)))
                          if entries[k].mtime_ns >= now or stamp_latest_ns(entries[k].ctime_ns) >= now]
        listing = opened.listing
        assert isinstance(listing, _Listing)
        old = opened.old
        if old is not None:
            chunk.names = old.names
            chunk.offs = opened.offs if opened.offs is not None else array("Q", listing.offsets())
            chunk.recs, chunk.sizes, chunk.fix = list(old.recs), list(old.sizes), list(old.fix)
            for k in opened.changed:
                e = entries[k]
                chunk.recs[k] = opened.recs[k]
                chunk.sizes[k] = e.size if e.kind == "file" else 0
                chunk.fix[k] = _fixup(e)
            return
        recs = listing.records()
        chunk.offs = array("Q", listing.offsets())
        plen = len(opened.path) + 1 if opened.path else 0
        chunk.names = [p[plen:].encode("utf-8", "surrogateescape") for p in map(_PATH, entries)]
        chunk.recs = list(map(recs.__getitem__, chunk.names))
        chunk.sizes = [e.size if e.kind == "file" else 0 for e in entries]
        chunk.fix = _fix_list(entries, chunk.fixups)

    # -- the new index

    def index(self, generation: int) -> Index:
        """The new generation's index: entries written now get ``generation`` as their layer."""
        records = self.records
        assert self.generation in (0, generation), "the walk recorded another generation"
        if not self.generation:  # recorded with layer 0 (not known before the walk): set it now
            records = [e if e.layer else e._replace(layer=generation) for e in records]
        entries: list[IndexEntry] = []  # a chunk taken over whole adds its entries as they are (layers set)
        chunks: list[_Chunk] = []
        deflater = _Deflater(self.stored)
        for c in self._chunks:
            if isinstance(c, _Built):
                c.chunk.entries = records[c.start:c.end]
                if c.old is not None and c.old.segs is not None:  # re-encode only the segments that changed
                    c.chunk.segs = _segments(c.chunk.entries, deflater, c.old.segs, {k // _SEG for k in c.changed})
                c = c.chunk
            entries += c.entries
            chunks.append(c)
        # multi-linked files, recorded after the walk
        tail = records[len(entries):]
        entries += tail
        deleted = self._deleted(entries, chunks, tail)
        encoded = _pack(self.time_ns, self.dev, chunks, tail, deleted, deflater)
        cache = None
        if len(entries) <= _CACHE_MAX_ENTRIES and self._chunks:
            cache = _WalkCache(self._config, dict(zip(self._paths, chunks)), not tail, chunks, self._sha_end)
        return Index(self.time_ns, self.dev, entries, deleted, encoded=encoded, walk_cache=cache)

    def _deleted(self, entries: list[IndexEntry], chunks: list[_Chunk], tail: list[IndexEntry]) -> list[str]:
        """Paths of the parent index this one no longer has, in the parent's order."""
        if self.parent is None:
            return []
        cache = self._cache
        if cache is None or not cache.complete or tail:
            now = {e.path for e in entries}
            return [e.path for e in self.parent.entries if e.path not in now]
        # Per directory: one taken over (whole, or all but changed entries of the same names, each
        # recorded again) deletes nothing; one walked entry by entry, what it no longer has; one not
        # walked, everything it had.
        same = {p for p, c, b in zip(self._paths, chunks, self._chunks)
                if c is cache.chunks.get(p) or (isinstance(b, _Built) and b.old is not None)}
        walked = dict(zip(self._paths, chunks))
        out: list[str] = []
        for path, old in cache.chunks.items():
            if path in same:
                continue
            new = walked.get(path)
            if new is None:
                out.extend(e.path for e in old.entries)
            else:
                now = {e.path for e in new.entries}
                out.extend(e.path for e in old.entries if e.path not in now)
        return out


_WS_ID = WORKSPACE_ID_NAME.encode()
_NAME_AT = SCAN_HEADER.size  # a record's name starts here; its length is the 4 bytes before
_NAME_LEN = struct.Struct("=I")


def _diff_in_place(old: _Chunk, raw: bytes, top: bool) -> dict[int, bytes] | None:
    """Position -> new record of each entry of ``old`` whose record in ``raw`` differs, when ``raw`` is laid
    out as ``old.key`` (same length, every differing record with the same name in the same place); else None.

    The differing records are found by halving the record ranges that
    differ (``old.offs``), so a large directory with a few changed entries
    costs a few comparisons, not one per entry.  At the top, the workspace
    id file (not an entry) is passed over.
    """
    before, offs = old.key, old.offs
    if before is None or offs is None or len(raw) != len(before):
        return None
    a, b = before, raw  # slices of bytes compare with memcmp (a memoryview's ==, byte by byte in Python's loop)
    diff: list[int] = []
    todo = [(0, len(offs) - 1)]
    while todo:
        lo, hi = todo.pop()
        if lo >= hi or a[offs[lo]:offs[hi]] == b[offs[lo]:offs[hi]]:
            continue
        if hi - lo == 1:
            diff.append(lo)
            continue
        mid = (lo + hi) // 2
        todo += ((mid, hi), (lo, mid))
    out = {}
    for i in diff:
        start, end = offs[i], offs[i + 1]
        if a[start + _NAME_AT - 4:end] != b[start + _NAME_AT - 4:end]:
            return None  # another name (or name length) at this place
        (nlen,) = _NAME_LEN.unpack_from(raw, start + _NAME_AT - 4)
        name = raw[start + _NAME_AT:start + _NAME_AT + nlen]
        try:
            k = old.names.index(name)
        except ValueError:
            if top and name == _WS_ID:
                continue
            return None
        out[k] = raw[start:end]
    return out


def _diff_by_name(old: _Chunk, listing: _Listing, dpath: str) -> dict[int, bytes] | None:
    """:func:`_diff_in_place` for any layout: by name; None when the names are not ``old``'s."""
    recs = listing.records()
    count = len(recs) - (1 if not dpath and _WS_ID in recs else 0)
    if count != len(old.names):
        return None
    get = recs.get
    changed = [k for k, (name, rec) in enumerate(zip(old.names, old.recs)) if get(name) != rec]
    out = {}
    for k in changed:
        rec = get(old.names[k])
        if rec is None:
            return None  # another name
        out[k] = rec
    return out


_ZLIB_HEADER = b"\x78\x01"  # deflate, 32 KiB window, fastest level (what zlib.compress(data, 1) writes)
_FINAL_BLOCK = zlib.compressobj(1, zlib.DEFLATED, -15).flush(zlib.Z_FINISH)  # an empty final block
_ADLER_MOD = 65521


def _deflate_piece(text: bytes) -> bytes:
    """``text`` raw-deflated on its own and sync-flushed: a byte-aligned piece of any deflate stream.

    A 4 KiB window and a small hash table: a compressor made in a twelfth
    of the time (zlib's default state is ~270 KiB to allocate), for the few
    short pieces of an index (its head and end).  Any decoder reads it with
    the stream's 32 KiB window.
    """
    c = zlib.compressobj(1, zlib.DEFLATED, -12, 4)
    return c.compress(text) + c.flush(zlib.Z_SYNC_FLUSH)


_STORED_HEAD = struct.Struct("<BHH")  # a stored block's header byte (BFINAL 0, BTYPE 00), LEN and NLEN
_STORED_MAX = 0xFFFF  # most bytes one stored block holds


def _stored_piece(text: bytes) -> bytes:
    """``text`` as deflate stored blocks (no compression): a byte-aligned piece of any deflate stream.

    What ``zlib.compressobj(0, ...)`` writes for it with ``Z_FULL_FLUSH``
    after a byte boundary (RFC 1951 3.2.4: the block's 3 header bits, the
    rest of that byte unused, then LEN and its one's complement, then the
    bytes), made here without a zlib call.
    """
    n = len(text)
    if n <= _STORED_MAX:
        return _STORED_HEAD.pack(0, n, n ^ 0xFFFF) + text
    out = []
    for i in range(0, n, _STORED_MAX):
        part = text[i:i + _STORED_MAX]
        out += (_STORED_HEAD.pack(0, len(part), len(part) ^ 0xFFFF), part)
    return b"".join(out)


class _Deflater:
    """Deflates the segments of one index, each a piece on its own, with one compressor made on first use.

    Each piece ends with ``Z_FULL_FLUSH``: byte-aligned, and the
    compressor's history is dropped, so no piece refers to an earlier one
    and each can be reused in any later index (see :func:`_pack`).  One
    compressor for all of them, made once (zlib's default state, ~270 KiB):
    one made per piece cost as much as deflating the piece, and the small
    one of :func:`_deflate_piece` deflates index JSON (hex digests in every
    entry) more slowly (16 entries: 30 us a piece against 23, on the
    stdlib tree's segments).

    Args:
        stored: keep each piece in stored blocks, not deflated (:func:`_stored_piece`): for an index a
            local directory keeps, as hydrate's baseline does (the stdlib tree's index: ~1.7 MB instead
            of ~0.5 MB, written to a local file in less time than deflating it took).  Decoded alike.
    """

    def __init__(self, stored: bool = False) -> None:
        self._c: Any = None
        self.stored = stored

    def piece(self, text: bytes) -> bytes:
        if self.stored:
            return _stored_piece(text)
        if self._c is None:
            self._c = zlib.compressobj(1, zlib.DEFLATED, -15, 8)
        return bytes(self._c.compress(text) + self._c.flush(zlib.Z_FULL_FLUSH))


def _adler_combine(a1: int, a2: int, len2: int) -> int:
    """Adler-32 of ``x + y`` from Adler-32 ``a1`` of ``x``, ``a2`` of ``y`` and ``len(y)`` (zlib's adler32_combine)."""
    rem = len2 % _ADLER_MOD
    s1 = ((a1 & 0xFFFF) + (a2 & 0xFFFF) + _ADLER_MOD - 1) % _ADLER_MOD
    s2 = (rem * (a1 & 0xFFFF) + (a1 >> 16) + (a2 >> 16) + _ADLER_MOD - rem) % _ADLER_MOD
    return s1 | (s2 << 16)


#: JSON text as :func:`._index.encode_index` writes it (one encoder, made once: ``json.dumps`` with these
#: options makes a new one on every call, which cost as much as encoding a segment)
_json = json.JSONEncoder(ensure_ascii=True, separators=(",", ":")).encode

#: entries per separately deflated piece of an index (a changed entry re-encodes only its own): 8 made
#: the stdlib tree's index 10% larger than 16 did (525 KB, not 479 KB) and each re-encoded piece cost
#: 25 us, not 40 (4: 31% larger, 16 us)
_SEG = 8


def _segments(entries: list[IndexEntry], deflater: _Deflater, old: list[tuple[bytes, int, int]] | None = None,
              changed: set[int] | frozenset[int] = frozenset()) -> list[tuple[bytes, int, int]]:
    """``entries`` as JSON array items in pieces of :data:`_SEG` (``old``'s piece where none ``changed``)."""
    out = []
    for s, i in enumerate(range(0, len(entries), _SEG)):
        if old is not None and s not in changed and s < len(old):
            out.append(old[s])
            continue
        text = _json(entries[i:i + _SEG])[1:-1].encode()  # (a tuple is a JSON array)
        out.append((deflater.piece(text), len(text), zlib.adler32(text)))
    return out


_COMMA = b","
_COMMA_PIECE = _deflate_piece(_COMMA)
_COMMA_ADLER = zlib.adler32(_COMMA)


def _packed(c: _Chunk, deflater: _Deflater) -> tuple[bytes, int, int]:
    """``c``'s entries as one piece (:attr:`_Chunk.packed`), made from its segments on first use."""
    if c.packed is None:
        if c.segs is None:
            c.segs = _segments(c.entries, deflater)
        out: list[bytes] = []
        adler, length = 1, 0  # the Adler-32 of no bytes
        for packed, text_len, text_adler in c.segs:
            if out:
                out.append(_COMMA_PIECE)
                adler = _adler_combine(adler, _COMMA_ADLER, 1)
                length += 1
            out.append(packed)
            adler = _adler_combine(adler, text_adler, text_len)
            length += text_len
        c.packed = (b"".join(out), length, adler)
    return c.packed


def _pack(time_ns: int, dev: int, chunks: list[_Chunk], tail: list[IndexEntry], deleted: list[str],
          deflater: _Deflater) -> bytes:
    """The index object (the document :func:`._index.encode_index` writes), from per-directory pieces."""
    head = json.dumps({"format": _FORMAT, "version": 1, "time_ns": time_ns, "dev": dev},
                      ensure_ascii=True, separators=(",", ":"))[:-1].encode() + b',"entries":['
    out = [_ZLIB_HEADER, _deflate_piece(head)]
    adler, first = zlib.adler32(head), True
    for c in chunks + ([_Chunk(None, tail, [], [], 0, [], False)] if tail else []):
        packed, text_len, text_adler = _packed(c, deflater)
        if not text_len:
            continue  # an empty directory
        if not first:
            out.append(_COMMA_PIECE)
            adler = _adler_combine(adler, _COMMA_ADLER, 1)
        first = False
        out.append(packed)
        adler = _adler_combine(adler, text_adler, text_len)
    end = b'],"deleted":' + json.dumps(deleted, ensure_ascii=True, separators=(",", ":")).encode() + b"}"
    out += [_deflate_piece(end), _FINAL_BLOCK, struct.pack(">I", _adler_combine(adler, zlib.adler32(end), len(end)))]
    return b"".join(out)
