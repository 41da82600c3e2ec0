"""adapter_config.json: what jpaged applies of a PEFT LoRA adapter's config, checked
field by field.

`parse_adapter_config` takes the parsed JSON and returns an `AdapterConfig` (r,
lora_alpha, use_rslora, rank_pattern / alpha_pattern compiled as PEFT matches
them, layers_to_transform), or raises a ValueError naming the file and the
field: anything that would change the adapter's forward pass and that jpaged
does not apply (DoRA, biases, trained modules, ...), target_modules that name
a module jpaged cannot adapt, and pattern keys that are not regexes or could
take long to match (a hostile adapter is read by the server).

Host only: the stdlib, no jax, numpy, torch or peft.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any

try:  # the stdlib's regex parser (to look at a pattern's shape), renamed in 3.11
    from re import _parser as _sre_parser
except ImportError:  # pragma: no cover
    import sre_parse as _sre_parser  # type: ignore[no-redef]

PEFT_MODULES: dict[str, str] = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
                                "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
MOE_MODULES = ("gate", "experts", "w1", "w2", "w3", "block_sparse_moe")  # their names in target_modules
MOE_REFUSAL = ("jpaged applies LoRA to a mixture-of-experts model's attention projections (and to the MLP of "
               "its dense layers), not to its experts or router")
# adapter_config.json fields whose (truthy) value changes the adapter's forward pass
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)", "lora_bias": "a bias on lora_B (lora_bias)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights)",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "layer_replication": "layer_replication", "target_parameters": "LoRA on parameters (target_parameters)",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)", "use_qalora": "QALoRA (use_qalora)",
    "arrow_config": "Arrow routing (arrow_config)", "kasa_config": "KaSA (kasa_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)", "use_bdlora": "block-diagonal LoRA (use_bdlora)",
}

# Bounds on what a pattern may make the loader compute.
MAX_PATTERNS = 1024                 # rank_pattern / alpha_pattern entries
MAX_PATTERN_CHARS = 256             # one pattern key (a module name or a regex)
MAX_PATTERN_REPEATS = 1             # "*", "+", "{2,}"... in a rank/alpha_pattern key (see _backtracking_error)
MAX_TARGET_REPEATS = 4              # in a target_modules regex (matched against two short names)
MAX_PATTERN_MATCHES = 1 << 19       # pattern keys x modules matched (an 80-layer adapter listing
                                    # every module in rank_pattern: 560 x 560)


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    """What jpaged applies of a checked adapter_config.json."""

    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: tuple[tuple[re.Pattern, int], ...]       # (PEFT's suffix regex of the key, r)
    alpha_pattern: tuple[tuple[re.Pattern, float], ...]
    layers_to_transform: frozenset[int] | None

    def module_scale(self, module: str) -> tuple[int, float]:
        """(configured rank, scale) of one PEFT module: peft.utils.other.get_pattern_key, the
        first key that is a regex suffix of `module`, else r / lora_alpha."""
        r = next((v for key, v in self.rank_pattern if key.match(module)), self.r)
        alpha = next((v for key, v in self.alpha_pattern if key.match(module)), self.lora_alpha)
        return r, alpha / (math.sqrt(r) if self.use_rslora else r)


def parse_adapter_config(raw: Any, where: str | os.PathLike) -> AdapterConfig:
    """adapter_config.json's parsed JSON, checked field by field: ValueError naming
    `where` (the file) and the field for anything jpaged cannot apply exactly."""
    def bad(field: str, problem: str) -> ValueError:  # ("rank_pattern['q_proj'] is 0": an entry's problem)
        return ValueError(f"{where}: {field}{'' if problem.startswith('[') else ' '}{problem}")

    if not isinstance(raw, dict):
        raise ValueError(f"{where}: not a JSON object")
    if raw.get("peft_type") != "LORA":
        raise bad("peft_type", f"is {show_value(raw.get('peft_type'))}; jpaged loads LoRA adapters only (LORA)")
    if raw.get("bias", "none") != "none":
        raise bad("bias", f"is {show_value(raw['bias'])}; jpaged applies adapters without biases (bias 'none')")
    for field, what in _UNSUPPORTED.items():
        if raw.get(field):
            raise ValueError(f"{where}: {what} is not supported ({field}={show_value(raw[field])}); "
                             f"jpaged applies plain LoRA")
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise bad("use_rslora", f"is {show_value(use_rslora)}, not true or false")
    _check_targets(where, raw.get("target_modules"))
    return AdapterConfig(
        r=_positive(raw.get("r", 8), int, lambda p: bad("r", p)),
        lora_alpha=_positive(raw.get("lora_alpha", 8), float, lambda p: bad("lora_alpha", p)),
        use_rslora=use_rslora,
        rank_pattern=_patterns(raw.get("rank_pattern"), int, lambda p: bad("rank_pattern", p)),
        alpha_pattern=_patterns(raw.get("alpha_pattern"), float, lambda p: bad("alpha_pattern", p)),
        layers_to_transform=_layers(raw.get("layers_to_transform"), lambda p: bad("layers_to_transform", p)))


def show_value(value: Any) -> str:
    """A config value for a message: its repr, cut (a hostile one may be megabytes)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."


def _positive(value: Any, kind: type, bad: Any) -> Any:
    """A positive int (kind int) or finite number (kind float); bad(problem) otherwise."""
    ok = (not isinstance(value, bool) and isinstance(value, int if kind is int else (int, float))
          and math.isfinite(value) and value > 0)
    if not ok:
        raise bad(f"is {show_value(value)}, not a positive {'integer' if kind is int else 'finite number'}")
    return kind(value)


def _patterns(value: Any, kind: type, bad: Any) -> tuple[tuple[re.Pattern, Any], ...]:
    """rank_pattern / alpha_pattern: {regex: value}, compiled as PEFT matches them."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad(f"is {show_value(value)}, not a JSON object")
    if len(value) > MAX_PATTERNS:
        raise bad(f"has {len(value):,} entries, above the limit of {MAX_PATTERNS}")
    out = []
    for key, v in value.items():
        if len(key) > MAX_PATTERN_CHARS:
            raise bad(f"key {show_value(key)} is {len(key):,} characters, above the limit of {MAX_PATTERN_CHARS}")
        try:
            pattern = re.compile(rf"(.*\.)?({key})$")
        except (re.error, RecursionError, OverflowError) as e:
            raise bad(f"key {show_value(key)} is not a regular expression ({e})") from None
        slow = _backtracking_error(key, MAX_PATTERN_REPEATS)
        if slow:
            raise bad(f"key {show_value(key)} is a regex that could take long to match: {slow}")
        out.append((pattern, _positive(v, kind, lambda p: bad(f"[{show_value(key)}] {p}"))))
    return tuple(out)


def _backtracking_error(pattern: str, max_repeats: int) -> str | None:
    """Why matching this (compiled) regex against a module name could take long, or None:
    nested repetition or a repeated alternation ("(a+)+", "(a|a)*": exponential) or
    more than `max_repeats` repetitions ("a.*b.*c": polynomial in the name's length)."""
    repeats = 0

    def walk(items: Any, under_repeat: bool) -> str | None:
        nonlocal repeats
        for op, arg in items:
            name = str(op)
            if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
                if under_repeat:
                    return "it repeats a repetition"
                repeats += arg[1] > 1
                inner = walk(arg[2], True)
            elif name == "BRANCH":
                inner = "it repeats an alternation" if under_repeat else None
                inner = inner or next(filter(None, (walk(b, under_repeat) for b in arg[1])), None)
            elif name in ("SUBPATTERN", "ASSERT", "ASSERT_NOT", "ATOMIC_GROUP"):
                inner = walk(arg[-1] if name != "ATOMIC_GROUP" else arg, under_repeat)
            else:
                inner = None
            if inner:
                return inner
        return None

    error = walk(_sre_parser.parse(pattern), False)
    return error or (f"it has {repeats} repetitions (at most {max_repeats})" if repeats > max_repeats else None)


def _layers(value: Any, bad: Any) -> frozenset[int] | None:
    """layers_to_transform: null, a layer index, or a list of them."""
    if value is None:
        return None
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise bad(f"is {show_value(value)}, not a layer index (an integer >= 0) or a list of them")
    return frozenset(values)


def _check_targets(where: str | os.PathLike, targets: Any) -> None:
    """target_modules names only modules jpaged can adapt (validation only: the tensors decide)."""
    if targets is None or targets == "all-linear":
        return
    if isinstance(targets, str):  # PEFT fullmatches the regex against each module name
        if len(targets) > MAX_PATTERN_CHARS:
            raise ValueError(f"{where}: target_modules is {len(targets):,} characters, above the limit of "
                             f"{MAX_PATTERN_CHARS}")
        problem = _regex_error(targets) or _backtracking_error(targets, MAX_TARGET_REPEATS)
        if problem:
            raise ValueError(f"{where}: target_modules {show_value(targets)} is not a regular expression ({problem})")
        bad = [m for m in ("model.embed_tokens", "lm_head") if re.fullmatch(targets, m)]
    elif isinstance(targets, list) and all(isinstance(t, str) for t in targets):
        bad = [t for t in targets if t.rsplit(".", 1)[-1] not in PEFT_MODULES]
    else:
        raise ValueError(f"{where}: target_modules is {show_value(targets)}, not a list of names or a regex")
    moe = [t for t in bad if t.rsplit(".", 1)[-1] in MOE_MODULES]
    if moe:
        raise ValueError(f"{where}: target_modules includes {show_value(moe)}, mixture-of-experts modules (router or "
                         f"experts): {MOE_REFUSAL}")
    if bad:
        raise ValueError(f"{where}: target_modules includes {show_value(bad)}, which jpaged cannot adapt; "
                         f"it applies LoRA to {sorted(PEFT_MODULES)} only")


def _regex_error(pattern: str) -> str | None:
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        return str(e) or type(e).__name__
    return None
