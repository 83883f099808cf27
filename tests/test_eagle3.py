"""EAGLE-3 draft heads: lossless with random weights, fed by the verify forward, loaded in the published layout."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specdec import LLM, ModelLoadError, SamplingParams
from specdec.models.eagle3 import load_eagle3_head, random_head, save_eagle3_head
from specdec.models.loader import load_model
from specdec.speculate import SpecConfig
from tests.broken_verify import accept_everything, accept_everything_fixed
from tests.stats import chi_square_p
from tests.test_speculative import GREEDY, _exact_token2_marginal, mixed_prompts

FEATURES = (0, 1, 1)  # the tiny target has 2 layers: the embedding, and the output of layer 0 twice


def make_head_dir(path, target_dir, seed: int = 3, draft_vocab: int = 64, std: float = 0.3, **kw):
    target = load_model(target_dir, "cpu", torch.float32)
    head = random_head(target, seed=seed, draft_vocab=draft_vocab, std=std, feature_layers=FEATURES, **kw)
    return save_eagle3_head(head, path)


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, qwen3_dir):
    return make_head_dir(tmp_path_factory.mktemp("head"), qwen3_dir)


@pytest.fixture(scope="module")
def plain(llm):
    return [o.token_ids for o in llm.generate(mixed_prompts(), GREEDY)]


def eagle_llm(target_dir, head_dir, k: int = 4, **kw) -> LLM:
    kw.setdefault("kv_cache_tokens", 4096)
    kw.setdefault("block_size", 4)
    spec = SpecConfig("eagle3", model=str(head_dir), num_draft_tokens=k, adaptive=kw.pop("adaptive", False))
    return LLM(target_dir, device="cpu", speculator=spec, **kw)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("k", [1, 2, 5, 8])
def test_greedy_equals_plain_with_a_random_head(qwen3_dir, head_dir, plain, k, static):
    llm = eagle_llm(qwen3_dir, head_dir, k, static_shapes=static, max_graph_batch=4)
    assert [o.token_ids for o in llm.generate(mixed_prompts(), GREEDY)] == plain
    m = llm.engine.metrics()
    assert m["draft_tokens"] > 0 and m["accepted_tokens"] > 0  # drafts were verified, some accepted
    assert not static or llm.engine.runner.static.acceptance.steps > 0  # accepted on the fixed shapes


@pytest.mark.parametrize("piecewise,static", [(False, False), (True, False), (False, True)])
def test_greedy_equals_plain_under_preemption_chunking_and_prefix_hits(qwen3_dir, head_dir, plain, piecewise,
                                                                     static):
    tight = eagle_llm(qwen3_dir, head_dir, 4, kv_cache_tokens=160, max_num_batched_tokens=24,
                      piecewise_graphs=piecewise, static_shapes=static, max_graph_batch=8)
    assert [o.token_ids for o in tight.generate(mixed_prompts(), GREEDY)] == plain
    assert tight.engine.scheduler.num_preemptions > 0
    again = tight.generate(mixed_prompts(), GREEDY)  # now with prefix-cache hits
    assert [o.token_ids for o in again] == plain
    assert tight.engine.blocks.prefix_hits > 0
    assert not static or tight.engine.runner.static.acceptance.steps > 10  # accepted on the fixed shapes


def test_mixed_sampling_settings_in_one_batch_keep_greedy_rows_exact(qwen3_dir, head_dir, plain):
    llm = eagle_llm(qwen3_dir, head_dir, 3)
    prompts = mixed_prompts()
    params = [GREEDY if i % 2 == 0 else SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=i,
                                                        ignore_eos=True) for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    assert [o.token_ids for i, o in enumerate(outs) if i % 2 == 0] == plain[::2]
    alone = llm.generate(prompts[1], params[1])[0].token_ids
    assert outs[1].token_ids == alone  # a seeded sampled request does not depend on its batch


def test_chains_of_different_lengths_in_one_batch_stay_exact(qwen3_dir, head_dir, plain):
    """Requests whose k is cut by their max_tokens at different steps: the chain's rows end at different forwards."""
    llm = eagle_llm(qwen3_dir, head_dir, 6, static_shapes=True, max_graph_batch=8)
    lengths = [7, 30, 12, 3, 21, 16]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    outs = llm.generate(mixed_prompts(), params)
    assert [o.token_ids for o in outs] == [p[:n] for p, n in zip(plain, lengths)]
    stats = llm.engine.speculator.stats
    assert stats["draft_forwards"] > 20 and stats["head_eager_forwards"] <= len(lengths)  # prefill observes only


def _head_forward_twice(spec, layout, ids, states):
    """The head's outputs and KV after one forward through its graphs and one eager, from the same cache."""
    before = [t.clone() for t in spec.kv.layers[0]]
    via_graphs = spec._forward(ids, states, layout)
    kv_graphs = [t.clone() for t in spec.kv.layers[0]]
    for t, saved in zip(spec.kv.layers[0], before):
        t.copy_(saved)
    graphs, spec.graphs = spec.graphs, None
    try:
        eager = spec._forward(ids, states, layout)
    finally:
        spec.graphs = graphs
    return via_graphs, eager, kv_graphs, [t.clone() for t in spec.kv.layers[0]]


@pytest.mark.parametrize("counts", [(3, 1), (1, 3), (1, 1, 1), (2, 5, 1)])
def test_head_graphs_compute_what_the_flat_forward_does(qwen3_dir, head_dir, counts):
    """Padded to a bucket (rows scattered and gathered through the row index), the head's forward gives the
    flat forward's outputs and writes the same keys and values; padding rows write only the scratch block."""
    llm = eagle_llm(qwen3_dir, head_dir, 4, static_shapes=True, max_graph_batch=8)
    spec = llm.engine.speculator
    assert spec.graphs is not None
    g = torch.Generator().manual_seed(sum(counts))
    layout, ids = [], []
    for i, count in enumerate(counts):
        start = 5 + 7 * i  # earlier positions hold whatever keys the cache has: both paths read the same
        blocks = llm.engine.blocks.allocate(llm.engine.blocks.blocks_for(start + count))
        layout.append((blocks, start, count))
        ids.extend(torch.randint(0, 96, (count,), generator=g).tolist())
    states = torch.randn(sum(counts), spec.head.config.layer.hidden_size, generator=g)
    (via_graphs, logits), (eager, none), kv_graphs, kv_eager = _head_forward_twice(spec, layout, ids, states)
    assert none is None
    torch.testing.assert_close(via_graphs, eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, spec.head.logits(eager), atol=1e-5, rtol=1e-5)
    real = spec.kv.scratch_block * spec.kv.block_size  # slots before the scratch block's
    for graphs_side, eager_side in zip(kv_graphs, kv_eager):
        torch.testing.assert_close(graphs_side[:real], eager_side[:real], atol=1e-5, rtol=1e-5)


def test_the_served_head_runs_fused_projections_that_compute_what_its_layers_do(qwen3_dir, head_dir):
    """The speculator fuses the head's q/k/v and gate/up as the target's; the fused GEMMs give each layer's
    own output (the weights are views, so nothing can go stale)."""
    head = eagle_llm(qwen3_dir, head_dir).engine.speculator.head
    attn, mlp = head.midlayer.self_attn, head.midlayer.mlp
    assert attn.qkv is not None and mlp.gate_up is not None
    x = torch.randn(5, attn.q_proj.in_features, generator=torch.Generator().manual_seed(0))
    for fused, layer in zip(attn.qkv(x), (attn.q_proj, attn.k_proj, attn.v_proj)):
        torch.testing.assert_close(fused, torch.nn.functional.linear(x, layer.weight, layer.bias))
    h = torch.randn(5, mlp.gate_proj.in_features, generator=torch.Generator().manual_seed(1))
    for fused, layer in zip(mlp.gate_up(h), (mlp.gate_proj, mlp.up_proj)):
        torch.testing.assert_close(fused, torch.nn.functional.linear(h, layer.weight))


def test_the_head_reads_the_verify_forward_and_adds_no_target_forward(qwen3_dir, head_dir):
    """One target forward per engine step; the head is fed the features of exactly the committed positions."""
    llm = eagle_llm(qwen3_dir, head_dir, 4)
    target_forwards = []
    forward = llm.engine.runner.forward
    llm.engine.runner.forward = lambda seqs, *a, **kw: target_forwards.append(1) or forward(seqs, *a, **kw)
    req = llm.engine.add_request(mixed_prompts(1)[0], SamplingParams(max_tokens=20, temperature=0,
                                                                       ignore_eos=True))
    steps = 0
    while not req.finished:
        last_start = req.num_computed
        llm.engine.step()
        steps += 1
    assert len(target_forwards) == steps
    observed = llm.engine.speculator.stats["head_tokens_observed"]
    assert observed == last_start  # every committed position once, but the finishing step's (nothing to draft)


def test_head_features_are_the_targets_hidden_states(qwen3_dir):
    """The captured features equal transformers' hidden_states at the requested layers (the last id, the number
    of layers, is the final-normed state an MTP head reads)."""
    import transformers

    target = load_model(qwen3_dir, "cpu", torch.float32)
    llm = LLM(qwen3_dir, device="cpu", kv_cache_tokens=1024, block_size=4)
    llm.model.capture_features((0, 1, 1, 2), 64)
    ids = mixed_prompts(1)[0]
    llm.engine.all_logits(ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    want = torch.cat([states[0][0], states[1][0], states[1][0], states[2][0]], -1)
    torch.testing.assert_close(llm.model.features[:len(ids)], want, atol=1e-4, rtol=1e-4)
    del target


@pytest.fixture(scope="module")
def sampled_eagle_llm(qwen3_dir, head_dir):
    return eagle_llm(qwen3_dir, head_dir, 2, max_num_seqs=512, kv_cache_tokens=16384)


def _token2_counts(llm, prompt, n, **params):
    sp = SamplingParams(max_tokens=3, ignore_eos=True, **{"temperature": 1.0, **params})
    outs = llm.generate([prompt] * n, sp)
    return np.bincount([o.token_ids[1] for o in outs], minlength=96), outs


def test_sampled_tokens_follow_the_target_distribution(qwen3_dir, sampled_eagle_llm):
    prompt = [5, 17, 30, 2, 9]
    counts, outs = _token2_counts(sampled_eagle_llm, prompt, 4000)
    assert sum(o.num_accepted for o in outs) > 300 and sum(o.num_drafted - o.num_accepted for o in outs) > 300
    assert chi_square_p(counts, _exact_token2_marginal(qwen3_dir, prompt)) > 1e-3


def test_the_verifier_reads_q_in_the_heads_draft_vocabulary(sampled_eagle_llm, monkeypatch):
    """The head hands out q over its 64-token draft vocabulary with the target id of each column; the sampler
    passes it on unmapped (no [sum k, V_target] rows)."""
    import specdec.engine.sampler as sampler

    seen = []
    real = sampler.accept_ragged

    def spy(target_probs, draft_ids, num_drafts, draft_q=None, generators=None):
        seen.append(draft_q)
        return real(target_probs, draft_ids, num_drafts, draft_q, generators)

    monkeypatch.setattr(sampler, "accept_ragged", spy)
    sampled_eagle_llm.generate([[5, 17, 30, 2, 9]] * 4, SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True))
    q = [d for d in seen if d is not None]
    ids = sampled_eagle_llm.engine.speculator.target_ids
    assert q and all(d.probs.shape[1] == 64 and torch.equal(d.vocab_ids, ids) for d in q)


def test_sampled_tokens_follow_the_target_distribution_through_head_graphs(qwen3_dir, head_dir):
    llm = eagle_llm(qwen3_dir, head_dir, 2, max_num_seqs=64, kv_cache_tokens=16384, static_shapes=True,
                    max_graph_batch=64)
    spec, padded, chains = llm.engine.speculator, [], []
    run_layout, run_chain = spec.graphs.run_layout, spec.chain_graphs.run_chain
    spec.graphs.run_layout = lambda *a: padded.append(1) or run_layout(*a)
    spec.chain_graphs.run_chain = lambda *a, **kw: chains.append(1) or run_chain(*a, **kw)
    prompt = [5, 17, 30, 2, 9]
    counts, outs = _token2_counts(llm, prompt, 4000)
    assert sum(o.num_accepted for o in outs) > 300 and sum(o.num_drafted - o.num_accepted for o in outs) > 300
    assert chi_square_p(counts, _exact_token2_marginal(qwen3_dir, prompt)) > 1e-3
    assert len(padded) > 50  # the observes after verify steps went through the padded buckets
    assert len(chains) > 50  # and the chains through the chain graphs, their draws inside
    assert llm.engine.runner.static.acceptance.steps > 50  # and acceptance on the verify steps' fixed shapes


@pytest.mark.parametrize("broken", [False, True])
def test_at_temperature_0_7_with_top_p_the_tokens_follow_the_target(qwen3_dir, head_dir, broken, monkeypatch):
    """The head drafts from its own distribution at the request's settings (T 0.7, top-p 0.9), through the
    graphs and acceptance on the fixed shapes; the emitted tokens follow the target's at those settings, and an
    accept-everything verifier fails."""
    import specdec.engine.sampler as sampler
    import specdec.fixed_accept as fixed_accept

    if broken:
        monkeypatch.setattr(sampler, "accept_ragged", accept_everything)
        monkeypatch.setattr(fixed_accept, "accept_fixed", accept_everything_fixed)
    llm = eagle_llm(qwen3_dir, head_dir, 2, max_num_seqs=64, kv_cache_tokens=16384, static_shapes=True,
                    max_graph_batch=64)
    prompt = [5, 17, 30, 2, 9]
    counts, outs = _token2_counts(llm, prompt, 4000, temperature=0.7, top_p=0.9)
    p = chi_square_p(counts, _exact_token2_marginal(qwen3_dir, prompt, temperature=0.7, top_p=0.9))
    assert llm.engine.runner.static.acceptance.steps > 50
    if broken:
        assert p < 1e-6
    else:  # a few hundred accepted and rejected drafts each (of 8000) give the test its power
        accepted = sum(o.num_accepted for o in outs)
        assert accepted > 200 and sum(o.num_drafted for o in outs) - accepted > 200
        assert p > 1e-3


def test_negative_control_accept_everything_fails(qwen3_dir, sampled_eagle_llm, monkeypatch):
    import specdec.engine.sampler as sampler

    monkeypatch.setattr(sampler, "accept_ragged", accept_everything)
    prompt = [5, 17, 30, 2, 9]
    counts, _ = _token2_counts(sampled_eagle_llm, prompt, 4000)
    assert chi_square_p(counts, _exact_token2_marginal(qwen3_dir, prompt)) < 1e-6


def test_a_head_in_the_published_layout_loads_with_its_own_names(qwen3_dir, head_dir):
    from safetensors import safe_open

    with safe_open(str(head_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
            "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight",
            "lm_head.weight", "d2t", "t2d"} <= names
    config = json.loads((head_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 64
    target = load_model(qwen3_dir, "cpu", torch.float32)
    head = load_eagle3_head(head_dir, target, torch.device("cpu"), torch.float32)
    assert head.d2t.dtype == torch.long and head.t2d.dtype == torch.bool and int(head.t2d.sum()) == 64
    targets = head.target_ids()
    assert bool(head.t2d[targets].all()) and len(set(targets.tolist())) == 64


@pytest.mark.parametrize("field,value,message", [
    ("target_hidden_size", 48, "target_hidden_size"),
    ("hidden_size", 48, "fc.weight has shape"),
    ("vocab_size", 128, "vocab_size"),
    ("eagle_config", {"eagle_aux_hidden_state_layer_ids": [0, 1, 5]}, "eagle_aux_hidden_state_layer_ids"),
])
def test_a_head_that_does_not_fit_its_target_is_refused(qwen3_dir, head_dir, tmp_path, field, value, message):
    import shutil

    bad = shutil.copytree(head_dir, tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    config[field] = value
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message) as info:
        eagle_llm(qwen3_dir, bad)
    assert "config.json" in str(info.value)


def test_a_head_with_a_missing_weight_is_refused(qwen3_dir, head_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    bad = shutil.copytree(head_dir, tmp_path / "bad")
    state = load_file(str(bad / "model.safetensors"))
    del state["fc.weight"]
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="fc.weight"):
        eagle_llm(qwen3_dir, bad)


def test_a_whole_model_passed_as_a_head_is_refused_for_what_it_is(qwen3_dir, head_dir):
    """A draft model's directory (Qwen3ForCausalLM weights) given to --speculator eagle3: the error says it is
    not an EAGLE-3 head and which speculator takes it, not a shape mismatch."""
    with pytest.raises(ModelLoadError, match=r"is not an EAGLE-3 head.*Qwen3ForCausalLM.*--speculator draft"):
        eagle_llm(qwen3_dir, qwen3_dir)


def test_a_kv_cache_sized_from_free_memory_leaves_the_head_room_for_as_many_blocks(qwen3_dir, head_dir,
                                                                                    monkeypatch):
    from specdec.engine.kv_cache import KVCache, num_blocks_for
    from specdec.models.config import ModelConfig
    from specdec.speculate.build import shared_kv_bytes_per_token

    head = json.loads((head_dir / "config.json").read_text())
    per_token = shared_kv_bytes_per_token(SpecConfig("eagle3", model=str(head_dir)), torch.float32)
    assert per_token == 2 * head["num_key_value_heads"] * head["head_dim"] * 4  # one layer, float32
    assert shared_kv_bytes_per_token(SpecConfig("eagle3", model=str(head_dir), draft_twin="qwen3-8b"),
                                     torch.bfloat16) == 2 * 8 * 128 * 2  # the twin head's layer
    assert shared_kv_bytes_per_token(SpecConfig("ngram"), torch.float32) == 0  # no cache on the target's blocks
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (64 << 30, 80 << 30))
    target = ModelConfig.from_dict(json.loads((qwen3_dir / "config.json").read_text()))
    target_bytes = KVCache.bytes_per_token(target, torch.float32)
    alone = num_blocks_for(target, 16, torch.float32, torch.device("cuda"), None, 0.9)
    shared = num_blocks_for(target, 16, torch.float32, torch.device("cuda"), None, 0.9, 0, per_token)
    assert abs(shared - alone * target_bytes / (target_bytes + per_token)) <= 1  # one budget, both caches in it
