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

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "rl_example.py"


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
