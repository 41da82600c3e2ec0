"""Expert-load statistics and routing capture of the MoE families: the step's
expert load (padding not counted) and routed experts against transformers'
router logits, the engine's accumulated load, /metrics' counters, the CLI
summary's lines, `decode.score(return_routes=True)` and a request's captured
routes; a dense model's step unchanged.

The tiny checkpoints (tests/conftest.py): 2 layers, 4 experts, top-2;
Qwen3-MoE's layer 0 is dense (one MoE layer), Mixtral's both are MoE.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import TINY_ENGINE, import_torch, parse_metrics, random_prompts
from jpaged.decode import create_kv_pool, ragged_metadata, score
from jpaged.runtime.step import run_step
from jpaged.runtime.step_inputs import StepInputs

torch = import_torch()

FAMILIES = ("qwen3_moe", "mixtral")
K = 2  # experts per token in both tiny checkpoints
E = 4
_run_step = jax.jit(run_step, static_argnums=0)


@pytest.fixture(scope="module", params=FAMILIES)
def moe(request):
    """(checkpoint dir, HF model, engine) of each tiny MoE family."""
    from jpaged.engine.llm import LLM
    path, hf = request.getfixturevalue(f"tiny_{request.param}")
    return path, hf, LLM(model=str(path), **TINY_ENGINE)


def hf_routes(hf, prompt: list[int]) -> np.ndarray:
    """transformers' top-k experts [tokens, L_moe, k] (sorted) from its router logits."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt]), output_router_logits=True).router_logits
    logits = [lg.reshape(len(prompt), -1).numpy() for lg in logits if lg is not None]
    return np.sort(np.stack([np.argsort(-lg, axis=-1)[:, :K] for lg in logits], axis=1), axis=-1)


def _ragged_step(llm, prompts: list[list[int]], padding: int, capture: bool):
    """One step over `prompts` packed back to back and `padding` pad tokens."""
    B, W, bs = len(prompts), 4, 16
    T = sum(map(len, prompts)) + padding
    tokens = np.zeros(T, np.int32)
    tokens[:T - padding] = np.concatenate(prompts)
    tables = jnp.array([[1 + b * W + j for j in range(W)] for b in range(B)], np.int32)
    meta = ragged_metadata(tables, jnp.zeros(B, jnp.int32), jnp.array([len(p) for p in prompts], np.int32), T, bs)
    pool = create_kv_pool(llm.model_config, num_blocks=B * W + 1, block_size=bs, dtype=jnp.float32)
    result, _ = _run_step(llm.graphdef, llm.params, pool,
                          StepInputs(tokens=jnp.asarray(tokens), meta=meta, capture_routes=capture))
    return result


def test_step_load_counts_valid_tokens_and_matches_hf_routes(moe):
    path, hf, llm = moe
    prompts = random_prompts([7, 19], seed=3)
    padding = 6  # padding tokens are routed too, and must not count
    result = _ragged_step(llm, prompts, padding, capture=True)
    load, routes = np.asarray(result.expert_load), np.asarray(result.routed_experts)
    num_moe = len(llm.model_config.mlp_layers(moe=True))
    valid = sum(map(len, prompts))
    assert load.shape == (num_moe, E) and load.dtype == np.int32
    assert routes.shape == (valid + padding, num_moe, K)
    np.testing.assert_array_equal(load.sum(axis=1), [valid * K] * num_moe)
    recount = np.stack([np.bincount(routes[:valid, layer].reshape(-1), minlength=E) for layer in range(num_moe)])
    np.testing.assert_array_equal(load, recount)
    start = 0
    for p in prompts:
        np.testing.assert_array_equal(np.sort(routes[start:start + len(p)], axis=-1), hf_routes(hf, p))
        start += len(p)
    # Without capture the same step returns the load alone.
    plain = _ragged_step(llm, prompts, padding, capture=False)
    assert plain.routed_experts is None
    np.testing.assert_array_equal(np.asarray(plain.expert_load), load)


def test_scanned_layers_record_the_same_routes(tiny_mixtral):
    """The scanned layer loop stacks each layer's routes as the unrolled one does."""
    from jpaged.engine.llm import LLM
    path, _ = tiny_mixtral
    prompts = random_prompts([9, 4], seed=4)
    unrolled = _ragged_step(LLM(model=str(path), **TINY_ENGINE, layer_loop="unroll"), prompts, 3, capture=True)
    scanned = _ragged_step(LLM(model=str(path), **TINY_ENGINE, layer_loop="scan"), prompts, 3, capture=True)
    np.testing.assert_array_equal(np.asarray(scanned.routed_experts), np.asarray(unrolled.routed_experts))
    np.testing.assert_array_equal(np.asarray(scanned.expert_load), np.asarray(unrolled.expert_load))


def test_a_dense_model_returns_no_load(tiny_llama):
    from jpaged.engine.llm import LLM
    llm = LLM(model=str(tiny_llama[0]), **TINY_ENGINE)
    result = _ragged_step(llm, random_prompts([5], seed=5), 3, capture=True)
    assert result.expert_load is None and result.routed_experts is None
    out = llm.generate(random_prompts([6], seed=6))
    assert out and llm.stats.expert_load is None
    with pytest.raises(ValueError, match="return_routes needs a mixture-of-experts model"):
        score(llm.graphdef, llm.params, jnp.ones((1, 4), jnp.int32), jnp.array([4]), return_routes=True)


def test_score_returns_hf_routes(moe):
    path, hf, llm = moe
    prompts = random_prompts([11, 6], seed=7)
    L = max(map(len, prompts))
    ids = np.zeros((2, L), np.int32)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = p
    lengths = jnp.array([len(p) for p in prompts])
    logprobs, routes = jax.jit(score, static_argnums=0, static_argnames="return_routes")(
        llm.graphdef, llm.params, jnp.asarray(ids), lengths, return_routes=True)
    np.testing.assert_array_equal(logprobs, score(llm.graphdef, llm.params, jnp.asarray(ids), lengths))
    routes = np.asarray(routes)
    for b, p in enumerate(prompts):
        np.testing.assert_array_equal(np.sort(routes[b, :len(p)], axis=-1), hf_routes(hf, p))
        assert (routes[b, len(p):] == -1).all()


def test_engine_accumulates_the_load_into_stats_metrics_and_summary(moe):
    from jpaged.entrypoints.metrics import format_summary, summarize
    from jpaged.entrypoints.openai.metrics import ServerMetrics
    path, _, llm = moe
    before = llm.totals.snapshot()
    outs = llm.generate(random_prompts([5, 12, 9], seed=8))
    stats = llm.stats
    num_moe = len(llm.model_config.mlp_layers(moe=True))
    assert stats.expert_load.shape == (num_moe, E)
    # Every real token computed (prompts, then each output token but the last) went to k experts per layer.
    np.testing.assert_array_equal(stats.expert_load.sum(axis=1), [stats.tokens_scheduled * K] * num_moe)
    assert stats.tokens_scheduled == sum(len(o.prompt_token_ids) + len(o.token_ids) - 1 for o in outs)
    np.testing.assert_array_equal(llm.totals.since(before).expert_load, stats.expert_load)

    metrics = ServerMetrics("tiny", block_size=16)
    metrics.on_snapshot(llm.snapshot())
    scraped = parse_metrics(metrics.render().decode())
    total = llm.snapshot().totals.expert_load
    for layer in range(num_moe):
        for expert in range(E):
            key = f"jpaged:moe_expert_tokens_total{{expert={expert},moe_layer={layer}}}"
            assert scraped[key] == total[layer, expert]

    summary = summarize(outs, llm, 1.0)
    assert "expert_load" not in summary  # off by default
    llm.config.expert_load_summary = True
    try:
        summary = summarize(outs, llm, 1.0)
    finally:
        llm.config.expert_load_summary = False
    assert summary["expert_load"] == stats.expert_load.tolist()
    text = format_summary(summary)
    assert all(f"expert load, MoE layer {layer}" in text for layer in range(num_moe))


def test_metrics_leave_out_the_counters_for_a_dense_model():
    from jpaged.core.stats import EngineSnapshot
    from jpaged.entrypoints.openai.metrics import ServerMetrics
    metrics = ServerMetrics("dense", block_size=16)
    metrics.on_snapshot(EngineSnapshot())
    assert "moe_expert_tokens" not in metrics.render().decode()


# Chunked prefill (16-token steps), blocks of 8, prefix caching and a pool small enough
# for preemption: a request's captured routes still cover each of its tokens once.
CAPTURE_ENGINE = {**TINY_ENGINE, "block_size": 8, "num_blocks": 15, "max_num_batched_tokens": 16,
                  "enable_prefix_caching": True, "max_num_seqs": 6, "preemption_mode": "recompute"}


def test_requests_capture_their_routes_through_the_engine(tiny_qwen3_moe):
    """Each capturing request's routes (every token but the last, per MoE layer) are
    the ones decode.score computes for its whole token sequence; n=2 samples share
    the prompt's; a request that does not ask gets none."""
    from jpaged.core.sequence import SamplingParams
    from jpaged.engine.llm import LLM
    llm = LLM(model=str(tiny_qwen3_moe[0]), **CAPTURE_ENGINE)
    shared = random_prompts([24], seed=9)[0]
    llm.generate([shared + [5]], SamplingParams(max_tokens=4, ignore_eos=True))  # its blocks cached
    prompts = [shared + p for p in random_prompts([3, 11], seed=10)] + random_prompts([30, 9], seed=11)
    capture = SamplingParams(max_tokens=12, ignore_eos=True, capture_routes=True)
    params = [capture, dataclasses.replace(capture, n=2), dataclasses.replace(capture, capture_routes=False),
              capture]
    outs = llm.generate(prompts, params)
    assert llm.stats.preemptions > 0
    assert outs[2].routed_experts is None
    for out in (outs[0], outs[1], outs[3]):
        _assert_routes_are_scores(llm, out)
    np.testing.assert_array_equal(outs[0].routed_experts, outs[0].samples[0]["routed_experts"])
    assert outs[0].to_json()["routed_experts"] == outs[0].routed_experts.tolist()
    sample = json.loads(json.dumps(outs[1].to_json()))["samples"][1]  # what jpaged batch writes
    assert sample["routed_experts"] == outs[1].samples[1]["routed_experts"].tolist()


# decode.score jitted, over token rows padded to a multiple of SCORE_WIDTH: one
# program per width rather than every op compiled again for each sequence length.
_jitted_score = jax.jit(score, static_argnums=0, static_argnames="return_routes")
SCORE_WIDTH = 32


def _assert_routes_are_scores(llm, out) -> None:
    """Each sample's captured routes are what decode.score routes for its tokens
    (the padding after them changes no real token's routes: attention is causal)."""
    num_moe = len(llm.model_config.mlp_layers(moe=True))
    for sample in out.samples:
        tokens = out.prompt_token_ids + sample["token_ids"]
        got = sample["routed_experts"]
        n = len(tokens) - 1
        assert got.shape == (n, num_moe, K) and got.dtype == np.int32
        row = np.zeros((1, -(-n // SCORE_WIDTH) * SCORE_WIDTH), np.int32)
        row[0, :n] = tokens[:-1]
        _, want = _jitted_score(llm.graphdef, llm.params, jnp.asarray(row), jnp.array([n]), return_routes=True)
        np.testing.assert_array_equal(got, np.asarray(want[0, :n]))


def test_captured_routes_under_speculative_decoding(tiny_mixtral):
    """Rows verifying drafts compute several positions at once, and rejected drafts'
    positions are computed again: each position keeps the routes of its final token."""
    from jpaged.core.sequence import SamplingParams
    from jpaged.engine.llm import LLM
    llm = LLM(model=str(tiny_mixtral[0]), **TINY_ENGINE, speculative_method="ngram", prompt_lookup_min=1,
              speculative_disable_by_batch_size=0)
    prompts = [(p * 8)[:n] for p, n in zip(random_prompts([3, 5], seed=12), (30, 41))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True, capture_routes=True))
    s = llm.stats
    assert s.spec_decode_num_drafts > 0 and s.spec_decode_num_accepted_tokens < s.spec_decode_num_draft_tokens
    for out in outs:
        _assert_routes_are_scores(llm, out)


def test_capture_routes_is_refused_for_a_dense_model(tiny_llama):
    from jpaged.core.sequence import SamplingParams
    from jpaged.engine.llm import LLM
    llm = LLM(model=str(tiny_llama[0]), **TINY_ENGINE)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, capture_routes=True))[0]
    assert out.finish_reason == "error" and "capture_routes needs a mixture-of-experts model" in out.error
    with pytest.raises(ValueError, match="capture_routes must be true or false"):
        SamplingParams(capture_routes=1).validate()


def test_expert_parallel_gives_one_devices_load_and_routes(tiny_mixtral):
    """Under expert parallelism (2 simulated devices) the step routes the replicated
    tokens once: the same load and captured routes as one device."""
    from jpaged.core.sequence import SamplingParams
    from jpaged.engine.llm import LLM
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices (tests/conftest.py simulates them on the CPU)")
    path = str(tiny_mixtral[0])
    params = SamplingParams(max_tokens=8, ignore_eos=True, capture_routes=True)
    prompts = random_prompts([7, 20], seed=13)
    one = LLM(model=path, **TINY_ENGINE)
    ep = LLM(model=path, **TINY_ENGINE, tensor_parallel_size=2, enable_expert_parallel=True)
    want, got = one.generate(prompts, params), ep.generate(prompts, params)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        np.testing.assert_array_equal(g.routed_experts, w.routed_experts)
    np.testing.assert_array_equal(ep.stats.expert_load, one.stats.expert_load)
