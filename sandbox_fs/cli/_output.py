"""What the ``sandbox-fs`` CLI writes: the one place untrusted text is made safe for a terminal.

Names chosen by a confined command, an archive or a snapshot (and so any
text that may embed them) are hostile: a name such as ``ESC]0;pwned BEL`` or
``ESC[2J`` would retitle or clear the operator's terminal, and a C1 control
such as U+009B is a CSI to many terminals.  Every text line the CLI prints
goes through :func:`escape_text`; every JSON document through
:func:`json_text`.

Text rule (the ``ls -b`` style, in hex): a character that
:meth:`str.isprintable` accepts is kept, except the backslash, which is
doubled (``\\`` -> ``\\\\``).  Every other character is written as the bytes
it stands for, each as ``\\xNN``: C0 controls and DEL (``ESC`` -> ``\\x1b``),
C1 controls by their UTF-8 bytes (U+009B -> ``\\xc2\\x9b``), invisible
format characters such as the bidi overrides of CVE-2021-42574 (U+202E ->
``\\xe2\\x80\\xae``), line and paragraph separators, unassigned and private-use
code points, and an undecodable byte of a name (held as a surrogateescape
code point U+DC80-U+DCFF) as that byte (``\\xff``).  The result is printable
text with no control character (C0, DEL or C1), and it is unambiguous: reading
``\\\\`` as ``\\`` and ``\\xNN`` as the byte NN, everything else as its UTF-8
bytes, gives back the exact bytes of the name.

Free text (an error's reason, a usage message, the confined command's own
output shown on a terminal) uses the same function with ``keep_backslash``:
controls are escaped the same way but a backslash stays as it is, because
such text may already hold names escaped by these rules (archive member
names in archive errors, see :func:`sandbox_fs.archive.show_name`), or is
ordinary program output.  The sandbox path of an error, in ``[...]``, is
always escaped in full, so it is the exact form of the path.

JSON rule: ``json.dumps(..., ensure_ascii=True)``: every non-ASCII character,
control and lone surrogate is a ``\\uNNNN`` escape, so no raw control byte is
written.  Names travel as Python ``str``: an undecodable byte NN of a host
name is the lone surrogate ``\\udcNN`` (Python's surrogateescape, PEP 383);
``os.fsencode(json.loads(...)[...])`` gives back the exact bytes.
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, TextIO

if TYPE_CHECKING:
    import argparse

__all__ = ["escape_text", "one_line", "json_text", "error_line", "report_lines", "print_report",
           "progress_printer", "write_command_output"]

_SAFE: dict[str, str] = {}


def _escape_char(ch: str) -> str:
    code = ord(ch)
    if 0xDC80 <= code <= 0xDCFF:  # surrogateescape: one undecodable byte of a name
        raw = bytes((code - 0xDC00,))
    else:  # surrogatepass: a lone surrogate that no fsdecode'd name holds, still shown exactly
        raw = ch.encode("utf-8", "surrogatepass")
    return "".join(f"\\x{b:02x}" for b in raw)


def escape_text(text: str | bytes, *, keep_backslash: bool = False, keep: str = "") -> str:
    """Return ``text`` safe to write to a terminal, one line, by the rule in the module docstring.

    Args:
        text: a name, a sandbox path or a line (``str``, possibly holding
            surrogateescape'd bytes), or ``bytes`` (decoded as UTF-8, an
            undecodable byte kept as the byte).
        keep_backslash: keep ``\\`` as it is (free text, see the module
            docstring) instead of doubling it (names, paths: unambiguous).
        keep: characters written as they are although not printable; only
            ``"\\n"`` and ``"\\t"`` are accepted (the command's own output on a
            terminal keeps its lines).

    Returns:
        ``str`` of printable characters only (plus those in ``keep``).

    Raises:
        ValueError: ``keep`` names another character.
    """
    if set(keep) - {"\n", "\t"}:
        raise ValueError("keep may only hold newline and tab")
    if isinstance(text, bytes):
        text = text.decode("utf-8", "surrogateescape")
    if text.isprintable():  # fast path: nothing to escape but maybe a backslash
        return text if keep_backslash else text.replace("\\", "\\\\")
    out = []
    for ch in text:
        if ch == "\\":
            out.append(ch if keep_backslash else "\\\\")
        elif ch in keep:
            out.append(ch)
        else:
            safe = _SAFE.get(ch)
            if safe is None:
                safe = ch if ch.isprintable() else _escape_char(ch)
                if len(_SAFE) < 4096:
                    _SAFE[ch] = safe
            out.append(safe)
    return "".join(out)


def one_line(text: object) -> str:
    """``text`` with every run of whitespace (newlines included) made one space."""
    return " ".join(str(text).split())


def json_text(data: Any, **kw: Any) -> str:
    """``data`` as JSON with only ASCII in it (``ensure_ascii``), keys sorted unless told otherwise."""
    kw.setdefault("sort_keys", True)
    return json.dumps(data, ensure_ascii=True, **kw)


def report_lines(data: Mapping[str, Any]) -> list[str]:
    """A text report: ``key=value ...`` (None left out), then one line per skipped entry.

    Every value is escaped with :func:`escape_text`.  A ``skipped`` list of
    ``{"path", "reason"}`` shows as ``skipped=N`` in the first line and as
    ``skipped [path]: reason`` lines after it.
    """
    skipped = data.get("skipped") or []
    head = " ".join(f"{escape_text(str(k))}={escape_text(str(len(v) if k == 'skipped' else v))}"
                    for k, v in data.items() if v is not None)
    tail = [f"skipped [{escape_text(str(s.get('path')))}]: "
            f"{escape_text(one_line(s.get('reason', '')), keep_backslash=True)}" for s in skipped]
    return [head, *tail]


def print_report(args: argparse.Namespace, data: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
    """Print a report (or a list of them, one per row) on stdout: JSON with ``--json``, else
    :func:`report_lines`."""
    if args.json:
        print(json_text(data))
    else:
        rows: Sequence[Mapping[str, Any]] = data if isinstance(data, list) else [data]  # type: ignore[list-item]
        for row in rows:
            print("\n".join(report_lines(row)))


def progress_printer() -> Callable[[int, int], None] | None:
    """A ``progress(entries, nbytes)`` callback redrawing one ``persisting:`` line on stderr, or
    None when stderr is not a terminal."""
    if not sys.stderr.isatty():
        return None

    def show(entries: int, nbytes: int) -> None:
        print(f"\rpersisting: {entries} entries, {nbytes / (1 << 20):.1f} MiB", end="", file=sys.stderr, flush=True)

    return show


def error_line(exc: BaseException) -> str:
    """The CLI's one-line text for a refusal (``SandboxError``) or an ``OSError``, escaped.

    ``code [sandbox path]: reason``: the path escaped in full, the reason's
    whitespace made single spaces and its controls escaped (backslash kept).
    """
    from ..errors import SandboxError  # noqa: PLC0415

    if isinstance(exc, SandboxError):
        path = exc.sandbox_path
        where = f" [{escape_text(path)}]" if path is not None else ""
        return f"{escape_text(exc.code)}{where}: {escape_text(one_line(exc.reason), keep_backslash=True)}"
    if isinstance(exc, OSError):
        what = os.strerror(exc.errno) if exc.errno else type(exc).__name__
        name = exc.filename
        if isinstance(name, bytes):
            name = os.fsdecode(name)
        where = f" [{escape_text(name)}]" if isinstance(name, str) else ""
        op = getattr(exc, "operation", None)
        return f"os_error{where}: {escape_text(what)}{f' ({escape_text(str(op))})' if op else ''}"
    return escape_text(one_line(str(exc)), keep_backslash=True)


def write_command_output(data: bytes, stream: TextIO) -> None:
    """Write the confined command's captured output to ``stream``.

    To a terminal (``isatty``) the output is escaped with
    :func:`escape_text` (``keep="\\n\\t"``, backslash kept): the command is
    hostile and must not drive the operator's terminal.  To a pipe or a file
    the bytes go through unchanged (``sandbox-fs run ... | cat`` gets them
    raw), as ``ls`` escapes names only for a terminal.
    """
    if not data:
        return
    stream.flush()
    if stream.isatty():
        data = escape_text(data, keep_backslash=True, keep="\n\t").encode("utf-8", "backslashreplace")
    stream.buffer.write(data)
    stream.buffer.flush()
