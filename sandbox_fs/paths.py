"""Sandbox paths and the path policy.

A *sandbox path* is what untrusted input names: a portable POSIX path,
relative to the workspace or absolute under the workspace's sandbox
location or an extra path grant.  It is a distinct type from a host path:
:class:`SandboxPath` values are produced only by :func:`normalize`, which
rejects NUL bytes, empty paths, components over 255 bytes, totals over 4096
bytes and ``..`` that would climb above the root, and removes ``.``,
duplicate and trailing slashes.

:class:`PathPolicy` maps a sandbox path to ``(Root, relative path,
read_only)``: the workspace Root, or the Root of an *extra path grant*
(an absolute host directory given by the application, read-only or
read-write, held as its own pinned Root).  A grant nested inside the
workspace wins for every path under it, and a read-only one is enforced
physically: the workspace Root handed out refuses writes into that
directory whatever path (symlink, ``..``) leads there.  Grants are runtime
access only: nothing persists them.

A grant may carry a *name* (:data:`GRANT_NAME_PATTERN`, unique among the
grants of one policy or session): a manifest ``mount`` entry names the grant
it exposes in the workspace (through the FUSE overlay), so a manifest never
holds a host path.  The name is an identifier, never used as a path.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from typing import Iterable

from .errors import InvalidArgumentError, InvalidPathError, PathEscapeError, ReadOnlyError
from .root import MAX_NAME_BYTES, MAX_PATH_BYTES, Root, open_root

__all__ = ["SandboxPath", "normalize", "Grant", "PathPolicy", "Resolved", "GRANT_NAME_PATTERN",
           "check_grant_name", "check_grant_names"]

#: What a grant name may be: 1 to 64 characters of ``A-Z a-z 0-9 _ . -``
#: (the same rule for :class:`Grant`, ``--grant NAME=PATH`` and a manifest's
#: ``mount`` entry).
GRANT_NAME_PATTERN = r"[A-Za-z0-9_.-]{1,64}"
_GRANT_NAME = re.compile(GRANT_NAME_PATTERN)


def _shown_name(name: object) -> str:
    text = name if isinstance(name, str) else type(name).__name__
    return repr(text[:64] + ("..." if len(text) > 64 else ""))


def check_grant_name(name: object) -> str:
    """Return ``name`` if it is a valid grant name (:data:`GRANT_NAME_PATTERN`).

    Raises:
        InvalidArgumentError: ``name`` is not a ``str`` or does not match
            (empty, over 64 characters, or another character such as ``/``,
            ``=``, ``:``, a space or NUL).
    """
    if not isinstance(name, str) or not _GRANT_NAME.fullmatch(name):
        raise InvalidArgumentError(f"a grant name must be 1 to 64 characters of A-Z a-z 0-9 _ . - "
                                   f"(got {_shown_name(name)})", sandbox_path=None)
    return name


def check_grant_names(grants: Iterable["Grant"]) -> None:
    """Refuse two grants with the same name (unnamed grants are never compared).

    Raises:
        InvalidArgumentError: two of ``grants`` carry the same ``name``.
    """
    seen: set[str] = set()
    for g in grants:
        if g.name is None:
            continue
        if g.name in seen:
            raise InvalidArgumentError(f"two grants are named {g.name!r}; grant names must be unique",
                                       sandbox_path=None, context={"grant": g.name})
        seen.add(g.name)


class SandboxPath(str):
    """A normalized sandbox path (a ``str`` subclass).  Build with :func:`normalize`.

    Relative values never start with ``/`` and never contain ``..``, ``.``
    or empty components; ``""`` names the root itself.  Absolute values
    (``is_absolute``) start with exactly one ``/`` and are otherwise the same.
    """

    __slots__ = ()

    @property
    def is_absolute(self) -> bool:
        return self.startswith("/")

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(p for p in self.split("/") if p)


def normalize(path: str | bytes, *, allow_absolute: bool = False) -> SandboxPath:
    """Lexically normalize an untrusted sandbox path.

    Args:
        path: the untrusted path (``str``; ``bytes`` are decoded as UTF-8
            with surrogateescape).
        allow_absolute: accept a leading ``/`` (the result stays absolute).

    Returns:
        The :class:`SandboxPath`: no ``.``, ``..``, empty components, or
        trailing slash; relative unless ``allow_absolute`` and ``path`` was
        absolute.

    Raises:
        InvalidPathError: NUL byte; empty; a component over 255 bytes; a total
            over 4096 bytes; backslash-separated traversal (``..\\``);
            ``..`` climbing above the root; absolute when not allowed.
    """
    if isinstance(path, bytes):
        path = path.decode("utf-8", "surrogateescape")
    if not isinstance(path, str):
        raise TypeError("sandbox path must be str")
    shown = path.replace("\0", "\\0")[:200]
    if "\0" in path:
        raise InvalidPathError("path contains a NUL byte", sandbox_path=shown)
    if path == "":
        raise InvalidPathError("path is empty", sandbox_path=shown)
    raw = path.encode("utf-8", "surrogateescape")
    if len(raw) > MAX_PATH_BYTES:
        raise InvalidPathError(f"path is over {MAX_PATH_BYTES} bytes", sandbox_path=shown[:64] + "...")
    absolute = path.startswith("/")
    if absolute and not allow_absolute:
        raise InvalidPathError("absolute paths are not allowed here", sandbox_path=shown)
    out: list[str] = []
    for comp in path.split("/"):
        if comp in ("", "."):
            continue
        if len(comp.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
            raise InvalidPathError(f"a component is over {MAX_NAME_BYTES} bytes", sandbox_path=shown)
        if comp == "..":
            if not out:
                raise InvalidPathError("'..' climbs above the root", sandbox_path=shown)
            out.pop()
            continue
        if "\\" in comp and ".." in comp.split("\\"):
            raise InvalidPathError("backslash-separated '..' traversal", sandbox_path=shown)
        out.append(comp)
    body = "/".join(out)
    return SandboxPath("/" + body if absolute else body)


@dataclass(frozen=True)
class Grant:
    """An extra path grant: an absolute host directory the application opens up.

    The path is validated as a whole when the Grant is made: it must be
    absolute, must not be ``/`` (the whole host), empty, ``//``-prefixed
    (POSIX leaves a leading ``//`` implementation-defined, and it broke the
    sandbox-path mapping) or hold a ``..`` component (which a rename could
    redirect); ``.`` components, repeated and trailing slashes are
    normalized away.  The directory itself is opened later by the host-path
    rule (:func:`sandbox_fs.root.open_host_dir_fd`: no symlink on any
    component).

    Attributes:
        path: normalized absolute host directory (trusted: it comes from the application).
        read_only: True for read-only access.
        name: None, or the identifier a manifest ``mount`` entry names the
            grant by (:data:`GRANT_NAME_PATTERN`; unique among a session's
            grants, checked by :class:`PathPolicy` and
            :class:`~sandbox_fs.materialize.MaterializeOptions`).

    Raises:
        InvalidPathError: ``path`` is not a ``str``, is empty, relative, ``/``,
            ``//``-prefixed, or holds a NUL byte or a ``..`` component.
        InvalidArgumentError: ``name`` is not None and not a valid grant name
            (see :func:`check_grant_name`).
    """

    path: str
    read_only: bool = True
    name: str | None = None

    def __post_init__(self) -> None:
        if self.name is not None:
            check_grant_name(self.name)
        path = self.path
        if not isinstance(path, str):
            raise InvalidPathError("a grant path must be a str", sandbox_path=None)
        if path == "":
            raise InvalidPathError("a grant path is empty", sandbox_path=None)
        shown = self.label  # never the host path: error text names the grant
        if "\0" in path:
            raise InvalidPathError("a grant path must not contain a NUL byte", sandbox_path=shown)
        if not path.startswith("/"):
            raise InvalidPathError("a grant must be an absolute host directory", sandbox_path=shown)
        if path.startswith("//"):
            raise InvalidPathError("a grant path must not start with '//'", sandbox_path=shown)
        comps = [c for c in path.split("/") if c not in ("", ".")]
        if ".." in comps:
            raise InvalidPathError("a grant path must not contain '..'", sandbox_path=shown)
        if not comps:
            raise InvalidPathError("a grant of '/' would open the whole host", sandbox_path=shown)
        object.__setattr__(self, "path", "/" + "/".join(comps))

    @property
    def label(self) -> str:
        """How errors name the grant: ``"grant NAME"``, or ``"grant"`` without a name (never its host path)."""
        return f"grant {self.name}" if self.name else "grant"

    @classmethod
    def parse(cls, spec: str, *, relative_to: str | None = None) -> "Grant":
        """Parse ``[NAME=]PATH``, ``[NAME=]PATH:ro`` or ``[NAME=]PATH:rw`` (the CLI form; default read-only).

        ``NAME=`` is taken as a name when the text before the first ``=``
        is a valid grant name (:data:`GRANT_NAME_PATTERN`: it holds no
        ``/``), so an absolute PATH holding ``=`` (``/srv/a=b``) stays a
        path; write a relative PATH whose first component holds ``=`` as
        ``./a=b``.  The text after the last ``:`` is the mode when it holds no
        ``/``: anything but ``ro`` or ``rw`` there is refused (a typo such as
        ``:r0`` never becomes part of the path), so a path whose last
        component holds ``:`` is written with an explicit mode
        (``/srv/a:b:ro``).

        Args:
            spec: the grant text.
            relative_to: a trusted absolute directory that a relative PATH is
                joined to (the CLI passes the operator's cwd); None refuses
                relative paths.

        Raises:
            InvalidPathError: PATH is relative and ``relative_to`` is None, or
                the path is refused by the constructor (``/``, ``//``-prefixed, ``..``).
            InvalidArgumentError: ``NAME=`` is followed by nothing, or the
                text after the last ``:`` holds no ``/`` and is not ``ro`` or ``rw``.
        """
        name: str | None = None
        head, eq, rest = spec.partition("=")
        if eq and _GRANT_NAME.fullmatch(head):
            name, spec = head, rest
            if not spec:
                raise InvalidArgumentError(f"grant {name!r} names no path (write NAME=PATH[:ro|:rw])",
                                           sandbox_path=None)
        path, sep, mode = spec.rpartition(":")
        if not sep or "/" in mode:  # no mode: the ':' (if any) is in a directory name
            path, mode = spec, "ro"
        elif mode not in ("ro", "rw"):
            raise InvalidArgumentError(
                "a grant ends with an unknown mode after its last ':' (write :ro or :rw; a path whose last "
                "component holds ':' takes an explicit :ro or :rw)", sandbox_path=f"grant {name}" if name else "grant")
        if relative_to is not None and not path.startswith("/"):
            path = posixpath.join(relative_to, path)
        return cls(path, read_only=(mode == "ro"), name=name)


@dataclass(frozen=True)
class Resolved:
    """Where a sandbox path lands: the Root to use, the path beneath it, and its access."""

    root: Root
    rel: str
    read_only: bool
    sandbox_path: SandboxPath


@dataclass
class _PinnedGrant:
    grant: Grant
    root: Root
    identity: tuple[int, int]


class PathPolicy:
    """Maps sandbox paths to Roots: the workspace, or one of the extra path grants.

    Args:
        workspace: the workspace Root (the policy keeps using it; the caller
            still owns and closes it).
        workspace_path: the absolute sandbox location of the workspace
            (for example its host directory, or ``"/workspace"``).  Absolute
            sandbox paths are accepted only under it or under a grant.
        grants: extra path grants, each opened once and pinned as its own Root.

    Raises:
        InvalidPathError: a grant path or ``workspace_path`` is not absolute.
        InvalidArgumentError: two grants have the same ``name``.
        FileNotFoundError, NotADirectoryError: a grant directory cannot be
            opened as a Root.
        SymlinkRefusedError: a grant directory, or a directory on its host
            path, is a symlink (the host-path rule of
            :func:`sandbox_fs.root.open_host_dir_fd`).
    """

    def __init__(self, workspace: Root, workspace_path: str, grants: Iterable[Grant] = ()) -> None:
        if not workspace_path.startswith("/"):
            raise InvalidPathError("workspace_path must be absolute", sandbox_path=None)
        self.workspace_path = posixpath.normpath(workspace_path)
        grants = list(grants)
        check_grant_names(grants)
        self._grants: list[_PinnedGrant] = []
        self._own_views: list[Root] = []
        try:
            for g in grants:
                r = open_root(g.path, read_only=g.read_only, label=g.path, shown=g.label)
                self._grants.append(_PinnedGrant(g, r, r.identity))
            # Read-only grants are enforced physically in every writable Root
            # the policy hands out (the workspace and read-write grants): a
            # write whose parent fd is, or is beneath, a read-only grant's
            # directory is refused whatever path (symlink, "..") led there.
            ro_ids = frozenset(p.identity for p in self._grants if p.grant.read_only)
            self.workspace = workspace
            if ro_ids:
                self.workspace = workspace.with_options(deny_write_ids=ro_ids)
                self._own_views.append(self.workspace)
                for p in self._grants:
                    if not p.grant.read_only:
                        view = p.root.with_options(deny_write_ids=ro_ids)
                        p.root.close()
                        p.root = view
        except BaseException:
            self.close()
            raise

    @property
    def grants(self) -> list[Grant]:
        return [p.grant for p in self._grants]

    @property
    def workspace_identity(self) -> tuple[int, int]:
        return self.workspace.identity

    def grant_views(self) -> list[tuple[Grant, Root]]:
        """Each grant with a new read-only Root on its pinned directory (the caller closes the Roots).

        Raises:
            WorkspaceClosedError: the policy was closed.
            OSError(EMFILE): the process has no free fd.
        """
        out: list[tuple[Grant, Root]] = []
        try:
            for p in self._grants:
                out.append((p.grant, p.root.with_options(read_only=True)))
        except BaseException:
            for _g, r in out:
                r.close()
            raise
        return out

    def open_grant_root(self, name: str, *, read_only: bool = True) -> Root:
        """A new Root on the directory of the grant named ``name`` (e.g. for a mount entry).

        The Root is a view of the grant's pinned Root (the same directory,
        opened once when the policy was made; read-only grants nested in it
        stay denied): read-only unless ``read_only`` is False *and* the grant
        is read-write.  The caller owns it and closes it.

        Raises:
            InvalidArgumentError: no grant of this policy is named ``name``.
            ReadOnlyError: ``read_only`` is False and the grant is read-only.
            WorkspaceClosedError: the policy was closed.
            OSError(EMFILE): the process has no free fd.
        """
        for p in self._grants:
            if p.grant.name is not None and p.grant.name == name:
                if not read_only and p.grant.read_only:
                    raise ReadOnlyError(f"grant {name!r} is read-only; it cannot be opened read-write",
                                        sandbox_path=None, context={"grant": name})
                return p.root.with_options(read_only=read_only)
        raise InvalidArgumentError(f"no grant is named {_shown_name(name)}", sandbox_path=None)

    def resolve(self, path: str, *, for_write: bool = False) -> Resolved:
        """Resolve an untrusted sandbox path.

        Args:
            path: relative (to the workspace) or absolute sandbox path.
            for_write: raise ReadOnlyError at once when the target is read-only.

        Raises:
            InvalidPathError: see :func:`normalize`.
            PathEscapeError: an absolute path under neither the workspace nor a grant.
            ReadOnlyError: ``for_write`` and the path is under a read-only grant.
        """
        sp = normalize(path, allow_absolute=True)
        absolute = sp if sp.is_absolute else SandboxPath(
            posixpath.join(self.workspace_path, sp) if sp else self.workspace_path)
        best: tuple[int, Root, str, bool] | None = None
        candidates = [(self.workspace_path, self.workspace, False)] + [
            (p.grant.path, p.root, p.grant.read_only) for p in self._grants]
        for base, root, ro in candidates:
            if absolute == base or absolute.startswith(base.rstrip("/") + "/"):
                if best is None or len(base) > best[0]:
                    rel = absolute[len(base):].lstrip("/")
                    best = (len(base), root, rel, ro)
        if best is None:
            raise PathEscapeError("path is outside the workspace and every grant", sandbox_path=sp,
                                  context={"operation": "resolve"})
        _, root, rel, ro = best
        if for_write and ro:
            raise ReadOnlyError("path is under a read-only grant", sandbox_path=sp)
        return Resolved(root, rel, ro, sp)

    def close(self) -> None:
        """Close the grant Roots (and the guarded workspace view).  Idempotent."""
        for p in self._grants:
            p.root.close()
        for v in getattr(self, "_own_views", []):
            v.close()

    def __enter__(self) -> "PathPolicy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

