"""atheris harness: the ``tar`` target (sandbox_fs.testing.fuzz), asserting the sandbox invariant after every input.

Run: ``fuzz/run.sh tar SECONDS [-jobs N]`` or ``sandbox-fs fuzz tar --seconds N``; directly,
``python fuzz/fuzz_tar.py [libFuzzer flags] [corpus dirs]``.
"""

from sandbox_fs.testing.fuzz._worker import run_direct

if __name__ == "__main__":
    run_direct("tar")
