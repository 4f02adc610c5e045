"""sandbox-fs: a security-hardened local filesystem sandbox.

The public surface is re-exported here; see :mod:`sandbox_fs.root` for the
capability object every file operation goes through.
"""

from __future__ import annotations

import functools
import os

from . import _native
from .errors import (
    InvalidPathError,
    NativeUnavailableError,
    PathEscapeError,
    ReadOnlyError,
    SandboxError,
    SymlinkRefusedError,
    WorkspaceClosedError,
)
from .paths import Grant, PathPolicy, SandboxPath, normalize
from .root import DirEntry, Root, UnsafeModeError, open_root

__all__ = [
    "Root",
    "open_root",
    "DirEntry",
    "PathPolicy",
    "Grant",
    "SandboxPath",
    "normalize",
    "features",
    "SandboxError",
    "PathEscapeError",
    "SymlinkRefusedError",
    "ReadOnlyError",
    "InvalidPathError",
    "WorkspaceClosedError",
    "NativeUnavailableError",
    "UnsafeModeError",
]

__version__ = "0.1.0"


@functools.lru_cache(maxsize=1)
def features() -> dict[str, object]:
    """What the running kernel offers, probed once per process.

    Returns:
        ``{"openat2": bool, "landlock_abi": int (0 when unavailable),
        "fuse": bool (``/dev/fuse`` is a character device we can open),
        "resolver": "openat2" | "fallback" (the default resolver now)}``.
    """
    abi = _native.lib.sfs_landlock_abi()
    fuse = False
    try:
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        os.close(fd)
        fuse = True
    except OSError:
        fuse = False
    return {
        "openat2": _native.have_openat2(),
        "landlock_abi": abi if abi > 0 else 0,
        "fuse": fuse,
        "resolver": _native.choose_resolver(),
    }
