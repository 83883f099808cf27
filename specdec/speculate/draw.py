"""Drawing a chain's next drafts from a drafter's logits, each request at its own sampling settings."""

from __future__ import annotations

import torch

from specdec.sampling import SamplingParams, processed_probs_rows
from specdec.transfer import upload
from specdec.verify import sample


def draw_drafts(logits: torch.Tensor, params: list[SamplingParams], generators: list, target_vocab: int,
                target_ids: torch.Tensor | None = None, uniforms: torch.Tensor | None = None,
                map_q: bool = True) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """logits [B, V_draft] -> (draft tokens [B] as target ids, on the device; per row its distribution
    q [1, V_target] (map_q=False: [1, V_draft], for in_target_vocab later), or None for a greedy row).

    Greedy rows take the argmax; the others draw from their processed distribution (batched, row i from
    generators[i] when it is not None, or from uniforms[i] [V_draft] when given); nothing is copied to the
    host.  target_ids [V_draft] maps a reduced draft vocabulary into the target's (an EAGLE-3 head's d2t);
    None: draft id i is target id i."""
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    qs: list[torch.Tensor | None] = [None] * len(params)
    if not sampled:
        best = logits.argmax(-1)  # [B]
        return (best if target_ids is None else target_ids[best]), qs
    index = None if len(sampled) == len(params) else upload(sampled, logits.device)  # none when all sample
    q = processed_probs_rows(logits if index is None else logits[index], [params[i] for i in sampled])  # [S, Vd]
    if uniforms is not None and index is not None:
        uniforms = uniforms[index]
    drawn = sample(q, [generators[i] for i in sampled], uniforms)  # [S] draft ids
    if map_q:
        q = in_target_vocab(q, target_vocab, target_ids)  # [S, V]
    for j, i in enumerate(sampled):
        qs[i] = q[j:j + 1]
    if index is None:
        tokens = drawn
    else:
        tokens = logits.argmax(-1)  # [B]
        tokens[index] = drawn
    return (tokens if target_ids is None else target_ids[tokens]), qs


def in_target_vocab(q: torch.Tensor, target_vocab: int, target_ids: torch.Tensor | None) -> torch.Tensor:
    """q [..., V_draft] -> [..., V_target]: each draft id's mass at its target id, 0 elsewhere."""
    if target_ids is None:
        if q.shape[-1] == target_vocab:
            return q
        return torch.nn.functional.pad(q, (0, target_vocab - q.shape[-1]))
    out = q.new_zeros(*q.shape[:-1], target_vocab)
    out[..., target_ids] = q
    return out
