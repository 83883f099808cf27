"""Byte-level BPE tokenizer for the reference pair, trained with the ``tokenizers`` library.

Byte-level means lossless: any text (Python source with its indentation, tabs, trailing spaces and
newlines) decodes back byte for byte; there is no normaliser. Special tokens (ids 0, 1, 2):
``<|endoftext|>`` (EOS, also the pad token), ``<|im_start|>``, ``<|im_end|>`` for a ChatML template.

The saved directory (``tokenizer.json`` + ``tokenizer_config.json``) loads with both
``tokenizers.Tokenizer.from_file(dir / "tokenizer.json")`` and ``transformers.AutoTokenizer.from_pretrained(dir)``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterable, Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def new_tokenizer() -> Tokenizer:
    """An untrained byte-level BPE tokenizer (GPT-2 style pre-tokenisation, no normaliser)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _capped(texts: Iterable[str], max_bytes: int | None) -> Iterator[str]:
    """Yield texts until ``max_bytes`` UTF-8 bytes have been yielded (None: all)."""
    total = 0
    for text in texts:
        yield text
        total += len(text.encode("utf-8"))
        if max_bytes is not None and total >= max_bytes:
            return


def train_tokenizer(
    texts: Iterable[str],
    out_dir: Path | str,
    vocab_size: int = 8192,
    max_bytes: int | None = None,
    model_max_length: int = 2048,
    show_progress: bool = True,
) -> Tokenizer:
    """Train on ``texts`` (at most ``max_bytes`` of them) and save the tokenizer files to ``out_dir``."""
    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(_capped(texts, max_bytes), trainer=trainer)
    save_tokenizer(tok, out_dir, model_max_length)
    return tok


def tokenizer_config(model_max_length: int = 2048) -> dict:
    """tokenizer_config.json: special tokens, length limit, ChatML template, no space clean-up on decode."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "model_max_length": model_max_length,
        "padding_side": "left",
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tok: Tokenizer, out_dir: Path | str, model_max_length: int = 2048) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir``; return the directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(model_max_length), indent=2) + "\n")
    return out


def load_tokenizer(tok_dir: Path | str, encode_special_tokens: bool = True) -> Tokenizer:
    """Load ``tokenizer.json``. With ``encode_special_tokens`` (for corpus text) a literal
    ``<|endoftext|>`` inside source code is encoded as plain text, not as the EOS token."""
    tok = Tokenizer.from_file(str(Path(tok_dir) / "tokenizer.json"))
    tok.encode_special_tokens = encode_special_tokens
    return tok


def special_ids(tok: Tokenizer) -> dict[str, int]:
    """Ids of the special tokens: ``{"eos": .., "im_start": .., "im_end": ..}``."""
    return {"eos": tok.token_to_id(EOS_TOKEN), "im_start": tok.token_to_id(IM_START), "im_end": tok.token_to_id(IM_END)}


def encode_texts(tok: Tokenizer, texts: list[str], batch_size: int = 1024) -> list[list[int]]:
    """Token ids of each text, via the (multi-threaded) batch encoder; no special tokens added."""
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    ids: list[list[int]] = []
    for start in range(0, len(texts), batch_size):
        ids.extend(e.ids for e in encode(texts[start:start + batch_size], add_special_tokens=False))
    return ids


def main(argv: list[str] | None = None) -> int:
    """CLI: train a tokenizer on the train split of a corpus built by ``specdec.data.corpus``."""
    from specdec.data.corpus import iter_documents

    parser = argparse.ArgumentParser(prog="python -m specdec.data.bpe", description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", required=True, help="corpus directory (specdec.data.corpus)")
    parser.add_argument("--out", required=True, help="output directory for tokenizer files")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--max-bytes", type=int, default=64 << 20, help="train on at most this much text")
    parser.add_argument("--model-max-length", type=int, default=2048)
    args = parser.parse_args(argv)
    texts = (doc["text"] for doc in iter_documents(args.corpus, "train"))
    tok = train_tokenizer(texts, args.out, args.vocab_size, args.max_bytes, args.model_max_length)
    print(f"vocab {tok.get_vocab_size()} saved to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
