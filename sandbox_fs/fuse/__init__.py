"""The optional FUSE overlay (extra ``sandbox-fs[fuse]``): a mediated workspace.

A daemon child process per session serves the workspace over pyfuse3; every
operation on the mount is performed through :class:`~sandbox_fs.root.Root`
handles, under the overlay's policy (read-only trees, no special files, no
set-id bits, symlink targets kept inside, byte and inode quotas, audit
events, fault injection).  See SECURITY.md, "The FUSE overlay".

Importing this package does not import pyfuse3 (only the daemon does);
:meth:`Overlay.start` raises :class:`OverlayUnavailableError` where the
overlay cannot run.
"""

from __future__ import annotations

from ._audit import AuditEvent
from ._errors import OverlayError, OverlayUnavailableError
from ._faults import FaultRule
from ._overlay import Overlay, OverlayMount, mount_overlap, overlap_text
from ._rules import OverlayPolicy

__all__ = ["AuditEvent", "FaultRule", "Overlay", "OverlayError", "OverlayMount", "OverlayPolicy",
           "OverlayUnavailableError", "mount_overlap", "overlap_text"]
