"""``specdec train drafter``: a drafter distilled from the target's own greedy continuations, end to end.

1. Prompts from each ``--prompts`` source: a JSON-lines file (``{"id", "prompt": text or [ids]}``) or a
   corpus directory (``specdec train corpus``; prefixes of its *train* split documents).
2. Overlap check: no training prompt may equal, or be a prefix of / extend, a held-out prompt (the run
   refuses to start otherwise). The held-out set is only ever used for measuring.
3. Continuations: the target's greedy continuations made by this project's engine
   (``LLM(target).generate(..., SamplingParams(temperature=0, max_tokens=N))``), a batch at a time, each
   batch cached as a JSON-lines shard under ``OUT/continuations/`` (with ``--topk-kl K``, the target's top-K
   log-probs of each continuation token beside it, ``shard-*.topk.npz``); a rerun generates only what is missing.
4. Training (``specdec.train.distill``'s batches and loss): cross-entropy on the target's tokens, plus
   optionally KL to the target's distributions (full, from the live target; or, with ``--topk-kl``, to its
   cached top-K, so the target is not loaded for training); starts from ``--base`` (a general model, never a drafter
   already trained for this target). Held-out tau (k = ``--k``) every ``--eval-every`` steps by the greedy
   walk (``specdec.drafting.walk``; teacher forced, equal to drafting autoregressively). Checkpoints every
   ``--checkpoint-every`` steps in ``OUT/checkpoint/``; a rerun with the same ``--out`` resumes.
5. After ``--max-steps``: export bf16 and FP8; then ``--qat-steps`` of 4-bit quantization-aware training
   and the int4 export (``specdec.models.quant``). Each export gets ``weights.sha256.json``.
6. Each export is served with the /draft server and walked by the verifier on the held-out set; the 4-bit
   and FP8 drafters' greedy next tokens are compared with the bf16 drafter's (agreement).

Provenance: ``OUT/DATA_MANIFEST.md`` (sources, splits, how obtained, overlap check, export sha256),
``OUT/train_log.jsonl`` (one JSON row per log / evaluation / export event), ``OUT/run.json`` (the settings;
a resume with different data or models is refused) and ``OUT/result.json``.

Several GPUs: under ``torchrun`` (``WORLD_SIZE`` > 1) rank 0 alone generates the continuations (the others
wait, then read the cache); each rank trains on its share of every global batch (``--batch-size`` is the
global batch) with the drafter in DistributedDataParallel; only rank 0 evaluates and writes checkpoints,
exports, the manifest and the logs.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from specdec.errors import ConfigError
from specdec.train.distill import DistillConfig, PairBatcher, acceptance_tau, distill_loss, draft_matches
from specdec.train.checkpoint import Checkpoint, RunMismatchError, check_run_identity  # noqa: F401 (re-exported)
from specdec.train.cli import model_dir_arg
from specdec.train.data import (  # noqa: F401 (re-exported)
    SHARD_PREFIX, TOPK_SUFFIX, HeldoutOverlapError, check_overlap, check_prompt_sources, generate_continuations,
    load_or_make_heldout, load_prompt_sources, read_shards, write_topk)
from specdec.train.lm import add_train_args, autocast, lr_factor, make_optimizer, pick_device
from specdec.train.log import TrainLog

FORMATS = ("bf16", "fp8", "int4")


@dataclasses.dataclass
class DrafterRun:
    target: str
    base: str
    sources: list[str]
    out: str
    heldout: str | None = None  # held-out set (with continuations) or prompts; default: the bundled prompts
    n_prompts: int = 2000  # per corpus source (a JSON-lines source gives all its prompts)
    min_prompt: int = 32
    max_prompt: int = 384
    max_new_tokens: int = 128
    gen_batch_size: int = 256
    heldout_max_tokens: int = 128
    heldout_limit: int | None = None
    qat_steps: int = 0
    group_size: int = 32
    k: int = 16
    eval_every: int = 100
    checkpoint_every: int = 100
    formats: tuple[str, ...] = FORMATS
    verify: bool = True
    drop_overlap: bool = False  # leave out training prompts that overlap the held-out set instead of refusing
    engine_dtype: str | None = None
    topk_kl: int = 0  # cache the target's top-K log-probs and use them (not the live target) for the KL term
    train: DistillConfig = dataclasses.field(default_factory=lambda: DistillConfig(kl_weight=0.0, corpus_fraction=0.0))

    def identity(self) -> dict[str, Any]:
        """What a resumed run must share with the first one."""
        return {"target": str(Path(self.target).resolve()), "base": str(Path(self.base).resolve()),
                "sources": [str(Path(s).resolve()) for s in self.sources], "n_prompts": self.n_prompts,
                "min_prompt": self.min_prompt, "max_prompt": self.max_prompt, "max_new_tokens": self.max_new_tokens,
                "seed": self.train.seed, "seq_len": self.train.seq_len, "kl_weight": self.train.kl_weight,
                **({"topk_kl": self.topk_kl} if self.topk_kl else {})}


# ---------------------------------------------------------------------------------------------- measuring


def heldout_tau(model, heldout: Sequence[dict], k: int, batch_size: int = 32) -> float:
    """Greedy tau of ``model`` (a transformers causal LM) on the held-out conversations at draft length k."""
    was_training = model.training
    model.eval()
    matches = draft_matches(model, [c["prompt"] for c in heldout], [c["continuation"] for c in heldout], batch_size)
    model.train(was_training)
    return round(acceptance_tau(matches, k), 4)


def load_as_transformers(model_dir: Path | str, device: str | torch.device = "cpu"):
    """A transformers causal LM with the weights specdec loads from ``model_dir`` (dequantized exports too)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdec.models.loader import read_state_dict

    config = AutoConfig.from_pretrained(str(model_dir))
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = read_state_dict(Path(model_dir), torch.device("cpu"), torch.float32)
    model.load_state_dict(state, strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.to(device).eval()


@torch.no_grad()
def greedy_agreement(model_a, model_b, conversations: Sequence[dict], batch_size: int = 32) -> float:
    """Share of held-out positions (prompt + continuation, teacher forced) where both models' greedy next
    token is the same."""
    same = total = 0
    device = next(model_a.parameters()).device
    for first in range(0, len(conversations), batch_size):
        seqs = [c["prompt"] + c["continuation"] for c in conversations[first:first + batch_size]]
        width = max(len(s) for s in seqs)
        ids = torch.zeros((len(seqs), width), dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.bool)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)
            mask[i, :len(s)] = True
        ids = ids.to(device)
        with autocast(device):
            a = model_a(input_ids=ids).logits.argmax(-1).cpu()
            b = model_b(input_ids=ids).logits.argmax(-1).cpu()
        same += int(((a == b) & mask).sum())
        total += int(mask.sum())
    return round(same / max(total, 1), 4)


def verify_export(model_dir: Path, heldout: Sequence[dict], k: int, vocab_size: int) -> dict:
    """Serve ``model_dir`` on loopback (sha256 checked) and walk the held-out set with the verifier."""
    from specdec.drafting.server import ThreadedServer, create_app, load_drafter
    from specdec.drafting.verify import tau_record, walk_conversations

    drafter = load_drafter(str(model_dir), device="cpu" if not torch.cuda.is_available() else None,
                           kv_cache_tokens=max(4096, 2 * sum(len(c["prompt"]) + len(c["continuation"]) + k
                                                              for c in heldout[:32])))
    with ThreadedServer(create_app(drafter, name=str(model_dir))) as server:
        walked = walk_conversations(server.url, list(heldout), k, concurrency=min(32, len(heldout)),
                                    vocab_size=vocab_size)
    record = tau_record(walked, k)
    return {key: record[key] for key in ("tau", "tokens", "steps", "samples", "failures", "serving_time_s")}


# ---------------------------------------------------------------------------------------------- training


def export_drafter(model, out_dir: Path, fmt: str, tokenizer_dir: Path, group_size: int,
                   extra_eos_ids: Sequence[int]) -> dict:
    """Write one export (bf16 / fp8 / int4) with its ``weights.sha256.json``; returns {dir, files: sha256}."""
    from specdec.models.provenance import write_weights_sha256
    from specdec.models.quant import without_qat
    from specdec.train.lm import save_checkpoint

    if fmt == "bf16":
        save_checkpoint(without_qat(model), out_dir, tokenizer_dir, "100GB", extra_eos_ids=extra_eos_ids)
    else:
        export_quantized(model, out_dir, fmt, tokenizer_dir, group_size, extra_eos_ids)
    return {"dir": str(out_dir), "sha256": write_weights_sha256(out_dir)}


def export_quantized(model: torch.nn.Module, out_dir: Path | str, fmt: str, tokenizer_dir: Path | str | None,
                     group_size: int, extra_eos_ids: Iterable[int] = ()) -> Path:
    """Save ``model`` (a transformers causal LM, QAT or not) as a quantized Hugging Face directory."""
    from safetensors.torch import save_file

    from specdec.models.quant import QUANT_METHOD, quantize_state, without_qat
    from specdec.train.lm import save_checkpoint

    plain = without_qat(model).float()
    out = save_checkpoint(plain, out_dir, tokenizer_dir, max_shard_size="100GB", extra_eos_ids=extra_eos_ids)
    state = dict(plain.state_dict())
    if plain.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tensors, names = quantize_state(state, fmt, group_size)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {"quant_method": QUANT_METHOD, "format": fmt, "group_size": group_size,
                                     "modules": sorted(names)}
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return out


def train(run: DrafterRun, records: list[dict], heldout: list[dict], log: TrainLog, rank: int = 0,
          world: int = 1) -> dict:
    """The training loop (resumable): bf16 phase, exports, QAT phase, int4 export. Returns a summary.

    Data parallel (``world`` > 1, process group initialised): every rank draws the same global batch and
    trains on rows ``rank::world`` of it, the losses normalised by the global batch's token counts, so the
    averaged gradients equal the global batch's; only rank 0 evaluates, exports and saves."""
    from specdec.models.quant import enable_qat, qat_enabled
    from specdec.train.distill import _eos_ids, load_model

    cfg = run.train
    out = Path(run.out)
    device = pick_device(cfg.device)
    draft = load_model(run.base, device, dtype=torch.float32)
    target = load_model(run.target, device) if cfg.kl_weight and not run.topk_kl else None
    if target is not None:
        target.requires_grad_(False)
        if target.config.vocab_size != draft.config.vocab_size:
            raise ValueError(f"base vocab {draft.config.vocab_size} != target vocab {target.config.vocab_size}")
    eos = _eos_ids(draft)
    pad_id = draft.config.pad_token_id if draft.config.pad_token_id is not None else (eos or [0])[0]
    pairs = [(np.asarray(r["prompt"], np.int64), np.asarray(r["continuation"], np.int64),
              *((r["top_ids"].astype(np.int64), r["top_logprobs"].astype(np.float32)) if run.topk_kl else ()))
             for r in records if r["continuation"]]
    batcher = PairBatcher(pairs, cfg.seq_len, cfg.batch_size, pad_id, seed=cfg.seed)
    ckpt = Checkpoint(out / "checkpoint")
    meta = ckpt.meta() if ckpt.exists() else {"step": 0, "tokens": 0, "qat": False, "history": [], "exports": {}}
    if meta["qat"]:
        enable_qat(draft, run.group_size)
    draft.train()
    opt = make_optimizer(draft, cfg.lr, cfg.weight_decay, cfg.beta2, device)
    if ckpt.exists():
        ckpt.restore(draft, opt)
        batcher.rng.bit_generator.state = meta["rng"]
        log("resume", step=meta["step"], tokens=meta["tokens"], qat=meta["qat"])
    step, tokens, history = meta["step"], meta["tokens"], meta["history"]
    exports = {fmt: e for fmt, e in meta["exports"].items() if Path(e["dir"]).is_dir()}
    total = cfg.max_steps + run.qat_steps
    warmup = min(cfg.warmup_steps, max(1, cfg.max_steps // 10))
    tok_dir = Path(run.target)

    def evaluate(kind: str) -> None:
        if rank == 0:
            tau = heldout_tau(draft, heldout, run.k, cfg.eval_batch_size)
            history.append(log("eval", kind=kind, step=step, tokens=tokens, qat=qat_enabled(draft), tau=tau))

    def export(fmts: Sequence[str]) -> None:
        for fmt in fmts:
            if rank == 0 and fmt in run.formats and fmt not in exports:
                exports[fmt] = export_drafter(draft, out / "export" / fmt, fmt, tok_dir, run.group_size, eos)
                exports[fmt]["step"] = step
                log("export", format=fmt, dir=exports[fmt]["dir"], sha256=exports[fmt]["sha256"])

    def save() -> None:
        if rank == 0:
            ckpt.save(draft, opt, {"step": step, "tokens": tokens, "qat": qat_enabled(draft), "history": history,
                                   "exports": exports, "rng": batcher.rng.bit_generator.state})

    if step == 0:
        evaluate("base")
    if step == cfg.max_steps and run.qat_steps and not qat_enabled(draft):  # no bf16 phase: QAT from the start
        export(["bf16", "fp8"])
        enable_qat(draft, run.group_size)
    forward = draft
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        forward = DistributedDataParallel(draft, device_ids=[torch.cuda.current_device()] if device.type == "cuda"
                                          else None)
    forward = torch.compile(forward) if cfg.compile else forward
    start, losses = time.monotonic(), []
    while step < total:
        in_qat = step >= cfg.max_steps
        lr = cfg.lr * (cfg.min_lr_ratio if in_qat else
                       lr_factor(step, step / max(cfg.max_steps, 1), warmup, cfg.min_lr_ratio))
        for group in opt.param_groups:
            group["lr"] = lr
        batch = batcher.next(device)
        norms = (batch[1].sum().clamp(min=1) / world, batch[2].sum().clamp(min=1) / world)
        batch = tuple(t[rank::world] for t in batch)  # this rank's share of the global batch
        with autocast(device):
            loss = distill_loss(forward, target, batch, cfg.kl_weight, norms)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(draft.parameters(), cfg.grad_clip)
        opt.step()
        step, tokens = step + 1, tokens + batcher.last_tokens
        losses.append(loss.item())
        if step % cfg.log_every == 0 or step == total:
            mean = sum(losses) / len(losses)
            if world > 1:  # each rank's share is scaled by the world size: their mean is the global batch's loss
                mean = torch.tensor(mean, device=device)
                torch.distributed.all_reduce(mean)
                mean = mean.item() / world
            log("train", step=step, tokens=tokens, lr=float(f"{lr:.4g}"), loss=round(mean, 4),
                qat=in_qat, seconds=round(time.monotonic() - start, 2))
            losses.clear()
        if step == cfg.max_steps:
            evaluate("bf16")
            export(["bf16", "fp8"])
            if run.qat_steps:
                enable_qat(draft, run.group_size)
        elif step % run.eval_every == 0 or step == total:
            evaluate("qat" if in_qat else "train")
        if step % run.checkpoint_every == 0 or step == total:
            save()
    if cfg.max_steps == 0 and step == 0:
        export(["bf16", "fp8"])
    if rank == 0 and "int4" in run.formats and exports.get("int4", {}).get("step") != step:
        exports.pop("int4", None)
        export(["int4"])  # after QAT (or, with --qat-steps 0, post-training quantization)
        exported = load_as_transformers(exports["int4"]["dir"], device)  # tau of what was written
        history.append(log("eval", kind="int4", step=step, tokens=tokens, qat=bool(run.qat_steps),
                           tau=heldout_tau(exported, heldout, run.k, cfg.eval_batch_size)))
        save()
    return {"steps": step, "tokens": tokens, "history": history, "exports": exports}


# ---------------------------------------------------------------------------------------------- provenance


def write_manifest(run: DrafterRun, source_rows: list[dict], heldout_info: dict, overlap: tuple[int, int],
                   records: list[dict], summary: dict | None) -> Path:
    """``OUT/DATA_MANIFEST.md``: what was trained on, what was held out, how each was obtained, exports."""
    n_tokens = sum(len(r["continuation"]) for r in records)
    lines = [
        "# DATA_MANIFEST: drafter training run", "",
        f"Written by `specdec train drafter` (specdec.train.drafter) on "
        f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}.", "",
        "## Models", "",
        f"- target: `{run.target}` (its greedy continuations are the training labels)",
        f"- base (the drafter's starting point): `{run.base}`: a general pre-trained model, not a drafter "
        "trained for this target", "",
        "## Prompt sources", "",
        "| source | kind | split | prompts | how obtained |", "|---|---|---|---|---|",
        *[f"| {r['source']} | {r['kind']} | {r['split']} | {r['prompts']} | {r['how']} |" for r in source_rows], "",
        "## Continuations (training labels)", "",
        f"The target's greedy continuations (temperature 0, at most {run.max_new_tokens} tokens, EOS kept) made by "
        f"the specdec engine (`LLM(target).generate`), {run.gen_batch_size} prompts a batch, cached in "
        f"`continuations/`: {len(records)} conversations, {n_tokens} continuation tokens"
        + (f"; with the target's top-{run.topk_kl} log-probs of each token (`shard-*{TOPK_SUFFIX}`)."
           if run.topk_kl else "."), "",
        "## Held-out set (measuring only, never trained on)", "",
        f"- source: `{heldout_info['source']}` (sha256 `{heldout_info['sha256']}`)",
        f"- {heldout_info['conversations']} conversations, {heldout_info['tokens']} continuation tokens; "
        f"{heldout_info['how']}",
        f"- overlap check: passed, none of the {overlap[0] - overlap[1]} training prompts trained on equals, is a "
        "prefix of, or extends a held-out prompt"
        + (f" ({overlap[1]} that did were left out: --drop-overlap)" if run.drop_overlap else
           " (the run refuses to start otherwise)"), "",
        "## Exported weights", "",
    ]
    exports = (summary or {}).get("exports", {})
    if exports:
        lines += ["| format | directory | file | sha256 |", "|---|---|---|---|"]
        lines += [f"| {fmt} | {e['dir']} | {name} | `{sha}` |" for fmt, e in exports.items()
                  for name, sha in e["sha256"].items()]
        lines += ["", "Each directory holds `weights.sha256.json`; `specdec draft serve` refuses weights that "
                      "do not match it."]
    else:
        lines.append("(none yet)")
    path = Path(run.out) / "DATA_MANIFEST.md"
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------------------------------------- the run


def init_distributed(device: str | None) -> tuple[int, int, bool]:
    """(rank, world size, whether this call made the process group): under ``torchrun`` (``WORLD_SIZE`` > 1)
    the default process group (NCCL on CUDA, one GPU per local rank; gloo on CPU), else (0, 1, False)."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and not dist.is_initialized():
        return 0, 1, False
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), False
    for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                        ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(name, value)
    cuda = pick_device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # rank 0 alone generates continuations and evaluates / exports while the others wait: a long timeout
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(hours=2))
    return dist.get_rank(), dist.get_world_size(), True


def run_pipeline(run: DrafterRun, quiet: bool = False) -> dict:
    """The whole pipeline; returns (and writes to ``OUT/result.json``) the summary (on data-parallel ranks
    other than 0: ``{}``)."""
    rank, world, made = init_distributed(run.train.device)
    try:
        if run.train.batch_size % world:
            raise ConfigError(f"--batch-size {run.train.batch_size} (the global batch) is not a multiple of the "
                              f"world size {world}: give a multiple of {world}")
        result = _run_pipeline(run, quiet, rank, world)
        if made:  # the ranks end together: one tearing its group down while rank 0 still exports aborted it
            torch.distributed.barrier()
        return result
    finally:
        if made:
            torch.distributed.destroy_process_group()


def _run_pipeline(run: DrafterRun, quiet: bool, rank: int, world: int) -> dict:
    from specdec.llm import LLM

    check_prompt_sources(run.sources)
    out = Path(run.out)
    out.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        check_run_identity(run)
    log = TrainLog(out / "train_log.jsonl" if rank == 0 else None, quiet or rank > 0)
    engine: list = []

    def llm_factory():
        if not engine:
            engine.append(LLM(run.target, device=run.train.device, dtype=run.engine_dtype))
        return engine[0]

    if rank > 0:
        torch.distributed.barrier()  # rank 0 makes the held-out set and the continuations; then read its cache
    heldout, heldout_info = load_or_make_heldout(run, llm_factory, log)
    prompts, source_rows = load_prompt_sources(run.sources, Path(run.target), run.n_prompts, run.min_prompt,
                                               run.max_prompt, run.train.seed)
    kept = check_overlap(prompts, heldout, run.drop_overlap)
    n_checked, n_dropped, prompts = len(prompts), len(prompts) - len(kept), kept
    log("overlap-check", training_prompts=n_checked, heldout=len(heldout), dropped=n_dropped)
    records = generate_continuations(llm_factory, prompts, out / "continuations", run.max_new_tokens,
                                     run.gen_batch_size, log, run.topk_kl)
    engine.clear()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if rank == 0 and world > 1:
        torch.distributed.barrier()
    overlap = (n_checked, n_dropped)
    if rank > 0:
        train(run, records, heldout, log, rank, world)
        return {}
    write_manifest(run, source_rows, heldout_info, overlap, records, None)
    summary = train(run, records, heldout, log, rank, world)
    write_manifest(run, source_rows, heldout_info, overlap, records, summary)
    taus = {row["kind"]: row["tau"] for row in summary["history"] if row["kind"] in ("base", "bf16", "int4")}
    result = {"k": run.k, "tau_base": taus.get("base"), "tau_bf16": taus.get("bf16"), "tau_int4": taus.get("int4"),
              "steps": summary["steps"], "tokens": summary["tokens"], "exports": summary["exports"],
              "curve": [{k: row[k] for k in ("step", "tokens", "qat", "tau", "kind")} for row in summary["history"]]}
    if run.verify:
        vocab = json.loads((Path(run.target) / "config.json").read_text())["vocab_size"]
        result["verified"] = {fmt: verify_export(Path(e["dir"]), heldout, run.k, vocab)
                              for fmt, e in summary["exports"].items()}
        log("verify", **{fmt: v["tau"] for fmt, v in result["verified"].items()})
        if "bf16" in summary["exports"]:
            ref = load_as_transformers(summary["exports"]["bf16"]["dir"])
            result["agreement_with_bf16"] = {
                fmt: greedy_agreement(ref, load_as_transformers(e["dir"]), heldout)
                for fmt, e in summary["exports"].items() if fmt != "bf16"}
            log("agreement", **result["agreement_with_bf16"])
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    from specdec.train.data import add_data_arguments
    from specdec.train.lm import train_config_from_args

    parser = argparse.ArgumentParser(prog="specdec train drafter", description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True, help="target model directory (with tokenizer files)")
    parser.add_argument("--base", required=True, help="general pre-trained model of the drafter's size to start from")
    add_data_arguments(parser, 2000, "prompts per corpus source")
    parser.add_argument("--kl-weight", type=float, default=0.0, help="weight of KL to the target (0: CE only)")
    parser.add_argument("--topk-kl", type=int, default=0, metavar="K",
                        help="cache the target's top-K log-probs (K <= 20) with the continuations and take the KL "
                             "over them (weight --kl-weight) instead of from the live target")
    parser.add_argument("--qat-steps", type=int, default=0, help="4-bit QAT steps after --max-steps")
    parser.add_argument("--group-size", type=int, default=32, help="4-bit group size")
    parser.add_argument("--k", type=int, default=16, help="draft length for tau")
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    parser.add_argument("--no-verify", action="store_true", help="skip serving and verifying the exports")
    parser.add_argument("--drop-overlap", action="store_true",
                        help="leave out training prompts that overlap the held-out set (default: refuse to run)")
    parser.add_argument("--engine-dtype", default=None, help="dtype of the engine generating continuations")
    add_train_args(parser, DistillConfig(batch_size=64, lr=1e-3, seq_len=512))
    args = parser.parse_args(argv)
    if args.max_steps is None or args.max_minutes is not None:
        parser.error("give --max-steps (steps of the bf16 phase; --max-minutes is not supported here)")
    if not 0 <= args.topk_kl <= 20:
        parser.error("--topk-kl K: 1 <= K <= 20 (the engine's log-probs limit), or 0 for none")
    cfg = train_config_from_args(args, DistillConfig, kl_weight=args.kl_weight, corpus_fraction=0.0)
    args.target, args.base = (model_dir_arg(parser, flag, value) for flag, value in
                              (("--target", args.target), ("--base", args.base)))
    run = DrafterRun(args.target, args.base, args.prompts, args.out, args.heldout, args.n_prompts, args.min_prompt,
                     args.max_prompt, args.max_new_tokens, args.gen_batch_size, args.max_new_tokens,
                     args.heldout_limit, args.qat_steps, args.group_size, args.k, args.eval_every,
                     args.checkpoint_every, tuple(args.formats), not args.no_verify, args.drop_overlap,
                     args.engine_dtype, args.topk_kl, cfg)
    result = run_pipeline(run)
    if result:
        print(json.dumps({k: result[k] for k in ("k", "tau_base", "tau_bf16", "tau_int4", "steps", "tokens")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
