"""What every route's body reads (SamplingFields, the base of the route models
in jpaged.entrypoints.openai.protocol): the sampling fields, stop strings,
structured outputs, and the refusal of the fields jpaged does not implement
(UNSUPPORTED_FIELDS: a 400 naming the field rather than an answer that silently
ignores it).  The fields' types are checked here, their values by
SamplingParams.validate (sampling_params).  A batch line is one of these bodies
too (protocol.BatchRequest).  Host code: no jax.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Optional, Union

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from jpaged.core.sequence import MAX_STOP_STRINGS, SamplingParams
from jpaged.entrypoints.openai.errors import Invalid, RequestError, parsed
from jpaged.entrypoints.openai.request_fields import (REQUEST_FIELDS, SAMPLING_FIELDS, SCHEMA_FIELDS,
                                                      STRUCTURED_FIELDS, unsupported_field)
from jpaged.structured import schemas
from jpaged.structured import spec as structured_spec

# Sampling fields whose body form depends on the route: /v1/completions takes
# `logprobs` as a count, /v1/chat/completions as a flag beside `top_logprobs`;
# prompt logprobs come back only through /v1/completions' echo, and /generate.
ROUTE_FIELDS = ("logprobs", "prompt_logprobs")


class SamplingFields(BaseModel):
    """What every route reads: the sampling fields (their types; their values
    are SamplingParams.validate's to check), stop strings, and the OpenAI fields
    jpaged refuses.  A null field is the server's default."""

    model_config = ConfigDict(strict=True, extra="ignore")

    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    seed: Optional[int] = None
    stop_token_ids: Optional[list[int]] = None
    n: Optional[int] = None
    cache_salt: Optional[str] = None
    ignore_eos: Optional[bool] = None
    capture_routes: Optional[bool] = None  # a MoE model's routed experts in each choice (SamplingParams')
    stop: Union[str, list[str], None] = None
    # Structured outputs (request_fields.STRUCTURED_FIELDS): any JSON here; their
    # shapes are checked where they become SamplingParams.structured.
    structured_outputs: Any = None
    response_format: Any = None
    guided_decoding: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    # vLLM's: objects of the JSON schemas (and tool parameters) that do not say otherwise
    # take no keys beyond theirs (jpaged.structured.schemas.close_objects).
    disable_additional_properties: Optional[bool] = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, body: Any) -> Any:
        """UNSUPPORTED_FIELDS (and best_of != n, and the route's own) other than
        their neutral values: a 400 naming the field, code "unsupported"."""
        if isinstance(body, dict):
            checked = {k: v for k, v in body.items() if k not in cls._route_implements()}
            refused = unsupported_field(checked, 1, cls._route_unsupported(body))
            if refused is not None:
                raise Invalid(refused[1], param=refused[0], code="unsupported")
        return body

    @classmethod
    def _route_unsupported(cls, body: dict[str, Any]) -> dict[str, tuple[Any, ...]]:
        """This route's unsupported fields beside UNSUPPORTED_FIELDS."""
        return {}

    @classmethod
    def _route_implements(cls) -> tuple[str, ...]:
        """Fields of UNSUPPORTED_FIELDS this route implements (the chat route's tools)."""
        return ()

    @field_validator("stop", mode="wrap")
    @classmethod
    def _stop(cls, value: Any, handler: Callable[[Any], Any]) -> Any:
        stop = parsed(handler, value, "stop must be a string or a list of strings, got")
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise Invalid(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        return stop

    @property
    def constraint_field(self) -> str | None:
        """The structured-output field this body sets (the first, if several)."""
        return next((k for k in STRUCTURED_FIELDS if getattr(self, k) not in (None, {"type": "text"})), None)

    @property
    def stop_strings(self) -> tuple[str, ...] | None:
        """The request's stop strings, empty ones dropped; None: not given."""
        if self.stop is None:
            return None
        return tuple(s for s in ([self.stop] if isinstance(self.stop, str) else self.stop) if s)

    def sampling_params(self, default: SamplingParams, aliases: dict[str, str] | None = None,
                        **route_fields: Any) -> SamplingParams:
        """The body's sampling fields and stop strings over `default`; the route
        gives the ROUTE_FIELDS it read in its own way.  A value SamplingParams
        refuses is a 400 naming its field (or its alias in this body)."""
        fields = {k: getattr(self, k) for k in _COMMON_SAMPLING_FIELDS + STRUCTURED_FIELDS + SCHEMA_FIELDS}
        fields.update(route_fields)
        fields = {k: v for k, v in fields.items() if v is not None}
        stops = self.stop_strings
        base = default if stops is None else dataclasses.replace(default, stop=stops)
        try:
            return _sampling_params(fields, base)
        except ValueError as e:
            message, param = str(e), _field_named(str(e))
            if param in (aliases or {}):  # named as this body names it
                message, param = aliases[param] + message[len(param):], aliases[param]
            # (guided_decoding_backend "xgrammar" and the like: refused as UNSUPPORTED_FIELDS are)
            code = "unsupported" if param and message.startswith(f"{param} is not supported") else None
            raise RequestError(message, param, code=code) from None


# The sampling fields the route models all read alike.
_COMMON_SAMPLING_FIELDS = tuple(k for k in SAMPLING_FIELDS if k not in ROUTE_FIELDS and k != "stop")
_PARAMS_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) | frozenset(REQUEST_FIELDS)


def _field_named(message: str) -> str | None:
    """The field a SamplingParams.validate message starts with ("top_p must be ...")."""
    m = re.match(r"[a-z_]+", message)
    return m.group(0) if m and m.group(0) in _PARAMS_FIELDS else None


def _sampling_params(fields: dict[str, Any], default: SamplingParams) -> SamplingParams:
    """`fields` (the sampling and structured fields, by name) over `default`;
    ValueError whose message starts with the bad field's name."""
    overrides = {k: fields[k] for k in SAMPLING_FIELDS if k in fields}
    structured = _structured(fields)
    if structured is not None:
        overrides["structured"] = structured
    if isinstance(overrides.get("stop_token_ids"), list):
        overrides["stop_token_ids"] = tuple(overrides["stop_token_ids"])
    params = dataclasses.replace(default, **overrides)
    params.validate()
    return params


def _structured(fields: dict[str, Any]) -> structured_spec.StructuredOutputs | None:
    """The request's constraint, its JSON schema's objects closed with disable_additional_properties."""
    inner, closed = schemas.split_flag(fields.get("structured_outputs"), fields.get("disable_additional_properties"))
    structured = structured_spec.from_request({**fields, "structured_outputs": inner})
    return schemas.closed_constraint(structured) if closed else structured
