"""Snapshot generations over an :class:`~sandbox_fs.snapshot.ObjectStore`: objects first, the pointer last.

Object layout, per snapshot name ``NAME`` (a plain token), under the
object store's directory or prefix::

    NAME/current                                  the pointer (JSON), replaced by compare-and-swap
    NAME/gen/<generation, 12+ digits>-<token>/archive.tar   the PAX tar persist streamed
    NAME/gen/<generation, 12+ digits>-<token>/meta.json     its SnapshotInfo (metadata version 2)
    NAME/gen/<generation, 12+ digits>-<token>/index         its index (see ``_index``)

A generation is *full* (its archive holds the whole tree) or a *layer*: its
archive holds only the entries added or changed since its parent generation,
and its index says, for every entry of the tree, which generation's archive
holds it, plus the deletion list.  A layer's metadata names its parent's
metadata digest, so one digest covers a whole chain.  Compaction: persist
writes a full generation instead of a layer when the parent's chain already
has :data:`MAX_CHAIN` generations, or its layers after the base already
hold more than :data:`MAX_DELTA_RATIO` times the base's archive bytes.

A persist writes its archive and metadata under a generation directory no
other writer uses (16 random hex digits after the number), then replaces
``NAME/current`` with :meth:`ObjectStore.put_bytes` conditioned on the
pointer's etag read when the persist began (or on its absence).  So a reader
that follows the pointer only ever finds complete generations, and of two
writers that began from the same pointer exactly one commits; the other
gets :class:`SnapshotConflictError` and its objects are deleted.  The
pointer lists the kept generations (newest first, at most ``keep``), each
with the SHA-256 of its metadata object; every metadata object records one
digest of its archive, BLAKE3 (``archive_blake3``; generations persisted
before it record the SHA-256, ``archive_sha256``, and are checked by that:
see ``_digest``), and no CRC-32 since it is checked by that digest (older
generations carry one, unused).  So everything read back is checked
against the pointer, and the pointer itself can be checked against the
metadata digest a session's MAC-protected state recorded
(:attr:`SnapshotInfo.digest`).

The pointer lists the ``keep`` newest generations (the *restore points*) and
after them every older generation a restore point's chain still needs, each
with its parent; retention counts restore points only, and pruning keeps
every chain a kept restore point needs.  Generations dropped from the
pointer are deleted right after the commit;
objects a crashed writer left behind (never named by a pointer) are removed
by :meth:`GenerationStore.gc`.

Forks (:meth:`GenerationStore.fork`) share objects between names: a pointer
entry may carry ``origin``, the name whose ``gen/`` directory holds that
generation (pointer version 2; version 1 pointers have none), and the
owner keeps ``OWNER/holds/HOLDER`` objects that pruning, :meth:`remove` and
:meth:`gc` respect (the protocol is in ``_holds``)::

    NAME/holds/<holder name>                      the generations of NAME that holder's pointer lists
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import json
import re
import secrets
import threading
from dataclasses import dataclass, field
from typing import IO, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .._json import loads_untrusted
from ._errors import (
    SnapshotConflictError,
    SnapshotCorruptError,
    SnapshotError,
    SnapshotLimitError,
    SnapshotNotFoundError,
    SnapshotStoreError,
    SnapshotVerifyError,
)
from ._holds import HeldBy, delete_quietly, held_dirs, hold_key, list_holds, write_hold
from ._baseline import Baseline, Listings, baseline_listings, index_with_listings, read_baseline, write_baseline
from ._digest import new_archive_hasher
from ._index import Index, decode_index, encode_index, index_digest, max_index_bytes
from ._models import _TOKEN, SNAPSHOT_VERSION_OBJECTS, SnapshotInfo, SnapshotLimits, SnapshotPolicy, validate_name
from ._objects import ObjectStore, ObjectWriter
from ._reader import VerifiedToEnd, VerifyingReader
from ._store import PendingArchive, SnapshotStore, _HashingSink, _info_from_json, _info_to_json

__all__ = ["GenerationStore", "GcReport", "MAX_CHAIN", "MAX_DELTA_RATIO", "MIN_GC_AGE_S"]

#: most generations in a chain (a full base and its layers); the next persist after it writes a full one
MAX_CHAIN = 8
#: layers after a base may hold at most this many times the base's archive bytes before a full one is written
MAX_DELTA_RATIO = 0.5

#: the shortest grace period :meth:`GenerationStore.gc` accepts, in seconds (see its docstring)
MIN_GC_AGE_S = 900.0

_POINTER_FORMAT = "sandbox-fs-generations"
#: the marker gc writes to read the store's clock (a dot: never a snapshot name, so never one of its keys)
_CLOCK_KEY = "sandbox-fs.gc-clock"
_MAX_POINTER_BYTES = 1 << 20
_MAX_META_BYTES = 256 << 20
_MAX_KEEP = 1000
_READ_CHUNK = 1 << 20
_GEN_DIR = r"[0-9]{12,19}-[0-9a-f]{16}"
#: the objects of one generation directory: the only keys gc ever deletes
_GEN_OBJECT = re.compile(rf"gen/({_GEN_DIR})/(?:archive\.tar|meta\.json|index)")
#: names whose baseline (the index this store object last wrote, or a restore's listings) is kept in memory
_MAX_BASELINES = 32


class _PointerEntry(BaseModel):
    """One kept generation in the pointer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    generation: int = Field(ge=1, le=1 << 62)
    dir: str = Field(pattern=rf"^{_GEN_DIR}$")
    meta_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    parent: str = Field(default="", pattern=rf"^(?:{_GEN_DIR})?$")
    #: the snapshot name whose objects these are ("": this pointer's own); set by a fork (version 2)
    origin: str = Field(default="", pattern=rf"^(?:{_TOKEN.pattern})?$")

    @model_validator(mode="after")
    def _dir_names_generation(self) -> "_PointerEntry":
        if int(self.dir.split("-", 1)[0]) != self.generation:
            raise ValueError("a generation directory must carry its generation number")
        return self


class _Pointer(BaseModel):
    """``NAME/current``: the kept generations of one snapshot name, newest (the current one) first."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["sandbox-fs-generations"] = _POINTER_FORMAT
    version: Literal[1, 2] = 1
    name: str
    generations: list[_PointerEntry] = Field(min_length=1, max_length=2 * _MAX_KEEP * MAX_CHAIN)
    restore_points: int = Field(default=1, ge=1, le=_MAX_KEEP)

    @model_validator(mode="after")
    def _newest_first(self) -> "_Pointer":
        gens = [e.generation for e in self.generations]
        if any(a <= b for a, b in zip(gens, gens[1:])):
            raise ValueError("generations must be listed newest first, each once")
        if self.restore_points > len(gens):
            raise ValueError("more restore points than generations")
        by_dir = {e.dir: e for e in self.generations}
        if len(by_dir) != len(gens):
            raise ValueError("a generation directory is listed twice")
        if any(e.origin for e in self.generations) and self.version < 2:
            raise ValueError("generations of another name (a fork's) need pointer version 2")
        if any(e.origin == self.name for e in self.generations):
            raise ValueError("a generation's origin is the pointer's own name")
        for e in self.generations:
            parent = by_dir.get(e.parent) if e.parent else None
            if e.parent and (parent is None or parent.generation >= e.generation):
                raise ValueError("a generation's parent must be an older generation of the pointer")
        return self

    def chain(self, entry: _PointerEntry) -> list[_PointerEntry]:
        """``entry``'s chain, base first (the validator guarantees every parent is present and older)."""
        by_dir = {e.dir: e for e in self.generations}
        out = [entry]
        while out[-1].parent:
            out.append(by_dir[out[-1].parent])
        return out[::-1]


def _dump_pointer(ptr: _Pointer) -> bytes:
    """The pointer object's bytes: version 2 (with ``origin``) only when it lists another name's generations."""
    body = ptr.model_dump(mode="json")
    forked = any(e.origin for e in ptr.generations)
    body["version"] = 2 if forked else 1
    for entry in body["generations"]:
        if not entry["origin"]:
            del entry["origin"]
    return json.dumps(body, indent=1).encode()


def _owner(name: str, entry: _PointerEntry) -> str:
    """The snapshot name whose objects ``entry`` names: its origin (a fork's source), else ``name``."""
    return entry.origin or name


def _gen_dir(generation: int) -> str:
    return f"{generation:012d}-{secrets.token_hex(8)}"


def _keys(name: str, gen_dir: str) -> tuple[str, str]:
    """``(archive key, metadata key)`` of one generation directory."""
    base = f"{name}/gen/{gen_dir}"
    return f"{base}/archive.tar", f"{base}/meta.json"


def _index_key(name: str, gen_dir: str) -> str:
    return f"{name}/gen/{gen_dir}/index"


class _ObjectSink(_HashingSink):
    """Persist's sink into an :class:`ObjectWriter`: counts and digests every byte (BLAKE3, see :mod:`._digest`).

    Written from persist's one writer thread only; ``count`` and
    :attr:`archive_digest` are read after it drained.  No CRC-32
    (:meth:`hexdigest` is ""): a version-2 generation is checked by its
    archive digest at every read, and that digest is in the metadata the
    pointer and a session's MAC'd state pin, so a CRC-32 beside it would
    catch nothing more.  The writer gets each buffer once and must copy what
    it keeps (persist reuses its buffers).
    """

    def __init__(self, writer: ObjectWriter) -> None:
        super().__init__(-1)
        self.writer = writer
        self.hasher = new_archive_hasher()

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        self.writer.write(view)
        self.hasher.update(view)
        self.count += len(view)
        return len(view)

    def hexdigest(self) -> str:
        """"": this sink keeps no CRC-32 (version-2 metadata records none, see the class)."""
        return ""

    @property
    def archive_digest(self) -> str:
        """The archive's BLAKE3, hex (its metadata's ``archive_blake3``)."""
        return self.hasher.hexdigest()


@dataclass
class _PendingGeneration(PendingArchive):
    """A generation being written: its objects' keys and the pointer state it was begun from."""

    generation: int = 0
    gen_dir: str = ""
    pointer: _Pointer | None = None
    pointer_etag: str | None = None
    writer: ObjectWriter | None = None
    done: bool = False
    #: the current generation when begun (the parent of a layer), and its metadata
    parent: _PointerEntry | None = None
    parent_info: SnapshotInfo | None = None
    #: True: persist writes a layer over ``parent``; False: a full generation
    layered: bool = False
    #: the new generation's index, set by persist before the commit
    index: Index | None = None


@dataclass
class _Chain:
    """What hydrate reads to restore one generation: its chain's archives (base first) and the final index."""

    infos: list[SnapshotInfo]
    readers: list["VerifyingReader"]
    index: Index | None  # a layered chain's final index (None: one archive, or a generation recorded without one)
    current_digest: str = ""  # the metadata digest of the generation current when it was opened

    def close(self) -> None:
        for r in self.readers:
            r.close()


@dataclass
class GcReport:
    """What :meth:`GenerationStore.gc` removed.

    Attributes:
        objects: keys of the orphaned objects deleted (generations no pointer names).
        bytes: their total size, in bytes.
        uploads: unfinished uploads aborted.
        holds: stale holds (see :meth:`GenerationStore.fork`) shrunk or removed.
    """

    objects: list[str] = field(default_factory=list)
    bytes: int = 0
    uploads: int = 0
    holds: int = 0


class GenerationStore:
    """A :class:`SnapshotStore` keeping ``keep`` generations per name in an :class:`ObjectStore`.

    Works over any object store (a local directory, an S3 bucket): the
    layout and commit protocol are in this module's docstring.  The store is
    trusted for availability only: everything read back is checked against
    the digests in the pointer and the metadata (SHA-256 of metadata and
    index, the archive digest of each archive), and a session checks
    the metadata digest against its MAC-protected state.  Thread-safe as far
    as the object store is: no state is kept between calls but the objects.

    Args:
        objects: where the objects live.  :meth:`close` closes it.
        keep: restore points kept per name (>= 1; default 2: the current one
            and the previous good one, which hydrate falls back to).
        baseline_key: HMAC key (bytes, >= 16) the baselines a restore leaves
            in the store (``NAME/baseline``) are authenticated with, so a new
            process's first persist after a restore is a layer too; a key the
            object store does not hold.  None: a baseline's index is kept in
            memory only (see ``_baseline`` for what it is trusted for).

    Raises:
        ValueError: ``keep`` is not within 1 to 1000, or ``baseline_key`` is shorter than 16 bytes.
    """

    enabled = True

    def __init__(self, objects: ObjectStore, *, keep: int = 2, baseline_key: bytes | None = None) -> None:
        if not 1 <= keep <= _MAX_KEEP:
            raise ValueError(f"keep must be within 1 and {_MAX_KEEP}")
        if baseline_key is not None and (not isinstance(baseline_key, bytes) or len(baseline_key) < 16):
            raise ValueError("baseline_key must be at least 16 bytes")
        self.objects = objects
        self.keep = keep
        self._baseline_key = baseline_key
        self._lock = threading.Lock()
        self._baselines: collections.OrderedDict[str, Baseline] = collections.OrderedDict()

    @property
    def baseline_key(self) -> bytes | None:
        """The baseline MAC key as far as it exists now (:meth:`baseline_mac_key` without creating one)."""
        return self.baseline_mac_key(create=False)

    def baseline_mac_key(self, *, create: bool) -> bytes | None:
        """The HMAC key of the baselines in the store: the ``baseline_key`` given, or None.

        A subclass may keep its key in the store and make it on the first
        write (``create=True``: a baseline is being written), never on a read
        (:class:`~sandbox_fs.snapshot.DirectorySnapshotStore` does).  Never raises.
        """
        return self._baseline_key

    # -- the pointer and the metadata

    def _pointer(self, name: str) -> tuple[_Pointer | None, str | None]:
        """``(pointer, etag)`` of ``name`` as one consistent read (``(None, None)``: no snapshot).

        Raises:
            SnapshotCorruptError: the pointer object is not a valid pointer of ``name``.
            SnapshotStoreError: the store failed.
        """
        key = f"{name}/current"
        for _ in range(5):
            before = self.objects.head(key)
            if before is None:
                return None, None
            try:
                raw = self.objects.get_bytes(key, _MAX_POINTER_BYTES)
            except SnapshotNotFoundError:
                continue  # removed meanwhile: look again
            except SnapshotLimitError:
                raise SnapshotCorruptError("the snapshot's generation pointer is too large", sandbox_path=None,
                                           context={"snapshot": name}) from None
            after = self.objects.head(key)
            if after is None or after.etag != before.etag:
                continue  # replaced between the reads: read again
            try:
                ptr = _Pointer.model_validate(loads_untrusted(raw))
            except (ValueError, ValidationError) as exc:
                raise SnapshotCorruptError("the snapshot's generation pointer is not valid", sandbox_path=None,
                                           context={"snapshot": name}, diagnostic=str(exc)) from None
            if ptr.name != name:
                raise SnapshotCorruptError("the generation pointer names another snapshot", sandbox_path=None,
                                           context={"snapshot": name})
            return ptr, before.etag
        raise SnapshotStoreError("the snapshot's generation pointer kept changing while it was read",
                                 sandbox_path=None, context={"snapshot": name})

    def _meta(self, name: str, entry: _PointerEntry) -> SnapshotInfo:
        """The verified metadata of one kept generation, with :attr:`SnapshotInfo.digest` set.

        A generation a fork shares (``entry.origin``) is read from its
        origin's objects and must name its origin; it is returned under
        ``name`` (the name it was looked up by), its ``archive`` key and
        ``digest`` unchanged.

        Raises:
            SnapshotCorruptError: missing, not matching the pointer's SHA-256, or not valid.
            SnapshotStoreError: the store failed.
        """
        owner = _owner(name, entry)
        _archive, meta_key = _keys(owner, entry.dir)
        ctx = {"snapshot": name, "generation": entry.generation}
        try:
            raw = self.objects.get_bytes(meta_key, _MAX_META_BYTES)
        except SnapshotNotFoundError:
            raise SnapshotCorruptError("a kept generation's metadata is missing", sandbox_path=None,
                                       context=ctx) from None
        except SnapshotLimitError:
            raise SnapshotCorruptError("a kept generation's metadata is too large", sandbox_path=None,
                                       context=ctx) from None
        digest = hashlib.sha256(raw).hexdigest()
        if digest != entry.meta_sha256:
            raise SnapshotCorruptError("a generation's metadata does not match the pointer's SHA-256",
                                       sandbox_path=None, context=ctx)
        try:
            info = _info_from_json(raw)
        except ValueError as exc:
            raise SnapshotCorruptError("a generation's metadata is not valid", sandbox_path=None, context=ctx,
                                       diagnostic=str(exc)) from None
        archive_key, _m = _keys(owner, entry.dir)
        if info.name != owner or info.generation != entry.generation or info.archive != archive_key \
                or info.version != SNAPSHOT_VERSION_OBJECTS:
            raise SnapshotCorruptError("a generation's metadata names another snapshot or generation",
                                       sandbox_path=None, context=ctx)
        return info.model_copy(update={"digest": digest, "name": name})

    def info(self, name: str) -> SnapshotInfo | None:
        """The metadata of the current generation of ``name``, or None when there is none.

        Raises:
            InvalidPathError: ``name`` is not a plain token.
            SnapshotCorruptError: the pointer or the current metadata is not valid.
            SnapshotStoreError: the store failed.
        """
        validate_name(name)
        ptr, _etag = self._pointer(name)
        return None if ptr is None else self._meta(name, ptr.generations[0])

    def generations(self, name: str) -> list[SnapshotInfo]:
        """The metadata of every restore point of ``name``, newest first (unreadable ones left out).

        Raises:
            InvalidPathError: ``name`` is not a plain token.
            SnapshotCorruptError: the pointer is not valid.
            SnapshotStoreError: the store failed.
        """
        validate_name(name)
        ptr, _etag = self._pointer(name)
        out = []
        for entry in ptr.generations[:ptr.restore_points] if ptr is not None else []:
            with contextlib.suppress(SnapshotCorruptError):
                out.append(self._meta(name, entry))
        return out

    def kept(self, name: str) -> list[int]:
        """The generation numbers the pointer of ``name`` keeps, newest first (empty: none).

        Raises:
            InvalidPathError, SnapshotCorruptError, SnapshotStoreError: see :meth:`generations`.
        """
        validate_name(name)
        ptr, _etag = self._pointer(name)
        return [] if ptr is None else [e.generation for e in ptr.generations[:ptr.restore_points]]

    def list(self) -> list[SnapshotInfo]:
        """The current metadata of every snapshot name, sorted by name (unreadable ones left out).

        Raises:
            SnapshotStoreError: the store cannot be listed.
        """
        out = []
        for name in self._names():
            with contextlib.suppress(SnapshotCorruptError, SnapshotNotFoundError):
                info = self.info(name)
                if info is not None:
                    out.append(info)
        return out

    def _names(self) -> list[str]:
        """Every snapshot name that has objects in the store (pointer or not), sorted."""
        names = set()
        for obj in self.objects.list(""):
            head = obj.key.split("/", 1)[0]
            if _TOKEN.fullmatch(head):
                names.add(head)
        return sorted(names)

    # -- writing

    def begin(self, name: str, *, expect_generation: int | None = None,
              expect_digest: str | None = None) -> _PendingGeneration:
        """Start generation ``current + 1`` of ``name``; nothing is visible until :meth:`commit`.

        Args:
            name: the snapshot name (a plain token).
            expect_generation: the generation the writer last saw current (0:
                none); another one current now is a conflict.  None: no
                expectation (the commit still refuses a pointer that moved
                after this call).
            expect_digest: when given, the current generation's metadata must
                have this SHA-256 (the one the writer restored or wrote), or
                it is a conflict too: a layer is only ever written over the
                generation its writer knows.

        Raises:
            InvalidPathError: ``name`` is not a plain token.
            SnapshotConflictError: the current generation is not ``expect_generation``.
            SnapshotCorruptError: the pointer is not valid.
            SnapshotStoreError: the store failed.
        """
        validate_name(name)
        ptr, etag = self._pointer(name)
        legacy = self._legacy_info(name) if ptr is None else None  # a version-1 snapshot the first one follows
        current = ptr.generations[0].generation if ptr is not None else legacy.generation if legacy else 0
        if expect_generation is not None and current != expect_generation:
            raise SnapshotConflictError("another writer committed this snapshot since this session last saw it "
                                        "(two sessions from one state?); nothing was written", sandbox_path=None,
                                        context={"snapshot": name, "expected_generation": expect_generation,
                                                 "current_generation": current})
        known = ptr.generations[0].meta_sha256 if ptr is not None else legacy.digest if legacy else None
        if expect_digest is not None and known is not None and known != expect_digest:
            raise SnapshotConflictError("the store's current generation is not the one this session knows "
                                        "(replaced by another writer); nothing was written", sandbox_path=None,
                                        context={"snapshot": name, "current_generation": current})
        parent, parent_info = self._parent_of(name, ptr)
        layered = parent_info is not None and parent_info.index_sha256 != "" \
            and parent_info.chain_length < MAX_CHAIN \
            and parent_info.chain_bytes <= MAX_DELTA_RATIO * max(parent_info.base_bytes, 1)
        generation = current + 1
        gen_dir = _gen_dir(generation)
        self._next_pointer(name, ptr, self._stand_in(generation, gen_dir, parent if layered else None))
        archive_key, _meta = _keys(name, gen_dir)
        writer = self.objects.put_stream(archive_key)
        sink = _ObjectSink(writer)
        return _PendingGeneration(name=name, fd=-1, sink=sink, stream=io.BufferedWriter(sink), partial=None,
                                  generation=generation, gen_dir=gen_dir, pointer=ptr, pointer_etag=etag,
                                  writer=writer, parent=parent, parent_info=parent_info, layered=layered)

    @staticmethod
    def _stand_in(generation: int, gen_dir: str, parent: _PointerEntry | None) -> _PointerEntry:
        """The pointer entry a commit of ``generation`` will add, with a stand-in metadata digest.

        Raises:
            SnapshotCorruptError: ``generation`` is larger than a pointer holds
                (the store's current one, or a version-1 snapshot's, is at the limit).
        """
        try:
            return _PointerEntry(generation=generation, dir=gen_dir, meta_sha256="0" * 64,
                                 parent=parent.dir if parent is not None else "")
        except ValidationError:
            raise SnapshotCorruptError("the store's current generation number is at the largest a pointer "
                                       "holds; nothing was written", sandbox_path=None,
                                       context={"generation": generation - 1}) from None

    def _legacy_info(self, name: str) -> SnapshotInfo | None:
        """The version-1 snapshot ``name`` has while it has no pointer (None: none; see DirectorySnapshotStore)."""
        return None

    def legacy_store(self, name: str) -> SnapshotStore | None:
        """The store that holds ``name`` when it is a version-1 snapshot with no generations yet (None: none here).

        :func:`hydrate` restores such a name from it.  Only a store over a
        directory that held version-1 snapshots has one
        (:class:`~sandbox_fs.snapshot.DirectorySnapshotStore`).

        Raises:
            SnapshotCorruptError: the pointer is not valid.
            SnapshotStoreError: the store failed.
        """
        return None

    def _parent_of(self, name: str, ptr: _Pointer | None) -> tuple[_PointerEntry | None, SnapshotInfo | None]:
        """The generation a new one may be a layer over, and its metadata (``(None, None)``: write a full one).

        Normally the current generation.  When the last restore of ``name``
        (this process's, or the baseline in the store) passed over the
        current generation for an older one (a fallback past one that failed
        verification, or a chosen generation), never the current one: the
        generation restored when its baseline index is trusted (still kept,
        and verified by that restore), else none.  A parent whose metadata
        does not verify is never chained onto either.

        Raises:
            SnapshotStoreError: the store failed.
        """
        if ptr is None:
            return None, None
        parent: _PointerEntry | None = ptr.generations[0]
        base = self._baseline(name)
        if base is not None and base.instead_of and base.instead_of == ptr.generations[0].meta_sha256:
            parent = next((e for e in ptr.generations[:ptr.restore_points] if e.meta_sha256 == base.digest
                           and e.generation == base.generation), None) if base.trusted else None
        if parent is None:
            return None, None
        try:
            return parent, self._meta(name, parent)
        except SnapshotCorruptError:
            return None, None

    def _baseline(self, name: str) -> Baseline | None:
        """The baseline of ``name``: this store object's, else the one stored (kept in memory once read)."""
        with self._lock:
            base = self._baselines.get(name)
        if base is None:
            base = read_baseline(self.objects, name, self.baseline_mac_key(create=False))
            if base is not None:
                self._keep_baseline(name, base)
        return base

    def _keep_baseline(self, name: str, base: Baseline) -> None:
        with self._lock:
            self._baselines[name] = base
            self._baselines.move_to_end(name)
            while len(self._baselines) > _MAX_BASELINES:
                self._baselines.popitem(last=False)

    def parent_index(self, pending: _PendingGeneration, policy: SnapshotPolicy) -> Index | None:
        """The index a layer is computed against: the parent's, or the baseline hydrate left for it.

        None when ``pending`` writes a full generation, or when the parent's
        index does not verify (a full generation is written instead: a layer
        is never computed against an index that is missing or does not match
        its metadata).  A baseline (see :meth:`remember_baseline`) is used
        when it was taken for exactly the parent generation (same metadata
        digest): its index, or its listings applied to the parent's own
        verified index (:func:`~._baseline.index_with_listings`); otherwise
        the parent's stored index, checked against its metadata's SHA-256.

        Raises:
            SnapshotStoreError: the store failed.
        """
        if not pending.layered or pending.parent_info is None or pending.pointer is None \
                or pending.parent is None:
            return None
        info = pending.parent_info
        chain = frozenset(e.generation for e in pending.pointer.chain(pending.parent))
        with self._lock:
            base = self._baselines.get(pending.name)
        try:
            if base is not None and base.digest == info.digest:
                if base.index is not None:
                    return base.index
                listings = baseline_listings(self.objects, pending.name, base, policy)
                if listings is not None:
                    source = base.source or base.written or \
                        self._index(pending.name, pending.parent, info, policy, chain)
                    base.index, base.listings, base.source = index_with_listings(source, listings), None, None
                    return base.index
            return self._index(pending.name, pending.parent, info, policy, chain)
        except SnapshotCorruptError:
            return None  # never a layer over an index that does not verify: a full generation

    def remember_baseline(self, name: str, info: SnapshotInfo, index: Index | None, *, instead_of: str = "",
                          store: bool = False, listings: Listings | None = None,
                          source: Index | None = None, written: Index | None = None) -> None:
        """Keep what the next layer of ``name`` compares against: an index, or a restore's listings.

        Hydrate calls this after a restore with the restored tree's listings
        (see :mod:`._baseline`), so the first persist after a resume compares
        against the inodes it made, not those of the machine that persisted;
        a commit calls it with the index it wrote (no re-read and re-check
        of it next time).  Kept in memory for this store object (the
        :data:`_MAX_BASELINES` names used last) and, with ``store``, in the
        store as ``NAME/baseline`` (its listings authenticated with
        :meth:`baseline_mac_key`, or left out without one; best effort).

        Args:
            name: the snapshot name.
            info: the generation's metadata (``generation``, ``digest``).
            index: its tree with this workspace's inodes and times, or None.
            instead_of: the metadata digest of the generation that was current
                when ``info``'s was restored, if another one ("" otherwise):
                the next persist never chains onto it.
            store: also write it to the store (hydrate does; a commit does not).
            listings: the restored tree's directory scans (hydrate), or None.
            source: the generation's verified index when the restore decoded
                it (a layered chain): the next persist in this process need
                not read it again.
            written: the index this store object's commit of ``info`` wrote
                (a commit passes it; a restore of that generation by this store
                object keeps the one its commit left, see :meth:`open_chain`).
        """
        with self._lock:
            prev = self._baselines.get(name)
        if written is None and prev is not None and prev.digest == info.digest:
            written = prev.written
        base = Baseline(info.generation, info.digest, instead_of, index, listings=listings,
                        source=source if listings is not None else None, written=written)
        self._keep_baseline(name, base)
        if store:
            write_baseline(self.objects, name, base, self.baseline_mac_key(create=True))

    def _index(self, name: str, entry: _PointerEntry, info: SnapshotInfo, policy: SnapshotPolicy,
               layers: frozenset[int]) -> Index:
        """The verified index of one generation.

        Raises:
            SnapshotCorruptError: missing, not matching the metadata, or not valid.
        """
        ctx = {"snapshot": name, "generation": entry.generation}
        if not info.index_sha256:
            raise SnapshotCorruptError("a generation has no index", sandbox_path=None, context=ctx)
        if info.index_bytes > max_index_bytes(policy):  # never read more than could decode
            raise SnapshotCorruptError("a generation's index is larger than its entry limit allows",
                                       sandbox_path=None, context=ctx)
        try:
            raw = self.objects.get_bytes(_index_key(_owner(name, entry), entry.dir), max(info.index_bytes, 0))
        except (SnapshotNotFoundError, SnapshotLimitError):
            raise SnapshotCorruptError("a generation's index is missing or larger than recorded", sandbox_path=None,
                                       context=ctx) from None
        if len(raw) != info.index_bytes or hashlib.sha256(raw).hexdigest() != info.index_sha256:
            raise SnapshotCorruptError("a generation's index does not match its metadata", sandbox_path=None,
                                       context=ctx)
        return decode_index(raw, policy, layers, name)

    def commit(self, pending: PendingArchive, info: SnapshotInfo) -> SnapshotInfo:
        """Write the generation's metadata, then swap the pointer to it (the commit point).

        The archive upload is finished and its size checked (``head``), the
        metadata (version 2, with the archive's BLAKE3) is written and read
        back, and only then is the pointer replaced, conditioned on the etag
        it had at :meth:`begin`.  The generations the new pointer no longer
        keeps are deleted after it.

        Returns:
            ``info`` with ``generation``, ``archive`` (its key), ``archive_blake3``,
            ``version`` and ``digest`` set, and every other field about this
            generation's own objects (the other archive digests, index, parent,
            chain) as this commit made them, whatever ``info`` said (a copy
            passes its source's metadata).

        Raises:
            SnapshotConflictError: another writer replaced the pointer since
                :meth:`begin`; this generation's objects are deleted (not retryable).
            SnapshotVerifyError: the archive or the metadata did not read back
                as written; the previous generation stays current (retryable).
            SnapshotStoreError: the store failed; the previous generation stays current.
        """
        assert isinstance(pending, _PendingGeneration) and pending.writer is not None
        sink = pending.sink
        assert isinstance(sink, _ObjectSink)
        name, gen = pending.name, pending.generation
        prev = pending.pointer.generations[0].generation if pending.pointer is not None else 0
        archive_key, meta_key = _keys(name, pending.gen_dir)
        index_key = _index_key(name, pending.gen_dir)
        verify_ctx = {"snapshot": name, "generation": prev, "failed_generation": gen}
        pending.done = True
        try:
            pending.writer.commit()
            head = self.objects.head(archive_key)
            if head is None or head.size != sink.count:
                raise SnapshotVerifyError("the new snapshot archive did not read back with its size; it was "
                                          "withdrawn and the previous generation stays current", sandbox_path=None,
                                          context=verify_ctx)
            # Every field that describes this generation's own objects is this commit's, never the
            # caller's: a copy passes its source's metadata, which may name an index, a parent or a
            # digest of objects this generation does not have (so: a full one, no index, until set below).
            update: dict[str, Any] = {"version": SNAPSHOT_VERSION_OBJECTS, "generation": gen,
                                      "archive": archive_key, "archive_blake3": sink.archive_digest,
                                      "archive_sha256": "", "archive_bytes": sink.count, "archive_crc32": "",
                                      "chain_length": 1, "chain_bytes": 0, "base_bytes": sink.count,
                                      "parent_generation": 0, "parent_digest": "",
                                      "index_sha256": "", "index_bytes": 0, "deleted": 0}
            if pending.index is not None:
                iraw = encode_index(pending.index)
                self.objects.put_bytes(index_key, iraw, if_none_match=True)
                update.update(index_sha256=hashlib.sha256(iraw).hexdigest(), index_bytes=len(iraw),
                              deleted=len(pending.index.deleted))
            parent = pending.parent_info
            if pending.layered and parent is not None:
                update.update(parent_generation=parent.generation, parent_digest=parent.digest,
                              chain_length=parent.chain_length + 1, chain_bytes=parent.chain_bytes + sink.count,
                              base_bytes=parent.base_bytes)
            info = info.model_copy(update=update)
            raw = _info_to_json(info)
            self.objects.put_bytes(meta_key, raw, if_none_match=True)
            if self.objects.get_bytes(meta_key, _MAX_META_BYTES) != raw:
                raise SnapshotVerifyError("the new snapshot metadata did not read back; the previous generation "
                                          "stays current", sandbox_path=None, context=verify_ctx)
            digest = hashlib.sha256(raw).hexdigest()
            parent_dir = pending.parent.dir if pending.layered and pending.parent is not None else ""
            self._swap_pointer(pending, _PointerEntry(generation=gen, dir=pending.gen_dir, meta_sha256=digest,
                                                      parent=parent_dir))
        except BaseException:
            self._delete_quietly([archive_key, meta_key, index_key])
            raise
        committed = info.model_copy(update={"digest": digest})
        if pending.index is not None:  # the next layer (or a restore) of this name uses it, without a re-read
            self.remember_baseline(name, committed, pending.index, written=pending.index)
        return committed

    def _next_pointer(self, name: str, old: _Pointer | None, entry: _PointerEntry) -> _Pointer:
        """The pointer that lists ``entry`` as the current generation after ``old``, pruned to ``keep``.

        Retention counts restore points; every chain a kept restore point
        needs stays.  :meth:`begin` builds it once with a stand-in entry, so a
        pointer that cannot be continued is refused before anything is uploaded.

        Raises:
            SnapshotCorruptError: the result is not a valid pointer (``old``,
                as the store gave it, is at the largest generation number or
                has chains longer than a pointer may list).
        """
        older = list(old.generations[:old.restore_points]) if old is not None else []
        points = [entry] + older[:self.keep - 1]
        by_dir = {e.dir: e for e in (old.generations if old is not None else [])}
        by_dir[entry.dir] = entry
        needed: dict[str, _PointerEntry] = {}
        for point in points:  # every chain a kept restore point needs
            cur: _PointerEntry | None = point
            while cur is not None and cur.dir not in needed:
                needed[cur.dir] = cur
                cur = by_dir.get(cur.parent) if cur.parent else None
        kept = sorted(needed.values(), key=lambda e: -e.generation)
        rest = [e for e in kept if e not in points]
        try:
            return _Pointer(name=name, generations=points + rest, restore_points=len(points),
                            version=2 if any(e.origin for e in kept) else 1)
        except ValidationError as exc:
            raise SnapshotCorruptError("the store's generation pointer cannot be continued (at the largest "
                                       "generation number, or chains longer than a pointer lists); nothing was "
                                       "written", sandbox_path=None, context={"snapshot": name},
                                       diagnostic=str(exc)) from None

    def _swap_pointer(self, pending: _PendingGeneration, entry: _PointerEntry) -> None:
        """Replace the pointer by compare-and-swap, then delete the generations it no longer keeps.

        Raises:
            SnapshotConflictError: the pointer changed since :meth:`begin`.
            SnapshotCorruptError: see :meth:`_next_pointer` (not after :meth:`begin` accepted the pointer).
            SnapshotStoreError: the store failed.
        """
        name = pending.name
        old = pending.pointer
        ptr = self._next_pointer(name, old, entry)
        needed = {e.dir for e in ptr.generations}
        kept = list(ptr.generations)
        data = _dump_pointer(ptr)
        try:
            if pending.pointer_etag is None:
                self.objects.put_bytes(f"{name}/current", data, if_none_match=True)
            else:
                self.objects.put_bytes(f"{name}/current", data, if_match=pending.pointer_etag)
        except SnapshotConflictError:
            raise SnapshotConflictError("another writer committed this snapshot first (two sessions from one "
                                        "state?); this persist was discarded and the other one is current",
                                        sandbox_path=None,
                                        context={"snapshot": name, "failed_generation": entry.generation}) from None
        dropped = [e for e in (old.generations if old is not None else []) if e.dir not in needed]
        if dropped:
            self._release(name, dropped, kept)

    def _delete_quietly(self, keys: list[str]) -> None:
        """Delete objects, best effort: a failure leaves orphans for :meth:`gc`."""
        delete_quietly(self.objects, keys)

    def _release(self, name: str, dropped: list[_PointerEntry], kept: list[_PointerEntry]) -> None:
        """After ``name``'s pointer stopped listing ``dropped`` (it lists ``kept``): delete what nothing keeps.

        Best effort (a failure leaves orphans for :meth:`gc`), in the order
        of ``_holds``: ``name``'s own generations go unless a hold (a fork)
        keeps them; for another name's generations (a fork's shared ones),
        ``name``'s hold on that origin first shrinks to what ``kept`` still
        lists, then they go unless the origin's pointer or another hold keeps them.
        """
        own = {e.dir for e in dropped if not e.origin}
        if own:
            self._collect(name, own, keep={e.dir for e in kept})
        for origin in sorted({e.origin for e in dropped if e.origin}):
            try:
                write_hold(self.objects, origin, name, {e.dir for e in kept if e.origin == origin})
            except (SnapshotError, ValueError, OSError):
                continue  # the hold stays as it was: nothing is deleted on its account (gc shrinks it)
            self._collect(origin, {e.dir for e in dropped if e.origin == origin})

    def _collect(self, owner: str, dirs: set[str], keep: set[str] | None = None) -> None:
        """Delete generation directories ``dirs`` of ``owner`` that its pointer and its holds do not keep.

        ``keep``: what the owner's pointer lists, when the caller just wrote
        it (else the pointer is read).  Nothing is deleted when the pointer
        or a hold cannot be read.
        """
        try:
            if keep is None:
                ptr, _etag = self._pointer(owner)
                keep = {e.dir for e in ptr.generations} if ptr is not None else set()
            held = held_dirs(self.objects, owner)
        except (SnapshotError, ValueError, OSError):
            return
        if held is None:
            return
        for d in sorted(dirs - keep - held):
            self._delete_quietly([*_keys(owner, d), _index_key(owner, d)])

    def abort(self, pending: PendingArchive) -> None:
        """Discard a generation that will not be committed (idempotent, never raises)."""
        if isinstance(pending, _PendingGeneration) and pending.writer is not None and not pending.done:
            pending.done = True
            with contextlib.suppress(Exception):
                pending.writer.abort()

    # -- reading archives

    def open_generation(self, name: str, limits: SnapshotLimits, *, generation: int | None = None,
                        digest: str | None = None) -> tuple[VerifyingReader, SnapshotInfo]:
        """Open one kept generation's archive for a single forward read, verified as it is read.

        The reader's :meth:`~VerifyingReader.verify` must be called after the
        extraction and before anything the archive produced is used (hydrate
        does): it checks size and archive digest against the metadata.

        Args:
            name: the snapshot name.
            limits: ``max_archive_bytes`` bounds the archive.
            generation: which kept generation (None: the current one).
            digest: when given, the metadata's SHA-256 must equal it (the
                digest a session's MAC-protected state recorded).

        Raises:
            SnapshotNotFoundError: no snapshot ``name``, or ``generation`` is not kept.
            SnapshotCorruptError: the metadata or the archive object is missing,
                does not match its digests or its recorded size, or is not ``digest``.
            SnapshotLimitError: the archive is larger than ``limits.max_archive_bytes``.
            SnapshotStoreError: the store failed.
        """
        chain = self.open_chain(name, limits, generation=generation, digest=digest)
        if len(chain.infos) > 1:
            chain.close()
            raise SnapshotError("this generation is a layer: only hydrate restores it (base and layers in one pass)",
                                sandbox_path=None, context={"snapshot": name, "generation": chain.infos[-1].generation})
        return chain.readers[0], chain.infos[0]

    def _restore_point(self, name: str, generation: int | None) -> tuple[_Pointer, _PointerEntry]:
        """The pointer and the restore point ``generation`` (None: the current one).

        Raises:
            SnapshotNotFoundError: no snapshot ``name``, or ``generation`` is not a kept restore point.
        """
        ptr, _etag = self._pointer(name)
        entries = [] if ptr is None else [e for e in ptr.generations[:ptr.restore_points]
                                          if generation is None or e.generation == generation][:1]
        if ptr is None or not entries:
            raise SnapshotNotFoundError("no snapshot (or no such kept generation) with this name", sandbox_path=None,
                                        context={"snapshot": name, "generation": generation or 0})
        return ptr, entries[0]

    def _verified_chain(self, name: str, generation: int | None,
                        digest: str | None) -> tuple[_Pointer, list[_PointerEntry], list[SnapshotInfo]]:
        """The pointer, and a restore point's chain (base first) with its verified metadata.

        Each metadata object is checked against the pointer, each layer's
        ``parent_digest`` against its parent's, and the newest against ``digest``.

        Raises:
            SnapshotNotFoundError: no snapshot ``name``, or ``generation`` is not kept.
            SnapshotCorruptError: an object is missing or does not match, the chain is broken,
                or the metadata is not ``digest``.
            SnapshotStoreError: the store failed.
        """
        ptr, entry = self._restore_point(name, generation)
        members = ptr.chain(entry)
        infos = [self._meta(name, e) for e in members]
        info = infos[-1]
        ctx = {"snapshot": name, "generation": info.generation}
        if digest is not None and info.digest != digest:
            raise SnapshotCorruptError("the snapshot's metadata is not the one the session state recorded "
                                       "(replaced in the store?)", sandbox_path=None, context=ctx)
        for parent, child in zip(infos, infos[1:]):
            if child.parent_digest != parent.digest or child.parent_generation != parent.generation:
                raise SnapshotCorruptError("a layer's metadata does not name its parent's", sandbox_path=None,
                                           context=ctx)
        if infos[0].parent_generation or len(infos) != info.chain_length:
            raise SnapshotCorruptError("a chain does not start at a full generation", sandbox_path=None, context=ctx)
        return ptr, members, infos

    def fork(self, source: str, target: str, *, generation: int | None = None,
             digest: str | None = None) -> SnapshotInfo:
        """Make new snapshot ``target`` whose only restore point is a generation of ``source``, sharing its objects.

        Nothing is copied: ``target``'s pointer lists the generation and its
        chain with ``origin`` set to the name that owns them, and a hold per
        owner (``OWNER/holds/TARGET``, see ``_holds``) keeps the owner's
        pruning, :meth:`remove` and :meth:`gc` from deleting them while
        ``target`` lists them.  Later persists of either name write new
        generations under that name only, so changes never show in the other.
        The holds are written before the source's pointer is read again and
        checked to still list the generation, and ``target``'s pointer is
        written last, only if none exists.

        Args:
            source: the snapshot to fork (a plain token).
            target: the new snapshot name (a plain token, not ``source``).
            generation: which restore point of ``source`` (None: the current one).
            digest: when given, that generation's metadata SHA-256 must equal
                it (the digest a session's MAC-protected state recorded).

        Returns:
            The forked generation's metadata under the name ``target``: same
            ``generation`` and ``digest`` as in ``source``.

        Raises:
            InvalidPathError: ``source`` or ``target`` is not a plain token.
            SnapshotNotFoundError: no snapshot ``source``, or ``generation`` is not a kept restore point.
            SnapshotCorruptError: the chain does not verify, or its metadata is not ``digest``.
            SnapshotConflictError: ``target`` is ``source``, already exists, is an owner
                of the chain, or has a hold left on an owner (run :meth:`gc`); or
                ``source`` pruned the generation meanwhile (fork again).  Nothing was made.
            SnapshotStoreError: the store failed; nothing was made.
        """
        validate_name(source)
        validate_name(target)
        ctx = {"snapshot": source, "target": target}
        _ptr, members, infos = self._verified_chain(source, generation, digest)
        shared = [e.model_copy(update={"origin": _owner(source, e)}) for e in members]
        if target == source or any(e.origin == target for e in shared) \
                or self.objects.head(f"{target}/current") is not None:
            raise SnapshotConflictError("the fork's snapshot name is in use (it exists, or is the source or one "
                                        "of its origins); nothing was made", sandbox_path=None, context=ctx)
        owners: dict[str, set[str]] = collections.defaultdict(set)
        for e in shared:
            owners[e.origin].add(e.dir)
        written: list[str] = []
        try:
            for owner in sorted(owners):
                self._new_hold(owner, target, owners[owner], ctx)
                written.append(owner)
            again, _etag = self._pointer(source)  # after the holds (see _holds)
            if again is None or members[-1].dir not in {e.dir for e in again.generations}:
                raise SnapshotConflictError("the source snapshot dropped the generation while it was forked; fork "
                                            "again", sandbox_path=None, context=ctx)
            ptr = _Pointer(version=2, name=target, generations=shared[::-1], restore_points=1)
            self.objects.put_bytes(f"{target}/current", _dump_pointer(ptr), if_none_match=True)
        except BaseException:
            self._delete_quietly([hold_key(owner, target) for owner in written])
            raise
        return infos[-1].model_copy(update={"name": target})

    def _new_hold(self, owner: str, holder: str, dirs: set[str], ctx: dict[str, Any]) -> None:
        """Write ``holder``'s hold on ``owner``, only where none exists.

        Raises:
            SnapshotConflictError: a hold of ``holder`` on ``owner`` exists.
            SnapshotStoreError: the store failed.
        """
        try:
            write_hold(self.objects, owner, holder, dirs, if_none_match=True)
        except SnapshotConflictError:
            raise SnapshotConflictError("a hold of the fork's snapshot name is left on the source (a removed "
                                        "snapshot of that name?); run gc or choose another name; nothing was made",
                                        sandbox_path=None, context=ctx) from None

    def open_chain(self, name: str, limits: SnapshotLimits, *, generation: int | None = None,
                   digest: str | None = None) -> _Chain:
        """Open a restore point for hydrate: its chain's archives, base first, and (for a layer) the final index.

        Each metadata object is checked against the pointer, each layer's
        ``parent_digest`` against its parent's metadata (so ``digest``, the
        newest one's, covers the chain), a layer's index against the newest
        metadata and its tree digest; each reader verifies its archive
        (:meth:`VerifyingReader.verify`) once read.  A full generation's
        index is not read (its archive is all a restore needs): the persist
        that chains onto it reads and checks it (:meth:`parent_index`); a
        layer this store object committed itself is restored with the index
        that commit wrote, kept in memory (:meth:`_written_index`).

        Args:
            name: the snapshot name.
            limits: ``max_archive_bytes`` bounds the chain's archives together;
                ``max_entries`` the index.
            generation: which restore point (None: the current one).
            digest: when given, the restore point's metadata SHA-256 must equal it.

        Raises:
            SnapshotNotFoundError: no snapshot ``name``, or ``generation`` is not kept.
            SnapshotCorruptError: an object is missing or does not match, the chain is broken,
                the index is not valid, or the metadata is not ``digest``.
            SnapshotLimitError: the archives are larger than ``limits.max_archive_bytes``.
            SnapshotStoreError: the store failed.
        """
        validate_name(name)
        ptr, members, infos = self._verified_chain(name, generation, digest)
        info = infos[-1]
        ctx = {"snapshot": name, "generation": info.generation}
        total = sum(i.archive_bytes for i in infos)
        if total > limits.max_archive_bytes:
            raise SnapshotLimitError("snapshot archives are larger than max_archive_bytes", sandbox_path=None,
                                     context={**ctx, "max_archive_bytes": limits.max_archive_bytes})
        index = None
        if info.index_sha256 and len(infos) > 1:  # (a full generation's is read by the persist that chains on it)
            index = self._written_index(name, info, limits)
        if index is None and info.index_sha256 and len(infos) > 1:
            policy = SnapshotPolicy(limits)
            index = self._index(name, members[-1], info, policy, frozenset(i.generation for i in infos))
            if index_digest(index.entries) != info.tree_digest:
                raise SnapshotCorruptError("a layer's index does not match its tree digest", sandbox_path=None,
                                           context=ctx)
        readers: list[VerifyingReader] = []
        try:
            for i in infos:
                readers.append(self._open_reader(i))
        except BaseException:
            for r in readers:
                r.close()
            raise
        return _Chain(infos, readers, index, ptr.generations[0].meta_sha256)

    def _written_index(self, name: str, info: SnapshotInfo, limits: SnapshotLimits) -> Index | None:
        """The index this store object's own commit of generation ``info`` wrote, kept in memory (None: none).

        It is the object whose bytes that commit stored and whose SHA-256 the
        metadata records (``info``'s digest names exactly that metadata), and
        it never left this process: reading it back from the store and
        checking it again would prove nothing more.  Only within ``limits``'
        entry count (else the stored one is read, and refused as it would be).
        """
        with self._lock:
            base = self._baselines.get(name)
        index = base.written if base is not None and base.digest == info.digest else None
        return index if index is not None and max(len(index.entries), len(index.deleted)) <= limits.max_entries \
            else None

    def _open_reader(self, info: SnapshotInfo) -> "VerifyingReader":
        """A verifying reader of one generation's archive.

        Raises:
            SnapshotCorruptError: the archive is missing or not of its recorded size.
            SnapshotStoreError: the store failed.
        """
        ctx = {"snapshot": info.name, "generation": info.generation}
        head = self.objects.head(info.archive)
        if head is None or head.size != info.archive_bytes:
            raise SnapshotCorruptError("snapshot archive is missing or its size does not match its metadata",
                                       sandbox_path=None, context=ctx)
        try:
            raw = self.objects.open_range(info.archive, 0, info.archive_bytes + 1)
        except SnapshotNotFoundError:
            raise SnapshotCorruptError("snapshot archive is missing", sandbox_path=None, context=ctx) from None
        return VerifyingReader(raw, info)

    def open_archive(self, name: str, limits: SnapshotLimits) -> tuple[IO[bytes], SnapshotInfo]:
        """Open the current generation's archive, verified before it is returned (two reads of it).

        Hydrate uses :meth:`open_generation` instead (one read, verified
        before the swap); this is the :class:`SnapshotStore` method for other
        readers.  The store may swap the object between the two reads: the
        returned reader verifies its own read too, before it hands out the
        bytes that reach the recorded end (:class:`VerifiedToEnd`).

        Raises:
            The errors of :meth:`open_generation`; the returned reader's read
            that reaches the end raises SnapshotCorruptError when the bytes
            read differ from the metadata's size and archive digest.
        """
        reader, info = self.open_generation(name, limits)
        with reader:
            reader.verify(info)
        fresh, again = self.open_generation(name, limits, generation=info.generation, digest=info.digest)
        # the second read verifies itself too: the store may have swapped the object since the first
        return io.BufferedReader(VerifiedToEnd(fresh, again), _READ_CHUNK), again

    # -- removal and garbage collection

    def remove(self, name: str) -> None:
        """Delete snapshot ``name``: its pointer first (no generation is current after it), then its objects.

        Objects another name still shares (a fork of ``name``: see
        :meth:`fork`) are kept, with the holds that keep them, until that
        name no longer needs them (its pruning or removal deletes them, or
        :meth:`gc`).  The generations of another name that ``name`` shared
        (``name`` is a fork) are released: its holds on them go, and so do
        they when nothing else keeps them.

        Raises:
            InvalidPathError: ``name`` is not a plain token.
            SnapshotStoreError: the store failed (objects left behind go with :meth:`gc`).
        """
        validate_name(name)
        try:
            ptr, _etag = self._pointer(name)
        except SnapshotCorruptError:
            ptr = None  # its holds on other names, if any, are left to gc
        self.objects.delete(f"{name}/current")
        held = held_dirs(self.objects, name)  # read after the pointer is gone (see _holds)
        for obj in list(self.objects.list(f"{name}/")):
            rest = obj.key[len(name) + 1:]
            if rest.startswith("holds/"):
                continue  # another name's hold on this one's generations
            m = _GEN_OBJECT.fullmatch(rest)
            if m is not None and (held is None or m.group(1) in held):
                continue  # a fork still needs it
            self.objects.delete(obj.key)
        if ptr is not None:
            self._release(name, [e for e in ptr.generations if e.origin], [])

    def gc(self, *, older_than: float = 3600.0, now: float | None = None) -> GcReport:
        """Remove objects no pointer names (orphans of crashed or conflicting writers) and stale uploads.

        An object of a generation directory (``NAME/gen/<dir>/archive.tar``,
        ``meta.json`` or ``index``: no other key is ever deleted, so objects of
        other tools sharing the bucket or directory stay) that the name's
        pointer and holds do not keep is deleted when it is older than
        ``older_than`` seconds; so are stale unfinished uploads
        (:meth:`ObjectStore.abort_stale_uploads`), and holds are shrunk to
        what their holder's pointer lists.  Kept generations are never
        touched.  A name whose pointer or holds cannot be read is left alone.

        Why an age, and why a floor: a persist in progress writes its
        generation's objects before its pointer names them, and a fork in
        progress writes its holds before its own pointer lists what they
        hold.  Nothing else tells those apart from a crashed writer's
        leftovers, so only their age protects them: deleting a persist's
        objects before its pointer swap commits a generation that cannot be
        read (and prunes the older ones), and deleting a fork's hold lets
        the source's next pruning delete what the fork lists.  The steps in
        between are a few requests, each bounded by the store client's
        timeouts and retries (S3: 3 attempts of up to 65 s by default), so
        ``older_than`` may not be below :data:`MIN_GC_AGE_S` (15 minutes).
        What the grace cannot cover: a writer stalled for longer than it; and
        an archive uploaded for longer than it to a store that dates a
        multipart object by its upload's start (AWS S3 does): it is that old
        the moment it appears, and a persist still uploading past the grace
        has its upload aborted (that persist fails; nothing committed is
        lost).  Choose a grace longer than the longest persist.  Ages are
        measured on the store's clock, the one object mtimes come from
        (S3: the server's ``LastModified``): unless ``now`` is given, gc
        writes the marker ``sandbox-fs.gc-clock.<random>``, reads its mtime
        as the current time and deletes it, so a local clock that is ahead
        of the server's never makes a young object look old.

        Args:
            older_than: grace period, in seconds (>= :data:`MIN_GC_AGE_S`).
            now: the store's current time, in seconds since the epoch
                (default: read from the store as above).

        Returns:
            What was removed (:class:`GcReport`).

        Raises:
            ValueError: ``older_than`` is below :data:`MIN_GC_AGE_S` (or not a number).
            SnapshotStoreError: the store failed (the marker cannot be written: a read-only store).
        """
        if not older_than >= MIN_GC_AGE_S:
            raise ValueError(f"older_than must be at least {MIN_GC_AGE_S:.0f} seconds (a persist or fork "
                             "still under way has written objects its pointer does not name yet)")
        now = self.store_time() if now is None else now
        report = GcReport()
        for name in self._names():
            try:
                ptr, _etag = self._pointer(name)
            except SnapshotCorruptError:
                continue
            held = self._gc_holds(name, now, older_than, report)
            if held is None:
                continue  # a hold cannot be read: nothing of this name is deleted
            kept = ({e.dir for e in ptr.generations} if ptr is not None else set()) | held
            for obj in list(self.objects.list(f"{name}/gen/")):
                m = _GEN_OBJECT.fullmatch(obj.key[len(name) + 1:])
                if m is None or m.group(1) in kept:
                    continue  # kept, or not an object this class writes (never deleted)
                if now - obj.mtime >= older_than:
                    self.objects.delete(obj.key)
                    report.objects.append(obj.key)
                    report.bytes += obj.size
        report.uploads = self.objects.abort_stale_uploads(older_than)
        return report

    def store_time(self) -> float:
        """The store's current time, in seconds since the epoch, on the clock its object mtimes come from.

        Writes the empty marker ``sandbox-fs.gc-clock.<random>`` (never a
        snapshot's key: a snapshot name holds no dot), reads its mtime and
        deletes it.

        Raises:
            SnapshotStoreError: the store failed, or the marker did not read back.
        """
        key = f"{_CLOCK_KEY}.{secrets.token_hex(8)}"
        try:
            self.objects.put_bytes(key, b"")
            info = self.objects.head(key)
        finally:
            delete_quietly(self.objects, [key])
        if info is None:
            raise SnapshotStoreError("the store's clock marker did not read back", sandbox_path=None,
                                     context={"key": key})
        return info.mtime

    def _gc_holds(self, owner: str, now: float, older_than: float, report: GcReport) -> set[str] | None:
        """The directories of ``owner`` its holds keep, after shrinking stale holds; None: one cannot be read.

        A hold older than ``older_than`` seconds (a younger one may be a fork
        still under way) is shrunk to what its holder's pointer still lists
        of ``owner``, and deleted when that is nothing (its holder was removed
        or crashed before releasing it).  A holder whose pointer cannot be
        read keeps its hold.
        """
        holds = list_holds(self.objects, owner)
        if holds is None:
            return None
        out: set[str] = set()
        for h in holds:
            out |= self._shrink_hold(owner, h, report) if now - h.mtime >= older_than else h.dirs
        return out

    def _shrink_hold(self, owner: str, hold: HeldBy, report: GcReport) -> frozenset[str]:
        """Shrink ``hold`` to what its holder's pointer still lists of ``owner`` (delete it when nothing); what it keeps now."""
        try:
            ptr, _etag = self._pointer(hold.holder)
        except SnapshotCorruptError:
            return hold.dirs  # kept as it is
        refs = {e.dir for e in ptr.generations if e.origin == owner} if ptr is not None else set()
        if hold.dirs and hold.dirs <= refs:
            return hold.dirs  # still needed as it is (an empty one is a tombstone left behind: removed)
        try:
            write_hold(self.objects, owner, hold.holder, hold.dirs & refs, if_match=hold.etag)
        except SnapshotConflictError:
            return hold.dirs  # rewritten meanwhile: kept as read
        report.holds += 1
        return hold.dirs & refs

    def close(self) -> None:
        """Close the object store.  Idempotent."""
        self.objects.close()

    def __enter__(self) -> "GenerationStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
