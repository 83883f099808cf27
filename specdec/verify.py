"""Lossless verification of drafted tokens by rejection sampling.

Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): a cheap
drafter proposes tokens x_0 .. x_{n-1} with distributions q_0 .. q_{n-1}; the
target model scores them in one pass, giving p_0 .. p_n, where p_j is the
target's distribution for the token that follows draft j-1.  For each batch
row with n drafts, acceptance emits tokens in three roles:

* accepted tokens: the longest prefix x_0 .. x_{a-1} of the drafts in which
  each x_j passes its test, i.e. is kept with probability
  min(1, p_j(x_j) / q_j(x_j)).  0 <= a <= n.
* recovered token: if a < n, draft x_a was rejected; one token is drawn from
  the residual normalize(max(p_a - q_a, 0)) in its place and the row stops.
* bonus token: if a == n (every draft accepted), one extra token is drawn
  from p_n, the target's distribution after the row's last draft.

Either way a row emits a + 1 tokens, and the final one is always drawn from a
distribution at target position a.  The emitted sequence has exactly the
distribution of sampling token by token from p (lossless).

Layout: ``accept_ragged`` takes the batch as it comes out of the verify
forward, ragged: row b's n_b + 1 target rows stacked after the rows before it
([T, V], T = sum(n_b + 1)), its drafts likewise ([D], D = sum(n_b)), nothing
padded.  ``accept`` is the padded form ([B, K+1, V], -1 padding) on top of it.

The drafter's q (``DraftQ``) comes in one of three forms, per draft:

* absent (a deterministic drafter: n-gram, remote): q_j is one-hot on x_j,
  never materialised, so x_j is kept with probability p_j(x_j) and the
  residual is p_j with x_j zeroed out;
* a row over the target vocabulary [V];
* a row over a reduced draft vocabulary [V_draft] with the target id of each
  column (an EAGLE-3 head's d2t): q is 0 at every other target token, so the
  residual there is p itself and a draft outside it has q(x) = 0.

Randomness: a row with n drafts uses exactly n + V uniforms (V = vocabulary
size), drawn in one call from the row's generator: the first n decide the
acceptance tests of drafts 0 .. n-1, the other V drive the exponential race
that draws the recovered or bonus token.  A seeded row's result and its
generator's final state therefore depend on that row alone, never on its batch
companions, its position in the batch or the batch's padding width K.  Rows
without a generator share the global RNG (D + B x V uniforms in two calls).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from specdec.transfer import upload

__all__ = ["Accepted", "DraftQ", "accept", "accept_ragged", "acceptance_rate", "expected_accepted_tokens",
           "in_target_vocab"]

# A residual max(p - q, 0) whose mass is at most this fraction of p's mass is
# treated as numerically empty and replaced by p.  The distribution error this
# can introduce is bounded by P(reject) * TV <= 1e-6, far below float noise.
_RESIDUAL_EPS = 1e-6

Generators = Sequence[torch.Generator | None] | None


@dataclasses.dataclass
class DraftQ:
    """The drafter's distributions q of a ragged batch's D drafts."""

    probs: torch.Tensor  # [Q, V_q] q rows, on the target's device
    rows: torch.Tensor  # [D] long, on the host: draft d's row of probs, or -1 (q one-hot on the draft itself)
    vocab_ids: torch.Tensor | None = None  # [V_q] distinct target id of each column; None: V_q = V, column = id


class Accepted(NamedTuple):
    """Per row b: drafts[:num_accepted[b]] are emitted, then token[b]."""

    num_accepted: torch.Tensor  # [B] long a_b
    token: torch.Tensor  # [B] long, the recovered or bonus token


def accept_ragged(
    target_probs: torch.Tensor,
    draft_ids: torch.Tensor,
    num_drafts: Sequence[int],
    draft_q: DraftQ | None = None,
    generators: Generators = None,
) -> Accepted:
    """Verify a ragged batch's drafts against the target.

    Args:
        target_probs: [T, V] target distributions p (processed: temperature,
            top-k, top-p; greedy = one-hot of the argmax), row b's n_b + 1 rows in
            turn, T = sum(n_b + 1).
        draft_ids: LongTensor [D], row b's n_b drafts in turn (on the host: no sync).
        num_drafts: [B] host ints n_b >= 0.
        draft_q: None (every draft deterministic) or the drafter's q (DraftQ).
        generators: None, or one torch.Generator (or None = global RNG) per row.
    """
    counts = [int(n) for n in num_drafts]
    _check_ragged(target_probs, draft_ids, counts, draft_q, generators)
    vocab = target_probs.shape[1]
    dtype = torch.promote_types(target_probs.dtype, torch.float32)
    device = target_probs.device
    if draft_q is not None and draft_q.probs.shape[0] == 0:
        draft_q = None  # every draft deterministic
    u_test, u_race = _draw_uniforms(generators, counts, vocab, device)  # [D], [B, V]
    lay = _Layout.of(counts, device)
    x = upload(draft_ids, device)  # [D]
    q = None if draft_q is None else _DeviceQ.of(draft_q, vocab, device)
    n_accepted = _num_accepted(target_probs, x, q, lay, u_test.to(dtype), dtype)  # [B]
    dist = _final_distribution(target_probs, x, q, lay, n_accepted, dtype)  # [B, V]
    return Accepted(n_accepted, _exponential_race(dist, u_race.to(dtype)))


def accept(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generators: Generators = None,
) -> torch.Tensor:
    """The padded form of accept_ragged: verify drafts, return accepted + recovered/bonus tokens.

    Args:
        draft_ids: LongTensor [B, K]; row b holds its n_b drafts, then -1 padding
            (read on the host).
        draft_probs: [B, K, V] drafter distributions q, or None (deterministic
            drafter: q is one-hot on each drafted token).
        target_probs: [B, K+1, V] target distributions p.
        generators: None, or one torch.Generator (or None = global RNG) per row.

    Returns:
        LongTensor [B, K+1]: row b holds its a_b accepted drafts, then one
        recovered or bonus token, then -1 padding.
    """
    _check_shapes(draft_ids, draft_probs, target_probs, generators)
    batch, k = draft_ids.shape
    vocab = target_probs.shape[-1]
    counts = _num_drafts(draft_ids.cpu()).tolist()
    # Row b's n_b drafts sit at flat slots b * K + j and its targets at b * (K+1) + j, j < n_b (+ 1).
    slots = torch.tensor([b * k + j for b, n in enumerate(counts) for j in range(n)], dtype=torch.long)
    rows = upload([b * (k + 1) + j for b, n in enumerate(counts) for j in range(n + 1)], target_probs.device)
    q = None if draft_probs is None else DraftQ(draft_probs.reshape(batch * k, vocab), slots)  # no copy
    result = accept_ragged(target_probs.reshape(-1, vocab)[rows], draft_ids.cpu().reshape(-1)[slots], counts, q,
                           generators)
    return _assemble(upload(draft_ids, target_probs.device), *result)


def in_target_vocab(q: torch.Tensor, target_vocab: int, target_ids: torch.Tensor | None) -> torch.Tensor:
    """q [..., V_draft] -> [..., V_target]: each draft id's mass at its target id, 0 elsewhere (target_ids None:
    draft id i is target id i)."""
    if target_ids is None:
        if q.shape[-1] == target_vocab:
            return q
        return F.pad(q, (0, target_vocab - q.shape[-1]))
    out = q.new_zeros(*q.shape[:-1], target_vocab)
    out[..., target_ids] = q
    return out


def expected_accepted_tokens(alpha: float, k: int) -> float:
    """Expected number of accepted drafts, sum_{i=1..k} alpha^i.

    Holds when every one of the k positions has acceptance rate alpha.
    """
    return float(sum(alpha**i for i in range(1, k + 1)))


def acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Probability that a draft x ~ q is accepted against p: sum_x min(p, q)."""
    p, q = torch.as_tensor(p), torch.as_tensor(q)
    return torch.minimum(p, q).sum(-1)


# --------------------------------------------------------------------------
# helpers


@dataclasses.dataclass
class _Layout:
    """Where each row's drafts and target rows sit in the stacked tensors (on the device)."""

    n: torch.Tensor  # [B] n_b
    first_draft: torch.Tensor  # [B] index of row b's first draft in [D]
    first_row: torch.Tensor  # [B] index of row b's first target row in [T]
    draft_row: torch.Tensor  # [D] b of each draft
    position: torch.Tensor  # [D] j of each draft within its row
    target_row: torch.Tensor  # [D] the target row that tests each draft
    total: int  # D

    @staticmethod
    def of(counts: list[int], device) -> _Layout:
        # Worked example: counts n = (2, 0, 3), so D = 5 drafts and T = 8 target rows.
        #   first_draft = (0, 2, 2)          cumsum(n) - n
        #   first_row   = (0, 3, 4)          first_draft + b: each earlier row adds one row beyond its drafts
        #   draft_row   = (0, 0, 2, 2, 2)    b, repeated n_b times
        #   position    = (0, 1, 0, 1, 2)    d - first_draft[b]
        #   target_row  = (0, 1, 4, 5, 6)    d + b = first_row[b] + j: p_j of row b, which tests draft j
        # Row b's target row at position a is first_row[b] + a; its draft j is first_draft[b] + j.
        batch = len(counts)
        n = torch.tensor(counts, dtype=torch.long)  # [B]
        first_draft = n.cumsum(0) - n  # [B]
        draft_row = torch.repeat_interleave(torch.arange(batch), n)  # [D]
        index = torch.arange(len(draft_row))  # [D]
        host = torch.cat([n, first_draft, first_draft + torch.arange(batch), draft_row,
                          index - first_draft[draft_row], index + draft_row])
        parts = upload(host, device).split([batch] * 3 + [len(index)] * 3)  # one host -> device copy
        return _Layout(*parts, total=len(index))


@dataclasses.dataclass
class _DeviceQ:
    """A DraftQ on the device, with what reading it needs."""

    probs: torch.Tensor  # [Q, V_q]
    rows: torch.Tensor  # [D] q row of each draft, -1 one-hot
    ids: torch.Tensor | None  # [V_q] target id of each column, None: column = target id
    column: torch.Tensor | None  # [V] column of each target id, -1 outside the draft vocabulary
    all_sampled: bool  # no draft's q is one-hot (known on the host)

    @staticmethod
    def of(q: DraftQ, vocab: int, device) -> _DeviceQ:
        ids = column = None
        if q.vocab_ids is not None:
            ids = q.vocab_ids.to(device)
            column = torch.full((vocab,), -1, dtype=torch.long, device=device)
            column[ids] = torch.arange(len(ids), device=device)
        return _DeviceQ(q.probs, upload(q.rows, device), ids, column, bool((q.rows >= 0).all()))

    def at_drafts(self, x: torch.Tensor, dtype) -> torch.Tensor:
        """q_j(x_j) of every draft, shaped as x and rows ([D] ragged, [B, K] padded): 1 where q is one-hot, 0
        outside the draft vocabulary."""
        col = x if self.column is None else self.column[x]  # -1 outside the draft vocabulary
        value = self.probs[self.rows.clamp(min=0), col.clamp(min=0)].to(dtype)
        value = torch.where(col >= 0, value, torch.zeros_like(value))
        return torch.where(self.rows >= 0, value, torch.ones_like(value))

    def residual(self, p_a: torch.Tensor, x_a: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        """[B, V] max(p_a - q, 0) with q the probs row `row` [B] (-1: one-hot on the draft x_a [B])."""
        q_a = self.probs[row.clamp(min=0)].to(p_a.dtype)  # [B, V_q]
        if self.ids is None:
            sampled = (p_a - q_a).clamp_(min=0)
        else:  # q is 0 outside the draft vocabulary: the residual there is p
            inside = (p_a.index_select(1, self.ids) - q_a).clamp_(min=0)  # [B, V_q]
            sampled = p_a.index_copy(1, self.ids, inside)
        if self.all_sampled:
            return sampled
        return torch.where(row.unsqueeze(1) >= 0, sampled, _without(p_a, x_a))


def _check_ragged(target_probs, draft_ids, counts, draft_q, generators) -> None:
    if target_probs.dim() != 2 or target_probs.shape[1] == 0:
        raise ValueError(f"target_probs must be [T, V] with V > 0, got {tuple(target_probs.shape)}")
    if any(n < 0 for n in counts):
        raise ValueError(f"negative draft counts {counts}")
    total = sum(counts)
    if target_probs.shape[0] != total + len(counts):
        raise ValueError(f"target_probs needs {total + len(counts)} rows (each row's drafts + 1), "
                         f"got {target_probs.shape[0]}")
    if tuple(draft_ids.shape) != (total,):
        raise ValueError(f"draft_ids must be [{total}], got {tuple(draft_ids.shape)}")
    if generators is not None and len(generators) != len(counts):
        raise ValueError(f"expected {len(counts)} generators, got {len(generators)}")
    if draft_q is None:
        return
    width = target_probs.shape[1] if draft_q.vocab_ids is None else len(draft_q.vocab_ids)
    if tuple(draft_q.rows.shape) != (total,) or draft_q.probs.dim() != 2 or draft_q.probs.shape[1] != width:
        raise ValueError(f"draft_q needs rows [{total}] and probs [Q, {width}], "
                         f"got {tuple(draft_q.rows.shape)} and {tuple(draft_q.probs.shape)}")


def _check_shapes(draft_ids, draft_probs, target_probs, generators) -> None:
    if draft_ids.dim() != 2:
        raise ValueError(f"draft_ids must be [B, K], got {tuple(draft_ids.shape)}")
    batch, k = draft_ids.shape
    if target_probs.dim() != 3 or tuple(target_probs.shape[:2]) != (batch, k + 1):
        raise ValueError(
            f"target_probs must be [B, K+1, V] = [{batch}, {k + 1}, V], "
            f"got {tuple(target_probs.shape)}"
        )
    vocab = target_probs.shape[-1]
    if vocab == 0:
        raise ValueError("target_probs has an empty vocabulary")
    if draft_probs is not None and tuple(draft_probs.shape) != (batch, k, vocab):
        raise ValueError(
            f"draft_probs must be [B, K, V] = [{batch}, {k}, {vocab}], "
            f"got {tuple(draft_probs.shape)}"
        )
    if generators is not None and len(generators) != batch:
        raise ValueError(f"expected {batch} generators, got {len(generators)}")


def _num_drafts(draft_ids: torch.Tensor) -> torch.Tensor:
    """[B] number of drafts per row: the length of the leading run of ids >= 0."""
    return (draft_ids >= 0).long().cumprod(dim=1).sum(dim=1)


def _draw_uniforms(generators, counts: list[int], vocab: int, device, out=None):
    """Uniforms in [0, 1): acceptance tests [D] and race noise [B, V].

    Rows without a generator take theirs from the global RNG, all in two calls
    (no host sync).  A row with a generator draws its n_b + V values from it in
    one call (on that generator's device): n_b acceptance uniforms, then V race
    uniforms.  out: None, or float32 buffers (tests [>= D], race [>= B, V]) to
    draw into, in place of fresh tensors (the same values): their first D and B
    rows are returned.
    """
    batch, total = len(counts), sum(counts)
    gens = [None] * batch if generators is None else list(generators)
    if out is None:
        u_test = torch.empty(total, device=device)
        u_race = torch.empty(batch, vocab, device=device)
    else:
        u_test, u_race = out[0][:total], out[1][:batch]
    if not all(g is not None for g in gens):  # some rows take the global RNG's
        torch.rand(total, device=device, out=u_test)
        torch.rand(batch, vocab, device=device, out=u_race)
    start = 0
    for b, (n, gen) in enumerate(zip(counts, gens)):
        if gen is not None:
            u = torch.rand(n + vocab, generator=gen, device=gen.device).to(device)
            u_test[start:start + n] = u[:n]
            u_race[b] = u[n:]
        start += n
    return u_test, u_race


def _num_accepted(target_probs, x, q, lay, u_test, dtype) -> torch.Tensor:
    """[B] number of accepted drafts a_b (the length of the accepted prefix)."""
    p_x = target_probs[lay.target_row, x].to(dtype)  # [D] p_j(x_j)
    q_x = torch.ones_like(p_x) if q is None else q.at_drafts(x, dtype)  # [D] q_j(x_j)
    ok = _passes(p_x, q_x, u_test)  # [D]
    # Accepted prefix = drafts before the row's first rejection.  Each draft
    # proposes a stop: its position j if rejected, else n_b; a_b is the least.
    # Example (the layout's): n = (2, 0, 3), ok = (1, 1, 1, 0, 1)
    #   stop = (2, 2, 3, 1, 3)  ->  a = min(n_b, stops of row b) = (2, 0, 1)
    # so row 2 keeps draft 0, rejects draft 1 and draws from the residual at its target row 4 + 1.
    stop = torch.where(ok, lay.n[lay.draft_row], lay.position)  # [D]
    return lay.n.scatter_reduce(0, lay.draft_row, stop, "amin")  # [B]


def _final_distribution(target_probs, x, q, lay, n_accepted, dtype) -> torch.Tensor:
    """[B, V] distribution of the last emitted token, at target position a_b.

    Residual normalize(max(p_a - q_a, 0)) for rows that rejected draft a_b;
    p_a for rows that accepted every draft (bonus) or whose residual is
    numerically empty.  Left unnormalised: the race does not need it.
    """
    p_a = target_probs[lay.first_row + n_accepted].to(dtype)  # [B, V]
    if lay.total == 0:
        return p_a
    # the rejected draft of row b; rows that rejected none point past their drafts (value unused)
    d_a = (lay.first_draft + n_accepted).clamp(max=lay.total - 1)  # [B]
    return _last_distribution(p_a, x[d_a], q, None if q is None else q.rows[d_a], n_accepted < lay.n)


def _passes(p_x: torch.Tensor, q_x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Whether each draft passes its test (any shape): kept with probability min(1, p/q), written without a
    division: p >= q keeps surely (also covers q = 0 < p); a token with p = 0 never passes."""
    return (p_x > 0) & ((p_x >= q_x) | (u * q_x < p_x))


def _last_distribution(p_a: torch.Tensor, x_a: torch.Tensor, q: _DeviceQ | None, q_row: torch.Tensor | None,
                       rejected: torch.Tensor) -> torch.Tensor:
    """[B, V] what the last token is drawn from, given each row's target row p_a [B, V] at position a_b, the
    draft there x_a [B] (any value where nothing was rejected), its q row q_row [B] (-1: one-hot; None with q)
    and whether the row rejected it [B] bool: the residual, else p_a (bonus, or a numerically empty residual)."""
    residual = _without(p_a, x_a) if q is None else q.residual(p_a, x_a, q_row)  # [B, V]
    residual_mass = residual.sum(-1, keepdim=True)  # [B, 1]
    p_mass = p_a.sum(-1, keepdim=True)  # [B, 1]
    use_residual = rejected.unsqueeze(1) & (residual_mass > _RESIDUAL_EPS * p_mass)  # [B, 1]
    return torch.where(use_residual, residual, p_a)


def _without(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[B, V] p with token x [B] zeroed: max(p - one_hot(x), 0) for p <= 1."""
    return p.scatter(1, x.unsqueeze(1), 0.0)


def _exponential_race(dist: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[B] one categorical draw per row from unnormalised dist [B, V].

    With E_i ~ Exp(1) independent, argmax_i dist_i / E_i is i with probability
    dist_i / sum(dist).  Entries with dist <= 0 (or NaN) score -1 and so are
    never chosen while the row has any positive mass.
    """
    e = -torch.log1p(-u)  # [B, V] Exp(1) from uniforms in [0, 1); may be 0 -> score inf
    score = torch.where(dist > 0, dist / e, torch.full_like(dist, -1.0))
    return score.argmax(dim=-1)


def _assemble(draft_ids, n_accepted, token) -> torch.Tensor:
    """[B, K+1]: accepted drafts, the final token at position a_b, then -1."""
    batch, k = draft_ids.shape
    positions = torch.arange(k + 1, device=draft_ids.device)  # [K+1]
    padded = F.pad(draft_ids, (0, 1), value=-1)  # [B, K+1]
    out = torch.where(positions < n_accepted.unsqueeze(1), padded, -1)
    return out.scatter_(1, n_accepted.unsqueeze(1), token.unsqueeze(1))
