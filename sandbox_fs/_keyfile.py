"""The per-installation key file (``.state-key``): taken only when no one but this user could have put it there.

:class:`~sandbox_fs.client.LocalSandboxClient` authenticates session states
with it, and :class:`~sandbox_fs.snapshot.DirectorySnapshotStore` derives its
baseline MAC key from it.  It lives in a host directory (the snapshot store
or the workspaces directory); a key that another user could have written or
read is no secret: a planted key lets its author forge session states and
baselines (a forged baseline makes persist record a changed file's previous
content).  So the key is used only when

- the file is a regular file (opened without following a symlink), with
  one link (not a hard link of another file), owned by the effective uid,
  with no permission bit for group or others, and at most 4 KiB;
- its directory is owned by the effective uid or root and no one else may
  rename or remove entries in it (no group/other write bit, or the sticky bit).

A missing key is created in such a directory, whole: 64 random hex digits
are written, fsynced and made 0600 under a temporary name opened with
``O_CREAT|O_EXCL``, then renamed onto the key's name with
``RENAME_NOREPLACE`` (never replacing a key another process made first), so
a reader sees no key or the whole one, never an empty or partial file, and
of two processes making it at once both end with the one that won (on a
file system without ``RENAME_NOREPLACE``, a hard link then the removal of
the temporary name).  A read (``create=False``) writes nothing.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat as _stat

from .errors import SandboxError
from .root import Root

__all__ = ["UnsafeKeyFileError", "installation_key", "MAX_KEY_FILE_BYTES"]

#: Largest key file read, in bytes.
MAX_KEY_FILE_BYTES = 4096


class UnsafeKeyFileError(SandboxError):
    """The installation key file, or its directory, could have been written or read by another user.

    ``context["reason"]`` says which rule failed (see :mod:`sandbox_fs._keyfile`).
    Nothing was read from the file; pass an explicit key
    (``ClientOptions.state_key``) or fix the file and its directory.
    """

    code = "unsafe_key_file"


def _refuse(name: str, why: str) -> UnsafeKeyFileError:
    return UnsafeKeyFileError("the installation key file is not safe to use as a secret; nothing was read",
                              sandbox_path=name, context={"reason": why})


def _check_dir(root: Root) -> None:
    st = root.stat(".")
    if st.st_uid not in (os.geteuid(), 0):
        raise _refuse(".", "its directory is owned by another user")
    if st.st_mode & 0o022 and not st.st_mode & _stat.S_ISVTX:
        raise _refuse(".", "its directory is writable by group or others (they could replace the key)")


def _check_file(fd: int, name: str) -> None:
    st = os.fstat(fd)
    if not _stat.S_ISREG(st.st_mode):
        raise _refuse(name, "not a regular file")
    if st.st_uid != os.geteuid():
        raise _refuse(name, "owned by another user")
    if st.st_mode & 0o077:
        raise _refuse(name, "readable or writable by group or others")
    if st.st_nlink != 1:
        raise _refuse(name, "has more than one link")
    if st.st_size > MAX_KEY_FILE_BYTES:
        raise _refuse(name, "larger than 4 KiB")


def _read(root: Root, name: str) -> bytes | None:
    """The checked key file's content, or None when it is missing."""
    try:
        fd = root.open_fd(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except SandboxError as exc:  # a symlink, FIFO, socket or device
        raise _refuse(name, f"not a regular file ({exc.code})") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
            raise _refuse(name, "a symbolic link") from None
        raise
    try:
        _check_file(fd, name)
        return os.pread(fd, MAX_KEY_FILE_BYTES + 1, 0)[:MAX_KEY_FILE_BYTES]
    finally:
        os.close(fd)


def installation_key(root: Root, name: str = ".state-key", *, create: bool = True) -> bytes | None:
    """Read (or make) the installation key ``name`` in the directory of ``root``, by the rules above.

    Args:
        root: the host directory's :class:`~sandbox_fs.root.Root`.
        name: the key file's name in it (``str``).
        create: make a missing key (64 random hex digits, mode 0600, moved
            into place whole); False never writes (a read-only use).

    Returns:
        The key's bytes, stripped of surrounding whitespace (possibly short
        or empty: the caller checks the length), or None when it is missing
        and ``create`` is False.

    Raises:
        UnsafeKeyFileError: the file or its directory breaks a rule.
        OSError, SandboxError: the directory cannot be read, or the key
            cannot be made (e.g. a read-only directory).
    """
    _check_dir(root)
    raw = _read(root, name)
    if raw is None and create:
        _create(root, name)
        raw = _read(root, name)
    return raw.strip() if raw is not None else None


def _create(root: Root, name: str) -> None:
    """Make the key ``name`` whole under a temporary name, then move it into place unless one exists by then.

    Raises:
        OSError, SandboxError: the directory cannot be written (ReadOnlyError, EACCES, ENOSPC ...).
    """
    tmp = f"{name}.{secrets.token_hex(8)}.tmp"
    fd = root.open_fd(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            data = secrets.token_hex(32).encode() + b"\n"
            done = 0
            while done < len(data):
                done += os.write(fd, data[done:])
            os.fsync(fd)
        finally:
            os.close(fd)
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile: theirs is the key
            try:
                root.rename(tmp, name, no_replace=True)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                root.link(tmp, name)  # a file system without RENAME_NOREPLACE (NFS): linkat never replaces either
    finally:
        with contextlib.suppress(OSError, SandboxError):
            root.remove(tmp)  # left only when the rename did not happen
