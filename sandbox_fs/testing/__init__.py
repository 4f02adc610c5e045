"""Test helpers for projects that embed sandbox-fs: hypothesis strategies, the attacker, the outside sentinel.

Public, documented API for downstream property tests of their own
integration (issue 15, part 7).  Importing this package needs hypothesis
(the ``sandbox-fs[testing]`` extra); nothing in the library imports it.

Modules: ``_sentinel`` (the outside sentinel and the destination
invariants), ``_strategies`` (hostile archives and host trees),
``_attacker`` (the attacker interleaving and its hook points),
``_plugin`` (the pytest plugin with the ``outside_sentinel`` fixture).
"""

from __future__ import annotations

__all__: list[str] = []
