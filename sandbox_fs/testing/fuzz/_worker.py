"""The child process of a campaign: one libFuzzer run, or the minimization of a finding.

``python -c BOOTSTRAP fuzz SPEC INSTRUMENT [libFuzzer flags and corpus dirs]``
(:data:`BOOTSTRAP`, so that atheris is set up before anything of the
library is imported) instruments the modules named by INSTRUMENT (comma
separated; ``-`` for none), runs atheris on the target; libFuzzer prints
``Done N runs in S second(s)`` and exits 0, or writes the failing input
under ``-artifact_prefix`` and exits non-zero.

``python -m sandbox_fs.testing.fuzz._worker minimize SPEC INPUT OUTPUT SECONDS``
shrinks a failing input in process (delta debugging: remove chunks, then
lower bytes, keeping inputs that still fail with the same exception type)
and writes the smallest to OUTPUT.  Exit 0 when OUTPUT still fails, 3 when
INPUT does not fail here (a flaky finding: OUTPUT is INPUT).
"""

from __future__ import annotations

import sys
import time
import traceback
from typing import Callable

from ._registry import load_target
from ._target import Target


def _fails(fn: Callable[[bytes], None], data: bytes) -> str | None:
    try:
        fn(data)
    except Exception as exc:  # noqa: BLE001  (any exception is the finding's signature)
        return type(exc).__name__
    return None


def minimize(fn: Callable[[bytes], None], data: bytes, seconds: float) -> tuple[bytes, str | None]:
    """The smallest input found within ``seconds`` that fails like ``data``; and the failure's exception name."""
    kind = _fails(fn, data)
    if kind is None:
        return data, None
    end = time.monotonic() + seconds
    chunk = max(1, len(data) // 2)
    while chunk >= 1 and time.monotonic() < end:
        i, shrunk = 0, False
        while i < len(data) and time.monotonic() < end:
            cand = data[:i] + data[i + chunk:]
            if _fails(fn, cand) == kind:
                data, shrunk = cand, True
            else:
                i += chunk
        if not shrunk:
            chunk //= 2
    for i in range(len(data)):
        if time.monotonic() >= end:
            break
        for b in (0, ord("0"), ord("a")):
            if data[i] > b:
                cand = data[:i] + bytes([b]) + data[i + 1:]
                if _fails(fn, cand) == kind:
                    data = cand
                    break
    return data, kind


BOOTSTRAP = """
import sys, atheris
spec, inst = sys.argv[2], [m for m in sys.argv[3].split(",") if m and m != "-"]
with atheris.instrument_imports(include=inst or ["-"]):
    from sandbox_fs.testing.fuzz._worker import warm_up
    target = warm_up(spec)
atheris.Setup([sys.argv[0], *sys.argv[4:]], target.one_input)
atheris.Fuzz()
"""


def warm_up(spec: str) -> Target:
    """Load the target and run its first seeds once, so that what it imports lazily is imported
    (and instrumented) before fuzzing starts; a seed's failure is left for libFuzzer to report."""
    target = load_target(spec)
    for seed in target.seeds()[:3]:
        try:
            target.one_input(seed)
        except Exception:  # noqa: BLE001,S110  (libFuzzer runs the corpus again and reports)
            pass
    return target


def run_direct(spec: str) -> None:
    """Fuzz ``spec`` in this process with ``sys.argv`` as libFuzzer's arguments (the ``fuzz/fuzz_*.py`` wrappers).

    The target's modules are instrumented as they are imported here; a
    module the caller already imported is not.
    """
    import atheris  # type: ignore[import-untyped,import-not-found,unused-ignore]  # noqa: PLC0415

    from ._registry import instrumented_modules  # noqa: PLC0415

    with atheris.instrument_imports(include=list(instrumented_modules(spec))):
        target = warm_up(spec)
    atheris.Setup(sys.argv, target.one_input)
    atheris.Fuzz()


def main(argv: list[str]) -> int:
    """Run the worker command in ``argv`` (see the module docstring); the exit status."""
    if len(argv) == 5 and argv[0] == "minimize":
        target = load_target(argv[1])
        # host-access: the campaign's own input file, named by the runner in its scratch directory
        with open(argv[2], "rb") as fh:
            data = fh.read()
        small, kind = minimize(target.one_input, data, float(argv[4]))
        # host-access: the minimized input, written where the runner asked (its scratch directory)
        with open(argv[3], "wb") as fh:
            fh.write(small)
        if kind is None:
            print("minimize: the input does not fail in a fresh process (flaky finding)", file=sys.stderr)
            return 3
        try:
            target.one_input(small)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        print(f"minimize: {len(data)} -> {len(small)} bytes, still failing with {kind}", file=sys.stderr)
        return 0
    print("usage: _worker minimize SPEC INPUT OUTPUT SECONDS", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
