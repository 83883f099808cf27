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

E and S are measured as the engine runs: medians of the last WINDOW eager steps, graph steps and finished
requests (a median, not a mean: the first eager steps of a process carry one-off costs, a kernel's first
build or a compile, that would otherwise hold admissions back for many steps); until each has MIN_SAMPLES
samples, m is 1.
"""

from __future__ import annotations

import collections
import math
import statistics

WINDOW = 32
MIN_SAMPLES = 3


class AdmissionBatcher:
    def __init__(self, max_num_seqs: int):
        self.max_num_seqs = max_num_seqs
        self.eager_s = _Median()  # seconds per eager step
        self.graph_s = _Median()  # seconds per graph-replayed step
        self.request_steps = _Median()  # steps a request decodes for
        self._batch: int | None = None  # cached until a new measurement

    def observe_step(self, eager: bool, seconds: float) -> None:
        (self.eager_s if eager else self.graph_s).add(seconds)
        self._batch = None

    def observe_finished(self, steps: int) -> None:
        if steps > 0:
            self.request_steps.add(float(steps))
            self._batch = None

    def batch(self) -> int:
        """m: the free slots to wait for (1: admit at once)."""
        if self._batch is None:
            self._batch = self._optimal_batch()
        return self._batch

    def _optimal_batch(self) -> int:
        eager, graph, steps = self.eager_s.value, self.graph_s.value, self.request_steps.value
        if eager is None or graph is None or steps is None:
            return 1
        extra = max(0.0, eager / graph - 1.0)  # E, in graph steps
        m = self.max_num_seqs * math.sqrt(2.0 * extra / max(1.0, steps))
        return max(1, min(self.max_num_seqs, round(m)))


class _Median:
    """The median of the last WINDOW samples (None before MIN_SAMPLES)."""

    def __init__(self):
        self.samples: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.value: float | None = None

    def add(self, sample: float) -> None:
        self.samples.append(sample)
        self.value = statistics.median(self.samples) if len(self.samples) >= MIN_SAMPLES else None
