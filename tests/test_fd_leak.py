"""No fd leak: /proc/self/fd counted before and after 10,000 mixed operations."""

from __future__ import annotations

import os

from sandbox_fs import SandboxError, open_root


def _nfds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_no_fd_leak(layout, resolver):
    os.symlink("../outside", layout.ws / "esc")
    base = _nfds()
    with open_root(layout.ws) as root:
        root.mkdir("d")
        n = 0
        while n < 10_000:
            i = n
            for op in (
                lambda: root.write_bytes(f"d/f{i % 13}", b"x" * (i % 50)),
                lambda: root.read_bytes(f"d/f{i % 13}"),
                lambda: root.stat(f"d/f{i % 13}"),
                lambda: root.listdir("d"),
                lambda: root.read_bytes("esc/secret.txt"),       # refused
                lambda: root.read_bytes("missing/x"),             # ENOENT
                lambda: root.mkdir(f"d/s{i % 5}", exist_ok=True),
                lambda: root.rename(f"d/f{i % 13}", f"d/g{i % 13}"),
                lambda: root.remove(f"d/g{i % 13}"),
                lambda: root.symlink("f1", f"d/l{i % 3}"),
                lambda: list(root.walk("d")),
                lambda: root.rmtree(f"d/s{i % 5}"),
            ):
                try:
                    op()
                except (SandboxError, OSError):
                    pass
                n += 1
    assert _nfds() == base
