"""OpenAI-style request bodies in, checked requests out; response bodies back.

Each route's body is a pydantic model (CompletionRequest, ChatCompletionRequest,
GenerateRequest), strict: a field of the wrong JSON type is a 400 naming it
(`param`), never coerced; fields not listed are ignored (clients send `user`,
`metadata` and the like), except the OpenAI and vLLM fields jpaged does not
implement (request_parsing.UNSUPPORTED_FIELDS, shared with the batch CLI), which
would change the answer: a 400 naming the field rather than an answer that
silently ignores it.  Chat roles are OpenAI's (request_parsing.CHAT_ROLES).

The models check the types and shape of a body; the values of the sampling
fields are checked by SamplingParams.validate through jpaged.core.request_parsing
(the same checks as the batch CLI's request lines).  What only the HTTP API has
is checked here: the model name (the base model's, or a LoRA adapter's: the
request runs that adapter), prompt forms, stop strings, stream / echo /
stream_options, and the logprobs fields (whose meaning differs between the
routes).  Host code: no jax.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from typing import Annotated, Any, Callable, Collection, Literal, Optional, Sequence, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo,
                      field_validator, model_validator)
from pydantic_core import PydanticCustomError

from jpaged.core.request_parsing import (CHAT_ONLY_FIELDS, REQUEST_FIELDS, SAMPLING_FIELDS,  # noqa: F401
                                         SCHEMA_FIELDS, STRUCTURED_FIELDS, UNSUPPORTED_FIELDS, parse_sampling_params,
                                         role_problem, unsupported_field)
from jpaged.core.sequence import MAX_LOGPROBS, MAX_STOP_STRINGS, SamplingParams, TokenLogprob
from jpaged.structured import schemas
from jpaged.structured import tools as structured_tools

LOGPROB_FLOOR = -9999.0  # what -inf (a token of probability 0) becomes: JSON has no infinities (as vLLM)

# Sampling fields whose body form depends on the route: /v1/completions takes
# `logprobs` as a count, /v1/chat/completions as a flag beside `top_logprobs`;
# prompt logprobs come back only through /v1/completions' echo, and /generate.
ROUTE_FIELDS = ("logprobs", "prompt_logprobs")

# Request fields that would change the answer and that jpaged does not
# implement, with their neutral values: UNSUPPORTED_FIELDS, imported from
# jpaged.core.request_parsing (one list for the server and the batch CLI); a
# route adds its own (_Request._route_unsupported).


class RequestError(Exception):
    """A request the server refuses: an OpenAI-style error body and a status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = message, param, status, code, kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def model_not_found(name: str) -> str:
    """The message of a 404 for a model (or LoRA adapter) this server does not serve: OpenAI's and vLLM's."""
    return f"The model `{name}` does not exist."


@dataclasses.dataclass
class GenerationRequest:
    """A checked request: prompts as LLM.tokenize takes them, and how to answer."""

    prompts: list[Any]          # raw strings, token-id lists, or {"messages": [...]} (chat)
    params: SamplingParams      # params.stop: the request's stop strings
    stop: list[str]             # the same, as a list
    stream: bool = False
    echo: bool = False
    include_usage: bool = False
    model: str = ""
    # Chat with tools (tool_choice other than "none"): answers are parsed for calls of these.
    declared_tools: structured_tools.DeclaredTools | None = None
    # The body field that constrains the output (response_format, tool_choice, ...), if any.
    constraint_field: str | None = None

    @property
    def parse_tool_calls(self) -> bool:
        return self.declared_tools is not None


# ------------------------------------------------------- validation errors
class Invalid(ValueError):
    """A check of ours failing inside model validation.  Pydantic carries it in
    the ValidationError (ctx["error"]); request_error takes back its message and,
    where the error's location does not say it (a check of several fields), its
    param and code."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def request_error(e: ValidationError) -> RequestError:
    """The 400 of a body that failed validation: its first error, naming the
    top-level field (`param`) and where inside it ("messages[0].content")."""
    err = e.errors(include_url=False)[0]
    loc = err["loc"]
    path = _path(loc)
    param = str(loc[0]) if loc else None
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, Invalid):
        message = str(cause)
        if path and not message.startswith(path):
            message = f"{path}: {message}"
        return RequestError(message, cause.param or param, code=cause.code)
    if isinstance(cause, Exception):  # a plain ValueError / AssertionError of a validator
        message = f"{path}: {cause}" if path else str(cause)
    elif err["type"] == "missing":
        message = f"{path} is required"
    elif err["type"] in ("model_type", "model_attributes_type", "dict_type"):
        message = f"{path or 'the body'} must be a JSON object, got {_json_type(err['input'])}"
    else:
        message = f"{path}: {err['msg']}, got {_json_type(err['input'])}"
    return RequestError(message, param)


def _path(loc: tuple[Any, ...]) -> str:
    """("messages", 0, "content") -> "messages[0].content"."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _parsed(handler: Callable[[Any], Any], value: Any, refusal: str) -> Any:
    """pydantic's parse of `value`, or Invalid("<refusal> <its JSON type>")."""
    try:
        return handler(value)
    except ValidationError:
        raise Invalid(f"{refusal} {_json_type(value)}") from None


def _json_type(x: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    kind = names.get(type(x), type(x).__name__)
    if kind in ("an object", "an array", "null"):
        return kind
    try:
        text = json.dumps(x, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(x)
    return f"{kind} {text if len(text) <= 80 else text[:80] + '...'}"


# ---------------------------------------------------------------- messages
class TextPart(BaseModel):
    """A part of a message's content; only text parts are supported."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    arguments: str  # the arguments object as JSON text (OpenAI's form)

    @field_validator("arguments")
    @classmethod
    def _arguments(cls, arguments: str) -> str:
        try:
            value = json.loads(arguments)
        except (ValueError, RecursionError):
            value = None
        if not isinstance(value, dict):
            raise Invalid(f"must be a JSON object as text (OpenAI's form), got {_json_type(arguments)}")
        return arguments


class ToolCallPart(BaseModel):
    """An earlier assistant turn's tool call (OpenAI's `tool_calls` entries)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """A chat message: `content` a string or a list of text parts (joined), or
    null or absent for an assistant turn that made `tool_calls` (each one's
    `arguments` a JSON object as text); a `tool` message answers the call
    `tool_call_id` (required).  Other fields (`name`...) go to the chat template
    as they came."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    tool_calls: Optional[list[ToolCallPart]] = None  # (before content: its check reads them)
    content: Union[str, list[TextPart], None]
    tool_call_id: Optional[str] = Field(None, validate_default=True)

    @model_validator(mode="before")
    @classmethod
    def _content_may_be_absent_beside_tool_calls(cls, message: Any) -> Any:
        """OpenAI: an assistant message that made tool calls needs no content."""
        if (isinstance(message, dict) and "content" not in message and message.get("role") == "assistant"
                and message.get("tool_calls")):
            return {**message, "content": None}
        return message

    @field_validator("role")
    @classmethod
    def _role(cls, role: str) -> str:
        problem = role_problem(role)  # an OpenAI role: never a string the template would write as markup
        if problem:
            raise Invalid(problem)
        return role

    @field_validator("content", mode="wrap")
    @classmethod
    def _content(cls, value: Any, handler: Callable[[Any], Any], info: ValidationInfo) -> Any:
        if value is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise Invalid("must be a string or a list of text parts (null only beside an assistant "
                          "message's tool_calls), got null")
        try:
            return handler(value)
        except ValidationError:
            if isinstance(value, list):
                raise Invalid("only text parts are supported "
                              '([{"type": "text", "text": ...}, ...])') from None
            raise Invalid(f"must be a string or a list of text parts, got {_json_type(value)}") from None

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id(cls, call_id: str | None, info: ValidationInfo) -> str | None:
        if call_id is None and info.data.get("role") == "tool":  # "messages[2].tool_call_id is required"
            raise PydanticCustomError("missing", "Field required")  # the id of the call it answers
        return call_id

    @model_validator(mode="after")
    def _calls_are_the_assistants(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise Invalid(f"tool_calls belong to assistant messages, not {self.role!r} ones", param="messages")
        return self

    def as_dict(self) -> dict[str, Any]:
        """The message as the chat template takes it: content one string (or None
        beside tool_calls), unset tool fields left out."""
        content = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        return {**self.model_dump(exclude_none=True, exclude={"content"}), "content": content}


def _non_empty_messages(messages: list[ChatMessage]) -> list[ChatMessage]:
    if not messages:
        raise Invalid("messages must be a non-empty list")
    return messages


Messages = Annotated[list[ChatMessage], AfterValidator(_non_empty_messages)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: Optional[bool] = None


# ---------------------------------------------------------------- requests
_PROMPT_FORMS = "a non-empty string, a non-empty list of token ids, or a list of those"


class _Request(BaseModel):
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
    stop: Union[str, list[str], None] = None
    # Structured outputs (request_parsing.STRUCTURED_FIELDS): any JSON here; their
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
        stop = _parsed(handler, value, "stop must be a string or a list of strings, got")
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
            return parse_sampling_params(fields, base)
        except ValueError as e:
            message, param = str(e), _field_named(str(e))
            if param in (aliases or {}):  # named as this body names it
                message, param = aliases[param] + message[len(param):], aliases[param]
            # (guided_decoding_backend "xgrammar" and the like: refused as UNSUPPORTED_FIELDS are)
            code = "unsupported" if param and message.startswith(f"{param} is not supported") else None
            raise RequestError(message, param, code=code) from None


# request_parsing's sampling fields the route models all read alike.
_COMMON_SAMPLING_FIELDS = tuple(k for k in SAMPLING_FIELDS if k not in ROUTE_FIELDS and k != "stop")
_PARAMS_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) | frozenset(REQUEST_FIELDS)


def _field_named(message: str) -> str | None:
    """The field a SamplingParams.validate message starts with ("top_p must be ...")."""
    m = re.match(r"[a-z_]+", message)
    return m.group(0) if m and m.group(0) in _PARAMS_FIELDS else None


class _OpenAIRequest(_Request):
    """The fields the two OpenAI routes share: the model's name and streaming."""

    model: Optional[str] = None         # omitted: the base model; else its name or a LoRA adapter's
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    prompt_logprobs: Any = None         # not an OpenAI field; refused here (see the message)

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise Invalid("stream_options is only allowed with stream: true")
        return options

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs(cls, value: Any) -> Any:
        if value is not None:
            raise Invalid("prompt_logprobs is not supported here; /v1/completions returns the prompt's "
                          "logprobs with echo: true and logprobs, /generate with prompt_logprobs",
                          code="unsupported")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options is not None and self.stream_options.include_usage)


class CompletionRequest(_OpenAIRequest):
    """POST /v1/completions: `prompt` is a string, a token-id list, or a list of
    either; `logprobs`: how many alternatives per token (with `echo`, the
    prompt's tokens get them too)."""

    prompt: Union[str, list[int], list[Union[str, list[int]]]]
    echo: Optional[bool] = None
    logprobs: Optional[int] = None

    @classmethod
    def _route_unsupported(cls, body: dict[str, Any]) -> dict[str, tuple[Any, ...]]:
        # A text prompt is encoded with the special tokens the model adds (BOS).
        return {"add_special_tokens": (None, True)}

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt(cls, value: Any, handler: Callable[[Any], Any]) -> Any:
        prompt = _parsed(handler, value, f"prompt must be {_PROMPT_FORMS}; got")
        if not prompt:
            raise Invalid("prompt must not be empty")
        if isinstance(prompt, list) and not _is_token_ids(prompt):
            for i, p in enumerate(prompt):
                if not p:
                    raise Invalid(f"prompt[{i}] must not be empty")
        return prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        one = isinstance(self.prompt, str) or _is_token_ids(self.prompt)
        return [self.prompt] if one else list(self.prompt)

    def generation(self, default: SamplingParams, model: str) -> GenerationRequest:
        echo = bool(self.echo)
        params = self.sampling_params(default, logprobs=self.logprobs,
                                      prompt_logprobs=self.logprobs if echo else None)
        return GenerationRequest(prompts=self.prompts, params=params, stop=list(params.stop),
                                 stream=bool(self.stream), echo=echo, include_usage=self.include_usage,
                                 model=model, constraint_field=self.constraint_field)


class ChatCompletionRequest(_OpenAIRequest):
    """POST /v1/chat/completions: `messages`, rendered with the model's chat
    template; `logprobs: true` with `top_logprobs` alternatives per token."""

    messages: Messages
    max_completion_tokens: Optional[int] = None   # the newer name of max_tokens (wins over it)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Any = None          # OpenAI function tools (jpaged.structured.tools.validate_tools)
    tool_choice: Any = None    # "none" | "auto" (the default with tools) | "required" | a named function
    parallel_tool_calls: Optional[bool] = None  # false: "required" makes exactly one call

    @classmethod
    def _route_unsupported(cls, body: dict[str, Any]) -> dict[str, tuple[Any, ...]]:
        # vLLM's chat `echo` (the last message leads the answer) is not /v1/completions' echo.
        return {**CHAT_ONLY_FIELDS, "echo": (None, False)}

    @classmethod
    def _route_implements(cls) -> tuple[str, ...]:
        return ("tools", "tool_choice")

    def _tool_constraint(self) -> tuple[list[dict[str, Any]] | None, Any]:
        """(the tools as function dicts or None, the constraint tool_choice puts on the answer)."""
        if self.tools is None or self.tools == []:
            if self.tool_choice not in (None, "none", "auto"):
                raise RequestError("tool_choice needs tools", "tool_choice")
            return None, None
        try:
            functions = structured_tools.validate_tools(self.tools, self._closes_objects())
        except ValueError as e:
            raise RequestError(str(e), "tools") from None
        try:
            return functions, structured_tools.tool_choice_constraint(functions, self.tool_choice,
                                                                      self.parallel_tool_calls is not False)
        except ValueError as e:
            raise RequestError(str(e), "tool_choice") from None

    def _closes_objects(self) -> bool:
        """disable_additional_properties, at the top level or in structured_outputs."""
        try:
            return schemas.split_flag(self.structured_outputs, self.disable_additional_properties)[1]
        except ValueError as e:
            raise RequestError(str(e), "structured_outputs") from None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise Invalid(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {top!r}")
        if top is not None and not info.data.get("logprobs"):
            raise Invalid("top_logprobs needs logprobs: true")
        return top

    def generation(self, default: SamplingParams, model: str) -> GenerationRequest:
        renamed = self.max_completion_tokens is not None
        req = self.model_copy(update={"max_tokens": self.max_completion_tokens}) if renamed else self
        aliases = {"max_tokens": "max_completion_tokens"} if renamed else None
        params = req.sampling_params(default, aliases, logprobs=(self.top_logprobs or 0) if self.logprobs else None)
        functions, constraint = self._tool_constraint()
        if constraint is not None:
            if params.structured is not None:
                raise RequestError(f"tool_choice {json.dumps(self.tool_choice)} and a structured-output field both "
                                   "constrain the answer: give one", "tool_choice")
            params = dataclasses.replace(params, structured=constraint)
        prompt: dict[str, Any] = {"messages": [m.as_dict() for m in self.messages]}
        if functions is not None:
            prompt["tools"] = self.tools
        return GenerationRequest(prompts=[prompt], params=params, stop=list(params.stop), stream=bool(self.stream),
                                 include_usage=self.include_usage, model=model,
                                 declared_tools=(structured_tools.declared_tools(functions, self.tool_choice)
                                                 if functions is not None and self.tool_choice != "none" else None),
                                 constraint_field="tool_choice" if constraint is not None else self.constraint_field)


class GenerateRequest(_Request):
    """POST /generate: {"prompt": text or token ids} or {"messages": [...]}, plus
    the sampling fields, `stop`, and `logprobs` / `prompt_logprobs` as counts (as
    in the batch CLI's request lines); no streaming, any `model`."""

    prompt: Union[str, list[int]] = None  # type: ignore[assignment]  # exactly one of the two
    messages: Messages = None  # type: ignore[assignment]
    stream: Optional[bool] = None
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None

    @classmethod
    def _route_unsupported(cls, body: dict[str, Any]) -> dict[str, tuple[Any, ...]]:
        if "messages" in body:
            return CHAT_ONLY_FIELDS
        # A text prompt is encoded with the special tokens the model adds; token ids as given.
        return {"add_special_tokens": (None, True)} if isinstance(body.get("prompt"), str) else {}

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt(cls, value: Any, handler: Callable[[Any], Any]) -> Any:
        prompt = _parsed(handler, value, "prompt must be a non-empty string or a non-empty list of token ids; got")
        if not prompt:
            raise Invalid("prompt must not be empty")
        return prompt

    @field_validator("stream")
    @classmethod
    def _stream(cls, stream: bool | None) -> bool | None:
        if stream:
            raise Invalid("stream is not supported by /generate; use /v1/completions with stream: true")
        return stream

    @model_validator(mode="after")
    def _one_prompt(self) -> "GenerateRequest":
        if ("prompt" in self.model_fields_set) == ("messages" in self.model_fields_set):
            raise Invalid('a request needs exactly one of "prompt" or "messages"', "prompt")
        return self

    def generation(self, default: SamplingParams, model: str) -> GenerationRequest:
        prompt = self.prompt if self.messages is None else {"messages": [m.as_dict() for m in self.messages]}
        params = self.sampling_params(default, logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs)
        return GenerationRequest(prompts=[prompt], params=params, stop=list(params.stop), model=model,
                                 constraint_field=self.constraint_field)


def _is_token_ids(prompt: list[Any]) -> bool:
    return all(type(t) is int for t in prompt)


# ------------------------------------------------------------------ parsing
def parse_request(request_type: type[CompletionRequest | ChatCompletionRequest | GenerateRequest], body: Any,
                  default: SamplingParams, model: str, adapters: Collection[str] = ()) -> GenerationRequest:
    """A decoded JSON body checked against `request_type`; RequestError (400) if it fails.
    `model` is the base model's served name, `adapters` the LoRA adapters' names: a
    body's "model" naming an adapter runs it (SamplingParams.lora, and the answer
    names it); any other name than these is a 404 model_not_found."""
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object, got {_json_type(body)}")
    try:
        request = request_type.model_validate(body)
    except ValidationError as e:
        raise request_error(e) from None
    name = getattr(request, "model", None)  # (/generate has none: it takes any model, and runs the base)
    if name is not None and name != model and name not in adapters:
        raise RequestError(model_not_found(name), "model", code="model_not_found")  # (the server's 404)
    gen = request.generation(default, model)
    if name is not None and name != model:
        gen.params, gen.model = dataclasses.replace(gen.params, lora=name), name
    return gen


def parse_completion(body: Any, default: SamplingParams, model: str,
                     adapters: Collection[str] = ()) -> GenerationRequest:
    """POST /v1/completions (CompletionRequest)."""
    return parse_request(CompletionRequest, body, default, model, adapters)


def parse_chat(body: Any, default: SamplingParams, model: str, adapters: Collection[str] = ()) -> GenerationRequest:
    """POST /v1/chat/completions (ChatCompletionRequest)."""
    return parse_request(ChatCompletionRequest, body, default, model, adapters)


def parse_generate(body: Any, default: SamplingParams, model: str,
                   adapters: Collection[str] = ()) -> GenerationRequest:
    """POST /generate (GenerateRequest)."""
    return parse_request(GenerateRequest, body, default, model, adapters)


# ---------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(request_id: str, obj: str, model: str, choices: list[dict[str, Any]],
             usage_counts: dict[str, int] | None = None, *, with_usage: bool = True) -> dict[str, Any]:
    body = {"id": request_id, "object": obj, "created": int(time.time()), "model": model, "choices": choices}
    if with_usage:
        body["usage"] = usage_counts
    return body


def completion_choice(index: int, text: str, finish_reason: str | None,
                      logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None,
                tools: structured_tools.DeclaredTools | None = None) -> dict[str, Any]:
    """A chat choice; with the request's `tools`, the text's `<tool_call>` blocks
    calling them become `message.tool_calls` (finish_reason "tool_calls" for a sample
    that stopped after whole calls; a call cut short keeps "length")."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tools is not None:
        content, calls = structured_tools.parse_tool_calls(text, tools)
        if calls:
            message = {"role": "assistant", "content": content, "tool_calls": [c.to_openai() for c in calls]}
            finish_reason = tool_calls_finish_reason(finish_reason, calls)
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def tool_calls_finish_reason(finish_reason: str | None, calls: Sequence[structured_tools.ToolCall]) -> str | None:
    """OpenAI's "tool_calls" for a sample that stopped after whole calls; else the sample's own reason."""
    if finish_reason == "stop" and calls and all(c.complete for c in calls):
        return "tool_calls"
    return finish_reason


def chat_chunk_choice(index: int, delta: dict[str, Any], finish_reason: str | None,
                      logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


# Token strings: each token id decoded alone (as vLLM does), special tokens included.
TokenText = Callable[[int], str]


def finite_logprob(value: float) -> float:
    return value if value > LOGPROB_FLOOR else LOGPROB_FLOOR  # (NaN > x is false: the floor too)


def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None],
                        token_text: TokenText, text_offset: int = 0) -> dict[str, Any]:
    """/v1/completions' `logprobs` of these tokens; a None entry (the first prompt
    token, which nothing predicts) has null logprob and alternatives.  Offsets
    count the token strings from `text_offset` (the length of those before)."""
    tokens, values, tops, offsets = [], [], [], []
    for token_id, lp in zip(token_ids, logprobs):
        text = token_text(token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        values.append(None if lp is None else finite_logprob(lp.logprob))
        tops.append(None if lp is None else _top_by_text(lp, token_text))
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _top_by_text(lp: TokenLogprob, token_text: TokenText) -> dict[str, float]:
    """{token string: logprob}, best first; two ids with one string keep the better."""
    top: dict[str, float] = {}
    for token_id, value in lp.top:
        top.setdefault(token_text(token_id), finite_logprob(value))
    return top


def chat_logprobs(logprobs: Sequence[TokenLogprob], token_text: TokenText) -> dict[str, Any]:
    """/v1/chat/completions' `logprobs` of these tokens."""
    return {"content": [{**_chat_token(lp.token_id, lp.logprob, token_text),
                         "top_logprobs": [_chat_token(i, v, token_text) for i, v in lp.top]}
                        for lp in logprobs]}


def _chat_token(token_id: int, logprob: float, token_text: TokenText) -> dict[str, Any]:
    text = token_text(token_id)
    return {"token": text, "logprob": finite_logprob(logprob), "bytes": list(text.encode("utf-8"))}


def token_logprob_json(lp: TokenLogprob | None) -> dict[str, Any] | None:
    """/generate's form, the batch CLI's: {"token_id", "logprob", "top": [[id, logprob], ...]}."""
    if lp is None:
        return None
    return {"token_id": lp.token_id, "logprob": finite_logprob(lp.logprob),
            "top": [[i, finite_logprob(v)] for i, v in lp.top]}
