"""Lossless verification of drafted tokens by rejection sampling.

Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): a cheap
drafter proposes tokens x_0 .. x_{n-1} with distributions q_0 .. q_{n-1}; the
target model scores them in one pass, giving p_0 .. p_n, where p_j is the
target's distribution for the token that follows draft j-1.  For each batch
row with n drafts, ``accept`` emits tokens in three roles:

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

Deterministic drafters (n-gram, remote) pass ``draft_probs=None``: q_j is then
one-hot on x_j, so x_j is kept with probability p_j(x_j) and the residual is
p_j with x_j zeroed out.

Randomness: a row with n drafts uses exactly n + V uniforms (V = vocabulary
size), drawn in one call from the row's generator: the first n decide the
acceptance tests of drafts 0 .. n-1, the other V drive the exponential race
that draws the recovered or bonus token.  A seeded row's result and its
generator's final state therefore depend on that row alone, never on its batch
companions, its position in the batch or the batch's padding width K.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from specdec.transfer import upload

__all__ = ["accept", "acceptance_rate", "expected_accepted_tokens"]

# A residual max(p - q, 0) whose mass is at most this fraction of p's mass is
# treated as numerically empty and replaced by p.  The distribution error this
# can introduce is bounded by P(reject) * TV <= 1e-6, far below float noise.
_RESIDUAL_EPS = 1e-6

Generators = Sequence[torch.Generator | None] | None


def accept(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generators: Generators = None,
) -> torch.Tensor:
    """Verify drafts against the target; return accepted + recovered/bonus tokens.

    Args:
        draft_ids: LongTensor [B, K]; row b holds its n_b drafts, then -1 padding.
        draft_probs: [B, K, V] drafter distributions q, or None (deterministic
            drafter: q is one-hot on each drafted token).
        target_probs: [B, K+1, V] target distributions p (already processed by
            temperature / top-k / top-p; greedy = one-hot of the argmax).
        generators: None, or one torch.Generator (or None = global RNG) per row.

    Returns:
        LongTensor [B, K+1]: row b holds its a_b accepted drafts, then one
        recovered or bonus token, then -1 padding.
    """
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
