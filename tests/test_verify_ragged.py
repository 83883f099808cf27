"""specdec.verify.accept_ragged against the padded acceptance it replaces (bench/padded_accept.py, frozen):
with the same generators and seeds both emit the same tokens and leave the generators in the same state, on
ragged batches mixing draft counts 0..k, greedy and sampled rows, and q absent, over the target vocabulary
or over a reduced draft vocabulary; a seeded row's result does not depend on its batch."""

from __future__ import annotations

import pytest
import torch

from bench.padded_accept import pad_step, padded_accept
from specdec.verify import DraftQ, accept_ragged

VOCAB = 12


def _distribution(gen, vocab, zeros=0, peak=1.0):
    """A random distribution over `vocab` with `zeros` entries 0 (peak > 1: more mass on few tokens)."""
    e = -torch.log1p(-torch.rand(vocab, generator=gen, dtype=torch.float64)) ** peak
    if zeros:
        e[torch.randperm(vocab, generator=gen)[:zeros]] = 0
    return (e / e.sum()).float()


def _row(gen, k, kind, draft_vocab):
    """One request: (target rows [n+1, V], drafts [n], q [n, V_q] or None, greedy)."""
    n = int(torch.randint(0, k + 1, (1,), generator=gen))
    greedy = bool(torch.rand(1, generator=gen) < 0.3)
    p = torch.stack([_distribution(gen, VOCAB, zeros=int(torch.randint(0, 6, (1,), generator=gen)), peak=2.0)
                     for _ in range(n + 1)])
    if greedy:
        p = torch.nn.functional.one_hot(p.argmax(-1), VOCAB).float()
    width = len(draft_vocab) if kind == "reduced" else VOCAB
    q = torch.stack([_distribution(gen, width, zeros=2, peak=2.0) for _ in range(n)]) if n else torch.zeros(0, width)
    drafts = torch.multinomial(q, 1, generator=gen)[:, 0] if n else torch.zeros(0, dtype=torch.long)
    if kind == "reduced":
        drafts = draft_vocab[drafts]
    if kind == "none" or (n and bool(torch.rand(1, generator=gen) < 0.2)):  # sometimes any token, even outside
        drafts = torch.randint(0, VOCAB, (n,), generator=gen)
    return p, drafts.tolist(), None if kind == "none" else q, greedy


def _in_target(q, draft_vocab):
    if q is None or draft_vocab is None:
        return q
    out = q.new_zeros(q.shape[0], VOCAB)
    out[:, draft_vocab] = q
    return out


def _ragged_q(rows, draft_vocab):
    """DraftQ of rows' q (None where deterministic), or None when no row has q."""
    qs = [q for _, d, q, _ in rows if q is not None and d]
    if not qs:
        return None
    index, at = [], 0
    for _, d, q, _ in rows:
        index += list(range(at, at + len(d))) if q is not None else [-1] * len(d)
        at += len(d) if q is not None else 0
    return DraftQ(torch.cat(qs), torch.tensor(index, dtype=torch.long), draft_vocab)


def _seeded(seeds):
    return [None if s is None else torch.Generator().manual_seed(s) for s in seeds]


def _both(rows, draft_vocab, seeds):
    """(ragged tokens per row, padded tokens per row, generator states of each)."""
    counts = [len(d) for _, d, _, _ in rows]
    target = torch.cat([p for p, _, _, _ in rows])  # [T, V]
    drafts = [d for _, d, _, _ in rows]
    gens_new, gens_old = _seeded(seeds), _seeded(seeds)
    a, token = accept_ragged(target, torch.tensor(sum(drafts, []), dtype=torch.long), counts,
                             _ragged_q(rows, draft_vocab), gens_new)
    new = [d[:n] + [t] for d, n, t in zip(drafts, a.tolist(), token.tolist())]
    draft_ids, q, padded_target = pad_step(target, counts, drafts, [_in_target(q, draft_vocab) for _, _, q, _ in rows])
    old = [[t for t in row if t >= 0] for row in padded_accept(draft_ids, q, padded_target, gens_old).tolist()]
    states = [(g.get_state(), h.get_state()) for g, h in zip(gens_new, gens_old) if g is not None]
    return new, old, states


@pytest.mark.parametrize("kinds", [("none",), ("full",), ("reduced",), ("full", "none"), ("reduced", "none")])
def test_ragged_equals_padded_draw_for_draw(kinds):
    gen = torch.Generator().manual_seed(len(kinds) * 7 + len(kinds[0]))
    draft_vocab = torch.randperm(VOCAB, generator=gen)[:7] if "reduced" in kinds else None
    rejected = bonus = 0
    for trial in range(150):
        batch = 1 + trial % 9
        k = 1 + trial % 5
        kind = [kinds[int(torch.randint(0, len(kinds), (1,), generator=gen))] for _ in range(batch)]
        rows = [_row(gen, k, c, draft_vocab) for c in kind]
        seeds = [1000 * trial + b for b in range(batch)]
        new, old, states = _both(rows, draft_vocab, seeds)
        assert new == old, (trial, kind)
        assert all(torch.equal(g, h) for g, h in states)
        rejected += sum(len(t) <= len(d) for t, (_, d, _, _) in zip(new, rows))
        bonus += sum(len(t) == len(d) + 1 for t, (_, d, _, _) in zip(new, rows))
    assert rejected > 50 and bonus > 50  # both branches exercised


def test_zero_drafts_everywhere_is_plain_sampling():
    gen = torch.Generator().manual_seed(5)
    rows = [_row(gen, 0, "full", None) for _ in range(4)]
    new, old, _ = _both(rows, None, [1, 2, 3, 4])
    assert new == old and all(len(t) == 1 for t in new)


@pytest.mark.parametrize("kind", ["none", "full", "reduced"])
def test_a_seeded_row_ignores_its_batch(kind):
    """Row 0 (seeded) alone, then among unseeded and seeded companions at other positions: the same tokens and
    the same generator state."""
    gen = torch.Generator().manual_seed(11)
    draft_vocab = torch.randperm(VOCAB, generator=gen)[:7] if kind == "reduced" else None
    for trial in range(20):
        rows = [_row(gen, 5, kind, draft_vocab) for _ in range(6)]

        def run(order, seeds):
            picked = [rows[i] for i in order]
            counts = [len(d) for _, d, _, _ in picked]
            gens = _seeded(seeds)
            a, token = accept_ragged(torch.cat([p for p, _, _, _ in picked]),
                                     torch.tensor(sum((d for _, d, _, _ in picked), []), dtype=torch.long), counts,
                                     _ragged_q(picked, draft_vocab), gens)
            at = order.index(0)
            return (int(a[at]), int(token[at])), gens[at].get_state()

        alone = run([0], [trial])
        for order, seeds in [([3, 0, 5], [None, trial, None]), ([1, 2, 4, 5, 0], [7, None, 8, 9, trial])]:
            got = run(order, seeds)
            assert got[0] == alone[0] and torch.equal(got[1], alone[1])


def test_shape_errors():
    p = torch.rand(5, VOCAB)
    with pytest.raises(ValueError):
        accept_ragged(p, torch.zeros(3, dtype=torch.long), [2, 2])  # 2 + 2 drafts need 6 rows
    with pytest.raises(ValueError):
        accept_ragged(p, torch.zeros(2, dtype=torch.long), [2, 1])  # 3 drafts, 2 ids
    with pytest.raises(ValueError):
        accept_ragged(p, torch.zeros(3, dtype=torch.long), [2, 1], DraftQ(torch.rand(3, 5), torch.arange(3)))
    with pytest.raises(ValueError):
        accept_ragged(p, torch.zeros(3, dtype=torch.long), [2, 1], None, [None])
