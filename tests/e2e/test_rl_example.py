"""scripts/rl_example.py in tiny mode: a 5-round smoke run of the RL loop.

Run as a subprocess (the script is an absl app); it writes one CSV row per round.
The engine's compile count must not move after the first round (update_params
never recompiles), the update step compiles once, and the engine's logprobs of
the sampled tokens equal the trainer's (decode.score on the same weights).
"""

from __future__ import annotations

import csv
import math
import pathlib
import subprocess
import sys

from helpers import cached_compiles_env

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "rl_example.py"


def test_rl_example_tiny_smoke(tmp_path):
    out = tmp_path / "rl"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--rounds=5", f"--out={out}"],
                          capture_output=True, text=True, env=cached_compiles_env(),
                          timeout=300)  # a hang guard, not a timing check
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("round ")] == \
        ["1", "2", "3", "4", "5"]
    with open(out.with_suffix(".csv")) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["round"]) for r in rows] == [1, 2, 3, 4, 5]
    assert len({r["compiles"] for r in rows}) == 1, [r["compiles"] for r in rows]
    assert all(r["update_compiles"] == "1" for r in rows)
    for r in rows:
        assert 0.0 <= float(r["reward"]) <= 1.0
        assert math.isfinite(float(r["kl"])) and float(r["kl"]) >= -1e-6
        assert float(r["lp_err"]) < 1e-4


def test_docs_rl_round():
    """docs/rl.md's round, with the script's own advantages, pack and Trainer on its tiny
    model: n samples per prompt, an update that moved the weights, and the engine serving
    the new ones."""
    import importlib.util

    import jax
    import numpy as np

    from doc_examples import marked_blocks
    from jpaged.core.sequence import SamplingParams
    spec = importlib.util.spec_from_file_location("rl_example_for_docs", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)  # defines the script's absl flags; main() is not run
    [code] = marked_blocks("docs/rl.md", "test_docs_rl_round")
    llm = script.make_engine(tiny=True, model="", num_seqs=8)
    prompts = [p for p, _ in script.tiny_prompts(np.random.default_rng(0), 2)]
    scope = dict(llm=llm, prompts=prompts, seeds=[0, 4], np=np, SamplingParams=SamplingParams,
                 reward=lambda ids: script.tiny_reward(llm, ids, None), advantages=script.advantages,
                 pack=script.pack, ref_params=llm.params,
                 trainer=script.Trainer(llm.graphdef, llm.params, lr=3e-3, kl_coef=0.04, micro_batch=0))
    exec(compile(code, "docs/rl.md", "exec"), scope)
    outs, new_params, kl, policy_lp = (scope[k] for k in ("outs", "new_params", "kl", "policy_lp"))
    assert [len(o.samples) for o in outs] == [4, 4] and scope["adv"].shape == (8,)
    assert llm.params is new_params and math.isfinite(kl) and kl >= -1e-6
    assert jax.tree.structure(new_params) == jax.tree.structure(scope["ref_params"])
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(new_params),
                                                        jax.tree.leaves(scope["ref_params"])))
    ids, mask = scope["ids"], scope["mask"]
    assert policy_lp.shape == mask.shape == (8, ids.shape[1] - 1)
