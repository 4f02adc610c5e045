"""Limits, policy and report models of :mod:`sandbox_fs.archive` (pydantic v2, frozen).

Each model's validator is built on its first use (``defer_build``), not at import, so a
command that never builds one does not pay for it (about 35 ms of CPU at start-up here).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ArchiveLimits", "ExtractPolicy", "ExtractReport", "SkippedMember"]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


class ArchiveLimits(BaseModel):
    """Resource bounds for one extraction.  ON by default, sized for a workspace.

    Every bound is checked against what is *measured while streaming*
    (bytes actually decompressed, written and read), never against sizes an
    archive declares; a declared size that alone already breaks a bound is
    refused early.  A breach raises
    :class:`~sandbox_fs.archive.ArchiveLimitError` at once.

    Attributes:
        max_members: members (files, dirs, links, skipped ones) per archive.
        max_total_bytes: uncompressed bytes written to disk, all members.
        max_member_bytes: uncompressed bytes of one member (sparse members
            count their real, expanded size).
        max_expansion_ratio: bound on (uncompressed bytes produced) /
            (compressed bytes actually read from the source); "produced" is
            the larger of the decompressed archive stream and the bytes
            written.  Checked once more than ``ratio_grace_bytes`` were
            produced, so tiny highly compressible archives pass.
        ratio_grace_bytes: uncompressed bytes produced before the ratio is
            enforced.
        max_path_bytes: bytes of a member name (and of a link target, and of
            the path a symlink target names) after normalization (PATH_MAX
            is 4096).  An atomic extraction lowers it to 4,065
            (``STAGED_PATH_MAX``: every staged path is reached as
            ``<staging name>/<member>``, and that must fit PATH_MAX).
        max_depth: path components of a member name and of a symlink target.
        max_header_bytes: bytes of one PAX extended header or GNU long
            name/link header (checked from the header block's size field
            before tarfile reads the header body into memory); also the bound
            on the sum of all PAX *global* headers.
        max_input_bytes: bytes read from the source (the compressed archive).
        max_cpu_seconds: CPU seconds the extracting thread may spend on one
            archive (``time.thread_time``), or None (the default: off).
            Defence in depth only: checked per member and per chunk read or
            written, so one call into a parser is not cut short; the
            parsers' own costs are bounded by the other limits.
        max_central_directory_bytes: zip central directory size (the ZIP64
            one when present), checked from the EOCD records before any entry
            list is built; zipfile's reads are then bounded to it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    max_members: int = Field(100_000, ge=1)
    max_total_bytes: int = Field(4 * GiB, ge=0)
    max_member_bytes: int = Field(1 * GiB, ge=0)
    max_expansion_ratio: float = Field(200.0, ge=1.0)
    ratio_grace_bytes: int = Field(16 * MiB, ge=0)
    max_path_bytes: int = Field(4096, ge=1, le=4096)
    max_depth: int = Field(64, ge=1, le=2048)
    max_header_bytes: int = Field(1 * MiB, ge=512)
    max_input_bytes: int = Field(8 * GiB, ge=1)
    max_central_directory_bytes: int = Field(16 * MiB, ge=22)
    max_cpu_seconds: float | None = Field(None, gt=0)


class ExtractPolicy(BaseModel):
    """What to do with members that are legal but not always wanted.

    Attributes:
        in_place: write straight into the destination (fast, NOT atomic: a
            failure leaves the members extracted so far; the member being
            written is removed).  Default False: stage, then move in.
        special_files: devices, FIFOs, sockets and unknown member types:
            ``"refuse"`` (raise, the default) or ``"skip"`` (skip and report).
        symlinks: ``"create"`` (the default, only targets resolving beneath
            the destination), ``"skip"`` (skip and report) or ``"refuse"``.
        hardlinks: ``"create"`` (to a regular file extracted earlier in this
            run), ``"skip"`` or ``"refuse"``.
        preserve_owner: apply the archive's uid/gid; honoured only when
            running as root (euid 0), otherwise ignored.  Ignored too when
            the destination Root has an ``owner`` (a workspace whose content
            belongs to the confined identity): the Root's owner wins, every
            entry made gets it.
        apply_mtime: set member mtimes (never following links).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    in_place: bool = False
    special_files: Literal["refuse", "skip"] = "refuse"
    symlinks: Literal["create", "skip", "refuse"] = "create"
    hardlinks: Literal["create", "skip", "refuse"] = "create"
    preserve_owner: bool = False
    apply_mtime: bool = True


class SkippedMember(BaseModel):
    """One member not extracted (policy ``skip``), with the rule and why."""

    model_config = ConfigDict(frozen=True, defer_build=True)

    member: str
    rule: str
    reason: str


class ExtractReport(BaseModel):
    """What one extraction did.

    Attributes:
        format: the archive format read (``"tar"``, ``"tar.gz"``, ``"tar.bz2"``,
            ``"tar.xz"``, ``"zip"``).
        members: members seen (including skipped ones).
        files, dirs, symlinks, hardlinks: nodes created.
        bytes_written: uncompressed file bytes written (bytes).
        input_bytes: bytes read from the source (bytes).
        skipped: members skipped by policy, with the reason (the first 1,000).
        skipped_count: how many members were skipped in all.
    """

    model_config = ConfigDict(frozen=True, defer_build=True)

    format: str
    members: int = 0
    files: int = 0
    dirs: int = 0
    symlinks: int = 0
    hardlinks: int = 0
    bytes_written: int = 0
    input_bytes: int = 0
    skipped: list[SkippedMember] = Field(default_factory=list)
    skipped_count: int = 0

    def summary(self) -> str:
        """One line for humans: counts, bytes and skips."""
        return (f"{self.files} files, {self.dirs} dirs, {self.symlinks} symlinks, {self.hardlinks} hard links, "
                f"{self.bytes_written} bytes written from {self.input_bytes} {self.format} bytes"
                + (f", {self.skipped_count} skipped" if self.skipped_count else ""))
