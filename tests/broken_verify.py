"""A broken verifier for the distribution tests' negative controls: it keeps every draft, then draws the bonus
from the target row after the last one (patched over specdec.engine.sampler.accept_ragged)."""

from __future__ import annotations

import torch

from specdec.verify import Accepted


def accept_everything(target_probs, draft_ids, num_drafts, draft_q=None, generators=None) -> Accepted:
    counts = [int(n) for n in num_drafts]
    last = (torch.tensor(counts) + 1).cumsum(0) - 1  # [B] each row's target row after its last draft
    generators = generators or [None] * len(counts)
    token = [torch.multinomial(target_probs[r], 1, generator=g) for r, g in zip(last.tolist(), generators)]
    return Accepted(torch.tensor(counts), torch.cat(token))
