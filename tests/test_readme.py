"""The README's embedding example runs as written (so it cannot drift from the API)."""

from __future__ import annotations

import pathlib
import re

import pytest

import sandbox_fs

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
MARKER = "<!-- embedding-example:"


def _embedding_example(marker: str = MARKER) -> str:
    text = README.read_text()
    assert text.count(marker) == 1, f"README.md must mark exactly one {marker!r} example"
    after = text[text.index(marker):]
    m = re.search(r"^```python\n(.*?)^```$", after, re.S | re.M)
    assert m is not None and after[:m.start()].count("\n") == 1, "the marker must stand right above a python block"
    return m.group(1)


def test_readme_embedding_example_runs():
    code = _embedding_example()
    assert "client.create(manifest=" in code and "client.resume(" in code and "session.exec(" in code
    if not sandbox_fs.features()["landlock_abi"]:  # pragma: no cover - every CI machine has Landlock
        import pytest

        pytest.skip("the example runs a confined command, which needs Landlock here")
    exec(compile(code, f"{README}:embedding-example", "exec"), {"__name__": "readme_example"})


def test_readme_library_example_runs(tmp_path):
    """The Library section's first block, with its workspace path pointed at a fresh directory."""
    code = _embedding_example("<!-- library-example:")
    assert code.count('"/srv/workspaces/job-42"') == 1
    ws = tmp_path / "job-42"
    ws.mkdir()
    code = code.replace('"/srv/workspaces/job-42"', repr(str(ws)))
    with pytest.raises(sandbox_fs.PathEscapeError) as ei:
        exec(compile(code, f"{README}:library-example", "exec"), {"__name__": "readme_library"})
    assert ei.value.code == "path_escape"
    assert (ws / "notes" / "hello.txt").read_text() == "hi\n"
    assert (ws / "notes" / "hello.txt").stat().st_mode & 0o777 == 0o600
