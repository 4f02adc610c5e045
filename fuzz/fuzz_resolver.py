"""atheris harness: the ``resolver`` target (sandbox_fs.testing.fuzz), asserting the sandbox invariant after every input.

Run: ``fuzz/run.sh resolver SECONDS [-jobs N]`` or ``sandbox-fs fuzz resolver --seconds N``; directly,
``python fuzz/fuzz_resolver.py [libFuzzer flags] [corpus dirs]``.
"""

from sandbox_fs.testing.fuzz._worker import run_direct

if __name__ == "__main__":
    run_direct("resolver")
