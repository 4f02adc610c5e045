"""``Root.copy_files_from``: the batched, per-file atomic copy between two Roots.

Run under both resolvers (``resolver`` fixture).  Attack tests check the
outside sentinel tree (``layout`` fixture): nothing outside is read into the
workspace or changed, no temporary name is left behind, no fd leaks.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import threading
import time
from pathlib import Path

import pytest

from sandbox_fs import open_root
from sandbox_fs.errors import PathEscapeError, ReadOnlyError, SymlinkRefusedError
from sandbox_fs.root import SpecialFileError, UnsafeModeError


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _no_tmp(top: Path) -> None:
    for dirpath, _dirs, files in os.walk(top):
        assert not [n for n in files if n.startswith(".sfs-tmp-")], f"temporary name left in {dirpath}"


@pytest.fixture
def src_tree(layout):
    src = layout.base / "src"
    (src / "a" / "b").mkdir(parents=True)
    (src / "top.txt").write_bytes(b"top\n")
    (src / "a" / "one.bin").write_bytes(os.urandom(5000))
    (src / "a" / "b" / "empty").write_bytes(b"")
    (src / "a" / "b" / "big.bin").write_bytes(os.urandom(70_000))
    os.utime(src / "a" / "one.bin", ns=(1_600_000_000_123_456_789, 1_600_000_000_123_456_789))
    return src


def _items(src: Path, names: list[str], dest_prefix: str = "out", mode: int = 0o640, ident: bool = True):
    out = []
    for n in names:
        st = os.lstat(src / n)
        out.append((n, f"{dest_prefix}/{n}", mode, st.st_mtime_ns, (st.st_dev, st.st_ino) if ident else None))
    return out


NAMES = ["top.txt", "a/one.bin", "a/b/empty", "a/b/big.bin"]


@pytest.mark.parametrize("digest", [True, False])
@pytest.mark.parametrize("buffer_bytes", [4096, 1 << 20])
def test_copy_files_from_copies_data_mode_mtime_digest(layout, resolver, src_tree, digest, buffer_bytes):
    for d in ["out", "out/a", "out/a/b"]:
        (layout.ws / d).mkdir()
    old = os.umask(0o077)
    try:
        with open_root(src_tree, read_only=True) as src, open_root(layout.ws) as ws:
            fds = _fds()
            res = ws.copy_files_from(src, _items(src_tree, NAMES), digest=digest, buffer_bytes=buffer_bytes)
            assert _fds() == fds
    finally:
        os.umask(old)
    assert len(res) == len(NAMES)
    for name, (n, sha) in zip(NAMES, res):
        data = (src_tree / name).read_bytes()
        out = layout.ws / "out" / name
        assert out.read_bytes() == data
        assert n == len(data)
        assert sha == (hashlib.sha256(data).hexdigest() if digest else None)
        st = out.lstat()
        assert stat.S_IMODE(st.st_mode) == 0o640  # explicit, never the umask's
        assert st.st_mtime_ns == os.lstat(src_tree / name).st_mtime_ns
    _no_tmp(layout.ws)


def test_copy_files_from_replaces_existing_file_and_symlink_without_following(layout, resolver, src_tree):
    before = layout.snapshot()
    (layout.ws / "out").mkdir()
    (layout.ws / "out" / "top.txt").write_text("old")
    os.symlink(layout.outside / "sentinel.txt", layout.ws / "out" / "link")
    with open_root(src_tree, read_only=True) as src, open_root(layout.ws) as ws:
        ws.copy_files_from(src, [("top.txt", "out/top.txt", 0o644, None, None),
                                 ("a/one.bin", "out/link", 0o600, None, None)])
    assert (layout.ws / "out" / "top.txt").read_bytes() == b"top\n"
    link = layout.ws / "out" / "link"
    assert not link.is_symlink() and link.read_bytes() == (src_tree / "a" / "one.bin").read_bytes()
    layout.assert_outside_unchanged(before)
    _no_tmp(layout.ws)


def test_copy_files_from_refuses_symlinked_sources(layout, resolver, src_tree):
    before = layout.snapshot()
    os.symlink(layout.outside / "secret.txt", src_tree / "leaf-link")
    os.symlink(layout.outside / "subdir", src_tree / "dir-link")
    os.symlink("a", src_tree / "inside-dir-link")  # even a link that stays inside
    (layout.ws / "out").mkdir()
    with open_root(src_tree, read_only=True) as src, open_root(layout.ws) as ws:
        fds = _fds()
        for rel in ["leaf-link", "dir-link/inner.txt", "inside-dir-link/one.bin"]:
            with pytest.raises(SymlinkRefusedError):
                ws.copy_files_from(src, [(rel, "out/x", 0o644, None, None)])
        with pytest.raises(PathEscapeError):
            ws.copy_files_from(src, [("../outside/secret.txt", "out/x", 0o644, None, None)])
        assert _fds() == fds
    assert not (layout.ws / "out" / "x").exists()
    layout.assert_secret_absent()
    layout.assert_outside_unchanged(before)
    _no_tmp(layout.ws)


def test_copy_files_from_never_writes_through_a_destination_directory_symlink(layout, resolver, src_tree):
    before = layout.snapshot()
    os.symlink(layout.outside / "subdir", layout.ws / "out")
    with open_root(src_tree, read_only=True) as src, open_root(layout.ws) as ws:
        with pytest.raises(SymlinkRefusedError):
            ws.copy_files_from(src, [("top.txt", "out/top.txt", 0o644, None, None)])
        with pytest.raises(PathEscapeError):
            ws.copy_files_from(src, [("top.txt", "../outside/new.txt", 0o644, None, None)])
    layout.assert_outside_unchanged(before)


def test_copy_files_from_refuses_fifo_without_blocking(layout, resolver, src_tree):
    os.mkfifo(src_tree / "fifo")
    (layout.ws / "out").mkdir()
    with open_root(src_tree, read_only=True) as src, open_root(layout.ws) as ws:
        with pytest.raises(SpecialFileError):
            ws.copy_files_from(src, [("fifo", "out/fifo", 0o644, None, None)])
        with pytest.raises(SpecialFileError):
            ws.copy_files_from(src, [("a", "out/a", 0o644, None, None)])  # a directory is not copied
    assert os.listdir(layout.ws / "out") == []


def test_copy_files_from_checks_identity_and_bounds(layout, resolver, src_tree):
    (layout.ws / "out").mkdir()
    (layout.ws / "out" / "keep").write_text("keep")
    other = os.lstat(src_tree / "top.txt")
    with open_root(src_tree, read_only=True) as src, open_root(layout.ws) as ws:
        with pytest.raises(OSError) as ei:
            ws.copy_files_from(src, [("a/one.bin", "out/keep", 0o644, None, (other.st_dev, other.st_ino))])
        assert ei.value.errno == errno.ESTALE
        for buf in (4096, 1 << 20):
            with pytest.raises(OSError) as ei:
                ws.copy_files_from(src, [("a/b/big.bin", "out/keep", 0o644, None, None)], max_bytes=10_000,
                                   buffer_bytes=buf)
            assert ei.value.errno == errno.EFBIG
            assert "out/keep" in str(ei.value)
        with pytest.raises(IsADirectoryError):
            ws.copy_files_from(src, [("top.txt", "out", 0o644, None, None)])
        with pytest.raises(UnsafeModeError):
            ws.copy_files_from(src, [("top.txt", "out/keep", 0o4755, None, None)])
        with pytest.raises(FileNotFoundError):
            ws.copy_files_from(src, [("top.txt", "missing/x", 0o644, None, None)])
        with pytest.raises(ValueError):
            ws.copy_files_from(src, [], buffer_bytes=100)
    assert (layout.ws / "out" / "keep").read_text() == "keep"
    _no_tmp(layout.ws)


def test_copy_files_from_read_only_and_denied_destinations(layout, resolver, src_tree):
    (layout.ws / "ro").mkdir()
    with open_root(src_tree, read_only=True) as src, open_root(layout.ws, read_only=True) as ws:
        with pytest.raises(ReadOnlyError):
            ws.copy_files_from(src, [("top.txt", "x", 0o644, None, None)])
    st = os.lstat(layout.ws / "ro")
    with open_root(src_tree, read_only=True) as src, open_root(layout.ws) as ws0:
        ws = ws0.with_options(deny_write_ids=frozenset({(st.st_dev, st.st_ino)}))
        try:
            with pytest.raises(ReadOnlyError):
                ws.copy_files_from(src, [("top.txt", "ro/x", 0o644, None, None)])
            ws.copy_files_from(src, [("top.txt", "x", 0o644, None, None)])
        finally:
            ws.close()
    assert os.listdir(layout.ws / "ro") == []
    assert (layout.ws / "x").read_bytes() == b"top\n"


def test_copy_files_from_before_each_stops_and_results_show_progress(layout, resolver, src_tree):
    (layout.ws / "out").mkdir()

    class Stop(Exception):
        pass

    def before(i: int) -> None:
        if i == 2:
            raise Stop()

    done: list = []
    with open_root(src_tree, read_only=True) as src, open_root(layout.ws) as ws:
        with pytest.raises(Stop):
            ws.copy_files_from(src, [("top.txt", f"out/f{i}", 0o644, None, None) for i in range(5)],
                               before_each=before, results=done)
    assert len(done) == 2
    assert sorted(os.listdir(layout.ws / "out")) == ["f0", "f1"]


@pytest.mark.parametrize("digest", [True, False])
def test_copy_files_from_groups_pack_many_files_in_one_buffer(layout, resolver, digest):
    """Files go to the native code in groups (one directory pair, packed in the buffer): the
    group boundaries (a directory change, 64 files, a file straddling the buffer's end) never
    change a byte, a digest, a mode or the order of the results."""
    src_dir = layout.base / "many"
    rng = __import__("random").Random(7)
    names = []
    for d in ("d1", "d2"):
        (src_dir / d).mkdir(parents=True)
        for i in range(90):
            n = f"{d}/f{i:03}"
            (src_dir / n).write_bytes(os.urandom(rng.choice([0, 1, 700, 3000, 5000, 9000, 20000])))
            names.append(n)
    names = [n for pair in zip(names[:90], names[90:]) for n in pair][:100] + names[45:90]  # interleaved, then one dir
    for d in ("d1", "d2"):
        (layout.ws / "out" / d).mkdir(parents=True)
    buf = bytearray(8192)
    with open_root(src_dir, read_only=True) as src, open_root(layout.ws) as ws:
        fds = _fds()
        items = [(n, f"out/{n}", 0o600 + (int(n[-3:]) % 3) * 0o11, None, None) for n in names]
        res = ws.copy_files_from(src, items, digest=digest, buffer=buf)
        res2 = ws.copy_files_from(src, items[:70], digest=digest, buffer=buf)  # the buffer is reused
        assert _fds() == fds
    assert len(res) == len(names) and res[:70] == res2
    for n, (size, sha) in zip(names, res):
        data = (src_dir / n).read_bytes()
        assert size == len(data) and (layout.ws / "out" / n).read_bytes() == data
        assert sha == (hashlib.sha256(data).hexdigest() if digest else None)
        assert stat.S_IMODE((layout.ws / "out" / n).lstat().st_mode) == 0o600 + (int(n[-3:]) % 3) * 0o11
    _no_tmp(layout.ws)


def test_copy_files_from_failure_inside_a_group_keeps_the_files_before_it(layout, resolver, src_tree):
    os.mkfifo(src_tree / "a" / "pipe")
    (layout.ws / "out").mkdir()
    done: list = []
    items = [("a/one.bin", "out/f0", 0o644, None, None), ("top.txt", "out/f1", 0o644, None, None),
             ("a/one.bin", "out/f2", 0o644, None, None), ("a/pipe", "out/f3", 0o644, None, None),
             ("a/one.bin", "out/f4", 0o644, None, None)]
    with open_root(src_tree, read_only=True) as src, open_root(layout.ws) as ws:
        with pytest.raises(SpecialFileError):
            ws.copy_files_from(src, items, results=done)
        with pytest.raises(ValueError):
            ws.copy_files_from(src, items, buffer=bytearray(100))
        with pytest.raises(TypeError):
            ws.copy_files_from(src, items, buffer=b"\0" * 8192)
    assert [n for n, _ in done] == [5000, 4, 5000]
    assert sorted(os.listdir(layout.ws / "out")) == ["f0", "f1", "f2"]
    _no_tmp(layout.ws)


def test_copy_files_from_race_swapping_source_dir_for_symlink(layout, resolver):
    """A thread swaps a source subdirectory for a symlink to the outside tree while batches run."""
    before_outside = None
    src_dir = layout.base / "race-src"
    sub = src_dir / "sub"
    sub.mkdir(parents=True)
    leak = layout.outside / "leak"
    leak.mkdir()
    names = [f"f{i:03}" for i in range(100)]
    for n in names:
        (sub / n).write_text(f"inside {n}\n")
        (leak / n).write_text(f"{layout.secret} outside {n}\n")
    before_outside = layout.snapshot()
    hidden = src_dir / ".real-sub"
    halt = threading.Event()
    swaps = [0]

    def swapper() -> None:
        while not halt.is_set():
            try:
                os.rename(sub, hidden)
                os.symlink(leak, sub)
                swaps[0] += 1
                time.sleep(0.0002)
                os.unlink(sub)
                os.rename(hidden, sub)
                time.sleep(0.0002)
            except OSError:
                time.sleep(0.0002)

    (layout.ws / "out").mkdir()
    outcomes = {"ok": 0, "refused": 0}
    t = threading.Thread(target=swapper, daemon=True)
    t.start()
    try:
        with open_root(src_dir, read_only=True) as src, open_root(layout.ws) as ws:
            deadline = time.monotonic() + 30
            for _ in range(40):
                # one item per call too, so directories are re-opened while the swapper runs
                for batch in ([(f"sub/{n}", f"out/{n}", 0o644, None, None) for n in names],
                              [("sub/f000", "out/single", 0o644, None, None)]):
                    try:
                        ws.copy_files_from(src, batch)
                        outcomes["ok"] += 1
                    except (SymlinkRefusedError, FileNotFoundError, PathEscapeError):
                        outcomes["refused"] += 1
                layout.assert_secret_absent()
                if swaps[0] > 20 and outcomes["refused"] and outcomes["ok"]:
                    break
                if time.monotonic() > deadline:
                    break
    finally:
        halt.set()
        t.join()
        if sub.is_symlink():
            sub.unlink()
        if hidden.exists() and not sub.exists():
            os.rename(hidden, sub)
    assert swaps[0] > 0, "the attacker thread never swapped"
    layout.assert_secret_absent()
    layout.assert_outside_unchanged(before_outside)
    _no_tmp(layout.ws)


def test_copy_files_from_refuses_bad_names_in_a_known_directory(layout, resolver, src_tree):
    """Later items in an already opened directory get the same path checks as the first."""
    from sandbox_fs.errors import InvalidPathError

    (layout.ws / "out").mkdir()
    with open_root(src_tree, read_only=True) as src, open_root(layout.ws) as ws:
        fds = _fds()
        good = ("a/one.bin", "out/one", 0o644, None, None)
        for bad_src, bad_dst, exc in [("a/..", "out/x", InvalidPathError), ("a/.", "out/x", InvalidPathError),
                                      ("a/one.bin", "out/..", InvalidPathError),
                                      ("a/one.bin", "out/", NotADirectoryError),
                                      ("a/one\0bin", "out/x", InvalidPathError),
                                      ("a/one.bin", "out/x\0y", InvalidPathError),
                                      ("/etc/passwd", "out/x", PathEscapeError),
                                      ("a/one.bin", "/tmp/x", PathEscapeError),
                                      ("a/" + "n" * 300, "out/x", InvalidPathError)]:
            with pytest.raises(exc):
                ws.copy_files_from(src, [good, (bad_src, bad_dst, 0o644, None, None)])
        res = ws.copy_files_from(src, [(b"a/one.bin", b"out/bytes", 0o644, None, None)])
        assert res[0][0] == 5000
        assert _fds() == fds
    assert sorted(os.listdir(layout.ws / "out")) == ["bytes", "one"]
    _no_tmp(layout.ws)


# ----------------------------------------------------------- materialize's use of the batch path


def _materialize(ws_dir: Path, base: Path, **opts):
    import trio

    from sandbox_fs.manifest import load_manifest
    from sandbox_fs.materialize import MaterializeOptions, materialize

    async def run():
        ws = open_root(ws_dir)
        try:
            return await materialize(ws, load_manifest({"entries": {"t": {"type": "local_dir", "src": "t"}}}),
                                     MaterializeOptions(base_dir=str(base), **opts))
        finally:
            ws.close()

    return trio.run(run)


def test_local_dir_reapply_repairs_through_the_per_file_path(layout, resolver):
    """A directory where a file belongs and a symlink planted at a file's place: repaired, never followed."""
    before = layout.snapshot()
    base = layout.base / "base"
    tree = base / "t"
    (tree / "d").mkdir(parents=True)
    for i in range(40):
        (tree / "d" / f"f{i:02}").write_text(f"file {i}\n")
    res = _materialize(layout.ws, base, batch_files=8)
    assert len(res.files) == 40
    f05 = layout.ws / "t" / "d" / "f05"
    f05.unlink()
    (f05 / "sub").mkdir(parents=True)  # a directory where the file belongs
    (layout.ws / "t" / "d" / "f06").unlink()
    os.symlink(layout.outside / "sentinel.txt", layout.ws / "t" / "d" / "f06")
    res = _materialize(layout.ws, base, batch_files=8)
    assert len(res.files) == 40
    for i in range(40):
        p = layout.ws / "t" / "d" / f"f{i:02}"
        assert not p.is_symlink() and p.read_text() == f"file {i}\n"
        f = res.file(f"t/d/f{i:02}")
        assert f.sha256 == hashlib.sha256(f"file {i}\n".encode()).hexdigest() and f.size == len(f"file {i}\n")
    layout.assert_outside_unchanged(before)
    _no_tmp(layout.ws)


def test_local_dir_total_bound_mid_batch_reports_exactly_what_was_written(layout, resolver):
    from sandbox_fs.materialize import MaterializeLimitError

    base = layout.base / "base"
    (base / "t").mkdir(parents=True)
    for i in range(30):
        (base / "t" / f"f{i:02}").write_bytes(b"x" * 100)
    with pytest.raises(MaterializeLimitError) as ei:
        _materialize(layout.ws, base, max_total_bytes=1050, batch_files=64)
    written = [p for p in os.listdir(layout.ws / "t") if not p.startswith(".")]
    assert len(written) == 10  # every file that fits, then the precise error
    assert ei.value.context["written_count"] == 10
    assert sorted(ei.value.context["written"]) == sorted(f"t/{n}" for n in written)
    _no_tmp(layout.ws)
