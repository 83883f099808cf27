"""Qwen3.5's MTP head (--speculator mtp): its forward and every chain the engine drafts against an independent
implementation, lossless greedy drafting at k = 1..4 (with preemption and chunked prefill, in both checkpoint
layouts), sampled tokens that follow the target's distribution (with an accept-everything control that fails),
and the refusals."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.engine.kv_cache import KVCache
from specdec.engine.runner import flat_attention_batch
from specdec.errors import ConfigError, ModelLoadError
from specdec.models.config import ModelConfig
from specdec.models.loader import load_model
from specdec.models.mtp import load_mtp_head, random_mtp_state
from specdec.speculate import SpecConfig
from tests.checkpoints import add_mtp_weights, save_tiny
from tests.test_qwen3_5 import Pools, build_hf, max_diff, rewrite
from tests.test_qwen3_5_engine import PROMPTS, check_sampled_token2

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def save_with_mtp(hf, path, seed: int = 5, **save_kw):
    """Save a transformers Qwen3.5 model with random mtp.* weights beside it, as a published checkpoint."""
    hf.save_pretrained(path, **save_kw)
    return add_mtp_weights(path, random_mtp_state(ModelConfig.from_dir(path), seed=seed))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return saved_target(tmp_path_factory)


def saved_target(tmp_path_factory):
    """(text-only checkpoint with mtp.*, the plain engine's greedy continuations of PROMPTS: transformers' own, as
    tests/test_qwen3_5_engine.py checks)."""
    path = save_with_mtp(build_hf("two-full"), tmp_path_factory.mktemp("mtp"))
    plain = LLM(path, device="cpu", kv_cache_tokens=2048, block_size=4).generate(PROMPTS, GREEDY)
    return path, [o.token_ids for o in plain]


def mtp_llm(path, k: int, **kw) -> LLM:
    kw.setdefault("kv_cache_tokens", 2048)
    kw.setdefault("block_size", 4)
    return LLM(path, device="cpu", speculator=SpecConfig("mtp", num_draft_tokens=k, adaptive=False), **kw)


# ---------------------------------------------------------------------------------------------- the head


class ReferenceHead:
    """The MTP head written out independently of specdec: [norm(embedding) ; norm(hidden)] -> fc -> transformers'
    own full-attention decoder layer (causal over the rows, positions 0..T-1) -> norm; logits by the LM head."""

    def __init__(self, path):
        import transformers
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5TextRotaryEmbedding

        from specdec.models.loader import read_mtp_state

        self.hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        self.mtp = read_mtp_state(path, "cpu", torch.float32)
        config = self.hf.config
        config._attn_implementation = "eager"
        self.layer = Qwen3_5DecoderLayer(config, layer_idx=config.layer_types.index("full_attention")).eval()
        prefix = "mtp.layers.0."
        self.layer.load_state_dict({k[len(prefix):]: v for k, v in self.mtp.items() if k.startswith(prefix)})
        self.rotary = Qwen3_5TextRotaryEmbedding(config)
        self.eps = config.rms_norm_eps

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:  # Qwen3.5's zero-centred RMSNorm
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.mtp[f"mtp.{name}.weight"])

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] beside the embeddings of next_ids [T] -> the head's states [T, H]."""
        embeds = self.norm(self.hf.model.embed_tokens(next_ids), "pre_fc_norm_embedding")
        x = torch.cat([embeds, self.norm(hidden, "pre_fc_norm_hidden")], dim=-1) @ self.mtp["mtp.fc.weight"].T
        t = x.shape[0]
        positions = torch.arange(t)[None]
        causal = torch.full((t, t), float("-inf")).triu(1)[None, None]
        out = self.layer(x[None], self.rotary(x, positions[None].expand(3, 1, -1)), attention_mask=causal,
                         position_ids=positions)
        return self.norm((out[0] if isinstance(out, tuple) else out)[0], "norm")

    @torch.no_grad()
    def target_hidden(self, ids: list[int]) -> torch.Tensor:
        """transformers' last hidden state (after the final norm) [T, H] of the sequence ids."""
        return self.hf(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]

    @torch.no_grad()
    def chain(self, ids: list[int], hidden: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """The head's distributions [len(drafts), V] over drafts 1.. of a request holding tokens ids, the target's
        last hidden states hidden [>= len(ids) - 1, H] of a sequence they begin: positions 0..len(ids) - 2 read
        the target's state beside the next token, then each draft is fed beside the head's own previous output."""
        hidden, fed = hidden[:len(ids) - 1], torch.tensor(ids[1:])
        probs = []
        for draft in drafts:
            states = self(hidden, fed)
            probs.append(self.hf.lm_head(states[-1]).softmax(-1))
            hidden, fed = torch.cat([hidden, states[-1:]]), torch.cat([fed, torch.tensor([draft])])
        return torch.stack(probs)


def test_the_head_equals_an_independent_implementation(target):
    """Over a prompt's positions: the engine's captured final feature is transformers' last hidden state, and the
    head fed it beside the next tokens gives the written-out head's states (concat order, norms, fc, layer)."""
    path, _ = target
    ref = ReferenceHead(path)
    ids = torch.randint(2, 300, (30,), generator=torch.Generator().manual_seed(4))
    model = load_model(path)
    model.capture_features((model.config.num_hidden_layers,), max_rows=64)
    Pools(model).feed(0, ids.tolist(), [30])
    hidden = ref.target_hidden(ids.tolist())  # [30, H]
    assert max_diff(model.features[:30], hidden) <= 1e-4
    head = load_mtp_head(path, model, torch.device("cpu"), torch.float32)
    kv = KVCache(head.config.layer, 16, 4, torch.device("cpu"), torch.float32)
    t = 29
    batch = flat_attention_batch([list(range(1, 9))], [0, t], [t], [4 + p for p in range(t)], 4, torch.device("cpu"))
    with torch.no_grad():
        got = head(ids[1:], torch.arange(t), model.features[:t], batch, kv.layers[0])  # [29, H]
    assert max_diff(got, ref(hidden[:-1], ids[1:])) <= 1e-4


def test_every_draft_is_the_reference_heads(target):
    """Every chain the engine drafts (k = 3) after prefills and after verify steps that kept some drafts: a greedy
    request's drafts are the reference head's argmax chain, a sampled request's q rows its distributions."""
    path, _ = target
    ref = ReferenceHead(path)
    llm = mtp_llm(path, 3)
    spec = llm.engine.speculator
    seen = []  # (tokens, drafts, q rows or None)
    propose = spec.propose

    def recording(requests, ks):
        propose(requests, ks)
        seen.extend((r.all_token_ids, list(r.draft_token_ids), r.draft_probs) for r in requests if r.draft_token_ids)

    spec.propose = recording
    params = [GREEDY, SamplingParams(max_tokens=24, temperature=1.0, seed=1, ignore_eos=True)]
    outs = llm.generate(PROMPTS[:2], params)
    assert outs[1].num_accepted >= 4  # some verify steps kept drafts
    assert len(seen) >= 12 and any(q is not None for _, _, q in seen)
    finals = [prompt + out.token_ids for prompt, out in zip(PROMPTS, outs)]
    hidden = [ref.target_hidden(ids) for ids in finals]  # a prefix's states are the whole sequence's first rows
    for ids, drafts, q in seen:
        probs = ref.chain(ids, hidden[next(i for i, f in enumerate(finals) if f[:len(ids)] == ids)], drafts)
        if q is None:
            assert drafts == probs.argmax(-1).tolist()
        else:
            assert max_diff(q, probs) <= 1e-4


# ---------------------------------------------------------------------------------------------- lossless


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_equals_plain_decoding(target, k):
    path, expected = target
    llm = mtp_llm(path, k)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    assert llm.engine.metrics()["draft_tokens"] > 0


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_equals_plain_decoding_in_fixed_shape_steps(target, k):
    """The CUDA-graph path (padded decode / verify steps, run eagerly on a CPU) with the head's drafts."""
    path, expected = target
    llm = mtp_llm(path, k, static_shapes=True)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    assert llm.engine.metrics()["accepted_tokens"] > 0
    assert llm.engine.runner.eager_forwards < llm.engine.stats["steps"] / 2
    head = llm.engine.speculator
    assert head.graphs is not None and head.stats["head_eager_forwards"] < llm.engine.stats["steps"] / 4


def test_greedy_equals_plain_under_preemption_and_chunked_prefill(target):
    path, expected = target
    llm = mtp_llm(path, 3, kv_cache_tokens=96, max_num_batched_tokens=8)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("static_shapes", [False, True])
def test_greedy_equals_plain_in_piecewise_steps(target, static_shapes):
    """Eager steps through engine/piecewise_hybrid.py (opt-in) keep the final-normed features the head reads."""
    path, expected = target
    llm = mtp_llm(path, 3, kv_cache_tokens=96, max_num_batched_tokens=8, piecewise_graphs=True,
                  static_shapes=static_shapes)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    runner = llm.engine.runner
    assert runner.piecewise.forwards == runner.eager_forwards > 0
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.metrics()["accepted_tokens"] > 0


@pytest.mark.parametrize("max_num_seqs,static_shapes", [(None, False), (2, False), (2, True)])
def test_adaptive_k_calibrates_on_the_hybrid_target(target, max_num_seqs, static_shapes):
    """Start-up calibration times scratch steps of many sequences: each takes a recurrent-state slot, which it
    gives back (they outnumbered the slots before), never more sequences than there are slots (max_num_seqs 2:
    the calibration ran out of slots before), and the output stays plain decoding's."""
    path, expected = target
    sizes = {} if max_num_seqs is None else {"max_num_seqs": max_num_seqs}
    llm = LLM(path, device="cpu", kv_cache_tokens=2048, block_size=4, speculator=SpecConfig("mtp", num_draft_tokens=2),
              static_shapes=static_shapes, **sizes)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    assert sorted(llm.engine.states.free) == list(range(llm.engine.config.max_num_seqs + 1))  # every slot back


def test_the_nested_sharded_layout_loads_its_top_level_mtp_weights(tmp_path):
    """Qwen3_5ForConditionalGeneration keeps the text model under model.language_model.* and the head at mtp.*;
    here sharded, the head in a shard of its own."""
    path = save_with_mtp(build_hf("one-full", multimodal=True, seed=3), tmp_path, max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    plain = LLM(path, device="cpu", kv_cache_tokens=1024, block_size=4).generate(PROMPTS[:2], GREEDY)
    llm = mtp_llm(path, 2)
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY)] == [o.token_ids for o in plain]
    assert llm.engine.metrics()["draft_tokens"] > 0


# ---------------------------------------------------------------------------------------------- sampled


@pytest.mark.parametrize("broken", [False, True])
def test_sampled_tokens_follow_the_target(target, broken, monkeypatch):
    """Drafts sampled from the head at temperature 1, verified on the hybrid target: the second token follows the
    target's exact marginal; an accept-everything verifier fails the same check."""
    check_sampled_token2(target[0], SpecConfig("mtp", num_draft_tokens=2, adaptive=False), 1200, broken, monkeypatch)


@pytest.mark.parametrize("broken", [False, True])
def test_sampled_tokens_follow_the_target_in_fixed_shape_steps(target, broken, monkeypatch):
    """The same through padded verify steps, whose recurrent states are committed on the device."""
    check_sampled_token2(target[0], SpecConfig("mtp", num_draft_tokens=2, adaptive=False), 1200, broken, monkeypatch,
                         static_shapes=True)


# ---------------------------------------------------------------------------------------------- refusals


def test_a_checkpoint_without_mtp_weights_is_refused(tmp_path):
    build_hf("one-full").save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"no MTP weights \(mtp\.\*\).*original checkpoint, or another speculator"):
        mtp_llm(tmp_path, 2)


def test_a_dense_target_and_a_draft_model_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="Qwen3.5's own multi-token-prediction head.*qwen3 model"):
        mtp_llm(save_tiny(tmp_path, tokenizer=False), 2)
    with pytest.raises(ConfigError, match="leave out model / --draft-model"):
        SpecConfig("mtp", model="somewhere")


def test_a_misshapen_mtp_weight_is_refused_naming_it_and_the_field(target, tmp_path):
    path, _ = target
    rewrite(path, tmp_path, lambda s: s.update({"mtp.fc.weight": torch.zeros(64, 100)}))
    with pytest.raises(ModelLoadError, match=r"mtp\.fc\.weight has shape \(64, 100\), but config\.json's hidden_size "
                                             r"imply \(64, 128\)"):
        mtp_llm(tmp_path, 2)
    rewrite(path, tmp_path, lambda s: s.pop("mtp.norm.weight"))
    with pytest.raises(ModelLoadError, match=r"lacks weights \['mtp\.norm\.weight'\]"):
        mtp_llm(tmp_path, 2)
