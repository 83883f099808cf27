"""How many sequence slots to let free up before admitting waiting requests: prefills coalesced by cost.

A step that prefills runs eagerly; on a GPU the other steps replay CUDA graphs, and an eager step costs
many of them (on an H200, 24 ms against 1 ms at 16 sequences on the reference pair).  Admitting each
waiting request in the step its slot frees up pays that price once per request; waiting until m slots are
free pays it once per m requests, but leaves on average (m - 1) / 2 slots idle meanwhile.  This is the
economic order quantity: with C slots, an eager step costing E graph steps more than a graph step, and
requests that decode for S steps (so C / S finish per step), the time lost per step is

    (C / S) * E / m    (eager steps)   +   (m - 1) / (2 C)    (idle slots, as a share of a step)

which is least at m = C * sqrt(2 E / S).  Example: C 16, E 23, S 67 -> m 13; C 64, E 13, S 50 -> m 46;
a target whose eager steps cost little more than graph steps (E -> 0, and the CPU, where every step is
eager) -> m 1, admission as soon as a slot frees up.

E and S are measured as the engine runs (moving averages of eager and graph step times, and of the steps
a finished request took); until both kinds of step have been seen, m is 1.
"""

from __future__ import annotations

import math


class AdmissionBatcher:
    EMA = 0.05  # weight of each new measurement

    def __init__(self, max_num_seqs: int):
        self.max_num_seqs = max_num_seqs
        self.eager_s: float | None = None  # seconds per eager step
        self.graph_s: float | None = None  # seconds per graph-replayed step
        self.request_steps: float | None = None  # steps a request decodes for

    def observe_step(self, eager: bool, seconds: float) -> None:
        if eager:
            self.eager_s = _average(self.eager_s, seconds, self.EMA)
        else:
            self.graph_s = _average(self.graph_s, seconds, self.EMA)

    def observe_finished(self, steps: int) -> None:
        if steps > 0:
            self.request_steps = _average(self.request_steps, float(steps), self.EMA)

    def batch(self) -> int:
        """m: the free slots to wait for (1: admit at once)."""
        if self.eager_s is None or self.graph_s is None or self.request_steps is None:
            return 1
        extra = max(0.0, self.eager_s / self.graph_s - 1.0)  # E, in graph steps
        m = self.max_num_seqs * math.sqrt(2.0 * extra / max(1.0, self.request_steps))
        return max(1, min(self.max_num_seqs, round(m)))


def _average(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1 - weight) * old + weight * new
