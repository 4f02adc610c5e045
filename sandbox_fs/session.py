"""Sandbox sessions under trio: one workspace, its lifecycle, file operations, commands and hooks.

A :class:`Session` is made by :class:`sandbox_fs.client.LocalSandboxClient`
(``create`` / ``resume``) and started by ``async with``::

    async with client.create(manifest=m) as session:
        await session.write("notes.txt", b"hi")

Lifecycle:

* :meth:`Session.start` opens the workspace Root and fills it: it reattaches
  when the live workspace matches the snapshot's fingerprint, else clears the
  workspace *contents* (never the root directory, never a mount point) and
  hydrates the snapshot; with no snapshot it applies the manifest.  Ephemeral
  manifest entries are re-applied on every start.  A failure part-way removes
  what start created and raises that one error.
* :meth:`Session.stop`: persistence only (transient cleanups, then persist).
* :meth:`Session.shutdown`: ends processes and mounts.
* :meth:`Session.aclose` (``__aexit__``): pre-stop hooks once, shutdown,
  stop, close.  The confined commands (and time) are hostile, so the
  stop-time persist runs only once nothing can change the workspace any
  more: every PTY and supervised process is killed and reaped, the shutdown
  hooks ran and the overlay daemon is gone.  Shutdown always runs.  One
  failing step re-raises its error; several raise an ``ExceptionGroup`` in
  step order.  A pre-stop hook or a shutdown step that fails (or a pre-stop
  hook that is cancelled) disables persistence for the session
  (:class:`PersistDisabledError`).

Binding: every session has a *workspace id* (128 random bits, hex) kept at
the workspace's top as ``.sfs-workspace-id`` (never persisted, never
fingerprinted) and in its serialized state, and the *generation* of the
snapshot it last persisted, restored or matched.  A resumed session refuses,
before anything in the workspace changes, a workspace holding another id
(:class:`WorkspaceMismatchError`) and a snapshot at another generation than
its state recorded (:class:`SnapshotGenerationError`, unless
``allow_rollback``), or the same generation with other stored metadata than
the digest its state recorded (:class:`SnapshotDigestMismatchError`: metadata
and data replaced together in the store); a restore then reads exactly the
generation whose metadata has that digest.  A state that recorded no digest
(written before states carried one, or by a store that records none) is bound
the same way to the generation it recorded and to the metadata digest the
check read: its restore is of that generation, never of whatever another
writer made current since.  A workspace holding no id is bound to nothing: a
resumed version-2 state reattaches it only when it matches the state's
snapshot (else the snapshot is restored over it), and refuses it when there
is no snapshot to match (it could be any session's tree); then it is given
the session's id.  A confined command can
remove or rewrite its own workspace's id, which only makes that workspace be
refused or rebuilt; it cannot claim another session's random id.

The FUSE overlay (``SessionConfig.overlay``, extra ``sandbox-fs[fuse]``):
:meth:`Session.start` hydrates and applies the manifest in the backing
workspace directly (nothing is mounted yet, so nothing is cached), then
starts the overlay daemon on it (:class:`sandbox_fs.fuse.Overlay`).  While
it runs the workspace is exclusive to it: every host-side session operation
(read, write, ls, stat, mkdir, rm, rename, extract) acts through the mount's
Root, so quotas count it, audit records it and the kernel's caches stay
right; commands run in a private root on the mount.  Persist reads the backing workspace directly.
:meth:`Session.shutdown` stops it (also after a cancel, or after the daemon
died); :meth:`Session.aclose` persists only after that, when no request of
the daemon (nor a write-back of pages a command dirtied through the mount)
can still reach the backing workspace.

Blocking filesystem work runs in worker threads, one hop per whole
operation (a start, a persist, one file operation), never one per file.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import posixpath
import re
import secrets
import stat as _stat
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Iterator, Literal, Sequence

import trio

from .errors import InvalidPathError, SandboxError
from .paths import Grant, PathPolicy, normalize
from .root import DirEntry, Root, fd_chown, open_root
from . import snapshot as _snap

if TYPE_CHECKING:  # the overlay is optional (extra sandbox-fs[fuse]): imported only when a session uses it
    from .fuse import AuditEvent, FaultRule, Overlay, OverlayPolicy

__all__ = [
    "Session",
    "SessionConfig",
    "SessionError",
    "SessionBusyError",
    "SessionNotStartedError",
    "MountOverlapError",
    "CrossRootError",
    "FeatureUnavailableError",
    "WorkspaceMismatchError",
    "SnapshotGenerationError",
    "SnapshotDigestMismatchError",
    "PersistDisabledError",
    "WORKSPACE_ID_NAME",
]

WORKSPACE_ID_NAME = _snap.WORKSPACE_ID_NAME
_WORKSPACE_ID = re.compile(r"[0-9a-f]{32}")

DEFAULT_MAX_READ_BYTES = 64 << 20


class SessionError(SandboxError):
    """Base of session refusals."""

    code = "session_error"


class SessionBusyError(SessionError):
    """The session is already bound to another run (one run at a time).

    Raised by :meth:`Session.bind_run` and :func:`sandbox_fs.client.open_session`;
    ``context["session"]`` names the session.  Retry once the other run ends.
    """

    code = "session_busy"
    retryable = True


class SessionNotStartedError(SessionError):
    """A file operation on a session that is not started, or already closed.

    Raised by :attr:`Session.workspace`, :attr:`Session.policy`, every file
    operation, :meth:`Session.exec` and :meth:`Session.pty_exec_start`.
    """

    code = "session_not_started"


class MountOverlapError(SessionError):
    """A persist skip path equals, contains or lies inside a mount point; or a mount's grant overlaps the workspace.

    Raised by :meth:`Session.register_persist_skip_path`; ``context["mount"]``
    is the mount point's workspace-relative path.  Raised by
    :meth:`Session.start` (with the overlay) when a manifest ``mount``
    entry's grant directory is the workspace, lies inside it or contains it
    (compared by directory identity; ``context["overlap"]`` is ``"same"``,
    ``"inside"`` or ``"contains"``), or when the grant directories of two
    mount entries overlap in the same way (``context["other"]`` names the
    other entry: a read-only one inside a writable one would be writable
    through it), before the overlay starts.
    """

    code = "mount_overlap"


class CrossRootError(SessionError):
    """A rename between the workspace and a grant (or two grants): not one filesystem capability.

    Raised by :meth:`Session.rename`; copy the file and remove the source instead.
    """

    code = "cross_root"


class FeatureUnavailableError(SessionError):
    """A session feature needs a module that is not installed (archive, manifest, exec).

    Raised by :meth:`Session.start` (a manifest without
    :mod:`sandbox_fs.materialize`) and :meth:`Session.extract` (no
    :mod:`sandbox_fs.archive`).
    """

    code = "feature_unavailable"


class WorkspaceMismatchError(SessionError):
    """The workspace a resume would act on holds another session's id (or an unreadable one); nothing changed.

    Raised by :meth:`Session.start` of a resumed session, before anything in
    the workspace changes; ``sandbox_path`` is the id file
    (:data:`WORKSPACE_ID_NAME`) and ``context["session"]`` the session id.
    """

    code = "workspace_mismatch"


class SnapshotGenerationError(SessionError):
    """The store's snapshot is at another generation than the resumed state recorded; nothing changed.

    ``context``: ``snapshot``, ``state_generation`` and ``store_generation``.
    Pass ``allow_rollback=True`` to resume anyway.
    """

    code = "snapshot_generation_mismatch"


class SnapshotDigestMismatchError(SnapshotGenerationError):
    """The store's snapshot metadata is not the one the resumed state recorded (same generation); nothing changed.

    The state's MAC covers the SHA-256 of the snapshot's stored metadata
    (:attr:`~sandbox_fs.snapshot.SnapshotInfo.digest`), which names the
    archive's digest (BLAKE3; SHA-256 in older generations): a store that replaced both is refused.  ``context``:
    ``snapshot`` and ``generation``.  ``allow_rollback=True`` resumes anyway.
    """

    code = "snapshot_digest_mismatch"


class PersistDisabledError(SessionError):
    """Persistence is disabled because a pre-stop hook failed or was cancelled (see :meth:`Session.aclose`).

    Raised by every :meth:`Session.stop` after that; ``context["session"]``
    names the session and the reason says which step failed.
    """

    code = "persist_disabled"


@dataclass
class SessionConfig:
    """Everything a session is allowed to do, derived by the client from trusted options.

    Never built from serialized state: the workspace location, its ownership
    and the grants come from the client's options only.

    Attributes:
        session_id: plain token naming the session (and its snapshot).
        workspace_dir: trusted host directory of the workspace.
        owned: True when the client created the workspace (``delete`` may remove it).
        parent: for owned workspaces, a Root on the client's workspaces
            directory (the workspace is created and removed through it).
        store: the snapshot store.
        grants: extra path grants (from client options).
        workspace_path: absolute sandbox location of the workspace.
        base_dir: trusted base directory for manifest host sources.
        limits: snapshot limits (persist and hydrate).
        archive_limits: limits object handed to the archive extractor (or None for its default).
        on_unrestorable: ``"refuse"`` or ``"skip"`` at persist time.
        max_read_bytes: default bound of :meth:`Session.read`, in bytes.
        hook_timeout_s: longest a pre-stop hook may run, in seconds.
        max_ptys: most PTYs alive at once (the oldest idle one is pruned first).
        materialize: ``async (root, manifest, options, only_ephemeral) -> result``
            (default: :func:`sandbox_fs.materialize.materialize`).
        identity: who confined commands run as: ``"auto"`` (on a root host
            one uid/gid leased at :meth:`Session.start` for the life of the
            session and given back at close; see
            :mod:`sandbox_fs.exec._identity`), ``"host"`` or an explicit
            ``(uid, gid)`` (see ``ConfinementPolicy.identity``).
        identity_range: ``(base, count)`` the ``"auto"`` lease is taken
            from (None: the documented default range).
        confinement: the default ``confinement`` of the session's commands
            (an :meth:`Session.exec` keyword wins), and what an overlay that
            cannot run means: ``"required"`` refuses
            (:class:`~sandbox_fs.fuse.OverlayUnavailableError`),
            ``"best_effort"`` / ``"none"`` run without it (see
            :attr:`Session.overlay_active`).
        overlay: serve the workspace through the FUSE overlay
            (:mod:`sandbox_fs.fuse`, extra ``sandbox-fs[fuse]``) while the
            session is started: confined commands and every host-side session
            operation then act through the mount (quotas, audit events, fault
            rules, a private root for commands).
        overlay_policy: the overlay's :class:`~sandbox_fs.fuse.OverlayPolicy`
            (quotas, allowed special files, audit buffer, cache timeouts);
            None for its defaults.  Ignored without ``overlay``.
    """

    session_id: str
    workspace_dir: str
    owned: bool
    parent: Root | None
    store: Any
    grants: tuple[Grant, ...] = ()
    workspace_path: str = "/workspace"
    base_dir: str | None = None
    limits: _snap.SnapshotLimits = field(default_factory=_snap.SnapshotLimits)
    archive_limits: Any = None
    on_unrestorable: Literal["refuse", "skip"] = "refuse"
    max_read_bytes: int = DEFAULT_MAX_READ_BYTES
    hook_timeout_s: float = 30.0
    materialize: Callable[..., Awaitable[Any]] | None = None
    max_ptys: int = 8
    identity: Literal["auto", "host"] | tuple[int, int] = "auto"
    identity_range: tuple[int, int] | None = None
    confinement: Literal["required", "best_effort", "none"] = "required"
    overlay: bool = False
    overlay_policy: OverlayPolicy | None = None


def _materialize_default() -> Callable[..., Awaitable[Any]] | None:
    try:
        from .materialize import materialize  # noqa: PLC0415
    except ImportError:
        return None
    return materialize


def _materialize_options(cfg: SessionConfig, *, overlay: bool = False) -> Any:
    try:
        from .materialize import MaterializeOptions  # noqa: PLC0415
    except ImportError:
        return {"base_dir": cfg.base_dir, "extra_path_grants": list(cfg.grants)}
    return MaterializeOptions(base_dir=cfg.base_dir, extra_path_grants=list(cfg.grants), overlay=overlay)


def _overlay_blocker() -> str | None:
    """Why the overlay cannot run on this host or build (None: it can); a cheap probe, cached."""
    from ._features import fuse_status  # noqa: PLC0415

    usable, reason = fuse_status()
    return None if usable else (reason or "FUSE is not usable here")


class Session:
    """One workspace and its lifecycle.  Build through the client, not directly.

    Attributes:
        id: the session id (plain token).
        start_mode: after :meth:`start`: ``"materialized"`` (full manifest
            applied), ``"restored"`` (hydrated from a snapshot),
            ``"reattached"`` (live workspace matched the snapshot or was
            resumed without one) or ``None`` before.
        fingerprint: fingerprint of the last snapshot persisted or matched.
        snapshot_name: name of the snapshot to restore from / last persisted.
        workspace_root_ready: the workspace directory exists and was filled.
        workspace_id: 32 hex digits binding the session's state to its workspace.
        generation: generation of the snapshot last persisted, restored or
            matched (None: none yet; 0: a snapshot from before generations).
        snapshot_digest: :attr:`~sandbox_fs.snapshot.SnapshotInfo.digest` of that
            snapshot's stored metadata (None: none yet, or a store that sets none).

    Thread-safety: use one Session from one trio run.
    """

    def __init__(self, config: SessionConfig, *, manifest: Any = None, restore_from: str | None = None,
                 require_snapshot: bool = False, fingerprint: str | None = None,
                 resumed: bool = False, workspace_id: str | None = None, generation: int | None = None,
                 bound: bool = False, allow_rollback: bool = False, snapshot_digest: str | None = None) -> None:
        self.config = config
        self.id = config.session_id
        self.manifest = manifest
        self.snapshot_name = restore_from
        self._require_snapshot = require_snapshot
        self.fingerprint = fingerprint
        self._resumed = resumed
        # A fresh session gets a new id; a resumed one its state's (version 1 states have none: a new one).
        self.workspace_id = workspace_id or secrets.token_hex(16)
        self.generation = generation
        self.snapshot_digest = snapshot_digest
        self._bound = bound  # the state recorded a workspace id and a generation (version 2)
        self._unbound_workspace = False  # a resumed session's existing workspace held no id file (see start)
        self._allow_rollback = allow_rollback
        self._persist_disabled: str | None = None
        self.workspace_root_ready = False
        self.start_mode: str | None = None
        self._root: Root | None = None
        self._policy: PathPolicy | None = None
        self._started = False
        self._closed = False
        self._shut_down = False
        self._pre_stop_done = False
        self._pre_stop_hooks: list[Callable[["Session"], Awaitable[None]]] = []
        self._transient_cleanups: list[Callable[["Session"], Awaitable[None]]] = []
        self._shutdown_hooks: list[Callable[["Session"], Awaitable[None]]] = []
        self._skip_paths: set[str] = set()
        self._mounts: set[str] = set()
        self._supervisor: Any = None
        self._own_supervisor = False
        self._pty_manager: Any = None
        self._bound_run: str | None = None
        self._lease: Any = None
        self._overlay: Overlay | None = None  # the running FUSE overlay (SessionConfig.overlay)
        self._direct_policy: PathPolicy | None = None  # the policy on the backing workspace while it runs
        self._overlay_reason: str | None = None  # why an asked-for overlay is not running (best_effort)
        self.last_persist: _snap.PersistReport | None = None
        self.close_errors: list[Exception] = []  # the errors of the last aclose's steps

    def __repr__(self) -> str:
        return f"<Session {self.id} {'owned' if self.config.owned else 'caller-owned'} mode={self.start_mode}>"

    # ------------------------------------------------------------ properties

    @property
    def owned(self) -> bool:
        """True when the client created the workspace and may delete it."""
        return self.config.owned

    @property
    def started(self) -> bool:
        """True once :meth:`start` succeeded (stays True after close)."""
        return self._started

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` ran."""
        return self._closed

    @property
    def workspace(self) -> Root:
        """The workspace Root (guarded by read-only grants nested in it).

        Raises:
            SessionNotStartedError: before :meth:`start` or after :meth:`aclose`.
        """
        return self.policy.workspace

    @property
    def policy(self) -> PathPolicy:
        """The session's PathPolicy: the workspace and the client's grants.

        Raises:
            SessionNotStartedError: before :meth:`start` or after :meth:`aclose`.
        """
        if self._policy is None or self._closed:
            raise SessionNotStartedError("the session is not started", sandbox_path=None)
        return self._policy

    @property
    def identity(self) -> tuple[int, int] | None:
        """``(uid, gid)`` the session's confined commands run as (None: the host's own ids).

        On a root host with ``SessionConfig.identity="auto"`` this is the id
        leased at :meth:`start`, held until :meth:`aclose`.
        """
        ident = self.config.identity
        if self._lease is not None:
            leased: tuple[int, int] = self._lease.ids
            return leased
        if isinstance(ident, tuple):
            return ident
        return None

    def _exec_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The session's defaults for a command: its ``confinement``, and its identity where the policy says ``"auto"``."""
        from . import exec as _exec  # noqa: PLC0415

        kwargs.setdefault("confinement", self.config.confinement)
        policy = kwargs.get("policy") or _exec.ConfinementPolicy()
        if policy.identity == "auto" and kwargs["confinement"] != "none":
            ident = self._lease.ids if self._lease is not None else self.config.identity
            if ident != "auto":  # "auto" left: a non-root host, where it means the host's ids
                kwargs["policy"] = dataclasses.replace(policy, identity=ident)
        return kwargs

    def _manifest_digest(self) -> str:
        if self.manifest is None:
            return ""
        return str(self.manifest.digest())

    def _ephemeral_paths(self) -> list[str]:
        if self.manifest is None or not hasattr(self.manifest, "ephemeral_paths"):
            return []
        return [str(p) for p in self.manifest.ephemeral_paths()]

    def _excluded(self) -> list[str]:
        out = []
        for p in [*self._ephemeral_paths(), *self._skip_paths]:
            rel = self._relative(p)
            if rel:
                out.append(rel)
        return out

    def _relative(self, path: str) -> str:
        """A sandbox path as a workspace-relative path ('' for the root)."""
        sp = normalize(path, allow_absolute=True)
        if not sp.is_absolute:
            return str(sp)
        base = posixpath.normpath(self.config.workspace_path)
        if sp == base:
            return ""
        if sp.startswith(base.rstrip("/") + "/"):
            return sp[len(base):].lstrip("/")
        raise InvalidPathError("path is not under the workspace", sandbox_path=str(sp))

    def _grant_ids(self) -> frozenset[tuple[int, int]]:
        if self._policy is None:
            return frozenset()
        return frozenset(p.identity for p in self._policy._grants)

    # ------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> "Session":
        """:meth:`start` the session.

        Raises:
            See :meth:`start`.
        """
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> "Session":
        """Open (create) the workspace and fill it: reattach, restore or materialize.

        Returns:
            self.

        Raises:
            SnapshotNotFoundError: a seed snapshot was named and does not exist.
            SnapshotCorruptError: the snapshot to restore fails verification.
            WorkspaceMismatchError: resumed onto a workspace holding another
                session's id, or an id file that is not one (nothing changed).
            SnapshotGenerationError: resumed from a state that recorded
                another snapshot generation than the store's current one, without
                ``allow_rollback`` (nothing changed).
            SessionError: the session was already started or closed.
            SnapshotStoreError: the store's directory is the workspace or a grant's, or lies
                inside one (not retryable; refused before the workspace is filled, or for a
                grant before any command can run).
            OverlayUnavailableError: ``SessionConfig.overlay`` with
                ``confinement="required"`` and the overlay cannot run here (no
                ``/dev/fuse``, no pyfuse3, no privilege to mount); raised
                before the workspace is touched when the probe of
                ``features()["fuse"]`` tells, else after start's cleanup.  With
                ``"best_effort"`` or ``"none"`` the session starts without it
                (:attr:`overlay_active` is False; :meth:`describe` says why).
            OverlayError: the overlay daemon failed while starting.
            SandboxError / OSError: from hydrate or materialize; everything
                start created (the owned workspace directory, open Roots) is
                removed first.

        With ``SessionConfig.overlay``: the snapshot is hydrated and the
        manifest applied in the backing workspace directly (bounded by the
        materialize limits, not by the overlay's quotas), then the overlay
        daemon is started on it and measures its usage; from then on every
        change goes through the mount.  A workspace already over a quota at
        mount starts; writes through the mount fail until it shrinks.

        Cancellation:
            A cancel during start cleans up like a failure (shielded: the
            overlay daemon is stopped, its fds closed) and re-raises
            ``trio.Cancelled``; a caller-owned workspace may be left partly
            filled.
        """
        if self._started or self._closed:
            await trio.lowlevel.checkpoint()
            raise SessionError("start: the session was already started or closed", sandbox_path=None)
        created = [False]
        try:
            mounts: list[Any] = []
            if self.config.overlay:  # refused before anything is touched: an overlay that cannot run, bad mounts
                self._overlay_unavailable(await trio.to_thread.run_sync(_overlay_blocker))
                mounts = self._plan_mounts(overlay=self._overlay_reason is None)
            mode = await trio.to_thread.run_sync(self._prepare_sync, created)
            assert self._policy is not None  # set by _prepare_sync
            overlay = self.config.overlay and self._overlay_reason is None
            if self.manifest is not None:
                mat = self.config.materialize or _materialize_default()
                if mat is None:
                    raise FeatureUnavailableError("a manifest needs sandbox_fs.materialize, which is not installed",
                                                  sandbox_path=None)
                await mat(self._policy.workspace, self.manifest, _materialize_options(self.config, overlay=overlay),
                          only_ephemeral=(mode != "materialized"))
            else:
                await trio.lowlevel.checkpoint()
            if overlay:
                # Mounted once the backing workspace is filled (hydrate, then the manifest): nothing
                # is in the kernel's cache yet, the daemon measures the quota usage at mount, and a
                # manifest means the same with or without the overlay.  Through the mount each file
                # costs ~6 daemon requests (a 290-file manifest took 0.35 s more, measured).
                await self._mount_overlay(mounts)
            if self.config.store is not None:  # nor in a grant (read-only ones too: its key would be read),
                # checked before any command can run (after the mount checks, which say more)
                await trio.to_thread.run_sync(self._refuse_store_in_grants)
            self.start_mode = mode
            self.workspace_root_ready = True
            self._started = True
            return self
        except BaseException:
            with trio.CancelScope(shield=True):  # bounded: the overlay's close ends in SIGKILL
                with contextlib.suppress(Exception):
                    await self._close_overlay()
                with contextlib.suppress(Exception):
                    await trio.to_thread.run_sync(self._undo_start, created[0])
            raise

    def _prepare_sync(self, created: list[bool]) -> str:
        cfg = self.config
        if cfg.owned:
            assert cfg.parent is not None
            try:
                cfg.parent.mkdir(self.id, 0o700)
                created[0] = True
            except FileExistsError:
                if not self._resumed:
                    raise
            self._root = cfg.parent.open_root(self.id)
        else:
            self._root = open_root(cfg.workspace_dir, label="")
        self._lease_identity(self._root, created[0])
        if self.identity is not None:
            # What the library creates in the workspace (materialize, hydrate,
            # session writes) is the confined identity's from the start.
            base = self._root
            self._root = base.with_options(owner=self.identity)
            base.close()
        if cfg.store is not None:  # before the command, the manifest or a restore can reach it
            _snap.refuse_store_in_workspace(self._root, cfg.store)
        if self._resumed and not created[0]:
            self._unbound_workspace = self._check_workspace_id()  # before anything in the workspace changes
        self._policy = PathPolicy(self._root, cfg.workspace_path, cfg.grants)
        mode = self._fill_sync(created)
        self._root.atomic_write(WORKSPACE_ID_NAME, (self.workspace_id + "\n").encode(), mode=0o644)
        return mode

    def _lease_identity(self, ws: Root, created: bool) -> None:
        """Lease the session's id (``identity="auto"`` on a root host), preferring the one its workspace is owned by.

        A resumed session whose workspace root is owned by an id of the range
        takes that id again when it is free (:func:`sandbox_fs.exec._identity.lease`
        checks it as any other: exclusive, in range, in no user database or
        process table), so its next command re-owns nothing and no file's
        ctime changes: the next persist stays a small layer.  A workspace
        made here is given to the identity at once (its first command would
        do so), so the hint holds even for a session that ran no command.

        Raises:
            SessionError: no id can be leased.
        """
        cfg = self.config
        if cfg.identity != "auto" or os.geteuid() != 0 or self._lease is not None:
            return
        from .exec import _identity  # noqa: PLC0415

        owner = ws.stat(".").st_uid  # the workspace's fd: the owner is a hint only (see lease)
        try:
            self._lease = _identity.lease(*(cfg.identity_range or (_identity.DEFAULT_ID_BASE,
                                                                    _identity.DEFAULT_ID_COUNT)), prefer=owner)
        except (OSError, ValueError) as exc:
            raise SessionError("no unprivileged identity could be leased for the session",
                               sandbox_path=None, diagnostic=str(exc)) from None
        if created:
            top = ws.open_fd(".", os.O_PATH | os.O_DIRECTORY)
            try:
                fd_chown(top, self._lease.ids)
            finally:
                os.close(top)

    def _refuse_store_in_grants(self) -> None:
        """Refuse a store directory that is a grant's or lies inside one (see :func:`refuse_store_in_workspace`)."""
        assert self._policy is not None
        for _grant, view in self._policy.grant_views():
            with view:
                _snap.refuse_store_in_workspace(view, self.config.store, what="a grant")

    def _check_workspace_id(self) -> bool:
        """Refuse a workspace bound to another session (see the module docstring); True when it holds no id.

        The id file is opened beneath the workspace without following a
        symlink, must be a regular file of at most 64 bytes holding 32 hex
        digits, and must equal this session's id; a version-1 state (no id
        recorded) may act only on a workspace that holds none.

        Returns:
            True when the workspace holds no id file (it is bound to nothing:
            see :meth:`_fill_sync` for what such a workspace may be used for).

        Raises:
            WorkspaceMismatchError: another id, or an id file that is not one.
        """
        assert self._root is not None
        try:
            fd = self._root.open_fd(WORKSPACE_ID_NAME, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY,
                                    follow_symlinks=False)
        except FileNotFoundError:
            return True
        except (OSError, SandboxError):
            fd = -1
        raw = b""
        if fd >= 0:
            try:
                if _stat.S_ISREG(os.fstat(fd).st_mode):
                    raw = os.read(fd, 65)
            finally:
                os.close(fd)
        held = raw.strip().decode("ascii", "replace")
        ctx = {"session": self.id}
        if not _WORKSPACE_ID.fullmatch(held):
            raise WorkspaceMismatchError("the workspace's id file is not a workspace id; nothing was changed "
                                         "(remove the workspace to rebuild it from its snapshot)",
                                         sandbox_path=WORKSPACE_ID_NAME, context=ctx)
        if not self._bound:
            raise WorkspaceMismatchError("this session state (version 1) records no workspace id but the workspace "
                                         "is bound to a session; resume from its newer state. Nothing was changed",
                                         sandbox_path=WORKSPACE_ID_NAME, context=ctx)
        if held != self.workspace_id:
            raise WorkspaceMismatchError("the workspace belongs to another session (its id differs from the "
                                         "state's); nothing was changed", sandbox_path=WORKSPACE_ID_NAME,
                                         context=ctx)
        return False

    def _check_generation(self, info: _snap.SnapshotInfo) -> None:
        """Refuse a snapshot at another generation than the resumed state recorded (unless ``allow_rollback``).

        Raises:
            SnapshotGenerationError: the generations differ.
        """
        if not (self._resumed and self._bound) or self._allow_rollback:
            return
        want = self.generation or 0
        if info.generation != want:
            newer = info.generation > want
            raise SnapshotGenerationError(
                ("the store holds a newer snapshot generation than this state recorded (a stale or replayed "
                 "state)" if newer else "the store holds an older snapshot generation than this state recorded "
                 "(the store was rolled back)") + "; nothing was changed (allow_rollback resumes anyway)",
                sandbox_path=None, context={"snapshot": info.name, "state_generation": want,
                                            "store_generation": info.generation})
        if self.snapshot_digest and info.digest != self.snapshot_digest:
            raise SnapshotDigestMismatchError(
                "the store's snapshot metadata is not the one this state recorded (replaced in the store); "
                "nothing was changed (allow_rollback resumes anyway)", sandbox_path=None,
                context={"snapshot": info.name, "generation": info.generation})

    def _expected_digest(self) -> str | None:
        """The metadata digest a restore must read: the state's, when it is checked (see :meth:`_check_generation`)."""
        if not (self._resumed and self._bound) or self._allow_rollback or not self.snapshot_digest:
            return None
        return self.snapshot_digest

    def _fill_sync(self, created: list[bool]) -> str:
        cfg = self.config
        assert self._root is not None
        name = self.snapshot_name
        info = cfg.store.info(name) if (name and cfg.store.enabled) else None
        if info is not None:
            self._check_generation(info)
        if info is None:
            if self._require_snapshot:
                raise _snap.SnapshotNotFoundError("the seed snapshot does not exist", sandbox_path=None,
                                                  context={"snapshot": name})
            if self._resumed and not created[0]:
                if self._bound and self._unbound_workspace:
                    # Nothing shows this tree is the state's: its id file is gone (a confined command
                    # can remove it) and no snapshot is there to compare it with, so it may be any
                    # other session's workspace left for this state to run in.
                    raise WorkspaceMismatchError(
                        "the workspace holds no workspace id and there is no snapshot to match it against, so "
                        "it cannot be shown to be this session's; nothing was changed (remove the workspace to "
                        "start the session afresh)", sandbox_path=WORKSPACE_ID_NAME, context={"session": self.id})
                return "reattached"  # live workspace, nothing to restore from
            return "materialized"
        ws = self._root
        if not created[0] and info.manifest_digest == self._manifest_digest():
            live = _snap.tree_digest(ws, excluded=info.excluded, mount_points=self._mounts,
                                     skip_identities=self._grant_ids(), limits=cfg.limits)
            if _snap.fingerprint(info.manifest_digest, live) == info.fingerprint:
                self.fingerprint = info.fingerprint
                self.generation = info.generation
                self.snapshot_digest = info.digest or None
                return "reattached"
        # A bound resume restores exactly the metadata _check_generation accepted: the state's
        # digest, or (a state that recorded none) the digest that check read, at its generation;
        # never whatever another writer made current between the check and the restore.
        bound = self._resumed and self._bound and not self._allow_rollback
        rep = _snap.hydrate(ws, cfg.store, info.name, limits=cfg.limits, mount_points=self._mounts,
                            keep_identities=self._grant_ids(),
                            digest=(self._expected_digest() or info.digest or None) if bound else None,
                            generation=info.generation if bound else None)
        self.fingerprint = rep.info.fingerprint
        self.generation = rep.info.generation  # the generation actually restored
        self.snapshot_digest = rep.info.digest or None
        return "restored"

    def _undo_start(self, created: bool) -> None:
        errors: list[BaseException] = []
        for close in (self._policy.close if self._policy else None,
                      self._direct_policy.close if self._direct_policy else None,
                      self._root.close if self._root else None):
            if close is not None:
                try:
                    close()
                except Exception as exc:  # pragma: no cover - close is idempotent
                    errors.append(exc)
        self._policy = None
        self._direct_policy = None
        self._root = None
        if self._lease is not None:  # processes are gone (shutdown, or start never ran one)
            self._lease.release()
            self._lease = None
        if created and self.config.parent is not None:
            self.config.parent.rmtree(self.id, missing_ok=True)

    async def stop(self) -> _snap.PersistReport | None:
        """Persistence only: run transient cleanups, then persist the snapshot.

        It does not end the session's processes: a command still running
        while it persists can change the workspace under the walk (the
        persist then fails with :class:`~sandbox_fs.snapshot.SnapshotSourceChangedError`)
        or between reads.  :meth:`aclose` calls it only after
        :meth:`shutdown`; call it by hand only while no command runs.

        Returns:
            The :class:`~sandbox_fs.snapshot.PersistReport` (``info`` is None
            with :class:`~sandbox_fs.snapshot.NoSnapshot`), or None when the
            session never started.

        Raises:
            PersistDisabledError: a pre-stop hook failed or was cancelled in
                :meth:`aclose`, or a step of :meth:`shutdown` failed:
                persistence is never attempted again for this session
                (nothing is written; the error says which step failed).
            UnrestorableEntryError, SnapshotLimitError, SnapshotSourceChangedError,
            OSError: from persist; the previous snapshot stays current.
            SnapshotVerifyError: the new archive did not read back; the store
                kept (or went back to) the previous generation, which
                :attr:`generation` then records.

        Cancellation:
            A cancel while persisting waits for the worker thread to finish
            the archive (it cannot be abandoned half-written); the previous
            snapshot stays current unless the commit already happened.
        """
        if self._persist_disabled is not None:
            await trio.lowlevel.checkpoint()
            raise PersistDisabledError(f"persistence is disabled for this session: {self._persist_disabled}",
                                       sandbox_path=None, context={"session": self.id})
        if not self._started or self._root is None:
            await trio.lowlevel.checkpoint()
            return None
        for fn in list(self._transient_cleanups):
            await fn(self)
        cfg, ws = self.config, self._root
        # The generation of our own snapshot this session last saw: a store where another writer
        # (a second machine resuming the same state) committed since is a conflict, not a new base.
        expect = self.generation if self.snapshot_name == self.id else None
        expect_digest = self.snapshot_digest if expect is not None else None
        try:
            report = await trio.to_thread.run_sync(
                lambda: _snap.persist(ws, cfg.store, self.id, manifest_digest=self._manifest_digest(),
                                      excluded=self._excluded(), mount_points=self._mounts,
                                      skip_identities=self._grant_ids(), on_unrestorable=cfg.on_unrestorable,
                                      limits=cfg.limits, expect_generation=expect, expect_digest=expect_digest))
        except _snap.SnapshotVerifyError as exc:
            if self.snapshot_name == self.id:  # the store's current generation of our snapshot, as it stands now
                current = exc.context.get("generation")
                self.generation = current if isinstance(current, int) and current > 0 else None
            raise
        self.last_persist = report
        if report.info is not None:
            self.fingerprint = report.info.fingerprint
            self.snapshot_name = report.info.name
            self.generation = report.info.generation
            self.snapshot_digest = report.info.digest or None
        return report

    async def shutdown(self) -> None:
        """Tear down processes (the attached supervisor) and mounts.  Idempotent.

        PTYs, then the supervisor's processes (each command's whole tree,
        killed and reaped), then the shutdown hooks (last registered first),
        then the FUSE overlay: its daemon is asked to stop (bounded wait, then
        SIGKILL) and every fd on the mount is closed, also when the daemon
        already died.  After it, session file operations act on the backing
        workspace directly.

        A failing step means something may still be changing the workspace
        (a process that was not killed, a host writer a hook did not stop), so
        it disables persistence for the session, like a failed pre-stop hook:
        a later :meth:`stop` raises :class:`PersistDisabledError`.

        Raises:
            Exception: from the supervisor's ``kill_all``, a shutdown hook or
                the overlay's close (every step still runs; the first error is
                re-raised).

        Cancellation:
            Runs shielded: a cancel waits for processes and mounts to go.
        """
        if self._shut_down:
            await trio.lowlevel.checkpoint()
            return
        self._shut_down = True
        errors: list[BaseException] = []
        with trio.CancelScope(shield=True):
            if self._pty_manager is not None:
                try:
                    await self._pty_manager.pty_terminate_all()
                except Exception as exc:
                    errors.append(exc)
            if self._supervisor is not None:
                try:
                    if self._own_supervisor:
                        await self._supervisor.aclose()  # kill_all, then remove its cgroup
                    else:
                        await self._supervisor.kill_all()
                except Exception as exc:
                    errors.append(exc)
            for fn in reversed(self._shutdown_hooks):
                try:
                    await fn(self)
                except Exception as exc:
                    errors.append(exc)
            try:
                await self._close_overlay()
            except Exception as exc:
                errors.append(exc)
            await trio.lowlevel.checkpoint()
        if errors:
            if self._persist_disabled is None:
                self._persist_disabled = f"shutting the session down failed ({type(errors[0]).__name__})"
            raise errors[0]

    async def aclose(self) -> None:
        """Pre-stop hooks (once) -> shutdown -> stop -> close.  Idempotent.

        The stop-time persist (:meth:`stop`) runs only after :meth:`shutdown`
        has ended everything that could still change the workspace: every PTY
        and every process of the supervisor (each command's tree, killed and
        reaped), the shutdown hooks, and the FUSE overlay daemon (the persist
        reads the backing workspace, which then has no other writer).  So a
        confined command can neither make the persist fail by changing files
        under it nor time its writes so that the snapshot holds a state the
        workspace never had.  Pre-stop hooks run first, while commands and
        the overlay still run, to bring the workspace into the state to keep.

        Shutdown always runs, even when a hook fails, and the workspace Root
        and grant Roots are always closed.

        A pre-stop hook that fails (raises, or outlives ``hook_timeout_s``)
        or is cancelled means the workspace may not be in the state the hook
        was to leave it in, and a failing shutdown step (a process not
        killed, a shutdown hook, the overlay's close) that something may
        still be changing it, so **persistence is never attempted** by this
        ``aclose`` or afterwards: the stop-time persist is skipped (the
        previous snapshot stays current) and any later :meth:`stop` raises
        :class:`PersistDisabledError`.  The remaining hooks still run after a
        failure (not after a cancel); shutdown and the closing of
        dependencies always run.

        Raises:
            Exception: the one failing step's error, or an ``ExceptionGroup``
                of every failing step's error (step order) when several fail.
            trio.Cancelled: a pre-stop hook was cancelled; it propagates once
                shutdown and closing are done (errors of those steps are then
                kept in :attr:`close_errors`).

        Cancellation:
            Pre-stop hooks run unshielded (bounded by ``hook_timeout_s``): a
            cancel delivered while one runs cancels it, which disables
            persistence as above.  Everything after them (shutdown, persist,
            close) runs shielded, so a cancel never leaves processes, mounts or
            fds behind, and never interrupts a persist; a cancel arriving then
            is delivered at the next checkpoint after.
        """
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        errors: list[Exception] = []
        cancelled: BaseException | None = None
        if not self._pre_stop_done:
            self._pre_stop_done = True
            for hook in list(self._pre_stop_hooks):
                try:
                    with trio.fail_after(self.config.hook_timeout_s):
                        await hook(self)
                except Exception as exc:
                    errors.append(exc)
                    if self._persist_disabled is None:
                        self._persist_disabled = f"a pre-stop hook failed ({type(exc).__name__})"
                except BaseException as exc:  # trio.Cancelled, KeyboardInterrupt: propagated after the close
                    cancelled = exc
                    self._persist_disabled = "a pre-stop hook was cancelled"
                    break
        with trio.CancelScope(shield=True):
            try:
                await self.shutdown()  # nothing may change the workspace once this returns cleanly
            except Exception as exc:  # shutdown disabled persistence: something may still write
                errors.append(exc)
            if self._persist_disabled is None:
                try:
                    await self.stop()
                except Exception as exc:
                    errors.append(exc)
            self._closed = True
            try:
                await trio.to_thread.run_sync(self._undo_start, False)
            except Exception as exc:  # pragma: no cover
                errors.append(exc)
        self.close_errors = errors
        if cancelled is not None:
            raise cancelled
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise ExceptionGroup(f"closing session {self.id} failed in {len(errors)} steps", errors)

    @property
    def persist_disabled(self) -> str | None:
        """Why persistence is disabled (a pre-stop hook failed or was cancelled), or None."""
        return self._persist_disabled

    # ------------------------------------------------------------- bindings

    @contextlib.contextmanager
    def bind_run(self, run_key: str) -> Iterator["Session"]:
        """Bind the session to one run for the duration of the ``with`` block.

        The guard is released on every exit, including when persistence or
        cleanup inside the block fails.

        Raises:
            SessionBusyError: the session is already bound to a run.
        """
        if self._bound_run is not None:
            raise SessionBusyError("the session is already bound to another run", sandbox_path=None,
                                   context={"session": self.id})
        self._bound_run = run_key
        try:
            yield self
        finally:
            self._bound_run = None

    @property
    def bound_run(self) -> str | None:
        """The key of the run the session is bound to (:meth:`bind_run`), or None."""
        return self._bound_run

    def register_pre_stop_hook(self, hook: Callable[["Session"], Awaitable[None]]) -> None:
        """Run ``await hook(session)`` once at the start of :meth:`aclose`, before shutdown and persist.

        Commands, PTYs and the overlay still run while it does.  If the hook
        fails or is cancelled, persistence is disabled for the session (see
        :meth:`aclose`).

        Raises:
            Nothing: it only records ``hook``.
        """
        self._pre_stop_hooks.append(hook)

    def register_transient_cleanup(self, fn: Callable[["Session"], Awaitable[None]]) -> None:
        """Run ``await fn(session)`` at every :meth:`stop`, before persisting.

        In :meth:`aclose` that is after :meth:`shutdown`: no command runs and
        session file operations act on the backing workspace directly.

        Raises:
            Nothing: it only records ``fn``.
        """
        self._transient_cleanups.append(fn)

    def register_shutdown_hook(self, fn: Callable[["Session"], Awaitable[None]]) -> None:
        """Run ``await fn(session)`` at :meth:`shutdown` (unmounts, ...), last registered first.

        It runs after the session's processes are killed and before the
        overlay stops; in :meth:`aclose`, before the stop-time persist, so a
        hook that stops a host-side writer to the workspace keeps it out of
        the snapshot.  A failing hook disables persistence (see :meth:`aclose`).

        Raises:
            Nothing: it only records ``fn``.
        """
        self._shutdown_hooks.append(fn)

    def register_mount(self, path: str) -> None:
        """Declare a mount point at sandbox path ``path``: never persisted, never cleared.

        Raises:
            InvalidPathError: ``path`` is malformed or not under the workspace.
        """
        self._mounts.add(self._relative(path))

    def register_persist_skip_path(self, path: str) -> None:
        """Leave sandbox path ``path`` (and everything under it) out of every persist.

        Raises:
            InvalidPathError: ``path`` is malformed or not under the workspace.
            MountOverlapError: ``path`` equals, contains or is inside a mount point.
        """
        rel = self._relative(path)
        if not rel:
            raise InvalidPathError("the workspace root cannot be a persist skip path", sandbox_path=path)
        for m in self._mounts:
            if rel == m or rel.startswith(m + "/") or m.startswith(rel + "/"):
                raise MountOverlapError("persist skip path overlaps a mount point", sandbox_path=path,
                                        context={"mount": m})
        self._skip_paths.add(rel)

    def attach_supervisor(self, supervisor: Any) -> None:
        """Attach a caller-owned process supervisor; :meth:`shutdown` awaits its ``kill_all()``.

        Without one, :meth:`exec` creates a :class:`sandbox_fs.exec.ProcessSupervisor`
        that the session owns and closes at shutdown.

        Raises:
            Nothing: it only records ``supervisor``.
        """
        self._supervisor = supervisor
        self._own_supervisor = False

    # ------------------------------------------------------- file operations

    def _resolve(self, path: str, for_write: bool = False) -> tuple[Root, str]:
        r = self.policy.resolve(path, for_write=for_write)
        return r.root, r.rel or "."

    async def _aresolve(self, path: str, for_write: bool = False) -> tuple[Root, str]:
        """:meth:`_resolve`, but a refusal is raised only after a checkpoint (trio's rule)."""
        try:
            return self._resolve(path, for_write)
        except BaseException:
            await trio.lowlevel.checkpoint()
            raise

    async def read(self, path: str, *, max_bytes: int | None = None) -> bytes:
        """Read a regular file, bounded.

        Args:
            path: sandbox path (relative to the workspace, or absolute under it or a grant).
            max_bytes: refuse files larger than this many bytes (default the
                session's ``max_read_bytes``).

        Raises:
            OSError(EFBIG): the file is larger than ``max_bytes``.
            PathEscapeError, InvalidPathError: ``path`` leaves the workspace and every grant.
            FileNotFoundError, IsADirectoryError: ``path`` is missing or a directory.
            SessionNotStartedError: the session is not started.

        Cancellation:
            Nothing is left behind (the read runs in a worker thread and its result is dropped).
        """
        root, rel = await self._aresolve(path)
        bound = self.config.max_read_bytes if max_bytes is None else max_bytes
        return await trio.to_thread.run_sync(lambda: root.read_bytes(rel, max_bytes=bound))

    async def read_chunks(self, path: str, *, chunk_bytes: int = 1 << 20,
                          max_bytes: int | None = None) -> AsyncIterator[bytes]:
        """Yield the file's content in chunks of at most ``chunk_bytes`` (one thread hop per chunk).

        Raises:
            OSError(EFBIG): more than ``max_bytes`` (default ``max_read_bytes``) were read.
            PathEscapeError, InvalidPathError: ``path`` leaves the workspace and every grant.
            FileNotFoundError, IsADirectoryError: ``path`` is missing or a directory.
            SessionNotStartedError: the session is not started.

        Cancellation:
            The file descriptor is closed when the generator is closed.
        """
        root, rel = await self._aresolve(path)
        bound = self.config.max_read_bytes if max_bytes is None else max_bytes
        f = await trio.to_thread.run_sync(lambda: root.open(rel, "rb", buffering=0))
        total = 0
        try:
            while True:
                chunk = await trio.to_thread.run_sync(f.read, chunk_bytes)
                if not chunk:
                    return
                total += len(chunk)
                if total > bound:
                    import errno as _errno  # noqa: PLC0415

                    raise OSError(_errno.EFBIG, "file is larger than max_bytes (read)", path)
                yield chunk
        finally:
            f.close()

    async def write(self, path: str, data: bytes, *, mode: int = 0o644, parents: bool = False) -> int:
        """Atomically replace the file at ``path`` with ``data``; returns bytes written.

        Args:
            path: sandbox path of the file.
            data: the new content (``bytes``).
            mode: permission bits of the file, within 0o777 (the umask is not applied).
            parents: create missing parent directories first (mode 0o755, as
                :meth:`mkdir` with ``parents=True`` makes them).

        Raises:
            FileNotFoundError: a parent directory is missing and ``parents`` is False.
            FileExistsError: with ``parents``, a parent name exists and is not a directory.
            IsADirectoryError: ``path`` is a directory.
            ReadOnlyError: ``path`` is under a read-only grant.
            PathEscapeError, InvalidPathError: ``path`` leaves the workspace and every grant.
            UnsafeModeError: ``mode`` outside 0o777.
            SessionNotStartedError: the session is not started.

        Cancellation:
            The write completes or leaves the old file (atomic rename); with
            ``parents``, directories already made stay.
        """
        root, rel = await self._aresolve(path, for_write=True)

        def work() -> int:
            try:
                return root.atomic_write(rel, data, mode=mode)
            except FileNotFoundError:
                parent = posixpath.dirname(rel)
                if not (parents and parent):
                    raise
            root.mkdir(parent, 0o755, parents=True, exist_ok=True)
            return root.atomic_write(rel, data, mode=mode)

        return await trio.to_thread.run_sync(work)

    async def ls(self, path: str = ".") -> list[DirEntry]:
        """List a directory (sorted, ``lstat`` of each entry; symlinks never followed).

        Raises:
            FileNotFoundError, NotADirectoryError: ``path`` is missing or not a directory.
            PathEscapeError, InvalidPathError: ``path`` leaves the workspace and every grant.
            SessionNotStartedError: the session is not started.

        Cancellation:
            Nothing is left behind.
        """
        root, rel = await self._aresolve(path)
        return await trio.to_thread.run_sync(root.scandir, rel)

    async def mkdir(self, path: str, *, mode: int = 0o755, parents: bool = False, exist_ok: bool = False) -> None:
        """Create a directory with exactly ``mode`` (see :meth:`Root.mkdir`).

        Raises:
            FileExistsError: the name exists (and is not a directory, or not ``exist_ok``).
            FileNotFoundError: a parent is missing and ``parents`` is False.
            ReadOnlyError: ``path`` is under a read-only grant.
            PathEscapeError, InvalidPathError: ``path`` leaves the workspace and every grant.
            UnsafeModeError: ``mode`` outside 0o777.
            SessionNotStartedError: the session is not started.

        Cancellation:
            With ``parents``, some parents may already exist.
        """
        root, rel = await self._aresolve(path, for_write=True)
        await trio.to_thread.run_sync(lambda: root.mkdir(rel, mode, parents=parents, exist_ok=exist_ok))

    async def rm(self, path: str, *, recursive: bool = False, missing_ok: bool = False) -> None:
        """Remove a file, a symlink or an empty directory; with ``recursive`` a whole tree.

        A recursive removal is fd-based, never follows a symlink and keeps
        mount points.  A leaf symlink is removed, never its target.

        Raises:
            OSError(ENOTEMPTY): a non-empty directory without ``recursive``.
            FileNotFoundError: missing and not ``missing_ok``.
            InvalidPathError: ``path`` is the workspace root, or malformed.
            ReadOnlyError: ``path`` is under a read-only grant.
            PathEscapeError: ``path`` leaves the workspace and every grant.
            SessionNotStartedError: the session is not started.

        Cancellation:
            A recursive removal may be partial.
        """
        root, rel = await self._aresolve(path, for_write=True)
        if rel == ".":
            await trio.lowlevel.checkpoint()
            raise InvalidPathError("rm: refusing to remove the workspace root", sandbox_path=path)

        def work() -> None:
            if recursive:
                root.rmtree(rel, missing_ok=missing_ok, skip=_snap.is_mount_point_of(root, self._mounts)
                            if root is self.policy.workspace else None)
                return
            try:
                try:
                    root.remove(rel)
                except IsADirectoryError:
                    root.rmdir(rel)  # only an empty one: ENOTEMPTY otherwise
            except FileNotFoundError:
                if not missing_ok:
                    raise

        await trio.to_thread.run_sync(work)

    async def rename(self, src: str, dst: str, *, no_replace: bool = False) -> None:
        """Rename within one root (the workspace or one grant).

        Raises:
            CrossRootError: ``src`` and ``dst`` are under different roots.
            FileExistsError: ``no_replace`` and ``dst`` exists.
            FileNotFoundError: ``src`` is missing.
            ReadOnlyError: either path is under a read-only grant.
            PathEscapeError, InvalidPathError: a path leaves the workspace and every grant.
            SessionNotStartedError: the session is not started.

        Cancellation:
            The rename happened or not (atomic).
        """
        sroot, srel = await self._aresolve(src, for_write=True)
        droot, drel = await self._aresolve(dst, for_write=True)
        if sroot is not droot:
            await trio.lowlevel.checkpoint()
            raise CrossRootError("rename across the workspace and a grant is not supported", sandbox_path=src)
        await trio.to_thread.run_sync(lambda: sroot.rename(srel, drel, no_replace=no_replace))

    async def stat(self, path: str, *, follow_symlinks: bool = False) -> os.stat_result:
        """``lstat`` (default) or ``stat`` of a sandbox path.

        Raises:
            FileNotFoundError: ``path`` is missing.
            PathEscapeError: ``path``, or with ``follow_symlinks`` a symlink, leads outside.
            InvalidPathError: ``path`` is malformed.
            SessionNotStartedError: the session is not started.

        Cancellation:
            Nothing is left behind.
        """
        root, rel = await self._aresolve(path)
        return await trio.to_thread.run_sync(lambda: root.stat(rel, follow_symlinks=follow_symlinks))

    async def extract(self, source: Any, dest: str = ".", *, format: str = "auto") -> Any:
        """Extract an archive into ``dest`` with the session's limits (:mod:`sandbox_fs.archive`).

        Args:
            source: what :func:`sandbox_fs.archive.extract_async` accepts
                (a binary file object, bytes, or an fd).
            dest: sandbox directory to extract into.
            format: ``"auto"``, ``"tar"`` or ``"zip"``.

        Returns:
            The extractor's report.

        Raises:
            FeatureUnavailableError: the archive extractor is not installed.
            ArchiveLimitError, UnsafeArchiveMemberError, ArchiveFormatError: from the extractor.
            ReadOnlyError, PathEscapeError, InvalidPathError: ``dest`` is not writable in the session.
            SessionNotStartedError: the session is not started.

        Cancellation:
            See :func:`sandbox_fs.archive.extract_async`: members already written stay.
        """
        try:
            from . import archive  # noqa: PLC0415
        except ImportError:
            archive = None  # type: ignore[assignment]  # an install without the archive package
        if archive is None or not hasattr(archive, "extract_async"):
            await trio.lowlevel.checkpoint()
            raise FeatureUnavailableError("archive extraction needs sandbox_fs.archive, which is not installed",
                                          sandbox_path=dest)
        root, rel = await self._aresolve(dest, for_write=True)
        kwargs: dict[str, Any] = {"format": format}
        if self.config.archive_limits is not None:
            kwargs["limits"] = self.config.archive_limits
        return await archive.extract_async(root, rel, source, **kwargs)

    async def exec(self, argv: Any, **kwargs: Any) -> Any:
        """Run a confined process in the workspace: a thin delegation to :func:`sandbox_fs.exec.run_confined`.

        The workspace Root, its host path (for ``HOME``/``TMPDIR`` only), the
        session's PathPolicy (grants) and the session's process supervisor
        are passed for you; every other keyword goes through unchanged.

        With the overlay running, the command gets a private root with the
        mount at ``SessionConfig.workspace_path`` (``ExecResult.overlay`` is
        True); without it, the workspace directly.  ``confinement`` defaults
        to ``SessionConfig.confinement``.

        Returns:
            :class:`sandbox_fs.exec.ExecResult`.

        Raises:
            SessionNotStartedError: the session is not started.
            OverlayUnavailableError: ``SessionConfig.overlay`` is set and the
                overlay is not running (it could not run at start) while this
                command asks ``confinement="required"``.
            OverlayError: the overlay daemon died (the mount is gone).
            ConfinementError, CommandNotFoundError, ExecTimeoutError, ExecFailedError:
                see :func:`sandbox_fs.exec.run_confined`.

        Cancellation:
            As :func:`sandbox_fs.exec.run_confined`: the command's tree is
            killed; background processes end with the command (its PID namespace).
        """
        from . import exec as _exec  # noqa: PLC0415

        try:
            kwargs = self._exec_kwargs(kwargs)
            policy = self._add_private_root(kwargs)
            workspace = policy.workspace
        except BaseException:
            await trio.lowlevel.checkpoint()
            raise
        if self._supervisor is None:
            self._supervisor = _exec.ProcessSupervisor()
            self._own_supervisor = True
        kwargs.setdefault("supervisor", self._supervisor)
        return await _exec.run_confined(argv, workspace=workspace, workspace_host_path=self.config.workspace_dir,
                                        grants=policy, **kwargs)

    # --------------------------------------------------------------- overlay

    @property
    def overlay(self) -> Overlay | None:
        """The running FUSE overlay (:class:`sandbox_fs.fuse.Overlay`), or None.

        None before :meth:`start`, after :meth:`shutdown`, without
        ``SessionConfig.overlay``, and when the overlay could not run and the
        session started without it (see :attr:`overlay_unavailable_reason`).
        Its ``root`` is the Root session file operations use; its
        ``mount_fd`` is borrowed (never close it).
        """
        return self._overlay

    @property
    def overlay_active(self) -> bool:
        """True while the session's workspace is served through the FUSE overlay."""
        return self._overlay is not None

    @property
    def overlay_unavailable_reason(self) -> str | None:
        """Why an asked-for overlay is not running (``confinement`` was not ``"required"``), or None."""
        return self._overlay_reason

    def _overlay_unavailable(self, reason: str | None) -> None:
        """Record that the overlay cannot run (``reason``; None: it can), or refuse under ``"required"``.

        Raises:
            OverlayUnavailableError: ``reason`` is set and ``SessionConfig.confinement`` is ``"required"``.
        """
        if reason is None:
            return
        if self.config.confinement == "required":
            from .fuse import OverlayUnavailableError  # noqa: PLC0415

            raise OverlayUnavailableError(f"the overlay cannot run here: {reason} (confinement='best_effort' "
                                          "runs the session without it)", sandbox_path=None)
        self._overlay_reason = reason

    def _plan_mounts(self, *, overlay: bool) -> list[Any]:
        """The manifest's ``mount`` entries, checked against the grants and registered as mount points.

        Raises:
            MountNeedsOverlayError: a mount entry, and ``overlay`` is False.
            ManifestTrustError: a mount entry names no grant, or asks a read-only one for writes.
        """
        if self.manifest is None or not hasattr(self.manifest, "mount_entries"):
            return []
        from .materialize import plan_mounts  # noqa: PLC0415

        planned = plan_mounts(self.manifest, self.config.grants, overlay=overlay)
        for m in planned:
            self._mounts.add(self._relative(m.path))  # never persisted, never cleared by a restore
        return planned

    async def _mount_overlay(self, mounts: Sequence[Any]) -> None:
        """Start the overlay on the backing workspace, serving ``mounts``; session operations then use its Root.

        ``mounts`` are the manifest's :class:`~sandbox_fs.materialize.MountRequest`
        entries: their placeholders are made in the backing workspace, and
        each grant is handed to the daemon to serve there.

        Raises:
            OverlayUnavailableError: it cannot run and confinement is ``"required"``.
            MountNeedsOverlayError: it cannot run, and the manifest has mount entries.
            MountOverlapError: a mount's grant directory is, lies inside or
                contains the workspace (checked before any placeholder is
                made or the overlay starts).
            OverlayError: the daemon failed.
        """
        from . import fuse as _fuse  # noqa: PLC0415

        assert self._root is not None and self._policy is not None
        policy = self.config.overlay_policy or _fuse.OverlayPolicy()
        grant_roots: list[Root] = []
        try:
            if mounts:
                from .materialize import make_mount_points  # noqa: PLC0415

                for m in mounts:
                    grant_roots.append(self._policy.open_grant_root(m.grant, read_only=m.read_only))
                for m, r in zip(mounts, grant_roots):
                    how = await trio.to_thread.run_sync(_fuse.mount_overlap, self._root, r)
                    if how is not None:
                        raise MountOverlapError(f"the grant of the mount entry {_fuse.overlap_text(how)}",
                                                sandbox_path=m.path, context={"mount": m.path, "overlap": how})
                await self._refuse_overlapping_mounts(mounts, grant_roots)
                await trio.to_thread.run_sync(make_mount_points, self._root, mounts)
            served = [_fuse.OverlayMount(m.path, r, m.read_only)
                      for m, r in zip(mounts, grant_roots)]
            try:
                ov = await _fuse.Overlay.start(self._root, policy=policy, mounts=served)
            except _fuse.OverlayUnavailableError as exc:
                self._overlay_unavailable(exc.reason)
                self._plan_mounts(overlay=False)  # mount entries cannot be served without it: refused
                return
        finally:
            for r in grant_roots:  # the daemon holds its own copies of the fds
                r.close()
        try:
            view = await trio.to_thread.run_sync(PathPolicy, ov.root, self.config.workspace_path, self.config.grants)
        except BaseException:
            with trio.CancelScope(shield=True):
                await ov.aclose()
            raise
        self._overlay = ov
        self._direct_policy, self._policy = self._policy, view

    async def _refuse_overlapping_mounts(self, mounts: Sequence[Any], roots: Sequence[Root]) -> None:
        """Refuse two mount entries whose grant directories are, contain or lie inside each other.

        Compared by directory identity (:func:`sandbox_fs.fuse.mount_overlap`),
        never by path: a read-only mount entry inside a writable one would
        be writable through the other.

        Raises:
            MountOverlapError: ``context["mount"]``/``["other"]`` name the two entries.
        """
        from . import fuse as _fuse  # noqa: PLC0415

        for i, (a, ra) in enumerate(zip(mounts, roots)):
            for b, rb in zip(mounts[i + 1:], roots[i + 1:]):
                how = await trio.to_thread.run_sync(_fuse.mount_overlap, ra, rb)
                if how is not None:
                    raise MountOverlapError("the grants of two mount entries overlap (one is, contains or "
                                            "lies inside the other)", sandbox_path=b.path,
                                            context={"mount": b.path, "other": a.path, "overlap": how})

    async def _close_overlay(self) -> None:
        """Stop the overlay (if running) and go back to the backing workspace's policy.  Idempotent.

        Raises:
            OverlayError: from :meth:`Overlay.aclose` (its fds are closed all the same).
        """
        ov, self._overlay = self._overlay, None
        if ov is None:
            await trio.lowlevel.checkpoint()
            return
        view, direct = self._policy, self._direct_policy
        self._policy, self._direct_policy = direct, None
        try:
            if view is not None:
                view.close()  # its grant Roots and guarded view: no fd of ours stays on the mount
        finally:
            await ov.aclose()

    def _running_overlay(self) -> Overlay:
        """The running overlay.

        Raises:
            SessionNotStartedError: the session is not started.
            OverlayUnavailableError: the session runs without the overlay.
        """
        self.policy  # noqa: B018 - raises SessionNotStartedError
        if self._overlay is None:
            from .fuse import OverlayUnavailableError  # noqa: PLC0415

            why = self._overlay_reason or ("SessionConfig.overlay is off" if not self.config.overlay
                                           else "it was shut down")
            raise OverlayUnavailableError(f"the session runs without the overlay ({why})", sandbox_path=None)
        return self._overlay

    async def _aoverlay(self) -> Overlay:
        try:
            return self._running_overlay()
        except BaseException:
            await trio.lowlevel.checkpoint()
            raise

    def _add_private_root(self, kwargs: dict[str, Any]) -> PathPolicy:
        """Give a command the overlay as its private root's workspace (or refuse it; see :meth:`exec`).

        Returns the PathPolicy the command is run with.  With the overlay it
        is the *backing* workspace's (``_direct_policy``), never the view's:
        run_confined's identity walk, nested-grant checks and Landlock act on
        that tree (through the view the walk would descend into mount
        entries, host directories, and re-own them), and the command sees
        the view only through ``PrivateRoot.workspace_fd``.  After the walk
        changed owners, ``PrivateRoot.refresh`` invalidates the view's
        attributes (never its entries: that would unmount the protected-path
        binds of the session's other runs).
        """
        policy = self.policy
        if not self.config.overlay:
            return policy
        ov = self._overlay
        if ov is None:
            if kwargs.get("confinement", self.config.confinement) == "required":
                self._running_overlay()  # raises OverlayUnavailableError with the reason
            return policy
        from . import exec as _exec  # noqa: PLC0415
        from .fuse import OverlayError  # noqa: PLC0415

        if not ov.alive:  # never run a command on the backing workspace behind the overlay's back
            raise OverlayError("the overlay daemon is gone, so the workspace cannot be reached; close the session",
                               sandbox_path=None)
        assert self._direct_policy is not None
        kwargs["private_root"] = _exec.PrivateRoot(ov.mount_fd, self.config.workspace_path,
                                                   refresh=lambda: ov.invalidate(None, attrs_only=True))
        return self._direct_policy

    async def audit_events(self) -> tuple[list[AuditEvent], int]:
        """Take the overlay's buffered audit events: ``(events, dropped)``.

        Each :class:`~sandbox_fs.fuse.AuditEvent` is ``(time_s, op, path,
        errno)`` (``path`` a workspace-relative sandbox path; ``errno`` 0 on
        success), oldest first, each returned once.  ``dropped`` counts the
        events lost since the last call because the daemon's buffer
        (``OverlayPolicy.audit_capacity``) was full.

        Raises:
            SessionNotStartedError: the session is not started.
            OverlayUnavailableError: the session runs without the overlay.
            OverlayError: the daemon died or answered out of protocol.

        Cancellation:
            Events already taken from the daemon when the cancel arrives are lost.
        """
        ov = await self._aoverlay()
        taken: tuple[list[AuditEvent], int] = await ov.audit_events()
        return taken

    async def set_faults(self, rules: Sequence[FaultRule]) -> None:
        """Replace the overlay's fault rules with ``rules`` (a sequence of :class:`~sandbox_fs.fuse.FaultRule`).

        Each rule makes the matching FUSE operations on matching sandbox
        paths fail with its errno (EIO, ENOSPC or EACCES), at most ``times``
        times.  An empty sequence clears them (see :meth:`clear_faults`).
        Host-side session operations go through the mount, so rules apply to
        them too.

        Raises:
            SessionNotStartedError, OverlayUnavailableError, OverlayError: as for :meth:`audit_events`.

        Cancellation:
            The new set may or may not be in force.
        """
        ov = await self._aoverlay()
        await ov.set_faults(list(rules))

    async def clear_faults(self) -> None:
        """Remove every fault rule (:meth:`set_faults` with none).

        Raises:
            SessionNotStartedError, OverlayUnavailableError, OverlayError: as for :meth:`audit_events`.

        Cancellation:
            The rules may or may not be cleared.
        """
        await self.set_faults([])

    async def set_quota(self, max_bytes: int | None, max_inodes: int | None) -> None:
        """Set the overlay's quotas at run time (None: unlimited).

        ``max_bytes`` bounds the apparent size of the workspace's regular
        files (a hard-linked inode counted once), ``max_inodes`` its entries.
        A write or create through the mount (a confined command's, or a host
        session operation's) that would cross a limit fails whole with
        ``OSError(EDQUOT)``; usage above a lowered limit stays until it shrinks.

        Raises:
            SessionNotStartedError, OverlayUnavailableError, OverlayError: as for :meth:`audit_events`.

        Cancellation:
            The new limits may or may not be in force.
        """
        ov = await self._aoverlay()
        await ov.set_quota(max_bytes, max_inodes)

    async def overlay_usage(self) -> dict[str, int]:
        """The overlay's quota accounting: ``{"bytes": n, "inodes": n}``.

        Raises:
            SessionNotStartedError, OverlayUnavailableError, OverlayError: as for :meth:`audit_events`.

        Cancellation:
            Nothing is left behind.
        """
        ov = await self._aoverlay()
        return dict(await ov.usage())

    # ------------------------------------------------------------------ PTYs

    def _ptys(self) -> Any:
        from . import exec as _exec  # noqa: PLC0415

        if self._supervisor is None:
            self._supervisor = _exec.ProcessSupervisor()
            self._own_supervisor = True
        if self._pty_manager is None:
            self._pty_manager = _exec.PtyManager(self._supervisor, max_live=self.config.max_ptys)
        return self._pty_manager

    async def pty_exec_start(self, argv: Any, **kwargs: Any) -> tuple[str, bytes]:
        """Start ``argv`` on a new PTY in the workspace, confined like :meth:`exec`.

        A thin delegation to :meth:`sandbox_fs.exec.PtyManager.pty_exec_start` with
        the workspace Root, its host path and the session's PathPolicy passed for
        you.  At most ``SessionConfig.max_ptys`` PTYs live at once; starting one
        more prunes the oldest idle one (exited ones first).  Every PTY is
        terminated at :meth:`shutdown`.

        Returns:
            ``(pty_id, first_output)``: an opaque id (``str``) and the bytes the
            program printed within ``first_output_timeout_s`` seconds.

        Raises:
            SessionNotStartedError: the session is not started.
            OverlayUnavailableError, OverlayError: as for :meth:`exec`.
            ConfinementError, CommandNotFoundError: see :func:`sandbox_fs.exec.run_confined`.

        Cancellation:
            A cancel before the process started leaves nothing; after, the PTY
            stays registered and is terminated at :meth:`shutdown`.
        """
        try:
            manager = self._ptys()
            kwargs = self._exec_kwargs(kwargs)
            policy = self._add_private_root(kwargs)
            workspace = policy.workspace
        except BaseException:
            await trio.lowlevel.checkpoint()
            raise
        started: tuple[str, bytes] = await manager.pty_exec_start(
            argv, workspace=workspace, workspace_host_path=self.config.workspace_dir, grants=policy, **kwargs)
        return started

    async def pty_write_stdin(self, pty_id: str, data: bytes) -> None:
        """Write ``data`` (bytes) to PTY ``pty_id``'s input.

        Raises:
            PtyNotFoundError: no live PTY has that id.

        Cancellation:
            Part of ``data`` may have been written.
        """
        await self._ptys().pty_write_stdin(pty_id, data)

    async def pty_read(self, pty_id: str, **kwargs: Any) -> bytes:
        """Read what PTY ``pty_id`` printed (bounded buffer; see :meth:`PtyManager.pty_read`).

        Raises:
            PtyNotFoundError: no live PTY has that id.

        Cancellation:
            Nothing is lost: unread output stays buffered.
        """
        output: bytes = await self._ptys().pty_read(pty_id, **kwargs)
        return output

    async def pty_terminate(self, pty_id: str) -> None:
        """Terminate PTY ``pty_id`` and its process group.

        Raises:
            PtyNotFoundError: no live PTY has that id.

        Cancellation:
            Runs to completion (the process group is killed).
        """
        await self._ptys().pty_terminate(pty_id)

    async def pty_terminate_all(self) -> None:
        """Terminate every PTY of this session.  Idempotent.

        Raises:
            Nothing: a PTY already gone is skipped.

        Cancellation:
            Runs to completion.
        """
        if self._pty_manager is None:
            await trio.lowlevel.checkpoint()
            return
        await self._pty_manager.pty_terminate_all()

    def _overlay_line(self) -> list[str]:
        """The ``overlay:`` line of :meth:`describe` (none without ``SessionConfig.overlay``)."""
        if not self.config.overlay:
            return []
        if self._overlay is not None:
            return ["overlay: on (FUSE; commands run in a private root on it)"]
        if self._overlay_reason is not None:
            return [f"overlay: off, running without it ({self._overlay_reason}; "
                    f"confinement={self.config.confinement})"]
        return ["overlay: asked, not running (the session is not started or was shut down)"]

    def describe(self) -> str:
        """A rendered tree of the manifest: one line per entry, indented by depth.

        Each line shows the entry name, its type and ``ephemeral`` when it is
        re-created on every start (and never persisted).  Secrets never appear.
        With ``SessionConfig.overlay`` a second line says whether the overlay
        runs, and if not, why.

        Raises:
            Nothing.
        """
        m = self.manifest
        if m is None:
            return "\n".join([f"session {self.id}: no manifest", *self._overlay_line()]) + "\n"
        lines = [f"session {self.id}: manifest {self._manifest_digest()[:12]}", *self._overlay_line()]
        flat = list(m.iter_entries()) if hasattr(m, "iter_entries") else []
        for fe in sorted(flat, key=lambda fe: fe.path.split("/")):
            depth = fe.path.count("/")
            name = fe.path.rsplit("/", 1)[-1]
            kind = getattr(fe.entry, "type", "entry")
            note = ", ephemeral" if fe.ephemeral else ""
            lines.append("  " * (depth + 1) + f"{name}{'/' if kind == 'dir' else ''} ({kind}{note})")
        return "\n".join(lines) + "\n"
