#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run every test: the pytest suite with both
# resolvers, then the shared attack cases through the CLI when ../shared/cases
# is present.  Exit status is non-zero if anything failed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${VENV:-$PWD/.venv}
export PATH="$VENV/bin:$PATH"

BASETEMP=$(mktemp -d /tmp/sfs-pytest-XXXXXX)
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --basetemp="$BASETEMP" tests
rm -rf --one-file-system "$BASETEMP"

# The shared attack corpus, through the command line (every case must pass).
CASES="$PWD/../shared/cases"
if [ -f "$CASES/run_cases.py" ]; then
    "$VENV/bin/python" "$CASES/run_cases.py" "$CASES" \
        --extract-cmd "$VENV/bin/sandbox-fs extract {archive} --into {dest}" \
        --apply-cmd "$VENV/bin/sandbox-fs apply {manifest} --base {base}"
else
    echo "test.sh: ../shared/cases not found; the attack corpus was not run" >&2
fi
