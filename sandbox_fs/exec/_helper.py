"""The ``sfs-exec`` helper's interface: where it is, its environment, its status pipe.

The helper (``native/sfs_exec.c``) is a small single-threaded C program
that applies every confinement step to itself and ``execve``\\ s the
command.  It reports on a status pipe: "pid N MODE" (it forked its init),
then "ok" (the command reached ``execve``) or a failure "STAGE ERRNO", then
"exit WSTATUS" when the init ends.
"""

from __future__ import annotations

import errno
import os
import subprocess
from typing import TYPE_CHECKING, Iterable, Mapping

import trio

from .._features import lowered
from ..errors import redact
from ._errors import CommandNotFoundError, ConfinementError, ExecError

if TYPE_CHECKING:  # pragma: no cover
    from ._prepare import Prepared

#: The exec helper's own environment, whatever the caller's: empty.  The
#: helper starts as root with every capability and (when dynamically linked)
#: runs the loader before main() confines it, so nothing from a manifest or
#: the caller (``LD_PRELOAD``, ``GLIBC_TUNABLES`` ...) may reach it; the
#: command's environment is handed over as data (``--env-fd``).
_HELPER_ENV: Mapping[str, str] = {}

#: Bytes of the status pipe kept (its lines are short).
_STATUS_MAX = 256


def helper_path() -> str:
    """Host path of the ``sfs-exec`` helper shipped inside the package."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sfs-exec")


def helper_or_raise(secrets: Iterable[str]) -> str:
    path = helper_path()
    if not os.access(path, os.X_OK):
        raise ConfinementError("the exec helper sandbox_fs/sfs-exec is missing; reinstall the package",
                               secrets=secrets)
    return path


_RO_MOUNTS: bool | None = None


def ro_mounts_available(helper: str) -> bool:
    """Can the helper make the read-only mount layer?  Root: yes.  Otherwise probed once
    (a user namespace is needed; some systems disable them, and ``SANDBOX_FS_DEGRADE=userns``
    takes them as disabled)."""
    global _RO_MOUNTS
    if os.geteuid() == 0:
        return True
    if not lowered().has("userns"):
        return False
    if _RO_MOUNTS is None:
        try:
            _RO_MOUNTS = subprocess.run([helper, "--ro-mounts", "--", "true"], stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        env=_HELPER_ENV, timeout=10).returncode == 0
        except (OSError, subprocess.SubprocessError):
            _RO_MOUNTS = False
    return _RO_MOUNTS


_STAGE_TEXT = {
    "landlock": "applying the Landlock ruleset failed",
    "no_new_privs": "setting no_new_privs failed",
    "capabilities": "dropping capabilities failed",
    "cgroup": "joining the cgroup failed",
    "unshare": "creating namespaces failed",
    "rlimit": "setting an rlimit failed",
    "setsid": "starting a new session failed",
    "tty": "making the PTY the controlling terminal failed",
    "cwd": "changing to the working directory failed",
    "proc_self": "granting /proc/self failed",
    "mounts": "making the mounts outside the workspace read-only failed",
    "mask": "hiding a host directory (cgroupfs) from the child failed",
    "netns": "joining the supervisor's network or IPC namespace failed",
    "seccomp": "installing the seccomp filter failed",
    "keyring": "joining a fresh session keyring failed",
    "env": "handing the environment to the exec helper failed",
    "pids": "joining the cgroup v1 pids leaf failed",
    "usage": "the exec helper was called wrongly",
    "identity": "switching to the unprivileged identity failed",
    "reach": "making a granted tree reachable for the unprivileged identity failed",
    "privroot": "building the command's private root failed",
    "guard": "mounting over a protected or unreadable path failed",
    "device": "placing a granted device node in the command's mount namespace failed",
}


def _status_error(status: bytes, argv0: str, prep: Prepared) -> ExecError:
    try:
        stage, err_s = status.decode("ascii", "replace").split()[:2]
        err = int(err_s)
    except ValueError:
        stage, err = "unknown", 0
    name = errno.errorcode.get(err, str(err))
    shown = redact(argv0, prep.secrets)
    if stage == "exec":
        if err in (errno.ENOENT, errno.ENOTDIR):
            return CommandNotFoundError(f"program not found: {shown}", sandbox_path=prep.cwd_shown,
                                        context={"errno": name}, secrets=prep.secrets)
        if err == errno.EACCES:
            return CommandNotFoundError(
                f"program not executable inside the sandbox: {shown} (outside the system set and every grant?)",
                sandbox_path=prep.cwd_shown, context={"errno": name}, secrets=prep.secrets)
        return ExecError(f"starting {shown} failed ({name})", sandbox_path=prep.cwd_shown,
                         context={"errno": name}, secrets=prep.secrets)
    if stage == "cwd":
        return ExecError("changing to the working directory failed", sandbox_path=prep.cwd_shown,
                         context={"errno": name}, secrets=prep.secrets)
    return ConfinementError(f"{_STAGE_TEXT.get(stage, 'the exec helper failed')} ({name})",
                            sandbox_path=prep.cwd_shown, context={"stage": stage, "errno": name},
                            secrets=prep.secrets)


_STATUS_TIMEOUT_S = 30.0


class _Status:
    """The helper's status pipe.

    Lines: "pid N MODE" (the helper forked its init), then "ok" (the command
    reached ``execve``) or a failure "STAGE ERRNO", then "exit WSTATUS"
    when the init ends.  Without ``--init`` the helper writes a failure
    line or nothing (EOF at ``execve``).
    """

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self.fd = fd
        self.data = b""
        self.eof = False
        self.exit_status: int | None = None

    @property
    def stream(self) -> int | None:
        return self.fd if self.fd >= 0 else None

    def _read_now(self) -> bool:
        """Read what is there without blocking; False when it would block."""
        while not self.eof and self.fd >= 0 and len(self.data) < _STATUS_MAX:
            try:
                chunk = os.read(self.fd, _STATUS_MAX)
            except BlockingIOError:
                return False
            if not chunk:
                self.eof = True
            self.data += chunk
        return True

    async def read_line(self) -> bytes | None:
        """Read until a full line or EOF; returns the line, or None at EOF with nothing pending."""
        while b"\n" not in self.data and not self.eof and self.fd >= 0 and len(self.data) < _STATUS_MAX:
            if not self._read_now() and b"\n" not in self.data:
                try:
                    await trio.lowlevel.wait_readable(self.fd)
                except trio.ClosedResourceError:
                    break
        if b"\n" in self.data:
            line, _, self.data = self.data.partition(b"\n")
            return line
        line, self.data = self.data, b""
        return line or None

    async def startup(self) -> bytes:
        """The command's start: b"" once it reached ``execve`` (or at EOF), else the failure line."""
        line = await self.read_line()
        return b"" if line in (None, b"ok") else line.strip()

    async def rest(self) -> bytes:
        """Everything up to EOF (EOF comes at the target's execve or its failure exit)."""
        while not self.eof and self.fd >= 0 and len(self.data) < _STATUS_MAX:
            if not self._read_now():
                try:
                    await trio.lowlevel.wait_readable(self.fd)
                except trio.ClosedResourceError:
                    break
        await self.aclose()
        return self.data.strip()

    def take_exit(self) -> int | None:
        """After the init was reaped: the command's raw wait status from the "exit" line, or None."""
        self._read_now()
        for line in self.data.split(b"\n"):
            if line.startswith(b"exit "):
                try:
                    self.exit_status = int(line.split()[1])
                except (IndexError, ValueError):
                    pass
        self.data = b"\n".join(ln for ln in self.data.split(b"\n") if not ln.startswith(b"exit "))
        return self.exit_status

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            trio.lowlevel.notify_closing(fd)
            os.close(fd)

    async def aclose(self) -> None:
        self.close()
        await trio.lowlevel.checkpoint_if_cancelled()
