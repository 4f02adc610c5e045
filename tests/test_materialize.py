"""materialize(): every entry type, trust rules, symlink-safe copying, repair, limits, cancellation."""

from __future__ import annotations

import hashlib
import io
import os
import stat
import tarfile
from pathlib import Path

import pytest
import trio

from sandbox_fs import Grant, PathEscapeError, SymlinkRefusedError, open_root
from sandbox_fs.errors import SandboxError
from sandbox_fs.manifest import ManifestError, load_manifest
from sandbox_fs.materialize import (
    MaterializeLimitError,
    MaterializeOptions,
    MaterializeProgress,
    SourceRefusedError,
    materialize,
)


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def all_nodes(top: Path) -> dict[str, os.stat_result]:
    out = {}
    for dirpath, dirs, files in os.walk(top):
        for n in dirs + files:
            p = Path(dirpath, n)
            out[str(p.relative_to(top))] = p.lstat()
    return out


async def apply(ws_dir: Path, manifest, **opts):
    ws = open_root(ws_dir)
    try:
        return await materialize(ws, load_manifest(manifest), MaterializeOptions(**opts))
    finally:
        ws.close()


@pytest.fixture
def base(layout):
    b = layout.base / "base"
    (b / "proj" / "sub").mkdir(parents=True)
    (b / "proj" / "a.txt").write_text("alpha\n")
    (b / "proj" / "sub" / "b.py").write_text("print(1)\n")
    (b / "proj" / "sub" / "c.pyc").write_bytes(b"\0compiled")
    os.chmod(b / "proj" / "sub" / "b.py", 0o4755)  # setuid must be cleared
    os.link(b / "proj" / "a.txt", b / "proj" / "hard.txt")
    os.symlink("../a.txt", b / "proj" / "sub" / "inside_link")
    os.utime(b / "proj" / "a.txt", ns=(1_500_000_000 * 10**9, 1_500_000_000 * 10**9))
    os.utime(b / "proj" / "sub", ns=(1_400_000_000 * 10**9, 1_400_000_000 * 10**9))
    (b / "single.bin").write_bytes(bytes(range(256)) * 100)
    os.chmod(b / "single.bin", 0o6750)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        data = b"from the archive\n"
        ti = tarfile.TarInfo("pkg/inner.txt")
        ti.size = len(data)
        tf.addfile(ti, io.BytesIO(data))
    (b / "vendor.tar.gz").write_bytes(buf.getvalue())
    return b


# ------------------------------------------------------------- entry types


async def test_every_entry_type(layout, base, resolver):
    before = layout.snapshot()
    m = {
        "entries": {
            "README": {"type": "file", "content": "hello\n"},
            "bin/run": {"type": "file", "content": "IyEvYmluL3NoCg==", "encoding": "base64", "mode": 0o755},
            "data": {"type": "dir", "mode": 0o750, "children": {"x/y.txt": {"type": "file", "content": "y"}}},
            "single": {"type": "local_file", "src": "single.bin"},
            "single_ro": {"type": "local_file", "src": "single.bin", "mode": 0o600},
            "proj": {"type": "local_dir", "src": "proj"},
            "latest": {"type": "symlink", "target": "data/x/y.txt"},
            "vendor": {"type": "archive", "src": "vendor.tar.gz"},
        }
    }
    res = await apply(layout.ws, m, base_dir=str(base))
    ws = layout.ws
    assert (ws / "README").read_text() == "hello\n"
    assert stat.S_IMODE((ws / "README").stat().st_mode) == 0o644
    assert (ws / "bin" / "run").read_bytes() == b"#!/bin/sh\n"
    assert stat.S_IMODE((ws / "bin" / "run").stat().st_mode) == 0o755
    assert stat.S_IMODE((ws / "data").stat().st_mode) == 0o750
    assert (ws / "data" / "x" / "y.txt").read_text() == "y"
    assert (ws / "single").read_bytes() == (base / "single.bin").read_bytes()
    assert stat.S_IMODE((ws / "single").stat().st_mode) == 0o750  # setuid/setgid cleared
    assert stat.S_IMODE((ws / "single_ro").stat().st_mode) == 0o600
    # local_dir: content, modes without setuid, mtimes, hard links split, inside symlink kept
    assert (ws / "proj" / "a.txt").read_text() == "alpha\n"
    assert stat.S_IMODE((ws / "proj" / "sub" / "b.py").stat().st_mode) == 0o755
    assert (ws / "proj" / "a.txt").stat().st_mtime_ns == 1_500_000_000 * 10**9
    assert (ws / "proj" / "sub").stat().st_mtime_ns == 1_400_000_000 * 10**9
    assert (ws / "proj" / "hard.txt").stat().st_ino != (ws / "proj" / "a.txt").stat().st_ino
    assert (ws / "proj" / "hard.txt").stat().st_nlink == 1
    assert os.readlink(ws / "proj" / "sub" / "inside_link") == "../a.txt"
    assert os.readlink(ws / "latest") == "data/x/y.txt"
    assert (ws / "vendor" / "pkg" / "inner.txt").read_text() == "from the archive\n"
    # result: each written file with size, sha256, mode, source kind
    for wf in res.files:
        p = ws / wf.sandbox_path
        assert wf.size == p.stat().st_size
        assert wf.sha256 == sha(p)
        assert wf.mode == stat.S_IMODE(p.stat().st_mode)
    kinds = {wf.sandbox_path: wf.source_kind for wf in res.files}
    assert kinds["README"] == "file" and kinds["single"] == "local_file" and kinds["proj/a.txt"] == "local_dir"
    assert [a["sandbox_path"] for a in res.archives] == ["vendor"] and res.archives[0]["files"] == 1
    assert {s.sandbox_path for s in res.symlinks} == {"latest", "proj/sub/inside_link"}
    assert res.total_bytes == sum(f.size for f in res.files) + len(b"from the archive\n")
    assert res.to_dict()["files"][0]["sandbox_path"] == res.files[0].sandbox_path
    # the trusted base is only read
    assert stat.S_IMODE((base / "single.bin").stat().st_mode) == 0o6750
    layout.assert_outside_unchanged(before)


async def test_include_exclude(layout, base):
    m = {"entries": {"only_py": {"type": "local_dir", "src": "proj", "include": ["*.py"]},
                     "no_pyc": {"type": "local_dir", "src": "proj", "exclude": ["*.pyc", "hard.txt"]},
                     "no_sub": {"type": "local_dir", "src": "proj", "exclude": ["sub"]}}}
    await apply(layout.ws, m, base_dir=str(base))
    ws = layout.ws
    assert sorted(p for p, st in all_nodes(ws / "only_py").items() if stat.S_ISREG(st.st_mode)) == ["sub/b.py"]
    assert not (ws / "no_pyc" / "sub" / "c.pyc").exists() and not (ws / "no_pyc" / "hard.txt").exists()
    assert (ws / "no_pyc" / "sub" / "b.py").exists()
    assert not (ws / "no_sub" / "sub").exists() and (ws / "no_sub" / "a.txt").exists()


async def test_digest_off_copies_fd_to_fd(layout, base):
    res = await apply(layout.ws, {"entries": {"p": {"type": "local_dir", "src": "proj"}}},
                      base_dir=str(base), digest=False)
    assert res.files and all(f.sha256 is None for f in res.files)
    assert (layout.ws / "p" / "a.txt").read_text() == "alpha\n"


async def test_only_ephemeral(layout, base):
    m = {"entries": {"keep": {"type": "file", "content": "k"},
                     "tmp": {"type": "dir", "ephemeral": True, "children": {"c": {"type": "file", "content": "c"}}},
                     "e": {"type": "file", "content": "e", "ephemeral": True}}}
    ws = open_root(layout.ws)
    try:
        res = await materialize(ws, load_manifest(m), MaterializeOptions(), only_ephemeral=True)
    finally:
        ws.close()
    assert sorted(f.sandbox_path for f in res.files) == ["e", "tmp/c"]
    assert not (layout.ws / "keep").exists()


# -------------------------------------------------------------- trust rules


async def test_manifest_granting_itself_etc_is_refused(layout):
    with pytest.raises(ManifestError) as ei:
        load_manifest({"entries": {"p": {"type": "local_file", "src": "/etc/passwd"}},
                       "extra_path_grants": [{"path": "/etc", "read_only": True}]})
    assert ei.value.context["field"] == "extra_path_grants"


@pytest.mark.parametrize("src", ["../../etc/passwd", "a/../../../etc/passwd"])
async def test_local_file_dotdot_src_refused(layout, base, src):
    with pytest.raises(ManifestError) as ei:
        await apply(layout.ws, {"entries": {"x": {"type": "local_file", "src": src}}}, base_dir=str(base))
    assert ei.value.context["field"] == "entries['x'].src"


async def test_local_file_absolute_src_without_grant_refused(layout, base):
    with pytest.raises(SourceRefusedError) as ei:
        await apply(layout.ws, {"entries": {"x": {"type": "local_file", "src": "/etc/passwd"}}}, base_dir=str(base))
    assert ei.value.sandbox_path == "x"
    assert not (layout.ws / "x").exists()


async def test_no_base_dir_means_no_local_sources(layout, base, monkeypatch):
    monkeypatch.chdir(base)  # the cwd is never a default base
    with pytest.raises(SourceRefusedError, match="no trusted base"):
        await apply(layout.ws, {"entries": {"x": {"type": "local_file", "src": "single.bin"}}})
    with pytest.raises(ValueError):
        MaterializeOptions(base_dir="relative/dir")


@pytest.mark.parametrize("plant,src,err", [
    (lambda b, o: os.symlink(o / "secret.txt", b / "abs_link"), "abs_link", SymlinkRefusedError),
    (lambda b, o: os.symlink("../outside/secret.txt", b / "rel_link"), "rel_link", SymlinkRefusedError),
    (lambda b, o: os.symlink("../outside", b / "outdir"), "outdir/secret.txt", PathEscapeError),
    (lambda b, o: os.symlink("/proc/self/root", b / "proc"), "proc" + "/etc/passwd", PathEscapeError),
    (lambda b, o: os.symlink("/proc/self/cwd", b / "cwd"), "cwd/secret.txt", PathEscapeError),
])
async def test_local_file_symlink_out_of_base_refused(layout, base, resolver, plant, src, err):
    plant(base, layout.outside)
    before = layout.snapshot()
    with pytest.raises(err):
        await apply(layout.ws, {"entries": {"x": {"type": "local_file", "src": src}}}, base_dir=str(base))
    assert not (layout.ws / "x").exists()
    layout.assert_secret_absent()
    layout.assert_outside_unchanged(before)


async def test_local_file_fifo_fails_fast(layout, base):
    os.mkfifo(base / "pipe")
    with trio.fail_after(10):
        with pytest.raises(SourceRefusedError, match="fifo"):
            await apply(layout.ws, {"entries": {"x": {"type": "local_file", "src": "pipe"}}}, base_dir=str(base))


async def test_local_dir_fifo_refused_or_skipped(layout, base):
    os.mkfifo(base / "proj" / "pipe")
    with trio.fail_after(10):
        with pytest.raises(SourceRefusedError, match="fifo"):
            await apply(layout.ws, {"entries": {"p": {"type": "local_dir", "src": "proj"}}}, base_dir=str(base))
        assert not (layout.ws / "p" / "a.txt").exists()  # refused before any file was written
        res = await apply(layout.ws, {"entries": {"p": {"type": "local_dir", "src": "proj",
                                                         "special_files": "skip"}}}, base_dir=str(base))
    assert [(s.sandbox_path, s.rule) for s in res.skipped] == [("p/pipe", "special_file")]
    assert not (layout.ws / "p" / "pipe").exists()


@pytest.mark.parametrize("policy", ["refuse", "skip"])
async def test_local_dir_escaping_symlinks(layout, base, resolver, policy):
    proj = base / "proj"
    os.symlink("..", proj / "up")
    os.symlink("../../outside/secret.txt", proj / "sec")
    os.symlink("../../outside", proj / "outdir")
    os.symlink("/etc/passwd", proj / "pw")
    os.symlink("up/..", proj / "sub" / "chain")  # lexically inside, physically out via 'up'
    before = layout.snapshot()
    m = {"entries": {"p": {"type": "local_dir", "src": "proj", "symlinks": policy}}}
    if policy == "refuse":
        with pytest.raises(SourceRefusedError) as ei:
            await apply(layout.ws, m, base_dir=str(base))
        assert ei.value.sandbox_path.startswith("p/")
        assert not (layout.ws / "p").exists()
    else:
        res = await apply(layout.ws, m, base_dir=str(base))
        assert sorted(s.sandbox_path for s in res.skipped) == ["p/outdir", "p/pw", "p/sec", "p/sub/chain", "p/up"]
        assert os.readlink(layout.ws / "p" / "sub" / "inside_link") == "../a.txt"
    ws_real = os.path.realpath(layout.ws)
    for rel, st in all_nodes(layout.ws).items():
        if stat.S_ISLNK(st.st_mode):
            assert os.path.realpath(layout.ws / rel).startswith(ws_real + "/")
    layout.assert_secret_absent()
    layout.assert_outside_unchanged(before)


async def test_grants_read_only_sources(layout, tmp_path):
    g = tmp_path / "grant"
    (g / "d").mkdir(parents=True)
    (g / "d" / "f.txt").write_text("granted\n")
    before = {k: (v.st_mode, v.st_mtime_ns, v.st_size) for k, v in all_nodes(g).items()}
    m = {"entries": {"f": {"type": "local_file", "src": f"{g}/d/f.txt"},
                     "d": {"type": "local_dir", "src": f"{g}/d"}}}
    for ro in (True, False):
        res = await apply(layout.ws, m, extra_path_grants=[Grant(str(g), read_only=ro)])
        assert (layout.ws / "f").read_text() == "granted\n" and (layout.ws / "d" / "f.txt").exists()
        assert {f.source_kind for f in res.files} == {"local_file", "local_dir"}
    assert {k: (v.st_mode, v.st_mtime_ns, v.st_size) for k, v in all_nodes(g).items()} == before
    # a grant path prefix is not a grant: /x/grant2 is not under /x/grant
    (tmp_path / "grant2").mkdir()
    (tmp_path / "grant2" / "s").write_text("no")
    with pytest.raises(SourceRefusedError):
        await apply(layout.ws, {"entries": {"s": {"type": "local_file", "src": f"{g}2/s"}}},
                    extra_path_grants=[Grant(str(g))])


def test_source_roots_are_read_only_even_for_rw_grants(tmp_path):
    from sandbox_fs.materialize import _Sources

    (tmp_path / "g").mkdir()
    src = _Sources(MaterializeOptions(base_dir=str(tmp_path), extra_path_grants=[Grant(str(tmp_path / "g"), False)]))
    try:
        root, rel = src.resolve(f"{tmp_path}/g/x", "x", "entries['x']")
        assert root.read_only and rel == "x"
        assert src.resolve("y", "y", "entries['y']")[0].read_only
        with pytest.raises(SandboxError):
            root.write_bytes("x", b"no")
    finally:
        src.close()
    assert not (tmp_path / "g" / "x").exists()


# ---------------------------------------------------- failure, repair, limits


async def test_partial_failure_reports_written_and_reapply_repairs(layout, base):
    os.mkfifo(base / "late")
    entries = {f"f{i:02}": {"type": "file", "content": str(i)} for i in range(40)}
    entries["bad"] = {"type": "local_file", "src": "late"}
    with pytest.raises(SourceRefusedError) as ei:
        await apply(layout.ws, {"entries": entries}, base_dir=str(base))
    ctx = ei.value.context
    assert ctx["written_count"] == len(ctx["written"]) or ctx["written_count"] > 50
    for p in ctx["written"]:
        assert (layout.ws / p).is_file()
    os.unlink(base / "late")
    (base / "late").write_text("now a file")
    res = await apply(layout.ws, {"entries": entries}, base_dir=str(base))
    assert len(res.files) == 41 and (layout.ws / "bad").read_text() == "now a file"
    assert not [n for n in os.listdir(layout.ws) if n.startswith(".sfs-tmp")]


async def test_reapply_repairs_a_tampered_workspace(layout, base, resolver):
    m = {"entries": {"a/file.txt": {"type": "file", "content": "A"},
                     "d": {"type": "dir", "mode": 0o700, "children": {"inner": {"type": "file", "content": "I"}}},
                     "link": {"type": "symlink", "target": "a/file.txt"},
                     "p": {"type": "local_dir", "src": "proj"}}}
    await apply(layout.ws, m, base_dir=str(base))
    ws = layout.ws
    before = layout.snapshot()
    # tamper: file -> dir, dir -> symlink to outside, link retargeted, content changed, mode changed
    (ws / "a" / "file.txt").unlink()
    (ws / "a" / "file.txt").mkdir()
    (ws / "a" / "file.txt" / "junk").write_text("junk")
    import shutil

    shutil.rmtree(ws / "d")
    os.symlink(str(layout.outside), ws / "d")
    (ws / "link").unlink()
    os.symlink("p/a.txt", ws / "link")
    (ws / "p" / "a.txt").write_text("tampered")
    shutil.rmtree(ws / "p" / "sub")
    os.symlink("../../outside", ws / "p" / "sub")
    await apply(layout.ws, m, base_dir=str(base))
    assert (ws / "a" / "file.txt").read_text() == "A"
    assert (ws / "d").is_dir() and not (ws / "d").is_symlink() and (ws / "d" / "inner").read_text() == "I"
    assert stat.S_IMODE((ws / "d").stat().st_mode) == 0o700
    assert os.readlink(ws / "link") == "a/file.txt"
    assert (ws / "p" / "a.txt").read_text() == "alpha\n"
    assert (ws / "p" / "sub").is_dir() and not (ws / "p" / "sub").is_symlink()
    assert (ws / "p" / "sub" / "b.py").read_text() == "print(1)\n"
    layout.assert_outside_unchanged(before)
    layout.assert_secret_absent()


async def test_limits(layout, base):
    with pytest.raises(MaterializeLimitError):
        await apply(layout.ws, {"entries": {"p": {"type": "local_dir", "src": "proj"}}},
                    base_dir=str(base), max_total_bytes=10)
    with pytest.raises(MaterializeLimitError):
        await apply(layout.ws, {"entries": {"x": {"type": "local_file", "src": "single.bin"}}},
                    base_dir=str(base), max_file_bytes=100)
    with pytest.raises(MaterializeLimitError):
        await apply(layout.ws, {"entries": {"p": {"type": "local_dir", "src": "proj"}}},
                    base_dir=str(base), max_files=2)
    with pytest.raises(ManifestError, match="unknown archive limit"):
        await apply(layout.ws, {"entries": {"v": {"type": "archive", "src": "vendor.tar.gz",
                                                  "limits": {"no_such_limit": 1}}}}, base_dir=str(base))
    # a manifest may narrow the application's archive limits, never widen them
    from sandbox_fs.archive import ArchiveLimitError, ArchiveLimits

    with pytest.raises(ArchiveLimitError):
        await apply(layout.ws, {"entries": {"v": {"type": "archive", "src": "vendor.tar.gz",
                                                  "limits": {"max_member_bytes": 3}}}}, base_dir=str(base))
    with pytest.raises(ArchiveLimitError):
        await apply(layout.ws, {"entries": {"v": {"type": "archive", "src": "vendor.tar.gz",
                                                  "limits": {"max_member_bytes": 10**9}}}}, base_dir=str(base),
                    archive_limits=ArchiveLimits(max_member_bytes=3))


@pytest.mark.parametrize("file_tokens", [1, 2])
async def test_shared_limiters_bound_the_fan_out(layout, tmp_path, file_tokens):
    b = tmp_path / "many"
    for d in range(6):
        (b / f"d{d}" / "n1" / "n2").mkdir(parents=True)
        for i in range(60):
            (b / f"d{d}" / "n1" / "n2" / f"f{i}").write_text("x" * i)
    # one token: the walking thread copies alone; two: each entry's copier waits for its own token
    lim_e, lim_f = trio.CapacityLimiter(2), trio.CapacityLimiter(file_tokens)
    peak = {"e": 0, "f": 0}
    entries = {f"c{d}": {"type": "local_dir", "src": f"d{d}"} for d in range(6)}
    entries["tree"] = {"type": "dir", "children": {f"x{d}": {"type": "local_dir", "src": f"d{d}"} for d in range(6)}}
    progress = MaterializeProgress()

    async def sample(cancel):
        while True:
            peak["e"] = max(peak["e"], lim_e.borrowed_tokens)
            peak["f"] = max(peak["f"], lim_f.borrowed_tokens)
            await trio.sleep(0)

    async with trio.open_nursery() as n:
        n.start_soon(sample, None)
        res = await apply(layout.ws, {"entries": entries}, base_dir=str(b), batch_files=16,
                          limiter_entries=lim_e, limiter_files=lim_f, progress=progress)
        n.cancel_scope.cancel()
    assert len(res.files) == 12 * 60
    assert progress.files == 12 * 60 and progress.bytes == res.total_bytes
    assert peak["e"] <= 2 and peak["f"] <= file_tokens
    assert peak["e"] >= 1 and peak["f"] >= 1


async def test_cancellation_leaves_only_complete_files(layout, tmp_path):
    b = tmp_path / "big"
    b.mkdir()
    for i in range(400):
        (b / f"f{i:03}").write_bytes(os.urandom(2048))
    ws = open_root(layout.ws)
    try:
        with trio.move_on_after(0.02):
            await materialize(ws, load_manifest({"entries": {"c": {"type": "local_dir", "src": "."}}}),
                              MaterializeOptions(base_dir=str(b), batch_files=8))
    finally:
        ws.close()
    for dirpath, _dirs, files in os.walk(layout.ws):
        for n in files:
            assert not n.startswith(".sfs-tmp"), "temporary file left behind"
            if dirpath.endswith("/c"):
                assert (Path(dirpath) / n).read_bytes() == (b / n).read_bytes()
    res = await apply(layout.ws, {"entries": {"c": {"type": "local_dir", "src": "."}}}, base_dir=str(b))
    assert len(res.files) == 400


async def test_cancel_stops_a_local_dir_mid_chunk(layout, tmp_path, monkeypatch):
    """A cancel reaches worker threads at their next file, not at the end of their chunk."""
    import sandbox_fs._root_copy as root_copy

    b = tmp_path / "one"
    b.mkdir()
    for i in range(400):
        (b / f"f{i:03}").write_bytes(os.urandom(3000))
    real_sha = root_copy._hashlib_sha256
    seen = {"n": 0}
    with trio.CancelScope() as scope:
        def counting_sha(data):  # runs in the worker threads, once per file copied
            seen["n"] += 1
            if seen["n"] == 20:
                trio.from_thread.run_sync(scope.cancel)
            return real_sha(data)

        monkeypatch.setattr(root_copy, "_hashlib_sha256", counting_sha)
        ws = open_root(layout.ws)
        try:
            # one chunk of 400 files: only a per-file check can stop it early
            await materialize(ws, load_manifest({"entries": {"c": {"type": "local_dir", "src": "."}}}),
                              MaterializeOptions(base_dir=str(b), batch_files=1000))
        finally:
            ws.close()
    assert scope.cancelled_caught
    names = os.listdir(layout.ws / "c")
    assert not [n for n in names if n.startswith(".sfs-tmp")], "temporary file left behind"
    assert 20 <= len(names) < 400
    for n in names:
        assert (layout.ws / "c" / n).read_bytes() == (b / n).read_bytes()


async def test_planted_workspace_symlink_is_never_written_through(layout, resolver):
    os.symlink(str(layout.outside), layout.ws / "a")
    os.symlink("../outside/sentinel.txt", layout.ws / "f")
    before = layout.snapshot()
    await apply(layout.ws, {"entries": {"a/x": {"type": "file", "content": "pwned"},
                                        "f": {"type": "file", "content": "pwned"}}})
    layout.assert_outside_unchanged(before)
    assert not (layout.ws / "a").is_symlink() and (layout.ws / "a" / "x").read_text() == "pwned"
    assert not (layout.ws / "f").is_symlink()


def test_options_validation():
    with pytest.raises(ValueError):
        MaterializeOptions(max_files=-1)
    assert MaterializeOptions(extra_path_grants=["/srv/data:rw"]).extra_path_grants == [Grant("/srv/data", False)]


@pytest.mark.parametrize("digest", [True, False])
async def test_reapply_replaces_a_directory_standing_on_a_copied_file(layout, base, digest):
    big = base / "proj" / "big.bin"
    big.write_bytes(os.urandom(300 * 1024))  # above the one-read size
    m = {"entries": {"p": {"type": "local_dir", "src": "proj"}, "one": {"type": "local_file", "src": "single.bin"}}}
    await apply(layout.ws, m, base_dir=str(base), digest=digest)
    for rel in ("p/a.txt", "p/big.bin", "one"):
        (layout.ws / rel).unlink()
        (layout.ws / rel).mkdir()
        (layout.ws / rel / "junk").write_text("junk")
    res = await apply(layout.ws, m, base_dir=str(base), digest=digest)
    assert (layout.ws / "p" / "a.txt").read_text() == "alpha\n"
    assert (layout.ws / "p" / "big.bin").read_bytes() == big.read_bytes()
    assert (layout.ws / "one").read_bytes() == (base / "single.bin").read_bytes()
    if digest:
        assert res.file("p/big.bin").sha256 == sha(big)


async def test_archive_entry_reapply_and_dir_sources(layout, base):
    m = {"entries": {"v": {"type": "archive", "src": "vendor.tar.gz", "format": "tar.gz"}}}
    for _ in range(2):
        res = await apply(layout.ws, m, base_dir=str(base))
        assert res.archives[0]["files"] == 1
        assert (layout.ws / "v" / "pkg" / "inner.txt").read_text() == "from the archive\n"
    with pytest.raises(SourceRefusedError, match="directory"):
        await apply(layout.ws, {"entries": {"x": {"type": "local_file", "src": "proj"}}}, base_dir=str(base))
    with pytest.raises(SandboxError) as ei:
        await apply(layout.ws, {"entries": {"x": {"type": "local_dir", "src": "single.bin"}}}, base_dir=str(base))
    assert str(base) not in str(ei.value)
    with pytest.raises(SandboxError) as ei:
        await apply(layout.ws, {"entries": {"x": {"type": "local_dir", "src": "missing"}}}, base_dir=str(base))
    assert str(base) not in str(ei.value) and "missing" in str(ei.value)


# ------------------------------------------------------------- limiter tokens


@pytest.mark.parametrize("which", ["limiter_entries", "limiter_files"])
@pytest.mark.parametrize("lim", ["zero", "not a limiter"])
def test_limiter_without_a_token_is_refused_when_the_options_are_made(which, lim):
    """CapacityLimiter(0) made materialize wait forever; now the options refuse it."""
    import trio

    from sandbox_fs.materialize import LimiterTokensError

    with pytest.raises(LimiterTokensError) as ei:
        MaterializeOptions(**{which: trio.CapacityLimiter(0) if lim == "zero" else object()})
    assert ei.value.code == "materialize_limiter_tokens" and isinstance(ei.value, ValueError)
    assert which in str(ei.value)


@pytest.mark.parametrize("which", ["limiter_entries", "limiter_files"])
async def test_limiter_lowered_to_zero_after_the_options_is_refused_when_used(layout, which):
    import trio

    from sandbox_fs.materialize import LimiterTokensError

    lim = trio.CapacityLimiter(2)
    opts = MaterializeOptions(**{which: lim})
    lim.total_tokens = 0  # trio allows it
    m = load_manifest({"entries": {"a.txt": {"type": "file", "content": "x"}}})
    with trio.fail_after(5):  # before the fix this hung forever
        with open_root(layout.ws) as ws, pytest.raises(LimiterTokensError):
            await materialize(ws, m, opts)
    assert not (layout.ws / "a.txt").exists()
