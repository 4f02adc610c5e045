"""Snapshot models: limits, metadata, the restore policy shared by persist and hydrate, reports.

*One policy for persist and hydrate* (a saved snapshot is always restorable):
persist applies the archive extractor's own rules (its member-name and
symlink-target functions, and the same limits): regular files, directories,
relative symlinks whose target stays beneath the workspace without passing
through another symlink, and hard links between members.  Absolute or
escaping symlinks, FIFOs, sockets, device nodes and names the extractor
refuses are refused at persist time (:class:`UnrestorableEntryError`) or,
with ``on_unrestorable="skip"``, left out and listed in the report.  Owners are
never recorded (uid/gid 0, no names); setuid/setgid/sticky bits are never
stored (modes are masked to 0o777, as :meth:`Root.chmod` enforces).
"""

from __future__ import annotations

import re
import stat as _stat
from dataclasses import dataclass, field
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..archive import STAGED_PATH_MAX, ArchiveLimits, ExtractPolicy, HeaderChainCheck
from ..errors import InvalidPathError
from ..root import MAX_PATH_BYTES
from ._errors import SnapshotLimitError

__all__ = [
    "SNAPSHOT_FORMAT",
    "SNAPSHOT_VERSION",
    "SnapshotLimits",
    "SnapshotInfo",
    "SnapshotPolicy",
    "PersistReport",
    "HydrateReport",
    "validate_name",
]

SNAPSHOT_FORMAT: Final = "sandbox-fs-snapshot"
SNAPSHOT_VERSION: Final = 1
#: the metadata version a :class:`~sandbox_fs.snapshot.GenerationStore` writes (``archive_blake3`` set; older
#: generations of this version have ``archive_sha256`` instead)
SNAPSHOT_VERSION_OBJECTS: Final = 2
_TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")


def validate_name(name: str, what: str = "snapshot name") -> str:
    """Return ``name`` if it is a plain token (``[A-Za-z0-9][A-Za-z0-9_-]{0,127}``).

    Snapshot names and session ids become file names in trusted host
    directories, so they may hold no ``/``, ``.``, NUL or anything else.

    Raises:
        InvalidPathError: ``name`` is not such a token.
    """
    if not isinstance(name, str) or not _TOKEN.fullmatch(name):
        shown = name[:64] if isinstance(name, str) else type(name).__name__
        raise InvalidPathError(f"{what} must be a plain token of letters, digits, '_' or '-'",
                               sandbox_path=None, context={"value": shown})
    return name


@dataclass(frozen=True)
class SnapshotLimits:
    """Bounds applied identically when persisting and when hydrating.

    Attributes:
        max_entries: most members (files, dirs, links) in one snapshot.
        max_file_bytes: largest single regular file, in bytes.
        max_total_bytes: most file content in one snapshot, in bytes.
        max_archive_bytes: largest archive file hydrate will read, in bytes.
    """

    max_entries: int = 1_000_000
    max_file_bytes: int = 16 << 30
    max_total_bytes: int = 64 << 30
    max_archive_bytes: int = 80 << 30


class SnapshotInfo(BaseModel):
    """Metadata stored next to each snapshot (``<name>.json`` in a local store).

    Attributes:
        format, version: ``"sandbox-fs-snapshot"`` and 1 (:class:`LocalSnapshotStore`) or 2
            (:class:`GenerationStore`: ``archive_blake3`` or, in older generations, ``archive_sha256``
            is set and checked at every read).
        name: the snapshot name (a plain token).
        archive: the store's name for the archive (``<name>.g<generation>.<token>.tar`` locally).
        archive_bytes: the archive's size, in bytes.
        archive_crc32: (version 1) the archive's CRC-32, 8 lowercase hex digits, required and
            checked at every read.  Version 2 rests on its archive digest instead: a generation
            persisted or copied now records "" here; an older one (written before the CRC-32 was
            dropped) carries a CRC-32, which is accepted (8 hex digits) and never relied on.
        fingerprint: :func:`fingerprint` of ``manifest_digest`` and ``tree_digest`` (64 hex digits).
        manifest_digest: the digest of the manifest the session ran with ("" when none).
        tree_digest: :func:`tree_digest` of what was persisted (64 hex digits).
        excluded: the normalized sandbox paths left out.
        mode_fixups: ``(sandbox path, mode)`` of members whose permission bits the
            extractor would otherwise change; hydrate applies them exactly.
        entries: members in the archive.
        content_bytes: bytes of regular-file content.
        created_ns: when persist finished the walk (``time.time_ns()``).
        generation: 1, 2, ... per name, assigned by the store at commit (0: none, e.g. a store without
            generations).
        archive_sha256: (version 2, generations persisted before ``archive_blake3``) the archive's
            SHA-256, 64 lowercase hex digits; "" otherwise.
        archive_blake3: (version 2) the archive's BLAKE3 (256-bit), 64 lowercase hex digits: what a
            generation persisted or copied now records ("" in version 1 and in older generations).
            At most one of ``archive_sha256`` and ``archive_blake3`` is set (see
            :mod:`~sandbox_fs.snapshot._digest`).
        digest: the SHA-256 of the stored metadata object itself, set by the store each time it
            reads it ("" for a store that does not); never stored (a value in the stored object is
            replaced).  A session's serialized state records it under its MAC, so metadata and data
            swapped together in the store are refused on resume.
        parent_generation: (version 2) 0 for a full generation; for a *layer* (only what changed
            since its parent, see :mod:`~sandbox_fs.snapshot._index`) the parent's generation.
        parent_digest: (version 2) the parent's metadata SHA-256 ("" for a full generation), so the
            digest of the newest metadata covers its whole chain.
        chain_length: (version 2) generations hydrate reads to restore this one (1: full).
        chain_bytes: (version 2) archive bytes of the chain's layers after its base (0: full).
        base_bytes: (version 2) archive bytes of the chain's full base generation.
        index_sha256, index_bytes: (version 2) the SHA-256 and size of the generation's index.
        deleted: (version 2) entries of the parent this generation no longer has.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["sandbox-fs-snapshot"] = SNAPSHOT_FORMAT
    version: Literal[1, 2] = SNAPSHOT_VERSION
    name: str
    archive: str
    archive_bytes: int = Field(ge=0)
    archive_crc32: str = Field(default="", pattern=r"^(?:[0-9a-f]{8})?$")
    fingerprint: str = Field(pattern=r"^[0-9a-f]{64}$")
    manifest_digest: str = ""
    tree_digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    excluded: list[str] = Field(default_factory=list)
    mode_fixups: list[tuple[str, int]] = Field(default_factory=list)
    entries: int = Field(ge=0)
    content_bytes: int = Field(ge=0)
    created_ns: int = 0
    generation: int = Field(default=0, ge=0)
    archive_sha256: str = Field(default="", pattern=r"^(?:[0-9a-f]{64})?$")
    archive_blake3: str = Field(default="", pattern=r"^(?:[0-9a-f]{64})?$")
    digest: str = Field(default="", pattern=r"^(?:[0-9a-f]{64})?$", exclude=True)
    parent_generation: int = Field(default=0, ge=0)
    parent_digest: str = Field(default="", pattern=r"^(?:[0-9a-f]{64})?$")
    chain_length: int = Field(default=1, ge=1)
    chain_bytes: int = Field(default=0, ge=0)
    base_bytes: int = Field(default=0, ge=0)
    index_sha256: str = Field(default="", pattern=r"^(?:[0-9a-f]{64})?$")
    index_bytes: int = Field(default=0, ge=0)
    deleted: int = Field(default=0, ge=0)

    @field_validator("name", "archive", "excluded", "mode_fixups", mode="after")
    @classmethod
    def _are_file_names(cls, v: str | list[str] | list[tuple[str, int]]) -> str | list[str] | list[tuple[str, int]]:
        """Each name or path is a file name, not a lone surrogate a JSON escape made.

        Every reader encodes them with ``surrogateescape``: hydrate the
        ``mode_fixups`` paths, a :class:`~sandbox_fs.root.Root` the
        ``archive`` a version-1 snapshot is opened, removed or copied by.
        ``'\ud800'`` there raised a bare UnicodeEncodeError (no SandboxError,
        the CLI's internal error); here it is a validation error, so every
        reader of the metadata gets SnapshotCorruptError.
        """
        for item in [v] if isinstance(v, str) else v:
            path = item if isinstance(item, str) else item[0]
            path.encode("utf-8", "surrogateescape")  # UnicodeEncodeError is a ValueError: a validation error
        return v

    @model_validator(mode="after")
    def _one_archive_check(self) -> "SnapshotInfo":
        """Version 1 is checked by its CRC-32 alone: it must carry one; version 2 by one archive digest."""
        if self.version == 1 and not self.archive_crc32:
            raise ValueError("version-1 snapshot metadata must record archive_crc32")
        if self.archive_sha256 and self.archive_blake3:
            raise ValueError("snapshot metadata records one archive digest: archive_sha256 or archive_blake3")
        if self.version == 1 and self.archive_blake3:
            raise ValueError("version-1 snapshot metadata records no archive_blake3")
        return self


class SnapshotPolicy:
    """The restore rules of a snapshot: one object, applied by persist and by hydrate.

    Hydrate treats a snapshot as an untrusted archive: it extracts it with
    :meth:`archive_limits` and :meth:`extract_policy` through the archive
    extractor, which parses every header with tarfile behind its guards.
    Persist applies the *same* object to what it is about to write, before
    anything is committed, so whatever persist commits, hydrate restores:

    * member names: the extractor's :func:`~sandbox_fs.archive.normalize_member_name`
      with :meth:`archive_limits` (zip slip CVE-2007-4559, backslash ``..``
      CVE-2021-37713, drive letters, NUL, a component over 255 bytes, depth,
      paths over :data:`~sandbox_fs.archive.STAGED_PATH_MAX`);
    * symlink targets: the extractor's :func:`~sandbox_fs.archive.symlink_target_walk` (absolute, escaping,
      through another symlink: CVE-2025-4517);
    * the header chain of every member exactly as written
      (:meth:`header_check`, the extractor's
      :class:`~sandbox_fs.archive.HeaderChainCheck`): each PAX extended header
      or GNU long name no larger than ``max_header_bytes``, a bounded number
      of them, each PAX body well formed and within the extractor's
      CVE-2024-6232 digit-run budget (per header and per archive);
    * counts and sizes: ``max_entries`` (members), ``max_file_bytes``,
      ``max_total_bytes`` and the archive's own size against
      ``max_archive_bytes`` (:meth:`check_archive_bytes`);
    * modes (:meth:`mode`): only the permission bits 0o777.  Set-user-ID,
      set-group-ID and sticky bits are never recorded at persist and always
      cleared at hydrate (a forged archive or ``mode_fixups`` carrying them
      restores the file without them): a snapshot never restores a set-id file.

    Args:
        limits: the :class:`SnapshotLimits` both sides apply (default: its defaults).
    """

    def __init__(self, limits: "SnapshotLimits | None" = None) -> None:
        self.limits = limits or SnapshotLimits()
        self.archive = self.archive_limits()

    def archive_limits(self, archive_bytes: int | None = None) -> ArchiveLimits:
        """The extractor's limits: the same bounds persist applied.

        Depth and path length are as wide as hydrate can stage: a path is at
        most :data:`~sandbox_fs.archive.STAGED_PATH_MAX` bytes (PATH_MAX
        less the staging directory's name, through which every restored path is
        reached).  An uncompressed tar never expands, so the expansion-ratio
        bound is left at its default.  With ``archive_bytes`` (the validated
        archive size, in bytes), the input is bounded by it too, not only by
        ``max_archive_bytes``.
        """
        limits = self.limits
        max_input = limits.max_archive_bytes if archive_bytes is None else max(
            1, min(limits.max_archive_bytes, archive_bytes))
        return ArchiveLimits(max_members=limits.max_entries, max_member_bytes=limits.max_file_bytes,
                             max_total_bytes=limits.max_total_bytes, max_input_bytes=max_input,
                             max_depth=MAX_PATH_BYTES // 2, max_path_bytes=STAGED_PATH_MAX)

    @staticmethod
    def extract_policy() -> ExtractPolicy:
        """How hydrate extracts: atomic staging, special files refused, links created, owners never applied."""
        return ExtractPolicy(in_place=False, special_files="refuse", symlinks="create", hardlinks="create",
                             preserve_owner=False, apply_mtime=True)

    @staticmethod
    def mode(st_mode: int) -> int:
        """The mode a snapshot records and restores: the permission bits only (set-id and sticky cleared)."""
        return _stat.S_IMODE(st_mode) & 0o777

    def header_check(self) -> HeaderChainCheck:
        """A fresh per-archive checker of written header chains (its PAX budget starts empty)."""
        return HeaderChainCheck(limits=self.archive)

    def check_archive_bytes(self, nbytes: int) -> None:
        """Refuse an archive hydrate would not read (larger than ``max_archive_bytes``).

        Raises:
            SnapshotLimitError: ``nbytes`` > ``max_archive_bytes``.
        """
        if nbytes > self.limits.max_archive_bytes:
            raise SnapshotLimitError("the snapshot archive would be larger than max_archive_bytes", sandbox_path=None,
                                     context={"max_archive_bytes": self.limits.max_archive_bytes,
                                              "archive_bytes": nbytes})


@dataclass
class PersistReport:
    """What :func:`persist` wrote.

    Attributes:
        info: the committed snapshot's metadata (None with :class:`NoSnapshot`).
        skipped: ``(sandbox path, reason)`` of entries left out (mount
            points, excluded paths, unrestorable entries with ``on_unrestorable="skip"``).
    """

    info: SnapshotInfo | None
    skipped: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class HydrateReport:
    """What :func:`hydrate` restored.

    Attributes:
        info: the metadata of the generation restored.
        extractor: the extractor used (``"archive"``).
        generation: the generation restored (``info.generation``): the current one, or with
            ``fallback=True`` an older kept one when newer ones failed verification.
        skipped_generations: the newer generations that failed verification and were passed over
            (newest first; empty when the current one was restored).
    """

    info: SnapshotInfo
    extractor: str
    generation: int = 0
    skipped_generations: list[int] = field(default_factory=list)
