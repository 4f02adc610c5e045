"""The errors of the FUSE overlay (all :class:`~sandbox_fs.errors.SandboxError`, stable ``code``)."""

from __future__ import annotations

from ..errors import SandboxError


class OverlayError(SandboxError):
    """The overlay daemon failed, died or answered out of protocol."""

    code = "overlay_error"
    retryable = False


class OverlayUnavailableError(OverlayError):
    """The overlay cannot run here: no ``/dev/fuse``, no pyfuse3, or no privilege to mount."""

    code = "overlay_unavailable"
    retryable = False
