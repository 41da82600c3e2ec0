"""Quantized KV pools (kv_cache_dtype float32 | bfloat16 | int8 | fp8_e4m3): accuracy,
the scale ablation, the K/V write's and the decode step's cost, and capacity.

    python benchmarks/bench_kv_quant.py [--parts=agreement,drift,ablation,capacity]
    python benchmarks/bench_kv_quant.py --parts=write_speed,step     # timings: run on an idle machine

Parts (--parts, any of them; the default runs the load-independent ones):

agreement    12 chat prompts (facts, lists, code, a haiku, arithmetic, two with a
             system prompt), --agreement_tokens (32) new tokens, greedy, through the
             engine with each --dtypes pool (attention_impl --attention_impl, "auto" =
             the C++ CPU kernel): how many of the 12 are token-identical to the
             float32 pool's, and where each other one first differs.
drift        8 paragraphs of plain English prose (stored below, ~180-260 tokens
             each) teacher-forced through `SamplingParams.prompt_logprobs` with each
             pool: mean and max |logprob - fp32 pool's logprob| over every predicted
             token, and each pool's perplexity over them.
ablation     "which scale": the drift of alternative int8 / fp8 schemes, each
             simulated on a float32 pool by a fake-quantizing K/V write (quantize,
             dequantize, store fp32; `--ablation_schemes`), with the reference
             attention, against the float32 pool under the same attention: the
             shipped schemes (a scale per token and KV head, Hadamard rotation;
             int8: a quarter-power of two 2**(c/4), fp8: a power of two), the
             power of two for int8 (the first shipped int8 scale), an exact fp32
             scale per token and head, an fp32 scale per block and head, and the
             scales without the rotation.  The shipped schemes are also run on real
             int8 / fp8 pools: their drift must equal the fake path's (the sanity
             check of the simulation).  Bytes per token row
             and blocks per budget vs fp32 for each scheme.  The per-block scheme
             needs every row of a block written in one step: each text is one
             prompt prefilled whole in one step (checked).
write_speed  XLA micro-benchmark of one decode step's K/V writes (all layers, batch
             --batch, donated pool): fp32 rows; int8 with a scale per token (quantize +
             one row scatter); int8 with an fp32 scale per block and head (scatter-max
             of the new rows' amax into the touched blocks' scales, gather those
             blocks, dequantize, insert the row, requantize with the grown scale,
             scatter blocks and scales back).  TIMING: run on an idle machine.
step         decode step time: --batch (32) sequences decoding from prompts of
             --step_prompt_tokens (256) for --step_tokens (256) new tokens (contexts
             256..512), median wall / device ms of the steps where exactly --batch rows
             decode, per pool dtype, through `jpaged.LLM` (max_num_seqs = --batch).
             TIMING: run on an idle machine.
capacity     blocks of each pool dtype for the same kv_memory_fraction
             (`LLM(...).num_blocks`; max_num_seqs x max_model_len large enough that no
             pool is capped; on the CPU the available memory the engine sizes from is
             read once and pinned, so every dtype sees the same budget), and the ratio
             to float32; plus bytes per block and the blocks a fixed --budget_gib holds.

Writes benchmarks/results/kv_quant_<part>.csv, the summary kv_quant.csv (one row per
pool dtype: columns from whichever parts ran, earlier ones kept) and kv_quant.md
(one section per part; a run replaces only its own parts' sections).
"""

from __future__ import annotations

import csv
import gc
import math
import re
import time
from typing import Any

import numpy as np
from absl import app, flags

import harness as B  # benchmarks/harness.py (the script's own directory is on sys.path)

PARTS = ("agreement", "drift", "ablation", "write_speed", "step", "capacity")
DTYPES = ("float32", "bfloat16", "int8", "fp8_e4m3")

_PARTS = flags.DEFINE_list("parts", ["agreement", "drift", "ablation", "capacity"],
                           f"Parts to run, of {','.join(PARTS)} (write_speed and step are timings).")
_DTYPES = flags.DEFINE_list("dtypes", list(DTYPES), "Pool dtypes (kv_cache_dtype); float32 is the baseline.")
_IMPL = flags.DEFINE_string("attention_impl", "auto", "attention_impl of the agreement / drift / step engines.")
_AGREEMENT_TOKENS = flags.DEFINE_integer("agreement_tokens", 32, "New tokens per agreement prompt.")
_IGNORE_EOS = flags.DEFINE_bool("ignore_eos", False, "Agreement: decode all tokens past EOS.")
_ABLATION = flags.DEFINE_list(
    "ablation_schemes",
    ["int8_tok_qpow2_rot", "int8_tok_pow2_rot", "int8_tok_fp32_rot", "int8_blk_fp32_rot",
     "int8_blk_pow2_rot", "int8_tok_qpow2_norot", "int8_blk_fp32_norot", "fp8_tok_pow2_rot",
     "fp8_tok_fp32_rot", "fp8_tok_pow2_norot"],
    "Fake-quantized schemes <int8|fp8>_<tok|blk>_<pow2|qpow2|fp32>_<rot|norot> (tok: a scale per token "
    "and KV head; blk: per block and KV head; pow2: a power-of-two scale, qpow2: a quarter power of "
    "two 2**(c/4), fp32: the exact amax/qmax).")
_BATCH = flags.DEFINE_integer("batch", 32, "Decoding sequences (step, write_speed).")
_STEP_PROMPT = flags.DEFINE_integer("step_prompt_tokens", 256, "Step: prompt tokens per sequence.")
_STEP_TOKENS = flags.DEFINE_integer("step_tokens", 256, "Step: new tokens per sequence (EOS ignored).")
_STEP_DTYPES = flags.DEFINE_list("step_dtypes", ["float32", "int8", "fp8_e4m3"], "Step: pool dtypes.")
_WRITE_CONTEXT = flags.DEFINE_integer("write_context", 384, "write_speed: tokens each sequence holds.")
_REPS = flags.DEFINE_integer("reps", 50, "write_speed: timed calls per variant.")
_FRACTION = flags.DEFINE_float("kv_memory_fraction", 0.05, "Capacity: the pools' kv_memory_fraction.")
_BUDGET = flags.DEFINE_float("budget_gib", 1.0, "Capacity: fixed KV budget for the arithmetic rows.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Block size of every pool.")
_TAG = flags.DEFINE_string("tag", "kv_quant", "Results name prefix.")

# ----------------------------------------------------------------- workloads
SYSTEM_PIRATE = "You are a helpful assistant who always answers like a pirate."
SYSTEM_TERSE = "You are a precise technical assistant. Use short sentences and bullet points."

# 12 chats: facts, lists, code, a haiku, arithmetic, two with a system prompt.
AGREEMENT_CHATS: list[dict] = [
    {"prompt": "What is the capital of Australia, and why is it not Sydney?"},
    {"prompt": "List five fruits that are high in vitamin C."},
    {"prompt": "Write a Python function that returns the n-th Fibonacci number."},
    {"prompt": "Write a haiku about autumn leaves."},
    {"prompt": "What is 17 times 23? Show your working."},
    {"messages": [{"role": "system", "content": SYSTEM_PIRATE},
                  {"role": "user", "content": "How do I make a cup of tea?"}]},
    {"prompt": "Explain what a black hole is to a ten-year-old."},
    {"prompt": "Give me three tips for writing a good cover letter."},
    {"messages": [{"role": "system", "content": SYSTEM_TERSE},
                  {"role": "user", "content": "What is the difference between TCP and UDP?"}]},
    {"prompt": "Translate 'Good morning, how are you?' into French and Spanish."},
    {"prompt": "Write a SQL query that counts the orders per customer in a table called orders."},
    {"prompt": "Who wrote Pride and Prejudice, and what is it about?"},
]

# The perplexity set: 8 paragraphs of plain English prose, teacher-forced as raw text.
PROSE: list[str] = [
    # history
    "The printing press did not change Europe overnight. When Johannes Gutenberg began printing with "
    "movable metal type in Mainz around 1450, books were still rare and expensive objects, copied by hand "
    "in monasteries or by professional scribes in the growing university towns. His workshop combined "
    "several existing technologies: the screw press used for wine and olive oil, an oil-based ink that "
    "clung to metal, and a hand mould that could cast thousands of identical letters quickly. The result "
    "was not simply faster copying but a new kind of sameness. Two readers in different cities could now "
    "hold the same page, with the same errors, and argue about it in letters. Within fifty years presses "
    "had spread to more than two hundred towns, and millions of volumes were in circulation. Scholars "
    "still debate how much the press caused the Reformation, the scientific revolution and the rise of "
    "vernacular languages, but few doubt that it made all three easier to sustain.",
    # science
    "Photosynthesis is the process by which plants, algae and some bacteria turn light into chemical "
    "energy. Inside the chloroplasts of a leaf, pigments such as chlorophyll absorb mostly red and blue "
    "light and reflect green, which is why most plants look green to us. The absorbed energy is used to "
    "split water molecules, releasing oxygen as a by-product and producing energy carriers that the cell "
    "can spend later. In a second set of reactions, often called the Calvin cycle, the plant uses those "
    "carriers to fix carbon dioxide from the air into simple sugars. These sugars become the raw material "
    "for almost everything else the plant builds, from cellulose in its cell walls to the starch stored in "
    "its roots and seeds. Because animals eat plants, or eat other animals that did, nearly all the energy "
    "in a food web can be traced back to this quiet chemistry happening in sunlight.",
    # cooking
    "Good bread needs only four ingredients: flour, water, salt and yeast. The skill lies in how they are "
    "combined and, above all, in patience. When flour meets water, two proteins in the wheat join to form "
    "gluten, a stretchy network that traps the gas produced by the yeast. Kneading the dough, or simply "
    "folding it a few times over several hours, lines up those strands and makes the network stronger. "
    "A long, cool rise gives the yeast and the bacteria in the dough time to develop flavour, which is why "
    "many bakers leave their dough in the refrigerator overnight. Before baking, the loaf is shaped to "
    "create tension on its surface and scored with a sharp blade so that it can expand in a controlled "
    "way. A very hot oven and a little steam during the first minutes help the crust stay soft long enough "
    "for the bread to rise fully before it sets and browns.",
    # travel
    "The train from the coast climbs slowly into the mountains, following a river that grows narrower and "
    "louder with every tunnel. At first the valley is wide and green, with orchards and small farms "
    "scattered along the slopes. After an hour the fields give way to pine forest, and the villages become "
    "smaller, each gathered around a church with a pointed bell tower. Passengers who have made the trip "
    "before move to the left side of the carriage before the long curve above the lake, where the whole "
    "range suddenly appears, its peaks still white in early summer. The station at the end of the line is "
    "little more than a wooden platform and a cafe that serves hot chocolate and thick slices of apple "
    "cake. From there, a path marked with red and white stripes leads up through the meadows to a hut "
    "where hikers can spend the night before crossing the pass.",
    # economics
    "Inflation is a general rise in prices that reduces what a unit of money can buy. A little inflation "
    "is usually considered healthy, because it encourages people to spend and invest rather than hoard "
    "cash, and it gives central banks room to cut interest rates when the economy slows. Problems begin "
    "when prices rise quickly or unpredictably. Workers find that their wages buy less each month, savers "
    "see the value of their deposits shrink, and businesses struggle to plan because they cannot tell "
    "whether a higher price reflects real demand or simply a falling currency. Central banks respond by "
    "raising interest rates, which makes borrowing more expensive and cools spending. The difficulty is "
    "timing: interest rates affect the economy with long and variable delays, so policymakers must act "
    "on forecasts, knowing that raising rates too far or too fast can push the economy into a recession.",
    # biology
    "Honeybees live in colonies that can hold tens of thousands of workers, a few hundred males and a "
    "single queen. The workers are all female, and the tasks they perform change as they age. Young bees "
    "clean cells and feed the larvae; older ones build wax comb, guard the entrance and finally leave the "
    "hive to forage for nectar and pollen. A forager that finds a rich patch of flowers returns and "
    "performs a waggle dance on the comb. The angle of the dance relative to vertical tells her sisters the "
    "direction of the flowers relative to the sun, and the length of the waggle run encodes the distance. "
    "In winter the colony clusters together and shivers its flight muscles to keep the queen warm, living "
    "on the honey stored during the summer. A strong colony can survive for many years, even though each "
    "individual worker lives only a few weeks in the busy season.",
    # literature
    "The old house at the end of the lane had been empty for as long as anyone in the village could "
    "remember. Its windows were dark, its garden had grown wild, and the gate hung from a single hinge. "
    "Children dared each other to touch the front door and then ran away laughing, though none of them "
    "could say what they were afraid of. One autumn evening a light appeared in an upstairs room. The next "
    "morning there was smoke rising from the chimney, and by the end of the week the gate had been mended "
    "and painted blue. The new owner was a small, quiet woman who walked to the shop every day with a "
    "basket over her arm and greeted everyone by name, although no one remembered telling her their names. "
    "She planted roses along the path and left a bowl of apples by the gate for anyone who wanted one.",
    # technology
    "A computer's memory is organised as a hierarchy. At the top are the processor's registers, which hold "
    "a few values and can be read in a single cycle. Below them sit several levels of cache, small amounts "
    "of very fast memory that keep copies of recently used data close to the cores. Main memory is much "
    "larger but also much slower, and reaching it can cost hundreds of cycles. Below that is storage, "
    "solid state drives or spinning disks, which keep data when the power is off but are slower still. "
    "Programs run fast when most of their accesses hit the upper levels of this hierarchy, which is why "
    "the order in which data is laid out and visited matters so much. Operating systems add another layer "
    "with virtual memory, giving each process the illusion of a large private address space that is mapped "
    "page by page onto physical memory.",
]


# ----------------------------------------------------------------- engine helpers
def make_llm(dtype: str, impl: str | None = None, **kw: Any):
    kw.setdefault("block_size", _BLOCK_SIZE.value)
    return B.make_llm(kv_cache_dtype=dtype, attention_impl=impl or _IMPL.value, **kw)


def release(llm: Any) -> None:
    try:
        llm.close()
    except Exception:  # noqa: BLE001 -- best effort
        pass
    del llm
    gc.collect()


def impl_note(llm: Any) -> str:
    """What attention actually ran: the resolved impl, and for "cpu" whether the
    kernel takes this pool's dtype (else the reference ran)."""
    impl = llm.attention_impl
    if impl == "cpu":
        import jax.numpy as jnp
        from pallas_kernels import cpu
        ok = cpu.available() and jnp.dtype(llm.kv_dtype) in getattr(cpu, "POOL_DTYPES", ())
        return "cpu" if ok else "cpu->reference"
    return impl


# ----------------------------------------------------------------- agreement
def run_agreement(dtypes: list[str]) -> tuple[list[dict], list[dict]]:
    import dataclasses
    # logprobs=2: the fp32 pool's top-2 gap where an answer first differs (how near a tie it was).
    params = dataclasses.replace(B.greedy(_AGREEMENT_TOKENS.value, ignore_eos=_IGNORE_EOS.value), logprobs=2)
    tokens: dict[str, list[list[int]]] = {}
    tops: dict[str, list[list[tuple]]] = {}
    notes: dict[str, str] = {}
    for dt in dtypes:
        llm = make_llm(dt, max_num_seqs=len(AGREEMENT_CHATS), max_model_len=512, enable_prefix_caching=False)
        outs = llm.generate(AGREEMENT_CHATS, params)
        bad = [o.error for o in outs if o.finish_reason == "error"]
        if bad:
            raise RuntimeError(f"{dt}: {bad[0]}")
        tokens[dt] = [list(o.token_ids) for o in outs]
        tops[dt] = [[lp.top for lp in o.logprobs] for o in outs]
        notes[dt] = impl_note(llm)
        print(f"agreement {dt} ({notes[dt]}): {[len(t) for t in tokens[dt]]} tokens", flush=True)
        if dt == "float32":
            for c, o in zip(AGREEMENT_CHATS, outs):
                print(f"   {_chat_label(c)[:40]!r} -> {o.text[:60]!r}")
        release(llm)
    base = tokens["float32"]
    detail, summary = [], []
    for dt in dtypes:
        diffs = []
        for i, (a, b) in enumerate(zip(base, tokens[dt])):
            first = _first_diff(a, b)
            margin = second = None
            if first is not None and first < len(tops["float32"][i]) and len(tops["float32"][i][first]) > 1:
                (t1, l1), (t2, l2) = tops["float32"][i][first][:2]
                margin = l1 - l2
                second = first < len(b) and b[first] == t2
            diffs.append((first, margin))
            detail.append({"kv_dtype": dt, "prompt": _chat_label(AGREEMENT_CHATS[i])[:48],
                           "tokens": len(b), "fp32_tokens": len(a), "identical": first is None,
                           "first_diff": first, "fp32_top2_gap": margin, "took_fp32_second": second})
        same = sum(d is None for d, _ in diffs)
        summary.append({"kv_dtype": dt, "attention": notes[dt],
                        "identical": f"{same}/{len(base)}",
                        "first_diff_positions": " ".join(
                            f"#{i}@{d}" + (f"({m:.2f})" if m is not None else "")
                            for i, (d, m) in enumerate(diffs) if d is not None) or "-"})
    return summary, detail


def _chat_label(c: dict) -> str:
    if "prompt" in c:
        return c["prompt"]
    return "[system] " + c["messages"][-1]["content"]


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ----------------------------------------------------------------- drift
def teacher_forced(llm: Any, check_one_step: bool = False) -> list[np.ndarray]:
    """Each PROSE text's per-token logprobs (of the actual next token) with this engine."""
    from jpaged.core.sequence import SamplingParams
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    B.cold_prefix_cache(llm)
    outs = llm.generate(list(PROSE), params)
    st = llm.stats
    if check_one_step and st.prefill_steps != 1:
        raise RuntimeError(f"the prompts were prefilled in {st.prefill_steps} steps, not 1: a block-scale "
                           "scheme needs every block written in one step")
    res = []
    for o in outs:
        if o.finish_reason == "error":
            raise RuntimeError(o.error)
        res.append(np.array([p.logprob for p in o.prompt_logprobs[1:]], dtype=np.float64))
    return res


def drift_stats(base: list[np.ndarray], lps: list[np.ndarray]) -> dict:
    b, x = np.concatenate(base), np.concatenate(lps)
    d = np.abs(x - b)
    per_text = [float(np.abs(xi - bi).mean()) for xi, bi in zip(lps, base)]
    return {"tokens": int(d.size), "mean_abs_dlogprob": float(d.mean()),
            "se_mean": float(np.std(per_text, ddof=1) / np.sqrt(len(per_text))) if len(per_text) > 1 else None,
            "p99_abs_dlogprob": float(np.quantile(d, 0.99)),
            "max_abs_dlogprob": float(d.max()), "ppl": float(np.exp(-x.mean())), "ppl_fp32": float(np.exp(-b.mean()))}


def drift_engine_kw() -> dict:
    # One step prefills every text whole: max_num_batched_tokens holds all of them.
    return dict(max_num_seqs=len(PROSE), max_model_len=512, max_num_batched_tokens=4096,
                enable_prefix_caching=False)


def run_drift(dtypes: list[str]) -> tuple[list[dict], dict[str, list[np.ndarray]]]:
    lps: dict[str, list[np.ndarray]] = {}
    notes = {}
    for dt in dtypes:
        llm = make_llm(dt, **drift_engine_kw())
        lps[dt] = teacher_forced(llm)
        notes[dt] = impl_note(llm)
        print(f"drift {dt} ({notes[dt]}): {sum(map(len, lps[dt]))} tokens, per text "
              f"{[len(x) for x in lps[dt]]}", flush=True)
        release(llm)
    rows = [{"kv_dtype": dt, "attention": notes[dt], **drift_stats(lps["float32"], lps[dt])} for dt in dtypes]
    return rows, lps


# ----------------------------------------------------------------- ablation: fake-quantized writes
SHIPPED_SCALE = {"int8": "qpow2", "fp8": "pow2"}  # what reference.quantize_rows does, per kind


def parse_scheme(name: str) -> dict:
    m = re.fullmatch(r"(int8|fp8)_(tok|blk)_(pow2|qpow2|fp32)_(rot|norot)", name)
    if not m:
        raise ValueError(f"scheme {name!r} is not <int8|fp8>_<tok|blk>_<pow2|qpow2|fp32>_<rot|norot>")
    return {"kind": m[1], "gran": m[2], "scale": m[3], "rotate": m[4] == "rot"}


def scheme_row_bytes(s: dict, head_dim: int, block_size: int) -> float:
    """Bytes one token's K (or V) row of one KV head takes: values + its share of the scale."""
    scale = 4 if s["scale"] == "fp32" else 1  # a code byte (pow2, qpow2) vs an fp32 scale
    return head_dim + (scale if s["gran"] == "tok" else scale / block_size)


def quant_with_amax(x, amax, s: dict):
    """x [..., D] fp32 quantized and dequantized with the scale that maps amax [..., 1] to
    the dtype's range: an exact fp32 scale ("fp32"), the power of two above it ("pow2"),
    or the quarter power of two above it ("qpow2": 2**(c/4), c an integer: one byte too)."""
    import jax.numpy as jnp
    from pallas_kernels import reference as R
    dtype = jnp.dtype(jnp.int8 if s["kind"] == "int8" else jnp.float8_e4m3fn)
    qmax = R.QUANT_MAX[dtype]
    amax = jnp.maximum(amax, 1e-30)
    if s["scale"] == "pow2":
        e = jnp.clip(jnp.ceil(jnp.log2(amax / qmax)), -16, 16)
        scale = jnp.exp2(e)
    elif s["scale"] == "qpow2":
        e = jnp.clip(jnp.ceil(4 * jnp.log2(amax / qmax)), -64, 64)
        scale = jnp.exp2(e / 4)
    else:
        scale = amax / qmax
    y = jnp.clip(x / scale, -qmax, qmax)
    y = jnp.round(y) if dtype == jnp.int8 else y.astype(dtype).astype(jnp.float32)
    return y * scale


def fake_backend(s: dict, head_dim: int):
    """A pallas_kernels Backend for a float32 pool that simulates scheme s: its K/V write
    stores the rows quantized and dequantized (fp32), its attention is the reference's.

    With the rotation it does what jpaged.models.base does around a quantized pool, with
    the same ops: q, k, v rotated by the Hadamard matrix (x @ H) before the write and
    the attention, the output rotated back; the pool holds rotated rows.  Dequantizing
    a row is exact in fp32, so for the shipped scheme this is the real int8 / fp8 pool's
    computation with the dequantization moved from the read to the write.
    Per block (gran "blk"): a block's scale per (K|V, KV head) is the max over the rows
    this step writes into it (scatter-max): the block's true scale when every row of
    the block is written in one step (a whole-prompt prefill: `teacher_forced` checks)."""
    import jax.numpy as jnp
    from jpaged.models.base import kv_rotation
    from pallas_kernels import Backend
    from pallas_kernels import reference as R
    rot = jnp.asarray(kv_rotation(head_dim)) if s["rotate"] else None
    qdtype = jnp.int8 if s["kind"] == "int8" else jnp.float8_e4m3fn

    def rotate(x):  # as base.paged_attention: [T, heads, D] @ H
        return jnp.einsum("thd,de->the", x.astype(jnp.float32), rot).astype(x.dtype)

    def write_kv(kv_pool, layer, k, v, blocks, offsets):
        if rot is not None:
            k, v = rotate(k), rotate(v)
        kv = jnp.stack([k, v], axis=1).astype(jnp.float32)  # [T, 2, KVH, D]
        if s["gran"] == "tok" and s["scale"] == SHIPPED_SCALE[s["kind"]]:  # the shipped quantizer itself
            fq = R.dequantize_rows(*R.quantize_rows(kv, qdtype))
        elif s["gran"] == "tok":
            fq = quant_with_amax(kv, jnp.max(jnp.abs(kv), axis=-1, keepdims=True), s)
        else:
            row_amax = jnp.max(jnp.abs(kv), axis=-1)  # [T, 2, KVH]
            blk_amax = jnp.zeros((kv_pool.shape[0],) + row_amax.shape[1:], jnp.float32)
            blk_amax = blk_amax.at[blocks].max(row_amax, mode="drop")
            fq = quant_with_amax(kv, blk_amax[blocks][..., None], s)
        return kv_pool.at[blocks, layer, :, :, offsets].set(fq.astype(kv_pool.dtype), mode="drop",
                                                               unique_indices=False)

    def attention(q, kv_pool, *args, **kw):
        if rot is None:
            return R.paged_attention_reference(q, kv_pool, *args, **kw)
        out = R.paged_attention_reference(rotate(q), kv_pool, *args, **kw)
        return jnp.einsum("the,de->thd", out.astype(jnp.float32), rot).astype(out.dtype)

    return Backend("reference", attention, write_kv)


class patched_backend:
    """While active, the model's "reference" backend is `backend`
    (jpaged.models.base resolves the backend by name while tracing)."""

    def __init__(self, backend: Any):
        self.backend = backend

    def __enter__(self):
        import jpaged.models.base as base
        from pallas_kernels import get_backend
        self._base, self._orig = base, base.get_backend
        backend = self.backend
        base.get_backend = lambda impl: backend if impl == "reference" else get_backend(impl)
        return self

    def __exit__(self, *exc):
        self._base.get_backend = self._orig


def run_ablation(schemes: list[str]) -> list[dict]:
    kw = drift_engine_kw()
    llm = make_llm("float32", impl="reference", **kw)
    D, bs = llm.model_config.head_dim, llm.config.block_size
    base = teacher_forced(llm)
    release(llm)
    print(f"ablation baseline: float32 pool, reference attention, {sum(map(len, base))} tokens", flush=True)
    rows = []
    real = {}
    for kind, dt in (("int8", "int8"), ("fp8", "fp8_e4m3")):  # real pools, same attention: the check
        if f"{kind}_tok_{SHIPPED_SCALE[kind]}_rot" in schemes:
            llm = make_llm(dt, impl="reference", **kw)
            real[dt] = teacher_forced(llm)
            release(llm)
            r = {"scheme": f"{dt} pool (real, shipped)", "kind": dt, "scale_per": "token x KV head",
                 "scale": SHIPPED_SCALE[kind], "rotation": True, "bytes_per_row": D + D / _BLOCK_SIZE.value,
                 "blocks_vs_fp32": 4 * _BLOCK_SIZE.value / (_BLOCK_SIZE.value + 1), **drift_stats(base, real[dt])}
            rows.append(r)
            print(f"ablation real {dt}: mean {r['mean_abs_dlogprob']:.5f} max {r['max_abs_dlogprob']:.4f}", flush=True)
    for name in schemes:
        s = parse_scheme(name)
        with patched_backend(fake_backend(s, D)):
            llm = make_llm("float32", impl="reference", **kw)
            lps = teacher_forced(llm, check_one_step=s["gran"] == "blk")
            release(llm)
        nb = scheme_row_bytes(s, D, bs)
        r = {"scheme": name, "kind": s["kind"], "scale_per": "token x KV head" if s["gran"] == "tok"
             else f"block ({bs} tokens) x KV head", "scale": s["scale"], "rotation": s["rotate"],
             "bytes_per_row": nb, "blocks_vs_fp32": 4 * D / nb, **drift_stats(base, lps)}
        dt = "int8" if s["kind"] == "int8" else "fp8_e4m3"
        if name == f"{s['kind']}_tok_{SHIPPED_SCALE[s['kind']]}_rot" and dt in real:
            r["vs_real_pool_max_abs"] = float(np.abs(np.concatenate(lps) - np.concatenate(real[dt])).max())
        rows.append(r)
        print(f"ablation {name}: mean {r['mean_abs_dlogprob']:.5f} max {r['max_abs_dlogprob']:.4f} "
              f"ppl {r['ppl']:.3f}" + (f"  (vs real pool: max {r['vs_real_pool_max_abs']:.2e})"
                                       if "vs_real_pool_max_abs" in r else ""), flush=True)
    return rows


# ----------------------------------------------------------------- write speed (XLA micro-benchmark)
def run_write_speed() -> list[dict]:
    """One decode step's K/V writes over all layers (batch tokens, one per sequence,
    each in its own block), jitted with the pool donated; median of --reps calls."""
    import jax
    import jax.numpy as jnp
    from pallas_kernels.reference import write_kv_reference
    llm = make_llm("float32", max_num_seqs=1, max_model_len=256, num_blocks=2)
    cfg = llm.model_config
    L, KVH, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    release(llm)
    bs, Bt, ctx = _BLOCK_SIZE.value, _BATCH.value, _WRITE_CONTEXT.value
    per_seq = math.ceil((ctx + 1) / bs)
    NB = 1 + Bt * per_seq
    rng = np.random.default_rng(0)
    # Sequence i owns blocks 1 + i*per_seq ...; its new token goes to position ctx.
    blocks = jnp.asarray(1 + np.arange(Bt) * per_seq + ctx // bs, jnp.int32)
    offsets = jnp.asarray(np.full(Bt, ctx % bs), jnp.int32)
    k = jnp.asarray(rng.standard_normal((L, Bt, KVH, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((L, Bt, KVH, D)), jnp.float32)

    def per_layer(fn):
        def step(pool, k, v, blocks, offsets):
            for layer in range(L):  # unrolled, as the step's layer loop on the CPU
                pool = fn(pool, layer, k[layer], v[layer], blocks, offsets)
            return pool
        return jax.jit(step, donate_argnums=(0,))

    def write_fp32(pool, layer, k, v, blocks, offsets):
        kv = jnp.stack([k, v], axis=1)
        return pool.at[blocks, layer, :, :, offsets].set(kv, mode="drop", unique_indices=True)

    def write_tok(pool, layer, k, v, blocks, offsets):   # values to their rows, codes to the code rows
        return write_kv_reference(pool, layer, k, v, blocks, offsets)

    def write_blk(state, layer, k, v, blocks, offsets):
        vals, scales = state  # int8 [NB, L, 2, KVH, BS, D], fp32 [NB, L, 2, KVH]
        kv = jnp.stack([k, v], axis=1)                                   # [T, 2, KVH, D]
        amax = jnp.max(jnp.abs(kv), axis=-1)                             # [T, 2, KVH]
        s_old = scales[blocks, layer]                                    # [T, 2, KVH]
        scales = scales.at[blocks, layer].max(amax / 127.0, mode="drop")  # scatter-max of the new rows
        s_new = scales[blocks, layer]
        blk = vals[blocks, layer].astype(jnp.float32) * s_old[..., None, None]  # gather + dequantize
        blk = blk.at[jnp.arange(blocks.shape[0]), :, :, offsets].set(kv)  # insert the new row
        safe = jnp.where(s_new > 0, s_new, 1.0)[..., None, None]
        q = jnp.clip(jnp.round(blk / safe), -127, 127).astype(jnp.int8)  # requantize the block
        vals = vals.at[blocks, layer].set(q, mode="drop", unique_indices=True)
        return vals, scales

    variants = {
        "fp32 rows (plain scatter)": (write_fp32, lambda: jnp.zeros((NB, L, 2, KVH, bs, D), jnp.float32),
                                      4 * D),
        "int8, one-byte scale code per token x head (shipped)": (
            write_tok, lambda: jnp.zeros((NB, L, 2, KVH, bs + 1, D), jnp.int8), D + D / bs),
        "int8, fp32 scale per block x head (requantize)": (
            write_blk, lambda: (jnp.zeros((NB, L, 2, KVH, bs, D), jnp.int8),
                                jnp.zeros((NB, L, 2, KVH), jnp.float32)), D + 4 / bs),
    }
    rows = []
    for name, (fn, make_pool, row_bytes) in variants.items():
        f = per_layer(fn)
        pool = make_pool()
        pool = f(pool, k, v, blocks, offsets)  # compile
        jax.block_until_ready(pool)
        ts = []
        for _ in range(_REPS.value):
            t0 = time.perf_counter()
            pool = f(pool, k, v, blocks, offsets)
            jax.block_until_ready(pool)
            ts.append(time.perf_counter() - t0)
        rows.append({"write": name, "batch": Bt, "layers": L, "bytes_per_row": row_bytes,
                     "median_us_per_step": 1e6 * float(np.median(ts)),
                     "us_per_layer": 1e6 * float(np.median(ts)) / L, "reps": len(ts)})
        print(f"write {name}: {rows[-1]['median_us_per_step']:.1f} us per step", flush=True)
    return rows


# ----------------------------------------------------------------- decode step
def prose_ids(llm: Any) -> list[int]:
    ids: list[int] = []
    for p in PROSE:
        ids += llm.tokenize(p)
    return ids


def run_step(dtypes: list[str]) -> list[dict]:
    Bt, P, N = _BATCH.value, _STEP_PROMPT.value, _STEP_TOKENS.value
    rows = []
    for dt in dtypes:
        llm = make_llm(dt, max_num_seqs=Bt, max_model_len=P + N + _BLOCK_SIZE.value,
                       max_num_batched_tokens=max(1024, Bt))
        pool = prose_ids(llm)
        # Distinct prompts (different windows of the prose), no shared prefix.
        prompts = [[pool[(i * 37 + j) % len(pool)] for j in range(P)] for i in range(Bt)]
        timed = B.time_decode_steps(llm, Bt, N, ids=prompts)  # the first pass compiles the buckets
        result = {"kv_dtype": dt, "attention": impl_note(llm), "batch": Bt, "context": f"{P}..{P + N}",
                  **timed}
        rows.append(result)
        print(f"step {dt}: {result['step_ms']:.2f} ms (device {result['device_ms']:.2f}), "
              f"{result['steps_timed']} steps", flush=True)
        release(llm)
    base = next((r["step_ms"] for r in rows if r["kv_dtype"] == "float32"), None)
    for r in rows:
        r["vs_fp32"] = r["step_ms"] / base if base else None
    return rows


# ----------------------------------------------------------------- capacity
def run_capacity(dtypes: list[str]) -> tuple[list[dict], str]:
    import jax
    import jpaged.runtime.kv_pool as kvp
    from jpaged.core.rounding import cdiv
    from jpaged.runtime.kv_pool import bytes_per_block
    max_num_seqs, max_model_len = 256, 2048
    pinned = None
    orig = kvp.available_host_memory
    if jax.default_backend() == "cpu":
        pinned = orig()
        kvp.available_host_memory = lambda: pinned
    note = (f"available host memory pinned at {pinned / 2**30:.2f} GiB for every engine"
            if pinned else f"{jax.default_backend()} free memory as each engine reads it")
    rows = []
    try:
        for dt in dtypes:
            llm = make_llm(dt, kv_memory_fraction=_FRACTION.value, max_num_seqs=max_num_seqs,
                           max_model_len=max_model_len)
            bs = llm.config.block_size
            cap = max_num_seqs * cdiv(max_model_len, bs) + 1
            bpb = bytes_per_block(llm.model_config, bs, llm.kv_dtype)
            if llm.num_blocks >= cap:
                raise RuntimeError(f"{dt}: pool capped at {cap} blocks: lower --kv_memory_fraction")
            budget = int(_BUDGET.value * 2**30)
            rows.append({"kv_dtype": dt, "pool_dtype": str(llm.kv_dtype), "bytes_per_block": bpb,
                         "bytes_per_token": bpb // bs, "num_blocks": llm.num_blocks,
                         "pool_mib": llm.kv_pool_bytes / 2**20, "tokens": llm.num_blocks * bs,
                         f"blocks_in_{_BUDGET.value:g}gib": budget // bpb})
            print(f"capacity {dt}: {llm.num_blocks} blocks of {bpb} B", flush=True)
            release(llm)
    finally:
        kvp.available_host_memory = orig
    base = next((r for r in rows if r["kv_dtype"] == "float32"), None)
    for r in rows:
        r["blocks_vs_fp32"] = r["num_blocks"] / base["num_blocks"] if base else None
    return rows, note


# ----------------------------------------------------------------- output
def update_summary(name: str, updates: dict[str, dict]) -> None:
    """benchmarks/results/<name>.csv: one row per pool dtype, the given columns replaced."""
    path = B.RESULTS / f"{name}.csv"
    rows: dict[str, dict] = {}
    cols: list[str] = ["kv_dtype"]
    if path.exists():
        with open(path) as f:
            r = csv.DictReader(f)
            cols = list(r.fieldnames or cols)
            for row in r:
                rows[row["kv_dtype"]] = row
    for dt, u in updates.items():
        rows.setdefault(dt, {"kv_dtype": dt}).update(u)
        cols += [c for c in u if c not in cols]
    order = [d for d in DTYPES if d in rows] + [d for d in rows if d not in DTYPES]
    B.write_csv(name, [rows[d] for d in order], cols)
    print(f"[updated {path.relative_to(B.REPO)}]")


def update_markdown(name: str, sections: dict[str, str]) -> None:
    """benchmarks/results/<name>.md: each part's section between its markers replaced
    (added at the end when new); other parts' sections are kept."""
    path = B.RESULTS / f"{name}.md"
    text = path.read_text() if path.exists() else (
        "# Quantized KV pools (`make bench-kv-quant`)\n\n"
        "SmolLM2-135M-Instruct (fp32 weights), block size 16.  Sections come from "
        "`benchmarks/bench_kv_quant.py --parts=...`; each is dated with the machine it ran on.\n")
    for part in PARTS:  # in the script's order
        if part not in sections:
            continue
        body = f"<!-- part:{part} -->\n{sections[part].rstrip()}\n<!-- /part:{part} -->"
        pat = re.compile(rf"<!-- part:{part} -->.*?<!-- /part:{part} -->", re.S)
        text = pat.sub(lambda _: body, text) if pat.search(text) else text.rstrip("\n") + "\n\n" + body + "\n"
    B.write_markdown(name, text)


def stamp() -> str:
    return f"_{B.machine()}, {B.today()}_"


def main(argv):
    del argv
    B.header("kv quant")
    parts = [p.strip() for p in _PARTS.value if p.strip()]
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise app.UsageError(f"unknown parts {sorted(unknown)}; expected some of {PARTS}")
    dtypes = list(_DTYPES.value)
    if "float32" not in dtypes:
        dtypes.insert(0, "float32")
    tag = _TAG.value
    md: dict[str, str] = {}
    summary: dict[str, dict] = {}
    fmt = {"mean_abs_dlogprob": ".5f", "se_mean": ".5f", "p99_abs_dlogprob": ".4f", "max_abs_dlogprob": ".4f", "ppl": ".3f",
           "ppl_fp32": ".3f", "bytes_per_row": ".2f", "blocks_vs_fp32": ".3f", "vs_real_pool_max_abs": ".2e",
           "median_us_per_step": ".1f", "us_per_layer": ".2f", "step_ms": ".2f", "device_ms": ".2f",
           "vs_fp32": ".3f", "pool_mib": ".1f"}

    if "agreement" in parts:
        rows, detail = run_agreement(dtypes)
        B.report(f"{tag}_agreement", detail, title="Greedy agreement with the fp32 pool, per prompt")
        print("\n" + B.table(rows))
        for r in rows:
            summary.setdefault(r["kv_dtype"], {})["greedy_identical"] = r["identical"]
        n = _AGREEMENT_TOKENS.value
        md["agreement"] = (
            f"## Greedy agreement ({len(AGREEMENT_CHATS)} chats, {n} new tokens)\n\n{stamp()}\n\n"
            f"Greedy tokens of each pool vs the float32 pool's (EOS {'ignored' if _IGNORE_EOS.value else 'honoured'}"
            f"; `#prompt@position(gap)` = where a differing answer first differs, 0-based, and the float32 "
            "pool's logprob gap between its top two tokens there: small gaps are near-ties).  Prompts: "
            + "; ".join(f"#{i} {_chat_label(c)[:40]}" for i, c in enumerate(AGREEMENT_CHATS)) + ".\n\n"
            + B.markdown_table(rows) + "\n")

    if "drift" in parts:
        rows, _ = run_drift(dtypes)
        cols = ["kv_dtype", "attention", "tokens", "mean_abs_dlogprob", "se_mean", "p99_abs_dlogprob", "max_abs_dlogprob", "ppl"]
        B.report(f"{tag}_drift", rows, cols, fmt, title="Teacher-forced logprob drift vs the fp32 pool")
        for r in rows:
            summary.setdefault(r["kv_dtype"], {}).update(
                {"mean_abs_dlogprob": f"{r['mean_abs_dlogprob']:.5f}", "max_abs_dlogprob": f"{r['max_abs_dlogprob']:.4f}",
                 "ppl": f"{r['ppl']:.3f}"})
        md["drift"] = (
            f"## Per-token logprob drift ({len(PROSE)} prose paragraphs, teacher-forced)\n\n{stamp()}\n\n"
            "`prompt_logprobs` of every token after the first, |logprob − the float32 pool's| and the "
            "perplexity over all of them.\n\n" + B.markdown_table(rows, cols, fmt) + "\n")

    if "ablation" in parts:
        rows = run_ablation(list(_ABLATION.value))
        cols = ["scheme", "kind", "scale_per", "scale", "rotation", "bytes_per_row", "blocks_vs_fp32",
                "mean_abs_dlogprob", "se_mean", "p99_abs_dlogprob", "max_abs_dlogprob", "ppl", "vs_real_pool_max_abs"]
        B.report(f"{tag}_ablation", rows, cols, fmt, title="Which scale: drift vs the fp32 pool (reference attention)")
        md["ablation"] = (
            f"## Which scale (ablation)\n\n{stamp()}\n\n"
            "Each scheme runs on a float32 pool through a stand-in for the reference backend "
            "(`fake_backend`): its K/V write stores the rows quantized and dequantized, and where "
            "`rotation` it rotates q, k, v by the Hadamard matrix and the output back, as the model "
            "does around a quantized pool.  The drift set is teacher-forced; the baseline is the "
            "float32 pool under the same (reference) attention.  `pool (real, shipped)`: the engine's "
            "own int8 / fp8 pool; `vs_real_pool_max_abs`: the simulated shipped scheme's largest "
            "per-token difference from it (the simulation's check: 0 = bit-identical).  Per block: one "
            "scale per (block, K|V, KV head), the max over the block's rows (each text prefilled whole "
            "in one step, so every block's rows are written together; a decode-time write would also "
            "requantize the block when its scale grows).  `se_mean`: standard error of the mean drift "
            "over the texts' means.  Compare means, not per-token maxima: which rows round which way "
            "changes under any fp32-level perturbation of the inputs (a first version of the simulation "
            "that stored the rows rotated back, mathematically the same scheme, differed from the real "
            "int8 pool by up to 0.2 on single tokens with the same mean drift).  "
            "`bytes_per_row`: one token's K (or V) row of one head, head_dim "
            "values + its share of the scale; `blocks_vs_fp32`: blocks the same budget holds, "
            "relative to fp32 rows (4 × head_dim bytes).\n\n" + B.markdown_table(rows, cols, fmt) + "\n")

    if "write_speed" in parts:
        rows = run_write_speed()
        B.report(f"{tag}_write_speed", rows, formats=fmt, title="K/V write of one decode step, all layers")
        md["write_speed"] = (
            f"## K/V write per decode step (XLA micro-benchmark)\n\n{stamp()}\n\n"
            f"Batch {_BATCH.value} (one token per sequence, each in its own block, contexts "
            f"{_WRITE_CONTEXT.value}), every layer, jitted with the pool donated; median of "
            f"{_REPS.value} calls.\n\n" + B.markdown_table(rows, formats=fmt) + "\n")

    if "step" in parts:
        rows = run_step(list(_STEP_DTYPES.value))
        B.report(f"{tag}_step", rows, formats=fmt, title="Decode step time per pool dtype")
        for r in rows:
            summary.setdefault(r["kv_dtype"], {}).update({f"step_ms_b{_BATCH.value}": f"{r['step_ms']:.2f}"})
        md["step"] = (
            f"## Decode step at batch {_BATCH.value}\n\n{stamp()}\n\n"
            f"{_BATCH.value} sequences of {_STEP_PROMPT.value}-token prompts decoding {_STEP_TOKENS.value} "
            "tokens (EOS ignored) through `jpaged.LLM`; median over the steps where exactly every row "
            "decodes (second pass; the first compiles).\n\n" + B.markdown_table(rows, formats=fmt) + "\n")

    if "capacity" in parts:
        rows, note = run_capacity(dtypes)
        B.report(f"{tag}_capacity", rows, formats=fmt,
                 title=f"Blocks for kv_memory_fraction {_FRACTION.value:g} ({note})")
        for r in rows:
            summary.setdefault(r["kv_dtype"], {}).update(
                {"bytes_per_block": r["bytes_per_block"], "blocks_vs_fp32": f"{r['blocks_vs_fp32']:.3f}"})
        md["capacity"] = (
            f"## Capacity (same kv_memory_fraction {_FRACTION.value:g})\n\n{stamp()}\n\n"
            f"`LLM(kv_cache_dtype=..., kv_memory_fraction={_FRACTION.value:g}, max_num_seqs=256, "
            f"max_model_len=2048).num_blocks` ({note}; no pool reaches the max_num_seqs × max_model_len cap), "
            f"and the blocks a fixed {_BUDGET.value:g} GiB holds.\n\n" + B.markdown_table(rows, formats=fmt) + "\n")

    if summary:
        update_summary(tag, summary)
    if md:
        update_markdown(tag, md)


if __name__ == "__main__":
    app.run(main)
