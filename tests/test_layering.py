"""The package's layering, checked on the source with ``ast``.

* ``Root``'s private methods and attributes are internal to the root modules
  (``root.py`` and ``_root_*.py``): every other module uses the public
  methods or the named internal contract of ``_root_walk``.
* The compiled module is reached only through ``_native.py``: no other
  module touches ``_native.lib`` / ``_native.ffi`` or imports ``_sfs_native``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import sandbox_fs
from sandbox_fs.root import Root

PKG = Path(sandbox_fs.__file__).parent
ROOT_MODULES = {"root.py"} | {p.name for p in PKG.glob("_root_*.py")}
ENGINES = sorted(p for p in PKG.glob("_root_*.py"))


def _modules() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def _private_root_names() -> set[str]:
    """Every ``_``-prefixed, non-dunder name ``Root`` defines (methods, properties, slots)."""
    names = {n for n in dir(Root) if n.startswith("_") and not n.startswith("__")}
    names |= {n for n in Root.__slots__ if n.startswith("_") and not n.startswith("__")}
    return names | {"_walk_dirs"}


def _private_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """``obj._name`` for any ``obj`` but a bare ``self`` / ``cls`` (their own class's names)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            out.append((node.lineno, node.attr))
    return out


def test_the_engines_use_root_internals_that_exist():
    """The scan below is only as good as its list of names: the engines' uses must be in it."""
    names = _private_root_names()
    used = set()
    for path in ENGINES:
        used |= {a for _, a in _private_uses(ast.parse(path.read_text(), str(path)))}
    assert {"_rel", "_use", "_open_fd", "_split", "_show", "_deny", "_acquire", "_release",
            "_open_parent", "_oserror", "_check_writable", "_check_write_target", "_scan_fd"} <= used & names


def test_no_module_outside_the_root_modules_calls_root_internals():
    names = _private_root_names()
    bad = []
    for path in _modules():
        if path.parent == PKG and path.name in ROOT_MODULES:
            continue
        tree = ast.parse(path.read_text(), str(path))
        bad += [f"{path.relative_to(PKG)}:{line}: .{attr}" for line, attr in _private_uses(tree) if attr in names]
    assert not bad, "Root internals used outside root.py/_root_*.py:\n" + "\n".join(bad)


def _native_aliases(tree: ast.AST) -> set[str]:
    """Local names bound to the ``_native`` module (``from . import _native [as x]``, ``import ..._native``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name == "_native":
                    out.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.endswith("._native") and alias.asname:
                    out.add(alias.asname)
    return out


def test_only_native_py_touches_the_compiled_module():
    bad = []
    for path in _modules():
        if path.parent == PKG and path.name == "_native.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        aliases = _native_aliases(tree)
        where = path.relative_to(PKG)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("lib", "ffi"):
                if isinstance(node.value, ast.Name) and node.value.id in aliases:
                    bad.append(f"{where}:{node.lineno}: {node.value.id}.{node.attr}")
                elif isinstance(node.value, ast.Attribute) and node.value.attr == "_native":
                    bad.append(f"{where}:{node.lineno}: ..._native.{node.attr}")
            elif isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if mod.endswith("_sfs_native") or (mod.endswith("_native") and
                                                   {a.name for a in node.names} & {"lib", "ffi"}):
                    bad.append(f"{where}:{node.lineno}: from {mod} import ...")
                if any(a.name == "_sfs_native" for a in node.names):
                    bad.append(f"{where}:{node.lineno}: import of _sfs_native")
            elif isinstance(node, ast.Import):
                if any(a.name.endswith("_sfs_native") for a in node.names):
                    bad.append(f"{where}:{node.lineno}: import of _sfs_native")
    assert not bad, "the compiled module reached outside _native.py:\n" + "\n".join(bad)
