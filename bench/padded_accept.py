"""The padded acceptance as it was before the ragged layout (specdec/verify.py at ace8680, and the sampler's
padding of that time), frozen: the baseline that bench/accept_ragged.py times and the oracle that
tests/test_verify_ragged.py checks specdec.verify.accept_ragged against, draw for draw.

It is the same algorithm as specdec/verify.py (see its module docstring), on a [B, K+1, V] / [B, K, V] layout
with -1 padding; do not change it: it is a fixed point of comparison, not a second implementation to maintain.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from specdec.transfer import upload
from specdec.verify import _assemble, _check_shapes, _exponential_race, _num_drafts  # unchanged by the ragged layout

_RESIDUAL_EPS = 1e-6

Generators = Sequence[torch.Generator | None] | None


def padded_accept(draft_ids, draft_probs, target_probs, generators: Generators = None) -> torch.Tensor:
    """specdec.verify.accept as it was: draft_ids [B, K] (-1 padding), draft_probs [B, K, V] or None, target_probs
    [B, K+1, V] -> [B, K+1] accepted drafts, the recovered or bonus token, -1 padding."""
    batch, k = draft_ids.shape
    vocab = target_probs.shape[-1]
    _check_shapes(draft_ids, draft_probs, target_probs, generators)
    dtype = torch.promote_types(target_probs.dtype, torch.float32)
    device = target_probs.device
    n_drafts = _num_drafts(draft_ids)  # [B], on draft_ids' device: given on the host, no sync to read it
    u_accept, u_race = _draw_uniforms(generators, n_drafts, batch, k, vocab, device)
    draft_ids, n_drafts = upload(draft_ids, device), upload(n_drafts, device)  # no wait for the forward
    n_accepted = _num_accepted(
        draft_ids, draft_probs, target_probs, n_drafts, u_accept.to(dtype)
    )  # [B]
    dist = _final_distribution(
        draft_ids, draft_probs, target_probs, n_drafts, n_accepted, dtype
    )  # [B, V]
    token = _exponential_race(dist, u_race.to(dtype))  # [B]
    return _assemble(draft_ids, n_accepted, token)



def pad_step(rows: torch.Tensor, counts: list[int], drafts: list[list[int]], q_rows: list[torch.Tensor | None]):
    """What the sampler did before the ragged layout: target rows [T, V] (row b's 1 + n_b in turn) -> target
    [B, K+1, V]; drafts -> [B, K] with -1 padding; q rows ([n_b, V] or None: one-hot) -> [B, K, V], or None
    when no row with drafts has q."""
    batch, k, vocab = len(counts), max(counts), rows.shape[-1]
    index = _row_index([1 + n for n in counts], rows.device)
    target = rows.new_zeros(batch, k + 1, vocab)
    target[index] = rows  # [B, K+1, V]
    draft_ids = torch.tensor([d + [-1] * (k - len(d)) for d in drafts], dtype=torch.long)  # [B, K]
    if all(q is None for d, q in zip(drafts, q_rows) if d):
        return draft_ids, None, target
    q = rows.new_zeros(batch, k, vocab)
    full = [F.one_hot(torch.tensor(d, device=rows.device), vocab).float() if r is None else r.float()
            for d, r in zip(drafts, q_rows) if d]
    q[_row_index(counts, rows.device)] = torch.cat(full)  # [B, K, V]
    return draft_ids, q, target


def _row_index(counts: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch index, position index) of each of sum(counts) stacked rows, row b having counts[b] rows."""
    batch = [b for b, n in enumerate(counts) for _ in range(n)]
    position = [j for n in counts for j in range(n)]
    return upload(batch, device), upload(position, device)


# --------------------------------------------------------------------------
# the helpers the ragged layout replaced, as they were


def _draw_uniforms(generators, n_drafts, batch, k, vocab, device):
    """Uniforms in [0, 1): acceptance tests [B, K] and race noise [B, V].

    Without per-row generators everything comes from the global RNG in two
    calls (no host sync).  Otherwise each row draws n_b + V values from its own
    generator (on that generator's device): n_b acceptance uniforms, then V
    race uniforms.  Padding slots of the acceptance tensor are never read.
    Reading n_b needs n_drafts on the host: a caller that builds draft_ids on
    the host avoids a device sync here.
    """
    if generators is None or all(g is None for g in generators):
        u_accept = torch.rand(batch, k, device=device)
        u_race = torch.rand(batch, vocab, device=device)
        return u_accept, u_race
    counts = n_drafts.tolist()
    accept_rows, race_rows = [], []
    for n, gen in zip(counts, generators):
        gen_device = device if gen is None else gen.device
        u = torch.rand(n + vocab, generator=gen, device=gen_device).to(device)
        accept_rows.append(F.pad(u[:n], (0, k - n), value=1.0))
        race_rows.append(u[n:])
    return torch.stack(accept_rows), torch.stack(race_rows)


def _num_accepted(draft_ids, draft_probs, target_probs, n_drafts, u_accept):
    """[B] number of accepted drafts a_b (the length of the accepted prefix)."""
    batch, k = draft_ids.shape
    dtype = u_accept.dtype
    x = draft_ids.clamp(min=0).unsqueeze(-1)  # [B, K, 1]; padding -> id 0, masked below
    p_x = target_probs[:, :k].gather(2, x).squeeze(-1).to(dtype)  # [B, K]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)  # deterministic drafter: q = one-hot at x
    else:
        q_x = draft_probs.gather(2, x).squeeze(-1).to(dtype)  # [B, K]
    # Keep with probability min(1, p/q), written without a division:
    # p >= q keeps surely (also covers q = 0 < p); a token with p = 0 never passes.
    ok = (p_x > 0) & ((p_x >= q_x) | (u_accept * q_x < p_x))  # [B, K]
    ok &= torch.arange(k, device=ok.device) < n_drafts.unsqueeze(1)
    # Accepted prefix = leading run of ok.  Example with K = 4:
    #   ok      = [1, 1, 0, 1]
    #   cumprod = [1, 1, 0, 0]   (zero from the first rejection on)
    #   sum     = 2              -> drafts 0, 1 accepted, draft 2 rejected,
    # so the recovered token lands at output position 2 and position 3 is -1.
    return ok.long().cumprod(dim=1).sum(dim=1)


def _final_distribution(draft_ids, draft_probs, target_probs, n_drafts, n_accepted, dtype):
    """[B, V] distribution of the last emitted token, at target position a_b.

    Residual normalize(max(p_a - q_a, 0)) for rows that rejected draft a_b;
    p_a for rows that accepted every draft (bonus) or whose residual is
    numerically empty.  Left unnormalised: the race does not need it.
    """
    batch, k = draft_ids.shape
    vocab = target_probs.shape[-1]
    at_a = n_accepted.view(batch, 1, 1).expand(batch, 1, vocab)  # [B, 1, V]
    p_a = target_probs.gather(1, at_a).squeeze(1).to(dtype)  # [B, V]
    if k == 0:
        return p_a
    pos = n_accepted.clamp(max=k - 1)  # [B]; rows with a = K are bonus rows, value unused
    if draft_probs is None:
        x_a = draft_ids.gather(1, pos.unsqueeze(1)).clamp(min=0)  # [B, 1]
        residual = p_a.scatter(1, x_a, 0.0)  # p - one_hot(x), clamped at 0
    else:
        at_pos = pos.view(batch, 1, 1).expand(batch, 1, vocab)
        q_a = draft_probs.gather(1, at_pos).squeeze(1).to(dtype)  # [B, V]
        residual = (p_a - q_a).clamp_(min=0)
    residual_mass = residual.sum(-1, keepdim=True)  # [B, 1]
    p_mass = p_a.sum(-1, keepdim=True)  # [B, 1]
    rejected = (n_accepted < n_drafts).unsqueeze(1)  # [B, 1]
    use_residual = rejected & (residual_mass > _RESIDUAL_EPS * p_mass)
    return torch.where(use_residual, residual, p_a)
