"""``sandbox-fs features [--json]``: what the kernel offers here, and what confinement a run gets.

One line per feature (``name: value``), or with ``--json`` the object of
:func:`sandbox_fs._features.host_features` plus ``version`` and
``native_abi``.  It is the first thing to look at when a run is refused:
``confinement="required"`` needs Landlock, and a process-count bound other
than ``none`` when the policy asks for one.
"""

from __future__ import annotations

import argparse
from typing import Any

from ._output import escape_text, json_text


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``sandbox-fs features``."""
    p.description = "Probe the kernel (nothing is changed) and print what a confined run would get here."
    p.add_argument("--json", action="store_true", help="print one JSON object instead of one line per feature")


def _yes(flag: object) -> str:
    return "yes" if flag else "no"


def feature_lines(found: dict[str, Any]) -> list[str]:
    """The human report: one ``name: value`` line per feature of ``found`` (see ``handle``)."""
    procs, ident = found["processes"], found["identity"]
    abi = found["landlock_abi"]
    if ident["runs_as"] == "leased":
        who = f"leased from {ident['base']}..{ident['base'] + ident['count'] - 1} (root: leasable)"
    else:
        who = "the host's own uid (not root: no identity to lease)"
    return [
        f"version: {found['version']} (native ABI {found['native_abi']})",
        f"openat2: {_yes(found['openat2'])}",
        f"resolver: {found['resolver']}",
        f"landlock: {f'ABI {abi}' if abi else 'no (confinement=required is refused)'}",
        f"seccomp: {_yes(found['seccomp'])}",
        f"user namespace: {_yes(found['user_namespace'])}",
        f"pid namespace: {_yes(found['pid_namespace'])}",
        f"mount namespace: {_yes(found['mount_namespace'])}",
        f"cgroup v2 pids: {_yes(procs['cgroup2_pids'])}",
        f"cgroup v1 pids: {_yes(procs['cgroup1_pids'])}",
        f"RLIMIT_NPROC binds: {_yes(procs['rlimit_nproc'])}",
        f"process bound: {procs['bound']}",
        f"fuse: {_yes(found['fuse'])}" + ("" if found["fuse"] else
                                          f" ({found['fuse_reason']}; run --overlay is refused under "
                                          "--confinement required)"),
        f"identity: {who}",
    ] + ([f"lowered: {', '.join(found['lowered'])} (SANDBOX_FS_DEGRADE: taken as absent)"]
         if found.get("lowered") else [])


def handle(args: argparse.Namespace) -> int:
    """Print the report; 0."""
    from .. import __version__, _features, _native  # noqa: PLC0415

    found = {"version": __version__, "native_abi": _native.EXPECTED_ABI, **_features.host_features()}
    if args.json:
        print(json_text(found))
    else:
        for line in feature_lines(found):
            print(escape_text(line, keep_backslash=True))
    return 0
