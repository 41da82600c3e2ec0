"""Speculative decoding: proposers of draft tokens (host side, no jax).

`ngram`: prompt lookup, drafts copied from earlier in the sequence.  The
verification in the ragged step and the engine's wiring are issue 25's next
steps."""
