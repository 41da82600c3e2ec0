"""Shared helpers of the experiments benchmarks/bench_*.py and benchmarks/soak.py.

Tables (printed, CSV), PNG plots, timing, the workloads, and the Hugging Face
peers (transformers `generate` on a left-padded static batch, and transformers'
own continuous batching `generate_batch`) built from the *same* weights jpaged
loads, so every engine sees identical parameters and identical prompt tokens.

Not part of the jpaged package: the scripts beside it import it as `harness`
(a script's own directory is on sys.path).  torch and matplotlib are imported lazily.
"""

from __future__ import annotations

import csv
import datetime
import os
import pathlib
import platform
import resource
import signal
import socket
import subprocess
import time
import urllib.request
from typing import Any, Sequence

import numpy as np

from jpaged.core.rounding import cdiv
from jpaged.entrypoints.batch import demo_prompts

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"

# --------------------------------------------------------------- workloads
# The latency demo's queue, the one `jpaged batch` runs without --prompts: short answers and long ones.
DEFAULT_PROMPTS = demo_prompts()
WASTE_PROMPTS = [
    "What is the capital of France?",
    "Explain in detail how the attention mechanism works in a transformer.",
    "Is Python interpreted or compiled? Answer in one sentence.",
    "Write a short story about a robot who learns to paint.",
]
SWEEP_PROMPT = "The transformer architecture revolutionized NLP because"

_COUNTRIES = ["France", "Japan", "Italy", "Spain", "Germany", "Canada", "Egypt", "Brazil",
              "Kenya", "Norway", "Peru", "India", "Greece", "Mexico", "Chile", "Poland"]
_TOPICS = ["the attention mechanism in a transformer", "photosynthesis", "a hash table",
           "the TCP handshake", "public-key cryptography", "a compiler", "the immune system",
           "garbage collection", "gradient descent", "a blockchain", "the water cycle",
           "an operating system scheduler", "vaccines", "a CPU cache", "plate tectonics",
           "paged virtual memory"]
_STORIES = ["a robot who learns to paint", "a lighthouse keeper", "a dragon afraid of fire",
            "a lost cat in Paris", "a time-travelling chef", "a shy astronaut", "an old oak tree",
            "a detective mouse", "a musician on Mars", "a talking teapot", "a pirate librarian",
            "the last snowflake", "a clockmaker's apprentice", "a friendly ghost", "a desert fox",
            "a girl who collects clouds"]


def mixed_prompts(n: int = 64) -> list[str]:
    """n distinct chat prompts, half with short answers and half with long ones, interleaved."""
    short = [f"What is the capital of {c}? Answer in one word." for c in _COUNTRIES]
    short += [f"What is {a} + {b}? Reply with just the number." for a, b in
              zip(range(3, 19), range(11, 27))]
    long = [f"Explain in detail how {t} works." for t in _TOPICS]
    long += [f"Write a short story about {s}." for s in _STORIES]
    out = []
    for i in range(max(len(short), len(long))):
        out += [short[i % len(short)], long[i % len(long)]]
    while len(out) < n:  # beyond 64: numbered variants stay distinct
        k = len(out)
        out.append(f"{out[k % 64]} (variant {k // 64})")
    return out[:n]


def chat(prompts: Sequence[str]) -> list[dict]:
    return [{"prompt": p} for p in prompts]


def token_ids(llm: Any, prompts: Sequence[Any]) -> list[list[int]]:
    """Prompt token ids exactly as jpaged builds them (chat template for dicts),
    so every engine is fed the same tokens."""
    return [llm.tokenize(p) for p in prompts]


def truncate_at_eos(tokens: Sequence[int], eos: set[int], max_tokens: int) -> list[int]:
    """Generated tokens up to and including the first EOS (what jpaged returns)."""
    out = []
    for t in list(tokens)[:max_tokens]:
        out.append(int(t))
        if t in eos:
            break
    return out


# --------------------------------------------------------------- machine
def machine() -> str:
    """The CPU (model, the vector ISA that matters here, cores) and the accelerator."""
    import jax
    backend = jax.default_backend()
    acc = "no accelerator" if backend == "cpu" else f"{backend}: {jax.devices()[0].device_kind}"
    model, isa = platform.machine(), ""
    try:
        with open("/proc/cpuinfo") as f:
            info = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in f if ":" in line)}
        model = info.get("model name", model)
        flags = set(info.get("flags", "").split())
        isa = ", " + (" ".join(x for x in ("avx2", "fma", "avx512f") if x in flags) or "no avx2")
    except OSError:
        pass
    return f"{os.cpu_count()}-core CPU ({model}{isa}), {acc}"


def today() -> str:
    return datetime.date.today().isoformat()


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far (Linux: ru_maxrss is KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def header(name: str) -> None:
    from absl import logging
    logging.set_verbosity(logging.WARNING)  # orbax / xla_bridge INFO lines
    print(f"== {name}  [{machine()}, {today()}]")


# --------------------------------------------------------------- output
def _fmt(v: Any, spec: str | None) -> str:
    if v is None:
        return "-"
    if spec:
        return format(v, spec)
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def table(rows: list[dict], columns: Sequence[str] | None = None,
          formats: dict[str, str] | None = None) -> str:
    """A right-aligned text table of dict rows (left-aligned for strings)."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())
    formats = formats or {}
    cells = [[_fmt(r.get(c), formats.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    left = [all(isinstance(r.get(c), str) for r in rows) for c in columns]
    def line(vals):
        return "  ".join(v.ljust(w) if lf else v.rjust(w) for v, w, lf in zip(vals, widths, left))
    out = [line(columns), "  ".join("-" * w for w in widths)]
    out += [line(row) for row in cells]
    return "\n".join(out)


def write_csv(name: str, rows: list[dict], columns: Sequence[str] | None = None) -> pathlib.Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.csv"
    columns = list(columns or rows[0].keys())
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return path


def report(name: str, rows: list[dict], columns: Sequence[str] | None = None,
           formats: dict[str, str] | None = None, title: str | None = None) -> None:
    """Prints the table and writes benchmarks/results/<name>.csv."""
    if title:
        print(f"\n{title}")
    print(table(rows, columns, formats))
    path = write_csv(name, rows, columns)
    print(f"[wrote {path.relative_to(REPO)}]")


def markdown_table(rows: list[dict], columns: Sequence[str] | None = None,
                   formats: dict[str, str] | None = None) -> str:
    """The same cells as `table`, as a GitHub markdown table."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())
    formats = formats or {}
    cell = lambda v, c: _fmt(v, formats.get(c)).replace("|", "\\|")  # noqa: E731
    out = ["| " + " | ".join(columns) + " |",
           "|" + "|".join("---" if all(isinstance(r.get(c), str) for r in rows) else "---:"
                          for c in columns) + "|"]
    out += ["| " + " | ".join(cell(r.get(c), c) for c in columns) + " |" for r in rows]
    return "\n".join(out)


def write_markdown(name: str, text: str) -> pathlib.Path:
    """Writes benchmarks/results/<name>.md."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.md"
    path.write_text(text.rstrip("\n") + "\n")
    print(f"[wrote {path.relative_to(REPO)}]")
    return path


def figure(ncols: int = 1, width: float = 6.0, height: float = 4.0):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def save_figure(name: str, fig: Any, title: str | None = None) -> pathlib.Path:
    import matplotlib.pyplot as plt
    RESULTS.mkdir(parents=True, exist_ok=True)
    if title:
        fig.suptitle(f"{title}\n{machine()}, {today()}", fontsize=9)
    fig.tight_layout()
    path = RESULTS / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"[wrote {path.relative_to(REPO)}]")
    return path


def pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else float("nan")


# --------------------------------------------------------------- engine helpers
def make_llm(**overrides: Any):
    from jpaged.engine.llm import LLM
    return LLM(None, **overrides)


def greedy(max_tokens: int, ignore_eos: bool = False):
    from jpaged.core.sequence import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)


def cold_prefix_cache(llm: Any) -> None:
    """Empties the engine's prefix cache so a timed run cannot reuse
    prompt blocks left by a warm-up run; sharing within the run stays on."""
    if not llm.has_unfinished_requests():
        llm.reset_prefix_cache()


def timed_generate(llm: Any, prompts: Sequence[Any], params: Any) -> tuple[list, float]:
    """llm.generate with a cold prefix cache; returns (outputs, wall seconds)."""
    cold_prefix_cache(llm)
    t0 = time.perf_counter()
    outs = llm.generate(list(prompts), params)
    return outs, time.perf_counter() - t0


def weight_bytes(llm: Any) -> int:
    import jax
    return int(sum(x.nbytes for x in jax.tree.leaves(llm.params)))


# --------------------------------------------------------------- step floors
MATMULS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def layer_weights(model: Any) -> list[dict]:
    """Per-layer projection weights, whether the model stores them stacked
    (one array with a leading layer axis) or as a list of layers."""
    layers = model.layers
    if hasattr(layers, "items"):
        stacked = {k: layers[k][...] for k in MATMULS}
        return [{k: v[i] for k, v in stacked.items()} for i in range(model.cfg.num_layers)]
    return [{k: layer[k][...] for k in MATMULS} for layer in layers]


def matmul_floor_fn(llm: Any, head: bool = True):
    """Jitted: only the 7 projection matmuls per layer x num_layers (+ the lm_head
    over every row when `head`), over jpaged's own weights (layers unrolled; two
    tiny reductions keep k and v live).  head=False is the prefill floor (a step
    computes logits for one row per sequence only) and returns one reduced row."""
    import jax
    from flax import nnx
    model = nnx.merge(llm.graphdef, llm.params)
    lw = layer_weights(model)
    head_w = model.embed[...].T if model.lm_head is None else model.lm_head[...]

    @jax.jit
    def f(x, lw, head_w):
        h = x
        for w in lw:
            q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
            h = h + q @ w["wo"] + (k.sum(-1, keepdims=True) + v.sum(-1, keepdims=True))
            h = h + ((h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"]
        return h @ head_w if head else h.sum(0, keepdims=True)
    return lambda x: f(x, lw, head_w)


def time_matmuls(llm: Any, batch: int, iters: int, head: bool = True) -> float:
    """Median seconds of `matmul_floor_fn` over `batch` token rows (device->host copy
    of the result included, as a step does)."""
    import jax.numpy as jnp
    f = matmul_floor_fn(llm, head)
    x = jnp.ones((batch, llm.model_config.hidden_size), llm.dtype) * 0.01
    f(x).block_until_ready()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        np.asarray(f(x))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def decode_step_times(llm: Any, batch: int) -> tuple[list[float], list[float]]:
    """Steps the requests already added to the end: (walls, device seconds) of the
    steps in which exactly `batch` rows decode (no prompt token in the step)."""
    walls, devs = [], []
    while llm.has_unfinished_requests():
        st = llm.stats
        prefills, dev0, tok0 = st.prefill_steps, st.device_seconds, st.tokens_scheduled
        t0 = time.perf_counter()
        llm.step()
        wall = time.perf_counter() - t0
        st = llm.stats
        if st.prefill_steps == prefills and st.tokens_scheduled - tok0 == batch:
            walls.append(wall)
            devs.append(st.device_seconds - dev0)
    return walls, devs


def time_decode_steps(llm: Any, batch: int, steps: int, ids: list[list[int]] | None = None) -> dict:
    """Median wall / device time of jpaged steps in which exactly `batch` sequences
    decode (no prompt tokens in the step): `batch` requests of `steps` tokens
    (ignore_eos) go in through llm.add_request and run with llm.step; the first
    pass compiles the shapes, the second is measured.  The engine must allow
    max_num_seqs >= batch.  `ids`: the prompts' token ids (default: the demo
    prompts, cycled)."""
    if ids is None:
        ids = token_ids(llm, chat([DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] for i in range(batch)]))
    params = greedy(steps, ignore_eos=True)
    result: dict = {}
    cold_prefix_cache(llm)
    for _ in range(2):
        for x in ids:
            llm.add_request(x, params)
        walls, devs = decode_step_times(llm, batch)
        result = {"step_ms": 1000 * float(np.median(walls)) if walls else float("nan"),
                  "device_ms": 1000 * float(np.median(devs)) if devs else float("nan"),
                  "steps_timed": len(walls)}
    return result


# --------------------------------------------------------------- Hugging Face peers
def hf_model(llm: Any, threads: int | None = None):
    """A transformers LlamaForCausalLM holding exactly the weights jpaged loaded
    (jpaged's own GGUF dequantisation), fp32, SDPA attention, eval mode.

    Built from `load_weights` rather than `from_pretrained(gguf_file=...)` so the
    peers need no `accelerate` and cannot differ from jpaged in dequantisation.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from jpaged.loading.weights import load_weights
    if threads:
        torch.set_num_threads(threads)
    c = llm.config
    loaded = load_weights(c.model, load_format=c.load_format, dtype="float32", cache_dir=c.cache_dir or None)
    m, a = loaded.config, loaded.arrays
    eos = list(llm.tokenizer.eos_token_ids) if llm.tokenizer else []
    hf_cfg = LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim, rms_norm_eps=m.rms_norm_eps,
        rope_theta=m.rope_theta, max_position_embeddings=m.max_position_embeddings,
        tie_word_embeddings=m.tie_word_embeddings, attention_bias=m.attention_bias,
        bos_token_id=None, eos_token_id=eos[0] if eos else None,
        pad_token_id=(llm.tokenizer.pad_token_id if llm.tokenizer and llm.tokenizer.pad_token_id is not None
                      else (eos[0] if eos else 0)))
    if m.rope_scaling:
        hf_cfg.rope_scaling = dict(m.rope_scaling)
    hf_cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_cfg)
    t = lambda x: torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))  # noqa: E731
    sd = {"model.embed_tokens.weight": t(a["embed"]), "model.norm.weight": t(a["final_norm"])}
    names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
             "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
             "w_down": "mlp.down_proj"}
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = t(a["layers.attn_norm"][i])
        sd[p + "post_attention_layernorm.weight"] = t(a["layers.mlp_norm"][i])
        for ours, theirs in names.items():
            sd[p + theirs + ".weight"] = t(a["layers." + ours][i].T)  # ours [in, out], torch [out, in]
        if m.attention_bias:
            for b, theirs in (("bq", "q_proj"), ("bk", "k_proj"), ("bv", "v_proj")):
                sd[p + f"self_attn.{theirs}.bias"] = t(a["layers." + b][i])
    if m.tie_word_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    else:
        sd["lm_head.weight"] = t(a["lm_head"].T)
    model.load_state_dict(sd, assign=True, strict=False)
    if m.tie_word_embeddings:
        model.tie_weights()
    # Non-persistent buffers (rotary inv_freq) were created on meta: rebuild them.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=hf_cfg)
    model.eval()
    return model


def hf_generation_config(model: Any, llm: Any, max_new_tokens: int):
    from transformers import GenerationConfig
    eos = list(llm.tokenizer.eos_token_ids) if llm.tokenizer else None
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                            pad_token_id=model.config.pad_token_id, bos_token_id=None,
                            temperature=None, top_p=None, top_k=None)


def hf_static(model: Any, llm: Any, prompt_ids: list[list[int]], max_new_tokens: int,
              batch_size: int) -> tuple[list[list[int]], float, list[float]]:
    """transformers generate() on left-padded static batches of `batch_size`, greedy.

    Returns (generated tokens per prompt, cut after the first EOS; wall seconds;
    per-request latency in seconds = end of its batch, measured from the start)."""
    import torch
    gc = hf_generation_config(model, llm, max_new_tokens)
    eos = set(llm.tokenizer.eos_token_ids) if llm.tokenizer else set()
    pad = model.config.pad_token_id
    outs: list[list[int]] = []
    lat: list[float] = []
    t0 = time.perf_counter()
    for s in range(0, len(prompt_ids), batch_size):
        chunk = prompt_ids[s:s + batch_size]
        L = max(len(x) for x in chunk)
        ids = torch.tensor([[pad] * (L - len(x)) + x for x in chunk])
        mask = torch.tensor([[0] * (L - len(x)) + [1] * len(x) for x in chunk])
        with torch.inference_mode():
            gen = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
        for row in gen[:, L:].tolist():
            outs.append(truncate_at_eos(row, eos, max_new_tokens))
        lat += [time.perf_counter() - t0] * len(chunk)
    return outs, time.perf_counter() - t0, lat


def hf_continuous(model: Any, llm: Any, prompt_ids: list[list[int]], max_new_tokens: int,
                  max_running: int, block_size: int = 256) -> tuple[list[list[int]], float]:
    """transformers' continuous batching (`generate_batch`, paged attention over SDPA), greedy."""
    import torch
    from transformers import ContinuousBatchingConfig
    gc = hf_generation_config(model, llm, max_new_tokens)
    eos = set(llm.tokenizer.eos_token_ids) if llm.tokenizer else set()
    max_len = max(len(x) for x in prompt_ids) + max_new_tokens
    blocks = max_running * cdiv(max_len, block_size) + 1
    cb = ContinuousBatchingConfig(
        page_size=block_size, num_blocks=blocks, max_requests_per_batch=max_running,
        max_batch_tokens=max(2048, max_running * 16),
        use_cuda_graph=False)
    t0 = time.perf_counter()
    with torch.inference_mode():
        res = model.generate_batch(inputs=prompt_ids, generation_config=gc,
                                   continuous_batching_config=cb, progress_bar=False, warmup=False)
    wall = time.perf_counter() - t0
    outs = [truncate_at_eos(r.generated_tokens, eos, max_new_tokens) for r in res.values()]
    if len(outs) != len(prompt_ids):
        raise RuntimeError(f"generate_batch returned {len(outs)} of {len(prompt_ids)} requests")
    return outs, wall


# ------------------------------------------------------------ server processes
def free_port() -> int:
    """A free TCP port on the loopback address."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """An HTTP server subprocess on 127.0.0.1 (`cmd`, run from the repository),
    its output in `log`."""

    def __init__(self, name: str, cmd: list[str], port: int, log: pathlib.Path):
        self.name, self.cmd, self.port, self.log = name, cmd, port, log
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        with open(log, "w") as f:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float) -> float:
        """Seconds until GET /health answered 200; RuntimeError if it exits or times out."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}: see {self.log}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not healthy in {timeout:.0f} s: see {self.log}")

    def stop(self) -> int | None:
        """SIGTERM (the server drains), then kill after 60 s; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        return self.proc.returncode
