"""Handle: an O_PATH fd on one entry beneath a Root; each method on the held fd or fd + one name.

Each method is compared with what the same operation does on a plain directory (``os`` by path
on a twin tree); names are validated before any syscall (a property test over generated names
with an outside sentinel); a directory swapped for a symlink to the outside between the lookup
and the use changes nothing (the handle acts on the inode it holds); a read-only Root refuses
every change.
"""

from __future__ import annotations

import errno
import importlib
import os
import pkgutil
import stat
import threading
import traceback
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sandbox_fs
from sandbox_fs import _native
from sandbox_fs.errors import InvalidPathError, PathEscapeError, ReadOnlyError, SymlinkRefusedError
from sandbox_fs.root import Handle, SpecialFileError

from tests.conftest import tree_digest

NOFOLLOW = {"follow_symlinks": False}


@pytest.fixture
def root(layout):
    r = sandbox_fs.open_root(layout.ws)
    yield r
    r.close()


@pytest.fixture
def top(root):
    h = root.handle()
    yield h
    h.close()


def _write(path: Path, data: bytes = b"data") -> None:
    path.write_bytes(data)


# ----------------------------------------------------------------------- basics


def test_handle_of_root_and_key(root, top, layout):
    st_ = os.lstat(layout.ws)
    assert top.key == (st_.st_dev, st_.st_ino)
    assert top.stat().st_ino == st_.st_ino
    assert not top.read_only
    assert isinstance(top.fd, int) and top.fd >= 0
    flags = __import__("fcntl").fcntl(top.fd, __import__("fcntl").F_GETFL)
    assert flags & _native.O_PATH
    assert not os.get_inheritable(top.fd)


def test_root_handle_path_resolves_beneath_and_keeps_leaf_symlink(root, layout):
    (layout.ws / "d").mkdir()
    os.symlink("d", layout.ws / "ln")
    os.symlink(str(layout.outside), layout.ws / "out")
    with root.handle("d") as h:
        assert h.key[1] == os.lstat(layout.ws / "d").st_ino
    with root.handle("ln") as h:  # the link itself, not its target
        assert stat.S_ISLNK(h.stat().st_mode)
        assert h.readlink() == b"d"
    with root.handle("out") as h:  # a link out is held as a link, never followed
        assert stat.S_ISLNK(h.stat().st_mode)
    with pytest.raises(PathEscapeError):
        root.handle("out/secret.txt")
    with pytest.raises(PathEscapeError):
        root.handle("../outside")
    with pytest.raises(FileNotFoundError):
        root.handle("missing")


def test_close_is_idempotent_and_context_manager_closes(root):
    h = root.handle()
    fd = h.fd
    with h:
        pass
    assert h.fd == -1 and h.closed
    h.close()
    with pytest.raises(OSError) as ei:
        h.stat()
    assert ei.value.errno == errno.EBADF
    with pytest.raises(OSError):  # the fd itself was closed
        os.fstat(fd)


def test_closed_root_stops_its_handles_with_ebadf(layout):
    r = sandbox_fs.open_root(layout.ws)
    h = r.handle()
    r.close()
    for call in (h.stat, h.listdir, lambda: h.lookup(b"x"), lambda: h.mkdir(b"x", 0o755)):
        with pytest.raises(OSError) as ei:
            call()
        assert ei.value.errno == errno.EBADF
    assert not (layout.ws / "x").exists()
    h.close()
    with pytest.raises(sandbox_fs.WorkspaceClosedError):
        r.handle()


# ------------------------------------------------------------- vs a plain directory


@pytest.fixture
def twin(tmp_path):
    """A plain directory the same operations are made on with ``os`` by path, for the expectation."""
    p = tmp_path / "twin"
    p.mkdir()
    return p


def _kinds(path: Path) -> dict[bytes, tuple[int, int]]:
    return {os.fsencode(n): (stat.S_IFMT(os.lstat(path / n).st_mode), stat.S_IMODE(os.lstat(path / n).st_mode))
            for n in os.listdir(path)}


def test_mkdir_mknod_symlink_open_match_plain_directory(top, layout, twin):
    old = os.umask(0)  # the plain calls then give the exact modes, as Handle always does
    try:
        d = top.mkdir(b"dir", 0o751)
        os.mkdir(twin / "dir", 0o751)
        f = top.mknod(b"node", stat.S_IFREG | 0o640)
        os.mknod(twin / "node", stat.S_IFREG | 0o640)
        p = top.mknod(b"fifo", stat.S_IFIFO | 0o600)
        os.mkfifo(twin / "fifo", 0o600)
        s = top.symlink(b"ln", b"dir/../node")
        os.symlink("dir/../node", twin / "ln")
        fd = top.open(b"file", os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o666)
        os.write(fd, b"hello")
        os.close(fd)
        fd = os.open(twin / "file", os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o666)
        os.write(fd, b"hello")
        os.close(fd)
    finally:
        os.umask(old)
    assert _kinds(layout.ws) == _kinds(twin)
    assert d.key[1] == os.lstat(layout.ws / "dir").st_ino
    assert f.key[1] == os.lstat(layout.ws / "node").st_ino
    assert p.key[1] == os.lstat(layout.ws / "fifo").st_ino
    assert s.readlink() == os.readlink(twin / "ln").encode()
    assert (layout.ws / "file").read_bytes() == b"hello"
    for h in (d, f, p, s):
        h.close()


def test_create_existing_name_gives_eexist(top, layout, twin):
    (layout.ws / "x").mkdir()
    (twin / "x").mkdir()
    for call, expect in ((lambda: top.mkdir(b"x", 0o755), lambda: os.mkdir(twin / "x")),
                         (lambda: top.symlink(b"x", b"t"), lambda: os.symlink("t", twin / "x")),
                         (lambda: top.mknod(b"x", stat.S_IFIFO | 0o600), lambda: os.mkfifo(twin / "x"))):
        with pytest.raises(OSError) as plain:
            expect()
        with pytest.raises(OSError) as ours:
            call()
        assert ours.value.errno == plain.value.errno == errno.EEXIST


def test_lookup_stat_listdir_open_dir(top, layout):
    (layout.ws / "d").mkdir()
    _write(layout.ws / "d" / "f", b"abc")
    os.symlink("f", layout.ws / "d" / "l")
    os.mkfifo(layout.ws / "d" / "p")
    d = top.lookup(b"d")
    assert d.stat() == os.lstat(layout.ws / "d") or d.stat().st_ino == os.lstat(layout.ws / "d").st_ino
    got = {n: (ino, t) for n, ino, t in d.listdir()}
    want = {}
    with os.scandir(layout.ws / "d") as it:
        for e in it:
            want[os.fsencode(e.name)] = (e.inode(), stat.S_IFMT(e.stat(follow_symlinks=False).st_mode) >> 12)
    assert got == want
    f = d.lookup(b"f")
    assert f.stat().st_size == 3 and f.key == (os.lstat(layout.ws / "d" / "f").st_dev,
                                               os.lstat(layout.ws / "d" / "f").st_ino)
    ln = d.lookup(b"l")
    assert stat.S_ISLNK(ln.stat().st_mode) and ln.readlink() == b"f"
    dfd = d.open_dir()
    try:
        assert sorted(os.listdir(dfd)) == ["f", "l", "p"]
    finally:
        os.close(dfd)
    with pytest.raises(NotADirectoryError):
        f.open_dir()
    with pytest.raises(NotADirectoryError):
        f.lookup(b"x")
    with pytest.raises(NotADirectoryError):
        f.listdir()
    with pytest.raises(FileNotFoundError):
        d.lookup(b"missing")
    with pytest.raises(OSError) as ei:
        f.readlink()
    assert ei.value.errno == errno.EINVAL  # as readlink(2) of a non-link
    assert top.statvfs().f_bsize == os.statvfs(layout.ws).f_bsize
    for h in (d, f, ln):
        h.close()


def test_listdir_of_many_entries_crosses_getdents_buffers(top, layout):
    names = {f"entry-{i:05d}-{'x' * 40}".encode() for i in range(3000)}
    for n in names:
        (layout.ws / os.fsdecode(n)).touch()
    got = top.listdir()
    assert {n for n, _, _ in got} == names and len(got) == len(names)
    assert all(t == stat.S_IFREG >> 12 for _, _, t in got)


def test_open_never_follows_and_refuses_special_files(top, layout):
    _write(layout.ws / "f", b"abc")
    os.symlink("f", layout.ws / "l")
    os.mkfifo(layout.ws / "p")
    fd = top.open(b"f", os.O_RDONLY)
    try:
        assert os.read(fd, 10) == b"abc"
        assert not os.get_inheritable(fd)
        assert not os.get_blocking(fd) or True  # regular files ignore O_NONBLOCK
    finally:
        os.close(fd)
    with pytest.raises(SymlinkRefusedError) as ei:
        top.open(b"l", os.O_RDONLY)
    assert ei.value.errno == errno.ELOOP
    with pytest.raises(SymlinkRefusedError):
        top.open(b"l", os.O_WRONLY | os.O_CREAT)
    assert (layout.ws / "f").read_bytes() == b"abc"
    with pytest.raises(SpecialFileError):  # never blocks waiting for a writer
        top.open(b"p", os.O_RDONLY)
    fd = top.open(b"p", os.O_RDONLY, allow_special=True)
    try:
        assert os.get_blocking(fd)  # O_NONBLOCK cleared again, as not asked for
    finally:
        os.close(fd)
    with pytest.raises(FileNotFoundError):
        top.open(b"missing", os.O_RDONLY)
    with pytest.raises(FileExistsError):
        top.open(b"f", os.O_CREAT | os.O_EXCL | os.O_WRONLY)


def test_open_with_trunc_and_append(top, layout, twin):
    for base in (layout.ws, twin):
        _write(base / "f", b"0123456789")
    fd = top.open(b"f", os.O_WRONLY | os.O_TRUNC)
    os.write(fd, b"ab")
    os.close(fd)
    fd = os.open(twin / "f", os.O_WRONLY | os.O_TRUNC)
    os.write(fd, b"ab")
    os.close(fd)
    fd = top.open(b"f", os.O_WRONLY | os.O_APPEND)
    os.write(fd, b"cd")
    os.close(fd)
    with open(twin / "f", "ab") as fo:
        fo.write(b"cd")
    assert (layout.ws / "f").read_bytes() == (twin / "f").read_bytes() == b"abcd"


def test_open_expect_gives_estale_after_the_name_is_replaced(top, layout):
    _write(layout.ws / "f", b"original")
    h = top.lookup(b"f")
    fd = top.open(b"f", os.O_RDONLY, expect=h.key)
    assert os.read(fd, 100) == b"original"
    os.close(fd)
    os.rename(layout.ws / "f", layout.ws / "moved")
    _write(layout.ws / "f", b"impostor contents")
    for flags in (os.O_RDONLY, os.O_WRONLY | os.O_TRUNC, os.O_RDWR):
        with pytest.raises(OSError) as ei:
            top.open(b"f", flags, expect=h.key)
        assert ei.value.errno == errno.ESTALE
    assert (layout.ws / "f").read_bytes() == b"impostor contents"  # O_TRUNC never reached it
    assert (layout.ws / "moved").read_bytes() == b"original"
    fd = top.open(b"moved", os.O_WRONLY | os.O_TRUNC, expect=h.key)  # another name of the inode
    os.close(fd)
    assert (layout.ws / "moved").read_bytes() == b""
    with pytest.raises(OSError) as ei:
        top.open(b"new", os.O_CREAT | os.O_WRONLY, expect=h.key)
    assert ei.value.errno == errno.EINVAL and not (layout.ws / "new").exists()
    h.close()


def test_unlink_rmdir_rename_match_plain_directory(top, layout, twin):
    for base in (layout.ws, twin):
        (base / "d").mkdir()
        (base / "e").mkdir()
        _write(base / "d" / "f")
        os.symlink("d", base / "l")
    d = top.lookup(b"d")
    e = top.lookup(b"e")
    for ours, plain in (
        (lambda: top.unlink(b"d"), lambda: os.unlink(twin / "d")),            # a directory
        (lambda: top.rmdir(b"l"), lambda: os.rmdir(twin / "l")),              # a symlink to one
        (lambda: top.rmdir(b"d"), lambda: os.rmdir(twin / "d")),              # not empty
        (lambda: top.unlink(b"nope"), lambda: os.unlink(twin / "nope")),
        (lambda: d.rename(b"nope", e, b"x"), lambda: os.rename(twin / "d" / "nope", twin / "e" / "x")),
    ):
        with pytest.raises(OSError) as a:
            ours()
        with pytest.raises(OSError) as b:
            plain()
        assert a.value.errno == b.value.errno
    d.rename(b"f", e, b"g")
    os.rename(twin / "d" / "f", twin / "e" / "g")
    top.unlink(b"l")  # the link, never its target
    os.unlink(twin / "l")
    top.rmdir(b"d")
    os.rmdir(twin / "d")
    assert sorted(os.listdir(layout.ws)) == sorted(os.listdir(twin)) == ["e"]
    assert os.listdir(layout.ws / "e") == os.listdir(twin / "e") == ["g"]
    e.close()
    d.close()


def test_rename_flags_noreplace_and_exchange(top, layout):
    _write(layout.ws / "a", b"A")
    _write(layout.ws / "b", b"B")
    with pytest.raises(FileExistsError):
        top.rename(b"a", top, b"b", _native.RENAME_NOREPLACE)
    top.rename(b"a", top, b"b", _native.RENAME_EXCHANGE)
    assert (layout.ws / "a").read_bytes() == b"B" and (layout.ws / "b").read_bytes() == b"A"
    top.rename(b"a", top, b"c", _native.RENAME_NOREPLACE)
    assert sorted(os.listdir(layout.ws)) == ["b", "c"]
    with pytest.raises(OSError) as ei:
        top.rename(b"b", top, b"d", 1 << 20)
    assert ei.value.errno == errno.EINVAL


def test_link_gives_the_same_inode_a_new_name(top, layout, twin):
    _write(layout.ws / "f", b"x")
    (layout.ws / "d").mkdir()
    f = top.lookup(b"f")
    d = top.lookup(b"d")
    new = d.link(f, b"f2")
    assert new.key == f.key and new.fd != f.fd
    assert os.lstat(layout.ws / "d" / "f2").st_ino == f.key[1]
    assert os.lstat(layout.ws / "f").st_nlink == 2
    os.symlink("f", layout.ws / "l")
    ln = top.lookup(b"l")
    top.link(ln, b"l2").close()  # the link itself, as linkat(AT_EMPTY_PATH) does
    assert os.readlink(layout.ws / "l2") == "f" and os.lstat(layout.ws / "l").st_nlink == 2
    with pytest.raises(PermissionError):  # a directory: EPERM as link(2)
        top.link(d, b"dirlink")
    with pytest.raises(FileExistsError):
        top.link(f, b"f")
    for h in (f, d, new, ln):
        h.close()


def test_chmod_chown_set_times_act_on_the_held_inode(top, layout):
    _write(layout.ws / "f")
    (layout.ws / "d").mkdir()
    os.symlink("f", layout.ws / "l")
    f, d, ln = top.lookup(b"f"), top.lookup(b"d"), top.lookup(b"l")
    f.chmod(0o604)
    d.chmod(0o710)
    assert stat.S_IMODE(os.lstat(layout.ws / "f").st_mode) == 0o604
    assert stat.S_IMODE(os.lstat(layout.ws / "d").st_mode) == 0o710
    with pytest.raises(OSError) as ei:  # Linux never changes a symlink's mode
        ln.chmod(0o600)
    assert ei.value.errno == errno.EOPNOTSUPP
    assert stat.S_IMODE(os.lstat(layout.ws / "f").st_mode) == 0o604  # the target untouched
    with pytest.raises(OSError) as ei:
        f.chmod(0o10000)
    assert ei.value.errno == errno.EINVAL
    if os.geteuid() == 0:
        f.chown(1234, 4321)
        ln.chown(777, -1)
        st_f, st_l = os.lstat(layout.ws / "f"), os.lstat(layout.ws / "l")
        assert (st_f.st_uid, st_f.st_gid) == (1234, 4321)
        assert st_l.st_uid == 777 and st_l.st_gid == 0  # the link's own owner; the target's kept
    f.set_times(1_000_000_001, 2_000_000_002)
    st_f = os.lstat(layout.ws / "f")
    assert (st_f.st_atime_ns, st_f.st_mtime_ns) == (1_000_000_001, 2_000_000_002)
    f.set_times(None, 5 * 10**9)
    st_f = os.lstat(layout.ws / "f")
    assert (st_f.st_atime_ns, st_f.st_mtime_ns) == (1_000_000_001, 5 * 10**9)
    f.set_times(Handle.NOW, None)
    assert os.lstat(layout.ws / "f").st_atime_ns > 10**18  # "now", after 2001
    ln.set_times(-10**9, 3 * 10**9)  # a symlink's own times
    st_l = os.lstat(layout.ws / "l")
    assert (st_l.st_atime_ns, st_l.st_mtime_ns) == (-10**9, 3 * 10**9)
    assert os.lstat(layout.ws / "f").st_mtime_ns == 5 * 10**9
    for h in (f, d, ln):
        h.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving an owner needs CAP_CHOWN (run as root)")
def test_owner_given_to_what_the_call_made_only(top, layout):
    d = top.mkdir(b"d", 0o755, owner=(1001, 1002))
    s = top.symlink(b"l", b"d", owner=(1001, 1002))
    n = top.mknod(b"n", stat.S_IFREG | 0o600, owner=(1001, 1002))
    fd = top.open(b"f", os.O_CREAT | os.O_WRONLY, 0o600, owner=(1001, 1002))
    os.close(fd)
    _write(layout.ws / "existing")
    fd = top.open(b"existing", os.O_CREAT | os.O_WRONLY, 0o600, owner=(1001, 1002))
    os.close(fd)
    for name in ("d", "l", "n", "f"):
        st_ = os.lstat(layout.ws / name)
        assert (st_.st_uid, st_.st_gid) == (1001, 1002), name
    assert os.lstat(layout.ws / "existing").st_uid == 0  # not made by the call: left alone
    for h in (d, s, n):
        h.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving an owner needs CAP_CHOWN (run as root)")
def test_root_owner_is_the_default_owner(layout):
    with sandbox_fs.open_root(layout.ws, owner=(2001, 2002)) as r, r.handle() as h:
        h.mkdir(b"d").close()
        os.close(h.open(b"f", os.O_CREAT | os.O_WRONLY))
        h.mkdir(b"mine", owner=(3001, 3002)).close()
    assert os.lstat(layout.ws / "d").st_uid == 2001 and os.lstat(layout.ws / "f").st_gid == 2002
    assert os.lstat(layout.ws / "mine").st_uid == 3001


# ------------------------------------------------------------------ name validation

BAD_NAMES = [b"", b".", b"..", b"/", b"a/b", b"../x", b"x/..", b"/etc", b"a\0b", b"\0", b"./"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_names_are_refused_before_any_syscall(top, layout, name):
    before = tree_digest(layout.base)
    calls = [
        lambda: top.lookup(name), lambda: top.open(name, os.O_RDONLY),
        lambda: top.open(name, os.O_CREAT | os.O_WRONLY), lambda: top.mkdir(name, 0o755),
        lambda: top.mknod(name, stat.S_IFREG | 0o600), lambda: top.symlink(name, b"t"),
        lambda: top.unlink(name), lambda: top.rmdir(name), lambda: top.link(top, name),
        lambda: top.rename(name, top, b"ok"), lambda: top.rename(b"ok", top, name),
    ]
    for call in calls:
        with pytest.raises(InvalidPathError):
            call()
    assert tree_digest(layout.base) == before


def test_a_name_that_is_not_bytes_is_a_type_error(top):
    with pytest.raises(TypeError):
        top.lookup("x")  # type: ignore[arg-type]


NAME = st.one_of(
    st.binary(max_size=12),
    st.lists(st.sampled_from([b"..", b".", b"/", b"\0", b"a", b"outside", b"sentinel.txt", b"x"]),
             min_size=1, max_size=5).map(b"".join),
)


def _preload_hypothesis() -> None:
    import hypothesis

    for mod in pkgutil.walk_packages(hypothesis.__path__, "hypothesis."):
        if not mod.name.startswith("hypothesis.extra"):
            try:
                importlib.import_module(mod.name)
            except ImportError:
                pass


def _run_contained(base: Path, fn) -> None:
    """Run ``fn(top)`` where ``top`` is ``base`` as ``fn`` sees it.

    As root: in a forked child chrooted to ``base``, so that a name that got through (say
    ``b"/x"``) lands inside ``base`` where the test sees it, never in the host's ``/``.  Without
    the privilege to chroot, in this process (an unprivileged user cannot write to ``/``).
    """
    if os.geteuid() != 0:
        fn(base)
        return
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        code = 1
        try:
            _preload_hypothesis()  # it imports modules lazily (shrinking ...): none can be found after chroot
            os.chroot(base)
            os.chdir("/")
            fn(Path("/"))
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the contained property check failed (its traceback is above)"


def test_generated_names_never_reach_outside_the_held_directory(layout):
    """No generated name creates, opens or changes anything outside the held directory ws/a/b."""
    (layout.ws / "a" / "b").mkdir(parents=True)
    _write(layout.ws / "a" / "sentinel.txt", b"guard")
    _write(layout.ws / "a" / "b" / "seed", b"seed")

    def property_check(top: Path) -> None:
        held_dir = top / "ws" / "a" / "b"

        def rest() -> dict:  # everything under top (the outside sentinel tree included) but the held directory
            return {k: v for k, v in tree_digest(top).items() if k != "ws/a/b" and not k.startswith("ws/a/b/")}

        before = rest()
        r = sandbox_fs.open_root(top / "ws")
        held = r.handle("a/b")

        @settings(max_examples=300, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture])
        @given(name=NAME, op=st.sampled_from(["lookup", "open", "create", "mkdir", "mknod", "symlink", "unlink",
                                              "rmdir", "link", "rename_from", "rename_to"]))
        def check(name: bytes, op: str) -> None:
            valid = bool(name) and name not in (b".", b"..") and b"/" not in name and b"\0" not in name
            fd = -1
            try:
                if op == "lookup":
                    held.lookup(name).close()
                elif op == "open":
                    fd = held.open(name, os.O_RDONLY)
                elif op == "create":
                    fd = held.open(name, os.O_CREAT | os.O_WRONLY, 0o600)
                elif op == "mkdir":
                    held.mkdir(name, 0o700).close()
                elif op == "mknod":
                    held.mknod(name, stat.S_IFIFO | 0o600).close()
                elif op == "symlink":
                    held.symlink(name, b"target").close()
                elif op == "unlink":
                    held.unlink(name)
                elif op == "rmdir":
                    held.rmdir(name)
                elif op == "link":
                    with held.lookup(b"seed") as seed:
                        held.link(seed, name).close()
                elif op == "rename_from":
                    held.rename(name, held, b"renamed")
                else:
                    held.rename(b"seed", held, name)
                assert valid, f"{name!r} was accepted"
            except InvalidPathError:
                assert not valid, f"{name!r} was refused"
            except OSError:  # ENAMETOOLONG, ENOENT, EEXIST ...: only a valid name reaches the kernel
                assert valid, f"{name!r} reached the kernel"
            finally:
                if fd >= 0:
                    os.close(fd)
                assert rest() == before, f"{op} {name!r} changed something outside the held directory"
                for entry in os.scandir(held_dir):  # reset the held directory
                    p = Path(entry.path)
                    p.rmdir() if entry.is_dir(follow_symlinks=False) else p.unlink()
                _write(held_dir / "seed", b"seed")

        try:
            check()
        finally:
            held.close()
            r.close()

    before = layout.snapshot()
    _run_contained(layout.base, property_check)
    layout.assert_outside_unchanged(before)


# ------------------------------------------------------------------------ TOCTOU


def test_directory_swapped_for_symlink_after_lookup_changes_nothing(top, layout):
    """The held inode is used: the name now being a symlink to the outside is never followed."""
    (layout.ws / "d").mkdir()
    before = layout.snapshot()
    d = top.lookup(b"d")

    def swap() -> None:
        os.rename(layout.ws / "d", layout.ws / "d.moved")
        os.symlink(str(layout.outside), layout.ws / "d")

    t = threading.Thread(target=swap)
    t.start()
    t.join()
    fd = d.open(b"sentinel.txt", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    os.write(fd, b"pwned")
    os.close(fd)
    d.mkdir(b"subdir", 0o755).close()
    d.symlink(b"secret.txt", b"x").close()
    d.chmod(0o700)
    d.set_times(0, 0)
    assert sorted(n for n, _, _ in d.listdir()) == [b"secret.txt", b"sentinel.txt", b"subdir"]
    layout.assert_outside_unchanged(before)
    assert (layout.ws / "d.moved" / "sentinel.txt").read_bytes() == b"pwned"
    d.close()


def test_racing_swaps_between_lookup_and_open_never_reach_outside(top, layout):
    (layout.ws / "d").mkdir()
    os.symlink(str(layout.outside), layout.ws / "evil")
    before = layout.snapshot()
    stop = threading.Event()

    def racer() -> None:
        while not stop.is_set():
            try:
                os.rename(layout.ws / "d", layout.ws / "tmp")
                os.rename(layout.ws / "evil", layout.ws / "d")
                os.rename(layout.ws / "d", layout.ws / "evil")
                os.rename(layout.ws / "tmp", layout.ws / "d")
            except OSError:
                pass

    t = threading.Thread(target=racer)
    t.start()
    made = 0
    try:
        for i in range(2000):
            try:
                h = top.lookup(b"d")
            except OSError:
                continue
            with h:
                try:
                    fd = h.open(f"new{i}".encode(), os.O_CREAT | os.O_WRONLY, 0o600)
                    os.close(fd)
                    made += 1
                except OSError as exc:  # the held inode was the symlink: ENOTDIR, nothing followed
                    assert exc.errno == errno.ENOTDIR
    finally:
        stop.set()
        t.join()
    layout.assert_outside_unchanged(before)
    (real,) = [e.path for e in os.scandir(layout.ws) if e.is_dir(follow_symlinks=False)]
    assert len(os.listdir(real)) == made


# -------------------------------------------------------------------- read-only


@pytest.fixture
def ro(layout):
    (layout.ws / "d").mkdir()
    _write(layout.ws / "d" / "f", b"keep")
    os.symlink("f", layout.ws / "d" / "l")
    r = sandbox_fs.open_root(layout.ws, read_only=True)
    yield r
    r.close()


def _mutations(d: Handle, f: Handle) -> dict:
    return {
        "open_w": lambda: d.open(b"f", os.O_WRONLY), "open_rw": lambda: d.open(b"f", os.O_RDWR),
        "open_trunc": lambda: d.open(b"f", os.O_RDONLY | os.O_TRUNC),
        "open_append": lambda: d.open(b"f", os.O_WRONLY | os.O_APPEND),
        "create": lambda: d.open(b"new", os.O_CREAT | os.O_WRONLY), "mkdir": lambda: d.mkdir(b"new", 0o755),
        "mknod": lambda: d.mknod(b"new", stat.S_IFREG | 0o600), "symlink": lambda: d.symlink(b"new", b"f"),
        "link": lambda: d.link(f, b"new"), "unlink": lambda: d.unlink(b"f"), "rmdir": lambda: d.rmdir(b"f"),
        "rename": lambda: d.rename(b"f", d, b"new"), "exchange": lambda: d.rename(b"f", d, b"l", 2),
        "chmod": lambda: f.chmod(0o600), "chown": lambda: f.chown(1, 1), "set_times": lambda: f.set_times(0, 0),
    }


def test_read_only_root_refuses_every_mutation_with_erofs(ro, layout):
    before = tree_digest(layout.ws)
    with ro.handle("d") as d, d.lookup(b"f") as f:
        assert d.read_only and f.read_only
        for op, call in _mutations(d, f).items():
            with pytest.raises(ReadOnlyError) as ei:
                call()
            assert ei.value.errno == errno.EROFS, op
        fd = d.open(b"f", os.O_RDONLY)  # reading stays allowed
        assert os.read(fd, 10) == b"keep"
        os.close(fd)
        assert d.lookup(b"l").readlink() == b"f"
        assert {n for n, _, _ in d.listdir()} == {b"f", b"l"}
    assert tree_digest(layout.ws) == before


def test_no_link_or_rename_from_a_read_only_root_into_a_writable_one(ro, layout):
    with sandbox_fs.open_root(layout.ws) as rw, rw.handle("d") as wd, ro.handle("d/f") as rf, \
            ro.handle("d") as rd:
        with pytest.raises(ReadOnlyError):  # the read-only file would become writable by the new name
            wd.link(rf, b"writable")
        with pytest.raises(ReadOnlyError):
            rd.rename(b"f", wd, b"g")
    assert sorted(os.listdir(layout.ws / "d")) == ["f", "l"]


def test_link_and_rename_across_roots_give_exdev(layout, tmp_path):
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    _write(other_dir / "o")
    (layout.ws / "w").touch()
    with sandbox_fs.open_root(layout.ws) as a, sandbox_fs.open_root(other_dir) as b, \
            a.handle() as ha, b.handle() as hb, hb.lookup(b"o") as o:
        with pytest.raises(PathEscapeError) as ei:
            ha.link(o, b"stolen")
        assert ei.value.errno == errno.EXDEV
        with pytest.raises(PathEscapeError):
            hb.rename(b"o", ha, b"stolen")
        with pytest.raises(PathEscapeError):
            ha.rename(b"w", hb, b"pushed")
    assert not (layout.ws / "stolen").exists() and not (other_dir / "pushed").exists()
    assert (other_dir / "o").exists()


def test_two_roots_on_the_same_directory_are_the_same_tree(layout):
    _write(layout.ws / "f")
    with sandbox_fs.open_root(layout.ws) as a, sandbox_fs.open_root(layout.ws) as b, \
            a.handle() as ha, b.handle() as hb, hb.lookup(b"f") as f:
        ha.link(f, b"g").close()
    assert os.lstat(layout.ws / "g").st_ino == os.lstat(layout.ws / "f").st_ino


# ------------------------------------------------- read-only grants nested in the Root


@pytest.fixture
def denying(layout):
    """A Root on ws where the directory ws/grant is denied to writes (a read-only grant nested in it)."""
    (layout.ws / "grant" / "sub").mkdir(parents=True)
    _write(layout.ws / "grant" / "g", b"granted")
    _write(layout.ws / "free", b"free")
    os.link(layout.ws / "free", layout.ws / "free2")
    st_ = os.lstat(layout.ws / "grant")
    with sandbox_fs.open_root(layout.ws) as base, base.with_options(deny_write_ids=frozenset({(st_.st_dev, st_.st_ino)})) as r:
        yield r


def test_handles_in_a_nested_read_only_grant_are_read_only(denying, layout):
    before = tree_digest(layout.ws / "grant")
    with denying.handle() as top, top.lookup(b"grant") as g, g.lookup(b"sub") as sub, \
            denying.handle("grant/sub") as sub2, denying.handle("grant/g") as gf:
        assert not top.read_only
        assert g.read_only and sub.read_only and sub2.read_only and gf.read_only
        for h in (g, sub, sub2):
            with pytest.raises(ReadOnlyError):
                h.mkdir(b"x", 0o755)
        with pytest.raises(ReadOnlyError):
            gf.chmod(0o600)
        with pytest.raises(ReadOnlyError):  # the grant itself, removed or renamed from its writable parent
            top.rmdir(b"grant")
        with pytest.raises(ReadOnlyError):
            top.rename(b"grant", top, b"moved")
        with pytest.raises(ReadOnlyError):
            top.rename(b"free", top, b"grant", _native.RENAME_EXCHANGE)
        with pytest.raises(ReadOnlyError):  # a read-only file given a writable name
            top.link(gf, b"stolen")
    assert tree_digest(layout.ws / "grant") == before
    assert not (layout.ws / "stolen").exists() and (layout.ws / "free").read_bytes() == b"free"


def test_multiply_linked_files_are_not_changed_in_place_where_grants_are_nested(denying, layout):
    with denying.handle() as top, top.lookup(b"free") as f:
        with pytest.raises(ReadOnlyError):
            top.open(b"free", os.O_WRONLY)
        with pytest.raises(ReadOnlyError):
            f.chmod(0o600)
        with pytest.raises(ReadOnlyError):
            f.set_times(0, 0)
        os.close(top.open(b"free", os.O_RDONLY))  # reading stays allowed
        top.unlink(b"free2")
        fd = top.open(b"free", os.O_WRONLY | os.O_APPEND)  # one link now: allowed
        os.write(fd, b"+")
        os.close(fd)
    assert (layout.ws / "free").read_bytes() == b"free+"


def test_root_handle_with_each_resolver(resolver, layout):
    (layout.ws / "d" / "e").mkdir(parents=True)
    os.symlink(str(layout.outside), layout.ws / "d" / "out")
    with sandbox_fs.open_root(layout.ws) as r:
        assert r.resolver == resolver
        with r.handle("d/e") as h:
            assert h.key[1] == os.lstat(layout.ws / "d" / "e").st_ino
        with pytest.raises(PathEscapeError):
            r.handle("d/out/secret.txt")
        with pytest.raises(PathEscapeError):
            r.handle("d/../../outside")



def test_create_gives_the_fd_and_a_handle_on_the_same_inode(top, layout):
    fd, h = top.create(b"new", os.O_WRONLY | os.O_EXCL, 0o600)
    try:
        os.write(fd, b"x")
        assert h.key == (os.fstat(fd).st_dev, os.fstat(fd).st_ino) == (os.lstat(layout.ws / "new").st_dev,
                                                                       os.lstat(layout.ws / "new").st_ino)
        assert stat.S_ISREG(h.stat().st_mode)
    finally:
        os.close(fd)
        h.close()
    with pytest.raises(FileExistsError):
        top.create(b"new", os.O_WRONLY | os.O_EXCL)
    fd, h = top.create(b"new", os.O_RDWR)  # without O_EXCL: the existing file
    os.close(fd)
    h.close()
    assert (layout.ws / "new").read_bytes() == b"x"


def test_modes_are_exact_whatever_the_process_umask(top, layout):
    old = os.umask(0o077)
    try:
        top.mkdir(b"d", 0o775).close()
        top.mknod(b"n", stat.S_IFREG | 0o664).close()
        top.mknod(b"p", stat.S_IFIFO | 0o666).close()
        os.close(top.open(b"f", os.O_CREAT | os.O_WRONLY, 0o644))
        os.close(top.open(b"e", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o640))
        _write(layout.ws / "existing")
        os.chmod(layout.ws / "existing", 0o600)
        os.close(top.open(b"existing", os.O_CREAT | os.O_WRONLY, 0o666))  # not made: left alone
    finally:
        os.umask(old)
    modes = {n: stat.S_IMODE(os.lstat(layout.ws / n).st_mode) for n in ("d", "n", "p", "f", "e", "existing")}
    assert modes == {"d": 0o775, "n": 0o664, "p": 0o666, "f": 0o644, "e": 0o640, "existing": 0o600}


def test_a_directory_keeps_the_set_group_id_it_inherits(top, layout):
    (layout.ws / "sg").mkdir()
    os.chmod(layout.ws / "sg", 0o2775)
    old = os.umask(0o022)
    try:
        with top.lookup(b"sg") as sg:
            sg.mkdir(b"child", 0o775).close()
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.lstat(layout.ws / "sg" / "child").st_mode) == 0o2775


def test_o_creat_on_an_existing_directory_is_eisdir_as_open(top, layout, twin):
    (layout.ws / "d").mkdir()
    (twin / "d").mkdir()
    with pytest.raises(IsADirectoryError):
        os.open(twin / "d", os.O_CREAT | os.O_RDONLY)
    with pytest.raises(IsADirectoryError):
        top.open(b"d", os.O_CREAT | os.O_RDONLY)


def test_the_handle_module_never_names_proc_or_builds_a_path():
    """Nothing in Handle reopens /proc/self/fd/N (a magic link) or joins path strings (docstrings aside)."""
    import ast

    from sandbox_fs import _root_handle

    tree = ast.parse(Path(_root_handle.__file__).read_text())
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    consts = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and id(n) not in docs
              and isinstance(n.value, (str, bytes))]
    assert not [c for c in consts if "proc" in (c.decode("latin-1") if isinstance(c, bytes) else c)]
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not attrs & {"path", "fspath", "fsdecode", "join", "fd_chmod", "fd_set_times", "_via_proc"}
