"""The one importer of the compiled module ``sandbox_fs._sfs_native``.

It turns the C functions' ``-errno`` returns into exceptions:

* ``EXDEV``  -> :class:`~sandbox_fs.errors.PathEscapeError` (a PermissionError)
* ``ELOOP``  -> :class:`~sandbox_fs.errors.SymlinkRefusedError`
* any other -> the matching ``OSError`` subclass (``FileNotFoundError``, ...)
  with ``filename`` set to the *sandbox* path and ``operation`` set.

It also picks the resolver: ``openat2`` when the kernel has it, else the
component-walking fallback; ``SANDBOX_FS_RESOLVER=fallback`` (or ``openat2``)
forces one.
"""

from __future__ import annotations

import errno
import os
import threading
from typing import TYPE_CHECKING, Any

from .errors import NativeUnavailableError, PathEscapeError, SymlinkRefusedError

if TYPE_CHECKING:
    from array import array

EXPECTED_ABI = 11

try:
    from ._sfs_native import ffi, lib  # noqa: F401  (the only import of it)
except ImportError as exc:  # pragma: no cover - exercised only on broken installs
    raise NativeUnavailableError(
        "the compiled module sandbox_fs._sfs_native is missing; reinstall with 'pip install .'",
        diagnostic=repr(exc),
    ) from None

if lib.SFS_ABI_VERSION != EXPECTED_ABI:  # pragma: no cover
    raise NativeUnavailableError(
        f"native ABI {lib.SFS_ABI_VERSION} does not match the Python package (expects {EXPECTED_ABI}); rebuild",
    )

RESOLVE_BENEATH = lib.RESOLVE_BENEATH
RESOLVE_NO_MAGICLINKS = lib.RESOLVE_NO_MAGICLINKS
RESOLVE_NO_SYMLINKS = lib.RESOLVE_NO_SYMLINKS
RESOLVE_NO_XDEV = lib.RESOLVE_NO_XDEV
RENAME_NOREPLACE = lib.RENAME_NOREPLACE
RENAME_EXCHANGE = lib.RENAME_EXCHANGE
O_PATH = lib.O_PATH
O_TMPFILE = lib.O_TMPFILE
MAX_SYMLINK_HOPS = lib.SFS_MAX_SYMLINK_HOPS
XFER_CHECK_IDENT = lib.SFS_XFER_CHECK_IDENT
XFER_FSYNC = lib.SFS_XFER_FSYNC
XFER_SET_MTIME = lib.SFS_XFER_SET_MTIME
XFER_MORE = lib.SFS_XFER_MORE
STAGE_SRC_OPEN = lib.SFS_STAGE_SRC_OPEN
STAGE_SRC_CHANGED = lib.SFS_STAGE_SRC_CHANGED
STAGE_TMP_CREATE = lib.SFS_STAGE_TMP_CREATE
# The raw per-file copy functions (return 0 / XFER_MORE / -errno; no mapping):
# see native/ and sandbox_fs._root_copy, their one caller.
xfer_file = lib.sfs_xfer_file
xfer_finish = lib.sfs_xfer_finish
xfer_abort = lib.sfs_xfer_abort
xfer_files = lib.sfs_xfer_files  # many files of one directory pair per call
NULL = ffi.NULL
XF_FIELDS = lib.SFS_XF_FIELDS
XF_CHMOD = lib.SFS_XF_CHMOD
XF_MTIME = lib.SFS_XF_MTIME
XF_STAGE_CREATE = lib.SFS_XF_STAGE_CREATE
XF_STAGE_COPY = lib.SFS_XF_STAGE_COPY
XF_STAGE_SHORT = lib.SFS_XF_STAGE_SHORT
XF_STAGE_META = lib.SFS_XF_STAGE_META

# Raw calls for hot paths and callers that decide what an errno means
# themselves: they return an fd / 0 or -errno and never raise.
#: ``open_file(dirfd, rel, flags, mode, resolve, fallback, allow_special)``:
#: open beneath ``dirfd`` (the resolver picked by ``fallback``, 0 or 1), then
#: refuse a FIFO, socket or device with -ENXIO unless ``allow_special``;
#: returns the new fd or -errno (see ``sfs_open_file`` in native/).
open_file = lib.sfs_open_file
#: ``open_member(dirfd, rel, flags, resolve, fallback, probe, out)``: :data:`open_file` for reading, and the
#: new fd's fstat into ``out`` (an ``int64_t[MEMBER_FIELDS]``: st_mode, st_ino, st_dev, st_nlink, st_size,
#: the mtime's seconds and nanoseconds, the ctime's, then with ``probe`` 0 when a read lease could be taken
#: and released on a regular file, else 1); returns the new fd or -errno (see ``sfs_open_member`` in native/)
open_member = lib.sfs_open_member
MEMBER_FIELDS = 10

# Handle calls (sandbox_fs._root_handle, see native/resolve.c): raw, each returns >= 0
# or -errno and never raises; the caller checks its name arguments first.
#: ``fchmod_empty(fd, mode)``: fchmodat2(fd, "", mode, AT_EMPTY_PATH)
fchmod_empty = lib.sfs_fchmod_empty
#: ``utimens_empty(fd, atime_ns, mtime_ns, how)``: utimensat(fd, "", AT_EMPTY_PATH), how = TIME_* bits
utimens_empty = lib.sfs_utimens_empty
#: ``fchown_empty(fd, uid, gid)``: fchownat(fd, "", AT_EMPTY_PATH|AT_SYMLINK_NOFOLLOW), -1 leaves an id
fchown_empty = lib.sfs_fchown_fd
#: ``link_empty(fd, newdirfd, name)``: linkat(fd, "", newdirfd, name, AT_EMPTY_PATH)
link_empty = lib.sfs_link_empty
#: ``open_name(dirfd, name, flags, mode, allow_special, expect_dev, expect_ino, uid, gid)`` -> fd
open_name = lib.sfs_open_name
#: ``make_name(dirfd, name, kind, mode, rdev, target, uid, gid)`` -> O_PATH fd of the entry made
make_name = lib.sfs_make_name
#: ``getdents(fd, buf, len)`` -> bytes of linux_dirent64 records (0 at the end)
getdents = lib.sfs_getdents
TIME_ATIME_OMIT = lib.SFS_TIME_ATIME_OMIT
TIME_ATIME_NOW = lib.SFS_TIME_ATIME_NOW
TIME_MTIME_OMIT = lib.SFS_TIME_MTIME_OMIT
TIME_MTIME_NOW = lib.SFS_TIME_MTIME_NOW
MAKE_DIR = lib.SFS_MAKE_DIR
MAKE_NODE = lib.SFS_MAKE_NODE
MAKE_SYMLINK = lib.SFS_MAKE_SYMLINK
renameat2_fn = lib.sfs_renameat2


def raise_errno(err: int, op: str, sandbox_path: str | None) -> None:
    """Raise the exception for positive errno ``err`` during ``op`` on ``sandbox_path``.

    Raises:
        PathEscapeError: err is EXDEV.
        SymlinkRefusedError: err is ELOOP.
        OSError: the matching subclass for every other errno.
    """
    shown = sandbox_path if sandbox_path is not None else "?"
    if err == errno.EXDEV:
        raise PathEscapeError(
            f"{op}: path resolves outside its root", sandbox_path=sandbox_path,
            context={"operation": op},
        )
    if err == errno.ELOOP:
        raise SymlinkRefusedError(
            f"{op}: a symlink is not allowed here, or the chain is too long",
            sandbox_path=sandbox_path, context={"operation": op},
        )
    exc = OSError(err, f"{os.strerror(err)} ({op})", shown)
    exc.operation = op  # type: ignore[attr-defined]
    raise exc


def check(ret: int, op: str, sandbox_path: str | None) -> int:
    """Return ``ret`` when >= 0, else raise for ``-ret`` (see :func:`raise_errno`)."""
    if ret < 0:
        raise_errno(-ret, op, sandbox_path)
    return ret


def _probe_openat2() -> bool:
    fd = lib.sfs_openat2(-100, b"/", os.O_RDONLY | os.O_DIRECTORY, 0, 0)  # AT_FDCWD
    if fd >= 0:
        os.close(fd)
        return True
    return -fd not in (errno.ENOSYS, errno.EPERM)


_HAVE_OPENAT2: bool | None = None


def have_openat2() -> bool:
    """True when the kernel offers openat2(2), seccomp does not block it (probed once) and
    ``SANDBOX_FS_DEGRADE`` does not remove it (:func:`sandbox_fs._features.lowered`)."""
    global _HAVE_OPENAT2
    if _HAVE_OPENAT2 is None:
        _HAVE_OPENAT2 = _probe_openat2()
    from ._features import lowered  # noqa: PLC0415

    return _HAVE_OPENAT2 and lowered().has("openat2")


def choose_resolver() -> str:
    """Return ``"openat2"`` or ``"fallback"`` from the kernel and ``SANDBOX_FS_RESOLVER``.

    Raises:
        ValueError: SANDBOX_FS_RESOLVER holds something else than openat2 / fallback / auto.
    """
    forced = os.environ.get("SANDBOX_FS_RESOLVER", "auto").strip().lower()
    if forced == "fallback":
        return "fallback"
    if forced in ("openat2", "auto", ""):
        if have_openat2():
            return "openat2"
        if forced == "openat2":
            raise NativeUnavailableError("SANDBOX_FS_RESOLVER=openat2 but the kernel refuses openat2")
        return "fallback"
    raise ValueError("SANDBOX_FS_RESOLVER must be 'openat2', 'fallback' or 'auto'")


def open_beneath(resolver: str, dirfd: int, rel: bytes, flags: int, mode: int, resolve: int,
                 op: str, sandbox_path: str | None) -> int:
    """Open ``rel`` beneath ``dirfd``; returns a new O_CLOEXEC fd.

    ``resolve`` always gains RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS.  The
    fallback resolver is used when ``resolver == "fallback"``.

    Raises:
        PathEscapeError, SymlinkRefusedError, OSError: see :func:`raise_errno`.
    """
    return check(open_beneath_ret(resolver, dirfd, rel, flags, mode, resolve), op, sandbox_path)


def open_beneath_ret(resolver: str, dirfd: int, rel: bytes, flags: int, mode: int, resolve: int) -> int:
    """:func:`open_beneath` returning ``-errno`` instead of raising (for a caller that names the path only on error)."""
    resolve |= RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS
    if resolver == "fallback":
        return lib.sfs_open_fallback(dirfd, rel, flags, mode, resolve)
    ret = lib.sfs_openat2(dirfd, rel, flags, mode, resolve)
    if ret in (-errno.ENOSYS, -errno.EPERM) and not have_openat2():  # pragma: no cover
        ret = lib.sfs_open_fallback(dirfd, rel, flags, mode, resolve)
    return ret


def set_times_fd(fd: int, ns: int, op: str, sandbox_path: str | None) -> None:
    """Set atime and mtime (``ns`` nanoseconds since the epoch) of the inode ``fd`` refers to.

    ``fd`` may be an ``O_PATH`` fd (a symlink opened ``O_PATH|O_NOFOLLOW``):
    ``utimensat(fd, "", AT_EMPTY_PATH)``, so the times go to the inode that
    was opened and checked, never to whatever a name points to later.

    Raises:
        OSError: EINVAL on kernels without ``AT_EMPTY_PATH`` for utimensat, or any other failure.
    """
    check(lib.sfs_set_times_fd(fd, ns), op, sandbox_path)


def fchown_fd(fd: int, owner: tuple[int, int], op: str, sandbox_path: str | None) -> None:
    """Give the inode ``fd`` refers to the owner ``(uid, gid)``: ``fchownat(fd, "", AT_EMPTY_PATH|AT_SYMLINK_NOFOLLOW)``.

    ``fd`` may be an ``O_PATH`` fd, of a symlink too (the link itself is
    changed, never its target): the owner goes to the inode that was opened
    and checked, never to whatever a name points to later.  An id of -1
    leaves that one unchanged.

    Raises:
        OSError: EINVAL for an id over 2**32 - 2; EPERM without the privilege; any other failure.
    """
    check(lib.sfs_fchown_fd(fd, owner[0], owner[1]), op, sandbox_path)


def owner_ids(owner: tuple[int, int] | None) -> tuple[int, int]:
    """``(uid, gid)`` for the native batch functions: ``(-1, -1)`` (leave as made) for None."""
    return (-1, -1) if owner is None else owner


def renameat2(olddirfd: int, old: bytes, newdirfd: int, new: bytes, flags: int,
              op: str, sandbox_path: str | None) -> None:
    """renameat2(2) on names relative to two dir fds (flags: RENAME_NOREPLACE ...)."""
    check(lib.sfs_renameat2(olddirfd, old, newdirfd, new, flags), op, sandbox_path)


def openat2_raw(dirfd: int, rel: bytes, flags: int, mode: int, resolve: int) -> int:
    """openat2(2) of ``rel`` beneath ``dirfd`` with exactly the ``resolve`` flags given.

    Returns:
        The new fd, or -errno (-ENOSYS when the kernel lacks openat2).  Never raises.
    """
    return lib.sfs_openat2(dirfd, rel, flags, mode, resolve)


def renameat2_raw(olddirfd: int, old: bytes, newdirfd: int, new: bytes, flags: int) -> int:
    """renameat2(2) (flags: RENAME_NOREPLACE, RENAME_EXCHANGE ...) without mapping the errno.

    Returns:
        0, or -errno.  Never raises.
    """
    return lib.sfs_renameat2(olddirfd, old, newdirfd, new, flags)


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (>= 1), or -errno (-ENOSYS, -EOPNOTSUPP) when there is none.

    Never raises.
    """
    return lib.sfs_landlock_abi()


def landlock_create(fs: int, net: int, scoped: int) -> int:
    """landlock_create_ruleset(2) handling the ``fs`` / ``net`` / ``scoped`` access masks.

    The attribute size passed matches the highest non-zero mask, so an
    older kernel accepts a ruleset that does not use the newer fields.

    Returns:
        The ruleset fd, or -errno.  Never raises.
    """
    return lib.sfs_landlock_create(fs, net, scoped)


def landlock_add_path(ruleset_fd: int, fd: int, access: int) -> int:
    """landlock_add_rule(2) PATH_BENEATH: allow ``access`` beneath the object ``fd`` refers to.

    Returns:
        0, or -errno.  Never raises.
    """
    return lib.sfs_landlock_add_path(ruleset_fd, fd, access)


def landlock_add_port(ruleset_fd: int, port: int, access: int) -> int:
    """landlock_add_rule(2) NET_PORT: allow TCP ``access`` on ``port``.

    Returns:
        0, or -errno.  Never raises.
    """
    return lib.sfs_landlock_add_port(ruleset_fd, port, access)


def copy_fd(in_fd: int, out_fd: int, max_bytes: int, op: str, sandbox_path: str | None) -> int:
    """Copy at most ``max_bytes`` from ``in_fd`` to ``out_fd``; returns bytes copied.

    Raises:
        OSError(EFBIG): the source holds more than ``max_bytes`` bytes.
        OSError: any other read/write failure.
    """
    return check(lib.sfs_copy(in_fd, out_fd, max_bytes), op, sandbox_path)


#: bytes of one record header of :func:`scan_dir` (native/scan.h), before the name
SCAN_HEADER_BYTES = lib.SFS_SCAN_HEADER_BYTES
#: the most bytes :func:`scan_dir` lists a directory into by default: 64 MiB, about a million names
#: of 8 bytes or 200,000 of 255 (a record is the header and the name, padded to 8 bytes)
SCAN_MAX_BYTES = 64 << 20
_SCAN_FIRST_BYTES = 64 << 10  # a directory of several hundred names fits; a larger one is listed again
_SCAN_SLACK_BYTES = 16 << 10  # room on a second call for names added since the first counted them
_scan_alloc = ffi.new_allocator(should_clear_after_alloc=False)  # sfs_scan_dir writes every byte it returns
_scan_local = threading.local()  # each thread's first buffer and need cell, reused call after call


def scan_dir(dfd: int, max_bytes: int | None = None) -> bytes:
    """Every entry of the directory open on ``dfd`` with its ``lstat``, in one native call.

    The directory is listed from its start (``getdents64`` on ``dfd``, whose
    file position is put back to the start afterwards) and each name ``fstatat``-ed relative to ``dfd`` with
    ``AT_SYMLINK_NOFOLLOW``; a name removed between the two is left out.  A
    directory too large for the first buffer (64 KiB, reused by the calling
    thread) is listed again into one of the size the first call counted (at
    least twice the last), up to ``max_bytes``.

    Args:
        dfd: an ``O_RDONLY | O_DIRECTORY`` fd.
        max_bytes: the most bytes of records to list (None: :data:`SCAN_MAX_BYTES`).

    Returns:
        The records (native/scan.h): per entry a :data:`SCAN_HEADER_BYTES`
        header (ino, dev, size, mtime_ns, ctime_ns, nlink, mode, name length;
        native byte order) and the name's bytes, zero-padded to 8 bytes; in
        the order the filesystem lists them.

    Raises:
        OSError(EFBIG): the listing needs more than ``max_bytes`` bytes (no
            syscall the scan makes returns EFBIG: never the kernel's errno).
        OSError: ``lseek``, ``getdents64`` or an ``fstatat`` failed (without a
            path: the caller names the directory); its errno as the kernel gave it.
    """
    if max_bytes is None:
        max_bytes = SCAN_MAX_BYTES
    local = _scan_local.__dict__
    first = local.get("buf")
    if first is None:
        first = local["buf"] = _scan_alloc("char[]", _SCAN_FIRST_BYTES)
        local["need"] = ffi.new("uint64_t *")
    need = local["need"]
    buf, size = first, min(_SCAN_FIRST_BYTES, max_bytes)
    while True:
        n = lib.sfs_scan_dir(dfd, buf, size, need)
        if n >= 0:
            return ffi.buffer(buf, n)[:]
        if not need[0]:  # an errno (ENOBUFS included, were a syscall to give it): never "too small"
            raise OSError(-n, os.strerror(-n))
        if need[0] > max_bytes:
            raise OSError(errno.EFBIG, f"a directory listing needs more than {max_bytes} bytes")
        # at least double: names added between the calls never make it list more than ~10 times
        size = min(max(need[0] + _SCAN_SLACK_BYTES, 2 * size), max_bytes)
        buf = _scan_alloc("char[]", size)


def new_xfer() -> object:
    """A zeroed ``struct sfs_xfer *`` (owned by the returned cdata) for :data:`xfer_file`."""
    return ffi.new("struct sfs_xfer *")


def new_xfers(n: int) -> object:
    """A zeroed ``struct sfs_xfer[n]`` (owned by the returned cdata) for :data:`xfer_files`."""
    return ffi.new("struct sfs_xfer[]", n)


def new_int() -> object:
    """A zeroed ``int *`` out-parameter (owned by the returned cdata)."""
    return ffi.new("int *")


def member_out(buf: bytearray) -> object:
    """An ``int64_t *`` view of the writable ``buf`` (valid while ``buf`` lives), the ``out`` of :data:`open_member`."""
    return ffi.from_buffer("int64_t[]", buf, require_writable=True)


def buffer_of(buf: bytearray) -> object:
    """A ``char *`` view of the writable ``buf`` (valid while ``buf`` lives), for :data:`xfer_file`."""
    return ffi.from_buffer("char[]", buf, require_writable=True)


def extract_files(src_fd: int, stage_fd: int, resolver: str, nums: "array[int]", names: bytearray,
                  n: int, owner: tuple[int, int] | None = None, data: Any = None) -> tuple[int, int, int]:
    """Create and fill ``n`` new files beneath ``stage_fd`` in one native call (the GIL is released for all of it).

    Each file is created by its path, resolved beneath ``stage_fd`` at that moment
    (``O_WRONLY|O_CREAT|O_EXCL|O_NOFOLLOW`` with ``RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS|
    RESOLVE_NO_MAGICLINKS``, or the fallback walker with the same flags), never
    through a directory fd kept from earlier.

    Args:
        src_fd: the uncompressed tar source (a regular file), read at explicit offsets
            (not used with ``data``).
        stage_fd: the staging directory's fd (an ``O_PATH`` directory fd).
        resolver: ``"openat2"`` or ``"fallback"`` (the Root's resolver).
        nums: ``array("q")`` of ``XF_FIELDS`` ints per entry: source offset (bytes),
            size (bytes), offset of a byte that must exist (-1: none), mode, mtime (ns),
            ``XF_CHMOD | XF_MTIME`` flags.
        names: ``n`` NUL-terminated paths relative to ``stage_fd``, one per entry.
        n: entry count.
        owner: ``(uid, gid)`` given to each new file with ``fchown`` of its fd
            right after it is created (a failure is ``XF_STAGE_META``); None
            leaves them as the process makes them.
        data: a buffer (``bytes``, ``bytearray``) holding the files' data instead of
            ``src_fd``: the source offsets index it, each file is written from it with
            ``write``; an entry past its end is ``XF_STAGE_SHORT``.  It must not change
            during the call.

    Returns:
        ``(done, errno, stage)``: ``done == n`` when every file was made; else the
        index of the failed entry (its file removed; earlier entries complete, later
        ones untouched), its positive errno and ``XF_STAGE_*`` (``EINVAL`` at
        ``XF_STAGE_CREATE``: a negative offset or size, nothing created).  Never
        raises for an errno: the caller decides what it means.

    Raises:
        ValueError: ``n`` is negative or ``nums`` holds fewer than ``n`` entries.
    """
    if n < 0 or len(nums) < n * XF_FIELDS:
        raise ValueError("extract_files: nums holds fewer than n entries")
    out = ffi.new("int64_t[2]")
    uid, gid = owner_ids(owner)
    buf = ffi.from_buffer("char[]", data) if data is not None else ffi.NULL
    done = lib.sfs_extract_files(src_fd, buf, len(data) if data is not None else 0, stage_fd,
                                 1 if resolver == "fallback" else 0,
                                 ffi.from_buffer("int64_t[]", nums), ffi.from_buffer("char[]", names),
                                 len(names), n, out, uid, gid)
    return done, int(out[0]), int(out[1])


# The new mount API (native/mount.c), for the FUSE overlay daemon's detached mount.
FSOPEN_CLOEXEC = lib.FSOPEN_CLOEXEC
FSMOUNT_CLOEXEC = lib.FSMOUNT_CLOEXEC
MOUNT_ATTR_NOSUID = lib.MOUNT_ATTR_NOSUID
MOUNT_ATTR_NODEV = lib.MOUNT_ATTR_NODEV


def fsopen(fsname: bytes, flags: int) -> int:
    """fsopen(2): a new filesystem context fd for ``fsname`` (``FSOPEN_CLOEXEC``).

    Returns:
        The context fd, or -errno (-EPERM without CAP_SYS_ADMIN, -ENODEV for
        an unknown filesystem type).  Never raises.
    """
    return lib.sfs_fsopen(fsname, flags)


def fsconfig_string(fs_fd: int, key: bytes, value: bytes) -> int:
    """fsconfig(2) ``FSCONFIG_SET_STRING`` of ``key`` to ``value``.  Returns 0 or -errno; never raises."""
    return lib.sfs_fsconfig_string(fs_fd, key, value)


def fsconfig_flag(fs_fd: int, key: bytes) -> int:
    """fsconfig(2) ``FSCONFIG_SET_FLAG`` of ``key``.  Returns 0 or -errno; never raises."""
    return lib.sfs_fsconfig_flag(fs_fd, key)


def fsconfig_create(fs_fd: int) -> int:
    """fsconfig(2) ``FSCONFIG_CMD_CREATE``: create the superblock.  Returns 0 or -errno; never raises."""
    return lib.sfs_fsconfig_create(fs_fd)


def fsmount(fs_fd: int, flags: int, attr_flags: int) -> int:
    """fsmount(2): a mount of the created context, attached nowhere (``MOUNT_ATTR_*`` in ``attr_flags``).

    Returns:
        An ``O_PATH`` fd on the mount's root, or -errno.  Never raises.
    """
    return lib.sfs_fsmount(fs_fd, flags, attr_flags)


# Capabilities the overlay daemon keeps once mounted (native/mount.c).
CAP_CHOWN = lib.CAP_CHOWN
CAP_DAC_OVERRIDE = lib.CAP_DAC_OVERRIDE
CAP_DAC_READ_SEARCH = lib.CAP_DAC_READ_SEARCH
CAP_FOWNER = lib.CAP_FOWNER
CAP_MKNOD = lib.CAP_MKNOD


def drop_capabilities(keep: int) -> int:
    """Drop every capability whose bit is not set in ``keep`` from all of this thread's sets, bounding included.

    Capabilities are per thread: only the calling thread is changed (call it
    while the process has one thread).  Returns 0 or -errno (-EPERM: a kept
    capability is not permitted, or CAP_SETPCAP is missing); never raises.
    """
    return lib.sfs_drop_capabilities(keep)

