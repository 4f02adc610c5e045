"""Manifest models: destinations, overlaps, trust, symlink targets, secrets, JSON round trip, schema."""

from __future__ import annotations

import json
import posixpath

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandbox_fs.manifest import (
    Archive,
    Dir,
    EnvValue,
    File,
    LocalDir,
    LocalFile,
    Manifest,
    ManifestError,
    ManifestTrustError,
    Symlink,
    check_destination,
    check_link_target,
    load_manifest,
)

FULL = {
    "root": "/srv/ws",
    "description": "every entry type",
    "entries": {
        "README.md": {"type": "file", "content": "hello\n"},
        "bin/run": {"type": "file", "content": "IyEvYmluL3NoCg==", "encoding": "base64", "mode": 0o755},
        "data": {"type": "dir", "mode": 0o750, "children": {"a.txt": {"type": "file", "content": "a"},
                                                             "deep/b": {"type": "dir"}}},
        "lib.py": {"type": "local_file", "src": "src/lib.py"},
        "proj": {"type": "local_dir", "src": "proj", "exclude": ["*.pyc"], "symlinks": "skip"},
        "latest": {"type": "symlink", "target": "data/a.txt"},
        "vendor": {"type": "archive", "src": "vendor.tar.gz", "format": "tar.gz", "limits": {"max_members": 10}},
        "tmp": {"type": "dir", "ephemeral": True, "children": {"cache": {"type": "file", "content": ""}}},
    },
    "environment": {"LANG": "C.UTF-8", "TOKEN": {"value": "s3cr3t-value", "secret": True}},
}


def test_every_entry_type_parses():
    m = load_manifest(json.dumps(FULL))
    kinds = {fe.path: type(fe.entry) for fe in m.iter_entries()}
    assert kinds == {
        "README.md": File, "bin/run": File, "data": Dir, "data/a.txt": File, "data/deep/b": Dir,
        "lib.py": LocalFile, "proj": LocalDir, "latest": Symlink, "vendor": Archive, "tmp": Dir,
        "tmp/cache": File,
    }
    assert m.entries["bin/run"].data() == b"#!/bin/sh\n"
    assert m.entries["bin/run"].decoded_size() == len(b"#!/bin/sh\n")
    assert isinstance(m.environment["LANG"], EnvValue) and m.environment["LANG"].value == "C.UTF-8"


def test_ephemeral_paths_include_children_of_an_ephemeral_dir():
    m = load_manifest(FULL)
    assert m.ephemeral_paths() == ["tmp", "tmp/cache"]


def test_json_round_trip_and_digest_stability():
    m = load_manifest(FULL)
    text = m.to_json(reveal_secrets=True)
    again = load_manifest(text)
    assert again == m
    assert again.digest() == m.digest()
    # root is not part of the digest; content is
    moved = load_manifest({**FULL, "root": "/elsewhere"})
    assert moved.digest() == m.digest()
    changed = json.loads(text)
    changed["entries"]["README.md"]["content"] = "changed\n"
    assert load_manifest(changed).digest() != m.digest()
    # key order does not matter
    reordered = {**FULL, "entries": dict(reversed(list(FULL["entries"].items())))}
    assert load_manifest(reordered).digest() == m.digest()


def test_secrets_are_redacted_in_repr_json_and_digest():
    m = load_manifest(FULL)
    secret = "s3cr3t-value"
    assert secret not in repr(m)
    assert secret not in repr(m.environment["TOKEN"])
    assert secret not in str(m.environment["TOKEN"])
    assert secret not in m.to_json()
    assert secret not in m.model_dump_json()
    assert secret not in m.canonical_json()
    assert secret in m.to_json(reveal_secrets=True)
    assert m.environment_values()["TOKEN"] == secret
    assert m.secret_values() == [secret]
    other = load_manifest({**FULL, "environment": {**FULL["environment"], "TOKEN": {"value": "x", "secret": True}}})
    assert other.digest() == m.digest()  # a digest is no oracle for a secret


def test_json_schema_export():
    schema = Manifest.model_json_schema()
    text = json.dumps(schema)
    for tag in ("file", "dir", "local_file", "local_dir", "symlink", "archive", "mount"):
        assert f'"{tag}"' in text
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) >= {"root", "entries", "environment"}


# ------------------------------------------------------------------- trust


@pytest.mark.parametrize("field,value", [
    ("extra_path_grants", [{"path": "/etc", "read_only": False}]),
    ("extra_path_grants", []),
    ("base_dir", "/"),
])
def test_untrusted_manifest_cannot_grant_itself_host_access(field, value):
    data = {"root": "/x", "entries": {"p": {"type": "local_file", "src": "/etc/passwd"}}, field: value}
    with pytest.raises(ManifestTrustError) as ei:
        load_manifest(data)
    assert ei.value.context["field"] == field
    assert field in str(ei.value)
    # the same document is accepted when the application says it is trusted
    trusted = load_manifest(data, trust="trusted")
    assert getattr(trusted, field) == value
    # and a trusted Manifest object is refused again as untrusted
    with pytest.raises(ManifestTrustError):
        load_manifest(trusted)


@pytest.mark.parametrize("extra", ["host_path", "mounts", "grants", "privileged"])
def test_unknown_fields_are_refused_everywhere(extra):
    with pytest.raises(ManifestError) as ei:
        load_manifest({"entries": {}, extra: "/etc"})
    assert extra in ei.value.context["field"]
    with pytest.raises(ManifestError) as ei:
        load_manifest({"entries": {"a": {"type": "local_dir", "src": "x", extra: "/etc"}}})
    assert ei.value.context["field"] == f"entries['a'].{extra}"


@pytest.mark.parametrize("src", ["../../etc/passwd", "a/../../b", "..", "x/.."])
def test_src_with_dotdot_is_refused_at_load(src):
    with pytest.raises(ManifestError) as ei:
        load_manifest({"entries": {"c": {"type": "local_file", "src": src}}})
    assert ei.value.context["field"] == "entries['c'].src"


def test_src_is_normalized():
    m = load_manifest({"entries": {"c": {"type": "local_file", "src": "./a//b/"},
                                   "d": {"type": "local_dir", "src": "/data/./x/"}}})
    assert m.entries["c"].src == "a/b"
    assert m.entries["d"].src == "/data/x"


# ----------------------------------------------------------- destinations


@pytest.mark.parametrize("dest", ["../outside/pwned.txt", "/etc/passwd", "a/../../x", "a/..", "", ".", "./",
                                  "a\0b", "..\\x", "a\\b", "x/" + "n" * 256])
def test_bad_destinations_are_refused(dest):
    with pytest.raises(ManifestError) as ei:
        load_manifest({"entries": {dest: {"type": "file", "content": "x"}}})
    assert ei.value.code == "invalid_manifest"
    assert "entries[" in ei.value.context["field"]


def test_destination_normalization_and_duplicates():
    m = load_manifest({"entries": {"./a//b/": {"type": "file"}}})
    assert list(m.entries) == ["a/b"]
    with pytest.raises(ManifestError, match="same destination"):
        load_manifest({"entries": {"a/b": {"type": "file"}, "a//b": {"type": "file"}}})
    with pytest.raises(ManifestError, match="repeats a key"):
        load_manifest('{"entries": {"a": {"type": "file"}, "a": {"type": "dir"}}}')
    with pytest.raises(ManifestError, match="same destination"):
        load_manifest({"entries": {"d": {"type": "dir", "children": {"x": {"type": "file"}}},
                                   "d/x": {"type": "file"}}})


@pytest.mark.parametrize("holder", ["file", "local_file", "local_dir", "symlink", "archive"])
def test_nesting_only_under_a_dir(holder):
    body = {"file": {"type": "file"}, "local_file": {"type": "local_file", "src": "a"},
            "local_dir": {"type": "local_dir", "src": "a"}, "symlink": {"type": "symlink", "target": "z"},
            "archive": {"type": "archive", "src": "a.tar"}}[holder]
    with pytest.raises(ManifestError, match="beneath a"):
        load_manifest({"entries": {"p": body, "p/q/r": {"type": "file"}}})
    load_manifest({"entries": {"p": {"type": "dir"}, "p/q/r": {"type": "file"}}})


def test_modes():
    m = load_manifest({"entries": {"f": {"type": "file"}, "x": {"type": "file", "mode": 0o755}}})
    assert m.entries["f"].mode is None and m.entries["x"].mode == 0o755
    for bad in (0o4755, 0o2755, 0o1777, 0o10644, -1, True, "0644"):
        with pytest.raises(ManifestError) as ei:
            load_manifest({"entries": {"f": {"type": "file", "mode": bad}}})
        assert ei.value.context["field"] == "entries['f'].mode"


def test_bad_content_and_sizes():
    with pytest.raises(ManifestError, match="base64"):
        load_manifest({"entries": {"f": {"type": "file", "content": "!!!", "encoding": "base64"}}})
    with pytest.raises(ManifestError, match="not valid JSON"):
        load_manifest("{nope")
    with pytest.raises(ManifestError, match="nests too deeply"):
        load_manifest("[" * 100_000)
    with pytest.raises(ManifestError, match="JSON object"):
        load_manifest("[1, 2]")
    deep: dict = {"type": "file"}
    for _ in range(80):
        deep = {"type": "dir", "children": {"d": deep}}
    with pytest.raises(ManifestError, match="deeper"):
        load_manifest({"entries": {"top": deep}})
    with pytest.raises(ManifestError, match="environment name"):
        load_manifest({"environment": {"BAD-NAME": "x"}})
    with pytest.raises(ManifestError):
        load_manifest({"environment": {"A": "x\0y"}})


# ---------------------------------------------------------- symlink targets


@pytest.mark.parametrize("link,target", [
    ("l", "/etc/passwd"), ("l", ".."), ("a/l", "../.."), ("a/l", "b/../../.."), ("l", "x/../y"),
    ("a/l", "../x/../../y"), ("l", ""), ("l", "a\0b"),
])
def test_symlink_targets_refused(link, target):
    with pytest.raises(ManifestError):
        check_link_target(link, target)
    with pytest.raises(ManifestError):
        load_manifest({"entries": {link: {"type": "symlink", "target": target}}})


@pytest.mark.parametrize("link,target,norm", [
    ("l", "a", "a"), ("a/l", "../b", "../b"), ("a/b/l", "../../c/./d", "../../c/d"), ("a/l", ".", "."),
    ("a/l", "..", ".."),
])
def test_symlink_targets_accepted(link, target, norm):
    assert check_link_target(link, target) == norm


# ------------------------------------------------------------- properties

_COMP = st.sampled_from(["a", "b", "..", ".", "", "c d", "\\", "..\\..", "é", "n" * 250])
_DEST = st.lists(_COMP, min_size=0, max_size=6).map("/".join) | st.text(max_size=40)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_DEST)
def test_property_no_accepted_destination_escapes(raw):
    try:
        norm = check_destination(raw)
    except ManifestError:
        return
    assert norm and not norm.startswith("/")
    parts = norm.split("/")
    assert ".." not in parts and "." not in parts and "" not in parts
    assert "\\" not in norm and "\0" not in norm
    # joined under any root it stays strictly beneath it
    joined = posixpath.normpath(posixpath.join("/ws", norm))
    assert joined.startswith("/ws/")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=3).map("/".join),
                min_size=1, max_size=6),
       st.lists(st.sampled_from(["file", "dir", "symlink"]), min_size=6, max_size=6))
def test_property_overlapping_destinations_refused(paths, kinds):
    entries = {}
    for p, k in zip(paths, kinds):
        entries[p] = {"file": {"type": "file"}, "dir": {"type": "dir"}, "symlink": {"type": "symlink",
                                                                                  "target": "a"}}[k]
    expected_ok = True
    for p in entries:
        parts = p.split("/")
        for i in range(1, len(parts)):
            anc = "/".join(parts[:i])
            if anc in entries and entries[anc]["type"] != "dir":
                expected_ok = False
    try:
        m = load_manifest({"entries": entries})
    except ManifestError:
        assert not expected_ok
        return
    assert expected_ok
    flat = [fe.path for fe in m.iter_entries()]
    assert len(flat) == len(set(flat))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["a", "b"]), min_size=1, max_size=4).map("/".join),
       st.lists(st.sampled_from(["a", "b", "..", ".", ""]), min_size=1, max_size=6).map("/".join))
def test_property_accepted_link_targets_stay_inside(link, target):
    """Physical check: build the tree with every prefix a real dir, resolve lexically from the link's dir."""
    try:
        norm = check_link_target(link, target)
    except ManifestError:
        return
    resolved = posixpath.normpath(posixpath.join("/ws", posixpath.dirname(link), norm))
    assert resolved == "/ws" or resolved.startswith("/ws/")
    comps = [c for c in target.split("/") if c not in ("", ".")]
    seen_normal = False
    for c in comps:
        if c == "..":
            assert not seen_normal
        else:
            seen_normal = True


# --------------------------------------------------------------- fuzzing

_SCALAR = st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.text(max_size=12) | st.sampled_from(
    ["file", "dir", "local_file", "local_dir", "symlink", "archive", "mount", "..", "/etc", "a/b", "", "base64"])
_JSON = st.recursive(_SCALAR, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.sampled_from(["type", "content", "src", "target", "mode", "children", "entries", "root", "environment",
                     "ephemeral", "encoding", "include", "exclude", "symlinks", "limits", "value", "secret",
                     "a", "../x", "b/c", "extra_path_grants", "grant", "read_only"]) | st.text(max_size=6), inner, max_size=5),
    max_leaves=25)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(["root", "entries", "environment", "description", "version"]), _JSON,
                       max_size=4))
def test_fuzz_load_manifest_only_raises_manifest_error(data):
    """Arbitrary JSON documents either load or raise ManifestError: never another exception."""
    for doc in (data, json.dumps(data)):
        try:
            m = load_manifest(doc)
        except ManifestError as exc:
            assert exc.code in ("invalid_manifest", "manifest_untrusted_field")
            assert "Traceback" not in str(exc)
            continue
        for fe in m.iter_entries():
            assert check_destination(fe.path) == fe.path
        assert len(m.digest()) == 64


# ------------------------------------------------------------------ environment hooks (issue 11, B)

from sandbox_fs.manifest import REFUSED_ENV_NAMES, check_untrusted_environment  # noqa: E402

HOOKS = sorted(REFUSED_ENV_NAMES) + ["LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "LD_DEBUG_OUTPUT", "LD_",
                                     "LD_BIND_NOW", "LUA_INIT_5_4", "LUA_PATH_5_3"]


@pytest.mark.parametrize("name", HOOKS)
@pytest.mark.parametrize("secret", [False, True])
def test_untrusted_manifest_cannot_set_loader_or_interpreter_hooks(name, secret):
    value = "./evil.so-" + name.lower()
    doc = {"environment": {"LANG": "C.UTF-8", name: {"value": value, "secret": secret}}}
    for data in (doc, json.dumps(doc)):
        with pytest.raises(ManifestTrustError) as info:
            load_manifest(data)
        assert info.value.field == f"environment[{name!r}]"
        assert name in str(info.value)  # the error names the key ...
        assert value not in str(info.value) and value not in repr(info.value.to_dict())  # ... never the value
    # a Manifest object handed over as untrusted is checked too
    m = load_manifest(doc, trust="trusted")  # a trusted manifest may set them
    assert m.environment[name].value == value
    with pytest.raises(ManifestTrustError):
        load_manifest(m)


@pytest.mark.parametrize("name", ["LANG", "LC_ALL", "TZ", "TERM", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE",
                                  "PYTHONHASHSEED", "NODE_ENV", "HOME", "TMPDIR", "PATH", "TOKEN", "ld_preload",
                                  "LDFLAGS", "XLD_PRELOAD"])
def test_ordinary_environment_names_are_accepted(name):
    assert load_manifest({"environment": {name: "v"}}).environment[name].value == "v"


@given(st.from_regex(r"LD_[A-Za-z0-9_]{0,30}", fullmatch=True))
def test_property_every_ld_variable_is_refused(name):
    with pytest.raises(ManifestTrustError, match=name):
        load_manifest({"environment": {name: "x"}})
    check_untrusted_environment(["LANG", 3, None])  # non-strings are left to the model's own checks


# ------------------------------------------------------------- lone surrogates in text fields
_SURROGATE_DOCS = [
    pytest.param({"description": "\ud800", "entries": {}}, id="description"),
    pytest.param({"entries": {"a": {"type": "symlink", "target": "b\udc80"}}}, id="symlink-target-escape"),
    pytest.param({"entries": {"a": {"type": "symlink", "target": "\udfff"}}}, id="symlink-target-lone"),
    pytest.param({"environment": {"A": "x\ud800"}, "entries": {}}, id="env-value"),
    pytest.param({"environment": {"A": {"value": "\udc00", "secret": True}}, "entries": {}}, id="secret-env-value"),
]


@pytest.mark.parametrize("doc", _SURROGATE_DOCS)
def test_a_text_field_with_a_lone_surrogate_is_refused_at_load(doc):
    """A JSON escape makes a lone surrogate in a description, symlink target or environment value: before,
    the manifest loaded, ``run`` ran the command and then failed to save the session (its state's JSON and
    :meth:`Manifest.digest` could not encode it: an internal error, nothing persisted).  Now it is refused
    where it is parsed, from JSON text as from a mapping."""
    for data in (json.dumps({"version": 1, **doc}), {"version": 1, **doc}):
        with pytest.raises(ManifestError):
            load_manifest(data)


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet="a/.\udc80\udcff\ud800\udc00\udfff\u00e9", max_size=5),
       where=st.sampled_from(["description", "target", "env", "secret"]))
def test_property_a_loaded_manifest_always_serializes_and_digests(text, where):
    """Whatever text a field holds: either the manifest is refused at load, or its state JSON round-trips
    and its digest is computed (no error after load, where a session would already have run its command)."""
    doc: dict = {"version": 1, "entries": {}}
    if where == "description":
        doc["description"] = text
    elif where == "target":
        doc["entries"] = {"a": {"type": "symlink", "target": "t" + text.replace("/", "")}}
    else:
        doc["environment"] = {"A": {"value": text, "secret": where == "secret"}}
    try:
        m = load_manifest(json.dumps(doc))
    except ManifestError:
        assert any(0xD800 <= ord(c) <= 0xDFFF for c in json.loads(json.dumps(text)))
        return
    assert load_manifest(m.to_json(reveal_secrets=True)) == m
    assert len(m.digest()) == 64


def test_cli_run_of_a_manifest_with_a_lone_surrogate_is_one_line_and_runs_nothing(tmp_path, capsys):
    """The command line: ``invalid_manifest`` (exit 1) before any workspace is made or command run; before the
    fix the command ran, then ``internal error`` (exit 70) and nothing was persisted."""
    from sandbox_fs.cli import main

    m, wdir, out = tmp_path / "m.json", tmp_path / "w", tmp_path / "ran"
    m.write_text(json.dumps({"version": 1, "description": "\ud800", "entries": {}}))
    wdir.mkdir()
    rc = main(["run", "--manifest", str(m), "--workspaces-dir", str(wdir), "--store", str(tmp_path / "st"),
               "--", "/bin/sh", "-c", f"touch {out}"])
    err = capsys.readouterr().err
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "invalid_manifest" in err, err
    assert "Traceback" not in err and str(tmp_path) not in err
    assert not out.exists() and list(wdir.iterdir()) == []
