"""Materialization: apply a :class:`~sandbox_fs.manifest.Manifest` to a workspace.

``await materialize(workspace, manifest, options)`` writes every entry through the
workspace :class:`~sandbox_fs.root.Root` and returns a :class:`MaterializationResult`
listing each written file (sandbox path, size in bytes, sha256, mode, source kind).

Host access comes only from the application: ``MaterializeOptions.base_dir`` (the
*trusted base directory*) and ``MaterializeOptions.extra_path_grants``, each opened as a
read-only Root (sources are only ever read).  There is no default base directory, never
the process cwd.  A relative ``src`` is resolved beneath the base Root, an absolute one
beneath the grant that contains it, at use time and in the kernel (``RESOLVE_BENEATH``),
so a symlink in the source tree, a parent swapped for a symlink mid-copy, or a
``/proc/self/root``-style alias cannot read outside (CVE-2017-1002101, CVE-2018-15664).

Copying:

* a ``local_file`` source is opened ``O_PATH|O_NOFOLLOW`` and ``fstat``-ed first, so a
  FIFO, socket or device is refused without being opened for reading; then it is opened
  ``O_RDONLY|O_NOFOLLOW|O_NONBLOCK`` and its identity compared with the first look;
* a ``local_dir`` is walked on a child Root opened with ``no_symlinks=True``: every file
  is opened with no symlink on any component and must have the ``(st_dev, st_ino)`` the
  walk saw (else :class:`SourceChangedError`).  A symlink inside the tree is reproduced
  only when its target stays inside the copied tree, otherwise refused (default) or
  skipped and reported.  Hard links become separate files; setuid/setgid/sticky are
  cleared; mtimes are kept.  Files go through :meth:`Root.copy_files_from` in batches;
  a file it cannot copy is done again one by one, which repairs it or raises the precise
  error;
* data is written with :meth:`Root.atomic_write` through a view of the workspace that
  refuses every symlink: a destination is never written through a symlink, and one
  planted at a destination is replaced, not followed.

Concurrency (trio): every entry, nested ``dir`` children included (flattened first),
runs under *one* pair of shared ``trio.CapacityLimiter``: ``limiter_entries`` bounds
entries in flight, ``limiter_files`` the worker threads copying files.  Blocking work
runs in worker threads, never one hop per file: a local_dir is walked by one thread,
then copied by it and up to ``min(limiter_files tokens, cpus) - 1`` more, each taking
chunks (one directory, at most ``batch_files`` files) from a shared queue; simple
entries go 64 to a hop.

Mount entries: ``{"type": "mount", "grant": NAME}`` names one of
``MaterializeOptions.extra_path_grants`` (a :class:`~sandbox_fs.paths.Grant`
with that ``name``); :func:`plan_mounts` checks every one before anything is
written, then materialize makes an empty placeholder directory at its
destination (owned like every other entry) and lists it in
``MaterializationResult.mounts`` (:class:`MountRequest`) for the session to
register (never persisted, never cleared) and to hand to the FUSE overlay,
which serves the grant there.  Without ``MaterializeOptions(overlay=True)`` a
manifest holding a mount entry is refused (:class:`MountNeedsOverlayError`).

Partial failure: the first error stops every other entry at its next file boundary and
is re-raised with ``context["written"]`` (up to 50 sandbox paths) and
``context["written_count"]``.  Each written file is complete (atomic write), and
applying the manifest again repairs the workspace: files are replaced, and a
non-directory where a directory belongs (or the reverse) is removed first.
"""
from __future__ import annotations

import collections
import hashlib
import os
import stat as _stat
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import PurePosixPath
from typing import Any, Callable, Iterator, Sequence

import trio

from . import _hooks
from ._root_walk import walk_dirs
from .errors import PathEscapeError, SandboxError, SymlinkRefusedError
from .manifest import (
    Archive,
    Dir,
    File,
    FlatEntry,
    LocalDir,
    LocalFile,
    Manifest,
    ManifestError,
    ManifestTrustError,
    Mount,
    Symlink,
    check_link_target,
)
from .paths import Grant, check_grant_names
from .root import Root, kind_of, open_root

__all__ = [
    "materialize",
    "MaterializeOptions",
    "MaterializationResult",
    "MaterializeProgress",
    "WrittenFile",
    "WrittenSymlink",
    "SkippedEntry",
    "MaterializeError",
    "SourceRefusedError",
    "SourceChangedError",
    "MaterializeLimitError",
    "LimiterTokensError",
    "MountNeedsOverlayError",
    "MountRequest",
    "plan_mounts",
    "make_mount_points",
]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

_SRC_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
_O_PATH = getattr(os, "O_PATH", 0o10000000)
_WRITTEN_SHOWN = 50
_CHUNK = 1 * MiB
_SMALL = 256 * KiB  # files below this are read in one call when hashing
_BATCH_BYTES = 64 * MiB  # a local_dir chunk holds at most this many bytes of files


# ------------------------------------------------------------------------ errors


class MaterializeError(SandboxError):
    """Materialization failed on an entry (wraps a plain OS error; names the sandbox path).

    :func:`materialize` adds ``context["written"]`` (up to 50 sandbox paths) and
    ``context["written_count"]`` to every error it raises.
    """

    code = "materialize_failed"


class SourceRefusedError(MaterializeError):
    """A source is refused: special file, escaping symlink in a local_dir, no base or grant covers it.

    Nothing outside the base directory or the grants was read.
    """

    code = "source_refused"


class SourceChangedError(MaterializeError):
    """A source changed while it was copied (a race); nothing outside was read.  Retry."""

    code = "source_changed"
    retryable = True


class MaterializeLimitError(MaterializeError):
    """A size or count bound of :class:`MaterializeOptions` was hit.

    The reason names the bound (``max_total_bytes``, ``max_files`` or
    ``max_file_bytes``) and its value.
    """

    code = "materialize_limit"


class LimiterTokensError(MaterializeError, ValueError):
    """A ``limiter_entries`` / ``limiter_files`` holds fewer than 1 token: every wait on it would hang.

    Raised by :class:`MaterializeOptions`, or by :func:`materialize` when the
    limiter's tokens were lowered since; ``context`` has ``limiter`` and ``total_tokens``.
    """

    code = "materialize_limiter_tokens"


class MountNeedsOverlayError(MaterializeError):
    """A manifest holds a ``mount`` entry but the workspace is not served by the FUSE overlay.

    Only the overlay can expose a grant at a workspace path; start the
    session with ``SessionConfig(overlay=True)`` (``sandbox-fs run
    --overlay``).  Raised before anything is written; ``sandbox_path`` is the
    first mount entry's destination.
    """

    code = "mount_needs_overlay"
    retryable = False


# ------------------------------------------------------------------ options/result


class MaterializeProgress:
    """Counters a caller may poll while :func:`materialize` runs (e.g. for a TTY display).

    Attributes:
        files: files written so far.
        bytes: file bytes written so far.
    Updated from worker threads under a lock; reads are racy but monotonic.
    """

    def __init__(self) -> None:
        self.files = 0
        self.bytes = 0
        self._lock = threading.Lock()

    def add(self, files: int, nbytes: int) -> None:
        with self._lock:
            self.files += files
            self.bytes += nbytes


@dataclass
class MaterializeOptions:
    """What the *application* (trusted) allows and bounds.  Never taken from a manifest.

    Attributes:
        base_dir: the trusted base directory (absolute host path) that
            relative ``src`` values are resolved beneath; None disables
            relative sources (there is no default, never the process cwd).
        extra_path_grants: application grants; an absolute ``src`` must lie
            under one of them.  Sources are read through read-only Roots
            whatever the grant's mode.
        limiter_entries: bounds entries applied at once (default: a new
            ``CapacityLimiter(8)``); share one across calls to bound them together.
        limiter_files: bounds worker threads copying files (default: a new
            ``CapacityLimiter(max(2, os.cpu_count()))``).  Must not be the
            same object as ``limiter_entries``.  Both limiters must hold at
            least 1 token, when the options are made and whenever
            materialize takes them (``total_tokens`` may be changed later).
        archive_limits: ``sandbox_fs.archive.ArchiveLimits`` for ``archive``
            entries (default: its defaults); a manifest may only narrow them.
        archive_policy: ``sandbox_fs.archive.ExtractPolicy`` (default: its defaults).
        max_file_bytes: largest single file copied from a host source (bytes).
        max_total_bytes: bytes written by one materialization, all files.
        max_files: files + dirs + symlinks created by one materialization.
        digest: compute each written file's sha256 (reads the data through
            Python; False copies fd to fd with ``copy_file_range`` and
            reports ``sha256=None``).
        fsync: fsync each file before its rename (default False, like ``cp -a``).
        batch_files: most files in one chunk of a local_dir (the unit a
            copier thread takes from the entry's queue, and of the
            ``max_total_bytes`` reservation).
        progress: optional :class:`MaterializeProgress` to update.
        overlay: True when the workspace is served by the FUSE overlay (the
            session's ``overlay=True``): ``mount`` entries then get a
            placeholder directory and are listed in the result's ``mounts``.
            False (default): a manifest with a mount entry is refused
            (:class:`MountNeedsOverlayError`).

    Raises (on construction):
        ValueError: ``base_dir`` is not absolute or a bound is negative.
        LimiterTokensError: a limiter has fewer than 1 token.
        InvalidArgumentError: two grants have the same name.
    """

    base_dir: str | None = None
    extra_path_grants: Sequence[Grant] = field(default_factory=list)
    limiter_entries: trio.CapacityLimiter | None = None
    limiter_files: trio.CapacityLimiter | None = None
    archive_limits: Any = None
    archive_policy: Any = None
    max_file_bytes: int = 4 * GiB
    max_total_bytes: int = 64 * GiB
    max_files: int = 1_000_000
    digest: bool = True
    fsync: bool = False
    batch_files: int = 256
    progress: MaterializeProgress | None = None
    overlay: bool = False

    def __post_init__(self) -> None:
        if self.base_dir is not None:
            self.base_dir = os.fspath(self.base_dir)
            if not self.base_dir.startswith("/"):
                raise ValueError("base_dir must be an absolute host path (never resolved against the cwd)")
        grants = []
        for g in self.extra_path_grants:
            grants.append(g if isinstance(g, Grant) else Grant.parse(str(g)))
        check_grant_names(grants)
        self.extra_path_grants = grants
        for name in ("max_file_bytes", "max_total_bytes", "max_files", "batch_files"):
            if getattr(self, name) < (1 if name == "batch_files" else 0):
                raise ValueError(f"{name} must be positive")
        for name in ("limiter_entries", "limiter_files"):
            lim = getattr(self, name)
            if lim is not None:
                _require_tokens(lim, name)


def _require_tokens(lim: Any, name: str) -> Any:
    """Return ``lim`` if it can ever grant a token: a limiter with fewer than 1 would hang every wait on it.

    ``total_tokens`` can be changed after the options are made, so this is
    checked again each time materialize takes the limiter.

    Raises:
        LimiterTokensError: ``lim`` has no ``total_tokens`` or fewer than 1
            (a ``ValueError`` too).
    """
    tokens = getattr(lim, "total_tokens", None)
    if isinstance(tokens, bool) or not isinstance(tokens, (int, float)) or not tokens >= 1:
        shown = tokens if isinstance(tokens, (int, float)) else type(tokens).__name__
        raise LimiterTokensError(f"{name} must be a trio.CapacityLimiter with at least 1 token (it has {shown}); "
                                 "with none, materialize would wait forever", sandbox_path=None,
                                 context={"limiter": name, "total_tokens": shown})
    return lim


@dataclass(frozen=True, slots=True)
class WrittenFile:
    """One file written: sandbox path, size (bytes), sha256 hex (None when not computed), mode, source kind."""

    sandbox_path: str
    size: int
    sha256: str | None
    mode: int
    source_kind: str


@dataclass(frozen=True, slots=True)
class WrittenSymlink:
    """One symlink created: sandbox path, target text, source kind."""

    sandbox_path: str
    target: str
    source_kind: str


@dataclass(frozen=True, slots=True)
class SkippedEntry:
    """Something left out under an explicit policy: sandbox path, rule, reason."""

    sandbox_path: str
    rule: str
    reason: str


@dataclass(frozen=True, slots=True)
class MountRequest:
    """One ``mount`` entry, checked against the application's grants (see :func:`plan_mounts`).

    Attributes:
        path: the destination, a workspace-relative sandbox path (the
            placeholder directory; what ``Session.register_mount`` and the
            overlay's ``OverlayMount(path=...)`` take).
        grant: the name of the grant to expose there.
        read_only: True unless the entry said ``"read_only": false`` and the
            grant is read-write (then the mount is writable).
    """

    path: str
    grant: str
    read_only: bool


@dataclass
class MaterializationResult:
    """What :func:`materialize` wrote.

    Attributes:
        files: every regular file written (sorted by sandbox path); archive
            members are summarized in ``archives`` instead.
        dirs: directories created or repaired (sandbox paths).
        symlinks: symlinks created.
        skipped: nodes left out under a ``skip`` policy, with the reason.
        archives: per ``archive`` entry: ``{"sandbox_path", **ExtractReport}``.
        mounts: the ``mount`` entries whose placeholder directory is in
            place (sorted by path): register each with the session and hand
            them to the overlay.
        elapsed_s: wall time in seconds.
    """

    files: list[WrittenFile] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)
    symlinks: list[WrittenSymlink] = field(default_factory=list)
    skipped: list[SkippedEntry] = field(default_factory=list)
    archives: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[MountRequest] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def total_bytes(self) -> int:
        """Bytes of regular files written, archive members included."""
        return sum(f.size for f in self.files) + sum(int(a.get("bytes_written", 0)) for a in self.archives)

    def file(self, sandbox_path: str) -> WrittenFile | None:
        """The :class:`WrittenFile` for ``sandbox_path``, or None."""
        for f in self.files:
            if f.sandbox_path == sandbox_path:
                return f
        return None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (modes as integers)."""
        return {
            "files": [asdict(f) for f in self.files],
            "dirs": list(self.dirs),
            "symlinks": [asdict(s) for s in self.symlinks],
            "skipped": [asdict(s) for s in self.skipped],
            "archives": list(self.archives),
            "mounts": [asdict(m) for m in self.mounts],
            "total_bytes": self.total_bytes,
            "elapsed_s": round(self.elapsed_s, 6),
        }

    def summary(self) -> str:
        """One line for humans."""
        extra = f", {len(self.archives)} archives" if self.archives else ""
        extra += f", {len(self.mounts)} mounts" if self.mounts else ""
        skipped = f", {len(self.skipped)} skipped" if self.skipped else ""
        return (f"materialized {len(self.files)} files ({self.total_bytes} bytes), {len(self.dirs)} dirs, "
                f"{len(self.symlinks)} symlinks{extra}{skipped} in {self.elapsed_s:.2f} s")


# ------------------------------------------------------------------------- mounts


def plan_mounts(manifest: Manifest, grants: Sequence[Grant], *, overlay: bool = True) -> list[MountRequest]:
    """Check every ``mount`` entry of ``manifest`` against the application's grants.

    Pure: nothing is opened, so a session can call it before it touches the
    workspace.  A mount entry must name a grant of ``grants`` (by
    :attr:`~sandbox_fs.paths.Grant.name`), and may ask for read-write access
    (``"read_only": false``) only to a read-write grant.

    Args:
        manifest: a validated :class:`~sandbox_fs.manifest.Manifest`.
        grants: the application's extra path grants (trusted).
        overlay: whether the workspace will be served by the FUSE overlay;
            False refuses any mount entry (what materialize does without
            ``MaterializeOptions(overlay=True)``).

    Returns:
        One :class:`MountRequest` per mount entry, sorted by path (empty
        when the manifest has none).

    Raises:
        MountNeedsOverlayError: ``overlay`` is False and the manifest holds a
            mount entry (checked first).
        ManifestTrustError: an entry names a grant the application did not
            give, or asks read-write access to a read-only grant
            (``context["field"]`` is ``entries[...].grant`` or
            ``.read_only``, ``context["grant"]`` the name; never a host path).
        InvalidArgumentError: two of ``grants`` have the same name.
    """
    entries = manifest.mount_entries()
    if entries and not overlay:
        raise MountNeedsOverlayError("a mount entry needs the FUSE overlay (SessionConfig(overlay=True), "
                                     "sandbox-fs run --overlay); nothing was written", sandbox_path=entries[0].path,
                                     context={"field": entries[0].field})
    check_grant_names(grants)
    by_name = {g.name: g for g in grants if g.name is not None}
    out = []
    for fe in entries:
        ent: Mount = fe.entry
        grant = by_name.get(ent.grant)
        if grant is None:
            raise ManifestTrustError(f"a mount entry may only name a grant the application gave; none is "
                                     f"named {ent.grant!r}", field=fe.field + ".grant", sandbox_path=fe.path,
                                     context={"grant": ent.grant})
        if not ent.read_only and grant.read_only:
            raise ManifestTrustError(f"a read-write mount of grant {ent.grant!r}, which the application gave "
                                     "read-only", field=fe.field + ".read_only", sandbox_path=fe.path,
                                     context={"grant": ent.grant})
        out.append(MountRequest(fe.path, ent.grant, ent.read_only))
    return sorted(out, key=lambda r: r.path)


def make_mount_points(workspace: Root, mounts: Sequence[MountRequest]) -> None:
    """Make the empty placeholder directory of each mount (mode 0o755, the Root's owner).  Blocking.

    For a session that starts the overlay before it materializes: call it on
    the workspace itself (after a restore), then hand the mounts to the
    overlay.  An existing directory is kept as it is; a non-directory
    standing at the path or at a parent is replaced, as materialize repairs.
    Nothing is ever created through a symlink.

    Raises:
        ReadOnlyError: ``workspace`` is read-only, or a path is under a read-only grant.
        OSError: a directory cannot be made (``filename`` is the sandbox path).
        PathEscapeError, SymlinkRefusedError, InvalidPathError, WorkspaceClosedError: see
            :class:`~sandbox_fs.root.Root`.
    """
    ws = workspace.with_options(no_symlinks=True)
    try:
        for m in sorted(mounts, key=lambda r: r.path):
            _ensure_dir(ws, m.path, 0o755)
    finally:
        ws.close()


# ------------------------------------------------------------------------ sources


class _Sources:
    """Read-only Roots on the trusted base and the grants; resolves an entry's ``src``."""

    def __init__(self, opts: MaterializeOptions) -> None:
        self.base: Root | None = None
        self.grants: list[tuple[str, Root]] = []
        self._opts = opts
        self._lock = threading.Lock()

    def _open(self) -> None:
        if self.base is None and self._opts.base_dir is not None:
            self.base = open_root(self._opts.base_dir, read_only=True, label="<base>")
        if not self.grants and self._opts.extra_path_grants:
            gs = sorted(self._opts.extra_path_grants, key=lambda g: len(g.path), reverse=True)
            for g in gs:
                self.grants.append((g.path, open_root(g.path, read_only=True, label=g.path, shown=g.label)))

    def resolve(self, src: str, dest: str, fld: str) -> tuple[Root, str]:
        """Return ``(read-only Root, relative path)`` for ``src``.

        Raises:
            SourceRefusedError: absolute ``src`` under no grant, or a relative
                ``src`` with no trusted base directory.
        """
        with self._lock:
            self._open()
        if src.startswith("/"):
            for gpath, root in self.grants:
                if src == gpath or src.startswith(gpath.rstrip("/") + "/"):
                    return root, src[len(gpath):].strip("/") or "."
            raise SourceRefusedError("an absolute src must lie under an extra path grant of the application",
                                     sandbox_path=dest, context={"field": fld + ".src"})
        if self.base is None:
            raise SourceRefusedError("no trusted base directory was given, so local sources are disabled",
                                     sandbox_path=dest, context={"field": fld + ".src"})
        return self.base, src

    def close(self) -> None:
        if self.base is not None:
            self.base.close()
        for _, r in self.grants:
            r.close()


def _join(a: str, b: str) -> str:
    if not b or b == ".":
        return a
    return f"{a}/{b}" if a else b


def _refuse_special(mode: int, shown: str, dest: str) -> None:
    if _stat.S_ISDIR(mode):
        raise SourceRefusedError("source is a directory, not a regular file (use a local_dir entry)",
                                 sandbox_path=dest, context={"source": shown})
    raise SourceRefusedError(f"source is a {kind_of(mode)}, not a regular file; special files are never read",
                             sandbox_path=dest, context={"source": shown})


def _open_source_file(root: Root, rel: str, dest: str) -> tuple[int, os.stat_result]:
    """Open a single source file: O_PATH look first (never opens a device or FIFO), then read-open.

    Raises:
        SymlinkRefusedError: the final component is a symlink.
        PathEscapeError: the path leaves the base or grant.
        SourceRefusedError: not a regular file.
        SourceChangedError: swapped between the two opens (another inode,
            a symlink, a special file, an escape or nothing at the name).
    """
    pfd = root.open_fd(rel, _O_PATH | os.O_NOFOLLOW, 0)
    try:
        pst = os.fstat(pfd)
    finally:
        os.close(pfd)
    if _stat.S_ISLNK(pst.st_mode):
        raise SymlinkRefusedError("the source is a symlink; a final symlink in a src is never followed",
                                  sandbox_path=dest, context={"operation": "open_source"})
    if not _stat.S_ISREG(pst.st_mode):
        _refuse_special(pst.st_mode, rel, dest)
    if _hooks.current is not None:
        _hooks.fire("materialize.local_file", root=root, path=rel, dest=dest)
    try:
        fd = root.open_fd(rel, _SRC_FLAGS, 0)
    except (SymlinkRefusedError, PathEscapeError, NotADirectoryError, FileNotFoundError) as exc:
        # the look saw a regular file there: a symlink, an escape or nothing now is a change
        raise SourceChangedError("the source file was replaced while it was opened; nothing outside was read",
                                 sandbox_path=dest, diagnostic=repr(exc)) from None
    except SandboxError as exc:
        if exc.code == "special_file":
            raise SourceChangedError("the source file was replaced while it was opened",
                                     sandbox_path=dest) from None
        raise
    try:
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (pst.st_dev, pst.st_ino):
            raise SourceChangedError("the source file was replaced while it was opened", sandbox_path=dest)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


# ---------------------------------------------------------------------------- run


class _Stopped(Exception):
    """Internal: another entry failed; stop at this file boundary."""


class _Run:
    """Shared state of one materialize call (used from the trio thread and worker threads)."""

    def __init__(self, ws: Root, opts: MaterializeOptions, lim_entries: trio.CapacityLimiter,
                 lim_files: trio.CapacityLimiter) -> None:
        self.ws = ws
        self.opts = opts
        self.sources = _Sources(opts)
        self.lim_entries = lim_entries
        self.lim_files = lim_files
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.result = MaterializationResult()
        self.error: BaseException | None = None
        self.bytes_budget = 0
        self.nodes = 0
        self.cancel_scope: trio.CancelScope | None = None

    # -- bookkeeping (thread-safe)

    def check_stop(self) -> None:
        if self.stop.is_set():
            raise _Stopped()

    def reserve(self, nbytes: int, nodes: int, dest: str) -> None:
        with self.lock:
            self.bytes_budget += nbytes
            self.nodes += nodes
            if self.bytes_budget > self.opts.max_total_bytes:
                raise MaterializeLimitError(f"more than max_total_bytes={self.opts.max_total_bytes} bytes",
                                            sandbox_path=dest)
            if self.nodes > self.opts.max_files:
                raise MaterializeLimitError(f"more than max_files={self.opts.max_files} nodes", sandbox_path=dest)

    def unreserve(self, nbytes: int, nodes: int) -> None:
        """Give back a reservation that was not used (never raises)."""
        with self.lock:
            self.bytes_budget -= nbytes
            self.nodes -= nodes

    def add_files(self, files: list[WrittenFile]) -> None:
        if not files:
            return
        with self.lock:
            self.result.files.extend(files)
        if self.opts.progress is not None:
            self.opts.progress.add(len(files), sum(f.size for f in files))

    def add(self, attr: str, items: list[Any]) -> None:
        if items:
            with self.lock:
                getattr(self.result, attr).extend(items)

    def fail(self, exc: BaseException) -> None:
        with self.lock:
            if self.error is None and not isinstance(exc, _Stopped):
                self.error = exc
        self.stop.set()
        if self.cancel_scope is not None:
            self.cancel_scope.cancel()

    # -- workspace writes (worker threads)

    def ensure_dir(self, path: str, mode: int) -> None:
        """mkdir -p with repair: a non-directory standing on the path is replaced."""
        _ensure_dir(self.ws, path, mode)

    def write(self, dest: str, make_data: Callable[[], Any], mode: int, mtime_ns: int | None) -> int:
        """Atomic write with repair (a directory where the file belongs is removed first)."""
        ws = self.ws
        try:
            return ws.atomic_write(dest, make_data(), mode=mode, fsync=self.opts.fsync,
                                   max_bytes=self.opts.max_file_bytes, mtime_ns=mtime_ns)
        except (IsADirectoryError, NotADirectoryError, SymlinkRefusedError, FileNotFoundError) as exc:
            if isinstance(exc, FileNotFoundError) and "/" not in dest:
                raise
            parent = dest.rpartition("/")[0]
            if parent:
                self.ensure_dir(parent, 0o755)
            if ws.exists(dest):
                ws.rmtree(dest)
        return ws.atomic_write(dest, make_data(), mode=mode, fsync=self.opts.fsync,
                               max_bytes=self.opts.max_file_bytes, mtime_ns=mtime_ns)

    def make_symlink(self, target: str, dest: str) -> None:
        ws = self.ws
        try:
            ws.symlink(target, dest)
            return
        except FileExistsError:
            st = ws.lstat(dest)
            if _stat.S_ISLNK(st.st_mode) and ws.readlink(dest) == target:
                return
            ws.rmtree(dest)
        except (FileNotFoundError, NotADirectoryError, SymlinkRefusedError):
            parent = dest.rpartition("/")[0]
            if not parent:
                raise
            self.ensure_dir(parent, 0o755)
        ws.symlink(target, dest)

    def copy_fd(self, fd: int, st: os.stat_result, dest: str, mode: int, kind: str) -> WrittenFile:
        """Copy an open regular source fd into ``dest`` (bounded; sha256 when asked)."""
        opts = self.opts
        if st.st_size > opts.max_file_bytes:
            raise MaterializeLimitError(f"source is over max_file_bytes={opts.max_file_bytes} bytes",
                                        sandbox_path=dest)
        self.reserve(st.st_size, 1, dest)
        if opts.digest and st.st_size < _SMALL:
            # Small file: one read, hash, write the bytes (no generator, no second read).
            data = os.read(fd, st.st_size + 1)
            if len(data) <= st.st_size:
                n = self.write(dest, lambda: data, mode, st.st_mtime_ns)
                return WrittenFile(dest, n, hashlib.sha256(data).hexdigest(), mode, kind)
        if opts.digest:
            box: list[Any] = [None]

            def make() -> Iterator[bytes]:
                os.lseek(fd, 0, os.SEEK_SET)
                h = hashlib.sha256()
                box[0] = h
                return _chunks(fd, st.st_size, h)

            n = self.write(dest, make, mode, st.st_mtime_ns)
            sha = box[0].hexdigest()
        else:
            tries = [0]

            def make_fd() -> int:
                if tries[0]:
                    os.lseek(fd, 0, os.SEEK_SET)  # a retry after a repair starts over
                tries[0] += 1
                return fd

            n = self.write(dest, make_fd, mode, st.st_mtime_ns)
            sha = None
        if n != st.st_size:
            self.reserve(n - st.st_size, 0, dest)
        return WrittenFile(dest, n, sha, mode, kind)


def _ensure_dir(ws: Root, path: str, mode: int) -> None:
    """mkdir -p beneath ``ws`` with repair: a non-directory standing on the path (or a parent) is replaced.

    An existing directory keeps its mode and owner; new ones get the Root's owner.
    """
    try:
        ws.mkdir(path, mode, exist_ok=True)
        return
    except FileNotFoundError:
        parent = path.rpartition("/")[0]
        if not parent:
            raise
        _ensure_dir(ws, parent, 0o755)
    except (FileExistsError, NotADirectoryError, SymlinkRefusedError):
        _repair_parents(ws, path)
        if ws.exists(path) and not _stat.S_ISDIR(ws.lstat(path).st_mode):
            ws.rmtree(path)
    ws.mkdir(path, mode, exist_ok=True)


def _repair_parents(ws: Root, path: str) -> None:
    parts = path.split("/")
    for i in range(1, len(parts)):
        sub = "/".join(parts[:i])
        try:
            st = ws.lstat(sub)
        except FileNotFoundError:
            ws.mkdir(sub, 0o755)
            continue
        if not _stat.S_ISDIR(st.st_mode):
            ws.rmtree(sub)
            ws.mkdir(sub, 0o755)


def _chunks(fd: int, size_hint: int, h: Any) -> Iterator[bytes]:
    want = min(max(size_hint + 1, 4 * KiB), _CHUNK)
    read = os.read
    while True:
        b = read(fd, want)
        if not b:
            return
        h.update(b)
        yield b
        want = _CHUNK


def _wrap(exc: BaseException, dest: str) -> BaseException:
    """Turn a plain OSError into a MaterializeError naming the sandbox path (never a host path)."""
    if isinstance(exc, SandboxError) or not isinstance(exc, OSError):
        return exc
    where = exc.filename if isinstance(exc.filename, str) else dest
    what = os.strerror(exc.errno) if exc.errno else type(exc).__name__
    op = getattr(exc, "operation", None)
    err = MaterializeError(f"{what}{f' ({op})' if op else ''}", sandbox_path=where,
                           context={"entry": dest, "errno": exc.errno})
    err.__cause__ = exc
    return err


# ------------------------------------------------------------------ entry workers


def _apply_simple(run: _Run, batch: list[FlatEntry]) -> None:
    """File, Symlink and LocalFile entries: one worker-thread hop for the whole batch."""
    files: list[WrittenFile] = []
    links: list[WrittenSymlink] = []
    try:
        for fe in batch:
            run.check_stop()
            ent = fe.entry
            try:
                if isinstance(ent, File):
                    data = ent.data()
                    mode = 0o644 if ent.mode is None else ent.mode
                    run.reserve(len(data), 1, fe.path)
                    n = run.write(fe.path, lambda: data, mode, None)
                    files.append(WrittenFile(fe.path, n, hashlib.sha256(data).hexdigest() if run.opts.digest
                                             else None, mode, "file"))
                elif isinstance(ent, Symlink):
                    target = check_link_target(fe.path, ent.target, field=fe.field + ".target")
                    run.reserve(0, 1, fe.path)
                    run.make_symlink(target, fe.path)
                    links.append(WrittenSymlink(fe.path, target, "symlink"))
                elif isinstance(ent, LocalFile):
                    root, rel = run.sources.resolve(ent.src, fe.path, fe.field)
                    fd, st = _open_source_file(root, rel, fe.path)
                    try:
                        mode = _stat.S_IMODE(st.st_mode) & 0o777 if ent.mode is None else ent.mode
                        files.append(run.copy_fd(fd, st, fe.path, mode, "local_file"))
                    finally:
                        os.close(fd)
            except BaseException as exc:
                raise _wrap(exc, fe.path) from None
    finally:
        run.add_files(files)
        run.add("symlinks", links)


class _DirWork:
    """One local_dir entry in flight: what its walk found and a queue of file chunks (thread-safe).

    The walking thread (:func:`_plan_local_dir`) creates each directory and
    queues that directory's files in chunks (at most ``batch_files`` files
    and 64 MiB, never two directories); when the walk is over it asks for
    up to ``max_copiers`` more copier threads (``spawn``, never more than
    there are chunks left) and copies too.  Copiers (:func:`_copy_worker`)
    take one chunk at a time until the queue is empty, so both threads stay
    busy to the end whatever the sizes of the chunks.

    The walk is not overlapped with the copy on purpose: measured on
    tmpfs, a Python walk (one ``lstat`` per node) running beside a copier
    only trades GIL hand-offs between the two threads and made the whole
    copy slower, not faster.
    """

    def __init__(self, dest: str, spawn: Callable[[], None], max_copiers: int) -> None:
        self.dest = dest
        self.tree: Root | None = None
        self.dirs: list[tuple[str, os.stat_result]] = []  # created directories, walk order
        self.links: list[tuple[str, str]] = []
        self._chunks: collections.deque[list[tuple[str, os.stat_result]]] = collections.deque()
        self._cond = threading.Condition(threading.Lock())
        self._closed = False
        self._spawn = spawn
        self._max_copiers = max_copiers

    def put(self, chunk: list[tuple[str, os.stat_result]]) -> None:
        with self._cond:
            self._chunks.append(chunk)
            self._cond.notify()

    def get(self) -> list[tuple[str, os.stat_result]] | None:
        """The next chunk (waits for the walk); None once the walk is over and the queue is empty."""
        with self._cond:
            while not self._chunks:
                if self._closed:
                    return None
                self._cond.wait()
            return self._chunks.popleft()

    def close(self, *, drop: bool = False) -> None:
        """The walk is over: start the copiers (``drop``: it failed, so the queued chunks are never copied)."""
        with self._cond:
            self._closed = True
            if drop:
                self._chunks.clear()
            self._cond.notify_all()
            more = max(0, min(self._max_copiers, len(self._chunks) - 1))
            self._max_copiers = 0
        for _ in range(more):
            self._spawn()


def _matches(rel: str, patterns: list[str]) -> bool:
    p = PurePosixPath(rel)
    return any(p.match(pat) for pat in patterns)


def _check_cancel(run: _Run) -> None:
    """In a worker thread: stop here if another unit failed or the materialize call was cancelled.

    Raises:
        _Stopped: ``run.stop`` is set.
        trio.Cancelled: the trio task that started this thread was cancelled.
    """
    if run.stop.is_set():
        raise _Stopped()
    trio.from_thread.check_cancelled()


def _plan_local_dir(run: _Run, fe: FlatEntry, work: _DirWork) -> None:
    """Walk the source tree, check every symlink and special file; then create the directories and queue the files.

    Nothing is written before the whole tree is checked, so a refused node
    (or a tree over ``max_files``) leaves the workspace untouched.
    """
    ent: LocalDir = fe.entry
    root, rel = run.sources.resolve(ent.src, fe.path, fe.field)
    tree = work.tree = root.open_root(rel, no_symlinks=True)  # closed by _apply_local_dir
    dirs, links = work.dirs, work.links
    dirs.append(("", tree.stat(".")))
    per_dir: list[tuple[str, list[tuple[str, os.stat_result]]]] = []
    skipped: list[SkippedEntry] = []
    nfiles = 0
    for dirpath, dirents, nondirs in walk_dirs(tree):
        _check_cancel(run)
        keep = []
        for de in dirents:
            if ent.exclude and _matches(de.path, ent.exclude):
                continue
            keep.append(de)
            dirs.append((de.path, de.stat))  # the walk's own lstat of the directory
        dirents[:] = keep
        files: list[tuple[str, os.stat_result]] = []
        for e in nondirs:
            if ent.exclude and _matches(e.path, ent.exclude):
                continue
            if ent.include and not _matches(e.path, ent.include):
                continue
            if e.kind == "file":
                files.append((e.path, e.stat))
            elif e.kind == "symlink":
                target = tree.readlink(e.path)
                try:
                    links.append((e.path, check_link_target(e.path, target)))
                except ManifestError as why:
                    if ent.symlinks == "skip":
                        skipped.append(SkippedEntry(_join(fe.path, e.path), "symlink", why.reason))
                        continue
                    raise SourceRefusedError(
                        f"symlink inside local_dir does not stay inside the copied tree ({why.reason})",
                        sandbox_path=_join(fe.path, e.path), context={"field": fe.field + ".symlinks"}) from None
            else:
                if ent.special_files == "skip":
                    skipped.append(SkippedEntry(_join(fe.path, e.path), "special_file", f"{e.kind} is never copied"))
                    continue
                _refuse_special(e.stat.st_mode, e.path, _join(fe.path, e.path))
        if files:
            per_dir.append((dirpath, files))
            nfiles += len(files)
        if nfiles + len(dirs) + len(links) > run.opts.max_files:
            raise MaterializeLimitError(f"local_dir has more than max_files={run.opts.max_files} nodes",
                                        sandbox_path=fe.path)
    run.reserve(0, len(dirs) + len(links), fe.path)
    for rel_path, _st in dirs:
        _check_cancel(run)
        run.ensure_dir(_join(fe.path, rel_path), 0o700)
    run.add("skipped", skipped)
    # Queue the files in chunks of one directory each (copy_files_from opens
    # each directory once per call), at most batch_files files / 64 MiB.
    max_count = run.opts.batch_files
    for _dirpath, files in per_dir:
        chunk: list[tuple[str, os.stat_result]] = []
        size = 0
        for item in files:
            chunk.append(item)
            size += item[1].st_size
            if len(chunk) >= max_count or size >= _BATCH_BYTES:
                work.put(chunk)
                chunk, size = [], 0
        if chunk:
            work.put(chunk)


def _plan_and_copy(run: _Run, fe: FlatEntry, work: _DirWork) -> None:
    """The walking thread: walk (queueing chunks), then help copy until the queue is drained."""
    try:
        _plan_local_dir(run, fe, work)
    except BaseException:
        work.close(drop=True)
        raise
    work.close()
    _copy_worker(run, work)


def _copy_worker(run: _Run, work: _DirWork) -> None:
    """A copier thread: copy chunks of one local_dir until its queue is drained (one hop).

    One copy buffer per thread, reused for every chunk.
    """
    buf = bytearray(_CHUNK) if run.opts.digest else None
    while True:
        _check_cancel(run)
        chunk = work.get()
        if chunk is None:
            return
        _copy_batch(run, work, chunk, buf)


def _copy_batch(run: _Run, work: _DirWork, batch: list[tuple[str, os.stat_result]],
                buf: bytearray | None = None) -> None:
    """Copy one chunk of a local_dir's files (in a worker thread; ``buf``: its copy buffer).

    Fast path: :meth:`Root.copy_files_from` (each directory opened once,
    one native call per group of files, sha256 from the bytes written).  A file it
    cannot copy (any error: a source that changed, a directory where the
    file belongs, a bound) is done again by :func:`_copy_one`, the per-file
    path, which re-opens the source, repairs the destination or raises the
    error materialize reports; the fast path leaves nothing behind on failure.
    """
    out: list[WrittenFile] = []
    tree = work.tree
    assert tree is not None
    dest_of = [_join(work.dest, rel_path) for rel_path, _ in batch]
    modes = [_stat.S_IMODE(walk_st.st_mode) & 0o777 for _, walk_st in batch]
    sizes = [walk_st.st_size for _, walk_st in batch]
    items = [(rel_path, dest_of[i], modes[i], walk_st.st_mtime_ns, (walk_st.st_dev, walk_st.st_ino))
             for i, (rel_path, walk_st) in enumerate(batch)]
    opts = run.opts
    max_file = opts.max_file_bytes
    stop_is_set = run.stop.is_set
    check_cancelled = trio.from_thread.check_cancelled
    # Reserve the whole batch at once; near a bound, file by file (the precise
    # error, and every file before it written, as the per-file path does).
    whole = bool(sizes) and max(sizes) <= max_file
    if whole:
        try:
            run.reserve(sum(sizes), len(sizes), dest_of[0])
        except MaterializeLimitError:
            run.unreserve(sum(sizes), len(sizes))
            whole = False
    reserved = [-1]  # per-file mode: index of the last item reserved by before()
    start = 0

    def before(i: int) -> None:
        if stop_is_set():
            raise _Stopped()
        check_cancelled()
        if not whole:
            k = start + i
            if sizes[k] > max_file:
                raise _SlowPath()
            run.reserve(sizes[k], 1, dest_of[k])
            reserved[0] = k

    try:
        while start < len(items):
            done: list[tuple[int, str | None]] = []
            failed = False
            try:
                # near a bound, one file per call: before() reserves exactly the file copied next
                run.ws.copy_files_from(tree, items[start:] if whole else items[start:start + 1], max_bytes=max_file,
                                       digest=opts.digest, fsync=opts.fsync, buffer=buf, before_each=before,
                                       results=done)
            except (_Stopped, MaterializeLimitError):
                raise
            except Exception:  # noqa: BLE001 - the per-file path decides (repair or the reported error)
                failed = True
            finally:
                for j, (n, sha) in enumerate(done):
                    k = start + j
                    if n != sizes[k]:
                        run.reserve(n - sizes[k], 0, dest_of[k])
                    out.append(WrittenFile(dest_of[k], n, sha, modes[k], "local_dir"))
                start += len(done)
            if failed and start < len(items):
                k = start
                run.check_stop()
                if whole or reserved[0] == k:  # _copy_one reserves this file itself
                    run.unreserve(sizes[k], 1)
                out.append(_copy_one(run, tree, batch[k][0], batch[k][1], dest_of[k]))
                start += 1
    finally:
        run.add_files(out)


class _SlowPath(Exception):
    """Internal: leave this file to the per-file path (it raises the precise error)."""


def _copy_one(run: _Run, tree: Root, rel_path: str, walk_st: os.stat_result, dest: str) -> WrittenFile:
    """Copy one local_dir file the per-file way (source re-opened, destination repaired)."""
    if _hooks.current is not None:
        _hooks.fire("materialize.local_dir_file", root=tree, path=rel_path, dest=dest)
    try:
        fd = tree.open_fd(rel_path, _SRC_FLAGS, 0)
    except (SymlinkRefusedError, PathEscapeError, NotADirectoryError) as exc:
        raise SourceChangedError("the source tree changed during the copy (a path component is now a "
                                 "symlink or a file); nothing outside was read", sandbox_path=dest,
                                 diagnostic=repr(exc)) from None
    except FileNotFoundError:
        raise SourceChangedError("a source file disappeared during the copy", sandbox_path=dest) from None
    except SandboxError as exc:
        if exc.code == "special_file":
            raise SourceChangedError("a source file was replaced during the copy", sandbox_path=dest) from None
        raise
    try:
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (walk_st.st_dev, walk_st.st_ino):
            raise SourceChangedError("a source file was replaced during the copy", sandbox_path=dest)
        return run.copy_fd(fd, st, dest, _stat.S_IMODE(st.st_mode) & 0o777, "local_dir")
    except BaseException as exc:
        raise _wrap(exc, dest) from None
    finally:
        os.close(fd)


def _finish_local_dir(run: _Run, work: _DirWork) -> None:
    """Symlinks, then directory modes and mtimes, deepest first (one hop)."""
    links = []
    for rel_path, target in work.links:
        run.check_stop()
        dest = _join(work.dest, rel_path)
        try:
            run.make_symlink(target, dest)
        except BaseException as exc:
            raise _wrap(exc, dest) from None
        links.append(WrittenSymlink(dest, target, "local_dir"))
    run.add("symlinks", links)
    for rel_path, st in sorted(work.dirs, key=lambda d: d[0].count("/") + (1 if d[0] else 0), reverse=True):
        dest = _join(work.dest, rel_path)
        # through the directory's fd, never by name (a name swapped for a hard link is refused)
        run.ws.set_dir_meta(dest, mode=_stat.S_IMODE(st.st_mode) & 0o777, mtime_ns=st.st_mtime_ns)
    run.add("dirs", [_join(work.dest, rel_path) for rel_path, _ in work.dirs])


class _TokenHeld:
    """A ``to_thread.run_sync`` limiter for a task that already holds a ``limiter_files`` token."""

    async def acquire_on_behalf_of(self, borrower: object) -> None:
        pass

    def release_on_behalf_of(self, borrower: object) -> None:
        pass


_TOKEN_HELD = _TokenHeld()


async def _in_thread_holding_token(fn: Callable[..., Any], *args: Any) -> None:
    await trio.to_thread.run_sync(fn, *args, limiter=_TOKEN_HELD)


def _no_spawn() -> None:
    pass


async def _apply_local_dir(run: _Run, fe: FlatEntry) -> None:
    """One local_dir: walk, then copy in worker threads, then symlinks and directory metadata.

    The walking thread runs on a ``limiter_files`` token taken here, before
    any copier of this entry exists, so a copier never holds a token the
    walk needs (no deadlock, even with one token); it copies too once the
    walk is over.  The other copier threads (at most ``min(tokens, cpus) -
    1``) each hop once and wait for their own token.
    """
    lim = run.lim_files
    max_copiers = max(0, min(int(min(lim.total_tokens, 1 << 16)), os.cpu_count() or 2) - 1)
    trio_token = trio.lowlevel.current_trio_token()
    work = _DirWork(fe.path, lambda: None, max_copiers)
    try:
        async with trio.open_nursery() as nursery:
            def start_copier() -> None:  # on the trio thread (run_sync_soon)
                try:
                    nursery.start_soon(_guarded, run, trio.to_thread.run_sync, _copy_worker, run, work)
                except RuntimeError:  # the nursery already closed: the walking thread drained the queue
                    pass

            work._spawn = lambda: trio_token.run_sync_soon(start_copier)
            async with lim:
                await _guarded(run, _in_thread_holding_token, _plan_and_copy, run, fe, work)
        run.check_stop()
        await trio.to_thread.run_sync(_finish_local_dir, run, work, limiter=lim)
    finally:
        work.close(drop=True)
        # The spawn closure refers to this work and to the run: without it, both
        # (and every WrittenFile) are freed as soon as the call is over, not by a gc pass.
        work._spawn = _no_spawn
        if work.tree is not None:
            work.tree.close()


def _narrow_limits(app_limits: Any, wanted: dict[str, int], fe: FlatEntry) -> Any:
    if not wanted:
        return app_limits
    fields = type(app_limits).model_fields  # only declared limits: never model attributes or methods
    update = {}
    for k, v in wanted.items():
        if k not in fields:
            raise ManifestError(f"unknown archive limit {k!r}", field=fe.field + ".limits", sandbox_path=fe.path)
        cur = getattr(app_limits, k)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not isinstance(cur, (int, float)):
            raise ManifestError(f"archive limit {k!r} must be a number", field=fe.field + ".limits",
                                sandbox_path=fe.path)
        update[k] = min(cur, type(cur)(v))
    try:
        # re-validate: a manifest may only narrow the application's limits,
        # and the model's own bounds (ge=...) still apply
        return type(app_limits).model_validate({**app_limits.model_dump(), **update})
    except ValueError as exc:
        raise ManifestError(f"invalid archive limits: {exc.errors()[0]['msg'] if hasattr(exc, 'errors') else exc}",
                            field=fe.field + ".limits", sandbox_path=fe.path) from None


async def _apply_archive(run: _Run, fe: FlatEntry) -> None:
    try:
        from .archive import ArchiveLimits, ExtractPolicy, extract_async
    except ImportError:
        raise SourceRefusedError("archive entries need sandbox_fs.archive, which is not available",
                                 sandbox_path=fe.path) from None
    ent: Archive = fe.entry
    limits = _narrow_limits(run.opts.archive_limits or ArchiveLimits(), ent.limits, fe)
    policy = run.opts.archive_policy or ExtractPolicy()

    def _open() -> tuple[int, os.stat_result]:
        root, rel = run.sources.resolve(ent.src, fe.path, fe.field)
        fd, st = _open_source_file(root, rel, fe.path)
        try:
            run.ensure_dir(fe.path, 0o755)
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    fd, _st = await trio.to_thread.run_sync(_open, limiter=run.lim_files)
    with os.fdopen(fd, "rb") as src:
        report = await extract_async(run.ws, fe.path, src, format=ent.format, limits=limits, policy=policy,
                                     limiter=run.lim_files)
    info = report.model_dump(mode="json") if hasattr(report, "model_dump") else dict(vars(report))
    info["sandbox_path"] = fe.path
    run.add("archives", [info])
    if run.opts.progress is not None:
        run.opts.progress.add(int(info.get("files", 0)), int(info.get("bytes_written", 0)))


async def _guarded(run: _Run, fn: Callable[..., Any], *args: Any) -> None:
    """Run one unit; the first failure is recorded and cancels the rest."""
    try:
        if fn is trio.to_thread.run_sync:
            await fn(*args, limiter=run.lim_files)
        else:
            await fn(*args)
    except _Stopped:
        pass
    except Exception as exc:  # noqa: BLE001 - recorded and re-raised by materialize()
        run.fail(exc)


async def _entry_task(run: _Run, fn: Callable[..., Any], *args: Any) -> None:
    try:
        _require_tokens(run.lim_entries, "limiter_entries")
        _require_tokens(run.lim_files, "limiter_files")
    except ValueError as exc:
        await trio.lowlevel.checkpoint()
        run.fail(exc)
        return
    async with run.lim_entries:
        await _guarded(run, fn, *args)


def _prepare(run: _Run, flat: list[FlatEntry]) -> None:
    """One hop: create every directory the entries need (declared dirs get u+rwx until the end)."""
    want: dict[str, int] = {}
    for fe in flat:
        parts = fe.path.split("/")
        for i in range(1, len(parts)):
            want.setdefault("/".join(parts[:i]), 0o755)
        if isinstance(fe.entry, Dir):
            want[fe.path] = (0o755 if fe.entry.mode is None else fe.entry.mode) | 0o700
        elif isinstance(fe.entry, Mount):
            want[fe.path] = 0o755  # the placeholder the overlay serves the grant at
    run.reserve(0, len(want), ".")
    for path in sorted(want, key=lambda p: p.count("/")):
        run.check_stop()
        try:
            run.ensure_dir(path, want[path])
        except BaseException as exc:
            raise _wrap(exc, path) from None


def _finish_dirs(run: _Run, flat: list[FlatEntry]) -> None:
    """One hop: declared dirs get their final mode, deepest first."""
    dirs = [fe for fe in flat if isinstance(fe.entry, Dir)]
    for fe in sorted(dirs, key=lambda f: f.path.count("/"), reverse=True):
        mode = 0o755 if fe.entry.mode is None else fe.entry.mode
        try:
            run.ws.set_dir_meta(fe.path, mode=mode)  # through the directory's fd, never by name
        except BaseException as exc:
            raise _wrap(exc, fe.path) from None
    run.add("dirs", [fe.path for fe in dirs])


async def materialize(workspace: Root, manifest: Manifest, options: MaterializeOptions, *,
                      only_ephemeral: bool = False) -> MaterializationResult:
    """Apply ``manifest`` to ``workspace``.

    Args:
        workspace: the workspace Root (writable).  It is used through a view
            that refuses every symlink; the caller still owns and closes it.
            With ``workspace.owner`` set, every entry made (files, directories,
            symlinks, archive members and the extractor's staging directory)
            is given that owner through its own fd (see
            :class:`~sandbox_fs.root.Root`); existing directories keep theirs.
        manifest: a validated :class:`~sandbox_fs.manifest.Manifest` (from
            :func:`~sandbox_fs.manifest.load_manifest`).  Its ``root``,
            ``base_dir`` and ``extra_path_grants`` are never used.
        options: the application's :class:`MaterializeOptions`.
        only_ephemeral: apply only the ephemeral entries (and what they
            need), e.g. on session start after hydrating a snapshot.  Mount
            placeholders are made either way.

    Returns:
        The :class:`MaterializationResult` (files sorted by sandbox path).

    Raises:
        SourceRefusedError: a source is a FIFO/socket/device, a local_dir
            holds an escaping symlink (policy ``refuse``), or no base / grant
            covers a ``src``.
        SourceChangedError: a source changed during the copy (retryable).
        SymlinkRefusedError: a ``local_file`` src ends in a symlink, or a
            symlink was met in a local_dir source path.
        PathEscapeError: a ``src`` resolves outside the base or grant.
        MaterializeLimitError: ``max_file_bytes``, ``max_total_bytes`` or
            ``max_files`` exceeded.
        MaterializeError: any other OS error, with the sandbox path.
        ManifestError: an archive entry names an unknown limit.
        sandbox_fs.archive errors: an archive entry is refused by the extractor.
        ReadOnlyError: ``workspace`` is read-only.
        MountNeedsOverlayError: the manifest holds a ``mount`` entry and
            ``options.overlay`` is False (nothing written).
        ManifestTrustError: a mount entry names a grant the application did
            not give, or asks read-write access to a read-only grant
            (:func:`plan_mounts`; nothing written).
        LimiterTokensError: ``limiter_entries`` or ``limiter_files`` holds
            fewer than 1 token now (its ``total_tokens`` was lowered after
            the options were made); checked before each entry takes them.
        Every error carries ``context["written"]`` / ``["written_count"]``.

    Cancellation:
        A checkpoint.  On cancel, worker threads stop at their next file
        boundary (each running thread first finishes the group of at most
        64 files it has taken, so the cancel may wait that long); files
        already written stay,
        complete (atomic writes: no partial file, no temp file left).  The
        workspace may then hold a subset of the manifest; applying it again
        repairs it.
    """
    await trio.lowlevel.checkpoint()
    if not isinstance(manifest, Manifest):
        raise TypeError("manifest must be a Manifest (use load_manifest)")
    started = time.monotonic()
    # Mount placeholders are never persisted, so they are made after a restore too.
    flat = [fe for fe in manifest.iter_entries()
            if fe.ephemeral or not only_ephemeral or isinstance(fe.entry, Mount)]
    lim_e = _require_tokens(options.limiter_entries or trio.CapacityLimiter(8), "limiter_entries")
    lim_f = _require_tokens(options.limiter_files or trio.CapacityLimiter(max(2, os.cpu_count() or 2)),
                            "limiter_files")
    if lim_e is lim_f:
        raise ValueError("limiter_entries and limiter_files must be different limiters")
    ws = workspace.with_options(no_symlinks=True)
    run = _Run(ws, options, lim_e, lim_f)
    try:
        try:
            run.result.mounts = plan_mounts(manifest, options.extra_path_grants, overlay=options.overlay)  # before anything is written
            await trio.to_thread.run_sync(_prepare, run, flat, limiter=lim_f)
            simple = [fe for fe in flat if isinstance(fe.entry, (File, Symlink, LocalFile))]
            with trio.CancelScope() as scope:
                run.cancel_scope = scope
                async with trio.open_nursery() as nursery:
                    for i in range(0, len(simple), 64):
                        nursery.start_soon(_entry_task, run, trio.to_thread.run_sync, _apply_simple, run,
                                           simple[i:i + 64])
                    for fe in flat:
                        if isinstance(fe.entry, LocalDir):
                            nursery.start_soon(_entry_task, run, _apply_local_dir, run, fe)
                        elif isinstance(fe.entry, Archive):
                            nursery.start_soon(_entry_task, run, _apply_archive, run, fe)
            if run.error is None:
                await trio.to_thread.run_sync(_finish_dirs, run, flat,
                                              limiter=_require_tokens(lim_f, "limiter_files"))
        except (_Stopped, Exception) as exc:
            if not isinstance(exc, _Stopped):
                run.fail(exc)
        if run.error is not None:
            raise _with_written(_wrap(run.error, "."), run.result) from None
    finally:
        run.stop.set()
        run.sources.close()
        ws.close()
    res = run.result
    res.files.sort(key=lambda f: f.sandbox_path)
    res.symlinks.sort(key=lambda s: s.sandbox_path)
    res.dirs = sorted(set(res.dirs))
    res.elapsed_s = time.monotonic() - started
    return res


def _with_written(exc: BaseException, result: MaterializationResult) -> BaseException:
    written = sorted(f.sandbox_path for f in result.files) + sorted(s.sandbox_path for s in result.symlinks)
    if isinstance(exc, SandboxError):
        exc.context["written"] = written[:_WRITTEN_SHOWN]
        exc.context["written_count"] = len(written)
    return exc
