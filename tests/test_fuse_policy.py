"""The overlay's pure-Python policy pieces: rules, audit log, fault rules, quotas.

No FUSE mount is needed: these modules never import pyfuse3.  The quota
walk runs over a real tree in ``tmp_path`` through ``Root.handle()``; one
test mounts a tmpfs inside ``tmp_path`` (root only, unmounted in its
teardown) to show the walk never crosses into another ``st_dev``.
"""

from __future__ import annotations

import ast
import errno
import itertools
import json
import os
import posixpath
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

import sandbox_fs
from sandbox_fs.fuse import _protocol
from sandbox_fs.fuse._audit import MAX_OP_CHARS, MAX_PATH_CHARS, AuditEvent, AuditLog, from_wire, to_wire
from sandbox_fs.fuse._faults import FUSE_OPS, FaultRule, FaultRules
from sandbox_fs.fuse._quota import NAME_ENTRY_BYTES, Quota, name_cost
from sandbox_fs.fuse._rules import OverlayPolicy, check_mode, check_special, check_symlink
from sandbox_fs.root import open_root

POLICY_MODULES = ["_rules.py", "_audit.py", "_faults.py", "_quota.py"]
FUSE_DIR = Path(sandbox_fs.__file__).parent / "fuse"


def _errno_of(fn, *args):
    """The errno ``fn(*args)`` raised, or None when it returned."""
    try:
        fn(*args)
    except OSError as exc:
        assert exc.errno is not None and exc.strerror, "refusals carry an errno and a reason"
        return exc.errno
    return None


# --------------------------------------------------------------------------- layering


def test_policy_modules_import_no_pyfuse3_and_no_private_name_of_another_package():
    bad = []
    for name in POLICY_MODULES:
        tree = ast.parse((FUSE_DIR / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                bad += [f"{name}: import {a.name}" for a in node.names if a.name.split(".")[0] == "pyfuse3"]
            elif isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if mod.split(".")[0] == "pyfuse3":
                    bad.append(f"{name}: from {mod}")
                if node.level >= 2 or (node.level == 0 and mod.startswith("sandbox_fs.") and
                                       not mod.startswith("sandbox_fs.fuse")):
                    # another package of sandbox_fs: only its public names
                    if any(part.startswith("_") for part in mod.split(".")):
                        bad.append(f"{name}: from {'.' * node.level}{mod} (a private module)")
                    bad += [f"{name}: {a.name} from {mod}" for a in node.names if a.name.startswith("_")]
    assert not bad, bad


def test_importing_the_policy_modules_loads_no_pyfuse3():
    code = ("import sys; import sandbox_fs.fuse._rules, sandbox_fs.fuse._audit, sandbox_fs.fuse._faults, "
            "sandbox_fs.fuse._quota; print('pyfuse3' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------- OverlayPolicy


def test_overlay_policy_defaults():
    p = OverlayPolicy()
    assert (p.read_only, p.allow_special, p.max_bytes, p.max_inodes, p.audit_capacity) == (
        False, frozenset(), None, None, 10000)
    assert (p.entry_timeout_s, p.attr_timeout_s, p.shared_timeout_s) == (3600, 3600, 1.0)


@given(read_only=st.booleans(),
       allow=st.frozensets(st.sampled_from(["fifo", "socket", "chr", "blk"])),
       max_bytes=st.none() | st.integers(0, 1 << 62),
       max_inodes=st.none() | st.integers(0, 1 << 40),
       cap=st.integers(0, 10**6),
       timeouts=st.tuples(*[st.floats(0, 1e6, allow_nan=False)] * 3))
def test_overlay_policy_json_round_trip(read_only, allow, max_bytes, max_inodes, cap, timeouts):
    p = OverlayPolicy(read_only=read_only, allow_special=allow, max_bytes=max_bytes, max_inodes=max_inodes,
                      audit_capacity=cap, entry_timeout_s=timeouts[0], attr_timeout_s=timeouts[1],
                      shared_timeout_s=timeouts[2])
    wire = json.loads(_protocol.encode({"tag": 1, "policy": p.model_dump(mode="json")}))["policy"]
    assert OverlayPolicy.model_validate(wire) == p
    assert OverlayPolicy.model_validate_json(p.model_dump_json()) == p


@pytest.mark.parametrize("bad", [
    {"max_bytes": -1}, {"max_inodes": -1}, {"audit_capacity": -1}, {"entry_timeout_s": -0.5},
    {"attr_timeout_s": float("nan")}, {"shared_timeout_s": float("inf")}, {"allow_special": ["door"]},
    {"no_such_field": 1},
])
def test_overlay_policy_refuses_bad_settings(bad):
    with pytest.raises(ValidationError):
        OverlayPolicy(**bad)


def test_overlay_policy_is_frozen():
    with pytest.raises(ValidationError):
        OverlayPolicy().read_only = True  # type: ignore[misc]


# --------------------------------------------------------------------------- check_mode


@pytest.mark.parametrize("ftype", [0, stat.S_IFREG, stat.S_IFDIR, stat.S_IFIFO])
def test_check_mode_every_mode_bit_pattern(ftype):
    """All 4096 values of the 12 mode bits: EPERM exactly when S_ISUID or S_ISGID is among them."""
    refused = []
    for bits in range(0o10000):
        err = _errno_of(check_mode, ftype | bits)
        assert err in (None, errno.EPERM)
        if err:
            refused.append(bits)
    assert refused == [b for b in range(0o10000) if b & 0o6000]
    assert len(refused) == 3 * 1024  # suid, sgid, both; sticky and rwx alone never refused


# --------------------------------------------------------------------------- check_special

KINDS = {
    "fifo": stat.S_IFIFO, "socket": stat.S_IFSOCK, "chr": stat.S_IFCHR, "blk": stat.S_IFBLK,
}
PLAIN = [0, stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK]
ALL_ALLOW_SETS = [frozenset(c) for n in range(5) for c in itertools.combinations(KINDS, n)]


@pytest.mark.parametrize("allow", ALL_ALLOW_SETS, ids=lambda a: "+".join(sorted(a)) or "none")
def test_check_special_every_kind_with_each_allow_set(allow):
    policy = OverlayPolicy(allow_special=allow)
    valid = set(KINDS.values()) | set(PLAIN)
    for fmt in range(0, 0o200000, 0o10000):  # all 16 values of the S_IFMT bits
        for perm in (0, 0o644, 0o7777):
            got = _errno_of(check_special, fmt | perm, policy)
            if fmt in PLAIN:
                assert got is None, oct(fmt)
            elif fmt in valid:
                kind = next(k for k, v in KINDS.items() if v == fmt)
                assert got == (None if kind in allow else errno.EPERM), (kind, allow)
            else:
                assert got == errno.EINVAL, oct(fmt)
    assert len(ALL_ALLOW_SETS) == 16


# --------------------------------------------------------------------------- check_symlink


def _stays_inside_model(link_rel: str, target: str) -> int | None:
    """The expected errno of check_symlink, from a lexical model of "the target stays inside".

    Persist's rule is stricter than "normpath stays inside" in one documented
    way: ``..`` may only lead the target (``a/../b`` is refused, since ``a``
    could be a symlink).  Drive-letter targets (``C:x``) count as absolute.
    """
    if not target:
        return errno.ENOENT
    if target.startswith("/") or re.match(r"[A-Za-z]:", target):
        return errno.EPERM
    comps = [c for c in target.split("/") if c not in ("", ".")]
    ups = 0
    while ups < len(comps) and comps[ups] == "..":
        ups += 1
    if ".." in comps[ups:]:
        return errno.EPERM
    depth = len(link_rel.split("/")) - 1  # directories above the link, within the workspace
    return errno.EPERM if ups > depth else None


def _normpath_inside(link_rel: str, target: str) -> bool:
    """Independent oracle: the target, joined to the link's directory and normalized, stays beneath the root."""
    joined = posixpath.normpath(posixpath.join("ROOT", posixpath.dirname(link_rel), target))
    return joined == "ROOT" or joined.startswith("ROOT/")


_name = st.sampled_from(["a", "b", "c d", "..x", "x..", "\u00e9", "C:"])
_tcomp = st.sampled_from(["..", ".", "", "a", "b", "C:", "c:x", "x\\..", "..."])


@settings(max_examples=1500, deadline=None)
@given(link=st.lists(_name, min_size=1, max_size=5).map("/".join),
       target=st.tuples(st.sampled_from(["", "/"]), st.lists(_tcomp, max_size=8)).map(
           lambda t: t[0] + "/".join(t[1])))
def test_check_symlink_matches_the_lexical_model(link, target):
    got = _errno_of(check_symlink, link, target.encode())
    assert got == _stays_inside_model(link, target), (link, target)
    if got is None:
        assert _normpath_inside(link, target), "an accepted target must stay inside"
    elif got == errno.EPERM and not (target.startswith("/") or re.match(r"[A-Za-z]:", target)):
        comps = [c for c in target.split("/") if c not in ("", ".")]
        leading_only = ".." not in list(itertools.dropwhile(lambda c: c == "..", comps))
        if leading_only:
            assert not _normpath_inside(link, target), "refused only because it leaves"


@pytest.mark.parametrize("link,target,want", [
    ("l", b"x", None), ("l", b"./x/y/", None), ("l", b".", None), ("d/l", b"..", None),
    ("d/e/l", b"../../f", None), ("l", b"..", errno.EPERM), ("l", b"../x", errno.EPERM),
    ("d/l", b"../../x", errno.EPERM), ("l", b"/etc/passwd", errno.EPERM), ("l", b"//x", errno.EPERM),
    ("d/l", b"x/../../..", errno.EPERM), ("d/l", b"x/../y", errno.EPERM), ("l", b"C:\\x", errno.EPERM),
    ("l", b"", errno.ENOENT), ("l", b"a" * 5000, errno.ENAMETOOLONG),
    ("l", b"\xff\xfe", None), ("\udcff/l", b"..", None),
])
def test_check_symlink_examples(link, target, want):
    assert _errno_of(check_symlink, link, target) == want


@pytest.mark.parametrize("link", ["", "/l", "a//l", "./l", "a/../l", "l/"])
def test_check_symlink_refuses_a_malformed_link_path(link):
    with pytest.raises(ValueError):
        check_symlink(link, b"x")


def test_check_symlink_agrees_with_root_symlink(tmp_path):
    """Root.symlink (the host side's creation rule) accepts and refuses the same targets, lexically."""
    (tmp_path / "d" / "e").mkdir(parents=True)
    cases = [b"x", b"..", b"../..", b"../../..", b"a/../b", b"/abs", b"../x/y", b"./../.."]
    with open_root(tmp_path) as root:
        for i, target in enumerate(cases):
            link = f"d/e/l{i}"
            ours = _errno_of(check_symlink, link, target)
            try:
                root.symlink(target, link)
                theirs = None
            except sandbox_fs.errors.PathEscapeError:
                theirs = errno.EPERM
            assert ours == theirs, target


SAME_RULE_TARGETS = [b"x", b"./x", b".", b"..", b"../..", b"../../..", b"../x", b"../../x", b"a/../b", b"x/..",
                     b"/abs", b"//x", b"C:x", b"x/./y/", b"...", b"../.../x"]


def test_check_symlink_is_the_rule_snapshot_persist_applies(tmp_path):
    """Links planted host-side, persisted with on_unrestorable="skip": persist skips exactly those refused here.

    (Target names never exist in the tree, so persist's extra disk checks -- a
    target passing through another symlink -- play no part.)
    """
    from sandbox_fs.snapshot import LocalSnapshotStore, persist

    ws = tmp_path / "ws"
    (ws / "d" / "e").mkdir(parents=True)
    expect = {}
    for i, target in enumerate(SAME_RULE_TARGETS):
        for parent in ("", "d", "d/e"):
            link = f"{parent}/l{i}".lstrip("/")
            os.symlink(target, ws / link)
            expect[link] = _errno_of(check_symlink, link, target) is None
    with open_root(ws) as root:
        report = persist(root, LocalSnapshotStore(tmp_path / "store"), "s", on_unrestorable="skip")
    skipped = {path for path, _reason in report.skipped}
    assert {link for link, ok in expect.items() if not ok} == skipped
    assert any(expect.values()) and not all(expect.values())


# --------------------------------------------------------------------------- audit


def test_audit_event_result():
    assert AuditEvent(1.0, "open", "a", 0).result == "ok"
    assert AuditEvent(1.0, "open", "a", errno.EACCES).result == "EACCES"
    assert AuditEvent(1.0, "write", "a", errno.EDQUOT).result == "EDQUOT"
    assert AuditEvent(1.0, "write", "a", 4000).result == "E4000"


def test_audit_log_keeps_order_and_times():
    log = AuditLog(10)
    for i in range(5):
        log.record("write", f"f{i}", i)
    events, dropped = log.drain()
    assert [(e.op, e.path, e.errno) for e in events] == [("write", f"f{i}", i) for i in range(5)]
    assert dropped == 0 and len(log) == 0
    assert all(a.time_s <= b.time_s for a, b in itertools.pairwise(events))


@given(capacity=st.integers(0, 50), n=st.integers(0, 200))
def test_audit_log_is_bounded_and_counts_drops(capacity, n):
    log = AuditLog(capacity)
    for i in range(n):
        log.record("lookup", str(i), 0)
        assert len(log) <= capacity
    kept = min(n, capacity)
    assert log.dropped == n - kept
    events, dropped = log.drain(max_events=10**6)
    assert [e.path for e in events] == [str(i) for i in range(kept)], "the earliest events are kept"
    assert dropped == n - kept
    assert log.drain() == ([], 0), "drops are reported once"
    log.record("open", "after", 0)
    events, dropped = log.drain()
    assert ([e.path for e in events], dropped) == ((["after"], 0) if capacity else ([], 1))


def test_audit_log_drops_after_a_partial_drain_counted_once():
    log = AuditLog(3)
    for i in range(5):
        log.record("read", str(i))
    ev, dropped = log.drain(max_events=2)
    assert [e.path for e in ev] == ["0", "1"] and dropped == 2
    log.record("read", "5")
    log.record("read", "6")
    log.record("read", "7")  # buffer: 2, 5, 6 -> full; 7 dropped
    ev, dropped = log.drain()
    assert [e.path for e in ev] == ["2", "5", "6"] and dropped == 1


def test_audit_log_refuses_negative_capacity():
    with pytest.raises(ValueError):
        AuditLog(-1)


def test_audit_log_cuts_overlong_op_and_path():
    log = AuditLog(2)
    log.record("x" * 500, "p/" * 5000, 5)
    (ev,), _ = log.drain()
    assert len(ev.op) == MAX_OP_CHARS and len(ev.path) == MAX_PATH_CHARS
    assert ev.path.endswith("\u2026") and ev.path.startswith("p/p/")


def test_audit_drain_batches_fit_one_datagram():
    log = AuditLog(10000)
    for i in range(3000):
        log.record("write", f"{i:05d}/" + "\u00e9" * 2000, errno.EIO)  # ~12 KB each as ASCII JSON
    seen = []
    first = True
    while len(log):
        events, dropped = log.drain()
        assert events, "a drain with events buffered returns at least one"
        assert dropped == 0 or first
        first = False
        data = _protocol.encode(to_wire(events, dropped))  # raises ProtocolError if too large
        assert len(data) <= _protocol.MAX_MESSAGE_BYTES
        seen += [e.path[:5] for e in from_wire(_protocol.decode(data))[0]]
    assert seen == [f"{i:05d}" for i in range(3000)]


def test_audit_drain_respects_max_events():
    log = AuditLog(100)
    for i in range(10):
        log.record("getattr", str(i))
    assert len(log.drain(max_events=3)[0]) == 3
    assert len(log) == 7


_text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]) | st.sampled_from(["\udc80", "\udcff"]),
                max_size=40)


@given(st.lists(st.tuples(st.floats(0, 4e9, allow_nan=False), st.sampled_from(sorted(FUSE_OPS)), _text,
                          st.integers(0, 200)), max_size=30),
       st.integers(0, 1 << 40))
def test_audit_wire_round_trip(raw, dropped):
    events = [AuditEvent(*r) for r in raw]
    msg = _protocol.decode(_protocol.encode(to_wire(events, dropped)))
    assert from_wire(msg) == (events, dropped)
    assert AuditLog.from_wire(AuditLog.to_wire(events, dropped)) == (events, dropped)


@given(st.floats(0, 1e17, allow_nan=False), st.sampled_from(["open", "x\"y", "\u00e9"]),
       _text | st.text(st.characters(max_codepoint=127)), st.integers(0, 10**6))
def test_audit_size_estimate_is_exact(t, op, path, err):
    from sandbox_fs.fuse._audit import _wire_bytes

    ev = AuditEvent(t, op, path, err)
    assert _wire_bytes(ev) == len(json.dumps([ev], separators=(",", ":"), ensure_ascii=True)) - 1


@pytest.mark.parametrize("msg", [
    {"tag": 1, "event": "audit", "events": [], "dropped": 0},
    {"tag": 0, "event": "ready", "events": [], "dropped": 0},
    {"tag": 0, "event": "audit", "events": {}, "dropped": 0},
    {"tag": 0, "event": "audit", "events": [], "dropped": -1},
    {"tag": 0, "event": "audit", "events": [], "dropped": True},
    {"tag": 0, "event": "audit", "events": []},
    {"tag": 0, "event": "audit", "events": [[1.0, "open", "a"]], "dropped": 0},
    {"tag": 0, "event": "audit", "events": [["1", "open", "a", 0]], "dropped": 0},
    {"tag": 0, "event": "audit", "events": [[1.0, 3, "a", 0]], "dropped": 0},
    {"tag": 0, "event": "audit", "events": [[1.0, "open", None, 0]], "dropped": 0},
    {"tag": 0, "event": "audit", "events": [[1.0, "open", "a", -2]], "dropped": 0},
    {"tag": 0, "event": "audit", "events": [[1.0, "open", "a", 1.5]], "dropped": 0},
    {"tag": 0, "event": "audit", "events": [[1.0, "open", "a" * (MAX_PATH_CHARS + 1), 0]], "dropped": 0},
])
def test_audit_from_wire_refuses_bad_shapes(msg):
    with pytest.raises(_protocol.ProtocolError):
        from_wire(msg)


def test_audit_from_wire_refuses_non_finite_time():
    msg = json.loads('{"tag":0,"event":"audit","events":[[NaN,"open","a",0]],"dropped":0}')
    with pytest.raises(_protocol.ProtocolError):
        from_wire(msg)


# --------------------------------------------------------------------------- faults

OPS = ["open", "write", "read", "unlink", "mkdir"]
PATHS = ["", "a", "a/b", "a/b/c", "ab", "b", "b/a"]


def _model_matches(rule_ops, rule_path, op, path):
    if "*" not in rule_ops and op not in rule_ops:
        return False
    if not rule_path:
        return True
    rp, pp = rule_path.split("/"), path.split("/") if path else []
    return pp[:len(rp)] == rp


_rule = st.builds(
    lambda ops, path, err, times: FaultRule(ops=ops, path=path, errno=err, times=times),
    st.frozensets(st.sampled_from(OPS + ["*"]), min_size=1, max_size=3),
    st.sampled_from(PATHS),
    st.sampled_from([errno.EIO, errno.ENOSPC, errno.EACCES]),
    st.none() | st.integers(1, 3),
)


@settings(max_examples=300, deadline=None)
@given(rules=st.lists(_rule, max_size=4),
       requests=st.lists(st.tuples(st.sampled_from(OPS + ["lookup"]), st.sampled_from(PATHS)), max_size=40))
def test_fault_rules_fire_exactly_where_and_as_often_as_stated(rules, requests):
    fr = FaultRules()
    fr.set(rules)
    left = [r.times for r in rules]
    for op, path in requests:
        want = None
        for i, r in enumerate(rules):
            if left[i] != 0 and _model_matches(r.ops, r.path, op, path):
                if left[i] is not None:
                    left[i] -= 1
                want = r.errno
                break
        assert _errno_of(fr.check, op, path) == want, (op, path)


def test_fault_rule_times_then_silent_and_set_resets():
    rule = FaultRule(ops={"write"}, path="a", errno=errno.ENOSPC, times=2)
    fr = FaultRules()
    fr.set([rule])
    assert [_errno_of(fr.check, "write", "a/x") for _ in range(4)] == [errno.ENOSPC] * 2 + [None] * 2
    fr.set([rule])  # the same rule again: its count starts afresh
    assert _errno_of(fr.check, "write", "a") == errno.ENOSPC
    fr.clear()
    assert len(fr) == 0 and _errno_of(fr.check, "write", "a") is None


def test_fault_rule_prefix_is_by_component_and_empty_path_is_everything():
    fr = FaultRules()
    fr.set([FaultRule(ops={"open"}, path="dir/sub", errno=errno.EACCES)])
    assert _errno_of(fr.check, "open", "dir/sub") == errno.EACCES
    assert _errno_of(fr.check, "open", "dir/sub/deep/x") == errno.EACCES
    for path in ("dir/subx", "dir", "", "sub", "dir/su", "x/dir/sub"):
        assert _errno_of(fr.check, "open", path) is None, path
    assert _errno_of(fr.check, "write", "dir/sub") is None
    fr.set([FaultRule(ops={"*"}, path="", errno=errno.EIO)])
    assert all(_errno_of(fr.check, op, p) == errno.EIO for op in FUSE_OPS for p in PATHS)


def test_a_later_rule_fires_once_an_earlier_one_is_spent():
    fr = FaultRules()
    fr.set([FaultRule(ops={"read"}, errno=errno.EIO, times=1), FaultRule(ops={"read"}, errno=errno.EACCES)])
    assert [_errno_of(fr.check, "read", "f") for _ in range(3)] == [errno.EIO, errno.EACCES, errno.EACCES]


def test_fault_rule_normalizes_its_path_and_round_trips():
    r = FaultRule(ops={"write", "open"}, path="./a//b/", errno=errno.EIO, times=3)
    assert r.path == "a/b"
    assert FaultRule.model_validate(json.loads(json.dumps(r.model_dump(mode="json")))) == r


@pytest.mark.parametrize("bad", [
    {"ops": set()}, {"ops": {"wrte"}}, {"path": "/abs"}, {"path": "a/../b"}, {"path": "a\0b"},
    {"errno": errno.EPERM}, {"times": 0}, {"times": -1}, {"extra": 1},
])
def test_fault_rule_refuses_bad_fields(bad):
    fields = {"ops": {"write"}, "path": "", "errno": errno.EIO} | bad
    with pytest.raises(ValidationError):
        FaultRule(**fields)


# --------------------------------------------------------------------------- quota: accounting


def test_quota_exactly_at_the_limit_is_allowed_one_byte_over_is_refused():
    q = Quota(max_bytes=100, max_inodes=2)
    q.check_grow(100)
    assert _errno_of(q.check_grow, 101) == errno.EDQUOT
    q.add_bytes(60)
    q.check_grow(40)
    assert _errno_of(q.check_grow, 41) == errno.EDQUOT
    q.add_bytes(40)
    assert q.bytes == 100
    assert _errno_of(q.check_grow, 1) == errno.EDQUOT
    q.check_grow(0)
    q.check_grow(-10)  # shrinking is always allowed
    q.check_new_inode()
    q.add_inodes(1)
    q.check_new_inode()
    q.add_inodes(1)
    assert _errno_of(q.check_new_inode) == errno.EDQUOT
    assert _errno_of(q.check_new_inode, 0) is None
    assert q.usage() == {"bytes": 100, "inodes": 2}


def test_quota_refusal_changes_nothing_and_lowering_deletes_nothing():
    q = Quota()
    q.add_bytes(1000)
    q.add_inodes(10)
    q.check_grow(1 << 60)  # unlimited
    q.set_limits(500, 5)  # below current usage
    assert (q.bytes, q.inodes) == (1000, 10)
    assert _errno_of(q.check_grow, 1) == errno.EDQUOT
    assert _errno_of(q.check_new_inode) == errno.EDQUOT
    assert (q.bytes, q.inodes) == (1000, 10)
    q.add_bytes(-600)
    q.add_inodes(-6)
    q.check_grow(100)
    assert _errno_of(q.check_grow, 101) == errno.EDQUOT
    q.check_new_inode()
    q.set_limits(None, None)
    q.check_grow(1 << 60)


def test_quota_usage_never_goes_negative():
    q = Quota()
    q.add_bytes(5)
    q.add_bytes(-50)
    q.add_inodes(-1)
    assert (q.bytes, q.inodes) == (0, 0)


@pytest.mark.parametrize("limits", [(-1, None), (None, -1), (1.5, None), (True, None), (None, "3")])
def test_quota_refuses_bad_limits(limits):
    q = Quota(10, 10)
    with pytest.raises(ValueError):
        q.set_limits(*limits)
    assert (q.max_bytes, q.max_inodes) == (10, 10)


# --------------------------------------------------------------------------- quota: measure


def _measure(path: Path) -> tuple[int, int]:
    with open_root(path) as root, root.handle() as h:
        return Quota().measure(h)


def _model_usage(top: Path) -> tuple[int, int]:
    """The oracle: lstat of every path beneath ``top`` on its device, hard links once; every
    name on the device costs ``name_cost`` bytes (each name of a hard-linked inode)."""
    dev = top.lstat().st_dev
    seen, nbytes, ninodes = set(), 0, 0
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            s = os.lstat(os.path.join(dirpath, name))
            if s.st_dev != dev:
                continue
            nbytes += name_cost(os.fsencode(name))
            if (s.st_dev, s.st_ino) in seen:
                continue
            seen.add((s.st_dev, s.st_ino))
            ninodes += 1
            nbytes += s.st_size if stat.S_ISREG(s.st_mode) or stat.S_ISLNK(s.st_mode) else 0
        dirnames[:] = [d for d in dirnames if os.lstat(os.path.join(dirpath, d)).st_dev == dev]
    return nbytes, ninodes


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_measure_counts_sizes_links_once_and_follows_no_symlink(tmp_path):
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    (ws / "d" / "e").mkdir(parents=True)
    outside.mkdir()
    (outside / "big").write_bytes(b"x" * 100_000)
    (outside / "dir").mkdir()
    (outside / "dir" / "f").write_bytes(b"y" * 50_000)
    (ws / "a").write_bytes(b"1" * 10)
    (ws / "d" / "b").write_bytes(b"2" * 200)
    (ws / "d" / "e" / "c").write_bytes(b"")
    (ws / "sparse").touch()
    os.truncate(ws / "sparse", 1 << 30)  # apparent size counts, not blocks
    os.link(ws / "a", ws / "d" / "a2")
    os.link(ws / "a", ws / "d" / "e" / "a3")
    os.symlink(outside / "big", ws / "to_big")
    os.symlink(outside / "dir", ws / "d" / "to_dir")
    os.symlink("a", ws / "rel")
    os.mkfifo(ws / "fifo")
    before = _fd_count()
    got = _measure(ws)
    assert _fd_count() == before, "every handle the walk opened is closed"
    # bytes: a (once) + b + sparse + the 3 symlink targets + 12 names (34 bytes of names, each
    # plus NAME_ENTRY_BYTES); inodes: d, e, a, b, c, sparse, 3 symlinks, fifo (a2, a3 are a)
    targets = len(str(outside / "big")) + len(str(outside / "dir")) + len("a")
    assert got == (10 + 200 + (1 << 30) + targets + 34 + 12 * NAME_ENTRY_BYTES, 10)
    assert got == _model_usage(ws)


def test_measure_hard_link_to_a_file_outside_counts_once_inside(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (tmp_path / "out").write_bytes(b"z" * 77)
    os.link(tmp_path / "out", ws / "in1")
    os.link(tmp_path / "out", ws / "in2")
    assert _measure(ws) == (77 + 2 * (3 + NAME_ENTRY_BYTES), 1)  # the data once, both names


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["file", "dir", "link", "hard", "sym"]),
                          st.integers(0, 3), st.integers(0, 5000)), max_size=25))
def test_measure_matches_the_lstat_model(tmp_path_factory, plan):
    ws = tmp_path_factory.mktemp("ws")
    dirs, files = [ws], []
    for i, (kind, where, size) in enumerate(plan):
        parent = dirs[where % len(dirs)]
        p = parent / f"n{i}"
        if kind == "dir":
            p.mkdir()
            dirs.append(p)
        elif kind == "file" or (kind == "hard" and not files):
            p.write_bytes(b"q" * size)
            files.append(p)
        elif kind == "hard":
            os.link(files[size % len(files)], p)
        else:
            os.symlink(str(files[0]) if files and kind == "sym" else "..", p)
    assert _measure(ws) == _model_usage(ws)


def test_measure_does_not_cross_into_another_st_dev(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs inside tmp_path needs root")
    ws = tmp_path / "ws"
    (ws / "mnt").mkdir(parents=True)
    (ws / "f").write_bytes(b"a" * 5)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "sfs-test", str(ws / "mnt")],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        (ws / "mnt" / "g").write_bytes(b"b" * 1000)
        (ws / "mnt" / "sub").mkdir()
        assert (ws / "mnt").stat().st_dev != ws.stat().st_dev
        # f's 5 bytes and its name; the mount point's name is left out with what is on it
        assert _measure(ws) == (5 + 1 + NAME_ENTRY_BYTES, 1), "the mount point and everything on it are left out"
        assert _measure(ws / "mnt") == (1000 + 1 + 3 + 2 * NAME_ENTRY_BYTES, 2), "measured from its own root, the tmpfs counts"
    finally:
        subprocess.run(["umount", "-l", str(ws / "mnt")], check=True)


class _FakeHandle:
    """A directory tree of fake handles for error paths; counts opens and closes."""

    live: set = set()

    def __init__(self, tree, dev=1, ino=1):
        self.tree, self.dev, self.ino = tree, dev, ino
        _FakeHandle.live.add(id(self))

    def stat(self):
        mode = stat.S_IFDIR | 0o755 if isinstance(self.tree, dict) else stat.S_IFREG | 0o644
        size = 0 if isinstance(self.tree, dict) else self.tree
        return os.stat_result((mode, self.ino, self.dev, 1, 0, 0, size, 0, 0, 0))

    def listdir(self):
        if self.tree == {"boom": None}:
            raise PermissionError(errno.EACCES, "no listing")
        return [(n.encode(), 0, 0) for n in self.tree]

    def lookup(self, name):
        child = self.tree[name.decode()]
        if child == "gone":
            raise FileNotFoundError(errno.ENOENT, "gone")
        return _FakeHandle(child, self.dev, hash(name) & 0xFFFF)

    def close(self):
        _FakeHandle.live.discard(id(self))


def test_measure_error_leaves_usage_unchanged_and_closes_every_handle():
    _FakeHandle.live = set()
    q = Quota()
    q.add_bytes(42)
    q.add_inodes(7)
    top = _FakeHandle({"a": {"b": {"c": 5, "bad": {"boom": None}}}, "z": 3})
    with pytest.raises(PermissionError):
        q.measure(top)
    assert (q.bytes, q.inodes) == (42, 7)
    assert _FakeHandle.live == {id(top)}, "only the caller's handle stays open"


def test_measure_skips_an_entry_gone_since_the_listing():
    _FakeHandle.live = set()
    top = _FakeHandle({"a": 5, "g": "gone", "d": {"x": 2}})
    assert Quota().measure(top) == (7 + 3 * (1 + NAME_ENTRY_BYTES), 3)  # a, d, x: data and names
    assert _FakeHandle.live == {id(top)}
