"""Errors raised by :mod:`sandbox_fs.archive`.

Every refusal is a :class:`~sandbox_fs.errors.SandboxError` with a stable
``code``.  Member names come from an untrusted archive: they are shown
escaped (non-printable characters as ``\\xNN``) and cut to 200 characters,
so an error line can never carry terminal escapes or a newline.
"""

from __future__ import annotations

from typing import Any

from ..errors import SandboxError

__all__ = ["ArchiveLimitError", "UnsafeArchiveMemberError", "ArchiveFormatError", "show_name"]

_SHOW_MAX = 200


def show_name(name: str | bytes | None) -> str | None:
    """Return an archive member name made safe to print on one line.

    Args:
        name: the member name as read from the archive (``str`` or ``bytes``).

    Returns:
        The name with every non-printable or non-ASCII-safe character escaped
        (``\\n`` -> ``\\x0a``), cut to 200 characters plus ``...``; None stays None.
    """
    if name is None:
        return None
    if isinstance(name, bytes):
        name = name.decode("utf-8", "backslashreplace")
    out = []
    for ch in name:
        if ch.isprintable() and ch != "\\":
            out.append(ch)
        elif ch == "\\":
            out.append("\\\\")
        else:
            code = ord(ch)
            if 0xDC80 <= code <= 0xDCFF:  # surrogate-escaped undecodable byte
                code -= 0xDC00
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
    text = "".join(out)
    return text if len(text) <= _SHOW_MAX else text[:_SHOW_MAX] + "..."


class ArchiveLimitError(SandboxError):
    """A resource limit of :class:`~sandbox_fs.archive.ArchiveLimits` was reached.

    Extraction stops at once; in atomic mode nothing new remains.

    Attributes:
        limit: the ``ArchiveLimits`` field name (``"max_members"`` ...).
        allowed: the configured bound.
        observed: the value that broke it (measured, never a declared size
            unless the declared size alone already breaks the bound).
        member: the member being processed (escaped), or None.
    """

    code = "archive_limit"
    retryable = False

    def __init__(self, limit: str, allowed: Any, observed: Any, member: str | bytes | None = None, *,
                 sandbox_path: str | None = None, reason: str | None = None) -> None:
        self.limit = limit
        self.allowed = allowed
        self.observed = observed
        self.member = show_name(member)
        text = reason or f"{limit} exceeded: {observed} > {allowed}"
        if self.member is not None:
            text = f"member '{self.member}': {text}"
        super().__init__(text, sandbox_path=sandbox_path,
                         context={"limit": limit, "allowed": allowed, "observed": observed, "member": self.member})


class UnsafeArchiveMemberError(SandboxError):
    """A member breaks an extraction rule (zip slip, link escape, special file ...).

    Attributes:
        rule: stable name of the rule broken, one of ``absolute_name``,
            ``drive_letter``, ``dotdot``, ``nul_in_name``, ``empty_name``,
            ``names_destination``, ``name_too_long``, ``symlink_target``,
            ``through_symlink``, ``hardlink_target``, ``special_file``,
            ``unknown_type``, ``encrypted``, ``unsupported_compression``,
            ``name_mismatch``, ``overlapping_entries``, ``conflict``,
            ``symlink_refused``, ``hardlink_refused``.
        member: the member name (escaped).
    """

    code = "unsafe_member"
    retryable = False

    def __init__(self, rule: str, member: str | bytes | None, reason: str, *,
                 sandbox_path: str | None = None) -> None:
        self.rule = rule
        self.member = show_name(member)
        text = f"member '{self.member}': {reason} ({rule})" if self.member is not None else f"{reason} ({rule})"
        super().__init__(text, sandbox_path=sandbox_path, context={"rule": rule, "member": self.member})


class ArchiveFormatError(SandboxError):
    """The input is not a readable archive of the asked format (corrupt, truncated, unsupported)."""

    code = "archive_format"
    retryable = False

    def __init__(self, reason: str, *, member: str | bytes | None = None, sandbox_path: str | None = None,
                 diagnostic: str | None = None) -> None:
        self.member = show_name(member)
        text = f"member '{self.member}': {reason}" if self.member is not None else reason
        super().__init__(text, sandbox_path=sandbox_path, context={"member": self.member}, diagnostic=diagnostic)
