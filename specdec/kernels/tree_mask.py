"""The layouts of a tree-verify mask, shared by the Triton kernel and the SDPA path (no triton needed here).

A tree mask is bool, True where query i of a sequence may see that sequence's new token j (an ancestor or
itself); every committed key stays visible.  Q (its last dimension) is at least every sequence's query count.
Example: a static tree root -> {a, b}, a -> c, laid out [root, a, b, c], is the [4, 4] mask
    root 1 0 0 0 / a 1 1 0 0 / b 1 0 1 0 / c 1 1 0 1.
"""

from __future__ import annotations

import torch

LAYOUTS = ("shared", "per_seq", "per_row")


def tree_layout(tree_mask: torch.Tensor, num_seqs: int, num_rows: int) -> str:
    """"shared" [Q, Q] (one static draft tree for every sequence), "per_seq" [B, Q, Q] or "per_row" [T, Q]
    (one row per flat query).  A 2-D mask with T rows is per row; T == Q reads the same either way (one
    sequence then holds every query, from flat row 0)."""
    if tree_mask.dim() == 3:
        if tree_mask.shape[0] != num_seqs:
            raise ValueError(f"a [B, Q, Q] tree mask needs {num_seqs} trees, got {tree_mask.shape[0]}")
        return "per_seq"
    if tree_mask.dim() != 2:
        raise ValueError(f"a tree mask is [Q, Q], [B, Q, Q] or [T, Q], got {tuple(tree_mask.shape)}")
    if tree_mask.shape[0] == num_rows:
        return "per_row"
    if tree_mask.shape[0] != tree_mask.shape[1]:
        raise ValueError(f"a shared tree mask is square, got {tuple(tree_mask.shape)}")
    return "shared"


def tree_strides(tree_mask: torch.Tensor | None, num_seqs: int, num_rows: int) -> tuple[int, int, int, int]:
    """Element strides (sequence, flat row, query, new key) of the mask: entry (b, t, i, j) sits at
    b * s0 + t * s1 + i * s2 + j * s3; a layout ignores the coordinates it does not have (stride 0)."""
    if tree_mask is None:
        return 0, 0, 0, 0
    layout = tree_layout(tree_mask, num_seqs, num_rows)
    if layout == "per_seq":
        return tree_mask.stride(0), 0, tree_mask.stride(1), tree_mask.stride(2)
    if layout == "per_row":
        return 0, tree_mask.stride(0), 0, tree_mask.stride(1)
    return 0, 0, tree_mask.stride(0), tree_mask.stride(1)
