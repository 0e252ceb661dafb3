"""Grouping decode rows by context length, so padded attention wastes little work.

The torch backend pads every decode row of a group to the group's longest context.
With contexts of 64 and 768 tokens in one batch, one group does ~2x the needed
work; one group per row pays a fixed per-group cost (a dozen small ops per layer)
64 times. :func:`group_by_length` sorts rows by length in blocks and splits them
optimally (dynamic programming) under the cost ``rows * max_blocks + group_cost``.
"""

from __future__ import annotations

# Fixed cost of one more group, in "row-blocks" of attention work (measured on CPU:
# ~2 us per row-block per layer vs ~150 us of per-group op overhead per layer).
DEFAULT_GROUP_COST = 64


def group_by_length(
    rows: list[int], num_blocks: list[int], group_cost: int = DEFAULT_GROUP_COST
) -> list[list[int]]:
    """Partition ``rows`` (with ``num_blocks[i]`` blocks each) into length groups.

    Returns groups of row ids, shortest contexts first; every row in exactly one group.
    """
    if not rows:
        return []
    order = sorted(range(len(rows)), key=lambda i: num_blocks[i])
    n = len(order)
    best = [0] + [0] * n  # best[j]: cost of the first j sorted rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        width = num_blocks[order[j - 1]]  # the longest of any group ending at j
        best[j], cut[j] = min((best[i] + (j - i) * width + group_cost, i) for i in range(j))
    groups: list[list[int]] = []
    j = n
    while j > 0:
        i = cut[j]
        groups.append([rows[order[k]] for k in range(i, j)])
        j = i
    return groups[::-1]
