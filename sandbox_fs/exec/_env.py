"""The confined command's environment: an allow-list, the caller's entries, handed over as a memfd."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Iterable, Mapping

from ._errors import InvalidEnvError

if TYPE_CHECKING:  # pragma: no cover
    from ..root import Root

#: Host environment names copied to the child (exact names; ``LC_*`` by prefix).
#: ``PATH`` is not one of them: the child's default is :data:`DEFAULT_PATH`.
ENV_ALLOWLIST = ("LANG", "LANGUAGE", "TERM", "TZ", "COLORTERM", "NO_COLOR")
_ENV_PREFIXES = ("LC_",)
#: The child's ``PATH`` unless the caller's environment sets one: fixed system
#: directories, never the host's ``PATH`` (which may name directories outside
#: the system set, or writable ones).
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"
#: Bounds of the environment blob (native/sfs_exec.c: SFS_MAX_ENV, SFS_MAX_ENV_ENTRIES).
MAX_ENV_BYTES = 1 << 20
MAX_ENV_ENTRIES = 4096

#: Workspace directories used as ``HOME`` and ``TMPDIR`` (created when missing).
HOME_DIR = ".home"
TMP_DIR = ".tmp"


def build_env(caller_env: Mapping[str, str] | None, *, workspace_host_path: str,
              host_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Build a child's environment: the allow-list from the host, then the caller's entries.

    The result is the *command's* environment, applied only at its
    ``execve`` after every confinement step; the exec helper itself always
    runs with an empty environment.  The caller (the application) is trusted
    with any name, ``LD_PRELOAD`` included: it affects only the confined
    command.  An untrusted manifest's loader and interpreter hooks are
    refused earlier, by :func:`sandbox_fs.manifest.load_manifest`.

    Args:
        caller_env: entries from the application or manifest; they override
            the allow-list (``HOME``/``TMPDIR``/``PATH`` included).
        workspace_host_path: the workspace's host path (trusted, from the
            application); ``HOME`` is ``<it>/.home`` and ``TMPDIR``
            ``<it>/.tmp`` unless ``caller_env`` sets them.
        host_env: the host environment (``os.environ`` when None).  Only
            :data:`ENV_ALLOWLIST` names and ``LC_*`` are copied; ``PATH`` is
            :data:`DEFAULT_PATH` unless ``caller_env`` sets it.

    Returns:
        A new ``dict[str, str]``.

    Raises:
        InvalidEnvError: a name is empty or holds ``=`` or NUL, or a value
            holds NUL (the error names the entry, never its value).
    """
    host = os.environ if host_env is None else host_env
    env = {k: v for k, v in host.items() if k in ENV_ALLOWLIST or k.startswith(_ENV_PREFIXES)}
    env["PATH"] = DEFAULT_PATH
    base = workspace_host_path.rstrip("/") or "/"
    env["HOME"] = f"{base}/{HOME_DIR}"
    env["TMPDIR"] = f"{base}/{TMP_DIR}"
    for k, v in (caller_env or {}).items():
        if not isinstance(k, str) or not isinstance(v, str) or not k or "=" in k or "\0" in k or "\0" in v:
            raise InvalidEnvError("environment names must be non-empty without '=' or NUL, values without NUL",
                                  context={"name": str(k)[:64]})
        env[k] = v
    return env

def env_blob_fd(env: Mapping[str, str], secrets: Iterable[str]) -> int:
    """A memfd holding ``env`` as NUL-terminated ``KEY=VALUE`` entries, for ``--env-fd``.

    Data for the helper, which applies it at the command's ``execve`` only:
    never argv (``/proc/PID/cmdline`` is world-readable) nor the helper's own
    environment (its loader runs before it confines itself).

    Raises:
        InvalidEnvError: over :data:`MAX_ENV_BYTES` bytes or
            :data:`MAX_ENV_ENTRIES` entries, or not encodable.
    """
    try:
        blob = b"".join(f"{k}={v}".encode("utf-8", "surrogateescape") + b"\0" for k, v in env.items())
    except UnicodeEncodeError:
        raise InvalidEnvError("an environment entry is not encodable", secrets=secrets) from None
    if len(blob) > MAX_ENV_BYTES or len(env) > MAX_ENV_ENTRIES:
        raise InvalidEnvError(f"the environment is over {MAX_ENV_BYTES} bytes or {MAX_ENV_ENTRIES} entries",
                              context={"entries": len(env)}, secrets=secrets)
    fd = os.memfd_create("sfs-env", os.MFD_CLOEXEC)
    try:
        view = memoryview(blob)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        raise
    return fd

def ensure_dirs(workspace: Root) -> None:
    if workspace.read_only:
        return
    for name in (HOME_DIR, TMP_DIR):
        try:
            workspace.mkdir(name, 0o700, exist_ok=True)
        except FileExistsError:
            pass
