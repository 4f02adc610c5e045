"""The fd walk of a workspace: listings through held directory fds, every entry opened by its path.

The walk never follows a symlink and never trusts a held directory fd.
Directories are *listed* through fds the walk holds (one per level, so the
fd count is bounded by the depth), with every ``lstat`` taken relative to
the listed directory; but a held fd can be moved out of the workspace at
any moment, so every entry the snapshot reads or records -- a regular
file's content and metadata, a subdirectory to list (and its mode), a
symlink's target -- is opened by its *path* beneath the workspace Root's
own fd at the moment of use (``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``,
``O_NOFOLLOW`` on the leaf, ``O_NONBLOCK`` for files; a symlink as an
``O_PATH`` fd read with ``readlinkat(fd, "")``) and ``fstat``-checked to be
the very inode (device, inode number, type) the listing's ``lstat`` saw.
So a file swapped for a symlink (or a FIFO, or another file), a parent
swapped for a symlink, or a directory moved out of the workspace while
the walk held it (and written into afterwards) is never read through: the
retryable :class:`SnapshotSourceChangedError`.  An entry gone both from
its path and from its listed directory was deleted and is skipped; one
still listed but not at its path (a parent moved) is
:class:`SnapshotSourceChangedError`.  A path longer than PATH_MAX is an
unrestorable entry (refused or skipped) like any other.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat as _stat
import struct
from dataclasses import dataclass
from operator import itemgetter
from typing import Callable, Generator, Iterable, Iterator, NamedTuple, Sequence, Union, overload

from .. import _hooks, _native
from ..archive import ArchiveLimitError, UnsafeArchiveMemberError
from ..errors import SandboxError
from ..paths import normalize
from ..root import Root, kind_of
from ._errors import SnapshotError, SnapshotLimitError, SnapshotSourceChangedError

__all__ = ["WORKSPACE_ID_NAME", "SCAN_HEADER", "parse_scan"]

# In-flight names (Root.atomic_write temp files, archive and hydrate staging dirs, the private directory of a
# checked rmdir): never persisted.
_IN_FLIGHT_PREFIXES = (".sfs-tmp-", ".sfs-extract-", ".sfs-hydrate-", ".sfs-rm-")
#: the workspace id file of a session (see :mod:`sandbox_fs.session`): at the workspace's top, never persisted
WORKSPACE_ID_NAME = ".sfs-workspace-id"


class _Stat(NamedTuple):
    """An entry's ``lstat`` as a directory scan returns it (the fields of ``os.stat_result`` the walk reads)."""

    st_mode: int
    st_ino: int
    st_dev: int
    st_nlink: int
    st_size: int
    st_mtime_ns: int
    st_ctime_ns: int

    @property
    def st_mtime(self) -> float:
        """The mtime in seconds, as ``os.stat_result.st_mtime`` computes it (seconds + nanoseconds * 1e-9)."""
        sec, nsec = divmod(self.st_mtime_ns, 1_000_000_000)
        return float(sec) + nsec * 1e-9


#: an ``lstat``: of a scan (:class:`_Stat`) or of ``os.stat``/``os.fstat``
StatLike = Union[os.stat_result, _Stat]


class _ListedEntry(NamedTuple):
    """An entry as its directory's listing saw it (nothing read through it is trusted until checked)."""

    path: str  # workspace-relative sandbox path
    kind: str  # file | dir | symlink | fifo | socket | char | block | unknown
    st: StatLike  # its lstat, taken relative to the listed directory's fd
    name: str = ""  # its name in its parent directory (fd-relative calls)


def _excluded(path: str, excluded: frozenset[str]) -> bool:
    """True when ``path`` or one of its ancestors is in ``excluded``."""
    if not excluded:
        return False
    if path in excluded:
        return True
    i = path.find("/")
    while i > 0:
        if path[:i] in excluded:
            return True
        i = path.find("/", i + 1)
    return False


def _norm_set(paths: Iterable[str]) -> frozenset[str]:
    """The normalized sandbox paths of ``paths`` (the root itself left out)."""
    out = set()
    for p in paths:
        sp = normalize(p)
        if sp:
            out.add(str(sp))
    return frozenset(out)


# Opened by path through the source view (Root.open_fd adds O_CLOEXEC; follow_symlinks=False adds O_NOFOLLOW).
_SUBDIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY
_MEMBER_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY


SCAN_HEADER = struct.Struct("=QQqqqQII")  # native/scan.h: ino dev size mtime_ns ctime_ns nlink mode namelen
assert SCAN_HEADER.size == _native.SCAN_HEADER_BYTES


def parse_scan(raw: bytes) -> list[tuple[str, _Stat]]:
    """``(name, lstat)`` of every record of a directory scan (:func:`sandbox_fs._native.scan_dir`), sorted by name."""
    out = []
    unpack = SCAN_HEADER.unpack_from
    head = SCAN_HEADER.size
    off, end = 0, len(raw)
    while off < end:
        ino, dev, size, mtime_ns, ctime_ns, nlink, mode, nlen = unpack(raw, off)
        start = off + head
        out.append((os.fsdecode(raw[start:start + nlen]), _Stat(mode, ino, dev, nlink, size, mtime_ns, ctime_ns)))
        off = start + ((nlen + 7) & ~7)
    out.sort(key=itemgetter(0))
    return out


def _scan_records(raw: bytes) -> tuple[dict[bytes, bytes], list[int]]:
    """``(name -> its whole record (header, name, padding), each record's offset and then len(raw))`` of a scan."""
    out = {}
    offs = []
    head = SCAN_HEADER.size
    name_len = struct.Struct("=I").unpack_from
    off, end = 0, len(raw)
    while off < end:
        offs.append(off)
        (nlen,) = name_len(raw, off + head - 4)
        nxt = off + head + ((nlen + 7) & ~7)
        out[raw[off + head:off + head + nlen]] = raw[off:nxt]
        off = nxt
    offs.append(end)
    return out, offs


def _scan_entry(rec: bytes) -> tuple[str, _Stat]:
    """``(name, lstat)`` of one scan record (see :func:`_scan_records`)."""
    ino, dev, size, mtime_ns, ctime_ns, nlink, mode, nlen = SCAN_HEADER.unpack_from(rec, 0)
    head = SCAN_HEADER.size
    return os.fsdecode(rec[head:head + nlen]), _Stat(mode, ino, dev, nlink, size, mtime_ns, ctime_ns)


class _Listing(Sequence[tuple[str, _Stat]]):
    """One directory's listing: the scan's raw records, and its ``(name, lstat)`` pairs sorted by name.

    The pairs are decoded from ``raw`` on first use, so a walk that can take
    a whole directory over from a previous one (a layered persist, see
    :mod:`._layers`) compares ``raw`` and never decodes an entry.
    """

    __slots__ = ("raw", "_items", "_records", "_offsets")

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self._items: list[tuple[str, _Stat]] | None = None
        self._records: dict[bytes, bytes] | None = None
        self._offsets: list[int] = []

    def records(self) -> dict[bytes, bytes]:
        """name -> its scan record (see :func:`_scan_records`)."""
        if self._records is None:
            self._records, self._offsets = _scan_records(self.raw)
        return self._records

    def offsets(self) -> list[int]:
        """Where each record starts in ``raw``, in listed order, then ``len(raw)``."""
        self.records()
        return self._offsets

    def repeats(self) -> bool:
        """True when the listing gives one name twice (a name renamed while the directory was read: POSIX
        leaves it listed once, twice or not at all)."""
        return len(self.records()) != len(self._offsets) - 1

    def items(self) -> list[tuple[str, _Stat]]:
        if self._items is None:
            self._items = parse_scan(self.raw)
        return self._items

    @overload
    def __getitem__(self, i: int) -> tuple[str, _Stat]: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[tuple[str, _Stat]]: ...

    def __getitem__(self, i: int | slice) -> tuple[str, _Stat] | Sequence[tuple[str, _Stat]]:
        return self.items()[i]

    def __len__(self) -> int:
        return len(self.items())

    def __iter__(self) -> Iterator[tuple[str, _Stat]]:
        return iter(self.items())


def _list_dir(dfd: int) -> Sequence[tuple[str, StatLike]]:
    """``(name, lstat)`` of every entry of the open directory ``dfd``, sorted by name.

    One native call (:func:`sandbox_fs._native.scan_dir`: ``getdents64`` on
    ``dfd`` and an ``fstatat(dfd, name, AT_SYMLINK_NOFOLLOW)`` per name), so
    every ``lstat`` is taken relative to ``dfd`` and never follows a symlink;
    an entry removed between the listing and its ``lstat`` is left out.
    (Tests replace this function to change the tree between a listing and
    the opens that follow it.)

    Raises:
        OSError: the directory cannot be read; EFBIG: its listing needs more than
            :data:`sandbox_fs._native.SCAN_MAX_BYTES`.
    """
    # host-access: none; lists a directory fd opened beneath the workspace Root (no path is walked)
    return _Listing(_native.scan_dir(dfd))


def _source_view(ws: Root) -> Root:
    """The Root every entry the walk keeps is opened through: the workspace's own fd, read-only, no symlinks.

    ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`` from the workspace Root's fd
    (a ``dup`` of it; the caller closes the view), so a path resolves only
    through real directories beneath the workspace, at the moment of use.
    """
    return ws.with_options(read_only=True, no_symlinks=True)


def _still_listed(dfd: int, name: str) -> bool:
    """True when ``name`` still exists in the directory open on ``dfd`` (the walk's held listing fd)."""
    try:
        os.stat(name, dir_fd=dfd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot tell: treat as changed (retryable), never as vanished


def _open_listed(src: Root, item: _ListedEntry, flags: int, dfd: int | None = None) -> int | None:
    """Open a listed entry by its path beneath the workspace Root, now; None when it has vanished.

    The path is resolved from the workspace Root's own fd (``src``, see
    :func:`_source_view`: ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``, ``O_NOFOLLOW``
    on the leaf) at the moment of use, never relative to a directory fd the
    walk has held since the listing: that directory may have been moved out
    of the workspace meanwhile (and anything written into it since).  The
    caller ``fstat``-checks that the fd is the inode the listing's ``lstat``
    saw (:func:`_check_identity`, :func:`_member_stat`).

    ``ENOENT``: with ``dfd`` (the held directory the name was listed in),
    an entry also gone from there has vanished (None: skipped, like a file
    deleted mid-walk); one still there is no longer at its path (a parent
    was moved or renamed): :class:`SnapshotSourceChangedError`.  Without
    ``dfd``, ``ENOENT`` is a vanished entry.

    Args:
        src: the source view of the workspace Root.
        item: the listed entry (its sandbox path and listing ``lstat``).
        flags: ``os.O_*`` read flags (``O_PATH``, ``O_DIRECTORY``, ``O_NONBLOCK`` ...).
        dfd: the walk's fd of the directory ``item`` was listed in, if still held.

    Raises:
        SnapshotSourceChangedError: a symlink, a special file (for a read
            open), a non-directory or an escape on its path now, or ``ENOENT``
            while still listed (retryable).
        OSError: any other failure (with its sandbox path, never a host path).
    """
    if _hooks.current is not None:
        _hooks.fire("persist.open_entry", root=src, path=item.path)
    try:
        return src.open_fd(item.path, flags, follow_symlinks=False)
    except (OSError, SandboxError) as exc:
        return _open_error(exc, item, dfd)


def _open_error(exc: OSError | SandboxError, item: _ListedEntry, dfd: int | None) -> None:
    """What an open of a listed entry by its path that raised ``exc`` means (see :func:`_open_listed`).

    Returns:
        None: the entry vanished (``ENOENT``, and gone from ``dfd`` too when held).

    Raises:
        SnapshotSourceChangedError: the entry or a parent changed, or another process holds a write
            lease on the file (``EAGAIN`` of the ``O_NONBLOCK`` open; retryable).
        OSError, SandboxError: any other failure (with its sandbox path, never a host path).
    """
    if isinstance(exc, FileNotFoundError):
        if dfd is not None and _still_listed(dfd, item.name):
            raise SnapshotSourceChangedError("entry is no longer at its path (a parent directory was moved "
                                             "while the workspace was being persisted)",
                                             sandbox_path=item.path) from None
        return None
    if getattr(exc, "errno", None) == errno.EAGAIN:
        # O_NONBLOCK open of a file another process holds a write lease on (it is told to give it up),
        # or a rename racing the resolution on every retry: in use or changing now, not a fault
        raise SnapshotSourceChangedError("entry is held by another process (a file lease) or its path was "
                                         "being renamed while the workspace was being persisted",
                                         sandbox_path=item.path) from None
    # ELOOP: a symlink now; special_file: Root refuses FIFOs/devices; ENOTDIR/EXDEV: a parent swapped
    if getattr(exc, "code", None) in _CHANGED_CODES or \
            getattr(exc, "errno", None) in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO, errno.EXDEV):
        raise SnapshotSourceChangedError("entry was replaced while it was being persisted",
                                         sandbox_path=item.path) from None
    if isinstance(exc, SandboxError):
        raise exc
    _native.raise_errno(exc.errno or errno.EIO, "persist", item.path)
    raise AssertionError("unreachable")  # pragma: no cover


def _check_identity(fd: int, item: _ListedEntry) -> os.stat_result:
    """``fstat`` of an entry just opened by path: the very inode (and type) the listing's ``lstat`` saw.

    Raises:
        SnapshotSourceChangedError: another inode or another type (replaced
            or moved between the listing and the open; retryable).
    """
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (item.st.st_dev, item.st.st_ino) or \
            _stat.S_IFMT(st.st_mode) != _stat.S_IFMT(item.st.st_mode):
        raise SnapshotSourceChangedError("entry was replaced while it was being persisted", sandbox_path=item.path)
    return st


def _lstat_listed(src: Root, item: _ListedEntry, dfd: int | None = None) -> os.stat_result | None:
    """The ``lstat`` of a listed entry taken by its path beneath the workspace Root now, identity-checked.

    What the snapshot records of a directory (mode, mtime) or a symlink
    comes from this, never from the listing alone.  None when it vanished
    (see :func:`_open_listed`).

    Raises:
        SnapshotSourceChangedError: see :func:`_open_listed` and :func:`_check_identity`.
    """
    fd = _open_listed(src, item, os.O_PATH, dfd)
    if fd is None:
        return None
    try:
        return _check_identity(fd, item)
    finally:
        os.close(fd)


def _readlink_listed(src: Root, item: _ListedEntry, dfd: int | None = None) -> tuple[str, os.stat_result] | None:
    """``(target, lstat)`` of a listed symlink, read through an ``O_PATH|O_NOFOLLOW`` fd opened by its path.

    The link is opened beneath the workspace Root (:func:`_open_listed`),
    ``fstat``-checked to be the listed symlink, and read with
    ``readlinkat(fd, "")``: the target read is the one of the checked inode.
    None when it vanished.

    Raises:
        SnapshotSourceChangedError: see :func:`_open_listed` and :func:`_check_identity`.
        OSError: reading the link failed.
    """
    fd = _open_listed(src, item, os.O_PATH, dfd)
    if fd is None:
        return None
    try:
        st = _check_identity(fd, item)
        return os.fsdecode(os.readlink(b"", dir_fd=fd)), st
    finally:
        os.close(fd)


@dataclass(frozen=True)
class _Prune:
    """What the walk never enters nor records, besides in-flight names and the workspace id file.

    Attributes:
        excluded: normalized sandbox paths left out, with everything under them.
        mount_points: normalized sandbox paths of mount points (others are found by ``st_dev``).
        skip_ids: ``(st_dev, st_ino)`` of directories never entered (extra path grants).
    """

    excluded: frozenset[str] = frozenset()
    mount_points: frozenset[str] = frozenset()
    skip_ids: frozenset[tuple[int, int]] = frozenset()

    @classmethod
    def of(cls, excluded: Iterable[str], mount_points: Iterable[str],
           skip_ids: Iterable[tuple[int, int]]) -> _Prune:
        """Normalize the sandbox paths (see :func:`sandbox_fs.paths.normalize`).

        Raises:
            InvalidPathError: a path is not a valid sandbox path.
        """
        return cls(_norm_set(excluded), _norm_set(mount_points), frozenset(skip_ids))


@dataclass
class _DirFrame:
    """A directory the walk holds open: its fd (owned by the walk) and the admitted subdirectories to enter."""

    dfd: int
    subdirs: list[_ListedEntry]
    next: int = 0  # index in ``subdirs`` of the next one to enter


#: a layered walk's hook, called with each directory's sandbox path, listing and fd before it is split:
#: the admitted subdirectories when it recorded the directory's entries itself (taken over from the
#: parent generation, whole or all but the changed ones), None to walk it entry by entry
BeginDir = Callable[[str, Sequence[tuple[str, StatLike]], int], "list[_ListedEntry] | None"]


#: a layered walk's hook: True when ``raw`` (a directory's scan records, at that sandbox path) is byte for byte a
#: listing an earlier walk checked for a repeated name and found none (the same bytes hold the same names)
KnownListing = Callable[[str, bytes], bool]


def _checked_listing(dfd: int, dpath: str, known: KnownListing | None) -> Sequence[tuple[str, StatLike]]:
    """:func:`_list_dir` of the walk's directory ``dfd`` (sandbox path ``dpath``), never one name twice.

    A listing ``known`` holds unchanged (the same names in the same places as
    one the parent walk already checked) is not searched for repeats again.

    Raises:
        SnapshotLimitError: the listing needs more than :data:`sandbox_fs._native.SCAN_MAX_BYTES`.
        SnapshotSourceChangedError: the directory was removed after it was opened, or its listing
            gave a name twice (retryable).
        OSError: the directory cannot be read (with its sandbox path, never a host path).
    """
    try:
        listing = _list_dir(dfd)
    except OSError as exc:
        if exc.errno == errno.EFBIG:  # the scan's own bound, never a kernel errno (see scan_dir)
            raise SnapshotLimitError("directory has more names than one listing holds",
                                     sandbox_path=dpath or ".",
                                     context={"max_listing_bytes": _native.SCAN_MAX_BYTES}) from None
        if exc.errno == errno.ENOENT:  # getdents64 of a directory removed after it was opened
            raise SnapshotSourceChangedError("a directory was removed while it was being persisted",
                                             sandbox_path=dpath or ".") from None
        _native.raise_errno(exc.errno or errno.EIO, "persist", dpath or ".")
        raise AssertionError("unreachable")  # pragma: no cover
    if isinstance(listing, _Listing) and not (known is not None and known(dpath, listing.raw)) \
            and listing.repeats():  # never one path twice in a walk
        raise SnapshotSourceChangedError("a directory changed while it was listed (a name came twice)",
                                         sandbox_path=dpath or ".")
    return listing


def _walk(ws: Root, src: Root, prune: _Prune, skipped: list[tuple[str, str]],
          admit_dir: Callable[[_ListedEntry, int], bool],
          begin_dir: BeginDir | None = None,
          known: KnownListing | None = None) -> Generator[tuple[int, list[_ListedEntry]], None, None]:
    """Deterministic top-down walk over directory fds, pruning excluded paths, mount points and grant roots.

    Yields ``(dfd, nondirs)`` once per directory: its open fd (valid until
    the next iteration; it is only the *listing*: the caller opens every
    entry it reads by its path beneath the workspace Root, see
    :func:`_open_listed`, and may use ``dfd`` only to tell a vanished entry
    from a moved one) and its non-directory entries.  Subdirectories are
    offered to ``admit_dir(entry, dfd)`` (the persist policy, which records
    them) in name order while their parent is listed, and the admitted ones
    are entered after the parent's non-directories, depth first: the order
    of :meth:`Root.walk`.  With ``begin_dir``, each listing is first offered
    to it (a layered persist taking an unchanged directory over whole: see
    :data:`BeginDir`); a directory it takes yields no non-directories and
    enters the subdirectories it returns.  A listing that ``known`` says is
    byte for byte one an earlier walk found without a repeated name (see
    :data:`KnownListing`) is not searched for one again.

    A listing comes from a held directory fd, and a held fd can be moved
    out of the workspace at any time (with anything written into it
    afterwards), so nothing read through it is trusted: every directory
    after the top is opened by its path beneath the workspace Root's own
    fd (``src``: ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``, ``O_NOFOLLOW``)
    when it is entered, and ``fstat``-checked to be the very inode its
    listing's ``lstat`` saw, so a directory moved out, swapped for a
    symlink or for another directory (a grant root, a mount point) after
    the listing is never entered.  Every ``lstat`` of a listing is taken
    relative to the open directory, so a path longer than PATH_MAX is
    listed like any other (and refused by the policy before it is opened
    by path).  A directory that vanished before it was entered is skipped
    (like a vanished file); a swapped or moved one is
    :class:`SnapshotSourceChangedError`.

    Open fds: one per ancestor that still has a subdirectory to enter (a
    directory's fd is closed as soon as its last subdirectory is opened),
    so at most the depth, never the width of the tree.

    Raises:
        SnapshotSourceChangedError: a directory was replaced after its listing, removed after it
            was opened (before or while it was listed), or its listing gave a name twice (retryable).
        SnapshotLimitError: a directory's listing needs more than :data:`sandbox_fs._native.SCAN_MAX_BYTES`.
        OSError: a directory cannot be read (with its sandbox path, never a host path).
    """
    root_dev = ws.stat(".").st_dev
    frames: list[_DirFrame] = []
    cur: tuple[int, str] | None = (ws.open_dir_fd("."), "")
    try:
        while cur is not None:
            dfd, dpath = cur
            frame = _DirFrame(dfd, [])
            frames.append(frame)
            cur = None
            listing = _checked_listing(dfd, dpath, known)
            taken = begin_dir(dpath, listing, dfd) if begin_dir is not None else None
            if taken is not None:
                frame.subdirs = taken
                yield dfd, []
            else:
                frame.subdirs, nondirs = _split_listing(listing, dfd, dpath, root_dev, prune, skipped, admit_dir)
                yield dfd, nondirs
            cur = _enter_next(src, frames)
    finally:
        if cur is not None:
            os.close(cur[0])
        for frame in frames:
            os.close(frame.dfd)


def _split_listing(listing: Iterable[tuple[str, StatLike]], dfd: int, dpath: str, root_dev: int, prune: _Prune,
                   skipped: list[tuple[str, str]],
                   admit_dir: Callable[[_ListedEntry, int], bool]) -> tuple[list[_ListedEntry], list[_ListedEntry]]:
    """``(admitted subdirectories, other entries)`` of ``listing``, of the directory open on ``dfd`` (``dpath``).

    Leaves out what :func:`_classify` leaves out.  Every other subdirectory
    is offered to ``admit_dir``, in name order.

    Raises:
        What ``admit_dir`` raises.
    """
    prefix = dpath + "/" if dpath else ""
    dirs = []
    nondirs = []
    for name, st in listing:
        entry = _classify(prefix, name, st, root_dev, prune, skipped)
        if entry is None:
            continue
        if entry.kind != "dir":
            nondirs.append(entry)
        elif admit_dir(entry, dfd):
            dirs.append(entry)
    return dirs, nondirs


def _classify(prefix: str, name: str, st: StatLike, root_dev: int, prune: _Prune,
              skipped: list[tuple[str, str]]) -> _ListedEntry | None:
    """The listed entry ``name`` of the directory ``prefix`` (its sandbox path and "/", or "" at the top).

    None for what the walk leaves out, recording why in ``skipped``:
    excluded paths, in-flight names, mount points (another device than
    ``root_dev``, or listed) and grant directories; and, at the top, the
    session's workspace id file (not recorded).
    """
    p = prefix + name
    if prune.excluded and _excluded(p, prune.excluded):
        skipped.append((p, "excluded"))
        return None
    isdir = _stat.S_ISDIR(st.st_mode)
    if name.startswith(_IN_FLIGHT_PREFIXES):
        skipped.append((p, "in-flight staging" if isdir else "in-flight atomic write"))
        return None
    if not prefix and name == WORKSPACE_ID_NAME:
        return None  # the session's binding to this workspace, not workspace content
    if not isdir:
        return _ListedEntry(p, kind_of(st.st_mode), st, name)
    if st.st_dev != root_dev or p in prune.mount_points:
        skipped.append((p, "mount point"))
        return None
    if (st.st_dev, st.st_ino) in prune.skip_ids:
        skipped.append((p, "extra path grant"))
        return None
    return _ListedEntry(p, "dir", st, name)


def _enter_next(src: Root, frames: list[_DirFrame]) -> tuple[int, str] | None:
    """Open the next admitted subdirectory, depth first: ``(its fd, its sandbox path)``; None: the walk is over.

    Opened by its path beneath the workspace Root now and identity-checked
    (see :func:`_walk`); one that vanished since its listing is skipped.
    A frame's fd is closed once its last subdirectory is opened (or it has
    none left).

    Raises:
        SnapshotSourceChangedError: the subdirectory was replaced after its listing (retryable).
        OSError: it cannot be opened (with its sandbox path).
    """
    while frames:
        frame = frames[-1]
        if frame.next >= len(frame.subdirs):
            frames.pop()
            os.close(frame.dfd)
            continue
        entry = frame.subdirs[frame.next]
        frame.next += 1
        cfd = _open_listed(src, entry, _SUBDIR_FLAGS, frame.dfd)  # by path beneath the Root, now
        if cfd is None:
            continue  # removed since the listing: skipped, like a vanished file
        if frame.next >= len(frame.subdirs):  # its last subdirectory: the parent's fd is no longer needed
            frames.pop()
            os.close(frame.dfd)
        try:
            _check_identity(cfd, entry)
        except BaseException:
            os.close(cfd)
            raise
        return cfd, entry.path
    return None


def _open_member(src: Root, item: _ListedEntry, dfd: int | None = None) -> int | None:
    """Open a listed regular file for reading by its path beneath the workspace Root; None when it vanished.

    Opened through the source view (:func:`_open_listed`: from the Root's
    own fd, no symlink anywhere on the path, ``O_NOFOLLOW | O_NONBLOCK`` so
    a FIFO never blocks), never by its name relative to a held directory
    fd.  ``dfd`` (the walk's fd of the directory it was listed in, when
    held) only tells a vanished file from a moved one.  The caller
    ``fstat``-checks the fd (:func:`_member_stat`).

    Raises:
        SnapshotSourceChangedError: it is now a symlink or a special file,
            a parent was swapped or moved (retryable).
        OSError: any other failure (with its sandbox path).
    """
    return _open_listed(src, item, _MEMBER_FLAGS, dfd)


#: the fields ``sfs_open_member`` writes (see :meth:`sandbox_fs.root.Root.open_member_fd`): the fstat of
#: the opened fd (st_ino and st_dev unsigned; each time as seconds and nanoseconds), then the probe's answer
_MEMBER_OUT = struct.Struct("=qQQqqqqqqq")
assert _MEMBER_OUT.size == 8 * _native.MEMBER_FIELDS


class MemberOpener:
    """Opens listed regular files by path and identity-checks them, one native call each (see :meth:`open`).

    Holds the buffer the native call writes the ``fstat`` into: one per walk (one thread).
    """

    __slots__ = ("_buf", "_out", "_unpack")

    def __init__(self) -> None:
        self._buf = bytearray(_MEMBER_OUT.size)
        self._out = _native.member_out(self._buf)
        self._unpack = _MEMBER_OUT.unpack_from

    def open(self, src: Root, item: _ListedEntry, dfd: int | None,
             probe: bool) -> tuple[int, _Stat, bool] | None:
        """:func:`_open_member` and :func:`_member_stat` in one native call: ``(fd, its fstat, writable)``.

        The file is opened by its path beneath the workspace Root now, as
        :func:`_open_listed` opens it (``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``
        from the Root's own fd, ``O_NOFOLLOW | O_NONBLOCK``), and the ``fstat`` of
        that very fd must show a regular file with the listed device and
        inode number.  ``writable``: with ``probe``, False only when a read
        lease could be taken (and was released at once): no open file
        description can write the inode (see ``_entries._open_for_writing``);
        True without ``probe``.  None when the file vanished.

        Raises:
            SnapshotSourceChangedError: a symlink, a special file or another
                inode now, a parent swapped or moved, or another process holds a
                write lease on the file (retryable).
            OSError: any other failure (with its sandbox path).
        """
        if _hooks.current is not None:
            _hooks.fire("persist.open_entry", root=src, path=item.path)
        try:
            fd = src.open_member_fd(item.path, _MEMBER_FLAGS, probe, self._out)
        except (OSError, SandboxError) as exc:
            return _open_error(exc, item, dfd)
        mode, ino, dev, nlink, size, msec, mnsec, csec, cnsec, writable = self._unpack(self._buf)
        if ino != item.st.st_ino or dev != item.st.st_dev or not _stat.S_ISREG(mode):
            os.close(fd)
            raise SnapshotSourceChangedError("entry was replaced while it was being persisted",
                                             sandbox_path=item.path)
        st = _Stat(mode, ino, dev, nlink, size, msec * 1_000_000_000 + mnsec, csec * 1_000_000_000 + cnsec)
        return fd, st, writable != 0


# errnos / codes of an entry changed under the walk: gone, no longer a symlink, a parent swapped
_CHANGED_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EINVAL, errno.ELOOP, errno.EXDEV, errno.ENXIO})
_CHANGED_CODES = frozenset({"path_escape", "symlink_refused", "special_file"})


@contextlib.contextmanager
def _source_changed(path: str) -> Iterator[None]:
    """Turn the errors of an entry changing under the walk into the retryable SnapshotSourceChangedError."""
    try:
        yield
    except (SnapshotError, UnsafeArchiveMemberError, ArchiveLimitError):
        raise
    except (OSError, SandboxError) as exc:
        if getattr(exc, "code", None) in _CHANGED_CODES or getattr(exc, "errno", None) in _CHANGED_ERRNOS:
            raise SnapshotSourceChangedError("entry changed while the workspace was being persisted",
                                             sandbox_path=path) from None
        raise
