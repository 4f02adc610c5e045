"""Hydrate: replace a workspace's contents with a snapshot, staged and verified before the swap.

*Hydrate* verifies the archive's size and CRC-32 against the metadata, so a
truncated or corrupted snapshot is refused with :class:`SnapshotCorruptError`.
It stages before it swaps: extraction goes through the archive extractor
(:mod:`sandbox_fs.archive`, limits on) into a private ``.sfs-hydrate-<hex>``
directory inside the workspace (reached by its name from the workspace fd in
every step, never through an fd of its own, and checked to be the directory
the extractor made before anything moves) while a thread computes the
archive's CRC-32 (``pread`` of the same fd, at most the recorded size and one
byte more: never to the end of a file grown after its size check; the exact
recorded modes are applied by the extractor through the fds it makes the
entries with, never by name), the CRC-32 is checked, and only then is the
workspace cleared and the staged entries moved up.  Any failure before the
swap leaves the previous contents untouched.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat as _stat
import struct
from dataclasses import dataclass
from typing import IO, Any, Callable, Iterable, Protocol

from .. import _hooks, _native
from .._root_walk import walk_dirs
from ..archive import ArchiveFormatError, extract_stream, extract_streams
from ..errors import InvalidPathError, SandboxError
from ..root import Root, Subtree
from ._errors import SnapshotCorruptError, SnapshotError, SnapshotNotFoundError, SnapshotSourceChangedError
from ._generations import GenerationStore
from ._baseline import Listings
from ._index import Index, coarse_now_ns
from ._models import HydrateReport, SnapshotInfo, SnapshotLimits, SnapshotPolicy
from ._store import LocalSnapshotStore, SnapshotStore, _CrcCheck
from ._walk import SCAN_HEADER
from ._where import refuse_store_in_workspace

__all__ = ["hydrate", "is_mount_point_of"]


def is_mount_point_of(ws: Root, mount_points: Iterable[str] = ()) -> Callable[[os.stat_result], bool]:
    """A ``skip`` predicate for :meth:`Root.clear`: True for mount points.

    A mount point is a directory on another device than the root, or one of
    ``mount_points`` (sandbox paths; bind mounts of the same device), matched
    by ``(st_dev, st_ino)`` taken now.
    """
    dev = ws.stat(".").st_dev
    ids = _mount_ids(ws, mount_points)
    return lambda st: st.st_dev != dev or (st.st_dev, st.st_ino) in ids


def _mount_ids(ws: Root, mount_points: Iterable[str]) -> frozenset[tuple[int, int]]:
    """``(st_dev, st_ino)`` of each of ``mount_points`` (sandbox paths) there now."""
    ids = set()
    for p in mount_points:
        try:
            st = ws.lstat(p)
        except (FileNotFoundError, NotADirectoryError):
            continue
        ids.add((st.st_dev, st.st_ino))
    return frozenset(ids)


def hydrate(ws: Root, store: SnapshotStore, name: str, *, limits: SnapshotLimits | None = None,
            mount_points: Iterable[str] = (), keep_identities: Iterable[tuple[int, int]] = (),
            generation: int | None = None, digest: str | None = None, fallback: bool = False) -> HydrateReport:
    """Replace the workspace's contents with snapshot ``name``.  Blocking: call from one worker thread.

    Verify and stage first, then swap: the archive's size is checked, then
    it is extracted by :func:`sandbox_fs.archive.extract` (limits on, as for
    any untrusted archive) into a private staging directory inside the
    workspace (``.sfs-hydrate-<hex>``, mode 0700, never persisted nor
    fingerprinted; reached by name from ``ws`` in every step, never through
    an fd of its own), with the exact permission bits recorded at persist
    (applied by the extractor through the fd each entry is made or opened
    with, never by name: a name another process swaps for a hard link to a
    file outside is never changed).  Meanwhile one thread of its own (``sfs-hydrate-crc``,
    with a :class:`LocalSnapshotStore`) reads the same fd with ``pread`` and
    computes the archive's CRC-32 (both release the GIL: the second core),
    so the archive is not read twice in a row; the CRC-32 is compared with
    the metadata before anything in the workspace changes, and a corrupted
    archive that made the extractor fail is reported as corrupt too.  The
    thread is joined before this returns or raises.  (Other stores verify
    in ``open_archive``, first.)
    Only when all of that succeeded is the workspace cleared (never the
    root itself, never a mount point, never the staging directory) and the
    staged entries moved up (``renameat2(RENAME_NOREPLACE)`` through the
    Root; a directory kept by the clear because it holds a mount point is
    merged into).  Any failure before the swap (a member the extractor
    refuses, a limit, a full disk, an interrupt) removes only the staging
    directory: the previous contents are left exactly as they were.  A
    staging directory left by a killed process is ignored by persist and
    :func:`tree_digest` and removed by the next successful hydrate.

    Args:
        ws: the workspace Root (writable).  With ``ws.owner`` set, every
            restored entry (and the staging directory) is made with that
            owner, through its own fd; persist records no owners.
        store: where the snapshot lives.
        name: snapshot name.
        limits: :class:`SnapshotLimits` (entries, bytes, archive size).
        mount_points: sandbox paths of mounts kept by the clear (besides
            directories on another device, always kept).
        keep_identities: ``(st_dev, st_ino)`` of directories nested in the
            workspace that are not its own (read-only grants): kept by the
            clear, never entered, and never merged into; a snapshot with an
            entry where one is (or below it) is refused before anything in the
            workspace changes.
        generation: restore exactly this generation (None: the current one).
        digest: when given, the restored generation's metadata must have this
            SHA-256 (:attr:`SnapshotInfo.digest`, as a session's MAC-protected
            state recorded it), else :class:`SnapshotCorruptError`.
        fallback: with a :class:`GenerationStore` and no ``generation``, a
            current generation that fails verification is passed over for the
            newest older kept one that verifies (reported in
            :attr:`HydrateReport.skipped_generations`); each is staged and
            verified before anything in the workspace changes.

    Returns:
        A :class:`HydrateReport`; ``generation`` is the generation restored.

    Raises:
        SnapshotNotFoundError: no such snapshot (or the store does not keep ``generation``).
        SnapshotCorruptError: the archive fails verification or is not a
            readable tar, or its metadata is not ``digest`` (the workspace is untouched).
        SnapshotLimitError: the archive is larger than ``max_archive_bytes``.
        ArchiveLimitError, UnsafeArchiveMemberError: the extractor refuses a
            member (a forged store: persist never writes such members); the
            workspace is untouched.
        SnapshotError: the staging directory was replaced by another
            process before the swap, or the snapshot has an entry where a
            kept directory of ``keep_identities`` is (the workspace is
            untouched); a staged
            entry cannot be moved over a kept mount point (after the clear;
            rare).
        OSError: the extraction failed on the filesystem (a full disk, a
            staged directory moved away by another process: ENOENT); the
            workspace is untouched.
    """
    limits = limits or SnapshotLimits()
    keep = frozenset(keep_identities)
    mount_points = tuple(mount_points)  # read by each step (and each fallback candidate)
    refuse_store_in_workspace(ws, store)
    if isinstance(store, GenerationStore) and (legacy := store.legacy_store(name)) is not None:
        store = legacy  # a version-1 snapshot in a directory store, from before its first generation
    if isinstance(store, GenerationStore):
        return _hydrate_generations(ws, store, name, limits, mount_points, keep,
                                    _Wanted(generation, digest, fallback))
    if generation is not None or digest is not None:
        info = store.info(name)
        if info is None or (generation is not None and info.generation != generation) \
                or (digest is not None and info.digest != digest):
            raise SnapshotNotFoundError("the store does not hold that generation of the snapshot", sandbox_path=None,
                                        context={"snapshot": name, "generation": generation or 0})
    if isinstance(store, LocalSnapshotStore):
        f, info = store.open_archive_unverified(name, limits)  # size checked; CRC-32 checked below
    else:
        f, info = store.open_archive(name, limits)  # verified by the store
    if digest is not None and info.digest != digest:
        f.close()
        raise SnapshotCorruptError("the snapshot's metadata changed in the store while it was opened",
                                   sandbox_path=None, context={"snapshot": name})
    with f:
        check = _CrcCheck(f.fileno(), info.archive_bytes) if isinstance(store, LocalSnapshotStore) else None
        try:
            _restore(ws, f, info, limits, mount_points, check, keep)
        finally:
            if check is not None:
                check.stop()  # joined before the archive's fd is closed
    return HydrateReport(info, "archive", info.generation)


class _Check(Protocol):
    """What verifies an archive while or after it is extracted (:class:`_CrcCheck`, the generation reader)."""

    def verify(self, info: SnapshotInfo) -> None: ...

    def stop(self) -> None: ...


@dataclass(frozen=True)
class _Wanted:
    """Which generation hydrate restores: one (``generation``), the current one, or the newest good one."""

    generation: int | None = None
    digest: str | None = None
    fallback: bool = False


@dataclass
class _Layers:
    """A chain to restore in one staged pass: its archives (base first), the member filter, their verification."""

    infos: list[SnapshotInfo]
    readers: list[Any]
    final: dict[bytes, tuple[int, str]]  # normalized path -> (index of the source holding it, kind)

    @classmethod
    def of(cls, infos: list[SnapshotInfo], readers: list[Any], index: Index) -> "_Layers":
        where = {info.generation: i for i, info in enumerate(infos)}
        return cls(infos, readers, {e.path.encode("utf-8", "surrogateescape"): (where[e.layer], e.kind)
                                    for e in index.entries})

    @property
    def archive_bytes(self) -> int:
        return sum(i.archive_bytes for i in self.infos)

    def take(self, source: int, name: bytes, kind: str) -> bool:
        """True for the one member the final index says holds ``name``: that source, that kind."""
        return self.final.get(name) == (source, kind)

    def verify(self, info: SnapshotInfo) -> None:
        """Verify every archive of the chain (see :meth:`VerifyingReader.verify`)."""
        for reader, one in zip(self.readers, self.infos):
            reader.verify(one)

    def stop(self) -> None:
        """Nothing runs in the background."""


def _baseline_listings(ws: Root, started_at: int, max_records: int,
                       skip: frozenset[tuple[int, int]] = frozenset()) -> Listings:
    """The restored tree's directory scans, for the next persist: the first persist after it is a layer.

    Their time is ``started_at``, the clock read before the staging
    directory was made (:func:`_hydrate_staged`), not a reading taken at the
    swap or when the scans begin: the staged tree is inside the workspace,
    so another process may change a file from the moment the extractor makes
    it, before the swap as after it (same size, its mtime set back), and the
    scan records that change's stat; the next persist takes a file as
    restored only when its stat is the scan's *and* strictly older than
    ``started_at``, and that change's ctime is at or after it, so it is read
    again.  (A clock read at the swap or the scan would be later than that
    ctime, and the change would be taken as the restored content.)  The
    restored files themselves carry a ctime at or after ``started_at`` too:
    the next persist hashes each of them once (it writes a file again only
    when its content is not the index's), so what it records is always
    content it read, never a stat that a process in the workspace could
    have set up.

    No index is read here (see :mod:`._baseline`): the directories are found
    by their scans, from the workspace down, each opened by its path beneath
    ``ws`` and checked to be the directory its parent's scan listed (device
    and inode), never one on another device or in ``skip`` (kept read-only
    grants, mount points); one native call lists and ``lstat``-s each
    (:func:`sandbox_fs._native.scan_dir`).  A directory that cannot be
    opened, listed or identified is left out (its files are read again),
    and so is everything past ``max_records`` records (the restore's
    ``max_entries``: more is what another process added).
    """
    dev = ws.stat(".").st_dev
    dirs: dict[str, bytes] = {}
    todo: list[tuple[str, tuple[int, int] | None]] = [("", None)]
    mode_len, ino_dev, head = _MODE_AND_NAME_LEN.unpack_from, _INO_AND_DEV.unpack_from, SCAN_HEADER.size
    count = 0
    while todo and count <= max_records:
        path, ident = todo.pop()
        raw = _scan(ws, path, ident)
        if raw is None:
            continue
        dirs[path] = raw
        off, end = 0, len(raw)
        while off < end:
            mode, nlen = mode_len(raw, off + head - 8)
            start = off + head
            if mode & 0o170000 == _stat.S_IFDIR:
                ino, rdev = ino_dev(raw, off)
                if rdev == dev and (dev, ino) not in skip:
                    name = raw[start:start + nlen].decode("utf-8", "surrogateescape")
                    if not name.startswith(_HYDRATE_PREFIX):
                        todo.append((f"{path}/{name}" if path else name, (dev, ino)))
            off = start + ((nlen + 7) & ~7)
            count += 1
    return Listings(started_at, dev, dirs)


_MODE_AND_NAME_LEN = struct.Struct("=II")  # the last two fields of a SCAN_HEADER
_INO_AND_DEV = struct.Struct("=QQ")  # its first two
assert SCAN_HEADER.format == "=QQqqqQII"


def _scan(ws: Root, path: str, ident: tuple[int, int] | None) -> bytes | None:
    """The scan records of directory ``path`` beneath ``ws`` (it must be ``ident``), or None when it cannot be had."""
    try:
        dfd = ws.open_dir_fd(path or ".")
    except (OSError, SandboxError):
        return None
    try:
        if ident is not None:
            st = os.fstat(dfd)
            if (st.st_dev, st.st_ino) != ident:
                return None  # swapped since its parent was listed
        return _native.scan_dir(dfd)
    except OSError:
        return None
    finally:
        os.close(dfd)


def _restore(ws: Root, f: "IO[bytes] | _Layers", info: SnapshotInfo, limits: SnapshotLimits, mount_points: Iterable[str],
             check: _Check | None, keep: frozenset[tuple[int, int]]) -> int:
    """Stage, verify and swap one archive (with kept directories guarded, see :func:`hydrate`).

    Returns:
        The coarse clock (ns) read before the staging directory was made (see :func:`_hydrate_staged`).
    """
    # With kept directories (read-only grants), every write of the restore checks its fds
    # against them: a name swapped for one meanwhile is refused or kept, never entered,
    # emptied, chmod'ed or merged into.
    target = ws.with_options(deny_write_ids=keep) if keep else contextlib.nullcontext(ws)
    with target as guarded:
        return _hydrate_staged(guarded, f, info, limits, mount_points, check, keep)


def _hydrate_generations(ws: Root, store: GenerationStore, name: str, limits: SnapshotLimits,
                         mount_points: Iterable[str], keep: frozenset[tuple[int, int]],
                         wanted: _Wanted) -> HydrateReport:
    """Restore from a :class:`GenerationStore`: the wanted generation, or the newest one that verifies.

    Each candidate is read once, verified (size and archive digest against
    its metadata, the metadata against the pointer) before the swap; with
    ``fallback`` a candidate that fails verification (:class:`SnapshotCorruptError`)
    is passed over for the next older kept one.  Any other error ends the restore.

    Raises:
        SnapshotCorruptError: the first candidate's failure, when none verified.
        The other errors of :func:`hydrate`.
    """
    if wanted.generation is not None:
        candidates: list[int | None] = [wanted.generation]
    elif wanted.fallback:
        candidates = list(store.kept(name)) or [None]
    else:
        candidates = [None]
    skipped: list[int] = []
    first: SnapshotCorruptError | None = None
    for gen in candidates:
        try:
            chain = store.open_chain(name, limits, generation=gen, digest=wanted.digest)
            try:
                info = chain.infos[-1]
                if chain.index is None or len(chain.readers) == 1:
                    started_at = _restore(ws, chain.readers[0], info, limits, mount_points, chain.readers[0], keep)
                else:
                    layers = _Layers.of(chain.infos, chain.readers, chain.index)
                    started_at = _restore(ws, layers, info, limits, mount_points, layers, keep)
            finally:
                chain.close()
            # for the next persist of this name, in this process or a new one (see _baseline_listings):
            # the restored tree's new inodes, and whether the current generation was passed over
            listings = _baseline_listings(ws, started_at, limits.max_entries, keep | _mount_ids(ws, mount_points)) \
                if info.index_sha256 else None
            store.remember_baseline(name, info, None, listings=listings, source=chain.index,
                                    instead_of="" if chain.current_digest == info.digest else chain.current_digest,
                                    store=True)
            return HydrateReport(info, "archive", info.generation, skipped)
        except SnapshotCorruptError as exc:
            if not wanted.fallback:
                raise
            first = first or exc
            skipped.append(gen if gen is not None else 0)
    assert first is not None
    raise first


def _hydrate_staged(ws: Root, f: "IO[bytes] | _Layers", info: SnapshotInfo, limits: SnapshotLimits,
                    mount_points: Iterable[str], check: _Check | None,
                    keep_ids: frozenset[tuple[int, int]] = frozenset()) -> int:
    """Extract into a staging directory, verify (``check``), then swap it in (see :func:`hydrate`).

    Returns:
        The coarse clock (ns) read before the staging directory was made
        (the first moment another process can reach a restored file):
        anything another process changes in the restored tree, staged or
        swapped in, carries a ctime at or after it.
    """
    # The staging directory is reached by its name only (never through an fd of its own),
    # from the workspace fd, in every step: the extractor stages beside it and renames its
    # tree to this name (applying the exact recorded modes through the fds it makes the
    # entries with), and the clear keeps and the moves read whatever is at that name,
    # checked to be the directory the extractor made.  So a process that swaps it can
    # change only what is moved in, never where anything goes.
    staging = f"{_HYDRATE_PREFIX}{secrets.token_hex(8)}"
    made: list[tuple[int, int]] = []  # the identity of the directory the extractor made at ``staging``
    exact = {p.encode("utf-8", "surrogateescape"): SnapshotPolicy.mode(m) for p, m in info.mode_fixups}
    # Read before the staging directory exists (the baseline's time, see _baseline_listings): the
    # staged tree is in the workspace, so another process can change a staged file from the moment
    # the extractor makes it; such a change carries a ctime at or after this reading.
    started_at = coarse_now_ns()
    try:
        try:
            _extract_with_archive(ws, staging, f, limits, info.archive_bytes, made, exact)
            sid = made[0]
            sub = Subtree(ws, staging, sid)
            sub.chmod(".", 0o700)  # the extractor made it 0755, as for any new destination
        except Exception as exc:
            # A corrupted archive may fail extraction in any way: report it as what it is.
            # (An interrupt does not wait for the check.)
            if check is not None:
                try:
                    check.verify(info)
                except SnapshotCorruptError as corrupt:
                    raise corrupt from exc
            raise
        if check is not None:
            check.verify(info)  # before anything in the workspace changes
        st = ws.lstat(staging)
        if (st.st_dev, st.st_ino) != sid:
            raise SnapshotError("the restore's staging directory was replaced during the restore; "
                                "the workspace is unchanged", sandbox_path=staging)
        if _hooks.current is not None:
            _hooks.fire("hydrate.swap", root=ws, staging=staging)
        is_mount = is_mount_point_of(ws, mount_points)
        if keep_ids:
            _refuse_entries_over_kept(ws, sub, keep_ids, sid, is_mount)
        # Before anything in the workspace changes, make every staged top-level directory
        # movable (renaming a directory rewrites its ".." entry: its owner needs write
        # permission on it); its recorded mode is set again once it is in place.  So no
        # step that can fail for lack of permission comes after the clear.
        modes: dict[str, int] = {}
        for entry in sub.listdir("."):
            est = sub.lstat(entry)
            if _stat.S_ISDIR(est.st_mode) and est.st_mode & 0o700 != 0o700:
                modes[entry] = _stat.S_IMODE(est.st_mode) & 0o777
                ws.set_dir_meta(f"{staging}/{entry}", mode=modes[entry] | 0o700)
        keep = lambda st: (st.st_dev, st.st_ino) in keep_ids or (st.st_dev, st.st_ino) == sid \
            or is_mount(st)  # noqa: E731
        ws.clear(skip=keep, make_writable=True, keep_denied=True)  # a non-root owner empties its read-only dirs
        for entry in sub.listdir("."):
            _move_up(ws, f"{staging}/{entry}", entry, is_mount, modes.get(entry), keep_ids)
        return started_at
    finally:
        # On a failure before the swap this is all that changes; after the swap it is empty.
        # Only the directory the extractor made (checked by identity) is removed, never
        # whatever another process put at its name.  Best effort: a leftover is never
        # persisted and goes with the next hydrate's clear.
        if made:
            with contextlib.suppress(OSError, SandboxError):
                Subtree(ws, staging, made[0]).remove_tree()


_HYDRATE_PREFIX = ".sfs-hydrate-"


def _refuse_entries_over_kept(ws: Root, sub: Subtree, keep_ids: frozenset[tuple[int, int]],
                              sid: tuple[int, int], is_mount: Callable[[os.stat_result], bool]) -> None:
    """Refuse (before the clear) a snapshot with an entry where a kept directory of ``keep_ids`` is.

    Finds the kept directories by identity with one fd walk of the workspace
    (not entering them, nor the staging directory), then looks each path and
    its ancestors up in the staging tree: an entry at a kept path, or a
    non-directory at one of its ancestors, would have to replace or merge into
    it.

    Raises:
        SnapshotError: such an entry (nothing in the workspace changed).
    """
    kept: list[str] = []
    try:
        for _dirpath, dents, _nondirs in walk_dirs(ws, "."):
            for ent in list(dents):  # lstat taken relative to the listed directory's fd
                ident = (ent.stat.st_dev, ent.stat.st_ino)
                if ident in keep_ids or ident == sid or is_mount(ent.stat):  # is_mount: another device too
                    dents.remove(ent)  # never entered: kept, the staging directory, a mount
                    if ident in keep_ids:
                        kept.append(ent.path)
    except (FileNotFoundError, NotADirectoryError):
        raise SnapshotSourceChangedError("the workspace changed while the restore looked for its read-only grants; "
                                         "nothing was changed", sandbox_path=None) from None
    for path in kept:
        parts = path.split("/")
        for i in range(1, len(parts) + 1):
            pre = "/".join(parts[:i])
            try:
                st = sub.lstat(pre)
            except (FileNotFoundError, NotADirectoryError, InvalidPathError):
                break  # (longer than any staged path can be: nothing there)
            if i == len(parts) or not _stat.S_ISDIR(st.st_mode):
                raise SnapshotError("the snapshot has an entry where a read-only grant nested in the workspace is; "
                                    "nothing was changed", sandbox_path=pre)


def _move_up(ws: Root, src: str, dst: str, is_mount: Callable[[os.stat_result], bool],
             final_mode: int | None = None, keep_ids: frozenset[tuple[int, int]] = frozenset()) -> None:
    """Move staged ``src`` to ``dst`` without replacing anything; merge into a kept directory.

    ``final_mode``: the recorded mode of a top-level directory that hydrate
    made movable before the clear, set once it is in place.  Directory modes
    are changed through the directory's own fd (:meth:`Root.set_dir_meta`),
    never by name.
    """
    sst = ws.lstat(src)
    if final_mode is not None:
        pass  # already movable
    elif _stat.S_ISDIR(sst.st_mode) and not sst.st_mode & _stat.S_IWUSR:
        final_mode = _stat.S_IMODE(sst.st_mode) & 0o777
        ws.set_dir_meta(src, mode=final_mode | 0o700)  # renaming a dir rewrites its ".."
    if _hooks.current is not None:
        _hooks.fire("hydrate.move_up", root=ws, src=src, dst=dst)
    try:
        ws.rename(src, dst, no_replace=True)
    except FileExistsError:
        dst_st = ws.lstat(dst)
        if (dst_st.st_dev, dst_st.st_ino) in keep_ids:
            raise SnapshotError("a snapshot entry would merge into a read-only grant", sandbox_path=dst)
        if not (_stat.S_ISDIR(sst.st_mode) and _stat.S_ISDIR(dst_st.st_mode)):
            raise SnapshotError("a snapshot entry collides with an entry the restore must keep (a mount point?)",
                                sandbox_path=dst) from None
        for entry in ws.listdir(src):
            _move_up(ws, f"{src}/{entry}", f"{dst}/{entry}", is_mount, None, keep_ids)
        if not is_mount(dst_st):
            ws.set_dir_meta(dst, mode=final_mode if final_mode is not None else _stat.S_IMODE(sst.st_mode) & 0o777)
        return
    if final_mode is not None:
        ws.set_dir_meta(dst, mode=final_mode)


def _extract_with_archive(ws: Root, dest: str, f: "IO[bytes] | _Layers", limits: SnapshotLimits,
                          archive_bytes: int, made: list[tuple[int, int]], exact: dict[bytes, int]) -> None:
    # ``dest`` is hydrate's staging name, not yet existing: the extractor stages in a sibling
    # directory (reached by name from ``ws``) and renames it to ``dest`` when complete.
    # Its input is bounded by the validated archive size, not by the file's current end
    # (a store file grown after the size check): reading more is a limit error, reported
    # by hydrate as a corrupt archive once the CRC-32 check (also bounded) disagrees.
    rules = SnapshotPolicy(limits)
    try:
        if isinstance(f, _Layers):  # base and layers, one staged pass, each path from the layer that holds it
            extract_streams(root=ws, dest=dest, sources=f.readers, take=f.take,
                            limits=rules.archive_limits(f.archive_bytes), policy=rules.extract_policy(), made=made,
                            exact_modes=exact)
        else:
            extract_stream(root=ws, dest=dest, source=f, limits=rules.archive_limits(archive_bytes),
                           policy=rules.extract_policy(), made=made, exact_modes=exact)
    except ArchiveFormatError as exc:
        raise SnapshotCorruptError("snapshot archive is not a readable tar", sandbox_path=None,
                                   diagnostic=str(exc)) from None
    # ``made`` now holds the identity of the directory the extractor made and moved to ``dest``
