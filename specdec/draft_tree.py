"""The geometry of a draft tree: parents -> children, depths, the verify step's ancestor mask, and the
static tree shape the EAGLE-3 head drafts.

A tree of N nodes hangs below the root (the newest committed token); parents[i] is -1 (the root) or an
earlier node.  The verify step feeds the root and the nodes in layout order, fed row 0 the root and row
i + 1 node i: node i sits at position root + depth(i) and sees the root's context, its ancestors and itself.

Example, the spine-and-siblings tree of depth 2 and width 2 (spine_and_siblings(2, 2)):
    nodes   0: spine depth 1 (parent -1)   1: spine depth 2 (parent 0)
            2: sibling of node 0 (parent -1)   3: sibling of node 1 (parent 0)
    depths  [1, 2, 1, 2]
    mask    root 1 0 0 0 0 / n0 1 1 0 0 0 / n1 1 1 1 0 0 / n2 1 0 0 1 0 / n3 1 1 0 0 1
"""

from __future__ import annotations

from collections.abc import Sequence


def children_of(parents: Sequence[int]) -> list[list[int]]:
    """[N + 1] lists: entry 0 the root's children, entry i + 1 node i's, in layout order."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for node, parent in enumerate(parents):
        if not -1 <= parent < node:
            raise ValueError(f"node {node}'s parent {parent} must be -1 (the root) or an earlier node")
        out[parent + 1].append(node)
    return out


def depths(parents: Sequence[int]) -> list[int]:
    """[N] each node's depth below the root (the root's children are at depth 1)."""
    out: list[int] = []
    for parent in parents:
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def ancestor_mask(parents: Sequence[int]) -> list[list[bool]]:
    """[N + 1][N + 1] row r (0: the root, i + 1: node i) marks the fed rows it may see: the root, its
    ancestors and itself."""
    size = len(parents) + 1
    rows = [[c == 0 for c in range(size)]]
    for node, parent in enumerate(parents):
        row = list(rows[parent + 1])
        row[node + 1] = True
        rows.append(row)
    return rows


def spine_and_siblings(depth: int, width: int) -> list[int]:
    """Parents of the tree the EAGLE-3 head drafts: a spine of `depth` nodes (its top token at each depth,
    nodes 0..depth-1), then at every depth its next width - 1 tokens as leaves beside that depth's spine node
    (the spine continues only through its first token: the head runs one forward per depth, as for a chain)."""
    spine = list(range(-1, depth - 1))
    leaves = [d - 1 for d in range(depth) for _ in range(width - 1)]
    return spine + leaves
