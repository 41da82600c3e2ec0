"""KV held per sequence by Gemma-shaped models: one shared block table for every
layer vs the hybrid layout (sliding-window layers in tables of their own that
give back the blocks behind their window; jpaged.core.kv_layout).

    python benchmarks/bench_kv_layout.py [--lengths=4096,16384 --engine_lengths=4096,16384]

Two measurements per model shape, layout and sequence length (a prompt of that
many tokens prefilled in chunks of --chunk, then one decode step):

* `host`: the block manager alone with the real model's layer pattern, window
  and KV dims (no weights): blocks held at the end, and their bytes in the
  model's real per-block size (bf16 pool).
* `engine`: scripts' LLM on random weights (load_format=dummy) with the model's
  layer count, pattern and window but a small width (hidden 64, 2 KV heads of
  16), through the whole step: the peak blocks in use (EngineStats) after one
  request of that length (during prefill a sliding group also holds the chunk
  in flight, up to --chunk tokens past its window).  Blocks counted per page;
  the byte figures use the real model's dims.

Shapes: Gemma 2 2B (26 layers alternating window 4096 / global, 4 KV heads of
256) and Gemma 3 1B (26 layers, a global layer every 6th, window 512, 1 KV
head of 256).  Writes benchmarks/results/kv_layout.{csv,md}.
"""

from __future__ import annotations

import json
import pathlib
import tempfile
import time

from absl import app, flags

import harness as B  # benchmarks/harness.py (the script's own directory is on sys.path)
from jpaged.core.block_manager import NULL_BLOCK, BlockManager
from jpaged.core.kv_layout import kv_layout
from jpaged.core.model_config import FULL, SLIDING, ModelConfig
from jpaged.core.sequence import SamplingParams, Sequence
from jpaged.runtime.kv_pool import bytes_per_block

_LENGTHS = flags.DEFINE_list("lengths", ["4096", "16384"], "Sequence lengths (host measurement).")
_ENGINE_LENGTHS = flags.DEFINE_list("engine_lengths", ["4096", "16384"], "Sequence lengths run through the engine.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Tokens per block.")
_CHUNK = flags.DEFINE_integer("chunk", 2048, "Prefill chunk (max_num_batched_tokens).")

SHAPES = {
    "gemma2-2b": dict(model_type="gemma2", num_hidden_layers=26, num_key_value_heads=4, head_dim=256,
                      sliding_window=4096, layer_types=[SLIDING if i % 2 == 0 else FULL for i in range(26)]),
    "gemma3-1b": dict(model_type="gemma3_text", num_hidden_layers=26, num_key_value_heads=1, head_dim=256,
                      sliding_window=512,
                      layer_types=[FULL if (i + 1) % 6 == 0 else SLIDING for i in range(26)]),
}


def real_config(shape: dict) -> ModelConfig:
    return ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                       num_layers=shape["num_hidden_layers"], num_heads=shape["num_key_value_heads"],
                       num_kv_heads=shape["num_key_value_heads"], head_dim=shape["head_dim"],
                       rms_norm_eps=1e-6, rope_theta=1e4, architecture="gemma",
                       sliding_window=shape["sliding_window"], layer_types=tuple(shape["layer_types"]))


def host_blocks(cfg: ModelConfig, layout_name: str, length: int) -> list[int]:
    """Blocks one sequence of `length` tokens holds in each group after chunked
    prefill and one decode."""
    bs, chunk = _BLOCK_SIZE.value, _CHUNK.value
    layout = kv_layout(cfg, layout_name)
    bm = BlockManager(1 + 4 * (length // bs + 2) * layout.num_groups, bs, enable_prefix_caching=False,
                      layout=layout)
    seq = Sequence(0, list(range(length)), SamplingParams())
    assert bm.admit(seq, bm.find_hit(seq), 0, min(chunk, length))
    seq.num_computed_tokens = min(chunk, length)
    while seq.num_computed_tokens <= length:     # the rest of the prompt, then one decode token
        end = min(seq.num_computed_tokens + chunk, length + 1)
        assert bm.prepare_seq_write(seq, seq.num_computed_tokens, end)
        seq.num_computed_tokens = end
    return [sum(b != NULL_BLOCK for b in t.block_ids) for t in bm.tables(seq)]


def engine_peak_blocks(shape: dict, layout_name: str, length: int, root: pathlib.Path) -> tuple[int, float]:
    """(peak blocks in use, seconds) of one dummy-weight request of `length` tokens."""
    from jpaged.engine.llm import LLM
    config = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "rms_norm_eps": 1e-6, "max_position_embeddings": length + 64, **shape,
              "num_key_value_heads": 2, "head_dim": 16}
    path = root / f"{shape['model_type']}.json"
    path.write_text(json.dumps(config))
    llm = LLM(model=str(path), load_format="dummy", kv_layout=layout_name, block_size=_BLOCK_SIZE.value,
              max_model_len=length + 8, max_num_seqs=1, max_num_batched_tokens=_CHUNK.value,
              num_blocks=1 + 2 * (length // _BLOCK_SIZE.value + 2) * 8, enable_prefix_caching=False,
              buckets_per_octave=1)
    t0 = time.perf_counter()
    out = llm.generate([[1 + i % 255 for i in range(length)]], SamplingParams(max_tokens=1, ignore_eos=True))[0]
    assert out.finish_reason == "length", out.error
    return llm.stats.peak_blocks_used, time.perf_counter() - t0


def main(argv):
    del argv
    B.header("kv layout")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in SHAPES.items():
            cfg = real_config(shape)
            for length in map(int, _LENGTHS.value):
                row = {"model": name, "tokens": length}
                for layout_name in ("shared", "auto"):
                    layout = kv_layout(cfg, layout_name)
                    label = "hybrid" if layout.is_hybrid else "shared"
                    groups = host_blocks(cfg, layout_name, length)
                    page = bytes_per_block(cfg, _BLOCK_SIZE.value, "bfloat16", layout.layers_per_page)
                    row[f"{label}_blocks"] = sum(groups)
                    row[f"{label}_layers_per_block"] = layout.layers_per_page
                    row[f"{label}_mib"] = sum(groups) * page / 2**20
                    if layout.is_hybrid:
                        row["hybrid_global_blocks"] = groups[0]
                        row["hybrid_sliding_blocks_per_group"] = groups[-1]
                    if str(length) in _ENGINE_LENGTHS.value:
                        peak, secs = engine_peak_blocks(shape, layout_name, length, pathlib.Path(tmp))
                        row[f"{label}_engine_peak_blocks"] = peak
                        row[f"{label}_engine_peak_mib"] = peak * page / 2**20
                        print(f"{name} {label} {length} tokens: engine peak {peak} blocks ({secs:.0f} s)")
                row["kv_saved_pct"] = 100 * (1 - row["hybrid_mib"] / row["shared_mib"])
                rows.append(row)
                print(row)
    B.write_csv("kv_layout.csv", rows)
    lines = ["| model | tokens | shared: blocks (layers each) | hybrid: blocks (layers each) = global + "
             "groups x sliding | KV held, MiB: shared → hybrid | saved | engine peak (prefill chunk in "
             "flight), blocks: shared / hybrid | engine peak, MiB: shared → hybrid |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        n_sliding = (r["hybrid_blocks"] - r["hybrid_global_blocks"]) // max(r["hybrid_sliding_blocks_per_group"], 1)
        peak_mib = (f"{r['shared_engine_peak_mib']:.0f} → {r['hybrid_engine_peak_mib']:.0f}"
                    if "hybrid_engine_peak_mib" in r else "")
        lines.append(f"| {r['model']} | {r['tokens']} | {r['shared_blocks']} ({r['shared_layers_per_block']}) | "
                     f"{r['hybrid_blocks']} ({r['hybrid_layers_per_block']}) = {r['hybrid_global_blocks']} + "
                     f"{n_sliding} x {r['hybrid_sliding_blocks_per_group']} | "
                     f"{r['shared_mib']:.0f} → {r['hybrid_mib']:.0f} | {r['kv_saved_pct']:.0f} % | "
                     f"{r.get('shared_engine_peak_blocks', '')} / {r.get('hybrid_engine_peak_blocks', '')} | "
                     f"{peak_mib} |")
    (B.RESULTS / "kv_layout.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    app.run(main)
