"""The eager steps run once at start-up (engine/eager_warm_up.py), checked on the CPU with the elementwise pieces
compiled as a GPU compiles them (torch.compile, dynamic shapes) but with dynamo's eager backend: which variant
a call needs is dynamo's guards' decision, the same as on a GPU, where building one takes 0.2-1 s.

After the warm-up, loads it did not run (prompts of other lengths alone, many together, arrivals beside
decoding requests) build no variant; without it the same loads do (the test's power).  The warm-up leaves the
engine's counters, its queue and its replies as they were."""

from __future__ import annotations

import contextlib

import pytest
import torch

from bench.common import compiles
from specdec import SamplingParams
from specdec.models import fused
from tests import test_mtp
from tests.test_mtp import mtp_llm

target = test_mtp.target  # its module's fixture: a tiny Qwen3.5 checkpoint with mtp.* weights


@contextlib.contextmanager
def compiled_pieces():
    """Kernels set to fused.PLAIN compiled by dynamo with the eager backend; restored afterwards."""
    saved, was_fused = {name: fused.Kernels.__dict__[name] for name in fused.PLAIN}, fused.Kernels.fused
    torch._dynamo.reset()
    fused.use_compiled(fused.compile_all("eager"))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(fused.Kernels, name, fn)
        fused.Kernels.fused = was_fused
        torch._dynamo.reset()


def ids(length: int, offset: int) -> list[int]:
    return [3 + (offset + 7 * j) % 90 for j in range(length)]


def started(path, warm: bool):
    """An MTP engine started as on a GPU: fixed-shape steps precaptured, then (warm) the eager warm-up."""
    llm = mtp_llm(path, 2, static_shapes=True, fixed_acceptance=True, max_graph_batch=8)
    with torch.inference_mode():
        llm.engine.precapture_graphs(eager=True)
        if warm:
            assert llm.engine.warm_up_eager(force=True) > 0
    return llm


def served_loads(llm) -> None:
    """Loads unlike the warm-up's: lone prompts of 30, 70 and 12 tokens; six together; arrivals while others decode."""
    sampled = [SamplingParams(max_tokens=6, temperature=1.0, seed=s, ignore_eos=True) for s in range(8)]
    for i, length in enumerate([30, 70, 12]):
        llm.generate([ids(length, i)], sampled[i])
    llm.generate([ids(n, 10 + i) for i, n in enumerate([12, 12, 44, 44, 80, 25])], sampled[:6])
    engine = llm.engine
    engine.add_request(ids(20, 30), sampled[0])
    engine.step()
    for n in (33, 33, 8):
        engine.add_request(ids(n, n), sampled[1])
    while engine.has_work():
        engine.step()


@pytest.mark.parametrize("warm", [True, False])
def test_after_the_warm_up_served_loads_compile_nothing_new(target, warm):
    """warm=False is the control: the same loads do build variants on first use without the warm-up."""
    path, _ = target
    with compiled_pieces():
        llm = started(path, warm)
        before = compiles()
        served_loads(llm)
        new = compiles() - before
    assert (new == 0) if warm else (new > 0), new


def test_the_warm_up_leaves_the_engine_and_its_replies_as_they_were(target):
    path, _ = target
    prompts = [ids(n, n) for n in (9, 27, 70)]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.0, seed=4, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=9, ignore_eos=True)]
    cold, warm = started(path, warm=False), started(path, warm=True)
    assert warm.engine.stats == cold.engine.stats
    assert warm.engine.speculator.stats == cold.engine.speculator.stats
    assert not warm.engine.has_work() and warm.engine.blocks.num_free == cold.engine.blocks.num_free
    replies = [o.token_ids for o in warm.generate(prompts, params)]
    assert replies == [o.token_ids for o in cold.generate(prompts, params)]


def test_a_cpu_engine_runs_no_warm_up_unless_forced(target):
    llm = mtp_llm(target[0], 1)
    assert llm.engine.warm_up_eager() == 0 and llm.engine.stats["steps"] == 0


def test_the_warm_up_fits_a_small_engine(target):
    """Prompts longer than the engine takes are cut to what it takes; the seventeen short prompts queue for
    four slots; the warm-up ends idle."""
    llm = mtp_llm(target[0], 2, kv_cache_tokens=64, max_model_len=40, max_num_seqs=4)
    assert llm.engine.warm_up_eager(force=True) > 0
    assert not llm.engine.has_work() and llm.engine.stats["steps"] == 0
