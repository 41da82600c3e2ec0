"""Structured outputs in the engine: constraints masked into the step, one
matcher per sample, and the rest of the engine (n > 1, preemption, prefix
caching, chunked prefill, stop strings, logprobs, aborts, async scheduling)
unchanged around them.  The tiny Llama with a byte-level tokenizer: every
character is a token, so a constraint's language is easy to check; the model
is random, so only what the constraint guarantees is asserted.  Its EOS id (2)
is also the byte "#" of that tokenizer: answers are read without it."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from helpers import TINY_ENGINE, assert_all_blocks_free
from jpaged.entrypoints.batch_requests import parse_request
from jpaged.core.sequence import SamplingParams
from jpaged.structured.spec import StructuredOutputs, from_request

DIGITS = StructuredOutputs(regex=r"[0-9]{2,5}")
CHOICE = StructuredOutputs(choice=("alpha", "beta", "gamma"))
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["x", "y"]}},
          "required": ["n", "tag"], "additionalProperties": False}
# A compact JSON form (no free whitespace) so that a random model finishes it in a few tokens.
COMPACT = StructuredOutputs(grammar='start: "{\\"n\\":" /[0-9]{1,2}/ ",\\"tag\\":\\"" ("x" | "y") "\\"}"')


@pytest.fixture(scope="module")
def llm(tiny_llama_tok_dir):
    from jpaged.engine.llm import LLM
    return LLM(model=tiny_llama_tok_dir, **{**TINY_ENGINE, "max_num_batched_tokens": 64})


def texts(outputs):
    return [[s["text"] for s in o.samples] for o in outputs]


def answers(outputs):
    """Each sample's text before its EOS ("#", see the module docstring)."""
    return [[s["text"].removesuffix("#") for s in o.samples] for o in outputs]


def run(llm, prompts, params):
    outs = llm.generate(prompts, params)
    assert llm.block_manager.num_used_blocks == 0  # (the pool may be a smaller one: install_pool)
    return outs


def test_constrained_samples_conform_greedy_and_seeded(llm):
    prompts = ["abc", "hello there", "x", "a longer prompt about numbers"]
    params = [SamplingParams(max_tokens=12, structured=DIGITS),
              SamplingParams(max_tokens=12, structured=CHOICE, temperature=1.0, seed=1),
              SamplingParams(max_tokens=12, structured=CHOICE, temperature=0.8, top_k=5, seed=2, n=3),
              SamplingParams(max_tokens=24, structured=COMPACT, temperature=1.0, seed=3)]
    outs = run(llm, prompts, params)
    got = answers(outs)
    assert re.fullmatch(r"[0-9]{2,5}", got[0][0])
    assert all(t in CHOICE.choice for a in got[1:3] for t in a)
    assert all(s["finish_reason"] == "stop" for o in outs for s in o.samples)
    assert len(outs[2].samples) == 3
    answer = json.loads(got[3][0])
    jsonschema.validate(answer, SCHEMA)
    assert outs[3].finish_reason == "stop"
    # Seeded: the same request repeats; a constraint does not depend on the batch it ran in.
    assert texts(run(llm, prompts[1:3], params[1:3])) == texts(outs[1:3])


def test_neighbours_tokens_are_those_they_get_alone(llm):
    free = [SamplingParams(max_tokens=10), SamplingParams(max_tokens=10, temperature=1.0, seed=5)]
    alone = run(llm, ["one", "two"], free)
    mixed = run(llm, ["one", "zzz", "two", "yyy"],
                [free[0], SamplingParams(max_tokens=10, structured=CHOICE), free[1],
                 SamplingParams(max_tokens=10, structured=DIGITS, temperature=1.0, seed=9)])
    assert [o.token_ids for o in alone] == [mixed[0].token_ids, mixed[2].token_ids]


def test_length_before_the_structure_completes_says_so(llm):
    out = run(llm, ["p"], SamplingParams(max_tokens=3, structured=COMPACT))[0]
    assert out.finish_reason == "length" and out.text == '{"n'


def test_bad_constraints_fail_their_request_only(llm):
    params = [SamplingParams(max_tokens=4, structured=StructuredOutputs(regex="a[")),
              SamplingParams(max_tokens=4, structured=StructuredOutputs(regex=r"[^\s\S]")),
              SamplingParams(max_tokens=4, structured=StructuredOutputs(json='{"type": "objectx"}')),
              SamplingParams(max_tokens=4, structured=StructuredOutputs(grammar="start: undefined_rule")),
              SamplingParams(max_tokens=4)]
    outs = run(llm, ["a"] * 5, params)
    assert [o.finish_reason for o in outs] == ["error"] * 4 + ["length"]
    assert "invalid regex constraint" in outs[0].error and "unclosed character class" in outs[0].error
    assert "admits no output" in outs[1].error
    assert "invalid json constraint" in outs[2].error
    assert "invalid grammar constraint" in outs[3].error
    assert llm.check_request([1, 2], params[0]).startswith("invalid regex constraint")


def test_stop_strings_and_logprobs_under_a_constraint(llm):
    regex = StructuredOutputs(regex=r"[ab]{1,6}c")
    out = run(llm, ["q"], SamplingParams(max_tokens=10, structured=regex, stop=("b",), logprobs=3))[0]
    assert "b" not in out.text and re.fullmatch(r"a{0,6}c?#?", out.text)
    assert len(out.logprobs) == len(out.token_ids)
    # Raw logprobs are the model's: a forced token's logprob is its unconstrained one.
    assert all(lp.logprob <= 0 for lp in out.logprobs)


def test_processed_logprobs_see_only_allowed_tokens(tiny_llama_tok_dir):
    from jpaged.engine.llm import LLM
    llm = LLM(model=tiny_llama_tok_dir, **{**TINY_ENGINE, "logprobs_mode": "processed"})
    out = llm.generate(["q"], SamplingParams(max_tokens=4, structured=DIGITS, logprobs=5))[0]
    digits = {llm.tokenizer.encode(str(d), add_special_tokens=False)[0] for d in range(10)}
    allowed = [digits, digits] + [digits | set(llm.tokenizer.eos_token_ids)] * 4  # EOS after two digits
    for lp, ok in zip(out.logprobs, allowed):
        assert lp.token_id in ok and {i for i, _ in lp.top} <= ok
    # The mass is renormalised over the allowed tokens: a row's 5 best hold most of it.
    assert all(0.5 < sum(np.exp(v) for _, v in lp.top) <= 1 + 1e-5 for lp in out.logprobs)


def test_preemption_prefix_cache_and_chunked_prefill_keep_the_tokens(llm):
    prompts = ["shared prefix for everyone " * 3 + str(i) for i in range(6)]
    params = [SamplingParams(max_tokens=16, structured=COMPACT if i % 2 else DIGITS,
                             temperature=1.0 if i % 3 else 0.0, seed=i) for i in range(6)]
    reference = texts(run(llm, prompts, params))
    for mode in ("recompute", "swap"):
        llm.install_pool(12, mode)  # too small for 6 at once: sequences are preempted
        try:
            assert texts(run(llm, prompts, params)) == reference, mode
            assert llm.stats.preemptions > 0, mode
        finally:
            llm.install_pool(llm.num_blocks, "recompute")
    llm.block_manager.enable_prefix_caching = True
    try:
        run(llm, prompts, params)
        again = run(llm, prompts, params)
        assert texts(again) == reference and sum(o.num_cached_tokens for o in again) > 0
    finally:
        llm.block_manager.enable_prefix_caching = False
        llm.reset_prefix_cache()


def test_aborting_a_constrained_request_leaves_the_engine_serving(llm):
    rid = llm.add_request(llm.tokenize("abc"), SamplingParams(max_tokens=30, structured=DIGITS))
    other = llm.add_request(llm.tokenize("def"), SamplingParams(max_tokens=5, structured=CHOICE))
    llm.step()
    llm.step()
    llm.abort([rid])
    done = {}
    while llm.has_unfinished_requests():
        done.update({d.request_id: d.output for d in llm.step() if d.finished})
    assert done[rid].finish_reason == "abort" and done[other].finish_reason == "stop"
    assert answers([done[other]])[0][0] in CHOICE.choice
    assert_all_blocks_free(llm)


def test_async_equals_sync_for_constrained_requests(tiny_llama_tok_dir, llm):
    from jpaged.engine.llm import LLM
    sync = LLM(model=tiny_llama_tok_dir, **{**TINY_ENGINE, "max_num_batched_tokens": 64,
                                            "async_scheduling": False})
    prompts = ["a", "bb", "ccc", "dddd"]
    params = [SamplingParams(max_tokens=12, structured=DIGITS), SamplingParams(max_tokens=12),
              SamplingParams(max_tokens=12, structured=CHOICE, temperature=1.0, seed=4, n=2),
              SamplingParams(max_tokens=20, structured=COMPACT, temperature=0.7, seed=8)]
    assert texts(llm.generate(prompts, params)) == texts(sync.generate(prompts, params))


# ------------------------------------------------------------- request fields
@pytest.mark.parametrize("body, expected", [
    ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutputs(regex="[0-9]+")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutputs(choice=("a", "b"))),
    ({"structured_outputs": {"json": {"type": "object"}}}, StructuredOutputs(json={"type": "object"})),
    ({"structured_outputs": {"json": '{"type": "object"}'}}, StructuredOutputs(json={"type": "object"})),
    ({"structured_outputs": {"grammar": "start: \"a\""}}, StructuredOutputs(grammar="start: \"a\"")),
    ({"structured_outputs": {"json_object": True}}, StructuredOutputs(json_object=True)),
    ({"guided_json": {"type": "string"}}, StructuredOutputs(json={"type": "string"})),
    ({"guided_regex": "a+", "guided_decoding_backend": "auto"}, StructuredOutputs(regex="a+")),
    ({"guided_choice": ["x"]}, StructuredOutputs(choice=("x",))),
    ({"guided_decoding": {"regex": "b"}}, StructuredOutputs(regex="b")),
    ({"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     StructuredOutputs(json=SCHEMA)),
    ({"response_format": {"type": "text"}}, None),
    ({}, None),
])
def test_request_fields_map_to_one_constraint(body, expected):
    assert from_request(body) == expected
    r = parse_request({"prompt": "hi", **body}, SamplingParams())
    assert r.error is None and not r.warnings and r.params.structured == expected


@pytest.mark.parametrize("body, field", [
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"pattern": "a"}}, "structured_outputs.pattern"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": "a+"}, "structured_outputs"),
    ({"guided_regex": 5}, "guided_regex"),
    ({"guided_decoding_backend": "xgrammar", "guided_regex": "a"}, "guided_decoding_backend"),
    ({"guided_whitespace_pattern": " ", "guided_json": {}}, "guided_whitespace_pattern"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format and guided_regex"),
])
def test_malformed_request_fields_name_the_field(body, field):
    r = parse_request({"prompt": "hi", **body}, SamplingParams(), 0)
    assert r.error is not None and r.error.startswith(f"request 0: {field}"), r.error
