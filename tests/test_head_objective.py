"""bench/head_objective.py's acceptance loss: one minus the T = 1 acceptance of a draft drawn from q."""

import torch

from bench.head_objective import step_loss


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
