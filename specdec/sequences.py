"""Small helpers on token sequences shared by the engine, the judge and the drafting tools."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_length(a: Sequence, b: Sequence) -> int:
    """How many leading items a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
