"""The EAGLE-3 draft head: one decoder layer that reads the target's own hidden states.

Checkpoints come in the layout EAGLE-3 heads are published in and vLLM / SGLang load (docs/EAGLE3.md):
config.json (``LlamaForCausalLMEagle3``: the head's hidden size, heads, ``draft_vocab_size``, optionally
``target_hidden_size`` and ``eagle_aux_hidden_state_layer_ids``) and safetensors with

    fc.weight                       [H, 3 H_target]   the three target layers' states -> one
    midlayer.input_layernorm.weight [H]               norms the token embedding
    midlayer.hidden_norm.weight     [H]               norms the projected (or fed-back) state
    midlayer.self_attn.{q,k,v,o}_proj.weight          q/k/v read [embedding ; state], 2 H wide
    midlayer.post_attention_layernorm.weight, midlayer.mlp.{gate,up,down}_proj.weight
    norm.weight                     [H]
    lm_head.weight                  [V_draft, H]      logits over the draft vocabulary
    d2t                             [V_draft]         target id of draft id i = i + d2t[i]
    t2d                             [V_target] bool   which target ids are in the draft vocabulary
    embed_tokens.weight             [V_target, H]     optional: the target's embedding is used without it

Position p of the head reads the embedding of token p + 1 beside the target's state at p (which predicted
token p + 1) and predicts token p + 2.  Its output before the final norm is the state it is fed at p + 1
while drafting on its own predictions.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from specdec.errors import ModelLoadError
from specdec.models.attention import AttentionBatch
from specdec.models.config import ModelConfig, read_config_json
from specdec.models.layers import GatedMLP, RMSNorm, Rotary
from specdec.models.transformer import Attention

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS_FILE = "model.safetensors"


def default_feature_layers(num_target_layers: int) -> tuple[int, int, int]:
    """The target layers a head reads when its config names none: low, middle and high, as vLLM and SGLang
    choose them.  Layer id j is the residual stream entering target layer j (the output of layer j - 1)."""
    return 2, num_target_layers // 2, num_target_layers - 3


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # the head's decoder layer (num_hidden_layers 1; vocab_size = the target's)
    draft_vocab_size: int
    target_hidden_size: int
    feature_layers: tuple[int, ...] | None  # None: default_feature_layers of the target
    norm_before_residual: bool = False

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "Eagle3Config":
        body = dict(raw)
        body["architectures"] = ["LlamaForCausalLM"]  # the midlayer is a Llama decoder layer
        body["num_hidden_layers"] = 1
        layer = ModelConfig.from_dict(body)
        eagle = raw.get("eagle_config") or {}
        ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
        try:
            return cls(layer=layer,
                       draft_vocab_size=int(raw.get("draft_vocab_size") or layer.vocab_size),
                       target_hidden_size=int(raw.get("target_hidden_size") or layer.hidden_size),
                       feature_layers=tuple(int(i) for i in ids) if ids else None,
                       norm_before_residual=bool(raw.get("norm_before_residual", False)))
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"{source}: bad value in the EAGLE-3 fields ({exc})") from exc

    def to_dict(self) -> dict:
        c = self.layer
        out = {
            "architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
            "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
            "draft_vocab_size": self.draft_vocab_size, "target_hidden_size": self.target_hidden_size,
            "tie_word_embeddings": False, "attention_bias": c.attention_bias, "hidden_act": "silu",
            "norm_before_residual": self.norm_before_residual,
        }
        if self.feature_layers is not None:
            out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.feature_layers),
                                   "use_aux_hidden_state": True}
        return out


class Eagle3Layer(nn.Module):
    """The head's decoder layer: attention over [norm(embedding) ; norm(state)], then the MLP."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden = config.hidden_size
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.self_attn = Attention(config)
        attn, bias = self.self_attn, config.attention_bias
        attn.q_proj = nn.Linear(2 * hidden, attn.num_heads * attn.head_dim, bias=bias)
        attn.k_proj = nn.Linear(2 * hidden, attn.num_kv_heads * attn.head_dim, bias=bias)
        attn.v_proj = nn.Linear(2 * hidden, attn.num_kv_heads * attn.head_dim, bias=bias)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.mlp = GatedMLP(hidden, config.intermediate_size)


class Eagle3Head(nn.Module):
    """forward(ids [T], positions [T], states [T, H], batch, kv_cache) -> states before the final norm [T, H];
    logits(states [N, H]) -> [N, V_draft]; to_target(draft ids) -> target ids."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        layer = config.layer
        self.fc = nn.Linear(3 * config.target_hidden_size, layer.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(layer)
        self.norm = RMSNorm(layer.hidden_size, layer.rms_norm_eps)
        self.lm_head = nn.Linear(layer.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(layer.vocab_size, dtype=torch.bool))
        self.embed_tokens: nn.Embedding | None = None  # the head's own, or the target's (share_embedding)
        self.rotary = Rotary(layer, layer.max_position_embeddings)

    def share_embedding(self, embedding: nn.Embedding) -> None:
        self.embed_tokens = embedding

    def fuse_projections(self) -> bool:
        """One GEMM for the layer's q/k/v and one for its gate/up, as the target's (fused_linear); returns
        whether both are fused (a quantised head's are not)."""
        layer = self.midlayer
        return layer.self_attn.fuse_projections() & layer.mlp.fuse_projections()

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The target's states of its three feature layers [T, 3 H_target] -> [T, H]."""
        return self.fc(features)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, states: torch.Tensor, batch: AttentionBatch,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        layer = self.midlayer
        embeds = layer.input_layernorm(self.embed_tokens(ids))  # [T, H]
        normed = layer.hidden_norm(states)
        residual = normed if self.config.norm_before_residual else states
        x = torch.cat([embeds, normed], dim=-1)  # [T, 2H]
        attn = layer.self_attn
        attended = attn.output(attn(x, self.rotary.lookup(positions, x.dtype), batch, kv_cache))
        residual, h = layer.post_attention_layernorm.add_forward(residual, attended)
        return residual + layer.mlp(h)

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(states))  # [N, V_draft]

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_ids(self) -> torch.Tensor:
        """[V_draft] the target id of every draft id (where the draft distribution's columns go)."""
        return self.to_target(torch.arange(self.config.draft_vocab_size, device=self.d2t.device))


# ---------------------------------------------------------------------------------------------- loading


def load_eagle3_head(head_dir: str | Path, target, device: torch.device, dtype: torch.dtype) -> Eagle3Head:
    """A head for `target` (a CausalLM) from a directory in the published layout; refused, naming the file and
    the field, when its shapes do not fit the target."""
    head_dir = Path(head_dir)
    config = read_head_config(head_dir)
    check_fits_target(config, target.config, head_dir / "config.json")
    from specdec.models.loader import read_state_dict

    state = read_state_dict(head_dir, device, dtype)
    for name in ("d2t", "t2d"):  # index maps keep their integer / bool type
        if name in state:
            state[name] = _raw_tensor(head_dir, name).to(device)
    with torch.device("meta"):
        head = Eagle3Head(config)
    own_embedding = "embed_tokens.weight" in state
    if own_embedding:
        with torch.device("meta"):
            head.embed_tokens = nn.Embedding(config.layer.vocab_size, config.layer.hidden_size)
    _check_weights(head, state, head_dir)
    head.load_state_dict(state, strict=False, assign=True)
    if "d2t" not in state:  # a head over the full target vocabulary
        head.d2t = torch.zeros(config.draft_vocab_size, dtype=torch.long, device=device)
        head.t2d = torch.ones(config.layer.vocab_size, dtype=torch.bool, device=device)
    if not own_embedding:
        head.share_embedding(target.model.embed_tokens)
    head.rotary = Rotary(config.layer, config.layer.max_position_embeddings).to(device)
    return head.eval().requires_grad_(False)


def read_head_config(head_dir: Path) -> Eagle3Config:
    """The config of the EAGLE-3 head in head_dir; refused, saying why, where the directory is not one."""
    raw = read_config_json(head_dir, "an EAGLE-3 head directory")
    _check_is_a_head(head_dir, raw)
    return Eagle3Config.from_dict(raw, str(head_dir / "config.json"))


def check_fits_target(config: Eagle3Config, target: ModelConfig, source) -> None:
    """Refuse a head whose shapes do not fit the target, naming the field."""
    layers = feature_layers(config, target.num_hidden_layers)
    problems = []
    if config.target_hidden_size != target.hidden_size:
        problems.append(f"target_hidden_size (or hidden_size) is {config.target_hidden_size}, the target's "
                        f"hidden_size {target.hidden_size}")
    if config.layer.vocab_size != target.vocab_size:
        problems.append(f"vocab_size is {config.layer.vocab_size}, the target's {target.vocab_size}")
    if config.draft_vocab_size > target.vocab_size:
        problems.append(f"draft_vocab_size {config.draft_vocab_size} exceeds the target's vocabulary "
                        f"{target.vocab_size}")
    if len(layers) != 3 or not all(0 <= i < target.num_hidden_layers for i in layers):
        problems.append(f"eagle_aux_hidden_state_layer_ids {list(layers)} must be three layer ids in "
                        f"[0, {target.num_hidden_layers}) (the target has {target.num_hidden_layers} layers)")
    if problems:
        raise ModelLoadError(f"{source}: this EAGLE-3 head does not fit the target: " + "; ".join(problems))


def feature_layers(config: Eagle3Config, num_target_layers: int) -> tuple[int, ...]:
    return config.feature_layers or default_feature_layers(num_target_layers)


def _raw_tensor(head_dir: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    from specdec.models.loader import weight_files

    for path in weight_files(head_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            if name in f.keys():
                return f.get_tensor(name)
    raise KeyError(name)


def _check_is_a_head(head_dir: Path, raw: dict) -> None:
    """Refuse a whole model passed as a head (its weights hold neither fc.* nor midlayer.*), saying what it is,
    before its config is read as a head's and refused for a shape that is beside the point."""
    from safetensors import SafetensorError, safe_open

    from specdec.models.loader import weight_files

    names: set[str] = set()
    for path in weight_files(head_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                names.update(f.keys())
        except (SafetensorError, OSError):  # unreadable: read_state_dict says so, naming the file
            return
    if names and not any(n.startswith(("fc.", "midlayer.")) for n in names):
        kind = ", ".join(raw.get("architectures") or []) or "not named"
        raise ModelLoadError(f"{head_dir} is not an EAGLE-3 head: its weights have no fc.* or midlayer.* tensors "
                             f"(config.json's architectures: {kind}). A whole model drafts with the draft "
                             f"speculator (--speculator draft); an EAGLE-3 head holds fc, midlayer.*, norm and "
                             f"lm_head (docs/EAGLE3.md)")


def _check_weights(head: Eagle3Head, state: dict, head_dir: Path) -> None:
    expected = {k: v for k, v in head.state_dict().items() if k not in ("d2t", "t2d")}
    missing = sorted(set(expected) - state.keys())
    unexpected = sorted(state.keys() - set(expected) - {"d2t", "t2d"})
    if missing:
        raise ModelLoadError(f"{head_dir}: the EAGLE-3 head lacks weights {missing[:5]}")
    if unexpected:
        raise ModelLoadError(f"{head_dir}: weights an EAGLE-3 head does not have: {unexpected[:5]}")
    for name, tensor in expected.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise ModelLoadError(f"{head_dir / WEIGHTS_FILE}: weight {name} has shape {tuple(state[name].shape)}, "
                                 f"config.json implies {tuple(tensor.shape)}")
    for name, size in (("d2t", head.config.draft_vocab_size), ("t2d", head.config.layer.vocab_size)):
        if name in state and tuple(state[name].shape) != (size,):
            raise ModelLoadError(f"{head_dir / WEIGHTS_FILE}: {name} has shape {tuple(state[name].shape)}, "
                                 f"expected ({size},) from config.json")


# ---------------------------------------------------------------------------------------------- saving


def save_eagle3_head(head: Eagle3Head, out_dir: str | Path, dtype: torch.dtype | None = None,
                     include_embedding: bool = False) -> Path:
    """Write `head` in the published layout (config.json + model.safetensors)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, tensor in head.state_dict().items():
        if name.startswith("embed_tokens") and not include_embedding:
            continue
        t = tensor.detach().cpu().contiguous()
        state[name] = t if name in ("d2t", "t2d") or dtype is None else t.to(dtype)
    save_file(state, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(head.config.to_dict(), indent=2) + "\n")
    return out_dir


def random_head(target, seed: int = 0, draft_vocab: int | None = None, std: float = 0.02,
                feature_layers: tuple[int, ...] | None = None) -> Eagle3Head:
    """A head with random weights sized for `target` (tests; the start of training).  draft_vocab < V gives a
    draft vocabulary of the first draft_vocab ids... spread evenly over the target's (d2t offsets)."""
    t = target.config
    vocab = draft_vocab or t.vocab_size
    layer = dataclasses.replace(t, architecture="llama", num_hidden_layers=1, qk_norm=False,
                                tie_word_embeddings=False)
    config = Eagle3Config(layer=layer, draft_vocab_size=vocab, target_hidden_size=t.hidden_size,
                          feature_layers=feature_layers)
    device = target.lm_head.weight.device
    gen = torch.Generator().manual_seed(seed)
    head = Eagle3Head(config)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn(p.shape, generator=gen) * std)
        ids = torch.linspace(0, t.vocab_size - 1, vocab).round().long().unique()
        assert len(ids) == vocab
        head.d2t.copy_(ids - torch.arange(vocab))
        head.t2d.zero_()
        head.t2d[ids] = True
    head.share_embedding(target.model.embed_tokens)
    return head.to(device=device, dtype=target.lm_head.weight.dtype).eval().requires_grad_(False)
