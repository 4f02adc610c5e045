"""The README's embedding example runs as written (so it cannot drift from the API)."""

from __future__ import annotations

import pathlib
import re

import sandbox_fs

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
MARKER = "<!-- embedding-example:"


def _embedding_example() -> str:
    text = README.read_text()
    assert text.count(MARKER) == 1, "README.md must mark exactly one embedding example"
    after = text[text.index(MARKER):]
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
