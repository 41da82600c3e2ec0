"""The engine's configuration: one ml_collections ConfigDict with every knob.

Experiment files under configs/ start from `default_config()` and override
fields; every field can also be overridden on the command line as
`--config.field=value`.
"""

from __future__ import annotations

import ml_collections


def default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    # Model: "smollm2-135m" (embedded GGUF), a .gguf path, or a HF checkpoint dir.
    c.model = "smollm2-135m"
    c.load_format = "auto"          # auto | gguf | hf | dummy (random weights)
    c.dtype = "float32"             # float32 | bfloat16: weights and activations
    c.kv_cache_dtype = "auto"       # auto (= dtype) | float32 | bfloat16: the KV pool
    c.cache_dir = ""                # converted-weights cache; "" -> $JPAGED_CACHE_DIR or ~/.cache/jpaged
    c.compilation_cache = True      # persist compiled steps under <cache_dir>/xla (fast restarts)
    # KV pool
    c.block_size = 16               # tokens per block, 1..256
    c.num_blocks = 0                # 0 -> sized from kv_memory_fraction
    c.kv_memory_fraction = 0.3      # of the memory left after the weights
    # Automatic prefix caching: full blocks are reused across requests by content
    c.enable_prefix_caching = True
    c.prefix_cache_index = "hash"   # hash (chained block digests) | radix (token-block tree)
    # Scheduling
    c.scheduler = "continuous"      # continuous | static
    c.max_num_seqs = 16             # sequences running at once
    c.max_num_batched_tokens = 1024 # tokens per step, decodes and prefill chunks (>= max_num_seqs)
    c.max_model_len = 2048          # prompt + generated tokens per sequence
    # Oversubscription: sequences are admitted while blocks are free; when a running
    # one needs a block and none is left, the latest-arrived running sequence is
    # preempted: "recompute" drops its K/V (it prefills prompt + output again on
    # resume), "swap" copies its blocks to a host pool of swap_space_gb (falling
    # back to recompute for a victim that does not fit there).
    c.preemption_mode = "recompute"  # recompute | swap
    c.swap_space_gb = 4.0           # host memory for swapped-out blocks
    # Default sampling (each request may override)
    c.max_new_tokens = 128
    c.temperature = 0.0
    c.top_p = 1.0
    c.top_k = 0
    c.seed = 0
    # Attention: reference (jnp) | cpu (C++ kernel) | pallas_gpu | pallas_tpu | auto (by backend)
    c.attention_impl = "auto"
    # Layer loop of the compiled step: "scan" (lax.scan over stacked weights: one
    # layer traced and compiled), "unroll" (one copy per layer), or "auto" (by backend).
    c.layer_loop = "auto"
    return c
