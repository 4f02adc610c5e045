"""The extractor's queue of new plain files, made in batches by a helper thread.

Batched new files (atomic mode, uncompressed tar read from a regular file):
a plain file member with a new name is *queued* (:meth:`BatchedFiles.add_new_file_from`)
after every check the one-by-one path makes (name rules, ``_parents``, limits
counted from the declared size before any byte is copied, and only once the
source file is known to hold the member's data and padding: a short source
goes one by one, so both paths give the same error for the same archive).
A member over :data:`BATCH_BYTES` is queued too (as a batch of its own) when
the extraction cannot be cancelled (no ``check_cancel``: a cancellable one
writes it one by one, checking for a cancel once a MiB), so its copy also
runs beside the parsing of the headers after it.
Batches of up to :data:`BATCH_FILES` files or :data:`BATCH_BYTES` bytes are
created and filled by ONE native call in one helper thread per extraction,
while the calling thread parses the next headers: each file is created by its
path (``<staging>/<member path>``), resolved *when it is made*
(``openat2`` ``O_CREAT|O_EXCL|O_NOFOLLOW`` with ``RESOLVE_BENEATH|
RESOLVE_NO_SYMLINKS|RESOLVE_NO_MAGICLINKS``, or the fallback walker with the
same flags), data copied at explicit source offsets, mode, mtime, close; a
failed file is unlinked.  No directory fd is kept across members: a
subdirectory that a racing process moves out of the staging tree is simply
not found (the extraction fails), never written into.  At most one batch is
in flight.  Ordering: the queue is flushed (waited for) before any member
that could depend on a queued file (a hard link, a repeated name), before
:meth:`Extractor.finish`, and on any error, where the error of the earliest
failing member wins, as in one-by-one order (a cancellation only waits for the
batch in flight).  New names written one by one (over :data:`BATCH_BYTES`),
directories and symlink records need no flush: they never touch a queued name
(the per-path kinds are updated when a file is queued, so a later member
naming it sees it).  With ``max_cpu_seconds`` set, batches run in the calling thread, so
the CPU limit still counts every syscall.

Batched new files read from a stream (:meth:`BatchedFiles.add_new_file_data`,
only when the caller asks for it: snapshot hydrate through ``extract_stream``
/ ``extract_streams``, whose source is its verifying reader): the member's
bytes (up to :data:`MEMORY_FILE_BYTES`) are read and counted in the calling
thread, appended to the batch's buffer, and the native call writes each file
from it.  Same checks, same queue and ordering rules; a stream that ends
within the member's data gives its bytes back to the stream and the member
goes one by one (the same error as ever).  Memory: a batch holds at most
``BATCH_BYTES + MEMORY_FILE_BYTES`` bytes, and at most two batches exist
(one queued, one in flight).

:class:`BatchedFiles` is a part of :class:`~sandbox_fs.archive._writer.Extractor`
(its base class): the queue's state lives on the extractor, set up by its
``__init__``.
"""

from __future__ import annotations

import errno
import mmap
import os
from typing import TYPE_CHECKING, Callable, Iterator

from .. import _native
from ..errors import SandboxError
from ._batch import BATCH_BYTES, BATCH_FILES, MEMORY_FILE_BYTES, CopyThread, FileBatch, batch_buffer
from ._errors import ArchiveFormatError, ArchiveLimitError, UnsafeArchiveMemberError
from ._meta import FILE, file_mode, mtime_ns_of, path_key
from ._names import normalize_member
from ._streams import CHUNK_BYTES

if TYPE_CHECKING:
    from ..root import Root, Subtree
    from ._models import ArchiveLimits, ExtractPolicy
    from ._streams import Meter, StreamCounter

__all__ = ["BatchedFiles"]

_XF_FIELDS = _native.XF_FIELDS


class BatchedFiles:
    """New plain files queued and made in batches (see the module docstring); a base of ``Extractor``."""

    limits: ArchiveLimits
    policy: ExtractPolicy
    meter: Meter
    work: Root | Subtree
    files: int
    shown_dest: str
    _kinds: dict[bytes, str]
    _owner: bool
    _fs_owner: tuple[int, int] | None
    _umask: int
    _exact: dict[bytes, int] | None
    _stage_fd: int
    _stage_pre: bytes
    _stage_resolver: str
    _batch: FileBatch
    _inflight: list[FileBatch]
    _worker: CopyThread | None
    _threaded: bool
    _batch_failed: bool
    batch_in_memory: bool
    _spare: mmap.mmap | None
    _mode_flags_cache: dict[int, tuple[int, int]]
    check_cancel: Callable[[], None] | None

    def can_batch(self) -> bool:
        """True when new plain files may be queued (atomic mode, no ownership to apply)."""
        return self._stage_fd >= 0 and not self._owner

    def add_new_file_from(self, name: str | bytes, mode: int, mtime: float | int | None, size: int,
                          counter: StreamCounter, offset_data: int) -> bool:
        """Queue regular-file member ``name`` whose ``size`` data bytes sit in the source file.

        Only for a *new* name in the fresh staging tree (:meth:`can_batch`),
        read from an uncompressed tar in a regular file (``counter.can_splice()``
        and the stream at ``offset_data``) that holds the member's data and
        block padding (:meth:`StreamCounter.has_data`): they are stepped over
        in the stream at once (counted as reads would be), the written bytes
        are counted from ``size`` before any byte is copied, and the file is
        created (by its path beneath the staging directory) and filled later
        by the helper thread (see the module docstring).

        Args:
            name: the member name; mode: its mode bits; mtime: seconds;
            size: data bytes (``max_member_bytes`` applies to it);
            counter: the tar stream; offset_data: stream offset of the data.

        Returns:
            False when the member is not for this path (a name already seen, the
            destination's own name, over :data:`BATCH_BYTES` in a cancellable extraction, a source file too
            short for its data): nothing was done, the caller uses
            :meth:`add_file`.  True when queued.

        Raises:
            ArchiveFormatError: ``size`` is negative (a header number is never
                trusted to be a length).
            UnsafeArchiveMemberError: name rules; ``through_symlink``/``conflict``
                from the parents.
            ArchiveLimitError: ``max_member_bytes``, ``max_total_bytes``,
                ``max_input_bytes``, ``max_expansion_ratio``, ``max_cpu_seconds``.
            ArchiveFormatError, OSError: an earlier batch failed (raised in
                archive order, with that member's name).
        """
        if size > BATCH_BYTES and self.check_cancel is not None:
            return False  # written one by one, cancellable once a MiB
        admitted = self._admit(name, size)
        if admitted is None:
            return False
        path, key = admitted
        if not counter.has_data(offset_data, size):
            return False  # a short source: one by one finds where the data ends, and says so as it does
        if self._batch.n and self._batch.src_fd != counter.splice_fd:
            self._submit()  # the queued files' offsets are in another source (or in memory)
        self._parents(path, name)
        src_off, probe = counter.skip_data(offset_data, size)  # counts size as written too
        self._enqueue(path, key, name, mode, mtime, src_off, size, probe)
        self._batch.src_fd = counter.splice_fd
        if self._batch.n >= BATCH_FILES or self._batch.nbytes >= BATCH_BYTES:
            self._submit()
        return True

    def add_new_file_data(self, name: str | bytes, mode: int, mtime: float | int | None, size: int,
                          counter: StreamCounter) -> bool:
        """Queue regular-file member ``name`` whose ``size`` data bytes are the next bytes of ``counter``.

        For a source that is not a regular file (hydrate's verifying reader,
        a pipe, a decompressor): the member's bytes are read here, in the
        calling thread, counted as reads (input and stream bytes, limits
        checked) and then as written bytes, and kept in the batch's memory,
        from which the helper thread writes the new file (``write``, in the
        same native call that creates it).  The bytes written are exactly the
        bytes read: the batch's buffer is written only by this thread, and
        only before the batch is handed over.  Only for a *new* name in the
        fresh staging tree (:meth:`can_batch`), as :meth:`add_new_file_from`,
        and only up to :data:`MEMORY_FILE_BYTES` (a larger member is written
        one by one, its bytes never all in memory).  Only when the caller
        asked for it (``batch_in_memory``: snapshot hydrate).

        Args:
            name, mode, mtime, size: as :meth:`add_new_file_from`.
            counter: the tar stream, at the member's data.

        Returns:
            False when the member is not for this path (see
            :meth:`add_new_file_from`; larger than :data:`MEMORY_FILE_BYTES`;
            a stream that ends within its data, whose bytes are then given
            back to ``counter`` (:meth:`StreamCounter.unread`, counted once)
            for the one-by-one path, which writes what exists and says where
            the data ends as it does for any stream): nothing was made.
            True when queued.

        Raises:
            ArchiveFormatError: ``size`` is negative; a corrupt stream.
            The other errors of :meth:`add_new_file_from`.
        """
        if size > MEMORY_FILE_BYTES:
            return False
        admitted = self._admit(name, size)
        if admitted is None:
            return False
        path, key = admitted
        if self._batch.n and self._batch.data is None:
            self._submit()  # the queued files are in a source file (the archive before this one)
        self._parents(path, name)
        b = self._batch
        if b.data is None:  # a buffer of a batch already made, or a new one
            b.data, self._spare = self._spare or batch_buffer(), None
        off = b.nbytes  # the batch's bytes so far: the buffer holds them from 0 (< BATCH_BYTES)
        if size:
            # the data and, when the stream allows, its block padding (read over by the next file's data);
            # off + the padded size <= BATCH_BYTES - 1 + MEMORY_FILE_BYTES: within the buffer
            with memoryview(b.data) as whole, whole[off:off + ((size + 511) & ~511)] as view:
                got = counter.read_member_into(view, size)
            if got < size:  # the stream ends inside: one by one, from these same bytes
                counter.unread(bytes(b.data[off:off + got]))
                return False
        self.meter.add_written(size)
        self._enqueue(path, key, name, mode, mtime, off, size, -1)
        if b.n >= BATCH_FILES or b.nbytes >= BATCH_BYTES:
            self._submit()
        return True

    def _admit(self, name: str | bytes, size: int) -> tuple[bytes, bytes] | None:
        """The checks before a member is queued: its normalized path and :func:`path_key`, or None for the
        one-by-one path.

        Raises:
            ArchiveFormatError: ``size`` is negative.
            UnsafeArchiveMemberError, ArchiveLimitError: name rules, ``max_member_bytes``.
        """
        if size < 0:
            raise ArchiveFormatError("negative member size", member=name)
        path = normalize_member(name, self.limits)
        if not path:
            return None
        lim = self.limits.max_member_bytes
        if size > lim:
            raise ArchiveLimitError("max_member_bytes", lim, size, name,
                                    reason=f"declared size {size} > max_member_bytes {lim}")
        key = path_key(path)
        return None if key in self._kinds else (path, key)

    def _enqueue(self, path: bytes, key: bytes, name: str | bytes, mode: int, mtime: float | int | None,
                 src_off: int, size: int, probe: int) -> None:
        """Append one admitted file (its parents made; ``key``: its :func:`path_key`) to the queued batch."""
        mbits = mode & 0o7777
        mode_flags = self._mode_flags_cache.get(mbits)
        if mode_flags is None:
            fmode = file_mode(mbits)
            chmod = _native.XF_CHMOD if fmode & ~self._umask != fmode else 0
            mode_flags = self._mode_flags_cache[mbits] = (fmode, chmod)
        if self._exact is not None and path in self._exact:
            mode_flags = (self._exact[path] & 0o777, _native.XF_CHMOD)
        b = self._batch
        if not self.policy.apply_mtime:
            b.nums.extend((src_off, size, probe, mode_flags[0], 0, mode_flags[1]))
        else:
            # mtime_ns_of, inlined for the common integer mtime (bounds keep ns within +-2**62)
            mtime_ns = mtime * 1_000_000_000 if type(mtime) is int and -4611686018 <= mtime <= 4611686018 \
                else mtime_ns_of(mtime)
            if mtime_ns is None:
                b.nums.extend((src_off, size, probe, mode_flags[0], 0, mode_flags[1]))
            else:
                b.nums.extend((src_off, size, probe, mode_flags[0], mtime_ns, mode_flags[1] | _native.XF_MTIME))
        b.names += self._stage_pre
        b.names += path
        b.names.append(0)
        b.members.append(name)
        b.n += 1
        b.nbytes += size
        self._kinds[key] = FILE
        self.files += 1

    def _submit(self) -> None:
        """Hand the queued batch to the helper thread, then wait for the one before it.

        At most one batch is made at a time: the helper thread starts this one
        once the one before it is done, and only if all of its files were made.
        """
        if self._threaded and self._worker is None:
            try:
                self._worker = CopyThread()
            except RuntimeError:  # no thread to be had: make the files in this thread
                self._threaded = False
        b, self._batch = self._batch, FileBatch(self._stage_fd, self._stage_resolver, self._stage_pre, self._fs_owner)
        if not self._threaded:
            b.run(b.src_fd)
            self._complete(b)
            return
        assert self._worker is not None
        b.after = self._inflight[-1] if self._inflight else None
        self._inflight.append(b)
        self._worker.put(b)
        while len(self._inflight) > 1:
            prev = self._take_back()
            self._complete(prev)  # raises its error; b is then never made
            if not prev.made_all():
                # a name of prev existed and was replaced in this thread: the helper thread
                # skips b (it comes back unmade); hand it over again, now after nothing
                self._take_back()
                b.after = None
                self._inflight.append(b)
                self._worker.put(b)

    def _take_back(self) -> FileBatch:
        """Wait for the oldest batch handed to the helper thread (they come back in order, made or not)."""
        assert self._worker is not None
        b = self._worker.wait()
        assert b is self._inflight[0]
        del self._inflight[0]
        b.after = None  # decided: keep no chain of earlier batches
        return b

    def _wait(self) -> None:
        """Wait for every batch handed to the helper thread; raise the first error (see :meth:`_complete`)."""
        while self._inflight:
            self._complete(self._take_back())

    def _complete(self, b: FileBatch) -> None:
        """Check a finished batch (one never run holds nothing to check); keep its buffer for the next one."""
        try:
            self._check_result(b)
        except BaseException:
            self._batch_failed = True
            raise
        finally:
            if b.data is not None:  # nothing reads it any more: the helper thread is done with b
                self._spare, b.data = b.data, None

    def _check_result(self, b: FileBatch) -> None:
        res = b.result
        if res is None:
            return  # never run (withdrawn): nothing was made
        while True:
            if isinstance(res, BaseException):
                raise res
            assert res is not None
            done, err, stage = res
            if done >= b.n:
                return
            if not (stage == _native.XF_STAGE_CREATE and err == errno.EEXIST):
                raise self._batch_error(b.members[done], err, stage)
            # The name exists although this run never made it (a name the filesystem
            # folds onto an earlier one, or a racing process in the staging tree): the
            # one-by-one path replaces it atomically; do that, then the rest of the batch.
            self._replace_queued(b, done)
            if done + 1 >= b.n:
                return
            rest = FileBatch(b.stage_fd, b.resolver, b.pre, b.owner)
            rest.nums = b.nums[(done + 1) * _XF_FIELDS:]
            rest.names = bytearray(b"".join(n + b"\0" for n in b.names.split(b"\0")[done + 1:b.n]))
            rest.members = b.members[done + 1:]
            rest.n = b.n - done - 1
            rest.src_fd = b.src_fd
            rest.data, rest.nbytes = b.data, b.nbytes  # the same offsets index the same bytes
            rest.run(rest.src_fd)
            b, res = rest, rest.result

    def _batch_error(self, member: str | bytes, err: int, stage: int) -> BaseException:
        """The error the one-by-one path raises for a failed queued file."""
        if stage == _native.XF_STAGE_SHORT:
            return ArchiveFormatError("unexpected end of data", member=member)
        if stage == _native.XF_STAGE_CREATE and err == errno.EISDIR:
            return UnsafeArchiveMemberError("conflict", member, "a file never replaces a directory")
        if stage == _native.XF_STAGE_CREATE and err in (errno.ELOOP, errno.EXDEV):
            return UnsafeArchiveMemberError("through_symlink", member,
                                            "a symlink on the path was refused (writes never follow symlinks)")
        try:
            _native.raise_errno(err or errno.EIO, "extract", self.shown_dest)
        except (OSError, SandboxError) as exc:
            return exc
        return OSError(err, os.strerror(err))  # pragma: no cover - raise_errno always raises

    def _replace_queued(self, b: FileBatch, i: int) -> None:
        """Write queued entry ``i`` of ``b`` through :meth:`Root.atomic_write` (replacing the name)."""
        name = b.members[i]
        path = normalize_member(name, self.limits)
        src_off, size, probe, fmode, mtime_ns, flags = b.nums[i * _XF_FIELDS:(i + 1) * _XF_FIELDS]
        src_fd = b.src_fd
        held = b.data

        def chunks() -> Iterator[bytes]:
            if held is not None:  # in memory (add_new_file_data): the bytes read, with nothing to probe
                yield bytes(held[src_off:src_off + size])
                return
            off, left = src_off, size
            while left:
                data = os.pread(src_fd, min(left, CHUNK_BYTES), off)
                if not data:
                    raise ArchiveFormatError("unexpected end of data", member=name)
                off += len(data)
                left -= len(data)
                yield data
            if probe >= 0 and not os.pread(src_fd, 1, probe):
                raise ArchiveFormatError("unexpected end of data", member=name)

        try:
            self._guard(name, lambda: self.work.atomic_write(
                path, chunks(), mode=fmode, fsync=False, mtime_ns=mtime_ns if flags & _native.XF_MTIME else None))
        except IsADirectoryError:
            raise UnsafeArchiveMemberError("conflict", name, "a file never replaces a directory") from None

    def flush(self) -> None:
        """Create every queued file now (wait for the helper thread).

        Raises:
            ArchiveFormatError: ``unexpected end of data`` (the source is short).
            UnsafeArchiveMemberError: ``conflict`` / ``through_symlink``.
            OSError: the file could not be created or written (sandbox path only).
        """
        if self._batch.n:
            self._submit()
        self._wait()

    def pending_error(self, run_queued: bool = False) -> BaseException | None:
        """Stop batching after an error in the calling thread; never raises.

        Waits for the batch in flight; with ``run_queued`` (an ordinary error,
        not a cancellation) also makes the queued files, so that the error of
        the earliest failing member wins, as in one-by-one order.  Then drops
        whatever is still queued.

        Returns:
            The first batch error (a member before the one that failed in the
            calling thread), or None.
        """
        err: BaseException | None = None
        try:
            if run_queued and not self._batch_failed:
                self.flush()
            else:
                for b in self._inflight:
                    b.withdrawn = True  # the batch being made completes; none starts after it
                self._wait()
        except BaseException as exc:  # reported to the caller, raised there
            err = exc
        finally:
            for b in self._inflight:
                b.withdrawn = True
            while self._inflight:  # a wait was interrupted or an error raised: the thread still owns them
                self._take_back()
            self._batch = FileBatch(self._stage_fd, self._stage_resolver, self._stage_pre, self._fs_owner)
        return err
