"""The extraction rules: every node is created through a ``Root`` with
``no_symlinks=True`` (``RESOLVE_NO_SYMLINKS`` on every path), beneath a
private staging directory.

Why this is immune by construction rather than by a list of checks: the
kernel refuses any symlink on the path of every open, mkdir, rename and link
we make, so a link planted earlier (by this archive, a previous one, or a
racing process) can never redirect a later write.  Symlink members are
*created last*, after every file, directory and hard link, and a member whose
path passes through a pending symlink is refused (rule ``through_symlink``).

Layout (atomic mode, the default):

* destination missing: stage in ``<parent>/.sfs-extract-<random>``, then one
  ``rename(RENAME_NOREPLACE)`` makes it the destination;
* destination exists (including the root itself, e.g. snapshot hydrate):
  stage in ``<dest>/.sfs-extract-<random>``; once complete, every staged
  top-level entry is moved in.  Pre-existing files of the destination are
  kept unless the archive has a member with the same name: a new file (or
  symlink) then *replaces* a pre-existing file or symlink (one
  ``RENAME_EXCHANGE`` each, atomic per name: the old entry goes into the
  staging tree, which is removed at the end); a new directory is merged into
  a pre-existing directory (whose own mode and mtime are kept).  A new
  directory over a pre-existing non-directory, or a new non-directory over a
  pre-existing directory, is a ``conflict`` found before anything is moved:
  nothing new remains.  A move that fails undoes the earlier ones (see
  :meth:`Extractor._merge`), so a failed merge leaves the destination as it was.

The staging directory (and a new in-place destination) is reached by its
*name* only, never through an fd kept across members: it is a
:class:`~sandbox_fs.root.Subtree` of the directory it was made in (the
destination, or the destination's parent), whose fd and name
:meth:`Extractor.finish` later renames.  A kept staging fd and the staging name
could come apart: a process able to rename inside the destination could move
the staging directory away and put its own under that name, so the members
would land in the moved directory and finish would move the other one into
place.  Now:

* the hot paths (new files and directories in the fresh staging tree, the
  batches) resolve ``<staging>/<member path>`` beneath that fd at each call,
  so nothing follows a moved directory; they skip Root's write guard, so they
  are used only when the Root has no read-only grant nested in it;
* every other call (replacing a file, hard links, symlinks, the directory
  metadata pass) opens the staging directory by name, checks its
  ``(st_dev, st_ino)`` against the one recorded when it was made, and acts
  beneath that fd for that call only (``DirectoryReplacedError`` otherwise);
* :meth:`Extractor.finish` checks the identity again just before the rename
  (``conflict`` otherwise), and :meth:`Extractor.abort` removes only a
  staging directory that passes the check (through the checked fd, never
  into a mount point): whatever another process put at the name is left.

Limits of a name: a directory swapped in between ``mkdir`` and the first
``lstat`` of the staging directory, or between finish's check and its
rename, is taken for ours; either way it is a directory inside the
destination, so a racer changes only what the destination ends up holding.
A member path is at most :data:`STAGED_PATH_MAX` bytes (PATH_MAX less the
staging name), and ``max_path_bytes`` is lowered to that for atomic
extractions.

Batched new files (atomic mode, an uncompressed tar in a regular file): see
``_batching``.  Pending symlinks: ``_symlinks``.  Directory metadata: ``_dirmeta``.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat as _stat
from typing import IO, Callable, Iterator, NamedTuple

from .. import _native
from ..errors import PathEscapeError, SandboxError, SymlinkRefusedError
from ..root import MAX_PATH_BYTES, Root, Subtree
from ._errors import ArchiveFormatError, ArchiveLimitError, UnsafeArchiveMemberError, show_name
from ._batch import CopyThread, FileBatch
from ._batching import BatchedFiles
from ._dirmeta import DirMetadata
from ._models import ArchiveLimits, ExtractPolicy, SkippedMember
from ._meta import (DIR, FILE, LINK, check_owner, dir_mode, file_mode, identity, mtime_ns_of, path_key,
                    process_umask)
from ._names import normalize_member
from ._streams import CHUNK_BYTES, Meter
from ._staging import STAGING_PREFIX, make_staging, sweep_stale
from ._symlinks import PendingSymlinks

__all__ = ["Extractor", "file_mode", "dir_mode", "STAGING_PREFIX", "STAGED_PATH_MAX"]

#: the longest member path (bytes) an atomic extraction can stage: every staged path is
#: resolved as ``<staging name>/<member path>`` (a 30-byte prefix) within PATH_MAX
STAGED_PATH_MAX = MAX_PATH_BYTES - len(STAGING_PREFIX) - 16 - 1
#: skipped members listed in the report (the count is always exact)
MAX_SKIPPED_LISTED = 1000
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
_STAGE_FLAGS = _CREATE_FLAGS | os.O_CLOEXEC
_PDIR_FLAGS = _native.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NO_SYMLINKS = _native.RESOLVE_NO_SYMLINKS


class _Move(NamedTuple):
    """One move of :meth:`Extractor._merge`: staged ``src`` to ``dst`` (paths beneath the destination)."""

    src: str
    dst: str
    ident: tuple[int, int]
    """``(st_dev, st_ino)`` of the staged entry."""
    replace: bool
    """True: exchanged with a pre-existing file or symlink at ``dst``; False: a new name."""


def _eof(_n: int) -> bytes:
    return b""


class _FileMember:
    """A regular-file member on the one-by-one path, as :meth:`Extractor.add_file` checked it.

    Attributes:
        name: the member name (for errors); path: its normalized path.
        read: ``read(n) -> bytes`` of its data (``b""`` at the end).
        splice: ``splice(dst_fd, n) -> copied`` kernel-side copy of the next
            data bytes, or None.
        declared_size: the header's size (bytes, checked non-negative), or None.
        mode: the permission bits to give it; mtime_ns: its mtime (ns) or None.
        owner: ``(uid, gid)`` to give it through its fd, or None.
    """

    __slots__ = ("name", "path", "read", "splice", "declared_size", "mode", "mtime_ns", "owner")

    def __init__(self, name: str | bytes, path: bytes, read: Callable[[int], bytes],
                 splice: Callable[[int, int], int] | None, declared_size: int | None, mode: int,
                 mtime_ns: int | None, owner: tuple[int, int] | None) -> None:
        self.name = name
        self.path = path
        self.read = read
        self.splice = splice
        self.declared_size = declared_size
        self.mode = mode
        self.mtime_ns = mtime_ns
        self.owner = owner


class Extractor(BatchedFiles, PendingSymlinks, DirMetadata):
    """Applies members to a destination beneath ``root``.  One per extraction; not thread-safe.

    Args:
        root: the capability holding the destination.
        dest: sandbox path of the destination relative to ``root``
            (``""``/``"."``: the root itself).
        limits, policy: see :class:`ArchiveLimits`, :class:`ExtractPolicy`.
        meter: the byte totals of this extraction.
        exact_modes: normalized member path -> permission bits (within
            0o777) applied exactly instead of :func:`file_mode`/:func:`dir_mode`
            (snapshot hydrate: the modes persist recorded), through the fd the
            entry was made or opened with, never by name.
    """

    def __init__(self, root: Root, dest: str, limits: ArchiveLimits, policy: ExtractPolicy, meter: Meter,
                 exact_modes: dict[bytes, int] | None = None) -> None:
        self.limits = limits
        self.policy = policy
        self.meter = meter
        self.members = 0
        self.files = self.dirs = self.symlinks = self.hardlinks = 0
        self.skipped: list[SkippedMember] = []
        self.skipped_count = 0
        # Per-member state is keyed by a digest of the normalized path, and pending
        # symlinks are spooled to an anonymous host temp file, so memory stays
        # O(members x ~150 bytes) whatever the name and target lengths.
        self._kinds: dict[bytes, str] = {}
        self._pending_live: dict[bytes, int] = {}  # key -> sequence number of the live record
        self._pending_seq = 0
        self._spool: IO[bytes] | None = None
        self._dir_meta: dict[bytes, tuple[int, int | None, tuple[int, int] | None]] = {}
        self._dir_ids: dict[bytes, tuple[int, int]] = {}  # key -> (st_dev, st_ino) of each directory made
        #: called between chunks of a large member; set by extract_async (trio.from_thread.check_cancelled)
        self.check_cancel: Callable[[], None] | None = None
        self._umask = process_umask()
        # A Root with an owner (a workspace whose content belongs to the confined identity)
        # gives every entry made its owner; the archive's owners are then never applied.
        self._fs_owner = root.owner
        self._owner = policy.preserve_owner and os.geteuid() == 0 and root.owner is None
        self._parent_root: Root | None = None  # holds a sibling staging dir
        self._dest_root: Root | None = None    # an existing destination
        self._dest_leaf: str | None = None
        self._staging: str | None = None
        self._staging_lock = -1  # the flock'ed fd of the staging directory (see _staging)
        self._opened: list[Root] = []
        self._stage_fd = -1
        self._stage_pre = b""
        self._stage_resolver = "openat2"
        #: (st_dev, st_ino) of the directory made for the destination, once finish() moved it in
        self.made_identity: tuple[int, int] | None = None
        self.work: Root | Subtree
        try:
            self._setup(root, dest)
        except BaseException:
            if self._staging_lock >= 0:
                os.close(self._staging_lock)
                self._staging_lock = -1
            for r in reversed(self._opened):
                r.close()
            raise
        if isinstance(self.work, Subtree):
            # Every path of the work tree is resolved as "<its name>/<path>" beneath the
            # fd it was made in, at the moment of use: the staging directory (or the new
            # in-place destination) is never reached through an fd of its own, so the tree
            # that finish() moves by name is the one every member was written into.
            pmax = MAX_PATH_BYTES - len(self.work.path) - 1
            if self.limits.max_path_bytes > pmax:
                self.limits = limits.model_copy(update={"max_path_bytes": pmax})
        if self._staging is not None and not self.work.root.denies_writes:
            assert isinstance(self.work, Subtree)
            # (Only when no read-only grant is nested in the Root: these paths skip Root's
            # write guard, so with one they are off and every write goes through the guard.)
            # Staging fast path: a new file in our own fresh staging tree is created with ONE
            # openat2(O_CREAT|O_EXCL|O_NOFOLLOW, RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS|
            # RESOLVE_NO_MAGICLINKS) of "<staging>/<path>" beneath the fd the staging
            # directory was made in, instead of Root's open-parent-then-open-leaf (two opens
            # and a close).  Same confinement; Root's write guard (read-only grants) already
            # approved creating the staging directory, and nothing inside it predates this
            # extraction (a racer's entry is refused by O_EXCL).
            self._stage_fd = self.work.root.fileno_dup()
            self._stage_pre = self.work.path + b"/"
            self._stage_resolver = self.work.resolver
        # batched new files (see the module docstring)
        self._batch = FileBatch(self._stage_fd, self._stage_resolver, self._stage_pre, self._fs_owner)
        self._inflight: list[FileBatch] = []  # handed to the helper thread and not yet taken back, oldest first
        self._worker: CopyThread | None = None
        self._threaded = limits.max_cpu_seconds is None
        self._batch_failed = False  # a batch error was raised: later queued files are never made
        #: new files read from a stream may be queued with their bytes (add_new_file_data): snapshot hydrate
        self.batch_in_memory = False
        self._spare: mmap.mmap | None = None  # the buffer of a made memory batch, for the next one
        self._mode_flags_cache: dict[int, tuple[int, int]] = {}
        self._last_parent = b""  # the last member parent found to be a directory of this run (see _parents)
        self._exact = exact_modes or None

    # ----------------------------------------------------------------- setup

    def _setup(self, root: Root, dest: str) -> None:
        d = dest.strip("/") if dest not in ("", ".") else ""
        d = "/".join(c for c in d.split("/") if c not in ("", "."))
        if any(c == ".." for c in d.split("/")):
            raise PathEscapeError("destination may not contain '..'", sandbox_path=dest)
        self.shown_dest = d or "."
        base = root.with_options(no_symlinks=True)
        self._opened.append(base)
        try:
            dest_root = base.open_root(d or ".") if d else base
            if dest_root is not base:
                self._opened.append(dest_root)
        except FileNotFoundError:
            parent, _, leaf = d.rpartition("/")
            prt = base.open_root(parent) if parent else base
            if prt is not base:
                self._opened.append(prt)
            if self.policy.in_place:
                prt.mkdir(leaf, 0o755)
                self.work = Subtree(prt, leaf, identity(prt.lstat(leaf)))
                return
            self._parent_root, self._dest_leaf = prt, leaf
            sweep_stale(prt)
            self._staging, made, self._staging_lock = make_staging(prt)
            self.work = Subtree(prt, self._staging, made)
            return
        self._dest_root = dest_root
        if self.policy.in_place:
            self.work = dest_root
            return
        sweep_stale(dest_root)
        self._staging, made, self._staging_lock = make_staging(dest_root)
        self.work = Subtree(dest_root, self._staging, made)

    @property
    def fresh(self) -> bool:
        """True when the work tree started empty (staging): nothing exists we did not make."""
        return self._staging is not None

    # ---------------------------------------------------------------- helpers

    def _skip_or_refuse(self, setting: str, rule: str, member: str | bytes, reason: str) -> None:
        if setting == "skip":
            self._skip(member, rule, reason)
            return
        raise UnsafeArchiveMemberError(rule, member, reason)

    def _skip(self, member: str | bytes, rule: str, reason: str) -> None:
        self.skipped_count += 1
        if len(self.skipped) < MAX_SKIPPED_LISTED:
            self.skipped.append(SkippedMember(member=show_name(member) or "", rule=rule, reason=reason))

    def count_member(self, member: str | bytes) -> None:
        """Count one member against ``max_members``.

        Raises:
            ArchiveLimitError: more than ``max_members`` members;
                ``max_cpu_seconds`` spent.
        """
        self.members += 1
        meter = self.meter
        meter.member = member
        if meter.cpu_limited:
            meter.check_cpu()
        if self.members > self.limits.max_members:
            raise ArchiveLimitError("max_members", self.limits.max_members, self.members, member)

    def name(self, name: str | bytes) -> bytes:
        """Normalize a member name (see :func:`normalize_member`)."""
        return normalize_member(name, self.limits)

    def _guard(self, member: str | bytes, fn: Callable[[], object]) -> object:
        """Run a Root write; a refused symlink / escape becomes ``through_symlink``."""
        try:
            return fn()
        except (SymlinkRefusedError, PathEscapeError):
            raise UnsafeArchiveMemberError("through_symlink", member,
                                           "a symlink on the path was refused (writes never follow symlinks)") from None

    def _parents(self, path: bytes, member: str | bytes) -> None:
        """Make the missing parents of ``path``; refuse a parent that is a file or a symlink member.

        A path recorded as a directory stays one for the whole extraction
        (no member replaces a directory), so the last parent found to be one
        is remembered and a run of members in one directory costs one compare.
        """
        parent = path.rpartition(b"/")[0]
        if not parent or parent == self._last_parent:
            return
        if self._kinds.get(path_key(parent)) == DIR:
            self._last_parent = parent
            return
        comps = parent.split(b"/")
        for i in range(1, len(comps) + 1):
            pre = b"/".join(comps[:i])
            kpre = path_key(pre)
            kind = self._kinds.get(kpre)
            if kind == DIR:
                continue
            if kind == LINK:
                raise UnsafeArchiveMemberError("through_symlink", member,
                                               "the path passes through a symlink member of this archive")
            if kind == FILE:
                raise UnsafeArchiveMemberError("conflict", member, "a parent of this member is a file")
            try:
                self._dir_ids[kpre] = self._guard(member, lambda: self._make_dir(pre, 0o755))  # type: ignore[assignment]
            except FileExistsError:
                raise UnsafeArchiveMemberError("conflict", member,
                                               "a parent of this member exists and is not a directory") from None
            self._kinds[kpre] = DIR
        self._last_parent = parent

    # ----------------------------------------------------------------- members

    def add_dir(self, name: str | bytes, mode: int | None, mtime: float | int | None,
                owner: tuple[int, int] | None = None) -> None:
        """Create directory member ``name`` (mode and mtime applied at the end).

        A directory member naming the destination itself (``./``, as made by
        ``tar -C dir -cf x .``) is skipped and reported: the destination's own
        mode and mtime are never changed by an archive.

        Raises:
            UnsafeArchiveMemberError: name rules; ``conflict`` when a file or
                a symlink member already holds the name.
            ArchiveFormatError: ``owner`` is to be applied (``preserve_owner``
                as root) and an id is outside 0 .. 2**32 - 2.
        """
        if self._owner and owner is not None:
            check_owner(owner, name)
        path = self.name(name)
        if not path:
            self._skip(name, "names_destination", "a directory member naming the destination itself is ignored")
            return
        key = path_key(path)
        kind = self._kinds.get(key)
        if kind == FILE:
            raise UnsafeArchiveMemberError("conflict", name, "a directory never replaces a file")
        if kind == LINK:
            raise UnsafeArchiveMemberError("conflict", name, "a directory never replaces a symlink")
        if kind is None:
            self._parents(path, name)
            try:
                self._dir_ids[key] = self._make_dir(path, 0o700 if self.fresh else 0o755)
            except (SymlinkRefusedError, PathEscapeError):
                raise UnsafeArchiveMemberError("through_symlink", name, "a symlink on the path was refused "
                                               "(writes never follow symlinks)") from None
            except FileExistsError:
                raise UnsafeArchiveMemberError("conflict", name, "the name exists and is not a directory") from None
            self._kinds[key] = DIR
            self.dirs += 1
        dmode = dir_mode(mode) if self._exact is None else self._exact.get(path, dir_mode(mode)) & 0o777
        self._dir_meta[key] = (dmode, mtime_ns_of(mtime) if self.policy.apply_mtime else None, owner)

    def add_file(self, name: str | bytes, read: Callable[[int], bytes], mode: int | None,
                 mtime: float | int | None, declared_size: int | None = None,
                 owner: tuple[int, int] | None = None,
                 splice: Callable[[int, int], int] | None = None) -> None:
        """Write regular-file member ``name`` from ``read(n)`` chunks.

        ``splice(dst_fd, n) -> copied`` (optional, with ``declared_size``)
        copies the next ``n`` data bytes kernel-side (``sendfile``) when the
        member's bytes sit in a regular source file; the limits are checked
        before each chunk exactly as for ``read``.

        A new name is created ``O_CREAT|O_EXCL`` and written; a name that
        exists (an earlier member, or a pre-existing file in in-place mode)
        is replaced atomically (temporary file, then rename), so the inode of
        an earlier hard link is never written through.

        Raises:
            UnsafeArchiveMemberError: name rules; ``conflict`` when a
                directory holds the name; ``through_symlink``.
            ArchiveLimitError: ``max_member_bytes`` (the declared size is
                refused early when it alone is over), ``max_total_bytes``,
                ``max_expansion_ratio``.
            ArchiveFormatError: ``declared_size`` is negative (the readers
                refuse it first; a header number is never used as a length
                unchecked); ``owner`` is to be applied (``preserve_owner`` as
                root) and an id is outside 0 .. 2**32 - 2.
        """
        if declared_size is not None and declared_size < 0:
            raise ArchiveFormatError("negative member size", member=name)
        if self._owner and owner is not None:
            check_owner(owner, name)
        path = self.name(name)
        if not path:
            raise UnsafeArchiveMemberError("names_destination", name, "a file may not name the destination itself")
        lim = self.limits.max_member_bytes
        if declared_size is not None and declared_size > lim:
            raise ArchiveLimitError("max_member_bytes", lim, declared_size, name,
                                    reason=f"declared size {declared_size} > max_member_bytes {lim}")
        key = path_key(path)
        kind = self._kinds.get(key)
        if kind is not None and (self._batch.n or self._inflight):
            self.flush()  # a queued file may hold this name; a new name depends on no queued file
        if kind == DIR:
            raise UnsafeArchiveMemberError("conflict", name, "a file never replaces a directory")
        if kind == LINK:
            del self._pending_live[key]  # a later file replaces the earlier (pending) symlink
        self._parents(path, name)
        fmode = file_mode(mode)
        if self._exact is not None:
            fmode = self._exact.get(path, fmode) & 0o777
        member = _FileMember(name, path, read, splice, declared_size, fmode,
                             mtime_ns_of(mtime) if self.policy.apply_mtime else None,
                             owner if self._owner and owner is not None else None)
        fd = self._create_new_file(member) if kind is None else -1
        if fd >= 0:
            self._fill_new_file(fd, member)
        else:
            self._replace_file(member)
        self._kinds[key] = FILE
        self.files += 1

    def _create_new_file(self, m: _FileMember) -> int:
        """Create ``m``'s name ``O_CREAT|O_EXCL`` and return its fd; -1 when the name exists.

        Raises:
            UnsafeArchiveMemberError: ``conflict`` (a directory holds the name),
                ``through_symlink``.
        """
        try:
            if self._stage_fd >= 0:
                return self._create_staged(m.path, m.mode)
            return self.work.open_fd(m.path, _CREATE_FLAGS, m.mode)
        except FileExistsError:
            return -1
        except IsADirectoryError:
            raise UnsafeArchiveMemberError("conflict", m.name, "a file never replaces a directory") from None
        except (SymlinkRefusedError, PathEscapeError):
            raise UnsafeArchiveMemberError("through_symlink", m.name,
                                           "a symlink on the path was refused (writes never follow symlinks)") from None

    def _fill_new_file(self, fd: int, m: _FileMember) -> None:
        """Write ``m``'s data to the new file ``fd``, then its mode, mtime and owner through it; closes ``fd``.

        On any error the new file is removed: a member is never left partial.
        """
        try:
            try:
                self._write_data(fd, m)
                if m.mode & ~self._umask != m.mode:
                    os.fchmod(fd, m.mode)
                if m.mtime_ns is not None:
                    os.utime(fd, ns=(m.mtime_ns, m.mtime_ns))
                if m.owner is not None:
                    os.fchown(fd, m.owner[0], m.owner[1])
            finally:
                os.close(fd)
        except BaseException:
            try:
                self.work.remove(m.path)  # never leave a partial member
            except (OSError, SandboxError):
                pass
            raise

    def _write_data(self, fd: int, m: _FileMember) -> None:
        """Copy ``m``'s data to ``fd``: ``splice`` for the declared size, then ``read`` until it ends.

        The byte limits are checked before each chunk is written; a long
        member stays cancellable (``check_cancel`` once a MiB).

        Raises:
            ArchiveLimitError: ``max_member_bytes``, ``max_total_bytes``, ``max_expansion_ratio``.
        """
        lim = self.limits.max_member_bytes
        meter = self.meter
        cancel = self.check_cancel
        write = os.write
        total = 0
        read = m.read
        if m.splice is not None and m.declared_size is not None:
            left = m.declared_size
            while left > 0:
                n = min(left, CHUNK_BYTES)
                if total + n > lim:
                    raise ArchiveLimitError("max_member_bytes", lim, total + n, m.name)
                if cancel is not None and total:
                    cancel()
                got = m.splice(fd, n)
                total += got
                left -= got
                meter.add_written(got)
            read = _eof
        while True:
            data = read(CHUNK_BYTES)
            if not data:
                return
            if cancel is not None and total:
                cancel()
            n = len(data)
            total += n
            if total > lim:
                raise ArchiveLimitError("max_member_bytes", lim, total, m.name)
            meter.add_written(n)
            off = write(fd, data)
            if off < n:
                view = memoryview(data)
                while off < n:
                    off += write(fd, view[off:])

    def _replace_file(self, m: _FileMember) -> None:
        """Write ``m`` over the name that exists, atomically (temporary file, then rename).

        The inode of an earlier hard link is never written through.

        Raises:
            UnsafeArchiveMemberError: ``conflict`` (a directory holds the name), ``through_symlink``.
            ArchiveLimitError: as :meth:`_write_data`.
        """
        lim = self.limits.max_member_bytes
        meter = self.meter
        read = m.read

        def chunks() -> Iterator[bytes]:
            total = 0
            while True:
                data = read(CHUNK_BYTES)
                if not data:
                    return
                total += len(data)
                if total > lim:
                    raise ArchiveLimitError("max_member_bytes", lim, total, m.name)
                meter.add_written(len(data))
                yield data

        try:
            self._guard(m.name, lambda: self.work.atomic_write(m.path, chunks(), mode=m.mode, fsync=False,
                                                               mtime_ns=m.mtime_ns, owner=m.owner))
        except IsADirectoryError:
            raise UnsafeArchiveMemberError("conflict", m.name, "a file never replaces a directory") from None

    def _create_staged(self, path: bytes, fmode: int) -> int:
        """Create the new file ``path`` in the fresh staging tree and return its fd.

        ONE ``openat2(O_CREAT|O_EXCL|O_NOFOLLOW)`` of the whole path beneath
        the staging directory's fd with ``RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS|
        RESOLVE_NO_MAGICLINKS`` (or the fallback walker with the same flags),
        resolved now: never through a directory fd kept from an earlier
        member, which a racing process may have moved out of the staging tree.
        With a Root owner, the new file is given it with ``fchown`` of that fd.

        Raises:
            FileExistsError: the name exists.
            SymlinkRefusedError, PathEscapeError: a symlink on the path.
            OSError: any other failure (with the destination's sandbox path);
                a failed ``fchown`` removes the file.
        """
        fd = _native.open_beneath(self._stage_resolver, self._stage_fd, self._stage_pre + path, _STAGE_FLAGS,
                                  fmode, _NO_SYMLINKS, "extract", self.shown_dest)
        if self._fs_owner is not None:
            try:
                os.fchown(fd, self._fs_owner[0], self._fs_owner[1])
            except OSError as exc:
                os.close(fd)
                try:
                    self.work.remove(path)  # the new name (O_EXCL: ours), never a partial member
                except (OSError, SandboxError):
                    pass
                _native.raise_errno(exc.errno or errno.EIO, "extract", self.shown_dest)
        return fd

    def _make_dir(self, path: bytes, mode: int) -> tuple[int, int]:
        """Make directory ``path`` (an existing directory is fine); return its ``(st_dev, st_ino)`` as made.

        The identity is what the directory metadata pass later checks each
        directory's fd against, so archive metadata only ever lands on a
        directory this extraction made (or found) at that path.
        """
        if self._stage_fd >= 0:
            return self._mkdir_staged(path, mode)
        self.work.mkdir(path, mode, exist_ok=True)
        return identity(self.work.lstat(path))

    def _mkdir_staged(self, path: bytes, mode: int) -> tuple[int, int]:
        """Make directory ``path`` (exactly ``mode``) in the fresh staging tree; an existing directory is fine.

        As :meth:`Root.mkdir` with ``exist_ok=True``: the parent is opened
        ``O_PATH|O_DIRECTORY`` beneath the staging directory's fd with
        ``RESOLVE_NO_SYMLINKS`` for this call only (never a kept fd), then one
        ``mkdirat`` of the last component, which never follows a link (a
        symlink there is an existing non-directory).  The new directory's
        mode (when the umask took bits) and the Root's owner (if any) are set
        through an fd of it (``O_DIRECTORY|O_NOFOLLOW`` beneath the parent's
        fd), checked to be the directory ``mkdirat`` made (its identity taken
        right after it).

        Raises:
            FileExistsError: the name exists and is not a directory.
            SymlinkRefusedError, PathEscapeError: a symlink on the parent's path.
            UnsafeArchiveMemberError: ``conflict``, another process replaced the
                new directory before its mode and owner were set.
            OSError: any other failure (with the destination's sandbox path).
        """
        parent, _, leaf = (self._stage_pre + path).rpartition(b"/")
        pfd = _native.open_beneath(self._stage_resolver, self._stage_fd, parent, _PDIR_FLAGS, 0, _NO_SYMLINKS,
                                   "extract", self.shown_dest)
        dfd = pfd
        try:
            try:
                os.mkdir(leaf, mode, dir_fd=dfd)
            except FileExistsError:
                st = os.stat(leaf, dir_fd=dfd, follow_symlinks=False)
                if _stat.S_ISDIR(st.st_mode):
                    return identity(st)
                raise
            owner = self._fs_owner
            if owner is None and mode & ~self._umask == mode:
                # nothing to set through an fd: the identity of the directory at the name, as made
                st = os.stat(leaf, dir_fd=dfd, follow_symlinks=False)
                if _stat.S_ISDIR(st.st_mode):
                    return identity(st)
            made = identity(os.stat(leaf, dir_fd=dfd, follow_symlinks=False)) if owner is not None else None
            fd = os.open(leaf, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            try:
                ident = identity(os.fstat(fd))
                if owner is not None:
                    if ident != made:
                        raise UnsafeArchiveMemberError("conflict", path, "a directory of this archive was replaced "
                                                       "by another process during the extraction")
                    os.fchown(fd, owner[0], owner[1])
                if mode & ~self._umask != mode:  # mkdir applied the umask: set the asked mode, never via a link
                    os.fchmod(fd, mode)
                return ident
            finally:
                os.close(fd)
        except FileExistsError:
            raise
        except OSError as exc:
            _native.raise_errno(exc.errno or errno.EIO, "extract", self.shown_dest)
        finally:
            os.close(pfd)

    def add_hardlink(self, name: str | bytes, target: str | bytes) -> None:
        """Create hard link ``name`` to ``target``, a regular file extracted earlier in this run.

        Raises:
            UnsafeArchiveMemberError: ``hardlink_target`` (target not a
                regular file of this run, or fails the name rules);
                ``hardlink_refused`` (policy); ``conflict``; name rules.
        """
        if self.policy.hardlinks != "create":
            self._skip_or_refuse(self.policy.hardlinks, "hardlink_refused", name, "hard link members are not allowed")
            return
        if self._batch.n or self._inflight:
            self.flush()  # the target may be a queued file
        path = self.name(name)
        if not path:
            raise UnsafeArchiveMemberError("names_destination", name, "a hard link may not name the destination")
        try:
            tpath = normalize_member(target, self.limits, shown=name)
        except UnsafeArchiveMemberError as exc:
            raise UnsafeArchiveMemberError("hardlink_target", name, f"hard link target refused: {exc.rule}") from None
        if self._kinds.get(path_key(tpath)) != FILE:
            raise UnsafeArchiveMemberError("hardlink_target", name,
                                           "hard links may only point to a regular file extracted earlier")
        if tpath == path:
            return
        key = path_key(path)
        kind = self._kinds.get(key)
        if kind == DIR:
            raise UnsafeArchiveMemberError("conflict", name, "a hard link never replaces a directory")
        if kind == LINK:
            del self._pending_live[key]
        self._parents(path, name)
        if kind == FILE:
            self._guard(name, lambda: self.work.remove(path))
        try:
            self._guard(name, lambda: self.work.link(tpath, path))
        except FileExistsError:
            raise UnsafeArchiveMemberError("conflict", name, "the name already exists") from None
        self._kinds[key] = FILE
        self.hardlinks += 1

    def special(self, name: str | bytes, what: str) -> None:
        """Handle a device, FIFO, socket or unknown-type member (refuse or skip by policy).

        Raises:
            UnsafeArchiveMemberError: rule ``special_file`` (or
                ``unknown_type``) when ``policy.special_files == "refuse"``.
        """
        rule = "unknown_type" if what == "unknown" else "special_file"
        self._skip_or_refuse(self.policy.special_files, rule, name, f"{what} members are not extracted")

    # ----------------------------------------------------------------- finish

    def _entered(self) -> "contextlib.AbstractContextManager[Root]":
        """The work tree as a Root for one short step (a checked fd of the staging directory)."""
        if isinstance(self.work, Subtree):
            return self.work.enter()
        return contextlib.nullcontext(self.work)

    def finish(self) -> None:
        """Create the symlinks, apply directory modes/mtimes, then move the staged tree in.

        Raises:
            UnsafeArchiveMemberError: a symlink rule or a ``conflict`` with a
                pre-existing entry of the destination (found before anything moves);
                ``conflict`` when the staging directory at its name is no longer the
                one this extraction made (replaced by another process).
        """
        self.flush()
        self._create_symlinks()
        self._apply_dir_meta()
        if self._staging is None:
            return
        owner = self._parent_root if self._parent_root is not None else self._dest_root
        assert owner is not None and isinstance(self.work, Subtree)
        if identity(owner.lstat(self._staging)) != self.work.identity:
            # Another process replaced the staging directory (by name, the members went into
            # whatever sat there, never elsewhere): say so rather than report a success.
            raise UnsafeArchiveMemberError("conflict", None, "the staging directory was replaced during extraction")
        if self._parent_root is not None:
            assert self._dest_leaf is not None
            self.work.chmod(".", 0o755)  # through the checked fd, never by name
            try:
                self._parent_root.rename(self._staging, self._dest_leaf, no_replace=True)
            except FileExistsError:
                raise UnsafeArchiveMemberError("conflict", None,
                                               "the destination appeared during extraction") from None
            self._staging = None
            self.made_identity = self.work.identity
            return
        assert self._dest_root is not None
        moves: list[_Move] = []
        self._plan(self._staging, "", moves)
        self._merge(moves)

    def _plan(self, srel: str, drel: str, moves: list[_Move]) -> None:
        dest = self._dest_root
        assert dest is not None
        for entry in dest.scandir(srel):
            s = f"{srel}/{entry.name}"
            d = f"{drel}/{entry.name}" if drel else entry.name
            try:
                st = dest.lstat(d)
            except FileNotFoundError:
                moves.append(_Move(s, d, identity(entry.stat), False))
                continue
            except (SymlinkRefusedError, PathEscapeError):
                raise UnsafeArchiveMemberError("through_symlink", d,
                                               "a pre-existing symlink of the destination is on this path") from None
            if entry.kind == "dir":
                if not _stat.S_ISDIR(st.st_mode):
                    raise UnsafeArchiveMemberError("conflict", d, "a directory never replaces a pre-existing file")
                self._plan(s, d, moves)
            else:
                if _stat.S_ISDIR(st.st_mode):
                    raise UnsafeArchiveMemberError("conflict", d, "a file never replaces a pre-existing directory")
                moves.append(_Move(s, d, identity(entry.stat), True))

    def _merge(self, moves: list[_Move]) -> None:
        """Move the staged entries into the existing destination: all of them, or (on an error) none.

        A new name is a ``rename(RENAME_NOREPLACE)``; a replaced file or
        symlink is a ``renameat2(RENAME_EXCHANGE)``, so the pre-existing entry
        is not unlinked but moved to the staged entry's place in the staging
        tree (it goes with that tree once all moves are done; on a filesystem
        without ``RENAME_EXCHANGE``, a plain replacing rename, which cannot be
        undone).  Should a move
        fail (an I/O error, a name that appeared, a directory swapped in where
        a file was planned), the moves made so far are undone in reverse
        order (:meth:`_undo`) before the error propagates, so the destination
        holds what it held before.

        Raises:
            UnsafeArchiveMemberError: ``conflict``: a name planned as new was
                taken, or a directory was put where a file was to be replaced.
            OSError, SandboxError: a move failed (EIO ...); what was moved is
                moved back first (best effort: an undo that fails too leaves
                a partial merge, which extracting again repairs).
        """
        dest = self._dest_root
        assert dest is not None
        done: list[_Move] = []
        try:
            for m in moves:
                if m.replace:
                    try:
                        dest.rename(m.src, m.dst, exchange=True)
                    except FileNotFoundError:  # the pre-existing entry went meanwhile: a new name
                        m = m._replace(replace=False)
                    except OSError as exc:
                        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS):
                            raise
                        # a filesystem without RENAME_EXCHANGE (NFS ...): replaced as before,
                        # a move that cannot be undone
                        dest.rename(m.src, m.dst)
                        continue
                if not m.replace:
                    try:
                        dest.rename(m.src, m.dst, no_replace=True)
                    except FileExistsError:
                        raise UnsafeArchiveMemberError("conflict", m.dst,
                                                       "the name appeared in the destination during extraction") from None
                done.append(m)
                if m.replace and _stat.S_ISDIR(dest.lstat(m.src).st_mode):
                    # a directory was swapped in at the name since the plan: never moved out of
                    # the destination (its tree would go with the staging tree)
                    raise UnsafeArchiveMemberError("conflict", m.dst, "a file never replaces a pre-existing directory")
        except BaseException:
            self._undo(done)
            raise

    def _undo(self, done: list[_Move]) -> None:
        """Move back, newest first, the entries :meth:`_merge` moved: best effort, each checked by identity.

        An entry is moved back only while the name in the destination still
        holds the one moved there (``(st_dev, st_ino)``); a process that put
        something else there meanwhile keeps it.  Should the check and the
        move be split by such a swap, the move is reversed again.
        """
        dest = self._dest_root
        assert dest is not None
        for m in reversed(done):
            with contextlib.suppress(OSError, SandboxError):
                if identity(dest.lstat(m.dst)) != m.ident:
                    continue
                if m.replace:
                    dest.rename(m.src, m.dst, exchange=True)
                else:
                    dest.rename(m.dst, m.src, no_replace=True)
                if identity(dest.lstat(m.src)) != m.ident:  # swapped between the check and the move
                    if m.replace:
                        dest.rename(m.src, m.dst, exchange=True)
                    else:
                        dest.rename(m.src, m.dst, no_replace=True)

    def abort(self) -> None:
        """Remove the staging tree (atomic mode).  In-place mode leaves what was extracted."""
        self.pending_error()  # the helper thread is idle before anything is removed
        try:
            if self._staging is not None and isinstance(self.work, Subtree):
                # Only our own staging directory, checked by identity, is removed (through
                # a checked fd, never into a mount point); whatever else sits at its name
                # now was put there by another process and is left alone.  Best effort:
                # a removal error (a read-only grant or a mount moved in) never hides the
                # error that made the run fail; a leftover keeps the in-flight name.
                try:
                    self.work.remove_tree()
                except (OSError, SandboxError):
                    pass
        finally:
            self._staging = None

    def close(self) -> None:
        """Remove what is left of the staging directory and close the Roots this extractor opened."""
        try:
            self.abort()
        finally:
            if self._worker is not None:
                self._worker.stop()
                self._worker = None
            if self._spool is not None:
                self._spool.close()
                self._spool = None
            if self._stage_fd >= 0:
                os.close(self._stage_fd)
                self._stage_fd = -1
            if self._staging_lock >= 0:
                os.close(self._staging_lock)  # a staging directory left behind is now sweepable
                self._staging_lock = -1
            for r in reversed(self._opened):
                r.close()
            self._opened.clear()
