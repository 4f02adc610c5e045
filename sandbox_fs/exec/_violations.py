"""Violation reports: what a confined command was denied (:attr:`ExecResult.violations`).

Source: Landlock's denial logging (ABI 7) through the audit subsystem.  The
helper restricts the command with ``LANDLOCK_RESTRICT_SELF_LOG_NEW_EXEC_ON``
(denials after ``execve`` are logged; the kernel's default logs only those
before it) and sets its comm to a random per-run *tag* just before
``landlock_restrict_self``: the kernel copies that comm into the domain's
audit details, and the ``AUDIT_LANDLOCK_DOMAIN`` record that introduces the
domain (in the same audit event as its first denial) carries it.  The host
reads the audit multicast group (``AUDIT_NLGRP_READLOG``; root, or
``CAP_AUDIT_READ``) on a socket of its own per run and keeps only records of
the domain its tag names: never another session's, never the host's.

One denial is one audit event (one serial): ``AUDIT_LANDLOCK_ACCESS``
(``domain=``, ``blockers=``, the path or port), the domain record the first
time, then ``AUDIT_SYSCALL`` (the denied process's host pid and the
syscall's ``exit=-errno``) and ``AUDIT_EOE``.  When the command's tree is
gone the watch sends itself a user record (the *barrier*) and reads until it
comes back: the audit queue is one FIFO, so every denial made before the
command exited has arrived by then.  If its domain appeared, it then waits
(bounded) for the domain's ``status=deallocated denials=N`` record: ``N`` is
the kernel's own count of the domain's denials, so records the audit backlog
lost are counted in :attr:`ExecResult.violations_dropped` too.

Audit must be enabled (``audit_enabled=1``); this module never enables it by
itself (:func:`enable_audit` is an explicit, host-wide step: see SECURITY.md,
"Violation reports").  Proxy refusals and other host-side denials are added
with :meth:`ViolationLog.add`.
"""

from __future__ import annotations

import errno as _errno
import secrets
import socket
import struct
import time
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import trio

#: Landlock ABI that has ``landlock_restrict_self`` log flags.
LOG_MIN_ABI = 7
#: ``LANDLOCK_RESTRICT_SELF_LOG_NEW_EXEC_ON``: also log denials after execve.
RESTRICT_SELF_LOG_FLAGS = 1 << 1
#: Violations kept per run; more are counted in ``violations_dropped``.
DEFAULT_CAPACITY = 256

_NETLINK_AUDIT = 9
_AUDIT_NLGRP_READLOG = 1
_AUDIT_GET, _AUDIT_SET = 1000, 1001
_AUDIT_SYSCALL, _AUDIT_EOE = 1300, 1320
_AUDIT_TRUSTED_APP = 1121
_AUDIT_LANDLOCK_ACCESS, _AUDIT_LANDLOCK_DOMAIN = 1423, 1424
_NLMSG_ERROR = 2
_NLM_F_REQUEST, _NLM_F_ACK = 1, 4
_NLMSG_HDR = struct.Struct("=IHHII")
_RCVBUF = 8 << 20
#: Events of not-yet-identified domains kept while waiting for their domain record.
_MAX_PENDING_EVENTS = 4096
_BARRIER_TIMEOUT_S = 2.0
_DEALLOC_TIMEOUT_S = 1.0

#: Landlock blocker names -> the operation shown.
_OPS = {
    "fs.execute": "execute", "fs.write_file": "write", "fs.read_file": "read", "fs.read_dir": "readdir",
    "fs.remove_dir": "rmdir", "fs.remove_file": "unlink", "fs.make_char": "mknod", "fs.make_block": "mknod",
    "fs.make_dir": "mkdir", "fs.make_reg": "create", "fs.make_sock": "mksock", "fs.make_fifo": "mkfifo",
    "fs.make_sym": "symlink", "fs.refer": "rename", "fs.truncate": "truncate", "fs.ioctl_dev": "ioctl",
    "net.connect_tcp": "connect", "net.bind_tcp": "bind", "scope.signal": "signal",
    "scope.abstract_unix_socket": "connect_unix", "ptrace": "ptrace", "fs.change_topology": "mount",
}


class Violation(NamedTuple):
    """One denied operation of a confined command (or one refusal on its behalf).

    Attributes:
        op: what was denied: ``"read"``, ``"write"``, ``"create"``,
            ``"execute"``, ``"connect"``, ``"bind"``, ``"signal"``, ...
            (Landlock's blocker names mapped to these; several joined with
            ``","``), or what a host-side component passes (``"connect"``
            for the egress proxy).
        target: the path as the command saw it (its mount namespace), or
            ``"ADDRESS:PORT"``/``"HOST:PORT"``; raw, possibly hostile text:
            shown only through :func:`escape_text`.
        errno: the error the command got (``EACCES`` ...; 0 when unknown).
        pid: the denied process's pid in the host's pid namespace (0 when
            unknown: e.g. a proxy refusal).
    """

    op: str
    target: str
    errno: int
    pid: int

    def to_json(self) -> dict[str, object]:
        """``{"op", "target", "errno", "error", "pid"}`` (``error``: the errno name, or ``""``)."""
        return {"op": self.op, "target": self.target, "errno": self.errno,
                "error": _errno.errorcode.get(self.errno, "") if self.errno else "", "pid": self.pid}


class ViolationLog:
    """A bounded list of violations plus a count of those dropped.

    Thread-unsafe; one per run (or per session for the egress proxy's refusals).

    Args:
        capacity: violations kept (int >= 0); later ones are only counted.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._items: list[Violation] = []
        self._dropped = 0

    def add(self, op: str, target: str, errno: int = 0, pid: int = 0) -> None:
        """Record one violation (or count it as dropped once ``capacity`` are kept).

        Args:
            op: the operation (``"connect"`` ...), a short name.
            target: path or ``HOST:PORT`` (raw; escaped on display).
            errno: the error the command saw (0: unknown / not an errno).
            pid: host pid of the process (0: unknown).
        """
        if len(self._items) < self.capacity:
            self._items.append(Violation(str(op), str(target), int(errno), int(pid)))
        else:
            self._dropped += 1

    def count_dropped(self, n: int) -> None:
        """Count ``n`` (>= 0) violations known to have happened but not recorded."""
        self._dropped += max(0, int(n))

    @property
    def violations(self) -> tuple[Violation, ...]:
        return tuple(self._items)

    @property
    def dropped(self) -> int:
        return self._dropped

    def __len__(self) -> int:
        return len(self._items) + self._dropped


def add_proxy_refusals(violations: tuple[Violation, ...], dropped: int, events: Iterable[Any],
                       capacity: int) -> tuple[tuple[Violation, ...], int]:
    """``(violations, dropped)`` grown by the egress proxy's refused attempts.

    Args:
        violations, dropped: the run's kernel-reported ones so far.
        events: ``EgressEvent``s (``host``, ``port``, ``allowed``); each not
            ``allowed`` becomes ``Violation("connect", "HOST:PORT", 0, 0)``
            (no errno: the command got a proxy refusal, not a syscall error;
            the event's ``reason`` stays in ``ExecResult.egress``).
        capacity: the bound (``policy.max_violations``); the rest are counted.
    """
    log = ViolationLog(capacity)
    for v in violations:
        log.add(*v)
    log.count_dropped(dropped)
    for ev in events:
        if not ev.allowed:
            host = str(ev.host)
            log.add("connect", f"[{host}]:{ev.port}" if ":" in host else f"{host}:{ev.port}")
    return log.violations, log.dropped


# --- display ------------------------------------------------------------

def escape_text(text: str, limit: int = 200) -> str:
    """``text`` safe for one terminal line: control characters, backslashes and
    non-printable characters as ``\\n``, ``\\xNN``, ``\\uNNNN``; longer than
    ``limit`` characters (after escaping) cut with ``...``."""
    out: list[str] = []
    for ch in text:
        if ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ch.isprintable():
            out.append(ch)
        elif ord(ch) < 0x100:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(f"\\u{ord(ch):04x}" if ord(ch) < 0x10000 else f"\\U{ord(ch):08x}")
    s = "".join(out)
    return s if len(s) <= limit else s[:limit] + "..."


def _cut(entry: str, limit: int = 160) -> str:
    return entry if len(entry) <= limit else entry[:limit] + "..."


def violation_summary(violations: tuple[Violation, ...], dropped: int = 0, *, shown: int = 5,
                      escape: Callable[[str], str] = escape_text) -> str:
    """One line for stderr: ``"3 denials: write /etc/hosts, connect 10.0.0.1:443, read /x"``.

    Args:
        violations: :attr:`ExecResult.violations`.
        dropped: :attr:`ExecResult.violations_dropped` (counted in the total).
        shown: entries listed (at most), then ``"and N more"``.
        escape: makes one name safe for a terminal line (default
            :func:`escape_text`; the CLI passes its own rule); a ``,`` is
            escaped after it as ``\\x2c``, so a name cannot fake an entry.

    Returns:
        The line without a newline; ``""`` when there is nothing to report.
    """
    total = len(violations) + dropped
    if total == 0:
        return ""
    parts = [_cut(f"{escape(v.op)} {escape(v.target)}".replace(",", "\\x2c")) for v in violations[:shown]]
    more = total - len(parts)
    line = f"{total} denial{'s' if total != 1 else ''}: " + ", ".join(parts)
    if more:
        line += f" and {more} more" if parts else f"and {more} more"
    return line


# --- audit records --------------------------------------------------------

def _fields(text: str) -> dict[str, str]:
    """``key=value`` pairs of an audit record's text (values unquoted; hex strings left as they are)."""
    out: dict[str, str] = {}
    for word in text.split():
        key, sep, value = word.partition("=")
        if sep and key not in out:
            out[key] = value
    return out


def _untrusted(value: str) -> str:
    """A value logged by ``audit_log_untrustedstring``: ``"text"``, or hex when it held odd bytes."""
    if len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1]
    try:
        return bytes.fromhex(value).decode("utf-8", "backslashreplace")
    except ValueError:
        return value


def _serial(text: str) -> tuple[str, str]:
    """``("SERIAL", rest)`` of ``"audit(SEC.MS:SERIAL): rest"`` (``("", text)`` if malformed)."""
    if text.startswith("audit(") and "): " in text:
        head, _, rest = text.partition("): ")
        return head.rpartition(":")[2], rest
    return "", text


def _messages(data: bytes) -> Iterator[tuple[int, bytes]]:
    """``(type, payload)`` of each netlink message in one datagram."""
    off = 0
    while off + _NLMSG_HDR.size <= len(data):
        length, mtype, _, _, _ = _NLMSG_HDR.unpack_from(data, off)
        if length < _NLMSG_HDR.size:
            return
        yield mtype, data[off + _NLMSG_HDR.size:off + length]
        off += (length + 3) & ~3


def _records(data: bytes) -> Iterator[tuple[int, str]]:
    """``(type, text)`` of each audit record in one datagram."""
    for mtype, body in _messages(data):
        yield mtype, body.rstrip(b"\0").decode("utf-8", "replace")


def _int(value: str) -> int:
    """A decimal field's value, 0 when absent or malformed."""
    return int(value) if value.isdigit() else 0


def _target(f: dict[str, str]) -> str:
    if "path" in f:
        return _untrusted(f["path"])
    if "name" in f:
        return _untrusted(f["name"])
    for addr, port in (("daddr", "dest"), ("saddr", "src"), ("laddr", "lport"), ("faddr", "fport")):
        if addr in f or port in f:
            host = f.get(addr, "")
            return f"[{host}]:{f.get(port, '')}" if ":" in host else f"{host}:{f.get(port, '')}"
    if "opid" in f:
        return f"pid {f['opid']}"
    return ""


class _Event:
    """One audit event (one serial) of a Landlock denial, while its records arrive."""

    __slots__ = ("domain", "op", "target", "errno", "pid")

    def __init__(self, domain: str, op: str, target: str) -> None:
        self.domain, self.op, self.target = domain, op, target
        self.errno, self.pid = _errno.EACCES, 0


# --- the host's side ------------------------------------------------------

def _request(mtype: int, payload: bytes = b"") -> bytes | None:
    """One audit netlink request to the kernel; the reply's payload (None on refusal)."""
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_AUDIT) as s:
            s.settimeout(1.0)
            s.bind((0, 0))
            s.send(_NLMSG_HDR.pack(_NLMSG_HDR.size + len(payload), mtype, _NLM_F_REQUEST | _NLM_F_ACK, 1, 0)
                   + payload)
            while True:
                for rtype, body in _messages(s.recv(65536)):
                    if rtype == _NLMSG_ERROR:
                        if struct.unpack_from("=i", body)[0] != 0:
                            return None
                        if mtype != _AUDIT_GET:
                            return b""  # the acknowledgement is the answer
                    elif rtype == mtype:
                        return body
    except OSError:
        return None


def audit_enabled() -> bool:
    """True when the kernel's audit subsystem is enabled (``AUDIT_GET``; False if it cannot be asked)."""
    body = _request(_AUDIT_GET)
    return body is not None and len(body) >= 8 and struct.unpack_from("=II", body)[1] != 0


def enable_audit(enabled: bool = True) -> bool:
    """Turn the kernel's audit subsystem on (or off): a **host-wide** change.

    Needs ``CAP_AUDIT_CONTROL``.  Every process forked afterwards gets a
    syscall audit context for good (until reboot, even after turning it
    off), and with no audit daemon records go to the kernel log (rate
    limited).  See SECURITY.md, "Violation reports".  Returns True when the
    kernel accepted the change.
    """
    payload = struct.pack("=11I", 1, 1 if enabled else 0, *([0] * 9))  # mask AUDIT_STATUS_ENABLED
    return _request(_AUDIT_SET, payload) is not None


class AuditWatch:
    """One run's reader of Landlock denial records (see the module docstring).

    Made by :meth:`open` before the spawn (so no record of the run is
    missed); :meth:`pump` reads while the command runs; :meth:`finish`
    after its tree is gone.  Always :meth:`close` it.
    """

    def __init__(self, sock: socket.socket, capacity: int) -> None:
        self.tag = "sfs" + secrets.token_hex(6)  # 15 bytes: a comm's size
        self._sock = sock
        self.log = ViolationLog(capacity)
        self._barrier = "sandbox-fs-barrier=" + secrets.token_hex(8)
        self._domains: set[str] = set()
        self._pending: dict[str, _Event] = {}
        self._unknown: dict[str, list[_Event]] = {}
        self._n_unknown = 0
        self._seen = 0
        self._reported: dict[str, int] = {}
        self._barrier_seen = False
        self.lost = False  # the socket overflowed (ENOBUFS): records were lost

    @classmethod
    def open(cls, capacity: int = DEFAULT_CAPACITY) -> AuditWatch | None:
        """A watch bound to the audit read-log group, or None where it cannot report.

        None when the audit subsystem is off (:func:`audit_enabled`), or the
        socket is refused (no ``CAP_AUDIT_READ``, no audit support).
        """
        if not audit_enabled():
            return None
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC,
                                 _NETLINK_AUDIT)
        except OSError:
            return None
        try:
            try:
                sock.setsockopt(socket.SOL_SOCKET, 33, _RCVBUF)  # SO_RCVBUFFORCE (root)
            except OSError:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RCVBUF)
            sock.bind((0, 1 << (_AUDIT_NLGRP_READLOG - 1)))
        except OSError:
            sock.close()
            return None
        return cls(sock, capacity)

    def close(self) -> None:
        self._sock.close()

    # -- reading --

    def _drain(self, limit: int = 512) -> bool:
        """Read what is queued now, at most ``limit`` datagrams (non-blocking: the
        caller's next wait yields to the other tasks); False when nothing was."""
        got = False
        for _ in range(limit):
            try:
                data = self._sock.recv(65536)
            except BlockingIOError:
                return got
            except OSError as e:
                if e.errno == _errno.ENOBUFS:
                    self.lost = True
                    continue
                return got
            got = True
            for mtype, text in _records(data):
                self._record(mtype, text)
        return got

    async def pump(self) -> None:
        """Read records until cancelled (run beside the command)."""
        while True:
            await trio.lowlevel.wait_readable(self._sock)
            self._drain()

    async def finish(self) -> None:
        """After the command's tree is gone: read every record it caused (bounded waits)."""
        self._drain()
        # A sender waits in the kernel while the audit backlog is full: a worker thread's wait.
        if await trio.to_thread.run_sync(self._send_barrier):
            deadline = time.monotonic() + _BARRIER_TIMEOUT_S
            while not self._barrier_seen and time.monotonic() < deadline:
                with trio.move_on_after(deadline - time.monotonic()):
                    await trio.lowlevel.wait_readable(self._sock)
                self._drain()
        deadline = time.monotonic() + _DEALLOC_TIMEOUT_S
        while self._domains - set(self._reported) and time.monotonic() < deadline:
            with trio.move_on_after(deadline - time.monotonic()):
                await trio.lowlevel.wait_readable(self._sock)
            self._drain()
        for ev in list(self._pending.values()):
            self._finalize(ev)
        self._pending.clear()
        # The kernel's count of the domain's denials covers records the audit
        # backlog lost, as well as those past the capacity.
        total = sum(self._reported.values())
        if total > self._seen:
            self.log.count_dropped(total - self._seen)

    def _send_barrier(self) -> bool:
        text = self._barrier.encode() + b"\0"  # the kernel drops the last byte as a terminator
        msg = _NLMSG_HDR.pack(_NLMSG_HDR.size + len(text), _AUDIT_TRUSTED_APP, _NLM_F_REQUEST, 0, 0) + text
        try:
            with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_AUDIT) as s:
                s.bind((0, 0))
                s.send(msg)
            return True
        except OSError:
            return False

    def _record(self, mtype: int, text: str) -> None:
        serial, rest = _serial(text)
        if mtype == _AUDIT_LANDLOCK_ACCESS:
            f = _fields(rest)
            ops = [_OPS.get(b, b) for b in f.get("blockers", "").split(",") if b]
            ev = _Event(f.get("domain", ""), ",".join(ops), _target(f))
            if serial in self._pending:
                self._finalize(self._pending.pop(serial))
            self._pending[serial] = ev
            if len(self._pending) > _MAX_PENDING_EVENTS:
                self._finalize(self._pending.pop(next(iter(self._pending))))
        elif mtype == _AUDIT_LANDLOCK_DOMAIN:
            f = _fields(rest)
            domain = f.get("domain", "")
            if f.get("status") == "allocated" and _untrusted(f.get("comm", "")) == self.tag:
                self._domains.add(domain)
                for ev in self._unknown.pop(domain, ()):
                    self._keep(ev)
            elif f.get("status") == "deallocated" and domain in self._domains:
                self._reported[domain] = _int(f.get("denials", ""))
        elif mtype == _AUDIT_SYSCALL and serial in self._pending:
            f = _fields(rest)
            ev = self._pending[serial]
            ev.pid = _int(f.get("pid", ""))
            code = f.get("exit", "")
            if code.startswith("-") and code[1:].isdigit():
                ev.errno = int(code[1:])
        elif mtype == _AUDIT_EOE and serial in self._pending:
            self._finalize(self._pending.pop(serial))
        elif mtype == _AUDIT_TRUSTED_APP and self._barrier in rest:
            self._barrier_seen = True

    def _finalize(self, ev: _Event) -> None:
        if ev.domain in self._domains:
            self._keep(ev)
        elif self._n_unknown < _MAX_PENDING_EVENTS:
            # Its domain record may come later (the first one was lost to the backlog).
            self._unknown.setdefault(ev.domain, []).append(ev)
            self._n_unknown += 1

    def _keep(self, ev: _Event) -> None:
        self._seen += 1
        self.log.add(ev.op, ev.target, ev.errno, ev.pid)
