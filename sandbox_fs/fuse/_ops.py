"""The overlay daemon's request handlers (``pyfuse3.Operations``), all through held :class:`~sandbox_fs.root.Handle` objects.

Every handler:

* computes the request's *sandbox path* from the dentry table
  (:meth:`~sandbox_fs.fuse._inodes.InodeTable.path_of`), unless nothing
  would read it: no fault rule is set and the audit buffer is full (the
  event is only counted as dropped), see :meth:`OverlayOps._req_path`;
* checks the fault rules first (an injected errno fires before any work);
* performs the operation on handles: a held directory handle plus one name,
  or a held ``O_PATH`` handle; an inode is opened for I/O through one of its
  dentries and verified to be the same inode (``expect``), never by path;
* records exactly one audit event (op, sandbox path, errno or 0);
* then lets the inode table close handles past its budget (fd pressure,
  :meth:`~sandbox_fs.fuse._inodes.InodeTable.trim`), never during the request;
* answers any failure with an errno: ``FUSEError`` passes, an ``OSError``
  gives its errno, anything else EIO (logged).  Nothing else may escape a
  handler: it would end ``pyfuse3.main()`` and the mount with it.

Policy: read-only trees give EROFS, set-id bits EPERM, special files per
:class:`OverlayPolicy` (EPERM), and the workspace's byte and inode quotas
are charged *before* each write, truncate and create (EDQUOT; the whole
request fails).  An unlinked inode that is still open stays charged until
its last release.

Symlink targets (:func:`check_symlink`, EPERM) are judged against the root
of the tree the link is in (the workspace, or a host-directory mount's own
root), at creation and again whenever a symlink gets a new name: renamed
(either side of an exchange) or hard-linked.  In the workspace a
*directory* rename that carries relative links inside it to another depth
is not re-checked (it would mean walking the subtree): snapshot persist
refuses such links when it runs, and at run time the confined command's
private root holds nothing outside the workspace for them to reach.  A
host-directory mount is a tree the host uses too, and the host follows
links in it with its own root, so there the rule is a class one
(:func:`check_shared_symlink`): no absolute target and no ``..``
component at all.  Such a link names only what lies at or beneath its own
directory, wherever a rename (ours or the host's) moves that directory.

Handlers never ``await``: each runs to completion on the trio thread (the
prototype measured worker threads as slower), so the tables need no lock.
Invalidation is *not* done here (it can deadlock from a handler): see
``_daemon.Invalidator``.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import pyfuse3
from pyfuse3 import EntryAttributes, FileInfo, FUSEError

from ..root import Handle
from ._audit import AuditLog
from ._faults import FaultRules
from ._inodes import MAX_DIR_DEPTH, Inode, InodeTable, Tree
from ._quota import Quota, name_cost
from ._rules import OverlayPolicy, check_mode, check_shared_symlink, check_special, check_symlink

log = logging.getLogger("sandbox_fs.fuse.daemon")

T = TypeVar("T")

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2

# The open(2) flags passed on to the backing file: access mode and the
# flags whose meaning survives the hop.  O_DIRECT is dropped (the daemon's
# buffers are not aligned), O_CREAT/O_EXCL/O_NOCTTY come from Handle.open.
# O_APPEND is dropped too: the kernel applies it itself (each write request
# carries the offset it chose, the file's size for an appending file), and
# it alone sees fcntl(F_SETFL) clear it; kept on the daemon's fd, pwrite
# would append whatever the offset, also after the command cleared it.
OPEN_FLAGS_KEPT = (os.O_ACCMODE | os.O_TRUNC | os.O_SYNC | os.O_DSYNC |
                   os.O_NOATIME | os.O_NONBLOCK)
WRITE_ACCESS = os.O_WRONLY | os.O_RDWR


@dataclass(eq=False)
class OpenFile:
    """One open file handle (``fh`` = the backing fd)."""

    node: Inode


MAX_DIR_STREAMS = 1024
"""Most directory streams (a backing fd and its getdents buffer, ~32 KiB) held at once, by all open
directory handles together.  Past it the least recently read handle's stream is closed; its next
readdir reopens the directory and skips to the kernel's offset.  Nothing per handle grows with the
directory's size: a listing is never copied (64 handles on one 20,000-name directory cost ~2 MiB)."""


class DirStream:
    """One directory read in order from a backing fd: ``peek`` the next entry, ``take`` it once sent."""

    def __init__(self, node: Inode, skip: int) -> None:
        self.fd = node.handle.open_dir()
        try:
            # host-access: none: lists a directory fd opened beneath the tree by its Handle
            self._it = os.scandir(self.fd)
            for _ in range(skip):
                if next(self._it, None) is None:
                    break
        except BaseException:
            os.close(self.fd)
            raise
        self._pending: tuple[bytes, int] | None = None

    def peek(self) -> tuple[bytes, int] | None:
        """The next entry ``(name, d_ino)`` (the same until :meth:`take`), or None at the end."""
        if self._pending is None:
            entry = next(self._it, None)
            if entry is None:
                return None
            self._pending = (os.fsencode(entry.name), entry.inode())
        return self._pending

    def take(self) -> None:
        """The entry :meth:`peek` gave was used (sent or skipped)."""
        self._pending = None

    def close(self) -> None:
        self._it.close()
        os.close(self.fd)


@dataclass(eq=False)
class OpenDir:
    """One open directory handle (``fh`` is an id): where its stream is, by the offsets given to the kernel.

    ``pos`` is the number of raw entries consumed; the entry at ``pos`` is
    replied with offset ``pos + 1``.  ``stream`` is None until the first
    readdir, and again after it was closed to stay under MAX_DIR_STREAMS.
    """

    node: Inode
    pos: int = 0
    stream: DirStream | None = None


class OverlayOps(pyfuse3.Operations):
    """The request handlers of one overlay mount.

    Args:
        table: the inode table (its root is the workspace root).
        policy: the overlay policy (special files, timeouts).
        mounts: the host-directory trees by sandbox path (``"a/b"``).
        audit: where one event per request goes.
        faults: fault rules checked first in every handler.
        quota: the workspace's byte and inode quota (trees other than the
            workspace are not charged).
    """

    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, table: InodeTable, policy: OverlayPolicy, mounts: dict[str, Tree],
                 audit: AuditLog, faults: FaultRules, quota: Quota) -> None:
        super().__init__()
        self.table = table
        self.policy = policy
        self.mounts = mounts
        self.audit = audit
        self.faults = faults
        self.quota = quota
        self.files: dict[int, OpenFile] = {}
        self.dirs: dict[int, OpenDir] = {}
        self._streams: OrderedDict[int, OpenDir] = OrderedDict()  # dir fh -> handle with a stream, LRU first
        self._next_dir_fh = 1

    # ------------------------------------------------------------ plumbing

    def _guard(self, op: str, path: str, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` as request ``op`` on ``path``: fault rules, errno mapping, one audit event."""
        err = 0
        try:
            self.faults.check(op, path)
            return fn(*args)
        except FUSEError as e:
            err = e.errno
            raise
        except OSError as e:
            err = e.errno or errno.EIO
        except ValueError:
            err = errno.EINVAL
        except Exception:
            log.exception("overlay: %s failed", op)
            err = errno.EIO
        finally:
            self.audit.record(op, path, err)
            self.table.trim()
        raise FUSEError(err)

    def _attr(self, node: Inode, st: os.stat_result) -> EntryAttributes:
        a = EntryAttributes()
        a.st_ino = node.ino
        a.entry_timeout = node.tree.entry_timeout_s
        a.attr_timeout = node.tree.attr_timeout_s
        a.st_mode = st.st_mode
        a.st_nlink = st.st_nlink
        a.st_uid = st.st_uid
        a.st_gid = st.st_gid
        a.st_rdev = st.st_rdev
        a.st_size = st.st_size
        a.st_blksize = st.st_blksize
        a.st_blocks = st.st_blocks
        a.st_atime_ns = st.st_atime_ns
        a.st_mtime_ns = st.st_mtime_ns
        a.st_ctime_ns = st.st_ctime_ns
        return a

    def _writable(self, node: Inode) -> None:
        if node.tree.read_only:
            raise OSError(errno.EROFS, "read-only")

    def _not_mount_point(self, path: str) -> None:
        if path in self.mounts:
            raise OSError(errno.EBUSY, "a mount point")

    def _charged(self, node: Inode) -> bool:
        return node.tree.index == 0

    def _req_path(self, ino: int, name: bytes | None = None) -> str:
        """The sandbox path of a request on ``ino`` (``name`` in it) for its fault rules and audit event.

        ``""`` when no fault rule is set and the audit buffer is full: the
        event would only be counted as dropped, and no rule matches.  (No
        await separates this from the event's recording, so the buffer
        cannot drain in between.)  Handlers that decide something by path
        (mount points) compute it themselves.
        """
        if self.faults or not self.audit.full:
            return self.table.path_of(ino, name)
        return ""

    def _child(self, pnode: Inode, name: bytes) -> tuple[Inode, os.stat_result]:
        """The inode ``name`` in ``pnode`` refers to (the mount's root at a mount path), learned, with its stat.

        One ``fstat``, of the new handle, before the table learns it: it
        gives the key the table files it under and the attributes replied
        (for an inode already known the new handle is on the same inode).
        """
        tree = self.mounts.get(self.table.path_of(pnode.ino, name)) if self.mounts else None
        if tree is not None:
            handle = tree.root.handle(".")
        else:
            tree = pnode.tree
            handle = pnode.handle.lookup(name)
        try:
            st = handle.stat()
        except BaseException:
            handle.close()
            raise
        node, _ = self.table.learn(pnode.ino, name, handle, tree)
        return node, st

    def _reopen(self, node: Inode, flags: int) -> int:
        """A real fd on ``node`` through one of its dentries, verified to be ``node``'s inode."""
        expect = node.handle.key
        dentries = ([node.dentry] if node.dentry in node.links else []) + list(node.links)
        for parent, name in dentries:
            pnode = self.table.find(parent)
            if pnode is None:
                continue
            try:
                return pnode.handle.open(name, flags, expect=expect)
            except OSError as e:
                if e.errno not in (errno.ENOENT, errno.ESTALE):
                    raise
        raise OSError(errno.ESTALE, "no name of this inode is left")

    def _check_entry(self, pnode: Inode, name: bytes, extra_bytes: int = 0) -> None:
        """Refuse a new inode called ``name`` in ``pnode`` past the quota (its inode, its name's cost, ``extra_bytes``)."""
        if self._charged(pnode):
            self.quota.check_new_inode()
            self.quota.check_grow(name_cost(name) + extra_bytes)

    def _created(self, pnode: Inode, name: bytes, handle: Handle, extra_bytes: int = 0) -> EntryAttributes:
        """Learn a new entry made by this request; the kernel now holds one lookup on it."""
        if self._charged(pnode):
            self.quota.add_inodes(1)
            self.quota.add_bytes(name_cost(name) + extra_bytes)
        node, _ = self.table.learn(pnode.ino, name, handle, pnode.tree)
        node.lookups += 1
        st = node.handle.stat()
        if st.st_mode & (stat.S_ISUID | stat.S_ISGID) and not stat.S_ISLNK(st.st_mode):
            # a directory made in a set-group-ID directory inherits the bit: never keep it
            node.handle.chmod(stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))
            st = node.handle.stat()
        return self._attr(node, st)

    def _release_unlinked(self, node: Inode | None, handle: Handle) -> None:
        """After a name was removed: uncharge the inode if that was its last link and nothing holds it open."""
        st = handle.stat()
        if st.st_nlink > 0 or (node is not None and not self._charged(node)):
            return
        if node is not None and node.opens > 0:
            node.orphaned = True
            return
        self.quota.add_inodes(-1)
        if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
            self.quota.add_bytes(-st.st_size)

    def _check_depth(self, parent: int, moved: tuple[Inode, bytes] | None = None) -> None:
        """Refuse a directory made (or ``moved``: ``(its directory, its name)``) into ``parent`` deeper than MAX_DIR_DEPTH (EMLINK)."""
        if self.table.depth_of(parent) + 1 <= MAX_DIR_DEPTH:
            return
        if moved is not None:
            try:
                h = moved[0].handle.lookup(moved[1])
            except FileNotFoundError:
                return  # the rename itself reports it
            try:
                if not stat.S_ISDIR(h.stat().st_mode):
                    return
            finally:
                h.close()
        raise OSError(errno.EMLINK, f"directories may not be nested deeper than {MAX_DIR_DEPTH}")

    def _check_named_here(self, node: Inode) -> None:
        """Refuse to link ``node`` unless every name of it is one its tree has now, as the table knows it.

        A hard link gives an inode a new name; it must never give one to an
        inode the tree does not already name (a host-planted link to an
        outside file that was removed since, reached through an open fd or
        ``/proc/self/fd``): each dentry of ``node`` in the table is looked up
        again in its parent's directory and must still be ``node``'s inode.
        None left: ENOENT.  Fewer than ``st_nlink``: some name of the inode
        lies where the table cannot vouch for it (outside the tree, or in a
        directory not looked up): EXDEV, which tools that hard-link take as
        "copy instead".  The lookups and the link run in one handler, with no
        other request between them; only a host-side change could race them.
        """
        named = 0
        for parent, name in list(node.links):
            pnode = self.table.find(parent)
            if pnode is None:
                continue
            try:
                found = pnode.handle.lookup(name)
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.ENOTDIR):
                    continue
                raise
            with found:
                named += found.key == node.handle.key
        if named == 0:
            raise OSError(errno.ENOENT, "no name of this inode is left in the tree")
        if node.handle.stat().st_nlink > named:
            raise OSError(errno.EXDEV, "the inode has names the overlay cannot vouch for")

    def _check_new_name(self, handle: Handle, parent: int, name: bytes) -> None:
        """Refuse to give the symlink ``handle`` is on the name ``name`` in ``parent`` when its target leaves the tree from there."""
        if stat.S_ISLNK(handle.stat().st_mode):
            self._check_target(parent, name, handle.readlink())

    def _check_target(self, parent: int, name: bytes, target: bytes) -> None:
        """Refuse ``target`` for a symlink called ``name`` in ``parent`` (EPERM; see the module docstring)."""
        if self.table.get(parent).tree.shared:
            check_shared_symlink(target)
        check_symlink(self.table.tree_path_of(parent, name), target)

    def _check_moved_link(self, pnode: Inode, name: bytes, new_parent: int, new_name: bytes) -> None:
        """``name`` in ``pnode`` is about to be called ``new_name`` in ``new_parent``: re-check it if it is a symlink."""
        try:
            handle = pnode.handle.lookup(name)
        except FileNotFoundError:
            return  # the rename itself reports it
        try:
            self._check_new_name(handle, new_parent, new_name)
        finally:
            handle.close()

    def _victim(self, pnode: Inode, name: bytes) -> tuple[Inode | None, Handle | None, bool]:
        """The inode ``name`` refers to before it is removed: ``(table inode, handle, handle is temporary)``."""
        node = self.table.child(pnode.ino, name)
        if node is not None:
            return node, node.handle, False
        try:
            return None, pnode.handle.lookup(name), True
        except FileNotFoundError:
            return None, None, False

    # -------------------------------------------------------------- lookup

    async def lookup(self, parent_inode: int, name: bytes, ctx: Any) -> EntryAttributes:
        return self._guard("lookup", self._req_path(parent_inode, name), self._lookup, parent_inode, name)

    def _lookup(self, parent: int, name: bytes) -> EntryAttributes:
        pnode = self.table.get(parent)
        try:
            node, st = self._child(pnode, name)
        except FileNotFoundError:
            # no negative caching: ENOENT as an error is not cached by the kernel
            self.table.remove_dentry(parent, name)
            raise
        node.lookups += 1
        return self._attr(node, st)

    async def forget(self, inode_list: Any) -> None:
        try:
            for ino, nlookup in inode_list:
                self.table.forget(ino, nlookup)
        except Exception:
            log.exception("overlay: forget failed")

    async def getattr(self, inode: int, ctx: Any) -> EntryAttributes:
        path = self._req_path(inode)
        return self._guard("getattr", path, self._getattr, inode)

    def _getattr(self, ino: int) -> EntryAttributes:
        node = self.table.get(ino)
        return self._attr(node, node.handle.stat())

    async def readlink(self, inode: int, ctx: Any) -> bytes:
        path = self._req_path(inode)
        return self._guard("readlink", path, lambda: self.table.get(inode).handle.readlink())

    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        return self._guard("statfs", "", self._statfs)

    def _statfs(self) -> pyfuse3.StatvfsData:
        sv = self.table.get(pyfuse3.ROOT_INODE).handle.statvfs()
        out = pyfuse3.StatvfsData()
        out.f_bsize = sv.f_bsize
        out.f_frsize = sv.f_frsize
        out.f_namemax = sv.f_namemax
        blocks, bfree, bavail = sv.f_blocks, sv.f_bfree, sv.f_bavail
        files, ffree, favail = sv.f_files, sv.f_ffree, sv.f_favail
        # with a quota, the file system looks as large as the quota allows
        max_bytes, max_inodes = self.quota.max_bytes, self.quota.max_inodes
        if max_bytes is not None and sv.f_frsize:
            cap = max_bytes // sv.f_frsize
            left = max(0, max_bytes - self.quota.bytes) // sv.f_frsize
            blocks, bfree, bavail = min(blocks, cap), min(bfree, left), min(bavail, left)
        if max_inodes is not None:
            left = max(0, max_inodes - self.quota.inodes)
            files, ffree, favail = min(files, max_inodes), min(ffree, left), min(favail, left)
        out.f_blocks, out.f_bfree, out.f_bavail = blocks, bfree, bavail
        out.f_files, out.f_ffree, out.f_favail = files, ffree, favail
        return out

    # --------------------------------------------------------- directories

    async def opendir(self, inode: int, ctx: Any) -> int:
        path = self._req_path(inode)
        return self._guard("opendir", path, self._opendir, inode)

    def _opendir(self, ino: int) -> int:
        node = self.table.get(ino)
        if not stat.S_ISDIR(node.handle.stat().st_mode):
            raise OSError(errno.ENOTDIR, "not a directory")
        fh = self._next_dir_fh
        self._next_dir_fh += 1
        self.dirs[fh] = OpenDir(node)
        node.opens += 1
        return fh

    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        od = self.dirs.get(fh)
        path = self._req_path(od.node.ino) if od is not None else "?"
        self._guard("readdir", path, self._readdir, od, start_id, token)

    def _readdir(self, od: OpenDir | None, start_id: int, token: Any) -> None:
        if od is None:
            raise OSError(errno.EBADF, "unknown directory handle")
        stream = self._stream(od, start_id)
        dnode = od.node
        while (entry := stream.peek()) is not None:
            name, d_ino = entry
            child = self.table.child(dnode.ino, name)
            try:
                if child is not None and child.key[2] == d_ino and child.tree is dnode.tree:
                    st = child.handle.stat()
                else:
                    child, st = self._child(dnode, name)
            except FileNotFoundError:
                stream.take()  # removed since it was read: not reported, its offset used up
                od.pos += 1
                continue
            if not pyfuse3.readdir_reply(token, name, self._attr(child, st), od.pos + 1):
                self.table.drop_if_unused(child)
                return  # the kernel's buffer is full: this entry comes first next time
            stream.take()
            od.pos += 1
            child.lookups += 1  # each readdirplus entry counts as a lookup

    def _stream(self, od: OpenDir, start_id: int) -> DirStream:
        """``od``'s stream positioned at the kernel's offset ``start_id`` (reopened when it is elsewhere or was closed)."""
        fh = id(od)
        if od.stream is not None and start_id == od.pos:
            self._streams.move_to_end(fh)
            return od.stream
        self._drop_stream(od)
        od.stream, od.pos = DirStream(od.node, start_id), start_id
        self._streams[fh] = od
        while len(self._streams) > MAX_DIR_STREAMS:
            _, oldest = self._streams.popitem(last=False)
            if oldest.stream is not None:
                oldest.stream.close()
                oldest.stream = None
        return od.stream

    def _drop_stream(self, od: OpenDir) -> None:
        if od.stream is not None:
            od.stream.close()
            od.stream = None
        self._streams.pop(id(od), None)

    async def releasedir(self, fh: int) -> None:
        od = self.dirs.get(fh)
        path = self._req_path(od.node.ino) if od is not None else "?"
        self._guard("releasedir", path, self._releasedir, fh)

    def _releasedir(self, fh: int) -> None:
        od = self.dirs.pop(fh, None)
        if od is not None:
            self._drop_stream(od)
            self._closed(od.node)

    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any) -> EntryAttributes:
        path = self._req_path(parent_inode, name)
        return self._guard("mkdir", path, self._mkdir, parent_inode, name, mode, ctx)

    def _mkdir(self, parent: int, name: bytes, mode: int, ctx: Any) -> EntryAttributes:
        pnode = self.table.get(parent)
        self._writable(pnode)
        check_mode(mode)
        self._check_depth(parent)
        self._check_entry(pnode, name)
        handle = pnode.handle.mkdir(name, stat.S_IMODE(mode), owner=(ctx.uid, ctx.gid))
        return self._created(pnode, name, handle)

    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        path = self.table.path_of(parent_inode, name)
        self._guard("rmdir", path, self._remove, parent_inode, name, path, True)

    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        path = self.table.path_of(parent_inode, name)
        self._guard("unlink", path, self._remove, parent_inode, name, path, False)

    def _remove(self, parent: int, name: bytes, path: str, is_dir: bool) -> None:
        pnode = self.table.get(parent)
        self._writable(pnode)
        self._not_mount_point(path)
        node, handle, temporary = self._victim(pnode, name)
        try:
            if is_dir:
                pnode.handle.rmdir(name)
            else:
                pnode.handle.unlink(name)
            self.table.remove_dentry(parent, name)
            if self._charged(pnode):
                self.quota.add_bytes(-name_cost(name))
                if handle is not None:
                    self._release_unlinked(node, handle)
        finally:
            if temporary and handle is not None:
                handle.close()

    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: Any) -> None:
        path = self.table.path_of(parent_inode_old, name_old)
        self._guard("rename", path, self._rename, parent_inode_old, name_old,
                    parent_inode_new, name_new, flags, path)

    def _rename(self, pold: int, old: bytes, pnew: int, new: bytes, flags: int, path: str) -> None:
        src_dir, dst_dir = self.table.get(pold), self.table.get(pnew)
        self._writable(src_dir)
        self._writable(dst_dir)
        if flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE):
            raise OSError(errno.EINVAL, "unsupported rename flags")
        if src_dir.tree is not dst_dir.tree:
            raise OSError(errno.EXDEV, "across trees")
        self._not_mount_point(path)
        self._not_mount_point(self.table.path_of(pnew, new))
        exchange = bool(flags & RENAME_EXCHANGE)
        if src_dir is not dst_dir:
            self._check_depth(pnew, (src_dir, old))
            if exchange:
                self._check_depth(pold, (dst_dir, new))
        self._check_moved_link(src_dir, old, pnew, new)
        if exchange:
            self._check_moved_link(dst_dir, new, pold, old)
        node, handle, temporary = (None, None, False) if exchange else self._victim(dst_dir, new)
        names_delta = 0 if exchange or not self._charged(dst_dir) else self._rename_names_delta(
            src_dir, old, new, handle)
        try:
            self.quota.check_grow(names_delta)
            src_dir.handle.rename(old, dst_dir.handle, new, flags)
            self.quota.add_bytes(names_delta)
            moved = self.table.remove_dentry(pold, old)
            other = self.table.remove_dentry(pnew, new)
            if moved is not None:
                self.table.add_dentry(pnew, new, moved)
            if exchange and other is not None:
                self.table.add_dentry(pold, old, other)
            if handle is not None and handle.key != (moved.handle.key if moved else None) \
                    and self._charged(dst_dir):
                self._release_unlinked(node, handle)
        finally:
            if temporary and handle is not None:
                handle.close()

    def _rename_names_delta(self, src_dir: Inode, old: bytes, new: bytes, victim: Handle | None) -> int:
        """Bytes of names a rename of ``old`` to ``new`` adds (negative: gives back).

        The old name goes; the new name comes unless it replaces a name
        already there (the victim's).  Renaming one name of an inode over
        another name of the same inode changes nothing (rename(2) leaves both).
        """
        if victim is None:
            return name_cost(new) - name_cost(old)
        try:
            src = src_dir.handle.lookup(old)
        except FileNotFoundError:
            return 0  # the rename itself reports it
        try:
            same = src.key == victim.key
        finally:
            src.close()
        return 0 if same else -name_cost(old)

    # ---------------------------------------------------------- new names

    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: Any) -> EntryAttributes:
        path = self._req_path(parent_inode, name)
        return self._guard("mknod", path, self._mknod, parent_inode, name, mode, rdev, ctx)

    def _mknod(self, parent: int, name: bytes, mode: int, rdev: int, ctx: Any) -> EntryAttributes:
        pnode = self.table.get(parent)
        self._writable(pnode)
        check_mode(mode)
        check_special(mode, self.policy)
        self._check_entry(pnode, name)
        handle = pnode.handle.mknod(name, mode, rdev, owner=(ctx.uid, ctx.gid))
        return self._created(pnode, name, handle)

    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: Any) -> EntryAttributes:
        path = self._req_path(parent_inode, name)
        return self._guard("symlink", path, self._symlink, parent_inode, name, target, ctx)

    def _symlink(self, parent: int, name: bytes, target: bytes, ctx: Any) -> EntryAttributes:
        pnode = self.table.get(parent)
        self._writable(pnode)
        self._check_target(parent, name, target)
        self._check_entry(pnode, name, len(target))
        handle = pnode.handle.symlink(name, target, owner=(ctx.uid, ctx.gid))
        return self._created(pnode, name, handle, len(target))

    async def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: Any) -> EntryAttributes:
        path = self._req_path(new_parent_inode, new_name)
        return self._guard("link", path, self._link, inode, new_parent_inode, new_name)

    def _link(self, ino: int, parent: int, name: bytes) -> EntryAttributes:
        node, pnode = self.table.get(ino), self.table.get(parent)
        self._writable(pnode)
        self._writable(node)
        if node.tree is not pnode.tree:
            raise OSError(errno.EXDEV, "across trees")
        self._check_named_here(node)
        self._check_new_name(node.handle, parent, name)
        if self._charged(pnode):
            self.quota.check_grow(name_cost(name))
        handle = pnode.handle.link(node.handle, name)
        if self._charged(pnode):
            self.quota.add_bytes(name_cost(name))
        linked, _ = self.table.learn(parent, name, handle, pnode.tree)
        linked.lookups += 1
        return self._attr(linked, linked.handle.stat())

    # ---------------------------------------------------------------- files

    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: Any) -> tuple[FileInfo, EntryAttributes]:
        path = self._req_path(parent_inode, name)
        return self._guard("create", path, self._create, parent_inode, name, mode, flags, ctx)

    def _create(self, parent: int, name: bytes, mode: int, flags: int, ctx: Any) -> tuple[FileInfo, EntryAttributes]:
        pnode = self.table.get(parent)
        self._writable(pnode)
        check_mode(mode)
        if not stat.S_ISREG(mode) and stat.S_IFMT(mode):
            raise OSError(errno.EINVAL, "create of a non-regular file")
        self._check_entry(pnode, name)
        fd = pnode.handle.open(name, (flags & OPEN_FLAGS_KEPT & ~os.O_TRUNC) | os.O_CREAT | os.O_EXCL,
                               stat.S_IMODE(mode), owner=(ctx.uid, ctx.gid))
        try:
            handle = pnode.handle.lookup(name)
            st = os.fstat(fd)
            if handle.key != (st.st_dev, st.st_ino):
                handle.close()
                raise OSError(errno.ESTALE, "the new file was replaced")
            attr = self._created(pnode, name, handle)
        except BaseException:
            os.close(fd)
            raise
        node = self.table.get(attr.st_ino)
        node.opens += 1
        self.files[fd] = OpenFile(node)
        node.cache_stamp = (st.st_mtime_ns, st.st_size)
        return FileInfo(fh=fd, keep_cache=True), attr

    async def open(self, inode: int, flags: int, ctx: Any) -> FileInfo:
        path = self._req_path(inode)
        return self._guard("open", path, self._open, inode, flags)

    def _open(self, ino: int, flags: int) -> FileInfo:
        node = self.table.get(ino)
        if flags & (WRITE_ACCESS | os.O_TRUNC):
            self._writable(node)
        flags &= OPEN_FLAGS_KEPT
        old_size = node.handle.stat().st_size if flags & os.O_TRUNC else 0
        fd = self._reopen(node, flags)
        try:
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        if flags & os.O_TRUNC and self._charged(node):
            self.quota.add_bytes(st.st_size - old_size)
        node.opens += 1
        self.files[fd] = OpenFile(node)
        return FileInfo(fh=fd, keep_cache=self._keep_cache(node, st))

    def _keep_cache(self, node: Inode, st: os.stat_result) -> bool:
        """Whether the kernel may keep the pages it has of ``node`` (False drops them at this open)."""
        if node.data_stale:
            node.data_stale = False
            node.cache_stamp = (st.st_mtime_ns, st.st_size)
            return False
        if not node.tree.shared:
            return True
        stamp = (st.st_mtime_ns, st.st_size)
        keep = node.cache_stamp == stamp
        node.cache_stamp = stamp
        return keep

    def _file(self, fh: int) -> OpenFile:
        of = self.files.get(fh)
        if of is None:
            raise OSError(errno.EBADF, "unknown file handle")
        return of

    def _fh_path(self, fh: int) -> str:
        of = self.files.get(fh)
        return self._req_path(of.node.ino) if of is not None else "?"

    async def read(self, fh: int, off: int, size: int) -> bytes:
        return self._guard("read", self._fh_path(fh), self._read, fh, off, size)

    def _read(self, fh: int, off: int, size: int) -> bytes:
        self._file(fh)
        return os.pread(fh, size, off)

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        return self._guard("write", self._fh_path(fh), self._write, fh, off, buf)

    def _write(self, fh: int, off: int, buf: bytes) -> int:
        of = self._file(fh)
        charged = self._charged(of.node)
        size = os.fstat(fh).st_size if charged else 0
        if charged:
            self.quota.check_grow(max(0, off + len(buf) - size))
        n = os.pwrite(fh, buf, off)  # at the kernel's offset: the daemon's fd never has O_APPEND
        if charged:
            self.quota.add_bytes(max(size, off + n) - size)
        return n

    async def fsync(self, fh: int, datasync: bool) -> None:
        self._guard("fsync", self._fh_path(fh), self._fsync, fh, datasync)

    def _fsync(self, fh: int, datasync: bool) -> None:
        self._file(fh)
        (os.fdatasync if datasync else os.fsync)(fh)

    async def release(self, fh: int) -> None:
        self._guard("release", self._fh_path(fh), self._release, fh)

    def _release(self, fh: int) -> None:
        of = self.files.pop(fh, None)
        if of is None:
            return
        os.close(fh)
        self._closed(of.node)

    def _closed(self, node: Inode) -> None:
        """One open handle on ``node`` (file or directory) is gone: at the last, uncharge an orphan, drop an unknown inode.

        The one last-close bookkeeping of both ``release`` and ``releasedir``:
        an inode whose last name was removed while open (a file, or a
        directory removed while listed) stays charged until here.
        """
        node.opens -= 1
        if node.opens == 0 and node.orphaned:
            node.orphaned = False
            self._release_unlinked(node, node.handle)
        self.table.drop_if_unused(node)

    # --------------------------------------------------------------- setattr

    async def setattr(self, inode: int, attr: EntryAttributes, fields: Any, fh: int | None,
                      ctx: Any) -> EntryAttributes:
        path = self._req_path(inode)
        return self._guard("setattr", path, self._setattr, inode, attr, fields, fh)

    def _setattr(self, ino: int, attr: EntryAttributes, fields: Any, fh: int | None) -> EntryAttributes:
        node = self.table.get(ino)
        self._writable(node)
        if fields.update_mode:
            check_mode(attr.st_mode)
        if fields.update_size:
            self._truncate(node, attr.st_size, fh)
        if fields.update_mode:
            node.handle.chmod(stat.S_IMODE(attr.st_mode))
        if fields.update_uid or fields.update_gid:
            node.handle.chown(attr.st_uid if fields.update_uid else -1,
                              attr.st_gid if fields.update_gid else -1)
        if fields.update_atime or fields.update_mtime:
            node.handle.set_times(attr.st_atime_ns if fields.update_atime else None,
                                  attr.st_mtime_ns if fields.update_mtime else None)
        return self._attr(node, node.handle.stat())

    def _truncate(self, node: Inode, size: int, fh: int | None) -> None:
        old = node.handle.stat()
        if not stat.S_ISREG(old.st_mode):
            raise OSError(errno.EISDIR if stat.S_ISDIR(old.st_mode) else errno.EINVAL, "not a regular file")
        charged = self._charged(node)
        if charged:
            self.quota.check_grow(size - old.st_size)
        if fh is not None and fh in self.files:
            os.ftruncate(fh, size)
        else:
            fd = self._reopen(node, os.O_WRONLY)
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
        if charged:
            self.quota.add_bytes(size - old.st_size)
