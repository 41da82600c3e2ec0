"""Prompt lookup (jpaged.speculative.ngram): drafts are what followed the most
recent earlier occurrence of the longest matching suffix, checked against a
plain-Python oracle on random sequences over small vocabularies (many repeats)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jpaged.speculative.ngram import propose


def oracle(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # ends before the last token
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40), min_n=st.integers(1, 3),
       extra=st.integers(0, 3), k=st.integers(1, 6))
def test_matches_the_oracle(tokens, min_n, extra, k):
    got = propose(tokens, min_n=min_n, max_n=min_n + extra, k=k)
    assert got.dtype == np.int32 and got.tolist() == oracle(tokens, min_n, min_n + extra, k)


def test_copies_a_repeated_passage():
    passage = list(range(100, 120))
    tokens = [1, 2, 3] + passage + [7, 8] + passage[:5]  # the answer starts quoting the passage
    assert propose(tokens, min_n=2, max_n=4, k=5).tolist() == passage[5:10]


def test_prefers_the_longest_match_then_the_most_recent():
    tokens = [5, 9, 1, 5, 6, 2, 4, 5, 6, 3, 4, 5, 6]
    # suffix (4, 5, 6) occurred at index 6: followed by 3 (not the 1-gram's or 2-gram's later hits)
    assert propose(tokens, min_n=1, max_n=3, k=2).tolist() == [3, 4]
    assert propose([1, 2, 1, 3, 1], min_n=1, max_n=1, k=1).tolist() == [3]  # the most recent "1"


def test_no_match_and_short_sequences():
    assert propose([1, 2, 3, 4], min_n=1, max_n=3, k=4).size == 0
    assert propose([7], min_n=1, max_n=3, k=4).size == 0
    assert propose([7, 7], min_n=1, max_n=3, k=4).tolist() == [7]  # runs up to the end at most


@pytest.mark.parametrize("kwargs", [dict(min_n=0, max_n=2, k=1), dict(min_n=3, max_n=2, k=1),
                                    dict(min_n=1, max_n=2, k=0)])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError, match="min_n"):
        propose([1, 2, 1], **kwargs)
