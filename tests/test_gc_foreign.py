"""GenerationStore.gc deletes only the objects of generation directories it writes, never another tool's.

Regression: gc deleted every key under ``NAME/gen/`` (any depth, any name)
that no pointer kept, so in a bucket or directory shared with other data
(``logs/gen/2024/app.log``, ``n/gen/notes.txt``) ``sandbox-fs snapshot gc``
removed objects sandbox-fs never wrote.
"""

from __future__ import annotations

import time
from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox_fs.root import open_root
from sandbox_fs.snapshot import GenerationStore, persist
from sandbox_fs.snapshot._objects_local import LocalObjects

ORPHAN = "000000000007-0123456789abcdef"
FOREIGN = ["logs/gen/2024/app.log", "logs/gen/x", "n/gen/notes.txt", "n/gen/000000000007-0123456789abcdef/extra",
           "n/gen/7-0123456789abcdef/archive.tar", "n/gen/000000000008-0123456789abcdef/archive.tar/more"]


def _store(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "f").write_bytes(b"data")
    store = GenerationStore(LocalObjects(tmp_path / "store"))
    with open_root(str(ws)) as root:
        persist(root, store, "n")
    return store


def test_gc_leaves_foreign_objects_and_removes_orphans(tmp_path):
    with _store(tmp_path) as store:
        for key in FOREIGN:
            store.objects.put_bytes(key, b"not sandbox-fs")
        orphans = [f"n/gen/{ORPHAN}/{leaf}" for leaf in ("archive.tar", "meta.json", "index")]
        for key in orphans:
            store.objects.put_bytes(key, b"orphan")
        kept_before = {o.key for o in store.objects.list("n/") if o.key.startswith("n/gen/0000000000")
                       and ORPHAN not in o.key}
        report = store.gc(now=time.time() + 7200)
        left = {o.key for o in store.objects.list("")}
        assert sorted(report.objects) == sorted(orphans)
        assert set(FOREIGN) <= left and kept_before <= left and not set(orphans) & left
        assert store.info("n") is not None


_COMPONENT = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,12}", fullmatch=True)


_GEN = st.from_regex(r"[0-9]{12,19}-[0-9a-f]{16}", fullmatch=True)
_LAYOUT = st.tuples(_GEN, st.sampled_from(["archive.tar", "meta.json", "index", "indexx", "meta"])).map(list)
_TAIL = st.one_of(st.lists(_COMPONENT, min_size=1, max_size=3), _LAYOUT,
                  st.tuples(_GEN, _COMPONENT, _COMPONENT).map(list))


@settings(max_examples=40, deadline=None)
@given(tails=st.lists(_TAIL, min_size=1, max_size=5))
def test_gc_only_removes_the_generation_layout(tmp_path_factory, tails):
    """Any key below a name's gen/ is deleted by gc exactly when it is gen/<generation dir>/<one of the three>."""
    import re

    layout = re.compile(r"gen/[0-9]{12,19}-[0-9a-f]{16}/(archive\.tar|meta\.json|index)")
    with GenerationStore(LocalObjects(tmp_path_factory.mktemp("gc") / "store")) as store:
        keys = set()
        for tail in tails:
            key = "x/gen/" + "/".join(tail)
            try:
                store.objects.put_bytes(key, b"?")
            except Exception:
                continue  # a component already holds an object (a file cannot be a directory)
            keys.add(key)
        removed = set(store.gc(now=time.time() + 7200).objects)
        assert removed == {k for k in keys if layout.fullmatch(k[2:])}
