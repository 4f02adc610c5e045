"""What an archive member's header numbers become on disk, and the keys of per-path state.

Modes follow PEP 706's ``data`` filter (:func:`file_mode`, :func:`dir_mode`);
owner ids are checked before ``fchown`` ever sees them (:func:`check_owner`);
mtimes become nanoseconds within the kernel's range (:func:`mtime_ns_of`).
Per-path state of an extraction is keyed by a 16-byte digest of the
normalized path (:func:`path_key`), directories by ``(st_dev, st_ino)``
(:func:`identity`).
"""

from __future__ import annotations

import hashlib
import os

from ._errors import ArchiveFormatError

#: what a path of this extraction holds (the values of the per-path kinds)
FILE, DIR, LINK = "file", "dir", "symlink"

__all__ = ["FILE", "DIR", "LINK", "file_mode", "dir_mode", "MAX_OWNER_ID", "check_owner", "mtime_ns_of", "path_key",
           "identity", "process_umask"]


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


def path_key(path: bytes) -> bytes:
    """A 16-byte BLAKE2b digest of a member path: per-member state stays small
    (about 150 bytes a member) however long the names are."""
    return hashlib.blake2b(path, digest_size=16).digest()


def process_umask() -> int:
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


def check_owner(owner: tuple[int, int], member: str | bytes) -> None:
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


def identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def mtime_ns_of(mtime: float | int | None) -> int | None:
    if mtime is None:
        return None
    try:
        ns = int(mtime * 1_000_000_000) if isinstance(mtime, float) else int(mtime) * 1_000_000_000
    except (OverflowError, ValueError):
        return None
    if not (-(1 << 62) < ns < (1 << 62)):
        return None
    return ns
