"""Sizes of memory as people write them: '512MiB', '2GiB', '1.5GB' or bytes.

Both the command line (an ``argparse`` type) and the settings' validators (a config
file's or Helm's text) read them here.
"""

from __future__ import annotations

import argparse


def memory_size(text: str) -> int:
    """Parse '512MiB', '2GiB', '1.5GB' or a plain number of bytes."""
    units = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
    units |= {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
    text = text.strip().lower().removesuffix("b")
    try:
        for suffix in sorted(units, key=len, reverse=True):
            if text.endswith(suffix):
                return int(float(text[: -len(suffix)]) * units[suffix])
        return int(text)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r}") from None


def memory_value(value):
    """``value`` in bytes when it is text; other values as they are (the field checks them)."""
    if isinstance(value, str):
        try:
            return memory_size(value)
        except argparse.ArgumentTypeError:
            raise ValueError("must be a size such as 512MiB, 2GiB or a number of bytes") from None
    return value
