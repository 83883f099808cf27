"""``specdec train head``: a draft head for a target, trained on the target's own continuations: an EAGLE-3 head
(``--kind eagle3``, the default) or a Qwen3.5 target's own MTP head (``--kind mtp``: train/mtp_head.py says what
differs; the steps below are the same for both).

1. Prompts from each ``--prompts`` source (train/data.py), checked against the held-out set (never trained on).
2. Continuations by this project's engine: half the prompts greedy, half sampled at temperature 1 (each from a
   seed of its own), cached as shards under ``OUT/continuations-greedy/`` and ``OUT/continuations-t1/``.
3. The draft vocabulary: the ``--draft-vocab`` most frequent tokens of the training sequences (d2t / t2d);
   an MTP head's is the target's whole vocabulary.
4. Training: features (the target's residual stream entering its three feature layers; for MTP its
   final-normed hidden state) and the target's next-token distributions from the live target, every batch;
   the training-time test (``train/head_loss.py``, each head's steps in ``train/head_unroll.py``:
   ``--ttt-steps`` unrolled steps, a loss at each, the cross-entropy against the target's distribution, i.e.
   the KL up to a constant); AdamW, warm-up and cosine decay; a checkpoint every ``--checkpoint-every`` steps
   (a rerun with the same ``--out`` resumes); a progress bar.
5. Held-out greedy acceptance per draft position (teacher-forced unrolling: step s at root r counts while
   steps 0..s - 1 matched, which is what greedy drafting accepts) at the start and end.
6. Exports in the published EAGLE-3 layout: ``OUT/export/bf16`` and ``OUT/export/fp8``, each with
   ``weights.sha256.json`` (MTP: ``OUT/export/bf16``, a copy of the target with the trained mtp.* weights);
   ``OUT/DATA_MANIFEST.md``, ``OUT/train_log.jsonl``, ``OUT/run.json``, ``OUT/result.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from specdec.errors import ConfigError
from specdec.models.config import ModelConfig
from specdec.models.eagle3 import (Eagle3Head, check_fits_target, default_feature_layers, feature_layers,
                                   load_eagle3_head, random_head, read_head_config, save_eagle3_head)
from specdec.models.fused import plain_kernels
from specdec.models.provenance import file_sha256
from specdec.train.checkpoint import Checkpoint, check_run_identity
from specdec.train.data import (add_data_arguments, check_overlap, check_prompt_sources, corpus_windows,
                                generate_continuations, is_corpus, load_or_make_heldout, load_prompt_sources)
from specdec.train.head_loss import UnrolledHead, head_loss, unrolled_logits
from specdec.train.head_unroll import Eagle3Unroll
from specdec.train.lm import autocast, bar_interval, lr_factor, make_optimizer, pick_device
from specdec.train.log import TrainLog

FORMATS = ("bf16", "fp8")
KINDS = ("eagle3", "mtp")
# The command's defaults for an EAGLE-3 head: the recipe of the bundled ref-head (docs/EAGLE3.md), measured
# against continuations alone on one H100 (docs/BENCHMARKS.md, fifteenth session).  An MTP head keeps lr 1e-3
# and no windows (bench/gpu_hybrid.sh's recipe).
EAGLE3_LR = 2e-3
MTP_LR = 1e-3
EAGLE3_WINDOWS = 100_000  # at most this many corpus windows (51M tokens at seq_len 512) when a source is a corpus


@dataclasses.dataclass
class HeadRun:
    target: str
    sources: list[str]
    out: str
    heldout: str | None = None  # held-out set or prompts (default: the bundled prompts)
    heldout_limit: int | None = None
    heldout_max_tokens: int = 128
    n_prompts: int = 4000  # per corpus source
    corpus_windows: int = 0  # at most this many windows of seq_len tokens of the corpus sources, trained on too
    min_prompt: int = 32
    max_prompt: int = 384
    max_new_tokens: int = 128
    gen_batch_size: int = 256
    draft_vocab: int | None = None  # None: the target's whole vocabulary
    ttt_steps: int = 7
    decay: float = 0.8
    seq_len: int = 512
    batch_size: int = 32
    lr: float = 1e-3
    max_steps: int = 1000
    max_minutes: float | None = None  # stop training after this long (the exports follow)
    warmup_steps: int = 50
    checkpoint_every: int = 200
    seed: int = 0
    device: str | None = None
    formats: tuple[str, ...] = FORMATS
    drop_overlap: bool = False
    kind: str = "eagle3"  # or "mtp": the target's own MTP head (train/mtp_head.py)
    start: str = "random"  # an EAGLE-3 head's output side: "random", or "target" (its final norm and LM head)
    feature_layers: tuple[int, ...] | None = None  # an EAGLE-3 head's target layers; None: vLLM's and SGLang's
    init_from: str | None = None  # an EAGLE-3 head to train on (its weights, draft vocabulary and feature layers)

    def identity(self) -> dict[str, Any]:
        identity = {"target": str(Path(self.target).resolve()),
                    "sources": [str(Path(s).resolve()) for s in self.sources],
                    "n_prompts": self.n_prompts, "min_prompt": self.min_prompt, "max_prompt": self.max_prompt,
                    "max_new_tokens": self.max_new_tokens, "draft_vocab": self.draft_vocab, "seed": self.seed,
                    "seq_len": self.seq_len, "ttt_steps": self.ttt_steps}
        if self.corpus_windows:
            identity["corpus_windows"] = self.corpus_windows
        if self.init_from:
            identity["init_from"] = str(Path(self.init_from).resolve())
        if self.kind != "eagle3":
            return identity | {"kind": self.kind}
        if self.feature_layers is not None:
            identity["feature_layers"] = list(self.feature_layers)
        return identity if self.start == "random" else identity | {"start": self.start}  # random: as before


# ---------------------------------------------------------------------------------------------- data


def make_records(run: HeadRun, log: TrainLog) -> tuple[list[dict], list[dict], dict, list[dict]]:
    """(training records, held-out conversations, held-out info, source rows).  A record is a continuation
    {id, prompt, continuation, sampled} or, with run.corpus_windows, a corpus window {id, source, window,
    opening} (train/data.py corpus_windows)."""
    from specdec.llm import LLM

    engine: list = []

    def llm_factory():
        if not engine:
            engine.append(LLM(run.target, device=run.device))
        return engine[0]

    out = Path(run.out)
    heldout, heldout_info = load_or_make_heldout(run, llm_factory, log)
    prompts, sources = load_prompt_sources(run.sources, Path(run.target), run.n_prompts, run.min_prompt,
                                           run.max_prompt, run.seed)
    kept = check_overlap(prompts, heldout, run.drop_overlap)
    log("overlap-check", training_prompts=len(prompts), heldout=len(heldout), dropped=len(prompts) - len(kept))
    greedy, sampled = kept[0::2], kept[1::2]
    records = [dict(r, sampled=False) for r in generate_continuations(
        llm_factory, greedy, out / "continuations-greedy", run.max_new_tokens, run.gen_batch_size, log)]
    records += [dict(r, sampled=True) for r in generate_continuations(
        llm_factory, sampled, out / "continuations-t1", run.max_new_tokens, run.gen_batch_size, log,
        temperature=1.0, seed=run.seed)]
    engine.clear()
    if run.corpus_windows:
        records += windows_of(run, heldout, log)
    return records, heldout, heldout_info, sources


def windows_of(run: HeadRun, heldout: list[dict], log: TrainLog) -> list[dict]:
    """The run's corpus windows, those whose document opening overlaps the held-out set left out or refused as
    prompts are (check_overlap)."""
    windows, rows = corpus_windows(run.sources, Path(run.target), run.corpus_windows, run.seq_len, run.seed)
    openings = [{"id": w["id"], "prompt": w["window"].tolist()} for w in windows if w["opening"]]
    clashing = {p["id"] for p in openings} - {p["id"] for p in check_overlap(openings, heldout, run.drop_overlap)}
    log("corpus-windows", sources=rows, dropped=len(clashing))
    return [w for w in windows if w["id"] not in clashing]


def sequence_of(record: dict) -> np.ndarray:
    """The token row a record trains on: a window, or a prompt followed by the target's continuation."""
    if "window" in record:
        return np.asarray(record["window"], np.int64)
    return np.asarray(record["prompt"] + record["continuation"], np.int64)


def draft_vocabulary(sequences: Sequence[np.ndarray], vocab_size: int, size: int | None) -> torch.Tensor:
    """[size] the target ids of the draft vocabulary, ascending: the `size` most frequent tokens of the
    sequences (ties by id), or every id."""
    if size is None or size >= vocab_size:
        return torch.arange(vocab_size)
    counts = np.bincount(np.concatenate(list(sequences)), minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))  # most frequent first, then by id
    return torch.from_numpy(np.sort(order[:size])).long()


def set_vocabulary(head: Eagle3Head, target_ids: torch.Tensor) -> None:
    """d2t / t2d for a draft vocabulary of these target ids (ascending)."""
    with torch.no_grad():
        head.d2t.copy_(target_ids.to(head.d2t.device) - torch.arange(len(target_ids), device=head.d2t.device))
        head.t2d.zero_()
        head.t2d[target_ids.to(head.t2d.device)] = True


class SequenceBatcher:
    """Random batches of [B, seq_len] token rows (prompt + continuation, right-padded) and their lengths."""

    def __init__(self, sequences: list[np.ndarray], seq_len: int, batch_size: int, seed: int):
        self.sequences = [s[:seq_len] for s in sequences if len(s) >= 3]
        self.seq_len, self.batch_size = seq_len, batch_size
        self.rng = np.random.default_rng(seed)

    def next(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(ids [B, width], lengths [B], real tokens in all): the tensors are copied to the device from pinned
        memory without waiting for the device (a plain copy would wait for every step queued before it)."""
        picked = self.rng.integers(0, len(self.sequences), self.batch_size)
        rows = [self.sequences[i] for i in picked]
        width = max(len(r) for r in rows)
        ids = np.zeros((len(rows), width), dtype=np.int64)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = r
        lengths = np.array([len(r) for r in rows], dtype=np.int64)
        return _to_device(ids, device), _to_device(lengths, device), int(lengths.sum())


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)  # a fresh pinned buffer each call: no reuse race


# ---------------------------------------------------------------------------------------------- the target side


class TargetSignals:
    """The frozen target (transformers): per batch, the head's inputs and targets."""

    def __init__(self, target_dir: str, device: torch.device, layers: tuple[int, ...]):
        from specdec.train.distill import load_model

        self.model = load_model(target_dir, device).requires_grad_(False)
        self.layers = layers
        self.embedding = self.model.get_input_embeddings()

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, draft_ids: torch.Tensor | None):
        """ids [B, T] -> (embed [B, T, H]: the embedding of token p + 1 at row p; features [B, T, len(layers) H]:
        the target's states at p; target log-probs [B, T, V_draft]: its distribution at p + 1 over the draft
        vocabulary, draft_ids, or the whole vocabulary when None)."""
        out = self.model(ids, output_hidden_states=True)
        features = torch.cat([out.hidden_states[j] for j in self.layers], dim=-1)
        logits = out.logits if draft_ids is None else out.logits[:, :, draft_ids]
        logprobs = logits.float().log_softmax(-1)
        nxt = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
        return (self.embedding(nxt).float(), features.float(),
                torch.cat([logprobs[:, 1:], logprobs[:, -1:]], dim=1))


# ---------------------------------------------------------------------------------------------- measuring


@torch.no_grad()
def heldout_acceptance(head: UnrolledHead, signals: TargetSignals, heldout: Sequence[dict], steps: int,
                       batch_size: int = 16) -> list[float]:
    """Greedy acceptance per draft position on the held-out conversations: at position s, the share of chains
    whose drafts 0..s - 1 were all accepted that also get draft s right (teacher-forced unrolling equals
    greedy drafting while every earlier draft matched).  Only roots inside the continuation count."""
    reached, accepted = np.zeros(steps), np.zeros(steps)
    draft_ids = head.target_ids()
    for first in range(0, len(heldout), batch_size):
        convs = heldout[first:first + batch_size]
        seqs = [list(c["prompt"]) + list(c["continuation"]) for c in convs]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long, device=signals.embedding.weight.device)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)
        embed, features, target = signals(ids, draft_ids)
        logits = unrolled_logits(head, embed, features, steps)
        hits = torch.stack([(lg.argmax(-1) == target.argmax(-1)) for lg in logits]).cpu().numpy()  # [S, B, T]
        for b, conv in enumerate(convs):
            start, end = len(conv["prompt"]) - 2, len(seqs[b]) - 2  # roots predicting continuation tokens
            for r in range(max(start, 0), end):
                for s in range(min(steps, end - r)):
                    reached[s] += 1
                    if not hits[s, b, r + s]:
                        break
                    accepted[s] += 1
    return [round(float(a / n), 4) if n else 0.0 for a, n in zip(accepted, reached)]


# ---------------------------------------------------------------------------------------------- training


@dataclasses.dataclass
class HeadModel:
    """What a run trains: the module (its parameters are what trains), its unrolling for the loss, the target's
    side, and its export (out_dir, format) -> {dir, sha256}."""

    module: nn.Module
    unroll: UnrolledHead
    signals: TargetSignals
    feature_layers: tuple[int, ...]
    vocab: int  # the draft vocabulary's size
    start: str  # where the weights started: "random", or "target" (an MTP head the target shipped)
    export: Callable[[Path, str], dict]


def eagle3_model(run: HeadRun, sequences: list[np.ndarray], device: torch.device) -> HeadModel:
    """The EAGLE-3 head a run trains: the head run.init_from names (float32, its own draft vocabulary and
    feature layers), or a new one over the run's draft vocabulary (the most frequent tokens of the sequences),
    its output side started as run.start says."""
    from specdec.models.loader import load_model

    small = load_model(run.target, device, torch.float32)
    if run.init_from:
        head = load_eagle3_head(run.init_from, small, device, torch.float32)
        layers, vocab, start = feature_layers(head.config, small.config.num_hidden_layers), head.target_ids(), "head"
    else:
        layers = feature_layers_of(run, small.config.num_hidden_layers)
        vocab = draft_vocabulary(sequences, small.config.vocab_size, run.draft_vocab)
        head, start = random_head(small, seed=run.seed, draft_vocab=len(vocab), feature_layers=layers), run.start
        set_vocabulary(head, vocab)
        if run.start == "target":
            start_from_target_output(head, small, vocab)
    head = head.float().requires_grad_(True)
    head.embed_tokens = None  # the target's embedding comes with each batch; the export shares the target's
    del small
    return HeadModel(head, Eagle3Unroll(head), TargetSignals(run.target, device, layers), layers, len(vocab),
                     start, lambda out_dir, fmt: export_head(head, out_dir, fmt))


def check_init_from(run: HeadRun, target: ModelConfig) -> None:
    """Refuse, before any work, an --init-from head that does not fit the target (naming its config's field) or
    that the run's other flags contradict: a continued head keeps its feature layers, draft vocabulary and
    output side."""
    if not run.init_from:
        return
    head_dir = Path(run.init_from)
    config = read_head_config(head_dir)
    check_fits_target(config, target, head_dir / "config.json")
    layers = feature_layers(config, target.num_hidden_layers)
    clashes = []
    if run.feature_layers is not None and tuple(run.feature_layers) != layers:
        clashes.append(f"--feature-layers {','.join(map(str, run.feature_layers))} (the head reads "
                       f"{','.join(map(str, layers))})")
    if run.draft_vocab is not None and run.draft_vocab != config.draft_vocab_size:
        clashes.append(f"--draft-vocab {run.draft_vocab} (the head's is {config.draft_vocab_size})")
    if run.start != "random":
        clashes.append(f"--start {run.start} (the head's output side is trained already)")
    if clashes:
        raise ConfigError(f"--init-from {head_dir}: " + "; ".join(clashes) + ": leave them out, a continued head "
                          "keeps its feature layers, draft vocabulary and output side")


def feature_layers_of(run: HeadRun, num_target_layers: int) -> tuple[int, ...]:
    """The target layers an EAGLE-3 head of this run reads: run.feature_layers, or the default; refused when an
    id is past the target's depth."""
    layers = run.feature_layers or default_feature_layers(num_target_layers)
    if not all(0 <= j <= num_target_layers for j in layers):
        raise ConfigError(f"--feature-layers {','.join(map(str, layers))}: the target has {num_target_layers} layers, "
                          f"so each id must be in 0..{num_target_layers} (j: the residual stream entering layer j)")
    return tuple(layers)


def start_from_target_output(head: Eagle3Head, target: nn.Module, vocab: torch.Tensor) -> None:
    """The head's final norm and LM head start as the target's (its LM head's rows of the draft vocabulary
    `vocab` [V_draft], target ids): the head then begins where the target's own output space is, and its
    layer learns to reach the target's last hidden state instead of a new space and a new read-out at once."""
    with torch.no_grad():
        head.norm.weight.copy_(target.model.norm.weight)
        head.lm_head.weight.copy_(target.lm_head.weight[vocab.to(target.lm_head.weight.device)])


def mtp_model(run: HeadRun, device: torch.device) -> HeadModel:
    """The target's MTP head (its own weights, or random ones where it ships none): train/mtp_head.py."""
    from specdec.train.mtp_head import check_target, export_mtp, mtp_model as make

    config = check_target(run.target)
    layers = (config.num_hidden_layers,)  # the final-normed hidden state
    signals = TargetSignals(run.target, device, layers)
    head, unroll, start = make(run.target, signals, run.seed, device)
    return HeadModel(head, unroll, signals, layers, config.vocab_size, start,
                     lambda out_dir, fmt: export_mtp(head, run.target, out_dir, fmt))


def train(run: HeadRun, records: list[dict], heldout: list[dict], log: TrainLog, progress: bool = True) -> dict:
    """The training loop (resumable); returns {steps, tokens, seconds, acceptance before/after, exports}."""
    device = pick_device(run.device)
    out = Path(run.out)
    sequences = [sequence_of(r) for r in records if r.get("continuation") or "window" in r]
    model = mtp_model(run, device) if run.kind == "mtp" else eagle3_model(run, sequences, device)
    head, unroll, signals, layers = model.module, model.unroll, model.signals, model.feature_layers
    draft_ids = unroll.target_ids()
    opt = make_optimizer(head, run.lr, 0.0, 0.95, device)
    ckpt = Checkpoint(out / "checkpoint")
    meta = ckpt.meta() if ckpt.exists() else {"step": 0, "tokens": 0, "seconds": 0.0, "history": []}
    batcher = SequenceBatcher(sequences, run.seq_len, run.batch_size, run.seed)
    if ckpt.exists():
        ckpt.restore(head, opt)
        batcher.rng.bit_generator.state = meta["rng"]
        log("resume", step=meta["step"], tokens=meta["tokens"])
    step, tokens, history = meta["step"], meta["tokens"], meta["history"]
    if step == 0:
        head.eval()
        history.append(log("eval", step=0, acceptance=heldout_acceptance(unroll, signals, heldout, run.ttt_steps)))
    head.train()
    budget_s = run.max_minutes * 60 if run.max_minutes else math.inf
    started, elapsed0 = time.monotonic(), meta["seconds"]

    def save() -> None:
        ckpt.save(head, opt, {"step": step, "tokens": tokens, "history": history,
                              "seconds": elapsed0 + time.monotonic() - started,
                              "rng": batcher.rng.bit_generator.state})

    bar = tqdm(total=run.max_steps, initial=step, desc="train head", unit="step", disable=not progress,
               mininterval=bar_interval())
    with plain_kernels():
        while step < run.max_steps and elapsed0 + time.monotonic() - started < budget_s:
            progress_done = max(step / run.max_steps, (elapsed0 + time.monotonic() - started) / budget_s)
            lr = run.lr * lr_factor(step, progress_done, min(run.warmup_steps, run.max_steps // 10 or 1), 0.1)
            for group in opt.param_groups:
                group["lr"] = lr
            ids, lengths, batch_tokens = batcher.next(device)
            embed, features, target = signals(ids, draft_ids)
            with autocast(device):
                loss, accuracy = head_loss(unroll, embed, features, target, lengths, run.ttt_steps, run.decay)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            step, tokens = step + 1, tokens + batch_tokens
            bar.update(1)
            if step % 50 == 0 or step == run.max_steps:
                log("train", step=step, tokens=tokens, lr=float(f"{lr:.4g}"), loss=round(loss.item(), 4),
                    accuracy=[round(a, 3) for a in accuracy.tolist()])
            if step % run.checkpoint_every == 0:
                save()
    bar.close()
    save()
    head.eval()
    history.append(log("eval", step=step, acceptance=heldout_acceptance(unroll, signals, heldout, run.ttt_steps)))
    save()
    exports = {fmt: model.export(out / "export" / fmt, fmt) for fmt in run.formats}
    for fmt, e in exports.items():
        log("export", format=fmt, dir=e["dir"], sha256=e["sha256"])
    return {"steps": step, "tokens": tokens, "seconds": round(elapsed0 + time.monotonic() - started, 1),
            "feature_layers": list(layers), "draft_vocab": model.vocab, "start": model.start, "history": history,
            "exports": exports}


def export_head(head: Eagle3Head, out_dir: Path, fmt: str) -> dict:
    """One export in the published layout (bf16, or FP8 e4m3 projections with per-row scales)."""
    from safetensors.torch import save_file

    from specdec.models.provenance import write_weights_sha256
    from specdec.models.quant import QUANT_METHOD, quantize_state

    save_eagle3_head(head, out_dir, torch.bfloat16)
    if fmt == "fp8":
        state = {k: v for k, v in head.state_dict().items() if k not in ("d2t", "t2d")}
        tensors, names = quantize_state(state, "fp8")
        tensors.update(d2t=head.d2t.cpu(), t2d=head.t2d.cpu())
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((out_dir / "config.json").read_text())
        config["quantization_config"] = {"quant_method": QUANT_METHOD, "format": "fp8", "modules": sorted(names)}
        (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"dir": str(out_dir), "sha256": write_weights_sha256(out_dir)}


# ---------------------------------------------------------------------------------------------- provenance


def write_manifest(run: HeadRun, sources: list[dict], heldout_info: dict, records: list[dict], summary: dict) -> Path:
    greedy = [r for r in records if r.get("sampled") is False]
    sampled = [r for r in records if r.get("sampled")]
    windows = [r for r in records if "window" in r]
    lines = [
        f"# DATA_MANIFEST ({'MTP' if run.kind == 'mtp' else 'EAGLE-3'} head)", "",
        f"Written by `specdec train head` (specdec.train.head) for the target `{run.target}`.", "",
        "## Training data", "",
        "| source | kind | split | prompts | how |", "| --- | --- | --- | ---: | --- |",
        *[f"| {s['source']} | {s['kind']} | {s['split']} | {s['prompts']} | {s['how']} |" for s in sources], "",
        f"Continuations by the specdec engine (at most {run.max_new_tokens} tokens): {len(greedy)} greedy "
        f"({sum(len(r['continuation']) for r in greedy)} tokens), {len(sampled)} sampled at temperature 1 with a "
        f"seed per prompt from {run.seed} ({sum(len(r['continuation']) for r in sampled)} tokens).", "",
        *([f"Corpus windows: {len(windows)} pieces of at most {run.seq_len} tokens "
           f"({sum(len(r['window']) for r in windows)} tokens) of the train-split documents of "
           f"{', '.join(sorted({r['source'] for r in windows}))} (a seeded choice, seed {run.seed}), the target's "
           "distribution along them made by its forward while training.", ""] if windows else []),
        "## Held out (measured on, never trained on)", "",
        f"- {heldout_info['source']} (sha256 {heldout_info['sha256']}): {heldout_info['conversations']} "
        f"conversations, {heldout_info['tokens']} continuation tokens; {heldout_info['how']}",
        "- Overlap check: no training prompt (or corpus window opening a document) equals, is a prefix of or "
        "extends a held-out prompt.", "",
        "## Head", "",
        f"- {head_description(run, summary)}, training-time test of "
        f"{run.ttt_steps} steps (decay {run.decay}), {summary['steps']} steps, {summary['tokens']} tokens, "
        f"{summary['seconds']} s.",
        *[f"- Export {fmt}: `{e['dir']}`, sha256 {json.dumps(e['sha256'])}" for fmt, e in summary["exports"].items()],
        "",
    ]
    path = Path(run.out) / "DATA_MANIFEST.md"
    path.write_text("\n".join(lines))
    return path


def head_description(run: HeadRun, summary: dict) -> str:
    if run.kind == "mtp":
        start = "the target's own mtp.* weights" if summary["start"] == "target" else f"random weights (seed {run.seed})"
        return (f"The target's MTP head (mtp.* only; embedding and LM head the target's, frozen), started from "
                f"{start}, feature layer {summary['feature_layers']} (the final-normed hidden state), the target's "
                f"whole vocabulary ({summary['draft_vocab']} tokens)")
    if summary["start"] == "head":
        weights = Path(run.init_from) / "model.safetensors"
        return (f"Feature layers {summary['feature_layers']}, draft vocabulary {summary['draft_vocab']} tokens, both "
                f"the head's it started from: `{run.init_from}` (model.safetensors sha256 {file_sha256(weights)})")
    start = ("the target's final norm and LM head rows, the rest random" if summary["start"] == "target"
             else "random weights")
    return (f"Feature layers {summary['feature_layers']}, draft vocabulary {summary['draft_vocab']} tokens (the most "
            f"frequent of the training sequences), started from {start}")


def check_kind(run: HeadRun) -> None:
    """Refuse, before any work, a run whose kind does not fit its target or formats."""
    if run.kind not in KINDS:
        raise ValueError(f"kind {run.kind!r}: one of {KINDS}")
    if run.init_from and run.kind != "eagle3":
        raise ConfigError("--init-from continues an EAGLE-3 head; an MTP head starts from the target's own mtp.* "
                          "weights where it ships them")
    if run.kind == "mtp":
        from specdec.train.mtp_head import check_formats, check_target

        check_target(run.target)
        check_formats(run.formats)


def run_pipeline(run: HeadRun, progress: bool = True) -> dict:
    check_kind(run)
    check_prompt_sources(run.sources)
    if run.corpus_windows and not has_corpus(run.sources):
        raise ConfigError("--corpus-windows cuts windows from corpus directories, and no --prompts source is one "
                          "(JSON-lines prompt files have no documents): add a corpus built by `python -m "
                          "specdec.data.corpus`, or leave --corpus-windows out")
    if run.kind == "eagle3":  # before any continuation is made
        target = ModelConfig.from_dir(run.target)
        feature_layers_of(run, target.num_hidden_layers)
        check_init_from(run, target)
    out = Path(run.out)
    out.mkdir(parents=True, exist_ok=True)
    check_run_identity(run)
    log = TrainLog(out / "train_log.jsonl", name="head")
    records, heldout, heldout_info, sources = make_records(run, log)
    summary = train(run, records, heldout, log, progress)
    write_manifest(run, sources, heldout_info, records, summary)
    history = summary["history"]
    result = {"acceptance_before": history[0]["acceptance"], "acceptance_after": history[-1]["acceptance"],
              **{k: summary[k] for k in ("steps", "tokens", "seconds", "feature_layers", "draft_vocab", "start",
                                         "exports")}}
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def has_corpus(sources: Sequence[str]) -> bool:
    """Whether any prompt source is a corpus directory (the only kind corpus windows are cut from)."""
    return any(is_corpus(Path(source)) for source in sources)


def defaults_for_kind(kind: str, sources: Sequence[str], lr: float | None,
                      windows: int | None) -> tuple[float, int]:
    """(lr, corpus windows) where the command line left them out: an EAGLE-3 head's recipe (EAGLE3_LR, and
    EAGLE3_WINDOWS when a prompt source is a corpus, none otherwise), an MTP head's MTP_LR and none."""
    eagle3 = kind == "eagle3"
    if lr is None:
        lr = EAGLE3_LR if eagle3 else MTP_LR
    if windows is None:
        windows = EAGLE3_WINDOWS if eagle3 and has_corpus(sources) else 0
    return lr, windows


def layer_ids(text: str) -> tuple[int, ...]:
    """'2,4,7' -> (2, 4, 7): an EAGLE-3 head's three target layers (low, middle, high), for argparse."""
    try:
        ids = tuple(int(part) for part in text.split(","))
    except ValueError:
        ids = ()
    if len(ids) != 3:
        raise argparse.ArgumentTypeError(f"{text!r}: give three comma-separated layer ids (low, middle, high), "
                                         "e.g. 2,4,7")
    return ids


def main(argv: list[str] | None = None) -> int:
    from specdec.train.cli import model_dir_arg

    parser = argparse.ArgumentParser(prog="specdec train head", description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True, help="target model directory or short name (ref-target)")
    parser.add_argument("--kind", choices=KINDS, default="eagle3",
                        help="eagle3: an EAGLE-3 head (exports in its published layout); mtp: a Qwen3.5 target's own "
                             "MTP head, from its mtp.* weights or random (exported into a copy of the target)")
    add_data_arguments(parser, 4000, "prompts per corpus source (half greedy, half sampled at temperature 1)")
    parser.add_argument("--corpus-windows", type=int, default=None,
                        help="also train on up to this many windows of --seq-len tokens of the corpus sources' train "
                             "documents themselves (labels: the target's distribution from its forward, so no "
                             f"generation; default: {EAGLE3_WINDOWS} for eagle3 when a source is a corpus, else 0; "
                             "0: continuations only)")
    parser.add_argument("--draft-vocab", type=int, default=None,
                        help="draft vocabulary size (default: the target's; eagle3 only)")
    parser.add_argument("--ttt-steps", type=int, default=7, help="training-time test: unrolled steps (>= 1)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=None, help=f"peak learning rate (default: {EAGLE3_LR} for "
                        f"eagle3, {MTP_LR} for mtp)")
    parser.add_argument("--max-steps", type=int, default=1000)
    parser.add_argument("--max-minutes", type=float, default=None, help="stop training after this long")
    parser.add_argument("--checkpoint-every", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None)
    parser.add_argument("--formats", nargs="+", default=None, choices=FORMATS,
                        help="exports (default: bf16 fp8 for eagle3, bf16 for mtp, its only one)")
    parser.add_argument("--drop-overlap", action="store_true",
                        help="leave out training prompts that overlap the held-out set (default: refuse to run)")
    parser.add_argument("--start", choices=("random", "target"), default="random",
                        help="an EAGLE-3 head's final norm and LM head: random (default) or the target's")
    parser.add_argument("--feature-layers", type=layer_ids, default=None,
                        help="an EAGLE-3 head's target layers, e.g. 2,4,7 (default: 2, L/2, L-3 as vLLM and "
                             "SGLang; j is the residual stream entering layer j)")
    parser.add_argument("--init-from", default=None, metavar="HEAD",
                        help="train on from this EAGLE-3 head (a directory in the published layout, or ref-head): "
                             "its weights, draft vocabulary and feature layers, e.g. a published head fine-tuned on "
                             "your own prompts (default: a new head)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.ttt_steps < 1 or args.max_steps < 1:
        parser.error("--ttt-steps and --max-steps must be at least 1")
    if args.corpus_windows is not None and args.corpus_windows < 0:
        parser.error("--corpus-windows must be 0 or more")
    if args.lr is not None and args.lr <= 0:
        parser.error("--lr must be above 0")
    lr, windows = defaults_for_kind(args.kind, args.prompts, args.lr, args.corpus_windows)
    if args.draft_vocab is not None and args.draft_vocab < 1:
        parser.error("--draft-vocab must be at least 1 (a larger size than the target's vocabulary takes all of it)")
    if args.kind == "mtp" and args.draft_vocab is not None:
        parser.error("--draft-vocab is for --kind eagle3: an MTP head drafts over the target's whole vocabulary")
    formats = args.formats or (["bf16"] if args.kind == "mtp" else list(FORMATS))
    target = model_dir_arg(parser, "--target", args.target)
    init_from = model_dir_arg(parser, "--init-from", args.init_from) if args.init_from else None
    run = HeadRun(target, args.prompts, args.out, heldout=args.heldout, heldout_limit=args.heldout_limit,
                  heldout_max_tokens=args.max_new_tokens, n_prompts=args.n_prompts, corpus_windows=windows,
                  min_prompt=args.min_prompt, max_prompt=args.max_prompt, max_new_tokens=args.max_new_tokens,
                  gen_batch_size=args.gen_batch_size, draft_vocab=args.draft_vocab, ttt_steps=args.ttt_steps,
                  seq_len=args.seq_len, batch_size=args.batch_size, lr=lr, max_steps=args.max_steps,
                  max_minutes=args.max_minutes, checkpoint_every=args.checkpoint_every, seed=args.seed,
                  device=args.device, formats=tuple(formats), drop_overlap=args.drop_overlap, kind=args.kind,
                  start=args.start, feature_layers=args.feature_layers, init_from=init_from)
    result = run_pipeline(run, progress=not args.no_progress)
    print(json.dumps({k: result[k] for k in ("acceptance_before", "acceptance_after", "steps", "tokens", "seconds")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
