"""Fuzz target ``state``: serialized session state through ``LocalSandboxClient.deserialize_state``.

An input is one mode byte and JSON text.  With bit 0 of the mode byte the
parsed payload is re-signed with the client's key (a valid MAC over a
mutated payload: every field rule must hold on its own); without it the MAC
is whatever the input carries (a mutated signed state: the MAC must refuse
it).  The invariant, besides the common one (only ``SandboxError`` refusals):
a state is accepted only with a valid MAC, and an accepted state obeys the
rules restated here independently of the model (plain-token session id and
snapshot name, hex digests of the right length, a version-2 state bound to
its workspace id, no field the model does not define, and a round trip
through its JSON form gives the same state).
"""

from __future__ import annotations

import hmac
import json
import os
import re
from typing import Any

from ._target import Finding, Scene, Target

__all__ = ["STATE"]

KEY = b"sandbox-fs fuzz state key, 32 b"
_TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
_HEX = {"fingerprint": 64, "snapshot_digest": 64, "workspace_id": 32}
_FIELDS = {"version", "session_id", "manifest", "snapshot", "workspace_root_ready", "fingerprint",
           "workspace_id", "generation", "snapshot_digest"}


class _Env:
    def __init__(self) -> None:
        from ...client import ClientOptions, LocalSandboxClient  # noqa: PLC0415

        self.scene = Scene("state")
        self.client = LocalSandboxClient(ClientOptions(workspaces_dir=os.path.join(self.scene.base, "wss"),
                                                       state_key=KEY))


_env: _Env | None = None


def _check_accepted(state: Any, payload: dict[str, Any], signed: bool) -> None:
    from ...client import SessionState  # noqa: PLC0415

    if not signed:
        raise Finding("a state without a valid MAC was accepted")
    extra = set(payload) - _FIELDS - {"mac"}
    if extra:
        raise Finding(f"fields the model does not define were accepted: {sorted(extra)[:5]}")
    if type(payload.get("version")) is not int or state.version != payload["version"] or state.version not in (1, 2):
        raise Finding(f"version {payload.get('version')!r} accepted as {state.version!r}")
    if not (isinstance(state.session_id, str) and _TOKEN.fullmatch(state.session_id)):
        raise Finding(f"session id {state.session_id!r} is not a plain token")
    if state.snapshot is not None and not (isinstance(state.snapshot, str) and _TOKEN.fullmatch(state.snapshot)):
        raise Finding(f"snapshot name {state.snapshot!r} is not a plain token")
    for name, width in _HEX.items():
        value = getattr(state, name)
        if value is not None and not re.fullmatch(f"[0-9a-f]{{{width}}}", value):
            raise Finding(f"{name} {value!r} is not {width} hex digits")
    if (state.version == 2) != (state.workspace_id is not None):
        raise Finding("a version 2 state without a workspace id, or a version 1 state with one")
    if state.generation is not None and (type(state.generation) is not int or not 0 <= state.generation <= 1 << 62):
        raise Finding(f"generation {state.generation!r} out of range")
    if state.manifest is not None and not isinstance(state.manifest, dict):
        raise Finding("the manifest is not a JSON object")
    if SessionState.model_validate(state.model_dump(mode="json")) != state:
        raise Finding("the accepted state does not round-trip through its JSON form")


def one_input(data: bytes) -> None:
    """Deserialize the state coded in ``data``; raise a Finding if the invariant breaks."""
    global _env
    if _env is None:
        _env = _Env()
    env = _env
    mode, body = (data[0], data[1:]) if data else (0, b"")
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return  # not JSON: the state file reader refuses it before the client sees it
    if mode & 1 and isinstance(obj, dict):
        obj = env.client.sign_state(obj)
    signed = isinstance(obj, dict) and isinstance(obj.get("mac"), str) and obj["mac"].isascii() and hmac.compare_digest(
        obj["mac"], env.client.sign_state(obj).get("mac", ""))

    def step() -> None:
        state = env.client.deserialize_state(obj)
        _check_accepted(state, obj, signed)

    env.scene.run(step)


def seeds() -> list[bytes]:
    """Signed and unsigned states of both versions, with a manifest, an extra field, a bad MAC."""
    v2 = {"version": 2, "session_id": "s1", "manifest": {"entries": {"a": {"type": "file", "content": "x"}}},
          "snapshot": "s1", "workspace_root_ready": True, "fingerprint": "a" * 64, "workspace_id": "b" * 32,
          "generation": 3, "snapshot_digest": "c" * 64}
    v1 = {"version": 1, "session_id": "old", "manifest": None, "snapshot": None,
          "workspace_root_ready": False, "fingerprint": None}
    out = []
    for payload in (v2, v1, dict(v2, root="/etc"), dict(v2, mac="0" * 64), dict(v1, version=True)):
        out.append(b"\x01" + json.dumps(payload).encode())
        out.append(b"\x00" + json.dumps(payload).encode())
    return out


TOKENS = (b'"version"', b'"session_id"', b'"mac"', b'"manifest"', b'"snapshot"', b'"fingerprint"',
          b'"workspace_id"', b'"generation"', b'"snapshot_digest"', b'"workspace_root_ready"', b'"root"',
          b'"grants"', b"true", b"null", b"4611686018427387904", b"-1", b'"../x"', b'"a.b"', b"1e400")

STATE = Target("state", one_input, seeds, TOKENS)
