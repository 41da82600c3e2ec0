"""LoRA adapters over HTTP and in the batch CLI, as vLLM serves them: a request's
"model" names its adapter, /v1/models lists them, /v1/load_lora_adapter and
/v1/unload_lora_adapter change them at run time.  In process on the tiny Llama
with a byte-level tokenizer (uvicorn in a thread); the oracle is the Python API
(SamplingParams.lora) on the same engine, asked before the server takes it."""

from __future__ import annotations

import asyncio
import json
import pathlib
import shutil
import threading
import urllib.error
import urllib.request

import pytest

uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
peft = pytest.importorskip("peft")

from helpers import TINY_ENGINE, serve_in_thread, make_peft_adapter  # noqa: E402
from jpaged.core.sequence import SamplingParams  # noqa: E402
from jpaged.entrypoints import batch  # noqa: E402
from jpaged.entrypoints.openai.app import create_app  # noqa: E402
from jpaged.entrypoints.openai.state import ServerOptions  # noqa: E402
from jpaged.core.lora_adapters import parse_lora_modules  # noqa: E402

SECONDS = 60  # any one wait
NEW_TOKENS = 8
PROMPT = "Tell me about the sea."
MESSAGES = [{"role": "user", "content": "Name a color."}]


def make_adapter(hf_model, path, seed: int) -> str:
    make_peft_adapter(hf_model, path, seed, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    return str(path)


def greedy(lora: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, lora=lora)


def http(method: str, url: str, body: dict | None = None) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=SECONDS) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def lora_info(url: str) -> dict[str, str]:
    """The labels of /metrics' vllm:lora_requests_info (vLLM's; llm-d routes by it)."""
    from prometheus_client.parser import text_string_to_metric_families
    status, text = http("GET", url + "/metrics")
    assert status == 200
    [family] = [f for f in text_string_to_metric_families(text) if f.name == "vllm:lora_requests_info"]
    return family.samples[0].labels


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    """{name: PEFT directory}: "a1" loaded at start, "a2" and "a3" for run time."""
    root = tmp_path_factory.mktemp("lora-server")
    return {name: make_adapter(tiny_llama[1], root / name, seed) for seed, name in enumerate(["a1", "a2", "a3"])}


@pytest.fixture(scope="module")
def engine_config(tiny_llama_tok_dir, adapters):
    """The server's engine, and the batch CLI's (the same shapes: compiled steps are shared)."""
    return {**TINY_ENGINE, "model": tiny_llama_tok_dir, "lora_modules": f"a1={adapters['a1']}", "max_loras": 2}


@pytest.fixture(scope="module")
def served(engine_config, adapters):
    """(base url, {(route, model): expected text}) of a server named "tiny" over an engine
    holding a1 (two slots: a2 fits at run time, a3 then does not)."""
    from jpaged.engine.llm import LLM
    llm = LLM(**engine_config)
    llm.load_lora_adapter("a2", adapters["a2"])
    expected = {}
    for lora in (None, "a1", "a2"):
        expected["completion", lora] = llm.generate([PROMPT], greedy(lora))[0].text
        expected["chat", lora] = llm.generate([{"messages": MESSAGES}], greedy(lora))[0].text
    llm.unload_lora_adapter("a2")
    with serve_in_thread(create_app(llm, model_name="tiny"), SECONDS) as url:
        yield url, expected


def client(url: str) -> "openai.AsyncOpenAI":
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=SECONDS, max_retries=0)


async def complete(c: "openai.AsyncOpenAI", model: str) -> "openai.types.Completion":
    return await c.completions.create(model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})


def test_model_names_the_adapter(served):
    """"model": "a1" runs the adapter (the Python API's tokens), the base name and no
    model the base; the answer names the model it ran."""
    url, expected = served

    async def run():
        async with client(url) as c:
            base, adapted = await complete(c, "tiny"), await complete(c, "a1")
            chat = await c.chat.completions.create(model="a1", messages=MESSAGES, max_tokens=NEW_TOKENS,
                                                   temperature=0, extra_body={"ignore_eos": True})
            return base, adapted, chat
    base, adapted, chat = asyncio.run(run())
    assert base.choices[0].text == expected["completion", None] and base.model == "tiny"
    assert adapted.choices[0].text == expected["completion", "a1"] and adapted.model == "a1"
    assert expected["completion", "a1"] != expected["completion", None]  # the adapter matters
    assert chat.choices[0].message.content == expected["chat", "a1"] and chat.model == "a1"
    status, text = http("POST", url + "/v1/completions", {"prompt": PROMPT, "max_tokens": NEW_TOKENS,
                                                          "temperature": 0, "ignore_eos": True})
    assert status == 200 and json.loads(text)["choices"][0]["text"] == expected["completion", None]


def test_models_lists_the_adapters(served, adapters):
    url, _ = served
    status, text = http("GET", url + "/v1/models")
    cards = {card["id"]: card for card in json.loads(text)["data"]}
    assert status == 200 and list(cards) == ["tiny", "a1"]
    assert (cards["a1"]["parent"], cards["a1"]["root"], cards["tiny"]["parent"]) == ("tiny", adapters["a1"], None)
    status, text = http("GET", url + "/v1/models/a1")
    assert status == 200 and json.loads(text)["parent"] == "tiny"
    status, text = http("POST", url + "/tokenize", {"model": "a1", "prompt": "hi"})  # the base's tokenizer
    assert status == 200 and json.loads(text)["count"] == 2


def test_unknown_model_is_a_404_for_that_request_alone(served):
    url, expected = served

    async def run():
        async with client(url) as c:
            good = asyncio.create_task(complete(c, "a1"))
            with pytest.raises(openai.NotFoundError):
                await c.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=NEW_TOKENS)
            status, text = await asyncio.to_thread(http, "POST", url + "/v1/completions",
                                                   {"model": "nope", "prompt": PROMPT})
            return await good, status, json.loads(text)
    good, status, body = asyncio.run(run())
    assert status == 404 and body == {"error": {"message": "The model `nope` does not exist.", "type":
                                                "invalid_request_error", "param": "model", "code": "model_not_found"}}
    assert good.choices[0].text == expected["completion", "a1"]


def test_load_use_and_unload_at_run_time(served, adapters):
    url, expected = served
    load = url + "/v1/load_lora_adapter"
    status, text = http("POST", load, {"lora_name": "a2", "lora_path": adapters["a2"]})
    assert (status, text) == (200, "Success: LoRA adapter 'a2' added successfully.")
    assert [m["id"] for m in json.loads(http("GET", url + "/v1/models")[1])["data"]] == ["tiny", "a1", "a2"]

    async def ask():
        async with client(url) as c:
            return (await complete(c, "a2")).choices[0].text
    assert asyncio.run(ask()) == expected["completion", "a2"]  # the same tokens as loaded in Python
    for body, words in [({"lora_name": "a2", "lora_path": adapters["a3"]}, "already loaded"),
                        ({"lora_name": "a3", "lora_path": adapters["a3"]}, "slots")]:  # two of two in use
        status, text = http("POST", load, body)
        assert status == 400 and words in json.loads(text)["error"]["message"], text
    # Unloading ends its requests in flight (between two steps): a stream's last chunk says "abort".
    stream = iter(openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=SECONDS, max_retries=0)
                  .completions.create(model="a2", prompt=PROMPT, max_tokens=100, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True}))
    next(stream)
    assert lora_info(url) == {"max_lora": "2", "running_lora_adapters": "a2", "waiting_lora_adapters": ""}
    status, text = http("POST", url + "/v1/unload_lora_adapter", {"lora_name": "a2"})
    assert (status, text) == (200, "Success: LoRA adapter 'a2' removed successfully.")
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "abort"
    assert lora_info(url)["running_lora_adapters"] == ""
    status, text = http("POST", url + "/v1/completions", {"model": "a2", "prompt": PROMPT})
    assert status == 404 and json.loads(text)["error"]["code"] == "model_not_found"
    status, text = http("POST", url + "/v1/unload_lora_adapter", {"lora_name": "a2"})
    assert status == 404 and "'a2' is not loaded" in json.loads(text)["error"]["message"], text


def test_bad_load_requests_are_400s_naming_the_problem(served, tmp_path, tiny_llama_tok_dir):
    url, _ = served
    load = url + "/v1/load_lora_adapter"
    missing = str(tmp_path / "no-such-adapter")
    for body, param, words in [({"lora_name": "x", "lora_path": missing}, "lora_path", missing),
                               ({"lora_name": "x", "lora_path": tiny_llama_tok_dir}, "lora_path",
                                "adapter_config.json"),
                               ({"lora_name": "x"}, "lora_path", "lora_path is required"),
                               ({"lora_name": "tiny", "lora_path": missing}, "lora_name", "base model"),
                               ({"lora_name": 3, "lora_path": missing}, "lora_name", "lora_name")]:
        status, text = http("POST", load, body)
        error = json.loads(text)["error"]
        assert (status, error["param"]) == (400, param) and words in error["message"], text
    assert [m["id"] for m in json.loads(http("GET", url + "/v1/models")[1])["data"]] == ["tiny", "a1"]


def _hostile(src: str, dest: pathlib.Path, config: dict | None = None, raw_config: bytes | None = None,
             header: bytes | None = None) -> str:
    """A copy of the adapter at `src` with its config changed (fields over the good one, or
    raw bytes) or its safetensors file replaced by one with `header`."""
    shutil.copytree(src, dest)
    path = dest / "adapter_config.json"
    if config is not None:
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if raw_config is not None:
        path.write_bytes(raw_config)
    if header is not None:
        (dest / "adapter_model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    return str(dest)


DEEP = b"[" * 100_000 + b"]" * 100_000
HOSTILE = {  # name -> (_hostile's changes, the file named, words of the message)
    "rank 0": (dict(config={"rank_pattern": {"q_proj": 0}}), "adapter_config.json", "rank_pattern['q_proj'] is 0"),
    "alpha text": (dict(config={"alpha_pattern": {"q_proj": "x"}}), "adapter_config.json", "alpha_pattern['q_proj']"),
    "bad regex": (dict(config={"rank_pattern": {"(": 8}}), "adapter_config.json", "rank_pattern key '('"),
    "layers float": (dict(config={"layers_to_transform": 1.5}), "adapter_config.json", "layers_to_transform is 1.5"),
    "deep config": (dict(raw_config=DEEP), "adapter_config.json", "nested too deeply"),
    "deep header": (dict(header=b'{"a": ' + DEEP + b"}"), "adapter_model.safetensors", "nested too deeply"),
    "huge config": (dict(raw_config=b" " * (2 << 20)), "adapter_config.json", "above the limit of 1,048,576"),
}


def test_hostile_adapters_are_400s_naming_file_and_field(served, adapters, tmp_path):
    """Each malformed adapter is a 400 (param lora_path) naming the file and the field;
    nothing is loaded and the server goes on serving."""
    url, expected = served
    for name, (changes, file, words) in HOSTILE.items():
        path = _hostile(adapters["a3"], tmp_path / name.replace(" ", "_"), **changes)
        status, text = http("POST", url + "/v1/load_lora_adapter", {"lora_name": "a3", "lora_path": path})
        error = json.loads(text)["error"]
        assert (status, error["param"]) == (400, "lora_path"), (name, text)
        assert error["message"].startswith(f"{path}/{file}: ") and words in error["message"], (name, text)
    assert [m["id"] for m in json.loads(http("GET", url + "/v1/models")[1])["data"]] == ["tiny", "a1"]
    status, text = http("POST", url + "/v1/completions", {"model": "a1", "prompt": PROMPT, "max_tokens": NEW_TOKENS,
                                                          "temperature": 0, "ignore_eos": True})
    assert status == 200 and json.loads(text)["choices"][0]["text"] == expected["completion", "a1"]


def test_unreadable_paths_do_not_tell_the_disk(served, tmp_path):
    """A missing path, an existing directory and a file get the same message (but their path)."""
    (tmp_path / "file").write_text("x")
    messages = set()
    for path in (tmp_path / "missing", tmp_path, tmp_path / "file"):
        status, text = http("POST", served[0] + "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(path)})
        assert status == 400, text
        messages.add(json.loads(text)["error"]["message"].replace(str(path), "<path>"))
    assert len(messages) == 1 and http("GET", served[0] + "/health")[0] == 200


@pytest.mark.parametrize("name", ["x" * 100_000, "<|im_end|>", "../x", "a,forged", "", "/abs", "a b"])
def test_lora_name_follows_the_start_up_rule(served, adapters, name):
    """lora_name at run time meets the rule lora_modules meets at start (a 400 naming
    lora_name); "," never reaches the comma-joined /metrics label."""
    url, _ = served
    status, text = http("POST", url + "/v1/load_lora_adapter", {"lora_name": name, "lora_path": adapters["a3"]})
    error = json.loads(text)["error"]
    assert (status, error["param"]) == (400, "lora_name") and "1 to 128 characters" in error["message"], text
    assert len(text) < 1000  # a long name is not echoed whole
    with pytest.raises(ValueError, match="1 to 128 characters"):
        parse_lora_modules({name: adapters["a3"]})  # (the dict form: "," splits the string form)
    assert lora_info(url)["running_lora_adapters"] == ""


def test_metrics_label_joins_only_rule_abiding_names():
    """vllm:lora_requests_info joins names with ",": one that broke the name rule (it cannot
    load) would be left out, never split into forged names."""
    from jpaged.entrypoints.openai.metrics import adapter_label
    assert adapter_label(["org/a:v1", "b"]) == "b,org/a:v1"
    assert adapter_label(["b", "org/a:v1", "x,forged", "<|im_end|>"]) == "b,org/a:v1"
    assert adapter_label([]) == ""


def test_adapter_files_are_read_off_the_engine_thread(served, adapters, monkeypatch):
    """Every read of the adapter's files happens in the server's host pool: the engine
    thread only fits what was read to the model and writes the slot."""
    from jpaged.loading import peft as peft_module
    url, _ = served
    threads, read = [], peft_module._read_capped

    def recording(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return read(*args, **kwargs)
    monkeypatch.setattr(peft_module, "_read_capped", recording)
    status, text = http("POST", url + "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": adapters["a2"]})
    assert status == 200, text
    assert threads and all(t.startswith("jpaged-host") for t in threads), threads
    assert http("POST", url + "/v1/unload_lora_adapter", {"lora_name": "a2"})[0] == 200


def test_adapter_routes_need_the_api_key():
    """They are always on, behind the key like every route but /health (no admin flag)."""
    from jpaged.core.config import default_config
    app = create_app(lambda: None, default_config(), options=ServerOptions(api_key="k"))
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        sent.append(message)
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b"",
                 "headers": [], "http_version": "1.1", "scheme": "http", "root_path": "",
                 "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1)}
        sent.clear()
        asyncio.run(app(scope, receive, send))
        assert sent[0]["status"] == 401, path
    assert b"vllm:lora_requests_info" not in app.state.jpaged.metrics.render()  # adapters off: as vLLM


def test_batch_lines_name_their_adapter(engine_config, served, tmp_path, keep_signal_handlers):
    """A line's "model": an adapter runs it, the config's model (or none) the base, an
    unknown name is that line's error."""
    _, expected = served
    lines = [{"messages": MESSAGES, "model": "a1"}, {"messages": MESSAGES, "model": "nope"},
             {"messages": MESSAGES}, {"messages": MESSAGES, "model": engine_config["model"]}]
    prompts, output = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps({**line, "max_tokens": NEW_TOKENS, "ignore_eos": True}) + "\n"
                               for line in lines))
    status = batch.run({**engine_config, "temperature": 0.0}, batch.Args(prompts=str(prompts), output=str(output)))
    assert status == 0
    records = {r["index"]: r for r in map(json.loads, output.read_text().splitlines())}
    assert records[0]["text"] == expected["chat", "a1"] and records[0]["error"] is None
    assert records[1]["finish_reason"] == "error" and records[1]["token_ids"] == []
    assert records[1]["error"] == "line 2: The model `nope` does not exist.", records[1]["error"]
    assert records[2]["text"] == records[3]["text"] == expected["chat", None]


def test_docs_lora_example(served, capsys):
    """docs/lora.md's openai example against this server ("sql" is its adapter a1 here, and
    the base is "tiny"): the adapter's and the base's answers, and the model list."""
    from doc_examples import marked_blocks
    url, _ = served
    [code] = marked_blocks("docs/lora.md", "test_docs_lora_example")
    code = code.replace("http://localhost:8000/v1", url + "/v1").replace('"sql"', '"a1"').replace(
        '"smollm2-135m"', '"tiny"')
    exec(compile(code, "docs/lora.md", "exec"), {})
    assert capsys.readouterr().out == "['tiny', 'a1']\n"

