"""Prefix indexes: which physical block holds the K/V of a given full block of tokens.

A full block is identified by its parent (the block before it in the sequence),
its own token ids, and extra keys (adapter id, per-tenant cache salt).  Two
interchangeable indexes map that identity to a physical block:

  HashIndex   (vLLM style) a flat dict from a stable chained digest
              blake2b(parent digest || extra keys || token ids) to the block.
              The digest of block i covers every token before it, so one dict
              probe per block finds the longest cached run.
  RadixIndex  (SGLang style, page granular) a tree whose edges are the token
              tuples of one block, one subtree per extra-key tuple.  A lookup
              walks children dicts from the root.

Both expose the same three operations on opaque handles (the digest for the
hash index, the tree node for the radix index):

  lookup(parent, tokens, extra) -> (handle, block) | None
  insert(parent, tokens, extra, block) -> (handle, inserted?)
  remove(handle, block)

`parent` is ROOT for a sequence's first block, else the handle of the block
before it.  Eviction policy and reference counts live in BlockManager.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any, Hashable

import numpy as np

ROOT = None


def _extra_bytes(extra: tuple) -> bytes:
    return repr(extra).encode()


def block_hash(parent: bytes | None, tokens: tuple[int, ...], extra: tuple = ()) -> bytes:
    """Stable 128-bit digest of one full block (not Python's per-process salted hash)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else b"\x00root")
    e = _extra_bytes(extra)
    h.update(struct.pack("<I", len(e)))
    h.update(e)
    h.update(np.asarray(tokens, dtype="<i8").tobytes())
    return h.digest()


class HashIndex:
    name = "hash"

    def __init__(self):
        self._blocks: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, parent: Any, tokens: tuple[int, ...], extra: tuple) -> tuple[bytes, int] | None:
        key = block_hash(parent, tokens, extra)
        block = self._blocks.get(key)
        return None if block is None else (key, block)

    def insert(self, parent: Any, tokens: tuple[int, ...], extra: tuple, block: int) -> tuple[bytes, bool]:
        key = block_hash(parent, tokens, extra)
        if key in self._blocks:
            return key, False  # the same content is cached in another block already
        self._blocks[key] = block
        return key, True

    def remove(self, handle: bytes, block: int) -> None:
        if self._blocks.get(handle) == block:
            del self._blocks[handle]


class _Node:
    __slots__ = ("tokens", "block", "parent", "children")

    def __init__(self, tokens: tuple[int, ...] | None, block: int, parent: "_Node | None"):
        self.tokens = tokens
        self.block = block
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}


class RadixIndex:
    """Page-granular radix tree: each edge is one full block of tokens."""

    name = "radix"

    def __init__(self):
        self._roots: dict[Hashable, _Node] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def _children(self, parent: _Node | None, extra: tuple, create: bool) -> dict | None:
        if parent is not None:
            return parent.children
        root = self._roots.get(extra)
        if root is None:
            if not create:
                return None
            root = self._roots[extra] = _Node(None, -1, None)
        return root.children

    def lookup(self, parent: _Node | None, tokens: tuple[int, ...], extra: tuple) -> tuple[_Node, int] | None:
        children = self._children(parent, extra, create=False)
        node = None if children is None else children.get(tokens)
        return None if node is None else (node, node.block)

    def insert(self, parent: _Node | None, tokens: tuple[int, ...], extra: tuple, block: int) -> tuple[_Node, bool]:
        if parent is None:
            parent = self._roots.get(extra) or self._roots.setdefault(extra, _Node(None, -1, None))
        node = parent.children.get(tokens)
        if node is not None:
            return node, False
        node = _Node(tokens, block, parent)
        parent.children[tokens] = node
        self._size += 1
        return node, True

    def remove(self, handle: _Node, block: int) -> None:
        # Evicting an inner node detaches its subtree: those blocks stay in the
        # LRU and are reclaimed in turn.  LRU with deepest-first ties evicts
        # children before parents, so this is rare.
        parent = handle.parent
        if parent is not None and parent.children.get(handle.tokens) is handle:
            del parent.children[handle.tokens]
        self._size -= 1


def make_index(name: str):
    if name == "hash":
        return HashIndex()
    if name == "radix":
        return RadixIndex()
    raise ValueError(f"prefix_cache_index must be 'hash' or 'radix', got {name!r}")
