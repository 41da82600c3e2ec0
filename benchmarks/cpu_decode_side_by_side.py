"""SmolLM2 (fp32, this CPU) generate tok/s at a few batch sizes, for comparing two
checkouts side by side: whichever jpaged comes first on sys.path runs.

    git worktree add /tmp/base <commit>
    PYTHONPATH=/tmp/base .venv/bin/python benchmarks/cpu_decode_side_by_side.py 1,32,64
    .venv/bin/python benchmarks/cpu_decode_side_by_side.py 1,32,64
    EXTRA='{"flat_weights": true}' .venv/bin/python benchmarks/cpu_decode_side_by_side.py 1,32

Each batch: B random 16-token prompts, 48 greedy tokens each (ignore_eos), one
untimed pass (compiles), one more after background builds, then the median of
three timed generate() calls (prefill included), as generated tokens / wall.
Prints one JSON line.  EXTRA: engine config overrides as JSON.
"""
import json
import os
import sys
import time

import numpy as np

import jpaged
from jpaged import LLM, SamplingParams

batches = [int(b) for b in sys.argv[1].split(",")]
extra = json.loads(os.environ.get("EXTRA", "{}"))
llm = LLM(**extra, max_num_seqs=max(batches), max_num_batched_tokens=max(512, 16 * max(batches)),
          enable_prefix_caching=False)
rng = np.random.default_rng(0)
out = {"jpaged": jpaged.__file__, **extra}
for batch in batches:
    prompts = [rng.integers(100, 20000, 16).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params)
    llm.runner.wait_for_programs()
    llm.generate(prompts, params)
    rates = []
    for _ in range(3):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        rates.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
    out[batch] = round(float(np.median(rates)), 1)
print(json.dumps(out))
