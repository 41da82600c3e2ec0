"""Stop strings in the engine (SamplingParams.stop): the Python API cuts a sample
where its text first holds one, ends it in that step and frees its blocks."""

from __future__ import annotations

import dataclasses

import pytest

from helpers import TINY_ENGINE, assert_all_blocks_free
from jpaged.core.sequence import SamplingParams

PROMPT = {"prompt": "Write three short sentences about the sea."}


@pytest.fixture(scope="module")
def unstopped(smollm_llm):
    return smollm_llm.generate([PROMPT], SamplingParams(max_tokens=48))[0]


def test_a_stop_string_cuts_the_text_before_it(smollm_llm, unstopped):
    assert "." in unstopped.text, unstopped.text  # the greedy answer has a period to stop at
    out = smollm_llm.generate([PROMPT], SamplingParams(max_tokens=48, stop=(".",)))[0]
    assert out.finish_reason == "stop"
    assert out.text == unstopped.text[:unstopped.text.index(".")]
    # Ended in the step that produced the period: no token past it was computed.
    assert out.token_ids == unstopped.token_ids[:len(out.token_ids)]
    assert "." in smollm_llm.outputs.decode(out.token_ids)
    assert "." not in smollm_llm.outputs.decode(out.token_ids[:-1])
    assert_all_blocks_free(smollm_llm)


def test_the_earliest_of_several_stop_strings_wins(smollm_llm, unstopped):
    words = unstopped.text.split()
    late, early = words[-2], words[1]
    out = smollm_llm.generate([PROMPT], SamplingParams(max_tokens=48, stop=(late, early)))[0]
    assert out.text == unstopped.text[:unstopped.text.index(early)]


def test_a_stop_string_without_a_tokenizer_is_that_requests_error(tiny_llm):
    ok, bad = tiny_llm.generate([[5, 6, 7], [5, 6, 7]], [SamplingParams(max_tokens=4),
                                                          SamplingParams(max_tokens=4, stop=("x",))])
    assert ok.finish_reason == "length"
    assert bad.finish_reason == "error" and "tokenizer" in bad.error


def test_bad_stop_values_are_refused():
    for stop in ("abc", (1,), ("a",) * 17):
        with pytest.raises(ValueError, match="stop"):
            SamplingParams(stop=stop).validate()


@pytest.fixture(scope="module")
def text_llm(tiny_llama_tok_dir):
    """The tiny Llama with a byte-level tokenizer (TINY_ENGINE): per-sample stops and
    step()'s deltas are plumbing, so the sampled (and logprob-returning) programs they
    need are the tiny model's (seconds to compile), not SmolLM2's."""
    from jpaged.engine.llm import LLM
    return LLM(model=tiny_llama_tok_dir, **TINY_ENGINE)


def a_stop_it_meets(text: str) -> str:
    """A printable ASCII character of `text` (the tiny model's random bytes), from its
    middle where it has one: a stop string the sample meets part-way."""
    return next(c for c in text[len(text) // 3:] + text + "." if c.isascii() and c.isprintable() and not c.isspace())


def test_each_sample_stops_on_its_own(text_llm):
    """n = 3 samples, a stop string that sample 0 meets: each sample is cut at its own
    first occurrence of it (or runs to its length), its tokens a prefix of its free run's."""
    free = SamplingParams(max_tokens=12, temperature=1.0, seed=3, n=3)
    whole_samples = text_llm.generate([PROMPT], free)[0].samples
    stop = a_stop_it_meets(whole_samples[0]["text"])
    out = text_llm.generate([PROMPT], dataclasses.replace(free, stop=(stop,)))[0]
    assert out.samples[0]["finish_reason"] == "stop", (stop, whole_samples[0])
    for stopped, whole in zip(out.samples, whole_samples):
        cut = whole["text"].find(stop)
        assert stopped["text"] == (whole["text"] if cut < 0 else whole["text"][:cut])
        assert stopped["finish_reason"] == ("stop" if cut >= 0 else whole["finish_reason"])
        assert stopped["token_ids"] == whole["token_ids"][:len(stopped["token_ids"])]
    assert_all_blocks_free(text_llm)


def stream(llm, params: SamplingParams) -> tuple[list, object]:
    """One request run with output_kind "delta": its deltas, and the output its last one holds."""
    rid = llm.add_request(*llm.prepare_prompt(PROMPT, params))
    deltas = []
    while llm.has_unfinished_requests():
        deltas += [d for d in llm.step() if d.request_id == rid]
    return deltas, deltas[-1].output


@pytest.mark.parametrize("with_stop", [False, True], ids=["no-stop", "stop"])
def test_streamed_deltas_add_up_to_the_librarys_output(text_llm, with_stop):
    """step()'s deltas: each sample's pieces of text, tokens and logprobs add up to
    what generate() returns for the same request, and only the last delta is final."""
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=5, n=2, logprobs=1)
    want = text_llm.generate([PROMPT], params)[0]
    if with_stop:
        params = dataclasses.replace(params, stop=(a_stop_it_meets(want.samples[0]["text"]),))
        want = text_llm.generate([PROMPT], params)[0]
        assert want.samples[0]["finish_reason"] == "stop", (params.stop, want.samples[0])
    deltas, output = stream(text_llm, dataclasses.replace(params, output_kind="delta"))
    assert len(deltas) > 2 and [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    for i, sample in enumerate(want.samples):
        pieces = [d.samples[i] for d in deltas]
        assert "".join(p.text for p in pieces) == sample["text"] == output.samples[i]["text"]
        assert [t for p in pieces for t in p.token_ids] == sample["token_ids"]
        assert [lp.token_id for p in pieces for lp in p.logprobs] == sample["token_ids"]
        assert pieces[-1].finish_reason == sample["finish_reason"]
        # A sample's finish reason appears once it has ended, and stays.
        reasons = [p.finish_reason for p in pieces]
        assert None not in reasons[reasons.index(sample["finish_reason"]):]
    assert_all_blocks_free(text_llm)


def test_a_final_request_gets_one_delta_holding_everything(text_llm):
    whole = text_llm.generate([PROMPT], SamplingParams(max_tokens=48))[0]
    deltas, output = stream(text_llm, SamplingParams(max_tokens=48))
    assert len(deltas) == 1 and deltas[0].samples[0].text == whole.text == output.text
    assert deltas[0].samples[0].token_ids == whole.token_ids and len(whole.token_ids) > 1


def test_a_bad_output_kind_is_refused():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="cumulative").validate()
