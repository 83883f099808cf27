"""Drawing a chain's next drafts from a drafter's logits, each request at its own sampling settings."""

from __future__ import annotations

import torch

from specdec.sampling import SamplingParams, processed_probs_rows
from specdec.transfer import upload
from specdec.verify import in_target_vocab


def draw_drafts(logits: torch.Tensor, params: list[SamplingParams], generators: list, target_vocab: int,
                target_ids: torch.Tensor | None = None, uniforms: torch.Tensor | None = None,
                map_q: bool = True, draws: int = 1) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """logits [B, V_draft] -> (draft tokens [B] as target ids, on the device ([B, draws] with draws > 1); per row
    its distribution q [1, V_target] (map_q=False: [1, V_draft], for in_target_vocab later), or None for a
    greedy row).

    Greedy rows take the argmax (the `draws` best tokens); the others draw `draws` tokens independently from
    their processed distribution by inverse CDF, one uniform each: row i's from generators[i] when it is not
    None, or uniforms[i] [draws] when given; nothing is copied to the host.  (A drafter's draws need only be
    exact samples of q: the verifier tests them against q.  One uniform a draw, not the V of an exponential
    race, saves drawing B x k x V random numbers a step.)  target_ids [V_draft] maps a reduced draft vocabulary
    into the target's (an EAGLE-3 head's d2t); None: draft id i is target id i."""
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    qs: list[torch.Tensor | None] = [None] * len(params)
    tokens = logits.argmax(-1, keepdim=True) if draws == 1 else logits.topk(draws, dim=-1).indices  # [B, draws]
    if sampled:
        index = None if len(sampled) == len(params) else upload(sampled, logits.device)  # none when all sample
        q = processed_probs_rows(logits if index is None else logits[index], [params[i] for i in sampled])  # [S, Vd]
        if uniforms is None:
            uniforms = draw_uniforms([generators[i] for i in sampled], draws, logits.device)
        elif index is not None:
            uniforms = uniforms[index]
        drawn = inverse_cdf(q, uniforms.view(len(sampled), draws))  # [S, draws] draft ids
        if index is None:
            tokens = drawn
        else:
            tokens[index] = drawn
        if map_q:
            q = in_target_vocab(q, target_vocab, target_ids)  # [S, V]
        for j, i in enumerate(sampled):
            qs[i] = q[j:j + 1]
    tokens = tokens[:, 0] if draws == 1 else tokens
    return (tokens if target_ids is None else target_ids[tokens]), qs


def inverse_cdf(q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[S, n] draws from each row of unnormalised q [S, V], one per uniform u [S, n] in [0, 1): the first token
    whose cumulative mass exceeds u times the row's mass."""
    cdf = q.float().cumsum(-1)  # [S, V]
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=q.shape[-1] - 1)


def draw_uniforms(generators: list, count: int, device) -> torch.Tensor:
    """[len(generators), count] uniforms: a row with a generator from it, the others from the global RNG."""
    out = torch.rand(len(generators), count, device=device)
    for i, gen in enumerate(generators):
        if gen is not None:
            out[i] = torch.rand(count, generator=gen, device=gen.device).to(device)
    return out

