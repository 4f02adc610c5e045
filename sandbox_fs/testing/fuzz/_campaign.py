"""A campaign: run a target for a bounded time in worker processes, minimize a finding, report JUnit.

:func:`run_target` is what ``sandbox-fs fuzz`` and ``fuzz/run.sh`` call.
It seeds an empty corpus directory from the target's built-in seeds,
starts ``jobs`` libFuzzer workers on it (each its own process and seed,
sharing the corpus directory), sums their ``Done N runs in S second(s)``
lines, and on a finding minimizes the failing input in a fresh process and
writes it beside the other artifacts.  :func:`write_junit` writes the
outcomes as a JUnit XML report (one test case per target).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

from ._registry import instrumented_modules, load_target
from ._target import render_dictionary
from ._worker import BOOTSTRAP

__all__ = ["Campaign", "Outcome", "run_target", "write_junit"]

_DONE = re.compile(r"Done (\d+) runs in (\d+) second")
_MINIMIZE_SECONDS = 20.0


@dataclass(frozen=True)
class Campaign:
    """What to run (the options of ``sandbox-fs fuzz``).

    Attributes:
        seconds: fuzzing time per target and worker (seconds, > 0).
        jobs: worker processes per target (>= 1).
        corpus: the corpus directory (``str``; made and seeded when empty;
            libFuzzer adds new inputs to it), or None for a scratch one per target.
        artifacts: where failing and minimized inputs are written (``str``).
        dictionary: a libFuzzer dictionary file, or None for the target's own tokens.
        instrument: instrument the target's modules for coverage feedback
            (costs a few seconds at start-up); False mutates blind.
        python: the interpreter the workers run (default: this one).
    """

    seconds: float = 60.0
    jobs: int = 1
    corpus: str | None = None
    artifacts: str = "."
    dictionary: str | None = None
    instrument: bool = True
    python: str = field(default_factory=lambda: sys.executable)


@dataclass
class Outcome:
    """How one target's run ended.

    Attributes:
        target: the target spec.
        runs: inputs executed (summed over workers).
        seconds: the longest worker's fuzzing time as libFuzzer reports it (whole seconds).
        wall_s: wall time of the whole run, minimization included (seconds).
        finding: one line describing the finding, or None.
        minimized: the minimized failing input's path, or None.
        log: the workers' output (the last 200 lines of each).
    """

    target: str
    runs: int = 0
    seconds: int = 0
    wall_s: float = 0.0
    finding: str | None = None
    minimized: str | None = None
    log: str = ""


def _seed(corpus: str, spec: str) -> None:
    # host-access: the corpus, log and artifact directories the campaign's caller named (a host path of the CI job)
    os.makedirs(corpus, exist_ok=True)
    if os.listdir(corpus):
        return
    for data in load_target(spec).seeds():
        name = hashlib.sha1(data).hexdigest()
        with open(os.path.join(corpus, name), "wb") as fh:
            fh.write(data)


def _finding_line(log: str) -> str:
    """The most telling line of a failing worker's log: the exception raised at the top."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.match(r"^[A-Za-z_.]*(Finding|Error|Exception)\b.*:", ln):
            return ln[:500]
    for ln in reversed(lines):
        if "ERROR:" in ln or "deadly signal" in ln:
            return ln[:500]
    return lines[-1][:500] if lines else "the worker failed without output"


def _start(spec: str, camp: Campaign, corpus: str, art: str, dict_path: str, job: int) -> tuple[subprocess.Popen[bytes], str]:
    inst = ",".join(instrumented_modules(spec)) if camp.instrument else "-"
    log = os.path.join(art, f".job{job}.log")
    args = [camp.python, "-c", BOOTSTRAP, "fuzz", spec, inst, corpus,
            f"-max_total_time={max(1, int(camp.seconds))}", "-rss_limit_mb=2048", "-timeout=30",
            f"-artifact_prefix={art}/job{job}-", f"-dict={dict_path}", f"-seed={job + 1}",
            "-print_final_stats=0"]
    # host-access: the campaign's own scratch, corpus and artifact files (a host path of the CI job, never a workspace)
    with open(log, "wb") as fh:
        proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=_worker_env(os.path.dirname(art), f"tmp{job}"))
    return proc, log


def _worker_env(scratch: str, name: str) -> dict[str, str]:
    """The environment of a worker: ``TMPDIR`` is a new directory ``name`` in the campaign's scratch.

    libFuzzer ends a worker with ``_exit`` (its time is up, or a finding),
    so nothing a target made with :mod:`tempfile` (a :class:`Scene`'s tree)
    is removed by the worker; under the scratch it goes with the campaign's
    own clean-up.
    """
    tmp = os.path.join(scratch, name)
    # host-access: the campaign's own scratch directory (a host path of the CI job, never a workspace)
    os.mkdir(tmp)
    return dict(os.environ, TMPDIR=tmp)


def _tail(path: str, lines: int = 200) -> str:
    # host-access: the campaign's own scratch, corpus and artifact files (a host path of the CI job, never a workspace)
    with open(path, "rb") as fh:
        return "\n".join(fh.read().decode("utf-8", "replace").splitlines()[-lines:])


def run_target(spec: str, camp: Campaign) -> Outcome:
    """Fuzz ``spec`` as ``camp`` says and return its :class:`Outcome` (never raises on a finding).

    Raises:
        KeyError, ImportError, AttributeError, TypeError: ``spec`` names no target (see ``load_target``).
        OSError: the corpus or artifact directory cannot be made or written.
    """
    target = load_target(spec)
    out = Outcome(spec)
    t0 = time.monotonic()
    # host-access: the campaign's own scratch, corpus and artifact files (a host path of the CI job, never a workspace)
    os.makedirs(camp.artifacts, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"sfs-fuzz-{target.name}-") as scratch:
        corpus = camp.corpus or os.path.join(scratch, "corpus")
        _seed(corpus, spec)
        dict_path = camp.dictionary
        if dict_path is None:
            dict_path = os.path.join(scratch, f"{target.name}.dict")
            # host-access: the campaign's own scratch, corpus and artifact files (a host path of the CI job, never a workspace)
            with open(dict_path, "w") as fh:
                fh.write(render_dictionary(target.tokens))
        art = os.path.join(scratch, "artifacts")
        # host-access: the campaign's own scratch, corpus and artifact files (a host path of the CI job, never a workspace)
        os.mkdir(art)
        workers = [_start(spec, camp, corpus, art, dict_path, j) for j in range(camp.jobs)]
        failed = []
        for proc, log in workers:
            try:
                rc = proc.wait(timeout=camp.seconds + 300)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
            text = _tail(log)
            out.log += text + "\n"
            done = _DONE.findall(text)
            if done:
                out.runs += int(done[-1][0])
                out.seconds = max(out.seconds, int(done[-1][1]))
            if rc != 0:
                failed.append(text)
        # host-access: the campaign's own scratch, corpus and artifact files (a host path of the CI job, never a workspace)
        crashes = sorted(n for n in os.listdir(art) if not n.startswith("."))
        if failed or crashes:
            out.finding = _finding_line(failed[0] if failed else out.log)
            if crashes:
                out.minimized = _minimize(spec, camp, os.path.join(art, crashes[0]), target.name)
    out.wall_s = time.monotonic() - t0
    return out


def _minimize(spec: str, camp: Campaign, crash: str, name: str) -> str:
    # host-access: the campaign's own scratch, corpus and artifact files (a host path of the CI job, never a workspace)
    with open(crash, "rb") as fh:
        digest = hashlib.sha1(fh.read()).hexdigest()[:12]
    raw = os.path.join(camp.artifacts, f"{name}-crash-{digest}")
    # host-access: the campaign's own scratch, corpus and artifact files (a host path of the CI job, never a workspace)
    shutil.copyfile(crash, raw)
    small = os.path.join(camp.artifacts, f"{name}-minimized-{digest}")
    code = ("import sys; from sandbox_fs.testing.fuzz._worker import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([camp.python, "-c", code, "minimize", spec, raw, small, str(_MINIMIZE_SECONDS)],
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=_MINIMIZE_SECONDS + 120,
                          env=_worker_env(os.path.dirname(os.path.dirname(crash)), "tmp-minimize"))
    if proc.returncode != 0 or not os.path.exists(small):
        return raw  # a crash that kills the interpreter, or a flaky one: keep the input as found
    return small


def write_junit(path: str, outcomes: list[Outcome]) -> None:
    """Write ``outcomes`` as a JUnit XML file at ``path``: suite ``sandbox-fs fuzz``, one case per target.

    A target with a finding gets a ``<failure>`` whose message is the finding
    line and whose text names the minimized input and ends with the log.

    Raises:
        OSError: ``path`` cannot be written.
    """
    suite = ET.Element("testsuite", name="sandbox-fs fuzz", tests=str(len(outcomes)),
                       failures=str(sum(1 for o in outcomes if o.finding)), errors="0",
                       time=f"{sum(o.wall_s for o in outcomes):.3f}")
    for o in outcomes:
        case = ET.SubElement(suite, "testcase", classname="sandbox_fs.fuzz", name=o.target, time=f"{o.wall_s:.3f}")
        ET.SubElement(case, "system-out").text = f"Done {o.runs} runs in {o.seconds} second(s)"
        if o.finding:
            fail = ET.SubElement(case, "failure", message=o.finding, type="finding")
            fail.text = f"minimized input: {o.minimized}\n\n{o.log[-20000:]}"
    root = ET.Element("testsuites", name="sandbox-fs fuzz")
    root.append(suite)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)
