"""Scaled twins of EAGLE-3 draft heads: a small head padded to a large head's shapes, same drafts.

A head twin reads a twin target's features (specdec/models/twin.py) and gives the small head's draft logits
on the real draft ids, so its drafts and acceptance are the small pair's while its cost is the large head's.
For a small head of hidden size h (reading a small target of hidden h_t) padded to H (reading H_t), see
docs/TWINS.md, section "EAGLE-3 heads":

- residual stream: the small head's h dimensions first; dimension h carries a small constant k, written
  once by fc from the twin target's constant dimension h_t (fc[h, h_t] = k / c) and never by the layer
  (row h of o_proj and down_proj is exactly zero), so the head's fed-back output carries it too.
- norms, heads, head dims, extra heads / neurons: as in the target twin (norm weights times sqrt(h/H), eps
  times h/H, weight 0 on dimension h); the head's attention has no q/k norm, so q is scaled by sqrt(D/d)
  instead, which turns q.k / sqrt(D) back into the small q.k / sqrt(d).
- q/k/v read [embedding ; state] (2H wide): the small columns 0..h-1 and h..2h-1 go to 0..h-1 and H..H+h-1.
- padded draft ids: lm_head rows -u e_h (the final norm's weight on dimension h is 1), a logit far below
  every real one; d2t maps them to distinct padded target ids, never to real ones.

k and u are calibrated by running the small head on a target's features (the small target's, or the twin
target's, whose real dimensions are the same).  `noise` fills structurally-zero weights as in the target
twin; the exact zeros that carry the function stay zero.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from specdec.errors import ConfigError
from specdec.models.config import ModelConfig
from specdec.models.eagle3 import Eagle3Config, Eagle3Head, default_feature_layers
from specdec.models.layers import Rotary
from specdec.models.transformer import CausalLM
from specdec.models.twin import CONSTANT_SCALE, LOGIT_MARGIN, SHAPES
from specdec.models.twin_builder import CastingDict, Padding, head_dim_map, head_rows, q_head_map

HEAD_DRAFT_VOCAB = 32000  # the published Qwen3 EAGLE-3 heads' draft vocabulary
HEAD_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")


@dataclasses.dataclass(frozen=True)
class TwinTarget:
    """What a head twin needs of its twin target."""

    hidden_size: int  # H_t
    vocab_size: int  # V'
    small_hidden: int  # h_t: the twin's residual stream keeps the small target's h_t dimensions first
    constant: float  # c: dimension h_t of the twin's residual stream at every real token's position
    embedding: nn.Embedding | None  # the twin's (shared by the head); None when the head is only written


def twin_target_of(twin: CausalLM, small_hidden: int, small_vocab: int) -> TwinTarget:
    """The facts of a twin target built by make_twin, read off its embedding: [V', H_t], column h_t = c."""
    emb = twin.model.embed_tokens.weight
    if emb.shape[1] <= small_hidden or emb.shape[0] < small_vocab:
        raise ConfigError(f"the target (hidden {emb.shape[1]}, vocabulary {emb.shape[0]}) is not a scaled twin "
                          f"of the head's target (hidden {small_hidden}): run the target as a twin too")
    column = emb[:small_vocab, small_hidden].float()
    c = column[0].item()
    if not c > 0 or not torch.allclose(column, torch.full_like(column, c), rtol=1e-2):
        raise ConfigError("the target is not a scaled twin of the head's target: its embedding has no constant "
                          f"in dimension {small_hidden}")
    return TwinTarget(emb.shape[1], emb.shape[0], small_hidden, c, twin.model.embed_tokens)


def planned_twin_target(small: CausalLM, shape: str | dict) -> TwinTarget:
    """The facts of make_twin(small, shape) without building it (to write a head twin for it)."""
    shape = _named(shape)
    emb = small.model.embed_tokens.weight.detach().float()
    c = CONSTANT_SCALE * emb.norm(dim=-1).min().item()  # as make_twin chooses it
    hidden = int(shape.get("target_hidden_size", shape["hidden_size"]))
    return TwinTarget(hidden, int(shape["vocab_size"]), small.config.hidden_size, c, None)


def _named(shape: str | dict) -> dict:
    if isinstance(shape, dict):
        return shape
    if shape not in SHAPES:
        raise ConfigError(f"unknown twin shape {shape!r}: use one of {', '.join(SHAPES)} or a config dict")
    return dict(SHAPES[shape], draft_vocab_size=HEAD_DRAFT_VOCAB)


# ---------------------------------------------------------------------------------------------- config


def head_twin_config(small: Eagle3Config, target: TwinTarget, shape: str | dict, draft_vocab: int | None,
                     layers: tuple[int, ...]) -> Eagle3Config:
    """The twin's config: the shape's layer fields, the twin target's hidden size and vocabulary, and the
    feature layers named explicitly (the twin target's real layers come first: the small target's ids)."""
    shape = _named(shape)
    s = small.layer
    missing = [k for k in HEAD_FIELDS if k not in shape]
    if missing:
        raise ConfigError(f"a head twin shape needs {', '.join(missing)}")
    big = dataclasses.replace(s, **{k: int(shape[k]) for k in HEAD_FIELDS}, vocab_size=target.vocab_size,
                              rms_norm_eps=s.rms_norm_eps * s.hidden_size / int(shape["hidden_size"]))
    vocab = _draft_vocab(small, target, shape, draft_vocab)
    problems = _problems(small, big, target, shape)
    if problems:
        raise ConfigError("cannot build this head twin: " + "; ".join(problems))
    return Eagle3Config(layer=big, draft_vocab_size=vocab, target_hidden_size=target.hidden_size,
                        feature_layers=tuple(layers), norm_before_residual=False)


def _draft_vocab(small: Eagle3Config, target: TwinTarget, shape: dict, asked: int | None) -> int:
    """The twin's draft vocabulary: `asked`, else the shape's, else HEAD_DRAFT_VOCAB as far as the twin
    target's padded ids go (each padded draft id needs a padded target id of its own); never below the small's."""
    small_vd, spare = small.draft_vocab_size, target.vocab_size - small.layer.vocab_size
    asked = asked or shape.get("draft_vocab_size")
    if asked is None:
        return max(small_vd, min(HEAD_DRAFT_VOCAB, small_vd + spare))
    asked = int(asked)
    if asked < small_vd:
        raise ConfigError(f"draft vocabulary {asked} < the head's {small_vd}")
    if asked - small_vd > spare:
        raise ConfigError(f"a draft vocabulary of {asked} needs {asked - small_vd} padded target ids, the twin "
                          f"target has {spare} ({target.vocab_size} - {small.layer.vocab_size})")
    return asked


def _problems(small: Eagle3Config, big: ModelConfig, target: TwinTarget, shape: dict) -> list[str]:
    s, out = small.layer, []
    if small.norm_before_residual:
        out.append("heads with norm_before_residual have no twins yet")
    if s.attention_bias or s.qk_norm:
        out.append("heads with attention biases or q/k norms have no twins yet")
    if small.target_hidden_size != target.small_hidden:
        out.append(f"the head reads a target of hidden size {small.target_hidden_size}, the twin target's real "
                   f"dimensions are {target.small_hidden}")
    if int(shape.get("target_hidden_size", target.hidden_size)) != target.hidden_size:
        out.append(f"target_hidden_size {shape['target_hidden_size']} is not the twin target's {target.hidden_size}")
    if big.hidden_size < s.hidden_size + 1:
        out.append("the twin's hidden size must exceed the head's by at least 1")
    if target.vocab_size < s.vocab_size:
        out.append(f"the twin target's vocabulary {target.vocab_size} < {s.vocab_size}")
    for name in ("intermediate_size", "num_key_value_heads"):
        if getattr(big, name) < getattr(s, name):
            out.append(f"{name} {getattr(big, name)} < {getattr(s, name)}")
    if big.num_query_groups < s.num_query_groups:
        out.append(f"query heads per kv head {big.num_query_groups} < {s.num_query_groups}")
    if big.head_dim % s.head_dim:
        out.append(f"head_dim {big.head_dim} is not a multiple of {s.head_dim}")
    return out


# ---------------------------------------------------------------------------------------------- weights


class _HeadBuilder(Padding):
    """The twin's weights from the small head's, for constants k (dimension h) and u (padded draft rows)."""

    def __init__(self, small: Eagle3Head, big: Eagle3Config, target: TwinTarget, noise: float, device):
        super().__init__(small, noise, device)
        self.sc, self.bc, self.t = small.config, big, target
        sl, bl = small.config.layer, big.layer
        self.h, self.H = sl.hidden_size, bl.hidden_size
        self.dmap = head_dim_map(sl.head_dim, bl.head_dim).to(device)
        self.q_rows = head_rows(q_head_map(sl, bl).to(device), self.dmap, bl.head_dim)  # [Q d]
        self.kv_rows = head_rows(torch.arange(sl.num_key_value_heads, device=device), self.dmap, bl.head_dim)  # [K d]
        self.norm_scale = math.sqrt(self.h / self.H)

    def fc(self, k: float) -> torch.Tensor:
        """[H, 3 H_t]: block b's real columns read the small target's dims, row h reads the constant.

        Example: h_t = 32, H_t = 48: small columns 0..31 / 32..63 / 64..95 go to 0..31 / 48..79 / 96..127, and
        fc[h, 32] = k / c makes the head's dimension h equal k (feature column 32 is the twin's constant c)."""
        ht, Ht = self.t.small_hidden, self.t.hidden_size
        w, small = self.fill((self.H, 3 * Ht)), self.small("fc.weight")  # small [h, 3 h_t]
        for b in range(3):
            w[:self.h, b * Ht:b * Ht + ht] = small[:, b * ht:(b + 1) * ht]
        w[self.h] = 0.0  # the constant dimension is written once, from the constant alone
        w[self.h, ht] = k / self.t.constant
        return w

    def qkv(self, name: str, rows: torch.Tensor, scale: float) -> torch.Tensor:
        """[rows', 2H] from [rows, 2h]: input columns [emb 0..h-1 ; state 0..h-1] -> 0..h-1 and H..H+h-1."""
        small, h, H = self.small(name) * scale, self.h, self.H
        w = self.fill((self._width(name), 2 * H))
        w[rows, :h] = small[:, :h]
        w[rows, H:H + h] = small[:, h:]
        return w

    def _width(self, name: str) -> int:
        b = self.bc.layer
        heads = b.num_attention_heads if "q_proj" in name else b.num_key_value_heads
        return heads * b.head_dim

    def layer(self, out: dict) -> None:
        p, s, b, h = "midlayer.", self.sc.layer, self.bc.layer, self.h
        q_scale = math.sqrt(b.head_dim / s.head_dim)  # q.k / sqrt(D) = the small q.k / sqrt(d)
        out[p + "self_attn.q_proj.weight"] = self.qkv(p + "self_attn.q_proj.weight", self.q_rows, q_scale)
        for name in ("k_proj", "v_proj"):
            out[p + f"self_attn.{name}.weight"] = self.qkv(p + f"self_attn.{name}.weight", self.kv_rows, 1.0)
        o = self.fill((self.H, b.num_attention_heads * b.head_dim))
        o[:h, self.q_rows] = self.small(p + "self_attn.o_proj.weight")
        o[h] = 0.0  # never writes the constant dimension
        out[p + "self_attn.o_proj.weight"] = o
        m, M = s.intermediate_size, b.intermediate_size
        for name in ("gate_proj", "up_proj"):
            w = self.fill((M, self.H))
            w[:m, :h] = self.small(p + f"mlp.{name}.weight")
            out[p + f"mlp.{name}.weight"] = w
        down = self.fill((self.H, M))
        down[:h, :m] = self.small(p + "mlp.down_proj.weight")
        down[h] = 0.0
        out[p + "mlp.down_proj.weight"] = down
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            out[p + name + ".weight"] = self.norm(p + name + ".weight", constant_weight=0.0)

    def norm(self, name: str, constant_weight: float) -> torch.Tensor:
        w = self.fill(self.H)
        w[:self.h] = self.small(name) * self.norm_scale
        w[self.h] = constant_weight
        return w

    def vocab(self, out: dict, u: float) -> None:
        """lm_head [V_d', H]: real rows as the small head's (0 on dimension h), padded rows -u e_h."""
        vd, h = self.sc.draft_vocab_size, self.h
        head = self.fill((self.bc.draft_vocab_size, self.H))
        head[:vd, :h] = self.small("lm_head.weight")
        head[:vd, h] = 0.0
        head[vd:] = 0.0
        head[vd:, h] = -u
        out["lm_head.weight"] = head
        out["norm.weight"] = self.norm("norm.weight", constant_weight=1.0)  # passes c / rms to lm_head

    def maps(self, out: dict) -> None:
        """d2t [V_d'], t2d [V']: padded draft id i -> padded target id V + (i - V_d).

        Example: V = 96, V_d = 64, V_d' = 96: draft id 70 -> target id 102 (d2t[70] = 32); real ids keep theirs."""
        vd, big_vd = self.sc.draft_vocab_size, self.bc.draft_vocab_size
        v, big_v = self.sc.layer.vocab_size, self.bc.layer.vocab_size
        d2t = torch.full((big_vd,), v - vd, dtype=torch.long, device=self.device)
        d2t[:vd] = self.s.d2t.to(self.device)
        t2d = torch.zeros(big_v, dtype=torch.bool, device=self.device)
        t2d[:v] = self.s.t2d.to(self.device)
        t2d[v:v + big_vd - vd] = True
        dict.__setitem__(out, "d2t", d2t)  # not cast to the weights' dtype: index maps stay long / bool
        dict.__setitem__(out, "t2d", t2d)

    def own_embedding(self, out: dict) -> None:
        """[V', H] for a head with an embedding of its own (its dimension h is never read: weight 0)."""
        emb = self.fill((self.bc.layer.vocab_size, self.H))
        emb[:self.sc.layer.vocab_size, :self.h] = self.small("embed_tokens.weight")
        out["embed_tokens.weight"] = emb


# ---------------------------------------------------------------------------------------------- calibration


@torch.no_grad()
def head_forward(head: Eagle3Head, ids: torch.Tensor, states: torch.Tensor, block_size: int = 16) -> torch.Tensor:
    """One sequence through the head from position 0 on a fresh KV cache: ids [T], states [T, H] -> [T, H]."""
    from specdec.engine.kv_cache import KVCache
    from specdec.engine.runner import flat_attention_batch

    tokens, device = len(ids), states.device
    blocks = list(range(-(-tokens // block_size)))
    kv = KVCache(head.config.layer, len(blocks), block_size, device, states.dtype)
    batch = flat_attention_batch([blocks], [0, tokens], [tokens], list(range(tokens)), block_size, device)
    return head(ids.to(device), torch.arange(tokens, device=device), states, batch, kv.layers[0])


@torch.no_grad()
def target_features(target: CausalLM, layers: tuple[int, ...], ids: list[int], hidden: int) -> torch.Tensor:
    """[T, 3 hidden]: the residual stream entering each feature layer, its first `hidden` dims (the real ones
    of a twin), at every position of `ids`."""
    from specdec.engine.engine import Engine, EngineConfig

    saved = target.features, target._feature_columns
    try:
        engine = Engine(target, EngineConfig(kv_cache_tokens=len(ids) + 64, max_num_seqs=1, static_shapes=False,
                                             max_num_batched_tokens=len(ids)))
        target.capture_features(layers, len(ids))
        engine.all_logits(ids)
        feats = target.features[:len(ids)].view(len(ids), len(layers), -1)[..., :hidden]
        return feats.reshape(len(ids), -1).clone()
    finally:
        target.features, target._feature_columns = saved


@dataclasses.dataclass
class HeadBounds:
    min_state_norm: float  # the smallest norm of a state the head is fed (fc's output or its own)
    max_final_rms: float  # the largest RMS of an output the draft logits are read from
    min_logit: float  # the smallest real draft logit


CHAIN_PASSES = 3  # calibration feeds the head's outputs back this many times (drafting's fed-back states)


@torch.no_grad()
def head_bounds(head: Eagle3Head, target: CausalLM, layers: tuple[int, ...], calibration: list[list[int]]
                ) -> HeadBounds:
    """Run the small head on the target's features of each sequence: once as observe feeds it (fc of the
    features at p beside token p + 1), then CHAIN_PASSES times fed its own previous outputs (the state at p
    is the output at p - 1), as drafting feeds it."""
    norms, rms, logits = [], [], []
    for seq in calibration:
        feats = target_features(target, layers, seq, head.config.target_hidden_size)[:-1]  # [T - 1, 3 h_t]
        ids = torch.tensor(seq[1:])  # token p + 1 beside the features at p
        states = head.project(feats.to(head.fc.weight.dtype))  # [T - 1, h]
        for _ in range(CHAIN_PASSES + 1):
            norms.append(states.float().norm(dim=-1).min().item())
            out = head_forward(head, ids, states)  # [T - 1, h]
            rms.append(out.float().pow(2).mean(-1).sqrt().max().item())
            logits.append(head.logits(out).float().min().item())
            states = torch.cat([states[:1], out[:-1]])
    return HeadBounds(min(norms), max(rms), min(logits))


def _default_calibration(vocab: int, max_len: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (min(256, max_len),), generator=gen).tolist() for _ in range(4)]


def head_constants(bounds: HeadBounds, small_hidden: int, big_hidden: int) -> tuple[float, float]:
    """k (the head's constant dimension) and u (the padded draft rows' weight).

    k is CONSTANT_SCALE times the smallest state norm (k^2 adds <= 1e-6 relative to a mean square).  The
    padded logit is -u k / rms', rms' = rms sqrt(h/H) the twin's final-norm RMS; at the largest RMS it is
    10 LOGIT_MARGIN below 0 and below the smallest real logit."""
    k = CONSTANT_SCALE * max(bounds.min_state_norm, 1e-6)
    depth = 10 * LOGIT_MARGIN - min(bounds.min_logit, 0.0)
    u = depth * max(bounds.max_final_rms, 1e-6) * math.sqrt(small_hidden / big_hidden) / k
    return k, u


# ---------------------------------------------------------------------------------------------- the twin


@torch.no_grad()
def make_head_twin(head: Eagle3Head, twin_target: CausalLM | TwinTarget, shape: str | dict, noise: float = 0.0,
                   draft_vocab: int | None = None, small_target: CausalLM | None = None,
                   calibration: list[list[int]] | None = None) -> Eagle3Head:
    """The twin of `head` at `shape` (a name in twin.SHAPES or a dict of head config fields) for `twin_target`
    (a twin made by make_twin, or planned_twin_target's facts of one).  Calibration runs `small_target` (the
    head's own target), else the twin target; `draft_vocab` overrides the shape's draft vocabulary."""
    target = twin_target if isinstance(twin_target, TwinTarget) else \
        twin_target_of(twin_target, head.config.target_hidden_size, head.config.layer.vocab_size)
    calibrator = small_target if small_target is not None else (None if isinstance(twin_target, TwinTarget)
                                                                 else twin_target)
    if calibrator is None:
        raise ConfigError("a head twin needs a target to calibrate its constants: pass small_target")
    layers = head.config.feature_layers or default_feature_layers(_small_layers(head, small_target))
    big = head_twin_config(head.config, target, shape, draft_vocab, layers)
    device = head.lm_head.weight.device
    max_len = min(head.config.layer.max_position_embeddings, calibrator.config.max_position_embeddings) - 1
    bounds = head_bounds(head, calibrator, layers,
                         calibration or _default_calibration(head.config.layer.vocab_size, max_len))
    k, u = head_constants(bounds, head.config.layer.hidden_size, big.layer.hidden_size)
    own = small_target is not None and head.embed_tokens is not small_target.model.embed_tokens
    return _assemble(head, big, target, _weights(head, big, target, noise, device, k, u, own), own)


def _small_layers(head: Eagle3Head, small_target: CausalLM | None) -> int:
    if small_target is None:
        raise ConfigError("the head names no feature layers (eagle_aux_hidden_state_layer_ids): pass small_target "
                          "so that the twin can name the small target's default ones")
    return small_target.config.num_hidden_layers


def _weights(head, big, target, noise, device, k, u, own) -> dict:
    builder = _HeadBuilder(head, big, target, noise, device)
    state = CastingDict(head.lm_head.weight.dtype)
    state["fc.weight"] = builder.fc(k)
    builder.layer(state)
    builder.vocab(state, u)
    if own:
        builder.own_embedding(state)
    builder.maps(state)
    return state


def _assemble(head: Eagle3Head, big: Eagle3Config, target: TwinTarget, state: dict, own: bool) -> Eagle3Head:
    device = head.lm_head.weight.device
    with torch.device("meta"):
        twin = Eagle3Head(big)
        if own:
            twin.embed_tokens = nn.Embedding(big.layer.vocab_size, big.layer.hidden_size)
    twin.load_state_dict(state, strict=True, assign=True)
    if not own and target.embedding is not None:
        if target.embedding.weight.shape[1] != big.layer.hidden_size:
            raise ConfigError(f"the head shares the target's embedding: its twin's hidden size must be the twin "
                              f"target's {target.embedding.weight.shape[1]}, not {big.layer.hidden_size}")
        twin.share_embedding(target.embedding)
    twin.rotary = Rotary(big.layer, big.layer.max_position_embeddings).to(device)
    return twin.eval().requires_grad_(False)


def is_head_dir(path) -> bool:
    """Whether a model directory holds an EAGLE-3 head (config.json's architectures)."""
    import json
    from pathlib import Path

    from specdec.models.eagle3 import ARCHITECTURE

    config = Path(path) / "config.json"
    try:
        return ARCHITECTURE in (json.loads(config.read_text()).get("architectures") or [])
    except (OSError, ValueError, AttributeError):
        return False


def write_head_twin(head_dir, target_dir, shape: str | dict, out_dir, noise: float = 0.0) -> Eagle3Head:
    """`specdec twin HEAD --target TARGET`: the twin of the head in head_dir (which drafts for the small target
    in target_dir) for make_twin(target, shape), written in the published layout."""
    from specdec.assets import resolve_model
    from specdec.models.eagle3 import load_eagle3_head, save_eagle3_head
    from specdec.models.loader import load_model

    small = load_model(resolve_model(target_dir), "cpu", torch.float32)
    head = load_eagle3_head(head_dir, small, torch.device("cpu"), torch.float32)
    own = head.embed_tokens is not small.model.embed_tokens
    twin = make_head_twin(head, planned_twin_target(small, shape), shape, noise=noise, small_target=small)
    save_eagle3_head(twin, out_dir, include_embedding=own)
    return twin
