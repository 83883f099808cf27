"""bench/tree_headroom.py's exact m-draft acceptance against a simulation of recursive rejection sampling."""

from __future__ import annotations

import torch

from bench.tree_headroom import recursive_acceptance


def _simulate(p: torch.Tensor, q: torch.Tensor, m: int, trials: int, gen: torch.Generator):
    """Recursive rejection sampling of m drafts drawn independently from q: (share accepted, output counts)."""
    accepted, counts = 0, torch.zeros(p.shape[0])
    for _ in range(trials):
        residual, token = p.clone(), None
        for x in torch.multinomial(q, m, replacement=True, generator=gen).tolist():
            if torch.rand((), generator=gen) < min(1.0, float(residual[x] / q[x])):
                token = x
                break
            left = (residual - q).clamp(min=0)
            residual = left / left.sum()
        accepted += token is not None
        token = token if token is not None else int(torch.multinomial(residual, 1, generator=gen))
        counts[token] += 1
    return accepted / trials, counts / trials


def test_exact_acceptance_matches_the_simulation_and_the_output_follows_p():
    gen = torch.Generator().manual_seed(5)
    p = torch.rand(6, generator=gen) ** 3
    p, q = p / p.sum(), torch.rand(6, generator=gen)
    q = q / q.sum()
    exact = recursive_acceptance(p[None], q[None], [1, 2, 3])
    assert exact[1] < exact[2] < exact[3] <= 1.0
    for m in (1, 3):
        share, out = _simulate(p, q, m, 20000, gen)
        assert abs(share - float(exact[m][0])) < 0.015, (m, share, float(exact[m][0]))
        assert (out - p).abs().max() < 0.015  # lossless: the output still follows p


def test_the_worked_example():
    exact = recursive_acceptance(torch.tensor([[0.5, 0.5]]), torch.tensor([[1.0, 0.0]]), [1, 2])
    assert torch.allclose(exact[1], torch.tensor([0.5], dtype=torch.float64))
    assert torch.allclose(exact[2], torch.tensor([0.5], dtype=torch.float64))
