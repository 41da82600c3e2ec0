"""Snapshot: the paged engine's greedy outputs must equal a contiguous-cache
engine's (block_size = max_model_len, so every sequence is one contiguous block).
Exits non-zero on any difference.

    python benchmarks/bench_snapshot.py [--block_size=16 --max_model_len=256 --max_tokens=128]
"""

from __future__ import annotations

import sys

from absl import app, flags

import harness as B  # benchmarks/harness.py (the script's own directory is on sys.path)

_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Paged engine's block size.")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", 256, "Both engines; also the contiguous block size (<= 256).")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 128, "Max new tokens.")


def main(argv):
    del argv
    B.header("snapshot")
    L = _MAX_MODEL_LEN.value
    prompts, params = B.chat(B.DEFAULT_PROMPTS), B.greedy(_MAX_TOKENS.value)
    res = {}
    for name, bs in (("paged", _BLOCK_SIZE.value), ("contiguous", L)):
        llm = B.make_llm(block_size=bs, max_model_len=L, max_num_seqs=len(prompts))
        res[name] = B.timed_generate(llm, prompts, params)[0]
        del llm
    rows, bad = [], 0
    for i, (p, c) in enumerate(zip(res["paged"], res["contiguous"])):
        same = p.token_ids == c.token_ids
        bad += not same
        first = next((k for k, (a, b) in enumerate(zip(p.token_ids, c.token_ids)) if a != b),
                     None if len(p.token_ids) == len(c.token_ids) else min(len(p.token_ids), len(c.token_ids)))
        rows.append({"seq": i, "prompt": B.DEFAULT_PROMPTS[i][:40], "paged_tokens": len(p.token_ids),
                     "contiguous_tokens": len(c.token_ids), "identical": "yes" if same else "NO",
                     "first_diff": first})
    B.report("snapshot", rows, title=f"Paged (block {_BLOCK_SIZE.value}) vs contiguous (block {L}), greedy")
    print(f"\n{'PASS' if not bad else 'FAIL'}: {len(rows) - bad}/{len(rows)} outputs identical")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    app.run(main)
