"""A prefix-cache hit over every layer group: how many of a sequence's leading full
blocks it can take from the cache, and each group's blocks for them.

Group 0 (global attention) finds its run of cached blocks in the prefix index; a
sliding-window group's cached blocks are found through group 0's handles.  The hit
is cut back until every sliding group holds the blocks that the window of the first
recomputed token reaches; blocks wholly before that window are not needed and stay
null in the group's table.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jpaged.core.block_allocator import NULL_BLOCK


@dataclasses.dataclass
class PrefixHit:
    """A usable cached prefix: num_blocks full blocks.  `tables`: each group's
    blocks for them (null where a sliding group needs none), `handles`: group
    0's prefix-index handles."""
    num_blocks: int = 0
    handles: list = dataclasses.field(default_factory=list)
    tables: list[list[int]] = dataclasses.field(default_factory=list)


def usable_prefix(handles: list[Any], blocks: list[int], found: list[list[int | None]],
                  first_needed: Callable[[int, int], int]) -> PrefixHit:
    """The longest head of group 0's cached run (`handles`, `blocks`) every group can use.

    found[g - 1][j]: group g's cached block for logical block j (None: not cached).
    first_needed(g, h): the first logical block group g needs when h blocks hit.
    """
    # last_missing[g][j]: the last logical block <= j that group g does not hold (-1: none)
    last_missing = []
    for row in found:
        marks, last = [], -1
        for j, block in enumerate(row):
            last = j if block is None else last
            marks.append(last)
        last_missing.append(marks)
    h = len(blocks)
    while h > 0:
        if all(marks[h - 1] < first_needed(g + 1, h) for g, marks in enumerate(last_missing)):
            break
        h -= 1
    tables = [blocks[:h]]
    for g, row in enumerate(found, start=1):
        first = min(first_needed(g, h), h)
        tables.append([NULL_BLOCK] * first + row[first:h])
    return PrefixHit(h, handles[:h], tables)
