"""sandbox-fs: a security-hardened local filesystem sandbox.

The public surface is re-exported here; see :mod:`sandbox_fs.root` for the
capability object every file operation goes through.
"""

from __future__ import annotations

from . import _native
from .errors import (
    DirectoryReplacedError,
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
    "DirectoryReplacedError",
    "UnsafeModeError",
]

__version__ = "0.1.0"

# Higher layers are imported on first use so that `import sandbox_fs` stays
# light (pydantic and the archive code load only when needed).
_LAZY = {
    "Manifest": "manifest", "load_manifest": "manifest", "ManifestError": "manifest",
    "materialize": "materialize", "MaterializeOptions": "materialize",
    "MaterializationResult": "materialize",
    "LocalSandboxClient": "client", "ClientOptions": "client", "SessionState": "client",
    "RunState": "client", "open_session": "client",
    "Session": "session",
    "LocalSnapshotStore": "snapshot", "NoSnapshot": "snapshot", "SnapshotStore": "snapshot",
    "run_confined": "exec", "ExecResult": "exec", "ProcessSupervisor": "exec",
}
__all__ += list(_LAZY)


def __getattr__(name: str) -> object:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'sandbox_fs' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def features() -> dict[str, object]:
    """What the running kernel offers (probed once per process), less what ``SANDBOX_FS_DEGRADE`` removes.

    Returns:
        ``{"openat2": bool, "landlock_abi": int (0 when unavailable),
        "fuse": bool (the FUSE overlay can run: ``/dev/fuse`` opens, pyfuse3
        imports and ``fsopen("fuse")`` is permitted; the reason when not:
        ``fuse_reason`` in ``sandbox-fs features --json``),
        "resolver": "openat2" | "fallback" (the default resolver now)}``.
        Every value is the kernel's, lowered by
        :func:`sandbox_fs._features.lowered` (which never raises one).

    Raises:
        InvalidArgumentError: ``SANDBOX_FS_DEGRADE`` is malformed.
        ValueError: ``SANDBOX_FS_RESOLVER`` is malformed.
    """
    from ._features import fuse_status, lowered  # noqa: PLC0415

    fuse, _reason = fuse_status()
    return {
        "openat2": _native.have_openat2(),
        "landlock_abi": lowered().abi(_native.landlock_abi()),
        "fuse": fuse,
        "resolver": _native.choose_resolver(),
    }
