"""The attacker: a hostile process's moves against a workspace, between steps and inside them.

:class:`Attacker` changes a throw-away workspace the way a confined command
(or anything else that can write it) would, with five rules:

* :meth:`Attacker.plant_symlink`: a symlink to the outside at a name;
* :meth:`Attacker.exchange_with_symlink`: ``renameat2(RENAME_EXCHANGE)`` of
  a directory with a symlink to the outside (the directory stays under a
  new name beside it);
* :meth:`Attacker.replace_with_fifo` / :meth:`Attacker.replace_with_hardlink`:
  a file replaced by a FIFO, or by a hard link to an outside file;
* :meth:`Attacker.move_out`: a directory moved out of the workspace (into
  the attacker's ``attic`` beside it);
* :meth:`Attacker.chmod`: a mode change.

Each rule records the workspace path it touched in :attr:`Attacker.touched`
(a model of the workspace can only be compared on the other paths) and in
:attr:`Attacker.log`.  A rule on a missing or unsuitable name does nothing
and returns False, so a drawn sequence always runs.

Interleavings:

* between library steps: call a rule;
* at a hook point (deterministic, so examples replay and shrink):
  :meth:`Attacker.at_hook` arms a rule for the next time the library
  reaches a named point of :mod:`sandbox_fs._hooks`; while
  :meth:`Attacker.armed` is active, the hook hands the rule to the
  attacker's own thread and waits until it is done, so the change lands in
  the window between the library's look and its use;
* free running (for long campaigns): :meth:`Attacker.free_running` runs
  random rules from a second thread until the ``with`` block ends.

The attacker never follows a symlink itself: it reaches a name's parent
through a ``Root`` of the workspace that refuses symlinks
(``no_symlinks=True``) and acts on the leaf with ``*at()`` calls, so its
own moves cannot change anything outside but what a rule means to change
(a hard link shares an outside file's inode; nothing writes through it).
Test-only: run it on directories the test made, never on real data.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import random
import secrets
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from .. import _hooks
from ..errors import SandboxError
from ..root import Root, open_root

__all__ = ["ATTACK_RULES", "Attacker", "AttackRecord"]

#: The rule names :meth:`Attacker.apply` accepts.
ATTACK_RULES: tuple[str, ...] = ("plant_symlink", "exchange_with_symlink", "replace_with_fifo",
                                 "replace_with_hardlink", "move_out", "chmod")

_RENAME_EXCHANGE = 2  # <linux/fs.h>
_libc = ctypes.CDLL(None, use_errno=True)


def _exchange(dfd: int, a: bytes, b: bytes) -> None:
    """``renameat2(dfd, a, dfd, b, RENAME_EXCHANGE)`` (glibc >= 2.28)."""
    if _libc.renameat2(dfd, a, dfd, b, _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@dataclass(frozen=True)
class AttackRecord:
    """One rule the attacker applied.

    Attributes:
        rule: one of :data:`ATTACK_RULES`.
        path: the workspace path it acted on.
        point: the hook point it ran at, or None (between steps / free running).
        done: False when the name was missing or unsuitable (nothing changed).
    """

    rule: str
    path: str
    point: str | None
    done: bool


class Attacker:
    """Hostile moves against the workspace at ``workspace`` (a host path of a throw-away directory).

    Args:
        workspace: the workspace directory (host path).
        outside: a directory outside the workspace that planted symlinks point to.
        outside_file: a regular file outside the workspace that hard links share.
        attic: a directory outside the workspace that :meth:`move_out` moves into
            (made if missing).
        seed: seeds :meth:`free_running`'s choices.

    Attributes:
        touched: workspace paths a rule changed (``str``, ``/``-separated).
        log: every rule applied, in order.

    Thread-safety: rules hold one lock, so a free-running thread and hook
    points never interleave inside a rule.
    """

    def __init__(self, workspace: str | os.PathLike[str], outside: str | os.PathLike[str],
                 outside_file: str | os.PathLike[str], attic: str | os.PathLike[str], *, seed: int = 0) -> None:
        self.outside = os.fspath(outside)
        self.outside_file = os.fspath(outside_file)
        # host-access: the attic is the test's own directory outside the workspace, made and held by fd before any attack
        Path(attic).mkdir(exist_ok=True)
        self._attic_fd = os.open(attic, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        self._ws: Root = open_root(workspace, no_symlinks=True)
        self.touched: set[str] = set()
        self.log: list[AttackRecord] = []
        self._lock = threading.RLock()
        self._rng = random.Random(seed)
        self._attic_state: dict[str, tuple[int, int, bytes | None]] = {}
        self._armed: list[tuple[str, str, str, Callable[[dict[str, Any]], bool] | None]] = []

    def close(self) -> None:
        """Close the attacker's workspace Root and attic fd."""
        self._ws.close()
        os.close(self._attic_fd)

    def __enter__(self) -> "Attacker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- rules

    def _parent(self, path: str) -> tuple[int, bytes] | None:
        parent, _, leaf = path.strip("/").rpartition("/")
        if not leaf or leaf in (".", ".."):
            return None
        try:
            return self._ws.open_dir_fd(parent or "."), os.fsencode(leaf)
        except (OSError, SandboxError):
            return None  # missing, or a symlink / file on the way (the attacker never follows one)

    def _act(self, rule: str, path: str, point: str | None, fn: Callable[[int, bytes], bool]) -> bool:
        with self._lock:
            got = self._parent(path)
            done = False
            if got is not None:
                pfd, leaf = got
                try:
                    done = fn(pfd, leaf)
                except OSError:
                    done = False
                finally:
                    os.close(pfd)
            if done:
                self.touched.add(path.strip("/"))
            self.log.append(AttackRecord(rule, path, point, done))
            return done

    def _kind(self, pfd: int, leaf: bytes) -> int | None:
        try:
            return stat.S_IFMT(os.stat(leaf, dir_fd=pfd, follow_symlinks=False).st_mode)
        except OSError:
            return None

    def _tmp(self) -> bytes:
        return b".atk-" + secrets.token_hex(4).encode()

    def plant_symlink(self, path: str, *, point: str | None = None) -> bool:
        """Put a symlink to the outside directory at ``path`` (replacing a non-directory there)."""
        def go(pfd: int, leaf: bytes) -> bool:
            tmp = self._tmp()
            os.symlink(self.outside, tmp, dir_fd=pfd)
            _rename_over(pfd, tmp, leaf)
            return True
        return self._act("plant_symlink", path, point, go)

    def exchange_with_symlink(self, path: str, *, point: str | None = None) -> bool:
        """Exchange the directory at ``path`` with a symlink to the outside (``RENAME_EXCHANGE``)."""
        def go(pfd: int, leaf: bytes) -> bool:
            if self._kind(pfd, leaf) != stat.S_IFDIR:
                return False
            tmp = self._tmp()
            os.symlink(self.outside, tmp, dir_fd=pfd)
            try:
                _exchange(pfd, tmp, leaf)
            except OSError:
                os.unlink(tmp, dir_fd=pfd)
                return False
            self.touched.add(_join(path, tmp))
            return True
        return self._act("exchange_with_symlink", path, point, go)

    def replace_with_fifo(self, path: str, *, point: str | None = None) -> bool:
        """Replace the non-directory at ``path`` (or a missing name) with a FIFO."""
        def go(pfd: int, leaf: bytes) -> bool:
            if self._kind(pfd, leaf) == stat.S_IFDIR:
                return False
            tmp = self._tmp()
            os.mkfifo(tmp, 0o666, dir_fd=pfd)
            _rename_over(pfd, tmp, leaf)
            return True
        return self._act("replace_with_fifo", path, point, go)

    def replace_with_hardlink(self, path: str, *, point: str | None = None) -> bool:
        """Replace the non-directory at ``path`` (or a missing name) with a hard link to the outside file."""
        def go(pfd: int, leaf: bytes) -> bool:
            if self._kind(pfd, leaf) == stat.S_IFDIR:
                return False
            tmp = self._tmp()
            os.link(self.outside_file, tmp, dst_dir_fd=pfd)
            _rename_over(pfd, tmp, leaf)
            return True
        return self._act("replace_with_hardlink", path, point, go)

    def move_out(self, path: str, *, point: str | None = None) -> bool:
        """Move the directory at ``path`` out of the workspace, into the attic."""
        def go(pfd: int, leaf: bytes) -> bool:
            if self._kind(pfd, leaf) != stat.S_IFDIR:
                return False
            os.rename(leaf, self._tmp(), src_dir_fd=pfd, dst_dir_fd=self._attic_fd)
            self._attic_state = self.attic_snapshot()
            return True
        return self._act("move_out", path, point, go)

    def chmod(self, path: str, mode: int = 0o000, *, point: str | None = None) -> bool:
        """Change the mode of the file or directory at ``path`` (never through a symlink)."""
        def go(pfd: int, leaf: bytes) -> bool:
            kind = self._kind(pfd, leaf)
            if kind not in (stat.S_IFDIR, stat.S_IFREG):
                return False
            fd = os.open(leaf, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
            try:
                # host-access: the attacker's own move: a chmod through the O_PATH fd it just opened (NOFOLLOW) beneath its no-symlink Root
                os.chmod(f"/proc/self/fd/{fd}", mode)  # fchmod on an O_PATH fd is EBADF before Linux 6.6
            finally:
                os.close(fd)
            return True
        return self._act("chmod", path, point, go)

    def apply(self, rule: str, path: str, *, point: str | None = None) -> bool:
        """Apply rule ``rule`` (one of :data:`ATTACK_RULES`) at ``path``; True when it changed something.

        Raises:
            ValueError: an unknown rule.
        """
        if rule not in ATTACK_RULES:
            raise ValueError(f"unknown attack rule {rule!r}")
        fn: Callable[..., bool] = getattr(self, rule)
        return fn(path, point=point)

    def attic_snapshot(self) -> dict[str, tuple[int, int, bytes | None]]:
        """``(type, size, content)`` of everything moved out so far: what the library must leave alone."""
        out: dict[str, tuple[int, int, bytes | None]] = {}
        with self._lock:
            attic = f"/proc/self/fd/{self._attic_fd}"
            # host-access: reads the attic through the fd held since __init__ (never by a name the workspace can change)
            for dirpath, dirnames, filenames in os.walk(attic, followlinks=False):
                for n in dirnames + filenames:
                    p = os.path.join(dirpath, n)
                    try:
                        s = os.lstat(p)
                        data = None
                        if stat.S_ISREG(s.st_mode):
                            with open(p, "rb") as f:
                                data = f.read()
                    except OSError:
                        continue
                    out[os.path.relpath(p, attic)] = (stat.S_IFMT(s.st_mode), s.st_size, data)
        return out

    def rebase_attic(self) -> None:
        """Take the attic as it is now as the state :meth:`attic_changes` compares with."""
        with self._lock:
            self._attic_state = self.attic_snapshot()

    def attic_changes(self) -> list[str]:
        """What appeared or changed in the attic since the last :meth:`move_out` (``list[str]``; empty: nothing).

        Removals are not reported: a library operation that had entered a
        directory before it was moved out may still remove that directory's
        own entries (they were the workspace's, and the mover could remove
        them itself); creating or changing anything there is a write outside.
        """
        now = self.attic_snapshot()
        return [f"{name}: {'new' if name not in self._attic_state else 'changed'}"
                for name, rec in sorted(now.items()) if self._attic_state.get(name) != rec]

    # ------------------------------------------------------------ interleaving

    def at_hook(self, point: str, rule: str, path: str, *,
                when: Callable[[dict[str, Any]], bool] | None = None) -> None:
        """Arm ``rule`` at ``path`` for the next time the library reaches hook ``point`` (once).

        Takes effect inside :meth:`armed`.  ``when`` filters on the point's
        context (for example, the operation or the path being opened).

        Raises:
            ValueError: an unknown point or rule.
        """
        if point not in _hooks.HOOK_POINTS:
            raise ValueError(f"unknown hook point {point!r}")
        if rule not in ATTACK_RULES:
            raise ValueError(f"unknown attack rule {rule!r}")
        self._armed.append((point, rule, path, when))

    def pending(self) -> int:
        """Armed rules that have not fired yet."""
        return len(self._armed)

    @contextlib.contextmanager
    def armed(self, *, timeout_s: float = 30.0, disarm: bool = True) -> Iterator["Attacker"]:
        """Install the hook that runs armed rules from the attacker's thread; on exit, disarm what did not fire.

        ``disarm=False`` keeps the rules that did not fire armed for the next
        :meth:`armed` block (a rule waits for the operation that reaches its point).

        At a matching point, the library's thread hands the rule to the
        attacker thread and waits until it is done (at most ``timeout_s``
        seconds; then ``TimeoutError`` propagates out of the operation).
        """
        jobs: queue.Queue[tuple[str, str, str, threading.Event] | None] = queue.Queue()

        def worker() -> None:
            while (job := jobs.get()) is not None:
                rule, path, point, done = job
                try:
                    self.apply(rule, path, point=point)
                finally:
                    done.set()

        thread = threading.Thread(target=worker, name="attacker-at-hook", daemon=True)
        thread.start()

        def hook(point: str, context: dict[str, Any]) -> None:
            if threading.current_thread() is thread or context.get("root") is self._ws:
                return  # the attacker's own moves
            for i, (want, rule, path, when) in enumerate(self._armed):
                if want == point and (when is None or when(context)):
                    del self._armed[i]
                    done = threading.Event()
                    jobs.put((rule, path, point, done))
                    if not done.wait(timeout_s):
                        raise TimeoutError(f"the attacker did not finish {rule} at {point}")
                    return

        try:
            with _hooks.installed(hook):
                yield self
        finally:
            if disarm:
                self._armed.clear()
            jobs.put(None)
            thread.join(timeout_s)

    @contextlib.contextmanager
    def free_running(self, paths: Callable[[], list[str]], *, pause_s: float = 0.0005) -> Iterator["Attacker"]:
        """Run random rules on random paths from a second thread until the block ends.

        Args:
            paths: called for candidate workspace paths before each move.
            pause_s: seconds between moves (``float``).

        Not replayable (the interleaving depends on the scheduler): for long
        campaigns, with hook-point attacks for what must shrink.
        """
        stop = threading.Event()

        def run() -> None:
            while not stop.is_set():
                cands = paths()
                if cands:
                    self.apply(self._rng.choice(ATTACK_RULES), self._rng.choice(cands))
                stop.wait(pause_s)

        thread = threading.Thread(target=run, name="attacker-free-running", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()


def _rename_over(dfd: int, tmp: bytes, leaf: bytes) -> None:
    """Rename ``tmp`` over ``leaf`` in ``dfd``; ``tmp`` never stays behind (a failed rename, or one
    between two links of one inode, which does nothing).

    Raises:
        OSError: the rename failed (``tmp`` removed).
    """
    try:
        os.rename(tmp, leaf, src_dir_fd=dfd, dst_dir_fd=dfd)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dfd)


def _join(path: str, leaf: bytes) -> str:
    parent = path.strip("/").rpartition("/")[0]
    name = os.fsdecode(leaf)
    return f"{parent}/{name}" if parent else name
