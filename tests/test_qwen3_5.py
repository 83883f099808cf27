"""Qwen3.5 hybrid models (Gated DeltaNet + gated full attention) against transformers on the same weights:
whole, chunked and batched prefill, decode with the recurrent state carried in a slot pool, deferred
(speculative) steps and their commit, the ConditionalGeneration layout, bad checkpoints, MTP weights."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.errors import ModelLoadError
from specdec.models.attention import AttentionBatch
from specdec.models.config import ModelConfig
from specdec.models.loader import load_model, random_model, read_mtp_state
from specdec.models.qwen3_5 import HybridCausalLM, PartialRotary
from specdec.models.recurrent_state import StateBatch, commit, new_state_pools

LINEAR, FULL = "linear_attention", "full_attention"
TEXT = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            max_position_embeddings=512, rms_norm_eps=1e-6, eos_token_id=1)
PATTERNS = {  # name -> (layer_types, rope_parameters)
    "one-full": ([LINEAR, LINEAR, LINEAR, FULL],
                 dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                      mrope_section=[2, 1, 1], mrope_interleaved=True)),
    "two-full": ([FULL, LINEAR, LINEAR, FULL],
                 dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                      mrope_section=[3, 3, 2], mrope_interleaved=True)),
}
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=1,
              temporal_patch_size=1, out_hidden_size=64, num_position_embeddings=16)
TOL = 1e-4


def text_config(pattern: str):
    import transformers

    layer_types, rope = PATTERNS[pattern]
    return transformers.Qwen3_5TextConfig(**TEXT, layer_types=layer_types, rope_parameters=rope)


def build_hf(pattern: str, multimodal: bool = False, seed: int = 0):
    """transformers' own random model, its weights then made larger (sharper logits that a wrong piece would
    visibly move: at the default init std 0.02 every logit is within 1e-3 of zero), norms off their init,
    and one slow-decaying value head so the state carries across the 64-token chunks."""
    import transformers

    torch.manual_seed(seed)
    text = text_config(pattern)
    if multimodal:
        config = transformers.Qwen3_5Config(text_config=text.to_dict(), vision_config=VISION)
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    else:
        model = transformers.Qwen3_5ForCausalLM(text)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("A_log"):
                p.copy_(torch.tensor([0.01, 0.3, 2.0, 8.0]).log())
            elif name.endswith("dt_bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif p.dim() >= 2:
                p.normal_(0, 0.12)
    return model.eval()


@pytest.fixture(scope="module", params=sorted(PATTERNS))
def case(request, tmp_path_factory):
    """(model dir, prompt ids [80], transformers' logits [80, V]) per layer pattern."""
    hf = build_hf(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    ids = torch.randint(2, 300, (80,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    return path, ids, ref


class Pools:
    """What the engine keeps for the model: a paged KV cache per attention layer (each sequence owning its
    own blocks), the recurrent-state pools (slot s + 1 for sequence s; slot 0 unused), and each sequence's
    committed length."""

    def __init__(self, model: HybridCausalLM, num_seqs: int = 4, max_len: int = 128, block_size: int = 4):
        c = model.config
        self.model, self.block_size = model, block_size
        self.blocks_per_seq = math.ceil(max_len / block_size)
        slots = (num_seqs * self.blocks_per_seq + 1) * block_size
        shape = (slots, c.num_key_value_heads, c.head_dim)
        self.kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in c.attention_layer_ids]
        self.conv, self.ssm = new_state_pools(c, num_seqs + 1, "cpu", torch.float32)
        self.lens = [0] * num_seqs
        self.forward = model  # what runs a step (a piecewise runner's forward, in its test)

    def table(self, s: int) -> list[int]:
        return [1 + s * self.blocks_per_seq + b for b in range(self.blocks_per_seq)]

    def step(self, feeds: dict[int, list[int]], defer: tuple[int, ...] = ()) -> tuple[list[torch.Tensor], StateBatch]:
        """One flat forward of the sequences in `feeds` (seq -> tokens): logits [n, V] per sequence, and the
        StateBatch (with pending records for the deferred ones, whose lengths are not advanced)."""
        ids, positions, slot_mapping, starts, ctx = [], [], [], [0], []
        for s, tokens in feeds.items():
            table, start = self.table(s), self.lens[s]
            ids += tokens
            positions += range(start, start + len(tokens))
            slot_mapping += [table[p // self.block_size] * self.block_size + p % self.block_size
                             for p in range(start, start + len(tokens))]
            starts.append(starts[-1] + len(tokens))
            ctx.append(start + len(tokens))
        counts = [len(t) for t in feeds.values()]
        batch = AttentionBatch(torch.tensor(starts), torch.tensor(ctx), torch.tensor([self.table(s) for s in feeds]),
                               torch.tensor(slot_mapping), max(counts), max(ctx), host_lens=(counts, ctx))
        batch.prepare(self.block_size)
        batch.states = StateBatch(self.conv, self.ssm, slots=[s + 1 for s in feeds], defer=[s in defer for s in feeds])
        with torch.no_grad():
            logits = self.forward(torch.tensor(ids), torch.tensor(positions), batch, self.kv)
        for s, tokens in feeds.items():
            if s not in defer:
                self.lens[s] += len(tokens)
        return list(torch.split(logits, counts)), batch.states

    def feed(self, s: int, tokens: list[int], chunks: list[int]) -> torch.Tensor:
        """Feed tokens to sequence s in chunks of the given sizes (cycled): logits [len(tokens), V]."""
        out, i, c = [], 0, 0
        while i < len(tokens):
            n = chunks[c % len(chunks)]
            out.append(self.step({s: tokens[i:i + n]})[0][0])
            i, c = i + n, c + 1
        return torch.cat(out)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item() if a.numel() else 0.0


def test_prefill_decode_and_chunked_prefill_match_transformers(case):
    path, ids, ref = case
    model = load_model(path)
    assert isinstance(model, HybridCausalLM)
    assert ref.std().item() > 0.5  # logits that a wrong piece would move
    whole = Pools(model).feed(0, ids, [len(ids)])  # > 64 tokens: crosses a chunk of the chunked form
    assert max_diff(whole, ref) <= TOL
    pools = Pools(model)
    prefill = pools.feed(0, ids[:40], [40])
    decode = pools.feed(0, ids[40:], [1])  # token by token, the state carried in its slot
    assert max_diff(torch.cat([prefill, decode]), ref) <= TOL
    assert max_diff(Pools(model).feed(0, ids, [5, 7]), ref) <= TOL
    assert max_diff(Pools(model).feed(0, ids, [10, 70]), ref) <= TOL  # the chunked form from a carried state


def test_batch_of_three_equals_each_alone(case):
    path, ids, ref = case
    model = load_model(path)
    lengths = [70, 13, 1]
    prompts = [ids[:70], ids[5:18], ids[9:10]]
    alone = [Pools(model).feed(0, p, [len(p)]) for p in prompts]
    assert max_diff(alone[0], ref[:70]) <= TOL
    pools = Pools(model)
    together, _ = pools.step({s: p for s, p in enumerate(prompts)})
    for s in range(3):
        assert together[s].shape[0] == lengths[s]
        assert max_diff(together[s], alone[s]) <= TOL
    # then a mixed step: seq 0 decodes, seq 1 feeds 5, seq 2 decodes, and a new seq 3 prefills 20
    nxt = {0: ids[70:71], 1: ids[18:23], 2: ids[10:11], 3: ids[:20]}
    mixed, _ = pools.step(nxt)
    assert max_diff(mixed[0], ref[70:71]) <= TOL
    assert max_diff(mixed[3], ref[:20]) <= TOL
    for s, prompt in ((1, ids[5:23]), (2, ids[9:11])):
        assert max_diff(mixed[s], Pools(model).feed(0, prompt, [len(prompt)])[-len(nxt[s]):]) <= TOL


@pytest.mark.parametrize("count", [0, 2, 4])
def test_deferred_verify_then_commit_equals_feeding_only_the_accepted(case, count):
    """A 4-token verify step deferred: its logits are those of the state in the slot; commit(count) leaves
    the slot as if only the first `count` tokens had been fed (the others are junk: they must leave no trace
    in the conv or ssm state), and decoding continues on transformers' logits."""
    path, ids, ref = case
    model = load_model(path)
    pools = Pools(model)
    pools.feed(0, ids[:30], [30])
    junk = [7, 8, 9, 10]
    verify = ids[30:30 + count] + junk[count:]
    logits, states = pools.step({0: verify}, defer=(0,))
    assert logits[0].shape[0] == 4
    assert max_diff(logits[0][:count], ref[30:30 + count]) <= TOL  # rows past count read junk
    before = [t.clone() for t in pools.ssm + pools.conv]
    assert all(torch.equal(a, b) for a, b in zip(before, pools.ssm + pools.conv))  # nothing written yet
    commit(states, [count])
    assert states.pending == {}
    pools.lens[0] += count
    direct = Pools(model)
    direct.feed(0, ids[:30 + count], [30] + ([count] if count else []))
    for mine, theirs in zip(pools.ssm + pools.conv, direct.ssm + direct.conv):
        assert max_diff(mine[1], theirs[1]) <= 1e-5
    assert max_diff(pools.feed(0, ids[30 + count:40], [1]), ref[30 + count:40]) <= TOL


def test_commit_in_a_mixed_verify_step(case):
    """Three sequences verifying 4 tokens in one forward: two deferred (counts 1 and 4), one not deferred
    (advanced by the forward; its count is ignored)."""
    path, ids, ref = case
    model = load_model(path)
    pools = Pools(model)
    pools.step({0: ids[:30], 1: ids[:30], 2: ids[:30]})
    feeds = {0: ids[30:31] + [5, 6, 7], 1: ids[30:34], 2: ids[30:34]}
    logits, states = pools.step(feeds, defer=(0, 1))
    for s in range(3):
        assert max_diff(logits[s][:1], ref[30:31]) <= TOL
    assert max_diff(logits[1], ref[30:34]) <= TOL
    with pytest.raises(ValueError, match="count"):
        commit(states, [5, 4, 0])
    commit(states, [1, 4, 99])
    pools.lens[0] += 1
    pools.lens[1] += 4
    assert max_diff(pools.step({0: ids[31:32]})[0][0], ref[31:32]) <= TOL
    both, _ = pools.step({1: ids[34:35], 2: ids[34:35]})
    assert max_diff(both[0], ref[34:35]) <= TOL and max_diff(both[1], ref[34:35]) <= TOL


def test_piecewise_forward_equals_the_plain_one_on_mixed_steps(case):
    """engine/piecewise_hybrid.py: the row-wise pieces on bucket-padded static buffers (run eagerly on a CPU)
    with each mixer's core between them give the plain forward's logits, captured features and states: a
    ragged prefill of three (44 rows, bucket 64), then a mixed step (two decodes and a 5-token feed beside a new
    20-token prefill chunk, one sequence deferred: 27 rows, bucket 32)."""
    from specdec.engine.piecewise_hybrid import HybridPiecewiseRunner

    path, ids, _ = case
    model = load_model(path)
    model.capture_features((0, 2, 4), 64)
    runner = HybridPiecewiseRunner(model, torch.device("cpu"), max_tokens=100, capture=False)
    assert runner.buckets == [16, 32, 64, 128]
    plain, pieces = Pools(model), Pools(model)
    pieces.forward = runner.forward
    steps = [({0: ids[:30], 1: ids[5:18], 2: ids[9:10]}, ()),
             ({0: ids[30:31], 1: ids[18:23], 2: ids[10:11], 3: ids[:20]}, (1,))]
    for feeds, defer in steps:
        rows = sum(len(t) for t in feeds.values())
        want, _ = plain.step(feeds, defer)
        want_features = model.features[:rows].clone()
        got, _ = pieces.step(feeds, defer)
        assert [g.shape for g in got] == [w.shape for w in want]
        assert all(max_diff(g, w) <= 1e-5 for g, w in zip(got, want))
        assert max_diff(model.features[:rows], want_features) <= 1e-5
    assert runner.forwards == 2
    assert all(max_diff(a, b) <= 1e-5 for a, b in zip(pieces.conv + pieces.ssm, plain.conv + plain.ssm))


def test_conditional_generation_layout_and_features(tmp_path, caplog):
    """model.language_model.* loads as model.*, model.visual.* is skipped with one message; the captured
    features are transformers' hidden states; fusing the projections changes nothing."""
    hf = build_hf("one-full", multimodal=True, seed=3)
    hf.save_pretrained(tmp_path)
    ids = torch.randint(2, 300, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([ids]), output_hidden_states=True)
    with caplog.at_level(logging.INFO, logger="specdec"):
        model = load_model(tmp_path)
    assert [r.getMessage() for r in caplog.records].count("vision tower skipped: specdec runs the text model") == 1
    assert model.config.architecture == "qwen3_5"
    model.capture_features((0, 2, 3), max_rows=64)
    pools = Pools(model)
    ours = pools.feed(0, ids[:30], [30])
    assert max_diff(ours, out.logits[0, :30]) <= TOL
    features = model.features[:30].view(30, 3, -1)
    for column, layer in enumerate((0, 2, 3)):
        assert max_diff(features[:, column], out.hidden_states[layer][0, :30]) <= TOL
    assert model.fuse_projections()
    assert max_diff(pools.feed(0, ids[30:], [1]), out.logits[0, 30:]) <= TOL


def test_mrope_text_positions_equal_plain_rope_over_the_rotary_dims():
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    for pattern in PATTERNS:
        hf_config = text_config(pattern)
        raw = json.loads(hf_config.to_json_string()) | {"architectures": ["Qwen3_5ForCausalLM"]}
        config = ModelConfig.from_dict(raw)
        assert config.mrope_section and config.mrope_interleaved
        positions = torch.arange(0, 500, 7)
        hf_cos, hf_sin = Qwen3_5TextRotaryEmbedding(hf_config)(torch.zeros(1, dtype=torch.float32),
                                                               positions[None, None, :].expand(3, 1, -1))
        cos, sin = PartialRotary(config, 512).lookup(positions, torch.float32)
        assert cos.shape[-1] == config.rotary_dim == hf_cos.shape[-1]
        assert max_diff(cos[:, 0], hf_cos[0]) <= 1e-6 and max_diff(sin[:, 0], hf_sin[0]) <= 1e-6


def test_config_fields_and_layer_types():
    raw = dict(TEXT, architectures=["Qwen3_5ForCausalLM"], num_hidden_layers=8)
    config = ModelConfig.from_dict(raw)  # no layer_types: every 4th layer is full attention (transformers)
    import transformers

    assert list(config.layer_types) == transformers.Qwen3_5TextConfig(**dict(TEXT, num_hidden_layers=8)).layer_types
    assert config.attention_layer_ids == (3, 7) and config.linear_layer_ids == (0, 1, 2, 4, 5, 6)
    assert config.num_attention_layers == 2 and config.is_hybrid
    assert config.partial_rotary_factor == 0.25 and config.attn_output_gate and config.zero_centred_norm
    assert ModelConfig.from_dict(dict(raw, full_attention_interval=2)).attention_layer_ids == (1, 3, 5, 7)
    nested = {"architectures": ["Qwen3_5ForConditionalGeneration"], "eos_token_id": 5, "tie_word_embeddings": True,
              "text_config": dict(TEXT, eos_token_id=None, tie_word_embeddings=False)}
    c = ModelConfig.from_dict(nested)
    assert c.eos_token_ids == (5,) and c.tie_word_embeddings and c.num_attention_layers == 1
    dense = ModelConfig.from_dict(dict(TEXT, architectures=["Qwen3ForCausalLM"]))
    assert dense.layer_types == () and dense.num_attention_layers == 4 and not dense.is_hybrid
    assert dense.partial_rotary_factor == 1.0 and not dense.attn_output_gate and not dense.zero_centred_norm


@pytest.mark.parametrize("layer_types, message", [
    ([LINEAR, "sliding_attention", LINEAR, FULL], r"layer_types.*'sliding_attention'.*'full_attention' or "
                                                  r"'linear_attention'"),
    ([LINEAR, LINEAR, FULL], r"layer_types has 3 entries but num_hidden_layers is 4"),
])
def test_bad_layer_types_are_load_errors(layer_types, message):
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_dict(dict(TEXT, architectures=["Qwen3_5ForCausalLM"], layer_types=layer_types))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad")
    build_hf("one-full").save_pretrained(path)
    return path


def rewrite(src, dst, edit) -> None:
    """Copy a checkpoint to dst with its tensors edited by edit(state)."""
    dst.mkdir(exist_ok=True)
    (dst / "config.json").write_text((src / "config.json").read_text())
    state = load_file(str(src / "model.safetensors"))
    edit(state)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})


def test_missing_and_misshapen_weights_are_load_errors(saved, tmp_path):
    key = "model.layers.1.linear_attn.A_log"
    rewrite(saved, tmp_path / "missing", lambda s: s.pop(key))
    with pytest.raises(ModelLoadError, match=key.replace(".", r"\.")):
        load_model(tmp_path / "missing")
    conv = "model.layers.0.linear_attn.conv1d.weight"
    rewrite(saved, tmp_path / "shape", lambda s: s.update({conv: torch.zeros(128, 1, 3)}))
    with pytest.raises(ModelLoadError, match=rf"{conv.replace('.', '[.]')} has shape \(128, 1, 3\)"):
        load_model(tmp_path / "shape")


def test_mtp_weights_are_set_aside(saved, tmp_path):
    assert read_mtp_state(saved, "cpu", torch.float32) == {}
    mtp = {"mtp.fc.weight": torch.randn(64, 128), "mtp.layers.0.input_layernorm.weight": torch.randn(64)}
    rewrite(saved, tmp_path, lambda s: s.update(mtp))
    model = load_model(tmp_path)
    assert not any(name.startswith("mtp") for name in model.state_dict())
    got = read_mtp_state(tmp_path, "cpu", torch.float64)
    assert sorted(got) == sorted(mtp) and all(got[k].dtype == torch.float64 for k in got)
    assert all(torch.equal(got[k].float(), mtp[k]) for k in mtp)


def test_random_model_for_a_hybrid_config():
    layer_types = PATTERNS["two-full"][0]
    config = ModelConfig.from_dict(dict(TEXT, architectures=["Qwen3_5ForCausalLM"], layer_types=layer_types))
    model = random_model(config, "cpu", torch.float32, std=0.1)
    assert isinstance(model, HybridCausalLM)
    assert all(layer.input_layernorm.weight.abs().max() == 0 for layer in model.model.layers)
    la = model.model.layers[1].linear_attn
    assert la.norm.weight.eq(1).all() and la.dt_bias.eq(1).all()
    assert la.A_log.exp().min() >= 0.01 and la.A_log.exp().max() <= 16
    logits = Pools(model).feed(0, list(range(2, 30)), [20, 1])
    assert logits.shape == (28, 300) and torch.isfinite(logits).all() and logits.std() > 0


def test_hybrid_model_runs_its_norms_and_gates_through_the_swappable_kernels():
    """Every norm and gate of the hybrid model goes through fused.Kernels (what enable_fused_kernels swaps for
    compiled pieces on a GPU); compiled pieces (the eager backend here) give the plain ones' logits."""
    from specdec.models import fused

    layer_types = PATTERNS["two-full"][0]
    config = ModelConfig.from_dict(dict(TEXT, architectures=["Qwen3_5ForCausalLM"], layer_types=layer_types))
    model = random_model(config, "cpu", torch.float32, std=0.1)
    tokens = list(range(2, 30))
    plain = Pools(model).feed(0, tokens, [20, 1])
    calls = {name: 0 for name in fused.PLAIN}

    def counted(name):
        compiled = fused.compile_elementwise(fused.PLAIN[name], backend="eager")

        def call(*args):
            calls[name] += 1
            return compiled(*args)
        return staticmethod(call)

    saved = {name: fused.Kernels.__dict__[name] for name in fused.PLAIN}
    try:
        for name in fused.PLAIN:
            setattr(fused.Kernels, name, counted(name))
        swapped = Pools(model).feed(0, tokens, [20, 1])
    finally:
        for name, fn in saved.items():
            setattr(fused.Kernels, name, fn)
    assert torch.equal(swapped, plain)
    for name in ("zero_centred_rms_norm", "add_zero_centred_rms_norm", "gated_rms_norm", "delta_rule_gates", "rotate"):
        assert calls[name] > 0, name


@pytest.mark.parametrize("counts,in_order", [((1, 1, 1), True), ((3, 3), True), ((1, 5, 1), False), ((2, 0, 2), False)])
def test_sequence_groups_read_the_step_s_rows_in_place_when_they_are_in_order(counts, in_order):
    """A group holding every row of the step in order (a decode or verify step of equal counts, a padded step)
    reads them as a view, with no gather; any other group gathers its rows."""
    from specdec.models.gated_deltanet import plan_groups

    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    batch = AttentionBatch(torch.tensor(starts), torch.tensor([n + 4 for n in counts]), torch.zeros(len(counts), 1,
                           dtype=torch.long), torch.zeros(starts[-1], dtype=torch.long), max(counts), max(counts) + 4,
                           host_lens=(list(counts), [n + 4 for n in counts]))
    batch.states = StateBatch([], [], slots=list(range(len(counts))), defer=[False] * len(counts))
    groups = plan_groups(batch)
    assert [g.in_order for g in groups] == [in_order] * len(groups)
    rows = torch.randn(starts[-1], 3)
    for group in groups:
        taken = group.take(rows)
        assert torch.equal(taken, rows[group.rows])  # the same values either way
        assert (taken.data_ptr() == rows.data_ptr()) == in_order  # a view only when in order


def test_chunked_prefills_of_different_lengths_share_padded_groups():
    """Sequences the chunked form runs join a group per bucket of chunk counts (1, 2, 3-4, 5-8, ...), padded to
    the bucket's longest by repeating each one's last row, marked not real; token-by-token ones group by count."""
    from specdec.models.gated_deltanet import plan_groups

    counts = [20, 130, 9, 33, 200, 64, 70, 9]
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    batch = AttentionBatch(torch.tensor(starts), torch.tensor(counts), torch.zeros(len(counts), 1, dtype=torch.long),
                           torch.zeros(starts[-1], dtype=torch.long), max(counts), max(counts),
                           host_lens=(list(counts), list(counts)))
    batch.states = StateBatch([], [], slots=list(range(10, 10 + len(counts))), defer=[False] * len(counts))
    groups = {tuple(g.seqs): g for g in plan_groups(batch)}
    assert sorted(groups) == [(0, 3, 5), (1, 4), (2, 7), (6,)]
    one_chunk = groups[(0, 3, 5)]
    assert one_chunk.n == 64 and one_chunk.counts.tolist() == [20, 33, 64] and one_chunk.slots.tolist() == [10, 13, 15]
    assert one_chunk.real.sum(dim=1).tolist() == [20, 33, 64]
    assert one_chunk.rows[0].tolist() == list(range(20)) + [19] * 44  # past its count: its last row again
    rows, out = one_chunk.scatter_rows(torch.arange(3 * 64).view(3, 64))
    assert rows.tolist() == [*range(0, 20), *range(starts[3], starts[3] + 33), *range(starts[5], starts[6])]
    assert out.tolist() == list(range(20)) + list(range(64, 97)) + list(range(128, 192))
    assert groups[(2, 7)].real is None and groups[(6,)].real is None and not any(g.in_order for g in groups.values())
