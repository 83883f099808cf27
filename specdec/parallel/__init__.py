"""Tensor parallelism over torch.distributed (specdec.parallel.tensor_parallel)."""
