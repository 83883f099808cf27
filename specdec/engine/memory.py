"""What the largest step needs for its activations, measured by running it once: the KV cache's budget
(kv_cache.kv_budget_bytes) is the free memory after the weights less this and a reserve for CUDA graphs."""

from __future__ import annotations

import torch

from specdec.engine.kv_cache import KVCache
from specdec.engine.request import Request
from specdec.engine.runner import ModelRunner
from specdec.engine.scheduler import ScheduledSeq
from specdec.models.transformer import CausalLM
from specdec.sampling import SamplingParams

MAX_LOGITS_ROWS_PER_SEQ = 33  # a verify step of 32 drafts


@torch.inference_mode()
def profile_step_bytes(model: CausalLM, max_tokens: int, max_seqs: int, block_size: int,
                       device: torch.device) -> int:
    """Peak activation bytes of the largest step: one prefill of max_tokens tokens, run for real on a
    throw-away cache (0 on a CPU, where nothing is measured), plus the float32 logits of the most rows a
    step can ask for (max_seqs sequences verifying 32 drafts, or max_tokens, whichever is fewer)."""
    dtype = model.lm_head.weight.dtype
    num_blocks = -(-max_tokens // block_size)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    cache = KVCache(model.config, num_blocks, block_size, device, dtype)
    req = Request([0] * max_tokens, SamplingParams(max_tokens=1), device)
    req.block_ids = list(range(num_blocks))
    states = None
    if model.config.is_hybrid:  # one throw-away recurrent-state slot (engine/state_slots.py)
        from specdec.engine.state_slots import StateSlots

        states = StateSlots(model.config, 1, device, dtype)
    ModelRunner(model, cache, device, states=states).forward([ScheduledSeq(req, max_tokens, 0, samples=True)])
    measured = 0
    if cuda:
        torch.cuda.synchronize(device)
        cache_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in cache.layers)
        measured = max(0, torch.cuda.max_memory_allocated(device) - before - cache_bytes)
    del cache
    if cuda:
        torch.cuda.empty_cache()
    rows = min(max_seqs * MAX_LOGITS_ROWS_PER_SEQ, max_tokens)
    return measured + 3 * rows * model.config.vocab_size * 4  # logits, probabilities, sampling scratch
