"""Streaming snapshots of a workspace (being split into modules)."""

from ._walk import *  # noqa: F401,F403
from ._walk import __all__  # noqa: F401
