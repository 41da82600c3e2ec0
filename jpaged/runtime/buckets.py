"""The step-size ladder: which token counts get a compiled step program, and
which of them `precompile` builds ahead."""

from __future__ import annotations

from jpaged.core.rounding import next_pow2


def token_buckets(max_num_batched_tokens: int, max_num_seqs: int, per_octave: int = 8,
                  min_tokens: int = 8) -> tuple[int, ...]:
    """The step-size ladder, each bucket one compiled program.

    Up to 16 tokens: powers of two from min(min_tokens, max_num_seqs rounded up)
    (`min_step_tokens` says why the smallest differs by kernel).  Above 16 a step's
    cost grows with its tokens (on this CPU a decode at 32-64 tokens is bound by
    its matmuls), so each octave
    [2^k, 2^(k+1)) is cut into `per_octave` equal rungs: 16, 18, ..., 32, 36, ...,
    64, 72, ... and no step above 16 tokens pads by more than 1/per_octave.  Only
    the buckets a run's steps land on are ever built.  The budget itself closes
    the ladder.  per_octave=1 is the plain power-of-two ladder."""
    min_tokens = min(min_tokens, next_pow2(max_num_seqs))
    top = max(max_num_batched_tokens, 1)
    ladder, b = [], min_tokens
    while b < top:
        ladder.append(b)
        b += b if b < 16 else max(1, (1 << (b.bit_length() - 1)) // per_octave)
    return tuple(ladder + [top])


def min_step_tokens(configured: int, attention_impl: str) -> int:
    """The smallest bucket: config min_step_tokens, its 0 resolved by the attention
    kernel (the field's description says why)."""
    return configured or (1 if attention_impl in ("reference", "cpu") else 8)


def precompile_buckets(ladder: tuple[int, ...], max_num_tokens: int | None = None) -> list[int]:
    """What precompile builds: the power-of-two rungs of the ladder up to the bucket
    of max_num_tokens (default: the top), and that bucket.  Every step then has a
    ready bucket at most twice its own (and its own arrives in the background),
    for log2 of the programs a full ladder would cost."""
    limit = ladder[-1] if max_num_tokens is None else next((b for b in ladder if b >= max_num_tokens), ladder[-1])
    return [b for b in ladder if b < limit and b & (b - 1) == 0] + [limit]
