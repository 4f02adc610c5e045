"""A layered walk skips the repeated-name search only for a listing that holds the recorded names in place.

``Layering.known_listing`` lets the walk (``_walk._walk``) pass over
``_Listing.repeats`` for a directory whose scan is byte for byte the
listing the parent walk checked, or laid out as it with the same name in
every place (``_layers._diff_in_place``).  A confined command renaming
entries while the directory is read can make a listing give one name twice
(or miss one); such a listing must never be taken for a known one.  The
property here: whenever ``_diff_in_place`` accepts a listing, that listing
parses to the key's names, in the key's places, so it holds no name twice.
"""

from __future__ import annotations

from array import array

from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox_fs.snapshot._layers import _Chunk, _diff_in_place
from sandbox_fs.snapshot._walk import SCAN_HEADER, _scan_records

_WS_ID = b".sandbox-fs-workspace-id"


def _rec(name: bytes, ino: int, size: int, mtime: int) -> bytes:
    head = SCAN_HEADER.pack(ino, 1, size, mtime, mtime, 1, 0o100644, len(name))
    return head + name + b"\0" * (-len(name) % 8)


def _chunk(recs: list[bytes], names: list[bytes]) -> _Chunk:
    key = b"".join(recs)
    _, offs = _scan_records(key)
    return _Chunk(key, [], [], [], 0, [], True, names=sorted(names), offs=array("Q", offs))


_NAMES = st.lists(st.sampled_from([b"a", b"b", b"ab", b"ba", b"abcdefgh", b"abcdefgi", b"x" * 9, _WS_ID]),
                  min_size=1, max_size=6, unique=True)
_EDIT = st.tuples(st.sampled_from(["stat", "rename", "repeat", "swap", "drop"]), st.integers(0, 5), st.integers(0, 5),
                  st.sampled_from([b"a", b"b", b"c", b"abcdefgh", b"abcdefgz", b"zz"]))


@settings(max_examples=400, deadline=None)
@given(names=_NAMES, edits=st.lists(_EDIT, max_size=3), top=st.booleans())
def test_property_a_listing_taken_as_known_holds_the_key_names_in_place(names, edits, top):
    key_recs = [_rec(n, i + 10, i, 100 + i) for i, n in enumerate(names)]
    old = _chunk(key_recs, [n for n in names if n != _WS_ID or not top])
    listed = list(zip(names, key_recs))
    for what, i, j, other in edits:
        i, j = i % len(listed), j % len(listed)
        name, rec = listed[i]
        if what == "stat":
            listed[i] = (name, _rec(name, 99, 7, 123))
        elif what == "rename":
            listed[i] = (other, _rec(other, 10 + i, i, 100 + i))
        elif what == "repeat":  # a rename during the read: one name listed twice
            listed[j] = (name, _rec(name, 10 + j, j, 100 + j))
        elif what == "swap":
            listed[i], listed[j] = listed[j], listed[i]
        elif len(listed) > 1:
            del listed[i]
    raw = b"".join(r for _, r in listed)
    if _diff_in_place(old, raw, top) is None:
        return
    recs, offs = _scan_records(raw)
    assert len(recs) == len(offs) - 1, "a listing with a repeated name was taken as known"
    assert [n for n, _ in listed] == names
