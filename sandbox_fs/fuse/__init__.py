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


# An internal contract outside ``__all__`` (the daemon's loop tuning, for the benchmark's pyfuse3 floor):
async def serve_pyfuse3() -> None:
    """Run ``pyfuse3.main()`` as the overlay daemon does: one worker task, no checkpoint for a free lock.

    For a pyfuse3 file system already set up with ``pyfuse3.init``, in a
    trio run: the daemon's loop tuning (``_loop``: one worker task, and
    ``pyfuse3.trio`` pointed at a trio whose ``Lock`` takes a free lock
    without a scheduler pass).  The daemon serves with it, and so does the
    benchmark's minimal passthrough (``bench/_floor_ptfs.py``), so that the
    floor and the overlay are measured with one tuning.  pyfuse3 is imported
    on the first call, not with this package.

    Raises:
        ImportError: pyfuse3 is not installed.
        Whatever ``pyfuse3.main()`` raises (a handler's exception).

    Cancellation: as ``pyfuse3.main()`` (its worker task is cancelled at
    its wait for the FUSE fd).
    """
    from ._loop import serve  # noqa: PLC0415 (imports pyfuse3)

    await serve()
