"""``specdec train head --kind mtp``: what differs from the EAGLE-3 head when the model trained is a Qwen3.5
target's own multi-token-prediction head (models/mtp.py).  The pipeline, the loss and the measuring are
train/head.py's; this gives the model and its export.

- The target must be a Qwen3.5 model.  The head starts from the target's mtp.* weights when it has them
  (fine-tuning), else from random ones; only mtp.* trains: the embedding and LM head are the target's, frozen.
- Its feature is the target's final-normed hidden state (layer id num_hidden_layers), and it drafts over the
  target's whole vocabulary (no d2t / t2d).
- The export is a copy of the target's directory with the trained mtp.* weights in place of any it had
  (models/mtp.save_with_mtp_head): ``--speculator mtp`` with that directory as the target drafts with them.
  bf16 only: an FP8 head's quantization_config would sit in the target's config.json and describe the target.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.errors import ConfigError
from specdec.models.config import ModelConfig
from specdec.models.mtp import PREFIX, MTPConfig, MTPHead, random_mtp_state, read_mtp_head, save_with_mtp_head
from specdec.train.head_unroll import MTPUnroll

FORMATS = ("bf16",)


def check_target(target_dir: str | Path) -> ModelConfig:
    """The target's config; refused unless it is a Qwen3.5 model (the only one with an MTP head specdec runs)."""
    config = ModelConfig.from_dir(target_dir)
    if config.architecture != "qwen3_5":
        raise ConfigError(f"--kind mtp trains Qwen3.5's own multi-token-prediction head; {target_dir} is a "
                          f"{config.architecture} model: train an EAGLE-3 head for it instead (--kind eagle3)")
    return config


def check_formats(formats: tuple[str, ...]) -> None:
    if set(formats) - set(FORMATS):
        raise ConfigError(f"--kind mtp exports {', '.join(FORMATS)} only, not {sorted(set(formats) - set(FORMATS))}: "
                          "the head lives in the target's directory, whose config.json would then declare an FP8 "
                          "quantization for the target's own weights too")


def mtp_model(target_dir: str, signals, seed: int, device: torch.device) -> tuple[MTPHead, MTPUnroll, str]:
    """(the head to train, float32 on device, its unrolling, where it started: "target" or "random")."""
    config = check_target(target_dir)
    head = read_mtp_head(target_dir, config, device, torch.float32)
    start = "target"
    if head is None:
        head, start = MTPHead(MTPConfig.for_target(config)), "random"
        head.load_state_dict({k[len(PREFIX):]: v for k, v in random_mtp_state(config, seed, std=0.02).items()})
    head = head.to(device=device, dtype=torch.float32).requires_grad_(True)
    return head, MTPUnroll(head, signals.model.get_output_embeddings()), start


def export_mtp(head: MTPHead, target_dir: str, out_dir: Path, fmt: str) -> dict:
    """The target's directory with the trained head in it (bf16), and its weights.sha256.json."""
    from specdec.models.provenance import write_weights_sha256

    check_formats((fmt,))
    save_with_mtp_head(head, target_dir, out_dir, torch.bfloat16)
    return {"dir": str(out_dir), "sha256": write_weights_sha256(out_dir)}
