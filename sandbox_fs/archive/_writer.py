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
  symlink) then *replaces* a pre-existing file or symlink (one rename each,
  atomic per name); a new directory is merged into a pre-existing directory
  (whose own mode and mtime are kept).  A new directory over a pre-existing
  non-directory, or a new non-directory over a pre-existing directory, is a
  ``conflict`` found before anything is moved: nothing new remains.

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

Batched new files (atomic mode, uncompressed tar read from a regular file):
a plain file member with a new name is *queued* (:meth:`Extractor.add_new_file_from`)
after every check the one-by-one path makes (name rules, ``_parents``, limits
counted from the declared size before any byte is copied, and only once the
source file is known to hold the member's data and padding: a short source
goes one by one, so both paths give the same error for the same archive).
Batches of up to :data:`BATCH_FILES` files or :data:`BATCH_BYTES` bytes are
created and filled by ONE native call in one helper thread per extraction,
while the calling thread parses the next headers: each file is created by its
path (``<staging>/<member path>``), resolved *when it is made*
(``openat2`` ``O_CREAT|O_EXCL|O_NOFOLLOW`` with ``RESOLVE_BENEATH|
RESOLVE_NO_SYMLINKS|RESOLVE_NO_MAGICLINKS``, or the fallback walker with the
same flags), data copied at explicit source offsets, mode, mtime, close; a
failed file is unlinked.  No directory fd is kept across members: a
subdirectory that a racing process moves out of the staging tree is simply
not found (the extraction fails), never written into.  At most one batch is
in flight.  Ordering: the queue is flushed (waited for) before any member
that could depend on a queued file (a hard link, a repeated name), before
:meth:`~Extractor.finish`, and on any error, where the error of the earliest
failing member wins, as in one-by-one order (a cancellation only waits for the
batch in flight).  New names written one by one (over :data:`BATCH_BYTES`),
directories and symlink records need no flush: they never touch a queued name
(the per-path kinds are updated when a file is queued, so a later member
naming it sees it).  With ``max_cpu_seconds`` set, batches run in the calling thread, so
the CPU limit still counts every syscall.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import queue
import secrets
import stat as _stat
import struct
import tempfile
import threading
from array import array
from typing import IO, TYPE_CHECKING, Callable, Iterator

from .. import _native
from ..errors import PathEscapeError, SandboxError, SymlinkRefusedError
from ..root import MAX_PATH_BYTES, Root, Subtree
from ._errors import ArchiveFormatError, ArchiveLimitError, UnsafeArchiveMemberError, show_name
from ._models import ArchiveLimits, ExtractPolicy, SkippedMember
from ._names import normalize_member, target_parts
from ._streams import Meter

if TYPE_CHECKING:
    from ._streams import StreamCounter

__all__ = ["Extractor", "file_mode", "dir_mode", "STAGING_PREFIX", "STAGED_PATH_MAX"]

STAGING_PREFIX = ".sfs-extract-"
#: the longest member path (bytes) an atomic extraction can stage: every staged path is
#: resolved as ``<staging name>/<member path>`` (a 30-byte prefix) within PATH_MAX
STAGED_PATH_MAX = MAX_PATH_BYTES - len(STAGING_PREFIX) - 16 - 1
CHUNK_BYTES = 1 << 20
#: skipped members listed in the report (the count is always exact)
MAX_SKIPPED_LISTED = 1000
_REC = struct.Struct("<HHHq?")  # path len, target len, member len, mtime_ns, has mtime
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
_STAGE_FLAGS = _CREATE_FLAGS | os.O_CLOEXEC
_PDIR_FLAGS = _native.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NO_SYMLINKS = _native.RESOLVE_NO_SYMLINKS
_FILE, _DIR, _LINK = "file", "dir", "symlink"
#: a batch of queued new files is handed to the helper thread at this many files ...
BATCH_FILES = 64
#: ... or this many data bytes; a larger member is written one by one (cancellable once a MiB)
BATCH_BYTES = 8 << 20
_XF = _native.XF_FIELDS


class _Batch:
    """New files queued for one native call: ``XF_FIELDS`` ints and a NUL-terminated path each,
    ``pre`` (the staging directory's name and a slash) then the member path, resolved beneath
    ``stage_fd`` (the directory the staging directory was made in)."""

    __slots__ = ("nums", "names", "members", "n", "nbytes", "stage_fd", "resolver", "pre", "owner", "result",
                 "after", "withdrawn")

    def __init__(self, stage_fd: int, resolver: str, pre: bytes, owner: tuple[int, int] | None) -> None:
        self.nums = array("q")
        self.names = bytearray()
        self.members: list[str | bytes] = []  # member names
        self.n = 0
        self.nbytes = 0
        self.stage_fd = stage_fd  # owned by the Extractor, open until the helper thread is idle
        self.resolver = resolver
        self.pre = pre
        self.owner = owner  # the Root's owner, given to each new file through its fd (None: as made)
        #: (done, errno, stage) once run, or the exception it raised; None: never run
        self.result: tuple[int, int, int] | BaseException | None = None
        #: the batch handed to the helper thread just before this one: this one runs only if all of it was made
        self.after: _Batch | None = None
        #: set by the calling thread when it stops batching: a batch not started by then never runs
        self.withdrawn = False

    def made_all(self) -> bool:
        """True when the helper thread made every file of this batch."""
        res = self.result
        return isinstance(res, tuple) and res[0] >= self.n

    def runnable(self) -> bool:
        """True when the helper thread may start this batch: not withdrawn, and the one before it all made."""
        return not self.withdrawn and (self.after is None or self.after.made_all())

    def run(self, src_fd: int) -> None:
        try:
            self.result = _native.extract_files(src_fd, self.stage_fd, self.resolver, self.nums, self.names,
                                                self.n, self.owner)
        except BaseException as exc:  # reported in the calling thread
            self.result = exc


class _CopyWorker:
    """The one helper thread of an extraction: runs the batches handed to it, one at a time, in order.

    A batch is handed over before the calling thread waits for the one
    before it, so the thread goes from one batch to the next while the
    calling thread is blocked (it needs the GIL only then), and makes a
    batch only when every file of the one before it was made
    (:meth:`_Batch.runnable`); a batch it does not make comes back with no
    result.
    """

    def __init__(self, src_fd: int) -> None:
        self._src_fd = src_fd
        self._jobs: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[_Batch] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="sandbox-fs-extract-copy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        jobs, done, fd = self._jobs, self._done, self._src_fd
        while True:
            b = jobs.get()
            if b is None:
                return
            if b.runnable():
                b.run(fd)
            done.put(b)

    def put(self, b: _Batch) -> None:
        self._jobs.put(b)

    def wait(self) -> _Batch:
        return self._done.get()

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()


def file_mode(mode: int | None) -> int:
    """Permission bits for an extracted file: setuid/setgid/sticky and group/other
    write cleared, owner read/write added, executable only when the archive says so
    (PEP 706 ``data`` filter rules)."""
    if mode is None:
        return 0o644
    return (mode & 0o755) | 0o600


def dir_mode(mode: int | None) -> int:
    """Permission bits for an extracted directory: as :func:`file_mode`, plus owner rwx."""
    if mode is None:
        return 0o755
    return (mode & 0o755) | 0o700


def _eof(_n: int) -> bytes:
    return b""


def _key(path: bytes) -> bytes:
    """A 16-byte BLAKE2b digest of a member path: per-member state stays small
    (about 150 bytes a member) however long the names are."""
    return hashlib.blake2b(path, digest_size=16).digest()


def _umask() -> int:
    """The process umask, read without changing it (``/proc/self/status``)."""
    try:
        with open("/proc/self/status", "rb") as fh:  # host-access: procfs of this process (kernel interface)
            for line in fh:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


#: the largest uid/gid fchown accepts as an id: 2**32 - 1 is (uid_t)-1, "leave unchanged"
MAX_OWNER_ID = (1 << 32) - 2


def _check_owner(owner: tuple[int, int], member: str | bytes) -> None:
    """Refuse archive owner ids fchown cannot take as ids (a header number is never used unchecked).

    tar uid/gid fields are octal or GNU base-256 numbers, so they can be
    negative or wider than ``uid_t``; -1 and 2**32 - 1 would mean "leave
    unchanged" to fchown(2), and anything outside 32 bits raises
    ``OverflowError`` in ``os.fchown``.

    Raises:
        ArchiveFormatError: an id outside 0 .. :data:`MAX_OWNER_ID`.
    """
    uid, gid = owner
    if not (0 <= uid <= MAX_OWNER_ID and 0 <= gid <= MAX_OWNER_ID):
        raise ArchiveFormatError("owner id out of range (uid and gid must be 0 .. 4294967294)", member=member)


def _ident(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _mtime_ns(mtime: float | int | None) -> int | None:
    if mtime is None:
        return None
    try:
        ns = int(mtime * 1_000_000_000) if isinstance(mtime, float) else int(mtime) * 1_000_000_000
    except (OverflowError, ValueError):
        return None
    if not (-(1 << 62) < ns < (1 << 62)):
        return None
    return ns


class Extractor:
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
        self._umask = _umask()
        # A Root with an owner (a workspace whose content belongs to the confined identity)
        # gives every entry made its owner; the archive's owners are then never applied.
        self._fs_owner = root.owner
        self._owner = policy.preserve_owner and os.geteuid() == 0 and root.owner is None
        self._parent_root: Root | None = None  # holds a sibling staging dir
        self._dest_root: Root | None = None    # an existing destination
        self._dest_leaf: str | None = None
        self._staging: str | None = None
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
        self._batch = _Batch(self._stage_fd, self._stage_resolver, self._stage_pre, self._fs_owner)
        self._inflight: list[_Batch] = []  # handed to the helper thread and not yet taken back, oldest first
        self._worker: _CopyWorker | None = None
        self._src_fd = -1
        self._threaded = limits.max_cpu_seconds is None
        self._batch_failed = False  # a batch error was raised: later queued files are never made
        self._fmode_cache: dict[int, tuple[int, int]] = {}
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
                self.work = Subtree(prt, leaf, _ident(prt.lstat(leaf)))
                return
            self._parent_root, self._dest_leaf = prt, leaf
            self._staging = STAGING_PREFIX + secrets.token_hex(8)
            prt.mkdir(self._staging, 0o700)
            # (the identity is taken right after mkdir: a directory swapped in between those
            # two calls would be taken for ours; it is inside the destination either way)
            self.work = Subtree(prt, self._staging, _ident(prt.lstat(self._staging)))
            return
        self._dest_root = dest_root
        if self.policy.in_place:
            self.work = dest_root
            return
        self._staging = STAGING_PREFIX + secrets.token_hex(8)
        dest_root.mkdir(self._staging, 0o700)
        self.work = Subtree(dest_root, self._staging, _ident(dest_root.lstat(self._staging)))

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
        self.meter.member = member
        self.meter.check_cpu()
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
        if self._kinds.get(_key(parent)) == _DIR:
            self._last_parent = parent
            return
        comps = parent.split(b"/")
        for i in range(1, len(comps) + 1):
            pre = b"/".join(comps[:i])
            kpre = _key(pre)
            kind = self._kinds.get(kpre)
            if kind == _DIR:
                continue
            if kind == _LINK:
                raise UnsafeArchiveMemberError("through_symlink", member,
                                               "the path passes through a symlink member of this archive")
            if kind == _FILE:
                raise UnsafeArchiveMemberError("conflict", member, "a parent of this member is a file")
            try:
                self._dir_ids[kpre] = self._guard(member, lambda: self._make_dir(pre, 0o755))  # type: ignore[assignment]
            except FileExistsError:
                raise UnsafeArchiveMemberError("conflict", member,
                                               "a parent of this member exists and is not a directory") from None
            self._kinds[kpre] = _DIR
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
            _check_owner(owner, name)
        path = self.name(name)
        if not path:
            self._skip(name, "names_destination", "a directory member naming the destination itself is ignored")
            return
        key = _key(path)
        kind = self._kinds.get(key)
        if kind == _FILE:
            raise UnsafeArchiveMemberError("conflict", name, "a directory never replaces a file")
        if kind == _LINK:
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
            self._kinds[key] = _DIR
            self.dirs += 1
        dmode = dir_mode(mode) if self._exact is None else self._exact.get(path, dir_mode(mode)) & 0o777
        self._dir_meta[key] = (dmode, _mtime_ns(mtime) if self.policy.apply_mtime else None, owner)

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
            _check_owner(owner, name)
        path = self.name(name)
        if not path:
            raise UnsafeArchiveMemberError("names_destination", name, "a file may not name the destination itself")
        lim = self.limits.max_member_bytes
        if declared_size is not None and declared_size > lim:
            raise ArchiveLimitError("max_member_bytes", lim, declared_size, name,
                                    reason=f"declared size {declared_size} > max_member_bytes {lim}")
        key = _key(path)
        kind = self._kinds.get(key)
        if kind is not None and (self._batch.n or self._inflight):
            self.flush()  # a queued file may hold this name; a new name depends on no queued file
        if kind == _DIR:
            raise UnsafeArchiveMemberError("conflict", name, "a file never replaces a directory")
        if kind == _LINK:
            del self._pending_live[key]  # a later file replaces the earlier (pending) symlink
        self._parents(path, name)
        fmode = file_mode(mode)
        if self._exact is not None:
            fmode = self._exact.get(path, fmode) & 0o777
        mt = _mtime_ns(mtime) if self.policy.apply_mtime else None
        meter = self.meter
        fd = -1
        if kind is None:
            try:
                if self._stage_fd >= 0:
                    fd = self._create_staged(path, fmode)
                else:
                    fd = self.work.open_fd(path, _CREATE_FLAGS, fmode)
            except FileExistsError:
                fd = -1
            except IsADirectoryError:
                raise UnsafeArchiveMemberError("conflict", name, "a file never replaces a directory") from None
            except (SymlinkRefusedError, PathEscapeError):
                raise UnsafeArchiveMemberError("through_symlink", name,
                                               "a symlink on the path was refused (writes never follow symlinks)") from None
        if fd >= 0:
            try:
                try:
                    total = 0
                    write = os.write
                    cancel = self.check_cancel
                    if splice is not None and declared_size is not None:
                        left = declared_size
                        while left > 0:
                            n = min(left, CHUNK_BYTES)
                            if total + n > lim:
                                raise ArchiveLimitError("max_member_bytes", lim, total + n, name)
                            if cancel is not None and total:
                                cancel()
                            got = splice(fd, n)
                            total += got
                            left -= got
                            meter.add_written(got)
                        read = _eof
                    while True:  # the chunks() loop inlined: this is the per-member hot path
                        data = read(CHUNK_BYTES)
                        if not data:
                            break
                        if cancel is not None and total:
                            cancel()  # a long member stays cancellable (once a MiB)
                        n = len(data)
                        total += n
                        if total > lim:
                            raise ArchiveLimitError("max_member_bytes", lim, total, name)
                        meter.add_written(n)
                        off = write(fd, data)
                        if off < n:
                            view = memoryview(data)
                            while off < n:
                                off += write(fd, view[off:])
                    if fmode & ~self._umask != fmode:
                        os.fchmod(fd, fmode)
                    if mt is not None:
                        os.utime(fd, ns=(mt, mt))
                    if self._owner and owner is not None:
                        os.fchown(fd, owner[0], owner[1])
                finally:
                    os.close(fd)
            except BaseException:
                try:
                    self.work.remove(path)  # never leave a partial member
                except (OSError, SandboxError):
                    pass
                raise
        else:
            def chunks():
                total = 0
                while True:
                    data = read(CHUNK_BYTES)
                    if not data:
                        return
                    total += len(data)
                    if total > lim:
                        raise ArchiveLimitError("max_member_bytes", lim, total, name)
                    meter.add_written(len(data))
                    yield data

            own = owner if self._owner and owner is not None else None  # fchown of the new file's fd
            try:
                self._guard(name, lambda: self.work.atomic_write(path, chunks(), mode=fmode, fsync=False, mtime_ns=mt,
                                                                 owner=own))
            except IsADirectoryError:
                raise UnsafeArchiveMemberError("conflict", name, "a file never replaces a directory") from None
        self._kinds[key] = _FILE
        self.files += 1

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
        return _ident(self.work.lstat(path))

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
                    return _ident(st)
                raise
            owner = self._fs_owner
            if owner is None and mode & ~self._umask == mode:
                # nothing to set through an fd: the identity of the directory at the name, as made
                st = os.stat(leaf, dir_fd=dfd, follow_symlinks=False)
                if _stat.S_ISDIR(st.st_mode):
                    return _ident(st)
            made = _ident(os.stat(leaf, dir_fd=dfd, follow_symlinks=False)) if owner is not None else None
            fd = os.open(leaf, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            try:
                ident = _ident(os.fstat(fd))
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

    # ------------------------------------------------------- batched new files

    def can_batch(self) -> bool:
        """True when new plain files may be queued (atomic mode, no ownership to apply)."""
        return self._stage_fd >= 0 and not self._owner

    def add_new_file_from(self, name: str | bytes, mode: int, mtime: float | int | None, size: int,
                          counter: StreamCounter, offset_data: int) -> bool:
        """Queue regular-file member ``name`` whose ``size`` data bytes sit in the source file.

        Only for a *new* name in the fresh staging tree (:meth:`can_batch`),
        read from an uncompressed tar in a regular file (``counter.can_splice()``
        and the stream at ``offset_data``) that holds the member's data and
        block padding (:meth:`StreamCounter.has_data`): they are stepped over
        in the stream at once (counted as reads would be), the written bytes
        are counted from ``size`` before any byte is copied, and the file is
        created (by its path beneath the staging directory) and filled later
        by the helper thread (see the module docstring).

        Args:
            name: the member name; mode: its mode bits; mtime: seconds;
            size: data bytes (``max_member_bytes`` applies to it);
            counter: the tar stream; offset_data: stream offset of the data.

        Returns:
            False when the member is not for this path (a name already seen, the
            destination's own name, over :data:`BATCH_BYTES`, a source file too
            short for its data): nothing was done, the caller uses
            :meth:`add_file`.  True when queued.

        Raises:
            ArchiveFormatError: ``size`` is negative (a header number is never
                trusted to be a length).
            UnsafeArchiveMemberError: name rules; ``through_symlink``/``conflict``
                from the parents.
            ArchiveLimitError: ``max_member_bytes``, ``max_total_bytes``,
                ``max_input_bytes``, ``max_expansion_ratio``, ``max_cpu_seconds``.
            ArchiveFormatError, OSError: an earlier batch failed (raised in
                archive order, with that member's name).
        """
        if size > BATCH_BYTES:
            return False
        if size < 0:
            raise ArchiveFormatError("negative member size", member=name)
        path = normalize_member(name, self.limits)
        if not path:
            return False
        lim = self.limits.max_member_bytes
        if size > lim:
            raise ArchiveLimitError("max_member_bytes", lim, size, name,
                                    reason=f"declared size {size} > max_member_bytes {lim}")
        key = _key(path)
        if key in self._kinds:
            return False
        if not counter.has_data(offset_data, size):
            return False  # a short source: one by one finds where the data ends, and says so as it does
        self._parents(path, name)
        src_off, probe = counter.skip_data(offset_data, size)  # counts size as written too
        mbits = mode & 0o7777
        fm = self._fmode_cache.get(mbits)
        if fm is None:
            fmode = file_mode(mbits)
            fm = self._fmode_cache[mbits] = (fmode, _native.XF_CHMOD if fmode & ~self._umask != fmode else 0)
        if self._exact is not None and path in self._exact:
            fm = (self._exact[path] & 0o777, _native.XF_CHMOD)
        b = self._batch
        if not self.policy.apply_mtime:
            b.nums.extend((src_off, size, probe, fm[0], 0, fm[1]))
        else:
            # _mtime_ns, inlined for the common integer mtime (bounds keep ns within +-2**62)
            mt = mtime * 1_000_000_000 if type(mtime) is int and -4611686018 <= mtime <= 4611686018 \
                else _mtime_ns(mtime)
            if mt is None:
                b.nums.extend((src_off, size, probe, fm[0], 0, fm[1]))
            else:
                b.nums.extend((src_off, size, probe, fm[0], mt, fm[1] | _native.XF_MTIME))
        b.names += self._stage_pre
        b.names += path
        b.names.append(0)
        b.members.append(name)
        b.n += 1
        b.nbytes += size
        self._kinds[key] = _FILE
        self.files += 1
        self._src_fd = counter.splice_fd
        if b.n >= BATCH_FILES or b.nbytes >= BATCH_BYTES:
            self._submit()
        return True

    def _submit(self) -> None:
        """Hand the queued batch to the helper thread, then wait for the one before it.

        At most one batch is made at a time: the helper thread starts this one
        once the one before it is done, and only if all of its files were made.
        """
        if self._threaded and self._worker is None:
            try:
                self._worker = _CopyWorker(self._src_fd)
            except RuntimeError:  # no thread to be had: make the files in this thread
                self._threaded = False
        b, self._batch = self._batch, _Batch(self._stage_fd, self._stage_resolver, self._stage_pre, self._fs_owner)
        if not self._threaded:
            b.run(self._src_fd)
            self._complete(b)
            return
        assert self._worker is not None
        b.after = self._inflight[-1] if self._inflight else None
        self._inflight.append(b)
        self._worker.put(b)
        while len(self._inflight) > 1:
            prev = self._take_back()
            self._complete(prev)  # raises its error; b is then never made
            if not prev.made_all():
                # a name of prev existed and was replaced in this thread: the helper thread
                # skips b (it comes back unmade); hand it over again, now after nothing
                self._take_back()
                b.after = None
                self._inflight.append(b)
                self._worker.put(b)

    def _take_back(self) -> _Batch:
        """Wait for the oldest batch handed to the helper thread (they come back in order, made or not)."""
        assert self._worker is not None
        b = self._worker.wait()
        assert b is self._inflight[0]
        del self._inflight[0]
        b.after = None  # decided: keep no chain of earlier batches
        return b

    def _wait(self) -> None:
        """Wait for every batch handed to the helper thread; raise the first error (see :meth:`_complete`)."""
        while self._inflight:
            self._complete(self._take_back())

    def _complete(self, b: _Batch) -> None:
        """Check a finished batch (one never run holds nothing to check)."""
        try:
            self._check_result(b)
        except BaseException:
            self._batch_failed = True
            raise

    def _check_result(self, b: _Batch) -> None:
        res = b.result
        if res is None:
            return  # never run (withdrawn): nothing was made
        while True:
            if isinstance(res, BaseException):
                raise res
            assert res is not None
            done, err, stage = res
            if done >= b.n:
                return
            if not (stage == _native.XF_STAGE_CREATE and err == errno.EEXIST):
                raise self._batch_error(b.members[done], err, stage)
            # The name exists although this run never made it (a name the filesystem
            # folds onto an earlier one, or a racing process in the staging tree): the
            # one-by-one path replaces it atomically; do that, then the rest of the batch.
            self._replace_queued(b, done)
            if done + 1 >= b.n:
                return
            rest = _Batch(b.stage_fd, b.resolver, b.pre, b.owner)
            rest.nums = b.nums[(done + 1) * _XF:]
            rest.names = bytearray(b"".join(n + b"\0" for n in b.names.split(b"\0")[done + 1:b.n]))
            rest.members = b.members[done + 1:]
            rest.n = b.n - done - 1
            rest.run(self._src_fd)
            b, res = rest, rest.result

    def _batch_error(self, member: str | bytes, err: int, stage: int) -> BaseException:
        """The error the one-by-one path raises for a failed queued file."""
        if stage == _native.XF_STAGE_SHORT:
            return ArchiveFormatError("unexpected end of data", member=member)
        if stage == _native.XF_STAGE_CREATE and err == errno.EISDIR:
            return UnsafeArchiveMemberError("conflict", member, "a file never replaces a directory")
        if stage == _native.XF_STAGE_CREATE and err in (errno.ELOOP, errno.EXDEV):
            return UnsafeArchiveMemberError("through_symlink", member,
                                            "a symlink on the path was refused (writes never follow symlinks)")
        try:
            _native.raise_errno(err or errno.EIO, "extract", self.shown_dest)
        except (OSError, SandboxError) as exc:
            return exc
        return OSError(err, os.strerror(err))  # pragma: no cover - raise_errno always raises

    def _replace_queued(self, b: _Batch, i: int) -> None:
        """Write queued entry ``i`` of ``b`` through :meth:`Root.atomic_write` (replacing the name)."""
        name = b.members[i]
        path = normalize_member(name, self.limits)
        src_off, size, probe, fmode, mt, flags = b.nums[i * _XF:(i + 1) * _XF]
        src_fd = self._src_fd

        def chunks() -> Iterator[bytes]:
            off, left = src_off, size
            while left:
                data = os.pread(src_fd, min(left, CHUNK_BYTES), off)
                if not data:
                    raise ArchiveFormatError("unexpected end of data", member=name)
                off += len(data)
                left -= len(data)
                yield data
            if probe >= 0 and not os.pread(src_fd, 1, probe):
                raise ArchiveFormatError("unexpected end of data", member=name)

        try:
            self._guard(name, lambda: self.work.atomic_write(
                path, chunks(), mode=fmode, fsync=False, mtime_ns=mt if flags & _native.XF_MTIME else None))
        except IsADirectoryError:
            raise UnsafeArchiveMemberError("conflict", name, "a file never replaces a directory") from None

    def flush(self) -> None:
        """Create every queued file now (wait for the helper thread).

        Raises:
            ArchiveFormatError: ``unexpected end of data`` (the source is short).
            UnsafeArchiveMemberError: ``conflict`` / ``through_symlink``.
            OSError: the file could not be created or written (sandbox path only).
        """
        if self._batch.n:
            self._submit()
        self._wait()

    def pending_error(self, run_queued: bool = False) -> BaseException | None:
        """Stop batching after an error in the calling thread; never raises.

        Waits for the batch in flight; with ``run_queued`` (an ordinary error,
        not a cancellation) also makes the queued files, so that the error of
        the earliest failing member wins, as in one-by-one order.  Then drops
        whatever is still queued.

        Returns:
            The first batch error (a member before the one that failed in the
            calling thread), or None.
        """
        err: BaseException | None = None
        try:
            if run_queued and not self._batch_failed:
                self.flush()
            else:
                for b in self._inflight:
                    b.withdrawn = True  # the batch being made completes; none starts after it
                self._wait()
        except BaseException as exc:  # reported to the caller, raised there
            err = exc
        finally:
            for b in self._inflight:
                b.withdrawn = True
            while self._inflight:  # a wait was interrupted or an error raised: the thread still owns them
                self._take_back()
            self._batch = _Batch(self._stage_fd, self._stage_resolver, self._stage_pre, self._fs_owner)
        return err

    def add_symlink(self, name: str | bytes, target: str | bytes, mtime: float | int | None) -> None:
        """Record symlink member ``name`` -> ``target``; it is created by :meth:`finish`.

        Raises:
            UnsafeArchiveMemberError: policy ``refuse`` (rule
                ``symlink_refused``); ``symlink_target`` (absolute, empty,
                climbing out); ``conflict`` (a file or directory member holds
                the name); name rules.
        """
        if self.policy.symlinks != "create":
            self._skip_or_refuse(self.policy.symlinks, "symlink_refused", name, "symlink members are not allowed")
            return
        path = self.name(name)
        if not path:
            raise UnsafeArchiveMemberError("names_destination", name, "a symlink may not name the destination itself")
        target_parts(path, target, self.limits, name)  # early, clear refusal of escapes (linear)
        key = _key(path)
        if self._kinds.get(key) in (_FILE, _DIR):
            raise UnsafeArchiveMemberError("conflict", name, "a symlink never replaces an earlier file or directory")
        self._parents(path, name)
        mt = _mtime_ns(mtime) if self.policy.apply_mtime else None
        tb = target if isinstance(target, bytes) else target.encode("utf-8", "surrogateescape")
        mb = (name if isinstance(name, bytes) else name.encode("utf-8", "surrogateescape"))[:4096]
        if self._spool is None:
            self._spool = tempfile.TemporaryFile()  # host temp dir, never the workspace
        self._spool.write(_REC.pack(len(path), len(tb), len(mb), mt or 0, mt is not None) + path + tb + mb)
        self._pending_seq += 1
        self._pending_live[key] = self._pending_seq
        self._kinds[key] = _LINK

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
        if self._kinds.get(_key(tpath)) != _FILE:
            raise UnsafeArchiveMemberError("hardlink_target", name,
                                           "hard links may only point to a regular file extracted earlier")
        if tpath == path:
            return
        key = _key(path)
        kind = self._kinds.get(key)
        if kind == _DIR:
            raise UnsafeArchiveMemberError("conflict", name, "a hard link never replaces a directory")
        if kind == _LINK:
            del self._pending_live[key]
        self._parents(path, name)
        if kind == _FILE:
            self._guard(name, lambda: self.work.remove(path))
        try:
            self._guard(name, lambda: self.work.link(tpath, path))
        except FileExistsError:
            raise UnsafeArchiveMemberError("conflict", name, "the name already exists") from None
        self._kinds[key] = _FILE
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

    def _is_link_on_disk(self, root: Root | Subtree, path: bytes) -> bool:
        try:
            return _stat.S_ISLNK(root.lstat(path).st_mode)
        except (SymlinkRefusedError, PathEscapeError):
            return True
        except (FileNotFoundError, NotADirectoryError):
            return False

    def _pending_records(self) -> Iterator[tuple[bytes, bytes, int | None, bytes]]:
        """The live pending symlinks, in archive order: (path, target, mtime_ns, member)."""
        if self._spool is None:
            return
        spool = self._spool
        spool.flush()
        spool.seek(0)
        seq = 0
        while True:
            head = spool.read(_REC.size)
            if not head:
                return
            plen, tlen, mlen, mt, has_mt = _REC.unpack(head)
            path, target, member = spool.read(plen), spool.read(tlen), spool.read(mlen)
            seq += 1
            if self._pending_live.get(_key(path)) == seq:
                yield path, target, (mt if has_mt else None), member

    def _check_through(self, path: bytes, target: bytes, member: bytes, check_roots: list[Root | Subtree],
                       finals: dict[bytes, bytes]) -> None:
        """Refuse a pending link whose target passes through another symlink; record where it points.

        Linear in the target's length: the prefixes' keys come from one
        running BLAKE2b state (``copy()`` per component, never re-hashing a
        prefix), and the disk is asked once per checked root, for the deepest
        prefix only: beneath a ``RESOLVE_NO_SYMLINKS`` Root that one
        ``lstat`` is refused (or is a link) exactly when some prefix is a
        symlink.  The per-archive work is then bounded by ``max_members``
        times (``max_path_bytes`` + ``max_depth``).
        """
        base, names, final = target_parts(path, target, self.limits, member)
        finals[_key(path)] = _key(final)
        if len(names) < 2:
            return  # passes through nothing beyond the link's own ancestors
        h = hashlib.blake2b(base, digest_size=16)
        sep = bool(base)
        unknown = False
        for name in names[:-1]:
            if sep:
                h.update(b"/")
            h.update(name)
            sep = True
            kind = self._kinds.get(h.copy().digest())
            if kind == _LINK:
                raise UnsafeArchiveMemberError("symlink_target", member,
                                               "symlink target passes through another symlink")
            if kind is None:
                unknown = True
        if unknown and check_roots:
            tail = b"/".join(names[:-1])
            deepest = base + b"/" + tail if base else tail
            if any(self._is_link_on_disk(r, deepest) for r in check_roots):
                raise UnsafeArchiveMemberError("symlink_target", member,
                                               "symlink target passes through another symlink")

    def _create_symlinks(self) -> None:
        if not self._pending_live:
            return
        check_roots: list[Root | Subtree] = [] if self.fresh else [self.work]
        if self._dest_root is not None and self._dest_root is not self.work:
            check_roots.append(self._dest_root)
        finals: dict[bytes, bytes] = {}
        for path, target, _mt, member in self._pending_records():
            self._check_through(path, target, member, check_roots, finals)
        acyclic: set[bytes] = set()
        for path, _t, _m, member in self._pending_records():
            # links to links are fine; cycles resolve nowhere (and fool realpath-based
            # checkers into seeing an escape): refuse them.  Linear overall.
            chain: list[bytes] = []
            seen: set[bytes] = set()
            cur = _key(path)
            while cur in finals and cur not in acyclic:
                if cur in seen:
                    raise UnsafeArchiveMemberError("symlink_target", member, "symlink members form a cycle")
                seen.add(cur)
                chain.append(cur)
                cur = finals[cur]
            acyclic.update(chain)
        del finals, acyclic
        for path, target, mt, member in self._pending_records():
            try:
                self._guard(member, lambda: self.work.symlink(target, path))
            except FileExistsError:
                raise UnsafeArchiveMemberError("conflict", member, "the symlink's name already exists") from None
            if mt is not None:
                self._set_link_time(path, mt, member)
            self.symlinks += 1

    def _set_link_time(self, path: bytes, mt: int, member: bytes) -> None:
        """Set the mtime of the symlink just made at ``path``, through an fd proven to be it.

        Never by name: the link's directory is opened (``O_PATH``, beneath the
        checked staging directory) and checked to be the directory this
        extraction made for it and writable (read-only grants: the Root's
        write guard, on the fd); the link is opened ``O_PATH|O_NOFOLLOW`` from
        it and ``fstat``-checked to be a symlink with one link (a name swapped
        meanwhile for another inode, such as a hard link to a file outside, is
        refused); then ``utimensat(fd, "", AT_EMPTY_PATH)``.  A kernel without
        that (EINVAL) leaves the link's time as made.

        Raises:
            UnsafeArchiveMemberError: ``conflict``, the name or its directory
                no longer holds what this extraction made.
            ReadOnlyError: the directory is (beneath) a read-only grant.
        """
        parent, _, leaf = path.rpartition(b"/")
        replaced = UnsafeArchiveMemberError("conflict", member, "the symlink or its directory was replaced by "
                                            "another process")
        with self._entered() as work:
            try:
                pfd = work.open_fd(parent or b".", _native.O_PATH | os.O_DIRECTORY)
            except (FileNotFoundError, NotADirectoryError, SymlinkRefusedError, PathEscapeError):
                raise replaced from None
            try:
                if parent and _ident(os.fstat(pfd)) != self._dir_ids.get(_key(parent)):
                    raise replaced
                work.check_write_fd(pfd, parent or b".")
                try:
                    fd = os.open(leaf, _native.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
                except FileNotFoundError:
                    raise replaced from None
                try:
                    st = os.fstat(fd)
                    if not (_stat.S_ISLNK(st.st_mode) and st.st_nlink == 1):
                        raise replaced
                    try:
                        _native.set_times_fd(fd, mt, "extract", self.shown_dest)
                    except OSError as exc:
                        if exc.errno != errno.EINVAL:
                            raise
                finally:
                    os.close(fd)
            finally:
                os.close(pfd)

    def _entered(self) -> "contextlib.AbstractContextManager[Root]":
        """The work tree as a Root for one short step (a checked fd of the staging directory)."""
        if isinstance(self.work, Subtree):
            return self.work.enter()
        return contextlib.nullcontext(self.work)

    def _apply_dir_meta(self) -> None:
        """Set modes, owners and mtimes of the directory members, walking only our directories.

        Done after every member (a directory's mtime changes as entries are
        added); order does not matter since changing a child's metadata never
        changes its parent's mtime.

        Each directory of ours is opened ``O_DIRECTORY|O_NOFOLLOW`` through
        the work Root (``RESOLVE_NO_SYMLINKS``: a symlink or non-directory
        there is skipped, never followed) and its entries are listed from
        that fd by type (``getdents``, no ``lstat`` each); owners, modes and
        mtimes are set through that same fd (``fchown``, ``fchmod``,
        ``futimens``; read-only grants checked on it), never by name: a
        directory cannot be a hard link, so nothing outside is ever changed.
        Memory: the paths of our directories still to visit; fds: one at a time.
        """
        if not self._dir_meta:
            return
        # One checked fd of the staging directory for this metadata-only step (modes and
        # times of our own directories; nothing is created), not one lookup per call.
        with self._entered() as work:
            self._apply_dir_meta_in(work)

    def _apply_dir_meta_in(self, work: Root) -> None:
        kinds, meta = self._kinds, self._dir_meta
        dflags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
        owner_ok = self._owner
        todo: list[bytes] = []  # our directories with metadata, parents before children
        stack: list[bytes] = [b""]
        while stack:
            rel = stack.pop()
            try:
                fd = work.open_fd(rel or b".", dflags)
            except (FileNotFoundError, NotADirectoryError, SymlinkRefusedError, PathEscapeError):
                if not rel:
                    raise
                continue  # swapped or removed meanwhile: never followed
            try:
                if rel and _key(rel) in meta:
                    todo.append(rel)
                with os.scandir(fd) as it:
                    for ent in it:
                        if ent.is_dir(follow_symlinks=False):
                            name = os.fsencode(ent.name)
                            child = rel + b"/" + name if rel else name
                            if kinds.get(_key(child)) == _DIR:
                                stack.append(child)
            finally:
                os.close(fd)
        # Children before parents, so a mode without search permission never blocks the rest;
        # each through the directory's own fd, never by name (a name swapped for a hard link to
        # a file outside is never changed), checked to be the directory made for the member.
        for rel in reversed(todo):
            try:
                fd = work.open_fd(rel, dflags)
            except (FileNotFoundError, NotADirectoryError, SymlinkRefusedError, PathEscapeError):
                continue
            try:
                k = _key(rel)
                mode, mt, owner = meta[k]
                if _ident(os.fstat(fd)) != self._dir_ids.get(k):
                    raise UnsafeArchiveMemberError("conflict", rel, "a directory of this archive was replaced by "
                                                   "another process during the extraction")
                work.check_write_fd(fd, rel)
                if owner_ok and owner is not None:
                    os.fchown(fd, owner[0], owner[1])
                os.fchmod(fd, mode)
                if mt is not None:
                    os.utime(fd, ns=(mt, mt))
            finally:
                os.close(fd)

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
        if _ident(owner.lstat(self._staging)) != self.work.identity:
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
        moves: list[tuple[str, str, bool]] = []
        self._plan(self._staging, "", moves)
        for src, dst, replace in moves:
            self._dest_root.rename(src, dst, no_replace=not replace)

    def _plan(self, srel: str, drel: str, moves: list[tuple[str, str, bool]]) -> None:
        dest = self._dest_root
        assert dest is not None
        for entry in dest.scandir(srel):
            s = f"{srel}/{entry.name}"
            d = f"{drel}/{entry.name}" if drel else entry.name
            try:
                st = dest.lstat(d)
            except FileNotFoundError:
                moves.append((s, d, False))
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
                moves.append((s, d, True))

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
            for r in reversed(self._opened):
                r.close()
            self._opened.clear()
