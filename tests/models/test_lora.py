"""LoRA adapters in the engine against PEFT + transformers (adapter merged), on tiny models.

Adapters are random (init_lora_weights=False: B is not zero), of rank 8 and 16,
on every projection or a subset; each engine holds several at once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import TINY_ENGINE, assert_all_blocks_free, import_torch, make_peft_adapter, random_prompts
from jpaged.core.sequence import SamplingParams
from jpaged.decode import score

torch = import_torch()
peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> LoraConfig keywords
ADAPTERS = {
    "all8": dict(r=8, lora_alpha=16, target_modules=ALL),
    "qv16": dict(r=16, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "mlp8rs": dict(r=8, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"], use_rslora=True),
}
LOGIT_ATOL = 1e-4
NEW_TOKENS = 12
# decode.score jitted (the graphdef static): one program per shape instead of its ops
# run one by one, eagerly (several seconds a call, its gradient more).
_score = jax.jit(score, static_argnums=0)


def make_adapter(hf_model, root, name: str, seed: int):
    """Saves a random PEFT adapter; returns (its directory, the HF model with it merged)."""
    path = root / name
    return path, make_peft_adapter(hf_model, path, seed, **ADAPTERS[name]).merge_and_unload().eval()


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def family(request, tmp_path_factory):
    """(engine holding every ADAPTERS entry, HF base model, {name: merged HF model})."""
    from jpaged.engine.llm import LLM
    path, hf = request.getfixturevalue(f"tiny_{request.param}")
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    made = {name: make_adapter(hf, root, name, seed) for seed, name in enumerate(ADAPTERS)}
    modules = ",".join(f"{name}={p}" for name, (p, _) in made.items())
    llm = LLM(model=str(path), **{**TINY_ENGINE, "lora_modules": modules, "max_loras": 4,
                                  "enable_prefix_caching": True})
    return llm, hf, {name: merged for name, (_, merged) in made.items()}


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def greedy(lora: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, lora=lora)


def test_logprobs_match_merged_adapter(family):
    """decode.score under each adapter's slot = the merged HF model's log-softmax (1e-4)."""
    llm, hf, merged = family
    prompts = random_prompts([9, 21], seed=3)
    L = max(map(len, prompts))
    ids = np.zeros((len(prompts), L), np.int32)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
    lens = np.array([len(p) for p in prompts], np.int32)
    weights, slots = llm.lora_weights()
    for name, model in merged.items():
        got = _score(llm.graphdef, llm.params, jnp.asarray(ids), jnp.asarray(lens), lora=weights,
                     lora_slots=jnp.full(len(prompts), slots[name], jnp.int32))
        for i, p in enumerate(prompts):
            with torch.no_grad():
                logits = model(torch.tensor([p])).logits[0].double()
            want = torch.log_softmax(logits, -1)[torch.arange(len(p) - 1), torch.tensor(p[1:])].numpy()
            np.testing.assert_allclose(np.asarray(got)[i, :len(p) - 1], want, atol=LOGIT_ATOL, err_msg=name)
    base = _score(llm.graphdef, llm.params, jnp.asarray(ids), jnp.asarray(lens))
    with_minus_one = _score(llm.graphdef, llm.params, jnp.asarray(ids), jnp.asarray(lens), lora=weights,
                            lora_slots=jnp.full(len(prompts), -1, jnp.int32))
    np.testing.assert_array_equal(np.asarray(base), np.asarray(with_minus_one))


def test_paged_logits_of_a_mixed_batch_match_merged_adapters(family):
    """One paged forward over four sequences, each under its own adapter (or the base):
    every token's logits within 1e-4 of the merged HF model's."""
    from jpaged.decode import create_kv_pool, forward_step, ragged_metadata
    from jpaged.layers.lora import LoraBatch, token_slots
    llm, hf, merged = family
    weights, slots = llm.lora_weights()
    names = [None, "all8", "qv16", "mlp8rs"]
    prompts = random_prompts([7, 13, 5, 10], seed=19)
    B, bs, W = len(prompts), 16, 1
    T = sum(map(len, prompts))
    pool = create_kv_pool(llm.model_config, num_blocks=1 + B * W, block_size=bs, dtype=jnp.float32)
    tables = 1 + jnp.arange(B * W, dtype=jnp.int32).reshape(B, W)
    meta = ragged_metadata(tables, jnp.zeros(B, jnp.int32), jnp.array([len(p) for p in prompts]), T, bs)
    row_slots = jnp.array([-1 if n is None else slots[n] for n in names], jnp.int32)
    lora = LoraBatch(weights, token_slots(row_slots, meta.cu_q_lens, T))
    logits, _ = jax.jit(forward_step, static_argnums=0, static_argnames="logits")(
        llm.graphdef, llm.params, pool, jnp.asarray(sum(prompts, [])), meta, logits="all", lora=lora)
    logits, start = np.asarray(logits), 0
    for p, n in zip(prompts, names):
        with torch.no_grad():
            want = (hf if n is None else merged[n])(torch.tensor([p])).logits[0].numpy()
        np.testing.assert_allclose(logits[start:start + len(p)], want, atol=LOGIT_ATOL, err_msg=str(n))
        start += len(p)


def test_mixed_batch_matches_merged_and_alone(family):
    """One generate mixing three adapters and the base: each row's greedy tokens are the
    merged HF model's, and what the row gets alone."""
    llm, hf, merged = family
    prompts = random_prompts([5, 17, 11, 8, 14, 6, 9, 20], seed=11)
    names = [None, "all8", "qv16", "mlp8rs"] * 2
    compiled = llm.num_compilations
    outs = llm.generate(prompts, [greedy(n) for n in names])
    for p, n, out in zip(prompts, names, outs):
        assert out.error is None
        assert out.token_ids == hf_greedy(hf if n is None else merged[n], p, NEW_TOKENS), n
    alone = [llm.generate([p], greedy(n))[0].token_ids for p, n in zip(prompts[:4], names[:4])]
    assert alone == [o.token_ids for o in outs[:4]]
    # The adapters change the tokens (the test is not vacuous).
    assert len({tuple(llm.generate([prompts[0]], greedy(n))[0].token_ids) for n in names[:4]}) == 4
    assert llm.num_compilations - compiled <= 4  # the lora variant of a few buckets, once
    assert_all_blocks_free(llm)


def test_prefix_cache_keeps_adapters_apart(family):
    llm, _, _ = family
    prompt = random_prompts([40], seed=5)[0]
    assert llm.generate([prompt], greedy("all8"))[0].num_cached_tokens == 0
    assert llm.generate([prompt], greedy("qv16"))[0].num_cached_tokens == 0
    assert llm.generate([prompt], greedy(None))[0].num_cached_tokens == 0
    assert llm.generate([prompt], greedy("all8"))[0].num_cached_tokens == 32
    assert llm.generate([prompt], greedy("qv16"))[0].num_cached_tokens == 32


def test_unknown_adapter_fails_alone(family):
    llm, _, _ = family
    prompts = random_prompts([6, 6], seed=8)
    bad, good = llm.generate(prompts, [greedy("nope"), greedy("all8")])
    assert bad.error is not None and "'nope' is not loaded" in bad.error and bad.token_ids == []
    assert good.error is None and len(good.token_ids) == NEW_TOKENS
    with pytest.raises(ValueError, match="lora must be"):
        SamplingParams(lora=3).validate()


def test_n_and_logprobs_per_adapter(family):
    """n > 1 samples share the adapter of their request; logprobs are the adapter's."""
    llm, _, merged = family
    prompt = random_prompts([10], seed=21)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=6, n=2, temperature=0.0, ignore_eos=True,
                                                lora="qv16", logprobs=1))[0]
    alone = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True, lora="qv16", logprobs=1))[0]
    assert [s["token_ids"] for s in out.samples] == [alone.token_ids] * 2
    np.testing.assert_allclose([lp.logprob for lp in out.samples[1]["logprobs"]],
                               [lp.logprob for lp in alone.logprobs], atol=1e-5)


def test_load_unload_update_without_recompiling(family, tmp_path):
    llm, hf, merged = family
    prompt = random_prompts([12], seed=13)[0]
    before = llm.generate([prompt], greedy("all8"))[0].token_ids  # this shape's programs, with adapters
    llm.runner.wait_for_programs()  # (and the buckets that run queued in the background)
    compiled = llm.num_compilations
    path, model = make_adapter(hf, tmp_path, "qv16", seed=99)
    llm.load_lora_adapter("late", str(path))
    assert "late" in llm.lora_adapters
    with pytest.raises(ValueError, match="already loaded"):
        llm.load_lora_adapter("late", str(path))
    with pytest.raises(ValueError, match="slots"):
        llm.load_lora_adapter("one-too-many", str(path))
    assert llm.generate([prompt], greedy("late"))[0].token_ids == hf_greedy(model, prompt, NEW_TOKENS)
    # A LoRA-only update: the adapter's new weights, the base and the others untouched.
    from jpaged.loading.peft import load_peft_adapter
    other = load_peft_adapter("x", llm.lora_adapters["all8"], llm.loaded.config, max_rank=16)
    llm.update_params(lora={"late": other.modules})
    assert llm.generate([prompt], greedy("late"))[0].token_ids == before
    assert llm.generate([prompt], greedy("all8"))[0].token_ids == before
    llm.unload_lora_adapter("late")
    assert "not loaded" in llm.generate([prompt], greedy("late"))[0].error
    assert llm.num_compilations == compiled


def test_preemption_keeps_each_rows_adapter(family, make_tiny_llm):
    """A pool too small for the batch: preempted rows (recompute and swap) resume under their adapter."""
    llm, hf, merged = family
    if llm.model_config.architecture != "llama":
        pytest.skip("one family is enough")
    prompts = random_prompts([30, 28, 26, 31], seed=17)
    names = ["all8", "qv16", None, "mlp8rs"]
    want = [o.token_ids for o in llm.generate(prompts, [greedy(n) for n in names])]
    modules = ",".join(f"{n}={p}" for n, p in llm.lora_adapters.items())
    for mode in ("recompute", "swap"):
        small = make_tiny_llm(lora_modules=modules, num_blocks=10, preemption_mode=mode, swap_space_gb=0.01)
        outs = small.generate(prompts, [greedy(n) for n in names])
        assert [o.token_ids for o in outs] == want, mode
        assert getattr(small.stats, f"{mode}_preemptions") > 0, mode


@pytest.mark.parametrize("tp", [2, 4])  # 4 > the tiny Llama's 2 KV heads: k/v updates repeat per head
def test_adapters_under_tensor_parallelism(family, make_tiny_llm, tp):
    """Each update follows its base layer's split (column: B's output; row: A's input);
    a mixed batch gives one device's tokens."""
    llm, _, _ = family
    if llm.model_config.architecture != "llama":
        pytest.skip("one family is enough")
    prompts = random_prompts([7, 19, 12, 9], seed=23)
    names = ["all8", None, "qv16", "mlp8rs"]
    want = [o.token_ids for o in llm.generate(prompts, [greedy(n) for n in names])]
    modules = ",".join(f"{n}={p}" for n, p in llm.lora_adapters.items())
    sharded = make_tiny_llm(lora_modules=modules, tensor_parallel_size=tp)
    assert [o.token_ids for o in sharded.generate(prompts, [greedy(n) for n in names])] == want
    lora = sharded.runner.lora
    assert lora.b["wq"][0].sharding.spec == jax.sharding.PartitionSpec(None, None, "model")
    assert lora.a["w_down"][0].sharding.spec == jax.sharding.PartitionSpec(None, "model", None)
    assert lora.a["wq"][0].sharding.is_fully_replicated and lora.b["wo"][0].sharding.is_fully_replicated


def test_adapters_with_scanned_layers(family, make_tiny_llm):
    """layer_loop=scan keeps the slots stacked [L, N, ...] like the base weights: same tokens."""
    llm, _, _ = family
    if llm.model_config.architecture != "llama":
        pytest.skip("one family is enough")
    prompts = random_prompts([8, 15], seed=29)
    names = ["all8", "mlp8rs"]
    want = [o.token_ids for o in llm.generate(prompts, [greedy(n) for n in names])]
    modules = ",".join(f"{n}={p}" for n, p in llm.lora_adapters.items())
    scanned = make_tiny_llm(lora_modules=modules, layer_loop="scan")
    assert scanned.runner.lora.stacked
    assert [o.token_ids for o in scanned.generate(prompts, [greedy(n) for n in names])] == want


def test_score_is_differentiable_in_the_adapter(family):
    """RL with adapters: decode.score's gradient reaches the slot a row names, and no other."""
    llm, _, _ = family
    weights, slots = llm.lora_weights()
    ids = jnp.asarray(random_prompts([10], seed=31), jnp.int32)

    def loss(lora):
        return score(llm.graphdef, llm.params, ids, jnp.array([10]), lora=lora,
                     lora_slots=jnp.array([slots["qv16"]])).sum()
    grads = jax.jit(jax.grad(loss))(weights)  # one program, not the backward op by op
    b_wq = np.asarray(grads.b["wq"][0])  # layer 0's [N, R, out]
    assert np.isfinite(b_wq).all() and np.abs(b_wq[slots["qv16"]]).max() > 0
    others = [s for n, s in slots.items() if n != "qv16"]
    assert np.abs(b_wq[others]).max() == 0


def test_adapters_over_data_parallel_replicas(family, tiny_llama_dir, tmp_path):
    """Every replica holds the same adapters (a runtime load reaches them all, or none)."""
    from jpaged.engine.router import create_engine
    llm, hf, _ = family
    if llm.model_config.architecture != "llama":
        pytest.skip("one family is enough")
    prompts = random_prompts([7, 9, 11, 5], seed=37)
    names = ["all8", "qv16", None, "all8"]
    want = [o.token_ids for o in llm.generate(prompts, [greedy(n) for n in names])]
    modules = ",".join(f"{n}={p}" for n, p in llm.lora_adapters.items() if n in ("all8", "qv16"))
    dp = create_engine(model=tiny_llama_dir, **TINY_ENGINE, lora_modules=modules, max_loras=3,
                       data_parallel_size=2)
    assert [o.token_ids for o in dp.generate(prompts, [greedy(n) for n in names])] == want
    path, model = make_adapter(hf, tmp_path, "mlp8rs", seed=41)
    dp.load_lora_adapter("late", str(path))
    assert all("late" in r.lora_adapters for r in dp.replicas)
    outs = dp.generate(prompts[:2], greedy("late"))
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, NEW_TOKENS) for p in prompts[:2]]
    with pytest.raises(ValueError, match="slots"):
        dp.load_lora_adapter("full", str(path))
    assert not any("full" in r.lora_adapters for r in dp.replicas)
    dp.unload_lora_adapter("late")
    assert dp.lora_adapters.keys() == {"all8", "qv16"}


def test_speculative_decoding_under_adapters(family, make_tiny_llm):
    """Draft rows verify under their row's adapter: ngram speculation keeps the greedy tokens."""
    llm, _, _ = family
    if llm.model_config.architecture != "llama":
        pytest.skip("one family is enough")
    base = random_prompts([6], seed=43)[0]
    prompts = [base * 4, (base[:3] + base) * 3]  # repeats that prompt lookup can draft from
    names = ["all8", "qv16"]
    want = [o.token_ids for o in llm.generate(prompts, [greedy(n) for n in names])]
    modules = ",".join(f"{n}={p}" for n, p in llm.lora_adapters.items())
    spec = make_tiny_llm(lora_modules=modules, speculative_method="ngram", num_speculative_tokens=3,
                         prompt_lookup_min=1, prompt_lookup_max=3, speculative_disable_by_batch_size=0)
    assert [o.token_ids for o in spec.generate(prompts, [greedy(n) for n in names])] == want
    assert spec.stats.spec_decode_num_draft_tokens > 0
