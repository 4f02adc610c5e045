#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run every test: ruff and mypy, the pytest suite
# with both resolvers on both cores (pytest-xdist), then bounded fuzzing of every target, the
# sanitizer run and the shared attack cases through the CLI (when ../shared/cases is present),
# two at a time.  Exit status is non-zero if anything failed.  The last line gives each phase's time,
# or, on a failure, the phase that failed ("test.sh: FAILED in ...").
set -euo pipefail
cd "$(dirname "$0")/.."
times=()
mark=$SECONDS
phase=setup
took() { times+=("$1 $((SECONDS - mark)) s"); mark=$SECONDS; phase=$2; }
# On any exit: the S3 server stopped and every temp dir of this run removed (a failed pytest run
# left its --basetemp, hundreds of MB, behind), and a failure says which phase it was.
on_exit() {
    local status=$?
    if [ -n "${S3_PID:-}" ]; then stop_s3; fi
    if [ -n "${BASETEMP:-}" ]; then rm -rf --one-file-system "$BASETEMP"; fi
    if [ -n "${JOBS:-}" ]; then rm -rf "$JOBS"; fi
    if [ "$status" != 0 ]; then
        echo "test.sh: FAILED in $phase after $SECONDS s (exit $status); the output above says why" >&2
    fi
}
trap on_exit EXIT
bash scripts/setup.sh
took setup lint
VENV=${VENV:-$PWD/.venv}
export PATH="$VENV/bin:$PATH"

# Lint and type check (ruff and mypy, configured in pyproject.toml): a few seconds.
"$VENV/bin/ruff" check --quiet .
"$VENV/bin/mypy"
took lint pytest

# The S3 server of the S3 snapshot store's tests: SeaweedFS on 127.0.0.1, ports picked when it starts, data
# in a temp dir, stopped by its pid on exit.  Where it cannot start, those tests skip and say why.
S3_DATA=$(mktemp -d /tmp/sfs-seaweed-XXXXXX)
if S3_INFO=$("$VENV/bin/python" tests/_seaweed.py start "$S3_DATA"); then
    S3_PID=${S3_INFO%% *}
    export SFS_S3_ENDPOINT=${S3_INFO#* } SFS_S3_PID=$S3_PID SFS_S3_DATA=$S3_DATA
    # a test may kill and restart it: the running pid is the one in weed.pid
    stop_s3() {
        kill -9 "$(cat "$S3_DATA/weed.pid" 2>/dev/null || echo "$S3_PID")" 2>/dev/null || true
        "$VENV/bin/python" tests/_seaweed.py clean "$S3_DATA" || true  # weed's sockets in /tmp
        rm -rf --one-file-system "$S3_DATA"
    }
else
    echo "test.sh: the SeaweedFS S3 server did not start; the S3 tests will try again or skip" >&2
    rm -rf --one-file-system "$S3_DATA"
fi

# Both cores (SFS_TEST_WORKERS workers, default 2): tests that change or count what the whole machine
# shares (the S3 server, ...) are put in one xdist group each by tests/conftest.py, and a group runs
# on one worker, one test after the other.
BASETEMP=$(mktemp -d /tmp/sfs-pytest-XXXXXX)
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --basetemp="$BASETEMP" \
    -n "${SFS_TEST_WORKERS:-2}" --dist loadgroup tests
rm -rf --one-file-system "$BASETEMP"
BASETEMP=""
if [ -n "${S3_PID:-}" ]; then stop_s3; S3_PID=""; fi  # only pytest uses it
took pytest "fuzz, sanitizer and corpus"

# Then, two jobs at a time (one per core), each its own process with its log in .venv/:
#   - bounded fuzzing of every target (fuzz/run.sh; SFS_FUZZ_SECONDS each), each input checked
#     against the sandbox invariant; a finding fails the run.  Blind mutation (no coverage
#     instrumentation: it costs more start-up than the time slot here);
#   - the native-facing targets against the C module built with clang -fsanitize=address,undefined
#     (fuzz/sanitize.sh, SFS_SANITIZE_SECONDS each): a sanitizer report fails the run;
#   - the shared attack corpus, through the command line (every case must pass).
FUZZ_TARGETS="resolver tar zip state policy manifest hydrate tarheader"
CASES="$PWD/../shared/cases"
JOBS=$(mktemp -d /tmp/sfs-test-jobs-XXXXXX)
export VENV JOBS CASES
run_job() {  # NAME: runs that job, its output in $VENV/NAME.log and its exit status in $JOBS/NAME.rc
    local rc=0
    case $1 in
        fuzz-*) PYTHON="$VENV/bin/python" SFS_FUZZ_NO_INSTRUMENT=${SFS_FUZZ_NO_INSTRUMENT:-1} \
                    sh fuzz/run.sh "${1#fuzz-}" "${SFS_FUZZ_SECONDS:-10}" ;;
        sanitize) PYTHON="$VENV/bin/python" sh fuzz/sanitize.sh "${SFS_SANITIZE_SECONDS:-3}" ;;
        corpus) "$VENV/bin/python" "$CASES/run_cases.py" "$CASES" \
                    --extract-cmd "$VENV/bin/sandbox-fs extract {archive} --into {dest}" \
                    --apply-cmd "$VENV/bin/sandbox-fs apply {manifest} --base {base}" ;;
    esac >"$VENV/$1.log" 2>&1 || rc=$?
    echo "$rc" >"$JOBS/$1.rc"
}
export -f run_job
jobs_list="sanitize"
for target in $FUZZ_TARGETS; do jobs_list="$jobs_list fuzz-$target"; done
if [ -f "$CASES/run_cases.py" ]; then
    jobs_list="$jobs_list corpus"
else
    echo "test.sh: ../shared/cases not found; the attack corpus was not run" >&2
fi
# xargs's own status is not the verdict: each job's .rc file is (a missing one is a failure too)
printf '%s\n' $jobs_list | xargs -P 2 -I{} bash -c 'run_job "$1"' _ {} || true
failed=""
for job in $jobs_list; do
    [ "$(cat "$JOBS/$job.rc" 2>/dev/null)" = 0 ] || failed="$failed $job"
    case $job in
        fuzz-*) echo "fuzz ${job#fuzz-}: $(grep -Eo 'Done [0-9]+ runs in [0-9]+ second' "$VENV/$job.log" | tail -1 || echo 'ran')" ;;
        sanitize) grep '^sanitized fuzz' "$VENV/$job.log" || true ;;
        corpus) cat "$VENV/$job.log" ;;
    esac
done
rm -rf "$JOBS"
JOBS=""
for job in $failed; do
    case $job in
        fuzz-*) echo "test.sh: fuzz target ${job#fuzz-} found a failure (minimized input in fuzz/findings/); log follows" >&2 ;;
        sanitize) echo "test.sh: the sanitizer fuzz run failed; log follows" >&2 ;;
        corpus) echo "test.sh: the attack corpus failed; its output is above" >&2; continue ;;
    esac
    tail -60 "$VENV/$job.log" >&2
done
[ -z "$failed" ] || exit 1
took "fuzz, sanitizer and corpus" done
summary=$(printf '%s, ' "${times[@]}")
echo "test.sh: all passed in $SECONDS s (${summary%, })"
