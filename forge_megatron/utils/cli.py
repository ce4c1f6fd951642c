"""Argument types shared by the command lines, in a module that imports no torch (the rollout driver's process
imports none; training/arguments.py imports torch through the losses)."""

import argparse
import math


def name_float_pairs(text: str) -> dict[str, float]:
    """Parse ``a=1.0,b=-0.5`` into ``{"a": 1.0, "b": -0.5}``; a clear error names the bad item."""
    out: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise argparse.ArgumentTypeError(f"expected name=value pairs separated by commas, got {item!r}")
        try:
            number = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"value of {name.strip()!r} is not a number: {value!r}") from None
        if not math.isfinite(number):
            raise argparse.ArgumentTypeError(f"value of {name.strip()!r} must be finite, got {value!r}")
        out[name.strip()] = number
    return out
