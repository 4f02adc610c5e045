"""A plain directory store keeps generations and layers; version-1 directories still restore; resume bindings.

The directory default is :class:`DirectorySnapshotStore` (a GenerationStore
over LocalObjects).  A directory a :class:`LocalSnapshotStore` (format
version 1) wrote keeps restoring, and its next persist continues its
generation numbers.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from sandbox_fs import open_root
from sandbox_fs.client import ClientOptions, LocalSandboxClient
from sandbox_fs.snapshot import (
    DirectorySnapshotStore,
    GenerationStore,
    LocalSnapshotStore,
    SnapshotConflictError,
    hydrate,
    persist,
)


def _tick() -> None:
    time.sleep(0.012)  # past the coarse clock's tick, so the racy rule does not re-read


def _client(tmp_path, which: str, **store) -> LocalSandboxClient:
    return LocalSandboxClient(ClientOptions(workspaces_dir=str(tmp_path / f"ws-{which}"), **store))


# ------------------------------------------------------------- version-1 directories after the switch


async def test_a_version_1_directory_still_restores_and_continues_as_generations(tmp_path):
    sdir = tmp_path / "store"
    old_store = LocalSnapshotStore(sdir)  # what a client of the previous release made of snapshot_dir
    with _client(tmp_path, "old", snapshot_store=old_store) as old:
        async with old.create(session_id="s1") as s:
            await s.write("f", b"v1 content")
        async with old.resume(old.serialize_state(s)) as s:
            await s.write("g", b"second")
        state = old.serialize_state(s)  # installation key in the store directory, generation 2
        await old.delete(s)
    old_store.close()
    assert state["generation"] == 2 and os.path.exists(sdir / "s1.json") and not (sdir / "s1").exists()
    with _client(tmp_path, "new", snapshot_dir=str(sdir)) as new:
        assert isinstance(new.store, DirectorySnapshotStore)
        assert [(i.name, i.generation, i.version) for i in new.store.list()] == [("s1", 2, 1)]
        async with new.resume(state) as r:  # same key file, same generation and digest: accepted
            assert r.start_mode == "restored" and r.generation == 2
            assert await r.read("f") == b"v1 content" and await r.read("g") == b"second"
            await r.write("f", b"changed")
        after = new.serialize_state(r)
        assert after["generation"] == 3
        info = new.store.info("s1")
        assert info.version == 2 and info.chain_length == 1  # the first generation is full
        assert not os.path.exists(sdir / "s1.json") and not [f for f in os.listdir(sdir) if f.endswith(".tar")]
        await new.delete(r)
        async with new.resume(after) as again:
            assert await again.read("f") == b"changed"
            await again.write("f", b"third")
        assert new.store.info("s1").chain_length == 2  # and now layers


def test_cli_restores_a_version_1_snapshot(tmp_path, capsys):
    from sandbox_fs.cli import main

    ws, dst, sdir = tmp_path / "ws", tmp_path / "dst", tmp_path / "store"
    ws.mkdir()
    dst.mkdir()
    (ws / "a").write_text("old format")
    with LocalSnapshotStore(sdir) as v1, open_root(ws) as w:
        persist(w, v1, "snap")
    assert main(["snapshot", "ls", "--store", str(sdir), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["generation"]) for r in rows] == [("snap", 1)]
    assert main(["snapshot", "restore", "--workspace", str(dst), "--store", str(sdir), "--name", "snap"]) == 0
    assert (dst / "a").read_text() == "old format"
    assert main(["snapshot", "save", "--workspace", str(dst), "--store", str(sdir), "--name", "snap",
                 "--json"]) == 0
    saved = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert saved["generation"] == 2 and (sdir / "snap" / "current").exists()


# ------------------------------------------------------------- a digest-less state is bound


async def test_a_digest_less_state_restores_the_generation_it_recorded_not_what_became_current(tmp_path, monkeypatch):
    """A state that recorded no digest (from before the digest, or a store that sets none) is still bound.

    Between the resume's generation check and its restore another writer
    commits a newer generation: the restore must read the generation the check
    accepted (by the digest that check read), never the newer one.
    """
    sdir = tmp_path / "store"
    with _client(tmp_path, "a", snapshot_dir=str(sdir)) as a:
        async with a.create(session_id="s") as s:
            await s.write("f", b"recorded")
        state = a.serialize_state(s)
        await a.delete(s)
        digest_less = a.sign_state(dict(state, snapshot_digest=None))
        other = tmp_path / "other"
        other.mkdir()
        (other / "f").write_text("committed meanwhile")
        store = a.store
        real_info = type(store).info
        raced = []

        def info_then_race(self, name):
            got = real_info(self, name)
            if name == "s" and not raced:
                raced.append(1)
                with open_root(other) as w:  # another writer commits generation 2
                    persist(w, GenerationStore(self.objects), "s")
            return got

        monkeypatch.setattr(type(store), "info", info_then_race)
        r = a.resume(digest_less)
        await r.start()
        monkeypatch.undo()
        try:
            assert raced and store.kept("s") == [2, 1]
            assert await r.read("f") == b"recorded" and r.generation == 1
            await r.write("f", b"mine")
        finally:
            with pytest.raises(SnapshotConflictError):  # and its persist cannot go over generation 2
                await r.aclose()
