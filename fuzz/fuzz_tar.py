"""atheris harness: tar archives (plain and compressed) through sandbox_fs.archive.extract.

Run: ``fuzz/run.sh tar SECONDS`` (or ``python fuzz/fuzz_tar.py fuzz/corpus/tar -max_total_time=60``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness  # noqa: E402

if __name__ == "__main__":
    _harness.main("tar")
