"""Holds: the generation directories of one snapshot name that another name's pointer references (forks).

A fork (:meth:`~sandbox_fs.snapshot.GenerationStore.fork`) shares the
source's stored objects instead of copying them: the fork's pointer lists
the source's generation directories with ``origin`` set to the name that
owns them.  So that the owner's pruning, :meth:`remove` and :meth:`gc` never
delete an object another name still needs, every name that references
another's generations keeps one *hold* object in the owner's namespace::

    OWNER/holds/HOLDER      {"format": "sandbox-fs-hold", "owner": ..., "holder": ..., "nonce": ..., "dirs": [...]}

The protocol (see ``_generations`` for where each step runs) rests only on
the object store being linearizable, as the pointer's compare-and-swap does:

- a fork writes its holds *before* it re-reads the source's pointer and
  checks that the generation it forks is still listed there, and before it
  writes its own pointer;
- whoever stops referencing a directory (the owner's pointer swap or
  :meth:`remove`, a holder's pointer swap or :meth:`remove`) first replaces
  or deletes its pointer, then shrinks or deletes its hold, and only then
  reads the owner's pointer and lists the owner's holds, deleting a
  directory that neither keeps.

So a directory that a fork saw listed after writing its hold is protected
by that hold for every later deletion decision, and a directory that a
pointer no longer lists never comes back into one.  Holds are trusted for
availability only, like everything in the store: a forged hold can keep
objects alive (cleared by ``gc`` when its holder does not reference them),
never make a restore read other data (each restore is checked against the
metadata digest in the MAC-protected session state).  A hold that cannot
be read keeps every directory of its owner (nothing is deleted on a guess).

Only the holder writes its hold unconditionally; anyone else (``gc``
shrinking a stale hold) changes it by compare-and-swap on the etag it read.
Two writes of a hold never give it the same bytes (a random ``nonce``), so
an etag read before a hold was removed and written anew by a new fork of
that holder name never matches the new one; and a hold shrunk to nothing is
first replaced, conditionally, by a *tombstone* (``dirs`` empty: holds
nothing) and only then deleted, since a delete cannot be conditional and a
fork's create-only write fails while the tombstone is there.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .._json import loads_untrusted
from ._errors import SnapshotError, SnapshotLimitError, SnapshotNotFoundError
from ._models import _TOKEN
from ._objects import ObjectStore

__all__ = ["HOLD_DIR", "Hold", "HeldBy", "hold_key", "write_hold", "list_holds", "held_dirs", "delete_quietly"]

#: a generation directory name (the same pattern as ``_generations``; a test keeps them equal)
HOLD_DIR = r"[0-9]{12,19}-[0-9a-f]{16}"
_MAX_HOLD_BYTES = 1 << 20
_MAX_HOLD_DIRS = 16000  # a pointer lists at most 2 * 1000 * 8 generations
_DIR_RE = re.compile(HOLD_DIR)
_TOKEN_FIELD = rf"^{_TOKEN.pattern}$"


class Hold(BaseModel):
    """``OWNER/holds/HOLDER``: the generation directories of ``owner`` that ``holder``'s pointer references."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["sandbox-fs-hold"] = "sandbox-fs-hold"
    version: Literal[1] = 1
    owner: str = Field(pattern=_TOKEN_FIELD)
    holder: str = Field(pattern=_TOKEN_FIELD)
    #: random per write: no two writes of a hold have the same bytes, so none has an earlier one's etag
    nonce: str = Field(default_factory=lambda: secrets.token_hex(8), pattern=r"^[0-9a-f]{16}$")
    #: empty: a tombstone (a hold being removed by compare-and-swap), which holds nothing
    dirs: list[str] = Field(max_length=_MAX_HOLD_DIRS)


@dataclass(frozen=True)
class HeldBy:
    """One hold as read from the store: who holds which directories, and the object's etag and mtime."""

    key: str
    holder: str
    dirs: frozenset[str]
    etag: str
    mtime: float


def hold_key(owner: str, holder: str) -> str:
    """The key of ``holder``'s hold on ``owner`` (both plain tokens, checked by the caller)."""
    return f"{owner}/holds/{holder}"


def write_hold(objects: ObjectStore, owner: str, holder: str, dirs: "set[str] | frozenset[str]", *,
               if_match: str | None = None, if_none_match: bool = False) -> None:
    """Replace ``holder``'s hold on ``owner`` with ``dirs``; empty ``dirs`` deletes it.

    The new hold's bytes never equal an earlier write's (a fresh nonce).
    With ``if_match``, an empty ``dirs`` deletes the hold only if it is
    still the one of that etag: it is first replaced by a tombstone under
    that condition, then deleted (see the module docstring).  Without
    conditions, an empty ``dirs`` deletes it whatever it holds (the holder
    releasing its own hold).

    Raises:
        SnapshotConflictError: ``if_match`` or ``if_none_match`` was given and did not hold
            (nothing was changed).
        SnapshotStoreError: the store failed.
    """
    key = hold_key(owner, holder)
    if not dirs and if_match is None and not if_none_match:
        objects.delete(key)
        return
    body = Hold(owner=owner, holder=holder, dirs=sorted(dirs)).model_dump(mode="json")
    objects.put_bytes(key, json.dumps(body, indent=1).encode(), if_match=if_match, if_none_match=if_none_match)
    if not dirs:  # the tombstone is in place: no fork can create a hold here until it is gone
        objects.delete(key)


def list_holds(objects: ObjectStore, owner: str) -> list[HeldBy] | None:
    """Every hold on ``owner``; None when one of them cannot be read or is not valid (keep everything).

    A key below ``OWNER/holds/`` whose last component is not a plain token is
    not a hold (not written by this module) and is left out.  A hold removed
    between the listing and its read is left out.

    Raises:
        SnapshotStoreError: the store failed.
    """
    out: list[HeldBy] = []
    prefix = f"{owner}/holds/"
    for obj in list(objects.list(prefix)):
        holder = obj.key[len(prefix):]
        if not _TOKEN.fullmatch(holder):
            continue
        try:
            raw = objects.get_bytes(obj.key, _MAX_HOLD_BYTES)
        except SnapshotNotFoundError:
            continue
        except SnapshotLimitError:
            return None
        try:
            hold = Hold.model_validate(loads_untrusted(raw))
        except (ValueError, ValidationError):
            return None
        if hold.owner != owner or hold.holder != holder or not all(_DIR_RE.fullmatch(d) for d in hold.dirs):
            return None
        out.append(HeldBy(obj.key, holder, frozenset(hold.dirs), obj.etag, obj.mtime))
    return out


def held_dirs(objects: ObjectStore, owner: str) -> frozenset[str] | None:
    """The union of every hold's directories on ``owner``; None when a hold cannot be read (keep everything).

    Raises:
        SnapshotStoreError: the store failed.
    """
    holds = list_holds(objects, owner)
    if holds is None:
        return None
    out: set[str] = set()
    for h in holds:
        out |= h.dirs
    return frozenset(out)


def delete_quietly(objects: ObjectStore, keys: list[str]) -> None:
    """Delete objects, best effort: a failure leaves orphans for ``gc``."""
    for key in keys:
        with contextlib.suppress(SnapshotError, ValueError, OSError):
            objects.delete(key)
