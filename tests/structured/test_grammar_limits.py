"""Structured-output constraints that would crash or stall the server (issue 37,
items 1-3, 12, 13): refused by the input limits before llguidance sees them, a
400 naming the field and the limit; with the limits lifted, a native crash is
contained in the compile sandbox and a slow compile is cut at its budget, and
either is remembered as that constraint's error; in `jpaged batch` such a line
is that line's error, and --output is locked against a second run.

The compiler tests use a byte-level tokenizer (no model); the batch test runs
the tiny Llama in this process, as tests/entrypoints/test_batch_robustness.py does."""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import random
import sys
import threading
import types

import pytest

from jpaged.entrypoints.batch_requests import parse_request
from jpaged.core.sequence import SamplingParams
from jpaged.entrypoints import batch
from jpaged.entrypoints.cli import UsageError
from jpaged.entrypoints.openai.errors import RequestError
from jpaged.entrypoints.openai.protocol import parse_chat
from jpaged.structured import grammar, limits, sandbox
from jpaged.structured.grammar import GrammarCompiler
from jpaged.structured.spec import StructuredOutputs, from_request

from helpers import TINY_ENGINE, serve_in_thread

# The CLI and HTTP helpers live with the entrypoint tests, a sibling folder.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "entrypoints"))
from test_serve_batch_failures import assert_one_line_error, run as run_cli  # noqa: E402
from test_server import http  # noqa: E402

N = 3000  # the repros


def lark_chain(n: int = N) -> str:
    """Issue item 1: rules each naming the next (~60 KB at 3,000)."""
    return "start: r0\n" + "".join(f'r{i}: r{i + 1} | "x{i}"\n' for i in range(n)) + f'r{n}: "end"\n'


def ref_chain(n: int = N) -> dict:
    """Issue item 2: $defs each a $ref to the next (~106 KB at 3,000)."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


@functools.cache
def big_choice(n: int = 100_000) -> tuple[str, ...]:
    """Issue item 3: a choice of 100,000 strings (~1 MB); drawn once per size (module
    import builds two requests of it in every test worker)."""
    letters = "".join(random.Random(0).choices("abcdefghijklmnopqrstuvwxyz", k=10 * n))
    return tuple(letters[i:i + 10] for i in range(0, 10 * n, 10))


SCHEMA_FIELDS = [  # (request fields, the field an error names)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ref_chain()}}},
     "response_format.json_schema.schema"),
    ({"guided_json": ref_chain()}, "guided_json"),
    ({"structured_outputs": {"json": ref_chain()}}, "structured_outputs.json"),
]
REPROS = [
    ({"structured_outputs": {"grammar": lark_chain()}}, "structured_outputs.grammar", "grammar_rules"),
    *[(body, field, "ref_chain") for body, field in SCHEMA_FIELDS],
    ({"structured_outputs": {"choice": big_choice()}}, "structured_outputs.choice", "choice_entries"),
]


def byte_tokenizer():
    """A byte-level `tokenizers` tokenizer: 256 tokens (as tests/helpers.with_tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


@pytest.fixture
def compiler(monkeypatch):
    """A GrammarCompiler over the byte-level tokenizer (EOS 2), with a cache of its own."""
    monkeypatch.setattr(grammar, "_SHARED", {})
    return GrammarCompiler(types.SimpleNamespace(backend=byte_tokenizer(), eos_token_ids=[2]), 256)


@pytest.fixture
def lifted(monkeypatch):
    """The input limits off (llguidance's own and the budget stay): the inputs
    reach the compiler."""
    monkeypatch.setattr(limits, "check_schema", lambda text, field: None)
    monkeypatch.setattr(limits, "LIMITS", dataclasses.replace(
        limits.LIMITS, grammar_rules=10 ** 9, grammar_bytes=10 ** 9, choice_entries=10 ** 9, choice_bytes=10 ** 12))


def sandbox_calls(monkeypatch) -> list:
    calls = []
    real = sandbox.CompileSandbox.compile

    def counted(self, spec, deadline):
        calls.append(spec.kind)
        return real(self, spec, deadline)
    monkeypatch.setattr(sandbox.CompileSandbox, "compile", counted)
    return calls


# ------------------------------------------------------------ input limits
@pytest.mark.parametrize("body, field, limit", REPROS)
def test_repros_are_refused_by_the_limits_naming_field_and_limit(body, field, limit):
    r = parse_request({"prompt": "hi", **body}, SamplingParams(), 0)  # the batch CLI's and /generate's
    assert r.error is not None and r.error.startswith(f"request 0: {field} ") and f"({limit})" in r.error
    with pytest.raises(RequestError) as e:  # the chat route: a 400 whose param is the top-level field
        parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}, SamplingParams(), "m")
    assert e.value.status == 400 and e.value.param == field.split(".")[0]
    assert e.value.message.startswith(field) and f"({limit})" in e.value.message


def nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("spec, limit", [
    (StructuredOutputs(grammar=lark_chain()), "grammar_rules"),
    (StructuredOutputs(grammar="root ::= r0\n" + "".join(f'r{i} ::= r{i + 1} | "x"\n' for i in range(N))),
     "grammar_rules"),
    (StructuredOutputs(grammar="start: " + "(" * 60 + '"a"' + ")" * 60), "grammar_depth"),
    (StructuredOutputs(json=ref_chain()), "ref_chain"),
    (StructuredOutputs(json=nested_arrays(150)), "schema_depth"),
    (StructuredOutputs(regex="a" * 20_000), "regex_bytes"),
    (StructuredOutputs(choice=tuple(big_choice())), "choice_entries"),
    (StructuredOutputs(choice=tuple("x" * 1000 + str(i) for i in range(1000))), "choice_bytes"),
])
def test_the_compiler_refuses_what_is_beyond_the_limits_without_compiling(compiler, monkeypatch, spec, limit):
    monkeypatch.setattr(sandbox.CompileSandbox, "compile", None)  # any compile would fail on this
    error = compiler.check(spec)
    assert error.startswith(f"structured_outputs.{spec.kind} ") and f"({limit})" in error


def test_schemas_real_clients_send_pass_the_limits(compiler):
    """Recursive $refs (a tree), a few levels of models in $defs, a choice of a
    few thousand strings, a grammar of a hundred rules: all compile."""
    tree = {"$defs": {"node": {"type": "object", "properties": {
        "name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"}
    models = {"$defs": {f"m{i}": {"type": "object", "properties": {"next": {"$ref": f"#/$defs/m{i + 1}"}}}
                        for i in range(20)}, "$ref": "#/$defs/m0"}
    models["$defs"]["m20"] = {"type": "integer"}
    specs = [from_request({"guided_json": tree}), from_request({"guided_json": models}),
             from_request({"guided_json": nested_arrays(40)}),
             from_request({"guided_choice": [f"label number {i}" for i in range(3000)]}),
             from_request({"guided_grammar": lark_chain(100)})]
    assert [compiler.check(spec) for spec in specs] == [None] * len(specs)


# -------------------------------------------------- the sandbox (limits lifted)
def test_a_native_crash_is_contained_and_remembered(compiler, lifted, monkeypatch):
    """Issue items 1 and 2 with the limits lifted: llguidance overflows its stack
    (SIGSEGV) in the sandbox worker, not here; the constraint's error says so,
    for every field that asks for it, and is not compiled again."""
    calls = sandbox_calls(monkeypatch)
    errors = [compiler.check(from_request(body)) for body, _ in SCHEMA_FIELDS]  # one schema, three fields
    assert errors == [errors[0]] * 3 and "crashed the grammar compiler" in errors[0], errors
    assert calls == ["json"]  # the same constraint: its error was cached
    with pytest.raises(ValueError, match="crashed the grammar compiler"):
        compiler.grammar(from_request(SCHEMA_FIELDS[0][0]))
    error = compiler.check(from_request({"structured_outputs": {"grammar": lark_chain()}}))
    assert "the grammar constraint crashed the grammar compiler" in error
    assert compiler.check(StructuredOutputs(regex="[0-9]{2,5}")) is None  # a worker again, this process alive
    assert calls == ["json", "grammar", "regex"]
    assert compiler.grammar(StructuredOutputs(regex="[0-9]{2,5}")).error is None


def test_a_compile_past_its_budget_is_cut_and_remembered(compiler, lifted, monkeypatch):
    """Issue item 3 with the limits lifted: a 30,000-string choice compiles for
    seconds; a 0.3 s budget kills its worker and names the limit."""
    monkeypatch.setattr(limits, "LIMITS", dataclasses.replace(limits.LIMITS, compile_seconds=0.3))
    assert compiler.check(StructuredOutputs(regex="a+")) is None  # the worker is up: the budget is the compile's
    calls = sandbox_calls(monkeypatch)
    spec = StructuredOutputs(choice=tuple(big_choice(30_000)))
    error = compiler.check(spec)
    assert error == "the choice constraint did not compile within 0.3 s (compile_seconds)"
    assert compiler.check(spec) == error and calls == ["choice"]
    assert compiler.check(StructuredOutputs(regex="b+")) is None


def test_compilers_of_one_tokenizer_share_what_they_compiled(compiler, monkeypatch):
    """Data-parallel replicas each load the tokenizer: a constraint one compiled
    (or refused) the others take from the cache."""
    other = GrammarCompiler(types.SimpleNamespace(backend=byte_tokenizer(), eos_token_ids=[2]), 256)
    good, bad = StructuredOutputs(regex="[a-c]{3}"), StructuredOutputs(regex="a[")
    assert compiler.check(good) is None and "unclosed character class" in compiler.check(bad)
    calls = sandbox_calls(monkeypatch)
    assert other.check(good) is None and other.grammar(good).error is None
    assert other.check(bad) == compiler.check(bad) and calls == []


def test_compiles_beyond_the_cap_wait_and_then_are_refused_uncached(compiler, monkeypatch):
    """Every worker busy for a caller's whole budget: its constraint is refused as
    busy, and, not being its fault, not remembered: it compiles once a worker is free."""
    monkeypatch.setattr(limits, "LIMITS", dataclasses.replace(limits.LIMITS, compile_seconds=0.2))
    box = sandbox.CompileSandbox(byte_tokenizer().to_str(), 256, [2], workers=1)
    monkeypatch.setattr(compiler._shared, "sandbox", box)
    try:
        held = box._idle.get()  # another constraint compiling
        error = compiler.check(StructuredOutputs(regex="a+"))
        assert error.startswith("the grammar compiler is busy") and "(concurrent_compiles, compile_seconds)" in error
        box._idle.put(held)
        monkeypatch.setattr(limits, "LIMITS", dataclasses.replace(limits.LIMITS, compile_seconds=60))
        assert compiler.check(StructuredOutputs(regex="a+")) is None
    finally:
        box.close()


# -------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def server_url(tiny_llama_tok_dir):
    """A server on the tiny Llama in this process (so the tests can lift its limits)."""
    from jpaged.engine.llm import LLM
    from jpaged.entrypoints.openai.app import create_app
    with serve_in_thread(create_app(LLM(model=tiny_llama_tok_dir, **TINY_ENGINE), model_name="tiny")) as url:
        yield url


def complete(url: str, **fields) -> tuple[int, dict]:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, **fields}
    status, _, text = http("POST", url + "/v1/completions", json.dumps(body).encode(), timeout=120)
    return status, json.loads(text)


def test_over_http_each_repro_is_a_400_and_the_server_goes_on(server_url, monkeypatch):
    for body, field, limit in REPROS:
        status, answer = complete(server_url, **body)
        assert status == 400 and answer["error"]["param"] == field.split(".")[0], answer
        assert answer["error"]["message"].startswith(field) and f"({limit})" in answer["error"]["message"]
    monkeypatch.setattr(limits, "check_schema", lambda text, field: None)  # the crash reaches llguidance
    status, answer = complete(server_url, **SCHEMA_FIELDS[1][0])
    assert status == 400 and answer["error"]["param"] == "guided_json", answer
    assert "crashed the grammar compiler" in answer["error"]["message"]
    status, answer = complete(server_url)
    assert status == 200 and answer["choices"][0]["finish_reason"] == "length"


def test_compiling_constraints_hold_none_of_the_request_threads(server_url, monkeypatch):
    """Six new constraints compiling at once (more than the server's 4 host
    threads): an unconstrained request is answered meanwhile, and each
    constrained one once its compile ends."""
    release, started = threading.Event(), []
    real = sandbox.CompileSandbox.compile

    def slow(self, spec, wait_until):
        started.append(spec)
        release.wait(60)
        return real(self, spec, wait_until)
    monkeypatch.setattr(sandbox.CompileSandbox, "compile", slow)
    answers: list = []
    senders = [threading.Thread(target=lambda i=i: answers.append(complete(
        server_url, structured_outputs={"regex": f"[0-9]{{{i + 1}}}"}))) for i in range(6)]
    for t in senders:
        t.start()
    try:
        while len(started) < limits.LIMITS.concurrent_compiles:  # the compilers are taken
            threading.Event().wait(0.05)
        status, answer = complete(server_url)
        assert status == 200 and answer["choices"][0]["finish_reason"] == "length"
        assert not answers  # every constrained request still waits for its compile
    finally:
        release.set()
        for t in senders:
            t.join(120)
    assert [status for status, _ in answers] == [200] * 6, answers


# ------------------------------------------------------------------- batch
@pytest.fixture
def config(tiny_llama_tok_dir):
    return dict(model=tiny_llama_tok_dir, load_format="hf", max_model_len=64, num_blocks=12, max_num_seqs=2,
                attention_impl="reference", max_tokens=3, compilation_cache=False)


def test_a_batch_line_whose_constraint_crashes_is_that_lines_error(config, tmp_path, lifted, monkeypatch,
                                                                   keep_signal_handlers):
    """Issue item 12: the $ref chain on one line (limits lifted, so llguidance
    crashes on it) is that line's error; the other lines complete, the limits
    still refuse the 100,000-string choice, and --resume finds every line done."""
    prompts, output = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    lines = [{"prompt": "Hello"}, {"prompt": "x", "guided_json": ref_chain()},
             {"prompt": "y", "structured_outputs": {"choice": big_choice()}}, {"prompt": "Bye"}]
    monkeypatch.setattr(limits, "LIMITS", dataclasses.replace(limits.LIMITS, choice_entries=10_000))
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert batch.run(config, batch.Args(prompts=str(prompts), output=str(output))) == 0
    results = {r["index"]: r for r in map(json.loads, output.read_text().splitlines())}
    assert sorted(results) == [0, 1, 2, 3]
    assert [results[i]["finish_reason"] for i in (0, 3)] == ["length", "length"]
    assert results[1]["finish_reason"] == "error" and "crashed the grammar compiler" in results[1]["error"]
    assert results[2]["finish_reason"] == "error" and "(choice_entries)" in results[2]["error"]
    assert batch._finished_indices(str(output)) == {0, 1, 2, 3}  # what --resume skips


# ------------------------------------------------------------------ the lock
def test_a_second_run_on_a_locked_output_exits_2_naming_the_file(tmp_path):
    """Issue item 13: while one run holds --output, another (--resume or not)
    refuses it in one line and leaves the file as it was."""
    prompts, output = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    output.write_text('{"index": 0}\n')
    held, done = batch.open_output(str(output), str(prompts), resume=True)  # the live first run
    try:
        assert done == {0}
        with pytest.raises(UsageError, match=f"--output: {output} is being written by another jpaged batch"):
            batch.open_output(str(output), str(prompts), resume=False)
        proc = run_cli(f"--prompts={prompts}", f"--output={output}", "--resume", timeout=120)
        assert_one_line_error(proc, f"--output: {output} is being written by another jpaged batch")
        assert output.read_text() == '{"index": 0}\n'
    finally:
        held.close()
    again, _ = batch.open_output(str(output), str(prompts), resume=False)  # free once the first run ends
    again.close()
    assert output.read_text() == ""
