"""The Python examples of the README and the docs/ pages that run in-process: each
runs, and its answer is right (the blocks are marked with the test that runs
them; see tests/doc_examples.py and tests/e2e/test_docs.py)."""

import jax
import jax.numpy as jnp
import numpy as np

from doc_examples import marked_blocks
from jpaged.decode import create_kv_pool, forward_step, ragged_metadata


def run(code: str, page: str) -> dict:
    scope: dict = {"__name__": "doc_example"}
    exec(compile(code, f"{page} (example)", "exec"), scope)
    return scope


def test_docs_decode_example_matches_full_recompute():
    [code] = marked_blocks("docs/rl.md", "test_docs_decode_example_matches_full_recompute")
    graphdef, params, cfg, generated = (run(code, "docs/rl.md")[k] for k in ("graphdef", "params", "cfg", "generated"))
    # Oracle: no cache reuse; every step recomputes the whole sequence in a fresh pool.
    recompute = jax.jit(lambda pool, tokens, n: forward_step(
        graphdef, params, pool, tokens,
        ragged_metadata(jnp.array([[1, 2, 3]]), jnp.array([0]), n[None], 48, 16))[0])
    tokens = [1, 17, 42, 99, 7]
    expected = []
    for _ in range(len(generated)):
        pool = create_kv_pool(cfg, num_blocks=4, block_size=16, dtype=jnp.float32)
        padded = jnp.array(tokens + [0] * (48 - len(tokens)))  # one shape: one compilation
        expected.append(int(np.argmax(recompute(pool, padded, jnp.int32(len(tokens)))[0])))
        tokens.append(expected[-1])
    assert generated == expected


def test_docs_structured_outputs_python_example(smollm_llm, monkeypatch, capsys):
    import json

    import jsonschema

    import jpaged
    monkeypatch.setattr(jpaged, "LLM", lambda **overrides: smollm_llm, raising=False)  # the session's engine
    [code] = marked_blocks("docs/structured-outputs.md", "test_docs_structured_outputs_python_example")
    scope = run(code, "docs/structured-outputs.md")
    city, outs = scope["city"], scope["outs"]
    assert outs[0].finish_reason == "stop" and outs[1].text in ("yes", "no")
    jsonschema.validate(json.loads(outs[0].text), city)
    assert outs[1].text in capsys.readouterr().out


def test_docs_python_api_example(smollm_llm, monkeypatch, capsys):
    """The quick start's Python example (the README and docs/python-api.md hold the same
    block): two prompts, seeded sampling; it prints the first answer and its finish."""
    import jpaged
    monkeypatch.setattr(jpaged, "LLM", lambda **overrides: smollm_llm, raising=False)  # the session's engine
    [readme] = marked_blocks("README.md", "test_docs_python_api_example")
    [page] = marked_blocks("docs/python-api.md", "test_docs_python_api_example")
    assert readme == page
    outs = run(page, "docs/python-api.md")["outs"]
    assert [o.index for o in outs] == [0, 1]
    assert all(o.finish_reason in ("stop", "length") and 0 < len(o.token_ids) <= 32 and o.text for o in outs)
    assert capsys.readouterr().out.startswith(f"{outs[0].text} {outs[0].finish_reason} ")
