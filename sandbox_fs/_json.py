"""JSON from untrusted bytes: every failure is a :class:`ValueError`, and nesting is bounded.

:func:`json.loads` raises :class:`RecursionError` (not a ``ValueError``) for
a document nested deeper than the interpreter's recursion limit allows
from the caller's stack (``[`` repeated 100 000 times is 100 kB), and a
document that parses just below that limit can still exhaust the stack of
whatever walks it next (``json.dumps`` for a MAC, pydantic, ``repr``).
Every parse of bytes a store, a state file or a peer process supplied goes
through :func:`loads_untrusted`, which turns both into the ``ValueError``
its caller already maps to a refusal with a stable code.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MAX_DEPTH", "check_depth", "loads_untrusted"]

#: deepest nesting of arrays and objects accepted (the formats read this way nest at most 4 deep)
MAX_DEPTH = 64


def check_depth(doc: Any, max_depth: int = MAX_DEPTH) -> None:
    """Refuse a decoded JSON value nesting lists/dicts deeper than ``max_depth`` (iteratively: no recursion).

    Raises:
        ValueError: it nests deeper.
    """
    stack: list[tuple[Any, int]] = [(doc, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            value = value.values()
        elif not isinstance(value, list):
            continue
        if depth >= max_depth:
            raise ValueError(f"JSON nests deeper than {max_depth}")
        stack.extend((v, depth + 1) for v in value if isinstance(v, (list, dict)))


def loads_untrusted(data: str | bytes | bytearray, *, max_depth: int | None = MAX_DEPTH) -> Any:
    """:func:`json.loads` of untrusted ``data``, nesting at most ``max_depth`` (None: only the parser's bound).

    Args:
        data: the JSON text (``bytes`` are decoded as UTF-8/16/32, as json does).
        max_depth: deepest nesting of arrays and objects; None for a caller
            that checks the shape of every value itself.

    Raises:
        ValueError: not JSON (:class:`json.JSONDecodeError`, :class:`UnicodeDecodeError`),
            nested too deeply for the parser, or deeper than ``max_depth``.
    """
    try:
        doc = json.loads(data)
    except RecursionError:
        raise ValueError("JSON nests too deeply to parse") from None
    if max_depth is not None:
        check_depth(doc, max_depth)
    return doc
