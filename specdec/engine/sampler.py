"""Accept or reject each sequence's drafts and draw its next token, losslessly.

A sequence with k drafts has k+1 logits rows; it emits its accepted drafts plus one token drawn from
the target (recovered after a rejection, or the bonus after full acceptance).  With no drafts this is
plain sampling.  Greedy rows take the longest prefix of drafts equal to the argmax, then the argmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.engine.scheduler import ScheduledSeq
from specdec.sampling import processed_probs
from specdec.verify import accept


def greedy_accept(drafts: list[int], best: list[int]) -> list[int]:
    """drafts [k], best [k+1] (the target's argmax after the last token and after each draft)
    -> accepted drafts + the argmax after them."""
    n = 0
    while n < len(drafts) and drafts[n] == best[n]:
        n += 1
    return drafts[:n] + [best[n]]


def sample_tokens(seqs: list[ScheduledSeq], logits: list[torch.Tensor]) -> list[list[int]]:
    """For each sequence that samples, the tokens it emits this step (accepted drafts + one)."""
    out: list[list[int]] = [[] for _ in seqs]
    greedy = [i for i, s in enumerate(seqs) if s.samples and s.request.params.greedy]
    stochastic = [i for i, s in enumerate(seqs) if s.samples and not s.request.params.greedy]
    if greedy:  # one argmax and one device->host copy for the whole batch
        best = torch.cat([logits[i] for i in greedy]).argmax(-1).tolist()
        offset = 0
        for i in greedy:
            seq = seqs[i]
            rows = 1 + seq.num_drafts
            out[i] = greedy_accept(seq.request.draft_token_ids[:seq.num_drafts], best[offset:offset + rows])
            offset += rows
    if stochastic:
        for i, tokens in zip(stochastic, _verify_stochastic([seqs[i] for i in stochastic],
                                                            [logits[i] for i in stochastic])):
            out[i] = tokens
    return out


def _verify_stochastic(seqs: list[ScheduledSeq], logits: list[torch.Tensor]) -> list[list[int]]:
    k = max(s.num_drafts for s in seqs)
    vocab = logits[0].shape[-1]
    device = logits[0].device
    target = torch.stack([_pad_rows(processed_probs(rows, s.request.params), k + 1)
                          for s, rows in zip(seqs, logits)])  # [B, k+1, V]
    draft_ids = torch.full((len(seqs), k), -1, dtype=torch.long, device=device)
    draft_probs = None
    if any(s.num_drafts and s.request.draft_probs is not None for s in seqs):
        draft_probs = torch.zeros(len(seqs), k, vocab, device=device)
    for b, s in enumerate(seqs):
        n = s.num_drafts
        if n:
            draft_ids[b, :n] = torch.tensor(s.request.draft_token_ids[:n], device=device)
            if draft_probs is not None:
                draft_probs[b, :n] = _draft_probs(s, n, vocab, device)
    tokens = accept(draft_ids, draft_probs, target, [s.request.generator for s in seqs])  # [B, k+1]
    return [[t for t in row if t >= 0] for row in tokens.tolist()]


def _pad_rows(probs: torch.Tensor, rows: int) -> torch.Tensor:
    return F.pad(probs, (0, 0, 0, rows - probs.shape[0]))


def _draft_probs(seq: ScheduledSeq, n: int, vocab: int, device) -> torch.Tensor:
    """[n, V] the drafter's distributions, one-hot for a deterministic drafter."""
    req = seq.request
    if req.draft_probs is None:
        return F.one_hot(torch.tensor(req.draft_token_ids[:n], device=device), vocab).float()
    return req.draft_probs[:n].to(device=device, dtype=torch.float32)
