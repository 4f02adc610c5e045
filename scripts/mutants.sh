#!/usr/bin/env bash
# Mutation testing of the security checks (issue 15 part 6).  Not part of scripts/test.sh.
#
#   bash scripts/mutants.sh [GROUP ...]     # default: every group, in the order below
#   bash scripts/mutants.sh --list          # the groups
#
# mutmut 2.5.1 (the 2.x line runs a shell test command per mutant and works with Python 3.11;
# it is installed here, in its own venv, never by setup.sh) mutates a copy of the checkout
# (MUTANTS_WORK, default /tmp/sfs-mutants) so the working tree is never edited.  Each group
# names the functions that hold one family of checks (scripts/mutants_select.py turns them into
# the patch mutmut's --use-patch-file mutates) and the tests that should kill their mutants,
# run with -x so a killed mutant costs one failing test.  Results: MUTANTS_WORK/results-GROUP.txt
# (`mutmut show ID` in MUTANTS_WORK/GROUP) and MUTANTS_WORK/summary.txt; the reasons for the
# survivors that stay are in mutants/survivors.md.
# Environment: VENV (the project's venv, default <repo>/.venv, from scripts/setup.sh),
# MUTMUT_VENV (default <repo>/.mutmut-venv), MUTANTS_WORK.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
VENV=${VENV:-$REPO/.venv}
MMVENV=${MUTMUT_VENV:-$REPO/.mutmut-venv}
WORK=${MUTANTS_WORK:-/tmp/sfs-mutants}

# name | tests (fast subset, most targeted first) | FILE::FUNCTION ...
GROUPS_SPEC=$(cat <<'EOF'
archive|tests/test_archive_links_through_links.py tests/test_archive_rules.py tests/test_archive_attacks.py -k "not (200k or 5000_deep or 10_mib or long_symlink_chain or gzip_bomb)"|sandbox_fs/archive/_names.py::* sandbox_fs/archive/_symlinks.py::PendingSymlinks._check_through sandbox_fs/archive/_symlinks.py::PendingSymlinks._create_symlinks sandbox_fs/archive/_symlinks.py::PendingSymlinks.add_symlink sandbox_fs/archive/_symlinks.py::PendingSymlinks._is_link_on_disk
materialize|tests/test_source_races.py tests/test_materialize.py|sandbox_fs/materialize.py::_open_source_file sandbox_fs/materialize.py::_copy_one sandbox_fs/materialize.py::_refuse_special
snapshot|tests/test_source_races.py tests/test_snapshot_policy.py tests/test_snapshot.py -k "not (sigkill or moved_out_at_any_point)"|sandbox_fs/snapshot/_walk.py::_source_view sandbox_fs/snapshot/_walk.py::_still_listed sandbox_fs/snapshot/_walk.py::_open_listed sandbox_fs/snapshot/_walk.py::_check_identity sandbox_fs/snapshot/_walk.py::_lstat_listed sandbox_fs/snapshot/_walk.py::_readlink_listed sandbox_fs/snapshot/_walk.py::_open_member sandbox_fs/snapshot/_entries.py::_symlink_reason sandbox_fs/snapshot/_entries.py::_member_stat
exec|tests/test_exec_checks.py tests/test_confinement_layers.py tests/test_exec_env.py tests/test_degraded.py|sandbox_fs/exec/_landlock.py::fs_mask sandbox_fs/exec/_landlock.py::fs_read_write sandbox_fs/exec/_ruleset.py::build_ruleset sandbox_fs/exec/_env.py::build_env sandbox_fs/exec/_coverage.py::missing_protections
paths|tests/test_paths.py tests/test_grants.py tests/test_mount_entries.py::test_a_valid_grant_name_is_kept tests/test_mount_entries.py::test_an_invalid_grant_name_is_refused -k "not test_policy_never_resolves_outside_workspace_or_grants"|sandbox_fs/paths.py::normalize sandbox_fs/paths.py::check_grant_name sandbox_fs/paths.py::PathPolicy.resolve
client|tests/test_client.py|sandbox_fs/client.py::_canonical sandbox_fs/client.py::_mac sandbox_fs/client.py::SessionState._binding sandbox_fs/client.py::LocalSandboxClient.deserialize_state
root|tests/test_root_checks.py tests/test_resolve_flags.py tests/test_root_attacks.py tests/test_root_hardening.py tests/test_host_paths.py|sandbox_fs/root.py::Root._rel sandbox_fs/root.py::Root._open_parent sandbox_fs/root.py::Root._check_write_target sandbox_fs/root.py::Root._checked sandbox_fs/root.py::Root.symlink sandbox_fs/root.py::_open_host_step sandbox_fs/root.py::open_host_dir_fd sandbox_fs/root.py::open_host_file_fd
EOF
)

if [ "${1:-}" = "--list" ]; then
    echo "$GROUPS_SPEC" | cut -d'|' -f1
    exit 0
fi
WANT=("$@")
[ ${#WANT[@]} -gt 0 ] || mapfile -t WANT < <(echo "$GROUPS_SPEC" | cut -d'|' -f1)

if [ ! -x "$MMVENV/bin/mutmut" ]; then
    python3 -m venv "$MMVENV"
    "$MMVENV/bin/python" -m pip install -q --disable-pip-version-check "mutmut==2.5.1" "whatthepatch==1.0.7"
fi
[ -x "$VENV/bin/python" ] || { echo "mutants.sh: run scripts/setup.sh first (no $VENV)" >&2; exit 1; }
[ -f sandbox_fs/sfs-exec ] && ls sandbox_fs/_sfs_native*.so >/dev/null 2>&1 || {
    echo "mutants.sh: the native module and helper are not built (scripts/setup.sh builds them)" >&2; exit 1; }

# Each group mutates a copy of its own (mutmut keeps one cache per directory): the committed files
# plus the built native module and helper.  Tests import the copy through PYTHONPATH, which comes
# before the venv's editable finder (checked).
rm -rf --one-file-system "$WORK"
mkdir -p "$WORK"
: >"$WORK/summary.txt"
for name in "${WANT[@]}"; do
    line=$(echo "$GROUPS_SPEC" | grep "^$name|") || { echo "mutants.sh: no group $name" >&2; exit 1; }
    tests=$(echo "$line" | cut -d'|' -f2)
    read -r -a specs <<<"$(echo "$line" | cut -d'|' -f3)"
    dir="$WORK/$name"
    mkdir -p "$dir"
    (cd "$REPO" && git ls-files -z | xargs -0 cp --parents -t "$dir" && cp sandbox_fs/_sfs_native*.so sandbox_fs/sfs-exec "$dir/sandbox_fs/")
    got=$(cd "$dir" && PYTHONPATH="$dir" "$VENV/bin/python" -c 'import sandbox_fs, os; print(os.path.dirname(sandbox_fs.__file__))')
    [ "$got" = "$dir/sandbox_fs" ] || { echo "mutants.sh: the copy is not what the tests import ($got)" >&2; exit 1; }
    (cd "$dir" && "$VENV/bin/python" scripts/mutants_select.py "$name.patch" "${specs[@]}")
    paths=$(printf '%s\n' "${specs[@]}" | sed 's/::.*//' | sort -u | paste -sd, -)
    start=$(date +%s)
    rc=0
    # String and f-string mutants only change messages; the error types, codes and paths they carry
    # are other mutation types.
    (cd "$dir" && "$MMVENV/bin/mutmut" run --paths-to-mutate "$paths" --use-patch-file "$name.patch" \
        --tests-dir tests --disable-mutation-types string,fstring --simple-output --no-progress \
        --runner "env PYTHONPATH=$dir SANDBOX_FS_DEGRADE= $VENV/bin/python -m pytest -x -q -p no:cacheprovider --basetemp=$dir/.pt $tests") \
        >"$WORK/run-$name.log" 2>&1 || rc=$?
    [ $((rc & 1)) -eq 0 ] || { echo "mutants.sh: mutmut failed on group $name; log follows" >&2; tail -30 "$WORK/run-$name.log" >&2; exit 1; }
    (cd "$dir" && "$MMVENV/bin/mutmut" results) >"$WORK/results-$name.txt" 2>&1 || true
    echo "$name: $(( $(date +%s) - start )) s, mutmut exit $rc" | tee -a "$WORK/summary.txt"
done
echo "mutants.sh: results in $WORK/results-GROUP.txt (mutmut show ID in $WORK/GROUP)"
