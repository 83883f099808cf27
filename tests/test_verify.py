"""Tests for specdec.verify: exactness on greedy targets, edge cases, seeding
and distributional losslessness (chi-square + total variation, with negative
controls showing the statistical checks have power)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from scipy.stats import chisquare

from specdec.verify import accept, acceptance_rate, expected_accepted_tokens

PVALUE_MIN = 1e-4  # chi-square threshold: a correct sampler fails this rarely
TV_MAX = 0.01


# --------------------------------------------------------------------------
# helpers


def _dirichlet(shape, gen, zeros_beyond=None):
    """Random distributions over the last dim (Dirichlet(1)); optionally keep
    only the `zeros_beyond` largest entries per distribution (top-k-like)."""
    e = -torch.log1p(-torch.rand(*shape, generator=gen, dtype=torch.float64))
    if zeros_beyond is not None:
        kth = e.topk(zeros_beyond, dim=-1).values[..., -1:]
        e = torch.where(e >= kth, e, torch.zeros_like(e))
    return (e / e.sum(-1, keepdim=True)).float()


def _draw(q, n, gen):
    """[n] samples from distribution q [V]."""
    return torch.multinomial(q, n, replacement=True, generator=gen)


def _fit(tokens, p):
    """(chi-square p-value, total variation distance) of samples vs p [V]."""
    vocab = p.numel()
    counts = torch.bincount(tokens, minlength=vocab).double()
    total = counts.sum()
    p64 = p.double() / p.double().sum()
    tv = 0.5 * (counts / total - p64).abs().sum().item()
    support = p64 > 0
    if counts[~support].sum() > 0:
        return 0.0, tv
    expected = total * p64[support]
    pvalue = chisquare(counts[support].numpy(), expected.numpy()).pvalue
    return float(pvalue), tv


def _assert_follows(tokens, p, tv_max=TV_MAX, what=""):
    pvalue, tv = _fit(tokens, p)
    assert pvalue > PVALUE_MIN and tv < tv_max, f"{what}: p-value {pvalue:.3g}, TV {tv:.4f}"


def _layout(out):
    """Number of emitted (non -1) tokens per row; asserts they form a prefix."""
    emitted = out >= 0
    m = emitted.sum(1)
    positions = torch.arange(out.shape[1])
    assert torch.equal(emitted, positions < m.unsqueeze(1)), "-1 padding is not a suffix"
    return m


def _greedy_reference(drafts, targets):
    """Pure-python greedy verification: drafts [K] (-1 padded), targets [K+1]."""
    out = []
    for j, d in enumerate(drafts):
        if d < 0 or d != targets[j]:
            break
        out.append(d)
    out.append(targets[len(out)])  # the target's token at the first mismatch, or the bonus
    return out + [-1] * (len(drafts) + 1 - len(out))


def _accept_all(drafts, target_probs, gen):
    """BUGGY sampler for negative controls: keeps every draft, then bonus."""
    bonus = torch.multinomial(target_probs[0, -1], drafts.shape[0], True, generator=gen)
    return torch.cat([drafts, bonus.unsqueeze(1)], 1)


def _resample_from_p_first(drafts0, p0, q0, gen):
    """BUGGY first-token sampler: on rejection resamples from p, not from
    normalize(max(p - q, 0))."""
    n = drafts0.shape[0]
    keep = torch.rand(n, generator=gen) < (p0[drafts0] / q0[drafts0])
    fresh = torch.multinomial(p0, n, True, generator=gen)
    return torch.where(keep, drafts0, fresh)


# --------------------------------------------------------------------------
# greedy (one-hot) targets: exact results


@pytest.mark.parametrize("use_q", [True, False])
def test_greedy_all_drafts_match_gives_drafts_plus_bonus(use_q):
    gen = torch.Generator().manual_seed(0)
    batch, k, vocab = 16, 4, 12
    targets = torch.randint(vocab, (batch, k + 1), generator=gen)
    q = _dirichlet((batch, k, vocab), gen) if use_q else None
    torch.manual_seed(0)
    out = accept(targets[:, :k].clone(), q, F.one_hot(targets, vocab).float())
    assert out.dtype == torch.long and out.shape == (batch, k + 1)
    assert torch.equal(out, targets)


@pytest.mark.parametrize("use_q", [True, False])
@pytest.mark.parametrize("j", [0, 1, 2, 3])
def test_greedy_first_mismatch_emits_target_then_padding(j, use_q):
    gen = torch.Generator().manual_seed(j)
    batch, k, vocab = 16, 4, 12
    targets = torch.randint(vocab, (batch, k + 1), generator=gen)
    drafts = targets[:, :k].clone()
    drafts[:, j] = (targets[:, j] + 1 + torch.randint(vocab - 1, (batch,), generator=gen)) % vocab
    q = _dirichlet((batch, k, vocab), gen) if use_q else None
    gens = [torch.Generator().manual_seed(100 + b) for b in range(batch)]
    out = accept(drafts, q, F.one_hot(targets, vocab).float(), gens)
    expected = torch.full((batch, k + 1), -1)
    expected[:, :j] = targets[:, :j]
    expected[:, j] = targets[:, j]  # later drafts match the targets but are dropped
    assert torch.equal(out, expected)


@pytest.mark.parametrize("use_q", [True, False])
def test_empty_drafts_give_only_the_bonus(use_q):
    gen = torch.Generator().manual_seed(1)
    batch, k, vocab = 5, 3, 7
    targets = torch.randint(vocab, (batch, k + 1), generator=gen)
    q = _dirichlet((batch, k, vocab), gen) if use_q else None
    drafts = torch.full((batch, k), -1)
    out = accept(drafts, q, F.one_hot(targets, vocab).float())
    expected = torch.full((batch, k + 1), -1)
    expected[:, 0] = targets[:, 0]
    assert torch.equal(out, expected)


@pytest.mark.parametrize("use_q", [True, False])
def test_ragged_rows_are_independent(use_q):
    gen = torch.Generator().manual_seed(2)
    k, vocab = 4, 9
    n_drafts = [4, 0, 1, 2, 3, 4, 2, 1]
    mismatch = [None, None, 0, None, 1, 3, 1, None]  # position of a wrong draft
    batch = len(n_drafts)
    targets = torch.randint(vocab, (batch, k + 1), generator=gen)
    drafts = torch.full((batch, k), -1)
    for b, (n, bad) in enumerate(zip(n_drafts, mismatch)):
        drafts[b, :n] = targets[b, :n]
        if bad is not None:
            drafts[b, bad] = (targets[b, bad] + 1) % vocab
    p = F.one_hot(targets, vocab).float()
    q = _dirichlet((batch, k, vocab), gen) if use_q else None
    out = accept(drafts, q, p)
    for b in range(batch):
        assert out[b].tolist() == _greedy_reference(drafts[b].tolist(), targets[b].tolist())
        # The same row alone, with its own (tight) width K = n_b.
        n = n_drafts[b]
        q_b = None if q is None else q[b : b + 1, :n]
        alone = accept(drafts[b : b + 1, :n], q_b, p[b : b + 1, : n + 1])
        assert out[b, : n + 1].tolist() == alone[0].tolist()
        assert (out[b, n + 1 :] == -1).all()
    # Bonus rows draw from position n_b, not K (targets differ per position).
    assert out[1, 0] == targets[1, 0] and out[3, 2] == targets[3, 2]
    assert out[0, 4] == targets[0, 4]


@pytest.mark.parametrize("use_q", [True, False])
def test_k_zero(use_q):
    gen = torch.Generator().manual_seed(3)
    batch, vocab = 6, 11
    targets = torch.randint(vocab, (batch, 1), generator=gen)
    q = torch.empty(batch, 0, vocab) if use_q else None
    out = accept(torch.empty(batch, 0, dtype=torch.long), q, F.one_hot(targets, vocab).float())
    assert out.shape == (batch, 1) and torch.equal(out, targets)
    # Non-greedy K = 0 is plain sampling from p.
    p = _dirichlet((vocab,), gen)
    torch.manual_seed(3)
    out = accept(torch.empty(100_000, 0, dtype=torch.long), None, p.expand(100_000, 1, vocab))
    _assert_follows(out[:, 0], p, what="K=0")


def test_zero_batch():
    out = accept(torch.empty(0, 3, dtype=torch.long), None, torch.rand(0, 4, 5))
    assert out.shape == (0, 4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_float_dtypes(dtype):
    gen = torch.Generator().manual_seed(4)
    batch, k, vocab = 8, 3, 10
    targets = torch.randint(vocab, (batch, k + 1), generator=gen)
    drafts = targets[:, :k].clone()
    drafts[::2, 1] = (drafts[::2, 1] + 1) % vocab
    q = _dirichlet((batch, k, vocab), gen).to(dtype)
    out = accept(drafts, q, F.one_hot(targets, vocab).to(dtype))
    for b in range(batch):
        assert out[b].tolist() == _greedy_reference(drafts[b].tolist(), targets[b].tolist())


# --------------------------------------------------------------------------
# edge cases of the rejection rule


def test_p_equal_q_accepts_everything():
    gen = torch.Generator().manual_seed(5)
    batch, k, vocab = 50_000, 4, 10
    q = _dirichlet((k + 1, vocab), gen)
    q[2] = _dirichlet((vocab,), gen, zeros_beyond=3)  # top-k-like zeros too
    drafts = torch.stack([_draw(q[j], batch, gen) for j in range(k)], 1)
    torch.manual_seed(5)
    out = accept(drafts, q[:k].expand(batch, k, vocab), q.expand(batch, k + 1, vocab))
    assert torch.equal(out[:, :k], drafts)
    assert ((out[:, k] >= 0) & (out[:, k] < vocab)).all()
    assert (q[k][out[:, k]] > 0).all()


@pytest.mark.parametrize("use_q", [True, False])
def test_zero_target_probability_is_never_emitted(use_q):
    gen = torch.Generator().manual_seed(6)
    batch, k, vocab = 100_000, 4, 10
    p = _dirichlet((k + 1, vocab), gen, zeros_beyond=3)  # only 3 tokens allowed per position
    q = _dirichlet((k, vocab), gen)  # full support: drafts often hit p = 0
    drafts = torch.stack([_draw(q[j], batch, gen) for j in range(k)], 1)
    drafts[torch.arange(batch) % 5 == 0, 2:] = -1  # some ragged rows
    drafts[torch.arange(batch) % 7 == 0] = -1  # some empty rows
    torch.manual_seed(6)
    q_in = q.expand(batch, k, vocab) if use_q else None
    out = accept(drafts, q_in, p.expand(batch, k + 1, vocab))
    m = _layout(out)
    for j in range(k + 1):
        col = out[:, j]
        col = col[col >= 0]
        assert (p[j][col] > 0).all(), f"position {j} emitted a zero-probability token"
    # Recovered tokens specifically (rows that rejected a draft) are checked too.
    n = (drafts >= 0).sum(1)
    recovered_rows = m - 1 < n
    assert recovered_rows.sum() > 10_000
    last = out.gather(1, (m - 1).unsqueeze(1)).squeeze(1)
    assert (p[(m - 1)[recovered_rows], last[recovered_rows]] > 0).all()


def test_empty_residual_falls_back_to_p():
    # p == q except at the drafted token, which has p = q = 0 ("drafted anyway"):
    # it must be rejected, max(p - q, 0) is all zero, so the token comes from p.
    vocab, batch = 6, 20_000
    p = torch.tensor([0.5, 0.5, 0, 0, 0, 0])
    drafts = torch.full((batch, 1), 2)
    torch.manual_seed(7)
    out = accept(drafts, p.expand(batch, 1, vocab), p.expand(batch, 2, vocab))
    assert (out[:, 1] == -1).all()
    assert ((out[:, 0] == 0) | (out[:, 0] == 1)).all()
    assert abs((out[:, 0] == 0).double().mean().item() - 0.5) < 0.02
    # Numerically near-empty residual (float noise between p and q): no NaN / bad ids.
    gen = torch.Generator().manual_seed(7)
    p = _dirichlet((2, vocab), gen)
    q = (p[:1] * (1 + 1e-7 * torch.randn(1, vocab, generator=gen))).clamp(min=0)
    drafts = _draw(p[0], batch, gen).unsqueeze(1)
    out = accept(drafts, q.expand(batch, 1, vocab), p.expand(batch, 2, vocab))
    assert ((out >= 0) & (out < vocab)).all()


def test_draft_with_zero_draft_probability_is_accepted_if_target_allows():
    vocab, batch = 5, 1000
    q = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0]])  # drafter claims token 1 only ...
    p = torch.tensor([[0.1, 0.2, 0.3, 0.2, 0.2], [0.0, 0.0, 0.0, 0.0, 1.0]])
    drafts = torch.full((batch, 1), 3)  # ... but token 3 was drafted anyway
    out = accept(drafts, q.expand(batch, 1, vocab), p.expand(batch, 2, vocab))
    assert torch.equal(out, torch.tensor([[3, 4]]).expand(batch, 2))  # min(1, p/0) = 1
    # Greedy target with q one-hot on the target token, draft elsewhere:
    # residual max(onehot(t) - onehot(t), 0) = 0 -> fallback to p -> t.
    q = F.one_hot(torch.tensor([[2]]), vocab).float()
    p = F.one_hot(torch.tensor([[2, 0]]), vocab).float()
    out = accept(torch.tensor([[4]]), q, p)
    assert out.tolist() == [[2, -1]]


def test_output_range_and_padding_layout_fuzz():
    gen = torch.Generator().manual_seed(8)
    for trial in range(40):
        batch = int(torch.randint(1, 40, (1,), generator=gen))
        k = int(torch.randint(0, 6, (1,), generator=gen))
        vocab = int(torch.randint(1, 30, (1,), generator=gen))
        p = _dirichlet((batch, k + 1, vocab), gen)
        topk = _dirichlet((batch, k + 1, vocab), gen, zeros_beyond=min(2, vocab))
        greedy = F.one_hot(p.argmax(-1), vocab).float()
        kind = torch.randint(3, (batch, k + 1, 1), generator=gen)
        p = torch.where(kind == 0, p, torch.where(kind == 1, topk, greedy))
        q = _dirichlet((batch, k, vocab), gen, zeros_beyond=max(1, vocab // 2))
        drafts = torch.randint(vocab, (batch, k), generator=gen)
        n = torch.randint(0, k + 1, (batch,), generator=gen)
        drafts[torch.arange(k) >= n.unsqueeze(1)] = -1
        use_q = trial % 2 == 0
        gens = None
        if trial % 3 == 0:
            gens = [torch.Generator().manual_seed(b) if b % 2 else None for b in range(batch)]
        out = accept(drafts, q if use_q else None, p, gens)
        assert out.shape == (batch, k + 1) and out.dtype == torch.long
        assert ((out >= -1) & (out < vocab)).all()
        m = _layout(out)
        assert ((m >= 1) & (m <= n + 1)).all()
        accepted = torch.arange(k + 1) < (m - 1).unsqueeze(1)
        padded = F.pad(drafts, (0, 1), value=-1)
        assert torch.equal(out[accepted], padded[accepted])
        last = out.gather(1, (m - 1).unsqueeze(1))
        p_last = p[torch.arange(batch), m - 1].gather(1, last)
        assert (p_last > 0).all()


def test_shape_errors():
    p = torch.rand(2, 3, 5)
    with pytest.raises(ValueError):
        accept(torch.zeros(2, 3, dtype=torch.long), None, p)  # target needs K+1
    with pytest.raises(ValueError):
        accept(torch.zeros(2, 2, dtype=torch.long), torch.rand(2, 2, 4), p)
    with pytest.raises(ValueError):
        accept(torch.zeros(2, 2, dtype=torch.long), None, p, [None])


# --------------------------------------------------------------------------
# seeding


def _seeded_case(seed, k=4, vocab=10):
    gen = torch.Generator().manual_seed(seed)
    p = _dirichlet((1, k + 1, vocab), gen)
    q = _dirichlet((1, k, vocab), gen)
    drafts = _draw(q[0, 0], k, gen).unsqueeze(0)
    n = seed % (k + 1)
    drafts[0, n:] = -1
    return drafts, q, p


def _batch_of(rows, k, vocab):
    """Stack (drafts, q, p) single rows padded to width k."""
    drafts = torch.cat([F.pad(d, (0, k - d.shape[1]), value=-1) for d, _, _ in rows])
    q = torch.cat([F.pad(qq, (0, 0, 0, k - qq.shape[1]), value=0.0) for _, qq, _ in rows])
    p = torch.cat([F.pad(pp, (0, 0, 0, k + 1 - pp.shape[1]), value=1 / vocab) for *_, pp in rows])
    return drafts, q, p


@pytest.mark.parametrize("use_q", [True, False])
def test_seeded_rows_are_deterministic_and_batch_independent(use_q):
    k, vocab = 4, 10
    rows = [_seeded_case(s, k, vocab) for s in range(12)]

    def run(order, width, companions_seeded):
        d, q, p = _batch_of([rows[i] for i in order], width, vocab)
        gens = [
            torch.Generator().manual_seed(1000 + i) if i < 6 or companions_seeded else None
            for i in order
        ]
        out = accept(d, q if use_q else None, p, gens)
        return {
            i: (out[pos].tolist(), None if g is None else g.get_state())
            for pos, (i, g) in enumerate(zip(order, gens))
        }

    torch.manual_seed(9)
    base = run(list(range(12)), k, True)
    again = run(list(range(12)), k, True)
    assert all(base[i][0] == again[i][0] for i in range(12))
    # Rows 0..5 are seeded; companions change (rows 6..11 unseeded, reordered,
    # dropped), their positions change, and the padding width K changes.
    variants = [
        run([5, 11, 0, 7, 4, 3, 9, 1, 2], k, False),
        run([0, 1, 2, 3, 4, 5], k, True),
        run([3], k, True),
        run([8, 2, 10, 0, 4, 1, 5, 3], k + 3, False),
    ]
    for variant in variants:
        for i, (tokens, state) in variant.items():
            if i >= 6:
                continue
            assert tokens[: k + 1] == base[i][0] and all(t == -1 for t in tokens[k + 1 :]), i
            assert torch.equal(state, base[i][1]), "generator consumption depends on the batch"
    # Randomness is really used: different seeds for one row give different results.
    d, q, p = _seeded_case(3, k, vocab)
    d, q, p = d.expand(64, k), q.expand(64, k, vocab), p.expand(64, k + 1, vocab)
    outs = accept(d, q if use_q else None, p, [torch.Generator().manual_seed(s) for s in range(64)])
    assert len({tuple(r) for r in outs.tolist()}) > 3


def test_empty_row_consumes_only_the_bonus_draw():
    vocab = 10
    gen = torch.Generator().manual_seed(10)
    p = _dirichlet((1, 4, vocab), gen)
    g1, g2 = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    wide = accept(torch.full((1, 3), -1), _dirichlet((1, 3, vocab), gen), p, [g1])
    bare = accept(torch.empty(1, 0, dtype=torch.long), None, p[:, :1], [g2])
    assert wide[0, 0] == bare[0, 0] and (wide[0, 1:] == -1).all()
    assert torch.equal(g1.get_state(), g2.get_state())


def test_global_rng_path_is_reproducible():
    gen = torch.Generator().manual_seed(12)
    batch, k, vocab = 256, 3, 10
    p = _dirichlet((batch, k + 1, vocab), gen)
    q = _dirichlet((batch, k, vocab), gen)
    drafts = torch.multinomial(q.view(-1, vocab), 1, generator=gen).view(batch, k)
    torch.manual_seed(13)
    a = accept(drafts, q, p)
    torch.manual_seed(13)
    b = accept(drafts, q, p, [None] * batch)
    torch.manual_seed(13)
    c = accept(drafts, q, p)
    assert torch.equal(a, c) and torch.equal(a, b)


# --------------------------------------------------------------------------
# statistics: the output follows the target distribution


def test_helpers():
    assert expected_accepted_tokens(0.5, 3) == pytest.approx(0.875)
    assert expected_accepted_tokens(1.0, 4) == pytest.approx(4.0)
    assert expected_accepted_tokens(0.0, 4) == 0.0
    assert expected_accepted_tokens(0.7, 0) == 0.0
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.1, 0.3, 0.0, 0.6])
    assert acceptance_rate(p, q).item() == pytest.approx(0.4)
    assert acceptance_rate(p, p).item() == pytest.approx(1.0)


def test_output_follows_target_distribution_with_negative_controls():
    gen = torch.Generator().manual_seed(14)
    batch, k, vocab = 400_000, 3, 10
    p = _dirichlet((k + 1, vocab), gen)  # a different p and q at each position
    q = _dirichlet((k, vocab), gen)
    drafts = torch.stack([_draw(q[j], batch, gen) for j in range(k)], 1)
    torch.manual_seed(14)
    out = accept(drafts, q.expand(batch, k, vocab), p.expand(batch, k + 1, vocab))
    _layout(out)
    # Output position j exists iff drafts 0..j-1 were accepted; given that,
    # the token there is a fresh speculative step and must follow p_j.
    for j in range(k + 1):
        col = out[:, j]
        col = col[col >= 0]
        assert col.numel() > 50_000
        _assert_follows(col, p[j], what=f"position {j}")
    # Negative control 1: accepting every draft emits q_0 at position 0.
    bad = _accept_all(drafts, p.expand(1, k + 1, vocab), gen)
    pvalue, tv = _fit(bad[:, 0], p[0])
    assert pvalue < PVALUE_MIN and tv > TV_MAX, (pvalue, tv)
    # Negative control 2: resampling from p (not the residual) on rejection.
    bad = _resample_from_p_first(drafts[:, 0], p[0], q[0], gen)
    pvalue, tv = _fit(bad, p[0])
    assert pvalue < PVALUE_MIN, (pvalue, tv)


def test_ragged_bonus_follows_its_own_position():
    # Half the rows have 1 draft, so their bonus must come from p_1, not p_K.
    gen = torch.Generator().manual_seed(15)
    batch, k, vocab = 400_000, 3, 10
    p = _dirichlet((k + 1, vocab), gen)
    q = 0.5 * p[:k] + 0.5 * _dirichlet((k, vocab), gen)
    drafts = torch.stack([_draw(q[j], batch, gen) for j in range(k)], 1)
    drafts[: batch // 2, 1:] = -1
    torch.manual_seed(15)
    out = accept(drafts, q.expand(batch, k, vocab), p.expand(batch, k + 1, vocab))
    for j in range(k + 1):
        col = out[:, j]
        assert (col >= 0).sum() > 50_000
        _assert_follows(col[col >= 0], p[j], what=f"position {j}")


def test_deterministic_drafter_output_follows_target():
    # draft_probs=None: q is one-hot on each draft.  With a fixed draft token
    # per row the output must still follow p, whatever that token is
    # (including token 7, which p forbids).
    gen = torch.Generator().manual_seed(16)
    batch, vocab = 400_000, 10
    rows = torch.arange(batch)

    def peaked(favourite):  # p: 0.7 on `favourite`, the rest spread, token 7 cut
        p = 0.3 * _dirichlet((vocab,), gen)
        p[favourite] += 0.7
        p[7] = 0.0
        return p / p.sum()

    # (a) one draft, the drafted token cycles through the whole vocabulary.
    p = torch.stack([peaked(2), peaked(5)])
    drafts = (rows % vocab).unsqueeze(1)
    torch.manual_seed(16)
    out = accept(drafts, None, p.expand(batch, 2, vocab))
    _assert_follows(out[:, 0], p[0], what="position 0")
    for x in range(vocab):  # 40k rows each: looser TV for the smaller sample
        _assert_follows(out[drafts[:, 0] == x, 0], p[0], tv_max=0.02, what=f"draft {x}")
    # Negative control: accepting every deterministic draft gives the draft pattern.
    pvalue, tv = _fit(_accept_all(drafts, p.expand(1, 2, vocab), gen)[:, 0], p[0])
    assert pvalue < PVALUE_MIN and tv > TV_MAX

    # (b) three drafts, mostly the favourite (a good drafter), so that deep
    # output positions get enough samples; every fifth row drafts other tokens.
    k = 3
    favourites = [2, 5, 0, 9]
    p = torch.stack([peaked(f) for f in favourites])
    drafts = torch.tensor(favourites[:k]).expand(batch, k).clone()
    odd = rows % 5 == 0
    drafts[odd] = torch.stack([(rows[odd] // 5 + j) % vocab for j in range(k)], 1)
    torch.manual_seed(17)
    out = accept(drafts, None, p.expand(batch, k + 1, vocab))
    for j in range(k + 1):
        col = out[:, j]
        assert (col >= 0).sum() > 50_000
        _assert_follows(col[col >= 0], p[j], what=f"position {j}")


def _accepted_count_sd(alpha, k):
    """Standard deviation of the number of accepted drafts N, where P(N >= j) = alpha^j for j <= k:
    E[N^2] = sum_j (2j - 1) alpha^j.  From theory, so that a rule whose counts barely vary (accept-everything:
    always k) is judged by its mean, not failed for a zero sample spread."""
    mean = expected_accepted_tokens(alpha, k)
    second = sum((2 * j - 1) * alpha**j for j in range(1, k + 1))
    return math.sqrt(second - mean**2)


def _mean_accepted_verdict(out, alpha, k):
    """(passes, why): whether the mean number of accepted drafts per row is expected_accepted_tokens(alpha, k)
    within 4 standard errors."""
    n_accepted = (_layout(out) - 1).double()
    mean = n_accepted.mean().item()
    theory = expected_accepted_tokens(alpha, k)
    se = _accepted_count_sd(alpha, k) / math.sqrt(out.shape[0])
    return abs(mean - theory) < 4 * se, f"mean accepted {mean:.4f}, theory {theory:.4f}, SE {se:.4f}"


def test_mean_accepted_matches_theory():
    gen = torch.Generator().manual_seed(17)
    batch, k, vocab = 200_000, 4, 10
    p = _dirichlet((vocab,), gen)
    q = (0.6 * p + 0.4 * _dirichlet((vocab,), gen))  # a drafter that roughly agrees
    alpha = acceptance_rate(p, q).item()
    assert 0.5 < alpha < 0.95
    drafts = _draw(q, batch * k, gen).view(batch, k)
    torch.manual_seed(17)
    out = accept(drafts, q.expand(batch, k, vocab), p.expand(batch, k + 1, vocab))
    passes, why = _mean_accepted_verdict(out, alpha, k)
    assert passes, why
    # With p the same at every position, every output position follows p.
    for j in range(k + 1):
        col = out[:, j]
        _assert_follows(col[col >= 0], p, what=f"position {j}")
    # Negative control: a verify that accepts every draft, through the same check, fails it.
    broken = _accept_all(drafts, p.expand(1, k + 1, vocab), gen)
    passes, why = _mean_accepted_verdict(broken, alpha, k)
    assert not passes, f"the accept-everything rule passed the mean-accepted check: {why}"
