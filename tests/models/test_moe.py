"""Mixture-of-experts models: the dropless MoE layer against its dense one-hot oracle,
Qwen3-MoE and Mixtral against transformers (logits, and greedy tokens through the
engine with chunked prefill, prefix caching and both preemption modes), their GGUF
twins, and LoRA on them.

The tiny checkpoints (tests/conftest.py): 2 layers, 4 experts, top-2; Qwen3-MoE's
layer 0 is a dense MLP (mlp_only_layers=[0]).
"""

from __future__ import annotations

import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import (TINY_ENGINE, import_torch, make_peft_adapter, random_prompts, tiny_gguf_writer,
                     with_tokenizer)
from jpaged.core.sequence import SamplingParams
from jpaged.decode import create_kv_pool, forward_step, ragged_metadata
from jpaged.layers.moe import (CPU_ALL_EXPERTS_MAX_TOKENS, all_experts_routed, expert_load, grouped_swiglu_experts,
                               moe_mlp, moe_mlp_dense, route, skinny_swiglu_experts, swiglu_experts, tile_rows,
                               tiled_swiglu_experts)
from pallas_kernels import cpu

torch = import_torch()

LOGIT_ATOL = 1e-4
FAMILIES = ("qwen3_moe", "mixtral")
NEW_TOKENS = 16
# Prompts 2..5 share a 24-token prefix (3 blocks of 8) with prompt 1, run first: prefix-cache hits.
SHARED = random_prompts([24], seed=40)[0]
FIRST = SHARED + random_prompts([5], seed=41)[0]
PROMPTS = [SHARED + p for p in random_prompts([3, 11, 6, 17], seed=42)] + random_prompts([30, 9], seed=43)
# Chunked prefill (16-token steps), blocks of 8 and a pool of 14 usable blocks for 6 rows
# growing to 57 tokens: prompts are split across steps and rows are preempted.
ENGINE = {**TINY_ENGINE, "block_size": 8, "num_blocks": 15, "max_num_batched_tokens": 16,
          "enable_prefix_caching": True, "max_num_seqs": 6}

_forward_step = jax.jit(forward_step, static_argnums=0, static_argnames=("logits",))


# ---------------------------------------------------------------- the layer
def _layer_weights(seed: int, d: int = 16, f: int = 8, E: int = 4):
    rng = np.random.default_rng(seed)
    router = rng.standard_normal((d, E)).astype(np.float32)
    experts = [(rng.standard_normal(s) * 0.3).astype(np.float32) for s in ((E, d, f), (E, d, f), (E, f, d))]
    return router, experts


_moe = jax.jit(moe_mlp, static_argnames=("top_k", "renormalize", "grouped"))
GROUPED = {"default": None, "platform": grouped_swiglu_experts, "ragged_dot": swiglu_experts,
           "tiles": tiled_swiglu_experts}
if cpu.available():  # the C++ grouped skinny matmul of CPU decode steps (matmul_impl)
    GROUPED["skinny"] = skinny_swiglu_experts


@pytest.mark.parametrize("grouped", GROUPED)
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("top_k,renormalize", [(2, True), (2, False), (1, False), (4, True)])
def test_grouped_matmuls_equal_the_dense_oracle(seed, top_k, renormalize, grouped):
    router, experts = _layer_weights(seed)
    x = np.random.default_rng(100 + seed).standard_normal((13 + 20 * seed, 16)).astype(np.float32)
    got = _moe(x, router, *experts, top_k=top_k, renormalize=renormalize, grouped=GROUPED[grouped])
    want = moe_mlp_dense(x, router, *experts, top_k=top_k, renormalize=renormalize)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", sorted({1, 2, CPU_ALL_EXPERTS_MAX_TOKENS, CPU_ALL_EXPERTS_MAX_TOKENS + 1, 17}))
def test_platform_choice_by_token_count_equals_the_dense_oracle(tokens):
    """The default (the CPU: every expert on every token up to CPU_ALL_EXPERTS_MAX_TOKENS,
    the tiles above) on both sides of the switch, and the all-experts form itself."""
    router, experts = _layer_weights(3)
    x = np.random.default_rng(tokens).standard_normal((tokens, 16)).astype(np.float32)
    want = moe_mlp_dense(x, router, *experts, top_k=2, renormalize=True)
    got = _moe(x, router, *experts, top_k=2, renormalize=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    weights, chosen = route(jnp.asarray(x), jnp.asarray(router), 2, True)
    direct = jax.jit(all_experts_routed, static_argnames="num_experts")(x, weights, chosen, *experts, num_experts=4)
    np.testing.assert_allclose(np.asarray(direct), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sizes", [(40, 0, 0, 0), (0, 0, 0, 40), (1, 0, 38, 1), (9, 8, 16, 7), (3, 0, 0, 0)])
def test_tiles_and_ragged_dot_equal_row_by_row(sizes):
    """Both grouped forms against each row through its own expert, for group sizes
    that leave experts idle, fill one tile exactly or spill into the next."""
    _, (w_gate, w_up, w_down) = _layer_weights(5)
    R = sum(sizes)
    xs = np.random.default_rng(6).standard_normal((R, 16)).astype(np.float32)
    expert = np.repeat(np.arange(4), sizes)
    h = jax.nn.silu(np.einsum("rd,rdf->rf", xs, w_gate[expert])) * np.einsum("rd,rdf->rf", xs, w_up[expert])
    want = np.einsum("rf,rfd->rd", np.asarray(h), w_down[expert])
    for fn in (swiglu_experts, tiled_swiglu_experts, *([skinny_swiglu_experts] if cpu.available() else [])):
        got = jax.jit(fn)(xs, w_gate, w_up, w_down, jnp.asarray(sizes, jnp.int32))
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5, err_msg=fn.__name__)


def test_tile_is_an_experts_share_in_8_to_128():
    assert [tile_rows(R, 4) for R in (3, 40, 64, 65)] == [8, 16, 16, 32]
    assert tile_rows(2048, 8) == 128 and tile_rows(32, 8) == 8


def test_all_tokens_to_one_expert_and_idle_experts():
    """A router that sends every token to expert 2 first (and leaves an expert idle):
    one group holds all T rows, empty groups are skipped, nothing is dropped."""
    router, experts = _layer_weights(7)
    router[:, 2] = 2.0                      # x > 0 below: expert 2 wins for every token
    router[:, 0] = -2.0                     # and expert 0 for none (softmax still far from underflow)
    x = np.abs(np.random.default_rng(8).standard_normal((11, 16))).astype(np.float32)
    weights, chosen = route(jnp.asarray(x), jnp.asarray(router), 2, True)
    assert np.all(np.asarray(chosen)[:, 0] == 2)
    load = np.asarray(expert_load(chosen, 4))
    assert load[2] == 11 and load[0] == 0 and load.sum() == 22
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)
    got = _moe(x, router, *experts, top_k=2, renormalize=True)
    want = moe_mlp_dense(x, router, *experts, top_k=2, renormalize=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_routing_adds_no_compilation():
    """Whatever the routing (here: every token to one expert, then spread), the same
    shapes run the same program."""
    fn = jax.jit(lambda *args: moe_mlp(*args, top_k=2, renormalize=True))  # a cache of its own
    router, experts = _layer_weights(9)
    x = np.abs(np.random.default_rng(10).standard_normal((16, 16))).astype(np.float32)
    skewed = router.copy()
    skewed[:, 1] = 50.0
    for r in (router, skewed, -router):
        fn(x, r, *experts)
    assert fn._cache_size() == 1


def test_moe_layer_is_differentiable():
    """decode.score's gradients go through the grouped matmuls: they equal the oracle's."""
    router, experts = _layer_weights(11)
    x = np.random.default_rng(12).standard_normal((9, 16)).astype(np.float32)

    def loss(x, w, fn, **kw):
        return (fn(x, router, *w, top_k=2, renormalize=True, **kw) ** 2).sum()

    few = x[:CPU_ALL_EXPERTS_MAX_TOKENS]  # grouped=None at as few tokens: the CPU's all-experts form
    skinny = [(skinny_swiglu_experts, x)] if cpu.available() else []
    for grouped, x in ((swiglu_experts, x), (tiled_swiglu_experts, x), *skinny, (None, few)):
        want = jax.grad(loss, argnums=(0, 1))(x, experts, moe_mlp_dense)
        got = jax.grad(loss, argnums=(0, 1))(x, experts, moe_mlp, grouped=grouped)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- against transformers
def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], float]:
    """HF greedy continuation of `prompt` and the smallest top-2 logit gap along it."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             pad_token_id=0)
        logits = model(out).logits[0, len(prompt) - 1:-1]
    top2 = torch.topk(logits, 2).values
    return out[0, len(prompt):].tolist(), float((top2[:, 0] - top2[:, 1]).min())


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """(kind, checkpoint dir, HF model, HF greedy tokens of FIRST and PROMPTS)."""
    path, hf = request.getfixturevalue(f"tiny_{request.param}")
    want = []
    for p in [FIRST, *PROMPTS]:
        tokens, gap = hf_greedy(hf, p, NEW_TOKENS)
        assert gap > 2 * LOGIT_ATOL, f"reference path has a near-tie ({gap:.2e}): pick other prompts"
        want.append(tokens)
    return request.param, pathlib.Path(path), hf, want


@pytest.fixture(scope="module")
def attn_adapter(tiny_qwen3_moe, tmp_path_factory):
    """(dir, PEFT's merged model) of a random PEFT adapter on Qwen3-MoE's q/k/v/o."""
    path = tmp_path_factory.mktemp("moe-lora") / "attn"
    peft_model = make_peft_adapter(tiny_qwen3_moe[1], path, 3, r=8, lora_alpha=16,
                                   target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    return path, peft_model.merge_and_unload().eval()


@pytest.fixture(scope="module")
def engine(request, family):
    """The recompute-preemption engine of each family; Qwen3-MoE's also holds attn_adapter."""
    from jpaged.engine.llm import LLM
    kind, path, _, _ = family
    extra = {}
    if kind == "qwen3_moe":
        adapter = request.getfixturevalue("attn_adapter")[0]
        extra = {"lora_modules": f"attn={adapter}", "max_loras": 1, "max_lora_rank": 8}
    return LLM(model=str(path), **ENGINE, **extra, preemption_mode="recompute")


def test_config_follows_the_checkpoint(family, engine):
    kind, _, hf, _ = family
    cfg = engine.model_config
    assert cfg.architecture == kind and cfg.num_experts == 4 and cfg.num_experts_per_tok == 2
    assert cfg.norm_topk_prob
    if kind == "qwen3_moe":
        assert cfg.moe_layers == (1,) and cfg.mlp_layers(moe=False) == (0,) and cfg.qk_norm
        assert cfg.moe_intermediate_size == 32 and cfg.intermediate_size == 128
    else:
        assert cfg.moe_layers is None and cfg.mlp_layers(moe=True) == (0, 1)
        assert cfg.moe_intermediate_size == cfg.intermediate_size == 32


def test_logits_match_hf(family, engine):
    """Full-vocabulary logits of three ragged prompts in one flat step, then a decode step."""
    _, _, hf, _ = family
    prompts = random_prompts([5, 17, 40], seed=2)
    B, W, bs = len(prompts), 6, 8
    pool = create_kv_pool(engine.model_config, num_blocks=B * W + 2, block_size=bs, dtype=jnp.float32)
    tables = jnp.array([[1 + b + B * j for j in range(W)] for b in range(B)], np.int32)
    T = sum(map(len, prompts)) + 5  # padding tokens too: they are routed like any other
    tokens = np.zeros(T, np.int32)
    tokens[:T - 5] = np.concatenate(prompts)
    q_lens = jnp.array([len(p) for p in prompts], np.int32)
    meta = ragged_metadata(tables, jnp.zeros(B, jnp.int32), q_lens, T, bs)
    logits, pool = _forward_step(engine.graphdef, engine.params, pool, jnp.asarray(tokens), meta, logits="all")
    logits, start = np.asarray(logits), 0
    for b, p in enumerate(prompts):
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0].numpy()
        np.testing.assert_allclose(logits[start:start + len(p)], want, rtol=0, atol=LOGIT_ATOL, err_msg=f"prompt {b}")
        start += len(p)
    nxt = np.argmax(logits[np.cumsum([len(p) for p in prompts]) - 1], axis=-1).astype(np.int32)
    meta = ragged_metadata(tables, q_lens, jnp.ones(B, jnp.int32), B, bs)
    step, _ = _forward_step(engine.graphdef, engine.params, pool, jnp.asarray(nxt), meta, logits="last")
    for b, p in enumerate(prompts):
        with torch.no_grad():
            want = hf(torch.tensor([p + [int(nxt[b])]])).logits[0, -1].numpy()
        np.testing.assert_allclose(np.asarray(step[b]), want, rtol=0, atol=LOGIT_ATOL)


def _greedy_through(llm, want):
    """FIRST alone (its blocks cached), then PROMPTS at once: HF's greedy tokens."""
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    assert llm.generate([FIRST], params)[0].token_ids == want[0]
    outs = llm.generate(PROMPTS, params)
    for i, (o, w) in enumerate(zip(outs, want[1:])):
        assert o.token_ids == w, f"prompt {i} ({len(PROMPTS[i])} tokens)"
    s = llm.stats
    assert s.preemptions > 0 and s.cached_prompt_tokens >= 4 * len(SHARED) - 8


def test_greedy_matches_hf_with_chunking_prefix_cache_and_recompute(family, engine):
    _greedy_through(engine, family[3])
    if cpu.available():  # matmul_impl "auto" on the CPU: decode steps' experts by the grouped kernel
        programs = {key[0]: exe.as_text() for key, exe in engine.runner.programs.items()}
        assert all(cpu.GROUPED_SKINNY_TARGET in text for text in programs.values())  # steps of <= 16 tokens
    assert engine.stats.recompute_preemptions > 0


def test_greedy_matches_hf_under_swap_preemption(family):
    from jpaged.engine.llm import LLM
    _, path, _, want = family
    llm = LLM(model=str(path), **ENGINE, preemption_mode="swap", swap_space_gb=0.01)
    _greedy_through(llm, want)
    assert llm.stats.swap_preemptions > 0


def test_prompt_lookup_speculation_and_score(family, engine):
    """Speculative decoding (rows of 1 + 4 tokens verified at once) gives HF's greedy
    tokens; decode.score gives HF's log-probabilities, and finite gradients."""
    from jpaged.decode import score
    from jpaged.engine.llm import LLM
    kind, path, hf, _ = family
    if kind != "qwen3_moe":
        pytest.skip("one family is enough")
    spec = LLM(model=str(path), **TINY_ENGINE, speculative_method="ngram", prompt_lookup_min=1,
               speculative_disable_by_batch_size=0)
    prompts = [(p * 8)[:n] for p, n in zip(random_prompts([3, 5], seed=2), (30, 41))]
    outs = spec.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    for p, o in zip(prompts, outs):
        want, gap = hf_greedy(hf, p, NEW_TOKENS)
        assert gap > 2 * LOGIT_ATOL and o.token_ids == want
    assert spec.stats.spec_decode_num_drafts > 0
    ids, lengths = jnp.asarray(random_prompts([24, 24], seed=4)), jnp.array([24, 17], jnp.int32)
    got = np.asarray(jax.jit(score, static_argnums=0)(engine.graphdef, engine.params, ids, lengths))
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor(np.asarray(ids[:1]))).logits[0, :-1], dim=-1)
    want = logprobs.gather(1, torch.tensor(np.asarray(ids[0, 1:]))[:, None])[:, 0].numpy()
    np.testing.assert_allclose(got[0], want, rtol=0, atol=LOGIT_ATOL)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(score(engine.graphdef, p, ids, lengths))))(engine.params)
    experts = [g for k, g in jax.tree_util.tree_flatten_with_path(grads)[0] if "experts_" in jax.tree_util.keystr(k)]
    assert experts and all(np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).sum() > 0 for g in experts)


def test_structured_outputs_constrain_a_moe_model(tiny_qwen3_moe, tmp_path):
    """Constraints mask a MoE model's logits as they do a dense one's (the byte-level
    tokenizer of helpers.with_tokenizer: its EOS, id 2, is the byte "#"): a regex
    greedy and a choice sampled, through the chunked, prefix-cached engine."""
    from jpaged.engine.llm import LLM
    from jpaged.structured.spec import StructuredOutputs
    llm = LLM(model=str(with_tokenizer(str(tiny_qwen3_moe[0]), tmp_path / "moe")), **ENGINE)
    params = [SamplingParams(max_tokens=8, structured=StructuredOutputs(regex=r"[0-9]{2,5}")),
              SamplingParams(max_tokens=8, structured=StructuredOutputs(choice=("alpha", "beta")),
                             temperature=1.0, seed=1, n=2)]
    digits, choices = llm.generate(["abc", "a longer prompt about numbers"], params)
    assert re.fullmatch(r"[0-9]{2,5}", digits.samples[0]["text"].removesuffix("#"))
    assert {s["text"].removesuffix("#") for s in choices.samples} <= {"alpha", "beta"}
    assert llm.block_manager.num_used_blocks == 0


def test_tensor_parallel_with_merged_projections(family):
    """tp=2 with merged projections: attention and the dense layer's MLP split over the
    devices, every expert's MLP units too (tensor parallelism within the experts; expert
    parallelism: tests/models/test_moe_ep.py), the router replicated: HF's tokens."""
    from jpaged.engine.llm import LLM
    kind, path, _, want = family
    if kind != "qwen3_moe":
        pytest.skip("one family is enough (Qwen3-MoE has a dense layer and experts)")
    llm = LLM(model=str(path), **TINY_ENGINE, tensor_parallel_size=2, merge_projections=True)
    outs = llm.generate(PROMPTS[-2:], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == want[-2:]
    specs = {jax.tree_util.keystr(p): x.sharding.spec for p, x in jax.tree_util.tree_flatten_with_path(llm.params)[0]}
    P = jax.sharding.PartitionSpec
    assert [specs[k] for k in specs if "router" in k] == [P()]
    assert [specs[k] for k in specs if "experts_" in k] == [P(None, "model", None), P(None, None, "model"),
                                                           P(None, None, "model")]  # down, gate, up [E, ., .]
    assert any("w_gate_up" in k and "model" in specs[k] for k in specs)


def test_scan_runs_an_all_moe_model_and_refuses_a_mixed_one(family, engine):
    """The scanned layer loop needs every layer to hold the same weights: Mixtral's
    (experts everywhere) gives the unrolled loop's logits; Qwen3-MoE's dense layer 0 is refused."""
    from jpaged.loading.weights import load_hf_dir
    from jpaged.models import build_model
    from jpaged.models.base import split_model
    kind, path, _, _ = family
    cfg, arrays = load_hf_dir(path)
    if kind == "qwen3_moe":
        with pytest.raises(ValueError, match=r"dense MLP layers \[0\] among its mixture-of-experts layers"):
            build_model(cfg, arrays, jnp.float32, scan_layers=True)
        return
    # The engine's weight matmuls too (matmul_impl: the C++ skinny kernel on a CPU), so that
    # only the layer loop differs.
    matmul_impl = "cpu" if nnx.merge(engine.graphdef, engine.params).cpu_matmul else "xla"
    graphdef, params = split_model(build_model(cfg, arrays, jnp.float32, scan_layers=True, matmul_impl=matmul_impl))
    prompt = random_prompts([12], seed=5)[0]
    meta = ragged_metadata(jnp.array([[1, 2]], np.int32), jnp.zeros(1, jnp.int32), jnp.array([12], np.int32),
                           12, 8)
    pool = create_kv_pool(cfg, num_blocks=3, block_size=8, dtype=jnp.float32)
    got, _ = _forward_step(graphdef, params, pool, jnp.asarray(prompt, jnp.int32), meta, logits="all")
    want, _ = _forward_step(engine.graphdef, engine.params, pool, jnp.asarray(prompt, jnp.int32), meta, logits="all")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)


def test_batch_invariant_is_refused(family):
    from jpaged.loading.weights import load_hf_dir
    from jpaged.models import build_model
    _, path, _, _ = family
    cfg, arrays = load_hf_dir(path)
    with pytest.raises(ValueError, match=r"batch_invariant is not supported for .*\(mixture of experts\)"):
        build_model(cfg, arrays, jnp.float32, batch_invariant=True)


def test_hf_config_values_that_cannot_run_are_refused(family):
    from jpaged.models import config_from_hf
    kind, path, _, _ = family
    hf = json.loads((path / "config.json").read_text())
    bad = [{"num_experts_per_tok": 5}, {"num_experts_per_tok": 0}]
    if kind == "qwen3_moe":
        bad += [{"decoder_sparse_step": 0}, {"mlp_only_layers": [2]}, {"mlp_only_layers": [0, 1]}]
    for change in bad:
        with pytest.raises(ValueError, match=kind):
            config_from_hf({**hf, **change})
    if kind == "qwen3_moe":  # every other layer sparse: layers 1, 3 of 4 hold experts
        cfg = config_from_hf({**hf, "num_hidden_layers": 4, "mlp_only_layers": [], "decoder_sparse_step": 2})
        assert cfg.moe_layers == (1, 3)


# ---------------------------------------------------------------- GGUF twins
def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute of Q/K rows (llama architecture only)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(kind: str, ckpt: pathlib.Path, hf_config, path: pathlib.Path) -> None:
    """The checkpoint as an F32 GGUF the way convert_hf_to_gguf writes it: Qwen3-MoE as
    architecture qwen3moe, Mixtral as llama (Q/K rows permuted) with stacked experts.
    The names are llama.cpp's (gguf.constants), written out here, not taken from jpaged."""
    import gguf
    from safetensors.numpy import load_file

    c = hf_config
    arch = "qwen3moe" if kind == "qwen3_moe" else "llama"
    w = tiny_gguf_writer(path, arch, c, head_dims=kind == "qwen3_moe")
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_expert_count(c.num_experts if kind == "qwen3_moe" else c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if kind == "qwen3_moe":
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    tokens = ["<pad>", "<bos>", "<eos>"] + [f"<t{i}>" for i in range(3, c.vocab_size)]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3))

    state = load_file(str(ckpt / "model.safetensors"))
    block = "mlp" if kind == "qwen3_moe" else "block_sparse_moe"
    gate, up, down = ("gate_proj", "up_proj", "down_proj") if kind == "qwen3_moe" else ("w1", "w3", "w2")
    names = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
             "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k",
             "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
             "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm",
             "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up", "mlp.down_proj.weight": "ffn_down",
             f"{block}.gate.weight": "ffn_gate_inp"}
    tensors = {"token_embd.weight": state["model.embed_tokens.weight"],
               "output_norm.weight": state["model.norm.weight"], "output.weight": state["lm_head.weight"]}
    E = c.num_experts if kind == "qwen3_moe" else c.num_local_experts
    for i in range(c.num_hidden_layers):
        for hf_name, g in names.items():
            t = state.get(f"model.layers.{i}.{hf_name}")
            if t is None:
                continue
            if arch == "llama" and g in ("attn_q", "attn_k"):
                t = _permute(t, c.num_attention_heads if g == "attn_q" else c.num_key_value_heads)
            tensors[f"blk.{i}.{g}.weight"] = t
        if f"model.layers.{i}.{block}.gate.weight" in state:
            for ours, theirs in (("ffn_gate_exps", gate), ("ffn_up_exps", up), ("ffn_down_exps", down)):
                tensors[f"blk.{i}.{ours}.weight"] = np.stack(
                    [state[f"model.layers.{i}.{block}.experts.{e}.{theirs}.weight"] for e in range(E)])
    for name, t in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_twin_loads_to_the_same_model_and_logits(family, engine, tmp_path):
    from jpaged.loading.weights import load_gguf, load_hf_dir, load_weights
    from jpaged.models import build_model
    from jpaged.models.base import split_model
    kind, path, hf, _ = family
    gguf_path = tmp_path / f"tiny-{kind}.gguf"
    _write_gguf(kind, path, hf.config, gguf_path)
    cfg, arrays, meta = load_gguf(gguf_path)
    hf_cfg, hf_arrays = load_hf_dir(path)
    assert meta["general.architecture"] == ("qwen3moe" if kind == "qwen3_moe" else "llama")
    assert cfg == hf_cfg  # Mixtral found by its expert tensors; Qwen3-MoE's dense layer by its lack of a router
    assert set(arrays) == set(hf_arrays)
    for name in arrays:
        np.testing.assert_array_equal(arrays[name], hf_arrays[name], err_msg=name)
    for from_cache in (False, True):  # the converted-weights cache keeps the experts' config and arrays
        loaded = load_weights(str(gguf_path), cache_dir=tmp_path / "cache")
        assert loaded.from_cache == from_cache and loaded.config == cfg
        np.testing.assert_array_equal(loaded.arrays["layers.experts_down"], arrays["layers.experts_down"])
    graphdef, params = split_model(build_model(cfg, arrays, jnp.float32))
    prompt = random_prompts([20], seed=6)[0]
    meta = ragged_metadata(jnp.array([[1, 2, 3]], np.int32), jnp.zeros(1, jnp.int32), jnp.array([20], np.int32),
                           20, 8)
    pool = create_kv_pool(cfg, num_blocks=4, block_size=8, dtype=jnp.float32)
    got, _ = _forward_step(graphdef, params, pool, jnp.asarray(prompt, jnp.int32), meta, logits="all")
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].numpy()
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=LOGIT_ATOL)


# ---------------------------------------------------------------- LoRA
def test_attention_lora_matches_peft(family, engine, request):
    """A PEFT adapter on q/k/v/o of Qwen3-MoE: PEFT's merged model's greedy tokens."""
    kind = family[0]
    if kind != "qwen3_moe":
        pytest.skip("one family is enough")
    merged = request.getfixturevalue("attn_adapter")[1]
    prompts = random_prompts([9, 21], seed=8)
    outs = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, lora="attn"))
    base = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    for p, o, b in zip(prompts, outs, base):
        want, gap = hf_greedy(merged, p, NEW_TOKENS)
        assert gap > 2 * LOGIT_ATOL
        assert o.token_ids == want
    assert [o.token_ids for o in outs] != [b.token_ids for b in base]  # the adapter changes the tokens


def _write_adapter(root: pathlib.Path, tensors: dict[str, np.ndarray], targets: list[str]) -> pathlib.Path:
    from safetensors.numpy import save_file
    root.mkdir()
    (root / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": targets, "bias": "none"}))
    save_file(tensors, str(root / "adapter_model.safetensors"))
    return root


def test_lora_on_experts_is_refused_naming_the_module(family, engine, tmp_path):
    from jpaged.loading.peft import load_peft_adapter, lora_from_arrays
    kind = family[0]
    cfg = engine.model_config
    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    rng = np.random.default_rng(0)
    a, b_gate = rng.standard_normal((4, d)).astype(np.float32), rng.standard_normal((f, 4)).astype(np.float32)
    prefix = "base_model.model.model.layers.1"
    expert, router = (("mlp.experts.2.gate_proj", "mlp.gate") if kind == "qwen3_moe"
                      else ("block_sparse_moe.experts.2.w1", "block_sparse_moe.gate"))
    for module, b in ((expert, b_gate), (router, rng.standard_normal((4, 4)).astype(np.float32))):
        path = _write_adapter(tmp_path / module.replace(".", "_"),
                              {f"{prefix}.{module}.lora_A.weight": a, f"{prefix}.{module}.lora_B.weight": b},
                              ["gate_proj"])
        with pytest.raises(ValueError, match=re.escape(f"model.layers.1.{module} is a mixture-of-experts module")):
            load_peft_adapter("x", path, cfg, max_rank=8)
    # target_modules naming the router or Mixtral's expert projections.
    path = _write_adapter(tmp_path / "targets", {f"{prefix}.self_attn.q_proj.lora_A.weight": a,
                                                 f"{prefix}.self_attn.q_proj.lora_B.weight": a.T.copy()},
                          ["q_proj", "gate", "w1"])
    with pytest.raises(ValueError, match=r"target_modules includes \['gate', 'w1'\], mixture-of-experts modules"):
        load_peft_adapter("x", path, cfg, max_rank=8)
    # The MLP targets of a MoE layer (a trainer's arrays): refused, naming the layer.
    L, f_dense = cfg.num_layers, cfg.intermediate_size
    arrays = {"w_down": (rng.standard_normal((L, f_dense, 4)).astype(np.float32),
                         rng.standard_normal((L, 4, d)).astype(np.float32))}
    with pytest.raises(ValueError, match=f"w_down of layer {cfg.mlp_layers(moe=True)[0]}, a mixture-of-experts layer"):
        lora_from_arrays("x", arrays, cfg, max_rank=8)
    if kind == "qwen3_moe":  # layer 0 is dense: its MLP may be adapted
        arrays["w_down"][1][1] = 0.0
        assert lora_from_arrays("x", arrays, cfg, max_rank=8).modules["w_down"][0].shape == (L, f_dense, 4)
