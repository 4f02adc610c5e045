"""The seccomp filter's Python side: the helper's ``--seccomp`` bits and the socket allow-list.

The filter itself (the syscall allow-list, modelled on Docker's default
profile) is built by the helper, ``native/sfs_exec.c``; Python chooses the
socket ``(family, type, protocol)`` triples a policy allows and the optional
bits.  See "Namespaces and the seccomp filter" in SECURITY.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from ._models import ConfinementPolicy

# The helper's --seccomp bits (native/sfs_exec.c); the allow-list itself is always installed.
_SECCOMP_KEYS = 1   # join a fresh session keyring first
_SECCOMP_TCP = 2    # MSG_FASTOPEN sends and TCP_FASTOPEN_CONNECT refused

# (family, type) pairs for the helper's --socket rules; protocol None: any.
_AF_UNIX, _AF_INET, _AF_INET6, _AF_NETLINK = 1, 2, 10, 16
_SOCK_STREAM, _SOCK_DGRAM, _SOCK_RAW, _SOCK_SEQPACKET = 1, 2, 3, 5
_IPPROTO_ICMP, _IPPROTO_TCP, _IPPROTO_UDP, _IPPROTO_ICMPV6 = 1, 6, 17, 58
_NETLINK_ROUTE = 0
_MAX_SOCKET_RULES = 32  # SFS_MAX_SOCKETS in native/sfs_exec.c


def socket_args(policy: "ConfinementPolicy") -> list[str]:
    """The rules of :meth:`ConfinementPolicy.socket_args` (see there)."""
    rules: list[tuple[str, int, int, int | None]] = [
        ("p", _AF_UNIX, _SOCK_STREAM, None), ("p", _AF_UNIX, _SOCK_SEQPACKET, None)]
    inet = (_AF_INET, _AF_INET6)
    if policy.unrestricted_tcp or policy.allow_tcp_connect or policy.allow_tcp_bind or policy.allow_hosts:
        rules += [("s", af, _SOCK_STREAM, p) for af in inet for p in (0, _IPPROTO_TCP)]
    if policy.allow_unix_sockets:
        rules += [("s", _AF_UNIX, t, None) for t in (_SOCK_STREAM, _SOCK_DGRAM, _SOCK_SEQPACKET)]
        rules.append(("p", _AF_UNIX, _SOCK_DGRAM, None))
    if policy.allow_udp:
        rules += [("s", af, _SOCK_DGRAM, p) for af in inet for p in (0, _IPPROTO_UDP)]
    if policy.allow_icmp:
        rules += [("s", _AF_INET, _SOCK_DGRAM, _IPPROTO_ICMP), ("s", _AF_INET6, _SOCK_DGRAM, _IPPROTO_ICMPV6)]
    if policy.allow_netlink:
        rules += [("s", _AF_NETLINK, t, _NETLINK_ROUTE) for t in (_SOCK_RAW, _SOCK_DGRAM)]
    for entry in sorted(policy.extra_sockets, key=repr):
        if (not isinstance(entry, tuple) or len(entry) != 3
                or not all(type(v) is int and 0 <= v <= 0xFFFF for v in entry[:2])
                or not (entry[2] is None or (type(entry[2]) is int and 0 <= entry[2] <= 0xFFFF))):
            raise ValueError(f"extra_sockets entry {entry!r} is not (family, type, protocol or None)")
        rules.append(("s", *entry))
    unique = list(dict.fromkeys(rules))
    if len(unique) > _MAX_SOCKET_RULES:
        raise ValueError(f"at most {_MAX_SOCKET_RULES} socket rules (extra_sockets has too many)")
    out: list[str] = []
    for kind, family, type_, proto in unique:
        out += ["--socket", f"{kind}:{family}:{type_}:{'*' if proto is None else proto}"]
    return out
