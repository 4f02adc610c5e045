#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job end to end on real input:
#   1. a manifest that brings in a real directory (the installed `trio`
#      package's source tree from site-packages, as local_dir) and a real sdist
#      (six, fetched with `pip download --no-binary :all:`, as an archive entry);
#   2. `sandbox-fs run` materializes it into a fresh private workspace and runs
#      `python -m compileall -q .` confined (Landlock required), persists a
#      snapshot and writes the session state;
#   3. the workspace is deleted, and a *new* session resumed from the state is
#      rebuilt from the snapshot and shows the compiled files are there.
# Everything lands under .demo/ in the repository (removed first).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${VENV:-$PWD/.venv}
SFS="$VENV/bin/sandbox-fs"
PY="$VENV/bin/python"
DEMO="$PWD/.demo"
rm -rf "$DEMO"
mkdir -p "$DEMO/downloads"

SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
PYPREFIX=$("$PY" -c 'import sys; print(sys.base_prefix)')
PYBIN=$("$PY" -c 'import sys, os; print(os.path.realpath(sys.executable))')
"$PY" -m pip download -q --disable-pip-version-check --no-binary :all: --no-deps -d "$DEMO/downloads" \
    "six==1.16.0" 2>&1 | grep -v "is ignored" || true
SDIST=$(ls "$DEMO/downloads"/six-*.tar.gz)

cat > "$DEMO/manifest.json" <<JSON
{
  "entries": {
    "src/trio": {"type": "local_dir", "src": "trio", "exclude": ["**/__pycache__/**"]},
    "src/six": {"type": "archive", "src": "$SDIST", "format": "tar"},
    "README.txt": {"type": "file", "content": "built by sandbox-fs run\n"},
    "tmp": {"type": "dir", "ephemeral": true}
  },
  "environment": {"DEMO_TOKEN": {"value": "not-for-your-eyes", "secret": true}}
}
JSON

echo "== 1. materialize + compile confined + persist"
"$SFS" run --manifest "$DEMO/manifest.json" --base "$SITE" \
    --grant "$(dirname "$SDIST"):ro" --grant "$PYPREFIX:ro" \
    --workspaces-dir "$DEMO/workspaces" --snapshot-dir "$DEMO/snapshots" --state "$DEMO/state.json" \
    --timeout 300 -- "$PYBIN" -m compileall -q .
echo "   pyc files in the workspace: $(find "$DEMO/workspaces" -name '*.pyc' | wc -l)"
echo "   snapshot generations in the store:"
"$SFS" snapshot ls --store "$DEMO/snapshots" | sed 's/^/     /'

echo "== 2. delete the workspace, resume a new session from the snapshot"
rm -rf "$DEMO/workspaces"
mkdir -p "$DEMO/workspaces"
"$SFS" run --resume "$DEMO/state.json" --base "$SITE" \
    --grant "$(dirname "$SDIST"):ro" --grant "$PYPREFIX:ro" \
    --workspaces-dir "$DEMO/workspaces" --snapshot-dir "$DEMO/snapshots" --state "$DEMO/state.json" \
    -- /bin/sh -c 'echo "compiled files restored: $(find . -name "*.pyc" | wc -l)"; ls src'

echo "== 3. a confined command cannot read outside the workspace"
set +e
"$SFS" run --resume "$DEMO/state.json" --base "$SITE" --grant "$PYPREFIX:ro" \
    --workspaces-dir "$DEMO/workspaces" --snapshot-dir "$DEMO/snapshots" --state "$DEMO/state.json" \
    -- /bin/sh -c 'cat /root/.bashrc >/dev/null 2>&1 && echo "LEAK: read /root" || echo "reading /root: denied"; echo "running as uid $(id -u) gid $(id -g), pid $$ in its own pid namespace"'
set -e

echo "== 4. the same session on the FUSE overlay: quota, audit, a private root"
if "$SFS" features --json | "$PY" -c 'import json, sys; sys.exit(0 if json.load(sys.stdin)["fuse"] else 1)'; then
    HOST_WS=$(ls -d "$DEMO"/workspaces/*/ | head -1)
    USED=$(du -s --apparent-size -B1 "$DEMO/workspaces" | cut -f1)
    set +e
    "$SFS" run --resume "$DEMO/state.json" --base "$SITE" --grant "$PYPREFIX:ro" \
        --workspaces-dir "$DEMO/workspaces" --snapshot-dir "$DEMO/snapshots" --state "$DEMO/state.json" \
        --overlay --quota-bytes $((USED + 1048576)) --audit "$DEMO/audit.jsonl" \
        -- /bin/sh -c 'for d in /workspace /usr /tmp /dev/null /proc/self /root/.bashrc /home /sys "$1"; do [ -e "$d" ] && p="$p $d" || a="$a $d"; done; echo "   in the private root:$p; absent:$a"; cd /workspace && echo hello > hello.txt && echo "   wrote hello.txt through the overlay";
                       head -c 4194304 /dev/zero > big.bin 2>/dev/null && echo "LEAK: quota not enforced" || echo "   4 MiB past a 1 MiB headroom: refused by the quota"; rm -f big.bin' sh "$HOST_WS"
    rc=$?
    set -e
    [ "$rc" = 0 ] || { echo "main.sh: the overlay run failed ($rc)" >&2; exit 1; }
    echo "   audit events written: $(wc -l < "$DEMO/audit.jsonl")"
else
    echo "   skipped: the overlay cannot run here ($("$SFS" features | grep -i fuse))"
fi
echo "main job done"
