"""The pytest plugin (entry point ``pytest11``, name ``sandbox_fs``): the ``outside_sentinel`` fixture.

A test that asks for ``outside_sentinel`` gets an :class:`OutsideSentinels`:
a populated ``outside/`` directory under the test's ``tmp_path`` (a secret
file, a subdirectory, a symlink and a hard link), recorded before the test
body runs.  After the body, every watched tree is checked and the test
*fails* (not errors) naming what changed::

    def test_extract_keeps_outside(outside_sentinel, tmp_path):
        dest = tmp_path / "dest"
        ...  # extract a hostile archive that aims at ../outside
        outside_sentinel.check_destination(dest)

Loading the plugin imports only the ``sandbox_fs`` package itself (pytest
loads it in every run where sandbox-fs is installed); the sentinel module is
imported when a test first uses the fixture.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Generator

import pytest

if TYPE_CHECKING:
    from ._sentinel import OutsideSentinel

__all__ = ["OutsideSentinels", "outside_sentinel"]

SECRET = b"SECRET: must never be read, changed or linked from a destination\n"


class OutsideSentinels:
    """The trees a test promised not to change, checked after the test body.

    Attributes:
        path: the default outside directory (``pathlib.Path``), made and
            populated by the fixture beside the test's destinations.
        secret: ``path / "secret.txt"`` (``pathlib.Path``), the file attacks aim at.
    """

    def __init__(self, base: Path) -> None:
        from ._sentinel import OutsideSentinel  # noqa: PLC0415

        self._cls = OutsideSentinel
        self.path = base / "outside"
        self.secret = self.path / "secret.txt"
        (self.path / "sub").mkdir(parents=True)
        self.secret.write_bytes(SECRET)
        (self.path / "sub" / "file").write_bytes(b"inner\n")
        # host-access: the plugin's self-check builds its own throw-away tree (tmp_path), not a workspace
        os.symlink("secret.txt", self.path / "link")
        os.link(self.path / "sub" / "file", self.path / "hardlink")
        self._watched: list[OutsideSentinel] = [OutsideSentinel(self.path)]
        self.checked = False

    def watch(self, path: str | os.PathLike[str]) -> None:
        """Record one more host directory (``str`` or ``os.PathLike``) that must not change."""
        self._watched.append(self._cls(path))

    def check(self) -> None:
        """Raise ``AssertionError`` naming the changes in every watched tree (none: return None)."""
        self.checked = True
        errors = [str(exc) for exc in self._errors()]
        if errors:
            raise AssertionError("\n".join(errors))

    def _errors(self) -> list[AssertionError]:
        out = []
        for sentinel in self._watched:
            try:
                sentinel.check()
            except AssertionError as exc:
                out.append(exc)
        return out

    def check_destination(self, destination: str | os.PathLike[str]) -> None:
        """Raise ``AssertionError`` if ``destination`` breaks the invariant (see ``check_destination``).

        Files hard-linked to any watched tree's inodes count as outside links.
        """
        from ._sentinel import check_destination  # noqa: PLC0415

        inodes: set[tuple[int, int]] = set()
        for sentinel in self._watched:
            inodes |= sentinel.inodes
        check_destination(destination, outside_inodes=inodes)


@pytest.fixture
def outside_sentinel(tmp_path: Path) -> Generator[OutsideSentinels, None, None]:
    """An :class:`OutsideSentinels` under ``tmp_path``; the test fails if a watched tree changed."""
    sentinels = OutsideSentinels(tmp_path)
    yield sentinels
    if not sentinels.checked:  # the call hook below did not run (the body raised first)
        sentinels.checked = True
        errors = sentinels._errors()
        if errors:
            pytest.fail("\n".join(str(e) for e in errors), pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """After the body of a test that uses ``outside_sentinel``, fail it if a watched tree changed."""
    result = yield
    funcargs = getattr(item, "funcargs", {})
    sentinels = funcargs.get("outside_sentinel")
    if isinstance(sentinels, OutsideSentinels):
        sentinels.check()
    return result
