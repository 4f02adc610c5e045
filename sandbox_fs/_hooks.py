"""Named hook points at the windows between a look and a use (for tests that race them).

The library calls :func:`fire` at each point where it has looked at
something (resolved a parent directory, ``lstat``-ed or listed an entry,
checked the staging directory) and is about to act on it.  With no hook
installed, a call site costs one module-global ``None`` check: each is
written ``if _hooks.current is not None: _hooks.fire(...)``, so not even
the call and its keyword arguments are paid (about 9 ns against 285 ns
for the bare call, measured with ``timeit`` here).  A test
installs one callable with :func:`installed` (or :func:`set_hook`); it is
called on the thread doing the operation, with the point's name and its
context, and may change the workspace before returning (this is how
``sandbox_fs.testing.Attacker`` races each window deterministically).

A hook runs inside the library's operation: it must not call back into the
same :class:`~sandbox_fs.root.Root` method.  What it raises propagates out
of the operation.

Points (name: where; context keys):

========================  ==================================================  ======================
``root.parent``           Root opened the parent directory of a name, before  root, path, op, parent_fd
                          the ``*at()`` call on the leaf (write, mkdir,
                          remove, rename, symlink, link, chmod, utime ...)
``root.rename``           Root.rename: both parents open, before renameat2    root, src, dst
``remove.enter_dir``      rmtree / clear: an entry is a directory, before it  root, name, parent_fd
                          is entered (once per directory)
``materialize.local_file``  a local_file source: after the ``O_PATH`` look,   root, path, dest
                          before the read open
``materialize.local_dir_file``  a local_dir file on the per-file path: after  root, path, dest
                          the walk's ``lstat``, before the read open
``persist.open_entry``    persist: a listed entry, before it is opened by     root, path
                          its path beneath the workspace
``hydrate.swap``          hydrate: the staging directory's identity checked,  root, staging
                          before the workspace is cleared
``hydrate.move_up``       hydrate: before a staged entry is renamed into      root, src, dst
                          place
========================  ==================================================  ======================

``root`` is the :class:`~sandbox_fs.root.Root` doing the operation (for
``materialize.*`` the source tree's Root); paths are its relative paths
(``bytes`` for ``root.*``, ``str`` elsewhere); ``parent_fd`` is borrowed
(never close it).

Thread-safety: one hook for the whole process; :func:`set_hook` is a plain
assignment, so install it before the operations it should see.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

__all__ = ["HOOK_POINTS", "Hook", "current", "fire", "installed", "set_hook"]

#: ``hook(name, context)``: called at each point while installed.
Hook = Callable[[str, dict[str, Any]], None]

#: Every point name :func:`fire` is called with (see the module docstring).
HOOK_POINTS: tuple[str, ...] = (
    "root.parent", "root.rename", "remove.enter_dir", "materialize.local_file",
    "materialize.local_dir_file", "persist.open_entry", "hydrate.swap", "hydrate.move_up",
)

#: The installed hook, or None (read at every call site; change it with :func:`set_hook`).
current: Hook | None = None


def fire(point: str, /, **context: Any) -> None:
    """Call the installed hook with the point's name and ``context``; nothing when none is installed.

    Raises:
        Whatever the hook raises.
    """
    hook = current
    if hook is not None:
        hook(point, context)


def set_hook(hook: Hook | None) -> Hook | None:
    """Install ``hook`` (None removes it); returns the one it replaces."""
    global current
    old, current = current, hook
    return old


@contextlib.contextmanager
def installed(hook: Hook) -> Iterator[Hook]:
    """Install ``hook`` for the ``with`` block, then put the previous one back."""
    old = set_hook(hook)
    try:
        yield hook
    finally:
        set_hook(old)
