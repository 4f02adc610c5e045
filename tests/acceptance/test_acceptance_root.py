"""Reports against capability-style directory APIs, replayed against ``Root``.

Each test names its report and the attack in its docstring and checks the
outside sentinel tree afterwards.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from sandbox_fs import SandboxError, open_root


@pytest.mark.parametrize("path", ["../", "..//", "../.", "./../", "a/../../", "a/..//../", "a/b/../../../",
                                  "../outside/", "../outside/./secret.txt/"])
def test_cve_2025_22873_trailing_dotdot_never_reaches_the_parent(layout, contained, resolver, path):
    """CVE-2025-22873 (Go ``os.Root``): ``Root.Open("../")`` opened the root's parent, because a path
    ending in ``../`` was handled apart from the rule for ``..``."""
    (layout.ws / "a" / "b").mkdir(parents=True)
    with open_root(layout.ws) as root:
        for op in (lambda: root.listdir(path), lambda: root.stat(path), lambda: root.open_dir_fd(path),
                   lambda: root.read_bytes(path), lambda: root.mkdir(path + "pwned"),
                   lambda: root.write_bytes(path + "pwned.txt", b"pwned"), lambda: root.chmod(path, 0o777),
                   lambda: root.utime(path, ns=(0, 0)), lambda: root.rmtree(path)):
            try:
                out = op()
            except (SandboxError, OSError):
                continue
            if isinstance(out, int):
                os.close(out)
            names = out if isinstance(out, list) else []
            assert "secret.txt" not in names and "outside" not in names and "ws" not in names, (path, out)
    contained.check()
    assert not (layout.outside / "pwned.txt").exists() and not (layout.base / "pwned").exists()


class Exchanger(threading.Thread):
    """The attacker: swaps ``victim/sub`` (a directory) and ``decoy`` (a symlink to the outside) with
    renameat2(RENAME_EXCHANGE), over and over, except while the test holds ``paused``."""

    def __init__(self, ws: str) -> None:
        super().__init__(daemon=True)
        self.dirfd = os.open(ws, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self.paused = threading.Lock()
        self.stop = threading.Event()
        self.count = 0

    def run(self) -> None:
        from sandbox_fs import _native

        while not self.stop.is_set():
            with self.paused:
                if _native.renameat2_raw(self.dirfd, b"victim/sub", self.dirfd, b"decoy",
                                         _native.RENAME_EXCHANGE) == 0:
                    self.count += 1
            time.sleep(0)

    def close(self) -> None:
        self.stop.set()
        self.join()
        os.close(self.dirfd)


def _reset(ws, outside) -> None:
    """With the attacker paused: ``victim/sub`` a directory of two files, ``decoy`` a symlink to outside."""
    decoy, sub = ws / "decoy", ws / "victim" / "sub"
    for d in (decoy, sub):
        if d.is_symlink():
            d.unlink()
        elif d.is_dir():  # a directory of ours that the exchange moved: only our two files
            for child in d.iterdir():
                child.unlink()
            d.rmdir()
    sub.mkdir(parents=True)
    for name in ("secret.txt", "sentinel.txt"):
        (sub / name).write_text("inside\n")
    os.symlink(outside, decoy)


def test_cve_2022_21658_rmtree_racing_a_symlink_exchange_removes_nothing_outside(layout, contained, resolver):
    """CVE-2022-21658 (Rust ``std::fs::remove_dir_all``): a directory swapped for a symlink between the
    check and the removal of its entries made the removal delete the files the symlink pointed at."""
    attacker = Exchanger(str(layout.ws))
    removed = refused = 0
    with open_root(layout.ws) as root:
        attacker.start()
        try:
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                with attacker.paused:
                    _reset(layout.ws, layout.outside)
                try:
                    root.rmtree("victim")
                    removed += 1
                except (SandboxError, OSError):
                    refused += 1
        finally:
            attacker.close()
    assert attacker.count > 20, f"the attacker barely ran ({attacker.count} exchanges)"
    assert removed > 0, "rmtree never completed: the race was not exercised"
    layout.assert_outside_unchanged(contained.before)
    assert (layout.outside / "secret.txt").read_text().startswith(layout.secret)
