"""Block allocation and block tables, driving the engine step by step.

    python benchmarks/bench_alloc_table.py [--block_size=16 --max_tokens=128 --background=0]

Part 1 (alloc): the 8 demo prompts under continuous batching; blocks each
request held at its peak vs what a contiguous max_model_len reservation takes.
Part 2 (table): one sequence's block table printed at every block boundary;
prefill is chunked to block_size tokens per step so prompt blocks show up one
by one.  --background=N runs N other requests alongside, so physical block ids
interleave as they would in a real batch.
"""

from __future__ import annotations

import math

from absl import app, flags

import harness as B  # benchmarks/harness.py (the script's own directory is on sys.path)

_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "KV block size.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 128, "Max new tokens.")
_BACKGROUND = flags.DEFINE_integer("background", 0, "Other requests running alongside the table demo.")
_PROMPT = flags.DEFINE_string("prompt", "Explain how the attention mechanism works in a transformer model.",
                              "Prompt of the table demo.")


def print_table(seq, bs: int, label: str) -> None:
    n = seq.num_computed_tokens
    print(f"\n  [{label}]  ({n} tokens in KV cache)")
    print(f"  {'logical':>8}  {'physical':>8}  {'tokens':>12}  {'fill':>7}")
    for i, phys in enumerate(seq.block_table.block_ids):
        lo, hi = i * bs, min(n, (i + 1) * bs) - 1
        fill = max(0, hi - lo + 1)
        rng = f"{lo}-{hi}" if fill else "-"
        print(f"  {i:>8}  {phys:>8}  {rng:>12}  {fill:>3}/{bs:<3}")


def main(argv):
    del argv
    B.header("alloc and table")
    bs = _BLOCK_SIZE.value
    llm = B.make_llm(block_size=bs, max_num_seqs=8)
    params = B.greedy(_MAX_TOKENS.value)
    # ---- part 1: blocks per request
    peak: dict[int, int] = {}
    ids = [llm.add_request(llm.tokenize(p), params, prompt=p["prompt"]) for p in B.chat(B.DEFAULT_PROMPTS)]
    seqs = {i: llm.get_sequence(i) for i in ids}
    while llm.has_unfinished_requests():
        llm.step()
        for i, s in seqs.items():
            peak[i] = max(peak.get(i, 0), len(s.block_table.block_ids))
    static_blocks = math.ceil(llm.config.max_model_len / bs)
    rows = []
    for i, s in seqs.items():
        # The last sampled token's K/V is never written; a block allocated and freed
        # within the finishing step is not seen between steps, hence the max().
        kv = s.num_tokens - 1
        used = max(peak[i], math.ceil(kv / bs))
        rows.append({"seq": i, "prompt": s.prompt[:34], "tokens": s.num_tokens, "kv_tokens": kv,
                     "blocks_used": used, "slots_unused": used * bs - kv, "static_blocks": static_blocks})
    print(f"pool capacity: {llm.num_blocks - 1} blocks of {bs} tokens")
    B.report("alloc", rows, title=f"Blocks used per request (block_size {bs}); static = "
                                  f"max_model_len {llm.config.max_model_len} reserved contiguously")
    fig, (ax,) = B.figure(1, 7)
    ax.bar([str(r["seq"]) for r in rows], [r["blocks_used"] for r in rows], label="paged: blocks used")
    ax.axhline(static_blocks, color="r", ls="--", label=f"static reservation ({static_blocks})")
    ax.set_yscale("log"); ax.set_xlabel("request"); ax.set_ylabel("blocks"); ax.legend()
    B.save_figure("alloc", fig, "Blocks used per request")

    # ---- part 2: one sequence's block table at each block boundary
    llm = B.make_llm(block_size=bs, max_num_seqs=1 + _BACKGROUND.value, max_num_batched_tokens=bs)
    for p in B.chat(B.DEFAULT_PROMPTS[: _BACKGROUND.value]):
        llm.add_request(llm.tokenize(p), params)
    tok = llm.tokenize({"prompt": _PROMPT.value})
    sid = llm.add_request(tok, params, prompt=_PROMPT.value)
    seq = llm.get_sequence(sid)
    print(f'\nprompt: "{_PROMPT.value}" (chat template)\nprompt tokens: {len(tok)}  block_size: {bs}'
          f"  background requests: {_BACKGROUND.value}")
    nblocks, prefilled, history = 0, False, []
    while not seq.is_done:
        llm.step()
        n = seq.num_computed_tokens
        if not prefilled and n >= len(tok):
            prefilled = True
            print_table(seq, bs, f"after prefill ({len(tok)} prompt tokens)")
        elif n and n % bs == 0:
            print_table(seq, bs, f"after token {n}")
        if len(seq.block_table.block_ids) != nblocks:
            nblocks = len(seq.block_table.block_ids)
            history.append({"tokens_in_cache": n, "blocks": nblocks,
                            "block_ids": " ".join(map(str, seq.block_table.block_ids))})
    print(f"\ngenerated: {len(seq.output_token_ids)}  total: {seq.num_tokens}  "
          f"blocks at the end: {max((h['blocks'] for h in history), default=0)} (all freed on finish)")
    B.write_csv("table", history)


if __name__ == "__main__":
    app.run(main)
