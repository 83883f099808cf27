"""Pre-training a small causal LM on a tokenised corpus: a Qwen3 (``transformers.Qwen3ForCausalLM``) or,
with ``--arch qwen3_5``, a Qwen3.5-shaped hybrid (``transformers.Qwen3_5ForCausalLM``, specdec.train.shapes).
The architecture only decides which config and model are built; the data, loop and checkpoint are the same.

Documents are joined with EOS into one token stream; a training batch is ``batch_size`` random windows of
``seq_len + 1`` tokens from it (inputs ``[:, :-1]``, targets ``[:, 1:]``). AdamW with linear warmup and a
cosine decay whose progress is ``max(step / max_steps, elapsed / max_seconds)``, so a run stopped by the
clock still ends its schedule. bf16 autocast on CUDA, float32 on CPU. Seeded: the initial weights and
the batch order depend only on ``seed`` (a run cut by ``max_seconds`` stops at a time-dependent step).

The checkpoint is a standard Hugging Face directory: ``config.json``, bf16 ``model*.safetensors`` (sharded
with an index above ``max_shard_size``), ``generation_config.json`` and the tokenizer files.

CLI: ``python -m specdec.train.lm --corpus DIR --tokenizer DIR --out DIR [--arch qwen3_5] [--max-minutes M] ...``
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from specdec.devices import pick_device
from specdec.train.shapes import (  # noqa: F401 (re-exported: the shapes and configs a run builds)
    ARCHS, DRAFT_SHAPE, TARGET_SHAPE, ModelShape, config_kwargs, model_config, qwen3_config, target_shape)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def new_model(config, seed: int = 0):
    """A freshly initialised model of ``config.architectures[0]`` (float32); the weights depend only on ``seed``."""
    import transformers

    torch.manual_seed(seed)
    return getattr(transformers, config.architectures[0])(config)


def count_params(model: torch.nn.Module) -> int:
    """Number of distinct parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())


def autocast(device: torch.device):
    """bf16 autocast on CUDA; a no-op elsewhere (float32 on CPU)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def bar_interval() -> float:
    """Seconds between progress-bar refreshes: short on a terminal, long in a log file."""
    return 1.0 if sys.stderr.isatty() else 15.0


# ---------------------------------------------------------------------------------------------- data


def tokenize_documents(tok, texts: list[str], batch_size: int = 2048, desc: str = "tokenize",
                       progress: bool = True) -> list[np.ndarray]:
    """Token ids of each text (``np.uint16`` when the vocabulary fits, else ``int32``), batch-encoded."""
    dtype = np.uint16 if tok.get_vocab_size() <= 65536 else np.int32
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    out: list[np.ndarray] = []
    bar = tqdm(total=len(texts), desc=desc, unit="doc", disable=not progress, mininterval=bar_interval())
    for start in range(0, len(texts), batch_size):
        batch = texts[start:start + batch_size]
        out.extend(np.asarray(e.ids, dtype=dtype) for e in encode(batch, add_special_tokens=False))
        bar.update(len(batch))
    bar.close()
    return out


def pack_documents(docs: Iterable[np.ndarray], eos_id: int) -> np.ndarray:
    """One stream: each document followed by EOS. Returns ``[N]`` with the documents' dtype."""
    docs = list(docs)
    dtype = docs[0].dtype if docs else np.int32
    eos = np.asarray([eos_id], dtype=dtype)
    return np.concatenate([part for doc in docs for part in (doc, eos)]) if docs else np.zeros(0, dtype)


def load_corpus_tokens(corpus_dir: Path | str, tok, split: str, progress: bool = True) -> list[np.ndarray]:
    """Tokenised documents of one split of a corpus built by ``specdec.data.corpus``."""
    from specdec.data.corpus import iter_documents

    texts = [doc["text"] for doc in iter_documents(corpus_dir, split)]
    return tokenize_documents(tok, texts, desc=f"tokenize {split}", progress=progress)


class WindowSampler:
    """Random windows of ``seq_len + 1`` tokens from a stream, in a seeded order."""

    def __init__(self, stream: np.ndarray, seq_len: int, batch_size: int, seed: int = 0):
        if len(stream) < seq_len + 2:
            raise ValueError(f"token stream of {len(stream)} tokens is shorter than one window of {seq_len + 1}")
        self.stream, self.seq_len, self.batch_size = stream, seq_len, batch_size
        self.rng = np.random.default_rng(seed)
        self.arange = np.arange(seq_len + 1)

    def next(self, device: torch.device) -> torch.Tensor:
        """A batch ``[batch_size, seq_len + 1]`` of int64 token ids on ``device``."""
        starts = self.rng.integers(0, len(self.stream) - self.seq_len - 1, size=self.batch_size)
        windows = self.stream[starts[:, None] + self.arange].astype(np.int64)  # [B, T+1]
        return torch.from_numpy(windows).to(device, non_blocking=True)


def eval_windows(stream: np.ndarray, seq_len: int, max_windows: int) -> torch.Tensor:
    """Up to ``max_windows`` non-overlapping, evenly spaced windows ``[W, seq_len + 1]`` (int64, CPU)."""
    n_fit = (len(stream) - 1) // (seq_len + 1)
    if n_fit < 1:
        raise ValueError(f"held-out stream of {len(stream)} tokens is shorter than one window of {seq_len + 1}")
    picks = np.linspace(0, n_fit - 1, num=min(n_fit, max_windows)).astype(np.int64)
    starts = picks * (seq_len + 1)
    return torch.from_numpy(stream[starts[:, None] + np.arange(seq_len + 1)].astype(np.int64))


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``batch`` ``[B, T+1]`` (float32 loss, whatever the autocast)."""
    logits = model(input_ids=batch[:, :-1], use_cache=False).logits  # [B, T, V]
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, batch_size: int = 32, device: torch.device | None = None) -> float:
    """Mean next-token loss (nats) of ``model`` over ``windows`` ``[W, T+1]``."""
    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(windows), batch_size):
        batch = windows[start:start + batch_size].to(device)  # [b, T+1]
        with autocast(device):
            total += lm_loss(model, batch).item() * batch[:, 1:].numel()
        count += batch[:, 1:].numel()
    model.train(was_training)
    return total / max(count, 1)


# ---------------------------------------------------------------------------------------------- training


@dataclasses.dataclass
class TrainConfig:
    """Optimisation and budget settings for ``train_lm``."""

    seq_len: int = 512
    batch_size: int = 128
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta2: float = 0.95
    grad_clip: float = 1.0
    max_steps: int | None = None
    max_seconds: float | None = None
    eval_points: int = 8
    eval_windows: int = 128
    eval_batch_size: int = 32
    seed: int = 0
    device: str | None = None
    compile: bool = False
    log_every: int = 25


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, beta2: float,
                   device: torch.device) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not norms); fused kernels on CUDA."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, beta2), fused=device.type == "cuda")


def lr_factor(step: int, progress: float, warmup_steps: int, min_ratio: float) -> float:
    """Linear warmup over ``warmup_steps``, then cosine from 1 to ``min_ratio`` as progress goes 0 -> 1."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def training_progress(step: int, elapsed: float, cfg) -> float:
    """Fraction of the run done: the larger of the step budget and the time budget used."""
    parts = [0.0]
    if cfg.max_steps:
        parts.append(step / cfg.max_steps)
    if cfg.max_seconds:
        parts.append(elapsed / cfg.max_seconds)
    return max(parts)


def run_training(
    model: torch.nn.Module,
    next_batch: Callable[[], Any],
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    cfg,
    evaluate_fn: Callable[[], float] | None = None,
    tokens_per_batch: Callable[[Any], int] = lambda b: b.numel(),
    desc: str = "train",
) -> dict[str, Any]:
    """The shared loop of ``train_lm`` and the drafter: AdamW, warmup + cosine, step and time budget.

    ``loss_fn(model, batch)`` returns a scalar; ``evaluate_fn()`` a held-out loss, called at
    ``cfg.eval_points`` evenly spaced points of progress and at the end. Returns the history
    (``[{step, tokens, seconds, lr, train_loss, heldout_loss?}]``), ``first_loss`` and totals.
    """
    if not cfg.max_steps and not cfg.max_seconds:
        raise ValueError("give max_steps or max_seconds (or both)")
    device = next(model.parameters()).device
    model.train()
    opt = make_optimizer(model, cfg.lr, cfg.weight_decay, cfg.beta2, device)
    fwd = torch.compile(model) if cfg.compile else model
    history: list[dict[str, Any]] = []
    losses: list[torch.Tensor] = []
    step = tokens = 0
    lr = 0.0
    first_loss = None
    next_eval = 1.0 / cfg.eval_points if cfg.eval_points else 2.0
    bar = tqdm(total=cfg.max_steps, desc=desc, unit="step", mininterval=bar_interval())
    start = time.monotonic()
    warmup = min(cfg.warmup_steps, max(1, cfg.max_steps // 10)) if cfg.max_steps else cfg.warmup_steps
    while (progress := training_progress(step, time.monotonic() - start, cfg)) < 1.0:
        lr = cfg.lr * lr_factor(step, progress, warmup, cfg.min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = next_batch()
        with autocast(device):
            loss = loss_fn(fwd, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        losses.append(loss.detach())
        step += 1
        tokens += tokens_per_batch(batch)
        if first_loss is None:
            first_loss = round(loss.item(), 4)
        if step % cfg.log_every == 0 or progress >= next_eval:
            elapsed = time.monotonic() - start
            train_loss = torch.stack(losses).mean().item()
            losses.clear()
            row = {"step": step, "tokens": tokens, "seconds": round(elapsed, 2), "lr": float(f"{lr:.4g}"),
                   "train_loss": round(train_loss, 4)}
            if evaluate_fn is not None and progress >= next_eval:
                row["heldout_loss"] = round(evaluate_fn(), 4)
                next_eval += 1.0 / cfg.eval_points
                tqdm.write(f"{desc} step {step} tokens {tokens} train {train_loss:.3f} "
                           f"held-out {row['heldout_loss']:.3f} ({elapsed:.0f}s)")
            history.append(row)
            bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{tokens / max(elapsed, 1e-9):.3g}",
                            lr=f"{lr:.2e}", refresh=False)
        bar.update(1)
    bar.close()
    seconds = time.monotonic() - start
    if losses:
        history.append({"step": step, "tokens": tokens, "seconds": round(seconds, 2), "lr": float(f"{lr:.4g}"),
                        "train_loss": round(torch.stack(losses).mean().item(), 4)})
    final = evaluate_fn() if evaluate_fn is not None else None
    return {"steps": step, "tokens": tokens, "seconds": round(seconds, 2), "first_loss": first_loss,
            "final_train_loss": history[-1]["train_loss"] if history else None,
            "final_heldout_loss": None if final is None else round(final, 4),
            "tokens_per_second": round(tokens / max(seconds, 1e-9)),
            "history": history}


def train_lm(model: torch.nn.Module, train_stream: np.ndarray, heldout_stream: np.ndarray | None,
             cfg: TrainConfig) -> dict[str, Any]:
    """Pre-train ``model`` in place on random windows of ``train_stream``; returns ``run_training``'s dict."""
    device = pick_device(cfg.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    model.to(device)
    sampler = WindowSampler(train_stream, cfg.seq_len, cfg.batch_size, cfg.seed)
    evaluate_fn = None
    if heldout_stream is not None and len(heldout_stream) > cfg.seq_len + 1:
        windows = eval_windows(heldout_stream, cfg.seq_len, cfg.eval_windows)
        evaluate_fn = lambda: evaluate(model, windows, cfg.eval_batch_size, device)  # noqa: E731
    return run_training(model, lambda: sampler.next(device), lm_loss, cfg, evaluate_fn,
                        tokens_per_batch=lambda b: b[:, 1:].numel(), desc="pretrain")


# ---------------------------------------------------------------------------------------------- saving


def save_checkpoint(model: torch.nn.Module, out_dir: Path | str, tokenizer_dir: Path | str | None,
                    max_shard_size: str | int = "2GB", extra_eos_ids: Iterable[int] = ()) -> Path:
    """Write a Hugging Face directory: bf16 safetensors (+ index when sharded), config, generation
    config (``eos_token_id`` = config's EOS + ``extra_eos_ids``) and the tokenizer files.

    ``model`` itself is left untouched (a bf16 copy is saved). Stale weight files in ``out_dir`` are removed.
    """
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), *out.glob("model*.safetensors.index.json")]:
        stale.unlink()
    bf16 = copy.deepcopy(model).to(device="cpu", dtype=torch.bfloat16)
    bf16.config.dtype = torch.bfloat16
    bf16.save_pretrained(out, max_shard_size=max_shard_size)
    eos = bf16.config.eos_token_id
    eos_ids = list(dict.fromkeys([eos, *extra_eos_ids])) if eos is not None else list(extra_eos_ids)
    GenerationConfig(
        bos_token_id=None,
        eos_token_id=eos_ids if len(eos_ids) > 1 else eos_ids[0],
        pad_token_id=bf16.config.pad_token_id,
    ).save_pretrained(out)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            shutil.copy2(Path(tokenizer_dir) / name, out / name)
    for path in out.iterdir():
        path.chmod(0o644)  # safetensors writes 0600
    return out


def dir_bytes(path: Path | str) -> int:
    """Total size of the files directly in ``path``."""
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


# ---------------------------------------------------------------------------------------------- CLI


def add_shape_args(parser: argparse.ArgumentParser, shape: ModelShape, prefix: str = "") -> None:
    """``--{prefix}hidden-size`` etc. with ``shape``'s values as defaults."""
    for field in dataclasses.fields(shape):
        flag = f"--{prefix}{field.name.replace('_', '-')}"
        default = getattr(shape, field.name)
        if isinstance(default, bool):
            parser.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=default)
        else:
            parser.add_argument(flag, type=type(default), default=default)


def shape_from_args(args: argparse.Namespace, prefix: str = "", cls: type = ModelShape) -> ModelShape:
    """The shape (a ``cls``: ``ModelShape`` or a subclass) given by ``add_shape_args`` flags."""
    key = prefix.replace("-", "_")
    return cls(**{f.name: getattr(args, key + f.name) for f in dataclasses.fields(cls)})


def add_train_args(parser: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """Optimisation/budget flags with ``defaults``."""
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
    parser.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
    parser.add_argument("--max-steps", type=int, default=defaults.max_steps)
    parser.add_argument("--max-minutes", type=float, default=None)
    parser.add_argument("--eval-points", type=int, default=defaults.eval_points)
    parser.add_argument("--eval-windows", type=int, default=defaults.eval_windows)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--device", default=None, help="cuda / cpu (default: cuda if available)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the training forward")


def train_config_from_args(args: argparse.Namespace, cls=TrainConfig, **extra) -> Any:
    """A ``TrainConfig`` (or subclass) from ``add_train_args`` flags."""
    return cls(seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup_steps,
               weight_decay=args.weight_decay, max_steps=args.max_steps,
               max_seconds=args.max_minutes * 60 if args.max_minutes else None, eval_points=args.eval_points,
               eval_windows=args.eval_windows, seed=args.seed, device=args.device, compile=args.compile, **extra)


def pretrain(corpus_dir: Path | str, tokenizer_dir: Path | str, out_dir: Path | str, shape: ModelShape,
             cfg: TrainConfig, max_shard_size: str | int = "2GB") -> dict[str, Any]:
    """Function API: tokenise the corpus, pre-train a fresh model of ``shape``, save it to ``out_dir``."""
    from specdec.data.bpe import load_tokenizer, special_ids

    tok = load_tokenizer(tokenizer_dir)
    ids = special_ids(tok)
    train = pack_documents(load_corpus_tokens(corpus_dir, tok, "train"), ids["eos"])
    heldout = pack_documents(load_corpus_tokens(corpus_dir, tok, "heldout"), ids["eos"])
    model = new_model(model_config(shape, tok.get_vocab_size(), ids["eos"]), cfg.seed)
    result = train_lm(model, train, heldout, cfg)
    save_checkpoint(model, out_dir, tokenizer_dir, max_shard_size, extra_eos_ids=[ids["im_end"]])
    result["params"] = count_params(model)
    return result


def arch_parser() -> argparse.ArgumentParser:
    """A parent parser with ``--arch`` alone: read first, since the shape flags and defaults depend on it."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--arch", choices=ARCHS, default="qwen3",
                        help="qwen3 (ref-target's) or qwen3_5 (a Qwen3.5-shaped hybrid); sets the shape defaults")
    return parser


def main(argv: list[str] | None = None) -> int:
    """CLI (the lead wires it as ``specdec train lm``)."""
    parser = argparse.ArgumentParser(prog="specdec train lm", description=__doc__.split("\n")[0],
                                     parents=[arch_parser()])
    parser.add_argument("--corpus", required=True, help="corpus directory (python -m specdec.data.corpus)")
    parser.add_argument("--tokenizer", required=True, help="directory with tokenizer.json (python -m specdec.data.bpe)")
    parser.add_argument("--out", required=True, help="output checkpoint directory")
    parser.add_argument("--max-shard-size", default="2GB")
    shape = target_shape(arch_parser().parse_known_args(argv)[0].arch)
    add_shape_args(parser, shape)
    add_train_args(parser, TrainConfig())
    args = parser.parse_args(argv)
    if args.max_steps is None and args.max_minutes is None:
        parser.error("give --max-steps or --max-minutes")
    result = pretrain(args.corpus, args.tokenizer, args.out, shape_from_args(args, cls=type(shape)),
                      train_config_from_args(args), args.max_shard_size)
    print(f"params {result['params']}  steps {result['steps']}  tokens {result['tokens']}  "
          f"held-out loss {result['final_heldout_loss']:.4f}  saved to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
