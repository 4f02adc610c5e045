"""The tar stream persist writes: headers from :mod:`._header`, file data through a few fixed buffers.

Memory is O(1) in workspace size: one file is open at a time and data moves
through fixed 1 MiB buffers (at most :data:`_MAX_BUFFERS`): each file is read
into one (``readv``), SHA-256-hashed there for the fingerprint and, with its
header, handed to one writer thread that writes (and the sink digests) the others
meanwhile, so every byte is read once and the write uses the second core.
A file of :data:`OFFLOAD_SHA_BYTES` or more may instead be hashed by the
writer thread, in the buffer it was read into, before that buffer is
written (:class:`PendingSha`): the caller walks on meanwhile.  A
file that grows or shrinks while it is read no longer matches its header and
is refused (:class:`SnapshotSourceChangedError`, retryable).  The writer
thread is joined before persist returns or raises, and a write error (ENOSPC)
is raised by persist: the archive is then discarded, never committed.
"""

from __future__ import annotations

import hashlib
import os
import queue
import tarfile
import threading
from typing import TYPE_CHECKING, Any

from ._errors import SnapshotError, SnapshotSourceChangedError

if TYPE_CHECKING:
    from ._store import _HashingSink

_BLOCK_BYTES = tarfile.BLOCKSIZE  # 512: tar members and headers are padded to this
_RECORD_BYTES = tarfile.RECORDSIZE  # 10240: the archive is padded to this, as tarfile does
_ZEROS = bytes(_RECORD_BYTES)


# Not exactly 1 MiB: on ext4 (Linux 6.x, large folios) appending exactly 1 MiB
# at 1 MiB-aligned offsets stalled for 0.6-1 s in about half the runs (240 MiB
# archive; large-folio allocation), while 1 MiB - 512 never did.  A multiple of
# the tar block, so headers and padding still pack.
_WRITE_BUF_BYTES = (1 << 20) - _BLOCK_BYTES

#: most write buffers one persist uses (8 MiB).  Two kept the walk waiting for the writer thread while
#: large files streamed (the stdlib tree into a DirectorySnapshotStore, load ~1, persists alternating:
#: 448 ms with 2, 438 with 4, 419 with 8, 410 with 16, 408 with 32; the walk's wait 49 -> 17 ms at 8).
#: 8, not 16: persisting 1 GiB, peak RSS 42 MiB with 2 buffers, 55.5 with 16 (goal <= 64 MiB).  They
#: are made only as the walk gets ahead: a layer of a few files uses one.
_MAX_BUFFERS = 8

#: a file at least this large may be SHA-256-hashed by the writer thread (``add_file(defer=True)``).  Each
#: such file costs a queue item and a wake-up of the writer (a futex call, and GIL hand-offs); from 64 KiB on
#: (about 35 us of hashing) that is small against the hash it moves, and on the stdlib tree the 10% of
#: files this large hold 2/3 of the bytes, which balances the writer (write, the sink's digest, those hashes) with
#: the walk (16 KiB: 1/3 of the files, 89% of the bytes, the writer the slower side and ~20 ms more CPU).
OFFLOAD_SHA_BYTES = 64 << 10


class PendingSha:
    """The SHA-256 of a file being hashed by the writer thread: its hex digest once :meth:`done`.

    The writer thread updates ``sha`` with the file's bytes, in the buffer
    they were read into, before it writes that buffer; it counts every hash
    job it has taken (:attr:`_WriterThread.hashed`), so the digest is final
    once that count reaches ``seq`` (the count at the file's last job).
    """

    __slots__ = ("sha", "seq", "_writer")

    def __init__(self, sha: "hashlib._Hash", seq: int, writer: "_WriterThread") -> None:
        self.sha = sha
        self.seq = seq
        self._writer = writer

    def done(self) -> bool:
        """True once the writer thread has hashed every byte of the file."""
        return self._writer.hashed >= self.seq

    def hexdigest(self) -> str:
        """The hex SHA-256 of the file's content.

        Raises:
            RuntimeError: not :meth:`done` yet (a caller bug: read it after the stream's ``close``).
        """
        if not self.done():
            raise RuntimeError("a file's SHA-256 was read before the persist writer hashed it")
        return self.sha.hexdigest()


def _buffer() -> memoryview:
    """A zero-filled buffer of ``_WRITE_BUF_BYTES``.

    A ``bytearray``, not an anonymous ``mmap``: glibc serves it from its heap
    once the first one was freed (its mmap threshold rises past 1 MiB), so a
    later persist finds the pages already mapped, where a fresh mapping
    faulted in each of its 256 pages again on every persist (a 1% layer of
    the stdlib tree took longer).
    """
    return memoryview(bytearray(_WRITE_BUF_BYTES))


class _WriterThread:
    """The persist writer thread: writes filled buffers to the sink, in order.

    Buffering: :class:`_TarStream` fills one buffer while this thread
    writes the others to the sink (``os.write`` and the sink's digest, a
    BLAKE3 or a version-1 store's CRC-32, of 1 MiB: both release the GIL, so they run on the second core while
    the caller walks, builds headers, reads and hashes files).  Buffers go
    round through two queues (filled -> written -> free again).  There are
    two at first; :meth:`swap` makes another when none is free, up to
    :data:`_MAX_BUFFERS`, and then waits until one is written, so memory
    stays that many buffers however large the workspace.  (The walk is the
    faster side while large files stream: this thread writes every byte and
    digests it: BLAKE3 into a :class:`GenerationStore`, CRC-32 into a version-1 store; more buffers let
    the walk run ahead there and this thread catch up while small files
    are walked, instead of the walk waiting.)  The SHA-256 of
    file data stays in the caller's thread: per-file hash steps each need
    the GIL, so moving them here makes small files slower.

    Besides buffers to write, the queue carries *hash jobs* (:meth:`hash`):
    ``(sha, bytes of a buffer)``, applied in order; a hash job for bytes of a
    buffer is always queued before that buffer's write, so the bytes are
    hashed before the buffer can come back to the caller.  :attr:`hashed`
    counts the hash jobs taken (see :class:`PendingSha`).

    The first error (ENOSPC ...) is kept and raised in the caller's thread
    by the next :meth:`swap` or :meth:`drain`; buffers after it are
    dropped, never written.  :meth:`stop` must be called on every path
    (persist does it in a ``finally``): it joins the thread before the
    caller closes the sink's fd, so no write can ever reach a reused fd.
    """

    def __init__(self, sink: "_HashingSink", spare: memoryview) -> None:
        self._sink = sink
        self._filled: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._free: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
        self._free.put(spare)
        self._spares = 1  # buffers made besides the one the caller holds
        self._error: BaseException | None = None
        self._stopped = False
        self.queued = 0  # hash jobs queued (caller's thread)
        self.hashed = 0  # hash jobs taken (writer thread)
        self._thread = threading.Thread(target=self._run, name="sfs-persist-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        filled, free, write = self._filled, self._free, self._sink.write
        while True:
            job = filled.get()
            if job is None:
                return
            buf, n = job
            if type(n) is not int:  # a hash job: (sha, bytes of a buffer queued after it)
                if self._error is None:
                    buf.update(n)
                self.hashed += 1
                continue
            try:
                if self._error is None:
                    write(buf[:n])
            except BaseException as exc:  # kept and raised in the caller's thread
                self._error = exc
            free.put(buf)

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def swap(self, buf: memoryview, n: int) -> memoryview:
        """Queue the first ``n`` bytes of ``buf`` for writing; return a written (or new) buffer.

        The caller must not touch ``buf`` until it is returned by a later swap.

        Raises:
            OSError: an earlier buffer failed to write (ENOSPC ...).
        """
        self._raise()
        self._filled.put((buf, n))
        try:
            other = self._free.get(block=False)
        except queue.Empty:  # every other buffer is still queued: another, up to _MAX_BUFFERS, else wait
            if self._spares + 1 < _MAX_BUFFERS:
                self._spares += 1
                other = _buffer()
            else:
                other = self._free.get()
        self._raise()
        return other

    def hash(self, sha: "hashlib._Hash", data: memoryview) -> int:
        """Queue ``sha.update(data)`` for the writer thread; ``data`` lies in a buffer not yet queued for writing.

        Returns:
            The hash jobs queued so far, this one included (see :class:`PendingSha`).
        """
        self.queued += 1
        self._filled.put((sha, data))
        return self.queued

    def write_now(self, data: bytes) -> None:
        """Write ``data`` after everything queued, and wait for it (a very long header; never in practice).

        Raises:
            OSError: writing failed.
        """
        spares = self._take_spares()  # every buffer queued is written
        self._filled.put((memoryview(data), len(data)))
        self._free.get()  # ``data`` is written
        for spare in spares:
            self._free.put(spare)
        self._raise()

    def _take_spares(self) -> list[memoryview]:
        """Every buffer but the caller's, each once written (a buffer comes back to ``_free`` only then)."""
        return [self._free.get() for _ in range(self._spares)]

    def drain(self) -> None:
        """Wait until every queued buffer is written (the caller holds one more).

        Raises:
            OSError: writing a buffer failed.
        """
        for spare in self._take_spares():
            self._free.put(spare)
        self._raise()

    def stop(self) -> None:
        """End the thread and join it (idempotent); nothing queued after an error is written."""
        if not self._stopped:
            self._stopped = True
            if self._error is None:
                self._error = SnapshotError("persist was abandoned", sandbox_path=None)
            self._filled.put(None)
        self._thread.join()


class _TarStream:
    """Streams tar members through fixed buffers of ``_WRITE_BUF_BYTES`` (1 MiB - 512) bytes into a sink.

    Headers are the caller's bytes, built by :func:`._header.encode_header`
    (ustar, or POSIX.1-2001 PAX when a field does not fit; the bytes
    tarfile's PAX writer makes, UTF-8 with ``surrogateescape``); file
    data is read from the member's fd straight into the buffer with
    ``readv`` (no per-chunk ``bytes`` objects, no second copy) and
    SHA-256-hashed there for the fingerprint.  With a sink, there are a few
    buffers and a :class:`_WriterThread`: while this thread walks, builds
    headers and reads files into one buffer, the writer writes the others
    to the sink (which digests and counts every byte).  The thread and the
    second buffer are started when the first buffer is full: an archive
    that fits one buffer (a layer of a few changed files) is written by
    :meth:`close` in the caller's thread, with no thread started and no
    hand-off to wait for.  So each file byte
    is read once, hashed once and written once, and memory stays
    :data:`_MAX_BUFFERS` buffers at most however large the workspace.  The caller must :meth:`stop` the
    writer on every path (success or failure) before the sink's fd is closed.

    With ``sink=None`` nothing is written and there is no thread: files are
    only hashed, in place (:func:`tree_digest`).

    A member must match its header: a file that returns fewer bytes than
    the size in its header (it shrank) or more (it grew) while it is read
    raises :class:`SnapshotSourceChangedError` (retryable); the archive is
    then discarded by the caller, never committed.
    """

    def __init__(self, sink: "_HashingSink | None") -> None:
        self.sink = sink
        self._view: memoryview | None = None  # made on first use (an empty archive needs none)
        self.pos = 0
        self.total = 0  # bytes handed to the sink so far
        self._writer: _WriterThread | None = None  # started when the first buffer is full

    @property
    def view(self) -> memoryview:
        """The buffer being filled."""
        if self._view is None:
            self._view = _buffer()
        return self._view

    @view.setter
    def view(self, buf: memoryview) -> None:
        self._view = buf

    @property
    def writes(self) -> bool:
        """True when members go to a sink; False when file data is only hashed."""
        return self.sink is not None

    def _writer_thread(self) -> _WriterThread:
        """The writer thread, started on first use with a second buffer (see the class docstring)."""
        if self._writer is None:
            assert self.sink is not None
            self._writer = _WriterThread(self.sink, _buffer())
        return self._writer

    def flush(self) -> None:
        """Hand the buffered bytes to the writer thread and switch buffers.

        Raises:
            OSError: writing an earlier buffer to the sink failed (ENOSPC ...).
        """
        if self.sink is None:
            self.pos = 0
            return
        if not self.pos:
            return
        self.view = self._writer_thread().swap(self.view, self.pos)  # returns a written (or new) buffer
        self.total += self.pos
        self.pos = 0

    def _put(self, data: bytes) -> None:
        n = len(data)
        if self.pos + n > _WRITE_BUF_BYTES:
            self.flush()
            if n > _WRITE_BUF_BYTES:  # a very long PAX header; never in practice (PATH_MAX)
                self._writer_thread().write_now(data)
                self.total += n
                return
        self.view[self.pos:self.pos + n] = data
        self.pos += n

    def add(self, hdr: bytes) -> None:
        """Append a member header without data (directory, symlink, hard link): its bytes from ``encode_header``."""
        if self.sink is not None:
            self._put(hdr)

    def add_file(self, size: int, fd: int, path: str, hdr: bytes | None, defer: bool = False) -> str | PendingSha:
        """Append a regular file's header and exactly ``size`` bytes read from ``fd``, then padding.

        Args:
            size: the size in its header (bytes, from the caller's ``fstat``):
                the exact length the data must have.
            fd: the member's fd, opened ``O_NOFOLLOW`` and identity-checked
                by the caller, positioned at offset 0.
            path: its sandbox path (for errors).
            hdr: its header bytes (``encode_header``); None without a sink
                (only hashed, nothing written).
            defer: with a sink, a file of :data:`OFFLOAD_SHA_BYTES` or more is
                hashed by the writer thread: a :class:`PendingSha` is returned.

        Returns:
            The hex SHA-256 of the file's content, or its :class:`PendingSha`.

        Raises:
            SnapshotSourceChangedError: the file shrank or grew while read.
            OSError: reading ``fd`` or writing the sink failed.
        """
        threaded = self.sink is not None  # data stays in the buffer (else it is only hashed there)
        if threaded:
            assert hdr is not None, "a written member needs its header"
            self._put(hdr)
        sha = hashlib.sha256()
        # (a file hashed by the writer thread starts it, if the first buffer has not yet)
        offload = self._writer_thread() if threaded and defer and size >= OFFLOAD_SHA_BYTES else None
        seq = 0
        left = size
        while True:
            room = _WRITE_BUF_BYTES - self.pos
            if not room:
                self.flush()
                room = _WRITE_BUF_BYTES
            # Ask for one byte more than the header's size: getting it means the file grew.
            want = left + 1 if left < room else room
            pos = self.pos
            view = self.view
            got = os.readv(fd, [view[pos:pos + want]])
            if got > left:
                raise SnapshotSourceChangedError("file grew while it was being persisted (a tar member must "
                                                 "match its header)", sandbox_path=path)
            if not got:
                if left:
                    raise SnapshotSourceChangedError("file shrank while it was being persisted",
                                                     sandbox_path=path)
                break
            if offload is not None:
                seq = offload.hash(sha, view[pos:pos + got])  # hashed before this buffer is written
            else:
                sha.update(view[pos:pos + got])
            left -= got
            if threaded:
                self.pos = pos + got
            if not left and got < want:
                break  # a short read of a regular file: end of file, exactly at the header's size
        pad = -size % _BLOCK_BYTES
        if pad and threaded:
            self._put(_ZEROS[:pad])
        if offload is not None and seq:
            return PendingSha(sha, seq, offload)
        return sha.hexdigest()

    def close(self) -> None:
        """End the archive as tarfile does (two zero blocks, zero-padded to a 10240-byte record), write it all.

        Waits until the writer thread has written everything.

        Raises:
            OSError: writing the sink failed.
        """
        assert self.sink is not None
        if self._writer is None and not self.pos:  # no member (a layer of an unchanged tree): the end record only
            self.sink.write(_ZEROS)
            self.total = len(_ZEROS)
            return
        self._put(_ZEROS[:2 * _BLOCK_BYTES])
        pad = -(self.total + self.pos) % _RECORD_BYTES
        if pad:
            self._put(_ZEROS[:pad])
        if self._writer is None:  # the whole archive fit one buffer: written here, no thread was started
            self.sink.write(self.view[:self.pos])
            self.total += self.pos
            self.pos = 0
            return
        self.flush()
        self._writer.drain()

    def stop(self) -> None:
        """Join the writer thread (idempotent; call on every path before the sink's fd is closed)."""
        if self._writer is not None:
            self._writer.stop()
