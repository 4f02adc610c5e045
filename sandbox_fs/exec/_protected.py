"""Protected and unreadable paths inside the writable trees (``ConfinementPolicy.protected``, ``deny_read``).

A pattern is a path relative to each writable tree (the workspace, each
read-write grant), ``/``-separated, whose components may be ``fnmatch``
globs (``*``, ``?``, ``[...]``; ``*`` matches names starting with a dot
too; no ``**``).  A trailing ``/`` says the entry is a directory (it only
matters when it has to be created).  Patterns are expanded at run start,
through the Root, one component at a time with ``O_PATH | O_NOFOLLOW``
(:class:`~sandbox_fs.root.Handle`): a symlink or a non-directory met on the
way is itself the protected entry (the link is protected, never its
target); a glob component matching nothing protects nothing.

A literal path that does not exist is made for the run, through the same
handles: missing parent directories as ordinary directories (writable,
pinned), the last component as an empty placeholder (a file, or a
directory with a trailing ``/``), which the read-only bind then covers, so
the command cannot create it.  Entries made are reference-counted per
tree (the Root's directory identity) across the concurrent runs and PTY
sessions of this process: a run whose walk meets an entry another live
run made takes a reference on it instead of treating it as the user's.
After the run (:meth:`GuardPlan.release`) each reference is dropped, and
only the last one removes the placeholder, then each directory made, if
it is still the inode made and still empty.  (Unlinking a name also
detaches every bind on it, so a placeholder removed while another run's
read-only bind covered it would have left that run's path creatable.)
Runs of another process on the same workspace do not share the count.
The helper mounts (``--guard``, see ``native/sfs_exec_guard.h``): every directory between the tree and an
entry is bound onto itself (a mount point cannot be renamed or removed:
renaming ``.git`` away does not move the protection), each protected entry
gets a read-only bind of itself, each unreadable one an empty mode-0000
read-only tmpfs (directory) or file (anything else).
"""

from __future__ import annotations

import fnmatch
import os
import stat
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from ..errors import InvalidArgumentError
from ._errors import ConfinementError

if TYPE_CHECKING:  # pragma: no cover
    from ..root import Handle, Root

#: The default protected set (see SECURITY.md, "Protected paths", for why each is in or out).
DEFAULT_PROTECTED: tuple[str, ...] = (
    ".git/hooks/", ".git/config", ".git/config.worktree", ".git/commondir",
    ".git/modules/*/hooks/", ".git/modules/*/config",
    ".bashrc", ".bash_profile", ".bash_login", ".bash_logout", ".profile",
    ".zshrc", ".zshenv", ".zprofile", ".zlogin",
    ".vscode/tasks.json", ".vscode/settings.json", ".vscode/launch.json",
    ".idea/runConfigurations/", ".idea/workspace.xml",
)

#: At most this many ``--guard`` entries per run (the helper's SFS_MAX_GUARDS).
MAX_GUARDS = 256

_GLOB_CHARS = frozenset(b"*?[")


def check_pattern(pattern: str) -> list[bytes]:
    """The components of ``pattern`` (see the module docstring).

    Raises:
        InvalidArgumentError: (a ValueError) empty, absolute, a NUL, an empty, ``.``, ``..`` or ``**`` component.
    """
    if not isinstance(pattern, str) or not pattern.strip("/") or pattern.startswith("/") or "\0" in pattern:
        raise InvalidArgumentError(f"bad protected pattern {pattern!r}: a relative path is needed", sandbox_path=None)
    comps = pattern.rstrip("/").split("/")
    for c in comps:
        if c in ("", ".", "..") or "**" in c:
            raise InvalidArgumentError(f"bad protected pattern {pattern!r}: empty, '.', '..' or '**' component",
                                       sandbox_path=None)
    return [os.fsencode(c) for c in comps]


def check_policy(protected: object, deny_read: object) -> None:
    """Check ``ConfinementPolicy.protected`` and ``deny_read``: tuples of valid patterns.

    Raises:
        InvalidArgumentError: (a ValueError) either is not a tuple of strings (a bare string would be
            read as one pattern per character), or a pattern is bad (:func:`check_pattern`).
    """
    for name, value in (("protected", protected), ("deny_read", deny_read)):
        if not isinstance(value, tuple) or not all(isinstance(p, str) for p in value):
            raise InvalidArgumentError(f"ConfinementPolicy.{name} must be a tuple of path patterns", sandbox_path=None)
        for p in value:
            check_pattern(p)


def _is_glob(comp: bytes) -> bool:
    return any(ch in _GLOB_CHARS for ch in comp)


@dataclass
class _Made:
    parent: Handle
    name: bytes
    key: tuple[int, int]
    is_dir: bool
    ref: tuple[tuple[int, int], tuple[bytes, ...], tuple[int, int]] = ((0, 0), (), (0, 0))


#: Entries made for live runs: ``(tree key, rel, entry key) -> references``; guarded by _MADE_LOCK,
#: which is held across a whole walk and a whole release, so a walk never sees an entry half released
#: (reentrant: a failed walk releases its plan while holding it).
_MADE_REFS: dict[tuple[tuple[int, int], tuple[bytes, ...], tuple[int, int]], int] = {}
_MADE_LOCK = threading.RLock()


@dataclass
class GuardPlan:
    """The helper's ``--guard`` arguments for one run, and what :meth:`release` undoes.

    Attributes:
        args: ``["--guard", "K:BASE:FD:REL", ...]`` (pins first, outer first).
        made: entries made for the run (directories and placeholders), in the order made.
        handles: every handle the plan holds (closed by :meth:`release`).
    """

    args: list[str] = field(default_factory=list)
    made: list[_Made] = field(default_factory=list)
    handles: list[Handle] = field(default_factory=list)
    roots: list[Root] = field(default_factory=list)

    def release(self) -> None:
        """Remove every entry made for the run that is still that inode and empty (newest first).

        Best effort, never raises: an entry the command changed (no longer
        empty, or replaced) is left as it is; an entry another live run
        still references is left for that run's release.  Closes every handle.
        """
        with _MADE_LOCK:
            self._release_made()
        for h in self.handles:
            h.close()
        self.handles = []
        for r in self.roots:
            r.close()
        self.roots = []

    def _release_made(self) -> None:
        for m in reversed(self.made):
            left = _MADE_REFS.get(m.ref, 1) - 1
            if left > 0:
                _MADE_REFS[m.ref] = left
                continue
            _MADE_REFS.pop(m.ref, None)
            cur = None
            try:
                cur = m.parent.lookup(m.name)
                st = cur.stat()
                if (st.st_dev, st.st_ino) == m.key:
                    if m.is_dir and stat.S_ISDIR(st.st_mode) and not cur.listdir():
                        m.parent.rmdir(m.name)
                    elif not m.is_dir and stat.S_ISREG(st.st_mode) and st.st_size == 0:
                        m.parent.unlink(m.name)
            except OSError:
                pass
            finally:
                if cur is not None:
                    cur.close()
        self.made = []


class _Walk:
    """Expansion of the patterns in one tree (see the module docstring)."""

    def __init__(self, tree: Root, owner: tuple[int, int] | None, plan: GuardPlan) -> None:
        self.tree, self.owner, self.plan = tree, owner, plan
        self.top = self._keep(tree.handle())
        self.tree_key = self.top.key
        self.entries: dict[tuple[bytes, ...], tuple[str, Handle]] = {}   # rel -> (kind, handle)
        self.dirs: dict[tuple[bytes, ...], Handle] = {}                  # rel -> directory on the way

    def _keep(self, h: Handle) -> Handle:
        self.plan.handles.append(h)
        return h

    def add(self, pattern: str, kind: str) -> None:
        """Expand ``pattern`` (``kind`` ``"r"``: read-only, ``"d"``: unreadable); raises ValueError, OSError."""
        comps = check_pattern(pattern)
        want_dir = pattern.endswith("/")
        frontier: list[tuple[tuple[bytes, ...], Handle]] = [((), self.top)]
        for i, comp in enumerate(comps):
            last = i == len(comps) - 1
            nxt: list[tuple[tuple[bytes, ...], Handle]] = []
            for rel, h in frontier:
                glob = _is_glob(comp)
                names = [n for n, _i, _t in h.listdir() if fnmatch.fnmatchcase(n, comp)] if glob else [comp]
                for name in names:
                    try:
                        child = self._keep(h.lookup(name))
                    except FileNotFoundError:
                        if not glob:
                            self._make(rel, h, comps[i:], want_dir, kind)
                        continue
                    self._share(h, rel + (name,), child)
                    if last or not stat.S_ISDIR(child.stat().st_mode):
                        self._entry(rel + (name,), kind, child)
                    else:
                        self.dirs[rel + (name,)] = child
                        nxt.append((rel + (name,), child))
            frontier = nxt

    def _make(self, rel: tuple[bytes, ...], parent: Handle, rest: Sequence[bytes], want_dir: bool,
              kind: str) -> None:
        """Make the missing ``rest`` beneath ``parent`` (at ``rel``): directories, then the placeholder."""
        cur = parent
        for k, name in enumerate(rest):
            leaf = k == len(rest) - 1
            try:
                if leaf and not want_dir:
                    os.close(cur.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644, owner=self.owner))
                    new = self._keep(cur.lookup(name))
                else:
                    new = self._keep(cur.mkdir(name, 0o755, owner=self.owner))
                ref = (self.tree_key, rel + (name,), new.key)
                _MADE_REFS[ref] = _MADE_REFS.get(ref, 0) + 1
                self.plan.made.append(_Made(cur, name, new.key, not (leaf and not want_dir), ref))
            except FileExistsError:  # made meanwhile: taken as it is
                new = self._keep(cur.lookup(name))
                self._share(cur, rel + (name,), new)
            rel = rel + (name,)
            if not leaf:
                if not stat.S_ISDIR(new.stat().st_mode):
                    self._entry(rel, kind, new)
                    return
                self.dirs[rel] = new
            cur = new
        self._entry(rel, kind, cur)

    def _share(self, parent: Handle, rel: tuple[bytes, ...], h: Handle) -> None:
        """Take a reference on ``h`` at ``rel`` if a live run made it (once per plan)."""
        ref = (self.tree_key, rel, h.key)
        if ref in _MADE_REFS and all(m.ref != ref for m in self.plan.made):
            _MADE_REFS[ref] += 1
            self.plan.made.append(_Made(parent, rel[-1], h.key, stat.S_ISDIR(h.stat().st_mode), ref))

    def _entry(self, rel: tuple[bytes, ...], kind: str, h: Handle) -> None:
        st = h.stat()
        if not stat.S_ISDIR(st.st_mode) and st.st_nlink > 1:
            # A bind covers one name; another hard link to the inode would still write (or read) it.
            raise ConfinementError("a protected or unreadable file has other hard links, through which the "
                                   "command could still change or read it", sandbox_path=_rel_text(rel))
        old = self.entries.get(rel)
        if old is None or (kind == "d" and old[0] == "r"):  # unreadable beats read-only
            self.entries[rel] = (kind, h)

    def emit(self, base: str, pass_fd: Callable[[int], str]) -> tuple[list[str], list[str]]:
        """``(pin args, entry args)`` for this tree (``base``: the helper's name for the tree)."""
        pins: set[tuple[bytes, ...]] = set()
        for rel in self.entries:
            pins.update(rel[:n] for n in range(1, len(rel)))
        pin_args: list[str] = []
        for rel in sorted(pins, key=lambda r: (len(r), r)):
            h = self.dirs.get(rel)
            if h is None or any(self.entries.get(rel[:n], ("",))[0] == "d" for n in range(1, len(rel) + 1)):
                continue
            pin_args += ["--guard", f"p:{base}:{pass_fd(os.dup(h.fd))}:{_rel_text(rel)}"]
        ent_args: list[str] = []
        for rel in sorted(self.entries, key=lambda r: (len(r), r)):
            kind, h = self.entries[rel]
            if any(self.entries.get(rel[:n], ("",))[0] == "d" for n in range(1, len(rel))):
                continue  # beneath an unreadable directory: already out of reach
            ent_args += ["--guard", f"{kind}:{base}:{pass_fd(os.dup(h.fd))}:{_rel_text(rel)}"]
        return pin_args, ent_args


def _rel_text(rel: tuple[bytes, ...]) -> str:
    text = os.fsdecode(b"/".join(rel))
    if "\n" in text or "\0" in text:
        raise ConfinementError("a protected path's name cannot be passed to the helper", sandbox_path=None)
    return text


def plan_guards(trees: Sequence[tuple[Root, str | None]], protected: Sequence[str], deny_read: Sequence[str],
                pass_fd: Callable[[int], str], owner: tuple[int, int] | None = None,
                own_roots: Sequence[Root] = ()) -> GuardPlan:
    """Expand the patterns in each writable tree and build the helper's ``--guard`` arguments.

    Args:
        trees: ``(tree, base)`` for each writable tree: ``base`` ``"w"`` for
            the private root's workspace (the tree is then a Root on the
            overlay's mount), None to pass the tree's own fd.
        protected: patterns made read-only (see the module docstring).
        deny_read: patterns made unreadable (they win over ``protected``).
        pass_fd: hands an fd (ours, a new one) to the helper; returns its number as text.
        owner: ``(uid, gid)`` of the entries made for the run (None: the Root's owner).
        own_roots: Roots the plan takes over (closed by :meth:`GuardPlan.release`).

    Returns:
        The plan; the caller calls :meth:`GuardPlan.release` after the run
        (also when it never started).

    Raises:
        ValueError: a bad pattern.
        ConfinementError: more than :data:`MAX_GUARDS` entries; a file matched has more than one
            hard link (a bind covers one name only).
        OSError: a lookup or a placeholder failed (the sandbox path in it).
    """
    plan = GuardPlan(roots=list(own_roots))
    with _MADE_LOCK:
        _plan_trees(plan, trees, protected, deny_read, pass_fd, owner)
    return plan


def _plan_trees(plan: GuardPlan, trees: Sequence[tuple[Root, str | None]], protected: Sequence[str],
                deny_read: Sequence[str], pass_fd: Callable[[int], str], owner: tuple[int, int] | None) -> None:
    """:func:`plan_guards`' walk (the caller holds _MADE_LOCK; on any error the plan is released)."""
    try:
        pins: list[str] = []
        ents: list[str] = []
        for tree, base in trees:
            walk = _Walk(tree, owner, plan)
            for pat in protected:
                walk.add(pat, "r")
            for pat in deny_read:
                walk.add(pat, "d")
            if not walk.entries:
                continue
            name = base if base is not None else pass_fd(tree.fileno_dup())
            p, e = walk.emit(name, pass_fd)
            pins += p
            ents += e
        if (len(pins) + len(ents)) // 2 > MAX_GUARDS:
            raise ConfinementError(f"more than {MAX_GUARDS} protected entries (and their parents)",
                                   sandbox_path=None)
        plan.args = pins + ents
    except BaseException:
        plan.release()
        raise
