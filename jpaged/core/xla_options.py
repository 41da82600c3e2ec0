"""XLA compiler options for the step's programs: config.xla_step_options parsed.

The field is a space-separated list of words, each a preset name or one
`name=value` option (an XLA debug option without its `--`, as XLA_FLAGS spells
it); later words win.  They reach `Lowered.compile(compiler_options=...)` of
every step program (jpaged.runtime.compilation) and that program's cache key,
and nothing else: JAX's other programs and the process's XLA_FLAGS are left
alone.

Presets (issue 38, ../shared/gpu-plan.md section 4):

  command_buffer         the whole step as one CUDA graph: every capturable
                         thunk kind, WHILE (a scanned layer loop) and CONDITIONAL
                         included (XLA's defaults leave both out), and graphs of
                         any size (the default min size is 5 thunks)
  dynamic_slice_fusion   cuBLAS reads each layer's slice of the stacked weights
                         in place (layer_loop=scan): no per-layer weight copies

XLA checks every name and value when it compiles, on every backend: its CPU
client takes the xla_gpu_* options (DebugOptions is one proto for every
backend), refuses a misspelt name or a value of the wrong type, and then ignores
them.  So a CPU run validates a GPU setting and generates the same tokens.

Host code: no jax here (jpaged.core).
"""

from __future__ import annotations

import re

OptionValue = bool | int | str

# XLA's default command-buffer kinds (debug_options_flags.cc) plus WHILE and
# CONDITIONAL, spelt out: through compiler_options XLA takes enum names only, not
# XLA_FLAGS' "+WHILE" additions.
_COMMAND_BUFFER_KINDS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"

PRESETS: dict[str, dict[str, OptionValue]] = {
    "command_buffer": {"xla_gpu_enable_command_buffer": _COMMAND_BUFFER_KINDS, "xla_gpu_graph_min_graph_size": 1},
    "dynamic_slice_fusion": {"xla_gpu_enable_dynamic_slice_fusion": True},
}

_NAME = re.compile(r"xla_[a-z0-9_]+")
ALLOWED = ('"" (none), or space-separated words, each a preset (' + ", ".join(PRESETS)
           + ') or an XLA option name=value (e.g. xla_gpu_autotune_level=0)')


def parse_xla_options(text: str) -> dict[str, OptionValue]:
    """The compiler options `text` names, presets expanded; ValueError (saying
    which word) for a word that is neither a preset nor `xla_<name>=<value>`.
    Values: true/false become bools, integers ints (what XLA's bool and int
    options take), anything else stays a string."""
    options: dict[str, OptionValue] = {}
    for word in text.split():
        if word in PRESETS:
            options.update(PRESETS[word])
            continue
        name, sep, value = word.partition("=")
        if not sep or not _NAME.fullmatch(name) or not value:
            raise ValueError(f"{word!r} is neither a preset nor an option name=value")
        options[name] = _value(value)
    return options


def _value(text: str) -> OptionValue:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if re.fullmatch(r"-?[0-9]+", text):
        return int(text)
    return text


def options_text(options: dict[str, OptionValue]) -> str:
    """A canonical one-line text of parsed options (sorted): what a program's cache key holds."""
    return " ".join(f"{k}={v!r}" for k, v in sorted(options.items()))
