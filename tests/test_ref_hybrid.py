"""The shipped Qwen3.5-shaped reference target with its own trained MTP head: resolvable as `ref-hybrid`, its
weights as recorded, greedy output with MTP drafts equal to plain decoding's with most drafts accepted, and
sampled tokens after a verify step that follow the target's exact distribution."""

from __future__ import annotations

import hashlib
import json

import pytest

from specdec import LLM, SamplingParams
from specdec.assets import heldout_prompts_path, resolve_model
from specdec.speculate import SpecConfig
from tests.stats import chi_square_p
from tests.test_speculative_refpair import N, exact_next, second_tokens


def test_ref_hybrid_weights_match_their_recorded_sha256():
    model = resolve_model("ref-hybrid")
    recorded = json.loads((model / "weights.sha256.json").read_text())
    assert "model-mtp.safetensors" in recorded  # the trained head ships inside the checkpoint, as Qwen3.5's
    assert all(hashlib.sha256((model / name).read_bytes()).hexdigest() == digest for name, digest in recorded.items())


@pytest.mark.parametrize("k", [1, 3])
def test_ref_hybrid_mtp_greedy_output_equals_plain_and_drafts_are_accepted(k):
    prompts = [json.loads(line)["prompt"] for line in heldout_prompts_path().read_text().splitlines()[:3]]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    plain = [o.token_ids for o in LLM("ref-hybrid", device="cpu").generate(prompts, params)]
    spec = LLM("ref-hybrid", device="cpu", speculator=SpecConfig("mtp", num_draft_tokens=k, adaptive=False))
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == plain
    drafted, accepted = sum(o.num_drafted for o in outs), sum(o.num_accepted for o in outs)
    assert accepted > 0.35 * drafted  # 0.68 at k = 1, 0.48 at k = 3 here; a random head: ~0


def test_sampled_tokens_after_an_mtp_verify_step_follow_the_target():
    llm = LLM("ref-hybrid", device="cpu", kv_cache_tokens=60000,
              speculator=SpecConfig("mtp", num_draft_tokens=2, adaptive=False))
    # short prompts (hybrids cache no prefixes, so each of the N requests computes its whole prompt): the one
    # whose next token is likeliest, so that most samples share a first token and go on to a verify step
    prompts = [llm.encode(json.loads(line)["prompt"])[:24] for line in heldout_prompts_path().read_text().splitlines()[:8]]
    ids = max(prompts, key=lambda p: exact_next(llm, p).max())
    before = llm.engine.metrics()["accepted_tokens"]
    first, counts = second_tokens(llm, ids)
    assert llm.engine.metrics()["accepted_tokens"] - before > N // 4  # drafts really were accepted
    assert counts.sum() > N // 2
    assert chi_square_p(counts, exact_next(llm, ids + [first])) > 1e-3
