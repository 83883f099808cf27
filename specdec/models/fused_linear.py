"""Projections that read one input with one GEMM: q/k/v, and the MLP's gate/up.

A decode step at batch 1 is a chain of matrix-vector products, each a separate kernel that streams its
weight from memory; three small GEMVs (q, k, v) stream less efficiently than one large one and cost three
launches.  ``FusedProjection`` concatenates the weights of several ``nn.Linear`` layers that share an
input into one tensor and points each layer's weight at its slice of it (a view: no extra memory, the
checkpoint's module names and state dict unchanged).  ``linear(x)`` then runs one GEMM and returns the
parts.  If any layer's weight is later replaced (not updated in place), the fused path is dropped and the
layers run one by one, so a stale copy can never be used.

Example: q [4096 -> 4096], k [4096 -> 1024], v [4096 -> 1024] become one [6144, 4096] weight;
x [T, 4096] @ W.T -> [T, 6144], split into [T, 4096], [T, 1024], [T, 1024].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FusedProjection:
    def __init__(self, layers: list[nn.Linear]):
        self.layers = layers
        self.sizes = [layer.out_features for layer in layers]
        has_bias = layers[0].bias is not None
        self.bias = torch.cat([layer.bias.detach() for layer in layers]) if has_bias else None
        if has_bias:
            for layer, b in zip(layers, self.bias.split(self.sizes)):
                layer.bias.data = b
        self.set_weight(torch.cat([layer.weight.detach() for layer in layers]))  # [sum(out), in]

    def set_weight(self, weight: torch.Tensor) -> None:
        """Use `weight` [sum(out), in] (the layers' weights stacked, in any memory layout) and point each layer's
        weight at its slice of it."""
        self.weight = weight
        for layer, w in zip(self.layers, weight.split(self.sizes)):
            layer.weight.data = w
        self._ptrs = self._current_ptrs()

    @staticmethod
    def can_fuse(layers: list[nn.Module]) -> bool:
        """Plain nn.Linear layers (not quantised or sharded wrappers) with one input size, dtype and device."""
        if not all(type(layer) is nn.Linear for layer in layers):
            return False
        first = layers[0]
        return all(layer.in_features == first.in_features and layer.weight.dtype == first.weight.dtype
                   and layer.weight.device == first.weight.device
                   and (layer.bias is None) == (first.bias is None) for layer in layers)

    def _current_ptrs(self) -> tuple[int, ...]:
        return tuple(layer.weight.data_ptr() for layer in self.layers)

    def valid(self) -> bool:
        """The layers still read their slices of the fused weight (nobody replaced a weight since)."""
        return self._current_ptrs() == self._ptrs

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [T, in] -> one [T, out_i] per layer (views into one GEMM's output).  Inside torch.compile the
        check is skipped (dynamo cannot trace pointer comparisons; it would split the graph at each)."""
        if not torch.compiler.is_compiling() and not self.valid():
            return [layer(x) for layer in self.layers]
        return list(F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1))


def fuse(layers: list[nn.Module]) -> FusedProjection | None:
    return FusedProjection(layers) if FusedProjection.can_fuse(layers) else None
