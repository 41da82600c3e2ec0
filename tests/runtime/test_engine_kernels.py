"""The engine on the kernels (C++ on the CPU; Pallas in interpret mode) gives the reference's tokens."""

import pytest

from helpers import random_prompts
from jpaged.engine.setup import resolve_attention_impl
from jpaged.core.sequence import SamplingParams


# Prompt lengths straddle the 16-token blocks; a 16-token budget chunks the
# prompts, so steps mix prefill chunks with decodes, and decode crosses
# block boundaries.
GREEDY_PROMPTS = random_prompts([5, 16, 21], seed=3)
GREEDY_PARAMS = SamplingParams(max_tokens=14, ignore_eos=True)
GREEDY_ENGINE = dict(max_num_seqs=3, max_num_batched_tokens=16)
BF16_PROMPTS = random_prompts([5, 16, 21], seed=4)


@pytest.fixture(scope="module")
def greedy_reference(make_tiny_llm):
    """The reference attention's tokens, once for every kernel."""
    outs = make_tiny_llm(attention_impl="reference", **GREEDY_ENGINE).generate(GREEDY_PROMPTS, GREEDY_PARAMS)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("impl", ["cpu", "pallas_gpu", "pallas_tpu"])
def test_greedy_tokens_match_reference(make_tiny_llm, greedy_reference, impl):
    kernel = make_tiny_llm(attention_impl=impl, **GREEDY_ENGINE).generate(GREEDY_PROMPTS, GREEDY_PARAMS)
    assert [o.token_ids for o in kernel] == greedy_reference


def test_attention_impl_names():
    from pallas_kernels import cpu
    # CPU backend: the C++ kernel when it builds here, else the reference.
    assert resolve_attention_impl("auto") == ("cpu" if cpu.available() else "reference", "")
    assert resolve_attention_impl("cpu") == ("cpu", "")
    assert resolve_attention_impl("pallas_gpu") == ("pallas_gpu", "")
    assert resolve_attention_impl("pallas_tpu") == ("pallas_tpu", "")


def test_an_unavailable_cpu_kernel_is_reported_not_hidden(monkeypatch):
    """attention_impl=cpu without a buildable kernel runs the reference, and says so."""
    from pallas_kernels import cpu
    monkeypatch.setattr(cpu, "available", lambda: False)
    monkeypatch.setattr(cpu, "unavailable_reason", lambda: "no C++ compiler")
    assert resolve_attention_impl("cpu") == ("reference", "cpu kernel unavailable: no C++ compiler")
    with pytest.raises(ValueError, match="attention_impl"):
        resolve_attention_impl("flash")


@pytest.fixture(scope="module")
def bf16_reference(make_tiny_llm, tiny_llm):
    """kv_cache_dtype=bfloat16 under fp32 activations: half the pool bytes (of the
    session's fp32 engine: the same blocks); the reference attention's tokens on it
    (once for every kernel)."""
    fp32 = tiny_llm
    bf16 = make_tiny_llm(attention_impl="reference", max_num_seqs=3, kv_cache_dtype="bfloat16")
    assert str(bf16.runner.kv_pool.dtype) == "bfloat16" and str(fp32.runner.kv_pool.dtype) == "float32"
    assert 2 * bf16.kv_pool_bytes == fp32.kv_pool_bytes
    return [o.token_ids for o in bf16.generate(BF16_PROMPTS, GREEDY_PARAMS)]


@pytest.mark.parametrize("impl", ["cpu", "pallas_gpu"])
def test_bf16_kv_cache_matches_across_impls(make_tiny_llm, bf16_reference, impl):
    """The kernels (mixed fp32 queries / bf16 K/V) give the reference's tokens
    on a bfloat16 pool (the pool's dtype and size: bf16_reference)."""
    kernel = make_tiny_llm(attention_impl=impl, max_num_seqs=3,
                           kv_cache_dtype="bfloat16").generate(BF16_PROMPTS, GREEDY_PARAMS)
    assert [o.token_ids for o in kernel] == bf16_reference


def test_kv_cache_dtype_is_checked(make_tiny_llm):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        make_tiny_llm(kv_cache_dtype="fp8")


@pytest.mark.slow
def test_bf16_kv_cache_keeps_smollm_answers(smollm_llm):
    """The embedded model answers the same short chat prompts with a bf16 pool."""
    from helpers import SMOLLM_ENGINE
    from jpaged.engine.llm import LLM
    prompts = [{"prompt": "What is the capital of France?"}, {"prompt": "Name one fruit."},
               {"prompt": "What is 2 + 2?"}]
    params = SamplingParams(max_tokens=16)
    bf16 = LLM(**{**SMOLLM_ENGINE, "kv_cache_dtype": "bfloat16", "attention_impl": "auto"})
    want = [o.text for o in smollm_llm.generate(prompts, params)]
    assert [o.text for o in bf16.generate(prompts, params)] == want
