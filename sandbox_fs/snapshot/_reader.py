"""The verifying reader hydrate reads a generation's archive through: one read, hashed on the second core.

:class:`VerifyingReader` takes the archive from the store in blocks of up
to 1 MiB in a thread of its own (``sfs-hydrate-read``), which hashes each
block with the generation's archive digest (BLAKE3, or SHA-256 for an older
generation: :mod:`._digest`) and hands that very ``bytes`` object to the reader's
caller through a bounded queue (:data:`_AHEAD_BLOCKS` blocks).  The bytes
the extractor parses are therefore exactly the bytes hashed (the archive is
read once: a store whose object changes meanwhile cannot serve one version
to the hash and another to the extractor), while the reads and the hashing
(``preadv``, ``blake3`` and ``hashlib`` release the GIL on 1 MiB) run beside
the extraction.  No CRC-32 is checked here: version-2 metadata records
none (an older generation's is accepted and never relied on), and the
archive digest decides.  Before, they ran in the extracting thread: on the stdlib
tree (244 MiB, tmpfs, ``bench/bench_snapshot.py --only tmpfs``, load ~1.7)
hydrate's median was 1284-1647 ms, and 906-919 ms with this thread.
The extractor copies each new file's bytes (up to 1 MiB) out of these blocks
(:meth:`~VerifyingReader.readinto`) into the buffer of a native batch that a
helper thread writes (``archive/_batching``, ``add_new_file_data``): still
the bytes hashed, copied in memory, never read from the store again.  A read
within the current block is one slice of that (immutable) block, and a
``readinto`` within it one copy out of it: the tar stream reads this reader
straight, without the InputCounter layer (``StreamCounter._direct_source``),
a header (512 bytes) or a member with its padding at a time.
"""

from __future__ import annotations

import contextlib
import io
import queue
import threading
from typing import IO, Any

from ._digest import ArchiveHasher, archive_check, new_archive_hasher
from ._errors import SnapshotCorruptError
from ._models import SnapshotInfo

__all__ = ["VerifyingReader", "VerifiedToEnd"]

_READ_CHUNK = 1 << 20
#: blocks read ahead of the extractor, at most (memory: this many MiB, plus one in each thread)
_AHEAD_BLOCKS = 4
_END = object()  # the queue's last item: the recorded end or the store's was reached


class _Pump:
    """The reading thread's state: the store's reader, the counts and hashes, the queue of blocks.

    Apart from the reader, so that a reader dropped without :meth:`VerifyingReader.close`
    can still be collected (its ``__del__`` closes it, which stops this).  After
    :meth:`stop` the thread puts at most two more items, which the queue always
    has room for once it has been emptied: it never blocks there.
    """

    def __init__(self, raw: IO[bytes], size: int, hasher: ArchiveHasher) -> None:
        self.raw = raw
        self.left = size  # bytes not yet taken from ``raw`` (each taken one is hashed)
        self.count = 0
        self.hasher = hasher
        self.queue: queue.Queue[Any] = queue.Queue(_AHEAD_BLOCKS)
        self.stopped = threading.Event()

    def run(self) -> None:
        put = self.queue.put
        try:
            while self.left > 0 and not self.stopped.is_set():
                data = self.raw.read(min(_READ_CHUNK, self.left))
                if not data:
                    break
                self.hasher.update(data)
                self.count += len(data)
                self.left -= len(data)
                put(data)  # this very object is what the extractor gets
            put(_END)
        except BaseException as exc:  # raised in the caller's thread by the read that reaches it
            put(exc)

    def stop(self) -> None:
        """Make the thread end (the caller joins it): no more reads; the queue is emptied."""
        self.stopped.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self.queue.get_nowait()


class VerifyingReader(io.RawIOBase):
    """The archive of one generation as hydrate reads it, hashed on the way (its archive digest, :mod:`._digest`).

    Reads end at the recorded size (the extractor never sees a byte more);
    :meth:`verify` reads whatever the extractor left (the tar's zero
    padding) and one byte more, then compares size and archive digest with
    the metadata.  Hydrate calls it before anything in the workspace changes.

    The store is read in blocks of up to 1 MiB by one thread (started by the
    first read), each block hashed once and handed out from memory: the
    extractor asks for a header or a tarfile record (~10 KiB) at a time.
    Reads are full (fewer bytes only at the recorded end), as tarfile needs.
    An error of the store is raised by the read that reaches it, and again
    by :meth:`verify`.  :meth:`close` stops and joins the thread before it
    closes the store's reader.
    """

    def __init__(self, raw: IO[bytes], info: SnapshotInfo) -> None:
        super().__init__()
        self._raw = raw
        self._size = info.archive_bytes
        check = archive_check(info)  # (metadata with no archive digest is hashed anyway and never verifies)
        self._pump = _Pump(raw, info.archive_bytes, check[0] if check is not None else new_archive_hasher())
        self._buf = b""  # the block taken and hashed; bytes from _pos on not yet handed out
        self._pos = 0
        self._view = memoryview(b"")  # a view of _buf, for readinto
        self._thread: threading.Thread | None = None
        self._ended = False  # the thread's end (or error) was taken from the queue
        self._error: BaseException | None = None  # the store's error, raised again by verify()

    def readable(self) -> bool:
        return True

    def _fill(self) -> bool:
        """Take the next block (False: at the recorded end, or the store's).

        Raises:
            ValueError: the reader is closed.
            The store's error, when the thread's read failed.
        """
        if self._pump.stopped.is_set():
            raise ValueError("read of a closed snapshot archive reader")
        if self._ended:
            return False
        if self._thread is None:
            self._thread = threading.Thread(target=self._pump.run, name="sfs-hydrate-read", daemon=True)
            self._thread.start()
        item = self._pump.queue.get()
        if item is _END:
            self._ended = True
            return False
        if isinstance(item, BaseException):
            self._ended = True
            self._error = item
            raise item
        self._buf, self._pos, self._view = item, 0, memoryview(item)
        return True

    def _drop(self) -> None:
        """Hand out nothing more of the block taken."""
        self._buf, self._pos, self._view = b"", 0, memoryview(b"")

    # -- what the extractor calls

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            size = self._size  # at most the rest: reads stop at the recorded end
        buf, pos = self._buf, self._pos
        end = pos + size
        if end <= len(buf):  # within the block: one slice of it (the block itself when it is all of it)
            self._pos = end
            return buf[pos:end]
        parts = [buf[pos:]]
        size -= len(buf) - pos
        self._drop()
        while size > 0 and self._fill():
            buf = self._buf
            piece = buf[:size]
            parts.append(piece)
            self._pos = len(piece)
            size -= len(piece)
        return b"".join(parts)

    def read_view(self, size: int) -> memoryview:
        """The next bytes, at most ``size``, as a read-only view of the hashed block that holds them.

        Fewer bytes than asked at the block's end (the next call goes on in
        the next block); empty at the recorded end.  No copy: the view is of
        the very ``bytes`` object the reading thread hashed (immutable), for
        a member's data written straight from it (``archive``'s
        ``StreamCounter.read_chunk``).

        Raises:
            ValueError: the reader is closed.
            The store's error, when the thread's read failed.
        """
        pos = self._pos
        if pos >= len(self._buf):
            if not self._fill():
                return memoryview(b"")
            pos = 0
        end = min(pos + size, len(self._buf))
        self._pos = end
        return self._view[pos:end]

    def readinto(self, b: Any) -> int:
        view = b if type(b) is memoryview and b.format == "B" and b.ndim == 1 else memoryview(b).cast("B")
        want = len(view)
        pos = self._pos
        end = pos + want
        if end <= len(self._buf):  # within the block: one copy out of it
            view[:] = self._view[pos:end]
            self._pos = end
            return want
        got = 0
        while got < want and (self._pos < len(self._buf) or self._fill()):
            pos = self._pos
            n = min(want - got, len(self._buf) - pos)
            view[got:got + n] = self._view[pos:pos + n]
            self._pos = pos + n
            got += n
        return got

    def verify(self, info: SnapshotInfo) -> None:
        """Read the rest (and one byte more) and compare with ``info``.

        Raises:
            SnapshotCorruptError: size or archive digest differs from the metadata (or it records none).
            SnapshotStoreError: the store failed mid-read.
        """
        self._drop()
        while self._fill():  # the rest, hashed by the thread
            self._drop()
        if self._error is not None:  # a store that failed mid-read is not a corrupt archive
            raise self._error
        if self._thread is not None:
            self._thread.join()  # it put its end last: its counts are final
        pump = self._pump
        extra = self._raw.read(1)
        check = archive_check(info)
        if extra or pump.count != info.archive_bytes or check is None or check[0].name != pump.hasher.name \
                or pump.hasher.hexdigest() != check[1]:
            raise SnapshotCorruptError("snapshot archive does not match its size and digest (corrupted or "
                                       "replaced in the store?)", sandbox_path=None,
                                       context={"snapshot": info.name, "generation": info.generation})

    def stop(self) -> None:
        """Nothing to stop for hydrate's check interface (the thread stops with :meth:`close`)."""

    def close(self) -> None:
        """Stop and join the reading thread, then close the store's reader.  Idempotent."""
        self._drop()
        self._pump.stop()
        if self._thread is not None:
            self._thread.join()
        with contextlib.suppress(Exception):
            self._raw.close()
        super().close()


class VerifiedToEnd(io.RawIOBase):
    """A :class:`VerifyingReader` that verifies itself: the read that reaches the recorded end verifies first.

    For a reader handed to a caller who does not call
    :meth:`VerifyingReader.verify` (``GenerationStore.open_archive``): the
    bytes of the read that would reach ``info.archive_bytes`` (or the
    store's end before it) are handed out only once size and archive digest match
    the metadata, so a store that swaps the object after an earlier
    verified read of it never has its archive read to the end (no check a
    caller makes on the way, of a weaker digest or of a digest the store
    supplies, can be forged past it).  A reader stopped before the end got bytes not yet
    verified.
    """

    def __init__(self, reader: VerifyingReader, info: SnapshotInfo) -> None:
        super().__init__()
        self._reader = reader
        self._info = info
        self._left = info.archive_bytes
        self._verified = False

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        """Read into ``b`` (0: the end, verified).

        Raises:
            SnapshotCorruptError: this read reaches the end, and size or archive digest differ from the metadata.
            SnapshotStoreError: the store failed.
        """
        n = self._reader.readinto(b)
        self._left -= n
        if not self._verified and (self._left <= 0 or not n):  # at the recorded end, or the store's
            self._reader.verify(self._info)
            self._verified = True
        return n

    def close(self) -> None:
        """Close the verifying reader (its thread and the store's reader).  Idempotent."""
        self._reader.close()
        super().close()
