"""Host allow-list entries for egress: ``NAME[:PORT]`` parsed, validated and compared.

Shared by :class:`sandbox_fs.exec.ConfinementPolicy` (``allow_hosts``), the
``sandbox-fs run --allow-host`` option and a manifest's ``network`` request
(which may ask only for what the application's list covers).

An entry is a host name (``pypi.org``), a pattern (``*.pythonhosted.org``:
one or more labels below the domain, never the bare domain), or an IPv4
literal, optionally followed by ``:PORT`` (1..65535; without it every
port).  Names are compared case-insensitively after IDNA encoding, so
``Bücher.example`` and ``xn--bcher-kva.example`` are the same entry.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Iterable

#: Most entries one list may hold.
MAX_HOSTS = 256

_LABEL = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")


@dataclass(frozen=True)
class HostEntry:
    """One parsed entry: ``pattern`` (lowercase ASCII, ``*.`` prefix for a pattern) and its ports.

    Attributes:
        pattern: ``"pypi.org"``, ``"*.pythonhosted.org"`` or ``"127.0.0.1"``.
        ports: the ports allowed (None: every port).
    """

    pattern: str
    ports: frozenset[int] | None

    @property
    def wildcard(self) -> bool:
        return self.pattern.startswith("*.")

    def covers(self, other: HostEntry) -> bool:
        """True when every (name, port) ``other`` allows, this entry allows too."""
        if self.ports is not None and (other.ports is None or not other.ports <= self.ports):
            return False
        if self.pattern == other.pattern:
            return True
        if not self.wildcard:
            return False
        base = self.pattern[2:]
        name = other.pattern[2:] if other.wildcard else other.pattern
        return name.endswith("." + base) or (other.wildcard and name == base)

    def __str__(self) -> str:
        if self.ports is None:
            return self.pattern
        return ",".join(f"{self.pattern}:{p}" for p in sorted(self.ports))


def _name(text: str) -> str:
    """The entry's name part as lowercase ASCII.

    Raises:
        ValueError: not a host name, a ``*.`` pattern or an IPv4 literal.
    """
    wildcard = text.startswith("*.")
    body = text[2:] if wildcard else text
    if body.endswith("."):
        body = body[:-1]  # a fully qualified name names the same host
    try:
        ipaddress.IPv4Address(body)
    except ValueError:
        pass
    else:
        if wildcard:
            raise ValueError("a '*.' pattern needs a domain name, not an address")
        return body
    try:
        ascii_name = body.encode("idna").decode("ascii").lower()
    except UnicodeError:
        raise ValueError("not a valid host name (IDNA)") from None
    labels = ascii_name.split(".")
    if len(ascii_name) > 253 or not all(_LABEL.match(label) for label in labels):
        raise ValueError("not a valid host name (labels of letters, digits and '-', at most 253 characters)")
    if labels[-1].isdigit():
        raise ValueError("not a valid host name (an all-digit last label)")
    if wildcard and len(labels) < 2:
        raise ValueError("a '*.' pattern needs a domain with at least two labels")
    return ("*." if wildcard else "") + ascii_name


def parse_host(text: object) -> HostEntry:
    """Parse one ``NAME[:PORT]`` entry.

    Args:
        text: ``"pypi.org"``, ``"*.pythonhosted.org:443"``, ``"127.0.0.1:8080"``.

    Raises:
        ValueError: not a string, empty, longer than 300 characters, a bad
            name or pattern, or a port outside 1..65535.
    """
    if not isinstance(text, str) or not text or len(text) > 300 or text.strip() != text:
        raise ValueError("a host entry must be a non-empty 'NAME[:PORT]' string")
    name, sep, port_text = text.rpartition(":")
    if not sep:
        name, port_text = text, ""
    ports: frozenset[int] | None = None
    if sep:
        if not port_text.isascii() or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise ValueError(f"port of {text[:64]!r} must be a number in 1..65535")
        ports = frozenset({int(port_text)})
    return HostEntry(_name(name), ports)


def parse_hosts(entries: Iterable[object]) -> tuple[HostEntry, ...]:
    """Parse a list of entries; entries of one pattern are merged (their ports joined).

    Raises:
        ValueError: an entry is malformed (:func:`parse_host`), or more
            than :data:`MAX_HOSTS` entries.
    """
    if isinstance(entries, (str, bytes)):
        raise ValueError("host entries must be a list of 'NAME[:PORT]' strings, not one string")
    items = list(entries)
    if len(items) > MAX_HOSTS:
        raise ValueError(f"at most {MAX_HOSTS} host entries")
    merged: dict[str, frozenset[int] | None] = {}
    for item in items:
        entry = parse_host(item)
        if entry.pattern in merged:
            old = merged[entry.pattern]
            merged[entry.pattern] = None if old is None or entry.ports is None else old | entry.ports
        else:
            merged[entry.pattern] = entry.ports
    return tuple(HostEntry(p, ports) for p, ports in merged.items())


def outside(requested: Iterable[object], permitted: Iterable[object]) -> list[str]:
    """The entries of ``requested`` no entry of ``permitted`` covers (as given), in order.

    Raises:
        ValueError: an entry of either list is malformed.
    """
    allowed = parse_hosts(permitted)
    return [str(item) for item in requested
            if not any(p.covers(parse_host(item)) for p in allowed)]
