"""Training for the reference model pair: pre-training (``lm``) and drafter distillation (``distill``)."""
