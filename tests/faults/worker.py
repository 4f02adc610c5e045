"""The fault suite's long-lived worker: forks one child per fault point from a warmed process.

Started once per batch by ``tests/test_faults*.py`` with ``LD_PRELOAD`` set to the
fault shim (``tests/faults/shim.c``), this process imports the library, then reads
one JSON command per line on stdin and answers one JSON line on stdout.  For every
fault point it forks two children, and never runs trio or a thread itself (a fork
of a process with threads keeps locks the vanished threads held):

* the *fault child* arms the shim (the Nth matching call fails with an errno, or
  SIGKILLs the process), or lowers ``RLIMIT_NOFILE``, runs the operation, and
  reports how it ended: success, an error (checked to be a ``SandboxError`` or an
  ``OSError`` with an expected errno, its text free of host paths), or a crash;
  after an error it also checks that it kept no fd and no thread;
* the *check child* (shim unarmed) checks what the fault left: the last good
  snapshot restores to a tree it was taken of, the workspace is the old tree or
  is repaired by re-applying, and after the repair no temporary name of the
  library (``.sfs-*`` in the workspace, anything but the current generation in
  the store) remains.  It then puts the scenario back to its starting state.

Scenarios (``kind``): ``persist``, ``hydrate``, ``extract``, ``materialize``.
Each is laid out under one directory given by the test (``ws/``, ``store/``,
``base/``, ``check/``, ``archive.tar``), possibly with ``ws`` and ``store`` on
small filesystems the test mounted.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Any, Callable

import sandbox_fs
from sandbox_fs import open_root
from sandbox_fs.archive import extract
from sandbox_fs.errors import SandboxError
from sandbox_fs.snapshot import LocalSnapshotStore, SnapshotLimits, hydrate, persist, tree_digest

SHIM_CLASSES = {"read": 1, "write": 2, "fsync": 4, "rename": 8, "open": 16, "names": 32}
ALL_CLASSES = 63
ACTIONS = {"count": 0, "fail": 1, "kill": 2}
ALLOWED_ERRNOS = {errno.EIO, errno.ENOSPC, errno.EMFILE, errno.ENFILE, errno.EDQUOT}
EXIT_OK, EXIT_ERROR, EXIT_CRASH = 0, 10, 20


def host_view(top: Path) -> dict[str, list[Any]]:
    """Type, mode, size and content (or link target) of every node under ``top``; mtimes left out."""
    out: dict[str, list[Any]] = {}  # lists, not tuples: views travel between processes as JSON
    for dirpath, dirs, files in os.walk(top):
        for name in dirs + files:
            p = Path(dirpath, name)
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                extra: Any = os.readlink(p)
            elif stat.S_ISREG(st.st_mode):
                extra = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                extra = None
            out[str(p.relative_to(top))] = [stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode),
                                            st.st_size if not stat.S_ISDIR(st.st_mode) else 0, extra]
    return out


def leftovers(top: Path) -> list[str]:
    """Names of the library's temporaries (``.sfs-*``) anywhere under ``top``."""
    return sorted(str(Path(d, n).relative_to(top)) for d, ds, fs in os.walk(top) for n in ds + fs
                  if n.startswith(".sfs-") and n != sandbox_fs.snapshot.WORKSPACE_ID_NAME)


def _diff(a: dict[str, list[Any]], b: dict[str, list[Any]]) -> list[str]:
    """The first few paths whose view differs between ``a`` and ``b``."""
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))[:5]


def without_stale_staging(top: Path, view: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """``view`` without what lies in a stale staging directory (``.sfs-extract-*`` that no live
    extraction holds locked) or a stale private directory of Root's checked removal (``.sfs-rm-*``
    that no removal holds locked): the removal that failed with the fault is best effort, and the
    next extraction into that directory sweeps both (``sandbox_fs.archive._staging``,
    ``Root.sweep_removals``).  A held one stays in."""
    import fcntl

    stale: set[str] = set()
    for rel in view:
        parts = rel.split("/")
        for i, part in enumerate(parts):
            if part.startswith((".sfs-extract-", ".sfs-rm-")):
                stage = "/".join(parts[:i + 1])
                if stage not in stale:
                    fd = os.open(top / stage, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        stale.add(stage)
                    except BlockingIOError:
                        pass
                    finally:
                        os.close(fd)
                break
    return {k: v for k, v in view.items() if not any(k == s or k.startswith(s + "/") for s in stale)}


def fill_tree(top: Path, tag: str, files: int = 24, big_bytes: int = 96 * 1024) -> None:
    """A small tree: nested directories, files of several sizes, a symlink, a hard link, odd modes."""
    (top / "src" / "pkg" / "deep").mkdir(parents=True, exist_ok=True)
    (top / "data").mkdir(exist_ok=True)
    for i in range(files):
        d = ("src", "src/pkg", "src/pkg/deep", "data")[i % 4]
        (top / d / f"f{i}.txt").write_bytes(f"{tag}:{i}\n".encode() * (1 + i * 7))
    (top / "data" / "big.bin").write_bytes(hashlib.sha256(tag.encode()).digest() * (big_bytes // 32))
    os.chmod(top / "data" / "f3.txt", 0o600)
    os.chmod(top / "src" / "pkg" / "deep", 0o750)
    link = top / "src" / "link"
    if not link.is_symlink():
        os.symlink("pkg/f1.txt", link)
    hard = top / "data" / "hard.txt"
    if not hard.exists():
        os.link(top / "data" / "f3.txt", hard)


def empty_dir(top: Path) -> None:
    """Remove everything under ``top`` (a throw-away test directory), keeping ``top``."""
    for name in os.listdir(top):
        p = top / name
        if p.is_dir() and not p.is_symlink():
            for d, ds, _fs in os.walk(p):
                for n in ds:
                    os.chmod(Path(d, n), 0o700)
            shutil.rmtree(p)
        else:
            p.unlink()


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class Scenario:
    """One operation and its invariants, laid out under ``top``."""

    name = "snap"

    def __init__(self, top: Path) -> None:
        self.top = top
        self.ws, self.store, self.check = top / "ws", top / "store", top / "check"
        self.base, self.archive = top / "base", top / "archive.tar"
        self.counter = 0

    def prepare(self) -> None:
        raise NotImplementedError

    def run(self) -> None:
        raise NotImplementedError

    def verify(self, outcome: str) -> list[str]:
        """Check what the fault left, repair, and reset to the starting state; the problems found."""
        raise NotImplementedError

    def restored_view(self) -> tuple[dict[str, list[Any]] | None, str | None]:
        """Hydrate the store's current snapshot into ``check/``: its view, or the error."""
        empty_dir(self.check)
        with open_root(self.check) as ck, LocalSnapshotStore(self.store, create=False) as st:
            try:
                hydrate(ck, st, self.name)
            except Exception as exc:  # noqa: BLE001 - reported as a finding
                return None, error_text(exc)
        return host_view(self.check), None

    def store_extras(self) -> list[str]:
        """Files in the store besides the current generation's metadata, lock and archive."""
        with LocalSnapshotStore(self.store, create=False) as st:
            info = st.info(self.name)
        keep = {f"{self.name}.json", f"{self.name}.lock"} | ({info.archive} if info else set())
        return sorted(set(os.listdir(self.store)) - keep)


class PersistScenario(Scenario):
    """Persist a changed workspace over a good generation: the old or the new one is current, never neither."""

    def prepare(self) -> None:
        fill_tree(self.ws, "ws", files=110)
        self.persist_now()
        self.old = host_view(self.ws)
        with open_root(self.ws) as ws:
            self.old_digest = tree_digest(ws)
        self.bump()

    def persist_now(self) -> None:
        with open_root(self.ws) as ws, LocalSnapshotStore(self.store) as st:
            persist(ws, st, self.name)

    def bump(self) -> None:
        self.counter += 1
        (self.ws / "src" / "counter.txt").write_text(f"{self.counter}\n" * self.counter)
        self.new = host_view(self.ws)

    def run(self) -> None:
        self.persist_now()

    def verify(self, outcome: str) -> list[str]:
        problems = []
        if host_view(self.ws) != self.new:
            problems.append("persist changed the workspace")
        if self.counter % 5 == 0:  # every 5th point: restore it in full
            view, err = self.restored_view()
            if err is not None:
                problems.append(f"the current snapshot does not restore: {err}")
            elif view not in (self.old, self.new):
                problems.append("the current snapshot restores to neither the previous nor the new tree")
            elif outcome == "ok" and view != self.new:
                problems.append("persist succeeded but the new tree is not current")
        else:  # otherwise: the archive verifies (size, CRC-32) and records one of the two trees
            with LocalSnapshotStore(self.store, create=False) as st, open_root(self.ws) as ws:
                try:
                    f, info = st.open_archive(self.name, SnapshotLimits())
                    f.close()
                except Exception as exc:  # noqa: BLE001 - reported as a finding
                    problems.append(f"the current snapshot does not verify: {error_text(exc)}")
                else:
                    now = tree_digest(ws)
                    if info.tree_digest not in (self.old_digest, now) or (outcome == "ok" and info.tree_digest != now):
                        problems.append("the current snapshot records neither the previous nor the new tree")
        self.persist_now()  # the repair: persisting again works and leaves one generation
        extras = self.store_extras()
        if extras:
            problems.append(f"the store keeps {extras} after a successful persist")
        self.old = self.new
        with open_root(self.ws) as ws:
            self.old_digest = tree_digest(ws)
        self.bump()
        return problems


class HydrateScenario(Scenario):
    """Hydrate snapshot ``snap`` over a different workspace; re-hydrating repairs it; the store is untouched."""

    def prepare(self) -> None:
        fill_tree(self.ws, "target", files=48)
        self.persist_as(self.name)
        self.target = host_view(self.ws)
        empty_dir(self.ws)
        fill_tree(self.ws, "before", files=48)
        (self.ws / "only-before").mkdir()
        (self.ws / "only-before" / "x").write_bytes(b"x" * 5000)
        self.persist_as("before")
        self.before = host_view(self.ws)
        self.store_files = self.store_state()
        self.target_name = self.name

    def persist_as(self, name: str) -> None:
        with open_root(self.ws) as ws, LocalSnapshotStore(self.store) as st:
            persist(ws, st, name)

    def store_state(self) -> dict[str, list[Any]]:
        return host_view(self.store)

    def hydrate_as(self, name: str) -> None:
        with open_root(self.ws) as ws, LocalSnapshotStore(self.store, create=False) as st:
            hydrate(ws, st, name)

    def run(self) -> None:
        self.hydrate_as(self.target_name)

    def verify(self, outcome: str) -> list[str]:
        problems = []
        if self.store_state() != self.store_files:
            problems.append("hydrate changed the store")
        left = host_view(self.ws)
        clean = {k: v for k, v in left.items() if not any(p.startswith(".sfs-") for p in k.split("/"))}
        # A success may leave its staging directory when its removal failed (best effort: it is
        # never persisted and goes with the next hydrate, checked by the repair below).  A failure
        # before the swap leaves the previous tree; one during the swap (after the clear) a
        # workspace that only re-hydrating repairs.
        # Points alternate the two snapshots: each hydrate replaces the other one's tree.
        target, other = (self.target, self.before) if self.target_name == self.name else (self.before, self.target)
        if outcome == "ok" and clean != target:
            problems.append("hydrate succeeded with another tree")
        self.mixed = clean not in (other, target)
        self.hydrate_as(self.target_name)  # the repair
        if host_view(self.ws) != target or leftovers(self.ws):
            problems.append(f"re-hydrating did not repair the workspace (left {leftovers(self.ws)})")
        self.target_name = "before" if self.target_name == self.name else self.name
        return problems


class ExtractScenario(Scenario):
    """Extract an archive into an existing destination: all of it or none of it, and no staging left."""

    def prepare(self) -> None:
        src = self.top / "tree"
        fill_tree(src, "archive", files=30)
        with tarfile.open(self.archive, "w", format=tarfile.PAX_FORMAT) as tf:
            tf.add(src, arcname=".")
        (self.ws / "dest").mkdir(parents=True)
        (self.ws / "dest" / "kept.txt").write_bytes(b"kept\n")
        self.before = host_view(self.ws)
        self.run()
        self.after = host_view(self.ws)
        self.reset()

    def reset(self) -> None:
        empty_dir(self.ws)
        (self.ws / "dest").mkdir()
        (self.ws / "dest" / "kept.txt").write_bytes(b"kept\n")

    def run(self) -> None:
        with open_root(self.ws) as ws:
            extract(ws, "dest", str(self.archive))

    def verify(self, outcome: str) -> list[str]:
        problems = []
        view = without_stale_staging(self.ws, host_view(self.ws))
        if outcome == "ok" and view != self.after:
            problems.append(f"extract succeeded with another tree: {_diff(view, self.after)}")
        if outcome != "ok" and view != self.before:
            problems.append(f"a failed extract left {sorted(set(view) - set(self.before))[:5]}")
        self.run()  # the repair: extracting again
        if host_view(self.ws) != self.after:
            problems.append("extracting again did not give the archive's tree")
        self.reset()
        return problems


class MaterializeScenario(Scenario):
    """Materialize a manifest (a local_dir, a local_file, an archive); applying it again repairs."""

    def prepare(self) -> None:
        fill_tree(self.base / "proj", "base", files=30)
        src = self.top / "tree"
        fill_tree(src, "archive", files=6)
        with tarfile.open(self.base / "a.tar", "w", format=tarfile.PAX_FORMAT) as tf:
            tf.add(src, arcname=".")
        self.run()
        self.after = host_view(self.ws)
        empty_dir(self.ws)

    def run(self) -> None:
        import trio

        from sandbox_fs.manifest import load_manifest
        from sandbox_fs.materialize import MaterializeOptions, materialize

        manifest = load_manifest({"entries": {
            "proj": {"type": "local_dir", "src": "proj"},
            "one.bin": {"type": "local_file", "src": "proj/data/big.bin"},
            "unpacked": {"type": "archive", "src": "a.tar"},
            "notes/readme.txt": {"type": "file", "content": "hello\n"},
        }})

        async def apply() -> None:
            with open_root(self.ws) as ws:
                await materialize(ws, manifest, MaterializeOptions(base_dir=str(self.base)))

        trio.run(apply)

    def verify(self, outcome: str) -> list[str]:
        problems = []
        view = without_stale_staging(self.ws, host_view(self.ws))
        if outcome == "ok" and view != self.after:
            problems.append(f"materialize succeeded with another tree: {_diff(view, self.after)}")
        if [p for p in leftovers(self.ws) if without_stale_staging(self.ws, {p: []})] and outcome == "error":
            problems.append(f"a failed materialize left temporaries {leftovers(self.ws)[:5]}")
        self.run()  # the repair: applying again over what the fault left
        if host_view(self.ws) != self.after or leftovers(self.ws):
            problems.append("applying the manifest again did not repair the workspace")
        empty_dir(self.ws)
        return problems


# tempfile finds its directory once per process by creating, writing and removing a probe file
# there: done here, before any fork, so a child SIGKILLed at a fault point never leaves that probe
# behind in /tmp (each child would otherwise run the probe itself).
tempfile.gettempdir()

SCENARIOS: dict[str, type[Scenario]] = {"persist": PersistScenario, "hydrate": HydrateScenario,
                                        "extract": ExtractScenario, "materialize": MaterializeScenario}


def open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


def in_child(fn: Callable[[int], int]) -> tuple[str, dict[str, Any]]:
    """Fork; the child runs ``fn(report_fd)`` and exits with its code.  (outcome, the child's report)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        code = EXIT_CRASH
        try:
            code = fn(w)
        except BaseException:  # noqa: BLE001 - reported to the parent
            os.write(w, json.dumps({"crash": traceback.format_exc()}).encode())
        os._exit(code)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    report = json.loads(b"".join(chunks) or b"{}")
    if os.WIFSIGNALED(status):
        return ("killed" if os.WTERMSIG(status) == signal.SIGKILL else f"signal {os.WTERMSIG(status)}"), report
    code = os.WEXITSTATUS(status)
    return {EXIT_OK: "ok", EXIT_ERROR: "error"}.get(code, "crash"), report


class Worker:
    def __init__(self) -> None:
        self.lib = ctypes.CDLL(None)
        self.lib.sfs_fault_arm.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_int, ctypes.c_int]
        self.lib.sfs_fault_disarm.restype = ctypes.c_long
        self.scenario: Scenario | None = None

    def setup(self, kind: str, top: str) -> dict[str, Any]:
        sc = SCENARIOS[kind](Path(top))
        for d in (sc.ws, sc.store, sc.check, sc.base):
            d.mkdir(parents=True, exist_ok=True)
        outcome, report = in_child(lambda w: self._prepare(sc, w))
        if outcome != "ok":
            return {"error": f"prepare: {outcome} {report}"}
        sc.__dict__.update(report["state"])  # what prepare measured, for the parent's later children
        self.scenario = sc
        return {"ok": True}

    @staticmethod
    def _prepare(sc: Scenario, w: int) -> int:
        sc.prepare()
        state = {k: v for k, v in sc.__dict__.items() if k not in ("top", "ws", "store", "check", "base", "archive")}
        os.write(w, json.dumps({"state": state}).encode())
        return EXIT_OK

    def fault(self, w: int, action: str, mask: int, nth: int, err: int, nofile: int | None) -> int:
        """The fault child: arm, run, report (never returns to the worker's loop)."""
        sc = self.scenario
        assert sc is not None
        before = open_fds()
        if nofile is not None:
            # the limit bounds fd numbers: ``nofile`` more than the highest one open now
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(before) + 1 + nofile,
                                                        resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        self.lib.sfs_fault_arm(mask if action != "none" else 0, nth, ACTIONS.get(action, 0), err)
        report: dict[str, Any] = {}
        code = EXIT_OK
        try:
            sc.run()
        except (SandboxError, OSError) as exc:
            code = EXIT_ERROR
            report["error"] = error_text(exc)
            report["errno"] = getattr(exc, "errno", None)
            if isinstance(exc, OSError) and not isinstance(exc, SandboxError) and exc.errno not in ALLOWED_ERRNOS:
                report.setdefault("problems", []).append(f"unexpected error {error_text(exc)}")
            if str(sc.top) in str(exc):
                report.setdefault("problems", []).append(f"the error shows a host path: {error_text(exc)}")
        finally:
            report["calls"] = self.lib.sfs_fault_disarm()
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
        kept = open_fds() - before
        if kept:
            report.setdefault("problems", []).append(f"{len(kept)} fds left open after {report.get('error', 'success')}")
        # trio keeps idle worker threads in its thread cache after trio.run (they exit after 10 s idle)
        extra = [t.name for t in threading.enumerate()
                 if t is not threading.main_thread() and not t.name.startswith("Trio thread")]
        if extra:
            report.setdefault("problems", []).append(f"threads left: {extra}")
        os.write(w, json.dumps(report).encode())
        return code

    def check(self, w: int, outcome: str) -> int:
        sc = self.scenario
        assert sc is not None
        problems = sc.verify(outcome)
        state = {k: v for k, v in sc.__dict__.items() if k not in ("top", "ws", "store", "check", "base", "archive")}
        os.write(w, json.dumps({"problems": problems, "state": state}).encode())
        return EXIT_OK

    @staticmethod
    def _resize(fs: str, size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", fs], check=True)

    def _shrink(self, fs: str, margin: int) -> None:
        """Make the tmpfs at ``fs`` full but ``margin`` bytes (rounded to pages)."""
        sv = os.statvfs(fs)
        used = (sv.f_blocks - sv.f_bfree) * sv.f_frsize
        self._resize(fs, str(max(used + margin, 4096 * 4)))

    def batch(self, action: str, mask: int, points: list[int], err: int = errno.EIO,
              nofile: list[int] | None = None, shrink: str | None = None) -> dict[str, Any]:
        """Run one fault child and one check child per point; the tally and every problem found."""
        sc = self.scenario
        assert sc is not None
        fds = open_fds()
        tally: dict[str, int] = {}
        errnos: dict[str, int] = {}
        problems: list[str] = []
        calls = 0
        mixed = 0
        runs = [(p, None) for p in points] if nofile is None else [(0, n) for n in nofile]
        for nth, limit in runs:
            if shrink is not None:  # ``points`` are the free bytes left on the tmpfs ``shrink``
                self._shrink(shrink, nth)
            outcome, rep = in_child(lambda w: self.fault(w, action, mask, nth, err, limit))
            if shrink is not None:
                self._resize(shrink, "256m")
                if outcome == "error" and rep.get("errno") != errno.ENOSPC and "No space left" not in rep.get("error", ""):
                    problems.append(f"free {nth}: a full disk gave another error: {rep.get('error')}")
            tally[outcome] = tally.get(outcome, 0) + 1
            if outcome == "error":
                key = errno.errorcode.get(rep.get("errno") or 0, rep.get("error", "?")[:40])
                errnos[key] = errnos.get(key, 0) + 1
            calls = max(calls, rep.get("calls", 0))
            where = f"{type(sc).__name__} {action} at {nth if limit is None else f'nofile+{limit}'}"
            if outcome not in ("ok", "error", "killed"):
                problems.append(f"{where}: {outcome} {rep.get('crash', '')[-2000:]}")
            problems += [f"{where}: {p}" for p in rep.get("problems", [])]
            checked, crep = in_child(lambda w: self.check(w, outcome))
            if checked != "ok":
                problems.append(f"{where}: the check failed: {checked} {crep.get('crash', '')[-2000:]}")
                break
            problems += [f"{where}: {p}" for p in crep["problems"]]
            sc.__dict__.update(crep["state"])
            mixed += bool(crep["state"].get("mixed"))
        if open_fds() != fds:
            problems.append("the worker's fds changed over the batch")
        return {"tally": tally, "problems": problems, "calls": calls, "mixed": mixed, "errnos": errnos}

    def count(self, mask: int) -> dict[str, Any]:
        """How many calls of ``mask`` one clean run makes (the range fault points are chosen in)."""
        outcome, rep = in_child(lambda w: self.fault(w, "count", mask, 0, 0, None))
        checked, crep = in_child(lambda w: self.check(w, outcome))
        if self.scenario is not None and checked == "ok":
            self.scenario.__dict__.update(crep["state"])
        return {"outcome": outcome, "calls": rep.get("calls", 0), "problems": rep.get("problems", []) +
                crep.get("problems", [])}


def warm() -> None:
    """Import every library module now, so that faults land on the operations, never on a lazy import."""
    import importlib
    import pkgutil

    for mod in pkgutil.walk_packages(sandbox_fs.__path__, "sandbox_fs."):
        if mod.name.endswith("__main__") or mod.name.startswith(("sandbox_fs.fuse._daemon", "sandbox_fs.fuse._ops",
                                                                  "sandbox_fs.cli")):
            continue  # the overlay daemon's side (pyfuse3) and the command line are never used here
        importlib.import_module(mod.name)
    importlib.import_module("trio")


def main() -> None:
    warm()
    worker = Worker()
    out = sys.stdout
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            reply = getattr(worker, op)(**cmd)
        except Exception:  # noqa: BLE001 - sent to the test
            reply = {"error": traceback.format_exc()}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
