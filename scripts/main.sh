#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job end to end on real input, a
# manifest that brings in a real directory (the installed `trio` package's
# source tree from site-packages, as local_dir) and a real sdist (six, fetched
# with `pip download --no-binary :all:`, as an archive entry):
#   1. `sandbox-fs run` materializes it into a fresh private workspace and runs
#      `python -m compileall -q .` confined (Landlock required), persists a
#      snapshot and writes the session state;
#   2. the workspace is deleted, and a *new* session resumed from the state is
#      rebuilt from the snapshot and shows the compiled files are there;
#   3. a confined command fails to read /root;
#   4. the session runs on the FUSE overlay (where /dev/fuse works);
#   5. `sandbox-fs snapshot ls` lists the restore points the store keeps.
# After every run it prints the generation that run saved: a full archive, or a
# layer holding only what changed.
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
STORE="$DEMO/snapshots"

indent() { sed -u 's/^/   /'; }
# The newest generation in the store: its number, and whether that run wrote a full archive or a layer.
show_generation() {
    "$SFS" snapshot ls --store "$STORE" --json | "$PY" -c '
import json, sys
g = max(json.load(sys.stdin), key=lambda r: r["generation"])
n, c, b = g["generation"], g["chain_length"], g["archive_bytes"]
layers = f"{c - 1} layer" + ("s" if c > 2 else "")
kind = "a full archive" if c == 1 else f"a layer of what changed (a restore reads the full archive + {layers})"
print(f"   saved generation {n}: {kind}, {b} bytes")'
}

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
    --workspaces-dir "$DEMO/workspaces" --store "$STORE" --state "$DEMO/state.json" \
    --timeout 300 -- "$PYBIN" -m compileall -q . 2>&1 | indent
echo "   pyc files in the workspace: $(find "$DEMO/workspaces" -name '*.pyc' | wc -l)"
show_generation

echo "== 2. delete the workspace, resume a new session from the snapshot"
rm -rf "$DEMO/workspaces"
mkdir -p "$DEMO/workspaces"
"$SFS" run --resume "$DEMO/state.json" --base "$SITE" \
    --grant "$(dirname "$SDIST"):ro" --grant "$PYPREFIX:ro" \
    --workspaces-dir "$DEMO/workspaces" --store "$STORE" --state "$DEMO/state.json" \
    -- /bin/sh -c 'echo "compiled files restored: $(find . -name "*.pyc" | wc -l)"; echo "src:" $(ls src)' 2>&1 | indent
show_generation

echo "== 3. a confined command cannot read outside the workspace"
set +e
"$SFS" run --resume "$DEMO/state.json" --base "$SITE" --grant "$PYPREFIX:ro" \
    --workspaces-dir "$DEMO/workspaces" --store "$STORE" --state "$DEMO/state.json" \
    -- /bin/sh -c 'cat /root/.bashrc >/dev/null 2>&1 && echo "LEAK: read /root" || echo "reading /root: denied"; echo "running as uid $(id -u) gid $(id -g), pid $$ in its own pid namespace"' 2>&1 | indent
set -e
show_generation

echo "== 4. the same session on the FUSE overlay: quota, audit, a private root"
if "$SFS" features --json | "$PY" -c 'import json, sys; sys.exit(0 if json.load(sys.stdin)["fuse"] else 1)'; then
    HOST_WS=$(ls -d "$DEMO"/workspaces/*/ | head -1)
    USED=$(du -s --apparent-size -B1 "$DEMO/workspaces" | cut -f1)
    set +e
    "$SFS" run --resume "$DEMO/state.json" --base "$SITE" --grant "$PYPREFIX:ro" \
        --workspaces-dir "$DEMO/workspaces" --store "$STORE" --state "$DEMO/state.json" \
        --overlay --quota-bytes $((USED + 1048576)) --audit "$DEMO/audit.jsonl" \
        -- /bin/sh -c 'for d in /workspace /usr /tmp /dev/null /proc/self /root/.bashrc /home /sys "$1"; do [ -e "$d" ] && p="$p $d" || a="$a $d"; done; echo "in the private root:$p; absent:$a"; cd /workspace && echo hello > hello.txt && echo "wrote hello.txt through the overlay";
                       head -c 4194304 /dev/zero > big.bin 2>/dev/null && echo "LEAK: quota not enforced" || echo "4 MiB past a 1 MiB headroom: refused by the quota"; rm -f big.bin' sh "$HOST_WS" 2>&1 | indent
    rc=$?
    set -e
    [ "$rc" = 0 ] || { echo "main.sh: the overlay run failed ($rc)" >&2; exit 1; }
    echo "   audit log: $(wc -l < "$DEMO/audit.jsonl") JSON lines in .demo/audit.jsonl"
    show_generation
else
    echo "   skipped: the overlay cannot run here ($("$SFS" features | grep -i fuse))"
fi

echo "== 5. the restore points the store keeps (newest first; chain_length: archives a restore reads)"
"$SFS" snapshot ls --store "$STORE" | indent
echo "main job done"
