"""How a model's projection weights lie in memory (issue 21: "weight layouts ... where that is faster").

A Linear layer computes x @ W^T with W [out, in].  Stored row-major (PyTorch's default) cuBLAS runs it as a
"TN" GEMM; stored column-major (the same [out, in] tensor, its memory [in, out]) as an "NN" GEMM, for which it
picks other kernels, which at decode's few rows stream the weights faster (docs/BENCHMARKS.md: the
`row-major-weights` variant of bench/decode.py).  The values, shapes and every module's code stay the same;
only strides change.

Fused projections (models/fused_linear.py: q/k/v, gate/up, a hybrid's in_proj) move as one tensor, their layers
re-pointed at its slices.  A Linear whose weight an Embedding shares (tied input/output embeddings) is left
row-major: an embedding lookup reads rows, which column-major storage would scatter.
"""

from __future__ import annotations

import torch
from torch import nn

from specdec.models.fused_linear import FusedProjection


def laid_out(weight: torch.Tensor, column_major: bool) -> torch.Tensor:
    """weight [out, in] with the same values, its memory column-major ([in, out] contiguous) or row-major."""
    return weight.t().contiguous().t() if column_major else weight.contiguous()


def is_column_major(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.t().is_contiguous() and not weight.is_contiguous()


def _lies_right(weight: torch.Tensor, column_major: bool) -> bool:
    """Whether weight is stored as asked already (a vector-shaped one, [1, n] or [n, 1], is both)."""
    return weight.t().is_contiguous() if column_major else weight.is_contiguous()


def lay_out_weights(model: nn.Module, column_major: bool = True) -> int:
    """Store every projection weight of `model` column-major (or back row-major), fused projections as one.
    Returns how many tensors moved.  Call it before any CUDA graph is captured: graphs keep the addresses."""
    moved = 0
    fused_layers = set()
    for module in model.modules():
        for fused in _fused_projections(module):
            fused_layers.update(id(layer) for layer in fused.layers)
            if not _lies_right(fused.weight, column_major):
                fused.set_weight(laid_out(fused.weight, column_major))
                moved += 1
    shared = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for module in model.modules():
        if type(module) is not nn.Linear or id(module) in fused_layers or id(module.weight) in shared:
            continue
        if not _lies_right(module.weight, column_major):
            module.weight.data = laid_out(module.weight.data, column_major)
            moved += 1
    return moved


def _fused_projections(module: nn.Module) -> list[FusedProjection]:
    """The fused projections a module holds (attributes, not submodules: q/k/v, gate/up, a hybrid's in_proj)."""
    return [p for p in vars(module).values() if isinstance(p, FusedProjection)]
