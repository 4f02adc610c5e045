"""The extractor's symlink members: recorded while streaming, created last.

A symlink member is checked lexically at once (``target_parts``) and
recorded in an anonymous host temp file (the spool: never the workspace);
only a digest of its path stays in memory.  The creation pass
(``_create_symlinks``) runs from ``finish``, after every file, directory and
hard link: it refuses a target that passes through another symlink (of this
archive or on disk) and link cycles, then creates each link through the work
Root (``RESOLVE_NO_SYMLINKS``) and sets its mtime through an ``O_PATH`` fd
proven to be it.

:class:`PendingSymlinks` is a part of :class:`~sandbox_fs.archive._writer.Extractor`
(its base class): its state lives on the extractor, set up by its ``__init__``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat as _stat
import struct
import tempfile
from typing import IO, TYPE_CHECKING, Callable, Iterator

from .. import _native
from ..errors import PathEscapeError, SymlinkRefusedError
from ..root import Root, Subtree
from ._errors import UnsafeArchiveMemberError
from ._meta import DIR, FILE, LINK, identity, mtime_ns_of, path_key
from ._names import target_parts

if TYPE_CHECKING:
    from ._models import ArchiveLimits, ExtractPolicy

__all__ = ["PendingSymlinks"]

_SYMLINK_RECORD = struct.Struct("<HHHq?")  # path len, target len, member len, mtime_ns, has mtime


class PendingSymlinks:
    """Symlink members, spooled and created last (see the module docstring); a base of ``Extractor``."""

    limits: ArchiveLimits
    policy: ExtractPolicy
    work: Root | Subtree
    symlinks: int
    shown_dest: str
    _kinds: dict[bytes, str]
    _pending_live: dict[bytes, int]
    _pending_seq: int
    _spool: IO[bytes] | None
    _dir_ids: dict[bytes, tuple[int, int]]
    _dest_root: Root | None

    if TYPE_CHECKING:
        fresh: bool

        def name(self, name: str | bytes) -> bytes: ...
        def _skip_or_refuse(self, setting: str, rule: str, member: str | bytes, reason: str) -> None: ...
        def _parents(self, path: bytes, member: str | bytes) -> None: ...
        def _guard(self, member: str | bytes, fn: Callable[[], object]) -> object: ...
        def _entered(self) -> contextlib.AbstractContextManager[Root]: ...

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
        key = path_key(path)
        if self._kinds.get(key) in (FILE, DIR):
            raise UnsafeArchiveMemberError("conflict", name, "a symlink never replaces an earlier file or directory")
        self._parents(path, name)
        mtime_ns = mtime_ns_of(mtime) if self.policy.apply_mtime else None
        tb = target if isinstance(target, bytes) else target.encode("utf-8", "surrogateescape")
        mb = (name if isinstance(name, bytes) else name.encode("utf-8", "surrogateescape"))[:4096]
        if self._spool is None:
            self._spool = tempfile.TemporaryFile()  # host temp dir, never the workspace
        record = _SYMLINK_RECORD.pack(len(path), len(tb), len(mb), mtime_ns or 0, mtime_ns is not None)
        self._spool.write(record + path + tb + mb)
        self._pending_seq += 1
        self._pending_live[key] = self._pending_seq
        self._kinds[key] = LINK

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
            head = spool.read(_SYMLINK_RECORD.size)
            if not head:
                return
            plen, tlen, mlen, mtime_ns, has_mtime = _SYMLINK_RECORD.unpack(head)
            path, target, member = spool.read(plen), spool.read(tlen), spool.read(mlen)
            seq += 1
            if self._pending_live.get(path_key(path)) == seq:
                yield path, target, (mtime_ns if has_mtime else None), member

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
        finals[path_key(path)] = path_key(final)
        if not names:
            return  # the link's own directory or one of its ancestors: passes through nothing
        h = hashlib.blake2b(base, digest_size=16)
        sep = bool(base)
        unknown = False
        for name in names[:-1]:
            if sep:
                h.update(b"/")
            h.update(name)
            sep = True
            kind = self._kinds.get(h.copy().digest())
            if kind == LINK:
                raise UnsafeArchiveMemberError("symlink_target", member,
                                               "symlink target passes through another symlink")
            if kind is None:
                unknown = True
        if not check_roots:
            return
        if sep:
            h.update(b"/")
        h.update(names[-1])
        tail = b"/".join(names)
        if self._kinds.get(h.digest()) is None:
            # the target itself is not an archive member: it must not be a symlink already on disk
            # (links between members are checked member by member; a planted one is not)
            full = base + b"/" + tail if base else tail
            if any(self._is_link_on_disk(r, full) for r in check_roots):
                raise UnsafeArchiveMemberError("symlink_target", member,
                                               "symlink target is a symlink that is not in the archive")
        elif unknown and len(names) > 1:
            deepest = base + b"/" + tail.rpartition(b"/")[0] if base else tail.rpartition(b"/")[0]
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
            cur = path_key(path)
            while cur in finals and cur not in acyclic:
                if cur in seen:
                    raise UnsafeArchiveMemberError("symlink_target", member, "symlink members form a cycle")
                seen.add(cur)
                chain.append(cur)
                cur = finals[cur]
            acyclic.update(chain)
        del finals, acyclic
        for path, target, mtime_ns, member in self._pending_records():
            try:
                self._guard(member, lambda: self.work.symlink(target, path))
            except FileExistsError:
                raise UnsafeArchiveMemberError("conflict", member, "the symlink's name already exists") from None
            if mtime_ns is not None:
                self._set_link_time(path, mtime_ns, member)
            self.symlinks += 1

    def _set_link_time(self, path: bytes, mtime_ns: int, member: bytes) -> None:
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
                if parent and identity(os.fstat(pfd)) != self._dir_ids.get(path_key(parent)):
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
                        _native.set_times_fd(fd, mtime_ns, "extract", self.shown_dest)
                    except OSError as exc:
                        if exc.errno != errno.EINVAL:
                            raise
                finally:
                    os.close(fd)
            finally:
                os.close(pfd)
