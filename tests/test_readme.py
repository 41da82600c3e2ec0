"""The README's jpaged.decode example runs, and its tokens are right."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.decode import create_kv_pool, forward_step, ragged_metadata

README = pathlib.Path(__file__).parent.parent / "README.md"


def readme_decode_example() -> str:
    section = README.read_text().split("## Using jpaged.decode", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_decode_example_matches_full_recompute():
    scope: dict = {}
    exec(compile(readme_decode_example(), "README.md", "exec"), scope)
    graphdef, params, cfg, generated = (scope[k] for k in ("graphdef", "params", "cfg", "generated"))
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


def readme_blocks(heading: str) -> list[str]:
    """The ```python blocks of the README section under `heading`."""
    section = README.read_text().split(heading + "\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_readme_structured_outputs_python_example(smollm_llm, monkeypatch, capsys):
    import json

    import jsonschema

    import jpaged
    monkeypatch.setattr(jpaged, "LLM", lambda **overrides: smollm_llm, raising=False)  # the session's engine
    scope: dict = {}
    exec(compile(readme_blocks("## Structured outputs and tool calls")[0], "README.md", "exec"), scope)
    city, outs = scope["city"], scope["outs"]
    assert outs[0].finish_reason == "stop" and outs[1].text in ("yes", "no")
    jsonschema.validate(json.loads(outs[0].text), city)
    assert outs[1].text in capsys.readouterr().out
