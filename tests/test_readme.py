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
