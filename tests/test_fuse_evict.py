"""The overlay's inode table under fd pressure: evicted handles are reopened by name, and only onto the same inode.

The table (``sandbox_fs.fuse._inodes``) holds one ``O_PATH`` handle per
inode the kernel knows.  Past ``max_held`` the least recently used are
closed after a request and reopened from the parent's handle when next
used.  A reopen is a by-name step, so the workspace (hostile) may have
swapped the name in between: the reopened entry must be the inode the
kernel was told about, else ``ESTALE`` — never a symlink planted in its
place, another file, or anything outside.  Needs no FUSE: plain data over a
real :class:`~sandbox_fs.root.Root`.
"""

from __future__ import annotations

import errno
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox_fs import open_root
from sandbox_fs.fuse._inodes import ROOT_INODE, InodeTable, Tree


def _table(ws, max_held: int) -> tuple[InodeTable, Tree]:
    root = open_root(ws)
    tree = Tree(0, root, False, False, 1.0, 1.0)
    table = InodeTable(root.handle("."), tree)
    table.max_held = max_held
    return table, tree


def _learn(table: InodeTable, tree: Tree, parent: int, name: bytes):
    pnode = table.get(parent)
    node, _ = table.learn(parent, name, pnode.handle.lookup(name), tree)
    node.lookups += 1
    return node


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_evicted_handles_are_closed_and_reopened_onto_the_same_inode(tmp_path):
    ws = tmp_path / "ws"
    (ws / "d").mkdir(parents=True)
    for i in range(20):
        (ws / "d" / f"f{i}").write_text(f"data {i}\n")
    table, tree = _table(ws, max_held=4)
    d = _learn(table, tree, ROOT_INODE, b"d")
    files = [_learn(table, tree, d.ino, f"f{i}".encode()) for i in range(20)]
    before = _open_fds()
    assert table.trim() == 17  # 21 held, 4 kept
    assert _open_fds() == before - 17
    # least recently used first: the directory was used for every lookup, so it stays
    assert [f.held is None for f in files] == [True] * 17 + [False] * 3
    assert d.held is not None
    table.max_held = 0
    assert table.trim() == 4
    assert d.held is None
    # using an evicted file reopens its evicted parent first, each verified
    st0 = files[0].handle.stat()
    host = os.stat(ws / "d" / "f0")
    assert (st0.st_dev, st0.st_ino) == (host.st_dev, host.st_ino)
    assert d.held is not None and files[0].held is not None
    fd = d.handle.open(b"f0", os.O_RDONLY, expect=files[0].handle.key)
    try:
        assert os.read(fd, 64) == b"data 0\n"
    finally:
        os.close(fd)
    assert table.evictions == 21
    table.close()


@pytest.mark.parametrize("swap", ["symlink_to_outside", "other_file", "removed", "dir_to_symlink"])
def test_a_name_swapped_while_its_handle_was_evicted_gives_estale(tmp_path, swap):
    """The workspace changes a name behind the table's back while the handle is closed: the reopen
    must refuse whatever is there now, and the outside stays untouched."""
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    (ws / "d").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret").write_text("SECRET\n")
    (ws / "d" / "f").write_text("inside\n")
    (ws / "other").write_text("other\n")
    table, tree = _table(ws, max_held=0)
    d = _learn(table, tree, ROOT_INODE, b"d")
    f = _learn(table, tree, d.ino, b"f")
    table.trim()
    assert d.held is None and f.held is None
    if swap == "symlink_to_outside":
        os.unlink(ws / "d" / "f")
        os.symlink(outside / "secret", ws / "d" / "f")
    elif swap == "other_file":
        os.rename(ws / "other", ws / "d" / "f")
    elif swap == "removed":
        os.unlink(ws / "d" / "f")
    else:
        os.rename(ws / "d", ws / "d.moved")
        os.symlink(outside, ws / "d")
        os.symlink(outside / "secret", outside / "f")
    with pytest.raises(OSError) as got:
        f.handle.stat()
    assert got.value.errno in (errno.ESTALE, errno.ENOENT)
    assert f.held is None  # nothing was adopted in its place
    assert (outside / "secret").read_text() == "SECRET\n"
    table.close()


def test_open_unnamed_and_pinned_inodes_are_never_evicted(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    for n in ("a", "b", "c"):
        (ws / n).write_text(n)
    table, tree = _table(ws, max_held=0)
    a, b, c = (_learn(table, tree, ROOT_INODE, n) for n in (b"a", b"b", b"c"))
    a.opens = 1  # an open file
    table.remove_dentry(ROOT_INODE, b"b")  # unlinked: no name left to reopen it by
    assert table.trim() == 1
    assert a.held is not None and b.held is not None and c.held is None
    assert table.get(ROOT_INODE).held is not None  # the root is pinned
    host = os.stat(ws / "c")
    assert c.handle.key == (host.st_dev, host.st_ino)  # reopened on use
    table.close()


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["use", "trim", "swap"]), st.integers(0, 11)), max_size=60),
       budget=st.integers(0, 6))
def test_property_every_use_gives_the_learned_inode_or_estale(tmp_path_factory, ops, budget):
    """Property: over any order of uses, trims and out-of-band swaps (the old file moved out of the
    tree, a new one written under its name), a handle obtained from the table is always on the inode
    learned for that FUSE inode, or the use fails with ESTALE once the handle was evicted; and the
    table never holds more than ``budget`` unpinned handles after a trim."""
    base = tmp_path_factory.mktemp("evict")
    ws, grave = base / "ws", base / "grave"
    grave.mkdir()
    for i in range(3):
        (ws / f"d{i}").mkdir(parents=True)
        for j in range(4):
            (ws / f"d{i}" / f"f{j}").write_text(f"{i}{j}")
    table, tree = _table(ws, max_held=budget)
    dirs = [_learn(table, tree, ROOT_INODE, f"d{i}".encode()) for i in range(3)]
    nodes = [_learn(table, tree, dirs[k // 4].ino, f"f{k % 4}".encode()) for k in range(12)]
    swapped: set[int] = set()
    for n, (op, k) in enumerate(ops):
        node = nodes[k]
        if op == "trim":
            table.trim()
            assert sum(x.held is not None for x in dirs + nodes) <= budget
        elif op == "swap":
            p = ws / f"d{k // 4}" / f"f{k % 4}"
            os.rename(p, grave / f"{n}")  # the old inode lives on, outside the tree
            p.write_text("replaced")
            swapped.add(k)
        else:
            was_held = node.held is not None
            try:
                h = node.handle
            except OSError as e:
                assert e.errno == errno.ESTALE and k in swapped and not was_held
                continue
            st_now = os.fstat(h.fd)
            assert (tree.index, st_now.st_dev, st_now.st_ino) == node.key
    table.close()


def test_an_inode_the_kernel_forgot_gets_its_number_back_on_the_next_lookup(tmp_path):
    """Regression: the kernel forgets unused inodes whenever it drops its dentry cache (memory
    pressure, ``drop_caches``); the next lookup gave the same backing inode a new number, so its
    ``st_ino`` changed under persist's walk and hydrate's extraction ("replaced" errors through the
    overlay on a loaded machine).  The number is reused for the same backing inode only."""
    ws = tmp_path / "ws"
    (ws / "d").mkdir(parents=True)
    (ws / "d" / "f").write_text("f\n")
    (ws / "g").write_text("g\n")
    table, tree = _table(ws, max_held=100)
    d = _learn(table, tree, ROOT_INODE, b"d")
    f = _learn(table, tree, d.ino, b"f")
    numbers = (d.ino, f.ino)
    table.forget(f.ino, 1)
    table.forget(d.ino, 1)
    assert table.find(d.ino) is None and table.find(f.ino) is None
    g = _learn(table, tree, ROOT_INODE, b"g")  # another inode never takes a forgotten number
    assert g.ino not in numbers
    d2 = _learn(table, tree, ROOT_INODE, b"d")
    f2 = _learn(table, tree, d2.ino, b"f")
    assert (d2.ino, f2.ino) == numbers
    table.close()
