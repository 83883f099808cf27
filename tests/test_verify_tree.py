"""Tests for specdec.verify_tree: a draft tree's walk emits the target's distribution token by token (with a
negative control that fails the same check), equals the chain verifier on chains, and is exact for greedy
rows and seeded rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import specdec.verify_tree as verify_tree
from specdec.verify import accept
from specdec.draft_tree import ancestor_mask, children_of, depths, spine_and_siblings
from specdec.verify_tree import Verdict, accept_tree
from tests.stats import chi_square_p

PVALUE_MIN = 1e-4

# root -> {a, b}, a -> {c}, b -> {d}, c -> {e}; laid out [a, b, c, d, e]
TREE_PARENTS = [-1, -1, 0, 1, 2]


def _dirichlet(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    e = -torch.log1p(-torch.rand(rows, vocab, generator=gen, dtype=torch.float64))
    return (e / e.sum(-1, keepdim=True)).float()


def _run(tree_tokens: list[int], p: torch.Tensor, trials: int) -> list[Verdict]:
    """`trials` copies of one tree against the same target rows p [N + 1, V], global RNG."""
    torch.manual_seed(7)
    return accept_tree([tree_tokens] * trials, [TREE_PARENTS] * trials, p.repeat(trials, 1))


def _assert_follows_target(verdicts: list[Verdict], tree_tokens: list[int], p: torch.Tensor) -> None:
    """Token 1 follows p's root row; token j + 1, where token j was node i's token reached through the tree,
    follows row i + 1.  Each check needs enough samples to have power."""
    vocab = p.shape[1]
    by_row: dict[int, list[int]] = {}
    for v in verdicts:
        for token, row in zip(v.tokens, v.rows):
            by_row.setdefault(row, []).append(token)
    for row in (0, 1, 2, 3):  # root, a, b, c: each reached often enough at these p
        counts = np.bincount(by_row[row], minlength=vocab)
        assert counts.sum() > 2000, (row, counts.sum())
        pvalue = chi_square_p(counts, p[row].double().numpy())
        assert pvalue > PVALUE_MIN, f"tokens after row {row} do not follow the target (p-value {pvalue:.2g})"


def _peaked_target(gen: torch.Generator, tree_tokens: list[int]) -> torch.Tensor:
    """Rows where the drafted tokens are likely (so deep rows are reached) but far from certain."""
    p = _dirichlet(len(tree_tokens) + 1, 6, gen)
    for node, parent in enumerate(TREE_PARENTS):
        p[parent + 1, tree_tokens[node]] += 1.0
    return p / p.sum(-1, keepdim=True)


def test_tree_output_follows_the_target_token_by_token():
    gen = torch.Generator().manual_seed(3)
    tokens = [1, 2, 3, 4, 5]
    p = _peaked_target(gen, tokens)
    _assert_follows_target(_run(tokens, p, 40_000), tokens, p)


def accept_first_child(children, draft_ids, u, tests):
    """A broken walk (the negative control): every first child accepted, whatever the target says."""
    verdict, row = Verdict(tokens=[], rows=[0]), 0
    while children[row]:
        node = children[row][0]
        verdict.tokens.append(draft_ids[node])
        row = node + 1
        verdict.rows.append(row)
    return verdict, (row, 0)


def test_accept_first_child_control_fails_the_same_check(monkeypatch):
    """A walk that accepts every first child emits the drafts, not the target: the check above catches it."""
    gen = torch.Generator().manual_seed(3)
    tokens = [1, 2, 3, 4, 5]
    p = _peaked_target(gen, tokens)

    monkeypatch.setattr(verify_tree, "_walk", accept_first_child)
    with pytest.raises(AssertionError, match="do not follow the target"):
        _assert_follows_target(_run(tokens, p, 40_000), tokens, p)


def test_duplicate_siblings_are_tested_once():
    """A sibling repeating a rejected token can never be accepted (its mass is gone from the residual)."""
    p = torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3], [1 / 3, 1 / 3, 1 / 3]])
    torch.manual_seed(0)
    verdicts = accept_tree([[0, 0]] * 4000, [[-1, -1]] * 4000, p.repeat(4000, 1))
    assert all(v.rows[:2] != [0, 2] for v in verdicts)  # node 1 (the duplicate) is never the accepted one
    firsts = np.bincount([v.tokens[0] for v in verdicts], minlength=3)
    assert chi_square_p(firsts, np.array([0.5, 0.5, 0.0])) > PVALUE_MIN


def test_chain_equals_the_chain_verifier_with_seeded_rows():
    """On a chain, with the same generators, the tree walk and verify.accept (deterministic drafts) draw the
    same uniforms for the same tests: their outputs are equal row for row."""
    gen = torch.Generator().manual_seed(5)
    batch, k, vocab = 300, 4, 7
    p = _dirichlet(batch * (k + 1), vocab, gen).view(batch, k + 1, vocab)
    drafts = p[:, :k].argmax(-1)  # likely tokens, so chains get long
    drafts[::3] = torch.randint(0, vocab, (len(drafts[::3]), k), generator=gen)
    seeds = list(range(batch))
    chain = accept(drafts, None, p, [torch.Generator().manual_seed(s) for s in seeds])
    tree = accept_tree(drafts.tolist(), [list(range(-1, k - 1))] * batch, p.reshape(-1, vocab),
                       [torch.Generator().manual_seed(s) for s in seeds])
    for row, verdict in zip(chain.tolist(), tree):
        assert [t for t in row if t >= 0] == verdict.tokens
        assert verdict.rows == list(range(len(verdict.tokens)))


def test_sampled_chain_equals_the_chain_verifier_with_seeded_rows():
    """Drafts drawn from q (draft_probs): on a chain the walk is verify.accept's min(1, p/q) test and residual."""
    gen = torch.Generator().manual_seed(6)
    batch, k, vocab = 300, 3, 6
    p = _dirichlet(batch * (k + 1), vocab, gen).view(batch, k + 1, vocab)
    q = (0.5 * p[:, :k] + 0.5 * _dirichlet(batch * k, vocab, gen).view(batch, k, vocab))
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).view(batch, k)
    chain = accept(drafts, q, p, [torch.Generator().manual_seed(s) for s in range(batch)])
    tree = accept_tree(drafts.tolist(), [list(range(-1, k - 1))] * batch, p.reshape(-1, vocab),
                       [torch.Generator().manual_seed(s) for s in range(batch)], list(q))
    assert [[t for t in row if t >= 0] for row in chain.tolist()] == [v.tokens for v in tree]
    assert sum(len(v.tokens) - 1 for v in tree) > 100  # drafts were accepted, and rejected


def test_sampled_candidates_follow_the_target_token_by_token(monkeypatch):
    """Every row's children drawn independently from that row's q: the emitted tokens follow p row by row."""
    gen = torch.Generator().manual_seed(8)
    trials, vocab = 40_000, 6
    p = _peaked_target(gen, [1, 2, 3, 4, 5])
    q = torch.stack([0.5 * p[r] + 0.5 * _dirichlet(1, vocab, gen)[0] for r in range(3)])  # rows 0, 1, 2 have children
    # root -> {n0, n1} drawn from q[0]; n0 -> {n2} from q[1]; n1 -> {n3} from q[2]; n2 -> {n4}: token 5, fixed
    draws = torch.multinomial(q[[0, 0, 1, 2]], trials, replacement=True, generator=gen).T  # [trials, 4]
    tokens = [row + [5] for row in draws.tolist()]
    torch.manual_seed(2)
    verdicts = accept_tree(tokens, [TREE_PARENTS] * trials, p.repeat(trials, 1), None, [q] * trials)
    _assert_follows_target(verdicts, [], p)
    # control: a walk that keeps testing against p and draws the final token from p, not from the residual
    def no_residual(rows, limit=None):
        for j in range(rows.tokens.shape[1]):
            x = rows.tokens[:, j:j + 1].clamp(min=0)
            yield rows.probs.gather(1, x)[:, 0], rows.q.gather(1, x)[:, 0]
        yield rows.probs

    monkeypatch.setattr(verify_tree, "_residuals", no_residual)
    torch.manual_seed(2)
    control = accept_tree(tokens, [TREE_PARENTS] * trials, p.repeat(trials, 1), None, [q] * trials)
    with pytest.raises(AssertionError, match="do not follow the target"):
        _assert_follows_target(control, [], p)


def test_greedy_rows_take_the_child_equal_to_the_argmax():
    # argmax after the root is 2 (node 1, row 2), after node 1 it is 4 (node 3, row 4), after node 3 it is 0,
    # which node 4 (token 1) misses: emitted 2, 4, then the argmax 0 from row 4
    p = torch.nn.functional.one_hot(torch.tensor([2, 0, 4, 1, 0, 3]), 5).float()  # rows 0..5
    verdict, = accept_tree([[1, 2, 3, 4, 1]], [[-1, -1, 0, 1, 3]], p)
    assert verdict.tokens == [2, 4, 0] and verdict.rows == [0, 2, 4]
    miss, = accept_tree([[1, 3]], [[-1, -1]], p[:3])
    assert miss.tokens == [2] and miss.rows == [0]


def test_seeded_tree_is_independent_of_its_batch():
    gen = torch.Generator().manual_seed(9)
    tokens = [1, 2, 3, 4, 5]
    p = _peaked_target(gen, tokens)
    alone = accept_tree([tokens], [TREE_PARENTS], p, [torch.Generator().manual_seed(11)])
    batch = accept_tree([tokens, tokens[:2]], [TREE_PARENTS, [-1, 0]], torch.cat([p, p[:3]]),
                        [torch.Generator().manual_seed(11), None])
    assert batch[0] == alone[0]


def test_bad_trees_are_refused():
    with pytest.raises(ValueError, match="parent"):
        children_of([-1, 1])
    with pytest.raises(ValueError, match="rows"):
        accept_tree([[1, 2]], [[-1, 0]], torch.ones(2, 4) / 4)


def test_tree_geometry_of_the_spine_and_siblings_shape():
    parents = spine_and_siblings(2, 2)
    assert parents == [-1, 0, -1, 0]
    assert depths(parents) == [1, 2, 1, 2]
    assert children_of(parents) == [[0, 2], [1, 3], [], [], []]
    assert ancestor_mask(parents) == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0],
                                      [1, 1, 0, 0, 1]]
    assert spine_and_siblings(3, 1) == [-1, 0, 1]  # width 1: a chain
