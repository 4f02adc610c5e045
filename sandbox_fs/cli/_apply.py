"""``sandbox-fs apply MANIFEST --base DIR [--root DIR] [--grant [NAME=]PATH[:ro|:rw]]... [--json]``.

Applies an (untrusted) manifest to a workspace directory.  The command-line
user is the trusted party: the manifest file, ``--base``, ``--grant`` and the
workspace location are theirs to choose, so the manifest's ``root`` is
honoured here (``--root`` overrides it).  The manifest itself still cannot
grant host access (``load_manifest(trust="untrusted")``).  The workspace
directory is created when missing (only its last component, mode 0700); a
symlink in its place is refused.

Output: a summary line on stdout, or the JSON result with ``--json``
(``{"ok": true, "result": ...}`` or ``{"ok": false, "error": ...}``).  On a
TTY, and never in JSON mode, a progress line (files, bytes) is redrawn on
stderr while a long apply runs.  A refusal prints one line on stderr naming
the field or sandbox path, and exits 1; never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import trio

from . import _hostpath
from ._errors import exception_leaves
from ._hostpath import host_path, parse_grant, read_input
from ._output import escape_text, json_text, one_line
from ..errors import SandboxError
from ..manifest import MAX_MANIFEST_BYTES, ManifestError, load_manifest
from ..materialize import MaterializeOptions, MaterializeProgress, materialize
from ..root import open_root


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``sandbox-fs apply``."""
    p.description = __doc__.split("\n\n")[1]
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("manifest", help="manifest JSON file ('-' for stdin)")
    p.add_argument("--base", metavar="DIR", default=None,
                   help="trusted base directory that local_file/local_dir/archive sources are read beneath "
                        "(no default: without it such sources are refused)")
    p.add_argument("--root", metavar="DIR", default=None,
                   help="workspace directory (overrides the manifest's root; created if missing)")
    p.add_argument("--grant", metavar="[NAME=]PATH[:ro|:rw]", action="append", default=[],
                   help="extra path grant sources may be read from (absolute src under PATH); repeatable")
    p.add_argument("--json", action="store_true", help="print the result (or error) as JSON on stdout")
    p.add_argument("--no-digest", action="store_true", help="skip sha256 of written files (fd-to-fd copy)")
    p.add_argument("--only-ephemeral", action="store_true", help="apply only the ephemeral entries")
    _hostpath.add_flag(p)


def _manifest_error(reason: str) -> ManifestError:
    return ManifestError(reason, field="MANIFEST")


def _workspace_dir(args: argparse.Namespace, manifest_root: str | None) -> str:
    if args.root is not None:
        return host_path(args, args.root) or args.root
    if manifest_root is None:
        raise ManifestError("the manifest has no root and --root was not given", field="root")
    if not manifest_root.startswith("/"):
        raise ManifestError("root must be an absolute directory (it is never resolved against the cwd)",
                            field="root")
    # The location of the workspace is authority, and the manifest may come
    # from an untrusted author: without --root its root is used only when
    # it names an existing, empty, real directory (never created here, never
    # one holding files that the manifest could overwrite).
    # By the host-path rule (no symlink on any component, --follow-host-symlinks
    # never applies to an untrusted author's path).
    try:
        with open_root(manifest_root, read_only=True, label="root") as probe:
            empty = not probe.listdir()
    except OSError:
        raise ManifestError("without --root, the manifest's root must be an existing directory with no "
                            "symlink on its path (pass --root to choose or create the workspace)",
                            field="root") from None
    if not empty:
        raise ManifestError("without --root, the manifest's root must be an empty directory "
                            "(pass --root to materialize into an existing tree)", field="root")
    return manifest_root


def _make_root_dir(path: str) -> None:
    """Make the workspace's last component (0700) beneath its parent, opened by the host-path rule."""
    parent, leaf = os.path.split(path)
    if not leaf:
        return
    try:
        pr = open_root(parent or ".", label="")
    except FileNotFoundError:
        raise ManifestError("the workspace's parent directory does not exist", field="root") from None
    with pr:
        try:
            pr.mkdir(leaf, 0o700)
        except FileExistsError:
            pass


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


async def _run_into(out: list[Any], args: argparse.Namespace, ws_dir: str, manifest: Any,
                    opts: MaterializeOptions) -> None:
    """Append the result of :func:`_run` to ``out``.

    The result comes back through ``out``, not as the return value of
    ``trio.run``, whose finished run keeps its main task's outcome in a
    reference cycle: the result (one object per file) is then freed when
    ``handle`` returns, not by a garbage collection at exit.
    """
    out.append(await _run(args, ws_dir, manifest, opts))


async def _run(args: argparse.Namespace, ws_dir: str, manifest: Any, opts: MaterializeOptions) -> Any:
    ws = await trio.to_thread.run_sync(lambda: open_root(ws_dir, label=""))
    try:
        show = (not args.json) and sys.stderr.isatty()
        if not show:
            return await materialize(ws, manifest, opts, only_ephemeral=args.only_ephemeral)
        prog = opts.progress
        assert prog is not None
        result: list[Any] = []
        async with trio.open_nursery() as nursery:
            async def work() -> None:
                result.append(await materialize(ws, manifest, opts, only_ephemeral=args.only_ephemeral))
                nursery.cancel_scope.cancel()

            nursery.start_soon(work)
            await trio.sleep(0.5)  # short applies print nothing
            while True:
                sys.stderr.write(f"\r\x1b[Kapplying: {prog.files} files, {_human(prog.bytes)}")
                sys.stderr.flush()
                await trio.sleep(0.2)
        return result[0]
    finally:
        if (not args.json) and sys.stderr.isatty():
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
        ws.close()


def handle(args: argparse.Namespace) -> int:
    """Run ``sandbox-fs apply``: 0 when applied (a refusal raises, see ``_errors``)."""
    try:
        # the manifest file the operator named, by the host-path rule (a regular file, no symlink)
        raw = read_input(args, args.manifest, "manifest", MAX_MANIFEST_BYTES, label="MANIFEST",
                         allow_stdin=True, refuse=_manifest_error)
        manifest = load_manifest(raw, trust="untrusted")
        ws_dir = _workspace_dir(args, manifest.root)
        base = host_path(args, args.base)  # opened by the host-path rule in materialize
        grants = [parse_grant(spec, args) for spec in args.grant]
        _make_root_dir(ws_dir)
        opts = MaterializeOptions(base_dir=base, extra_path_grants=grants, digest=not args.no_digest,
                                  progress=MaterializeProgress())
        box: list[Any] = []
        trio.run(_run_into, box, args, ws_dir, manifest, opts)
        result = box.pop()
    except BaseException as exc:
        if args.json:
            leaf = next((e for e in exception_leaves(exc) if isinstance(e, SandboxError)), None)
            if leaf is not None:
                print(json_text({"ok": False, "error": leaf.to_dict()}, default=str, sort_keys=False))
                raise leaf from None
        raise
    if args.json:
        print(json_text({"ok": True, "result": result.to_dict()}, sort_keys=False))
    else:
        print(escape_text(result.summary(), keep_backslash=True))
        for s in result.skipped[:20]:
            print(f"skipped [{escape_text(s.sandbox_path)}]: {escape_text(s.rule)}: "
                  f"{escape_text(one_line(s.reason), keep_backslash=True)}")
    return 0
