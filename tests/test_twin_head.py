"""Scaled twins of EAGLE-3 heads draft what the small head drafts, on the twin target's features."""

from __future__ import annotations

import json

import pytest
import torch

from specdec import LLM, ConfigError
from specdec.cli import main
from specdec.models.eagle3 import load_eagle3_head, random_head, save_eagle3_head
from specdec.models.loader import load_model
from specdec.models.twin import LOGIT_MARGIN, make_twin
from specdec.models.twin_head import head_forward, make_head_twin, target_features
from specdec.speculate import SpecConfig
from tests.test_speculative import GREEDY, mixed_prompts

SHAPE = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
             num_key_value_heads=4, head_dim=16, vocab_size=128, tie_word_embeddings=False)
FEATURES = (0, 1, 1)
DRAFT_VOCAB = 64  # padded to 64 + (128 - 96) = 96: one padded target id for each padded draft id


@pytest.fixture(scope="module")
def small(qwen3_dir):
    return load_model(qwen3_dir, "cpu", torch.float32)


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, small):
    head = random_head(small, seed=3, draft_vocab=DRAFT_VOCAB, std=0.3, feature_layers=FEATURES)
    return save_eagle3_head(head, tmp_path_factory.mktemp("head"))


@pytest.fixture(scope="module")
def head(head_dir, small):
    return load_eagle3_head(head_dir, small, torch.device("cpu"), torch.float32)


def draft_logits(head, target, ids: list[int], passes: int = 3) -> list[torch.Tensor]:
    """The head's logits [T - 1, V_draft] on the target's features, then fed its own outputs back `passes`
    times (the state at p is its output at p - 1, as drafting feeds it)."""
    feats = target_features(target, FEATURES, ids, target.config.hidden_size)[:-1]
    tokens = torch.tensor(ids[1:])
    states = head.project(feats)
    out = []
    for _ in range(passes + 1):
        states_out = head_forward(head, tokens, states)
        out.append(head.logits(states_out))
        states = torch.cat([states[:1], states_out[:-1]])
    return out


# Without noise the twin differs only in float32 summation order over padded dimensions: logits of
# magnitude ~3 agree to ~1e-4 after four fed-back passes, to a degree that depends on the CPU's BLAS.
@pytest.mark.parametrize("noise,tol", [(0.0, 5e-4), (1e-6, 1e-3)])
def test_twin_head_gives_the_small_heads_logits_and_drafts(small, head, noise, tol):
    twin = make_twin(small, SHAPE, noise=noise)
    twin_head = make_head_twin(head, twin, SHAPE, noise=noise, small_target=small)
    ids = torch.randint(0, 96, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    for ref, got in zip(draft_logits(head, small, ids), draft_logits(twin_head, twin, ids)):
        assert got.shape[1] == 96
        assert (got[:, :DRAFT_VOCAB] - ref).abs().max().item() <= tol
        real_min = ref.min(-1).values  # [T]
        assert bool((got[:, DRAFT_VOCAB:].max(-1).values <= real_min - LOGIT_MARGIN).all())
        assert torch.equal(got.argmax(-1), ref.argmax(-1))  # the same greedy drafts


def test_twin_head_config_names_its_feature_layers_and_maps_padded_ids_apart(small, head):
    twin_head = make_head_twin(head, make_twin(small, SHAPE), SHAPE, small_target=small)
    c = twin_head.config
    assert (c.layer.hidden_size, c.layer.num_attention_heads, c.layer.head_dim, c.target_hidden_size) == (48, 8, 16, 48)
    assert c.draft_vocab_size == 96 and c.layer.vocab_size == 128
    assert c.to_dict()["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(FEATURES)
    targets = twin_head.target_ids()
    assert torch.equal(targets[:DRAFT_VOCAB], head.target_ids())
    assert sorted(targets[DRAFT_VOCAB:].tolist()) == list(range(96, 128))  # distinct padded target ids
    assert bool(twin_head.t2d[targets].all()) and int(twin_head.t2d.sum()) == 96


def test_draft_vocabularies_beyond_the_padded_target_ids_are_refused(small, head):
    twin = make_twin(small, SHAPE)
    with pytest.raises(ConfigError, match="padded target ids"):
        make_head_twin(head, twin, SHAPE, draft_vocab=97, small_target=small)
    with pytest.raises(ConfigError, match="not a scaled twin"):
        make_head_twin(head, small, SHAPE)


def eagle_pair(target_dir, head_dir, twin=None) -> LLM:
    spec = SpecConfig("eagle3", model=str(head_dir), num_draft_tokens=3, adaptive=False, draft_twin=twin)
    return LLM(target_dir, device="cpu", kv_cache_tokens=4096, block_size=4, twin=twin, speculator=spec)


def test_twin_pair_output_and_acceptance_equal_the_small_pairs(qwen3_dir, head_dir, llm):
    prompts = mixed_prompts(4)
    plain = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    small_pair, twin_pair = eagle_pair(qwen3_dir, head_dir), eagle_pair(qwen3_dir, head_dir, SHAPE)
    assert twin_pair.engine.speculator.head.config.layer.hidden_size == 48
    outs = [twin_pair.generate(prompts, GREEDY), small_pair.generate(prompts, GREEDY)]
    assert [o.token_ids for o in outs[0]] == plain == [o.token_ids for o in outs[1]]
    twin_m, small_m = twin_pair.engine.metrics(), small_pair.engine.metrics()
    assert twin_m["accepted_tokens"] == small_m["accepted_tokens"] > 0
    assert twin_m["draft_tokens"] == small_m["draft_tokens"]


def test_draft_twin_needs_a_twin_target(qwen3_dir, head_dir):
    spec = SpecConfig("eagle3", model=str(head_dir), num_draft_tokens=3, adaptive=False, draft_twin=SHAPE)
    with pytest.raises(ConfigError, match="twin"):
        LLM(qwen3_dir, device="cpu", kv_cache_tokens=1024, speculator=spec)


def test_written_head_twin_loads_against_the_twin_target(qwen3_dir, head_dir, small, head, tmp_path, capsys):
    shape_file = tmp_path / "shape.json"
    shape_file.write_text(json.dumps(SHAPE))
    out = tmp_path / "head-twin"
    assert main(["twin", str(head_dir), "--shape", str(shape_file), "--out", str(out)]) == 2
    assert "--target" in capsys.readouterr().err
    assert main(["twin", str(head_dir), "--shape", str(shape_file), "--out", str(out),
                 "--target", str(qwen3_dir)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 96
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(FEATURES)
    twin = make_twin(small, SHAPE)
    loaded = load_eagle3_head(out, twin, torch.device("cpu"), torch.float32)
    in_memory = make_head_twin(head, twin, SHAPE, small_target=small)
    ids = torch.randint(0, 96, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    for a, b in zip(draft_logits(loaded, twin, ids, passes=1), draft_logits(in_memory, twin, ids, passes=1)):
        assert (a - b).abs().max().item() <= 1e-5
