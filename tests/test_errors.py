"""The error family: codes, retryable, redaction, OSError compatibility, native smoke."""

from __future__ import annotations

import errno

import pytest

from sandbox_fs import _native
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
