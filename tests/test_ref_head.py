"""The shipped EAGLE-3 head of ref-target: resolvable as `ref-head`, its weights as recorded, greedy output
equal to plain decoding's with most drafts accepted, and sampled tokens after a verify step that follow the
target's exact distribution."""

from __future__ import annotations

import hashlib
import json

import pytest

from specdec import LLM, SamplingParams
from specdec.assets import heldout_prompts_path, resolve_model
from specdec.speculate import SpecConfig
from tests.stats import chi_square_p
from tests.test_speculative_refpair import N, exact_next, second_tokens


def test_ref_head_weights_match_their_recorded_sha256():
    head = resolve_model("ref-head")
    recorded = json.loads((head / "weights.sha256.json").read_text())
    assert recorded and all(hashlib.sha256((head / name).read_bytes()).hexdigest() == digest
                            for name, digest in recorded.items())


def test_ref_head_greedy_output_equals_plain_and_drafts_are_accepted():
    prompts = [json.loads(line)["prompt"] for line in heldout_prompts_path().read_text().splitlines()[:4]]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    plain = [o.token_ids for o in LLM("ref-target", device="cpu").generate(prompts, params)]
    spec = LLM("ref-target", device="cpu",
               speculator=SpecConfig("eagle3", model="ref-head", num_draft_tokens=4, adaptive=False))
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == plain
    drafted, accepted = sum(o.num_drafted for o in outs), sum(o.num_accepted for o in outs)
    assert accepted > 0.25 * drafted  # 0.36 here (k = 4); a random head: ~0


@pytest.fixture(scope="module")
def head_llm():
    return LLM("ref-target", device="cpu", kv_cache_tokens=60000,
               speculator=SpecConfig("eagle3", model="ref-head", num_draft_tokens=2, adaptive=False))


def test_sampled_tokens_after_a_verify_step_follow_the_target(head_llm):
    ids = head_llm.encode(json.loads(heldout_prompts_path().read_text().splitlines()[0])["prompt"])
    before = head_llm.engine.metrics()["accepted_tokens"]
    first, counts = second_tokens(head_llm, ids)
    assert head_llm.engine.metrics()["accepted_tokens"] - before > N // 4  # drafts really were accepted
    assert counts.sum() > N // 2
    assert chi_square_p(counts, exact_next(head_llm, ids + [first])) > 1e-3
