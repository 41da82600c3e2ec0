"""`jpaged export-tokenizer DIR`: the model's tokenizer as a Hugging Face tokenizer directory.

    jpaged export-tokenizer DIR [--config my_config.py] [--config.model=path.gguf ...]

writes the tokenizer jpaged serves for the config's model (its GGUF metadata, or
its checkpoint's tokenizer files) to DIR as tokenizer.json, tokenizer_config.json
(special tokens and the chat template), special_tokens_map.json and
generation_config.json (jpaged.tokenizer.hf_export), so that
`transformers.AutoTokenizer.from_pretrained(DIR)` loads it: what lm-eval's
`tokenizer=` and guidellm's `--processor` take.  No weights are read or written.
"""

from __future__ import annotations

import os
import pathlib
import sys
from typing import Any

from absl import app

from jpaged.core.config import ConfigError, apply_overrides, auto_load_format, default_config, model_path, \
    validate_config
from jpaged.entrypoints import cli


def load_tokenizer(model: str, load_format: str = "auto") -> Any:
    """The Tokenizer jpaged builds for `model` (a config's model and load_format),
    from its tokenizer alone; ValueError when the model has none."""
    from jpaged.loading.weights import embedded_gguf_path
    from jpaged.tokenizer.tokenizer import Tokenizer
    path = model_path(model)
    if path is None:  # the embedded model
        return Tokenizer.from_gguf(str(embedded_gguf_path()))
    fmt = load_format if load_format != "auto" else auto_load_format(path)
    if fmt == "gguf":
        return Tokenizer.from_gguf(str(path))
    directory = path.parent if path.is_file() else path  # (dummy: a config.json beside its tokenizer files)
    if not (directory / "tokenizer.json").exists():
        raise ValueError(f"{model} has no tokenizer.json to export")
    return Tokenizer.from_hf_dir(directory)


def run(config_file: Any, output_dir: str) -> list[pathlib.Path]:
    """The command: the config's model's tokenizer written to `output_dir`; the files written."""
    from jpaged.tokenizer.hf_export import save_hf_tokenizer
    config = apply_overrides(default_config(), config_file)
    validate_config(config)
    tokenizer = load_tokenizer(config.model, config.load_format)
    return save_hf_tokenizer(tokenizer, output_dir, model_max_length=config.max_model_len)


def main(argv: list[str] | None = None) -> None:
    """`jpaged export-tokenizer DIR`: parses `argv` (default sys.argv) and exits."""
    config = cli.start(argv, lambda: _define_flags())

    def command(positional: list[str]) -> None:
        if len(positional) != 2:
            cli.exit_usage("export-tokenizer takes one argument, the directory to write "
                           "(jpaged export-tokenizer DIR [--config.model=...])")
        output = positional[1]
        if os.path.exists(output) and not os.path.isdir(output):
            cli.exit_usage(f"{output} exists and is not a directory")
        try:
            paths = run(config.value, output)
        except (ConfigError, ValueError, OSError) as e:
            cli.exit_usage(str(e))
        print(f"wrote {', '.join(p.name for p in paths)} to {output}: "
              f"transformers.AutoTokenizer.from_pretrained({output!r}) loads it")
        sys.exit(0)

    app.run(command, flags_parser=lambda a: cli.parse_flags(a, config))


def _define_flags() -> Any:
    config = cli.define_config_flag()
    cli.register_key_flags([config])
    return config


if __name__ == "__main__":
    main()
