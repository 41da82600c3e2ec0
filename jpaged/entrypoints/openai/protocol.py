"""Request bodies in, checked requests (GenerationRequest) out: each HTTP
route's and each line of the batch CLI's prompts file.

Each body is a pydantic model (CompletionRequest, ChatCompletionRequest,
GenerateRequest, BatchRequest), strict: a field of the wrong JSON type is an
error naming it (`param`), never coerced; fields not listed are ignored (clients
send `user`, `metadata` and the like), except the OpenAI and vLLM fields jpaged
does not implement (request_fields.UNSUPPORTED_FIELDS), which would change the
answer: an error naming the field rather than an answer that silently ignores it.

The models check the types and shape of a body; the values of the sampling
fields are checked by SamplingParams.validate (sampling_fields).  Checked here:
the model name (the base model's, or a LoRA adapter's: the request runs that
adapter; resolve_adapter), prompt forms, stop strings, stream / echo /
stream_options, and the logprobs fields (whose meaning differs between the
routes).  Chat messages: jpaged.entrypoints.openai.messages.  Host code: no jax.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Collection, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator, model_validator

from jpaged.core.sequence import MAX_LOGPROBS, SamplingParams
from jpaged.entrypoints.openai.errors import Invalid, RequestError, json_type, model_not_found, parsed, request_error
from jpaged.entrypoints.openai.messages import Messages
from jpaged.entrypoints.openai.request_fields import CHAT_ONLY_FIELDS, UNSUPPORTED_FIELDS  # noqa: F401 (the routes' list)
from jpaged.entrypoints.openai.sampling_fields import SamplingFields
from jpaged.structured import schemas
from jpaged.structured import tools as structured_tools

@dataclasses.dataclass
class GenerationRequest:
    """A checked request: prompts as LLM.tokenize takes them, and how to answer."""

    prompts: list[Any]          # raw strings, token-id lists, or {"messages": [...]} (chat)
    params: SamplingParams      # params.stop: the request's stop strings
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


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: Optional[bool] = None


# ---------------------------------------------------------------- requests
_PROMPT_FORMS = "a non-empty string, a non-empty list of token ids, or a list of those"


class _OpenAIRequest(SamplingFields):
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
        prompt = parsed(handler, value, f"prompt must be {_PROMPT_FORMS}; got")
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
        return GenerationRequest(prompts=self.prompts, params=params,
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
        return GenerationRequest(prompts=[prompt], params=params, stream=bool(self.stream),
                                 include_usage=self.include_usage, model=model,
                                 declared_tools=(structured_tools.declared_tools(functions, self.tool_choice)
                                                 if functions is not None and self.tool_choice != "none" else None),
                                 constraint_field="tool_choice" if constraint is not None else self.constraint_field)


class _PromptOrMessages(SamplingFields):
    """A body of exactly one of `prompt` or `messages`, with `logprobs` and
    `prompt_logprobs` as counts: /generate's and a batch line's."""

    messages: Messages = None  # type: ignore[assignment]
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None

    @model_validator(mode="before")
    @classmethod
    def _one_prompt(cls, body: Any) -> Any:
        if isinstance(body, dict) and ("prompt" in body) == ("messages" in body):
            raise Invalid('a request needs exactly one of "prompt" or "messages"', "prompt")
        return body

    def _params(self, default: SamplingParams) -> SamplingParams:
        return self.sampling_params(default, logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs)

    def _messages(self) -> dict[str, Any]:
        return {"messages": [m.as_dict() for m in self.messages]}


class GenerateRequest(_PromptOrMessages):
    """POST /generate: {"prompt": text or token ids} or {"messages": [...]}, plus
    the sampling fields, `stop`, and `logprobs` / `prompt_logprobs` as counts (as
    in the batch CLI's request lines); no streaming, any `model`."""

    prompt: Union[str, list[int]] = None  # type: ignore[assignment]  # exactly one of the two
    stream: Optional[bool] = None

    @classmethod
    def _route_unsupported(cls, body: dict[str, Any]) -> dict[str, tuple[Any, ...]]:
        if "messages" in body:
            return CHAT_ONLY_FIELDS
        # A text prompt is encoded with the special tokens the model adds; token ids as given.
        return {"add_special_tokens": (None, True)} if isinstance(body.get("prompt"), str) else {}

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt(cls, value: Any, handler: Callable[[Any], Any]) -> Any:
        prompt = parsed(handler, value, "prompt must be a non-empty string or a non-empty list of token ids; got")
        if not prompt:
            raise Invalid("prompt must not be empty")
        return prompt

    @field_validator("stream")
    @classmethod
    def _stream(cls, stream: bool | None) -> bool | None:
        if stream:
            raise Invalid("stream is not supported by /generate; use /v1/completions with stream: true")
        return stream

    def generation(self, default: SamplingParams, model: str) -> GenerationRequest:
        prompt = self.prompt if self.messages is None else self._messages()
        params = self._params(default)
        return GenerationRequest(prompts=[prompt], params=params, model=model,
                                 constraint_field=self.constraint_field)


class BatchRequest(_PromptOrMessages):
    """A line of `jpaged batch`'s prompts file: {"prompt": a user message} or
    {"messages": [...]} (either rendered with the chat template), the fields of
    /generate, and `model`: the base model's name (or absent) or a LoRA adapter's."""

    prompt: str = None  # type: ignore[assignment]  # exactly one of the two
    model: Optional[str] = None

    @classmethod
    def _route_unsupported(cls, body: dict[str, Any]) -> dict[str, tuple[Any, ...]]:
        return CHAT_ONLY_FIELDS  # always a chat

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt(cls, value: Any, handler: Callable[[Any], Any]) -> Any:
        prompt = parsed(handler, value, "prompt must be a non-empty string, got")
        if not prompt:
            raise Invalid(f"prompt must be a non-empty string, got {json_type(prompt)}")
        return prompt

    def generation(self, default: SamplingParams, model: str) -> GenerationRequest:
        prompt = {"prompt": self.prompt} if self.messages is None else self._messages()
        params = self._params(default)
        return GenerationRequest(prompts=[prompt], params=params, model=model,
                                 constraint_field=self.constraint_field)


def _is_token_ids(prompt: list[Any]) -> bool:
    return all(type(t) is int for t in prompt)


# ------------------------------------------------------------------ parsing
def parse_request(request_type: type[CompletionRequest | ChatCompletionRequest | GenerateRequest | BatchRequest],
                  body: Any, default: SamplingParams, model: str | None,
                  adapters: Collection[str] = ()) -> GenerationRequest:
    """A decoded JSON body (an HTTP route's, or a batch line) checked against
    `request_type`; RequestError (the server's 400) if it fails.  `model` is the
    base model's served name, `adapters` the LoRA adapters' names (resolve_adapter)."""
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object, got {json_type(body)}")
    try:
        request = request_type.model_validate(body)
    except ValidationError as e:
        raise request_error(e) from None
    # (/generate has no "model": it takes any model, and runs the base)
    lora = resolve_adapter(getattr(request, "model", None), model, adapters)
    gen = request.generation(default, model or "")
    if lora is not None:
        gen.params, gen.model = dataclasses.replace(gen.params, lora=lora), lora
    return gen


def resolve_adapter(name: str | None, model: str | None, adapters: Collection[str]) -> str | None:
    """The LoRA adapter a body's "model" names: None for the base model (absent,
    null, or `model`); a name neither the base's nor one of `adapters` is
    RequestError model_not_found (the server's 404, a batch line's error)."""
    if name is None or name == model:
        return None
    if name not in adapters:
        raise RequestError(model_not_found(name), "model", code="model_not_found")
    return name


# Each route's parser: parse_request with its body model.
def parse_completion(body: Any, default: SamplingParams, model: str, adapters: Collection[str] = ()) -> GenerationRequest:
    return parse_request(CompletionRequest, body, default, model, adapters)


def parse_chat(body: Any, default: SamplingParams, model: str, adapters: Collection[str] = ()) -> GenerationRequest:
    return parse_request(ChatCompletionRequest, body, default, model, adapters)


def parse_generate(body: Any, default: SamplingParams, model: str, adapters: Collection[str] = ()) -> GenerationRequest:
    return parse_request(GenerateRequest, body, default, model, adapters)
