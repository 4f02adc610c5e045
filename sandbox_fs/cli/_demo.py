"""``sandbox-fs demo``: a short, self-contained show of Root refusing escapes."""

from __future__ import annotations

import argparse
import os
import tempfile

from ._output import escape_text
from ..errors import SandboxError
from ..root import open_root


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``sandbox-fs demo`` takes no options."""


def handle(args: argparse.Namespace) -> int:
    """Run the demo: 0 when every escape was refused, else 1."""
    from .. import features

    print(f"kernel features: {features()}")
    with tempfile.TemporaryDirectory(prefix="sfs-demo-") as tmp:
        ws, outside = os.path.join(tmp, "ws"), os.path.join(tmp, "outside")
        os.mkdir(ws)  # host-access: the demo's own throw-away temp dir
        os.mkdir(outside)  # host-access: the demo's own throw-away temp dir
        # host-access: the demo's sentinel, outside the workspace on purpose
        with open(os.path.join(outside, "secret.txt"), "w") as f:
            f.write("secret\n")
        # host-access: the demo plants the hostile link itself
        os.symlink("../outside", os.path.join(ws, "escape"))
        refused = 0
        with open_root(ws) as root:
            root.write_text("hello.txt", "inside\n")
            print(f"wrote and read back inside: {root.read_text('hello.txt')!r}")
            for label, op in [
                ("read ../outside/secret.txt", lambda: root.read_bytes("../outside/secret.txt")),
                ("read through symlink escape/", lambda: root.read_bytes("escape/secret.txt")),
                ("write through symlink escape/", lambda: root.write_bytes("escape/pwned", b"x")),
                ("read /etc/passwd", lambda: root.read_bytes("/etc/passwd")),
                ("symlink to /etc", lambda: root.symlink("/etc", "etc")),
            ]:
                try:
                    op()
                    print(f"  {label}: ALLOWED (unexpected)")
                except SandboxError as exc:
                    refused += 1
                    print(f"  {label}: refused -> {escape_text(str(exc), keep_backslash=True)}")
        # host-access: the demo checks its own sentinel dir
        ok = refused == 5 and os.listdir(outside) == ["secret.txt"]
        print("demo:", "every escape refused, outside untouched" if ok else "FAILED")
        return 0 if ok else 1
