"""The range a number field of the schema allows, declared beside its default.

`max_steps: int = field(default=100, metadata=bounds(at_least=1, at_most=10**12))`: recipe/typecheck.py checks
every field that declares bounds, whatever its section, and names the field's path; the docs' reference shows
them. A rule that relates two fields is code in recipe/checks.py (or the task's or strategy's `check`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

# The key of a field's metadata that holds its Bounds.
METADATA_KEY = "bounds"


@dataclass(frozen=True)
class Bounds:
    """A closed (`at_least`, `at_most`) or open (`above`, `below`) lower and upper bound; `note` says what the
    edge values mean, after the refusal (`0: at validation's steps`)."""

    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None
    below: float | None = None
    note: str = ""

    def refusal(self, value: float) -> str | None:
        """What `value` breaks, as the end of a message (`must be >= 1`); None when it is within (NaN never is)."""
        low = self.at_least is None or value >= self.at_least
        low = low and (self.above is None or value > self.above)
        high = self.at_most is None or value <= self.at_most
        high = high and (self.below is None or value < self.below)
        if low and high:
            return None
        # A range with an open side reads best whole (`in [0, 1)`); a closed pair names the side broken, since
        # an upper bound such as 10**12 guards against overflow rather than says what the field means.
        if self._interval() is not None:
            text = f"must be in {self._interval()}"
        elif not low:
            text = f"must be >= {_number(self.at_least)}" if self.above is None else f"must be > {_number(self.above)}"
        else:
            text = f"must be <= {_number(self.at_most)}" if self.below is None else f"must be < {_number(self.below)}"
        return f"{text} ({self.note})" if self.note else text

    def words(self) -> str:
        """The bounds as the reference page shows them: `at least 1, at most 4,096`, `in [0, 1)`."""
        if (interval := self._interval()) is not None:
            return f"in {interval}"
        sides = [
            f"{name} {_number(bound)}"
            for name, bound in (
                ("at least", self.at_least),
                ("more than", self.above),
                ("at most", self.at_most),
                ("less than", self.below),
            )
            if bound is not None
        ]
        return ", ".join(sides)

    def _interval(self) -> str | None:
        """`[0, 1)` when there is a lower and an upper bound and one of them is open; otherwise None."""
        lower = self.at_least if self.at_least is not None else self.above
        upper = self.at_most if self.at_most is not None else self.below
        if lower is None or upper is None or (self.above is None and self.below is None):
            return None
        opening = "[" if self.at_least is not None else "("
        closing = "]" if self.at_most is not None else ")"
        return f"{opening}{_number(lower)}, {_number(upper)}{closing}"


def bounds(
    *,
    at_least: float | None = None,
    above: float | None = None,
    at_most: float | None = None,
    below: float | None = None,
    note: str = "",
) -> dict[str, Bounds]:
    """A field's metadata declaring its range: `field(default=0.9, metadata=bounds(at_least=0, below=1))`."""
    if (at_least is not None and above is not None) or (at_most is not None and below is not None):
        raise ValueError("bounds: one lower bound (at_least or above) and one upper bound (at_most or below)")
    return {METADATA_KEY: Bounds(at_least, above, at_most, below, note)}


def bounds_of(field: dataclasses.Field[Any]) -> Bounds | None:
    """The Bounds a dataclass field declares, or None."""
    return field.metadata.get(METADATA_KEY)


def _number(bound: float | None) -> str:
    """A bound as a message writes it: thousands separated (4,096), a whole float as an int (1.0 -> 1)."""
    if isinstance(bound, float) and math.isfinite(bound) and bound.is_integer():
        bound = int(bound)
    return f"{bound:,}"
