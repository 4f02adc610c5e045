#!/bin/sh
# Usage: fuzz/sanitize.sh [SECONDS] [TARGET ...]     (default 3 seconds; targets resolver tar)
# Builds the C module (native/) with clang -fsanitize=address,undefined into a scratch copy of the
# package and runs the native-facing fuzz targets against it for SECONDS each, the ASan runtime
# preloaded into Python.  Any sanitizer report aborts the worker: exit 1, like any finding.
# detect_leaks=0: CPython's interpreter-lifetime allocations are reported as leaks at exit
# (thousands of lines, none ours); leaks in the module are not what this run looks for.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
py=${PYTHON:-python3}
seconds=${1:-3}
[ $# -gt 0 ] && shift
targets=${*:-resolver tar}
command -v clang >/dev/null 2>&1 || { echo "fuzz/sanitize.sh: clang is missing (apt-get install clang libclang-rt-14-dev)" >&2; exit 2; }
asan=$(clang -print-file-name=libclang_rt.asan-x86_64.so)
[ -f "$asan" ] || { echo "fuzz/sanitize.sh: the ASan runtime is missing (apt-get install libclang-rt-14-dev)" >&2; exit 2; }
scratch=$(mktemp -d "${TMPDIR:-/tmp}/sfs-sanitize-XXXXXX")
trap 'rm -rf "$scratch"' EXIT
mkdir "$scratch/pkg"
(cd "$repo" && tar --exclude='*.so' --exclude=__pycache__ -cf - sandbox_fs native) | tar -xf - -C "$scratch/pkg"
san="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -shared-libsan"
(cd "$scratch/pkg" && CC=clang LDSHARED="clang -shared $san" CFLAGS="$san -O1 -g" \
    "$py" -c "import sys; sys.path.insert(0, 'native'); import build; build.ffibuilder.compile(tmpdir='.')" \
    >"$scratch/build.log" 2>&1) || { cat "$scratch/build.log" >&2; exit 1; }
# An editable install may map sandbox_fs to the checkout through a meta path finder: this
# sitecustomize drops it, so the scratch copy is the one imported (checked below).
cat >"$scratch/pkg/sitecustomize.py" <<'PY'
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")
                    and "editable" not in getattr(type(f), "__module__", "")]
PY
export PYTHONPATH="$scratch/pkg" LD_PRELOAD="$asan"
cd "$scratch"  # not the checkout: python -c puts the working directory first on sys.path
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:allocator_may_return_null=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
"$py" -c "import sandbox_fs._sfs_native as m, sys; sys.exit(0 if m.__file__.startswith('$scratch') else 'the sanitized module was not the one imported: ' + m.__file__)"
rc=0
for target in $targets; do
    "$py" -m sandbox_fs.cli fuzz "$target" --seconds "$seconds" --no-instrument \
        --artifacts "${SFS_FUZZ_ARTIFACTS:-$here/findings}" | sed 's/^fuzz /sanitized fuzz /' || rc=1
done
exit $rc
