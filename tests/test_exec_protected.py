"""Protected and unreadable paths (issue 14, part 3): ``ConfinementPolicy.protected`` and ``deny_read``.

Every command runs as the leased non-root identity on this root host, with
the read-only mount layer (and once in the FUSE overlay's private root).
Each refusal has a positive control in the same command: a file that is not
protected is written, so a command that cannot write at all fails the test.
Files are checked host-side after the run (they are the outside sentinel).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

import sandbox_fs
from sandbox_fs import exec as sfs_exec
from sandbox_fs import open_root
from sandbox_fs.exec import ConfinementPolicy, PrivateRoot, run_confined
from sandbox_fs.exec import DEFAULT_PROTECTED
from sandbox_fs.exec._protected import check_pattern

ABI = sandbox_fs.features()["landlock_abi"]

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the leased identity needs a root host"),
    pytest.mark.skipif(not os.access(sfs_exec.helper_path(), os.X_OK), reason="sandbox_fs/sfs-exec is not built"),
    pytest.mark.skipif(ABI == 0, reason="features()['landlock_abi'] is 0: the kernel has no Landlock"),
]

POLICY = ConfinementPolicy(protected=DEFAULT_PROTECTED, deny_read=(".env", "secrets/"))

#: Existing protected files and what they hold.
FILES = {
    ".git/config": "[core]\n",
    ".git/hooks/pre-commit": "#!/bin/sh\ntrue\n",
    ".bashrc": "# rc\n",
    ".profile": "# profile\n",
    ".vscode/tasks.json": "{}\n",
    ".vscode/settings.json": "{}\n",
    ".idea/runConfigurations/run.xml": "<x/>\n",
}


def sh(script: str) -> list[str]:
    return ["/bin/sh", "-c", script]


@pytest.fixture
def base():
    """A temp dir under /tmp every uid may search (pytest's tmp_path sits under a 0700 directory)."""
    d = Path(tempfile.mkdtemp(prefix="sfs-protected-"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d)


def _fill(ws: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = ws / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


async def _run(ws: Path, script: str, policy: ConfinementPolicy = POLICY, **kw):
    root = open_root(ws)
    try:
        return await run_confined(sh(script), workspace=root, workspace_host_path=str(ws), policy=policy, **kw)
    finally:
        root.close()


def _attempts(paths) -> str:
    """A script trying to overwrite, append to, remove and replace each path; prints ``WROTE path`` on success."""
    out = []
    for p in paths:
        out.append(f"(echo evil > '{p}') 2>/dev/null && echo 'WROTE {p}'")
        out.append(f"(echo evil >> '{p}') 2>/dev/null && echo 'WROTE {p}'")
        out.append(f"rm -f '{p}' 2>/dev/null; [ -e '{p}' ] || echo 'WROTE {p}'")
        out.append(f"(echo evil > /tmp/x.$$ && mv -f /tmp/x.$$ '{p}') 2>/dev/null && echo 'WROTE {p}'")
        out.append(f"(touch -d 2001-01-01 '{p}') 2>/dev/null && echo 'WROTE {p}'")
        out.append(f"ln '{p}' ./link.$$ 2>/dev/null && echo 'WROTE {p}'")  # a second name to write through
    return "\n".join(out)


async def test_each_default_protected_file_refuses_writes_and_stays_the_same(base):
    ws = base / "ws"
    _fill(ws, FILES)
    before = {rel: ((ws / rel).read_text(), (ws / rel).stat().st_mtime_ns) for rel in FILES}
    script = _attempts(FILES) + "\n(echo ok > free.txt && mkdir -p src && echo ok > src/a.py) && echo FREE-OK"
    r = await _run(ws, script)
    assert r.read_only_mounts and r.identity is not None and r.identity[0] != 0
    out = r.stdout.decode()
    assert "WROTE" not in out, out
    assert "FREE-OK" in out, r.stderr  # the rest of the workspace stays writable
    for rel, (text, mtime) in before.items():
        assert (ws / rel).read_text() == text and (ws / rel).stat().st_mtime_ns == mtime, rel
    assert (ws / "src" / "a.py").read_text() == "ok\n"


async def test_a_protected_directory_refuses_new_entries(base):
    ws = base / "ws"
    _fill(ws, {".git/hooks/pre-commit": "#!/bin/sh\n"})
    r = await _run(ws, "(echo evil > .git/hooks/post-checkout) 2>/dev/null && echo WROTE; "
                       "mkdir .git/hooks/d 2>/dev/null && echo WROTE; echo ok > .git/HEAD && echo HEAD-OK")
    assert "WROTE" not in r.stdout.decode()
    assert "HEAD-OK" in r.stdout.decode(), r.stderr  # .git itself is not protected
    assert sorted(os.listdir(ws / ".git" / "hooks")) == ["pre-commit"]


async def test_missing_protected_paths_cannot_be_created_and_placeholders_go_away(base):
    ws = base / "ws"
    ws.mkdir()
    (ws / "keep.txt").write_text("x\n")
    script = ("(echo evil > .bashrc) 2>/dev/null && echo WROTE-rc; "
              "(mkdir -p .git/hooks && echo evil > .git/hooks/pre-commit) 2>/dev/null && echo WROTE-hook; "
              "(echo '[core]' > .git/config) 2>/dev/null && echo WROTE-config; "
              "(echo '{}' > .vscode/tasks.json) 2>/dev/null && echo WROTE-tasks; "
              "echo ok > .vscode/extensions.json && echo FREE-OK")
    r = await _run(ws, script)
    out = r.stdout.decode()
    assert "WROTE" not in out, out
    assert "FREE-OK" in out, r.stderr  # a missing parent is made as an ordinary directory
    # After the run: every placeholder is gone, the command's own file stays.
    assert not (ws / ".bashrc").exists() and not (ws / ".git").exists()
    assert sorted(os.listdir(ws / ".vscode")) == ["extensions.json"]
    assert sorted(os.listdir(ws)) == sorted([".home", ".tmp", ".vscode", "keep.txt"])


async def test_a_symlinked_protected_path_protects_the_link_never_the_target(base):
    ws = base / "ws"
    outside = base / "outside"
    outside.mkdir()
    sentinel = outside / "rc"
    sentinel.write_text("HOST\n")
    _fill(ws, {"dotfiles/zshrc": "# z\n"})
    os.symlink("dotfiles/zshrc", ws / ".zshrc")
    os.symlink(str(sentinel), ws / ".bashrc")
    script = ("rm -f .zshrc 2>/dev/null; [ -L .zshrc ] || echo WROTE-unlink; "
              "ln -sfn evil .zshrc 2>/dev/null; [ \"$(readlink .zshrc)\" = dotfiles/zshrc ] || echo WROTE-relink; "
              "mv .bashrc moved 2>/dev/null && echo WROTE-mv; "
              "(echo evil > .bashrc) 2>/dev/null && echo WROTE-outside; "
              "echo ok > dotfiles/other && echo FREE-OK")
    r = await _run(ws, script)
    out = r.stdout.decode()
    assert "WROTE" not in out, out
    assert "FREE-OK" in out, r.stderr
    assert os.readlink(ws / ".zshrc") == "dotfiles/zshrc" and os.readlink(ws / ".bashrc") == str(sentinel)
    assert sentinel.read_text() == "HOST\n"


async def test_renaming_the_parent_and_recreating_is_refused(base):
    ws = base / "ws"
    _fill(ws, {".git/config": "[core]\n", ".git/hooks/pre-commit": "#!/bin/sh\n", "sub/.bashrc": "x\n"})
    script = ("mv .git .git-old 2>/dev/null && echo WROTE-mv; "
              "mv .git/hooks .git/hooks-old 2>/dev/null && echo WROTE-mv-hooks; "
              "(mkdir -p .git/hooks && echo evil > .git/hooks/pre-commit) 2>/dev/null && echo WROTE-hook; "
              "rmdir .vscode 2>/dev/null; mv sub sub2 && echo FREE-OK")
    r = await _run(ws, script)
    out = r.stdout.decode()
    assert "WROTE" not in out, out
    assert "FREE-OK" in out, r.stderr  # a directory holding no protected path moves freely
    assert (ws / ".git" / "config").read_text() == "[core]\n"
    assert (ws / ".git" / "hooks" / "pre-commit").read_text() == "#!/bin/sh\n"
    assert not (ws / ".git-old").exists()


async def test_deny_read_hides_files_and_directories(base):
    ws = base / "ws"
    _fill(ws, {".env": "TOKEN=s3cret\n", "secrets/key": "KEY\n", "public.txt": "pub\n"})
    r = await _run(ws, "cat .env; ls secrets; cat secrets/key; (echo x > .env) 2>/dev/null && echo WROTE; "
                       "cat public.txt")
    out = r.stdout.decode()
    assert "s3cret" not in out and "KEY" not in out and "WROTE" not in out, out
    assert "pub" in out, r.stderr
    assert (ws / ".env").read_text() == "TOKEN=s3cret\n" and (ws / "secrets" / "key").read_text() == "KEY\n"


async def test_a_glob_protects_each_match_and_a_glob_matching_nothing_protects_nothing(base):
    ws = base / "ws"
    _fill(ws, {"ci/a.yml": "a\n", "ci/b.yml": "b\n", "ci/c.txt": "c\n"})
    pol = ConfinementPolicy(protected=("ci/*.yml", "nothing/*.cfg"))
    r = await _run(ws, "for f in ci/a.yml ci/b.yml; do (echo evil > $f) 2>/dev/null && echo WROTE $f; done; "
                       "echo ok > ci/c.txt && mkdir -p nothing && echo ok > nothing/x.cfg && echo FREE-OK", pol)
    assert "WROTE" not in r.stdout.decode() and "FREE-OK" in r.stdout.decode(), (r.stdout, r.stderr)
    assert (ws / "ci" / "a.yml").read_text() == "a\n" and (ws / "nothing" / "x.cfg").read_text() == "ok\n"


async def test_without_protected_paths_the_same_writes_succeed(base):
    """The control: the default policy leaves the same files writable (so the refusals above are the feature's)."""
    ws = base / "ws"
    _fill(ws, {".git/config": "[core]\n", ".bashrc": "# rc\n"})
    r = await _run(ws, "echo evil > .git/config && echo evil > .bashrc && echo DONE", ConfinementPolicy())
    assert "DONE" in r.stdout.decode(), r.stderr
    assert (ws / ".git" / "config").read_text() == "evil\n"


def test_patterns_are_checked():
    for bad in ("", "/etc/passwd", "../x", "a/../b", "a//b", "./a", "a/**/b"):
        with pytest.raises(ValueError):
            check_pattern(bad)
    assert check_pattern(".git/hooks/") == [b".git", b"hooks"]


async def test_in_the_overlays_private_root(base):
    """The FUSE overlay's clone at workspace_path: the binds are made inside it after it is placed."""
    from sandbox_fs.fuse import Overlay, OverlayPolicy, OverlayUnavailableError

    backing = base / "backing"
    _fill(backing, {".git/config": "[core]\n", ".env": "TOKEN=s3cret\n", "hello.txt": "hi\n"})
    backing_root = open_root(backing)
    try:
        try:
            ov = await Overlay.start(backing_root, policy=OverlayPolicy())
        except OverlayUnavailableError as exc:
            pytest.skip(f"the FUSE overlay is unavailable here: {exc}")
        try:
            script = ("(echo evil > .git/config) 2>/dev/null && echo WROTE-config; "
                      "mv .git .git2 2>/dev/null && echo WROTE-mv; "
                      "(echo evil > .bashrc) 2>/dev/null && echo WROTE-rc; cat .env; "
                      "echo ok > free.txt && cat hello.txt && echo FREE-OK")
            r = await run_confined(sh(script), workspace=ov.root, workspace_host_path=str(backing), policy=POLICY,
                                   private_root=PrivateRoot(ov.mount_fd))
        finally:
            await ov.aclose()
    finally:
        backing_root.close()
    out = r.stdout.decode()
    assert r.overlay
    assert "WROTE" not in out and "s3cret" not in out, out
    assert "FREE-OK" in out, r.stderr
    assert (backing / ".git" / "config").read_text() == "[core]\n"
    assert (backing / "free.txt").read_text() == "ok\n"
    assert not (backing / ".bashrc").exists()


async def test_a_pty_session_keeps_its_placeholders_until_it_ends(base):
    from sandbox_fs.exec import ProcessSupervisor, PtyManager

    ws = base / "ws"
    ws.mkdir()
    root = open_root(ws)
    sup = ProcessSupervisor()
    ptys = PtyManager(sup)
    try:
        pty_id, out = await ptys.pty_exec_start(
            sh("(echo evil > .bashrc) 2>/dev/null && echo WROTE; echo ok > free.txt && echo done"), workspace=root,
            workspace_host_path=str(ws), policy=ConfinementPolicy(protected=(".bashrc",)), first_output_timeout_s=5)
        while b"done" not in out:
            more = await ptys.pty_read(pty_id, timeout_s=5)
            if not more:
                break
            out += more
        assert b"WROTE" not in out and b"done" in out, out
        assert (ws / ".bashrc").read_bytes() == b""  # the placeholder, while the session lives
        await ptys.pty_terminate(pty_id)
        assert not (ws / ".bashrc").exists()
    finally:
        await ptys.aclose()
        await sup.aclose()
        root.close()


def test_policy_fields_are_checked():
    with pytest.raises(ValueError):
        ConfinementPolicy(protected=".git/config")  # type: ignore[arg-type]  # a str, not a tuple
    with pytest.raises(ValueError):
        ConfinementPolicy(deny_read=("../outside",))


async def test_a_protected_path_without_the_mount_layer_is_refused_when_required(base):
    from sandbox_fs.exec import ConfinementError

    ws = base / "ws"
    ws.mkdir()
    with pytest.raises(ConfinementError):
        await _run(ws, "true", ConfinementPolicy(protected=(".bashrc",), read_only_mounts=False),
                   confinement="required")


async def test_protected_paths_apply_in_a_read_write_grant_too(base):
    from sandbox_fs import Grant, PathPolicy

    ids = (0x6F00_4568, 0x6F00_4568)
    ws = base / "ws"
    ws.mkdir()
    home = base / "home"
    home.mkdir()
    (home / ".bashrc").write_text("# rc\n")
    os.chown(home, *ids)
    root = open_root(ws)
    grants = PathPolicy(root, "/workspace", [Grant(str(home), read_only=False)])
    try:
        script = (f"(echo evil >> {home}/.bashrc) 2>/dev/null && echo WROTE-rc; "
                  f"(echo evil > {home}/.profile) 2>/dev/null && echo WROTE-profile; "
                  f"mv {home}/.bashrc {home}/x 2>/dev/null && echo WROTE-mv; "
                  f"echo ok > {home}/notes.txt && echo FREE-OK")
        r = await run_confined(sh(script), workspace=root, workspace_host_path=str(ws), grants=grants,
                               policy=ConfinementPolicy(identity=ids, protected=(".bashrc", ".profile")))
    finally:
        grants.close()
        root.close()
    out = r.stdout.decode()
    assert "WROTE" not in out, out
    assert "FREE-OK" in out, r.stderr
    assert (home / ".bashrc").read_text() == "# rc\n" and not (home / ".profile").exists()
    assert (home / "notes.txt").read_text() == "ok\n"


def test_the_command_line_flags(base):
    import json
    import subprocess
    import sys

    (base / "src").mkdir()
    manifest = {"entries": {".bashrc": {"type": "file", "content": "# rc\n"},
                            ".env": {"type": "file", "content": "TOKEN=s3cret\n"}}}
    (base / "m.json").write_text(json.dumps(manifest))
    (base / "wsdir").mkdir()
    common = [sys.executable, "-m", "sandbox_fs", "run", "--manifest", str(base / "m.json"), "--base", str(base / "src"),
              "--workspaces-dir", str(base / "wsdir"), "--snapshot-dir", str(base / "snaps")]
    script = "(echo evil > .bashrc) 2>/dev/null && echo WROTE; cat .env; cat .bashrc; echo ok > free && echo FREE-OK"
    r = subprocess.run([*common, "--protect-defaults", "--deny-read", ".env", "--", "/bin/sh", "-c", script],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "WROTE" not in r.stdout and "s3cret" not in r.stdout, r.stdout
    assert "# rc" in r.stdout and "FREE-OK" in r.stdout, r.stderr
    bad = subprocess.run([*common, "--protect", "../x", "--", "/bin/true"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "pattern" in bad.stderr, bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr


async def test_a_hard_linked_protected_file_is_refused(base):
    """A bind covers one name: another link would still write the inode, so the run is refused."""
    from sandbox_fs.exec import ConfinementError

    ws = base / "ws"
    _fill(ws, {".git/config": "[core]\n"})
    os.link(ws / ".git" / "config", ws / "alias")
    with pytest.raises(ConfinementError, match="hard links"):
        await _run(ws, "echo evil > alias", ConfinementPolicy(protected=(".git/config",)))
    assert (ws / ".git" / "config").read_text() == "[core]\n"
    assert not (ws / ".git" / "hooks").exists()  # nothing made for a refused run
