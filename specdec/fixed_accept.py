"""Acceptance on fixed shapes: verify.accept_ragged's rejection sampling and the sampler's greedy acceptance for a
padded batch, with no host sync, no data-dependent shape and no branch on a tensor's value, so that one CUDA
graph per (B, q) shape replays it.

Layout: B sequences (padding ones included) of q logits rows each, as a fixed-shape verify step leaves them
([B, q, V], the static runner's buffer viewed).  Sequence b's rows first[b] .. first[b] + n_b score its n_b
drafts and give its bonus; drafts are padded to q - 1 per sequence (any ids past n_b).  Example: q = 4,
first = (0, 1), n = (3, 1): sequence 0 fed its newest token and 3 drafts, tests them on its rows 0..2 and draws
its bonus from row 3; sequence 1 fed 2 tokens and 1 draft, tests it on row 1 and draws its bonus from row 2
(row 3 pads it, as row 0 is a fed token that samples nothing).

The maths is verify.py's, through the same pieces (processed_probs_tensors, _passes, _last_distribution,
_exponential_race, _DeviceQ): the same uniforms give the same tokens.  The uniforms come in drawn, as
verify._draw_uniforms draws them for the batch's sampled sequences, so seeded requests keep their generators.
"""

from __future__ import annotations

import torch

from specdec.sampling import processed_probs_tensors
from specdec.verify import _assemble, _DeviceQ, _exponential_race, _last_distribution, _passes

__all__ = ["accept_fixed", "device_q", "fixed_q"]


def accept_fixed(logits: torch.Tensor, first: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor,
                 greedy: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 u_test: torch.Tensor, u_race: torch.Tensor, draft_q: _DeviceQ | None = None,
                 cuts: bool = True, any_sampled: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept or reject a padded batch's drafts.

    Args:
        logits: [B, q, V] the target's logits rows (raw: processed here).
        first: [B] long, the row of logits[b] that scores draft 0 (0 on a verify step).
        drafts: [B, q-1] long, sequence b's n_b drafts then padding.
        num_drafts: [B] long n_b <= q - 1 - first[b].
        greedy: [B] bool, sequences that take the argmax (their uniforms are not read).
        temperature, top_k, top_p: [B] each sequence's settings (processed_probs_tensors).
        u_test: [B, q-1] uniforms of the drafts' tests; u_race: [B, V] uniforms of the last token's race.
        draft_q: None (every draft deterministic) or the drafts' q with rows [B, q-1] (-1: one-hot, see fixed_q).
        cuts: False when no sequence has top-k or top-p (known on the host: the sort is skipped).
        any_sampled: False when every sequence is greedy (known on the host: nothing but the argmax runs).

    Returns:
        num_accepted [B] long a_b, and tokens [B, q] long: the accepted drafts, the recovered or bonus token at
        index a_b, then -1.
    """
    batch, q, vocab = logits.shape
    rows = _scoring_rows(first, q)  # [B, q] flat row of each draft's test and of the bonus
    flat = logits.reshape(batch * q, vocab)
    valid = torch.arange(q - 1, device=logits.device) < num_drafts.unsqueeze(1)  # [B, q-1] real drafts
    x = drafts.clamp(min=0)  # [B, q-1] (padding may be any id)
    a_greedy, t_greedy = _greedy(flat, rows, x, valid)
    if not any_sampled:
        return a_greedy, _assemble(drafts, a_greedy, t_greedy)
    per_row = [s.unsqueeze(1).expand(batch, q).reshape(-1) for s in (temperature, top_k, top_p)]  # [B q] each
    probs = processed_probs_tensors(flat, *per_row, cuts=cuts)  # [B q, V] float32
    a_sampled, t_sampled = _sampled(probs, rows, x, valid, num_drafts, u_test.float(), u_race.float(), draft_q)
    num_accepted = torch.where(greedy, a_greedy, a_sampled)  # [B]
    return num_accepted, _assemble(drafts, num_accepted, torch.where(greedy, t_greedy, t_sampled))


def fixed_q(probs: torch.Tensor, has_q: torch.Tensor, vocab_ids: torch.Tensor | None, vocab: int) -> _DeviceQ:
    """The drafts' q for accept_fixed from padded rows probs [B, q-1, V_q] and has_q [B, q-1] bool (False: the
    draft is deterministic, its q one-hot), vocab_ids [V_q] the target id of each column (None: V_q = V).  A view,
    no copy of probs; builds the column map (one scatter: outside a graph, or inside it as a fixed-shape op)."""
    batch, k, width = probs.shape
    index = torch.arange(batch * k, device=probs.device).view(batch, k)  # [B, q-1] draft (b, j) -> row b k + j
    rows = torch.where(has_q, index, -1)
    return device_q(probs.reshape(batch * k, width), rows, vocab_ids, vocab)


def device_q(probs: torch.Tensor, rows: torch.Tensor, vocab_ids: torch.Tensor | None, vocab: int) -> _DeviceQ:
    """A _DeviceQ over q rows probs [Q, V_q] for drafts whose rows [B, q-1] point into them (-1: one-hot).  It
    never assumes every draft has q (a host fact a graph would bake in)."""
    column = None
    if vocab_ids is not None:
        column = torch.full((vocab,), -1, dtype=torch.long, device=probs.device)
        column[vocab_ids] = torch.arange(len(vocab_ids), device=probs.device)
    return _DeviceQ(probs, rows, vocab_ids, column, all_sampled=False)


def _scoring_rows(first: torch.Tensor, q: int) -> torch.Tensor:
    """[B, q] flat logits row of each sequence's j-th scoring row, first[b] + j, clamped to its last row q - 1.

    Example: q = 3, first = (0, 1): rows (0, 1, 2) and (3 + 1, 3 + 2, 3 + 2)."""
    offsets = torch.arange(q, device=first.device)  # [q]
    within = (first.unsqueeze(1) + offsets).clamp(max=q - 1)  # [B, q]
    return within + q * torch.arange(first.shape[0], device=first.device).unsqueeze(1)


def _greedy(flat: torch.Tensor, rows: torch.Tensor, x: torch.Tensor, valid: torch.Tensor):
    """(a [B], token [B]) of greedy acceptance (sampler.greedy_accept): the longest prefix of drafts equal to the
    argmax, then the argmax after it."""
    best = flat.argmax(-1)[rows]  # [B, q]
    a = ((x == best[:, :-1]) & valid).long().cumprod(1).sum(1)  # [B] leading matches
    return a, best.gather(1, a.unsqueeze(1)).squeeze(1)


def _sampled(probs, rows, x, valid, n, u_test, u_race, q: _DeviceQ | None):
    """(a [B], token [B]) of rejection sampling (verify.accept_ragged's maths on the padded layout).

    Example: n = (2, 3), passes = ((1, 1, ·), (1, 0, 1)) -> leading passes among real drafts a = (2, 1); row 0
    draws its bonus from its row 2, row 1 its recovered token from the residual at its row 1 (draft 1's q)."""
    batch, k = x.shape
    p_x = probs[rows[:, :-1], x]  # [B, q-1] p_j(x_j)
    q_x = torch.ones_like(p_x) if q is None else q.at_drafts(x, p_x.dtype)  # [B, q-1] q_j(x_j)
    a = (_passes(p_x, q_x, u_test) & valid).long().cumprod(1).sum(1)  # [B]
    p_a = probs[rows.gather(1, a.unsqueeze(1)).squeeze(1)]  # [B, V] the target row at position a_b
    if k == 0:  # plain decoding: every row draws from p
        return a, _exponential_race(p_a, u_race)
    at = a.clamp(max=k - 1).unsqueeze(1)  # [B, 1] the rejected draft (rows that rejected none: value unused)
    q_row = None if q is None else q.rows.gather(1, at).squeeze(1)
    dist = _last_distribution(p_a, x.gather(1, at).squeeze(1), q, q_row, a < n)  # [B, V]
    return a, _exponential_race(dist, u_race)
