"""``sandbox-fs schema [manifest]``: print the JSON Schema of a sandbox-fs document.

Only the manifest schema exists today (pydantic's ``Manifest.model_json_schema()``,
draft 2020-12); the positional argument leaves room for more.
"""

from __future__ import annotations

import argparse
from typing import Any

from ._args import int_option
from ._output import json_text
from ..manifest import Manifest

_SCHEMAS = {"manifest": Manifest}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``sandbox-fs schema``."""
    p.add_argument("what", nargs="?", default="manifest", choices=sorted(_SCHEMAS))
    p.add_argument("--indent", type=int_option(0, 16), default=2, help="JSON indentation, 0 to 16 (0: compact)")


def schema(what: str = "manifest") -> dict[str, Any]:
    """The JSON Schema (``dict``) of document kind ``what`` (``"manifest"``)."""
    return _SCHEMAS[what].model_json_schema()


def handle(args: argparse.Namespace) -> int:
    """Print the JSON Schema asked for; 0."""
    print(json_text(schema(args.what), indent=args.indent or None))
    return 0
