"""Argument types the command lines share (`tokendance serve`, `tokendance bench`): kept out of
the parsers so that no command-line module imports another."""

from __future__ import annotations

import argparse
import re

SIZE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_bytes(text: str) -> int:
    """'1048576', '512M', '512MiB', '2G' -> bytes (binary units)."""
    if text.strip().lower() == "auto":
        return "auto"
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 536870912, 512M, 2G)")
    return int(match.group(1)) * SIZE_UNITS[match.group(2).upper()]


def mebibytes(text: str) -> int:
    return int(float(text) * 2**20)
