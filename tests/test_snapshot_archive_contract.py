"""The snapshot -> archive contract: archive's internal API for snapshot, and no reach-ins past it.

``sandbox_fs.archive`` re-exports the names of ``archive/_for_snapshot.py``
(keyword-only functions, not in its ``__all__``); these tests pin that they
behave exactly as the engine functions they front, and that no module outside
``sandbox_fs/archive/`` imports a private module of archive.
"""

from __future__ import annotations

import ast
import inspect
import io
import os
import tarfile
from pathlib import Path

import pytest

import sandbox_fs
import sandbox_fs.archive as archive
from sandbox_fs import open_root
from sandbox_fs.archive import (
    ArchiveFormatError,
    ArchiveLimitError,
    ArchiveLimits,
    ExtractPolicy,
    UnsafeArchiveMemberError,
    extract,
)
from sandbox_fs.archive import _for_snapshot, _names, _tar, _writer

CONTRACT = _for_snapshot.__all__
FUNCTIONS = ["extract_stream", "extract_streams", "normalize_member_name", "symlink_target_walk", "extracted_file_mode",
             "extracted_dir_mode", "mtime_is_applied"]


def test_contract_is_exported_by_archive_but_not_public():
    assert set(CONTRACT) == set(FUNCTIONS) | {"HeaderChainCheck", "STAGED_PATH_MAX"}
    for name in CONTRACT:
        assert getattr(archive, name) is getattr(_for_snapshot, name)
        assert name not in archive.__all__
    assert archive.STAGED_PATH_MAX == _writer.STAGED_PATH_MAX


@pytest.mark.parametrize("name", FUNCTIONS + ["HeaderChainCheck", "HeaderChainCheck.check", "HeaderChainCheck.admit"])
def test_contract_callables_take_keyword_arguments_only(name):
    obj = _for_snapshot
    for part in name.split("."):
        obj = getattr(obj, part)
    params = [p for p in inspect.signature(obj).parameters.values() if p.name != "self"]
    assert params and all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params), name


def test_positional_calls_are_refused():
    limits = ArchiveLimits()
    with pytest.raises(TypeError):
        archive.normalize_member_name(b"a", limits)  # type: ignore[misc]
    with pytest.raises(TypeError):
        archive.symlink_target_walk(b"a", b"b", limits)  # type: ignore[misc]
    with pytest.raises(TypeError):
        archive.extracted_file_mode(0o644)  # type: ignore[misc]
    with pytest.raises(TypeError):
        archive.extracted_dir_mode(0o755)  # type: ignore[misc]
    with pytest.raises(TypeError):
        archive.HeaderChainCheck(limits)  # type: ignore[misc]
    with pytest.raises(TypeError):
        archive.mtime_is_applied(0)  # type: ignore[misc]
    with pytest.raises(TypeError):
        archive.extract_stream(None, "d", io.BytesIO(), limits, ExtractPolicy())  # type: ignore[misc]


def _outcome(fn, *a, **kw):
    try:
        return ("ok", fn(*a, **kw))
    except (UnsafeArchiveMemberError, ArchiveLimitError) as exc:
        return (type(exc).__name__, getattr(exc, "rule", None), getattr(exc, "limit", None))


NAMES = [b"a", b"a/b/c", b"./a//b/", b"/etc/passwd", b"..", b"a/../../b", b"a\\..\\b", b"C:x", b"a\0b", b".",
         b"x" * 256, b"a/" * 40 + b"z", "caf\u00e9".encode(), b"\xff\xfe"]


@pytest.mark.parametrize("limits", [ArchiveLimits(), ArchiveLimits(max_depth=8, max_path_bytes=64)])
def test_normalize_member_name_is_the_engines_rule(limits):
    for name in NAMES + [os.fsdecode(n) for n in NAMES]:
        assert _outcome(archive.normalize_member_name, name=name, limits=limits) == \
            _outcome(_names.normalize_member, name, limits), name


@pytest.mark.parametrize("limits", [ArchiveLimits(), ArchiveLimits(max_depth=4, max_path_bytes=32)])
def test_symlink_target_walk_is_the_engines_rule(limits):
    cases = [(b"l", b"f"), (b"d/l", b"../f"), (b"d/e/l", b"../../x/y/z"), (b"l", b"/etc"), (b"l", b"../out"),
             (b"d/l", b"x/../../y"), (b"l", b"a/b/c/d/e/f"), (b"l", "t" * 40), (b"d/l", b"./.")]
    for link, target in cases:
        assert _outcome(archive.symlink_target_walk, link=link, target=target, limits=limits) == \
            _outcome(_names.symlink_walk, link, target, limits, link), (link, target)
    with pytest.raises(UnsafeArchiveMemberError) as ei:
        archive.symlink_target_walk(link=b"l", target=b"/x", limits=ArchiveLimits(), member="shown")
    assert ei.value.rule == "symlink_target"


def test_extracted_modes_are_the_engines_modes():
    for mode in [None, *range(0, 0o10000, 0o11), 0o4755, 0o2755, 0o1777, 0o7777]:
        assert archive.extracted_file_mode(mode=mode) == _writer.file_mode(mode)
        assert archive.extracted_dir_mode(mode=mode) == _writer.dir_mode(mode)


def _header(name: str, *, pax: dict[str, str] | None = None, fmt: int = tarfile.PAX_FORMAT) -> bytes:
    ti = tarfile.TarInfo(name)
    if pax:
        ti.pax_headers = pax
    return ti.tobuf(fmt, "utf-8", "surrogateescape")


def _engine_refuses(members: list[bytes], limits: ArchiveLimits, tmp_path: Path) -> bool:
    """Whether the extractor refuses an archive made of these headers (each a member without data)."""
    data = b"".join(members) + bytes(tarfile.RECORDSIZE)
    dst = tmp_path / f"x{len(os.listdir(tmp_path))}"
    dst.mkdir()
    with open_root(dst) as r:
        try:
            extract(r, "out", io.BytesIO(data), format="tar", limits=limits)
        except (ArchiveFormatError, ArchiveLimitError):
            return True
    return False


def test_header_chain_check_agrees_with_the_extractor(tmp_path, monkeypatch):
    limits = ArchiveLimits(max_header_bytes=4096)
    plain = _header("short")
    long_name = _header("nnnnnnnnn/" * 30 + "x")
    digits = _header("d", pax={"comment": "1" * 1500})
    huge = _header("h" * 5000)  # a PAX body over max_header_bytes
    for hdr, refused in ((plain, False), (long_name, False), (digits, False), (huge, True)):
        why, cost = archive.HeaderChainCheck(limits=limits).check(header=hdr, member="m")
        assert (why is not None) == refused == _engine_refuses([hdr], limits, tmp_path)
        if hdr is digits:
            assert why is None and cost == 1500 * 1500  # the digit run's squared length
    assert archive.HeaderChainCheck(limits=limits).check(header=plain, member="m") == (None, 0)
    # the archive budget: what one chain may spend, the archive's total may not exceed (admit counts it)
    monkeypatch.setattr(_tar, "PAX_DIGIT_COST_ARCHIVE", 3 * 1500 * 1500 - 1)
    check = archive.HeaderChainCheck(limits=limits)
    verdicts = []
    for _ in range(3):
        why, cost = check.check(header=digits, member="m")
        verdicts.append(why is None)
        if why is None:
            check.admit(cost=cost)
    assert verdicts == [True, True, False]
    assert _engine_refuses([digits] * 3, limits, tmp_path) and not _engine_refuses([digits] * 2, limits, tmp_path)


def test_header_chain_check_refuses_a_chain_longer_than_the_engine_reads():
    ti = tarfile.TarInfo("x")
    one = _header("g" * 200, fmt=tarfile.GNU_FORMAT)[:-512]  # one GNU long-name extension header and body
    chain = one * _tar.MAX_HEADER_CHAIN + ti.tobuf(tarfile.USTAR_FORMAT)
    why, _cost = archive.HeaderChainCheck(limits=ArchiveLimits()).check(header=chain, member="x")
    assert why is not None and "extension headers" in why


def _tar_bytes(entries) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, mode, data in entries:
            ti = tarfile.TarInfo(name)
            ti.type, ti.mode, ti.size = kind, mode, len(data)
            tar.addfile(ti, io.BytesIO(data) if data else None)
    return buf.getvalue()


def test_extract_stream_is_extract_plus_made_identity_and_exact_modes(tmp_path):
    data = _tar_bytes([("d", tarfile.DIRTYPE, 0o555, b""), ("d/f", tarfile.REGTYPE, 0o400, b"hello"),
                       ("g", tarfile.REGTYPE, 0o640, b"x" * 3000)])
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    policy = ExtractPolicy(in_place=False)
    with open_root(a) as ra, open_root(b) as rb:
        want = extract(ra, "out", io.BytesIO(data), format="tar", policy=policy)
        made: list[tuple[int, int]] = []
        got = archive.extract_stream(root=rb, dest="out", source=io.BytesIO(data), limits=ArchiveLimits(),
                                     policy=policy, made=made, exact_modes={b"d/f": 0o400, b"d": 0o555})
    assert got == want
    st = os.lstat(b / "out")
    assert made == [(st.st_dev, st.st_ino)]
    assert os.stat(a / "out" / "d" / "f").st_mode & 0o7777 == _writer.file_mode(0o400) == 0o600
    assert os.stat(b / "out" / "d" / "f").st_mode & 0o7777 == 0o400  # exact
    assert os.stat(b / "out" / "d").st_mode & 0o7777 == 0o555
    assert os.stat(b / "out" / "g").st_mode & 0o7777 == os.stat(a / "out" / "g").st_mode & 0o7777
    assert (b / "out" / "d" / "f").read_bytes() == b"hello"
    os.chmod(b / "out" / "d", 0o755)


def test_extract_stream_refusal_leaves_nothing_and_reports_no_directory(tmp_path):
    bad = _tar_bytes([("ok", tarfile.REGTYPE, 0o644, b"1"), ("../evil", tarfile.REGTYPE, 0o644, b"2")])
    (tmp_path / "w").mkdir()
    made: list[tuple[int, int]] = []
    with open_root(tmp_path / "w") as r, pytest.raises(UnsafeArchiveMemberError):
        archive.extract_stream(root=r, dest="out", source=io.BytesIO(bad), limits=ArchiveLimits(),
                               policy=ExtractPolicy(in_place=False), made=made)
    assert os.listdir(tmp_path / "w") == []  # atomic: nothing new remains
    assert made == []  # the staged directory never became ``out``


def _private_archive_imports(path: Path, root: Path) -> list[str]:
    """Imports in ``path`` of a private module of sandbox_fs.archive (or a private name from it)."""
    package = list(path.relative_to(root.parent).parts[:-1])  # e.g. ["sandbox_fs", "snapshot"]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            mods = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            mods = [(mod, [a.name for a in node.names])]
        else:
            continue
        for mod, names in mods:
            parts = mod.split(".")
            if parts[:2] != ["sandbox_fs", "archive"]:
                continue
            if len(parts) > 2 and parts[2].startswith("_"):
                found.append(f"{path}:{node.lineno}: {mod}")
            elif len(parts) == 2 and names and any(n.startswith("_") for n in names):
                found.append(f"{path}:{node.lineno}: from {mod} import {', '.join(names)}")
    return found


def test_no_module_outside_archive_imports_archives_private_modules():
    root = Path(sandbox_fs.__file__).parent
    bad = []
    for path in sorted(root.rglob("*.py")):
        if (root / "archive") in path.parents:
            continue
        bad += _private_archive_imports(path, root)
    assert bad == []


def test_the_scan_finds_each_spelling_of_a_reach_in(tmp_path):
    pkg = tmp_path / "sandbox_fs"
    (pkg / "snapshot").mkdir(parents=True)
    spellings = ["from .archive._writer import dir_mode", "from ..archive._extract import _extract",
                 "from sandbox_fs.archive._names import normalize_member", "import sandbox_fs.archive._tar",
                 "from .archive import _writer", "from sandbox_fs.archive import _names"]
    for i, line in enumerate(spellings):
        where = pkg / "snapshot" if line.startswith("from ..") else pkg
        (where / f"m{i}.py").write_text(line + "\n")
        assert len(_private_archive_imports(where / f"m{i}.py", pkg)) == 1, line
    (pkg / "ok.py").write_text("from .archive import extract_stream, STAGED_PATH_MAX\nimport sandbox_fs.archive\n")
    assert _private_archive_imports(pkg / "ok.py", pkg) == []
