"""The overlay daemon's inode table: FUSE inode numbers to held :class:`~sandbox_fs.root.Handle` objects.

Every inode the kernel knows is one :class:`Inode`, keyed by the tree it
belongs to and its backing ``(st_dev, st_ino)``, so hard links to one
backing inode share one FUSE inode.  It holds an ``O_PATH`` handle, never a
path.  The dentry table maps ``(parent FUSE inode, name)`` to the FUSE inode
the kernel was last told that name refers to; it is what gives the *sandbox
path* shown in audit events and matched by fault rules (at the time of the
event), what invalidation walks, and how an inode known only by its handle is
reopened for I/O (through one of its dentries, then verified).

Handles are evicted under fd pressure: past :attr:`InodeTable.max_held`
held handles (set by the daemon from its ``RLIMIT_NOFILE``), the least
recently used handles of inodes that are neither open nor a tree's root and
still have a name are closed after the request (:meth:`InodeTable.trim`).
The inode stays in the table; its next use reopens it by name from its
parent's handle (itself reopened the same way when evicted) and checks that
the name still holds the same ``(st_dev, st_ino)`` and file type: a name that
now holds another inode (the host changed the tree) gives ``ESTALE``, never
the other inode.  Only an actor outside the overlay can change a name behind
the table's back (the confined command acts through the overlay, whose own
changes keep the dentry table right), and the reopen is one ``O_PATH |
O_NOFOLLOW`` lookup beneath the tree, so what it can find is only ever an
entry of the tree.  One case it cannot tell: every name of the inode
removed out of band and a new entry of the same type given the freed inode
number; the FUSE inode then shows the new entry (as a lookup would).
Inodes without a name (unlinked) or open are never evicted, so the
overlay's own removals never free an evicted inode.

Nothing here does I/O other than closing handles, and nothing imports
pyfuse3: the table is plain data, used from the daemon's trio thread only.
"""

from __future__ import annotations

import errno
import os
import stat
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..root import Handle, Root

ROOT_INODE = 1
"""The FUSE inode number of the workspace root (``pyfuse3.ROOT_INODE``)."""

MAX_PATH_DEPTH = 4096
"""Most dentries :meth:`InodeTable.path_of` follows up from a request's inode.

Past it (a tree made that deep by the host, or a deep subtree renamed
deeper) the path's top is cut and the path is marked: it starts with
:data:`TRUNCATED_PREFIX`, which no real sandbox path does (they never start
with ``/``); fault rules treat such a path as matching every rule's path
(fail closed) and audit shows it so."""

TRUNCATED_PREFIX = "/\u2026/"
"""The start of a path whose top components :meth:`InodeTable.path_of` cut (``/…/``, then the rest)."""

MAX_DIR_DEPTH = 2048
"""Deepest directory (components below the workspace root) mkdir or rename may make through the overlay.

Deeper requests fail with ``EMLINK``.  2048 components is what a path of
PATH_MAX (4096 bytes) can name at all (one-byte names): host tools working
by path cannot reach below, and it keeps every directory's path within
:data:`MAX_PATH_DEPTH`.  A rename checks the new parent's depth only (the
moved directory's own height is not walked): a deeper subtree moved below
gets marked paths past MAX_PATH_DEPTH, never silently cut ones."""

PATH_KEEP_CHARS = 4097
"""Most characters of a path :meth:`InodeTable.path_of` builds: one more than an audit event keeps
(``_audit.MAX_PATH_CHARS``, 4096), so audit shows a longer path cut (ending in ``…``), and fault
rules, whose paths are at most 4096 characters and match by prefix, decide on the kept part exactly
as on the whole path.  Every inode memoizes its (kept) path; beneath a cut path all descendants share
the same string, so a request costs O(1) once its ancestors are memoized, whatever the depth."""


REMEMBERED_NUMBERS = 1 << 18
"""Most FUSE inode numbers of forgotten inodes kept, by backing key, for reuse (least recently forgotten go first).

The kernel forgets an unused inode whenever it drops its dentry cache (memory
pressure, ``drop_caches``); the next lookup of the same backing inode must get
the same number again, or its ``st_ino`` changes under a reader that keeps
``(st_dev, st_ino)`` to check identity (persist's walk, hydrate's extraction,
``Root``'s checked removal), which then sees a replaced entry that never was.
A number is given back only to the key it was made for and only while no live
inode holds it.  About 200 bytes each: 256 Ki of them bound the table to ~50 MiB
however many inodes the daemon served; past that, the oldest forgotten ones get
new numbers again."""


@dataclass(eq=False)
class Tree:
    """One backing tree served by the overlay: the workspace (index 0) or a host-directory mount.

    Attributes:
        index: 0 for the workspace, 1.. for the mounts in configuration order.
        root: the capability on the tree's root directory (owned by the daemon).
        read_only: every mutation in the tree fails with EROFS.
        shared: the tree can change behind the overlay's back (a host
            directory): short timeouts, ``keep_cache`` only while a file's
            mtime and size are unchanged.
        entry_timeout_s, attr_timeout_s: kernel cache validity given with
            every entry and attribute reply, in seconds.
        mount_path: the sandbox path the tree is mounted at (``""`` for the workspace).
    """

    index: int
    root: Root
    read_only: bool
    shared: bool
    entry_timeout_s: float
    attr_timeout_s: float
    mount_path: str = ""


@dataclass(eq=False, slots=True)
class Inode:
    """One inode the kernel knows.

    Attributes:
        ino: the FUSE inode number, also the ``st_ino`` the kernel shows; reused
            only for the same backing key once the kernel forgot it (see
            :data:`REMEMBERED_NUMBERS`), never for another key.
        held: the ``O_PATH`` handle on the backing inode, or None while it is
            evicted (closed by :meth:`InodeTable.forget` and by eviction);
            use :attr:`handle`, which reopens an evicted one.
        key: ``(tree index, st_dev, st_ino)``.
        tree: the tree it belongs to.
        lookups: the kernel's lookup count (lookup, readdirplus entries,
            create, mkdir, mknod, symlink, link each add one; forget subtracts).
        opens: open file handles on it (quota of an unlinked inode is
            released at the last release).
        dentry: the ``(parent ino, name)`` it was last known by (kept after
            the name is removed, for the paths of audit events on an
            unlinked-but-open file); None for the workspace root.
        links: every ``(parent ino, name)`` of it in the dentry table.
        orphaned: its last name was removed while it was open: its bytes and
            inode are still charged to the quota until the last release.
        cache_stamp: ``(st_mtime_ns, st_size)`` when a file of a shared tree
            was last opened with ``keep_cache`` (None: not yet).
        data_stale: the backing file was invalidated while open: the next
            open drops the kernel's page cache (``keep_cache=False``).
        pinned: never evicted (the workspace root and each mount's root,
            which no name in its parent's tree can reopen).
        kind: the file type (``S_IFMT`` bits) taken when the handle was
            evicted; a reopen must find the same.
        table: the table it belongs to (for :attr:`handle`).
    """

    ino: int
    held: Handle | None
    key: tuple[int, int, int]
    tree: Tree
    lookups: int = 0
    opens: int = 0
    dentry: tuple[int, bytes] | None = None
    links: set[tuple[int, bytes]] = field(default_factory=set)
    orphaned: bool = False
    cache_stamp: tuple[int, int] | None = None
    data_stale: bool = False
    pinned: bool = False
    kind: int = 0
    table: "InodeTable | None" = field(default=None, repr=False)

    @property
    def handle(self) -> Handle:
        """The ``O_PATH`` handle on the backing inode, reopened by name and verified when it was evicted.

        Raises:
            OSError: ``ESTALE``, the inode was evicted and no name of it in
                the table still holds it; ``EBADF`` after :meth:`InodeTable.close`.
        """
        table = self.table
        if table is None:
            if self.held is None:
                raise OSError(errno.EBADF, "the inode's handle is closed")
            return self.held
        return table.handle_of(self)


class InodeTable:
    """FUSE inode numbers <-> :class:`Inode`, plus the dentry table.

    Not thread-safe: used from the daemon's trio thread only (the
    invalidation thread gets copies of what it needs).
    """

    def __init__(self, root_handle: Handle, workspace: Tree) -> None:
        """Start with the workspace root as inode 1 (lookup count 1, never forgotten).

        Args:
            root_handle: a handle on the workspace root; owned by the table from now on.
            workspace: the workspace's :class:`Tree` (index 0).
        """
        self._by_ino: dict[int, Inode] = {}
        self._by_key: dict[tuple[int, int, int], Inode] = {}
        self._children: dict[tuple[int, bytes], int] = {}
        # ino -> (depth, path kept to PATH_KEEP_CHARS); cleared whenever an
        # inode already known gets another dentry (a rename, a removed name): paths beneath it change
        self._memo: dict[int, tuple[int, str]] = {ROOT_INODE: (0, "")}
        self._next_ino = ROOT_INODE + 1
        # backing key -> the number its inode had when the kernel forgot it (see REMEMBERED_NUMBERS)
        self._forgotten: OrderedDict[tuple[int, int, int], int] = OrderedDict()
        # inos whose (unpinned) handle is held, least recently used first
        self._held: OrderedDict[int, None] = OrderedDict()
        self.max_held: int | None = None
        """Most unpinned handles kept after a request (None: no limit); see :meth:`trim`."""
        self.evictions = 0
        """How many handles :meth:`trim` closed so far."""
        dev, ino = root_handle.key
        root = Inode(ROOT_INODE, root_handle, (workspace.index, dev, ino), workspace, lookups=1, pinned=True)
        self._by_ino[ROOT_INODE] = root
        self._by_key[root.key] = root

    def __len__(self) -> int:
        return len(self._by_ino)

    def get(self, ino: int) -> Inode:
        """The inode ``ino``.  Raises ``OSError(ESTALE)`` for an inode the table does not hold."""
        try:
            return self._by_ino[ino]
        except KeyError:
            raise OSError(errno.ESTALE, "unknown inode") from None

    def find(self, ino: int) -> Inode | None:
        """The inode ``ino``, or None."""
        return self._by_ino.get(ino)

    def child(self, parent: int, name: bytes) -> Inode | None:
        """The inode the dentry ``(parent, name)`` refers to, or None when the table has no such dentry."""
        ino = self._children.get((parent, name))
        return None if ino is None else self._by_ino.get(ino)

    def learn(self, parent: int, name: bytes, handle: Handle, tree: Tree) -> tuple[Inode, bool]:
        """Record that ``name`` in ``parent`` is the inode ``handle`` is on.

        The handle is owned by the table from now on: closed here when the
        inode is already known under its key (the known handle is kept).
        The lookup count is *not* changed: the caller adds one when the
        kernel was told about the entry.

        Returns:
            ``(inode, new)``: ``new`` is True when the inode was not in the table.
        """
        dev, st_ino = handle.key
        key = (tree.index, dev, st_ino)
        node = self._by_key.get(key)
        new = node is None
        if node is None:
            pnode = self._by_ino.get(parent)
            node = Inode(self._number_for(key), handle, key, tree, table=self,
                         pinned=pnode is None or pnode.tree is not tree)
            self._by_ino[node.ino] = node
            self._by_key[key] = node
            if not node.pinned:
                self._held[node.ino] = None
        elif node.held is None:
            if stat.S_IFMT(handle.stat().st_mode) != node.kind:
                # the evicted inode's number was freed and given to this entry: not the same inode
                del self._by_key[key]
                return self.learn(parent, name, handle, tree)
            node.held = handle  # an evicted inode: the fresh handle is on the same inode
            self._held[node.ino] = None
        else:
            handle.close()
        self.add_dentry(parent, name, node)
        return node, new

    def _number_for(self, key: tuple[int, int, int]) -> int:
        """The FUSE inode number for a new inode of ``key``: the one it had before the kernel forgot it, else a fresh one."""
        ino = self._forgotten.pop(key, None)
        if ino is not None and ino not in self._by_ino:
            return ino
        ino = self._next_ino
        self._next_ino += 1
        return ino

    def handle_of(self, node: Inode) -> Handle:
        """``node``'s handle (see :attr:`Inode.handle`): marked most recently used, reopened when evicted."""
        held = node.held
        if held is not None:
            if not node.pinned:
                self._held.move_to_end(node.ino)
            return held
        return self._reopen(node)

    def _reopen(self, node: Inode) -> Handle:
        """Reopen evicted ``node`` and every evicted ancestor, top-down, each verified by ``(st_dev, st_ino)``."""
        chain: list[Inode] = []
        cur = node
        for _ in range(MAX_PATH_DEPTH + 1):
            if cur.held is not None:
                break
            if cur.pinned or cur.dentry is None or cur.ino not in self._by_ino:
                raise OSError(errno.ESTALE, "the inode's handle was closed and it has no name to reopen")
            parent = self._by_ino.get(cur.dentry[0])
            if parent is None:
                raise OSError(errno.ESTALE, "the inode's directory is no longer known")
            chain.append(cur)
            cur = parent
        else:
            raise OSError(errno.ESTALE, "the inode's path is too deep to reopen")
        for child in reversed(chain):
            assert cur.held is not None
            found = cur.held.lookup(child.dentry[1]) if child.dentry is not None else None
            assert found is not None
            st = found.stat()
            if (child.tree.index, st.st_dev, st.st_ino) != child.key or stat.S_IFMT(st.st_mode) != child.kind:
                found.close()
                raise OSError(errno.ESTALE, "the inode's name now holds another inode")
            child.held = found
            self._held[child.ino] = None
            cur = child
        assert node.held is not None
        return node.held

    def trim(self) -> int:
        """Close the least recently used handles past :attr:`max_held`; returns how many were closed.

        Only inodes that are not open, not pinned and still have a name are
        evicted (an unlinked inode could not be reopened).  Called by the
        daemon after each request, never in the middle of one, so no handle
        a handler is using is closed under it.
        """
        limit = self.max_held
        if limit is None or len(self._held) <= limit:
            return 0
        excess = len(self._held) - limit
        victims: list[Inode] = []
        for ino in self._held:
            if len(victims) >= excess:
                break
            node = self._by_ino.get(ino)
            if node is not None and node.opens == 0 and node.links and node.held is not None:
                try:
                    node.kind = stat.S_IFMT(node.held.stat().st_mode)
                except OSError:
                    continue  # keep what cannot be checked again
                victims.append(node)
        for node in victims:
            del self._held[node.ino]
            assert node.held is not None
            node.held.close()
            node.held = None
        self.evictions += len(victims)
        return len(victims)

    def add_dentry(self, parent: int, name: bytes, node: Inode) -> None:
        """``(parent, name)`` now refers to ``node`` (replacing what it referred to in the table)."""
        old = self._children.get((parent, name))
        if old is not None and old != node.ino:
            self._unlink_from(old, parent, name)
        self._children[(parent, name)] = node.ino
        node.links.add((parent, name))
        if node.dentry is not None and node.dentry != (parent, name):
            self._forget_paths()
        node.dentry = (parent, name)
        node.orphaned = False

    def _forget_paths(self) -> None:
        """An inode's dentry changed: every memoized path beneath it may be wrong."""
        self._memo.clear()
        self._memo[ROOT_INODE] = (0, "")

    def remove_dentry(self, parent: int, name: bytes) -> Inode | None:
        """Forget the dentry ``(parent, name)``; returns the inode it referred to (None if unknown)."""
        ino = self._children.pop((parent, name), None)
        if ino is None:
            return None
        return self._unlink_from(ino, parent, name)

    def _unlink_from(self, ino: int, parent: int, name: bytes) -> Inode | None:
        node = self._by_ino.get(ino)
        if node is None:
            return None
        node.links.discard((parent, name))
        if node.dentry == (parent, name) and node.links:
            node.dentry = next(iter(node.links))
            self._forget_paths()
        return node

    def drop_if_unused(self, node: Inode) -> None:
        """Remove ``node`` when the kernel was never told about it (lookup count 0, not open)."""
        if node.lookups == 0 and node.opens == 0 and node.ino != ROOT_INODE:
            self._drop(node)

    def forget(self, ino: int, nlookup: int) -> None:
        """Subtract ``nlookup`` from the lookup count; at 0 the handle is closed and the inode removed."""
        node = self._by_ino.get(ino)
        if node is None or ino == ROOT_INODE:
            return
        node.lookups = max(0, node.lookups - nlookup)
        if node.lookups == 0 and node.opens == 0:
            self._drop(node)

    def _drop(self, node: Inode) -> None:
        del self._by_ino[node.ino]
        if self._by_key.get(node.key) is node:
            del self._by_key[node.key]
            self._forgotten[node.key] = node.ino  # the key's next inode gets this number again
            self._forgotten.move_to_end(node.key)
            if len(self._forgotten) > REMEMBERED_NUMBERS:
                self._forgotten.popitem(last=False)
        for dentry in node.links:
            if self._children.get(dentry) == node.ino:
                del self._children[dentry]
        node.links.clear()
        self._held.pop(node.ino, None)
        if node.held is not None:
            node.held.close()
            node.held = None
        self._memo.pop(node.ino, None)

    def path_of(self, ino: int, name: bytes | None = None) -> str:
        """The sandbox path of ``ino`` (plus ``name`` beneath it), relative to the workspace root.

        ``""`` is the workspace root.  A dentry chain that reaches an inode the
        table no longer holds starts with ``"?"``.  A chain longer than
        :data:`MAX_PATH_DEPTH` dentries is cut at the top and starts with
        :data:`TRUNCATED_PREFIX`.  Names are decoded with ``os.fsdecode``
        (undecodable bytes as surrogate escapes).  At most
        :data:`PATH_KEEP_CHARS` characters are kept.  Cost: the dentries up
        to the nearest memoized ancestor.
        """
        _depth, path = self._walk(ino)
        if name is None or len(path) >= PATH_KEEP_CHARS:
            return path
        tail = os.fsdecode(name)
        return (tail if path == "" else f"{path}/{tail}")[:PATH_KEEP_CHARS]

    def depth_of(self, ino: int) -> int:
        """How many components below the workspace root ``ino`` is (0: the root); past :data:`MAX_PATH_DEPTH`, more than it."""
        return self._walk(ino)[0]

    def _walk(self, ino: int) -> tuple[int, str]:
        """``(depth, path)`` of ``ino``, memoizing what it passes (see :meth:`path_of`)."""
        chain: list[tuple[int, bytes]] = []  # (ino, its name) from ino upwards
        cur = ino
        base: tuple[int, str] | None = None
        prefix = ""
        for _ in range(MAX_PATH_DEPTH + 1):
            memo = self._memo.get(cur)
            if memo is not None:
                base = memo
                break
            node = self._by_ino.get(cur)
            if node is None or node.dentry is None:
                prefix = "?"
                break
            chain.append((cur, node.dentry[1]))
            cur = node.dentry[0]
        else:
            prefix = TRUNCATED_PREFIX
        if base is None:  # not anchored at the root: nothing memoized
            body = "/".join(os.fsdecode(part) for _i, part in reversed(chain))
            if prefix == "?":
                return len(chain), (f"?/{body}" if body else "?")[:PATH_KEEP_CHARS]
            return MAX_PATH_DEPTH + 1, (TRUNCATED_PREFIX + body)[:PATH_KEEP_CHARS]
        depth, path = base
        for node_ino, part in reversed(chain):
            depth += 1
            if len(path) < PATH_KEEP_CHARS:
                text = os.fsdecode(part)
                path = (text if not path else f"{path}/{text}")[:PATH_KEEP_CHARS]
            self._memo[node_ino] = (depth, path)
        return depth, path

    def tree_path_of(self, ino: int, name: bytes) -> str:
        """The path of ``name`` in directory ``ino`` relative to the root of the tree ``ino`` belongs to.

        For the workspace this is the sandbox path (as :meth:`path_of`); for
        an entry beneath a host-directory mount it is relative to that
        mount's root (the walk stops where the parent belongs to another
        tree), which is what a symlink target is judged against.

        Raises:
            OSError: ``ESTALE``, the dentry chain reaches an inode the table
                no longer holds (no path to judge a request by).
        """
        parts: list[bytes] = [name]
        node = self.get(ino)
        for _ in range(MAX_PATH_DEPTH):
            if node.ino == ROOT_INODE:
                break
            parent = None if node.dentry is None else self._by_ino.get(node.dentry[0])
            if node.dentry is None or parent is None:
                raise OSError(errno.ESTALE, "the directory's path is no longer known")
            if parent.tree is not node.tree:
                break  # node is the root of its tree (a mount point)
            parts.append(node.dentry[1])
            node = parent
        else:
            raise OSError(errno.ESTALE, "the directory's path is too deep")
        return os.fsdecode(b"/".join(reversed(parts)))

    def resolve(self, path: str) -> tuple[int, bytes, Inode | None] | None:
        """Walk the dentry table along sandbox ``path`` (``a/b/c``).

        Returns:
            ``(parent ino, last name, inode or None)`` for the last component
            when every directory before it is in the table, else None (the
            kernel cannot have cached anything beneath an unknown directory).
        """
        names = [os.fsencode(p) for p in path.split("/") if p not in ("", ".")]
        if not names:
            return None
        cur = ROOT_INODE
        for part in names[:-1]:
            ino = self._children.get((cur, part))
            if ino is None:
                return None
            cur = ino
        last = names[-1]
        return cur, last, self.child(cur, last)

    def dentries(self) -> list[tuple[int, bytes, int]]:
        """A copy of the dentry table: ``(parent ino, name, ino)`` each."""
        return [(p, n, i) for (p, n), i in self._children.items()]

    def inodes(self) -> Iterator[Inode]:
        """Every inode in the table (do not change the table while iterating)."""
        return iter(self._by_ino.values())

    def close(self) -> None:
        """Close every handle (the daemon is stopping)."""
        for node in list(self._by_ino.values()):
            if node.held is not None:
                node.held.close()
                node.held = None
            node.table = None
        self._held.clear()
        self._by_ino.clear()
        self._by_key.clear()
        self._forgotten.clear()
        self._children.clear()
