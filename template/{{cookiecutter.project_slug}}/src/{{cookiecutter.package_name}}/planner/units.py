"""Units of plan's figures: bytes and parameter counts as people read them."""

from __future__ import annotations

GIB, GB = 2**30, 1e9


def size(value: float) -> str:
    """Bytes in the unit that keeps them readable: GiB, MiB or KiB (binary units, labelled)."""
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f} B"


def count(value: float) -> str:
    """A parameter count: 1.42 B, 124.4 M, 812.5 K."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f}"
