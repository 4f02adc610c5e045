"""The local sandbox client: create, resume and delete sessions; serialized session and run state.

Authority comes only from :class:`ClientOptions`, given by the host
application.  Serialized :class:`SessionState` carries **no authority**: the
session id, the manifest data (secrets redacted), a snapshot reference, a
readiness flag, a fingerprint, the workspace id and the snapshot generation.
On resume the workspace location (``<workspaces_dir>/<session id>``, the id
checked to be a plain token), its ownership and the extra path grants are
re-derived from the options, and the manifest is re-loaded as *untrusted*
(it cannot grant).  A state with any other field (``root``, ``grants``,
``owned`` ...) is refused.

Every state is HMAC-SHA256 protected (RFC 2104), with
``ClientOptions.state_key`` or else a per-installation key kept beside the
snapshots (or the workspaces): the session id and snapshot name select a
workspace and a snapshot, so a tampered or unsigned state is refused.

A valid MAC says this installation wrote the state, not that it belongs with
the workspace it is resumed onto, so a state (version 2) is also *bound*:
a resume onto a workspace holding another ``workspace_id`` is refused
(:class:`~sandbox_fs.session.WorkspaceMismatchError`), and so is one whose
store holds another generation of the snapshot than the state recorded
(:class:`~sandbox_fs.session.SnapshotGenerationError`, unless
``allow_rollback=True``), both before anything in the workspace changes.
Where no workspace exists, a resume rebuilds it from the snapshot, on this
machine or another.  Version-1 states (no binding) still load and resume onto
a workspace that holds no id; the next serialization writes version 2.
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Literal

import trio
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ._json import check_depth
from ._keyfile import UnsafeKeyFileError, installation_key
from .errors import SandboxError
from .paths import Grant
from .root import Root, open_root
from .session import Session, SessionConfig, SessionError, SnapshotDigestMismatchError, SnapshotGenerationError
from .snapshot import DirectorySnapshotStore, LocalSnapshotStore, NoSnapshot, SnapshotLimits, SnapshotStore
from .snapshot import validate_name
from .snapshot import SnapshotInfo, SnapshotNotFoundError, SnapshotStoreError, fork_snapshot

if TYPE_CHECKING:  # the overlay is optional: sandbox_fs.fuse is imported only by a session that uses it
    from .fuse import OverlayPolicy

__all__ = [
    "ClientOptions",
    "LocalSandboxClient",
    "SessionState",
    "RunState",
    "SessionStateError",
    "SessionStateVersionError",
    "SessionStateTamperedError",
    "SessionStateKeyMissingError",
    "UnsafeKeyFileError",
    "open_session",
    "STATE_VERSION",
]

STATE_VERSION: Literal[2] = 2
_MAC_DOMAIN = b"sandbox-fs/session-state/v1\0"  # version 1 states (read only)
_MAC_DOMAIN_V2 = b"sandbox-fs/session-state/v2\0"
_READ_VERSIONS = (1, 2)


class SessionStateError(SessionError, ValueError):
    """Serialized session or run state is malformed or carries fields it may not carry.

    Raised by :meth:`LocalSandboxClient.deserialize_state` (and so by
    ``resume`` and :func:`open_session`); ``context["fields"]`` names up to 10
    offending fields.  Also raised when the installation state key is damaged.
    """

    code = "session_state_invalid"


class SessionStateVersionError(SessionStateError):
    """Serialized state has a version this sandbox-fs does not read.

    Raised by :meth:`LocalSandboxClient.deserialize_state`; this release reads
    versions 1 and 2 and writes :data:`STATE_VERSION`.
    """

    code = "session_state_version"


class SessionStateTamperedError(SessionStateError):
    """The state's HMAC is missing or does not match.

    Raised by :meth:`LocalSandboxClient.deserialize_state` before any other
    field is trusted.  The MAC key is ``ClientOptions.state_key``, else the
    installation key, so a state from another installation is refused too.
    """

    code = "session_state_tampered"


class SessionStateKeyMissingError(SessionStateError):
    """No installation state key exists where a client that only reads state looks for it.

    Raised by :class:`LocalSandboxClient` opened with ``create=False`` (to
    resume, fork or delete an existing session) and given no ``state_key``
    when there is no ``.state-key`` in its local snapshot store (or, without
    one, in its workspaces directory): the state was written with another
    store or key, so it could not be checked.  Unlike
    :class:`SessionStateTamperedError` this says nothing about the state;
    no key (and nothing else) was made.
    """

    code = "session_state_key_missing"


class SessionState(BaseModel):
    """What is needed to reconnect to a session, and nothing that grants anything.

    Attributes:
        version: format version: 2 (written), or 1 (read: before the binding).
        session_id: plain token; the workspace is ``<workspaces_dir>/<id>``.
        manifest: the manifest's JSON data (re-loaded untrusted on resume), or None.
        snapshot: name of the snapshot to restore from, or None.
        workspace_root_ready: the workspace was filled at least once.
        fingerprint: fingerprint of the last persisted snapshot, or None.
        workspace_id: (version 2) 32 hex digits, also kept in the workspace;
            a resume onto a workspace holding another id is refused.
        generation: (version 2) generation of ``snapshot`` (or of the
            session's own snapshot) last persisted, restored or matched; None
            when there was none.  A resume whose store holds another
            generation is refused unless ``allow_rollback``.
        snapshot_digest: (version 2) SHA-256 of that generation's stored
            metadata (:attr:`~sandbox_fs.snapshot.SnapshotInfo.digest`), which
            names its archive's digest (BLAKE3; SHA-256 in older generations); under the MAC, so a store that replaced
            a generation's metadata and data together is refused on resume.
            None when the store sets none.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1, 2] = STATE_VERSION
    session_id: str
    manifest: dict[str, Any] | None = None
    snapshot: str | None = None
    workspace_root_ready: bool = False
    fingerprint: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    workspace_id: str | None = Field(default=None, pattern=r"^[0-9a-f]{32}$")
    generation: int | None = Field(default=None, ge=0, le=1 << 62)
    snapshot_digest: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")

    @field_validator("session_id", "snapshot")
    @classmethod
    def _token(cls, v: str | None) -> str | None:
        if v is not None:
            validate_name(v, "session id / snapshot name")
        return v

    @model_validator(mode="after")
    def _binding(self) -> "SessionState":
        if self.version == 1 and (self.workspace_id is not None or self.generation is not None):
            raise ValueError("a version 1 state carries no workspace_id or generation")
        if self.version >= 2 and self.workspace_id is None:
            raise ValueError("a version 2 state must carry its workspace_id")
        return self


class RunState(BaseModel):
    """A run's sessions, keyed by stable caller-chosen keys (never object identity).

    Attributes:
        version: format version (1).
        current_key: the key of the session the run is on now.
        sessions: key -> serialized :class:`SessionState` (as from
            :meth:`LocalSandboxClient.serialize_state`).
        display_names: key -> display name (two keys may share one).
    """

    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = 1
    current_key: str | None = None
    sessions: dict[str, dict[str, Any]] = Field(default_factory=dict)
    display_names: dict[str, str] = Field(default_factory=dict)


@dataclass(frozen=True)
class ClientOptions:
    """Trusted configuration from the host application.  The only source of authority.

    Attributes:
        workspaces_dir: trusted host directory under which private workspaces
            (mode 0700) are created as ``<workspaces_dir>/<session id>``;
            created 0700 when missing.
        snapshot_store: a :class:`~sandbox_fs.snapshot.SnapshotStore`; None
            with ``snapshot_dir`` None means :class:`NoSnapshot`.
        snapshot_dir: trusted host directory for a
            :class:`~sandbox_fs.snapshot.DirectorySnapshotStore` (generations and
            layers; version-1 snapshots in it still restore).
        extra_path_grants: extra path grants given to every session.
        base_dir: the trusted base directory for manifest host sources.
        workspace_path: absolute sandbox location of the workspace.
        state_key: HMAC-SHA256 key for serialized state (bytes, >= 16), or None.
        limits: snapshot limits (persist and hydrate).
        archive_limits: limits handed to the archive extractor by ``Session.extract``.
        on_unrestorable: persist policy for unrestorable entries: ``"refuse"`` or ``"skip"``.
        max_read_bytes: default bound of ``Session.read``, in bytes.
        hook_timeout_s: longest a pre-stop hook may run, in seconds.
        materialize: override of :func:`sandbox_fs.materialize.materialize`.
        manifest_loader: ``(data, trust) -> Manifest`` used on resume
            (default :func:`sandbox_fs.manifest.load_manifest`).
        identity: who confined commands run as (``SessionConfig.identity``):
            ``"auto"`` leases one uid/gid per live session on a root host.
        identity_range: ``(base, count)`` of the leased ids (None: the default).
        confinement: the default ``confinement`` of the sessions' commands,
            and whether an overlay that cannot run is refused (``"required"``)
            or the session runs without it (``SessionConfig.confinement``).
        overlay: serve each session's workspace through the FUSE overlay
            (``SessionConfig.overlay``; extra ``sandbox-fs[fuse]``).
        overlay_policy: the overlay's :class:`~sandbox_fs.fuse.OverlayPolicy`
            (quotas, audit buffer, ...), or None for its defaults.
    """

    workspaces_dir: str
    snapshot_store: Any = None
    snapshot_dir: str | None = None
    extra_path_grants: tuple[Grant, ...] = ()
    base_dir: str | None = None
    workspace_path: str = "/workspace"
    state_key: bytes | None = None
    limits: SnapshotLimits = field(default_factory=SnapshotLimits)
    archive_limits: Any = None
    on_unrestorable: Literal["refuse", "skip"] = "refuse"
    max_read_bytes: int = 64 << 20
    hook_timeout_s: float = 30.0
    materialize: Callable[..., Awaitable[Any]] | None = None
    manifest_loader: Callable[[Any, str], Any] | None = None
    identity: Literal["auto", "host"] | tuple[int, int] = "auto"
    identity_range: tuple[int, int] | None = None
    confinement: Literal["required", "best_effort", "none"] = "required"
    overlay: bool = False
    overlay_policy: OverlayPolicy | None = None

    def __post_init__(self) -> None:
        if self.state_key is not None and (not isinstance(self.state_key, bytes) or len(self.state_key) < 16):
            raise ValueError("state_key must be at least 16 bytes")
        object.__setattr__(self, "extra_path_grants", tuple(self.extra_path_grants))


def _canonical(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _mac(key: bytes, payload: dict[str, Any]) -> str:
    """HMAC-SHA256 (RFC 2104) of the canonical payload, under the domain of its version."""
    domain = _MAC_DOMAIN if payload.get("version") == 1 else _MAC_DOMAIN_V2
    return hmac.new(key, domain + _canonical(payload), hashlib.sha256).hexdigest()


def _default_loader(data: Any, trust: Literal["untrusted", "trusted"]) -> Any:
    try:
        from .manifest import load_manifest  # noqa: PLC0415
    except ImportError:
        raise SessionError("the state holds a manifest but sandbox_fs.manifest is not installed",
                           sandbox_path=None) from None
    return load_manifest(data, trust=trust)


_AUTHORITY_FIELDS = ("root", "extra_path_grants", "base_dir")


def _manifest_data(manifest: Any) -> dict[str, Any] | None:
    """The manifest as JSON data for a state: secret values redacted, trusted-only fields removed.

    A state must carry no secrets and no authority, so ``root``,
    ``extra_path_grants`` and ``base_dir`` are dropped (the client options
    supply location and grants) and secrets read ``***``.  Resume a manifest
    whose secrets matter by passing it again: ``client.resume(state, manifest=m)``.
    """
    if manifest is None:
        return None
    to_json = getattr(manifest, "to_json", None)
    data: dict[str, Any]
    if callable(to_json):
        data = json.loads(to_json(reveal_secrets=False))
    elif callable(getattr(manifest, "model_dump", None)):
        data = manifest.model_dump(mode="json")
    else:
        raise SessionError("manifest cannot be serialized (no to_json / model_dump)", sandbox_path=None)
    for name in _AUTHORITY_FIELDS:
        data.pop(name, None)
    return data


class LocalSandboxClient:
    """Creates, resumes and deletes sessions on this host.

    Args:
        options: the trusted :class:`ClientOptions`.
        create: make a missing ``snapshot_dir`` (0700) and installation key
            (0600).  False for a client that only acts on existing state
            (resume, fork, delete): neither is made, so a wrong store or
            workspaces directory given with a state is refused with nothing
            left behind.  The workspaces directory is then made (0700) only
            when a checked state needs a workspace in it (a resume may rebuild
            one on a new machine).

    Raises:
        SnapshotStoreError: ``create`` is False and ``snapshot_dir`` does not
            exist (code ``snapshot_store_unavailable``, not retryable).
        SessionStateKeyMissingError: ``create`` is False, no ``state_key`` is
            given and there is no installation key (in ``snapshot_dir``, else
            in ``workspaces_dir``).
        SymlinkRefusedError: ``workspaces_dir`` or ``snapshot_dir``, or a
            directory on it, is a symlink (host paths are resolved without
            following symlinks: see :func:`sandbox_fs.root.open_host_dir_fd`;
            resolve a trusted symlinked path with ``os.path.realpath`` first).
        UnsafeKeyFileError: without ``state_key``, the installation key file
            ``.state-key`` (in the snapshot directory, else the workspaces
            directory) is not a regular file of this user with one link and
            mode 0600, or its directory is another user's or writable by group
            or others: another user could have planted or read the key (pass
            ``state_key`` for a shared directory).
        SessionStateError: the installation key file is too short.
        OSError: a directory cannot be created or opened.

    Use as ``with LocalSandboxClient(opts) as client:`` or call :meth:`close`.
    """

    def __init__(self, options: ClientOptions, *, create: bool = True) -> None:
        self.options = options
        self._create = create
        self._own_store = False
        self.store: SnapshotStore = NoSnapshot()
        parent: Root | None = None
        try:
            self.store = self._open_store(options, create)
            self._own_store = options.snapshot_store is None and options.snapshot_dir is not None
            if options.state_key is None and not self._store_holds_key():
                # the key lives in the workspaces directory: not made just to find no key in it
                parent = self._open_parent(create, missing=None if create else self._no_key)
            self._state_key = options.state_key or self._installation_key(parent)
            if parent is None and create:
                parent = self._open_parent(True)
        except BaseException:
            if parent is not None:
                parent.close()
            if self._own_store:
                self.store.close()
            raise
        self._parent_root: Root | None = parent

    @property
    def _parent(self) -> Root:
        """The workspaces directory, made (0700) when missing and opened by the host-path rule on first use."""
        if self._parent_root is None:  # create=False: made only once a checked state needs a workspace
            self._parent_root = self._open_parent(True)
        return self._parent_root

    def _has_workspace(self, name: str) -> bool:
        """Whether ``<workspaces_dir>/<name>`` exists (a missing workspaces directory is not made to tell)."""
        if self._parent_root is None:
            try:
                self._parent_root = self._open_parent(False)
            except FileNotFoundError:
                return False
        return self._parent_root.exists(name)

    def _open_parent(self, create: bool, missing: Callable[[], SandboxError] | None = None) -> Root:
        """The workspaces directory (made 0700 when ``create``); ``missing()`` is raised when it does not exist."""
        try:
            return open_root(os.fspath(self.options.workspaces_dir), label="workspaces", create=create)
        except FileNotFoundError:
            if missing is None:
                raise
            raise missing() from None

    @staticmethod
    def _open_store(options: ClientOptions, create: bool) -> SnapshotStore:
        """The snapshot store of ``options`` (a missing directory is made only when ``create``)."""
        if options.snapshot_store is not None:
            return options.snapshot_store  # type: ignore[no-any-return]
        if options.snapshot_dir is None:
            return NoSnapshot()
        try:
            return DirectorySnapshotStore(options.snapshot_dir, create=create)  # layers; version-1 ones restore
        except FileNotFoundError:
            if create:
                raise
            raise SnapshotStoreError("the snapshot store directory does not exist (a session's state is read with "
                                     "the store it was written with); nothing was made",
                                     sandbox_path=None, retryable=False) from None

    def _store_holds_key(self) -> bool:
        return isinstance(self.store, (LocalSnapshotStore, DirectorySnapshotStore))

    @staticmethod
    def _no_key() -> SessionStateKeyMissingError:
        return SessionStateKeyMissingError(
            "no installation state key here: the state was written with another snapshot store (or workspaces "
            "directory) or another state key; give that one (nothing was made)", sandbox_path=None)

    def _installation_key(self, parent: Root | None) -> bytes:
        """The per-installation state key, ``.state-key`` (created 0600 on first use).

        It lives in the local snapshot store when there is one (snapshots
        outlive workspaces, and a state is resumed from its snapshot), else
        in the workspaces directory.

        Session ids and snapshot names act as capabilities (they select a
        workspace and a snapshot), so serialized state is always
        authenticated: with ``ClientOptions.state_key`` when given, else
        with this key, which never leaves the trusted workspaces directory.
        (Its name holds a dot, so no session id can ever name it.)  It is
        taken only when no other user could have written or read it
        (:func:`sandbox_fs._keyfile.installation_key`).

        Raises:
            UnsafeKeyFileError: the key file or its directory breaks a rule.
            SessionStateError: the key is shorter than 32 bytes.
        """
        home = self.store.root if self._store_holds_key() else parent  # type: ignore[attr-defined]
        assert home is not None
        key = installation_key(home, ".state-key", create=self._create)
        if key is None:
            raise self._no_key()
        if len(key) < 32:
            raise SessionStateError("the installation state key is damaged (too short)", sandbox_path=None)
        return key

    def close(self) -> None:
        """Release the client's directory fds (sessions keep their own).  Idempotent.

        Raises:
            Nothing.
        """
        if self._parent_root is not None:
            self._parent_root.close()
        if self._own_store:
            self.store.close()

    def __enter__(self) -> "LocalSandboxClient":
        """The client itself; ``__exit__`` calls :meth:`close`.

        Raises:
            Nothing.
        """
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- sessions

    def _config(self, session_id: str, root: str | os.PathLike[str] | None) -> SessionConfig:
        o = self.options
        workspace_dir = os.path.join(os.fspath(o.workspaces_dir), session_id) if root is None else os.fspath(root)
        owned = root is None
        return SessionConfig(
            session_id=session_id,
            workspace_dir=workspace_dir,
            owned=owned, parent=self._parent if owned else None, store=self.store,
            grants=o.extra_path_grants, workspace_path=o.workspace_path, base_dir=o.base_dir,
            limits=o.limits, archive_limits=o.archive_limits, on_unrestorable=o.on_unrestorable,
            max_read_bytes=o.max_read_bytes, hook_timeout_s=o.hook_timeout_s, materialize=o.materialize,
            identity=o.identity, identity_range=o.identity_range, confinement=o.confinement,
            overlay=o.overlay, overlay_policy=o.overlay_policy)

    def create(self, manifest: Any = None, snapshot: str | None = None, *,
               root: str | os.PathLike[str] | None = None, session_id: str | None = None) -> Session:
        """A new, not yet started session (``async with client.create(...) as s`` starts it).

        Args:
            manifest: a loaded manifest (trusted by whoever loaded it), or None.
            snapshot: name of a snapshot in the store to seed the workspace
                from (instead of applying the full manifest).
            root: a caller-owned host directory to use as the workspace
                (never deleted by the client); None for a private workspace
                ``<workspaces_dir>/<id>`` (mode 0700) the client owns.
            session_id: a plain token; default 32 random hex digits.

        Raises:
            InvalidPathError: ``session_id`` or ``snapshot`` is not a plain token.
        """
        sid = validate_name(session_id or secrets.token_hex(16), "session id")
        if snapshot is not None:
            validate_name(snapshot)
        return Session(self._config(sid, root), manifest=manifest, restore_from=snapshot or sid,
                       require_snapshot=snapshot is not None)

    def resume(self, state: "SessionState | dict[str, Any]", *, root: str | os.PathLike[str] | None = None,
               manifest: Any = None, allow_rollback: bool = False) -> Session:
        """A session that reconnects to serialized ``state`` (start it to reattach or rebuild).

        Only the id, manifest data, snapshot reference, fingerprint, workspace
        id and generation are taken from the state; location, ownership and
        grants come from the options (and ``root`` for a caller-owned
        workspace).  The binding is checked when the session starts, before
        anything in the workspace changes (see the module docstring).

        Args:
            state: a :class:`SessionState` or its serialized dict.
            root: the caller-owned workspace directory again, or None for the
                private ``<workspaces_dir>/<id>``.
            manifest: a trusted manifest that replaces the state's copy;
                otherwise the state's manifest data is loaded as untrusted.
            allow_rollback: resume even when the store's snapshot is at
                another generation than the state recorded (the store's
                current generation is then used, and recorded).

        Raises:
            SessionStateError, SessionStateVersionError, SessionStateTamperedError:
                see :meth:`deserialize_state`.
            WorkspaceMismatchError, SnapshotGenerationError: raised by
                :meth:`Session.start` (see there).
        """
        st = state if isinstance(state, SessionState) else self.deserialize_state(state)
        if manifest is None and st.manifest is not None:
            loader = self.options.manifest_loader or _default_loader
            manifest = loader(st.manifest, "untrusted")
        return Session(self._config(st.session_id, root), manifest=manifest,
                       restore_from=st.snapshot or st.session_id, fingerprint=st.fingerprint, resumed=True,
                       workspace_id=st.workspace_id, generation=st.generation, bound=st.version >= 2,
                       snapshot_digest=st.snapshot_digest if st.version >= 2 else None,
                       allow_rollback=allow_rollback)

    async def delete(self, session: Session, *, snapshot: bool = False) -> bool:
        """Close the session (if open) and remove what the client owns.

        Removes the private workspace ``<workspaces_dir>/<id>`` with an
        fd-based walk that never follows a symlink and keeps mount points;
        a caller-owned workspace is never touched.

        Args:
            snapshot: also remove the session's own snapshot (named by its id).

        Returns:
            True when a workspace was removed.

        Raises:
            Exception: from :meth:`Session.aclose` when the session was still open.

        Cancellation:
            Runs shielded once started: a removal is never left half done by a cancel.
        """
        if not session.closed:
            await session.aclose()
        sid = validate_name(session.id, "session id")
        removed = False
        with trio.CancelScope(shield=True):
            if session.owned and session.config.parent is self._parent:
                def work() -> bool:
                    if not self._parent.exists(sid):
                        return False
                    dev = self._parent.stat(".").st_dev
                    self._parent.rmtree(sid, missing_ok=True, skip=lambda st: st.st_dev != dev)
                    return True
                removed = await trio.to_thread.run_sync(work)
            if snapshot:
                await trio.to_thread.run_sync(self.store.remove, sid)
        await trio.lowlevel.checkpoint()
        return removed

    async def fork(self, state: "SessionState | dict[str, Any]", *, session_id: str | None = None) -> dict[str, Any]:
        """Fork a session: a new session state, with its own id and workspace, seeded from the source's snapshot.

        The new session starts from the generation of the source's snapshot
        that ``state`` recorded, which must still be the store's current one
        (the source's *stopped* state: a live session's unpersisted changes
        are not in it).  The store decides how (see
        :func:`~sandbox_fs.snapshot.fork_snapshot`): a
        :class:`~sandbox_fs.snapshot.GenerationStore` (a local object directory,
        S3) *shares* the source's stored objects, copying nothing, and keeps
        them from being deleted while the fork lists them; the version-1
        :class:`~sandbox_fs.snapshot.LocalSnapshotStore` *copies* the archive
        through the store's methods (memory bounded by a 1 MiB chunk).
        Either way later persists of either session write under its own name,
        so changes in one never show in the other.

        The returned state is like any other: under this client's MAC, bound to
        a new random workspace id and to the new snapshot's generation and
        metadata digest, with the source's manifest data (loaded as untrusted
        on resume).  Nothing is made on the host: :meth:`resume` it to build
        the workspace ``<workspaces_dir>/<new id>`` from the snapshot, on this
        machine or another.  The source's workspace and snapshot are never
        written (a hold object is added beside the source's objects).

        Args:
            state: the source session's :class:`SessionState` or serialized dict
                (checked as by :meth:`deserialize_state`).
            session_id: the new session's id, a plain token; default 32 random hex digits.

        Returns:
            The new session's serialized state (a JSON-ready dict with its ``mac``).

        Raises:
            SessionStateError, SessionStateVersionError, SessionStateTamperedError:
                see :meth:`deserialize_state`.
            InvalidPathError: ``session_id`` is not a plain token.
            SessionError: the client has no snapshot store, ``session_id`` is the
                source's id or snapshot name, or a workspace with that id exists.
            SnapshotNotFoundError: the source has no persisted snapshot.
            SnapshotGenerationError, SnapshotDigestMismatchError: the store's snapshot of
                the source is at another generation, or has other metadata, than ``state``
                recorded (a stale state: fork from the newer one).
            SnapshotConflictError: the new snapshot name is in use, or the
                source changed while it was forked (nothing was made).
            SnapshotCorruptError, SnapshotStoreError, OSError: from the store (nothing was made).

        Cancellation:
            The store work runs in one worker thread that a cancel waits for;
            when it had finished, the forked snapshot exists without a state
            (``store.remove(new id)`` removes it).
        """
        st = state if isinstance(state, SessionState) else self.deserialize_state(state)
        new_id = validate_name(session_id or secrets.token_hex(16), "session id")
        source = st.snapshot or st.session_id
        if not self.store.enabled:
            raise SessionError("forking a session needs a snapshot store", sandbox_path=None)
        if new_id in (st.session_id, source) or self._has_workspace(new_id):
            raise SessionError("the fork's session id is the source's or has a workspace already",
                               sandbox_path=None, context={"session": new_id})
        info = await trio.to_thread.run_sync(self._fork_sync, st, source, new_id)
        new = SessionState(session_id=new_id, manifest=st.manifest, snapshot=new_id, fingerprint=info.fingerprint,
                           workspace_id=secrets.token_hex(16), generation=info.generation,
                           snapshot_digest=info.digest or None)
        return self.sign_state(new.model_dump(mode="json"))

    def _fork_sync(self, st: SessionState, source: str, new_id: str) -> SnapshotInfo:
        """The store part of :meth:`fork`: check the source is at the state's generation, then fork it."""
        generation, digest = None, None
        if st.version >= 2:  # bound: the store must hold what the state recorded, as on resume
            info = self.store.info(source)
            if info is None or not st.generation:
                raise SnapshotNotFoundError("the source session has no persisted snapshot to fork",
                                            sandbox_path=None, context={"snapshot": source})
            ctx = {"snapshot": source, "state_generation": st.generation, "store_generation": info.generation}
            if info.generation != st.generation:
                raise SnapshotGenerationError("the store's snapshot of the source is at another generation than "
                                              "the state recorded (a stale state?); nothing was made",
                                              sandbox_path=None, context=ctx)
            if st.snapshot_digest and info.digest != st.snapshot_digest:
                raise SnapshotDigestMismatchError("the store's snapshot metadata of the source is not the one the "
                                                  "state recorded; nothing was made", sandbox_path=None, context=ctx)
            generation, digest = st.generation, st.snapshot_digest or info.digest or None
        info, _shared = fork_snapshot(self.store, source, new_id, generation=generation, digest=digest,
                                      limits=self.options.limits)
        return info

    # ----------------------------------------------------------------- state

    def serialize_state(self, session: Session) -> dict[str, Any]:
        """A JSON-ready dict of the session's :class:`SessionState`, with its ``mac``.

        Give it back to :meth:`resume` (as the dict, or as JSON text parsed
        with ``json.loads``).  It holds no secret and no authority.

        Raises:
            SessionError: the session's manifest cannot be serialized (no
                ``to_json`` / ``model_dump``).
        """
        st = SessionState(session_id=session.id, manifest=_manifest_data(session.manifest),
                          snapshot=session.snapshot_name if self.store.enabled and session.fingerprint else None,
                          workspace_root_ready=session.workspace_root_ready, fingerprint=session.fingerprint,
                          workspace_id=session.workspace_id,
                          generation=session.generation if self.store.enabled else None,
                          snapshot_digest=session.snapshot_digest if self.store.enabled else None)
        payload = st.model_dump(mode="json")
        if self._state_key is not None:
            payload["mac"] = _mac(self._state_key, payload)
        return payload

    def sign_state(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Return a copy of ``payload`` (a JSON-ready dict, any ``mac`` dropped) with its ``mac`` under this client's key.

        What :meth:`serialize_state` does after building the payload; for tools
        and tests that forge state under a key they hold (fuzzing
        :meth:`deserialize_state` with valid MACs over mutated payloads).  Signing
        grants nothing: :meth:`deserialize_state` still validates every field.

        Raises:
            TypeError: ``payload`` is not JSON-serializable.
        """
        out = {k: v for k, v in payload.items() if k != "mac"}
        if self._state_key is not None:
            out["mac"] = _mac(self._state_key, out)
        return out

    def deserialize_state(self, data: dict[str, Any]) -> SessionState:
        """Validate serialized state.

        Raises:
            SessionStateVersionError: ``version`` is missing or not 1 or 2.
            SessionStateTamperedError: the ``mac`` is missing or wrong (checked
                before anything else is trusted).  State is always authenticated:
                with ``ClientOptions.state_key``, else the installation key.
            SessionStateError: any other malformed or extra field (``root``,
                ``grants``, ``owned`` ... are refused, never ignored), or
                arrays/objects nested deeper than 64 (checked before the MAC).
        """
        if not isinstance(data, dict):
            raise SessionStateError("session state must be a JSON object", sandbox_path=None)
        version = data.get("version")
        if version not in _READ_VERSIONS or isinstance(version, bool):
            what = "has no version" if version is None else (  # the state is untrusted: only a short int is shown
                f"version {version!r} is not supported" if isinstance(version, int) and abs(version) < 1000
                else "version is not supported")
            raise SessionStateVersionError(f"session state {what} (this sandbox-fs reads 1 and {STATE_VERSION})",
                                           sandbox_path=None)
        try:
            check_depth(data)  # the MAC re-serializes it: a deep one would exhaust the stack
        except ValueError:
            raise SessionStateError("session state nests too deeply", sandbox_path=None) from None
        payload = dict(data)
        mac = payload.pop("mac", None)
        if self._state_key is not None:
            want = _mac(self._state_key, payload)
            # (compare_digest raises TypeError for a str that is not ASCII: the state is untrusted)
            if not isinstance(mac, str) or not mac.isascii() or not hmac.compare_digest(mac, want):
                raise SessionStateTamperedError("session state HMAC is missing or does not match", sandbox_path=None)
        try:
            return SessionState.model_validate(payload)
        except ValidationError as exc:
            fields = sorted({".".join(str(p) for p in e["loc"]) for e in exc.errors()})
            raise SessionStateError("session state is malformed or carries fields it may not carry",
                                    sandbox_path=None, context={"fields": fields[:10]},
                                    diagnostic=str(exc)) from None
        except SandboxError as exc:
            raise SessionStateError("session state is malformed: " + exc.reason, sandbox_path=None) from None


# ------------------------------------------------------------ source resolution


@contextlib.asynccontextmanager
async def open_session(client: LocalSandboxClient, *, session: Session | None = None,
                       run_state: RunState | None = None, session_state: "SessionState | dict[str, Any] | None" = None,
                       manifest: Any = None, snapshot: str | None = None, key: str | None = None,
                       display_name: str | None = None, keep_workspace: bool = False,
                       allow_rollback: bool = False) -> AsyncIterator[Session]:
    """Resolve the session for a run and manage it for the ``async with`` block.

    Order: (1) an injected live ``session`` (caller-owned: started if needed,
    used, never stopped or deleted here); (2) the state stored in
    ``run_state.sessions[key]`` (``key`` defaults to ``run_state.current_key``);
    (3) an explicit ``session_state``; (4) a fresh session from ``manifest`` /
    ``snapshot``.  Manifest and snapshot only seed a fresh session.

    Sessions from (2)-(4) are runner-owned: on exit they are closed (pre-stop
    hooks, shutdown, then persist), their state is written back into
    ``run_state`` under ``key``, and the workspace is deleted unless
    ``keep_workspace`` or the close failed (then it stays for a later resume).
    ``run_state.current_key`` is set to ``key`` on entry, and the entry's
    state is recorded at once, so an interrupted run resumes every session it
    had and selects the right one.  The session is bound to this run for the
    block (:meth:`Session.bind_run`); the guard is released on every exit.

    Args:
        key: stable caller-chosen key of this session in the run state;
            default the run state's current key, else a new unique key.
        display_name: shown name; several keys may share one.
        keep_workspace: keep a runner-owned workspace after close.
        allow_rollback: passed to :meth:`LocalSandboxClient.resume` for (2) and (3).

    Raises:
        SessionBusyError: the session is already bound to another run.
        SessionStateError: the stored state is invalid.
        WorkspaceMismatchError, SnapshotGenerationError: the stored state is not bound to this
            workspace or snapshot generation (see :meth:`LocalSandboxClient.resume`).
        Exception: from start or close (see :meth:`Session.aclose`).

    Cancellation:
        Close runs shielded, so a cancel still shuts down, persists and
        releases the guard before propagating.
    """
    if key is None and run_state is not None:
        key = run_state.current_key
    if key is None:
        key = f"{display_name or 'session'}-{secrets.token_hex(6)}"
    caller_owned = session is not None
    if session is None:
        stored = run_state.sessions.get(key) if run_state is not None else None
        if stored is not None:
            session = client.resume(stored, allow_rollback=allow_rollback)
        elif session_state is not None:
            session = client.resume(session_state, allow_rollback=allow_rollback)
        else:
            session = client.create(manifest=manifest, snapshot=snapshot)

    def record() -> None:
        if run_state is not None:
            run_state.sessions[key] = client.serialize_state(session)
            run_state.current_key = key
            if display_name is not None:
                run_state.display_names[key] = display_name

    with session.bind_run(key):
        if not session.started:
            await session.start()
        record()
        if caller_owned:
            try:
                yield session
            finally:
                record()
            return
        close_ok = False
        try:
            yield session
        finally:
            try:
                await session.aclose()
                close_ok = True
            finally:
                record()
                if close_ok and not keep_workspace:
                    await client.delete(session)
