"""The fake engines' toy bigram model (tests.fakes.engine.ToyModel) saved as a Hugging Face Llama checkpoint,
so that `--scorer` can score the fakes' texts with the very log-probs the fakes sample from.

How a transformer becomes a bigram table: every attention and MLP block writes zero to the residual stream
(o_proj and down_proj are zero), so the last hidden state is the current token's embedding.  Word w embeds as
SCALE e_w (e_w one-hot), which the final RMSNorm turns into sqrt(H) e_w; column w of the LM head is row w of the
table divided by sqrt(H), so the logits are the table's row for the previous word.

The tokenizer splits text as the fakes do, into whitespace-led words (`\\s*\\S+`): " kan" and, for a text's
first word, a bare "kan", which embeds as " kan" does and is never predicted.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from tests.fakes.engine import EOS, WORDS, ToyModel

HIDDEN = 48  # >= the table's rows (its words) and outputs (its words and end-of-text)
SCALE = 100.0  # the embeddings' length: the final RMSNorm's epsilon then changes the logits by < 1e-8
NEVER = -30.0
# transformers serve (5.x) samples at a request's temperature only where the model's generation config says
# do_sample, and then from the 50 likeliest tokens unless it gives top_k: the fakes and specdec sample from all
PLAIN_SAMPLING = {"do_sample": True, "top_k": 0}  # the bare words' logit: text never continues with a word without its leading space


def vocabulary() -> dict[str, int]:
    """" kan" -> its word id, "</s>" -> EOS, bare "kan" -> EOS + 1 + its word id."""
    spaced = {" " + w: i for i, w in enumerate(WORDS)}
    bare = {w: EOS + 1 + i for i, w in enumerate(WORDS)}
    return {**spaced, "</s>": EOS, **bare}


def save_toy_checkpoint(path: Path, variant: float = 0.0) -> Path:
    """Write the toy model (as `--variant` makes it) and its tokenizer to `path`; return `path`."""
    import transformers

    vocab_size = len(vocabulary())
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=16,
                                      num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                      bos_token_id=EOS, eos_token_id=EOS, pad_token_id=EOS, rope_theta=10000.0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        set_bigram_weights(model, torch.tensor(ToyModel(variant=variant).logprobs, dtype=torch.float32))
    model.generation_config.update(**PLAIN_SAMPLING)
    model.save_pretrained(path)
    save_word_tokenizer(Path(path))
    return Path(path)


def set_bigram_weights(model, table: torch.Tensor) -> None:
    """Make `model` compute logits = table[previous word] (see the module's docstring)."""
    embed = model.model.embed_tokens.weight
    embed.zero_()
    for i in vocabulary().values():
        embed[i, i if i <= EOS else i - EOS - 1] = SCALE  # a bare word embeds as its spaced form
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    model.model.norm.weight.fill_(1.0)
    head = model.lm_head.weight  # [vocab, hidden]
    head.zero_()
    rows, outputs = table.shape  # words, words + end-of-text
    head[:outputs, :rows] = table.T / math.sqrt(HIDDEN)
    head[outputs:, :rows] = NEVER / math.sqrt(HIDDEN)


def save_word_tokenizer(path: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab=vocabulary(), unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s*\S+"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["</s>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "bos_token": "</s>",
        "pad_token": "</s>", "unk_token": "</s>"}))
