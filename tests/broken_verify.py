"""A broken verifier for the distribution tests' negative controls: it keeps every draft, then draws the bonus
from the target row after the last one (patched over specdec.engine.sampler.accept_ragged; on fixed-shape steps
over specdec.fixed_accept.accept_fixed)."""

from __future__ import annotations

import torch

from specdec.verify import Accepted


def accept_everything(target_probs, draft_ids, num_drafts, draft_q=None, generators=None) -> Accepted:
    counts = [int(n) for n in num_drafts]
    last = (torch.tensor(counts) + 1).cumsum(0) - 1  # [B] each row's target row after its last draft
    generators = generators or [None] * len(counts)
    token = [torch.multinomial(target_probs[r], 1, generator=g) for r, g in zip(last.tolist(), generators)]
    return Accepted(torch.tensor(counts), torch.cat(token))


def accept_everything_fixed(logits, first, drafts, num_drafts, greedy, temperature, top_k, top_p, u_test, u_race,
                            draft_q=None, cuts=True, any_sampled=True):
    """accept_everything on the fixed shape (patched over specdec.fixed_accept.accept_fixed): every draft kept,
    the bonus raced from the processed target row after the last one."""
    from specdec.fixed_accept import _scoring_rows
    from specdec.sampling import processed_probs_tensors
    from specdec.verify import _assemble, _exponential_race

    batch, q, vocab = logits.shape
    last = _scoring_rows(first, q).gather(1, num_drafts.unsqueeze(1)).squeeze(1)  # [B] the row after the last draft
    probs = processed_probs_tensors(logits.reshape(-1, vocab)[last], temperature, top_k, top_p)  # [B, V]
    return num_drafts, _assemble(drafts, num_drafts, _exponential_race(probs, u_race))
