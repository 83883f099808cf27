"""Qwen3.5 hybrid models in the engine: greedy output equals transformers' greedy generate, a batch equals each
request alone, preemption (recompute from scratch) and chunked prefill change nothing, and speculation with
n-gram lookup (verify steps that defer the recurrent state, then commit the kept tokens) equals plain decoding
and, sampled, follows the target's distribution (with an accept-everything control that fails)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from specdec import LLM, SamplingParams
from specdec.errors import ConfigError
from specdec.speculate import SpecConfig
from tests.broken_verify import accept_everything, accept_everything_fixed
from tests.checkpoints import save_tiny
from tests.stats import chi_square_p
from tests.test_qwen3_5 import build_hf

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 30, 2, 9, 41], [7, 7, 7, 12, 12, 7, 7, 7, 12, 12, 7, 7], list(range(40, 75)), [3, 4]]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """(model dir, transformers' greedy continuations of PROMPTS)."""
    hf = build_hf("two-full")
    path = tmp_path_factory.mktemp("hybrid")
    hf.save_pretrained(path)
    expected = []
    with torch.no_grad():
        for ids in PROMPTS:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
            expected.append(out[0, len(ids):].tolist())
    return path, expected


def generate(path, prompts=PROMPTS, **kw) -> list[list[int]]:
    kw.setdefault("kv_cache_tokens", 2048)
    kw.setdefault("block_size", 4)
    llm = LLM(path, device="cpu", **kw)
    return [o.token_ids for o in llm.generate(prompts, GREEDY)], llm


def test_greedy_equals_transformers_generate_batched_and_alone(hybrid):
    path, expected = hybrid
    together, llm = generate(path)
    assert together == expected
    assert [generate(path, [p])[0][0] for p in PROMPTS[:2]] == expected[:2]
    assert llm.engine.blocks.prefix_hits == 0 and not llm.engine.states.last  # no prefix cache; nothing pending
    assert sorted(llm.engine.states.free) == list(range(llm.engine.config.max_num_seqs + 1))  # every slot back


def test_prompts_of_many_lengths_prefilled_in_one_step_equal_transformers(hybrid):
    """Prefills of different lengths share chunked groups, each padded to its longest with tokens that do nothing
    (gated_deltanet._group_key): 20, 33 and 64 tokens (one chunk), 130 and 200 (3-4 chunks), 70 (2 chunks) and
    a 9-token prompt (token by token), all in one step; each continuation equals transformers' alone."""
    path, _ = hybrid
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    prompts = [[3 + (5 * i + 11 * j) % 60 for j in range(n)] for i, n in enumerate((20, 130, 9, 33, 200, 64, 70))]
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist() for ids in prompts]
    together, llm = generate(path, prompts)
    assert llm.engine.stats["steps"] == GREEDY.max_tokens  # every prompt prefilled in the first step
    assert together == expected


def test_preemption_and_chunked_prefill_change_nothing(hybrid):
    path, expected = hybrid
    tight, llm = generate(path, kv_cache_tokens=96, max_num_batched_tokens=8)
    assert tight == expected
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("k", [1, 4])
def test_ngram_speculation_equals_plain_decoding(hybrid, k):
    path, expected = hybrid
    spec, llm = generate(path, speculator=SpecConfig("ngram", num_draft_tokens=k, adaptive=False))
    assert spec == expected
    m = llm.engine.metrics()
    assert m["draft_tokens"] > 0 and m["accepted_tokens"] > 0 and m["draft_tokens"] > m["accepted_tokens"]


def test_hybrid_refuses_what_it_cannot_run(hybrid):
    path, _ = hybrid
    with pytest.raises(ConfigError, match="hybrid"):
        LLM(path, device="cpu", static_shapes=True, kv_cache_tokens=256, compile_graphs="inductor")


@pytest.mark.parametrize("static_shapes", [False, True])
def test_piecewise_steps_equal_transformers(hybrid, static_shapes):
    """Eager steps (prefills, mixed steps) through engine/piecewise_hybrid.py (opt-in; its pieces run eagerly
    on a CPU on bucket-padded buffers): greedy output equals transformers', batched, under preemption and
    chunked prefill, and with n-gram drafts; every eager step took the pieces."""
    from specdec.engine.piecewise_hybrid import HybridPiecewiseRunner

    path, expected = hybrid
    ngram = SpecConfig("ngram", num_draft_tokens=3, adaptive=False)
    for extra in ({}, {"kv_cache_tokens": 96, "max_num_batched_tokens": 8}, {"speculator": ngram}):
        out, llm = generate(path, piecewise_graphs=True, static_shapes=static_shapes, **extra)
        assert out == expected
        runner = llm.engine.runner
        assert isinstance(runner.piecewise, HybridPiecewiseRunner)
        assert runner.piecewise.forwards == runner.eager_forwards > 0
        if "kv_cache_tokens" in extra:
            assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.metrics()["accepted_tokens"] > 0
    assert LLM(path, device="cpu", kv_cache_tokens=256).engine.piecewise_graphs is False  # the default: off


@pytest.mark.parametrize("speculator", [None, "ngram-1", "ngram-4", "draft-3", "eagle3-2"])
def test_fixed_shape_steps_equal_transformers(hybrid, drafter, hybrid_head, speculator):
    """Decode and verify steps padded to fixed shapes (the CUDA-graph path, run eagerly on a CPU): padding
    sequences on the scratch slot, padding rows of verify steps deferred and committed on the device; greedy
    output still equals transformers', with and without speculation, through preemption and chunking."""
    path, expected = hybrid
    spec = None
    if speculator is not None:
        method, k = speculator.split("-")
        model = {"ngram": None, "draft": str(drafter), "eagle3": str(hybrid_head)}[method]
        spec = SpecConfig(method, model=model, num_draft_tokens=int(k), adaptive=False)
    padded, llm = generate(path, static_shapes=True, speculator=spec)
    assert padded == expected
    engine = llm.engine
    assert engine.runner.eager_forwards < engine.stats["steps"] / 2  # most steps took the padded path
    assert engine.runner.static.acceptance.steps > engine.stats["steps"] / 2  # and were accepted on it
    if spec is not None:
        drafted, accepted = engine.metrics()["draft_tokens"], engine.metrics()["accepted_tokens"]
        assert drafted > accepted and (accepted > 0 or method != "ngram")  # rejections (and n-gram's hits)
    assert sorted(engine.states.free) == list(range(engine.config.max_num_seqs + 1))
    tight, llm = generate(path, static_shapes=True, speculator=spec, kv_cache_tokens=96, max_num_batched_tokens=8)
    assert tight == expected and llm.engine.scheduler.num_preemptions > 0


def _token2_marginal(path, prompt: list[int]) -> np.ndarray:
    """P(second generated token) at temperature 1, from transformers in float64."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    with torch.no_grad():
        p1 = model(torch.tensor([prompt])).logits[0, -1].softmax(-1)  # [V]
        vocab = p1.shape[0]
        p2 = model(torch.tensor([prompt + [t] for t in range(vocab)])).logits[:, -1].softmax(-1)  # [V, V]
    return (p1[:, None] * p2).sum(0).numpy()


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    """A tiny Qwen3 drafter over the hybrid's 300-token vocabulary."""
    return save_tiny(tmp_path_factory.mktemp("drafter"), tokenizer=False, vocab_size=300)


def test_a_draft_model_on_a_hybrid_target_equals_plain_decoding(hybrid, drafter):
    path, expected = hybrid
    spec, llm = generate(path, speculator=SpecConfig("draft", model=str(drafter), num_draft_tokens=3,
                                                     adaptive=False))
    assert spec == expected and llm.engine.metrics()["draft_tokens"] > 0


@pytest.mark.parametrize("broken", [False, True])
def test_sampled_speculation_on_a_hybrid_follows_the_target(hybrid, drafter, broken, monkeypatch):
    """A drafter's sampled drafts verified at temperature 1 on the hybrid target (deferred state, commit of the
    kept tokens): the second token follows the target's exact marginal; an accept-everything verifier fails
    the same check."""
    path, _ = hybrid
    spec = SpecConfig("draft", model=str(drafter), num_draft_tokens=2, adaptive=False)
    check_sampled_token2(path, spec, 3000, broken, monkeypatch)


@pytest.fixture(scope="module")
def hybrid_head(tmp_path_factory, hybrid):
    """A random EAGLE-3 head for the hybrid target, reading its layers 0, 1 and 2 (linear and full attention);
    small weights, so its q is broad and the sampled test sees hundreds of drafts kept and rejected."""
    from specdec.models.eagle3 import random_head, save_eagle3_head
    from specdec.models.loader import load_model

    target = load_model(hybrid[0], "cpu", torch.float32)
    head = random_head(target, seed=3, draft_vocab=64, std=0.02, feature_layers=(0, 1, 2))
    return save_eagle3_head(head, tmp_path_factory.mktemp("hybrid-head"))


@pytest.mark.parametrize("k", [1, 3])
def test_an_eagle3_head_on_a_hybrid_target_equals_plain_decoding(hybrid, hybrid_head, k):
    path, expected = hybrid
    spec, llm = generate(path, speculator=SpecConfig("eagle3", model=str(hybrid_head), num_draft_tokens=k,
                                                     adaptive=False))
    assert spec == expected and llm.engine.metrics()["draft_tokens"] > 0


@pytest.mark.parametrize("broken", [False, True])
def test_an_eagle3_head_s_sampled_drafts_on_a_hybrid_follow_the_target(hybrid, hybrid_head, broken, monkeypatch):
    spec = SpecConfig("eagle3", model=str(hybrid_head), num_draft_tokens=2, adaptive=False)
    check_sampled_token2(hybrid[0], spec, 1200, broken, monkeypatch)


def check_sampled_token2(path, spec: SpecConfig, n: int, broken: bool, monkeypatch, **engine) -> None:
    """n requests of one prompt sampled at temperature 1 with speculator spec on the hybrid target at path (engine:
    more LLM options): the second token follows the target's exact marginal, with enough drafts kept and rejected
    to tell; with broken, an accept-everything verifier, the same check fails."""
    import specdec.engine.sampler as sampler
    import specdec.fixed_accept as fixed_accept

    if broken:
        monkeypatch.setattr(sampler, "accept_ragged", accept_everything)
        monkeypatch.setattr(fixed_accept, "accept_fixed", accept_everything_fixed)  # fixed-shape steps' acceptance
    prompt = [5, 17, 30, 2, 9, 41]
    llm = LLM(path, device="cpu", kv_cache_tokens=16384, block_size=4, max_num_seqs=256, speculator=spec, **engine)
    outs = llm.generate([prompt] * n, SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True))
    static = llm.engine.runner.static
    assert static is None or static.acceptance.steps > 0  # with static_shapes, acceptance ran on the fixed shapes
    marginal = _token2_marginal(path, prompt)
    counts = np.bincount([o.token_ids[1] for o in outs], minlength=len(marginal))
    p = chi_square_p(counts, marginal)
    if broken:
        assert p < 1e-6
    else:
        accepted = sum(o.num_accepted for o in outs)
        assert accepted > 200 and sum(o.num_drafted for o in outs) - accepted > 200, accepted  # power
        assert p > 1e-3
