"""The request fields every body model reads (a batch line's and each HTTP
route's: jpaged.entrypoints.openai.protocol), and the fields jpaged refuses.

UNSUPPORTED_FIELDS: fields of vLLM and OpenAI that would change the answer and
that jpaged does not implement; a request that asks for one is refused naming
the field (the batch CLI: that line's error; the HTTP server: a 400) rather than
answered as if the field were absent.  Host code: no jax.
"""

from __future__ import annotations

import json
from typing import Any

from jpaged.structured import spec as structured_spec
from jpaged.structured.json_values import json_type, short

# capture_routes: vLLM-style extension (SamplingParams.capture_routes): a MoE model's
# answer carries each choice's routed experts (responses.with_routes).
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "n",
                   "cache_salt", "ignore_eos", "capture_routes", "logprobs", "prompt_logprobs")
# The fields that constrain the output, all mapped to SamplingParams.structured
# (jpaged.structured.spec.from_request): vLLM's `structured_outputs` (and its older
# `guided_decoding` / `guided_*` extras) and OpenAI's `response_format`.
STRUCTURED_FIELDS = ("structured_outputs", "response_format", "guided_decoding",
                     *structured_spec.GUIDED_FIELDS, *structured_spec.NEUTRAL_EXTRAS)
PROMPT_FIELDS = ("prompt", "messages")
# vLLM's disable_additional_properties (also accepted inside structured_outputs): the
# JSON schemas' objects take no keys they do not list (jpaged.structured.schemas).
SCHEMA_FIELDS = ("disable_additional_properties",)
# A batch line's fields (BatchRequest's).  "model": the base model's name (or
# absent), or a LoRA adapter's, which the request runs (as vLLM).
REQUEST_FIELDS = PROMPT_FIELDS + SAMPLING_FIELDS + STRUCTURED_FIELDS + SCHEMA_FIELDS + ("model",)

# Each unsupported field with the values that leave the answer as jpaged
# computes it; any other value is refused.  Fields no list here names stay
# ignored (with a warning in the batch CLI).  `best_of` (accepted only equal to
# n) is checked beside these (unsupported_field).
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    # sampling: penalties, biases, filters
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "min_p": (None, 0),
    "min_tokens": (None, 0),
    "logit_bias": (None, {}),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "logits_processors": (None, []),
    "thinking_token_budget": (None,),
    "repetition_detection": (None,),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1),
    # tool calling (the HTTP chat route implements tools and tool_choice)
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),       # with no tools, nothing to call
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    # the prompt
    "suffix": (None, ""),
    "truncate_prompt_tokens": (None,),
    "prompt_embeds": (None,),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "documents": (None, []),
    "reasoning_effort": (None,),
    # the answer's text and logprobs
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "detokenize": (None, True),
    "logprob_token_ids": (None,),
    "prompt_logprob_token_ids": (None,),
    "return_tokens_as_token_ids": (None, False),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "web_search_options": (None,),
}

# Where a request is always a chat (a batch line's "prompt" is a user message),
# special tokens around the rendered chat come from its template alone (as vLLM's
# chat default): add_special_tokens: true would add BOS and the like.
CHAT_ONLY_FIELDS: dict[str, tuple[Any, ...]] = {"add_special_tokens": (None, False)}

# The roles a chat message may have (OpenAI's; "function" is its deprecated
# form of "tool", whose calls jpaged cannot make).  Another role would reach the
# chat template as written: a role "user<|im_end|>" would forge a turn.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def unsupported_field(obj: dict[str, Any], default_n: int = 1,
                      extra: dict[str, tuple[Any, ...]] | None = None) -> tuple[str, str] | None:
    """(field, message) of the first field of `obj` that asks for what jpaged
    does not implement (UNSUPPORTED_FIELDS, and `extra` for a route's own), or
    None.  A neutral value passes only with its own JSON type (false is not 0);
    `best_of` passes only equal to n (`obj`'s, or `default_n`)."""
    table = {**UNSUPPORTED_FIELDS, **(extra or {})}
    for name, value in obj.items():
        if name == "best_of":
            n = obj.get("n")
            n = default_n if n is None else n
            if value is not None and not (_is_number(value) and _is_number(n) and value == n):
                return name, (f"best_of is not supported yet (only best_of == n, here {short(n)}), "
                              f"got {json_type(value)}")
        elif name in table and not any(_same_json(value, v) for v in table[name]):
            accepted = ["null" if v is None else json.dumps(v) for v in table[name]]
            accepted = " or ".join(filter(None, [", ".join(accepted[:-1]), accepted[-1]]))
            return name, f"{name} is not supported yet (got {json_type(value)}; jpaged accepts only {accepted})"
    return None


def role_problem(role: Any) -> str | None:
    """What is wrong with a chat message's role ("must be one of ..."), or None."""
    if isinstance(role, str) and role in CHAT_ROLES:
        return None
    return f"must be one of {', '.join(map(repr, CHAT_ROLES))}, got {json_type(role)}"


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _same_json(value: Any, neutral: Any) -> bool:
    """`value == neutral` as JSON values: 0 and 0.0 alike, but true is not 1."""
    if _is_number(neutral):
        return _is_number(value) and value == neutral
    if type(value) is not type(neutral):
        return False
    try:
        return bool(value == neutral)
    except Exception:  # noqa: BLE001 - an exotic object from a Python caller
        return False
