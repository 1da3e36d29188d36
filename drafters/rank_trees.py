"""Trees of candidate ranks, shared by the drafters that read a ranked list per depth: `medusa`
(head d's top candidates) and `recycling` (a token's recorded candidates). A path such as (0, 1)
is the best candidate at depth 1, then the second best below it.
"""
from __future__ import annotations

import heapq


def tree_from_accuracies(accuracy: list[list[float]], budget: int) -> list[tuple[int, ...]]:
    """accuracy[d][r] = measured probability that the rank-r candidate at depth d + 1 is right.
    Returns the `budget` paths with the highest product of accuracies, best first. A path is never
    chosen before its parent (factors <= 1), so the result is a connected tree."""
    heap = [(-accuracy[0][r], (r,)) for r in range(len(accuracy[0]))]
    heapq.heapify(heap)
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < budget:
        neg_p, path = heapq.heappop(heap)
        chosen.append(path)
        depth = len(path)
        if depth < len(accuracy):
            for r, a in enumerate(accuracy[depth]):
                heapq.heappush(heap, (neg_p * a, path + (r,)))
    return chosen


def sorted_tree(paths, drafter: str) -> tuple[list[tuple[int, ...]], list[int]]:
    """Paths in topological order (shorter first) with each path's parent index (-1 = root);
    `drafter` names whose tree option a disconnected path came from."""
    paths = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(paths)}
    parents = []
    for p in paths:
        if len(p) > 1 and p[:-1] not in index:
            raise ValueError(f"{drafter} tree: path {list(p)} has no parent path {list(p[:-1])}; a tree must be connected")
        parents.append(index[p[:-1]] if len(p) > 1 else -1)
    return paths, parents
