"""The drafter: a much smaller Qwen3 model distilled from the target's greedy continuations.

1. Prompts are prefixes of training documents (``sample_prompts``).
2. The target continues each prompt greedily (``greedy_continuations``: a batched, left-padded greedy loop
   with the ``transformers`` KV cache; the engine can replace it later behind the same signature).
3. The drafter is trained with cross-entropy on the continuation tokens only, plus (``kl_weight``) the KL
   divergence to the target's next-token distribution, computed on the fly, at every real position of
   the prompt and continuation; a share of each batch (``corpus_fraction``) can be plain corpus windows
   with the KL term alone. It starts fresh or from a pre-trained small base (``init_from``).
4. ``draft_matches`` + ``acceptance_tau`` measure the greedy mean acceptance length tau of the drafter
   for the target: one teacher-forced drafter pass over prompt + target continuation gives, at each
   continuation position, whether the drafter's greedy token equals the target's; while every earlier
   draft token matched, the drafter's context *is* prompt + continuation, so this equals drafting k
   tokens autoregressively (``literal_tau`` does it the slow way, for tests).

CLI: ``python -m specdec.train.distill --target DIR --corpus DIR --out DIR [--max-minutes M] ...``
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from specdec.drafting.walk import walk
from specdec.train.data import sample_prompts
from specdec.train.lm import (
    DRAFT_SHAPE,
    ModelShape,
    TrainConfig,
    WindowSampler,
    add_shape_args,
    add_train_args,
    autocast,
    bar_interval,
    count_params,
    new_model,
    pick_device,
    qwen3_config,
    run_training,
    save_checkpoint,
    shape_from_args,
    train_config_from_args,
)

TokenIds = Sequence[int] | np.ndarray


def load_model(model_dir: Path | str, device: str | torch.device | None = None, dtype: torch.dtype | None = None):
    """A Hugging Face causal LM in eval mode: bf16 on CUDA, float32 on CPU unless ``dtype`` says otherwise."""
    from transformers import AutoModelForCausalLM

    device = pick_device(device) if not isinstance(device, torch.device) else device
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()


def _eos_ids(model) -> list[int]:
    """EOS ids from the generation config (or the model config)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = model.config.eos_token_id if eos is None else eos
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _cache_kwarg(model) -> str:
    """Name of the KV-cache argument of ``forward``: ``past_key_values`` (transformers <= 5.2x) or ``cache``."""
    return "past_key_values" if "past_key_values" in inspect.signature(model.forward).parameters else "cache"


def _cache_out(output):
    """The KV cache returned by a forward, whatever this transformers version calls it."""
    for name in ("cache", "past_key_values"):
        value = getattr(output, name, None)
        if value is not None:
            return value
    raise RuntimeError("the model returned no KV cache: pass use_cache=True")


@torch.no_grad()
def greedy_batch(model, prompts: list[TokenIds], max_new_tokens: int, pad_id: int,
                 eos_ids: list[int]) -> list[list[int]]:
    """Greedy continuations of one batch of prompts: left padding, KV cache, stop at EOS (kept).

    Returns one list of new token ids per prompt, at most ``max_new_tokens`` long.
    """
    device = next(model.parameters()).device
    batch, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((batch, width), pad_id, dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):] = torch.as_tensor(np.asarray(prompt, dtype=np.int64))
        mask[i, width - len(prompt):] = 1
    ids, mask = ids.to(device), mask.to(device)  # [B, L]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, L]
    lengths = mask.sum(-1, keepdim=True)  # [B, 1]: next position of each row
    eos = torch.tensor(eos_ids or [-1], device=device)
    cache_kw = _cache_kwarg(model)
    with autocast(device):
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    new_tokens = []
    for step in range(max_new_tokens):
        token = out.logits[:, -1].argmax(-1)  # [B]
        token = torch.where(done, torch.full_like(token, pad_id), token)
        new_tokens.append(token)
        done |= torch.isin(token, eos)
        if step == max_new_tokens - 1 or bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # [B, L+step+1]
        with autocast(device):
            out = model(input_ids=token[:, None], attention_mask=mask, position_ids=lengths, use_cache=True,
                        logits_to_keep=1, **{cache_kw: _cache_out(out)})
        lengths = lengths + 1
    generated = torch.stack(new_tokens, dim=1).cpu().tolist()  # [B, n]
    result = []
    for row in generated:
        stop = next((j + 1 for j, t in enumerate(row) if t in eos_ids), len(row))
        result.append(row[:stop])
    return result


def greedy_continuations(
    target_dir,
    prompts: Sequence[str] | Sequence[TokenIds],
    max_new_tokens: int = 128,
    batch_size: int = 64,
    device: str | torch.device | None = None,
    max_seconds: float | None = None,
    progress: bool = True,
) -> list[list[int]]:
    """The target's greedy continuation (token ids, EOS included when reached) of each prompt.

    ``target_dir`` is a model directory or a model loaded from one; ``prompts`` are texts (encoded with the
    target's tokenizer, special-token strings as plain text) or token-id lists. Prompts are processed in
    the given order, ``batch_size`` at a time; with ``max_seconds`` it stops after the batch that crosses
    that time and returns the continuations of the first prompts only.
    """
    is_model = isinstance(target_dir, torch.nn.Module)
    model = target_dir if is_model else load_model(target_dir, device)
    if prompts and isinstance(prompts[0], str):
        from specdec.data.bpe import load_tokenizer

        tok = load_tokenizer(model.name_or_path if is_model else target_dir)
        prompts = [e.ids for e in tok.encode_batch(list(prompts), add_special_tokens=False)]
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    eos_ids = _eos_ids(model)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else (eos_ids or [0])[0]
    start = time.monotonic()
    results: list[list[int]] = []
    bar = tqdm(total=len(prompts), desc="continuations", unit="prompt", disable=not progress,
               mininterval=bar_interval())
    for first in range(0, len(prompts), batch_size):
        chunk = list(prompts[first:first + batch_size])
        results.extend(greedy_batch(model, chunk, max_new_tokens, pad_id, eos_ids))
        bar.update(len(chunk))
        if max_seconds is not None and time.monotonic() - start >= max_seconds:
            break
    bar.close()
    return results


def build_distill_pairs(target, docs: Sequence[np.ndarray], n_prompts: int, min_prompt: int = 32,
                        max_prompt: int = 384, max_new_tokens: int = 128, batch_size: int = 256,
                        device: str | torch.device | None = None, seed: int = 0,
                        max_seconds: float | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt, target greedy continuation) pairs for training the drafter; empty continuations dropped."""
    prompts = sample_prompts(docs, n_prompts, min_prompt, max_prompt, seed)
    conts = greedy_continuations(target, prompts, max_new_tokens, batch_size, device, max_seconds)
    return [(np.asarray(p, dtype=np.int64), np.asarray(c, dtype=np.int64)) for p, c in zip(prompts, conts) if len(c)]


# ---------------------------------------------------------------------------------------------- training


@dataclasses.dataclass
class DistillConfig(TrainConfig):
    """Drafter training: ``TrainConfig`` plus the distillation terms."""

    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 50
    kl_weight: float = 1.0
    corpus_fraction: float = 0.25


class PairBatcher:
    """Batches ``[B, seq_len + 1]`` of right-padded (prompt + continuation) pairs, optionally mixed with
    plain corpus windows, and their loss masks over the predicted positions ``[B, seq_len]``.

    A pair may carry the target's cached top-K per continuation token, ``(prompt, cont, top_ids [n, K],
    top_logprobs [n, K])``: then each batch also holds them aligned with the predicted positions."""

    def __init__(self, pairs: list[tuple[np.ndarray, np.ndarray]], seq_len: int, batch_size: int, pad_id: int,
                 corpus_stream: np.ndarray | None = None, corpus_fraction: float = 0.0, seed: int = 0):
        self.pairs, self.width, self.pad_id = pairs, seq_len + 1, pad_id
        self.rng = np.random.default_rng(seed)
        use_corpus = corpus_stream is not None and corpus_fraction > 0 and len(corpus_stream) > seq_len + 2
        if not pairs and not use_corpus:
            raise ValueError("nothing to train the drafter on: no continuation pairs and no corpus stream")
        self.n_corpus = (batch_size if not pairs else int(round(batch_size * corpus_fraction))) if use_corpus else 0
        self.n_pairs = batch_size - self.n_corpus
        self.windows = WindowSampler(corpus_stream, seq_len, self.n_corpus, seed + 1) if self.n_corpus else None
        self.last_tokens = 0  # real (non-pad) positions of the last batch, counted without a device sync
        self.topk = pairs[0][2].shape[1] if pairs and len(pairs[0]) == 4 else 0

    def next(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(ids ``[B, T+1]``, ce_mask ``[B, T]``, kl_mask ``[B, T]``): masks are over targets ``ids[:, 1:]``;
        with cached top-K also (top_ids ``[B, T, K]``, top_logprobs ``[B, T, K]``), set where ce_mask is."""
        ids = np.full((self.n_pairs, self.width), self.pad_id, dtype=np.int64)
        ce = np.zeros((self.n_pairs, self.width - 1), dtype=np.float32)
        kl = np.zeros_like(ce)
        top_ids = np.zeros((self.n_pairs, self.width - 1, self.topk), dtype=np.int64)
        top_logp = np.zeros(top_ids.shape, dtype=np.float32)
        for row, i in enumerate(self.rng.integers(0, len(self.pairs), size=self.n_pairs)):
            prompt, cont = self.pairs[i][:2]
            seq = np.concatenate([prompt, cont])[-self.width:]  # keep the continuation, cut the prompt's start
            n_cont = min(len(cont), len(seq) - 1)
            ids[row, : len(seq)] = seq
            ce[row, len(seq) - 1 - n_cont: len(seq) - 1] = 1.0  # positions whose target is a continuation token
            kl[row, : len(seq) - 1] = 1.0
            if self.topk:
                top_ids[row, len(seq) - 1 - n_cont: len(seq) - 1] = self.pairs[i][2][len(cont) - n_cont:]
                top_logp[row, len(seq) - 1 - n_cont: len(seq) - 1] = self.pairs[i][3][len(cont) - n_cont:]
        arrays = [ids, ce, kl] + ([top_ids, top_logp] if self.topk else [])
        batch = tuple(torch.from_numpy(a).to(device) for a in arrays)
        self.last_tokens = int(kl.sum()) + self.n_corpus * (self.width - 1)
        if self.windows is None:
            return batch
        extra = self.windows.next(device)  # [b, T+1]: plain text, KL only
        zeros = torch.zeros(extra.shape[0], self.width - 1, device=device)
        rest = [torch.cat([t, t.new_zeros((extra.shape[0], *t.shape[1:]))]) for t in batch[3:]]
        return (torch.cat([batch[0], extra]), torch.cat([batch[1], zeros]), torch.cat([batch[2], zeros + 1]), *rest)


def topk_kl(logits: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(target || draft) over the target's top-K support, per position: logits ``[..., V]``, top_ids and
    top_logprobs ``[..., K]`` -> ``[...]``. Both distributions are renormalised over the K ids (the drafter's
    log-softmax at those ids, minus its log-mass there), so it is 0 exactly when the drafter's relative
    probabilities of the K ids equal the target's; pushing mass onto the support is left to the CE term."""
    target_logp = F.log_softmax(top_logprobs.float(), dim=-1)
    draft_logp = F.log_softmax(logits.gather(-1, top_ids), dim=-1)
    return (target_logp.exp() * (target_logp - draft_logp)).sum(-1)


def distill_loss(draft, target, batch, kl_weight: float, norms=None) -> torch.Tensor:
    """Masked CE on continuation tokens + ``kl_weight`` * KL(target || draft): to the target's cached top-K
    (``topk_kl``, on the continuation positions) when the batch carries it, else to the live ``target``'s
    full distribution on the KL mask. ``norms``: the (CE, KL) denominators (default: the masks' sums;
    data-parallel training passes the global batch's over the world size, so averaged gradients are the
    global batch's)."""
    ids, ce_mask, kl_mask = batch[:3]  # [B, T+1], [B, T], [B, T]
    ce_norm, kl_norm = norms or (ce_mask.sum().clamp(min=1), kl_mask.sum().clamp(min=1))
    logits = draft(input_ids=ids[:, :-1]).logits.float()  # [B, T, V]
    ce = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view_as(ce_mask)
    loss = (ce * ce_mask).sum() / ce_norm
    if kl_weight and len(batch) == 5:
        loss = loss + kl_weight * (topk_kl(logits, batch[3], batch[4]) * ce_mask).sum() / ce_norm
    elif kl_weight and target is not None:
        with torch.no_grad():
            target_logp = F.log_softmax(target(input_ids=ids[:, :-1]).logits.float(), dim=-1)  # [B, T, V]
        kl = F.kl_div(F.log_softmax(logits, dim=-1), target_logp, log_target=True, reduction="none").sum(-1)
        loss = loss + kl_weight * (kl * kl_mask).sum() / kl_norm
    return loss


def train_drafter(
    target,
    pairs: list[tuple[np.ndarray, np.ndarray]],
    out_dir: Path | str | None,
    shape: ModelShape = DRAFT_SHAPE,
    cfg: DistillConfig | None = None,
    init_from: Path | str | None = None,
    corpus_stream: np.ndarray | None = None,
    heldout_windows: torch.Tensor | None = None,
    tokenizer_dir: Path | str | None = None,
    max_shard_size: str | int = "2GB",
    extra_eos_ids: Sequence[int] = (),
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Train the drafter on ``pairs`` (and ``corpus_stream`` windows) against ``target`` (a model or a dir).

    Saves it to ``out_dir`` (when given) with the tokenizer files of ``tokenizer_dir`` (default: the
    target's directory). Returns (drafter, ``run_training``'s dict + ``params``).
    """
    from specdec.train.lm import evaluate

    cfg = cfg or DistillConfig()
    device = pick_device(cfg.device)
    target_model = target if isinstance(target, torch.nn.Module) else load_model(target, device)
    target_model.eval().requires_grad_(False)
    vocab = target_model.config.vocab_size
    eos = _eos_ids(target_model)
    if init_from is not None:
        draft = load_model(init_from, device, dtype=torch.float32)
        if draft.config.vocab_size != vocab:
            raise ValueError(f"--init-from model has vocab {draft.config.vocab_size}, the target {vocab}")
    else:
        draft = new_model(qwen3_config(shape, vocab, target_model.config.eos_token_id,
                                       target_model.config.pad_token_id), cfg.seed)
    draft.to(device)
    pad_id = target_model.config.pad_token_id if target_model.config.pad_token_id is not None else eos[0]
    batcher = PairBatcher(pairs, cfg.seq_len, cfg.batch_size, pad_id, corpus_stream, cfg.corpus_fraction, cfg.seed)
    evaluate_fn = None
    if heldout_windows is not None:
        evaluate_fn = lambda: evaluate(draft, heldout_windows, cfg.eval_batch_size, device)  # noqa: E731
    result = run_training(
        draft, lambda: batcher.next(device),
        lambda model, batch: distill_loss(model, target_model, batch, cfg.kl_weight),
        cfg, evaluate_fn, tokens_per_batch=lambda b: batcher.last_tokens, desc="distill",
    )
    result["params"] = count_params(draft)
    if out_dir is not None:
        tok_dir = tokenizer_dir or (None if isinstance(target, torch.nn.Module) else target)
        save_checkpoint(draft, out_dir, tok_dir, max_shard_size, extra_eos_ids=[*eos, *extra_eos_ids])
    return draft.eval(), result


# ---------------------------------------------------------------------------------------------- tau


@torch.no_grad()
def draft_matches(draft, prompts: Sequence[TokenIds], conts: Sequence[TokenIds],
                  batch_size: int = 64) -> list[np.ndarray]:
    """For each (prompt, continuation): a bool array ``[len(cont)]``, True where the drafter's greedy
    token given prompt + cont[:j] equals cont[j] (one teacher-forced pass, right padding)."""
    device = next(draft.parameters()).device
    out: list[np.ndarray] = []
    for first in range(0, len(prompts), batch_size):
        ps, cs = prompts[first:first + batch_size], conts[first:first + batch_size]
        seqs = [np.concatenate([np.asarray(p, np.int64), np.asarray(c, np.int64)]) for p, c in zip(ps, cs)]
        width = max(len(s) for s in seqs)
        ids = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.from_numpy(s)
        with autocast(device):
            pred = draft(input_ids=ids.to(device)).logits.argmax(-1).cpu()  # [b, W]
        for i, (p, c) in enumerate(zip(ps, cs)):
            guess = pred[i, len(p) - 1: len(p) - 1 + len(c)].numpy()
            out.append(guess == np.asarray(c, np.int64))
    return out


def acceptance_walk(matches: np.ndarray, k: int) -> tuple[int, int]:
    """(tokens, steps) of the greedy walk (``specdec.drafting.walk``) over one continuation with k draft
    tokens per step: a = matched prefix of the k drafts, step = min(a + 1, tokens left)."""
    n = len(matches)

    def accepted_at(pos: int) -> int:
        a = 0
        while a < k and pos + a < n and matches[pos + a]:
            a += 1
        return a

    return walk(n, accepted_at)


def acceptance_tau(matches: Sequence[np.ndarray], k: int) -> float:
    """Mean acceptance length tau = tokens / steps over all continuations, at draft length ``k``."""
    totals = [acceptance_walk(m, k) for m in matches]
    steps = sum(s for _, s in totals)
    return sum(t for t, _ in totals) / steps if steps else float("nan")


@torch.no_grad()
def literal_tau(draft, prompts: Sequence[TokenIds], conts: Sequence[TokenIds], k: int) -> float:
    """tau by the definition: at each step the drafter greedily drafts k tokens (no cache) from
    prompt + cont[:pos]. Slow; for checking ``draft_matches`` + ``acceptance_tau``."""
    device = next(draft.parameters()).device
    tokens = steps = 0
    for prompt, cont in zip(prompts, conts):
        cont = list(cont)
        pos = 0
        while pos < len(cont):
            ctx = list(prompt) + cont[:pos]
            drafted = []
            for _ in range(k):
                logits = draft(input_ids=torch.tensor([ctx + drafted], device=device)).logits
                drafted.append(int(logits[0, -1].argmax()))
            ref = cont[pos:pos + k]
            a = next((i for i, (x, y) in enumerate(zip(drafted, ref)) if x != y), min(k, len(ref)))
            step = min(a + 1, len(cont) - pos)
            tokens, steps, pos = tokens + step, steps + 1, pos + step
    return tokens / steps if steps else float("nan")


# ---------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    """CLI (the lead wires it as ``specdec train distill``)."""
    from specdec.data.bpe import load_tokenizer, special_ids
    from specdec.train.lm import eval_windows, load_corpus_tokens, pack_documents

    parser = argparse.ArgumentParser(prog="specdec train distill", description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True, help="target model directory (with tokenizer files)")
    parser.add_argument("--corpus", required=True, help="corpus directory (python -m specdec.data.corpus)")
    parser.add_argument("--out", required=True, help="output drafter directory")
    parser.add_argument("--init-from", default=None, help="start from this pre-trained small model directory")
    parser.add_argument("--n-prompts", type=int, default=20000)
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=384)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--gen-batch-size", type=int, default=256)
    parser.add_argument("--gen-minutes", type=float, default=None, help="time budget for the continuations")
    parser.add_argument("--kl-weight", type=float, default=1.0)
    parser.add_argument("--corpus-fraction", type=float, default=0.25)
    parser.add_argument("--max-shard-size", default="2GB")
    add_shape_args(parser, DRAFT_SHAPE)
    add_train_args(parser, DistillConfig())
    args = parser.parse_args(argv)
    from specdec.train.cli import model_dir_arg

    args.target = model_dir_arg(parser, "--target", args.target)
    if args.max_steps is None and args.max_minutes is None:
        parser.error("give --max-steps or --max-minutes")
    cfg = train_config_from_args(args, DistillConfig, kl_weight=args.kl_weight, corpus_fraction=args.corpus_fraction)
    tok = load_tokenizer(args.target)
    eos = special_ids(tok)["eos"]
    docs = load_corpus_tokens(args.corpus, tok, "train")
    heldout = pack_documents(load_corpus_tokens(args.corpus, tok, "heldout"), eos)
    target = load_model(args.target, args.device)
    pairs = build_distill_pairs(target, docs, args.n_prompts, args.min_prompt, args.max_prompt, args.max_new_tokens,
                                args.gen_batch_size, args.device, args.seed,
                                args.gen_minutes * 60 if args.gen_minutes else None)
    windows = eval_windows(heldout, cfg.seq_len, cfg.eval_windows) if len(heldout) > cfg.seq_len + 1 else None
    _, result = train_drafter(target, pairs, args.out, shape_from_args(args), cfg, args.init_from,
                              pack_documents(docs, eos), windows, tokenizer_dir=args.target,
                              max_shard_size=args.max_shard_size, extra_eos_ids=[special_ids(tok)["im_end"]])
    print(f"params {result['params']}  pairs {len(pairs)}  steps {result['steps']}  "
          f"held-out loss {result['final_heldout_loss']}  saved to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
