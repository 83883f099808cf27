"""The greedy acceptance walk that defines tau, the mean acceptance length.

At position ``pos`` of a continuation the drafter proposes up to k tokens; ``a`` of them agree with the
continuation; the target's verify step then yields the ``a`` accepted tokens plus one of its own, except
that no step runs past the end of the continuation:

    step = min(a + 1, end - pos)

Worked example (k = 4, continuation of 6 tokens): a = 4 at pos 0 -> step 5; a = 0 at pos 5 -> step 1
(only one token left anyway): 6 tokens in 2 steps, tau 3.0.
"""

from __future__ import annotations

from collections.abc import Callable

from specdec.sequences import common_prefix_length  # noqa: F401  (re-exported)


def walk(end: int, accepted_at: Callable[[int], int], start: int = 0) -> tuple[int, int]:
    """(tokens, steps) of the walk over continuation positions [start, end).

    ``accepted_at(pos)`` is how many drafted tokens proposed at ``pos`` match the continuation from ``pos``.
    """
    tokens = steps = 0
    pos = start
    while pos < end:
        step = min(accepted_at(pos) + 1, end - pos)
        tokens, steps, pos = tokens + step, steps + 1, pos + step
    return tokens, steps
