"""The embedded SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized) on the default engine.

The command line's default config (what `jpaged batch` / `jpaged serve` run
without --config), as an experiment file: copy it, start from default_config()
and set fields, e.g. `config.block_size = 32`.
"""

from jpaged.entrypoints.cli_config import get_config  # noqa: F401  (the config is defined once, there)
