"""Sampling: seeded reproducibility and distribution tests with power (plus negative controls)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec import SamplingParams
from tests.stats import chi_square_p

PROMPT = [5, 17, 30, 2, 9]
N_SAMPLES = 3000


def reference_distribution(llm, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The processed next-token distribution, computed independently in numpy from transformers' logits."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(llm.model_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, -1].numpy() / temperature
    p = np.exp(logits - logits.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, dtype=bool)
    mass = 0.0
    for rank, tok in enumerate(order):
        if (top_k and rank >= top_k) or mass >= top_p:
            break
        keep[tok] = True
        mass += p[tok]
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def sampled_counts(llm, params: SamplingParams) -> np.ndarray:
    outs = llm.generate([PROMPT] * N_SAMPLES, params)
    return np.bincount([o.token_ids[0] for o in outs], minlength=llm.engine.vocab_size)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.8), (1.3, 12, 1.0)])
def test_sampled_frequencies_follow_processed_distribution(llm, temperature, top_k, top_p):
    counts = sampled_counts(llm, SamplingParams(max_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p,
                                                seed=None))
    right = reference_distribution(llm, temperature, top_k, top_p)
    assert chi_square_p(counts, right) > 1e-3
    # negative control: the same samples must reject a nearby wrong distribution
    wrong = reference_distribution(llm, temperature * 1.6, top_k, top_p)
    assert chi_square_p(counts, wrong) < 1e-6


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate(PROMPT, params)[0].token_ids
    others = [SamplingParams(max_tokens=12, temperature=1.0, seed=s, ignore_eos=True) for s in range(5)]
    batch = llm.generate([[3, 4], PROMPT + [1], PROMPT, [9] * 7], [others[0], others[1], params, others[2]])
    assert batch[2].token_ids == alone
    assert llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True))[0] \
        .token_ids != alone


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].token_ids
    top1 = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0.9, top_k=1, ignore_eos=True))[0]
    assert top1.token_ids == greedy


def test_processed_probs_rows_equal_row_by_row_processing():
    from specdec.sampling import processed_probs, processed_probs_rows

    logits = torch.randn(6, 11, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.7, top_k=4), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.7, top_k=4), SamplingParams(top_p=0.5),
              SamplingParams(temperature=1.3), SamplingParams(temperature=0.0)]
    rows = processed_probs_rows(logits, params)
    for i, p in enumerate(params):
        assert torch.allclose(rows[i], processed_probs(logits[i:i + 1], p)[0])


def test_processed_probs_tensors_equal_row_by_row_processing():
    """Settings as tensors (the form a CUDA graph reads): each row as processed_probs gives it, for greedy rows,
    temperatures, top-k (with a tie at the k-th logit), top-p and both together."""
    from specdec.sampling import processed_probs, processed_probs_tensors

    logits = torch.randn(9, 40, generator=torch.Generator().manual_seed(5))
    logits[2, 7] = logits[2].topk(5).values[-1]  # row 2 (top_k 5) keeps both tokens tied at the 5th logit
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9),
              SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.3),
              SamplingParams(temperature=0.5, top_k=10, top_p=0.8), SamplingParams(temperature=0.0, top_k=3),
              SamplingParams(temperature=2.0, top_k=40), SamplingParams(temperature=1.0, top_p=0.3),
              SamplingParams(temperature=0.9, top_k=1)]
    rows = processed_probs_tensors(logits, torch.tensor([p.temperature for p in params]),
                                   torch.tensor([p.top_k for p in params]), torch.tensor([p.top_p for p in params]))
    for i, p in enumerate(params):
        torch.testing.assert_close(rows[i], processed_probs(logits[i:i + 1], p)[0], atol=1e-6, rtol=0)
    assert int((rows[2] > 0).sum()) == 6 and int((rows[8] > 0).sum()) == 1


def test_drafters_row_sampler_follows_each_rows_distribution_and_seeds_reproduce():
    from specdec.speculate.draw import draw_drafts

    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.0, 0.1, 0.1, 0.8]])
    t1 = SamplingParams(temperature=1.0)

    def sample(p, generators=None, draws=1):  # the drafters' draws from p (the logits log p at T = 1)
        rows = p.shape[0]
        return draw_drafts(p.log(), [t1] * rows, generators or [None] * rows, p.shape[1], draws=draws)[0]

    draws = sample(probs.repeat(20000, 1)).view(20000, 2)
    for row in range(2):
        counts = np.bincount(draws[:, row].numpy(), minlength=4)
        assert chi_square_p(counts, probs[row].numpy()) > 1e-3
    wrong = np.bincount(draws[:, 0].numpy(), minlength=4)  # negative control: row 0's draws against row 1
    assert chi_square_p(wrong, probs[1].numpy()) < 1e-6
    several = sample(probs[1:].repeat(20000, 1), draws=3)  # [20000, 3]: a tree's candidates, each a draw of p
    for column in range(3):
        assert chi_square_p(np.bincount(several[:, column].numpy(), minlength=4), probs[1].numpy()) > 1e-3
    seeded = [torch.Generator().manual_seed(s) for s in (5, 6)]
    again = [torch.Generator().manual_seed(s) for s in (5, 6)]
    first = torch.stack([sample(probs, seeded) for _ in range(50)])
    assert torch.equal(first, torch.stack([sample(probs, again) for _ in range(50)]))
    alone = torch.Generator().manual_seed(6)  # a seeded row's draws do not depend on its companions
    assert torch.equal(first[:, 1], torch.stack([sample(probs[1:], [alone])[0] for _ in range(50)]))
