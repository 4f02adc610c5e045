"""Client: serialized state carries no authority; open_session source resolution; RunState keys."""

from __future__ import annotations

import json
import os

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
from sandbox_fs.session import SessionBusyError

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
    import hashlib
    import hmac

    from sandbox_fs import client as client_mod

    payload = {k: v for k, v in state.items() if k != "mac"}
    payload["mac"] = hmac.new(client._state_key, client_mod._MAC_DOMAIN + client_mod._canonical(payload),
                              hashlib.sha256).hexdigest()
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
    granted = ClientOptions(workspaces_dir=str(tmp_path / "w"), snapshot_dir=str(tmp_path / "st"),
                            extra_path_grants=(Grant(str(layout.outside), read_only=True),))
    with LocalSandboxClient(granted) as client:
        r = client.resume(state)  # same state, grants from the trusted options only
        async with r:
            assert (await r.read(str(layout.outside / "sentinel.txt"))) == b"sentinel\n"
        await client.delete(r)


@pytest.mark.parametrize("version", [None, 0, 2, "1", True, 1.5])
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
                    {k: v for k, v in state.items() if k != "mac"}, dict(state, mac="0" * 64)):
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
