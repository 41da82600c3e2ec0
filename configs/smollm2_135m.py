"""The embedded SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized) on the default engine."""

from jpaged.core.config import default_config


def get_config():
    config = default_config()
    config.model = "smollm2-135m"
    config.max_num_seqs = 8
    config.max_tokens = 128
    config.compilation_cache = True  # restarts reuse compiled steps (sets JAX's cache dir)
    return config
