"""jpaged against Hugging Face transformers (torch, CPU, fp32) on the same weights.

Tolerance: logits agree to max |diff| <= 1e-4 (fp32, |logits| up to ~10).
Greedy tokens must be identical; each test also checks that the reference's
greedy path has no near-tie (top-2 logit gap far above the logit tolerance),
so identical tokens are a real check and not luck.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import import_torch, random_prompts
from jpaged.decode import create_kv_pool, forward_step, ragged_metadata, score
from jpaged.core.sequence import SamplingParams

torch = import_torch()

LOGIT_ATOL = 1e-4
NEW_TOKENS = 24
PROMPT_LENGTHS = [5, 17, 40]


def hf_greedy(model, prompt: list[int], n: int, eos_token_id=None) -> tuple[list[int], float]:
    """HF greedy continuation of `prompt` and the smallest top-2 logit gap along it."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=n, eos_token_id=eos_token_id, pad_token_id=0)
        logits = model(out).logits[0, len(prompt) - 1:-1]
    top2 = torch.topk(logits, 2).values
    return out[0, len(prompt):].tolist(), float((top2[:, 0] - top2[:, 1]).min())


FAMILIES = ["llama", "qwen2", "qwen3", "gemma2", "gemma3"]

# forward_step as one compiled program (op by op it costs seconds per call).
_forward_step = jax.jit(forward_step, static_argnums=0, static_argnames=("logits",))


@pytest.fixture(scope="module", params=FAMILIES)
def tiny_pair(request):
    """(jpaged LLM, HF model) for each tiny checkpoint of conftest: Llama (llama3 RoPE,
    untied), Qwen2 (bias, tied), Qwen3 (q/k norms), Gemma 2 (window 8 alternating
    with global layers, soft caps), Gemma 3 (q/k norms, 2 sliding : 1 global, local RoPE)."""
    from helpers import TINY_ENGINE
    from jpaged.engine.llm import LLM
    path, hf = request.getfixturevalue(f"tiny_{request.param}")
    if request.param == "llama":
        return request.getfixturevalue("tiny_llm"), hf
    return LLM(model=str(path), **TINY_ENGINE), hf


def test_tiny_config_features(tiny_pair):
    """Each checkpoint switches on the features it is there to test."""
    llm, hf = tiny_pair
    cfg, kind = llm.model_config, hf.config.model_type
    assert cfg.architecture == {"llama": "llama", "qwen2": "llama", "qwen3": "qwen3", "gemma2": "gemma",
                                "gemma3_text": "gemma"}[kind]
    if kind == "llama":
        assert dict(cfg.rope_scaling)["rope_type"] == "llama3" and not cfg.tie_word_embeddings
        assert cfg.rope_theta == 500000.0
    elif kind == "qwen2":
        assert cfg.attention_bias and cfg.tie_word_embeddings and cfg.rope_scaling is None
    elif kind == "qwen3":
        assert cfg.qk_norm and cfg.head_dim * cfg.num_heads != cfg.hidden_size
    else:
        windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]
        assert windows == ([8, None] * 2 if kind == "gemma2" else [8, 8, None])
        assert max(PROMPT_LENGTHS) > 2 * cfg.sliding_window  # prompts reach far past the window
        if kind == "gemma2":
            assert cfg.attn_logit_softcap == 5.0 and cfg.final_logit_softcap == 10.0
        else:
            assert cfg.qk_norm and cfg.rope_local_theta == 10000.0 and cfg.rope_scaling is not None


def test_tiny_greedy_matches_hf_generate(tiny_pair):
    llm, hf = tiny_pair
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        want, gap = hf_greedy(hf, prompt, NEW_TOKENS)
        assert len(want) == NEW_TOKENS and out.finish_reason == "length"
        assert gap > 2 * LOGIT_ATOL, f"reference path has a near-tie ({gap:.2e}): pick other prompts"
        assert out.token_ids == want, f"prompt of {len(prompt)} tokens"
        assert out.prompt_token_ids == prompt


def test_tiny_greedy_with_prompt_lookup_matches_hf_generate(tiny_pair):
    """Speculative decoding (prompt lookup, rows of 1 + 4 tokens verified at once,
    sliding windows included) gives HF's greedy tokens on prompts that repeat
    themselves, so drafts are proposed."""
    from helpers import TINY_ENGINE
    from jpaged.engine.llm import LLM
    llm, hf = tiny_pair
    spec = LLM(model=llm.config.model, **{**TINY_ENGINE, "speculative_method": "ngram", "prompt_lookup_min": 1,
                                          "speculative_disable_by_batch_size": 0})
    prompts = [(p * 8)[:n] for p, n in zip(random_prompts([3, 5, 7], seed=2), (30, 41, 60))]
    outs = spec.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        want, gap = hf_greedy(hf, prompt, NEW_TOKENS)
        assert gap > 2 * LOGIT_ATOL, f"reference path has a near-tie ({gap:.2e}): pick other prompts"
        assert out.token_ids == want, f"prompt of {len(prompt)} tokens"
    assert spec.stats.spec_decode_num_drafts > 0


@pytest.mark.parametrize("block_size", [16, 4])
def test_tiny_logits_match_hf(tiny_pair, block_size):
    """forward_step(logits="all") over a whole batch of ragged prompts, scattered
    non-contiguously in the pool, equals HF's per-prompt logits."""
    llm, hf = tiny_pair
    prompts = random_prompts(PROMPT_LENGTHS, seed=2)
    B, Q = len(prompts), 48
    W = -(-Q // block_size)
    pool = create_kv_pool(llm.model_config, num_blocks=B * W + 2, block_size=block_size,
                          dtype=jnp.float32)
    # Interleave the sequences' blocks (and skip block 0, the null block).
    tables = jnp.array([[1 + b + B * j for j in range(W)] for b in range(B)], np.int32)
    T = sum(len(p) for p in prompts) + 5  # the prompts back to back, then padding
    tokens = np.zeros(T, np.int32)
    tokens[:T - 5] = np.concatenate(prompts)
    q_lens = jnp.array([len(p) for p in prompts], np.int32)
    meta = ragged_metadata(tables, jnp.zeros(B, jnp.int32), q_lens, T, block_size)
    logits, pool = _forward_step(llm.graphdef, llm.params, pool, jnp.asarray(tokens), meta,
                                logits="all")
    logits = np.asarray(logits)
    assert logits.shape == (T, llm.model_config.vocab_size)
    start = 0
    for b, p in enumerate(prompts):
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0].numpy()
        np.testing.assert_allclose(logits[start:start + len(p)], want, rtol=0, atol=LOGIT_ATOL,
                                   err_msg=f"prompt {b} ({len(p)} tokens)")
        start += len(p)

    # A decode step on top of the cached prompts: the next token's logits.
    last = np.cumsum([len(p) for p in prompts]) - 1
    nxt = np.argmax(logits[last], axis=-1).astype(np.int32)
    meta = ragged_metadata(tables, q_lens, jnp.ones(B, jnp.int32), B, block_size)
    step, _ = _forward_step(llm.graphdef, llm.params, pool, jnp.asarray(nxt), meta, logits="last")
    for b, p in enumerate(prompts):
        with torch.no_grad():
            want = hf(torch.tensor([p + [int(nxt[b])]])).logits[0, -1].numpy()
        np.testing.assert_allclose(np.asarray(step[b]), want, rtol=0, atol=LOGIT_ATOL)


def paged_score(llm, params, ids: jax.Array, lengths: jax.Array, block_size: int = 4) -> jax.Array:
    """decode.score's former implementation: the rows through forward_step (the
    engine's paged reference attention) over a private pool, each row's blocks
    contiguous."""
    B, L = ids.shape
    W = -(-L // block_size)
    pool = create_kv_pool(llm.model_config, num_blocks=1 + B * W, block_size=block_size, dtype=jnp.float32)
    tables = 1 + jnp.arange(B * W, dtype=jnp.int32).reshape(B, W)
    meta = ragged_metadata(tables, jnp.zeros(B, jnp.int32), jnp.full(B, L, jnp.int32), B * L, block_size)
    logits, _ = _forward_step(llm.graphdef, params, pool, ids.reshape(-1), meta, logits="all")
    logprobs = jax.nn.log_softmax(logits.reshape(B, L, -1)[:, :-1], axis=-1)
    chosen = jnp.take_along_axis(logprobs, ids[:, 1:, None], axis=-1)[..., 0]
    return jnp.where(jnp.arange(1, L)[None, :] < lengths[:, None], chosen, 0.0)


def test_score_matches_hf_and_the_paged_path(tiny_pair):
    """decode.score (dense causal attention, no pool) on a right-padded batch: HF's
    log-softmax of each prompt's next tokens, zeros past each length, and the paged
    reference attention's numbers (Gemma: windows of 8 over 40-token prompts, soft caps)."""
    llm, hf = tiny_pair
    prompts = random_prompts(PROMPT_LENGTHS, seed=3)
    L = max(PROMPT_LENGTHS) + 3
    ids = np.zeros((len(prompts), L), np.int32)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = p
    ids, lengths = jnp.asarray(ids), jnp.asarray([len(p) for p in prompts], jnp.int32)
    got = np.asarray(jax.jit(score, static_argnums=0)(llm.graphdef, llm.params, ids, lengths))
    assert got.shape == (len(prompts), L - 1)
    for b, p in enumerate(prompts):
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(torch.tensor([p])).logits[0, :-1], dim=-1)
        want = logprobs.gather(1, torch.tensor(p[1:])[:, None])[:, 0].numpy()
        np.testing.assert_allclose(got[b, :len(p) - 1], want, rtol=0, atol=LOGIT_ATOL, err_msg=f"prompt {b}")
        assert np.all(got[b, len(p) - 1:] == 0)
    np.testing.assert_allclose(got, np.asarray(paged_score(llm, llm.params, ids, lengths)), rtol=1e-5, atol=1e-5)


def test_score_gradient_matches_the_paged_path(tiny_pair):
    """jax.grad of a loss through decode.score equals the gradient through the paged
    reference attention, for every family (Gemma 2's tanh caps and windows included),
    to fp32 rounding: a wrong mask or cap would be off by far more than 1e-3."""
    llm, _ = tiny_pair
    ids = jnp.asarray(random_prompts([24, 24], seed=4))
    lengths = jnp.array([24, 17], jnp.int32)
    weights = jnp.linspace(-1.0, 1.0, 23)  # a loss that is not just the total log-likelihood

    dense = jax.jit(jax.grad(lambda p: jnp.sum(weights * score(llm.graphdef, p, ids, lengths))))(llm.params)
    paged = jax.jit(jax.grad(lambda p: jnp.sum(weights * paged_score(llm, p, ids, lengths))))(llm.params)
    leaves = jax.tree.leaves(dense)
    assert all(np.isfinite(np.asarray(g)).all() for g in leaves)
    assert sum(float(jnp.abs(g).sum()) for g in leaves) > 0
    for g, h in zip(leaves, jax.tree.leaves(paged)):  # fp32 rounding, amplified by the spread weights
        g, h = np.asarray(g), np.asarray(h)
        np.testing.assert_allclose(g, h, rtol=1e-3, atol=1e-3 * np.abs(h).max())


# ------------------------------------------------------------- embedded SmolLM2
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Explain what a GPU is."}],
    [{"role": "user", "content": "List three colors."}],
]
SMOL_TOKENS = 32


@pytest.fixture(scope="module")
def hf_smollm():
    """transformers' own load of the SAME GGUF (dequantised to fp32) and its tokenizer.

    transformers parses the file's header with gguf's GGUFReader once per call (the
    tokenizer's, the config's and the weights': three times) and builds gguf's
    tensor-name map once per module of the model (~400 times); both are memoised
    for this load, ~13 of its ~17 s.  What it reads, dequantises and builds is
    unchanged."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jpaged.loading.weights import embedded_gguf_path
    path = embedded_gguf_path()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                     dtype=torch.float32).eval()
    return tok, model


def _hf_chat_ids(tok, chat) -> list[int]:
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def test_smollm_greedy_matches_transformers_gguf(smollm_llm, hf_smollm):
    tok, model = hf_smollm
    outs = smollm_llm.generate([{"messages": c} for c in CHATS], SamplingParams(max_tokens=SMOL_TOKENS))
    eos = smollm_llm.tokenizer.eos_token_ids
    for chat, out in zip(CHATS, outs):
        ids = _hf_chat_ids(tok, chat)
        assert out.prompt_token_ids == ids, "chat template / tokenizer disagree with transformers"
        want, gap = hf_greedy(model, ids, SMOL_TOKENS, eos_token_id=eos)
        if out.token_ids != want:
            n = next(i for i, (a, b) in enumerate(zip(out.token_ids + [-1], want + [-1])) if a != b)
            pytest.fail(f"diverges at generated token {n}: jpaged {out.token_ids[n:n + 4]} vs "
                        f"HF {want[n:n + 4]}; smallest HF top-2 gap on the path {gap:.3e}")
        assert out.finish_reason == ("stop" if want[-1] in eos else "length")
        assert out.text == tok.decode(want, skip_special_tokens=True)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_sliding_window_cpu_kernel_matches_hf(kind, request):
    """The C++ kernel's window skipping and soft cap, through the engine with
    4-token blocks (the window of 8 spans 2-3 blocks), give HF's greedy tokens."""
    from helpers import TINY_ENGINE
    from jpaged.engine.llm import LLM
    path, hf = request.getfixturevalue(f"tiny_{kind}")
    llm = LLM(model=str(path), **{**TINY_ENGINE, "attention_impl": "cpu", "block_size": 4})
    if llm.attention_impl != "cpu":
        pytest.skip(f"the CPU kernel is unavailable here: {llm.attention_note}")
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        want, gap = hf_greedy(hf, prompt, NEW_TOKENS)
        assert gap > 2 * LOGIT_ATOL and out.token_ids == want, f"prompt of {len(prompt)} tokens"
