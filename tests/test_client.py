"""Client: serialized state carries no authority; open_session source resolution; RunState keys."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandbox_fs import Grant
from sandbox_fs.client import (
    ClientOptions,
    LocalSandboxClient,
    RunState,
    SessionStateError,
    SessionStateTamperedError,
    SessionStateVersionError,
    open_session,
)
from sandbox_fs.manifest import load_manifest
from sandbox_fs.session import SessionBusyError, SnapshotGenerationError, WorkspaceMismatchError

MANIFEST = {"entries": {"a.txt": {"type": "file", "content": "from manifest"}}}


async def _saved_state(client, **create):
    async with client.create(**create) as s:
        await s.write("f.txt", b"data")
    return s, client.serialize_state(s)


# ------------------------------------------------------------- no authority


@pytest.mark.parametrize("field,value", [
    ("root", "/"),
    ("workspace_dir", "/etc"),
    ("grants", [{"path": "/", "read_only": False}]),
    ("extra_path_grants", ["/:rw"]),
    ("owned", True),
    ("caller_owned", False),
    ("base_dir", "/"),
])
async def test_tampered_state_cannot_add_authority(client, field, value):
    _s, state = await _saved_state(client)
    bad = dict(state, **{field: value})
    with pytest.raises(SessionStateError) as ei:  # the MAC catches the edit first
        client.resume(bad)
    assert ei.value.code == "session_state_tampered"
    # and even with a valid MAC (a leaked key), the field itself is refused
    with pytest.raises(SessionStateError) as ei:
        client.resume(_resign(client, bad))
    assert ei.value.code == "session_state_invalid"
    assert field in ei.value.context["fields"][0]


def _resign(client, state):

    from sandbox_fs import client as client_mod

    payload = {k: v for k, v in state.items() if k != "mac"}
    payload["mac"] = client_mod._mac(client._state_key, payload)
    return payload


async def test_state_is_authenticated_by_default_and_ids_cannot_be_swapped(client, tmp_path):
    """Session ids and snapshot names are capabilities: an unkeyed client still MACs its state."""
    assert client.options.state_key is None
    victim, vstate = await _saved_state(client)
    _a, astate = await _saved_state(client)
    assert "mac" in astate
    for swapped in (dict(astate, session_id=vstate["session_id"]), dict(astate, snapshot=vstate.get("snapshot"))):
        if swapped == astate:
            continue
        with pytest.raises(SessionStateError) as ei:
            client.resume(swapped)
        assert ei.value.code == "session_state_tampered"
    key_file = tmp_path / "store" / ".state-key"  # beside the snapshots, which outlive workspaces
    assert key_file.exists() and (key_file.stat().st_mode & 0o777) == 0o600


@pytest.mark.parametrize("sid", ["../outside", "/etc", "a/b", "..", "", "x\0y", "a.b"])
async def test_tampered_session_id_cannot_point_the_root_elsewhere(client, sid):
    _s, state = await _saved_state(client)
    with pytest.raises(SessionStateError):
        client.resume(dict(state, session_id=sid))


async def test_tampered_manifest_in_state_cannot_grant(client):
    _s, state = await _saved_state(client)
    bad = dict(state, manifest={"entries": {}, "extra_path_grants": [{"path": "/", "read_only": False}]})
    with pytest.raises(SessionStateError):
        client.resume(bad)  # the MAC refuses the edit
    with pytest.raises(Exception) as ei:
        client.resume(_resign(client, bad))  # and a validly signed one still cannot grant
    assert ei.value.code == "manifest_untrusted_field"


async def test_delete_after_tampering_removes_only_client_owned_workspace(client, opts, layout):
    """A caller-owned workspace's state, however edited, never lets delete reach the caller's directory."""
    (layout.ws / "precious.txt").write_text("caller")
    before = layout.snapshot()
    async with client.create(root=layout.ws) as s:
        pass
    state = client.serialize_state(s)
    # ownership flip attempts are refused outright
    for bad in (dict(state, owned=True), dict(state, root=str(layout.ws)), dict(state, workspace_root=str(layout.ws))):
        with pytest.raises(SessionStateError):
            client.resume(bad)
    # the valid state, resumed without the caller's root, gets a derived private workspace
    r = client.resume(state)
    assert r.owned and r.config.workspace_dir == os.path.join(opts.workspaces_dir, s.id)
    async with r:
        assert r.start_mode == "restored"  # rebuilt from the snapshot, not the caller's dir
    assert await client.delete(r, snapshot=True) is True
    assert (layout.ws / "precious.txt").read_text() == "caller"
    layout.assert_outside_unchanged(before)
    assert os.listdir(opts.workspaces_dir) == []


async def test_grants_come_only_from_options(tmp_path, layout):
    opts = ClientOptions(workspaces_dir=str(tmp_path / "w"), snapshot_dir=str(tmp_path / "st"))
    with LocalSandboxClient(opts) as client:
        _s, state = await _saved_state(client)
        assert "grants" not in json.dumps(state)
        r = client.resume(state)
        async with r:
            assert r.policy.grants == []
            with pytest.raises(PermissionError):
                await r.read(str(layout.outside / "secret.txt"))
        await client.delete(r)
        state = client.serialize_state(r)  # (the first state is now stale: r persisted a newer generation)
    granted = ClientOptions(workspaces_dir=str(tmp_path / "w"), snapshot_dir=str(tmp_path / "st"),
                            extra_path_grants=(Grant(str(layout.outside), read_only=True),))
    with LocalSandboxClient(granted) as client:
        r = client.resume(state)  # same state, grants from the trusted options only
        async with r:
            assert (await r.read(str(layout.outside / "sentinel.txt"))) == b"sentinel\n"
        await client.delete(r)


@pytest.mark.parametrize("version", [None, 0, 3, "1", "2", True, 1.5])
async def test_unknown_state_version_refused(client, version):
    _s, state = await _saved_state(client)
    bad = dict(state)
    if version is None:
        del bad["version"]
    else:
        bad["version"] = version
    with pytest.raises(SessionStateVersionError) as ei:
        client.deserialize_state(bad)
    assert "version" in ei.value.reason


async def test_hmac_protected_state(tmp_path):
    key = b"k" * 32
    opts = ClientOptions(workspaces_dir=str(tmp_path / "w"), snapshot_dir=str(tmp_path / "st"), state_key=key)
    with LocalSandboxClient(opts) as client:
        s, state = await _saved_state(client)
        assert len(state["mac"]) == 64
        assert client.deserialize_state(state).session_id == s.id
        for bad in (dict(state, workspace_root_ready=False), dict(state, snapshot="other"),
                    {k: v for k, v in state.items() if k != "mac"}, dict(state, mac="0" * 64),
                    dict(state, mac="\u00e9" * 64), dict(state, mac="\ud800" + "0" * 63), dict(state, mac=None)):
            with pytest.raises(SessionStateTamperedError):
                client.deserialize_state(bad)
        await client.delete(client.resume(state))
    other = ClientOptions(workspaces_dir=str(tmp_path / "w"), state_key=b"z" * 32)
    with LocalSandboxClient(other) as c2, pytest.raises(SessionStateTamperedError):
        c2.deserialize_state(state)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(extra=st.dictionaries(st.text(min_size=1, max_size=12), st.one_of(st.text(max_size=20), st.booleans(),
                                                                          st.integers()), min_size=1, max_size=3))
def test_property_any_unknown_field_is_refused(extra, tmp_path_factory):
    base = tmp_path_factory.mktemp("p")
    with LocalSandboxClient(ClientOptions(workspaces_dir=str(base / "w"))) as client:
        state = {"version": 1, "session_id": "abc", "manifest": None, "snapshot": None,
                 "workspace_root_ready": True, "fingerprint": None}
        fields = {k: v for k, v in extra.items() if k not in state}
        if not fields:
            return
        with pytest.raises(SessionStateError):
            client.deserialize_state(dict(state, **fields))


async def test_state_holds_no_secrets(client):
    m = load_manifest({"entries": {}, "environment": {"TOKEN": {"value": "hunter2-very-secret", "secret": True},
                                                      "PLAIN": "visible"}})
    async with client.create(manifest=m) as s:
        pass
    text = json.dumps(client.serialize_state(s))
    assert "hunter2-very-secret" not in text and "visible" in text
    r = client.resume(client.serialize_state(s))
    assert r.manifest.digest() == m.digest()  # digests redact secrets too: reattach still works
    async with r:
        assert r.start_mode == "reattached"
    await client.delete(r)


async def test_trusted_manifest_fields_not_carried_into_state(tmp_path, client):
    m = load_manifest({"entries": {"a": {"type": "file", "content": "x"}}, "base_dir": str(tmp_path)},
                      trust="trusted")
    async with client.create(manifest=m) as s:
        pass
    state = client.serialize_state(s)
    assert "base_dir" not in state["manifest"]
    r = client.resume(state)  # loads untrusted: would be refused if base_dir were still there
    async with r:
        assert await r.read("a") == b"x"
    await client.delete(r)


# ---------------------------------------------------------- open_session


async def test_source_injected_session_is_caller_owned(client, opts):
    s = client.create()
    await s.start()
    async with open_session(client, session=s, manifest=load_manifest(MANIFEST)) as got:
        assert got is s
        with pytest.raises(FileNotFoundError):
            await got.read("a.txt")  # manifest never applied to an injected session
    assert not s.closed and s.started and os.path.isdir(os.path.join(opts.workspaces_dir, s.id))
    with pytest.raises(SessionBusyError):
        async with open_session(client, session=s):
            async with open_session(client, session=s):
                pass
    assert s.bound_run is None
    await client.delete(s)


async def test_source_plain_fresh_is_runner_owned(client, opts):
    rs = RunState()
    async with open_session(client, run_state=rs, key="main", manifest=load_manifest(MANIFEST)) as s:
        assert await s.read("a.txt") == b"from manifest"
        assert rs.current_key == "main" and rs.sessions["main"]["session_id"] == s.id
    assert s.closed and os.listdir(opts.workspaces_dir) == []  # persisted, shut down, deleted
    assert rs.sessions["main"]["fingerprint"] is not None


async def test_source_snapshot_seeded_fresh(client):
    seed, _ = await _saved_state(client)
    async with open_session(client, snapshot=seed.id) as s:
        assert s.start_mode == "restored" and await s.read("f.txt") == b"data"


async def test_source_explicit_state_rebuilds_and_ignores_seed_args(client):
    old, state = await _saved_state(client, manifest=load_manifest(MANIFEST))
    await client.delete(old)
    other = load_manifest({"entries": {"b.txt": {"type": "file", "content": "other"}}})
    async with open_session(client, session_state=state, manifest=other, keep_workspace=True) as s:
        assert s.id == old.id and s.start_mode == "restored"
        assert await s.read("f.txt") == b"data"
        with pytest.raises(FileNotFoundError):
            await s.read("b.txt")
    async with open_session(client, session_state=client.serialize_state(s)) as s2:
        assert s2.start_mode == "reattached"  # the workspace survived (keep_workspace)


async def test_source_run_state_wins_over_explicit_state(client):
    a, state_a = await _saved_state(client)
    b, state_b = await _saved_state(client)
    rs = RunState(current_key="k", sessions={"k": state_a})
    async with open_session(client, run_state=rs, session_state=state_b) as s:
        assert s.id == a.id


async def test_run_state_handoff_between_keys_and_json_round_trip(client):
    rs = RunState()
    async with open_session(client, run_state=rs, key="planner", display_name="agent") as s:
        await s.write("who", b"planner")
    async with open_session(client, run_state=rs, key="coder", display_name="agent") as s2:
        await s2.write("who", b"coder")
    assert rs.current_key == "coder" and s.id != s2.id  # same display name, distinct keys and sessions
    assert rs.display_names == {"planner": "agent", "coder": "agent"}
    rs2 = RunState.model_validate_json(rs.model_dump_json())
    async with open_session(client, run_state=rs2, key="planner") as back:
        assert back.id == s.id and await back.read("who") == b"planner"
    assert rs2.current_key == "planner"
    async with open_session(client, run_state=rs2) as cur:  # no key: the current one
        assert cur.id == s.id


async def test_resume_after_interruption_selects_the_right_session(client):
    rs = RunState()
    async with open_session(client, run_state=rs, key="step1") as s1:
        await s1.write("done", b"1")

    class Interrupted(Exception):
        pass

    with pytest.raises(Interrupted):
        async with open_session(client, run_state=rs, key="step2") as s2:
            await s2.write("partial", b"2")
            raise Interrupted()
    saved = json.loads(rs.model_dump_json())  # what the host wrote to disk
    assert saved["current_key"] == "step2" and set(saved["sessions"]) == {"step1", "step2"}
    rs_again = RunState.model_validate(saved)
    async with open_session(client, run_state=rs_again) as again:
        assert again.id == s2.id and await again.read("partial") == b"2"
    async with open_session(client, run_state=rs_again, key="step1") as first:
        assert first.id == s1.id and await first.read("done") == b"1"


async def test_guard_released_when_close_fails(client, opts):
    rs = RunState()
    with pytest.raises(Exception) as ei:
        async with open_session(client, run_state=rs, key="k") as s:
            os.mkfifo(os.path.join(opts.workspaces_dir, s.id, "fifo"))  # persist will refuse it
    assert ei.value.code == "snapshot_unrestorable_entry"
    assert s.bound_run is None and s.closed
    assert os.path.isdir(os.path.join(opts.workspaces_dir, s.id))  # kept: close failed, nothing lost
    assert rs.current_key == "k"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sid=st.one_of(st.text(max_size=40), st.sampled_from(["..", "../x", "/abs", "a/../b", ".", "~root", "a\\b"])),
       snap=st.one_of(st.none(), st.text(max_size=20)))
def test_property_state_ids_never_name_anything_outside_the_client_dirs(sid, snap, tmp_path_factory):
    """Any id/snapshot text either is refused or names exactly <workspaces_dir>/<token> and a store token."""
    base = tmp_path_factory.mktemp("ids")
    with LocalSandboxClient(ClientOptions(workspaces_dir=str(base / "w"))) as client:
        state = {"version": 1, "session_id": sid, "snapshot": snap, "workspace_root_ready": True}
        try:
            s = client.resume(state)
        except SessionStateError:
            return
        assert os.path.dirname(s.config.workspace_dir) == str(base / "w")
        assert os.path.basename(s.config.workspace_dir) == sid and "/" not in sid and sid not in ("", ".", "..")
        assert s.owned and s.config.grants == ()
        assert snap is None or ("/" not in snap and "." not in snap)


# --------------------------------------------------- binding: workspace id and generation


def _tree(top) -> dict:
    from tests.conftest import tree_digest

    return {k: v for k, v in tree_digest(Path(top)).items() if k != "."}


async def test_swapped_state_is_refused_and_loses_nothing(client, tmp_path):
    """B's state copied over A's, resumed onto A's workspace: refused, A's unsaved work intact.

    On the code before, the MAC was valid and bound to nothing, so A's workspace was cleared (unsaved work
    included) and B's snapshot restored into it.
    """
    ws_a, ws_b = tmp_path / "wsA", tmp_path / "wsB"
    ws_a.mkdir()
    ws_b.mkdir()
    async with client.create(root=ws_a) as a:
        await a.write("a.txt", b"A saved")
    async with client.create(root=ws_b) as b:
        await b.write("b-secret.txt", b"B's data")
    state_b = client.serialize_state(b)
    (ws_a / "unsaved.txt").write_bytes(b"A's unsaved work")
    before = _tree(ws_a)
    with pytest.raises(WorkspaceMismatchError) as ei:
        async with client.resume(state_b, root=ws_a):
            pass
    assert ei.value.code == "workspace_mismatch" and str(ws_a) not in str(ei.value)
    assert _tree(ws_a) == before and not (ws_a / "b-secret.txt").exists()
    async with client.resume(client.serialize_state(a), root=ws_a) as again:  # A's own state still acts on it
        assert await again.read("a.txt") == b"A saved"


async def test_resume_without_a_workspace_rebuilds_it_on_another_machine(tmp_path):
    key = b"k" * 32
    store = str(tmp_path / "shared-store")
    one = ClientOptions(workspaces_dir=str(tmp_path / "m1"), snapshot_dir=store, state_key=key)
    two = ClientOptions(workspaces_dir=str(tmp_path / "m2"), snapshot_dir=store, state_key=key)
    with LocalSandboxClient(one) as c1:
        async with c1.create() as s:
            await s.write("w.txt", b"work")
        state = c1.serialize_state(s)
    assert state["version"] == 2 and state["generation"] == 1 and len(state["workspace_id"]) == 32
    with LocalSandboxClient(two) as c2:
        async with c2.resume(state) as r:
            assert r.start_mode == "restored" and await r.read("w.txt") == b"work"
            assert (await r.read(".sfs-workspace-id")).strip().decode() == state["workspace_id"]
        assert c2.serialize_state(r)["generation"] == 2


async def test_workspace_id_is_kept_out_of_snapshots_and_fingerprints(client, opts):
    async with client.create() as s:
        await s.write("f", b"1")
    info = client.store.info(s.id)
    import tarfile

    with tarfile.open(os.path.join(opts.snapshot_dir, info.archive)) as tar:
        assert tar.getnames() == ["f"]
    async with client.resume(client.serialize_state(s)) as r:
        assert r.start_mode == "reattached"  # the id file does not change the fingerprint


@pytest.mark.parametrize("forged", ["other", "garbage", "dir", "symlink", "removed"])
async def test_id_file_rewritten_by_the_command_is_refused_or_binds_nothing(client, opts, forged):
    async with client.create() as s:
        await s.write("f", b"1")
    state = client.serialize_state(s)
    ws = os.path.join(opts.workspaces_dir, s.id)
    idp = os.path.join(ws, ".sfs-workspace-id")
    os.unlink(idp)
    if forged == "other":
        with open(idp, "w") as fh:
            fh.write("0" * 32 + "\n")
    elif forged == "garbage":
        with open(idp, "w") as fh:
            fh.write("x" * 1000)
    elif forged == "dir":
        os.mkdir(idp)
    elif forged == "symlink":
        os.symlink(os.path.join(opts.snapshot_dir, ".state-key"), idp)
    if forged == "removed":
        async with client.resume(state) as r:  # nothing to bind: reattached as before, and given its id again
            assert r.start_mode == "reattached"
        with open(idp) as fh:
            assert fh.read().strip() == state["workspace_id"]
        return
    before = _tree(ws)
    with pytest.raises(WorkspaceMismatchError):
        await client.resume(state).start()
    assert _tree(ws) == before


@pytest.mark.parametrize("store", [False, True])
@pytest.mark.parametrize("id_file", ["removed", "kept"])
async def test_another_sessions_state_never_runs_in_a_workspace_whose_id_was_removed(tmp_path, store, id_file):
    """B's state resumed onto A's workspace after A's command removed A's id file.

    With no snapshot to match, nothing shows the tree is B's: refused, A's tree untouched (before, B
    reattached it and ran in what A's command left).  With B's snapshot, A's tree is never reattached
    as it is: B's snapshot is restored over it.  With A's id kept, B is refused either way.
    """
    opts = ClientOptions(workspaces_dir=str(tmp_path / "w"), state_key=b"k" * 32,
                         snapshot_dir=str(tmp_path / "store") if store else None)
    ws_a, ws_b = tmp_path / "wsA", tmp_path / "wsB"
    ws_a.mkdir()
    ws_b.mkdir()
    with LocalSandboxClient(opts) as client:
        async with client.create(root=ws_a) as a:
            await a.write("a.txt", b"A")
        async with client.create(root=ws_b) as b:
            await b.write("b.txt", b"B")
        state_b = client.serialize_state(b)
        if id_file == "removed":
            (ws_a / ".sfs-workspace-id").unlink()  # what A's confined command can do
        (ws_a / "planted.sh").write_bytes(b"left by A's command for B")
        before = _tree(ws_a)
        if store and id_file == "removed":
            async with client.resume(state_b, root=ws_a) as r:
                assert r.start_mode == "restored"
                assert await r.read("b.txt") == b"B" and not (ws_a / "planted.sh").exists()
            return
        with pytest.raises(WorkspaceMismatchError) as ei:
            await client.resume(state_b, root=ws_a).start()
        assert str(ws_a) not in str(ei.value)
        assert _tree(ws_a) == before


async def test_stale_state_is_refused_unless_allow_rollback(client, opts):
    async with client.create() as s:
        await s.write("f", b"v1")
    stale = client.serialize_state(s)  # generation 1
    async with client.resume(stale) as r:
        await r.write("f", b"v2")
    assert client.store.info(s.id).generation == 2
    ws = os.path.join(opts.workspaces_dir, s.id)
    with open(os.path.join(ws, "f"), "wb") as fh:
        fh.write(b"drifted, unsaved")
    before = _tree(ws)
    with pytest.raises(SnapshotGenerationError) as ei:
        await client.resume(stale).start()
    assert ei.value.context["state_generation"] == 1 and ei.value.context["store_generation"] == 2
    assert "newer" in ei.value.reason and _tree(ws) == before
    async with client.resume(stale, allow_rollback=True) as ok:
        assert ok.generation == 2 and await ok.read("f") == b"v2"
    assert client.serialize_state(ok)["generation"] == 3
    # a store rolled back under a newer state is refused too
    newer = client.serialize_state(ok)
    # (the directory store keeps generations: the operator puts back a pointer naming generation 2 only)
    ptr = json.loads(client.store.objects.get_bytes(f"{s.id}/current", 1 << 20))
    ptr["generations"] = [g for g in ptr["generations"] if g["generation"] <= 2]
    ptr["restore_points"] = 1
    client.store.objects.put_bytes(f"{s.id}/current", json.dumps(ptr).encode())
    with pytest.raises(SnapshotGenerationError, match="older"):
        await client.resume(newer).start()


async def test_generation_is_macd(client):
    _s, state = await _saved_state(client)
    with pytest.raises(SessionStateTamperedError):
        client.resume(dict(state, generation=state["generation"] + 5))
    with pytest.raises(SessionStateTamperedError):
        client.resume(dict(state, workspace_id="0" * 32))


def _v1_state(client, session_id: str, snapshot: str | None, fingerprint: str | None) -> dict:
    """A state file exactly as the version-1 code wrote it (its fields and its MAC domain)."""
    import hashlib
    import hmac

    from sandbox_fs import client as client_mod

    payload = {"version": 1, "session_id": session_id, "manifest": None, "snapshot": snapshot,
               "workspace_root_ready": True, "fingerprint": fingerprint}
    payload["mac"] = hmac.new(client._state_key, b"sandbox-fs/session-state/v1\0" + client_mod._canonical(payload),
                              hashlib.sha256).hexdigest()
    return payload


async def test_version_1_state_still_loads_resumes_and_is_rewritten_as_version_2(client, opts):
    async with client.create() as s:
        await s.write("f", b"old")
    ws = os.path.join(opts.workspaces_dir, s.id)
    os.unlink(os.path.join(ws, ".sfs-workspace-id"))  # a workspace made before the binding holds no id
    old = _v1_state(client, s.id, s.id, s.fingerprint)
    assert client.deserialize_state(old).version == 1
    async with client.resume(old) as r:
        assert r.start_mode == "reattached" and await r.read("f") == b"old"
    new = client.serialize_state(r)
    assert new["version"] == 2 and new["workspace_id"] == r.workspace_id
    # the v1 file replayed onto the now bound workspace: refused, use the newer state
    with pytest.raises(WorkspaceMismatchError, match="version 1"):
        await client.resume(old).start()
    await client.delete(r)
    async with client.resume(old) as rebuilt:  # no workspace: rebuilt from the snapshot, as before
        assert rebuilt.start_mode == "restored" and await rebuilt.read("f") == b"old"


def test_version_1_state_with_binding_fields_is_refused(client):
    bad = _v1_state(client, "abc", None, None)
    bad.pop("mac")
    bad["workspace_id"] = "0" * 32
    with pytest.raises(SessionStateError):
        client.deserialize_state(_resign(client, bad))


async def test_a_fallback_generation_is_what_the_state_records(client, monkeypatch):
    from sandbox_fs.snapshot import SnapshotVerifyError

    async with client.create() as s:
        await s.write("f", b"good")
    state = client.serialize_state(s)
    objects = client.store.objects  # the new archive does not read back with its size
    real_head = objects.head
    monkeypatch.setattr(objects, "head", lambda key: None if key.endswith("archive.tar") else real_head(key))
    r = client.resume(state)
    await r.start()
    await r.write("f", b"newer")
    with pytest.raises(SnapshotVerifyError):
        await r.aclose()
    monkeypatch.undo()
    after = client.serialize_state(r)
    assert after["generation"] == 1 == client.store.info(s.id).generation
    await client.delete(r)
    async with client.resume(after) as again:  # not a rollback: the state says what the store holds
        assert await again.read("f") == b"good"


# ------------------------------------------------- the MAC's wire format and the binding rules


def _keyed_client(tmp_path):
    return LocalSandboxClient(ClientOptions(workspaces_dir=str(tmp_path / "w"), snapshot_dir=str(tmp_path / "s"),
                                            state_key=b"k" * 32))


def test_state_mac_is_over_canonical_json(tmp_path):
    """A known answer: states written by earlier releases, or reordered by a JSON store, still verify."""
    payload = {"version": 2, "workspace_id": "0" * 32, "session_id": "s1", "generation": 3,
               "manifest": {"entries": {"\u00e9.txt": {"type": "file", "content": "\u00fc"}}}}
    with _keyed_client(tmp_path) as c:
        signed = c.sign_state(payload)
        assert signed["mac"] == "6ba75310da39284e742df1a0c27c97ff10f16fa196f7b4190b81a8333bb11a4a"
        reordered = json.loads(json.dumps(dict(reversed(list(signed.items())))))
        assert c.deserialize_state(reordered).generation == 3


def test_signed_state_breaking_the_binding_rules_is_refused(tmp_path):
    """A validly signed state is still validated: no v2 state without its workspace_id, no bad ids."""
    with _keyed_client(tmp_path) as c:
        with pytest.raises(SessionStateError) as ei:
            c.deserialize_state(c.sign_state({"version": 2, "session_id": "s1"}))
        assert ei.value.code == "session_state_invalid"
        with pytest.raises(SessionStateError) as ei:  # the session id is still a plain token
            c.deserialize_state(c.sign_state({"version": 2, "session_id": "../s1", "workspace_id": "0" * 32}))
        assert ei.value.code == "session_state_invalid"
        extra = {f"x{i:02}": 1 for i in range(12)}
        with pytest.raises(SessionStateError) as ei:  # the fields named in the error are bounded
            c.deserialize_state(c.sign_state({"version": 2, "session_id": "s1", "workspace_id": "0" * 32, **extra}))
        assert ei.value.context["fields"] == sorted(extra)[:10]


def test_deep_state_is_refused_before_the_mac(tmp_path):
    deep: dict = {}
    for _ in range(65):
        deep = {"a": deep}
    with _keyed_client(tmp_path) as c:
        with pytest.raises(SessionStateError, match="nests too deeply") as ei:
            c.deserialize_state({"version": 2, "session_id": "s1", "manifest": deep, "mac": "0" * 64})
        assert ei.value.code == "session_state_invalid"


# ------------------------------------------------------------- the installation key (one helper, client and store)


@pytest.mark.parametrize("damage", ["short", "long", "symlink", "fifo", "dir"])
def test_a_damaged_or_planted_installation_key_is_refused_never_followed_or_replaced(tmp_path, damage):
    from sandbox_fs.client import UnsafeKeyFileError

    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    sentinel = tmp_path / "outside-key"
    sentinel.write_text("s" * 64 + "\n")  # a valid-looking key outside the store: a symlink must not lend it
    key = store / ".state-key"
    if damage == "short":
        key.write_text("x" * 31 + "\n")
        key.chmod(0o600)
    elif damage == "long":
        key.write_bytes(b"k" * 5000)
        key.chmod(0o600)
    elif damage == "symlink":
        key.symlink_to(sentinel)
    elif damage == "fifo":
        os.mkfifo(key, 0o600)
    else:
        key.mkdir(mode=0o700)
    before = os.lstat(key)
    with pytest.raises((SessionStateError, UnsafeKeyFileError)) as ei:
        LocalSandboxClient(ClientOptions(workspaces_dir=str(tmp_path / "w"), snapshot_dir=str(store)))
    assert isinstance(ei.value, SessionStateError) is (damage == "short")
    assert str(tmp_path) not in str(ei.value)
    after = os.lstat(key)
    assert (after.st_ino, after.st_mode, after.st_mtime_ns) == (before.st_ino, before.st_mode, before.st_mtime_ns)
    assert sentinel.read_text() == "s" * 64 + "\n"
    assert sorted(os.listdir(store)) == [".state-key"]  # no temporary left behind


def test_the_client_and_the_store_share_one_installation_key_made_once_and_whole(tmp_path):
    """Made by whichever comes first, 0600, moved into place whole: racing makers and readers see one key."""
    import threading

    from sandbox_fs._keyfile import installation_key
    from sandbox_fs.root import open_root
    from sandbox_fs.snapshot import DirectorySnapshotStore
    from sandbox_fs.snapshot._baseline import baseline_key_of

    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    got: list[bytes | None] = []
    with open_root(str(store)) as r:
        threads = [threading.Thread(target=lambda: got.append(installation_key(r, create=True))) for _ in range(8)]
        threads += [threading.Thread(target=lambda: got.append(installation_key(r, create=False) or b"-" * 64))
                    for _ in range(4)]  # a reader sees no key (None) or the whole one, never a short one
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    made = [k for k in got if k != b"-" * 64]
    assert len(got) == 12 and len(set(made)) == 1 and len(made[0] or b"") == 64
    assert (os.stat(store / ".state-key").st_mode & 0o777) == 0o600 and sorted(os.listdir(store)) == [".state-key"]
    with LocalSandboxClient(ClientOptions(workspaces_dir=str(tmp_path / "w"), snapshot_dir=str(store))) as c:
        assert c._state_key == made[0]
    with DirectorySnapshotStore(store) as st:
        assert st.baseline_key == baseline_key_of(made[0] or b"")
