"""A workspace (or a grant) inside the snapshot store's directory: the overlap seen from the store's side.

The store refused to lie inside the workspace, but not the workspace to lie
inside the store.  With ``workspaces_dir`` the store's directory (one
directory for everything), the workspace of session ``ID`` *is* the
directory of snapshot ``ID``'s objects: the confined command saw and could
rewrite its pointer, generations and the holds its forks keep, and a resume
(whose restore clears the workspace) deleted the session's own snapshot
(the next stop then failed with a conflict).  Refused now, either way round,
before anything is written or any command runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandbox_fs import open_root
from sandbox_fs.client import ClientOptions, LocalSandboxClient
from sandbox_fs.snapshot import DirectorySnapshotStore, SnapshotStoreError, hydrate, persist

KEY = b"k" * 32


def _store_objects(d: Path) -> list[str]:
    """What of a snapshot's objects lies under ``d`` (a pointer, a generation directory)."""
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.name in ("current", "gen"))


def test_one_directory_for_workspaces_and_store_is_refused_before_the_session_starts(tmp_path: Path) -> None:
    """``ClientOptions(workspaces_dir=D, snapshot_dir=D)``: before the fix the session ran, its stop wrote
    ``D/x/current`` and ``D/x/gen/`` into its own workspace, and its resume deleted them."""
    d = tmp_path / "d"

    async def main() -> None:
        with LocalSandboxClient(ClientOptions(workspaces_dir=str(d), snapshot_dir=str(d), state_key=KEY)) as c:
            with pytest.raises(SnapshotStoreError) as err:
                async with c.create(session_id="x") as s:
                    await s.write("f", b"one")
            assert not err.value.retryable and err.value.context["inside"] == "store"
            assert str(tmp_path) not in str(err.value)

    trio.run(main)
    assert _store_objects(d) == []  # the sentinel: no snapshot object was written beside the command
    assert not (d / "x" / "f").exists()


_PLACES = {"same": "", "child": "w", "deep": "a/b/w", "sibling": "../w", "above": ".."}


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(place=st.sampled_from(sorted(_PLACES)), depth=st.integers(0, 2))
def test_property_persist_and_hydrate_refuse_any_overlap(tmp_path_factory: pytest.TempPathFactory, place: str,
                                                         depth: int) -> None:
    """Workspace and store directory at any relative place: persist and hydrate work only when neither is the
    other nor lies inside it (the other way round is the existing rule, ``test_attack_store``)."""
    top = tmp_path_factory.mktemp("overlap")
    sdir = top.joinpath(*(["s"] * (depth + 1)))
    w = (sdir / _PLACES[place]).resolve() if _PLACES[place] else sdir
    if place == "above":  # the store lies inside the workspace (the rule from the other side)
        w = sdir.parent
    w.mkdir(parents=True, exist_ok=True)
    (w / "f").write_text("one\n")
    overlap = place != "sibling"
    with DirectorySnapshotStore(sdir) as store, open_root(w) as r:
        if overlap:
            with pytest.raises(SnapshotStoreError):
                persist(r, store, "w")
            with pytest.raises(SnapshotStoreError):
                hydrate(r, store, "w")
            assert _store_objects(sdir) == []  # the sentinel: nothing was written into the store
            return
        persist(r, store, "w")
        (w / "f").write_text("two\n")
        hydrate(r, store, "w")
    assert (w / "f").read_text() == "one\n"  # the positive control


def test_cli_run_with_its_root_inside_the_store_never_runs_the_command(tmp_path: Path) -> None:
    """``run --root S/w --store S``: refused in one line before the command runs."""
    s, base = tmp_path / "s", tmp_path / "base"
    base.mkdir()
    (base / "m.json").write_text('{"entries": {"hello.txt": {"type": "file", "content": "hello\\n"}}}')
    w = s / "w"
    r = subprocess.run([sys.executable, "-m", "sandbox_fs", "run", "--manifest", str(base / "m.json"), "--base",
                        str(base), "--root", str(w), "--store", str(s), "--state", str(tmp_path / "state.json"),
                        "--confinement", "none", "--", "/bin/sh", "-c", "echo ran > ran"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "inside the snapshot store" in r.stderr and str(tmp_path) not in r.stderr
    assert not (w / "ran").exists()  # the sentinel: the command never ran
    assert _store_objects(s) == [] and not os.path.exists(tmp_path / "state.json")
