"""A hypothesis state machine over Root and the snapshot/materialize layers, with an attacker interleaved.

Library rules (each drawn on paths a model of the workspace says are valid,
so an unattacked step must do exactly what the model predicts): write
(``write_bytes``), ``atomic_write`` with a mode, read, mkdir, rename (plain,
no-replace, exchange), symlink, link, remove, rmtree, clear, chmod, utime,
extract a small generated tar, materialize a small manifest (inline files,
a ``local_file`` and a ``local_dir`` from a host base tree), persist and
hydrate a snapshot.

Attacker rules (:class:`sandbox_fs.testing.Attacker`): plant a symlink to
the outside, exchange a directory with a symlink (``RENAME_EXCHANGE``),
replace a file with a FIFO or with a hard link to an outside file, move a
directory out of the workspace, chmod.  They run between steps, and armed
at a hook point of :mod:`sandbox_fs._hooks`, from the attacker's own thread
in the window of the next library step that reaches that point (for materialize, a second
attacker on the host base tree races the source windows).

Invariants after every step:

* the outside sentinel tree (a secret file among others) is byte- and
  metadata-identical, the hard-link bait's content is unchanged, and
  nothing appeared or changed in what the attacker moved out (the library
  may still remove entries of a directory it had entered: they were the
  workspace's own);
* no read returned the secret (or the bait, from a path the attacker did
  not touch): a read of an untouched path returns exactly the model's bytes;
* for every path the attacker did not touch (nor a step it raced), the disk
  matches the model: type, content, mode, link target, file mtimes the model
  knows, and no unexpected names.

An attacked step may fail only with a ``SandboxError`` or an allowed
``OSError`` (:func:`sandbox_fs.testing.classify_failure`); its paths then
join the touched set.

Profiles: the CI profile (default) runs bounded examples and only
hook-point attacks, so every example replays and shrinks.
``HYPOTHESIS_PROFILE=long`` (for campaigns) runs many more and longer
examples and adds a free-running attacker thread during every library step
(not replayable: a failure there is reported with its log, to be turned
into a hook-point case).  Both resolvers (``SANDBOX_FS_RESOLVER``).
Statistics (examples, steps, attacker moves, the longest interleaving)
print at the end of each test (``pytest -s``).
"""

from __future__ import annotations

import contextlib
import io
import os
import posixpath
import shutil
import stat
import tarfile
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import pytest
import trio
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import FlakyStrategyDefinition
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from sandbox_fs import _hooks, open_root
from sandbox_fs.archive import extract
from sandbox_fs.manifest import load_manifest
from sandbox_fs.materialize import MaterializeOptions, materialize
from sandbox_fs.snapshot import LocalSnapshotStore, hydrate, persist
from sandbox_fs.testing import ATTACK_RULES, Attacker, OutsideSentinel, classify_failure

settings.register_profile("sfs-stateful-ci", max_examples=50, stateful_step_count=25, deadline=None,
                          suppress_health_check=list(HealthCheck))
settings.register_profile("sfs-stateful-long", max_examples=400, stateful_step_count=60, deadline=None,
                          suppress_health_check=list(HealthCheck))
LONG = os.environ.get("HYPOTHESIS_PROFILE") == "long"
PROFILE = settings.get_profile("sfs-stateful-long" if LONG else "sfs-stateful-ci")
if os.environ.get("SFS_STATEFUL_EXAMPLES"):  # a longer local run without the free-running thread
    PROFILE = settings(PROFILE, max_examples=int(os.environ["SFS_STATEFUL_EXAMPLES"]))

#: File mtimes the rules set (seconds).  Bounded by what hydrate restores: the extractor applies an
#: mtime only within +-2**62 ns (``sandbox_fs.archive.mtime_is_applied``, about 2116-02-20), and
#: persist refuses an entry dated past it (tests/test_snapshot.py covers that refusal).
MTIMES_S = st.integers(0, (1 << 62) // 10**9)
SECRET = b"SECRET-stateful-7f3a9c"
BAIT = b"BAIT-hardlinked-outside\n"
NAMES = ["a", "b", "c"]
FILE_MODES = [0o644, 0o600, 0o755, 0o444]
DIR_MODES = [0o755, 0o700, 0o555]
STATS: dict[str, int] = {"examples": 0, "steps": 0, "moves": 0, "moves_at_hooks": 0, "attacked_steps": 0,
                         "longest_interleaving": 0, "hook_fired": 0}
#: Attacker moves that landed at each hook point (printed with the statistics).
POINTS: dict[str, int] = {}


@dataclass(frozen=True)
class Node:
    """A model entry: ``kind`` dir / file / link; files share ``ino`` when hard-linked."""

    kind: str
    mode: int = 0
    data: bytes = b""
    target: str = ""
    ino: int = 0
    mtime_ns: int | None = None


#: Hook points on the workspace (the materialize points are on the host base tree: its own attacker).
_WS_POINTS = [p for p in _hooks.HOOK_POINTS if not p.startswith("materialize.")]


def _under(path: str, top: str) -> bool:
    return top == "." or path == top or path.startswith(top + "/")


def _parent(path: str) -> str:
    return posixpath.dirname(path) or "."


class Workspace(RuleBasedStateMachine):
    """One example: a fresh throw-away area, a model, an attacker on the workspace and one on the base tree."""

    basetemp: str = "/tmp"

    def __init__(self) -> None:
        super().__init__()
        STATS["examples"] += 1
        self.area = Path(tempfile.mkdtemp(prefix="stateful-", dir=self.basetemp))
        self.ws_dir, self.outside = self.area / "ws", self.area / "outside"
        for d in (self.ws_dir, self.outside / "sub", self.area / "bait", self.area / "base"):
            d.mkdir(parents=True)
        (self.outside / "secret.txt").write_bytes(SECRET + b"\n")
        (self.outside / "sub" / "inner.txt").write_bytes(b"inner " + SECRET)
        self.bait = self.area / "bait" / "bait.txt"
        self.bait.write_bytes(BAIT)
        self._reset_base()
        self.sentinel = OutsideSentinel(self.outside)
        self.ws = open_root(self.ws_dir)
        self.checker = open_root(self.ws_dir, no_symlinks=True)
        self.store = LocalSnapshotStore(self.area / "store")
        self.attacker = Attacker(self.ws_dir, self.outside, self.bait, self.area / "attic", seed=STATS["examples"])
        self.src_attacker = Attacker(self.area / "base", self.outside, self.bait, self.area / "attic-src")
        self.model: dict[str, Node] = {}
        self.touched: set[str] = set()
        self.snap: tuple[dict[str, Node], set[str]] | None = None
        self.next_ino = 1
        self.counter = 0
        self.src_log: list[Any] = []

    def teardown(self) -> None:
        log = self.attacker.log + self.src_log
        moves = sum(r.done for r in log)
        STATS["longest_interleaving"] = max(STATS["longest_interleaving"], moves)
        STATS["moves"] += moves
        STATS["moves_at_hooks"] += sum(r.done and r.point is not None for r in log)
        STATS["hook_fired"] += sum(r.point is not None for r in log)
        for r in log:
            if r.point is not None and r.done:
                POINTS[r.point] = POINTS.get(r.point, 0) + 1
        for closer in (self.attacker.close, self.src_attacker.close, self.store.close, self.ws.close,
                       self.checker.close):
            with contextlib.suppress(Exception):
                closer()
        for dirpath, dirnames, _ in os.walk(self.area):  # read-only dirs the rules made (never through a link)
            for n in dirnames:
                p = os.path.join(dirpath, n)
                with contextlib.suppress(OSError):
                    if stat.S_ISDIR(os.lstat(p).st_mode):
                        os.chmod(p, 0o755)
        shutil.rmtree(self.area, ignore_errors=True)

    def _reset_base(self) -> None:
        base = self.area / "base"
        for n in os.listdir(base):
            p = base / n
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        (base / "src.txt").write_bytes(b"source file\n")
        os.chmod(base / "src.txt", 0o640)
        (base / "tree" / "sub").mkdir(parents=True)
        (base / "tree" / "t.txt").write_bytes(b"tree file\n")
        (base / "tree" / "sub" / "u.txt").write_bytes(b"sub file\n")

    # ------------------------------------------------------------ model helpers

    def trusted(self, path: str) -> bool:
        return not any(_under(path, t) for t in self.touched)

    def _dirs(self) -> list[str]:
        return ["."] + sorted(p for p, n in self.model.items() if n.kind == "dir")

    def _new_names(self, under_dirs: bool = True) -> list[str]:
        """Absent names whose parent is a model directory (at most 3 deep)."""
        out = []
        for d in self._dirs() if under_dirs else ["."]:
            if d.count("/") >= 2:
                continue
            for n in NAMES:
                p = n if d == "." else f"{d}/{n}"
                if p not in self.model:
                    out.append(p)
        return out

    def _of_kind(self, *kinds: str) -> list[str]:
        return sorted(p for p, n in self.model.items() if n.kind in kinds)

    def _file(self, data: bytes, mode: int, mtime_ns: int | None = None) -> Node:
        self.next_ino += 1
        return Node("file", mode, data, ino=self.next_ino, mtime_ns=mtime_ns)

    def _drop(self, top: str) -> None:
        for p in [p for p in self.model if _under(p, top)]:
            del self.model[p]

    def _move(self, src: str, dst: str) -> dict[str, Node]:
        moved = {p: n for p, n in self.model.items() if _under(p, src)}
        for p in moved:
            del self.model[p]
        return {dst + p[len(src):]: n for p, n in moved.items()}

    @contextlib.contextmanager
    def step(self, *paths: str) -> Iterator[dict[str, Any]]:
        """Run one library step: hook attacks armed, free attacker in the long profile; decide how strict to be.

        Yields a dict; the body sets ``out["ok"] = True`` after the call
        succeeded.  A step is *raced* when the attacker moved during it or
        one of ``paths`` (or an ancestor) is already touched: then it may fail
        only with an allowed error, and its paths join the touched set.
        Otherwise it must succeed.
        """
        STATS["steps"] += 1
        start = len(self.attacker.log)
        raced_before = not all(self.trusted(p) for p in paths)
        out: dict[str, Any] = {"ok": False}
        err: BaseException | None = None
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.attacker.armed(disarm=False))  # a move waits for a step reaching its point
            if LONG:
                stack.enter_context(self.attacker.free_running(lambda: sorted(self.model)))
            try:
                yield out
            except Exception as exc:  # noqa: BLE001 - judged below
                err = exc
        moved = any(r.done for r in self.attacker.log[start:]) or any(r.done for r in self.src_attacker.log)
        if moved:
            STATS["attacked_steps"] += 1
        raced = raced_before or moved
        self.touched |= self.attacker.touched
        if err is not None:
            assert raced, f"an unraced step failed: {err!r}"
            assert classify_failure(err, host_paths=[str(self.area)]), f"not an allowed failure: {err!r}"
        if raced:
            self.touched.update(paths or ["."])
            if any(r.done and r.rule == "move_out" for r in self.attacker.log[start:]):
                # an operation in flight when its directory was moved out completes in that
                # directory (as with any fd-relative API); no later step may touch it
                self.attacker.rebase_attic()
        out["apply"] = out["ok"] and not raced
        self._sync_touched()

    def _sync_touched(self) -> None:
        """Another name of a touched file's inode is touched too (a chmod through one changes both)."""
        self.touched |= self.attacker.touched
        inos = {n.ino for p, n in self.model.items() if n.kind == "file" and not self.trusted(p)}
        self.touched.update(p for p, n in self.model.items() if n.kind == "file" and n.ino in inos)

    # ------------------------------------------------------------ attacker rules

    @rule(data=st.data(), which=st.lists(st.sampled_from(ATTACK_RULES), min_size=1, max_size=2))
    def attack_now(self, data: st.DataObject, which: list[str]) -> None:
        """Attacker moves between steps, on model paths or fresh names."""
        for rule_name in which:
            cands = sorted(self.model) + self._new_names()
            if cands:
                self.attacker.apply(rule_name, data.draw(st.sampled_from(cands), label="attack path"))
        self._sync_touched()

    @rule(data=st.data(), arms=st.lists(st.tuples(st.sampled_from(_WS_POINTS), st.sampled_from(ATTACK_RULES)),
                                        min_size=1, max_size=3))
    def arm_at_hook(self, data: st.DataObject, arms: list[tuple[str, str]]) -> None:
        """Arm moves for the next times the next step reaches the drawn points (run from the attacker's thread)."""
        cands = sorted(self.model)
        for point, rule_name in arms:
            if cands:
                self.attacker.at_hook(point, rule_name, data.draw(st.sampled_from(cands), label="armed path"))

    # ------------------------------------------------------------ library rules

    @rule(data=st.data(), content=st.binary(max_size=48))
    def write(self, data: st.DataObject, content: bytes) -> None:
        cands = self._new_names() + self._of_kind("file", "link")
        if not cands:
            return
        path = data.draw(st.sampled_from(cands), label="write path")
        with self.step(path) as out:
            self.ws.write_bytes(path, content)
            out["ok"] = True
        if out["apply"]:
            self.model[path] = self._file(content, 0o644)

    @rule(data=st.data(), content=st.binary(max_size=48), mode=st.sampled_from(FILE_MODES),
          mtime=MTIMES_S)
    def atomic_write(self, data: st.DataObject, content: bytes, mode: int, mtime: int) -> None:
        cands = self._new_names() + self._of_kind("file", "link")
        if not cands:
            return
        path = data.draw(st.sampled_from(cands), label="atomic_write path")
        with self.step(path) as out:
            self.ws.atomic_write(path, [content], mode=mode, fsync=False, mtime_ns=mtime * 10**9)
            out["ok"] = True
        if out["apply"]:
            self.model[path] = self._file(content, mode, mtime * 10**9)

    @rule(data=st.data())
    def read(self, data: st.DataObject) -> None:
        cands = self._of_kind("file")
        if not cands:
            return
        path = data.draw(st.sampled_from(cands), label="read path")
        got: list[bytes] = []
        with self.step(path):
            got.append(self.ws.read_bytes(path))
        if got:
            assert SECRET not in got[0], f"a read of {path!r} returned outside data"
            if self.trusted(path):
                assert got[0] == self.model[path].data, f"read {path!r}: not the model's bytes"
                assert BAIT not in got[0] or BAIT in self.model[path].data

    @rule(data=st.data(), mode=st.sampled_from(DIR_MODES))
    def mkdir(self, data: st.DataObject, mode: int) -> None:
        cands = self._new_names()
        if not cands:
            return
        path = data.draw(st.sampled_from(cands), label="mkdir path")
        with self.step(path) as out:
            self.ws.mkdir(path, mode)
            self.ws.chmod(path, mode)  # mkdir's mode is masked by the umask; the model keeps the exact one
            out["ok"] = True
        if out["apply"]:
            self.model[path] = Node("dir", mode)

    @rule(data=st.data(), flavor=st.sampled_from(["plain", "no_replace", "exchange"]))
    def rename(self, data: st.DataObject, flavor: str) -> None:
        srcs = sorted(self.model)
        if not srcs:
            return
        src = data.draw(st.sampled_from(srcs), label="rename src")
        if flavor == "exchange":
            dsts = [p for p in self.model if not _under(p, src) and not _under(src, p)]
        elif flavor == "no_replace":
            dsts = [p for p in self._new_names() if not _under(p, src)]
        else:  # to a new name, or over a non-directory when src is one too
            dsts = [p for p in self._new_names() if not _under(p, src)]
            if self.model[src].kind != "dir":
                dsts += [p for p in self._of_kind("file", "link") if p != src]
        if not dsts:
            return
        dst = data.draw(st.sampled_from(sorted(dsts)), label="rename dst")
        with self.step(src, dst) as out:
            self.ws.rename(src, dst, no_replace=flavor == "no_replace", exchange=flavor == "exchange")
            out["ok"] = True
        if any(_under(t, src) or _under(t, dst) for t in self.touched):
            self.touched.update((src, dst))  # the touched names moved with them
        same = self.model[src].kind == "file" and dst in self.model and self.model[dst].kind == "file" \
            and self.model[dst].ino == self.model[src].ino
        if out["apply"] and same and flavor != "exchange":
            pass  # rename(2) between two names of one inode does nothing
        elif out["apply"]:
            if flavor == "exchange":
                a, b = self._move(src, "\0a"), self._move(dst, "\0b")
                self.model.update({dst + p[2:]: n for p, n in a.items()})
                self.model.update({src + p[2:]: n for p, n in b.items()})
            else:
                self._drop(dst)
                self.model.update(self._move(src, dst))

    @rule(data=st.data())
    def symlink(self, data: st.DataObject) -> None:
        cands = self._new_names()
        targets = sorted(self.model) + ["missing"]
        if not cands:
            return
        path = data.draw(st.sampled_from(cands), label="symlink path")
        to = data.draw(st.sampled_from(targets), label="symlink target")
        target = posixpath.relpath(to, _parent(path) if _parent(path) != "." else ".")
        with self.step(path) as out:
            self.ws.symlink(target, path)
            out["ok"] = True
        if out["apply"]:
            self.model[path] = Node("link", target=target)

    @rule(data=st.data())
    def link(self, data: st.DataObject) -> None:
        srcs, dsts = self._of_kind("file"), self._new_names()
        if not srcs or not dsts:
            return
        src = data.draw(st.sampled_from(srcs), label="link src")
        dst = data.draw(st.sampled_from(dsts), label="link dst")
        with self.step(src, dst) as out:
            self.ws.link(src, dst)
            out["ok"] = True
        if out["apply"]:
            self.model[dst] = self.model[src]

    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        cands = self._of_kind("file", "link")
        if not cands:
            return
        path = data.draw(st.sampled_from(cands), label="remove path")
        with self.step(path) as out:
            self.ws.remove(path)
            out["ok"] = True
        if out["apply"]:
            del self.model[path]

    @rule(data=st.data())
    def rmtree(self, data: st.DataObject) -> None:
        cands = self._of_kind("dir")
        if not cands:
            return
        path = data.draw(st.sampled_from(cands), label="rmtree path")
        with self.step(path) as out:
            self.ws.rmtree(path)
            out["ok"] = True
        if out["apply"]:
            self._drop(path)

    @rule()
    def clear(self) -> None:
        with self.step(".") as out:
            self.ws.clear()
            out["ok"] = True
        if out["apply"]:
            self.model.clear()

    @rule(data=st.data())
    def chmod(self, data: st.DataObject) -> None:
        cands = self._of_kind("file", "dir")
        if not cands:
            return
        path = data.draw(st.sampled_from(cands), label="chmod path")
        node = self.model[path]
        mode = data.draw(st.sampled_from(DIR_MODES if node.kind == "dir" else FILE_MODES), label="mode")
        with self.step(path) as out:
            self.ws.chmod(path, mode)
            out["ok"] = True
        if out["apply"]:
            self._update_inode(path, mode=mode)

    @rule(data=st.data(), mtime=MTIMES_S)
    def utime(self, data: st.DataObject, mtime: int) -> None:
        cands = self._of_kind("file")
        if not cands:
            return
        path = data.draw(st.sampled_from(cands), label="utime path")
        with self.step(path) as out:
            self.ws.utime(path, ns=(mtime * 10**9, mtime * 10**9))
            out["ok"] = True
        if out["apply"]:
            self._update_inode(path, mtime_ns=mtime * 10**9)

    def _update_inode(self, path: str, **changes: Any) -> None:
        node = self.model[path]
        for p, n in list(self.model.items()):
            if p == path or (node.kind == "file" and n.kind == "file" and n.ino == node.ino):
                self.model[p] = replace(n, **changes)

    @rule(data=st.data(), files=st.dictionaries(st.sampled_from(["f", "d/g", "d/h", "e"]), st.binary(max_size=16),
                                                 min_size=1, max_size=3))
    def extract_archive(self, data: st.DataObject, files: dict[str, bytes]) -> None:
        dirs = [d for d in self._dirs() if d.count("/") < 2]
        parent = data.draw(st.sampled_from(dirs), label="extract parent")
        self.counter += 1
        dest = f"x{self.counter}" if parent == "." else f"{parent}/x{self.counter}"
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for name, content in sorted(files.items()):
                info = tarfile.TarInfo(name)
                info.size, info.mode, info.mtime = len(content), 0o644, 10**6
                tar.addfile(info, io.BytesIO(content))
        buf.seek(0)
        with self.step(dest) as out:
            extract(self.ws, dest, buf, format="tar")
            out["ok"] = True
        if out["apply"]:
            self.model[dest] = Node("dir", 0o755)
            for name, content in files.items():
                if "/" in name:
                    self.model.setdefault(f"{dest}/{name.split('/')[0]}", Node("dir", 0o755))
                self.model[f"{dest}/{name}"] = self._file(content, 0o644, 10**15)

    @rule(race=st.sampled_from(["none", "plant_symlink", "replace_with_hardlink", "replace_with_fifo"]),
          point=st.sampled_from(["materialize.local_file", "materialize.local_dir_file"]),
          content=st.text(max_size=12))
    def materialize_manifest(self, race: str, point: str, content: str) -> None:
        self.counter += 1
        dest = f"m{self.counter}"
        if race != "none":
            victim = "src.txt" if point == "materialize.local_file" else "tree/t.txt"
            self.src_attacker.at_hook(point, race, victim)
        manifest = load_manifest({"entries": {
            f"{dest}/inline": {"type": "file", "content": content},
            f"{dest}/single": {"type": "local_file", "src": "src.txt"},
            f"{dest}/tree": {"type": "local_dir", "src": "tree"},
        }})
        # a directory where a local_dir file goes sends that file down the per-file path (the hook's window)
        self.ws.mkdir(dest)
        self.ws.mkdir(f"{dest}/tree")
        self.ws.mkdir(f"{dest}/tree/t.txt")
        self.model[dest] = Node("dir", 0o755)

        async def go() -> None:
            await materialize(self.ws, manifest, MaterializeOptions(base_dir=str(self.area / "base")))

        self.src_attacker.log.clear()
        with self.step(dest) as out, self.src_attacker.armed():
            trio.run(go)
            out["ok"] = True
        raced = any(r.done for r in self.src_attacker.log)
        self.src_log.extend(self.src_attacker.log)
        self.src_attacker.log.clear()
        self._reset_base()
        if out["apply"] and not raced:
            self.model[f"{dest}/inline"] = self._file(content.encode(), 0o644)
            self.model[f"{dest}/single"] = self._file(b"source file\n", 0o640)
            self.model[f"{dest}/tree"] = Node("dir", 0o755)
            self.model[f"{dest}/tree/sub"] = Node("dir", 0o755)
            self.model[f"{dest}/tree/t.txt"] = self._file(b"tree file\n", 0o644)
            self.model[f"{dest}/tree/sub/u.txt"] = self._file(b"sub file\n", 0o644)
        else:
            self.touched.add(dest)

    @rule()
    def persist_snapshot(self) -> None:
        with self.step() as out:
            persist(self.ws, self.store, "s", on_unrestorable="skip")
            out["ok"] = True
        if out["ok"]:
            self.snap = (dict(self.model), set(self.touched))

    @rule()
    def hydrate_snapshot(self) -> None:
        if self.snap is None:
            return
        with self.step() as out:
            hydrate(self.ws, self.store, "s")
            out["ok"] = True
        if out["ok"]:
            model, touched = self.snap
            self.model = dict(model)
            self.touched |= touched
        else:
            self.touched.add(".")

    # ------------------------------------------------------------ invariants

    @invariant()
    def outside_unchanged(self) -> None:
        self.sentinel.check()
        assert self.bait.read_bytes() == BAIT, "the hard-link bait was written through"
        changed = self.attacker.attic_changes() + self.src_attacker.attic_changes()
        assert not changed, f"what the attacker moved out changed: {changed}"

    @invariant()
    def no_outside_data_inside(self) -> None:
        for dirpath, _dirs, files in os.walk(self.ws_dir, followlinks=False):
            for n in files:
                p = os.path.join(dirpath, n)
                if stat.S_ISREG(os.lstat(p).st_mode):
                    with open(p, "rb") as f:
                        assert SECRET not in f.read(), f"outside data copied into the workspace: {p}"

    @invariant()
    def model_matches_disk(self) -> None:
        for path, node in sorted(self.model.items()):
            if not self.trusted(path):
                continue
            st_ = self.checker.lstat(path)
            if node.kind == "dir":
                assert stat.S_ISDIR(st_.st_mode), path
            elif node.kind == "link":
                assert stat.S_ISLNK(st_.st_mode) and self.checker.readlink(path) == node.target, path
                continue
            else:
                assert stat.S_ISREG(st_.st_mode), path
                assert self.checker.read_bytes(path) == node.data, path
                if node.mtime_ns is not None:
                    assert st_.st_mtime_ns == node.mtime_ns, path
            assert stat.S_IMODE(st_.st_mode) == node.mode, (path, oct(st_.st_mode), oct(node.mode))
        for d in self._dirs():
            if not self.trusted(d):
                continue
            names = set(self.checker.listdir(d))
            want = {p.rpartition("/")[2] for p in self.model if _parent(p) == d}
            extra = {n for n in names - want if self.trusted(n if d == "." else f"{d}/{n}")}
            assert not extra, f"unexpected names in {d!r}: {sorted(extra)}"


def _run(tmp_path: Path) -> None:
    Workspace.basetemp = str(tmp_path)
    before = dict(STATS)
    try:
        if LONG:
            _run_free(before["examples"])
        else:
            _run_ci()
    finally:
        assert _hooks.current is None
        ran = {k: STATS[k] - before[k] for k in STATS if k != "longest_interleaving"}
        print(f"\nstateful {os.environ.get('SANDBOX_FS_RESOLVER')}: {ran}, longest interleaving so far "
              f"{STATS['longest_interleaving']} attacker moves in one example; moves by hook point {POINTS}")


def _run_ci(attempts: int = 3) -> None:
    """The CI profile, run again (at most ``attempts`` times) when hypothesis saw its draws diverge.

    Attacks armed at hook points run at the same points on replay, but which
    points a step reaches can still depend on the scheduler (materialize's
    copier threads, the snapshot writer thread), and a step's candidates come
    from the model, so hypothesis occasionally replays a prefix that draws
    differently and raises FlakyStrategyDefinition.  That says nothing about
    the library; an invariant failure is still raised as it happened.  Draws
    that diverge on every attempt fail the test.
    """
    for attempt in range(attempts):
        try:
            run_state_machine_as_test(Workspace, settings=PROFILE)
            return
        except FlakyStrategyDefinition:
            if attempt == attempts - 1:
                raise
            print(f"\nstateful: draws diverged on attempt {attempt + 1}; running the profile again")


def _run_free(start: int) -> None:
    """The long profile: generate only, restarting when the free-running thread made a run's draws diverge.

    With a free-running attacker the model (so what a step may draw) depends
    on the scheduler, so hypothesis cannot replay a prefix (it raises
    FlakyStrategyDefinition and stops that run): the run starts again, until
    the profile's examples are done.  An invariant failure is reported as it
    happened (as FlakyFailure when it did not reproduce), with its steps.
    """
    free = settings(PROFILE, phases=[Phase.generate], database=None)
    restarts = 0
    while STATS["examples"] - start < PROFILE.max_examples and restarts < 1000:
        try:
            run_state_machine_as_test(Workspace, settings=free)
        except FlakyStrategyDefinition:
            restarts += 1
    print(f"\nlong profile: {restarts} restarts (draws diverged under the free-running thread)")


def test_stateful_toctou(resolver: str, tmp_path: Path) -> None:
    """The state machine over both resolvers (see the module docstring)."""
    _run(tmp_path)


def test_the_invariants_can_fail(resolver: str, tmp_path: Path) -> None:
    """A write through a planted link, or a step that does not do what the model says, is caught."""
    Workspace.basetemp = str(tmp_path)
    m = Workspace()
    try:
        m.attacker.plant_symlink("a")
        (m.ws_dir / "a" / "secret.txt").write_bytes(b"x")  # what a library following the link would do
        with pytest.raises(AssertionError, match="outside tree"):
            m.outside_unchanged()
    finally:
        m.teardown()
    m = Workspace()
    try:
        m.model["b"] = m._file(b"model", 0o644)
        m.ws.write_bytes("b", b"disk")
        with pytest.raises(AssertionError):
            m.model_matches_disk()
        m.ws.write_bytes("b", b"model")
        m.model_matches_disk()
        m.ws.write_bytes("c", b"")  # a name the model does not know
        with pytest.raises(AssertionError, match="unexpected names"):
            m.model_matches_disk()
    finally:
        m.teardown()
