"""The cost of one RL round (scripts/rl_example.py's GRPO loop) split into rollout,
scoring, update and update_params, against the same round written naively with
transformers: same weights, same prompts, same CPU.

    python benchmarks/bench_rl_round.py [--prompts_per_round=4 --samples=4 --max_tokens=32 --rounds=4]

(The flags are scripts/rl_example.py's; here --rounds counts the timed rounds.)

jpaged: llm.generate (n samples per prompt, sharing the prompt's blocks) ->
decode.score under the reference weights -> value_and_grad through decode.score +
AdamW (the whole batch at once; --micro_batch=k splits it) -> llm.update_params.
transformers: model.generate(do_sample=True, num_return_sequences=n) on the
left-padded prompts -> a frozen copy's forward (reference logprobs) -> forward +
backward + clip_grad_norm_ + torch AdamW on the same loss, full batch (the model
is updated in place, so there is no weight swap).

Both sample at temperature 1 over the whole vocabulary (no top-k / top-p) and
ignore EOS, so each generates exactly prompts x samples x max_tokens tokens.
The two sides alternate round by round: one untimed round each (jpaged compiles
its programs), then --rounds timed rounds.  The table gives each phase's best
round (and its median): on the shared VM, other users' load slows single rounds
down, torch's OpenMP pool by up to 20x (the raw rounds, with the load average,
are in benchmarks/results/rl_round.md).
Targets: jpaged's rollout >= 2x faster than transformers generate; update_params
< 1 % of jpaged's round.
"""

from __future__ import annotations

import copy
import os
import sys
import time

import numpy as np
from absl import app, flags

import harness as B  # benchmarks/harness.py (the script's own directory is on sys.path)

sys.path.insert(0, str(B.REPO / "scripts"))
import rl_example as rl  # noqa: E402  (defines the flags used here)

from jpaged.core.sequence import SamplingParams  # noqa: E402

FLAGS = flags.FLAGS
PHASES = ("rollout", "scoring", "update", "update_params")


def jpaged_round(llm, trainer, ref_params, prompts, answers, seed: int) -> dict:
    P, S, T = len(prompts), FLAGS.samples, FLAGS.max_tokens
    times = {}
    t0 = time.perf_counter()
    outs = llm.generate(prompts, [SamplingParams(n=S, temperature=1.0, max_tokens=T, seed=seed + i * S,
                                                 ignore_eos=True) for i in range(P)])
    times["rollout"] = time.perf_counter() - t0
    r = np.array([[rl.arithmetic_reward(llm, s["token_ids"], a) for s in o.samples]
                  for o, a in zip(outs, answers)], np.float32)
    ids, lengths, mask = rl.pack(outs)
    t0 = time.perf_counter()
    ref_lp = trainer.reference_logprobs(ref_params, ids, lengths)
    times["scoring"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    new_params, _, _ = trainer.step(llm.params, ref_lp, ids, lengths, mask, rl.advantages(r))
    times["update"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.update_params(new_params)
    times["update_params"] = time.perf_counter() - t0
    times["tokens"] = sum(len(s["token_ids"]) for o in outs for s in o.samples)
    times["load"] = os.getloadavg()[0]
    return times


class HFRound:
    """The naive round: transformers generate, then a torch AdamW step on the GRPO loss."""

    def __init__(self, llm, lr: float, kl_coef: float):
        import torch
        self.torch, self.llm, self.kl_coef = torch, llm, kl_coef
        self.model = B.hf_model(llm)  # jpaged's own dequantised weights, fp32, SDPA
        for p in self.model.parameters():  # our own writable copy (tied embeddings stay tied)
            p.data = p.data.clone()
            p.requires_grad_(True)
        self.ref = copy.deepcopy(self.model).requires_grad_(False)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=1e-4)  # optax's defaults

    def logprobs(self, model, seqs, attn, pos):
        torch = self.torch
        logits = model(input_ids=seqs, attention_mask=attn, position_ids=pos).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, seqs[:, 1:, None])[..., 0]

    def __call__(self, prompt_ids, answers, seed: int) -> dict:
        from transformers import GenerationConfig
        torch, S, T = self.torch, FLAGS.samples, FLAGS.max_tokens
        pad = self.model.config.pad_token_id
        L0 = max(map(len, prompt_ids))
        ids = torch.tensor([[pad] * (L0 - len(x)) + x for x in prompt_ids])
        mask = torch.tensor([[0] * (L0 - len(x)) + [1] * len(x) for x in prompt_ids])
        gc = GenerationConfig(max_new_tokens=T, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              num_return_sequences=S, eos_token_id=None, pad_token_id=pad, bos_token_id=None)
        times = {}
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        with torch.no_grad():  # not inference_mode: the sequences feed the backward pass
            seqs = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
        times["rollout"] = time.perf_counter() - t0
        assert seqs.shape == (len(prompt_ids) * S, L0 + T), seqs.shape  # EOS ignored: every sample is T long
        completions = seqs[:, L0:].tolist()
        r = np.array([rl.arithmetic_reward(self.llm, c, answers[i // S]) for i, c in enumerate(completions)],
                     np.float32).reshape(-1, S)
        adv = torch.from_numpy(rl.advantages(r))
        attn = torch.cat([mask.repeat_interleave(S, 0), torch.ones(len(seqs), T, dtype=mask.dtype)], 1)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        cmask = torch.zeros(len(seqs), L0 + T - 1)
        cmask[:, L0 - 1:] = 1.0  # score entries that predict completion tokens
        t0 = time.perf_counter()
        with torch.no_grad():
            ref_lp = self.logprobs(self.ref, seqs, attn, pos)
        times["scoring"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        lp = self.logprobs(self.model, seqs, attn, pos)
        d = ref_lp - lp
        kl = ((torch.exp(d) - d - 1) * cmask).sum() / cmask.sum()
        loss = -(adv * (lp * cmask).sum(1)).mean() + self.kl_coef * kl
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        times["update"] = time.perf_counter() - t0
        times["update_params"] = 0.0  # trained in place
        times["tokens"] = seqs[:, L0:].numel()
        times["load"] = os.getloadavg()[0]
        return times


def median(rounds: list[dict], key: str) -> float:
    return float(np.median([r[key] for r in rounds]))


def best(rounds: list[dict], key: str) -> float:
    return float(np.min([r[key] for r in rounds]))


def main(argv):
    del argv
    B.header("rl_round")
    P, S, T = FLAGS.prompts_per_round, FLAGS.samples, FLAGS.max_tokens
    lr = FLAGS.lr or 1e-5
    llm = rl.make_engine(False, FLAGS.model, P * S)
    batch = rl.arithmetic_prompts(np.random.default_rng(FLAGS.seed), P)
    prompt_ids = [llm.tokenize(p) for p, _ in batch]  # the same token ids for both sides
    answers = [a for _, a in batch]
    print(f"round: {P} prompts x {S} samples x {T} tokens (EOS ignored), prompts "
          f"{min(map(len, prompt_ids))}-{max(map(len, prompt_ids))} tokens; 1 untimed + {FLAGS.rounds} timed rounds",
          flush=True)

    ref_params = llm.params
    trainer = rl.Trainer(llm.graphdef, llm.params, lr, FLAGS.kl_coef, FLAGS.micro_batch)
    hf_round = HFRound(llm, lr, FLAGS.kl_coef)
    jp, hf = [], []
    for i in range(1 + FLAGS.rounds):  # alternating, so that other load on the machine hits both alike
        jp.append(jpaged_round(llm, trainer, ref_params, prompt_ids, answers, seed=1000 * i))
        print("jpaged      ", {k: round(v, 3) for k, v in jp[-1].items()}, f"compiles {llm.num_compilations}",
              flush=True)
        hf.append(hf_round(prompt_ids, answers, seed=1000 * i))
        print("transformers", {k: round(v, 3) for k, v in hf[-1].items()}, flush=True)
    report(jp[1:], hf[1:], P, S, T)  # the first round compiles / warms up


def report(jp: list[dict], hf: list[dict], P: int, S: int, T: int) -> None:
    """The table (best and median round of each phase), the targets and
    results/rl_round.md (with every timed round)."""
    for r in jp + hf:
        r["total"] = sum(r[p] for p in PHASES)
    rows = [{"phase": phase, "jpaged_s": best(jp, phase), "transformers_s": best(hf, phase),
             "transformers_over_jpaged": best(hf, phase) / best(jp, phase) if best(jp, phase) else None,
             "jpaged_pct_of_round": 100 * best(jp, phase) / best(jp, "total"),
             "jpaged_median_s": median(jp, phase), "transformers_median_s": median(hf, phase)}
            for phase in PHASES + ("total",)]
    formats = {k: ".3f" for k in rows[0] if k != "phase"}
    formats["transformers_over_jpaged"] = formats["jpaged_pct_of_round"] = ".2f"
    B.report("rl_round", rows, formats=formats,
             title=f"One RL round ({P} prompts x {S} samples x {T} tokens): best of {len(jp)} rounds (and median)")
    tok = P * S * T
    rollout, swap_pct = rows[0]["transformers_over_jpaged"], rows[3]["jpaged_pct_of_round"]
    speeds = (f"rollout: jpaged {tok / rows[0]['jpaged_s']:.1f} tok/s, "
              f"transformers {tok / rows[0]['transformers_s']:.1f} tok/s (best rounds)")
    print(f"\n{speeds}")
    checks = [("jpaged rollout >= 2x faster than transformers generate", rollout >= 2, f"{rollout:.2f}x"),
              ("update_params < 1 % of the round", swap_pct < 1, f"{swap_pct:.3f} %")]
    B.report("rl_round_targets", [{"target": c, "met": "yes" if ok else "NO", "measured": m}
                                  for c, ok, m in checks], title="Targets")
    raw = [{"side": side, "round": i + 1, **{k: r[k] for k in PHASES + ("total", "load")}}
           for side, rs in (("jpaged", jp), ("transformers", hf)) for i, r in enumerate(rs)]
    B.write_markdown("rl_round", f"# One RL round, {B.machine()}, {B.today()}\n\n"
                     f"{P} prompts x {S} samples x {T} tokens (EOS ignored); best of {len(jp)} timed rounds "
                     f"(the two sides alternate); {speeds}.\n\n"
                     + B.markdown_table(rows, formats=formats) + "\n\nEvery timed round (seconds; load = "
                     "the machine's 1-minute load average at its end):\n\n"
                     + B.markdown_table(raw, formats={k: ".3f" for k in PHASES + ("total",)} | {"load": ".1f"}))


if __name__ == "__main__":
    FLAGS.set_default("max_tokens", 32)
    FLAGS.set_default("rounds", 4)
    app.run(main)
