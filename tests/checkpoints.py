"""Tiny random Hugging Face checkpoints, saved with `transformers`, for the CPU tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-6)


def hf_config(arch: str, tie: bool = False, rope_scaling: bool = False, eos: int = 1, **overrides):
    import transformers

    kwargs = dict(TINY, tie_word_embeddings=tie, bos_token_id=0, eos_token_id=eos, **overrides)
    if arch == "qwen3":
        kwargs["rope_theta"] = 10000.0
        return transformers.Qwen3Config(**kwargs)
    if rope_scaling:
        kwargs["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
        kwargs["rope_theta"] = 500000.0
    else:
        kwargs["rope_theta"] = 10000.0
    return transformers.LlamaConfig(**kwargs)


def save_tiny(path: Path, arch: str = "qwen3", tie: bool = False, rope_scaling: bool = False, seed: int = 0,
              tokenizer: bool = True, max_shard_size: str | None = None, **overrides) -> Path:
    """Build a random model, scale its weights up a little (sharper, less tie-prone logits), save it."""
    import transformers

    torch.manual_seed(seed)
    config = hf_config(arch, tie, rope_scaling, **overrides)
    cls = transformers.Qwen3ForCausalLM if arch == "qwen3" else transformers.LlamaForCausalLM
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.normal_(0, 0.15)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    if tokenizer:
        save_char_tokenizer(path, config.vocab_size)
    return path


def save_char_tokenizer(path: Path, vocab_size: int) -> None:
    """A character-level tokenizer.json: ids 0/1 are <s>/</s>, then printable ASCII."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    chars = [chr(c) for c in range(32, 32 + vocab_size - 2)]
    vocab = {"<s>": 0, "</s>": 1, **{ch: i + 2 for i, ch in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}",
    }))


def add_mtp_weights(path: Path, state: dict[str, torch.Tensor]) -> Path:
    """Write mtp.* tensors into a saved checkpoint, as published Qwen3.5 checkpoints carry them (transformers
    neither makes nor saves them): into model.safetensors, or for a sharded checkpoint into a shard of their
    own that the index names."""
    from safetensors.torch import load_file, save_file

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        save_file(state, str(path / "model-mtp.safetensors"), metadata={"format": "pt"})
        raw = json.loads(index.read_text())
        raw["weight_map"].update({name: "model-mtp.safetensors" for name in state})
        index.write_text(json.dumps(raw, indent=2))
        return path
    weights = load_file(str(path / "model.safetensors"))
    save_file(weights | state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
