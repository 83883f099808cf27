"""bench/head_objective.py's acceptance loss: one minus the T = 1 acceptance of a draft drawn from q, and its
place in head_loss (row_loss: masked and weighted per step as the cross-entropy)."""

import torch

from bench.head_objective import objective_loss, step_loss
from specdec.models.eagle3 import random_head
from specdec.models.loader import load_model
from specdec.train.head_loss import head_loss, soft_cross_entropy, unrolled_logits
from specdec.train.head_unroll import Eagle3Unroll
from tests.test_train_head import LAYERS, _signals


def test_the_acceptance_loss_is_one_minus_the_overlap_and_its_gradient_raises_the_overlap():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 1.0]])
    assert torch.allclose(step_loss(p, p.clamp(min=1e-30).log()), torch.zeros(2), atol=1e-6)  # q = p: all kept
    far = torch.tensor([[-30.0, -30.0, -30.0, 30.0], [30.0, -30.0, -30.0, -30.0]])
    assert torch.allclose(step_loss(p, far), torch.ones(2), atol=1e-6)  # disjoint: nothing kept
    logits = torch.zeros(2, 4, requires_grad=True)  # q uniform: kept with 0.25 + 0.25 + 0.2 and 0.25
    loss = step_loss(p, logits)
    assert torch.allclose(loss, torch.tensor([0.3, 0.75]))
    loss.sum().backward()
    stepped = step_loss(p, logits.detach() - 0.5 * logits.grad)
    assert (stepped < loss.detach()).all()  # a gradient step keeps more of p
    ce = -(p * logits.detach().log_softmax(-1)).sum(-1)
    assert torch.allclose(step_loss(p, logits.detach(), mix=0.5), loss.detach() + 0.5 * ce)


def test_a_row_loss_is_masked_and_weighted_per_step_as_the_cross_entropy(qwen3_dir):
    """head_loss with row_loss = the cross-entropy equals its default; the bench's tv objective equals the
    decay-weighted mean over real positions of 1 - sum min(p, q), written out here."""
    target = load_model(qwen3_dir, "cpu", torch.float32)
    head = random_head(target, seed=5, draft_vocab=64, std=0.3, feature_layers=LAYERS)
    ids = torch.tensor([[5, 17, 30, 2, 9, 44, 61, 3, 8, 12], [7, 4, 19, 22, 3, 0, 0, 0, 0, 0]])
    lengths = torch.tensor([10, 5])
    embed, features = _signals(qwen3_dir, ids)
    logprobs = torch.randn(2, 10, 64).log_softmax(-1)
    unroll = Eagle3Unroll(head)
    with torch.no_grad():
        default, _ = head_loss(unroll, embed, features, logprobs, lengths, 3, fused=False)
        as_row_loss, _ = head_loss(unroll, embed, features, logprobs, lengths, 3,
                                   row_loss=lambda lg, lp: soft_cross_entropy(lg, lp, False))
        tv = objective_loss("tv", unroll, embed, features, logprobs, lengths, 3)
        steps = unrolled_logits(unroll, embed, features, 3)
    torch.testing.assert_close(as_row_loss, default)
    positions = torch.arange(10)
    want = sum(0.8**s * step_loss(logprobs.exp(), lg)[(positions[None] + 1 < lengths[:, None]) & (positions[None] >= s)]
               .mean() for s, lg in enumerate(steps)) / sum(0.8**s for s in range(3))
    torch.testing.assert_close(tv, want)
