"""A fuzz target, and the throw-away scene every input runs in: a workspace beside an outside sentinel.

A :class:`Target` is a name, a one-input function (raises on a finding),
its seed inputs and its dictionary tokens.  :class:`Scene` is the host
side: a private base directory holding ``ws/`` (the destination, emptied
before each input) and ``outside/`` (a populated tree recorded by an
:class:`~sandbox_fs.testing.OutsideSentinel`).  :meth:`Scene.run` applies
the security invariant of issue 15 after every input: the outside is
unchanged, the destination holds no escaping symlink, special or set-id
node or hard link to an outside inode, and any failure is an allowed one
(:func:`~sandbox_fs.testing.classify_failure`).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .._sentinel import OutsideSentinel, check_destination, classify_failure

__all__ = ["Finding", "Scene", "Target", "render_dictionary"]


class Finding(AssertionError):
    """An input broke the invariant: an unexpected exception (chained as ``__cause__``) or a changed outside."""


@dataclass(frozen=True)
class Target:
    """One fuzz target.

    Attributes:
        name: the target's name (``sandbox-fs fuzz NAME``).
        one_input: runs one input (``bytes``); raises (a :class:`Finding`
            or any exception) on a finding, returns None otherwise.
        seeds: returns the built-in seed inputs (``list[bytes]``), used
            when the corpus directory is empty.
        tokens: libFuzzer dictionary tokens (``bytes`` each).
        native: True when the target drives the C module (the sanitizer run uses these).
    """

    name: str
    one_input: Callable[[bytes], None]
    seeds: Callable[[], list[bytes]]
    tokens: Sequence[bytes] = field(default_factory=tuple)
    native: bool = False


def render_dictionary(tokens: Sequence[bytes]) -> str:
    """The libFuzzer dictionary text for ``tokens``: one ``"..."`` line each, non-printable bytes as ``\\xNN``."""
    lines = []
    for tok in tokens:
        text = "".join(chr(b) if 32 <= b < 127 and b not in (0x22, 0x5C) else f"\\x{b:02x}" for b in tok)
        lines.append(f'"{text}"')
    return "\n".join(lines) + "\n"


class Scene:
    """A private base directory with ``ws/`` and a recorded ``outside/`` beside it.

    Made on first use and removed at interpreter exit.  ``prepare(scene)``,
    when given, runs before the outside is recorded (to plant hard links to
    outside files in a host tree, which changes their link counts).  ``outside/`` holds
    ``secret.txt``, ``sub/file``, a symlink and a hard-linked pair, so an
    input that reads, writes, links or replaces any of them is caught.

    Attributes:
        base, ws, outside: the host directories (``str``).
        sentinel: the :class:`OutsideSentinel` over ``outside``.
    """

    def __init__(self, prefix: str, prepare: Callable[["Scene"], object] | None = None) -> None:
        self.base = tempfile.mkdtemp(prefix=f"sfs-fuzz-{prefix}-")
        atexit.register(shutil.rmtree, self.base, True)
        self.ws = os.path.join(self.base, "ws")
        self.outside = os.path.join(self.base, "outside")
        # host-access: the harness's own mkdtemp scratch tree, built while no input runs; never a name from an input
        os.makedirs(os.path.join(self.outside, "sub"))
        # host-access: the harness's own mkdtemp scratch tree, built while no input runs; never a name from an input
        with open(os.path.join(self.outside, "secret.txt"), "wb") as fh:
            fh.write(b"SECRET\n")
        # host-access: the harness's own mkdtemp scratch tree, built while no input runs; never a name from an input
        with open(os.path.join(self.outside, "sub", "file"), "wb") as fh:
            fh.write(b"inner\n")
        # host-access: the harness's own mkdtemp scratch tree, built while no input runs; never a name from an input
        os.symlink("secret.txt", os.path.join(self.outside, "link"))
        # host-access: the harness's own mkdtemp scratch tree, built while no input runs; never a name from an input
        os.link(os.path.join(self.outside, "sub", "file"), os.path.join(self.outside, "hardlink"))
        if prepare is not None:
            prepare(self)
        self.sentinel = OutsideSentinel(self.outside)

    def reset(self) -> None:
        """Empty the workspace (a fresh ``ws/``)."""
        if os.path.lexists(self.ws):
            _force_rmtree(self.ws)
        # host-access: the harness's own mkdtemp scratch tree, built while no input runs; never a name from an input
        os.mkdir(self.ws)

    def run(self, step: Callable[[], object], *, destination: str | None = None,
            host_paths: Sequence[str] | None = None) -> None:
        """Run ``step`` and assert the invariant.

        Args:
            step: the operation on the input; may raise an allowed failure.
            destination: the host directory checked with ``check_destination``
                (default: the workspace).
            host_paths: host paths no error text may show (default: the base
                directory; empty where sandbox paths are host paths, as for grants).

        Raises:
            Finding: ``step`` raised a failure that is not allowed (chained),
                the outside changed, or the destination breaks the invariant.
        """
        try:
            step()
        except Exception as exc:  # noqa: BLE001  (every exception is classified)
            if not classify_failure(exc, host_paths=[self.base] if host_paths is None else host_paths):
                raise Finding(f"unexpected failure {type(exc).__name__}: {exc}") from exc
        try:
            self.sentinel.check()
            check_destination(destination or self.ws, sentinel=self.sentinel)
        except AssertionError as exc:
            raise Finding(str(exc)) from None


def _force_rmtree(path: str) -> None:
    """Remove ``path`` even where an input left a directory without write or search permission."""
    def fix(_fn: object, p: str, _exc: object) -> None:
        try:
            # host-access: a dir rmtree was walking in the harness's own tree; no process runs during a reset
            os.chmod(os.path.dirname(p), 0o700)
        except OSError:
            pass
    # host-access: the harness's own workspace between inputs (rmtree walks by fd, follows no symlink)
    shutil.rmtree(path, onerror=fix)
    if os.path.lexists(path):
        # host-access: the harness's own workspace between inputs (rmtree walks by fd, follows no symlink)
        shutil.rmtree(path)
