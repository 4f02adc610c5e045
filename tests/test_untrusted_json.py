"""Deeply nested JSON from a hostile store, state file or peer is a refusal with a stable code, never RecursionError.

``json.loads`` raises RecursionError (not ValueError) past the interpreter's
recursion limit; every site parsing untrusted JSON mapped only ValueError to
its refusal, so a 100 kB pointer object made ``sandbox-fs snapshot ls`` and
``GenerationStore.info``/``list``/hydrate fail as an internal error.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox_fs._json import MAX_DEPTH, loads_untrusted
from sandbox_fs.client import ClientOptions, LocalSandboxClient, SessionStateError
from sandbox_fs.fuse._protocol import ProtocolError, decode
from sandbox_fs.snapshot import GenerationStore, SnapshotCorruptError, SnapshotPolicy
from sandbox_fs.snapshot._index import decode_index
from sandbox_fs.snapshot._objects_local import LocalObjects

DEEP = b"[" * 100_000  # far past any recursion limit
GEN_DIR = "000000000001-0123456789abcdef"


def _nested(depth: int) -> object:
    doc: object = []
    for _ in range(depth - 1):
        doc = [doc]
    return doc


def test_deep_pointer_is_corrupt_not_recursion(tmp_path):
    with GenerationStore(LocalObjects(tmp_path / "store")) as store:
        store.objects.put_bytes("bad/current", DEEP)
        with pytest.raises(SnapshotCorruptError):
            store.info("bad")
        assert store.list() == []  # one hostile name does not break the listing


def test_deep_metadata_is_corrupt_not_recursion(tmp_path):
    with GenerationStore(LocalObjects(tmp_path / "store")) as store:
        store.objects.put_bytes(f"bad/gen/{GEN_DIR}/meta.json", DEEP)
        pointer = {"name": "bad", "generations": [{"generation": 1, "dir": GEN_DIR,
                                                   "meta_sha256": hashlib.sha256(DEEP).hexdigest()}]}
        store.objects.put_bytes("bad/current", json.dumps(pointer).encode())
        with pytest.raises(SnapshotCorruptError):
            store.info("bad")


def test_deep_index_is_corrupt_not_recursion():
    with pytest.raises(SnapshotCorruptError):
        decode_index(zlib.compress(DEEP), SnapshotPolicy(), frozenset({1}), "bad")


def test_deep_state_is_refused_before_the_mac(tmp_path):
    state = {"version": 2, "session_id": "x", "a": _nested(990)}  # parses, but the MAC's dumps would recurse
    with LocalSandboxClient(ClientOptions(workspaces_dir=str(tmp_path / "ws"),
                                          snapshot_dir=str(tmp_path / "store"))) as client:
        with pytest.raises(SessionStateError):
            client.deserialize_state(state)


def test_deep_protocol_message_is_a_protocol_error():
    with pytest.raises(ProtocolError):
        decode(DEEP)


@pytest.mark.parametrize("depth", [990, 100_000])
def test_cli_deep_state_file_is_one_line(tmp_path, depth):
    state = tmp_path / "state.json"
    state.write_text('{"version":2,"a":' + "[" * depth + "]" * depth + "}")
    env = {**os.environ, "SANDBOX_FS_DEBUG": ""}
    proc = subprocess.run([sys.executable, "-m", "sandbox_fs", "session", "resume", "--state", str(state),
                           "--store", str(tmp_path / "store"), "--workspaces-dir", str(tmp_path / "ws")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "internal error" not in lines[0] and "Traceback" not in proc.stderr


def test_cli_snapshot_ls_with_a_deep_pointer(tmp_path):
    with LocalObjects(tmp_path / "store") as objects:
        objects.put_bytes("bad/current", DEEP)
    proc = subprocess.run([sys.executable, "-m", "sandbox_fs", "snapshot", "ls", "--store", str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=120)
    assert "internal error" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 0, proc.stderr


@settings(max_examples=60, deadline=None)
@given(depth=st.integers(1, 5000), opener=st.sampled_from(["[", '{"k":']), tail=st.binary(max_size=8))
def test_loads_untrusted_only_value_error(depth, opener, tail):
    """Any nesting, closed or not, with junk after it: a value within MAX_DEPTH, else ValueError only."""
    closer = "]" if opener == "[" else "}"
    text = (opener * depth + "0" + closer * depth).encode() + tail
    try:
        doc = loads_untrusted(text)
    except ValueError:
        assert depth > MAX_DEPTH or tail.strip(b" \t\n\r")
        return
    assert depth <= MAX_DEPTH and doc is not None


@settings(max_examples=40, deadline=None)
@given(depth=st.integers(1, 5000), raw=st.binary(max_size=64))
def test_decode_index_only_corrupt(depth, raw):
    """Whatever the bytes (deep, random), decode_index refuses with SnapshotCorruptError and nothing else."""
    for body in ((b"[" * depth) + raw, raw):
        with pytest.raises(SnapshotCorruptError):
            decode_index(zlib.compress(body), SnapshotPolicy(), frozenset({1}), "bad")
