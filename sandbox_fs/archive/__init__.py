"""Bounded, streaming, race-free extraction of tar and zip archives into a ``Root``.

Entry points: :func:`extract` (synchronous) and :func:`extract_async` (trio,
one worker thread per archive).  Limits are :class:`ArchiveLimits` (on by
default), choices are :class:`ExtractPolicy`, the result an
:class:`ExtractReport`.

Rules (each refusal an :class:`UnsafeArchiveMemberError` with a stable ``rule``):

* names: absolute, drive letters, ``..`` (``/`` or ``\\`` separated), NUL,
  empty after normalization, or naming the destination itself are refused
  (a *directory* member ``./`` is skipped and reported instead);
* every file and directory is created through a ``Root`` that refuses
  symlinks on the whole path (``RESOLVE_NO_SYMLINKS``): nothing is ever
  written through a symlink, whatever an earlier member or another process
  did;
* symlink members are created **last**, only with relative targets that stay
  beneath the destination without passing through another symlink, and
  whose target, when it is not a member of the archive, is not a symlink
  already in an existing destination (links between members are each
  checked on their own; a planted one is not), with
  ``..`` only as leading components (the rule of ``Root.symlink``, shared with
  snapshot persist), and bounded by ``max_depth`` components and
  ``max_path_bytes``; a member under a pending symlink is refused
  (``through_symlink``);
* hard links only to a regular file extracted earlier in this run;
* devices, FIFOs, sockets and unknown types are refused (or skipped by policy);
* modes: setuid/setgid/sticky and group/other write cleared, owner rw(x)
  added, executable only when the archive says so; ownership: a destination
  Root with an ``owner`` gives it to every entry made (directories, files,
  symlinks, the staging directory; hard links share their target's inode),
  through the new entry's fd, and the archive's owners are then never
  applied; otherwise the archive's owners only with ``preserve_owner`` and
  running as root; mtimes set without following links;
* duplicates: a later file (or hard link) replaces an earlier file or
  pending symlink atomically, never writing through an earlier hard link's
  inode; a file never replaces a directory; a directory never replaces a file
  or a symlink; a symlink never replaces a file or a directory; symlink
  cycles are refused.

Memory is bounded by a buffer: the archive is streamed once, per-member state
is a 16-byte digest per path, pending symlinks are spooled to a host temp file.
An uncompressed tar given as a regular file (a host path) in atomic mode has
its new plain files made in batches (at most 64 files / 8 MiB queued and one
batch in flight) by one helper thread per extraction, each batch in one native
call, while the calling thread parses the next headers; every rule above is
checked before a file is queued, each queued file is created by its path
resolved beneath the staging directory when it is made (no directory fd is
kept across members), and a member is queued only when the source file holds
all of its data (see ``_batching``).
Header numbers used as sizes or offsets are never trusted to be non-negative:
a negative size (a GNU base-256 field, a PAX record) or sparse map entry is an
:class:`ArchiveFormatError`, before the member is counted or anything is made.
CPU is bounded too: each PAX header body is validated by a linear parser
before tarfile's (quadratic on digit runs in CPython < 3.11.10,
CVE-2024-6232) sees it; symlink checks are linear in the target; the zip
central directory is located as zipfile locates it and its entries are
counted while walking it.
"""

from __future__ import annotations

from ._errors import ArchiveFormatError, ArchiveLimitError, UnsafeArchiveMemberError
from ._extract import FORMATS, extract, extract_async

# The internal API of sandbox_fs.snapshot (the names in ``_for_snapshot.__all__``): importable from here,
# not public, so not in ``__all__``.  Other packages take archive's names from here, never from a ``_module``.
from ._for_snapshot import STAGED_PATH_MAX as STAGED_PATH_MAX
from ._for_snapshot import HeaderChainCheck as HeaderChainCheck
from ._for_snapshot import extract_stream as extract_stream
from ._for_snapshot import extract_streams as extract_streams
from ._for_snapshot import extracted_dir_mode as extracted_dir_mode
from ._for_snapshot import extracted_file_mode as extracted_file_mode
from ._for_snapshot import mtime_is_applied as mtime_is_applied
from ._for_snapshot import normalize_member_name as normalize_member_name
from ._for_snapshot import symlink_target_walk as symlink_target_walk
from ._models import ArchiveLimits, ExtractPolicy, ExtractReport, SkippedMember

__all__ = [
    "extract",
    "extract_async",
    "ArchiveLimits",
    "ExtractPolicy",
    "ExtractReport",
    "SkippedMember",
    "ArchiveLimitError",
    "UnsafeArchiveMemberError",
    "ArchiveFormatError",
    "FORMATS",
]
