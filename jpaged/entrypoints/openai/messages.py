"""The chat messages of a request body (/v1/chat/completions, /generate,
/tokenize, a batch line): strict pydantic models whose failures name the message and field
("messages[2].tool_call_id is required").  Roles are OpenAI's
(request_fields.CHAT_ROLES): never a string the template would write as
markup.  Host code: no jax.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Callable, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, \
    field_validator, model_validator
from pydantic_core import PydanticCustomError

from jpaged.entrypoints.openai.errors import Invalid, json_type
from jpaged.entrypoints.openai.request_fields import role_problem


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
            raise Invalid(f"must be a JSON object as text (OpenAI's form), got {json_type(arguments)}")
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
            raise Invalid(f"must be a string or a list of text parts, got {json_type(value)}") from None

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
