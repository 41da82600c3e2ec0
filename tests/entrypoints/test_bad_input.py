"""Bad requests fail alone, with a message naming the problem; the rest of the batch is unharmed."""

from __future__ import annotations

import math

import pytest

from helpers import assert_all_blocks_free, random_prompts
from jpaged.core.sequence import SamplingParams

GOOD = random_prompts([9, 30], seed=21)
OK = SamplingParams(max_tokens=12, ignore_eos=True)

# (prompt, params, words the error must contain) -- max_model_len is 128, vocab 256.
BAD = [
    ([], OK, ["empty"]),
    (list(range(3, 3 + 128)), OK, ["128", "max_model_len"]),
    (list(range(3, 3 + 300)), OK, ["300", "max_model_len"]),
    ([5, 256, 7], OK, ["vocabulary", "256"]),
    ([5, -1, 7], OK, ["vocabulary", "-1"]),
    ([5, 6], SamplingParams(max_tokens=0), ["max_tokens"]),
    ([5, 6], SamplingParams(max_tokens=-3), ["max_tokens"]),
    ([5, 6], SamplingParams(temperature=-0.5), ["temperature"]),
    ([5, 6], SamplingParams(temperature=math.nan), ["temperature"]),
    ([5, 6], SamplingParams(top_p=0.0), ["top_p"]),
    ([5, 6], SamplingParams(top_p=1.5), ["top_p"]),
    ([5, 6], SamplingParams(top_k=1.5), ["top_k"]),
    ("a text prompt", OK, ["tokenizer"]),  # the tiny checkpoint has no tokenizer
]


@pytest.fixture(scope="module")
def bad_batch(tiny_llm):
    prompts = [GOOD[0]] + [p for p, _, _ in BAD] + [GOOD[1]]
    params = [OK] + [sp for _, sp, _ in BAD] + [OK]
    return tiny_llm.generate(prompts, params)


def test_valid_requests_complete_as_if_alone(tiny_llm, bad_batch):
    first, last = bad_batch[0], bad_batch[-1]
    for out in (first, last):
        assert out.finish_reason == "length" and out.error is None and len(out.token_ids) == 12
    alone = [tiny_llm.generate([p], OK)[0].token_ids for p in GOOD]
    assert [first.token_ids, last.token_ids] == alone
    assert_all_blocks_free(tiny_llm)


@pytest.mark.parametrize("i", range(len(BAD)), ids=[
    "empty", "len==max_model_len", "len>max_model_len", "id>=vocab", "negative id", "max_tokens=0",
    "max_tokens<0", "temperature<0", "temperature=nan", "top_p=0", "top_p>1", "top_k float", "text without tokenizer"])
def test_bad_request_gets_error(bad_batch, i):
    out = bad_batch[1 + i]
    _, _, words = BAD[i]
    assert out.finish_reason == "error"
    assert out.error, "an error result must say what went wrong"
    for w in words:
        assert w in out.error, f"error {out.error!r} does not mention {w!r}"
    assert out.token_ids == [] and out.ttft_ms is None and out.latency_ms is not None


def test_outputs_keep_prompt_order_and_ids(bad_batch):
    assert [o.request_id for o in bad_batch] == sorted(o.request_id for o in bad_batch)
    assert bad_batch[0].prompt_token_ids == GOOD[0] and bad_batch[-1].prompt_token_ids == GOOD[1]


def test_longest_valid_prompt_generates_one_token(tiny_llm):
    """max_model_len - 1 prompt tokens is the longest accepted: room for one token."""
    out = tiny_llm.generate(random_prompts([127], seed=22), OK)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 1


def test_mismatched_params_list_raises(tiny_llm):
    with pytest.raises(ValueError, match="one SamplingParams per prompt"):
        tiny_llm.generate(GOOD, [OK])


def test_non_integer_token_ids_are_rejected_not_truncated(tiny_llm):
    from jpaged.core.sequence import SamplingParams
    outs = tiny_llm.generate([[5, 3.7, 9], [5, 6, 7]], SamplingParams(max_tokens=3))
    assert outs[0].finish_reason == "error" and "integers" in outs[0].error
    assert outs[1].finish_reason in ("stop", "length") and len(outs[1].token_ids) > 0


def test_misspelt_config_field_is_an_error():
    from jpaged.engine.llm import LLM
    with pytest.raises(ValueError, match=r"blok_size: unknown field; did you mean block_size\?"):
        LLM(model="unused", blok_size=32)
