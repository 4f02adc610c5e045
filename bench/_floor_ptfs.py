"""A minimal pyfuse3 passthrough: the floor :mod:`bench_fuse` measures the overlay against (``--floor``).

Benchmark-only, never product code: it serves ``SRC`` at ``MNT`` by *host
path strings* (``os.lstat(path)``, ``os.open(path)``), with no policy, no
audit, no fault rules, no quota and no ``Root``, which is exactly what the
overlay exists not to do.  What it keeps is what any pyfuse3 daemon pays:
one trio task loop, one Python handler per request, an ``EntryAttributes``
per reply, the same caching (3600 s entry/attr timeouts, ``keep_cache``,
readdirplus, FLUSH answered with ENOSYS) and the same mount options
(``default_permissions``).  Its times are the per-request floor of a Python
daemon on this stack; the overlay's ratio to them is what our policy costs.

It serves with the daemon's pyfuse3 tuning, imported from the product
(:func:`sandbox_fs.fuse.serve_pyfuse3`: one worker task, no scheduler pass
for the uncontended read lock), so the floor never drifts from what the
daemon runs; or with pyfuse3's defaults given ``--pyfuse3-defaults``.
Nothing else of ``sandbox_fs`` is used: the request handlers stay this
file's own minimal ones.

Usage: ``python bench/_floor_ptfs.py [--pyfuse3-defaults] SRC MNT`` (as
root); prints ``ready`` once mounted and serves until ``umount MNT``.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Any

import pyfuse3
import trio
from pyfuse3 import EntryAttributes, FileInfo, FUSEError

from sandbox_fs.fuse import serve_pyfuse3

TIMEOUT_S = 3600.0


class MinimalPassthrough(pyfuse3.Operations):
    """Lookup, getattr, readdirplus, open/create/read/write/release, mkdir/unlink: the least a passthrough does."""

    def __init__(self, root: str) -> None:
        super().__init__()
        self.paths: dict[int, str] = {pyfuse3.ROOT_INODE: root}
        self.root_ino = os.lstat(root).st_ino
        self.dirs: dict[int, list[str]] = {}
        self.next_dir = 1

    def _attr(self, path: str) -> EntryAttributes:
        try:
            st = os.lstat(path)
        except OSError as e:
            raise FUSEError(e.errno or errno.EIO) from None
        a = EntryAttributes()
        a.st_ino = pyfuse3.ROOT_INODE if st.st_ino == self.root_ino else st.st_ino
        a.entry_timeout = a.attr_timeout = TIMEOUT_S
        a.st_mode, a.st_nlink, a.st_uid, a.st_gid = st.st_mode, st.st_nlink, st.st_uid, st.st_gid
        a.st_rdev, a.st_size, a.st_blksize, a.st_blocks = st.st_rdev, st.st_size, st.st_blksize, st.st_blocks
        a.st_atime_ns, a.st_mtime_ns, a.st_ctime_ns = st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns
        return a

    def _path(self, ino: int) -> str:
        try:
            return self.paths[ino]
        except KeyError:
            raise FUSEError(errno.ENOENT) from None

    async def lookup(self, parent_inode: int, name: bytes, ctx: Any) -> EntryAttributes:
        path = os.path.join(self._path(parent_inode), os.fsdecode(name))
        a = self._attr(path)
        self.paths[a.st_ino] = path
        return a

    async def forget(self, inode_list: Any) -> None:
        pass  # the table only grows: the floor, not a product

    async def getattr(self, inode: int, ctx: Any) -> EntryAttributes:
        return self._attr(self._path(inode))

    async def opendir(self, inode: int, ctx: Any) -> int:
        fh = self.next_dir
        self.next_dir += 1
        self.dirs[fh] = [self._path(inode)]
        return fh

    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        entry = self.dirs[fh]
        if len(entry) == 1:
            entry += sorted(os.listdir(entry[0]))
        top = entry[0]
        for i in range(start_id, len(entry) - 1):
            name = entry[i + 1]
            path = os.path.join(top, name)
            a = self._attr(path)
            if not pyfuse3.readdir_reply(token, os.fsencode(name), a, i + 1):
                return
            self.paths[a.st_ino] = path

    async def releasedir(self, fh: int) -> None:
        self.dirs.pop(fh, None)

    async def open(self, inode: int, flags: int, ctx: Any) -> FileInfo:
        try:
            fd = os.open(self._path(inode), (flags & ~os.O_APPEND) | os.O_CLOEXEC)
        except OSError as e:
            raise FUSEError(e.errno or errno.EIO) from None
        return FileInfo(fh=fd, keep_cache=True)

    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: Any) -> tuple[FileInfo, EntryAttributes]:
        path = os.path.join(self._path(parent_inode), os.fsdecode(name))
        try:
            fd = os.open(path, (flags & ~os.O_APPEND) | os.O_CREAT | os.O_CLOEXEC, mode)
        except OSError as e:
            raise FUSEError(e.errno or errno.EIO) from None
        a = self._attr(path)
        self.paths[a.st_ino] = path
        return FileInfo(fh=fd, keep_cache=True), a

    async def read(self, fh: int, off: int, size: int) -> bytes:
        return os.pread(fh, size, off)

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        return os.pwrite(fh, buf, off)

    async def release(self, fh: int) -> None:
        os.close(fh)

    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any) -> EntryAttributes:
        path = os.path.join(self._path(parent_inode), os.fsdecode(name))
        try:
            os.mkdir(path, mode)
        except OSError as e:
            raise FUSEError(e.errno or errno.EIO) from None
        a = self._attr(path)
        self.paths[a.st_ino] = path
        return a

    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        try:
            os.unlink(os.path.join(self._path(parent_inode), os.fsdecode(name)))
        except OSError as e:
            raise FUSEError(e.errno or errno.EIO) from None


async def serve(stock: bool) -> None:
    try:
        if stock:
            await pyfuse3.main()
        else:
            await serve_pyfuse3()  # as the daemon serves (a floor with the same tuning)
    finally:
        pyfuse3.close(unmount=False)


def main() -> int:
    args = sys.argv[1:]
    stock = "--pyfuse3-defaults" in args
    src, mnt = [a for a in args if not a.startswith("--")]
    pyfuse3.init(MinimalPassthrough(src), mnt, set(pyfuse3.default_options) | {"fsname=floor-ptfs"})
    print("ready", flush=True)
    trio.run(serve, stock)
    return 0


if __name__ == "__main__":
    sys.exit(main())
