"""Prompt lookup: draft tokens copied from where the sequence's last n tokens
occurred before.

Summaries, rewrites, code edits and RAG answers repeat spans of their prompt.
When the last n tokens (n from `max_n` down to `min_n`: the longest match
first) also occur earlier in the sequence, the tokens that followed that
earlier occurrence are a free guess at what comes next.  The most recent
earlier occurrence is used (the nearest context is the likeliest to repeat).
Host code, numpy only; one sequence at a time, O(len * n) per tried n.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose(token_ids: np.ndarray | list[int], *, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to k draft tokens (int32) for the sequence `token_ids`: the tokens after
    the most recent earlier occurrence of its longest suffix of min_n..max_n
    tokens; none (an empty array) when no such suffix occurs before."""
    if not 1 <= min_n <= max_n or k < 1:
        raise ValueError(f"need 1 <= min_n <= max_n and k >= 1, got min_n={min_n}, max_n={max_n}, k={k}")
    tokens = np.asarray(token_ids, dtype=np.int32)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        start = _last_earlier_occurrence(tokens, n)
        if start is not None:
            return tokens[start + n:start + n + k].copy()
    return np.zeros(0, np.int32)


def _last_earlier_occurrence(tokens: np.ndarray, n: int) -> int | None:
    """Start of the last occurrence of tokens[-n:] that ends before the last token."""
    windows = sliding_window_view(tokens[:-1], n)  # windows[i] = tokens[i:i+n], i + n <= len - 1
    hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
    return int(hits[-1]) if hits.size else None
