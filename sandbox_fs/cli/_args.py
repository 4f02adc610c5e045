"""Numeric command-line options: checked types for ``argparse`` (``type=``).

Every int or float option of every subcommand uses :func:`int_option` or
:func:`float_option` (``tests/test_cli_surface.py`` walks the parser and
fails on a bare ``type=int`` / ``type=float``).  A value that is not a
number, not finite (``nan``, ``inf``, ``-inf``, ``1e400``), below the
option's minimum (negatives where they mean nothing) or above its maximum
is refused by argparse: one ``sandbox-fs: error: usage: ...`` line and exit
2, before any work starts.

Bounds: byte counts and counts stop at ``INT64_MAX`` (2**63-1, what the
kernel and the C layer take as a size); durations in seconds stop at
:data:`MAX_SECONDS` (one year: a longer wall-clock or CPU limit is no limit
at all and only overflows a deadline).
"""

from __future__ import annotations

import argparse
import math
from typing import Callable

__all__ = ["INT64_MAX", "MAX_SECONDS", "int_option", "float_option", "seconds_option", "NumericType"]

INT64_MAX = 2**63 - 1
MAX_SECONDS = 365 * 24 * 3600.0
_MAX_DIGITS = 64  # longer text is no number we take (and int() of it costs quadratic time)


class NumericType:
    """An argparse ``type=`` callable with known bounds (the tests read ``kind``, ``low``, ``high``)."""

    def __init__(self, kind: type, low: float, high: float, *, low_open: bool = False, unit: str = "") -> None:
        self.kind = kind
        self.low = kind(low)
        self.high = kind(high)  # a float bound is compared as a float (2**63-1 -> 2.0**63)
        self.low_open = low_open
        self.unit = unit
        self.__name__ = kind.__name__  # argparse names the type in its messages

    def _range(self) -> str:
        def show(v: float) -> str:
            if v == INT64_MAX:
                return "2**63-1"
            return str(int(v)) if float(v).is_integer() and abs(v) < 1e18 else f"{v:g}"

        low = f"{'>' if self.low_open else '>='} {show(self.low)}"
        return f"{low} and <= {show(self.high)}{' ' + self.unit if self.unit else ''}"

    def __call__(self, text: str) -> int | float:
        shown = text if len(text) <= 24 else text[:24] + "..."
        if len(text) > _MAX_DIGITS:
            raise argparse.ArgumentTypeError(f"{shown!r} is not a number in range ({self._range()})")
        try:
            value: int | float = int(text, 10) if self.kind is int else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{shown!r} is not {'an integer' if self.kind is int else 'a number'}") from None
        if self.kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{shown!r} is not a finite number")
        too_low = value <= self.low if self.low_open else value < self.low
        if too_low or value > self.high:
            raise argparse.ArgumentTypeError(f"{shown!r} is out of range (must be {self._range()})")
        return value

    def __repr__(self) -> str:
        return f"NumericType({self.kind.__name__}, {self._range()})"


def int_option(low: int = 0, high: int = INT64_MAX, *, unit: str = "") -> Callable[[str], int]:
    """A decimal integer in ``[low, high]`` (default 0 .. 2**63-1)."""
    return NumericType(int, low, high, unit=unit)  # type: ignore[return-value]


def float_option(low: float = 0.0, high: float = float(INT64_MAX), *, low_open: bool = False,
                 unit: str = "") -> Callable[[str], float]:
    """A finite float in ``[low, high]`` (``(low, high]`` with ``low_open``)."""
    return NumericType(float, low, high, low_open=low_open, unit=unit)


def seconds_option(high: float = MAX_SECONDS) -> Callable[[str], float]:
    """A duration in seconds: finite, > 0, at most ``high`` (default one year)."""
    return NumericType(float, 0.0, high, low_open=True, unit="s")
