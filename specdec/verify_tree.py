"""Lossless verification of a draft tree: multi-candidate rejection sampling with deterministic candidates.

A draft tree of N nodes hangs below the sequence's last committed token (the root).  Node i holds token
draft_ids[i] and parents[i] (-1: the root, else an earlier node: parents precede children).  The verify
forward scores the root and every node, giving target rows 0..N: row 0 is p after the root, row i + 1 is p
after node i.  A chain is the tree parents = [-1, 0, 1, ...].

The walk starts at the root.  At the current node, its children c_1, c_2, ... (in layout order) are tried
one by one against the residual r of the current row's p (r = p at first):

* c_j is accepted with probability r(x_j) / sum(r)  (x_j its token); the walk moves to c_j;
* otherwise x_j is removed from r (r(x_j) = 0) and the next child is tried;
* when no child is accepted (or the node has none), one token is drawn from r and the walk ends.

So the first emitted token is x_1 with probability p(x_1), x_2 with p(x_2), ..., and any other token x with
p(x): exactly p.  Every step after an acceptance repeats this at the accepted node's row, so the emitted
sequence follows the target token by token (lossless) whatever the drafter proposed: candidates are a
deterministic function of the context (e.g. a head's top-m tokens), so no drafter distribution q is needed.
Greedy rows (p one-hot) accept the child that equals the argmax, if any, then emit the argmax.

Randomness: a sequence with N nodes uses N + V uniforms from its own generator (or the global RNG): uniform
i for node i's test, the last V for the exponential race of the final token, as `specdec.verify` does.

The result per sequence is a Verdict: the emitted tokens (accepted drafts, then the final token) and the
target row that predicted each of them (0 for the first; the accepted node's row after).  A chain accepting
a drafts has rows 0..a; a tree's accepted path may skip rows, which the engine compacts (engine/engine.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from specdec.draft_tree import children_of
from specdec.transfer import upload
from specdec.verify import _RESIDUAL_EPS, _exponential_race


@dataclasses.dataclass
class Verdict:
    tokens: list[int]  # accepted drafts, then the final (recovered or bonus) token
    rows: list[int]  # rows[j]: the target row (0 = root, i + 1 = node i) that predicted tokens[j]


def accept_tree(draft_ids: Sequence[Sequence[int]], parents: Sequence[Sequence[int]], target_probs: torch.Tensor,
                generators: Sequence[torch.Generator | None] | None = None) -> list[Verdict]:
    """Verify B draft trees at once.

    Args:
        draft_ids: per sequence its N_b node tokens (host lists).
        parents: per sequence its N_b parent indices (module docstring).
        target_probs: [sum(N_b + 1), V] processed target distributions, sequence b's N_b + 1 rows in turn
            (root row first, then one per node).
        generators: None, or per sequence a torch.Generator or None (global RNG).

    Two host copies in all: every node's p value at its parent's row, then the final tokens."""
    sizes = [len(d) for d in draft_ids]
    if len(parents) != len(sizes) or any(len(p) != n for p, n in zip(parents, sizes)):
        raise ValueError("draft_ids and parents need one list per sequence, of equal lengths")
    if target_probs.shape[0] != sum(n + 1 for n in sizes):
        raise ValueError(f"target_probs needs {sum(n + 1 for n in sizes)} rows (each tree's nodes + 1), "
                         f"got {target_probs.shape[0]}")
    device, vocab = target_probs.device, target_probs.shape[-1]
    first_row = [0]
    for n in sizes:
        first_row.append(first_row[-1] + n + 1)
    # p at each node's parent row, for its own token: the acceptance tests' numerators
    parent_rows = [first_row[b] + p + 1 for b, ps in enumerate(parents) for p in ps]
    tokens = [t for d in draft_ids for t in d]
    p_nodes = target_probs[upload(parent_rows, device), upload(tokens, device)].tolist() if tokens else []
    u_tests, u_race = _uniforms(generators, sizes, vocab, device)
    verdicts, finals, removed = [], [], []
    offset = 0
    for b, n in enumerate(sizes):
        verdict, final_row, out = _walk(draft_ids[b], children_of(parents[b]), p_nodes[offset:offset + n],
                                        u_tests[b])
        verdicts.append(verdict)
        finals.append(first_row[b] + final_row)
        removed.append(out)
        offset += n
    last = _final_tokens(target_probs, finals, removed, u_race).tolist()
    for verdict, token in zip(verdicts, last):
        verdict.tokens.append(token)
    return verdicts


def _walk(draft_ids: Sequence[int], children: list[list[int]], p_nodes: list[float], u: list[float]
          ) -> tuple[Verdict, int, list[int]]:
    """One tree's walk on the host -> (the verdict without its final token, the final row, the tokens
    removed from that row's residual)."""
    verdict = Verdict(tokens=[], rows=[0])
    row = 0
    while True:
        mass, removed = 1.0, []
        for node in children[row]:
            token = draft_ids[node]
            p = 0.0 if token in removed else p_nodes[node]
            if u[node] * mass < p:  # accepted with probability r(x) / sum(r)
                verdict.tokens.append(token)
                row = node + 1
                verdict.rows.append(row)
                break
            mass -= p
            removed.append(token)
        else:
            return verdict, row, removed


def _uniforms(generators, sizes: list[int], vocab: int, device) -> tuple[list[list[float]], torch.Tensor]:
    """Per sequence its N_b test uniforms (host lists) and the race uniforms [B, V] (on the device)."""
    if generators is None or all(g is None for g in generators):
        tests = torch.rand(sum(sizes)).tolist()  # host RNG: the tests are read on the host anyway
        race = torch.rand(len(sizes), vocab, device=device)
        split, at = [], 0
        for n in sizes:
            split.append(tests[at:at + n])
            at += n
        return split, race
    if len(generators) != len(sizes):
        raise ValueError(f"expected {len(sizes)} generators, got {len(generators)}")
    tests, races = [], []
    for n, gen in zip(sizes, generators):
        u = torch.rand(n + vocab, generator=gen, device=device if gen is None else gen.device)
        tests.append(u[:n].tolist())
        races.append(u[n:].to(device))
    return tests, torch.stack(races)


def _final_tokens(target_probs: torch.Tensor, rows: list[int], removed: list[list[int]],
                  u_race: torch.Tensor) -> torch.Tensor:
    """[B] the final token of each sequence: drawn from its final row's p with the rejected candidates
    removed (or p itself, when nothing of it is left: _RESIDUAL_EPS)."""
    device = target_probs.device
    p = target_probs[upload(rows, device)].float()  # [B, V]
    residual = p.clone()
    hits = [(b, t) for b, tokens in enumerate(removed) for t in tokens]
    if hits:
        residual[upload([b for b, _ in hits], device), upload([t for _, t in hits], device)] = 0.0
    keep = residual.sum(-1, keepdim=True) > _RESIDUAL_EPS * p.sum(-1, keepdim=True)
    return _exponential_race(torch.where(keep, residual, p), u_race.float())
