"""Member-name and link-target rules: our code, tested hardest.

A member name is untrusted.  :func:`normalize_member` turns it into a
relative POSIX path beneath the destination or refuses it.  Rules and their
sources:

* absolute names (``/etc/x``, ``\\\\server\\x``) and drive letters (``C:x``):
  CVE-2007-4559, Snyk "Zip Slip" (2018), node-tar CVE-2021-37713;
* ``..`` components, with ``/`` *or* ``\\`` as separator: Zip Slip,
  CVE-2021-37713 (backslash traversal);
* NUL bytes (zipfile silently cuts names at NUL; tar may carry one in a PAX
  ``path``);
* empty after dropping ``.`` and empty components, or naming the destination
  itself;
* a component over NAME_MAX (255 bytes), more than ``max_depth`` components,
  more than ``max_path_bytes`` bytes (limits).

Symlink targets (:func:`target_parts`, :func:`symlink_walk`): relative, ``..``
only as leading components (``Root.symlink``'s rule: a ``..`` after a name
resolves physically from that name, which may be a link), not above the
destination, at most ``max_depth`` components and ``max_path_bytes`` bytes;
checked in time linear in the target.  Snapshot persist imports these, so
what persist accepts hydrate restores.
"""

from __future__ import annotations

import os
import re

from ._errors import ArchiveLimitError, UnsafeArchiveMemberError
from ._models import ArchiveLimits

__all__ = ["normalize_member", "symlink_walk", "target_parts", "NAME_MAX"]

NAME_MAX = 255
_DRIVE = re.compile(rb"^[A-Za-z]:")
_SEPS = re.compile(rb"[/\\]")
#: what sends a name to the full check below: NUL, backslash, ':', '..', '//', '/./', a leading
#: '/' or './', a trailing '/.', or '.' alone (one regex scan: ~10x cheaper than ten substring tests)
_NOT_FAST = re.compile(rb"[\0\\:]|\.\.|//|/\./|\A\.?/|/\.\Z|\A\.\Z")


def _as_bytes(name: str | bytes) -> bytes:
    return name if isinstance(name, bytes) else os.fsencode(name)


def normalize_member(name: str | bytes, limits: ArchiveLimits, *, shown: str | bytes | None = None) -> bytes:
    """Return the normalized relative path of a member, or refuse it.

    Args:
        name: the member name from the archive (``str``, surrogate-escaped,
            or ``bytes``); for tar it is the PAX ``path`` / GNU long name when
            present (tarfile applies those overrides).
        limits: supplies ``max_path_bytes`` and ``max_depth``.
        shown: the name to show in errors (defaults to ``name``).

    Returns:
        ``bytes``: components joined by ``/`` without ``.`` or empty ones;
        ``b""`` when the name designates the destination itself (the caller
        decides whether that is refused or skipped).

    Raises:
        UnsafeArchiveMemberError: rules ``nul_in_name``, ``absolute_name``,
            ``drive_letter``, ``dotdot``, ``name_too_long`` (a component over
            255 bytes).
        ArchiveLimitError: ``max_depth`` or ``max_path_bytes`` exceeded.
    """
    raw = name if isinstance(name, bytes) else name.encode("utf-8", "surrogateescape")
    # one leading "./" (as in `tar -C dir -cf x .`) is dropped for the fast check only;
    # a name the fast path declines is judged whole below
    clean = raw[2:] if raw[:2] == b"./" else raw
    if _NOT_FAST.search(clean) is None:
        # fast path for the common clean name: only the length limits apply
        if len(clean) <= limits.max_path_bytes and clean.count(b"/") < limits.max_depth:
            # no '//', no leading '/': the components joined again are the name less one trailing '/'
            path = clean[:-1] if clean[-1:] == b"/" else clean
            if len(path) <= NAME_MAX or max(map(len, path.split(b"/"))) <= NAME_MAX:
                return path
    member = shown if shown is not None else name
    if b"\0" in raw:
        raise UnsafeArchiveMemberError("nul_in_name", member, "name holds a NUL byte")
    if raw.startswith((b"/", b"\\")):
        raise UnsafeArchiveMemberError("absolute_name", member, "absolute names are refused")
    if _DRIVE.match(raw):
        raise UnsafeArchiveMemberError("drive_letter", member, "names with a drive letter are refused")
    if b".." in _SEPS.split(raw):
        raise UnsafeArchiveMemberError("dotdot", member, "'..' components are refused (zip slip)")
    comps = [c for c in raw.split(b"/") if c and c != b"."]
    for c in comps:
        if len(c) > NAME_MAX:
            raise UnsafeArchiveMemberError("name_too_long", member, f"a component is over {NAME_MAX} bytes")
    if len(comps) > limits.max_depth:
        raise ArchiveLimitError("max_depth", limits.max_depth, len(comps), member)
    path = b"/".join(comps)
    if len(path) > limits.max_path_bytes:
        raise ArchiveLimitError("max_path_bytes", limits.max_path_bytes, len(path), member)
    return path


def target_parts(link_path: bytes, target: str | bytes, limits: ArchiveLimits,
                 member: str | bytes) -> tuple[bytes, list[bytes], bytes]:
    """Check a symlink target lexically; return ``(base, names, final)`` in time linear in its length.

    The one symlink-target predicate of sandbox-fs (the extractor, snapshot
    persist and :meth:`Root.symlink` agree): the target is relative, not
    empty, without NUL, at most ``max_path_bytes`` bytes and ``max_depth``
    components, and may use ``..`` **only as leading components** (a ``..``
    after a name would be resolved physically from that name, which may be a
    symlink, so a lexical check of it is unsound; ``Root.symlink`` refuses it
    too).  The leading ``..`` may not climb above the destination, counted
    from the link's directory.

    Returns:
        ``base``: the link's directory after the leading ``..`` pops (a
        normalized path, ``b""`` for the destination); ``names``: the target's
        remaining components (no ``.``, no ``..``); ``final``: the normalized
        path the target names (``b""`` for the destination itself).

    Raises:
        UnsafeArchiveMemberError: rule ``symlink_target``.
        ArchiveLimitError: ``max_path_bytes`` (target, or the path it names),
            ``max_depth`` (target components).
    """
    t = _as_bytes(target)
    if not t:
        raise UnsafeArchiveMemberError("symlink_target", member, "empty symlink target")
    if b"\0" in t:
        raise UnsafeArchiveMemberError("symlink_target", member, "symlink target holds a NUL byte")
    if len(t) > limits.max_path_bytes:
        raise ArchiveLimitError("max_path_bytes", limits.max_path_bytes, len(t), member)
    if t.startswith(b"/") or _DRIVE.match(t):
        raise UnsafeArchiveMemberError("symlink_target", member, "absolute symlink targets are refused")
    # drop "." and empty components at C speed first (a 4 KiB target of "./"*2000
    # would otherwise cost a 2,000-step Python loop per link)
    flat = b"/" + t + b"/"
    while b"/./" in flat:
        flat = flat.replace(b"/./", b"/")
    while b"//" in flat:
        flat = flat.replace(b"//", b"/")
    flat = flat.strip(b"/")
    comps = flat.split(b"/") if flat and flat != b"." else []
    if len(comps) > limits.max_depth:
        raise ArchiveLimitError("max_depth", limits.max_depth, len(comps), member,
                                reason=f"symlink target has {len(comps)} components > max_depth {limits.max_depth}")
    ups = 0
    while ups < len(comps) and comps[ups] == b"..":
        ups += 1
    names = comps[ups:]
    if b".." in names:
        raise UnsafeArchiveMemberError("symlink_target", member,
                                       "symlink target has '..' after a name; only leading '..' are allowed")
    stack = link_path.split(b"/")[:-1]
    if ups > len(stack):
        raise UnsafeArchiveMemberError("symlink_target", member, "symlink target resolves outside the destination")
    base = b"/".join(stack[:len(stack) - ups])
    tail = b"/".join(names)
    final = (base + b"/" + tail if base and tail else base or tail)
    if len(final) > limits.max_path_bytes:
        raise ArchiveLimitError("max_path_bytes", limits.max_path_bytes, len(final), member,
                                reason=f"symlink target names a path of {len(final)} bytes > max_path_bytes "
                                       f"{limits.max_path_bytes}")
    return base, names, final


def symlink_walk(link_path: bytes, target: str | bytes, limits: ArchiveLimits,
                 member: str | bytes) -> tuple[list[bytes], bytes]:
    """Check a symlink target lexically and return the paths it traverses.

    The rules are :func:`target_parts`' (relative, leading ``..`` only, not
    above the destination, bounded by ``max_path_bytes`` and ``max_depth``).
    Because a path component that is a symlink resolves against the link's
    *target* (the CPython 2025 data-filter bypasses, CVE-2025-4517 and
    friends, used chains of links for that), the caller must also make sure
    that no path returned here is a symlink: then the kernel's resolution
    equals this lexical one and stays beneath the destination.

    Args:
        link_path: normalized path of the link (relative to the destination).
        target: the link target from the archive.
        limits: supplies ``max_path_bytes`` and ``max_depth``.
        member: the member name for errors.

    Returns:
        ``(through, final)``: the normalized paths of every directory the
        target passes *through* after its leading ``..`` (each name followed
        by another component; at most ``max_depth`` of them), and the
        normalized path the target names (``b""`` for the destination
        itself).  The final component may be another link (a chain) when
        that one is checked too and no cycle forms.

    Raises:
        UnsafeArchiveMemberError: rule ``symlink_target``.
        ArchiveLimitError: ``max_path_bytes``, ``max_depth``.
    """
    base, names, final = target_parts(link_path, target, limits, member)
    through: list[bytes] = []
    pre = base
    for name in names[:-1]:
        pre = pre + b"/" + name if pre else name
        through.append(pre)
    return through, final
