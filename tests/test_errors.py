"""The error family: codes, retryable, redaction, OSError compatibility, native smoke."""

from __future__ import annotations

import errno
import importlib
import pathlib
import pkgutil
import re

import pytest

from sandbox_fs import _native
from sandbox_fs import errors as errors_module
from sandbox_fs.errors import (InvalidPathError, PathEscapeError, ReadOnlyError, SandboxError,
                               SymlinkRefusedError, WorkspaceClosedError, redact)


def test_native_smoke():
    assert _native.lib.SFS_ABI_VERSION == _native.EXPECTED_ABI
    assert _native.RESOLVE_BENEATH == 0x08 and _native.RESOLVE_NO_MAGICLINKS == 0x02
    assert _native.MAX_SYMLINK_HOPS == 40


def test_base_is_abstract():
    with pytest.raises(TypeError):
        SandboxError("x")


def test_codes_are_stable_and_distinct():
    classes = [PathEscapeError, SymlinkRefusedError, ReadOnlyError, InvalidPathError, WorkspaceClosedError]
    codes = [c.code for c in classes]
    assert codes == ["path_escape", "symlink_refused", "read_only", "invalid_path", "workspace_closed"]
    assert all(c.retryable is False for c in classes)


def test_directory_replaced_is_a_retryable_oserror_with_a_stable_code():
    from sandbox_fs import DirectoryReplacedError

    e = DirectoryReplacedError("the directory was replaced by another process", sandbox_path=".sfs-extract-x")
    assert e.code == "directory_replaced" and e.retryable is True
    assert isinstance(e, OSError) and e.errno == errno.ESTALE
    assert str(e) == "directory_replaced [.sfs-extract-x]: the directory was replaced by another process"


def test_oserror_compat():
    e = PathEscapeError("no", sandbox_path="a/b")
    assert isinstance(e, PermissionError) and e.errno == errno.EXDEV and e.filename == "a/b"
    assert str(e) == "path_escape [a/b]: no"
    assert isinstance(SymlinkRefusedError("x"), OSError) and SymlinkRefusedError("x").errno == errno.ELOOP
    with pytest.raises(FileNotFoundError) as ei:
        _native.raise_errno(errno.ENOENT, "open", "p/q")
    assert ei.value.filename == "p/q" and ei.value.operation == "open"


def test_diagnostic_never_printed_and_secrets_redacted():
    e = InvalidPathError("bad token hunter2 in path", sandbox_path="x", diagnostic="/host/secret/path",
                         context={"value": "hunter2"}, secrets=["hunter2"])
    for text in (str(e), repr(e), str(e.to_dict())):
        assert "/host/secret/path" not in text
        assert "hunter2" not in text
    assert e.diagnostic == "/host/secret/path"
    assert redact("aXbXab", ["ab", "a"]) == "***XbX***"


# ---------------------------------------------------------------- the table of stable codes

_ROW = re.compile(r"^\s*\|\s*`(?P<code>[a-z_]+)`\s*\|\s*`(?P<cls>\w+)`\s*\|\s*(?P<where>[^|]+?)\s*\|"
                  r"\s*(?P<retryable>yes|no)\s*\|\s*$")


def _table_rows(text: str) -> dict[str, tuple[str, str, bool]]:
    """class name -> (code, import from, retryable), from the pipe table in ``text``."""
    rows: dict[str, tuple[str, str, bool]] = {}
    for line in text.splitlines():
        m = _ROW.match(line)
        if m:
            assert m["cls"] not in rows, f"{m['cls']} is listed twice"
            rows[m["cls"]] = (m["code"], m["where"].strip("`"), m["retryable"] == "yes")
    return rows


def _every_error_class() -> dict[str, type]:
    """Every SandboxError subclass the package defines (each submodule imported first)."""
    import sandbox_fs
    # The public paths, named explicitly so a package move that breaks one fails here too.
    for name in ("archive", "client", "exec", "manifest", "materialize", "paths", "root", "session",
                 "snapshot", "cli"):
        importlib.import_module(f"sandbox_fs.{name}")
    for mod in pkgutil.walk_packages(sandbox_fs.__path__, "sandbox_fs."):
        if not mod.name.endswith("__main__"):
            importlib.import_module(mod.name)
    found: dict[str, type] = {}
    todo = [SandboxError]
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith("sandbox_fs.") and cls.__name__ not in found:
            found[cls.__name__] = cls
        todo.extend(cls.__subclasses__())
    return found


@pytest.mark.parametrize("doc", ["errors.py", "SECURITY.md"])
def test_the_table_of_stable_codes_matches_the_classes(doc):
    here = pathlib.Path(__file__).resolve().parent.parent
    text = (here / "SECURITY.md").read_text() if doc == "SECURITY.md" else errors_module.__doc__
    rows = _table_rows(text)
    classes = _every_error_class()
    assert sorted(set(classes) - set(rows)) == [], f"classes missing from the table in {doc}"
    assert sorted(set(rows) - set(classes)) == [], f"rows in {doc} name no class"
    for name, cls in classes.items():
        code, where, retryable = rows[name]
        assert (cls.code, cls.retryable) == (code, retryable), f"{name} in {doc}"
        if where.startswith("sandbox_fs"):
            assert getattr(importlib.import_module(where), name) is cls, f"{name} is not importable from {where}"
    own = [cls.code for cls in classes.values() if "code" in vars(cls)]
    assert len(own) == len(set(own)), "two classes define the same code"


def test_errors_all_lists_every_error_class_it_defines():
    defined = {n for n, v in vars(errors_module).items()
               if isinstance(v, type) and issubclass(v, SandboxError) and v.__module__ == errors_module.__name__}
    assert defined <= set(errors_module.__all__)
    assert "DirectoryReplacedError" in errors_module.__all__
