"""TOCTOU race: a second thread keeps swapping a directory and a symlink to
the outside while the main thread opens, creates, writes, renames and removes
beneath it.  The outside sentinel tree must not change at all, and every read
that succeeds must return inside data.
"""

from __future__ import annotations

import os
import threading
import time


from sandbox_fs import SandboxError, open_root

DURATION_S = float(os.environ.get("SANDBOX_FS_RACE_SECONDS", "2.5"))


def _swapper(ws, stop: threading.Event, counter: list[int]) -> None:
    real = ws / "d"
    parked = ws / "d.real"
    link_tmp = ws / "d.link"
    while not stop.is_set():
        try:
            os.symlink("../outside/subdir", link_tmp)
            os.rename(real, parked)          # d disappears
            os.rename(link_tmp, real)        # d is now a symlink to outside
            os.rename(real, link_tmp)        # ... and back
            os.rename(parked, real)
            os.unlink(link_tmp)
            counter[0] += 1
        except OSError:
            # our own operations may have changed things: restore a real dir
            try:
                if os.path.islink(real):
                    os.unlink(real)
                if os.path.isdir(parked) and not os.path.lexists(real):
                    os.rename(parked, real)
                if os.path.lexists(link_tmp):
                    os.unlink(link_tmp)
            except OSError:
                pass


def test_swap_race(layout, resolver):
    ws = layout.ws
    (ws / "d").mkdir()
    (ws / "d" / "inner.txt").write_text("inside")
    # same names as outside/subdir so a followed link would hit the sentinel
    before = layout.snapshot()
    stop = threading.Event()
    swaps = [0]
    t = threading.Thread(target=_swapper, args=(ws, stop, swaps), daemon=True)
    ops = {"ok": 0, "refused": 0}
    with open_root(ws) as root:
        t.start()
        deadline = time.monotonic() + DURATION_S
        i = 0
        try:
            while time.monotonic() < deadline:
                i += 1
                for op in (
                    lambda: root.read_bytes("d/inner.txt"),
                    lambda: root.write_bytes("d/inner.txt", b"inside"),
                    lambda: root.write_bytes(f"d/new{i % 7}", b"inside"),
                    lambda: root.mkdir(f"d/sub{i % 5}", exist_ok=True),
                    lambda: root.rename(f"d/new{i % 7}", f"d/renamed{i % 3}"),
                    lambda: root.remove(f"d/renamed{i % 3}"),
                    lambda: root.chmod("d/inner.txt", 0o644),
                    lambda: root.symlink("inner.txt", f"d/ln{i % 4}"),
                    lambda: root.rmtree(f"d/sub{i % 5}"),
                    lambda: root.open("d/inner.txt", "a").close(),
                ):
                    try:
                        out = op()
                    except (SandboxError, OSError):
                        ops["refused"] += 1
                        continue
                    ops["ok"] += 1
                    if isinstance(out, bytes):
                        assert layout.secret.encode() not in out
                        assert out == b"inside"
        finally:
            stop.set()
            t.join()
    assert swaps[0] > 50, f"the swapper barely ran ({swaps[0]} swaps)"
    assert ops["ok"] > 100 and ops["refused"] > 0, ops
    layout.assert_outside_unchanged(before)
