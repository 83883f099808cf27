"""Accept or reject each sequence's drafts and draw its next token, losslessly.

A sequence with k drafts has k+1 logits rows; it emits its accepted drafts plus one token drawn from
the target (recovered after a rejection, or the bonus after full acceptance).  With no drafts this is
plain sampling.  Greedy rows take the longest prefix of drafts equal to the argmax, then the argmax.
A sequence whose drafts form a tree (request.draft_parents) is walked by specdec/verify_tree.py instead: its
rows are the root's and each node's, and its verdict says which rows the emitted tokens came from.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.engine.scheduler import ScheduledSeq
from specdec.sampling import processed_probs_rows
from specdec.transfer import upload
from specdec.verify import accept
from specdec.verify_tree import Verdict, accept_tree


def greedy_accept(drafts: list[int], best: list[int]) -> list[int]:
    """drafts [k], best [k+1] (the target's argmax after the last token and after each draft)
    -> accepted drafts + the argmax after them."""
    n = 0
    while n < len(drafts) and drafts[n] == best[n]:
        n += 1
    return drafts[:n] + [best[n]]


def sample_tokens(seqs: list[ScheduledSeq], logits: list[torch.Tensor]) -> list[Verdict]:
    """For each sequence, the tokens it emits this step (accepted drafts + one; none for a sequence that does
    not sample) and the logits row that predicted each."""
    trees = [i for i, s in enumerate(seqs) if s.samples and s.tree_parents is not None]
    verdicts = dict(zip(trees, _verify_trees([seqs[i] for i in trees], [logits[i] for i in trees])))
    chains = _sample_chains([s if i not in verdicts else None for i, s in enumerate(seqs)], logits)
    return [verdicts.get(i) or Verdict(tokens, list(range(len(tokens)))) for i, tokens in enumerate(chains)]


def _verify_trees(seqs: list[ScheduledSeq], logits: list[torch.Tensor]) -> list[Verdict]:
    if not seqs:
        return []
    probs = processed_probs_rows(torch.cat(logits), [s.request.params for s, rows in zip(seqs, logits)
                                                     for _ in range(rows.shape[0])])  # [sum(N_b + 1), V]
    return accept_tree([s.request.draft_token_ids[:s.num_drafts] for s in seqs], [s.tree_parents for s in seqs], probs,
                       [s.request.generator for s in seqs], [s.request.draft_probs for s in seqs])


def _sample_chains(seqs: list[ScheduledSeq | None], logits: list[torch.Tensor]) -> list[list[int]]:
    """Tokens of the sequences whose drafts are a chain (None entries: left out, no tokens)."""
    out: list[list[int]] = [[] for _ in seqs]
    greedy = [i for i, s in enumerate(seqs) if s is not None and s.samples and s.request.params.greedy]
    stochastic = [i for i, s in enumerate(seqs) if s is not None and s.samples and not s.request.params.greedy]
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
    """Rejection sampling for every sampled sequence at once: a few batched kernels and one host copy,
    whatever the batch size (per-row work is only each seeded row's draw from its generator)."""
    k = max(s.num_drafts for s in seqs)
    vocab = logits[0].shape[-1]
    device = logits[0].device
    counts = [1 + s.num_drafts for s in seqs]
    # Worked example: drafts (2, 0, 1) -> counts (3, 1, 2), k = 2; the 6 logits rows land at
    # (batch, position) (0,0) (0,1) (0,2) (1,0) (2,0) (2,1) of target [3, 3, V]; the rest stays 0.
    probs = processed_probs_rows(torch.cat(logits), [s.request.params for s, n in zip(seqs, counts)
                                                     for _ in range(n)])  # [sum(counts), V]
    target = probs.new_zeros(len(seqs), k + 1, vocab)
    target[_row_index(counts, device)] = probs  # [B, k+1, V]
    draft_ids = torch.tensor([s.request.draft_token_ids[:s.num_drafts] + [-1] * (k - s.num_drafts)
                              for s in seqs], dtype=torch.long)  # [B, k] on the host: accept reads counts free
    draft_probs = None
    drafted = [s for s in seqs if s.num_drafts]
    if any(s.request.draft_probs is not None for s in drafted):
        draft_probs = probs.new_zeros(len(seqs), k, vocab)
        rows = torch.cat([_draft_probs(s, s.num_drafts, vocab, device) for s in drafted])  # [sum(drafts), V]
        draft_probs[_row_index([s.num_drafts for s in seqs], device)] = rows
    tokens = accept(draft_ids, draft_probs, target, [s.request.generator for s in seqs])  # [B, k+1]
    return [[t for t in row if t >= 0] for row in tokens.tolist()]


def _row_index(counts: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch index, position index) of each of sum(counts) stacked rows, row b having counts[b] rows."""
    batch = [b for b, n in enumerate(counts) for _ in range(n)]
    position = [j for n in counts for j in range(n)]
    return upload(batch, device), upload(position, device)


def _draft_probs(seq: ScheduledSeq, n: int, vocab: int, device) -> torch.Tensor:
    """[n, V] the drafter's distributions, one-hot for a deterministic drafter."""
    req = seq.request
    if req.draft_probs is None:
        return F.one_hot(upload(req.draft_token_ids[:n], device), vocab).float()
    return req.draft_probs[:n].to(device=device, dtype=torch.float32)
