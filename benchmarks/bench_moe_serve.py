"""Issue 40's end-to-end MoE speed target on this CPU: a Qwen3-MoE-shaped model
against the dense model with the same active parameters, both through
`serve_batch` (`jpaged batch`) on the same 64-request workload, side by side.

    python benchmarks/bench_moe_serve.py [--requests=64] [--max_tokens=32] [--rounds=2] \
        [--layers=30] [--out=benchmarks/results/moe_cpu_serve.json]

Both models are SmolLM2-135M-wide Qwen3 configs (hidden 576, 9 heads / 3 KV heads,
30 layers, vocabulary 49152, tied embeddings) with random weights (load_format=dummy,
a config.json beside the embedded SmolLM2's tokenizer, exported with `jpaged
export-tokenizer`):
  dense  qwen3, MLP width 1536;
  moe    qwen3_moe, 8 experts of width 768, top-2 (norm_topk_prob): the same
         active MLP parameters per token (2 x 768), 4x the expert bytes.
The workload: 64 chat prompts (the demo prompts, cycled), 32 new tokens each,
ignore_eos and greedy, so both models generate exactly the same token count.
Each round runs `scripts/serve_batch.py` once per model (alternating, so the
machine's load falls on both alike) and reads the summary's generate wall
(wall_s, model load and compilation excluded); the table gives every round and
the ratio of the medians.  The layer's own step split (router, sort/dispatch,
grouped matmuls, combine) is benchmarks/bench_moe.py --split.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
              max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
              bos_token_id=1, eos_token_id=2, torch_dtype="float32")


def model_configs(layers: int) -> dict[str, dict]:
    """config.json of each model: the dense one and the MoE with its active parameters."""
    return {
        "dense": dict(SHARED, model_type="qwen3", architectures=["Qwen3ForCausalLM"], num_hidden_layers=layers,
                      intermediate_size=1536),
        "moe": dict(SHARED, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=layers,
                    intermediate_size=1536, moe_intermediate_size=768, num_experts=8, num_experts_per_tok=2,
                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    }


def write_models(tmp: pathlib.Path, layers: int) -> dict[str, pathlib.Path]:
    """A directory per model: its config.json and the embedded model's tokenizer files."""
    tokenizer = tmp / "tokenizer"
    jpaged = "from jpaged.entrypoints.main import main; main()"  # `jpaged` from this checkout
    subprocess.run([sys.executable, "-c", jpaged, "export-tokenizer", str(tokenizer)], cwd=REPO, check=True,
                   capture_output=True)
    dirs = {}
    for name, cfg in model_configs(layers).items():
        d = tmp / name
        d.mkdir()
        for f in tokenizer.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        (d / "config.json").write_text(json.dumps(cfg))
        dirs[name] = d
    return dirs


def write_prompts(path: pathlib.Path, requests: int, max_tokens: int) -> None:
    sys.path.insert(0, str(REPO))
    from jpaged.entrypoints.batch import demo_prompts
    prompts = demo_prompts()  # what `jpaged batch` runs without --prompts
    with path.open("w") as f:
        for i in range(requests):
            f.write(json.dumps({"prompt": prompts[i % len(prompts)], "max_tokens": max_tokens,
                                "ignore_eos": True, "temperature": 0.0}) + "\n")


def serve(model: pathlib.Path, prompts: pathlib.Path, summary: pathlib.Path, extra: list[str]) -> dict:
    cmd = [sys.executable, "scripts/serve_batch.py", f"--config.model={model}", "--config.load_format=dummy",
           f"--prompts={prompts}", f"--summary_json={summary}", *extra]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(summary.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max_tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--out", default=None, help="write the rounds and ratio as JSON here")
    ap.add_argument("--extra", default="", help="more serve_batch flags for both runs (space-separated)")
    args = ap.parse_args()
    for name in ("requests", "max_tokens", "rounds", "layers"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    with tempfile.TemporaryDirectory() as t:
        tmp = pathlib.Path(t)
        models = write_models(tmp, args.layers)
        prompts = tmp / "prompts.jsonl"
        write_prompts(prompts, args.requests, args.max_tokens)
        rounds: dict[str, list[dict]] = {name: [] for name in models}
        for i in range(args.rounds):
            for name, d in models.items():
                s = serve(d, prompts, tmp / f"{name}_{i}.json", args.extra.split())
                rounds[name].append(s)
                print(f"round {i} {name}: generate wall {s['wall_s']:.2f} s (of it waiting for compiles "
                      f"{s['compile_wait_s']:.2f} s), {s['output_tokens']} tokens, process {s['process_wall_s']:.1f} s",
                      flush=True)
    walls = {name: statistics.median(s["wall_s"] for s in runs) for name, runs in rounds.items()}
    # The steps' own time: the generate wall less what it waited for compiles (each
    # process compiles its buckets as they first come, inside the generate wall).
    steps = {name: statistics.median(s["wall_s"] - s["compile_wait_s"] for s in runs) for name, runs in rounds.items()}
    tokens = {name: runs[0]["output_tokens"] for name, runs in rounds.items()}
    ratio, steps_ratio = walls["moe"] / walls["dense"], steps["moe"] / steps["dense"]
    print("\n| model | generate wall s | less compile waits s | output tokens | tok/s (less compiles) |\n"
          "|---|---:|---:|---:|---:|")
    for name in models:
        print(f"| {name} | {walls[name]:.2f} | {steps[name]:.2f} | {tokens[name]} | {tokens[name] / steps[name]:.1f} |")
    for i, (d, m) in enumerate(zip(rounds["dense"], rounds["moe"])):
        print(f"round {i}: MoE / dense generate wall {m['wall_s'] / d['wall_s']:.2f}, less compile waits "
              f"{(m['wall_s'] - m['compile_wait_s']) / (d['wall_s'] - d['compile_wait_s']):.2f}")
    print(f"\nMoE / dense (medians of {args.rounds} rounds): generate wall {ratio:.2f}, less compile waits "
          f"{steps_ratio:.2f} (target <= 1.5)")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"walls_s": walls, "steps_s": steps, "tokens": tokens,
                                                      "ratio": ratio, "steps_ratio": steps_ratio,
                                                      "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
