"""Command-line plumbing of the commands (`jpaged batch`, `jpaged serve`, and
scripts/serve_batch.py, scripts/serve.py): a --config file flag whose every
field can be overridden as --config.field=value, and every mistake on the
command line reported as one line with exit status 2, before anything heavy
loads.  No jax here."""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Callable, NoReturn, TypeVar

from absl import flags
from ml_collections import ConfigDict, config_flags

from jpaged.core.config import DEPRECATED_FIELDS, ConfigError, apply_overrides, config_help, default_config
from jpaged.entrypoints import cli_config

# The config without --config: a file of the package (so an installed `jpaged` finds it
# anywhere); configs/smollm2_135m.py in a checkout is the same config.
CONFIG_DEFAULT = cli_config.__file__

T = TypeVar("T")


class UsageError(Exception):
    """Bad command-line input: reported as one line, exit status 2."""


def exit_usage(message: str) -> NoReturn:
    line = f"error: {message}"
    encoding = getattr(sys.stderr, "encoding", None) or "utf-8"
    try:  # a path from argv may hold undecodable bytes (surrogate escapes): escaped, never raised
        line = line.encode(encoding, "backslashreplace").decode(encoding)
    except LookupError:
        line = ascii(line)[1:-1]
    print(line, file=sys.stderr)
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


def rename_deprecated_overrides(argv: list[str]) -> list[str]:
    """argv with each --config.<old name> (DEPRECATED_FIELDS) renamed to its field,
    with a FutureWarning: config_flags only overrides fields the config file has."""
    out = []
    for arg in argv:
        for old, new in DEPRECATED_FIELDS.items():
            for prefix in (f"--config.{old}", f"-config.{old}"):
                if arg == prefix or arg.startswith(prefix + "="):
                    warnings.warn(f"--config.{old} is deprecated: use --config.{new}", FutureWarning, stacklevel=2)
                    arg = f"--config.{new}" + arg[len(prefix):]
        out.append(arg)
    return out


def start(argv: list[str] | None, define_flags: Callable[[], T]) -> T:
    """A command's first step: sets sys.argv to `argv` (config_flags reads its
    --config.field overrides from sys.argv, when the flag is defined and again
    when it parses) with deprecated field names renamed, then defines the
    command's flags; what `define_flags` returns."""
    _one_line_warnings()
    sys.argv = rename_deprecated_overrides(list(sys.argv if argv is None else argv))
    return define_flags()


def _one_line_warnings() -> None:
    """FutureWarnings (a deprecated config field) as one line, `warning: <message>`,
    like the command's errors: they are for the user, not about jpaged's source."""
    original = warnings.formatwarning

    def formatwarning(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> str:
        if issubclass(category, FutureWarning):
            return f"warning: {message}\n"
        return original(message, category, *args, **kwargs)

    warnings.formatwarning = formatwarning


def register_key_flags(holders: list[flags.FlagHolder]) -> None:
    """Lists `holders` in --help (absl lists the main module's flags there, and a
    command's flags are defined in its module, not in the script that runs it)."""
    for holder in holders:
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[holder.name])


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
    """--config (default: jpaged.entrypoints.cli_config), with --config.field=value overrides."""
    try:
        return config_flags.DEFINE_config_file(
            "config", CONFIG_DEFAULT, "Engine config file: a Python file whose get_config() returns the "
            "config (start from jpaged.core.config.default_config()). Default: the package's "
            "jpaged/entrypoints/cli_config.py, the embedded SmolLM2-135M-Instruct. Every field can be "
            "overridden as --config.<field>=<value>.\n\n" + config_help())
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
