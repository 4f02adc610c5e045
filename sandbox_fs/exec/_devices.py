"""Device nodes a confined command may use (:attr:`ConfinementPolicy.devices`) and driver families.

The host opens each granted node ``O_PATH`` by the trusted host-path rule
(:func:`sandbox_fs.root.open_host_device_fd`: no symlink on any component,
the node itself a character or block device); the command then gets
Landlock ``READ_FILE | WRITE_FILE | IOCTL_DEV`` on exactly those inodes and,
from the mount layer, a bind of each node at its path without ``nodev``.
A driver family (:data:`DEVICE_FAMILIES`) adds the control nodes of one
driver that exist on this host and the read-only ``/sys`` and ``/proc``
paths its user-space library reads.  Nothing here opens a device for I/O:
no driver code runs on the host.
"""

from __future__ import annotations

import fnmatch
import os
import stat
from dataclasses import dataclass, field
from typing import Sequence

from ..errors import SandboxError
from ._errors import ConfinementError
from . import _landlock

#: Most device nodes one run may be granted (the helper's bound too).
MAX_DEVICES = 32
#: Most read-only paths the families of one run may add.
MAX_FAMILY_PATHS = 32


class DeviceError(ConfinementError):
    """A device grant was refused: not an absolute plain path, a symlink on the path, not a
    character or block device, missing, an unknown driver family or one absent from this host,
    too many nodes, or a node the mount layer cannot place."""

    code = "device_refused"


@dataclass(frozen=True)
class DeviceFamily:
    """What one driver's user-space stack needs besides the per-device nodes the caller lists.

    Attributes:
        name: the family's name in :attr:`ConfinementPolicy.device_families`.
        present: a host path whose existence says the driver is loaded (else the family is refused).
        devices: control device nodes, granted read-write-ioctl when they exist (others skipped).
        device_globs: ``(directory, pattern)``: every device node in directory whose name matches.
        read_paths: directories (or files) under ``/sys`` and ``/proc`` granted read-only when they exist.
    """

    name: str
    present: str
    devices: tuple[str, ...] = ()
    device_globs: tuple[tuple[str, str], ...] = ()
    read_paths: tuple[str, ...] = ()


#: The driver families (documented, path by path, in SECURITY.md "Devices").
DEVICE_FAMILIES: dict[str, DeviceFamily] = {
    "nvidia": DeviceFamily(
        "nvidia", "/dev/nvidiactl",
        devices=("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset"),
        read_paths=("/proc/driver/nvidia", "/sys/module/nvidia", "/sys/module/nvidia_uvm",
                    "/sys/module/nvidia_modeset", "/sys/bus/pci/devices", "/sys/devices/system/memory"),
    ),
    "dri": DeviceFamily(
        "dri", "/sys/class/drm",
        device_globs=(("/dev/dri", "renderD*"),),
        read_paths=("/sys/class/drm", "/sys/dev/char", "/sys/bus/pci/devices", "/sys/devices"),
    ),
    "amd": DeviceFamily(
        "amd", "/dev/kfd",
        devices=("/dev/kfd",),
        device_globs=(("/dev/dri", "renderD*"),),
        read_paths=("/sys/class/kfd", "/sys/class/drm", "/sys/dev/char", "/sys/module/amdgpu",
                    "/sys/bus/pci/devices", "/sys/devices"),
    ),
}


def check_device_path(path: str, what: str) -> str:
    """``path`` if it is absolute and plain (no empty, ``.`` or ``..`` component, no NUL, not ``/``).

    Raises:
        DeviceError: it is not.
    """
    if not isinstance(path, str) or not path.startswith("/") or path == "/" or "\0" in path or len(path) >= 4096:
        raise DeviceError(f"{what} must be an absolute host path")
    if any(c in ("", ".", "..") for c in path[1:].split("/")):
        raise DeviceError(f"{what} must be a plain absolute path (no empty, '.' or '..' component)")
    return path


def check_policy_devices(devices: Sequence[str], families: Sequence[str]) -> None:
    """Validate the policy fields' shapes (no file-system access).

    Raises:
        DeviceError: a path is not plain and absolute, a family is unknown, or more than :data:`MAX_DEVICES`.
    """
    if isinstance(devices, str) or isinstance(families, str):
        raise DeviceError("devices and device_families are sequences of strings, not one string")
    for i, p in enumerate(devices):
        check_device_path(p, f"devices[{i}]")
    for name in families:
        if name not in DEVICE_FAMILIES:
            raise DeviceError(f"unknown driver family {name!r} (known: {', '.join(sorted(DEVICE_FAMILIES))})")
    if len(devices) > MAX_DEVICES:
        raise DeviceError(f"at most {MAX_DEVICES} device nodes per run")


@dataclass
class OpenedDevices:
    """The ``O_PATH`` fds of one run's device grants (owned; :meth:`close` them).

    Attributes:
        nodes: ``(fd, path)`` of each device node, deduplicated by inode.
        read_paths: ``(fd, path, is_dir)`` of each family's read-only path.
    """

    nodes: list[tuple[int, str]] = field(default_factory=list)
    read_paths: list[tuple[int, str, bool]] = field(default_factory=list)

    def close(self) -> None:
        for fd in [n[0] for n in self.nodes] + [r[0] for r in self.read_paths]:
            try:
                os.close(fd)
            except OSError:
                pass
        self.nodes, self.read_paths = [], []

    def add_rules(self, ruleset: _landlock.Ruleset, abi: int) -> None:
        """Landlock: read, write and ``IOCTL_DEV`` (ABI >= 5) on each node; read on each read path."""
        node_access = (_landlock.FS_READ_FILE | _landlock.FS_WRITE_FILE | _landlock.FS_IOCTL_DEV) & _landlock.fs_mask(abi)
        for fd, _path in self.nodes:
            ruleset.add_fd(fd, node_access)
        for fd, _path, is_dir in self.read_paths:
            ruleset.add_fd(fd, _landlock.FS_READ_FILE | (_landlock.FS_READ_DIR if is_dir else 0))


def _open_node(path: str, label: str, out: OpenedDevices, seen: set[tuple[int, int]]) -> None:
    from ..root import open_host_device_fd  # noqa: PLC0415  (root imports exec lazily)

    from ..errors import SymlinkRefusedError  # noqa: PLC0415

    try:
        fd = open_host_device_fd(path, label=label)
    except SymlinkRefusedError:
        raise DeviceError(f"{label} refused: the path or a directory on it is a symlink (give the physical "
                          "path; symlinks are never followed for devices)") from None
    except SandboxError as exc:
        raise DeviceError(f"{label} refused: {getattr(exc, 'reason', None) or exc.code}") from None
    except OSError as exc:
        raise DeviceError(f"{label} refused: {os.strerror(exc.errno or 0)}") from None
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) in seen:
        os.close(fd)
        return
    seen.add((st.st_dev, st.st_ino))
    if len(out.nodes) >= MAX_DEVICES:
        os.close(fd)
        raise DeviceError(f"at most {MAX_DEVICES} device nodes per run")
    out.nodes.append((fd, path))


def _glob_nodes(directory: str, pattern: str) -> list[str]:
    """Names of the device nodes in a fixed system directory matching pattern (sorted)."""
    try:
        # host-access: a family's fixed system device directory (/dev/dri), listed by name only
        names = os.listdir(directory)
    except OSError:
        return []
    out = []
    for name in sorted(names):
        if not fnmatch.fnmatchcase(name, pattern):
            continue
        try:
            st = os.lstat(os.path.join(directory, name))  # host-access: same fixed directory; opened by rule after
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
            out.append(os.path.join(directory, name))
    return out


def _open_read_path(path: str, out: OpenedDevices) -> None:
    """A family's read-only path: skipped when missing; a symlink on it is refused."""
    from ..root import open_host_dir_fd  # noqa: PLC0415

    try:
        st = os.lstat(path)  # host-access: a family's fixed /sys or /proc path (kind only; opened by rule below)
    except OSError:
        return
    if stat.S_ISDIR(st.st_mode):
        try:
            fd = open_host_dir_fd(path, label=f"family path {path}")
        except (SandboxError, OSError):
            raise DeviceError(f"the driver family path {path} could not be opened without following a symlink") from None
        out.read_paths.append((fd, path, True))
    elif stat.S_ISREG(st.st_mode):
        # host-access: fixed kernel file of a family (/sys, /proc): O_PATH, never read here
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        out.read_paths.append((fd, path, False))


def open_devices(devices: Sequence[str], families: Sequence[str]) -> OpenedDevices:
    """Open every device node and family path of a policy; the caller closes the result.

    Raises:
        DeviceError: see :class:`DeviceError` (every fd opened so far is closed).
    """
    check_policy_devices(devices, families)
    out = OpenedDevices()
    seen: set[tuple[int, int]] = set()
    try:
        for i, path in enumerate(devices):
            _open_node(path, f"devices[{i}]", out, seen)
        for name in dict.fromkeys(families):
            fam = DEVICE_FAMILIES[name]
            if not os.path.lexists(fam.present):  # host-access: a fixed driver path: is the driver loaded?
                raise DeviceError(f"driver family {name!r} is not present on this host")
            nodes = [p for p in fam.devices if os.path.lexists(p)]  # host-access: fixed driver nodes
            for d, pattern in fam.device_globs:
                nodes += _glob_nodes(d, pattern)
            for path in nodes:
                _open_node(path, f"{name} device {os.path.basename(path)}", out, seen)
            for path in fam.read_paths:
                if path not in {p for _fd, p, _d in out.read_paths}:
                    _open_read_path(path, out)
            if len(out.read_paths) > MAX_FAMILY_PATHS:
                raise DeviceError(f"at most {MAX_FAMILY_PATHS} family paths per run")
    except BaseException:
        out.close()
        raise
    return out
