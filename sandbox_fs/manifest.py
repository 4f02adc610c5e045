"""Manifests: what a fresh workspace starts with (pydantic v2 models).

A *manifest* maps workspace-relative destinations (sandbox paths) to
*entries*::

    {"root": "/srv/ws/42",
     "entries": {
        "README.md":   {"type": "file", "content": "hello\\n"},
        "bin/run":     {"type": "file", "content": "IyEvYmluL3NoCg==", "encoding": "base64", "mode": 493},
        "data":        {"type": "dir", "mode": 493, "children": {"a.txt": {"type": "file"}}},
        "lib.py":      {"type": "local_file", "src": "src/lib.py"},
        "proj":        {"type": "local_dir", "src": "proj", "exclude": ["*.pyc"]},
        "latest":      {"type": "symlink", "target": "data/a.txt"},
        "vendor":      {"type": "archive", "src": "vendor.tar.gz"},
        "tmp/cache":   {"type": "dir", "ephemeral": true},
        "ref":         {"type": "mount", "grant": "refdata", "read_only": true}},
     "environment": {"LANG": "C.UTF-8", "TOKEN": {"value": "s3cr3t", "secret": true}}}

Trust model.  Manifests may be written by untrusted authors; the host
application that applies them is trusted and alone decides which host
directories may be read (``MaterializeOptions(base_dir=..., extra_path_grants=...)``
in :mod:`sandbox_fs.materialize`).  :func:`load_manifest` with
``trust="untrusted"`` (the default) therefore refuses a manifest that carries
its own ``extra_path_grants`` or ``base_dir`` (the host-access fields), and
unknown fields are refused everywhere (``extra="forbid"``), so no spelling
of "give me more host access" slips through.  The ``root`` field is only a
*request*: the library never opens a host path taken from a manifest (the
caller passes the workspace :class:`~sandbox_fs.root.Root`); the
``sandbox-fs apply`` command honours it because the command-line user, who
chose the manifest file, is the trusted party there (``--root`` overrides it).

Destination rules (zip slip, CVE-2007-4559 analogue): a destination is a
relative POSIX sandbox path; it is normalized (``.``, ``//`` and a trailing
``/`` removed) and refused when it is empty, absolute, holds ``..``, a NUL
byte or a backslash, has a component over 255 bytes or is over 4096 bytes.
No two entries may land on the same path, and an entry may sit beneath
another entry only when that one is a ``dir`` (so a ``local_dir``, an
``archive`` or a ``symlink`` can never be written through or overlapped).

Symlink targets (see :func:`check_link_target`): relative only, ``..`` only
as a leading prefix, and the lexical resolution from the link's directory
stays inside the workspace.  Forbidding ``..`` after a normal component is
what makes the lexical check sound even when some components are
themselves symlinks (``a/l/..`` where ``a/l -> ..`` would climb out).

Mount entries (``{"type": "mount", "grant": NAME}``) expose an extra path
grant of the application, named ``NAME`` (``Grant(path, read_only,
name=NAME)``), at their destination through the FUSE overlay: a manifest
names a grant, never a host path, and can only name one the application
gave, read-only unless it says ``"read_only": false`` *and* the grant is
read-write (checked when the manifest is applied, by
:func:`sandbox_fs.materialize.plan_mounts`, since only then are the grants
known).  Nothing may lie beneath a mount entry; it is never persisted in a
snapshot and never cleared by a restore.

Modes are permission bits within 0o777 (setuid, setgid and sticky are never
set, PEP 706's data filter rule); default 0o644 for files, 0o755 for
directories, executables only when asked.  Environment values may be
``secret``: they are redacted (``***``) in ``repr``, in JSON output and in
:meth:`Manifest.digest`, unless explicitly revealed.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from typing import Annotated, Any, Iterator, Literal, Mapping, Sequence, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    StrictBool,
    StrictInt,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)

from pydantic_core import PydanticSerializationError

from . import _hosts
from .errors import SandboxError
from .paths import GRANT_NAME_PATTERN
from .root import MAX_NAME_BYTES, MAX_PATH_BYTES

__all__ = [
    "Manifest",
    "load_manifest",
    "ManifestError",
    "ManifestTrustError",
    "File",
    "Dir",
    "LocalFile",
    "LocalDir",
    "Symlink",
    "Archive",
    "Mount",
    "Entry",
    "EnvValue",
    "FlatEntry",
    "Network",
    "check_destination",
    "check_link_target",
    "check_untrusted_environment",
    "REFUSED_ENV_NAMES",
    "REFUSED_ENV_PREFIXES",
    "MAX_MANIFEST_BYTES",
    "MAX_ENTRIES",
    "MAX_INLINE_BYTES",
]

MAX_MANIFEST_BYTES = 64 << 20  # bytes of manifest JSON text
MAX_ENTRIES = 100_000  # entries after flattening dir children
MAX_DIR_DEPTH = 64  # nesting of dir children
MAX_INLINE_BYTES = 64 << 20  # total bytes of inline ``file`` content (decoded)
MAX_PATTERNS = 256  # include + exclude patterns of one local_dir
_REDACTED = "***"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

#: Fields only a trusted manifest may carry: they would widen host access.
TRUSTED_ONLY_FIELDS = ("extra_path_grants", "base_dir")

#: Environment name prefixes an untrusted manifest may not set: the dynamic
#: loader's variables (ld.so(8): ``LD_PRELOAD``, ``LD_LIBRARY_PATH``,
#: ``LD_AUDIT`` ... load code into every dynamically linked program).
REFUSED_ENV_PREFIXES = ("LD_",)

#: Environment names an untrusted manifest may not set: each makes a program
#: load code, or parse files, that the program itself did not name.
#:
#: * glibc's list of variables it strips for set-id programs (``unsecvars.h``)
#:   except ``TMPDIR`` (the workspace's own, which a manifest may point
#:   elsewhere in it): ``GCONV_PATH`` (iconv modules: the pkexec escape,
#:   CVE-2021-4034), ``GLIBC_TUNABLES`` (CVE-2023-4911), ``GETCONF_DIR``,
#:   ``HOSTALIASES``, ``LOCALDOMAIN``, ``LOCPATH``, ``MALLOC_TRACE``,
#:   ``NIS_PATH``, ``NLSPATH``, ``RESOLV_HOST_CONF``, ``RES_OPTIONS``,
#:   ``TZDIR``;
#: * shells: ``BASH_ENV`` and ``ENV`` (a file sourced by every non-interactive
#:   bash / interactive sh), ``SHELLOPTS``, ``BASHOPTS``, ``PS4`` (expanded,
#:   command substitutions included, under ``set -x``), ``PROMPT_COMMAND``;
#: * interpreters, each a file or module run before the program or options
#:   injected into every run: Python ``PYTHONSTARTUP``, ``PYTHONPATH``,
#:   ``PYTHONHOME``, ``PYTHONBREAKPOINT``, ``PYTHONUSERBASE``; Perl
#:   ``PERL5OPT``, ``PERL5LIB``, ``PERLLIB``, ``PERL5DB``; Ruby ``RUBYOPT``,
#:   ``RUBYLIB``; Node ``NODE_OPTIONS``, ``NODE_PATH``; the JVM
#:   ``JAVA_TOOL_OPTIONS``, ``_JAVA_OPTIONS``, ``JDK_JAVA_OPTIONS``; Lua
#:   ``LUA_INIT`` (and ``LUA_INIT_5_x``, by prefix), ``LUA_PATH``, ``LUA_CPATH``.
#:
#: Why refuse what only reaches a confined command: the command's
#: environment is applied at its ``execve``, after every confinement step
#: (the exec helper itself always runs with an empty environment), so none
#: of these widens the sandbox; but the host application may run its *own*
#: trusted tools in the workspace with the manifest's environment, and a
#: manifest author must not be able to make them run the author's code.  A
#: trusted manifest (``load_manifest(trust="trusted")``) and the
#: application's own ``env`` passed to ``run_confined`` may set them.
REFUSED_ENV_NAMES = frozenset({
    "GCONV_PATH", "GETCONF_DIR", "GLIBC_TUNABLES", "HOSTALIASES", "LOCALDOMAIN", "LOCPATH",
    "MALLOC_TRACE", "NIS_PATH", "NLSPATH", "RESOLV_HOST_CONF", "RES_OPTIONS", "TZDIR",
    "BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "PS4", "PROMPT_COMMAND",
    "PYTHONSTARTUP", "PYTHONPATH", "PYTHONHOME", "PYTHONBREAKPOINT", "PYTHONUSERBASE",
    "PERL5OPT", "PERL5LIB", "PERLLIB", "PERL5DB", "RUBYOPT", "RUBYLIB", "NODE_OPTIONS", "NODE_PATH",
    "JAVA_TOOL_OPTIONS", "_JAVA_OPTIONS", "JDK_JAVA_OPTIONS", "LUA_INIT", "LUA_PATH", "LUA_CPATH",
})
_REFUSED_ENV_NAME_PREFIXES = REFUSED_ENV_PREFIXES + ("LUA_INIT_", "LUA_PATH_", "LUA_CPATH_")


class ManifestError(SandboxError, ValueError):
    """A manifest is malformed or breaks a rule.

    ``context["field"]`` names the offending field (``entries['a/b'].mode``
    style); ``sandbox_path`` is the destination involved, if any.
    """

    code = "invalid_manifest"
    retryable = False

    def __init__(self, reason: str, *, field: str | None = None, sandbox_path: str | None = None,
                 **kw: Any) -> None:
        ctx = dict(kw.pop("context", None) or {})
        if field is not None:
            ctx["field"] = field
        self.field = field
        shown = f"{field}: {reason}" if field else reason
        super().__init__(shown, sandbox_path=sandbox_path, context=ctx, **kw)


class ManifestTrustError(ManifestError):
    """A manifest asks for host access the application did not give.

    An untrusted manifest carries a trusted-only field or a loader
    environment variable; or a ``mount`` entry names a grant the application
    did not give, or asks read-write access to a read-only grant
    (``context["grant"]`` is the name; no host path is shown).
    """

    code = "manifest_untrusted_field"


# --------------------------------------------------------------------------- rules


def _field(dest: str, name: str | None = None) -> str:
    return f"entries[{dest!r}]" + (f".{name}" if name else "")


def check_destination(raw: Any, *, field: str = "entries") -> str:
    """Validate and normalize one destination (a workspace-relative sandbox path).

    Args:
        raw: the untrusted destination key (``str``).
        field: the field name reported in the error.

    Returns:
        The normalized path: no ``.``, empty components or trailing ``/``.

    Raises:
        ManifestError: not a string; empty or only ``.``; absolute; a ``..``
            component; a NUL byte or a backslash; a component over 255 bytes
            or a path over 4096 bytes (PATH_MAX / NAME_MAX).
    """
    if not isinstance(raw, str):
        raise ManifestError("a destination must be a string", field=field)
    shown = raw.replace("\0", "\\0")[:200]
    if "\0" in raw:
        raise ManifestError("destination contains a NUL byte", field=field, sandbox_path=shown)
    if "\\" in raw:
        raise ManifestError("destination contains a backslash (not portable, a zip slip vector)",
                            field=field, sandbox_path=shown)
    if raw.startswith("/"):
        raise ManifestError("destination must be relative to the workspace, not absolute",
                            field=field, sandbox_path=shown)
    try:
        size = len(raw.encode("utf-8", "surrogateescape"))
    except UnicodeEncodeError:
        raise ManifestError("destination is not encodable", field=field) from None
    if size > MAX_PATH_BYTES:
        raise ManifestError(f"destination is over {MAX_PATH_BYTES} bytes", field=field,
                            sandbox_path=shown[:64] + "...")
    parts = []
    for comp in raw.split("/"):
        if comp in ("", "."):
            continue
        if comp == "..":
            raise ManifestError("destination may not contain '..'", field=field, sandbox_path=shown)
        if len(comp.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
            raise ManifestError(f"a destination component is over {MAX_NAME_BYTES} bytes",
                                field=field, sandbox_path=shown[:64] + "...")
        parts.append(comp)
    if not parts:
        raise ManifestError("destination names the workspace root itself", field=field, sandbox_path=shown)
    return "/".join(parts)


def check_link_target(link_path: str, target: Any, *, field: str = "target") -> str:
    """Check that symlink ``target``, placed at ``link_path``, resolves inside the tree.

    The rule (applied to manifest ``symlink`` entries against the workspace
    root, and to symlinks inside a ``local_dir`` against the copied tree):
    the target is relative, non-empty, free of NUL, and ``..`` components may
    only form a leading prefix; the number of leading ``..`` may not exceed
    the depth of the link's directory.  Because no ``..`` follows a normal
    component, a symlink met while resolving can only lead *down* into a
    place that obeys the same rule, so the lexical check is sound by
    induction (the ``a/l/..`` trick of CVE-2021-32803-style link chains
    cannot climb out).

    Args:
        link_path: normalized relative path of the link inside its tree.
        target: the untrusted target text (``str``).
        field: the field name reported in the error.

    Returns:
        The target text with ``.`` and empty components removed.

    Raises:
        ManifestError: absolute, empty, NUL, over 4096 bytes, ``..`` after a
            normal component, or climbing above the tree.
    """
    if not isinstance(target, str) or not target or "\0" in target:
        raise ManifestError("symlink target must be a non-empty string without NUL", field=field,
                            sandbox_path=link_path)
    if len(target.encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES:
        raise ManifestError(f"symlink target is over {MAX_PATH_BYTES} bytes", field=field, sandbox_path=link_path)
    if target.startswith("/"):
        raise ManifestError("symlink target must be relative (absolute targets leave the workspace)",
                            field=field, sandbox_path=link_path)
    comps = [c for c in target.split("/") if c not in ("", ".")]
    ups = 0
    while ups < len(comps) and comps[ups] == "..":
        ups += 1
    if any(c == ".." for c in comps[ups:]):
        raise ManifestError("symlink target may use '..' only as a leading prefix", field=field,
                            sandbox_path=link_path)
    depth = len([c for c in link_path.split("/") if c]) - 1
    if ups > depth:
        raise ManifestError("symlink target resolves outside the tree", field=field, sandbox_path=link_path)
    if not comps:
        return "."
    return "/".join(comps)


def _check_mode(value: int | None, default_kind: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("mode must be an integer (e.g. 420 for 0o644)")
    if value < 0 or value & ~0o777:
        raise ValueError(f"mode {value:#o} is outside 0o777: setuid, setgid and sticky bits are never set")
    return value


# --------------------------------------------------------------------------- entries


class _EntryBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    ephemeral: bool = Field(False, description="Re-created on every session start; never saved in snapshots.")


class File(_EntryBase):
    """Inline file content.

    Attributes:
        content: UTF-8 text, or base64 text when ``encoding == "base64"``.
        encoding: ``"utf-8"`` (default) or ``"base64"``.
        mode: permission bits within 0o777 (default 0o644; executables only when asked).
    """

    type: Literal["file"] = "file"
    content: str = ""
    encoding: Literal["utf-8", "base64"] = "utf-8"
    mode: StrictInt | None = Field(None, description="Permission bits within 0o777; default 0o644.")

    _v_mode = field_validator("mode")(lambda cls, v: _check_mode(v, "file"))

    @model_validator(mode="after")
    def _content_decodes(self) -> "File":
        if self.encoding == "base64":
            try:
                base64.b64decode(self.content, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError("content is not valid base64") from None
        else:
            try:
                self.content.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("content is not valid UTF-8 text") from None
        return self

    def data(self) -> bytes:
        """The decoded content (``bytes``)."""
        if self.encoding == "base64":
            return base64.b64decode(self.content, validate=True)
        return self.content.encode("utf-8")

    def decoded_size(self) -> int:
        """Size in bytes of the decoded content, without decoding base64."""
        if self.encoding == "base64":
            n = len(self.content)
            return n // 4 * 3 - self.content[-2:].count("=") if n else 0
        return len(self.content.encode("utf-8"))


class Dir(_EntryBase):
    """A directory, optionally with nested children (``{relative path: entry}``).

    Attributes:
        mode: permission bits within 0o777 (default 0o755).
        children: nested entries; their keys follow the destination rules
            and are joined under this directory.
    """

    type: Literal["dir"] = "dir"
    mode: StrictInt | None = Field(None, description="Permission bits within 0o777; default 0o755.")
    children: dict[str, "Entry"] = Field(default_factory=dict)

    _v_mode = field_validator("mode")(lambda cls, v: _check_mode(v, "dir"))


class LocalFile(_EntryBase):
    """A host file copied from beneath the trusted base directory (or an application grant).

    Attributes:
        src: path relative to the trusted base directory, or an absolute path
            under one of the application's extra path grants.  Resolved at use
            time beneath a Root; a final symlink is refused.
        mode: permission bits within 0o777; default: the source's bits with
            setuid/setgid/sticky cleared.
    """

    type: Literal["local_file"] = "local_file"
    src: str
    mode: StrictInt | None = None

    _v_mode = field_validator("mode")(lambda cls, v: _check_mode(v, "file"))
    _v_src = field_validator("src")(lambda cls, v: _check_src(v))


class LocalDir(_EntryBase):
    """A host directory tree copied from beneath the trusted base (or a grant).

    Attributes:
        src: as for :class:`LocalFile`.
        include: glob patterns (``pathlib.PurePosixPath.match`` semantics,
            matched from the right: ``"*.py"`` matches at any depth); when
            given, only matching files are copied.
        exclude: glob patterns; a matching file is skipped, a matching
            directory is pruned.
        symlinks: ``"refuse"`` (default): a symlink whose target does not
            stay inside the copied tree (see :func:`check_link_target`)
            fails the entry before anything is written; ``"skip"``: such a
            symlink is left out and reported.  A symlink that stays inside is
            reproduced as a symlink in both cases.
        special_files: ``"refuse"`` (default) or ``"skip"`` for FIFOs,
            sockets and device nodes (PEP 706); they are never opened.
    """

    type: Literal["local_dir"] = "local_dir"
    src: str
    include: list[str] = Field(default_factory=list)
    exclude: list[str] = Field(default_factory=list)
    symlinks: Literal["refuse", "skip"] = "refuse"
    special_files: Literal["refuse", "skip"] = "refuse"

    _v_src = field_validator("src")(lambda cls, v: _check_src(v))

    @field_validator("include", "exclude")
    @classmethod
    def _patterns(cls, v: list[str]) -> list[str]:
        if len(v) > MAX_PATTERNS:
            raise ValueError(f"at most {MAX_PATTERNS} patterns")
        for p in v:
            if not p or "\0" in p or len(p) > 1024 or p.startswith("/"):
                raise ValueError("a pattern must be a non-empty relative glob without NUL, at most 1024 chars")
        return v


class Symlink(_EntryBase):
    """A symlink whose target must resolve inside the workspace (see :func:`check_link_target`)."""

    type: Literal["symlink"] = "symlink"
    target: str


class Archive(_EntryBase):
    """A host tar or zip archive extracted with :mod:`sandbox_fs.archive` at the destination.

    Attributes:
        src: as for :class:`LocalFile`.
        format: ``"auto"`` (sniffed) or an explicit format name understood by
            the archive extractor (``"tar"``, ``"tar.gz"``, ``"zip"`` ...).
        limits: ``{limit name: int}``; each value can only *narrow* the
            application's ``ArchiveLimits`` (the smaller value wins).
    """

    type: Literal["archive"] = "archive"
    src: str
    format: str = "auto"
    limits: dict[str, int] = Field(default_factory=dict)

    _v_src = field_validator("src")(lambda cls, v: _check_src(v))

    @field_validator("format")
    @classmethod
    def _fmt(cls, v: str) -> str:
        if not re.fullmatch(r"[a-z0-9.]{1,16}", v):
            raise ValueError("format must be 'auto' or a short format name like 'tar.gz' or 'zip'")
        return v

    @field_validator("limits")
    @classmethod
    def _lim(cls, v: dict[str, int]) -> dict[str, int]:
        for k, n in v.items():
            if not re.fullmatch(r"[a-z_][a-z0-9_]{0,63}", k):
                raise ValueError(f"bad limit name {k[:64]!r}")
            if isinstance(n, bool) or n < 0:
                raise ValueError(f"limit {k} must be a non-negative integer")
        return v


class Mount(_EntryBase):
    """An application grant exposed at the destination through the FUSE overlay (never copied).

    Materialized as an empty placeholder directory that the overlay serves
    the grant's directory at; never persisted in a snapshot, never cleared
    by a restore, and refused without the overlay.

    Attributes:
        grant: the name of one of the application's extra path grants
            (:data:`~sandbox_fs.paths.GRANT_NAME_PATTERN`); a name the
            application did not give is refused when the manifest is applied.
        read_only: True (default): the mount is read-only.  False is allowed
            only when the grant itself is read-write.
    """

    type: Literal["mount"] = "mount"
    grant: str = Field(pattern=f"^{GRANT_NAME_PATTERN}$")
    read_only: StrictBool = True


Entry = Annotated[Union[File, Dir, LocalFile, LocalDir, Symlink, Archive, Mount], Field(discriminator="type")]
Dir.model_rebuild()


def _check_src(v: str) -> str:
    """A source is a relative path beneath the base or an absolute path (only valid under a grant)."""
    if not v or "\0" in v:
        raise ValueError("src must be a non-empty path without NUL")
    if len(v.encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES:
        raise ValueError(f"src is over {MAX_PATH_BYTES} bytes")
    if any(c == ".." for c in v.split("/")):
        raise ValueError("src may not contain '..' (sources stay beneath the trusted base or a grant)")
    absolute = v.startswith("/")
    body = "/".join(c for c in v.split("/") if c not in ("", "."))
    if not body and not absolute:
        return "."
    return ("/" + body) if absolute else body


# ------------------------------------------------------------------- environment


class Network(BaseModel):
    """What a manifest asks of the network: ``{"allow_hosts": ["pypi.org", "*.pythonhosted.org:443"]}``.

    Only a request: :meth:`Manifest.egress_hosts` grants an entry only when
    an entry of the application's list covers it (see
    :mod:`sandbox_fs._hosts` for the ``NAME[:PORT]`` syntax).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    allow_hosts: list[str] = Field(default_factory=list)

    @field_validator("allow_hosts")
    @classmethod
    def _hosts(cls, v: list[str]) -> list[str]:
        _hosts.parse_hosts(v)  # ValueError: a malformed entry, or too many
        return v


class EnvValue(BaseModel):
    """One environment value; ``secret=True`` keeps it out of every printed or serialized form.

    ``repr()``/``str()`` show ``***`` for a secret.  JSON output
    (``model_dump``/``Manifest.to_json``) shows ``***`` unless the
    serialization context has ``{"reveal_secrets": True}``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    value: str
    secret: bool = False

    @field_validator("value")
    @classmethod
    def _no_nul(cls, v: str) -> str:
        if "\0" in v:
            raise ValueError("environment values may not contain NUL")
        try:  # what execve's os.fsencode does: a lone surrogate outside \udc80-\udcff is no byte string
            v.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            raise ValueError("environment values must be encodable (no lone surrogate)") from None
        return v

    @field_serializer("value")
    def _ser_value(self, v: str, info: SerializationInfo) -> str:
        ctx = info.context or {}
        if self.secret and not ctx.get("reveal_secrets"):
            return _REDACTED
        return v

    def __repr__(self) -> str:
        return f"EnvValue(value={_REDACTED if self.secret else self.value!r}, secret={self.secret})"

    __str__ = __repr__


# ---------------------------------------------------------------------- manifest


class FlatEntry(BaseModel):
    """One entry after flattening ``dir`` children: its full destination and inherited ``ephemeral``."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    path: str
    entry: Any
    ephemeral: bool
    field: str


class Manifest(BaseModel):
    """A workspace manifest.  Build with :func:`load_manifest` for untrusted input.

    Attributes:
        root: the requested workspace host directory.  Only a request: the
            library never opens it (see the module docstring).
        entries: ``{destination: entry}``; destinations are normalized.
        environment: ``{NAME: value or EnvValue}`` (plain strings become
            non-secret :class:`EnvValue`).
        description: free text.
        extra_path_grants: trusted manifests only; never used by
            :func:`~sandbox_fs.materialize.materialize` (the application
            passes grants in ``MaterializeOptions``).
        base_dir: trusted manifests only; same remark.

    Raises (on construction):
        ManifestError: a destination, overlap, nesting, size or count rule is broken.
        pydantic.ValidationError: a field has the wrong type or value
            (:func:`load_manifest` turns it into a ManifestError).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1] = 1
    root: str | None = None
    description: str | None = None
    entries: dict[str, Entry] = Field(default_factory=dict)
    environment: dict[str, EnvValue] = Field(default_factory=dict)
    extra_path_grants: list[dict[str, Any]] | None = Field(
        None, description="Trusted manifests only (refused by load_manifest(trust='untrusted')).")
    base_dir: str | None = Field(None, description="Trusted manifests only.")
    network: Network | None = None

    @field_validator("root")
    @classmethod
    def _root(cls, v: str | None) -> str | None:
        if v is not None and (not v or "\0" in v or len(v) > MAX_PATH_BYTES):
            raise ValueError("root must be a non-empty path without NUL")
        return v

    @field_validator("environment", mode="before")
    @classmethod
    def _env_before(cls, v: Any) -> Any:
        if isinstance(v, Mapping):
            return {k: ({"value": x} if isinstance(x, str) else x) for k, x in v.items()}
        return v

    @field_validator("environment")
    @classmethod
    def _env_names(cls, v: dict[str, EnvValue]) -> dict[str, EnvValue]:
        for k in v:
            if not _ENV_NAME.match(k):
                raise ValueError(f"environment name {k[:64]!r} is not [A-Za-z_][A-Za-z0-9_]*")
        return v

    @field_validator("entries")
    @classmethod
    def _normalize_entries(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _normalize_keys(v, "entries", 0)

    @model_validator(mode="after")
    def _check_tree(self) -> "Manifest":
        flat = list(self.iter_entries())
        if len(flat) > MAX_ENTRIES:
            raise ManifestError(f"more than {MAX_ENTRIES} entries", field="entries")
        kinds: dict[str, str] = {}
        inline = 0
        for fe in flat:
            if fe.path in kinds:
                raise ManifestError("two entries have the same destination", field=fe.field, sandbox_path=fe.path)
            kinds[fe.path] = fe.entry.type
        for fe in flat:
            parts = fe.path.split("/")
            for i in range(1, len(parts)):
                anc = "/".join(parts[:i])
                k = kinds.get(anc)
                if k is not None and k != "dir":
                    raise ManifestError(f"destination lies beneath a {k} entry ({anc!r}); only a dir may hold entries",
                                        field=fe.field, sandbox_path=fe.path)
            if isinstance(fe.entry, Symlink):
                check_link_target(fe.path, fe.entry.target, field=fe.field + ".target")
            if isinstance(fe.entry, File):
                inline += fe.entry.decoded_size()
                if inline > MAX_INLINE_BYTES:
                    raise ManifestError(f"inline file content is over {MAX_INLINE_BYTES} bytes in total",
                                        field=fe.field + ".content", sandbox_path=fe.path)
        return self

    @model_validator(mode="after")
    def _serializable(self) -> "Manifest":
        """Every text field serializes, as the session's saved state and :meth:`digest` will serialize it.

        A lone surrogate (a JSON escape such as ``"\\ud800"``) in a
        description or a symlink target parsed, and the session then ran the
        command and failed to save its state (an internal error, nothing
        persisted): refused here, before anything is materialized or run.
        """
        try:
            self.model_dump_json(context={"reveal_secrets": True})
        except PydanticSerializationError:
            raise ManifestError("a text field holds a lone surrogate (no UTF-8 text)", field="manifest") from None
        return self

    # ------------------------------------------------------------------ views

    def iter_entries(self) -> Iterator[FlatEntry]:
        """Yield every entry with its full destination, parents before children."""
        stack: list[tuple[str, str, Any, bool]] = [
            (key, _field(key), ent, False) for key, ent in reversed(list(self.entries.items()))]
        while stack:
            path, fld, ent, eph = stack.pop()
            eph = eph or ent.ephemeral
            yield FlatEntry(path=path, entry=ent, ephemeral=eph, field=fld)
            if isinstance(ent, Dir):
                for ck, ce in reversed(list(ent.children.items())):
                    stack.append((f"{path}/{ck}", f"{fld}.children[{ck!r}]", ce, eph))

    def ephemeral_paths(self) -> list[str]:
        """Sorted sandbox paths of ephemeral entries (an ephemeral dir's children included).

        Snapshots (persist) skip these paths and everything beneath them.
        """
        return sorted(fe.path for fe in self.iter_entries() if fe.ephemeral)

    def mount_entries(self) -> list[FlatEntry]:
        """The ``mount`` entries (:class:`Mount`) with their full destinations, parents first."""
        return [fe for fe in self.iter_entries() if isinstance(fe.entry, Mount)]

    def mount_paths(self) -> list[str]:
        """Sorted sandbox paths of the ``mount`` entries (for ``Session.register_mount``)."""
        return sorted(fe.path for fe in self.mount_entries())

    def egress_hosts(self, permitted: Sequence[str]) -> tuple[str, ...]:
        """The hosts a command of this manifest may reach (``ConfinementPolicy.allow_hosts``).

        The application's ``permitted`` list is the ceiling: without a
        ``network`` request it is returned as given; with one, only the
        request, every entry of which must lie within ``permitted`` (a name
        or pattern some permitted entry covers, on its ports).  Trusted or
        not, a manifest never widens what the application allows.

        Args:
            permitted: the application's ``NAME[:PORT]`` entries.

        Raises:
            ManifestTrustError: a requested entry lies outside ``permitted``
                (``context["hosts"]`` lists them, at most 10).
            ValueError: ``permitted`` holds a malformed entry.
        """
        if self.network is None:
            return tuple(permitted)
        asked = self.network.allow_hosts
        refused = _hosts.outside(asked, permitted)
        if refused:
            shown = ", ".join(ascii(h[:64]) for h in refused[:3]) + (" ..." if len(refused) > 3 else "")
            raise ManifestTrustError(f"the manifest asks for hosts the application does not allow: {shown}",
                                     field="network.allow_hosts", context={"hosts": refused[:10]})
        return tuple(asked)

    def environment_values(self) -> dict[str, str]:
        """The real environment values (secrets included) for the process layer; never print this."""
        return {k: v.value for k, v in self.environment.items()}

    def secret_values(self) -> list[str]:
        """The secret environment values, for :func:`sandbox_fs.errors.redact`."""
        return [v.value for v in self.environment.values() if v.secret]

    def to_json(self, *, reveal_secrets: bool = False, indent: int | None = None) -> str:
        """JSON text of the manifest; secret values are ``***`` unless ``reveal_secrets``.

        Round trip: ``load_manifest(m.to_json(reveal_secrets=True)) == m``.
        """
        return self.model_dump_json(indent=indent, exclude_none=True, exclude_defaults=False,
                                    context={"reveal_secrets": reveal_secrets})

    def canonical_json(self) -> str:
        """Canonical JSON used by :meth:`digest`: sorted keys, no whitespace, secrets redacted, no ``root``."""
        data = self.model_dump(mode="json", exclude={"root"}, context={"reveal_secrets": False})
        return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    def digest(self) -> str:
        """Stable SHA-256 hex digest of :meth:`canonical_json` (snapshot fingerprints).

        ``root`` is left out (the same manifest materialized elsewhere has the
        same digest) and secret values are redacted (a digest must not become
        an oracle for guessing a low-entropy secret).  The text is encoded
        as UTF-8 with ``surrogatepass``: a lone surrogate (a symlink target
        or description a JSON escape or ``surrogateescape`` made) is digested
        as its own three bytes, never an error (``surrogatepass`` is
        injective, and text without surrogates encodes as plain UTF-8).
        """
        return hashlib.sha256(self.canonical_json().encode("utf-8", "surrogatepass")).hexdigest()

    def __repr__(self) -> str:
        return f"Manifest(entries={len(self.entries)}, environment={sorted(self.environment)!r}, root={self.root!r})"

    __str__ = __repr__


def _normalize_keys(v: Mapping[str, Any], where: str, depth: int) -> dict[str, Any]:
    if depth > MAX_DIR_DEPTH:
        raise ManifestError(f"dir children nest deeper than {MAX_DIR_DEPTH}", field=where)
    out: dict[str, Any] = {}
    for key, ent in v.items():
        fld = f"{where}[{key!r}]" if isinstance(key, str) else where
        norm = check_destination(key, field=fld)
        if norm in out:
            raise ManifestError("two entries have the same destination", field=fld, sandbox_path=norm)
        if isinstance(ent, Dir) and ent.children:
            ent = ent.model_copy(update={"children": _normalize_keys(ent.children, fld + ".children", depth + 1)})
        out[norm] = ent
    return out


# ------------------------------------------------------------------------ loading


def check_untrusted_environment(names: Any) -> None:
    """Refuse loader and interpreter-injection variables in an untrusted manifest's environment.

    Args:
        names: the environment's names (an iterable of ``str``; other items
            are left to the model's own checks).

    Raises:
        ManifestTrustError: a name starts with one of
            :data:`REFUSED_ENV_PREFIXES` (``LD_*``: ld.so(8)) or is in
            :data:`REFUSED_ENV_NAMES`; the error's field names the key
            (``environment['LD_PRELOAD']``), never its value.
    """
    for name in names:
        if isinstance(name, str) and (name in REFUSED_ENV_NAMES or name.startswith(_REFUSED_ENV_NAME_PREFIXES)):
            raise ManifestTrustError(
                f"an untrusted manifest may not set {name[:64]!r}: it makes programs load code "
                "or files they did not name (loader or interpreter hook)",
                field=f"environment[{name[:64]!r}]")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ManifestError("a JSON object repeats a key", field=str(k)[:200])
        out[k] = v
    return out


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("file", "dir", "local_file", "local_dir", "symlink", "archive", "mount") and out.endswith("]"):
            continue  # the discriminator tag pydantic inserts
        elif out and (out.endswith("entries") or out.endswith("children") or out.endswith("environment")
                      or out.endswith("limits")):
            out += f"[{part!r}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "manifest"


def load_manifest(data: str | bytes | Mapping[str, Any] | Manifest, *,
                  trust: Literal["untrusted", "trusted"] = "untrusted") -> Manifest:
    """Parse and validate a manifest.

    Args:
        data: JSON text (``str`` or ``bytes``, at most 64 MiB), an already
            parsed mapping, or a :class:`Manifest`.
        trust: ``"untrusted"`` (default) refuses the trusted-only fields
            ``extra_path_grants`` and ``base_dir``; ``"trusted"`` accepts them
            (they are still never *used* by ``materialize``).

    Returns:
        The validated :class:`Manifest` with normalized destinations.

    Raises:
        ManifestTrustError: an untrusted manifest carries a trusted-only field,
            or its environment sets a loader or interpreter-injection
            variable (:func:`check_untrusted_environment`; the error names
            the key).
        ManifestError: not JSON; a repeated JSON key; nesting too deep;
            larger than 64 MiB; any model or destination rule broken (the
            error names the field, e.g. ``entries['a'].mode``).
    """
    if trust not in ("untrusted", "trusted"):
        raise ValueError("trust must be 'untrusted' or 'trusted'")
    if isinstance(data, Manifest):
        if trust == "untrusted":
            for name in TRUSTED_ONLY_FIELDS:
                if getattr(data, name) is not None:
                    raise ManifestTrustError("an untrusted manifest may not widen host access", field=name)
            check_untrusted_environment(data.environment)
        return data
    if isinstance(data, (str, bytes, bytearray)):
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest is over {MAX_MANIFEST_BYTES} bytes", field="manifest")
        try:
            data = json.loads(data, object_pairs_hook=_no_duplicate_keys)
        except ManifestError:
            raise
        except RecursionError:
            raise ManifestError("manifest JSON nests too deeply", field="manifest") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise ManifestError(f"manifest is not valid JSON ({type(exc).__name__})", field="manifest") from None
    if not isinstance(data, Mapping):
        raise ManifestError("manifest must be a JSON object", field="manifest")
    if trust == "untrusted":
        for name in TRUSTED_ONLY_FIELDS:
            if name in data:
                raise ManifestTrustError(
                    "an untrusted manifest may not widen host access; only the application grants host paths",
                    field=name)
        env = data.get("environment")
        if isinstance(env, Mapping):
            check_untrusted_environment(env)
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        err = exc.errors(include_url=False, include_input=False)[0]
        original = (err.get("ctx") or {}).get("error")
        if isinstance(original, ManifestError):
            raise original from None
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        field = _loc(tuple(err.get("loc", ())))
        raise ManifestError(msg, field=field) from None
    except RecursionError:
        raise ManifestError("manifest nests too deeply", field="entries") from None
