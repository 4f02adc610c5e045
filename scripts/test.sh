#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run every test: ruff and mypy, the pytest suite
# with both resolvers, then the shared attack cases through the CLI when ../shared/cases
# is present.  Exit status is non-zero if anything failed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${VENV:-$PWD/.venv}
export PATH="$VENV/bin:$PATH"

# Lint and type check (ruff and mypy, configured in pyproject.toml): a few seconds.
"$VENV/bin/ruff" check --quiet .
"$VENV/bin/mypy"

# The S3 server of the S3 snapshot store's tests: SeaweedFS on 127.0.0.1, ports picked when it starts, data
# in a temp dir, stopped by its pid on exit.  Where it cannot start, those tests skip and say why.
S3_DATA=$(mktemp -d /tmp/sfs-seaweed-XXXXXX)
if S3_INFO=$("$VENV/bin/python" tests/_seaweed.py start "$S3_DATA"); then
    S3_PID=${S3_INFO%% *}
    export SFS_S3_ENDPOINT=${S3_INFO#* } SFS_S3_PID=$S3_PID SFS_S3_DATA=$S3_DATA
    # a test may kill and restart it: the running pid is the one in weed.pid
    trap 'kill -9 "$(cat "$S3_DATA/weed.pid" 2>/dev/null || echo "$S3_PID")" 2>/dev/null || true
          rm -rf --one-file-system "$S3_DATA"' EXIT
else
    echo "test.sh: the SeaweedFS S3 server did not start; the S3 tests will try again or skip" >&2
    rm -rf --one-file-system "$S3_DATA"
fi

BASETEMP=$(mktemp -d /tmp/sfs-pytest-XXXXXX)
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --basetemp="$BASETEMP" tests
rm -rf --one-file-system "$BASETEMP"

# Bounded fuzzing of every target (fuzz/run.sh; SFS_FUZZ_SECONDS each, the loop about 2 minutes
# in all), each input checked against the sandbox invariant; a finding fails the run.  Blind
# mutation (no coverage instrumentation: it costs more start-up than the time slot here).
for target in resolver tar zip state policy manifest hydrate tarheader; do
    PYTHON="$VENV/bin/python" SFS_FUZZ_NO_INSTRUMENT=${SFS_FUZZ_NO_INSTRUMENT:-1} sh fuzz/run.sh "$target" "${SFS_FUZZ_SECONDS:-10}" >"$VENV/fuzz-$target.log" 2>&1 || {
        echo "test.sh: fuzz target $target found a failure (minimized input in fuzz/findings/); log follows" >&2
        tail -60 "$VENV/fuzz-$target.log" >&2
        exit 1
    }
    echo "fuzz $target: $(grep -Eo 'Done [0-9]+ runs in [0-9]+ second' "$VENV/fuzz-$target.log" | tail -1 || echo 'ran')"
done

# The native-facing targets against the C module built with clang -fsanitize=address,undefined
# (fuzz/sanitize.sh, SFS_SANITIZE_SECONDS each, about 15 s in all): a sanitizer report fails the run.
PYTHON="$VENV/bin/python" sh fuzz/sanitize.sh "${SFS_SANITIZE_SECONDS:-3}" >"$VENV/fuzz-sanitize.log" 2>&1 || {
    echo "test.sh: the sanitizer fuzz run failed; log follows" >&2
    tail -60 "$VENV/fuzz-sanitize.log" >&2
    exit 1
}
grep '^sanitized fuzz' "$VENV/fuzz-sanitize.log"

# The shared attack corpus, through the command line (every case must pass).
CASES="$PWD/../shared/cases"
if [ -f "$CASES/run_cases.py" ]; then
    "$VENV/bin/python" "$CASES/run_cases.py" "$CASES" \
        --extract-cmd "$VENV/bin/sandbox-fs extract {archive} --into {dest}" \
        --apply-cmd "$VENV/bin/sandbox-fs apply {manifest} --base {base}"
else
    echo "test.sh: ../shared/cases not found; the attack corpus was not run" >&2
fi
