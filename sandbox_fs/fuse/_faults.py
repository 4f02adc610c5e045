"""Fault injection for tests: rules that make chosen overlay operations fail.

A :class:`FaultRule` names FUSE operations, a sandbox path (it matches that
path and everything beneath it) and the errno to fail with, at most
``times`` times.  :class:`FaultRules` holds the daemon's current set,
replaced or cleared at run time (the control protocol's ``faults`` op:
``{"rules": [rule.model_dump(mode="json"), ...]}``), and is asked once per
request, before the request acts: :meth:`FaultRules.check` raises the
``OSError`` of the first rule that fires.

Not thread-safe: one daemon thread checks and replaces the set.
"""

from __future__ import annotations

import errno as _errno
import os
from typing import Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["FaultRule", "FaultRules", "FaultErrno", "FUSE_OPS"]

MAX_RULE_PATH_CHARS = 4096
"""Longest :attr:`FaultRule.path`, in characters (the daemon decides on 4097 kept characters of a request's path)."""

FUSE_OPS = frozenset({
    "access", "create", "flush", "forget", "fsync", "fsyncdir", "getattr", "getxattr", "link", "listxattr",
    "lookup", "mkdir", "mknod", "open", "opendir", "read", "readdir", "readlink", "release", "releasedir",
    "removexattr", "rename", "rmdir", "setattr", "setxattr", "statfs", "symlink", "unlink", "write",
})
"""The operation names a rule may name (pyfuse3's request handlers); ``"*"`` names them all."""


FaultErrno = Literal[5, 28, 13]
"""The errnos a rule may inject: EIO, ENOSPC, EACCES (Linux numbers; checked at import)."""
if (_errno.EIO, _errno.ENOSPC, _errno.EACCES) != (5, 28, 13):  # pragma: no cover - not Linux numbers
    raise ImportError("FaultErrno assumes Linux errno numbers")


class FaultRule(BaseModel):
    """One fault: fail ``ops`` on ``path`` (and beneath it) with ``errno``, at most ``times`` times.

    Attributes:
        ops: FUSE operation names from :data:`FUSE_OPS` (``"write"``,
            ``"open"``, ...), or ``"*"`` for every operation; not empty.
        path: a sandbox path relative to the workspace root; it matches
            itself and every path beneath it (``"a"`` matches ``"a"`` and
            ``"a/b"``, not ``"ab"``); ``""`` matches everything.  Given
            with ``.`` or empty components or a trailing ``/``, it is kept
            normalized.
        errno: ``errno.EIO``, ``errno.ENOSPC`` or ``errno.EACCES``.
        times: fire at most this many times (>= 1), or None for every match.

    Raises:
        pydantic.ValidationError: an unknown operation, no operation, an
            absolute path or one with ``..`` or NUL, another errno, or
            ``times`` < 1.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    ops: frozenset[str] = Field(min_length=1)
    path: str = ""
    errno: FaultErrno
    times: int | None = Field(default=None, ge=1)

    @field_validator("ops")
    @classmethod
    def _known_ops(cls, ops: frozenset[str]) -> frozenset[str]:
        unknown = sorted(ops - FUSE_OPS - {"*"})
        if unknown:
            raise ValueError(f"unknown FUSE operations: {unknown}")
        return ops

    @field_validator("path")
    @classmethod
    def _relative_path(cls, path: str) -> str:
        if path.startswith("/") or "\0" in path:
            raise ValueError("path must be a sandbox path relative to the workspace, without NUL")
        parts = [p for p in path.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise ValueError("path may not contain '..'")
        joined = "/".join(parts)
        if len(joined) > MAX_RULE_PATH_CHARS:
            # the daemon keeps 4097 characters of a request's path: a longer rule could not be decided
            raise ValueError(f"path may not be longer than {MAX_RULE_PATH_CHARS} characters")
        return joined

    def matches(self, op: str, path: str) -> bool:
        """True when this rule names ``op`` and ``path`` is its path or beneath it (``times`` not considered).

        A path starting with ``/`` is one whose top the daemon had to cut
        (deeper than its dentry walk goes; no sandbox path starts so): it
        could be beneath any rule's path, so it matches every one (fail closed).
        """
        if "*" not in self.ops and op not in self.ops:
            return False
        return (not self.path or path == self.path or path.startswith(self.path + "/")
                or path.startswith("/"))


class FaultRules:
    """The daemon's current fault rules, in order; each rule's remaining ``times`` is counted here."""

    def __init__(self) -> None:
        self._rules: list[FaultRule] = []
        self._left: list[int | None] = []

    def __len__(self) -> int:
        return len(self._rules)

    @property
    def rules(self) -> tuple[FaultRule, ...]:
        """The current rules, in order (exhausted ones included)."""
        return tuple(self._rules)

    def set(self, rules: Iterable[FaultRule]) -> None:
        """Replace the set with ``rules`` (counts start afresh); an empty iterable clears it."""
        self._rules = list(rules)
        self._left = [r.times for r in self._rules]

    def clear(self) -> None:
        """Remove every rule."""
        self.set(())

    def check(self, op: str, path: str) -> None:
        """Fail this request if a rule fires for it: the first matching rule with firings left.

        Args:
            op: the FUSE operation name of the request.
            path: its sandbox path relative to the workspace (``""``: the root).

        Raises:
            OSError: the firing rule's errno (its count of firings left goes down by one).
        """
        for i, rule in enumerate(self._rules):
            left = self._left[i]
            if left == 0 or not rule.matches(op, path):
                continue
            if left is not None:
                self._left[i] = left - 1
            raise OSError(rule.errno, f"{os.strerror(rule.errno)} (injected fault)")
