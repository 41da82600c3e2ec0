"""GRPO-style RL with jpaged in one process: sample with the engine, score the
samples, take an optax step, swap the new weights into the engine, sample again.

    python scripts/rl_example.py                      # embedded SmolLM2-135M-Instruct: one-digit sums
    python scripts/rl_example.py --tiny --rounds=30   # a tiny random Llama (no tokenizer): token reward

Each round:
  1. rollout  llm.generate: --prompts_per_round prompts, --samples samples of each
              (SamplingParams(n=...): the samples share their prompt's KV blocks).
  2. reward   a verifiable reward per sample; advantages normalised within each
              prompt's group: (r - mean) / (std + eps).
  3. score    log p of the sampled tokens under the reference (the initial, frozen
              weights) with jpaged.decode.score.
  4. update   loss = -mean(advantage * sum of the completion's token log p)
                     + kl_coef * KL(policy || reference)   (k3 estimator, sampled tokens)
              value_and_grad through decode.score, then clip_by_global_norm(1) + AdamW.
  5. swap     llm.update_params(new_params): same tree and shapes, so no step
              recompiles; the prefix cache (K/V of the old weights) is dropped.

Sampling is at temperature 1 with no top-k/top-p, so the engine's raw logprobs are
those of the policy that sampled; the `lp_err` column checks them against the
trainer's (decode.score of the same params): ~1e-5 by default, 0 with
--batch_invariant.
"""

from __future__ import annotations

import csv
import json
import os
import pathlib
import platform
import re
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags, logging

from jpaged import decode
from jpaged.engine.llm import LLM
from jpaged.core.sequence import SamplingParams

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Embedded model name or HF checkpoint dir (chat model).")
_TINY = flags.DEFINE_bool("tiny", False, "A tiny random Llama built on the fly (token-id prompts, token reward).")
_ROUNDS = flags.DEFINE_integer("rounds", 20, "RL rounds (rollout + one optimizer step each).")
_PROMPTS = flags.DEFINE_integer("prompts_per_round", 4, "Prompts per round (GRPO groups).")
_SAMPLES = flags.DEFINE_integer("samples", 4, "Samples per prompt (SamplingParams.n).")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 12, "Tokens sampled per completion at most.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature.")
_LR = flags.DEFINE_float("lr", None, "AdamW learning rate (default 1e-5; 3e-3 with --tiny).")
_KL_COEF = flags.DEFINE_float("kl_coef", 0.04, "Weight of KL(policy || reference) in the loss.")
_MICRO_BATCH = flags.DEFINE_integer("micro_batch", 0, "Sequences per gradient pass (gradients are "
                                    "accumulated over the round's batch; bounds the memory); 0: the "
                                    "whole batch in one pass.")
_SEED = flags.DEFINE_integer("seed", 0, "Seeds the task's prompts and the samples.")
_SLEEP = flags.DEFINE_enum("sleep_level", "0", ["0", "1", "2"], "Put the engine to sleep (LLM.sleep) after each "
                           "rollout, update_params while asleep, wake_up before the next: 2 drops its weights "
                           "(the trainer holds them) and its KV pool, 1 keeps a host copy; 0: never sleep.")
_BATCH_INVARIANT = flags.DEFINE_bool("batch_invariant", False, "Run the engine (and so decode.score, which "
                                     "takes its graphdef) in batch_invariant mode: the rollout's logprobs "
                                     "then equal the trainer's bit for bit (lp_err 0).")
_OUT = flags.DEFINE_string("out", None, "Write <out>.csv (one row per round) and <out>.png (the curve).")

TINY_TARGET = 5  # tiny mode's reward: the fraction of generated tokens equal to this id


# ------------------------------------------------------------------- tasks
def arithmetic_prompts(rng: np.random.Generator, k: int) -> list[tuple[dict, str]]:
    """(chat prompt, answer) for k one-digit sums; a short system prompt keeps sequences short."""
    out = []
    for a, b in rng.integers(0, 10, size=(k, 2)):
        messages = [{"role": "system", "content": "You are a calculator."},
                    {"role": "user", "content": f"What is {a} + {b}? Reply with just the number."}]
        out.append(({"messages": messages}, str(a + b)))
    return out


def arithmetic_reward(llm: LLM, token_ids: list[int], answer: str) -> float:
    """1 if the completion contains the right sum as a number, else 0."""
    return float(answer in re.findall(r"\d+", llm.tokenizer.decode(token_ids, skip_special_tokens=True)))


def tiny_prompts(rng: np.random.Generator, k: int) -> list[tuple[list[int], None]]:
    return [(rng.integers(3, 64, size=8).tolist(), None) for _ in range(k)]


def tiny_reward(llm: LLM, token_ids: list[int], answer: None) -> float:
    return float(np.mean(np.asarray(token_ids) == TINY_TARGET))


def write_tiny_config(path: pathlib.Path) -> str:
    """A config.json for a 2-layer Llama (vocabulary 64); load_format="dummy" fills
    it with random weights (std 0.02: near-uniform next-token distributions)."""
    (path / "config.json").write_text(json.dumps(dict(
        model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)))
    return str(path)


# ------------------------------------------------------------------- training
def loss_fn(params, graphdef, ref_lp, ids, lengths, mask, adv, kl_coef, num_rows, num_tokens):
    """GRPO loss of one micro-batch, normalised by the whole batch's row and token
    counts, so that the micro-batches' gradients add up to the batch's."""
    lp = decode.score(graphdef, params, ids, lengths)            # [B, L-1] log p(next token)
    pg = -jnp.sum(adv * jnp.sum(lp * mask, axis=1)) / num_rows
    d = ref_lp - lp
    kl = jnp.sum((jnp.exp(d) - d - 1) * mask) / num_tokens         # k3: unbiased, >= 0
    return pg + kl_coef * kl, (kl, lp)


class Trainer:
    """The reference's logprobs and the optimizer step, jitted once per batch shape.

    With `micro_batch` > 0, batches go through in micro-batches of that many
    sequences (gradients summed), to bound the memory of the backward pass for
    large batches; 0 runs the whole batch at once.  (decode.score's dense
    attention keeps that memory near a plain transformer's: activations plus a
    [B, heads, L, L] softmax per layer.)"""

    def __init__(self, graphdef, params, lr: float, kl_coef: float, micro_batch: int):
        self.graphdef, self.kl_coef, self.micro_batch = graphdef, kl_coef, micro_batch
        self.opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr))
        self.opt_state = self.opt.init(params)
        self.score = jax.jit(decode.score, static_argnums=0)
        self.grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), static_argnums=1)
        # The donation trap: the engine holds a reference to the params it serves
        # (llm.params), so they must NOT be donated here: donate_argnums=0 would
        # delete the engine's weights (its next step, or update_params, would meet
        # a deleted array).  The optimizer state and the gradients are ours alone.
        self.apply = jax.jit(self._apply, donate_argnums=(1, 2))

    def _apply(self, params, opt_state, grads):
        updates, opt_state = self.opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def chunks(self, n: int):
        size = self.micro_batch if self.micro_batch > 0 else n
        return [slice(i, i + size) for i in range(0, n, size)]

    def reference_logprobs(self, ref_params, ids, lengths) -> np.ndarray:
        return np.concatenate([self.score(self.graphdef, ref_params, ids[mb], lengths[mb])
                               for mb in self.chunks(len(ids))])

    def step(self, params, ref_lp, ids, lengths, mask, adv):
        """One AdamW step on the batch: (new params, mean KL per token, the policy's logprobs)."""
        grads, kl, lps = None, 0.0, []
        for mb in self.chunks(len(ids)):
            (_, (kl_mb, lp)), g = self.grad(params, self.graphdef, ref_lp[mb], ids[mb], lengths[mb], mask[mb],
                                            adv[mb], self.kl_coef, len(ids), mask.sum())
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
            kl += float(kl_mb)
            lps.append(np.asarray(lp))
        new_params, self.opt_state = self.apply(params, self.opt_state, grads)
        return jax.block_until_ready(new_params), kl, np.concatenate(lps)


def pack(outs):
    """The round's sequences (prompt + completion) as ids [B, L] (L a multiple of 8,
    so the update step sees few shapes: each is one compilation), lengths [B] and
    a mask [B, L-1] of the score entries that predict completion tokens."""
    rows = [(o.prompt_token_ids, s["token_ids"]) for o in outs for s in o.samples]
    L = 8 * -(-max(len(p) + len(c) for p, c in rows) // 8)
    ids = np.zeros((len(rows), L), np.int32)
    mask = np.zeros((len(rows), L - 1), np.float32)
    for b, (p, c) in enumerate(rows):
        ids[b, :len(p) + len(c)] = p + c
        mask[b, len(p) - 1:len(p) + len(c) - 1] = 1.0
    return ids, np.array([len(p) + len(c) for p, c in rows], np.int32), mask


def advantages(rewards: np.ndarray) -> np.ndarray:
    """rewards [P, S] -> advantages [P * S], normalised within each prompt's group."""
    mean, std = rewards.mean(1, keepdims=True), rewards.std(1, keepdims=True)
    return ((rewards - mean) / (std + 1e-4)).reshape(-1)


def make_engine(tiny: bool, model: str, num_seqs: int, batch_invariant: bool = False) -> LLM:
    """An engine that runs all of a round's samples at once."""
    if tiny:
        with tempfile.TemporaryDirectory(prefix="rl-tiny-") as tmp:  # read once, at load
            return LLM(model=write_tiny_config(pathlib.Path(tmp)), load_format="dummy", max_model_len=128,
                       num_blocks=num_seqs * 8 + 1, max_num_seqs=num_seqs, max_num_batched_tokens=max(128, num_seqs),
                       attention_impl="cpu" if batch_invariant else "reference", batch_invariant=batch_invariant)
    return LLM(model=model, max_model_len=256, num_blocks=num_seqs * 16 + 1, max_num_seqs=num_seqs,
               max_num_batched_tokens=max(256, num_seqs), batch_invariant=batch_invariant)


# ------------------------------------------------------------------- main
def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # jax's backend-probing INFO lines
    P, S, tiny = _PROMPTS.value, _SAMPLES.value, _TINY.value
    llm = make_engine(tiny, _MODEL.value, P * S, _BATCH_INVARIANT.value)
    make_prompts, reward = (tiny_prompts, tiny_reward) if tiny else (arithmetic_prompts, arithmetic_reward)
    lr = _LR.value or (3e-3 if tiny else 1e-5)
    ref_params = llm.params  # the reference policy: the initial weights, never updated
    trainer = Trainer(llm.graphdef, llm.params, lr, _KL_COEF.value, _MICRO_BATCH.value)
    rng = np.random.default_rng(_SEED.value)
    rows = []
    print(f"{P * S} samples/round ({P} prompts x {S}), lr {lr:g}, kl_coef {_KL_COEF.value:g}, "
          f"model {'tiny random llama' if tiny else _MODEL.value}")
    for rnd in range(_ROUNDS.value):
        # 1. rollout: n samples per prompt, each prompt's samples with their own seeds
        batch = make_prompts(rng, P)
        sampling = [SamplingParams(n=S, temperature=_TEMPERATURE.value, max_tokens=_MAX_TOKENS.value,
                                   seed=_SEED.value + (rnd * P + i) * S, logprobs=0,
                                   ignore_eos=tiny)  # tiny: fixed lengths, so fixed step shapes
                    for i in range(P)]
        t0 = time.perf_counter()
        outs = llm.generate([prompt for prompt, _ in batch], sampling)
        rollout_s = time.perf_counter() - t0
        params = llm.params  # the trainer's copy (while the engine sleeps, llm.params is only shapes)
        sleep_s = 0.0
        if _SLEEP.value != "0":  # the pool (and, at level 1, the weights) off the device while training
            t0 = time.perf_counter()
            llm.sleep(int(_SLEEP.value))
            sleep_s = time.perf_counter() - t0
        num_generated = sum(len(s["token_ids"]) for o in outs for s in o.samples)

        # 2. rewards and group-normalised advantages
        r = np.array([[reward(llm, s["token_ids"], answer) for s in o.samples]
                      for o, (_, answer) in zip(outs, batch)], np.float32)       # [P, S]
        adv = advantages(r)

        # 3. the reference's log p of the sampled tokens
        ids, lengths, mask = pack(outs)
        t0 = time.perf_counter()
        ref_lp = trainer.reference_logprobs(ref_params, ids, lengths)
        score_s = time.perf_counter() - t0

        # 4. one optimizer step on the round's samples
        t0 = time.perf_counter()
        new_params, kl, policy_lp = trainer.step(params, ref_lp, ids, lengths, mask, adv)
        update_s = time.perf_counter() - t0

        # 5. the engine samples the next round with the new weights
        t0 = time.perf_counter()
        llm.update_params(new_params)
        swap_s = time.perf_counter() - t0
        if llm.is_sleeping:
            t0 = time.perf_counter()
            llm.wake_up()
            sleep_s += time.perf_counter() - t0

        # The engine's logprobs (those it sampled with) against the trainer's, same weights.
        engine_lp = np.array([lp.logprob for o in outs for s in o.samples for lp in s["logprobs"]])
        lp_err = float(np.max(np.abs(policy_lp[mask > 0] - engine_lp)))
        # A step may have run padded to a larger ready bucket while its own was built
        # in the background: count that program in its round, not in a later one.
        llm.runner.wait_for_programs()
        row = dict(round=rnd + 1, reward=float(r.mean()), kl=kl, sample_tok_s=num_generated / rollout_s,
                   rollout_s=rollout_s, score_s=score_s, update_s=update_s, update_params_ms=1000 * swap_s,
                   sleep_wake_s=sleep_s,
                   compiles=llm.num_compilations, update_compiles=trainer.grad._cache_size(), lp_err=lp_err)
        rows.append(row)
        print(f"round {rnd + 1:3d}  reward {row['reward']:.3f}  kl {kl:.4f}  sample {row['sample_tok_s']:6.1f} tok/s"
              f"  rollout {rollout_s:5.2f}s  score {score_s:5.2f}s  update {update_s:6.2f}s"
              f"  update_params {row['update_params_ms']:.2f}ms  sleep+wake {sleep_s:.2f}s  compiles {row['compiles']}"
              f"  lp_err {lp_err:.1e}", flush=True)
        if not tiny and rnd in (0, _ROUNDS.value - 1):
            print("   e.g.", [s["text"] for s in outs[0].samples])
    if _OUT.value:
        write_curve(_OUT.value, rows, f"rl_example.py: {'tiny random llama' if tiny else _MODEL.value}, "
                    f"{P} prompts x {S} samples/round, lr {lr:g}, kl_coef {_KL_COEF.value:g}")


def machine() -> str:
    device = "no accelerator" if jax.default_backend() == "cpu" else jax.devices()[0].device_kind
    return f"{os.cpu_count()}-core {platform.machine()} CPU, {device}"


def write_curve(out: str, rows: list[dict], title: str) -> None:
    """<out>.csv (one row per round) and <out>.png: the reward (with a 4-round
    moving average) and the KL to the reference, per round."""
    path = pathlib.Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"[wrote {path.with_suffix('.csv')}; no matplotlib, no plot]")
        return
    x = [int(r["round"]) for r in rows]
    reward = np.array([float(r["reward"]) for r in rows])
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    ax.plot(x, reward, "o", alpha=0.5, label="mean reward of the round")
    ax.plot(x, [reward[max(0, i - 3):i + 1].mean() for i in range(len(x))], "-", label="4-round moving average")
    ax.set(xlabel="round", ylabel="mean reward", ylim=(-0.02, 1.02))
    kl_ax = ax.twinx()
    kl_ax.plot(x, [float(r["kl"]) for r in rows], "--", color="tab:red", alpha=0.6, label="KL to reference")
    kl_ax.set_ylabel("KL to reference (k3, per token)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(ax.get_legend_handles_labels()[0] + kl_ax.get_legend_handles_labels()[0],
              ax.get_legend_handles_labels()[1] + kl_ax.get_legend_handles_labels()[1],
              loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3, fontsize=8)
    ax.set_title(f"{title}\n{machine()}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    plt.close(fig)
    print(f"[wrote {path.with_suffix('.csv')} and {path.with_suffix('.png')}]")


if __name__ == "__main__":
    app.run(main)
