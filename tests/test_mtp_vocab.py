"""The MTP head over a reduced draft vocabulary (draft_token_map / draft_vocab_size): greedy output stays plain
decoding's and sampled tokens the target's distribution (an accept-everything control fails) with a vocabulary
that leaves out tokens the target emits; the head's q is the full head's softmax restricted to its ids; on a
twin the padded ids stay masked; the most frequent ids of a tokenizer over a text; and every refusal."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.cli import build_parser
from specdec.errors import ConfigError
from specdec.speculate import SpecConfig, spec_config_from_args
from specdec.speculate import draft_vocab
from specdec.speculate.draft_vocab import check_token_ids, draft_token_ids, most_frequent, read_token_map
from tests.test_mtp import GREEDY, saved_target
from tests.test_fixed_accept import expected_keys
from tests.test_qwen3_5_engine import PROMPTS, _token2_marginal, check_sampled_token2

VOCAB = 300  # the tiny Qwen3.5's
# every id but multiples of 3 (and ids 1..5 kept): a third of what the target emits is never drafted
REDUCED = sorted(set(range(1, 6)) | {t for t in range(VOCAB) if t % 3})


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(the tiny Qwen3.5 with random mtp.* weights, plain greedy continuations of PROMPTS): tests/test_mtp.py's."""
    return saved_target(tmp_path_factory)


def token_map(tmp_path, ids, name: str = "map.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(ids))
    return str(path)


def vocab_llm(path, map_file: str, k: int, **kw) -> LLM:
    spec = SpecConfig("mtp", num_draft_tokens=k, adaptive=False, draft_token_map=map_file)
    return LLM(path, device="cpu", kv_cache_tokens=2048, block_size=4, speculator=spec, **kw)


def recorded_drafts(llm: LLM) -> list[int]:
    """Every token the speculator drafts from now on (a list that fills as the engine runs)."""
    spec, drafts = llm.engine.speculator, []
    propose = spec.propose

    def recording(requests, ks):
        propose(requests, ks)
        drafts.extend(t for r in requests for t in r.draft_token_ids)

    spec.propose = recording
    return drafts


# ---------------------------------------------------------------------------------------------- lossless


@pytest.mark.parametrize("k,static_shapes", [(1, False), (3, False), (3, True)])
def test_greedy_equals_plain_decoding_with_a_reduced_vocabulary(target, tmp_path, k, static_shapes):
    """static_shapes: the chain-graph path (every draw and forward as one padded step) maps draft ids too."""
    path, expected = target
    emitted = {t for out in expected for t in out}
    assert emitted - set(REDUCED) and emitted & set(REDUCED)  # some of what the target says is never drafted
    llm = vocab_llm(path, token_map(tmp_path, REDUCED), k, static_shapes=static_shapes)
    drafts = recorded_drafts(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    assert drafts and set(drafts) <= set(REDUCED)
    assert llm.engine.metrics()["accepted_tokens"] > 0


def high_probability_gaps(path) -> list[int]:
    """REDUCED less the ten most likely second tokens of check_sampled_token2's prompt: the tiny target's
    distribution is flat, so what matters is the mass outside the vocabulary, which only the residual gives."""
    marginal = _token2_marginal(path, [5, 17, 30, 2, 9, 41])
    top = set(np.argsort(-marginal)[:10].tolist())
    ids = [t for t in REDUCED if t not in top]
    assert 1 - marginal[ids].sum() > 0.3, marginal[ids].sum()
    return ids


@pytest.mark.parametrize("broken,static_shapes", [(False, False), (True, False), (False, True)])
def test_sampled_tokens_follow_the_target_with_a_reduced_vocabulary(target, tmp_path, broken, static_shapes,
                                                                     monkeypatch):
    path = target[0]
    spec = SpecConfig("mtp", num_draft_tokens=2, adaptive=False,
                      draft_token_map=token_map(tmp_path, high_probability_gaps(path)))
    check_sampled_token2(path, spec, 1200, broken, monkeypatch, static_shapes=static_shapes)


def test_the_draft_distribution_is_the_full_heads_restricted_to_its_ids(target, tmp_path):
    llm = vocab_llm(target[0], token_map(tmp_path, list(reversed(REDUCED))), 2)  # any order in the file
    spec, ids = llm.engine.speculator, torch.tensor(REDUCED)
    head = spec.head
    assert torch.equal(head.target_ids(), ids) and spec.target_ids is head.target_ids()
    assert head.config.draft_vocab_size == len(REDUCED) and head.lm_head.weight.shape == (len(REDUCED), 64)
    assert llm.model.lm_head.weight.shape == (VOCAB, 64)  # the target's own head keeps every row
    states = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    full = states @ llm.model.lm_head.weight.T  # [6, V]
    expected = full.softmax(-1)[:, ids]
    expected = expected / expected.sum(-1, keepdim=True)  # renormalised over the draft vocabulary
    assert (head.logits(states).softmax(-1) - expected).abs().max().item() < 1e-6


def test_a_twin_s_padded_ids_in_the_draft_vocabulary_stay_masked(tmp_path):
    """On a twin of vocabulary 320 for 300, a draft vocabulary with padded ids (300..319) drafts what the small
    model's head drafts over the same real ids: the padded columns, the last ones, are masked."""
    from tests.test_twin_qwen3_5 import SHAPE, mtp_run, save_with_mtp
    from tests.test_qwen3_5 import build_hf

    path = save_with_mtp(build_hf("two-full"), tmp_path / "model")
    real = token_map(tmp_path, REDUCED, "real.json")
    padded = token_map(tmp_path, REDUCED + list(range(300, 320, 2)), "padded.json")
    greedy = [GREEDY] * 3
    outs, drafts, stats = mtp_run(path, params=greedy, draft_token_map=real)
    twin_outs, twin_drafts, twin_stats = mtp_run(path, twin=SHAPE, params=greedy, draft_token_map=padded)
    assert twin_outs == outs and twin_drafts == drafts and len(drafts) >= 10
    for key in ("verify_steps", "draft_tokens", "accepted_tokens"):
        assert twin_stats[key] == stats[key], key
    llm = LLM(path, device="cpu", kv_cache_tokens=256, block_size=4, twin=SHAPE,
              speculator=SpecConfig("mtp", num_draft_tokens=2, adaptive=False, draft_token_map=padded))
    logits = llm.engine.speculator.head.logits(torch.randn(4, 96))  # [4, V_d]: the last 10 columns are padding
    assert logits.shape == (4, len(REDUCED) + 10)
    assert torch.isinf(logits[:, -10:]).all() and torch.isfinite(logits[:, :-10]).all()


# ---------------------------------------------------------------------------------------------- the most frequent


@pytest.fixture
def word_tokenizer(tmp_path):
    """A model directory whose tokenizer.json splits on whitespace: ids 0 [UNK], 1 a, 2 b, 3 c, 4 d, 5 e, 6 f."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {w: i for i, w in enumerate(["[UNK]", "a", "b", "c", "d", "e", "f"])}
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_the_most_frequent_ids_ties_by_id_and_never_an_unproduced_one_first(word_tokenizer):
    from specdec.tokenizer import Tokenizer

    counts = draft_vocab.token_counts(["c e c b", "e b c a"], Tokenizer(word_tokenizer), 8)  # ids 6, 7: never
    assert counts.tolist() == [0, 1, 2, 3, 0, 2, 0, 0]
    assert most_frequent(counts, 1) == [3]
    assert most_frequent(counts, 2) == [2, 3]  # b and e tie at 2: the lower id
    assert most_frequent(counts, 4) == [1, 2, 3, 5]  # a (once) before the unproduced 0 and 4
    assert most_frequent(counts, 6) == [0, 1, 2, 3, 4, 5]  # then the unproduced by id


def test_draft_vocab_size_counts_the_corpus_once_then_reads_the_cache(word_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(draft_vocab, "corpus_texts", lambda chars: iter(["d d d f", "f a d"]))
    assert draft_token_ids(None, 2, word_tokenizer, 7) == [4, 6]
    assert list((tmp_path / "cache" / "draft-vocab").glob("*.json"))

    def no_corpus(chars):
        raise AssertionError("the cached counts are read, the corpus is not")

    monkeypatch.setattr(draft_vocab, "corpus_texts", no_corpus)
    assert draft_token_ids(None, 3, word_tokenizer, 7) == [1, 4, 6]
    with pytest.raises(ConfigError, match=r"--draft-vocab-size 8 is larger than the target's vocabulary of 7"):
        draft_token_ids(None, 8, word_tokenizer, 7)
    with pytest.raises(ConfigError, match=r"has no tokenizer.json: pass draft_token_map / --draft-token-map"):
        draft_token_ids(None, 3, tmp_path / "cache", 7)


def test_the_corpus_text_is_bounded():
    texts = list(draft_vocab.corpus_texts(40_000))
    assert texts and sum(len(t) for t in texts) <= 40_000


def test_draft_vocab_size_on_the_bundled_hybrid_keeps_greedy_output(tmp_path, monkeypatch):
    """ref-hybrid ships a tokenizer: its 512 most frequent ids over a text (here a short one) through the engine."""
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(draft_vocab, "corpus_texts", lambda chars: iter([_heldout_text()]))
    prompt, params = "def fibonacci(n):", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = LLM("ref-hybrid", device="cpu", kv_cache_tokens=1024).generate([prompt], params)[0].token_ids
    spec = SpecConfig("mtp", num_draft_tokens=2, adaptive=False, draft_vocab_size=512)
    llm = LLM("ref-hybrid", device="cpu", kv_cache_tokens=1024, speculator=spec)
    assert llm.engine.speculator.head.config.draft_vocab_size == 512
    assert llm.generate([prompt], params)[0].token_ids == plain
    assert llm.engine.metrics()["accepted_tokens"] > 0


def _heldout_text() -> str:
    """The bundled held-out prompts' text (prefixes of Python files)."""
    from specdec.assets import heldout_prompts_path

    return "\n".join(json.loads(line)["prompt"] for line in heldout_prompts_path().read_text().splitlines())


# ---------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("content,message", [
    ("[1, 2", r"not JSON .*write a JSON list of distinct target token ids"),
    ('{"ids": [1]}', r"not a list of integer token ids"),
    ("[1, 2.5]", r"not a list of integer token ids"),
    ("[1, true]", r"not a list of integer token ids"),
    ("[]", r"the list is empty"),
    ("[0, 299, 300, -1]", r"ids out of range \[0, 300\) of the target's vocabulary: \[300, -1\]"),
    ("[4, 5, 4, 7, 7]", r"ids listed more than once: \[4, 7\]"),
    (json.dumps(list(range(301))), r"301 ids, more than the target's vocabulary of 300"),
], ids=["not-json", "not-a-list", "a-float", "a-bool", "empty", "out-of-range", "repeated", "too-many"])
def test_a_bad_token_map_is_refused_naming_the_file(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=rf"draft token map {path}: {message}"):
        read_token_map(path, VOCAB)


def test_an_unreadable_token_map_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=rf"draft token map {tmp_path / 'none.json'}: cannot read it"):
        read_token_map(tmp_path / "none.json", VOCAB)
    assert check_token_ids([9, 3, 5], VOCAB, "x") == [3, 5, 9]


def test_the_engine_refuses_a_bad_map_and_a_size_past_the_vocabulary(target, tmp_path):
    path = target[0]
    with pytest.raises(ConfigError, match=r"draft token map .*map.json: ids out of range \[0, 300\)"):
        vocab_llm(path, token_map(tmp_path, [1, 300]), 2)
    spec = SpecConfig("mtp", num_draft_tokens=2, adaptive=False, draft_vocab_size=301)
    with pytest.raises(ConfigError, match=r"--draft-vocab-size 301 is larger than the target's vocabulary of 300"):
        LLM(path, device="cpu", kv_cache_tokens=2048, block_size=4, speculator=spec)


def test_spec_config_refuses_a_draft_vocabulary_for_other_speculators_and_both_ways_at_once():
    with pytest.raises(ConfigError, match=r"--draft-vocab-size sets the mtp speculator's draft vocabulary, not "
                                          r"'eagle3''s \(an EAGLE-3 head carries its own, d2t\)"):
        SpecConfig("eagle3", model="head", draft_vocab_size=32)
    with pytest.raises(ConfigError, match=r"--draft-token-map sets the mtp speculator's draft vocabulary, not 'ngram'"):
        SpecConfig("ngram", draft_token_map="map.json")
    with pytest.raises(ConfigError, match=r"both choose the draft vocabulary: pass one"):
        SpecConfig("mtp", draft_token_map="map.json", draft_vocab_size=32)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ConfigError, match=r"draft_vocab_size / --draft-vocab-size must be a positive integer"):
            SpecConfig("mtp", draft_vocab_size=bad)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_flags_reach_spec_config(command):
    parser = build_parser()
    args = parser.parse_args([command, "m", "--speculator", "mtp", "--draft-vocab-size", "32768"])
    assert spec_config_from_args(args).draft_vocab_size == 32768
    args = parser.parse_args([command, "m", "--speculator", "mtp", "--draft-token-map", "ids.json"])
    assert spec_config_from_args(args).draft_token_map == "ids.json"
    args = parser.parse_args([command, "m", "--speculator", "draft", "--draft-model", "d", "--draft-vocab-size", "8"])
    with pytest.raises(ConfigError, match="sets the mtp speculator's draft vocabulary, not 'draft'"):
        spec_config_from_args(args)


# ---------------------------------------------------------------------------------------------- precapture


@pytest.mark.parametrize("reduced", [True, False])
def test_precapture_prepares_the_acceptance_at_the_heads_q_width(target, tmp_path, reduced):
    """With fixed acceptance, Engine.precapture_graphs (run on a CPU with eager=True) makes each (B, q)'s sampled
    key at the head's q width (its reduced vocabulary, mapped, or the target's whole one) and without q rows; greedy and seeded sampled
    serving then make no key, and (reduced) the outputs are those of an engine without precapture."""
    path = target[0]
    spec = SpecConfig("mtp", num_draft_tokens=2, adaptive=False,
                      draft_token_map=token_map(tmp_path, REDUCED) if reduced else None)
    llm, lazy = [LLM(path, device="cpu", kv_cache_tokens=2048, block_size=4, speculator=spec, static_shapes=True,
                     max_graph_batch=4, max_graph_context=256) if i == 0 or reduced else None for i in range(2)]
    width, mapped = (len(REDUCED), True) if reduced else (VOCAB, False)
    assert llm.engine.speculator.q_width() == (width, mapped)
    llm.engine.precapture_graphs(eager=True)
    acceptance = llm.engine.runner.static.acceptance
    keys = expected_keys([1, 2, 3], width, mapped)
    assert set(acceptance.shapes) == keys
    seeded = SamplingParams(max_tokens=16 if reduced else 8, temperature=1.0, seed=5, ignore_eos=True)
    for params in (GREEDY, seeded) if reduced else (seeded,):
        outs = [o.token_ids for o in llm.generate(PROMPTS[:3], params)]
        assert lazy is None or outs == [o.token_ids for o in lazy.generate(PROMPTS[:3], params)]
        assert set(acceptance.shapes) == keys
    assert acceptance.steps
