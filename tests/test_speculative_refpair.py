"""Lossless sampling on the shipped pair, where the drafter is good (87% greedy agreement) and most drafts are
accepted: the token after a verify step follows the target's exact distribution, and a verifier that
accepts every draft (the negative control) fails the same test."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.assets import heldout_prompts_path
from specdec.speculate import SpecConfig
from tests.broken_verify import accept_everything
from tests.stats import chi_square_p

N = 1500  # requests at temperature 1; token 1 is the one tested


@pytest.fixture(scope="module")
def setting():
    prompt = json.loads(heldout_prompts_path().read_text().splitlines()[0])["prompt"]
    spec = LLM("ref-target", device="cpu", kv_cache_tokens=60000,
               speculator=SpecConfig(method="draft", model="ref-draft", num_draft_tokens=2, adaptive=False))
    ids = spec.encode(prompt)
    return spec, ids


def second_tokens(llm: LLM, ids: list[int]) -> tuple[int, np.ndarray]:
    """The most common first token t0 and the counts of the second token among the samples that start with t0.

    Token 0 comes from the prefill step (no drafts); token 1 from the first verify step (drafts d1..d4)."""
    # 4 tokens: after token 0, 2 drafts fit (drafting stops where max_tokens would cut the output)
    params = [SamplingParams(max_tokens=4, temperature=1.0, seed=i, ignore_eos=True) for i in range(N)]
    outs = [o.token_ids for o in llm.generate([ids] * N, params)]
    first = Counter(o[0] for o in outs).most_common(1)[0][0]
    counts = np.bincount([o[1] for o in outs if o[0] == first], minlength=llm.model.config.vocab_size)
    return first, counts


def exact_next(llm: LLM, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = llm.engine.all_logits(ids)[-1].float()
    return torch.softmax(logits, -1).numpy().astype(np.float64)


def test_sampled_tokens_after_a_verify_step_follow_the_target(setting):
    spec, ids = setting
    before = spec.engine.metrics()["accepted_tokens"]
    first, counts = second_tokens(spec, ids)
    assert spec.engine.metrics()["accepted_tokens"] - before > N // 4  # drafts really were accepted
    assert counts.sum() > N // 2
    assert chi_square_p(counts, exact_next(spec, ids + [first])) > 1e-3  # 0.18 here


def test_negative_control_accepting_every_draft_fails(setting, monkeypatch):
    """Accept every draft (then the bonus): the second token follows the drafter, and the test sees it."""
    import specdec.engine.sampler as sampler

    spec, ids = setting
    monkeypatch.setattr(sampler, "accept_ragged", accept_everything)
    first, counts = second_tokens(spec, ids)
    assert chi_square_p(counts, exact_next(spec, ids + [first])) < 1e-6  # 0 (underflow) here
