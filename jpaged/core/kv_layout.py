"""Which layers share a block table: the KV cache's layer groups.

A pool block (a page) holds `layers_per_page` layers' K/V for block_size
tokens.  Every layer belongs to one group, and every group has its own block
table per sequence, so that groups can hold different blocks:

* shared (one group of every layer): a block holds the whole model's K/V for
  its tokens; the layout of models without sliding-window layers, and of any
  model with kv_layout=shared.
* hybrid (vLLM's hybrid allocator; Gemma 2 and 3): global layers and
  sliding-window layers sit in different groups.  A sliding group holds a
  sequence's blocks only while a future query can still see them: a block
  wholly before the window of the next token to be computed is given back
  (its table entry becomes the null block, which the kernels never read
  there).  All groups draw equal-sized pages from one pool and one free list,
  so a page freed by a sliding group can hold any group's next block.  The
  page size is the smallest group's layer count; the other layers are split
  into groups of that many (the last one padded with unused slots): Gemma 2's
  13 global + 13 sliding layers make 2 groups of 13, Gemma 3 1B's 4 global +
  22 sliding make 1 + 6 groups of 4 (2 slots unused).

Group 0 is always a global group when the model has one: its blocks' prefix
cache keys name a block's content; the other groups' cached blocks are found
through group 0's keys (jpaged.core.block_manager).

Host-side only (no jax); the model places its layers with the same
`kv_layout(cfg)` when a step's metadata carries the other groups' tables.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, get_args

from jpaged.core.model_config import ModelConfig
from jpaged.core.rounding import cdiv

# The kv_layout config field's choices ("auto": by the model; "shared": one table).
KVLayoutName = Literal["auto", "shared"]
KV_LAYOUTS: tuple[str, ...] = get_args(KVLayoutName)


@dataclasses.dataclass(frozen=True)
class KVLayout:
    layers_per_page: int
    groups: tuple[tuple[int, ...], ...]     # the layers of each group, by slot
    windows: tuple[int | None, ...]          # each group's sliding window (None: global)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1

    def place(self, layer: int) -> tuple[int, int]:
        """(group, slot within the page) of `layer`."""
        for g, layers in enumerate(self.groups):
            if layer in layers:
                return g, layers.index(layer)
        raise ValueError(f"layer {layer} is in no group")

    def first_needed_block(self, group: int, position: int, block_size: int) -> int:
        """The first logical block of `group` that the token at `position`, or any
        later one, can read: 0 for a global group."""
        window = self.windows[group]
        if window is None or not self.is_hybrid:
            return 0
        return max(0, position - window + 1) // block_size

    def max_pages_per_seq(self, max_model_len: int, block_size: int, max_chunk: int) -> int:
        """The most pages one sequence holds at once (a chunk of up to max_chunk new
        tokens in flight): every block for global groups, the window's for sliding ones."""
        full = cdiv(max_model_len, block_size)
        return sum(full if w is None or not self.is_hybrid else
                   min(full, cdiv(w - 1 + max_chunk, block_size) + 1) for w in self.windows)


@functools.cache
def kv_layout(cfg: ModelConfig, kv_layout_name: str = "auto") -> KVLayout:
    """The layout for `cfg`: hybrid when kv_layout_name is "auto" and the model mixes
    sliding-window and global layers (one window size), else one shared group."""
    if kv_layout_name not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout_name!r}")
    windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]
    full = tuple(i for i, w in enumerate(windows) if w is None)
    sliding = tuple(i for i, w in enumerate(windows) if w is not None)
    if kv_layout_name == "shared" or not full or not sliding or len({windows[i] for i in sliding}) > 1:
        return KVLayout(cfg.num_layers, (tuple(range(cfg.num_layers)),), (None,))
    size = min(len(full), len(sliding))
    groups, group_windows = [], []
    for layers, window in ((full, None), (sliding, windows[sliding[0]])):
        for i in range(0, len(layers), size):
            groups.append(layers[i:i + size])
            group_windows.append(window)
    return KVLayout(size, tuple(groups), tuple(group_windows))

