"""The fuzz targets by name, and loading a downstream target given as ``module:attribute``."""

from __future__ import annotations

import importlib

from ._target import Target

__all__ = ["INSTRUMENT", "TARGET_MODULES", "instrumented_modules", "load_target", "target_names"]

# name -> module (under sandbox_fs.testing.fuzz) and attribute holding its Target
TARGET_MODULES: dict[str, tuple[str, str]] = {
    "resolver": ("_resolver", "RESOLVER"),
    "tar": ("_archive", "TAR"),
    "zip": ("_archive", "ZIP"),
    "state": ("_state", "STATE"),
    "policy": ("_policy", "POLICY"),
    "manifest": ("_manifest", "MANIFEST"),
    "hydrate": ("_hydrate", "HYDRATE"),
}

# name -> the modules atheris instruments for coverage feedback (a prefix covers its submodules).
# Instrumenting costs seconds at start-up per module tree, so each target names what it drives.
INSTRUMENT: dict[str, tuple[str, ...]] = {
    "resolver": ("sandbox_fs.testing.fuzz._resolver",),
    "tar": ("sandbox_fs.archive", "tarfile"),
    "zip": ("sandbox_fs.archive", "zipfile"),
    "state": ("sandbox_fs.client", "sandbox_fs.testing.fuzz._state"),
    "policy": ("sandbox_fs.paths", "sandbox_fs.testing.fuzz._policy"),
    "manifest": ("sandbox_fs.manifest", "sandbox_fs.materialize"),
    "hydrate": ("sandbox_fs.snapshot", "sandbox_fs.archive"),
}


def instrumented_modules(spec: str) -> tuple[str, ...]:
    """The module names atheris instruments for ``spec`` (a downstream ``module:attr``: that module)."""
    if spec in INSTRUMENT:
        return INSTRUMENT[spec]
    return (spec.split(":", 1)[0],)


def target_names() -> list[str]:
    """The built-in target names, in the order ``sandbox-fs fuzz all`` runs them."""
    return list(TARGET_MODULES)


def load_target(spec: str) -> Target:
    """Return the :class:`Target` named ``spec``: a built-in name, or ``package.module:ATTRIBUTE``.

    Raises:
        KeyError: ``spec`` is neither a built-in name nor a ``module:attribute``.
        ImportError, AttributeError: the module or attribute of a ``module:attribute`` spec is missing.
        TypeError: the attribute is not a Target.
    """
    if spec in TARGET_MODULES:
        mod, attr = TARGET_MODULES[spec]
        value = getattr(importlib.import_module(f"{__package__}.{mod}"), attr)
    elif ":" in spec:
        mod, attr = spec.split(":", 1)
        value = getattr(importlib.import_module(mod), attr)
    else:
        raise KeyError(spec)
    if not isinstance(value, Target):
        raise TypeError(f"{spec} is not a sandbox_fs.testing.fuzz.Target")
    return value
