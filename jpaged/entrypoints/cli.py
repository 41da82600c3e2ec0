"""Command-line plumbing of the scripts (serve_batch.py, serve.py): a --config
file flag whose every field can be overridden as --config.field=value, and
every mistake on the command line reported as one line with exit status 2,
before anything heavy loads.  No jax here."""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from absl import flags
from ml_collections import ConfigDict, config_flags

from jpaged.core.config import ConfigError, apply_overrides, default_config

CONFIG_DEFAULT = "configs/smollm2_135m.py"


def exit_usage(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def misspelt_override(argv: list[str]) -> str | None:
    """The one-line error for the first --config.<field> naming no field, if any."""
    for arg in argv[1:]:
        name = arg.split("=", 1)[0].removeprefix("--config.")
        if arg.startswith("--config.") and name.split(".")[0] not in default_config():
            try:
                apply_overrides(default_config(), **{name: None})
            except ConfigError as e:
                return str(e)
            return f"{name}: unknown field"
    return None


def config_path(argv: list[str]) -> str:
    """The last --config file named on the command line."""
    path = CONFIG_DEFAULT
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        elif arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
    return path + ("" if os.path.exists(path) else " (no such file)")


def define_config_flag() -> flags.FlagHolder:
    """--config (default configs/smollm2_135m.py), with --config.field=value overrides."""
    try:
        return config_flags.DEFINE_config_file("config", CONFIG_DEFAULT, "Engine config file.")
    except (KeyError, AttributeError, TypeError, ValueError) as e:  # config_flags applies overrides here
        exit_usage(misspelt_override(sys.argv) or f"--config.* overrides: {str(e).splitlines()[0]}")


def parse_flags(argv: list[str], config: flags.FlagHolder) -> list[str]:
    """absl's parsing, with every mistake (an unknown flag or config field, a
    value of the wrong type, a config file that does not load) reported as one
    line and exit status 2, like the config checks."""
    try:
        rest = flags.FLAGS(argv)
    except Exception as e:  # noqa: BLE001 - absl and config_flags raise assorted types
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "failure to load" in message:  # config_flags: the --config file itself
            message = f"--config: cannot load {config_path(argv)}"
        elif not isinstance(e, flags.Error):  # raised by the config file's own code
            message = f"--config: cannot load {config_path(argv)}: {type(e).__name__}: {message}"
        exit_usage(misspelt_override(argv) or message)
    if not isinstance(config.value, ConfigDict):  # config_flags defers a file's load error
        exit_usage(f"--config: cannot load {config_path(argv)}")
    return rest
