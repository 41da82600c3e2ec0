"""Vocab-split vs replicated embedding / LM head at TP = 2, side by side in one run.

    .venv/bin/python benchmarks/bench_embedding_split.py

bench_sharding.py's dummy8 model (SmolLM2-shaped, 8 query / 2 KV heads, tied
embedding, random weights) at TP = 2 on 4 simulated CPU devices, built twice:
once with jpaged.layers.sharding's rule table (embedding split on vocab), once with
the embedding rule removed (replicated).  Prints each one's weights per device,
the collectives of its decode step and its warm tok/s (median of 3 alternating
runs of 8 prompts x 32 greedy tokens).  On the CPU the tok/s is overhead, not speed.
"""
import jax
jax.config.update("jax_num_cpu_devices", 4)
import json
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import numpy as np
from bench_sharding import DUMMY8_CONFIG
import jpaged.layers.sharding as sh
from jpaged.engine.llm import LLM
from jpaged.core.sequence import SamplingParams
tmp = pathlib.Path(tempfile.mkdtemp()); (tmp / "config.json").write_text(json.dumps(DUMMY8_CONFIG))
prompts = [list(np.random.default_rng(i).integers(3, 1000, 24)) for i in range(8)]
prompts = [[int(t) for t in p] for p in prompts]
sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
rules = dict(sh.WEIGHT_RULES)
res = {}
engines = {}
for name in ("vocab", "replicated"):
    sh.WEIGHT_RULES.clear(); sh.WEIGHT_RULES.update(rules)
    if name == "replicated":
        del sh.WEIGHT_RULES["embed"], sh.WEIGHT_RULES["lm_head"]
    llm = LLM(model=str(tmp), load_format="dummy", tensor_parallel_size=2, max_model_len=256, num_blocks=200,
              max_num_seqs=8, max_num_batched_tokens=256, attention_impl="cpu", enable_prefix_caching=False)
    llm.generate(prompts, sp)  # warm
    llm.precompile(8)
    exe = [e for k, e in llm.runner.programs.items() if k[0] == 8][0]
    ops = sh.collectives(exe.as_text())
    engines[name] = llm
    res[name] = dict(weights_mib=list(llm.memory_per_device().values())[0][0] / 2**20,
                     all_reduce=(sum(1 for o in ops if o[0] == "all-reduce"), sum(o[2] for o in ops if o[0] == "all-reduce")),
                     all_gather=(sum(1 for o in ops if o[0] == "all-gather"), sum(o[2] for o in ops if o[0] == "all-gather")),
                     tok_s=[])
for rep in range(3):  # alternate, side by side
    for name, llm in engines.items():
        t0 = time.perf_counter(); out = llm.generate(prompts, sp); dt = time.perf_counter() - t0
        res[name]["tok_s"].append(sum(len(o.token_ids) for o in out) / dt)
for name, r in res.items():
    print(name, {k: (sorted(v)[1] if k == "tok_s" else v) for k, v in r.items()})
