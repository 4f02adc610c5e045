"""The fuzz targets that ship with sandbox-fs, and the campaign runner behind ``sandbox-fs fuzz``.

Every target asserts the security invariant of issue 15 after each input
(see :class:`~sandbox_fs.testing.fuzz.Scene`), not only "no crash".
Targets: ``resolver``, ``tar``, ``zip``, ``state``, ``policy``, ``manifest``, ``hydrate`` (see ``target_names()``).  A
downstream project writes its own :class:`Target` and runs it with
``sandbox-fs fuzz package.module:ATTRIBUTE``.  Running needs atheris (the
``sandbox-fs[fuzz]`` extra); importing this package does not.
"""

from __future__ import annotations

from ._campaign import Campaign, Outcome, run_target, write_junit
from ._registry import load_target, target_names
from ._target import Finding, Scene, Target, render_dictionary

__all__ = ["Campaign", "Finding", "Outcome", "Scene", "Target", "load_target", "render_dictionary",
           "run_target", "target_names", "write_junit"]
