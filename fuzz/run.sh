#!/bin/sh
# Usage: fuzz/run.sh TARGET SECONDS     (TARGET: tar | zip)
# Runs the atheris harness fuzz/fuzz_TARGET.py on fuzz/corpus/TARGET for SECONDS.
# Without atheris installed it replays the corpus and mutates it for SECONDS instead.
# New corpus entries found by libFuzzer go to a scratch dir, never into the committed seeds.
set -eu
target=${1:?usage: fuzz/run.sh TARGET SECONDS}
seconds=${2:?usage: fuzz/run.sh TARGET SECONDS}
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python3}
harness="$here/fuzz_$target.py"
[ -f "$harness" ] || { echo "fuzz/run.sh: unknown target '$target'" >&2; exit 2; }
scratch=$(mktemp -d "${TMPDIR:-/tmp}/sfs-fuzz-$target-XXXXXX")
trap 'rm -rf "$scratch"' EXIT
if "$py" -c 'import atheris' 2>/dev/null; then
  exec "$py" "$harness" "$scratch" "$here/corpus/$target" -max_total_time="$seconds" -rss_limit_mb=2048 \
       -timeout=30 -artifact_prefix="$scratch/"
else
  exec "$py" "$harness" "$here/corpus/$target" -max_total_time="$seconds"
fi
