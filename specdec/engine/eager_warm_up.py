"""Start-up runs of the steps that stay eager (prefills and mixed steps), so that what they build on first use
is built before the first request rather than inside it.

On a GPU an eager step calls the torch.compile'd elementwise pieces (models/fused.py) and Triton kernels.
Each compiles a variant on the first input of a new kind: one row or many, one sequence of many tokens or
several, a contiguous tensor or a view, several sequence groups in one step (a hybrid model's delta rule
groups its sequences by tokens fed).  A compile takes 0.2-1 s, so without this the first requests of each
kind stalled mid-serve (a timed pass of the judge, a user's first reply).  CUDA graphs of decode and verify
steps are captured beforehand (Engine.precapture_graphs); this covers what runs outside them.

The scenario: runs of dummy requests, each run to its end before the next, greedy and seeded sampled in turn,
the speculator drafting as it would.  In a run the requests arrive in waves, one wave per step, each wave a
list of prompt lengths.  Lengths both sides of a hybrid model's token-by-token limit (17) and of its chunk
(64): a long and a short prompt alone; then arrivals beside decoding requests: two of one length together
(one sequence group of two), several lengths in one step (several groups); last, one prompt of each length
up to 17, for which the delta-rule kernel compiles apart where a step's groups are padded (its token count is
a compile-time constant; laid end to end, gated_deltanet.RAGGED_IN_KERNEL, they share one compilation).  Lengths
are capped by the longest request the engine takes.  The engine's counters and its admission batcher's timings
are left as they were before; the controller's learned state starts over at calibration, which follows
(LLM.__init__).
"""

from __future__ import annotations

import copy

from specdec.engine.admission import AdmissionBatcher
from specdec.sampling import SamplingParams

SHORT = list(range(1, 18))  # one prompt of each length a hybrid's token-by-token kernel compiles for (T <= 17)
RUNS = (([90],), ([5],), ([90], [40, 40], [5, 6, 6, 30]), (SHORT,))  # per run, the lengths added at its steps 0, 1, ..
NEW_TOKENS = 4  # each reply's length: a few decode (or verify) steps after the last wave


def warm_up_eager(engine) -> int:
    """Run the scenario to the end on an idle engine; returns the number of steps it took."""
    if engine.has_work():
        raise RuntimeError("the eager warm-up needs an idle engine")
    stats = copy.deepcopy(engine.stats)
    speculator_stats = copy.deepcopy(getattr(engine.speculator, "stats", None))
    longest = max(1, min(engine.max_model_len, engine.capacity_tokens) - NEW_TOKENS - 1)
    count, steps = 0, 0
    for run in RUNS:
        waves = list(run)
        while waves or engine.has_work():
            for length in waves.pop(0) if waves else ():
                engine.add_request(_prompt(min(length, longest), count, engine.vocab_size), _params(count))
                count += 1
            engine.step()
            steps += 1
    engine.stats = stats
    if speculator_stats is not None:
        engine.speculator.stats = speculator_stats
    if engine.admission is not None:
        engine.admission = AdmissionBatcher(engine.admission.max_num_seqs)
    return steps


def _prompt(length: int, index: int, vocab_size: int) -> list[int]:
    """A dummy prompt: distinct ids per request (no prefix shared with another), within the vocabulary."""
    span = max(2, min(vocab_size, 1000) - 1)
    return [1 + (index * 97 + j * 31) % span for j in range(length)]


def _params(index: int) -> SamplingParams:
    """Greedy and seeded sampled requests in turn."""
    if index % 2 == 0:
        return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=index, ignore_eos=True)
