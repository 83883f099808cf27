"""Accept or reject each sequence's drafts and draw its next token, losslessly.

A sequence with k drafts has k+1 logits rows; it emits its accepted drafts plus one token drawn from
the target (recovered after a rejection, or the bonus after full acceptance).  With no drafts this is
plain sampling.  Greedy rows take the longest prefix of drafts equal to the argmax, then the argmax.
A sequence whose drafts form a tree (request.draft_parents) is walked by specdec/verify_tree.py instead: its
rows are the root's and each node's, and its verdict says which rows the emitted tokens came from.

After a step on the static runner, acceptance runs on that step's fixed shape instead (the same maths, one
graph replay on a GPU: engine/fixed_acceptance.py) when every sequence is eligible: a chain of drafts or none,
q rows in one draft vocabulary.  A step with a draft tree, or one that ran eagerly, takes the path below.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdec.engine.fixed_acceptance import Launched, eligible
from specdec.engine.scheduler import ScheduledSeq
from specdec.sampling import processed_probs_rows
from specdec.verify import DraftQ, accept_ragged, in_target_vocab
from specdec.verify_tree import Verdict, accept_tree


def greedy_accept(drafts: list[int], best: list[int]) -> list[int]:
    """drafts [k], best [k+1] (the target's argmax after the last token and after each draft)
    -> accepted drafts + the argmax after them."""
    n = 0
    while n < len(drafts) and drafts[n] == best[n]:
        n += 1
    return drafts[:n] + [best[n]]


def sample_tokens(seqs: list[ScheduledSeq], logits: list[torch.Tensor], static=None,
                  on_launch: Callable[[Launched], object] | None = None) -> list[Verdict]:
    """For each sequence, the tokens it emits this step (accepted drafts + one; none for a sequence that does
    not sample) and the logits row that predicted each.  static: the StaticRunner when the step ran on it (its
    fixed-shape acceptance is used if the sequences are eligible), else None.  on_launch: called with the
    fixed-shape acceptance once it is queued, before the host waits for its result (work for the device to
    run meanwhile: a head's observe, speculate/head_ahead.py observe_ahead); not called on the other paths."""
    if static is not None and eligible(seqs):
        launched = static.launch_accept(seqs)
        if on_launch is not None:
            on_launch(launched)
        return chain_verdicts(static.acceptance.read(launched))
    trees = [i for i, s in enumerate(seqs) if s.samples and s.tree_parents is not None]
    verdicts = dict(zip(trees, _verify_trees([seqs[i] for i in trees], [logits[i] for i in trees])))
    chains = _sample_chains([s if i not in verdicts else None for i, s in enumerate(seqs)], logits)
    return [verdicts.get(i) or chain for i, chain in enumerate(chain_verdicts(chains))]


def chain_verdicts(emitted: list[list[int]]) -> list[Verdict]:
    """Verdicts of chains from each sequence's emitted tokens: token j came from the sequence's logits row j."""
    return [Verdict(tokens, list(range(len(tokens)))) for tokens in emitted]


def _verify_trees(seqs: list[ScheduledSeq], logits: list[torch.Tensor]) -> list[Verdict]:
    if not seqs:
        return []
    probs = processed_probs_rows(torch.cat(logits), [s.request.params for s, rows in zip(seqs, logits)
                                                     for _ in range(rows.shape[0])])  # [sum(N_b + 1), V]
    return accept_tree([s.request.draft_token_ids[:s.num_drafts] for s in seqs], [s.tree_parents for s in seqs], probs,
                       [s.request.generator for s in seqs], [s.request.draft_probs for s in seqs],
                       [s.request.draft_vocab for s in seqs])


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
    """Rejection sampling for every sampled sequence at once, on the ragged layout (nothing padded to the longest
    chain): a few batched kernels and one host copy, whatever the batch size (per-row work is only each seeded
    row's draw from its generator)."""
    counts = [s.num_drafts for s in seqs]
    probs = processed_probs_rows(torch.cat(logits), [s.request.params for s, n in zip(seqs, counts)
                                                     for _ in range(1 + n)])  # [sum(1 + counts), V]
    drafts = [s.request.draft_token_ids[:n] for s, n in zip(seqs, counts)]
    draft_ids = torch.tensor([t for d in drafts for t in d], dtype=torch.long)  # [sum(counts)] on the host
    verdict = accept_ragged(probs, draft_ids, counts, _draft_q(seqs, probs.shape[-1], probs.device),
                            [s.request.generator for s in seqs])
    n_accepted, token = torch.stack(verdict).tolist()  # [2, B]: the one host copy
    return [d[:a] + [t] for d, a, t in zip(drafts, n_accepted, token)]


def _draft_q(seqs: list[ScheduledSeq], vocab: int, device) -> DraftQ | None:
    """The drafters' q of the sequences' drafts: the rows of each sequence that has them, stacked in turn (one
    copy, kept in the draft vocabulary when all share one), or None when none has.  A deterministic drafter's
    one-hot q is not built: its drafts' rows are -1."""
    sampled = [s.num_drafts > 0 and s.request.draft_probs is not None for s in seqs]
    if not any(sampled):
        return None
    vocabs = {id(s.request.draft_vocab) for s, on in zip(seqs, sampled) if on}
    shared = len(vocabs) == 1  # one drafter: its q rows share their columns
    rows, index, at = [], [], 0
    for seq, on in zip(seqs, sampled):
        n, req = seq.num_drafts, seq.request
        if not on:
            index += [-1] * n
            continue
        q = req.draft_probs[:n]  # [n, V_draft or V]
        rows.append(q if shared else in_target_vocab(q, vocab, req.draft_vocab))
        index += range(at, at + n)
        at += n
    draft_vocab = next(s.request.draft_vocab for s, on in zip(seqs, sampled) if on) if shared else None
    return DraftQ(torch.cat(rows).to(device), torch.tensor(index, dtype=torch.long), draft_vocab)
