#!/bin/sh
# Usage: fuzz/run.sh TARGET SECONDS [-jobs N]
# Runs one fuzz target (sandbox-fs fuzz TARGET) for SECONDS on a scratch copy of the committed
# seeds fuzz/corpus/TARGET, with the dictionary fuzz/dict/TARGET.dict.  New corpus entries go to
# the scratch copy, never into the committed seeds; a failing input and its minimized form go to
# fuzz/findings/ (or $SFS_FUZZ_ARTIFACTS).  Exit status: 0 no finding, 1 a finding, 2 usage.
# PYTHON picks the interpreter (default python3); SFS_FUZZ_NO_INSTRUMENT=1 mutates blind.
set -eu
usage="usage: fuzz/run.sh TARGET SECONDS [-jobs N]"
target=${1:?$usage}
seconds=${2:?$usage}
jobs=1
if [ $# -ge 3 ]; then
  case $3 in
    -jobs=*) jobs=${3#-jobs=} ;;
    -jobs) jobs=${4:?$usage} ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
fi
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python3}
[ -d "$here/corpus/$target" ] || { echo "fuzz/run.sh: unknown target '$target'" >&2; exit 2; }
scratch=$(mktemp -d "${TMPDIR:-/tmp}/sfs-fuzz-$target-XXXXXX")
trap 'rm -rf "$scratch"' EXIT
mkdir "$scratch/corpus"
cp "$here/corpus/$target"/* "$scratch/corpus/"
set -- --seconds "$seconds" --jobs "$jobs" --corpus "$scratch/corpus" --artifacts "${SFS_FUZZ_ARTIFACTS:-$here/findings}"
[ -f "$here/dict/$target.dict" ] && set -- "$@" --dict "$here/dict/$target.dict"
[ "${SFS_FUZZ_NO_INSTRUMENT:-0}" = 1 ] && set -- "$@" --no-instrument
rc=0
if [ -f "$here/fuzz_$target.py" ] && ! grep -q run_direct "$here/fuzz_$target.py"; then
  # a standalone atheris script (not a shipped target): libFuzzer flags directly, artifacts to scratch
  dict=""
  [ -f "$here/dict/$target.dict" ] && dict="-dict=$here/dict/$target.dict"
  "$py" "$here/fuzz_$target.py" "$scratch/corpus" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=30 \
      -artifact_prefix="$scratch/" $dict || rc=$?
  if [ $rc -ne 0 ]; then
    mkdir -p "${SFS_FUZZ_ARTIFACTS:-$here/findings}"
    cp "$scratch"/crash-* "$scratch"/timeout-* "$scratch"/oom-* "${SFS_FUZZ_ARTIFACTS:-$here/findings}/" 2>/dev/null || true
  fi
  exit $rc
fi
"$py" -m sandbox_fs.cli fuzz "$target" "$@" || rc=$?
exit $rc
