"""Batches of new plain files, each made by one native call, and the helper thread that runs them.

A :class:`FileBatch` holds up to :data:`BATCH_FILES` files or
:data:`BATCH_BYTES` data bytes: per file ``XF_FIELDS`` ints (source offset,
size, padding probe, mode, mtime, flags) and a NUL-terminated path beneath
the directory the staging directory was made in.  :class:`CopyThread` is
the one helper thread of an extraction.  What may be queued, and when the
queue is flushed, is the extractor's business (see ``_writer``).
"""

from __future__ import annotations

import mmap
import queue
import threading
from array import array

from .. import _native

__all__ = ["FileBatch", "CopyThread", "BATCH_FILES", "BATCH_BYTES", "MEMORY_FILE_BYTES", "batch_buffer"]

#: a batch of queued new files is handed to the helper thread at this many files ...
BATCH_FILES = 64
#: ... or this many data bytes; a larger member is a batch of its own, or written one by one (cancellable once
#: a MiB) when the extraction can be cancelled
BATCH_BYTES = 8 << 20
#: the largest member queued with its bytes in the batch's memory (a source that is not a regular file);
#: a larger one is written one by one.  A batch so holds at most BATCH_BYTES + MEMORY_FILE_BYTES of data.
MEMORY_FILE_BYTES = 1 << 20


def batch_buffer() -> mmap.mmap:
    """A zeroed buffer for a batch's bytes in memory: ``BATCH_BYTES + MEMORY_FILE_BYTES`` long.

    An anonymous private mapping, not a ``bytearray``: ``bytearray(n)`` writes
    all of its 9 MiB (a page fault and a page of zeroes each, ~4-7 ms in
    the parsing thread), where a batch of small files uses a few MiB of it;
    here only the pages written are ever touched.  Private: a process forked
    meanwhile shares nothing of it.
    """
    return mmap.mmap(-1, BATCH_BYTES + MEMORY_FILE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


class FileBatch:
    """New files queued for one native call: ``XF_FIELDS`` ints and a NUL-terminated path each,
    ``pre`` (the staging directory's name and a slash) then the member path, resolved beneath
    ``stage_fd`` (the directory the staging directory was made in)."""

    __slots__ = ("nums", "names", "members", "n", "nbytes", "stage_fd", "resolver", "pre", "owner", "result",
                 "after", "withdrawn", "src_fd", "data")

    def __init__(self, stage_fd: int, resolver: str, pre: bytes, owner: tuple[int, int] | None) -> None:
        self.nums = array("q")
        self.names = bytearray()
        self.members: list[str | bytes] = []  # member names
        self.n = 0
        self.nbytes = 0
        self.stage_fd = stage_fd  # owned by the Extractor, open until the helper thread is idle
        self.resolver = resolver
        self.pre = pre
        self.owner = owner  # the Root's owner, given to each new file through its fd (None: as made)
        #: (done, errno, stage) once run, or the exception it raised; None: never run
        self.result: tuple[int, int, int] | BaseException | None = None
        #: the batch handed to the helper thread just before this one: this one runs only if all of it was made
        self.after: FileBatch | None = None
        #: set by the calling thread when it stops batching: a batch not started by then never runs
        self.withdrawn = False
        #: the source file its offsets are in (one batch never mixes sources: a chain's archives
        #: each have their own, see ``extract_streams``); -1 until its first member
        self.src_fd = -1
        #: the files' data when they are in memory (offsets index it, ``nbytes`` of it are theirs; ``src_fd``
        #: is then not read): written by the calling thread before the batch is handed over, never after
        self.data: mmap.mmap | None = None

    def made_all(self) -> bool:
        """True when the helper thread made every file of this batch."""
        res = self.result
        return isinstance(res, tuple) and res[0] >= self.n

    def runnable(self) -> bool:
        """True when the helper thread may start this batch: not withdrawn, and the one before it all made."""
        return not self.withdrawn and (self.after is None or self.after.made_all())

    def run(self, src_fd: int) -> None:
        try:
            if self.data is None:
                self.result = _native.extract_files(src_fd, self.stage_fd, self.resolver, self.nums, self.names,
                                                    self.n, self.owner)
            else:
                with memoryview(self.data) as whole, whole[:self.nbytes] as held:  # the bytes queued, no more
                    self.result = _native.extract_files(-1, self.stage_fd, self.resolver, self.nums, self.names,
                                                        self.n, self.owner, held)
        except BaseException as exc:  # reported in the calling thread
            self.result = exc


class CopyThread:
    """The one helper thread of an extraction: runs the batches handed to it, one at a time, in order.

    A batch is handed over before the calling thread waits for the one
    before it, so the thread goes from one batch to the next while the
    calling thread is blocked (it needs the GIL only then), and makes a
    batch only when every file of the one before it was made
    (:meth:`FileBatch.runnable`); a batch it does not make comes back with no
    result.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[FileBatch | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[FileBatch] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="sandbox-fs-extract-copy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        jobs, done = self._jobs, self._done
        while True:
            b = jobs.get()
            if b is None:
                return
            if b.runnable():
                b.run(b.src_fd)
            done.put(b)

    def put(self, b: FileBatch) -> None:
        self._jobs.put(b)

    def wait(self) -> FileBatch:
        return self._done.get()

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()
