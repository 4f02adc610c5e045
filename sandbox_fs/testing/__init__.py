"""Test helpers for projects that embed sandbox-fs: hypothesis strategies, the attacker, the outside sentinel.

Public, documented API for downstream property tests of their own
integration (issue 15, part 7).  Importing this package needs hypothesis
(the ``sandbox-fs[testing]`` extra); nothing in the library imports it.

Modules: ``_sentinel`` (the outside sentinel and the destination
invariants), ``_strategies`` (hostile archives and host trees),
``_attacker`` (the attacker interleaving and its hook points),
``_plugin`` (the pytest plugin with the ``outside_sentinel`` fixture).

Names are imported on first use, so the pytest plugin (loaded by every
pytest run where sandbox-fs is installed) imports nothing it does not need.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._sentinel import ALLOWED_ERRNOS, OutsideSentinel, check_destination, classify_failure  # noqa: F401
    from ._attacker import ATTACK_RULES, AttackRecord, Attacker  # noqa: F401
    from ._strategies import (HostNode, HostTreePlan, hostile_host_trees, hostile_tar_archives,  # noqa: F401
                              hostile_zip_archives, sandbox_path_names)

_LAZY = {
    "ALLOWED_ERRNOS": "_sentinel",
    "OutsideSentinel": "_sentinel",
    "check_destination": "_sentinel",
    "classify_failure": "_sentinel",
    **dict.fromkeys(["ATTACK_RULES", "AttackRecord", "Attacker"], "_attacker"),
    **dict.fromkeys(["HostNode", "HostTreePlan", "hostile_host_trees", "hostile_tar_archives",
                     "hostile_zip_archives", "sandbox_path_names"], "_strategies"),
}

__all__: list[str] = []
__all__ += list(_LAZY)


def __getattr__(name: str) -> object:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value
