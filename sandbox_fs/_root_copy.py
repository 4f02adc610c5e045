"""The batched copy engine behind :meth:`Root.copy_files_from <sandbox_fs.root.Root.copy_files_from>`.

Items are taken in order.  Each source and destination directory is opened
once per call (beneath its root, ``RESOLVE_NO_SYMLINKS``); consecutive items
of one directory pair form a group of up to :data:`GROUP_MAX` files that
one native call (``_native.xfer_files``, one GIL release) copies, each file
through a temporary name renamed over its destination.  With a digest, the
group's data are packed in one buffer and hashed after the call.

Internal to the root modules: it uses ``Root`` internals (``_acquire``,
``_release``, ``_rel``, ``_split``, ``_open_fd``, ``_show``, ``_deny``,
``_check_writable``, ``_check_write_target``), which no other module calls.
"""

from __future__ import annotations

import errno
import os
from hashlib import sha256 as _hashlib_sha256
from typing import TYPE_CHECKING, Any, Callable, Iterable, NamedTuple

from . import _native
from .root import _COPY_UNBOUNDED, _DIR_FLAGS, SpecialFileError, _check_mode, _retry_eintr

if TYPE_CHECKING:
    from .root import Root

__all__ = ["copy_files"]

#: Files per native call.
GROUP_MAX = 64
#: Retries of one file whose temporary name was taken by someone else.
_TMP_NAME_ATTEMPTS = 100

CopyResult = tuple[int, "str | None"]


class _Pending(NamedTuple):
    """An item whose directories are open, waiting in the group for the native call."""

    src: str
    dst: str
    src_leaf: bytes
    dst_leaf: bytes
    mode: int
    mtime_ns: int | None
    ident: tuple[int, int] | None


class _Batch:
    """The state of one ``copy_files_from`` call: native buffers, open directory fds, the pending group."""

    def __init__(self, dst: Root, src: Root, *, bound: int, digest: bool, fsync: bool, buffer_bytes: int,
                 buffer: bytearray | None, results: list[CopyResult]) -> None:
        self.dst, self.src = dst, src
        self.bound = bound
        self.buffer_bytes = buffer_bytes
        buf = (buffer if buffer is not None else bytearray(buffer_bytes)) if digest else None
        self.cbuf = _native.buffer_of(buf) if buf is not None else _native.NULL
        self.view = memoryview(buf) if buf is not None else None
        self.xfers: Any = _native.new_xfers(GROUP_MAX)  # struct sfs_xfer[GROUP_MAX]
        self.ret_box: Any = _native.new_int()  # int *: the failed file's return
        self.base_flags = _native.XFER_FSYNC if fsync else 0
        self.tmp_prefix = b".sfs-tmp-" + os.urandom(6).hex().encode() + b"-"
        self.tmp_counter = 0
        self.uid, self.gid = _native.owner_ids(dst.owner)
        self.src_dirs: dict[str, int] = {}  # source directory path -> its open fd
        self.dst_dirs: dict[str, int] = {}
        self.group: list[_Pending] = []  # consecutive items of the directory pair group_fds
        self.group_fds = (-1, -1)  # (source dir fd, destination dir fd)
        self.out = results

    def dir_fds(self, srootfd: int, drootfd: int, srel: str, sdir_s: str, drel: str, ddir_s: str) -> tuple[int, int]:
        """The ``(source, destination)`` directory fds of an item, opened (and checked) on first use.

        ``sdir_s`` / ``ddir_s`` are the directory parts of ``srel`` / ``drel``.
        A directory is validated fully on the first path met in it; the leaf
        is one component by construction, and the native call refuses ``""``,
        ``.`` and ``..`` (checked fully on that error).
        """
        sdfd = self.src_dirs.get(sdir_s)
        if sdfd is None:
            src = self.src
            sdir = src._split(src._rel(srel), "copy")[0]
            sdfd = src._open_fd(srootfd, sdir, _DIR_FLAGS, 0, "copy", _native.RESOLVE_NO_SYMLINKS)
            self.src_dirs[sdir_s] = sdfd
        ddfd = self.dst_dirs.get(ddir_s)
        if ddfd is None:
            dst = self.dst
            drel_b = dst._rel(drel)
            ddir = dst._split(drel_b, "copy")[0]
            ddfd = dst._open_fd(drootfd, ddir, _DIR_FLAGS, 0, "copy", _native.RESOLVE_NO_SYMLINKS)
            self.dst_dirs[ddir_s] = ddfd
            if dst._deny:
                dst._check_write_target(ddfd, None, drel_b, False)
        return sdfd, ddfd

    def close_dirs(self, dirs: dict[str, int]) -> None:
        for fd in dirs.values():
            os.close(fd)

    def _fill_xfers(self) -> list[bytes]:
        """Describe the group in ``self.xfers``; returns the ``(src leaf, tmp name, dst leaf)`` names of each."""
        names: list[bytes] = []
        base_flags, bound, xs, prefix = self.base_flags, self.bound, self.xfers, self.tmp_prefix
        check_ident, set_mtime = _native.XFER_CHECK_IDENT, _native.XFER_SET_MTIME
        counter = self.tmp_counter
        for j, (_src, _dst, src_leaf, dst_leaf, mode, mtime_ns, ident) in enumerate(self.group):
            x = xs[j]
            flags = base_flags
            if ident is not None:
                x.dev, x.ino = ident
                flags |= check_ident
            if mtime_ns is not None:
                x.mtime_ns = mtime_ns
                flags |= set_mtime
            x.flags = flags
            x.mode = mode
            x.max_bytes = bound
            counter += 1
            names += (src_leaf, prefix + str(counter).encode(), dst_leaf)
        self.tmp_counter = counter
        return names

    def _record(self, done: int) -> int:
        """Append the results of the group's first ``done`` files; returns the buffer offset after them."""
        view, xs, out = self.view, self.xfers, self.out
        sha256 = _hashlib_sha256
        off = 0
        for j in range(done):
            size = xs[j].size
            out.append((size, sha256(view[off:off + size]).hexdigest() if view is not None else None))
            off += size
        return off

    def flush(self) -> None:
        """Copy the group; raise the error of the first file that fails (those before it are done)."""
        group, xs = self.group, self.xfers
        attempts = 0
        while group:
            n = len(group)
            names = self._fill_xfers()
            blob = b"\0".join(names) + b"\0"
            done = _native.xfer_files(self.group_fds[0], self.group_fds[1], n, blob, len(blob), xs, self.cbuf,
                                      self.buffer_bytes, self.ret_box, self.uid, self.gid)
            off = self._record(done)
            if done == n:
                group.clear()
                return
            ret = self.ret_box[0]
            failed = group[done]
            tmp = names[3 * done + 1]
            del group[:done]
            if done:
                attempts = 0
            if ret == _native.XFER_MORE:  # larger than the rest of the buffer: finished here
                self.out.append(_finish_large(self.dst, xs + done, self.view, off, self.group_fds[1], tmp,
                                              failed.dst_leaf, self.bound, failed.dst))
                del group[0]
                attempts = 0
            elif ret == -errno.EEXIST and xs[done].stage == _native.STAGE_TMP_CREATE \
                    and attempts < _TMP_NAME_ATTEMPTS:
                attempts += 1  # a name planted in the destination: again with the next one
            else:
                stage = xs[done].stage
                group.clear()
                _raise_item_error(self.dst, -ret, stage, self.src, failed.src, failed.dst)


def copy_files(dst: Root, src: Root, items: Iterable[Any], *, max_bytes: int | None, digest: bool, fsync: bool,
               buffer_bytes: int, buffer: bytearray | None, before_each: Callable[[int], None] | None,
               results: list[CopyResult] | None) -> list[CopyResult]:
    """Copy ``items`` (``CopyItem`` or 5-tuples) from ``src`` into ``dst``: see ``Root.copy_files_from``.

    Raises:
        The errors listed in ``Root.copy_files_from``.
    """
    if buffer is not None:
        if type(buffer) is not bytearray:
            raise TypeError("buffer must be a bytearray")
        buffer_bytes = len(buffer)
    if buffer_bytes < 4096:
        raise ValueError("buffer_bytes must be at least 4096")
    out: list[CopyResult] = [] if results is None else results
    dst._check_writable(b".", "copy")
    batch = _Batch(dst, src, bound=_COPY_UNBOUNDED if max_bytes is None else max_bytes, digest=digest,
                   fsync=fsync, buffer_bytes=buffer_bytes, buffer=buffer, results=out)
    srootfd = src._acquire()
    try:
        drootfd = dst._acquire()
        try:
            _copy_items(batch, items, before_each, srootfd, drootfd)
        finally:
            batch.close_dirs(batch.dst_dirs)
            dst._release()
    finally:
        batch.close_dirs(batch.src_dirs)
        src._release()
    return out


def _copy_items(batch: _Batch, items: Iterable[Any], before_each: Callable[[int], None] | None,
                srootfd: int, drootfd: int) -> None:
    """Check each item, open its directories, and add it to the group (copied when the group is full or ends)."""
    dst, src, group = batch.dst, batch.src, batch.group
    src_dirs, dst_dirs = batch.src_dirs, batch.dst_dirs
    make_pending = _Pending._make
    for i, (srel_s, drel_s, mode, mtime_ns, ident) in enumerate(items):
        try:
            if before_each is not None:
                before_each(i)
            if type(mode) is not int or mode & ~0o777 or mode < 0:
                _check_mode(mode, drel_s)
            if type(srel_s) is not str or type(drel_s) is not str or "\0" in srel_s \
                    or "\0" in drel_s or srel_s[:1] == "/" or drel_s[:1] == "/":
                srel_s, drel_s = _checked_names(dst, src, srel_s, drel_s)
            sdir_s, _, sleaf_s = srel_s.rpartition("/")
            ddir_s, _, dleaf_s = drel_s.rpartition("/")
            sdfd = src_dirs.get(sdir_s)
            ddfd = dst_dirs.get(ddir_s)
            if sdfd is None or ddfd is None:  # a directory met for the first time: opened and checked
                sdfd, ddfd = batch.dir_fds(srootfd, drootfd, srel_s, sdir_s, drel_s, ddir_s)
        except BaseException:
            batch.flush()  # the items before this one are copied first, as promised
            raise
        group_fds = batch.group_fds
        if sdfd != group_fds[0] or ddfd != group_fds[1]:  # another directory pair: a new group
            if group:
                batch.flush()
            batch.group_fds = (sdfd, ddfd)
        elif len(group) >= GROUP_MAX:
            batch.flush()
        sleaf = sleaf_s.encode("utf-8", "surrogateescape")
        dleaf = sleaf if dleaf_s == sleaf_s else dleaf_s.encode("utf-8", "surrogateescape")
        group.append(make_pending((srel_s, drel_s, sleaf, dleaf, mode, mtime_ns, ident)))
    batch.flush()


def _checked_names(dst: Root, src: Root, srel: str | bytes, drel: str | bytes) -> tuple[str, str]:
    """Validate an unusual pair of item paths fully; return them as ``str``.

    Raises:
        InvalidPathError, PathEscapeError: as ``Root._split`` of either path.
    """
    for root, rel in ((src, srel), (dst, drel)):
        root._split(root._rel(rel), "copy")
    return os.fsdecode(srel), os.fsdecode(drel)


def _finish_large(dst: Root, x: Any, view: memoryview | None, off: int, ddfd: int, tmp: bytes, leaf: bytes, bound: int,
                  rel: str) -> CopyResult:
    """Finish a file whose first ``x.size`` bytes (at ``view[off:]``) are written, its fds open in ``x``.

    Reads the rest through the whole ``view``, hashes, writes, then renames
    the temporary name ``tmp`` over ``leaf`` in ``ddfd``.

    Raises:
        OSError(EFBIG): the source holds more than ``bound`` bytes (the temporary name is removed).
        OSError: a read, write or the rename failed.
    """
    assert view is not None  # XFER_MORE: only a file packed in the digest buffer is left unfinished
    try:
        h = _hashlib_sha256(view[off:off + x.size])
        total = x.size
        src_fd, tmp_fd = x.src_fd, x.tmp_fd
        while True:
            n = _retry_eintr(os.readv, src_fd, [view])
            if not n:
                break
            total += n
            if total > bound:
                _native.raise_errno(errno.EFBIG, "copy", dst._show(rel))
            chunk = view[:n]
            h.update(chunk)
            off = 0
            while off < n:
                off += _retry_eintr(os.write, tmp_fd, chunk[off:])
    except BaseException:
        _native.xfer_abort(ddfd, tmp, x)
        raise
    ret = _native.xfer_finish(ddfd, tmp, leaf, x)
    if ret < 0:
        _native.raise_errno(-ret, "copy", dst._show(rel))
    return total, h.hexdigest()


def _raise_item_error(dst: Root, err: int, stage: int, src: Root, srel: str, drel: str) -> None:
    """Raise the error of a failed item (its paths checked and formatted only now).

    Raises:
        SpecialFileError: the source is not a regular file.
        OSError(ESTALE): the source was replaced (identity check).
        InvalidPathError, PathEscapeError, SymlinkRefusedError, OSError: for ``err`` at ``stage``.
    """
    _checked_names(dst, src, srel, drel)
    if stage == _native.STAGE_SRC_OPEN:
        _native.raise_errno(err, "copy", src._show(srel))
    if stage == _native.STAGE_SRC_CHANGED:
        if err == errno.ESTALE:
            _native.raise_errno(err, "copy: the source was replaced", src._show(srel))
        raise SpecialFileError("copy: the source is not a regular file; it is never read",
                               sandbox_path=src._show(srel), context={"operation": "copy"})
    _native.raise_errno(err, "copy", dst._show(drel))
