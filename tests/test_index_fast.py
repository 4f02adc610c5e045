"""The index decoder's fast checks agree with the rules they stand for.

``decode_index`` checks a whole index at C speed (``_names_ok``: every name
accepted by the extractor's rule and already normalized; ``_entries_ok``:
every entry's fields) and falls back to the per-name / per-entry checks only
when the fast one says no.  A fast check that says yes where the rule says
no would let an untrusted index through, so each is compared here with the
rule itself over hostile generated input: names of any bytes, ``..``, ``.``,
``//``, absolute, drive letters, NUL, non-UTF-8, components and paths at and
over the limits; entries with every wrong type and out-of-range value.
"""

from __future__ import annotations

import json
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox_fs.archive import ArchiveLimitError, ArchiveLimits, UnsafeArchiveMemberError, normalize_member_name
from sandbox_fs.snapshot import SnapshotCorruptError, SnapshotPolicy
from sandbox_fs.snapshot._index import IndexEntry, _entries, _entry, _names_ok, decode_index

SHA = "0123456789abcdef" * 4


def _rule(name: str, limits: ArchiveLimits) -> bool:
    """What decode_index requires of a name: the extractor accepts it, unchanged, and it is not the workspace."""
    try:
        raw = name.encode("utf-8", "surrogateescape")  # (a lone surrogate a JSON escape can make: no name)
        return normalize_member_name(name=raw, limits=limits) == raw and raw != b""
    except (UnsafeArchiveMemberError, ArchiveLimitError, UnicodeEncodeError):
        return False


_PART = st.sampled_from(["a", "b.c", ".", "..", "", "...", "a..", "..a", "\\", "a\\..", "..\\a", "a\\.\\b", "C:",
                         "z:x", "a:b", ":", "\0", "x" * 255, "y" * 256, "\udcff", "\u00e9", " ", "\n", "./", "/."])
_NAMES = st.one_of(
    st.binary(max_size=24).map(lambda b: b.decode("utf-8", "surrogateescape")),
    st.text(alphabet="./a\\:\0C\u00e9\udc80\ud800\udc7f", max_size=16),
    st.tuples(st.sampled_from(["", "/", "\\", "./", "C:"]), st.lists(_PART, max_size=8),
              st.sampled_from(["", "/", "/.", "\\"])).map(lambda t: t[0] + "/".join(t[1]) + t[2]),
    st.tuples(st.integers(1, 70), st.sampled_from(["a/", "ab/", "./", "a//"])).map(lambda t: (t[1] * t[0])[:-1]),
    st.tuples(st.integers(240, 300), st.integers(0, 3)).map(lambda t: "/".join(["q" * t[0]] * (t[1] + 1))),
)
_LIMITS = st.builds(ArchiveLimits, max_path_bytes=st.sampled_from([1, 4, 16, 255, 300, 600, 4096]),
                    max_depth=st.sampled_from([1, 2, 3, 8, 64, 2048]))


@settings(max_examples=600, deadline=None)
@given(name=_NAMES, limits=_LIMITS)
def test_one_name_fast_check_is_the_rule(name, limits):
    assert _names_ok([name], limits) == _rule(name, limits), ascii(name)


@settings(max_examples=400, deadline=None)
@given(names=st.lists(_NAMES, max_size=6), good=st.lists(st.sampled_from(["a", "a/b", "lib/x.py", "d/e/f"]),
                                                         max_size=4), limits=_LIMITS)
def test_name_list_fast_check_is_the_rule(names, good, limits):
    """Names joined for one scan never hide a bad one or make one up (at list edges and between names)."""
    for names_ in (names + good, good + names, names):
        assert _names_ok(names_, limits) == all(_rule(n, limits) for n in names_), ascii(names_)


_VALUES = st.one_of(
    st.integers(-3, 3), st.sampled_from([0o777, 0o1000, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, 1 << 64, -(1 << 63)]),
    st.booleans(), st.none(), st.floats(allow_nan=False, width=16),
    st.sampled_from(["", "file", "dir", "symlink", "File", "fifo", SHA, SHA.upper(), SHA[:-1], SHA + "0",
                     SHA[:-1] + "g", SHA[:-1] + "\u0660", "a", "a/b", "\udcff", "\ud800", "a\udc00"]),
    st.lists(st.integers(), max_size=2),
)


def _good_entry(kind: str) -> list[object]:
    return ["p", kind, 1, 2, 3, 4, 0o644, SHA if kind == "file" else ("" if kind == "dir" else "t"), 1, 1]


_ENTRY = st.one_of(
    st.tuples(st.sampled_from(["file", "dir", "symlink"]), st.integers(0, 9), _VALUES).map(
        lambda t: _good_entry(t[0])[:t[1]] + [t[2]] + _good_entry(t[0])[t[1] + 1:]),
    st.sampled_from(["file", "dir", "symlink"]).map(_good_entry),
    st.tuples(st.sampled_from(["file", "dir", "symlink"]),
              st.sampled_from([SHA, "", "t", SHA.upper(), SHA[:-1], SHA + "0", "\ud800", "t\udfff", "\udc80"])).map(
        lambda t: _good_entry(t[0])[:7] + [t[1]] + _good_entry(t[0])[8:]),  # content of another kind
    st.lists(_VALUES, min_size=9, max_size=11),
    _VALUES,
)


def _slow(raw: list[object], layers: frozenset[int]) -> list[IndexEntry] | None:
    try:
        return [_entry(e, layers) for e in raw]
    except ValueError:
        return None


@settings(max_examples=600, deadline=None)
@given(raw=st.lists(_ENTRY, max_size=5), layers=st.sampled_from([frozenset({1}), frozenset({1, 2}), frozenset()]))
def test_entry_fast_check_is_the_rule(raw, layers):
    want = _slow(raw, layers)
    try:
        got = _entries(raw, layers)
    except ValueError:
        assert want is None, raw
        return
    assert want is not None and got == want and all(type(e) is IndexEntry for e in got), raw


def _doc(entries: list[list[object]], deleted: list[str]) -> bytes:
    return zlib.compress(json.dumps({"format": "sandbox-fs-index", "version": 1, "time_ns": 1, "dev": 1,
                                     "entries": entries, "deleted": deleted}).encode())


def _tree_rule(entries: list[tuple[str, str]], deleted: list[str]) -> bool:
    """The tree rules restated: unique names, every ancestor that is an entry a directory, no kept deletion."""
    kinds = dict(entries)
    if len(kinds) != len(entries) or any(p in kinds for p in deleted):
        return False
    for path, _ in entries:
        parts = path.split("/")
        if any(kinds.get("/".join(parts[:i]), "dir") != "dir" for i in range(1, len(parts))):
            return False
    return True


@settings(max_examples=400, deadline=None)
@given(entries=st.lists(st.tuples(st.sampled_from(["a", "b", "a/b", "a/c", "a/b/c", "a/b/c/d", "b/x/y", "a/x/y/z"]),
                                  st.sampled_from(["file", "dir", "symlink"])), max_size=7),
       deleted=st.lists(st.sampled_from(["a", "a/b", "z", "a/b/c"]), max_size=2))
def test_tree_rules(entries, deleted):
    raw = _doc([_good_entry(k)[:0] + [p] + _good_entry(k)[1:] for p, k in entries], deleted)
    try:
        decode_index(raw, SnapshotPolicy(), frozenset({1}), "n")
    except SnapshotCorruptError:
        assert not _tree_rule(entries, deleted)
        return
    assert _tree_rule(entries, deleted)


@pytest.mark.parametrize("path", ["a/../b", "/a", "a//b", "a/./b", "./a", "a/", "C:x", "a\\..\\b", "", "a\0b",
                                  "x" * 256, "ab/" * 1400 + "a", "a\ud800", "d/\udc00", "\udfff"])
def test_refused_names_in_a_large_index(path):
    """A bad name among many good ones (the fast check's whole-list scan) is refused, as an entry or a deletion."""
    good = [_good_entry("dir")[:0] + [f"d{i}"] + _good_entry("dir")[1:] for i in range(300)]
    bad = [path] + _good_entry("file")[1:]
    for doc in (_doc(good[:150] + [bad] + good[150:], []), _doc(good, [path])):
        with pytest.raises(SnapshotCorruptError):
            decode_index(doc, SnapshotPolicy(), frozenset({1}), "n")


@pytest.mark.parametrize("target", ["\ud800", "d/\udc00", "\udfff", "a\udbff"])
def test_symlink_targets_that_are_no_file_names_in_a_large_index(target):
    """A symlink entry whose target is a lone surrogate (a JSON escape outside surrogateescape's range), among many
    good entries (the fast check) and alone (the per-entry check): the index is not valid.  Before, it was
    accepted and index_digest's encoding raised a bare UnicodeEncodeError in a layered chain's restore."""
    good = [[f"d{i}"] + _good_entry("symlink")[1:] for i in range(300)]
    bad = ["bad"] + _good_entry("symlink")[1:7] + [target] + _good_entry("symlink")[8:]
    for doc in (_doc(good[:150] + [bad] + good[150:], []), _doc([bad], [])):
        with pytest.raises(SnapshotCorruptError, match="not valid"):
            decode_index(doc, SnapshotPolicy(), frozenset({1}), "n")


def test_a_local_baseline_body_is_stored_undeflated_and_reads_back_as_the_listings_written(tmp_path):
    """A directory store's baseline keeps its listings in stored zlib blocks (no deflate in hydrate); they read
    back, through the MAC and the body's SHA-256, as written (each directory's records byte for byte)."""
    from sandbox_fs.snapshot import DirectorySnapshotStore
    from sandbox_fs.snapshot._baseline import Baseline, Listings, baseline_listings, read_baseline, write_baseline

    dirs = {"": b"\x01" * 64, "d\udcff/e": b"\x02" * 72, "d": b""}
    with DirectorySnapshotStore(tmp_path / "st") as st:
        key = st.baseline_mac_key(create=True)
        write_baseline(st.objects, "n", Baseline(1, "a" * 64, "", listings=Listings(7, 8, dirs)), key)
        stored = (st.objects.get_bytes("n/baseline", 1 << 20)).split(b"\n", 1)[1]
        assert zlib.decompressobj().decompress(stored)  # a zlib stream, and the records themselves:
        assert b"\x02" * 72 in stored
        base = read_baseline(st.objects, "n", key)
        got = baseline_listings(st.objects, "n", base, SnapshotPolicy())
        assert read_baseline(st.objects, "n", b"k" * 32) is None  # another key: no listings, no header
    assert got == Listings(7, 8, dirs)


def test_baseline_body_parsing_refuses_truncation_and_repeats_and_stops_at_a_bad_record():
    """The body's directory framing: a cut or a repeated path refuses the whole body; within one directory a
    record whose name runs past the end ends the listing (nothing after it is used)."""
    import struct

    from sandbox_fs.snapshot import _baseline
    from sandbox_fs.snapshot._walk import SCAN_HEADER

    def framed(path: bytes, raw: bytes) -> bytes:
        return struct.pack("<II", len(path), len(raw)) + path + raw

    good = framed(b"d", b"") + framed(b"", b"x" * 8)
    assert _baseline._decode(good) == {"d": b"", "": b"x" * 8}
    for bad in (good[:-1], good[:3], good + framed(b"d", b"")):
        with pytest.raises(ValueError):
            _baseline._decode(bad)
    rec = SCAN_HEADER.pack(5, 1, 3, 4, 5, 1, 0o100644, 1) + b"a" + b"\0" * 7
    long = SCAN_HEADER.pack(6, 1, 3, 4, 5, 1, 0o100644, 200) + b"b" * 8
    assert list(_baseline._records(rec + long + rec)) == [b"a"]
    assert _baseline._records(rec[:-9]) == {} and _baseline._records(None) == {}


@pytest.mark.parametrize("enabled", [True, False])
def test_decode_leaves_the_collector_as_it_found_it(enabled):
    """decode_index pauses the cyclic GC while it works; after it (accepted or refused) the GC is as it was."""
    import gc

    ok = _doc([_good_entry("file")], [])
    bad = _doc([["/abs"] + _good_entry("file")[1:]], [])
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        decode_index(ok, SnapshotPolicy(), frozenset({1}), "n")
        assert gc.isenabled() is enabled
        with pytest.raises(SnapshotCorruptError):
            decode_index(bad, SnapshotPolicy(), frozenset({1}), "n")
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


@pytest.mark.parametrize("order", ["first_ends_first", "last_ends_first"])
def test_overlapping_gc_pauses_restore_the_collector(order):
    """Two hydrates in two threads pause the collector at once: once both end it is enabled again.

    With a per-pause "was it enabled?" the second pause saw the first's
    disable, and when the first ended before it the collector stayed off for
    the rest of the process.  Interleaved by hand (the pauses are context
    managers), in both end orders, and across threads.
    """
    import gc
    import threading

    from sandbox_fs.snapshot._index import gc_paused

    was = gc.isenabled()
    try:
        gc.enable()
        a, b = gc_paused(), gc_paused()
        a.__enter__()
        done = threading.Event()

        def other() -> None:
            b.__enter__()
            done.set()

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert done.is_set() and not gc.isenabled()
        first, second = (a, b) if order == "first_ends_first" else (b, a)
        first.__exit__(None, None, None)
        assert not gc.isenabled()  # the other pause is still in progress
        second.__exit__(None, None, None)
        assert gc.isenabled()
        gc.disable()  # a host that keeps it off: left off
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


def _pause_with_handler_at(step: int, outer: int, enabled: bool) -> tuple[bool, bool, bool, int]:
    """``outer`` nested gc_paused() with a simulated signal handler that pauses too, run at the ``step``-th
    bytecode boundary of any gc_paused frame (as a Python signal handler runs).  Returns (fired, blocked:
    the handler would have waited on the pause lock its own thread holds, collector enabled after, depth)."""
    import gc
    import sys

    from sandbox_fs.snapshot import _index

    code = _index.gc_paused.__wrapped__.__code__  # type: ignore[attr-defined]
    seen = {"n": 0, "fired": False, "blocked": False}

    def handler() -> None:
        seen["fired"] = True
        if not _index._GC_PAUSE_LOCK.acquire(blocking=False):  # a plain lock held by this thread: deadlock
            seen["blocked"] = True
            return
        _index._GC_PAUSE_LOCK.release()
        with _index.gc_paused():
            pass

    def local(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "opcode":
            seen["n"] += 1
            if seen["n"] == step:
                handler()  # tracing is off inside a trace function: its pauses run untraced
        return local

    def tracer(frame, event, arg):  # type: ignore[no-untyped-def]
        if frame.f_code is code:
            frame.f_trace_opcodes = True
            return local
        return None

    def nest(k: int) -> None:
        if k:
            with _index.gc_paused():
                nest(k - 1)

    (gc.enable if enabled else gc.disable)()
    sys.settrace(tracer)
    try:
        nest(outer)
    finally:
        sys.settrace(None)
    return seen["fired"], seen["blocked"], gc.isenabled(), _index._GC_PAUSE["depth"]


@pytest.mark.parametrize("outer", [1, 2])
@pytest.mark.parametrize("enabled", [True, False])
def test_a_pause_in_a_signal_handler_at_any_bytecode_of_gc_paused_neither_deadlocks_nor_leaves_gc_off(outer, enabled):
    """A Python signal handler runs between any two bytecodes of the thread it interrupts; a host's handler that
    persists or hydrates pauses too.  With a plain lock, one run inside the lock's section waited for its own
    thread for good; and a nested pause between the count's update and the collector's left it off for good
    when it recorded the collector as disabled.  Every bytecode boundary of every gc_paused frame is tried."""
    import gc

    was = gc.isenabled()
    try:
        step = 1
        while True:
            fired, blocked, after, depth = _pause_with_handler_at(step, outer, enabled)
            if not fired:
                break
            assert not blocked, f"the handler at step {step} would deadlock"
            assert (after, depth) == (enabled, 0), f"handler at step {step}"
            step += 1
        assert step > 10  # the sweep reached the sections it is about
    finally:
        (gc.enable if was else gc.disable)()


@settings(max_examples=40, deadline=None)
@given(step=st.integers(1, 200), outer=st.integers(1, 4), enabled=st.booleans())
def test_property_a_pausing_handler_anywhere_leaves_the_collector_as_the_host_set_it(step, outer, enabled):
    import gc

    was = gc.isenabled()
    try:
        _fired, blocked, after, depth = _pause_with_handler_at(step, outer, enabled)
        assert not blocked and (after, depth) == (enabled, 0)
    finally:
        (gc.enable if was else gc.disable)()
