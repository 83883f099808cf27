"""Qwen3.5's multi-token-prediction (MTP) head: one extra decoder layer, shipped inside the target's checkpoint,
that drafts the token after next from the target's final hidden state.

The weights sit beside the text model under mtp.* (at the top level in both the Qwen3_5ForCausalLM and the
nested Qwen3_5ForConditionalGeneration layout; loader.read_mtp_state reads them):

    mtp.pre_fc_norm_embedding.weight [H]       zero-centred RMSNorm of the token embedding
    mtp.pre_fc_norm_hidden.weight    [H]       zero-centred RMSNorm of the fed hidden state
    mtp.fc.weight                    [H, 2 H]  [norm(embedding) ; norm(hidden)] -> H, no bias
    mtp.layers.0.*                             one full-attention layer as the target's (gated attention, q/k
                                               norms, partial rotary, MLP), names as model.layers.N.*
    mtp.norm.weight                  [H]       zero-centred RMSNorm of the layer's output

The target's embedding, LM head and rotary table are shared.  Position p of the head reads the embedding of
token p + 1 beside the target's final-normed hidden state at p (the state the target's LM head read to predict
token p + 1: capture layer id num_hidden_layers, models/transformer.py capture_features) and predicts token
p + 2 from lm_head(its output).  Its output after mtp.norm is both what the LM head reads and the state it is fed
at p + 1 while drafting on its own predictions (k > 1).  This is how vLLM (qwen3_5_mtp.py with its EAGLE-style
proposer, method "mtp") and SGLang (qwen3_next_mtp.py) run these heads; docs/ARCHITECTURE.md has the details.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from specdec.errors import ConfigError, ModelLoadError
from specdec.models.attention import AttentionBatch
from specdec.models.config import FULL_ATTENTION, ModelConfig
from specdec.models.qwen3_5 import HybridDecoderLayer, ZeroCentredRMSNorm

PREFIX = "mtp."


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    layer: ModelConfig  # the head's decoder layer: the target's config cut to one full-attention layer
    target_layers: int  # the target's num_hidden_layers: its final feature's layer id
    draft_vocab: int | None = None  # V_d of a reduced draft vocabulary (MTPHead.restrict_vocab); None: the target's

    @classmethod
    def for_target(cls, target: ModelConfig) -> "MTPConfig":
        layer = dataclasses.replace(target, num_hidden_layers=1, layer_types=(FULL_ATTENTION,))
        return cls(layer=layer, target_layers=target.num_hidden_layers)

    @property
    def draft_vocab_size(self) -> int:
        """Columns of the head's logits (as Eagle3Config's reads): the target's whole vocabulary, or V_d."""
        return self.draft_vocab or self.layer.vocab_size


class MTPHead(nn.Module):
    """forward(ids [T], positions [T], states [T, H], batch, kv_cache) -> the head's states after mtp.norm [T, H];
    logits(states [N, H]) -> [N, V] through the target's LM head.  The interface of models/eagle3.Eagle3Head, so
    speculate/eagle3.py's chain machinery drives either."""

    def __init__(self, config: MTPConfig):
        super().__init__()
        self.config = config
        c = config.layer
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.pre_fc_norm_embedding = ZeroCentredRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.pre_fc_norm_hidden = ZeroCentredRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList([HybridDecoderLayer(c, 0)])
        self.norm = ZeroCentredRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.embed_tokens: nn.Embedding | None = None  # the target's, from share_target
        self.lm_head: nn.Linear | None = None
        self.rotary = None
        self.real_vocab: int | None = None  # a twin's: the model's vocabulary inside the LM head's padded one
        #                                     (with a reduced vocabulary: the draft columns of real tokens)
        self.draft_ids: torch.Tensor | None = None  # [V_d] sorted target ids of a reduced draft vocabulary

    def share_target(self, target) -> None:
        """Use the target's (a HybridCausalLM) embedding, LM head and rotary table."""
        self.embed_tokens, self.lm_head, self.rotary = target.model.embed_tokens, target.lm_head, target.rotary

    def fuse_projections(self) -> bool:
        """One GEMM for the layer's q/k/v and one for its gate/up, as the target's (fused_linear)."""
        layer = self.layers[0]
        return layer.self_attn.fuse_projections() & layer.mlp.fuse_projections()

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The target's final feature [T, H] is fed as it is (the head norms it itself)."""
        return features

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, states: torch.Tensor, batch: AttentionBatch,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        embeds = self.pre_fc_norm_embedding(self.embed_tokens(ids))  # [T, H]
        x = self.fc(torch.cat([embeds, self.pre_fc_norm_hidden(states)], dim=-1))  # [T, 2H] -> [T, H]
        x = self.layers[0](x, batch, self.rotary, self.rotary.lookup(positions, x.dtype), kv_cache)
        return self.norm(x)

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(states)  # [N, V_draft]: the states are normed already
        if self.real_vocab is not None:  # a twin's padded vocabulary is never drafted (twin_qwen3_5.make_mtp_twin)
            logits[:, self.real_vocab:] = float("-inf")
        return logits

    def target_ids(self) -> torch.Tensor | None:
        """[V_d] the target id of each draft column with a reduced vocabulary; None: the target's own (no map)."""
        return self.draft_ids

    def restrict_vocab(self, ids: torch.Tensor) -> None:
        """Draft over these target ids only (sorted, distinct; FR-Spec's most frequent tokens, SGLang's speculative
        token map): the LM head becomes a copy of those rows of the shared one [V_d, H], so a draft token's head
        reads V_d rows, not V (the full head stays the target's).  Rejection sampling with q = 0 outside them
        stays exact (verify.py).  On a twin (real_vocab set) ids at or past real_vocab are padding: being
        sorted they are the last columns, masked as the full head's padded ones are."""
        vocab = len(self.lm_head.weight)
        ids = ids.to(self.lm_head.weight.device, torch.long)
        if self.draft_ids is not None or ids.dim() != 1 or not len(ids) or not _sorted_within(ids, vocab):
            raise ConfigError(f"a draft vocabulary is set once, as distinct sorted ids in [0, {vocab})")
        if self.real_vocab is not None and ids[0] >= self.real_vocab:
            raise ConfigError(f"every id of the draft vocabulary is a twin's padding (>= {self.real_vocab}): "
                              "it needs some of the model's real tokens")
        full = self.lm_head.weight  # [V, H]
        self.lm_head = nn.Linear(full.shape[1], len(ids), bias=False, device="meta")
        self.lm_head.weight = nn.Parameter(full[ids], requires_grad=False)  # [V_d, H]: indexing copies the rows
        self.draft_ids = ids
        self.config = dataclasses.replace(self.config, draft_vocab=len(ids))
        if self.real_vocab is not None:  # the draft columns of real tokens: ids are sorted, so a prefix
            real = int(torch.searchsorted(ids, self.real_vocab))
            self.real_vocab = real if real < len(ids) else None


def _sorted_within(ids: torch.Tensor, vocab: int) -> bool:
    """ids [N] strictly increasing, all in [0, vocab)."""
    return bool((ids[1:] > ids[:-1]).all()) and 0 <= int(ids[0]) and int(ids[-1]) < vocab


# ---------------------------------------------------------------------------------------------- loading

# The config.json fields each weight's shape follows (for a refusal that says which one disagrees).
_SHAPE_FIELDS = {
    "fc.weight": "hidden_size",
    "q_proj.weight": "num_attention_heads, head_dim, attn_output_gate, hidden_size",
    "k_proj.weight": "num_key_value_heads, head_dim, hidden_size",
    "v_proj.weight": "num_key_value_heads, head_dim, hidden_size",
    "o_proj.weight": "num_attention_heads, head_dim, hidden_size",
    "q_norm.weight": "head_dim",
    "k_norm.weight": "head_dim",
    "gate_proj.weight": "intermediate_size, hidden_size",
    "up_proj.weight": "intermediate_size, hidden_size",
    "down_proj.weight": "intermediate_size, hidden_size",
}


def load_mtp_head(model_dir: str | Path, target, device: torch.device, dtype: torch.dtype) -> MTPHead:
    """The MTP head of the checkpoint `target` (a HybridCausalLM) was loaded from; refused, saying what to do,
    when the target is not Qwen3.5 or its checkpoint has no mtp.* weights, and naming the tensor and the
    config field when a weight's shape does not fit the target."""
    head = read_required_mtp_head(model_dir, target.config, device, dtype)
    head.share_target(target)
    return head.eval().requires_grad_(False)


def read_required_mtp_head(model_dir: str | Path, config: ModelConfig, device: torch.device,
                           dtype: torch.dtype) -> MTPHead:
    """read_mtp_head, refused (saying what to do) when the model is not Qwen3.5 or its checkpoint ships no mtp.*
    weights."""
    if config.architecture != "qwen3_5":
        raise ConfigError(f"the mtp speculator drafts with Qwen3.5's own multi-token-prediction head; {model_dir} is "
                          f"a {config.architecture} model: use --speculator eagle3, draft or ngram")
    head = read_mtp_head(model_dir, config, device, dtype)
    if head is None:
        raise ConfigError(f"{model_dir} has no MTP weights (mtp.*): --speculator mtp needs a Qwen3.5 checkpoint "
                          "that ships its multi-token-prediction head (the published ones do; some conversions "
                          "drop it): use the original checkpoint, or another speculator (eagle3, draft, ngram)")
    return head


def read_mtp_head(model_dir: str | Path, target: ModelConfig, device: torch.device,
                  dtype: torch.dtype) -> MTPHead | None:
    """The checkpoint's MTP head, its weights checked against the target's config, not yet sharing the target's
    embedding, LM head and rotary table; None when the checkpoint has no mtp.* weights."""
    from specdec.models.loader import read_mtp_state

    stored = read_mtp_state(model_dir, device, dtype)
    if not stored:
        return None
    state = {name[len(PREFIX):]: tensor for name, tensor in stored.items()}
    with torch.device("meta"):
        head = MTPHead(MTPConfig.for_target(target))
    _check_weights(head, state, Path(model_dir))
    head.load_state_dict(state, assign=True)
    return head


def _check_weights(head: MTPHead, state: dict, model_dir: Path) -> None:
    expected = head.state_dict()
    missing = sorted(PREFIX + k for k in expected.keys() - state.keys())
    unexpected = sorted(PREFIX + k for k in state.keys() - expected.keys())
    if missing:
        raise ModelLoadError(f"{model_dir}: the MTP head lacks weights {missing[:5]}: the checkpoint is incomplete")
    if unexpected:
        raise ModelLoadError(f"{model_dir}: MTP weights specdec's head does not have: {unexpected[:5]} (it runs one "
                             "dense full-attention layer, mtp_num_hidden_layers 1)")
    for name, tensor in expected.items():
        got = tuple(state[name].shape)
        if got != tuple(tensor.shape):
            fields = _SHAPE_FIELDS.get(".".join(name.split(".")[-2:]), "hidden_size")
            raise ModelLoadError(f"{model_dir}: MTP weight {PREFIX}{name} has shape {got}, but config.json's "
                                 f"{fields} imply {tuple(tensor.shape)}: the head does not fit this target")


# ---------------------------------------------------------------------------------------------- saving

MTP_FILE = "model-mtp.safetensors"


def save_with_mtp_head(head: MTPHead, target_dir: str | Path, out_dir: str | Path,
                       dtype: torch.dtype | None = None) -> Path:
    """A copy of the target's checkpoint directory (config, tokenizer, weights: byte for byte) whose mtp.*
    weights are `head`'s: any the target had are left out of its files, and the head's go to a shard of their
    own that the shard index (written where the target had a single file) names; `--speculator mtp` with
    out_dir as the target then drafts with `head`."""
    import shutil

    from specdec.models.loader import INDEX_FILE, weight_files

    target_dir, out_dir = Path(target_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in target_dir.iterdir():
        if path.is_file():
            shutil.copy2(path, out_dir / path.name)
    weight_map = {}
    for path in weight_files(out_dir):
        if path.name != MTP_FILE:
            weight_map.update(dict.fromkeys(_drop_mtp_tensors(path), path.name))
    state = {PREFIX + k: (v if dtype is None else v.to(dtype)).detach().cpu().contiguous()
             for k, v in head.state_dict().items()}
    save_file(state, str(out_dir / MTP_FILE), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(state, MTP_FILE))
    total = sum((out_dir / name).stat().st_size for name in set(weight_map.values()))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return out_dir


def _drop_mtp_tensors(path: Path) -> list[str]:
    """Rewrite the safetensors file at path without its mtp.* tensors (when it has any); the names it keeps."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        names, metadata = list(f.keys()), f.metadata()
    kept = [n for n in names if not n.startswith(PREFIX)]
    if len(kept) < len(names):
        tensors = load_file(str(path))
        save_file({n: tensors[n] for n in kept}, str(path), metadata=metadata)
    return kept


# ---------------------------------------------------------------------------------------------- tests, benchmarks


@torch.no_grad()
def random_mtp_state(target: ModelConfig, seed: int = 0, std: float = 0.1) -> dict[str, torch.Tensor]:
    """Random mtp.* weights (float32, CPU) for a Qwen3.5 target: matrices N(0, std), norms N(0, 0.1) (scale ~1),
    named as a checkpoint stores them."""
    gen = torch.Generator().manual_seed(seed)
    head = MTPHead(MTPConfig.for_target(target))
    state = {}
    for name, p in head.state_dict().items():
        scale = 0.1 if name.endswith("norm.weight") else std
        state[PREFIX + name] = torch.randn(p.shape, generator=gen) * scale
    return state
