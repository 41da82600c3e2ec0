"""The engine on the kernels (C++ on the CPU; Pallas in interpret mode) gives the reference's tokens."""

import pytest

from conftest import random_prompts
from jpaged.engine import resolve_attention_impl
from jpaged.sequence import SamplingParams


@pytest.mark.parametrize("impl", ["cpu", "pallas_gpu", "pallas_tpu"])
def test_greedy_tokens_match_reference(make_tiny_llm, impl):
    # Prompt lengths straddle the 16-token blocks; two rows share a prefill step
    # (the ragged kernel) and decode crosses block boundaries (the decode kernel).
    prompts = random_prompts([5, 16, 21], seed=3)
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    reference = make_tiny_llm(attention_impl="reference", max_num_seqs=3).generate(prompts, params)
    kernel = make_tiny_llm(attention_impl=impl, max_num_seqs=3).generate(prompts, params)
    assert [o.token_ids for o in kernel] == [o.token_ids for o in reference]


def test_attention_impl_names():
    from pallas_kernels import cpu
    # CPU backend: the C++ decode kernel when it builds here, else the reference.
    assert resolve_attention_impl("auto") == ("cpu" if cpu.available() else "reference")
    assert resolve_attention_impl("cpu") == "cpu"
    assert resolve_attention_impl("pallas_gpu") == "gpu"
    assert resolve_attention_impl("pallas_tpu") == "tpu"
    with pytest.raises(ValueError, match="attention_impl"):
        resolve_attention_impl("flash")
