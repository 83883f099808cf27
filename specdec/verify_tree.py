"""Lossless verification of a draft tree: recursive rejection sampling over each node's candidates.

A draft tree of N nodes hangs below the sequence's last committed token (the root).  Node i holds token
draft_ids[i] and parents[i] (-1: the root, else an earlier node: parents precede children).  The verify
forward scores the root and every node, giving target rows 0..N: row 0 is p after the root, row i + 1 is p
after node i.  A chain is the tree parents = [-1, 0, 1, ...].

The children of a row are candidates for the token after it, each drawn from a proposal q_j: either a
distribution the drafter sampled it from (draft_probs[row]: all children of a row drawn from it
independently) or, for a deterministic drafter, one-hot on the child's own token.  The walk starts at the
root; at the current row the children are tried in layout order against r, the current row's p at first:

* child j (token x_j) is accepted with probability min(1, r(x_j) / q_j(x_j)), and the walk moves to it;
* otherwise r becomes normalize(max(r - q_j, 0)) and the next child is tried;
* when no child is accepted (or the row has none), one token is drawn from r and the walk ends.

Each test is one step of ordinary speculative sampling with target r and proposal q_j, whose rejection
branch is the rest of the recursion, so the token emitted after a row follows its p exactly (SpecInfer's
multi-candidate sampling; for one-hot q_j: x_j is kept with probability r(x_j) and then removed from r).  After
an acceptance the walk repeats at the accepted node's row, so the emitted sequence follows the target token by
token.  Greedy rows (p one-hot) accept the child equal to the argmax, if any, then emit the argmax.

Randomness: a sequence with N nodes uses N + V uniforms from its own generator (or the global RNG): uniform
i for node i's test, the last V for the exponential race of the final token, as `specdec.verify` does; on
a chain the walk and `specdec.verify.accept` agree draw for draw.

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
from specdec.verify import _RESIDUAL_EPS, _exponential_race, in_target_vocab


@dataclasses.dataclass
class Verdict:
    tokens: list[int]  # accepted drafts, then the final (recovered or bonus) token
    rows: list[int]  # rows[j]: the target row (0 = root, i + 1 = node i) that predicted tokens[j]


@dataclasses.dataclass
class _Rows:
    """The rows of a step whose children are tried: each one's p, proposals and candidate tokens."""

    probs: torch.Tensor  # [R, V] target p of each such row
    tokens: torch.Tensor  # [R, M] its children's tokens in layout order, -1 padding
    q: torch.Tensor | None  # [R, V] the distribution its children were drawn from (zeros where deterministic)
    sampled: torch.Tensor | None  # [R] bool: its children were drawn from q (else each is one-hot on itself)


def accept_tree(draft_ids: Sequence[Sequence[int]], parents: Sequence[Sequence[int]], target_probs: torch.Tensor,
                generators: Sequence[torch.Generator | None] | None = None,
                draft_probs: Sequence[torch.Tensor | None] | None = None,
                draft_vocab: Sequence[torch.Tensor | None] | None = None) -> list[Verdict]:
    """Verify B draft trees at once.

    Args:
        draft_ids: per sequence its N_b node tokens (host lists).
        parents: per sequence its N_b parent indices (module docstring).
        target_probs: [sum(N_b + 1), V] processed target distributions, sequence b's N_b + 1 rows in turn
            (root row first, then one per node).
        generators: None, or per sequence a torch.Generator or None (global RNG).
        draft_probs: None, or per sequence None (deterministic candidates) or [R_b, V]: row r the distribution
            the children of target row r were drawn from (rows >= R_b: deterministic).
        draft_vocab: None, or per sequence None or [V_draft]: its draft_probs span a reduced draft vocabulary,
            column c being target id draft_vocab[c] (mapped into the target vocabulary here: the walk's
            residuals are over the whole of it).

    Two host copies in all: every child's test values, then the final tokens."""
    sizes = [len(d) for d in draft_ids]
    if len(parents) != len(sizes) or any(len(p) != n for p, n in zip(parents, sizes)):
        raise ValueError("draft_ids and parents need one list per sequence, of equal lengths")
    if target_probs.shape[0] != sum(n + 1 for n in sizes):
        raise ValueError(f"target_probs needs {sum(n + 1 for n in sizes)} rows (each tree's nodes + 1), "
                         f"got {target_probs.shape[0]}")
    draft_probs = _in_target_vocab(draft_probs, draft_vocab, len(sizes), target_probs.shape[-1])
    first_row = [0]
    for n in sizes:
        first_row.append(first_row[-1] + n + 1)
    children = [children_of(p) for p in parents]
    # every row with children: (sequence, row), its children
    tried = [(b, row, kids) for b, ch in enumerate(children) for row, kids in enumerate(ch) if kids]
    rows = _gather_rows(target_probs, first_row, draft_ids, draft_probs, tried)
    a, b = _tests(rows)
    u_tests, u_race = _uniforms(generators, sizes, target_probs.shape[-1], target_probs.device)
    values = {(seq, row): (a[i], b[i]) for i, (seq, row, _) in enumerate(tried)}
    verdicts, finals = [], []  # finals: per sequence (its final row, children tried there)
    for s in range(len(sizes)):
        verdict, final = _walk(children[s], draft_ids[s], u_tests[s], lambda row, s=s: values[(s, row)])
        verdicts.append(verdict)
        finals.append(final)
    last = _final_tokens(target_probs, first_row, draft_ids, draft_probs, children, finals, u_race).tolist()
    for verdict, token in zip(verdicts, last):
        verdict.tokens.append(token)
    return verdicts


def _in_target_vocab(draft_probs, draft_vocab, count: int, vocab: int) -> list[torch.Tensor | None]:
    """Per sequence its q rows [R_b, V] over the target vocabulary, or None."""
    draft_probs = draft_probs if draft_probs is not None else [None] * count
    draft_vocab = draft_vocab if draft_vocab is not None else [None] * count
    return [None if q is None else in_target_vocab(q, vocab, ids) for q, ids in zip(draft_probs, draft_vocab)]


def _walk(children: list[list[int]], draft_ids: Sequence[int], u: list[float], tests
          ) -> tuple[Verdict, tuple[int, int]]:
    """One tree's walk on the host; tests(row) -> (a, b) per child of that row: accept child j iff
    u_j * b_j < a_j.  Returns the verdict without its final token and (the final row, children tried there)."""
    verdict = Verdict(tokens=[], rows=[0])
    row = 0
    while True:
        kids = children[row]
        if not kids:
            return verdict, (row, 0)
        a, b = tests(row)
        for j, node in enumerate(kids):
            if u[node] * b[j] < a[j]:  # accepted with probability min(1, r(x) / q(x))
                verdict.tokens.append(draft_ids[node])
                row = node + 1
                verdict.rows.append(row)
                break
        else:
            return verdict, (row, len(kids))


def _gather_rows(target_probs, first_row, draft_ids, draft_probs, tried) -> _Rows:
    """The p, proposals and candidate tokens of the rows whose children are tried."""
    device = target_probs.device
    if not tried:
        return _Rows(target_probs[:0].float(), torch.zeros(0, 1, dtype=torch.long, device=device), None, None)
    width = max(len(kids) for _, _, kids in tried)
    probs = target_probs[upload([first_row[s] + row for s, row, _ in tried], device)].float()  # [R, V]
    tokens = upload([[draft_ids[s][k] for k in kids] + [-1] * (width - len(kids)) for s, _, kids in tried], device)
    sampled = [draft_probs[s] is not None and row < draft_probs[s].shape[0] for s, row, _ in tried]
    if not any(sampled):
        return _Rows(probs, tokens, None, None)
    q = probs.new_zeros(probs.shape)
    for i, ((s, row, _), on) in enumerate(zip(tried, sampled)):
        if on:
            q[i] = draft_probs[s][row].to(device=device, dtype=q.dtype)
    return _Rows(probs, tokens, q, upload(sampled, device, torch.bool))


def _residuals(rows: _Rows, limit: torch.Tensor | None = None):
    """Walk every row's children in order on the device, yielding per child j (a_j, b_j) = (r(x_j), q_j(x_j)) and
    finally r after the children tried (all, or limit[i] of row i)."""
    r = rows.probs
    for j in range(rows.tokens.shape[1]):
        x = rows.tokens[:, j:j + 1]  # [R, 1]
        live = x[:, 0] >= 0 if limit is None else (x[:, 0] >= 0) & (j < limit)
        x = x.clamp(min=0)
        a = r.gather(1, x)[:, 0]
        if rows.q is None:
            b = torch.ones_like(a)
            nxt = r.scatter(1, x, 0.0)  # r - one_hot(x), clamped at 0
        else:
            b = torch.where(rows.sampled, rows.q.gather(1, x)[:, 0], 1.0)
            nxt = torch.where(rows.sampled[:, None], (r - rows.q).clamp_(min=0), r.scatter(1, x, 0.0))
        yield a, b
        mass = nxt.sum(-1, keepdim=True)
        keep = live[:, None] & (mass > _RESIDUAL_EPS * r.sum(-1, keepdim=True))  # else: numerically empty
        r = torch.where(keep, nxt / mass.clamp_min(1e-30), r)
    yield r


def _tests(rows: _Rows) -> tuple[list[list[float]], list[list[float]]]:
    """Per row with children: a [M] and b [M] of its children's tests, on the host (one copy)."""
    pairs = list(_residuals(rows))[:-1]
    if not pairs:
        return [], []
    both = torch.stack([torch.stack([a for a, _ in pairs], 1), torch.stack([b for _, b in pairs], 1)]).tolist()
    return both[0], both[1]


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


def _final_tokens(target_probs, first_row, draft_ids, draft_probs, children, finals, u_race) -> torch.Tensor:
    """[B] the final token of each sequence: drawn from its final row's residual after the children tried
    there (p itself when none were, or when nothing of it is left: _RESIDUAL_EPS)."""
    tried = [(s, row, children[s][row]) for s, (row, _) in enumerate(finals)]
    rows = _gather_rows(target_probs, first_row, draft_ids, draft_probs, tried)
    limit = upload([count for _, count in finals], target_probs.device)
    *_, residual = _residuals(rows, limit)
    return _exponential_race(residual, u_race.float())
