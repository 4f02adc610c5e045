"""atheris harness: zip archives through sandbox_fs.archive.extract.

Run: ``fuzz/run.sh zip SECONDS`` (or ``python fuzz/fuzz_zip.py fuzz/corpus/zip -max_total_time=60``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness  # noqa: E402

if __name__ == "__main__":
    _harness.main("zip")
