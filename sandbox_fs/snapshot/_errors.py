"""The snapshot errors: every refusal of persist, hydrate and the stores is a :class:`SnapshotError`."""

from __future__ import annotations

from typing import Any

from ..errors import SandboxError

__all__ = [
    "SnapshotError",
    "SnapshotNotFoundError",
    "SnapshotCorruptError",
    "SnapshotLimitError",
    "SnapshotSourceChangedError",
    "UnrestorableEntryError",
    "SnapshotVerifyError",
    "SnapshotStoreError",
    "SnapshotConflictError",
]


class SnapshotError(SandboxError):
    """Base of snapshot refusals."""

    code = "snapshot_error"


class SnapshotNotFoundError(SnapshotError, LookupError):
    """The named snapshot does not exist in the store."""

    code = "snapshot_not_found"


class SnapshotCorruptError(SnapshotError, ValueError):
    """A snapshot's archive or metadata is truncated, altered or malformed."""

    code = "snapshot_corrupt"


class SnapshotLimitError(SnapshotError):
    """A snapshot exceeds :class:`SnapshotLimits` (at persist or at hydrate)."""

    code = "snapshot_limit"


class SnapshotSourceChangedError(SnapshotError):
    """The workspace changed under the walk (a file resized or replaced, a directory moved); retry may succeed."""

    code = "snapshot_source_changed"
    retryable = True


class UnrestorableEntryError(SnapshotError):
    """A workspace entry that hydrate would refuse (absolute/escaping symlink, FIFO, device, socket)."""

    code = "snapshot_unrestorable_entry"


class SnapshotVerifyError(SnapshotError):
    """A committed archive failed its CRC-32 read-back: the store fell back to the previous generation.

    ``context["generation"]`` is the generation that is current now (the
    previous one, or 0 when there was none) and ``context["failed_generation"]``
    the one that was withdrawn.  Nothing the previous generation held is lost;
    the workspace is unchanged, so persisting again may succeed.
    """

    code = "snapshot_verify_failed"
    retryable = True


class SnapshotStoreError(SnapshotError):
    """The object store could not be reached or refused the request.

    ``retryable`` is True for transient failures (connection refused or reset,
    timeouts, 5xx, throttling) and False for ones a retry cannot fix (bad
    credentials, a missing bucket, access denied).  The message never names
    a credential or a host path.
    """

    code = "snapshot_store_unavailable"
    retryable = True

    def __init__(self, reason: str, *, retryable: bool = True, **kw: Any) -> None:
        """Args as :class:`~sandbox_fs.errors.SandboxError`, plus ``retryable`` (bool, default True)."""
        super().__init__(reason, **kw)
        self.retryable = retryable


class SnapshotConflictError(SnapshotError):
    """Another writer advanced this snapshot's current-generation pointer first.

    Raised when two sessions (for example two machines resuming one state)
    persist to the same name: the first conditional pointer write wins, the
    other gets this error and nothing it wrote becomes current.  Not
    retryable: resume from the winner's state instead.
    """

    code = "snapshot_conflict"
    retryable = False
