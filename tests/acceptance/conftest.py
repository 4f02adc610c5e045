"""Fixtures of the acceptance cases: hostile inputs taken from public vulnerability reports.

Every case checks the state of an outside sentinel tree, never only an exit
status or an exception.  The ``layout`` and ``resolver`` fixtures come from
``tests/conftest.py``; ``contained`` adds the checks every case shares:

* the outside tree (``layout.outside``) is byte- and metadata-identical;
* nothing under the workspace is a symlink resolving outside it, a device,
  FIFO or socket, a set-id file, or a hard link to an inode of the outside tree;
* the outside secret appears in no file of the workspace.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Collection

import pytest


def _inodes(top: Path) -> set[tuple[int, int]]:
    out = set()
    for dirpath, dirs, files in os.walk(top):
        for name in dirs + files:
            st = os.lstat(os.path.join(dirpath, name))
            out.add((st.st_dev, st.st_ino))
    return out


def breaches(ws: Path, outside: Path, planted: Collection[Path] = ()) -> list[str]:
    """Every node under ``ws`` that breaks containment (see the module docstring).

    ``planted``: paths the test itself planted host-side before the attack (a
    symlink or hard link to the outside in an existing destination); they may
    still be there afterwards, untouched, and are not counted.
    """
    bad = []
    keep = {os.fspath(p) for p in planted}
    real_ws = os.path.realpath(ws)
    outside_inodes = _inodes(outside)
    for dirpath, dirs, files in os.walk(ws):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            if p in keep:
                continue
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                r = os.path.realpath(p)
                if not (r == real_ws or r.startswith(real_ws + os.sep)):
                    bad.append(f"symlink {p} -> {r}")
            elif not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                bad.append(f"special node {p}")
            elif st.st_mode & (stat.S_ISUID | stat.S_ISGID) and not stat.S_ISDIR(st.st_mode):
                bad.append(f"set-id file {p}")
            if (st.st_dev, st.st_ino) in outside_inodes:
                bad.append(f"hard link to an outside inode {p}")
    return bad


@dataclass
class Contained:
    """The sentinel state taken before an attack, and the checks run after it."""

    layout: object
    before: dict

    def check(self, planted: Collection[Path] = ()) -> None:
        layout = self.layout
        layout.assert_outside_unchanged(self.before)  # type: ignore[attr-defined]
        keep = {os.fspath(p) for p in planted}
        secret = layout.secret.encode()  # type: ignore[attr-defined]
        for dirpath, _dirs, files in os.walk(layout.ws):  # type: ignore[attr-defined]
            for name in files:
                p = os.path.join(dirpath, name)
                if p not in keep and stat.S_ISREG(os.lstat(p).st_mode):
                    with open(p, "rb") as f:
                        assert secret not in f.read(), f"the outside secret leaked into {p}"
        assert breaches(layout.ws, layout.outside, planted) == []  # type: ignore[attr-defined]


@pytest.fixture
def contained(layout) -> Contained:
    """Snapshot the outside tree now; call ``.check()`` after the attack."""
    return Contained(layout, layout.snapshot())
