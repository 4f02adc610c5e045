"""What the walk keeps of each entry: the restore policy applied per entry, hard links, the tree digest.

*Hard links*: ordinary files stream as they are listed (O(1) memory); a
regular file with ``st_nlink > 1`` is deferred until the walk has counted
its names (only multi-linked inodes are remembered) and archived only when
every one of its links is inside the walk (the first name as a file, the
others as hard-link members).  A file also linked from outside the
workspace (or from an excluded path) is never read: refused, or skipped
and reported, so outside content cannot reach a snapshot.  A count of
names is only a count of links when no name was counted twice: a name
moved from a directory already listed to one listed later is seen in both,
and a name renamed while its directory is read may be listed twice (POSIX
leaves it unspecified; such a count is refused as changed, retryable).
So before such a file is read, every name counted is looked up again while
the directories holding them are shown not to change (each one's ctime is
strictly older than the check's start on the kernel's coarse clock, taking
a truncated whole-second ctime as the latest moment it may stand for, and the
same after the last lookup: the racy-git rule of :mod:`._index`; and no
two of those paths the same directory, a subtree moved between listings):
all the names were there at one moment, so they are that many links.  A name gone
or a directory changed is :class:`SnapshotSourceChangedError` (retryable).

The *fingerprint* is ``sha256("sfs-fp-v1" NUL manifest_digest NUL tree_digest)``
where the tree digest covers, in walk order, every kept entry's path, type,
size, permission bits and content SHA-256 (symlink: its target text).  It is
computed in Python over the fd walk, never by running a command in the
workspace, and lets a resumed session skip a restore when the live
workspace provably matches the snapshot.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import fcntl
import hashlib
import os
import signal
import stat as _stat
import tarfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal, cast

from ..archive import (
    ArchiveLimitError,
    UnsafeArchiveMemberError,
    extracted_dir_mode,
    extracted_file_mode,
    mtime_is_applied,
    normalize_member_name,
    symlink_target_walk,
)
from ..errors import InvalidPathError, SandboxError
from ..root import Root
from ._errors import SnapshotLimitError, SnapshotSourceChangedError, UnrestorableEntryError
from ._index import IndexEntry, coarse_now_ns, stamp_latest_ns
from ._models import SnapshotLimits, SnapshotPolicy
from ._header import MemberHeader, encode_header, encode_listed, ustar_fits
from ._tar import PendingSha, _TarStream
from ._walk import (
    BeginDir,
    KnownListing,
    MemberOpener,
    StatLike,
    _ListedEntry,
    _Prune,
    _lstat_listed,
    _open_member,
    _readlink_listed,
    _source_changed,
    _source_view,
    _Stat,
    _walk,
)

__all__ = ["tree_digest", "fingerprint"]


class _Digest:
    """The tree digest: SHA-256 over one record per kept entry, in walk order.

    A file's content SHA-256 may still be computed by the persist writer
    thread (a :class:`~._tar.PendingSha`): its record, and every record
    after it, wait in :attr:`_queue` (in walk order) until it is done, so the
    digest covers the same bytes in the same order either way.  The queue
    holds at most the files of the write buffers in flight.

    Attributes:
        parts: when a list, every record added is also appended to it (a layered
            walk keeps each directory's records, see :mod:`._layers`; it never
            adds a pending content).
    """

    def __init__(self) -> None:
        self.sha = hashlib.sha256()
        self.parts: list[bytes] | None = None
        self._queue: collections.deque[bytes | tuple[bytes, PendingSha]] = collections.deque()

    def add(self, path: str, kind: str, size: int, mode: int, content: str | PendingSha) -> None:
        if type(content) is str:
            rec = f"{path}\0{kind}\0{size}\0{mode:o}\0{content}\n".encode("utf-8", "surrogateescape")
            if self.parts is not None:
                self.parts.append(rec)
            if not self._queue:
                self.sha.update(rec)
                return
            self._queue.append(rec)
        else:
            assert self.parts is None, "a layered walk hashes its files itself"
            self._queue.append((f"{path}\0{kind}\0{size}\0{mode:o}\0".encode("utf-8", "surrogateescape"),
                                cast(PendingSha, content)))
        self._settle(wait=False)

    def _settle(self, wait: bool) -> None:
        """Add the queued records whose contents are known, in order (``wait``: all of them).

        Raises:
            RuntimeError: with ``wait``, a content is still being hashed (a caller bug, see :meth:`hexdigest`).
        """
        queue, update = self._queue, self.sha.update
        while queue:
            head = queue[0]
            if type(head) is bytes:
                update(head)
            else:
                pre, pending = cast("tuple[bytes, PendingSha]", head)
                if not wait and not pending.done():
                    return
                update(pre + pending.hexdigest().encode("ascii") + b"\n")
            queue.popleft()

    def add_records(self, recs: bytes) -> None:
        """Add records :meth:`add` made before, as they are (a directory taken over whole)."""
        if self._queue:
            self._queue.append(recs)
            self._settle(wait=False)
        else:
            self.sha.update(recs)

    def state(self) -> Any:
        """A copy of the SHA-256 state (nothing may be queued: a layered walk never queues)."""
        assert not self._queue, "a layered walk hashes its files itself"
        return self.sha.copy()

    def resume(self, state: Any) -> None:
        """Continue from a :meth:`state` taken after the very records added so far (they are not hashed again)."""
        assert not self._queue, "a layered walk hashes its files itself"
        self.sha = state.copy()

    def hexdigest(self) -> str:
        """The tree digest; only once every pending content is hashed (after the tar stream's ``close``).

        Raises:
            RuntimeError: a file's content is still being hashed.
        """
        self._settle(wait=True)
        return self.sha.hexdigest()


def fingerprint(manifest_digest: str, tree_digest_hex: str) -> str:
    """The snapshot fingerprint: SHA-256 over a version tag, the manifest digest and the tree digest."""
    return hashlib.sha256(f"sfs-fp-v1\0{manifest_digest}\0{tree_digest_hex}".encode()).hexdigest()


def _is_link(ws: Root, path: bytes) -> bool | None:
    """True/False for a symlink / something else at ``path``; None when missing or unreachable."""
    try:
        return _stat.S_ISLNK(ws.lstat(path or b".").st_mode)
    except (FileNotFoundError, NotADirectoryError, InvalidPathError):
        return None  # (InvalidPathError: a name no file can have, such as a component over 255 bytes)
    except SandboxError:
        return True  # reaching it needs a symlink the kernel refused: treat as a link


def _symlink_reason(ws: Root, link: bytes, target: str, alimits: Any) -> str | None:
    """Why hydrate would refuse this symlink (None: it restores), by the extractor's rules.

    Absolute or escaping targets raise from :func:`~sandbox_fs.archive.symlink_target_walk`; a target
    passing *through* another symlink is refused (CVE-2025-4517 chains);
    a chain of links that comes back on itself is a cycle, also refused.
    Up to 40 links are followed (the kernel's own bound, ELOOP).
    """
    through, final = symlink_target_walk(link=link, target=target, limits=alimits)
    for p in through:
        is_link = _is_link(ws, p)
        if is_link:
            return "symlink target passes through another symlink"
        if is_link is None:
            break
    seen = {link}
    cur = final
    for _ in range(40):
        if cur in seen:
            return "symlinks form a cycle"
        seen.add(cur)
        if not _is_link(ws, cur):
            return None
        try:
            nxt = ws.readlink(cur)
            _t, cur = symlink_target_walk(link=cur, target=nxt, limits=alimits)
        except FileNotFoundError:
            return None
        except (UnsafeArchiveMemberError, ArchiveLimitError):
            return None  # that link is refused on its own when the walk reaches it
    return "symlink chain is longer than 40 links"


def _walk_into(ws: Root, prune: _Prune, policy: SnapshotPolicy, on_unrestorable: str, tar: _TarStream,
               progress: Callable[[int, int], None] | None = None,
               setup: Callable[[_WalkState], None] | None = None) -> _WalkState:
    """Walk the workspace once and record every kept entry in the digest (and write it to ``tar``).

    Ordinary entries stream as they are listed (O(1) memory).  Listings
    come from directory fds the walk holds (see :func:`_walk`), but every
    entry that is read (a file's content, a symlink's target, a
    subdirectory to list) and everything recorded of it is taken from the
    entry opened by its path beneath the workspace Root's own fd at that
    moment (:func:`_source_view`, ``RESOLVE_NO_SYMLINKS``) and ``fstat``-checked
    to be the listed inode, so a directory moved out of the workspace while
    the walk holds it contributes nothing (retryable
    :class:`SnapshotSourceChangedError`).  A regular file with more than one link is
    deferred until the walk has counted its names (only multi-linked
    inodes are remembered): it is archived only when every one of its
    links was seen inside the workspace walk (the first name as a file,
    the others as hard-link members); otherwise it is linked to a file
    outside the workspace (or to an excluded path) and its content is
    never read: refused, or skipped and reported.

    Args:
        ws: the workspace Root.
        prune: what the walk leaves out (:class:`~._walk._Prune`).
        policy: the restore rules and limits.
        on_unrestorable: ``"refuse"`` or ``"skip"`` an entry hydrate would refuse.
        tar: the stream members are written to (``_TarStream(None)``: hash only).
        progress: called with ``(entries, content bytes)`` at most every 0.2 s, and once at the end.
        setup: called with the new walk state before the walk (a layered persist sets its
            ``reuse`` and ``records``).

    Returns:
        The walk's state: counts, digest, skipped entries, mode fix-ups.

    Raises:
        UnrestorableEntryError: with ``on_unrestorable="refuse"``, an entry hydrate would refuse.
        SnapshotLimitError: the workspace exceeds the policy's limits.
        SnapshotSourceChangedError: the workspace changed under the walk (retryable).
        OSError: a directory or file cannot be read, or the sink cannot be written.
    """
    with _source_view(ws) as src:
        state = _WalkState(ws, src, policy, tar, on_unrestorable, prune)
        if setup is not None:
            setup(state)
        last_report = time.monotonic()
        with contextlib.closing(_walk(ws, src, prune, state.skipped, state.admit_dir, state.begin_dir,
                                      state.known_listing)) as walk:
            for dfd, nondirs in walk:
                for entry in nondirs:
                    if state.add_nondir(entry, dfd) and progress is not None:
                        now = time.monotonic()
                        if now - last_report >= 0.2:
                            last_report = now
                            progress(state.entries, state.content)
        if state.end_dirs is not None:
            state.end_dirs()
        for linked in state.multi_linked.values():
            state.add_linked(linked)
        if progress is not None:
            progress(state.entries, state.content)
    return state


@dataclass
class _Linked:
    """The names of one multi-linked inode seen by the walk, with its link count at listing time."""

    nlink: int
    items: list[_ListedEntry]
    changed: bool = False


class _WalkState:
    """What one walk records: counters, the digest, the tar stream, skipped entries and mode fix-ups.

    Args:
        ws: the workspace Root (symlink chains are looked up through it).
        src: its source view: every entry is opened by its path beneath the workspace Root.
        policy: the restore rules and limits both persist and hydrate apply.
        tar: where members go; one without a sink only hashes (``writes`` False).
        on_unrestorable: ``"refuse"`` raises on an entry hydrate would refuse; ``"skip"`` records it.
        prune: what the walk leaves out.
    """

    def __init__(self, ws: Root, src: Root, policy: SnapshotPolicy, tar: _TarStream, on_unrestorable: str,
                 prune: _Prune | None = None) -> None:
        self.ws = ws
        self.prune = prune
        self.src = src
        self.policy = policy
        self.limits = policy.limits
        self.headers = policy.header_check()
        self.on_unrestorable = on_unrestorable
        self.tar = tar
        self.write = tar.writes
        self.digest = _Digest()
        self.skipped: list[tuple[str, str]] = []
        #: ``(path, exact mode)`` of members the extractor would give another mode (recorded when writing)
        self.fixups: list[tuple[str, int]] | None = [] if self.write else None
        self._opener = MemberOpener()
        #: (st_dev, st_ino) -> the names seen, for regular files with st_nlink > 1 only
        self.multi_linked: dict[tuple[int, int], _Linked] = {}
        self.entries = 0
        self.content = 0
        #: layered persist: the parent-index entry of an unchanged regular file or directory, given its
        #: lstat (None: read or write it again), see _index
        self.reuse: Callable[[_ListedEntry, StatLike | None], IndexEntry | None] | None = None
        #: layered persist: the parent's entry of an unchanged entry of a directory its walk recorded
        #: with the same options (no name rule to apply again), see _layers
        self.taken_over: Callable[[_ListedEntry], IndexEntry | None] | None = None
        #: layered persist: the parent's entry of a one-link regular file whose inode, size, mtime and mode
        #: are the recorded ones but not its ctime (a re-own by another identity), see :meth:`_same_content`
        self.same_file: Callable[[_ListedEntry], IndexEntry | None] | None = None
        #: layered persist: the new generation's index entries, in walk order (None: not recorded)
        self.records: list[IndexEntry] | None = None
        #: layered persist: offered each directory's listing first (see _walk.BeginDir), and called after the walk
        self.begin_dir: BeginDir | None = None
        #: layered persist: whether a listing is one a previous walk checked (see _walk.KnownListing)
        self.known_listing: KnownListing | None = None
        self.end_dirs: Callable[[], None] | None = None
        #: when a list, every subdirectory admit_dir admits is appended to it
        self.admitted: list[_ListedEntry] | None = None
        #: the layer of the index entries this walk records (its generation; 0: set when the index is made)
        self.layer = 0

    def take_chunk(self, entries: list[IndexEntry], digest: bytes | None, fixups: list[tuple[str, int]],
                   content: int) -> None:
        """Record a directory's entries as a previous walk recorded them (see :mod:`._layers`).

        The caller checked that they fit ``max_entries`` and ``max_total_bytes``.
        ``digest``: their tree-digest records (None: the caller accounts for them in the digest).
        """
        self.entries += len(entries)
        self.content += content
        if digest is not None:
            self.digest.add_records(digest)
        if self.records is not None:
            self.records.extend(entries)
        if self.fixups is not None:
            self.fixups.extend(fixups)

    def take_over(self, item: _ListedEntry, old: IndexEntry) -> None:
        """Record an unchanged file or directory as its parent-index entry: not read, not written.

        Raises:
            SnapshotLimitError: a limit is exceeded.
        """
        self.count(item)
        if old.kind == "file":
            self._add_content(item.path, old.size)
            fix = old.mode != extracted_file_mode(mode=old.mode)
        else:
            fix = old.mode != extracted_dir_mode(mode=old.mode)
        if self.fixups is not None and fix:
            self.fixups.append((item.path, old.mode))
        self.digest.add(item.path, old.kind, old.size if old.kind == "file" else 0, old.mode, old.content)
        if self.records is not None:
            self.records.append(old)

    def _add_content(self, path: str, size: int) -> None:
        """Count ``size`` bytes of file content.

        Raises:
            SnapshotLimitError: the file exceeds ``max_file_bytes``, or the total ``max_total_bytes``.
        """
        if size > self.limits.max_file_bytes:
            raise SnapshotLimitError("file is larger than max_file_bytes", sandbox_path=path,
                                     context={"max_file_bytes": self.limits.max_file_bytes})
        self.content += size
        if self.content > self.limits.max_total_bytes:
            raise SnapshotLimitError("workspace holds more than max_total_bytes", sandbox_path=path,
                                     context={"max_total_bytes": self.limits.max_total_bytes})

    def _record(self, path: str, kind: str, st: StatLike, mode: int, content: str) -> None:
        """Add an index entry whose member this generation's archive holds (layer :attr:`layer`)."""
        if self.records is not None:
            self.records.append(IndexEntry(path, kind, st.st_ino, st.st_size if kind == "file" else 0,
                                           st.st_mtime_ns, st.st_ctime_ns, mode, content, st.st_nlink, self.layer))

    def restorable(self, item: _ListedEntry,
                   dfd: int | None = None) -> tuple[bool, str | None, StatLike | None]:
        """``(True, symlink target or None, lstat)`` when the item may be persisted; refuses or records it otherwise.

        The rules are the archive extractor's own (:func:`~sandbox_fs.archive.normalize_member_name`
        and :func:`~sandbox_fs.archive.symlink_target_walk`), applied here so a saved snapshot always hydrates:
        names (zip slip, CVE-2007-4559; backslash ``..``, CVE-2021-37713; drive
        letters; over PATH_MAX), symlink targets (absolute, escaping, or passing
        through another symlink: CVE-2025-4517), and special files.  The name is
        checked first, so a path the Root could not even address is refused or
        skipped like any other unrestorable entry.

        What the snapshot records of a symlink (its target, its mtime) or a
        directory (mode, mtime), and what a refusal of a special file names,
        comes from the entry opened by its path beneath the workspace Root now
        (the source view, :func:`_readlink_listed`, :func:`_lstat_listed`) and checked to
        be the listed inode, never from the held listing directory ``dfd``
        alone (used only to tell a vanished entry from a moved one).  The
        returned ``lstat`` is that checked one (for a regular file, the
        listing's: the file is checked when it is opened).  An entry that
        vanished is ``(False, None, None)``, like a deleted file.

        Raises:
            UnrestorableEntryError: with ``on_unrestorable="refuse"``.
            SnapshotSourceChangedError: the entry changed type, or moved or
                vanished from under a parent while it was examined (retryable).
        """
        reason = None
        target = None
        st: StatLike | None = item.st
        raw = item.path.encode("utf-8", "surrogateescape")
        alimits = self.policy.archive
        try:
            normalize_member_name(name=raw, limits=alimits)
            if item.kind == "symlink":
                with _source_changed(item.path):
                    got = _readlink_listed(self.src, item, dfd)
                    if got is None:
                        return False, None, None  # removed since the listing, like a vanished file
                    target, st = got
                    reason = _symlink_reason(self.ws, raw, target, alimits)
            elif item.kind != "file":
                st = _lstat_listed(self.src, item, dfd)
                if st is None:
                    return False, None, None
                if item.kind != "dir":
                    reason = f"{item.kind} entries are not restorable"
        except UnsafeArchiveMemberError as exc:
            reason = {"symlink_target": "symlink is absolute or resolves outside the workspace"}.get(
                exc.rule, f"name is refused by hydrate ({exc.rule})")
        except ArchiveLimitError as exc:
            reason = f"path exceeds {exc.limit}"
        if reason is None:
            return True, target, st
        if self.on_unrestorable == "skip":
            self.skipped.append((item.path, reason))
            return False, None, None
        raise UnrestorableEntryError(f"{reason}; hydrate would refuse it, so persist refuses it too",
                                     sandbox_path=item.path, context={"kind": item.kind})

    def admit_dir(self, item: _ListedEntry, dfd: int) -> bool:
        """Record a listed subdirectory if the policy keeps it; True: the walk enters it.

        Raises:
            UnrestorableEntryError, SnapshotSourceChangedError: see :meth:`restorable`.
            SnapshotLimitError: more than ``max_entries``.
        """
        if self.taken_over is not None:
            old = self.taken_over(item)
            if old is not None:
                self.take_over(item, old)
                return self._admitted(item)
        ok, _target, st = self.restorable(item, dfd)
        if not ok:
            return False
        assert st is not None  # checked by its path beneath the Root: mode and mtime are the workspace's
        if self.reuse is not None:
            old = self.reuse(item, st)
            if old is not None:  # unchanged since the parent: its member stays in the layer that has it
                self.take_over(item, old)
                return self._admitted(item)
        mode = SnapshotPolicy.mode(st.st_mode)
        admitted, hdr = self.header(item.path, tarfile.DIRTYPE, mode, st.st_mtime)
        if not admitted:
            return False
        self.count(item)
        self.digest.add(item.path, "dir", 0, mode, "")
        self._record(item.path, "dir", st, mode, "")
        if self.fixups is not None and mode != extracted_dir_mode(mode=mode):
            self.fixups.append((item.path, mode))
        if hdr is not None:
            self.tar.add(hdr)
        return self._admitted(item)

    def _admitted(self, item: _ListedEntry) -> bool:
        if self.admitted is not None:
            self.admitted.append(item)
        return True

    def add_nondir(self, item: _ListedEntry, dfd: int) -> bool:
        """Record a listed non-directory (a multi-linked file is deferred); True when it was counted.

        Raises:
            UnrestorableEntryError, SnapshotSourceChangedError: see :meth:`restorable` and :meth:`add_file`.
            SnapshotLimitError: a limit is exceeded.
            OSError: reading the file or writing the sink failed.
        """
        if self.taken_over is not None and item.kind == "file":
            old = self.taken_over(item)
            if old is not None:
                self.take_over(item, old)
                return True
        ok, target, checked = self.restorable(item, dfd)
        if not ok:
            return False
        if item.kind == "symlink":
            assert target is not None and checked is not None
            return self._add_symlink(item, target, checked)
        if self.reuse is not None and item.st.st_nlink == 1:
            old = self.reuse(item, None)
            if old is not None:
                self.take_over(item, old)
                return True
        self.count(item)
        if item.st.st_nlink > 1:
            self._defer_linked(item)
            return True
        if self.same_file is None:  # no content to compare first: open, fstat-check and probe in one call
            got = self._opener.open(self.src, item, dfd, self.records is not None)
            if got is None:
                self.entries -= 1
                return False
            fd = got[0]
            try:
                if self.add_file(item, fd, [], got[1:]) is None:
                    self.entries -= 1  # its header is refused by the policy and skipped
            finally:
                os.close(fd)
            return True
        fd = _open_member(self.src, item, dfd)
        if fd is None:
            self.entries -= 1
            return False
        try:
            if self._same_content(item, fd):
                return True
            if self.add_file(item, fd, []) is None:
                self.entries -= 1  # its header is refused by the policy and skipped
        finally:
            os.close(fd)
        return True

    def _same_content(self, item: _ListedEntry, fd: int) -> bool:
        """Record a file whose only change is its ctime as its parent entry with the new ctime, when its content is the same.

        A re-own (a session resumed under another id) changes every ctime and
        nothing else.  Such a file (inode, size, mtime, mode as recorded; one
        link; not open for writing: the read-lease probe of :meth:`add_file`)
        is read and hashed here, not written: when its SHA-256 is the parent's
        and its ``fstat`` did not change during the read, the index records it
        with the new ctime and the parent's layer, whose member restores
        exactly it (same content, mode and mtime).  Otherwise the fd is rewound
        and :meth:`add_file` reads and writes it as any changed file.  The
        recorded stat is the one taken before the read, as in :meth:`add_file`,
        so the racy rule of the next persist holds alike.

        Returns:
            True when it was recorded.

        Raises:
            SnapshotSourceChangedError: the fd is no longer the listed file.
            SnapshotLimitError: a limit is exceeded (see :meth:`take_over`).
            OSError: reading the file failed.
        """
        old = self.same_file(item) if self.same_file is not None and self.records is not None else None
        if old is None:
            return False
        st = _member_stat(fd, item)
        if (st.st_nlink, st.st_size, st.st_mtime_ns, SnapshotPolicy.mode(st.st_mode)) != \
                (1, old.size, old.mtime_ns, old.mode) or st.st_size > self.limits.max_file_bytes \
                or _open_for_writing(fd):
            return False
        try:
            same = _content_sha(fd, st.st_size) == old.content
        finally:
            os.lseek(fd, 0, os.SEEK_SET)
        after = os.fstat(fd)
        if not same or (after.st_size, after.st_mtime_ns, after.st_ctime_ns) != \
                (st.st_size, st.st_mtime_ns, st.st_ctime_ns):
            return False
        self.entries -= 1  # counted by the caller; take_over counts it again
        self.take_over(item, old._replace(ino=st.st_ino, ctime_ns=st.st_ctime_ns))
        return True

    def _add_symlink(self, item: _ListedEntry, target: str, st: StatLike) -> bool:
        """Record a symlink (``st``: its ``lstat`` opened by its path and identity-checked); False if skipped."""
        admitted, hdr = self.header(item.path, tarfile.SYMTYPE, 0o777, st.st_mtime, link=target)
        if not admitted:
            return False
        self.count(item)
        self.digest.add(item.path, "symlink", 0, 0o777, target)
        self._record(item.path, "symlink", st, 0o777, target)
        if hdr is not None:
            self.tar.add(hdr)
        return True

    def _defer_linked(self, item: _ListedEntry) -> None:
        """Remember one name of a multi-linked file until the walk has seen all the names it will see."""
        st = item.st
        key = (st.st_dev, st.st_ino)
        linked = self.multi_linked.get(key)
        if linked is None:
            self.multi_linked[key] = _Linked(st.st_nlink, [item])
        else:
            linked.items.append(item)
            if st.st_nlink != linked.nlink:
                linked.changed = True

    def _dir_stats(self, parents: list[str]) -> list[tuple[int, int, int]]:
        """``(st_dev, st_ino, st_ctime_ns)`` of each directory, looked up beneath the workspace Root now.

        Raises:
            SnapshotSourceChangedError: one is gone or no longer a directory (retryable).
        """
        out = []
        for parent in parents:
            try:
                st = self.src.lstat(parent)
            except (OSError, SandboxError):
                st = None
            if st is None or not _stat.S_ISDIR(st.st_mode):
                raise SnapshotSourceChangedError("a directory holding a hard-linked file changed while the "
                                                 "workspace was persisted", sandbox_path=parent)
            out.append((st.st_dev, st.st_ino, st.st_ctime_ns))
        return out

    def _check_names(self, linked: _Linked) -> None:
        """Every name counted for ``linked`` is a link of it at one moment: no moved name was counted twice.

        See the module docstring.  Waits for the next clock tick (a few ms;
        up to 2 s on a file system keeping whole-second ctimes, see
        :func:`._index.stamp_latest_ns`) while a directory changed in the
        current one, for at most :data:`_LINK_CHECK_WAIT_S` in all.

        Raises:
            SnapshotSourceChangedError: a name is gone or is another inode, or
                a directory holding one changed meanwhile (retryable).
        """
        parents = sorted({item.path.rpartition("/")[0] or "." for item in linked.items})
        deadline = time.monotonic() + _LINK_CHECK_WAIT_S
        while time.monotonic() < deadline:
            began = coarse_now_ns()
            before = self._dir_stats(parents)
            if len({(dev, ino) for dev, ino, _c in before}) != len(before):  # one directory at two paths:
                raise SnapshotSourceChangedError("a directory holding a hard-linked file was moved while the "
                                                 "workspace was persisted", sandbox_path=linked.items[0].path)
            # A ctime the file system truncated (whole seconds) may stand for a change after ``began``.
            latest = max(stamp_latest_ns(ctime_ns) for _dev, _ino, ctime_ns in before)
            if latest >= began:
                # changed in this tick (or step): a change later in it would keep the same ctime
                time.sleep(max(_TICK_S, (latest - began) / 1e9 + _TICK_S))
                continue
            for item in linked.items:
                if _lstat_listed(self.src, item) is None:
                    raise SnapshotSourceChangedError("hard links of this file changed while the workspace was "
                                                     "persisted", sandbox_path=item.path)
            if self._dir_stats(parents) != before:
                raise SnapshotSourceChangedError("a directory holding a hard-linked file changed while the "
                                                 "workspace was persisted (its links cannot be counted)",
                                                 sandbox_path=linked.items[0].path)
            return
        raise SnapshotSourceChangedError("a directory holding a hard-linked file kept changing while the "
                                         "workspace was persisted", sandbox_path=linked.items[0].path)

    def header(self, path: str, kind: bytes, mode: int, mtime: float, size: int = 0,
               link: str = "") -> tuple[bool, bytes | None]:
        """``(admitted, header bytes)`` of one member (:func:`._header.encode_header`), checked by the policy.

        The member records no owners (uid/gid 0, no names) and its mtime in
        whole seconds (``int(mtime)``, toward zero).  An mtime the extractor
        would not apply (:func:`sandbox_fs.archive.mtime_is_applied`) makes
        the entry unrestorable: hydrate would give it the time of the
        restore, not the one recorded.

        The policy's :meth:`SnapshotPolicy.header_check` judges the exact
        bytes that will be written (and, for :func:`tree_digest`, the bytes
        persist would write, so both make the same decisions).  A member
        whose header fits ustar has no extension header and nothing to check;
        without a sink it is not even built (``(True, None)``).  A
        refused one is skipped and reported (``(False, None)``) with
        ``on_unrestorable="skip"``.

        Raises:
            UnrestorableEntryError: the header is refused and ``on_unrestorable="refuse"``.
        """
        name = path + "/" if kind == tarfile.DIRTYPE else path
        secs = int(mtime)  # whole seconds: a fraction would need a PAX record on every member
        if not mtime_is_applied(mtime=secs):
            return self._unrestorable(path, kind, "its mtime is outside the range hydrate restores "
                                      "(+-2**62 ns of the epoch, about 1824 to 2116)")
        if ustar_fits(name, link, size, secs):
            return True, encode_listed(name, kind, mode, secs, size, link) if self.write else None
        hdr = encode_header(MemberHeader(name, kind, mode, secs, size, link))  # with a PAX header, judged:
        why, cost = self.headers.check(header=hdr, member=path)
        if why is not None:
            return self._unrestorable(path, kind, why)
        self.headers.admit(cost=cost)
        return True, hdr

    def _unrestorable(self, path: str, kind: bytes, why: str) -> tuple[bool, None]:
        """A member hydrate would not restore as recorded: skipped and reported, or refused (see :meth:`header`)."""
        if self.on_unrestorable == "skip":
            self.skipped.append((path, why))
            return False, None
        raise UnrestorableEntryError(f"{why}; hydrate would refuse it, so persist refuses it too",
                                     sandbox_path=path, context={"kind": _KIND_NAMES.get(kind, "file")})

    def count(self, item: _ListedEntry) -> None:
        self.entries += 1
        if self.entries > self.limits.max_entries:
            raise SnapshotLimitError("workspace has more entries than max_entries", sandbox_path=item.path,
                                     context={"max_entries": self.limits.max_entries})

    def add_file(self, item: _ListedEntry, fd: int, links: list[_ListedEntry],
                 checked: tuple[_Stat, bool] | None = None) -> StatLike | None:
        """Archive the file open on ``fd`` as ``item``, then ``links`` as hard links to it.

        Each name in ``links`` is looked up by its path beneath the workspace
        Root and checked to be this very inode before it is recorded.

        ``checked``: the fd's ``fstat``, already checked to be the listed
        regular file, and whether the file may be open for writing (the
        read-lease probe, made with an index to record), as
        :meth:`~._walk.MemberOpener.open` took them when it opened ``fd``
        (None: taken here, :func:`_member_stat` and :func:`_open_for_writing`).

        Returns:
            Its ``fstat``, or None when the policy refused its header and it
            was skipped (``links`` then too; the caller uncounts them).

        Raises:
            UnrestorableEntryError: the policy refuses its header (or a link's)
                and ``on_unrestorable="refuse"``.
            SnapshotSourceChangedError: the file or one of its links changed (retryable).
            SnapshotLimitError: a size limit is exceeded.
            OSError: reading the file or writing the sink failed.
        """
        st: StatLike
        if checked is None:
            st = _member_stat(fd, item)
            # Only an index entry can make a later persist skip the file (no index recorded: nothing to probe).
            writable = self.records is not None and _open_for_writing(fd)
        else:
            st, writable = checked
        rec: StatLike = st
        if self.records is not None and writable:  # content can change without a ctime: read again
            rec = _Stat(st.st_mode, st.st_ino, st.st_dev, st.st_nlink, st.st_size, st.st_mtime_ns, _REREAD_CTIME_NS)
        for other in links:
            if _lstat_listed(self.src, other) is None:
                raise SnapshotSourceChangedError("hard links of this file changed while the workspace was "
                                                 "persisted", sandbox_path=other.path)
        mode = SnapshotPolicy.mode(st.st_mode)
        admitted, hdr = self.header(item.path, tarfile.REGTYPE, mode, st.st_mtime, size=st.st_size)
        if not admitted:
            self.skipped.extend((other.path, "a hard link of a skipped file") for other in links)
            return None
        self._add_content(item.path, st.st_size)
        if self.fixups is not None and mode != extracted_file_mode(mode=mode):
            self.fixups.append((item.path, mode))
        # Without an index to record, a large file's SHA-256 may be left to the writer thread (only the
        # tree digest needs it, and that waits for it in walk order); an index entry needs it now.
        content = self.tar.add_file(st.st_size, fd, item.path, hdr, defer=self.records is None)
        self.digest.add(item.path, "file", st.st_size, mode, content)
        if type(content) is str:
            self._record(item.path, "file", rec, mode, content)
        for other in links:
            admitted, lhdr = self.header(other.path, tarfile.LNKTYPE, mode, st.st_mtime, link=item.path)
            if not admitted:
                self.entries -= 1
                continue
            self.digest.add(other.path, "file", st.st_size, mode, content)
            if type(content) is str:
                self._record(other.path, "file", rec, mode, content)
            if lhdr is not None:
                self.tar.add(lhdr)
        return st

    def add_linked(self, linked: _Linked) -> None:
        """Archive one multi-linked inode if all its links are inside the walk, else refuse or skip it.

        Raises:
            UnrestorableEntryError: a link is outside the walk and ``on_unrestorable="refuse"``.
            SnapshotSourceChangedError: its links changed during the walk (retryable).
        """
        items = linked.items
        if linked.changed or len(items) > linked.nlink or len({it.path for it in items}) != len(items):
            # (one path counted twice: a listing gave the same name twice, which POSIX allows for a
            # name renamed while the directory is read; the count would take it for a second link)
            raise SnapshotSourceChangedError("hard links of this file changed while the workspace was persisted",
                                             sandbox_path=items[0].path)
        if len(items) < linked.nlink:
            reason = (f"file has {linked.nlink} hard links but only {len(items)} in the persisted workspace "
                      "(linked to a file outside it or to an excluded path); its content is never read")
            if self.on_unrestorable == "skip":
                self.skipped.extend((it.path, reason) for it in items)
                self.entries -= len(items)
                return
            raise UnrestorableEntryError(reason, sandbox_path=items[0].path, context={"kind": "file"})
        self._check_names(linked)  # the count above counted links, not a moved name twice
        first = items[0]
        fd = _open_member(self.src, first)
        if fd is None:
            raise SnapshotSourceChangedError("hard links of this file changed while the workspace was persisted",
                                             sandbox_path=first.path)
        try:
            st = os.fstat(fd)
            if st.st_nlink != linked.nlink:
                raise SnapshotSourceChangedError("hard links of this file changed while the workspace was "
                                                 "persisted", sandbox_path=first.path)
            if self.add_file(first, fd, items[1:]) is None:
                self.entries -= len(items)  # refused by the policy and skipped, with all its names
        finally:
            os.close(fd)


def tree_digest(ws: Root, *, excluded: Iterable[str] = (), mount_points: Iterable[str] = (),
                skip_identities: Iterable[tuple[int, int]] = (),
                on_unrestorable: Literal["refuse", "skip"] = "skip",
                limits: SnapshotLimits | None = None) -> str:
    """SHA-256 tree digest of the workspace, exactly as :func:`persist` would compute it.

    Blocking: call from a worker thread.

    Args:
        ws: the workspace Root.
        excluded: sandbox paths (relative) left out, with everything under them.
        mount_points: sandbox paths of mount points (also detected by ``st_dev``).
        skip_identities: ``(st_dev, st_ino)`` of directories never entered
            (extra path grants nested in the workspace).
        on_unrestorable: ``"skip"`` leaves unrestorable entries out of the
            digest (the default here: a digest is a comparison, not a save).
        limits: bound on entries and bytes hashed.

    Raises:
        UnrestorableEntryError: ``on_unrestorable="refuse"`` and such an entry exists.
        SnapshotLimitError: the tree exceeds ``limits``.
        SnapshotSourceChangedError: the tree changed under the walk (an
            entry replaced, a directory moved out while held; retryable).
    """
    walked = _walk_into(ws, _Prune.of(excluded, mount_points, skip_identities),
                        SnapshotPolicy(limits or SnapshotLimits()), on_unrestorable, _TarStream(None))
    return walked.digest.hexdigest()


#: the ctime an index records for a file read while open for writing (see :func:`_open_for_writing`):
#: later than any walk's time, so the entry is never unchanged and is racy to a whole-directory take-over
_REREAD_CTIME_NS = (1 << 63) - 1
#: how long to wait for the next tick of the coarse clock (1 ms at HZ=1000 to 10 ms at HZ=100), and how often
_TICK_S = 0.004
#: the longest the link check waits for its directories' ctimes to be in the past (a 2 s timestamp step, and more)
_LINK_CHECK_WAIT_S = 5.0


def _open_for_writing(fd: int) -> bool:
    """True unless the regular file open read-only on ``fd`` is provably open for writing nowhere.

    A write through a shared writable ``mmap`` whose page is already dirty
    changes the content without changing the file's mtime or ctime (the
    kernel updates them only when a clean page is first written; on tmpfs a
    page never becomes clean again).  Such a mapping keeps the file open for
    writing, so a file read while no one has it open for writing changes its
    ctime on every later change of content: only then may its index entry
    make the next persist skip it.  Probed with a read lease
    (``F_SETLEASE F_RDLCK``, released at once), which the kernel refuses
    with EAGAIN while any open file description (a mapping's included) can
    write the inode.  A lease that cannot be taken for another reason (not
    the file's owner without CAP_LEASE, a filesystem without leases) is
    taken as "open for writing": the file is read again next time.

    Taking a lease makes this process the fd's owner, and a process that
    opens the file for writing while the lease is held breaks it, which
    signals the owner: SIGIO by default, whose default action terminates
    the process.  So the fd's signal is first set to SIGURG (``F_SETSIG``),
    whose default action is to ignore it.

    The three calls never block, and are made holding the GIL
    (:data:`_FCNTL`): releasing it three times per file handed it to the
    archive writer thread each time (a full persist of 3,000 files of 200
    bytes took 1.35x as long as without the probe, against 1.15x now;
    medians of 15, side by side, on a loaded machine).  A walk without a
    parent's content to compare first makes the same three calls, in the
    same order, inside the native call that opens and ``fstat``-s the file
    (``sfs_open_member``, see :class:`~._walk.MemberOpener`): 1.7 us a file
    less than the open, ``os.fstat`` and these three calls from Python.
    """
    if _FCNTL is None:  # pragma: no cover  (a libc without fcntl through ctypes)
        try:
            fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        except OSError:
            return True
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return False
    if _FCNTL(fd, fcntl.F_SETSIG, signal.SIGURG) < 0:  # a lease break never kills this process
        return True
    if _FCNTL(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK) < 0:
        return True
    _FCNTL(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    return False


def _gil_fcntl() -> Callable[[int, int, int], int] | None:
    """libc's ``fcntl(fd, cmd, int)`` called without releasing the GIL (``ctypes.PyDLL``), or None.

    Only for commands that never block (:func:`_open_for_writing`'s).  The
    int argument is passed in a register like a fixed one on the Linux ABIs.
    No ``argtypes``: ctypes passes a Python int as a C ``int`` by default, and
    converting through declared types cost ~0.35 us a call (a third of the
    probe's time; 3.8 -> 2.8 us a file).
    """
    try:
        # host-access: none; libc's fcntl on fds the walk opened beneath the workspace Root
        f = ctypes.PyDLL(None, use_errno=True).fcntl
    except (OSError, AttributeError):  # pragma: no cover
        return None
    f.restype = ctypes.c_int
    return cast(Callable[[int, int, int], int], f)


#: libc's fcntl, called holding the GIL (see :func:`_gil_fcntl`)
_FCNTL = _gil_fcntl()


_HASH_BUF_BYTES = 1 << 20


def _content_sha(fd: int, size: int) -> str | None:
    """The hex SHA-256 of exactly ``size`` bytes read from ``fd`` (at its offset), or None when it has more or fewer."""
    sha = hashlib.sha256()
    buf = bytearray(min(size + 1, _HASH_BUF_BYTES))
    view = memoryview(buf)
    left = size
    while True:
        got = os.readv(fd, [view[:min(left + 1, len(buf))]])
        if got > left:
            return None  # grew
        if not got:
            return None if left else sha.hexdigest()
        sha.update(view[:got])
        left -= got


def _member_stat(fd: int, item: _ListedEntry) -> os.stat_result:
    """``fstat`` of a member just opened: still a regular file, and the very inode the walk listed.

    Raises:
        SnapshotSourceChangedError: it is no longer a regular file, or it is
            another file than the one the directory listing's ``lstat``
            saw (replaced between the listing and the open; retryable).
    """
    st = os.fstat(fd)
    if not _stat.S_ISREG(st.st_mode) or st.st_ino != item.st.st_ino or st.st_dev != item.st.st_dev:
        raise SnapshotSourceChangedError("entry was replaced while it was being persisted",
                                         sandbox_path=item.path)
    return st


_KIND_NAMES = {tarfile.DIRTYPE: "dir", tarfile.SYMTYPE: "symlink", tarfile.LNKTYPE: "file", tarfile.REGTYPE: "file"}
