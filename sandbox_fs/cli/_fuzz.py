"""``sandbox-fs fuzz TARGET|all``: run the shipped fuzz targets (or a downstream one) for a bounded time.

Each target asserts the security invariant after every input (see
:mod:`sandbox_fs.testing.fuzz`).  One line per target on stdout,
``fuzz TARGET: Done N runs in S second(s), no finding``; a finding adds one
line on stderr naming it and the minimized input written under
``--artifacts``.  Exit status: 0 no finding, 1 a finding in any target,
2 usage (atheris missing: install ``sandbox-fs[fuzz]``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from ._args import int_option, seconds_option
from ._errors import EXIT_REFUSED, EXIT_USAGE
from ._output import escape_text, one_line

_TARGET_HELP = ("a target name (resolver, tar, zip, manifest, hydrate, state, policy), 'all', "
                "or package.module:ATTRIBUTE naming a sandbox_fs.testing.fuzz.Target (tarheader, which "
                "scripts/test.sh also runs, is a checkout script: fuzz/run.sh tarheader SECONDS)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``sandbox-fs fuzz``."""
    p.description = ("Fuzz a target (atheris/libFuzzer) for a bounded time, asserting the sandbox invariant "
                     "after every input; exit 1 on a finding, after writing the minimized input.")
    p.add_argument("target", metavar="TARGET", help=_TARGET_HELP)
    p.add_argument("--seconds", type=seconds_option(), default=60.0, help="fuzzing time per target (default 60)")
    p.add_argument("--jobs", type=int_option(1, 256), default=1, help="worker processes per target (default 1)")
    p.add_argument("--corpus", metavar="DIR",
                   help="corpus directory, seeded when empty and grown by the run (with 'all': DIR/TARGET); "
                        "default a scratch directory per target")
    p.add_argument("--junit", metavar="FILE", help="write a JUnit XML report (one test case per target)")
    p.add_argument("--artifacts", metavar="DIR", default=".",
                   help="where a failing input and its minimized form are written (default .)")
    p.add_argument("--dict", metavar="FILE", dest="dictionary",
                   help="libFuzzer dictionary (default the target's own tokens; with 'all' ignored)")
    p.add_argument("--no-instrument", dest="instrument", action="store_false",
                   help="no coverage instrumentation (starts seconds faster, mutates blind)")


def handle(args: argparse.Namespace) -> int:
    """Run the campaign; 0 without a finding, 1 with one, 2 when atheris is missing."""
    if importlib.util.find_spec("atheris") is None:
        print("sandbox-fs: error: usage: fuzzing needs atheris: pip install 'sandbox-fs[fuzz]'", file=sys.stderr)
        return EXIT_USAGE
    from ..testing.fuzz import Campaign, run_target, target_names, write_junit  # noqa: PLC0415

    specs = target_names() if args.target == "all" else [args.target]
    outcomes = []
    for spec in specs:
        corpus = args.corpus
        if corpus is not None and args.target == "all":
            corpus = os.path.join(corpus, spec)
        camp = Campaign(seconds=args.seconds, jobs=args.jobs, corpus=corpus, artifacts=args.artifacts,
                        dictionary=args.dictionary if args.target != "all" else None, instrument=args.instrument)
        try:
            out = run_target(spec, camp)
        except (KeyError, ImportError, AttributeError, TypeError) as exc:
            print(f"sandbox-fs: error: usage: no fuzz target {escape_text(spec)!s} "
                  f"({escape_text(one_line(exc))})", file=sys.stderr)
            return EXIT_USAGE
        outcomes.append(out)
        verdict = "FINDING" if out.finding else "no finding"
        print(f"fuzz {escape_text(spec)}: Done {out.runs} runs in {out.seconds} second(s), {verdict}", flush=True)
        if out.finding:
            print(f"sandbox-fs: fuzz {escape_text(spec)}: finding: {escape_text(one_line(out.finding))}; "
                  f"minimized input: {escape_text(str(out.minimized))}", file=sys.stderr, flush=True)
    if args.junit:
        write_junit(args.junit, outcomes)
    return EXIT_REFUSED if any(o.finding for o in outcomes) else 0
