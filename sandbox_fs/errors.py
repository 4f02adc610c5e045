"""The SandboxError family: every refusal sandbox-fs raises, and its stable codes.

Every refusal is a :class:`SandboxError` subclass with

* ``code``: a stable, machine-readable string (part of the public API);
* ``retryable``: set explicitly by each class, never inferred from text;
* ``sandbox_path``: the sandbox path involved (never a host path), or None;
* ``reason``: one human sentence;
* ``context``: a dict of extra, printable facts;
* ``diagnostic``: host-side detail (host paths, errno text) for logs only.
  ``str()`` and ``repr()`` never include it.

Errors that carry an errno are also the matching ``OSError`` subclass
(``PathEscapeError`` is a ``PermissionError`` with errno EXDEV, for example),
so ``except PermissionError`` keeps working.

Stable error codes (the same table is in SECURITY.md; ``tests/test_errors.py``
checks both against the classes).  ``SandboxError`` and ``SandboxOSError``
are bases and never raised themselves; "retryable" means running the same
operation again may succeed::

    | code | class | import from | retryable |
    |---|---|---|---|
    | `sandbox_error` | `SandboxError` | `sandbox_fs.errors` | no |
    | `sandbox_error` | `SandboxOSError` | `sandbox_fs.errors` | no |
    | `path_escape` | `PathEscapeError` | `sandbox_fs.errors` | no |
    | `symlink_refused` | `SymlinkRefusedError` | `sandbox_fs.errors` | no |
    | `read_only` | `ReadOnlyError` | `sandbox_fs.errors` | no |
    | `invalid_path` | `InvalidPathError` | `sandbox_fs.errors` | no |
    | `invalid_argument` | `InvalidArgumentError` | `sandbox_fs.errors` | no |
    | `workspace_closed` | `WorkspaceClosedError` | `sandbox_fs.errors` | no |
    | `native_unavailable` | `NativeUnavailableError` | `sandbox_fs.errors` | no |
    | `directory_replaced` | `DirectoryReplacedError` | `sandbox_fs.errors` | yes |
    | `special_file` | `SpecialFileError` | `sandbox_fs.root` | no |
    | `unsafe_mode` | `UnsafeModeError` | `sandbox_fs.root` | no |
    | `archive_limit` | `ArchiveLimitError` | `sandbox_fs.archive` | no |
    | `unsafe_member` | `UnsafeArchiveMemberError` | `sandbox_fs.archive` | no |
    | `archive_format` | `ArchiveFormatError` | `sandbox_fs.archive` | no |
    | `invalid_manifest` | `ManifestError` | `sandbox_fs.manifest` | no |
    | `manifest_untrusted_field` | `ManifestTrustError` | `sandbox_fs.manifest` | no |
    | `materialize_failed` | `MaterializeError` | `sandbox_fs.materialize` | no |
    | `source_refused` | `SourceRefusedError` | `sandbox_fs.materialize` | no |
    | `source_changed` | `SourceChangedError` | `sandbox_fs.materialize` | yes |
    | `materialize_limit` | `MaterializeLimitError` | `sandbox_fs.materialize` | no |
    | `materialize_limiter_tokens` | `LimiterTokensError` | `sandbox_fs.materialize` | no |
    | `mount_needs_overlay` | `MountNeedsOverlayError` | `sandbox_fs.materialize` | no |
    | `overlay_error` | `OverlayError` | `sandbox_fs.fuse` | no |
    | `overlay_unavailable` | `OverlayUnavailableError` | `sandbox_fs.fuse` | no |
    | `snapshot_error` | `SnapshotError` | `sandbox_fs.snapshot` | no |
    | `snapshot_not_found` | `SnapshotNotFoundError` | `sandbox_fs.snapshot` | no |
    | `snapshot_corrupt` | `SnapshotCorruptError` | `sandbox_fs.snapshot` | no |
    | `snapshot_limit` | `SnapshotLimitError` | `sandbox_fs.snapshot` | no |
    | `snapshot_source_changed` | `SnapshotSourceChangedError` | `sandbox_fs.snapshot` | yes |
    | `snapshot_unrestorable_entry` | `UnrestorableEntryError` | `sandbox_fs.snapshot` | no |
    | `snapshot_verify_failed` | `SnapshotVerifyError` | `sandbox_fs.snapshot` | yes |
    | `snapshot_store_unavailable` | `SnapshotStoreError` | `sandbox_fs.snapshot` | yes |
    | `snapshot_conflict` | `SnapshotConflictError` | `sandbox_fs.snapshot` | no |
    | `session_error` | `SessionError` | `sandbox_fs.session` | no |
    | `session_busy` | `SessionBusyError` | `sandbox_fs.session` | yes |
    | `session_not_started` | `SessionNotStartedError` | `sandbox_fs.session` | no |
    | `mount_overlap` | `MountOverlapError` | `sandbox_fs.session` | no |
    | `cross_root` | `CrossRootError` | `sandbox_fs.session` | no |
    | `feature_unavailable` | `FeatureUnavailableError` | `sandbox_fs.session` | no |
    | `workspace_mismatch` | `WorkspaceMismatchError` | `sandbox_fs.session` | no |
    | `snapshot_generation_mismatch` | `SnapshotGenerationError` | `sandbox_fs.session` | no |
    | `snapshot_digest_mismatch` | `SnapshotDigestMismatchError` | `sandbox_fs.session` | no |
    | `persist_disabled` | `PersistDisabledError` | `sandbox_fs.session` | no |
    | `session_state_invalid` | `SessionStateError` | `sandbox_fs.client` | no |
    | `session_state_version` | `SessionStateVersionError` | `sandbox_fs.client` | no |
    | `session_state_tampered` | `SessionStateTamperedError` | `sandbox_fs.client` | no |
    | `session_state_key_missing` | `SessionStateKeyMissingError` | `sandbox_fs.client` | no |
    | `unsafe_key_file` | `UnsafeKeyFileError` | `sandbox_fs.client` | no |
    | `exec_error` | `ExecError` | `sandbox_fs.exec` | no |
    | `confinement_unavailable` | `ConfinementError` | `sandbox_fs.exec` | no |
    | `command_not_found` | `CommandNotFoundError` | `sandbox_fs.exec` | no |
    | `exec_timeout` | `ExecTimeoutError` | `sandbox_fs.exec` | no |
    | `exec_failed` | `ExecFailedError` | `sandbox_fs.exec` | no |
    | `pty_not_found` | `PtyNotFoundError` | `sandbox_fs.exec` | no |
    | `invalid_env` | `InvalidEnvError` | `sandbox_fs.exec` | no |
    | `device_refused` | `DeviceError` | `sandbox_fs.exec` | no |
    | `cli_input` | `CliInputError` | (command line only) | no |
"""
from __future__ import annotations

import errno as _errno
from typing import Any, Iterable, Mapping

__all__ = [
    "SandboxError",
    "PathEscapeError",
    "SymlinkRefusedError",
    "ReadOnlyError",
    "InvalidPathError",
    "InvalidArgumentError",
    "WorkspaceClosedError",
    "NativeUnavailableError",
    "DirectoryReplacedError",
    "SandboxOSError",
    "redact",
]

_REDACTED = "***"


def redact(text: str, secrets: Iterable[str]) -> str:
    """Return ``text`` with every non-empty value of ``secrets`` replaced by ``***``.

    Longer secrets are replaced first so that a secret containing another is
    never half-revealed.
    """
    for value in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(value, _REDACTED)
    return text


class SandboxError(Exception):
    """Base of every sandbox-fs refusal.  Never raised bare.

    Args:
        reason: one sentence saying what was refused and why.
        sandbox_path: the sandbox path involved (``str``), or None.
        context: extra printable facts (``dict[str, Any]``).
        diagnostic: host-side detail for logs; never printed by ``str()``.
        secrets: values to redact from the message and context.
    """

    code: str = "sandbox_error"
    retryable: bool = False

    def __init__(
        self,
        reason: str,
        *,
        sandbox_path: str | None = None,
        context: Mapping[str, Any] | None = None,
        diagnostic: str | None = None,
        secrets: Iterable[str] = (),
    ) -> None:
        if type(self) is SandboxError:
            raise TypeError("SandboxError is abstract: raise a subclass")
        secrets = tuple(secrets)
        self.reason = redact(reason, secrets)
        self.sandbox_path = sandbox_path
        self.context = {
            k: (redact(v, secrets) if isinstance(v, str) else v)
            for k, v in dict(context or {}).items()
        }
        self.diagnostic = diagnostic
        Exception.__init__(self, self._message())

    def _message(self) -> str:
        where = f" [{self.sandbox_path}]" if self.sandbox_path is not None else ""
        return f"{self.code}{where}: {self.reason}"

    def __str__(self) -> str:
        return self._message()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._message()!r})"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view (no diagnostic): code, retryable, path, reason, context."""
        return {
            "code": self.code,
            "retryable": self.retryable,
            "sandbox_path": self.sandbox_path,
            "reason": self.reason,
            "context": self.context,
        }


class SandboxOSError(SandboxError, OSError):
    """A SandboxError that is also an ``OSError`` with a fixed errno.

    Subclasses set ``errno_value``.  ``OSError.__str__`` is overridden so the
    message never includes a host filename.
    """

    errno_value: int = _errno.EIO

    def __init__(self, reason: str, **kw: Any) -> None:
        SandboxError.__init__(self, reason, **kw)
        self.errno = self.errno_value
        self.strerror = self.reason
        self.filename = self.sandbox_path

    def __str__(self) -> str:  # OSError would print "[Errno n] ..."
        return self._message()


class PathEscapeError(SandboxOSError, PermissionError):
    """A path, symlink or link would resolve outside its root (errno EXDEV)."""

    code = "path_escape"
    errno_value = _errno.EXDEV


class SymlinkRefusedError(SandboxOSError):
    """A symlink was met where none is allowed, or a chain too long (ELOOP)."""

    code = "symlink_refused"
    errno_value = _errno.ELOOP


class ReadOnlyError(SandboxOSError, PermissionError):
    """A write was attempted through a read-only Root or grant (EROFS)."""

    code = "read_only"
    errno_value = _errno.EROFS


class InvalidPathError(SandboxError, ValueError):
    """A sandbox path is malformed: NUL, empty, too long, or climbs above its root.

    Raised by :func:`sandbox_fs.paths.normalize` and by every operation that
    takes a sandbox path.
    """

    code = "invalid_path"


class InvalidArgumentError(SandboxError, ValueError):
    """An option or argument given by the caller is out of range or malformed (not a path)."""

    code = "invalid_argument"


class WorkspaceClosedError(SandboxError, ValueError):
    """A Root (or an object holding one) was used after close().

    An operation running while another thread closes the Root finishes first;
    the close takes effect when the last one ends.
    """

    code = "workspace_closed"


class NativeUnavailableError(SandboxError, ImportError):
    """The compiled native module is missing or does not match this package.

    Raised when ``sandbox_fs`` is imported; reinstall the package (``pip install .``)
    so the module is compiled for this source.
    """

    code = "native_unavailable"


class DirectoryReplacedError(SandboxOSError):
    """A directory reached by its name is no longer the one it was (another process replaced it).

    Raised by :class:`sandbox_fs.root.Subtree` when the directory at its path
    has another ``(st_dev, st_ino)`` than recorded: nothing was done in it.
    Retrying the whole operation may succeed.
    """

    code = "directory_replaced"
    errno_value = _errno.ESTALE
    retryable = True
