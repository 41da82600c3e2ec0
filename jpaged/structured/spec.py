"""What a request asks its output to be: `StructuredOutputs`, and how the
request fields of every entry point map to it (one place for all of them).

Field names follow vLLM's `StructuredOutputsParams` (`json`, `regex`, `choice`,
`grammar`, `json_object`); the OpenAI `response_format` and vLLM's older
`guided_*` extras map onto the same object (`from_request`).  Host code.
"""

from __future__ import annotations

import dataclasses
import json as _json
import re
from typing import Any

from jpaged.structured.json_values import json_type
from jpaged.structured import limits

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# vLLM's pre-0.10 extras, each the StructuredOutputs field it means.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
# Extras that shape how a constraint is enforced rather than what it is: accepted
# only at the values that leave jpaged's enforcement as it is.
NEUTRAL_EXTRAS = {"guided_decoding_backend": (None, "", "auto", "guidance", "llguidance"),
                  "guided_whitespace_pattern": (None,)}


@dataclasses.dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one constraint on a sample's text.

    json         a JSON schema (a dict, or its JSON text; stored as canonical text)
    json_object  True: any JSON object
    regex        a regular expression the whole output matches (Rust regex syntax)
    choice       one of these strings, exactly
    grammar      a Lark grammar as llguidance takes it, or GBNF (llama.cpp's)
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, (dict, bool)):  # as text: hashable (key order kept: it is the order generated)
            try:
                object.__setattr__(self, "json", _json.dumps(self.json, ensure_ascii=False))
            except RecursionError:
                raise ValueError(f"structured_outputs.json nests deeper than Python's JSON encoder writes; "
                                 f"the limit is {limits.LIMITS.schema_depth} (schema_depth)") from None
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        """Which constraint this is (one of KINDS)."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def validate(self) -> None:
        """ValueError naming the field when this is not exactly one well-typed
        constraint within limits.LIMITS (whether it compiles is the grammar
        compiler's check).  Checked once per object (a request's is checked where
        it is parsed, checked and queued; a 256 KiB schema takes tens of ms)."""
        if self.__dict__.get("_checked_against") is limits.LIMITS:
            return
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}, got "
                             f"{', '.join(given) or 'none'}")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            if not isinstance(value, str):
                raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got {json_type(value)}")
            limits.check_schema(value, "structured_outputs.json")  # its size and depth, before it is parsed
            try:
                schema = _json.loads(value)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got {json_type(schema)}")
        elif kind == "json_object":
            if value is not True:
                raise ValueError(f"structured_outputs.json_object must be true, got {json_type(value)}")
        elif kind == "choice":
            if (not isinstance(value, tuple) or not value
                    or not all(isinstance(c, str) and c for c in value)):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings, "
                                 f"got {json_type(value)}")
        elif not isinstance(value, str) or not value:
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string, got {json_type(value)}")
        if kind != "json":  # (checked above)
            limits.check(kind, value, f"structured_outputs.{kind}")
        object.__setattr__(self, "_checked_against", limits.LIMITS)  # (not a field: equality and hash ignore it)

    def source(self) -> str:
        """The constraint as text (the JSON schema's text, the regex, the grammar, ...)."""
        value = getattr(self, self.kind)
        if self.kind == "choice":
            return _json.dumps(list(value), ensure_ascii=False)
        return "" if value is True else value

    def describe(self) -> str:
        """A short human name ("regex '[a-z]+'"), for errors and logs."""
        text = self.source()
        return f"{self.kind} {text[:60]!r}{'...' if len(text) > 60 else ''}" if text else self.kind


def from_dict(obj: Any, where: str = "structured_outputs", leaf: bool = False) -> StructuredOutputs:
    """vLLM's `structured_outputs` request object ({"json": schema} / {"regex": ...} /
    {"choice": [...]} / {"grammar": ...} / {"json_object": true}); ValueError
    naming `where` for anything else (`leaf`: `where` names the value itself,
    as guided_json does, not an object holding it)."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where} must be an object with one of {', '.join(KINDS)}, got {json_type(obj)}")
    unknown = [k for k in obj if k not in KINDS and obj[k] is not None]
    if unknown:
        raise ValueError(f"{where}.{unknown[0]} is not supported (jpaged takes {', '.join(KINDS)})")
    fields = {k: obj[k] for k in KINDS if obj.get(k) is not None}
    if isinstance(fields.get("json"), str):  # the schema's JSON text
        fields["json"] = _canonical_json(fields["json"], where if leaf else f"{where}.json")
    spec = _built(fields, where, leaf)
    _validate(spec, where, leaf)
    return spec


def from_response_format(value: Any, where: str = "response_format") -> StructuredOutputs | None:
    """OpenAI's `response_format`: {"type": "text"} (None), {"type": "json_object"},
    or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ValueError(f'{where} must be an object with a "type", got {json_type(value)}')
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind != "json_schema":
        raise ValueError(f'{where}.type must be "text", "json_object" or "json_schema", got {json_type(kind)}')
    body = value.get("json_schema")
    if not isinstance(body, dict):
        raise ValueError(f"{where}.json_schema must be an object with a schema, got {json_type(body)}")
    schema = body.get("schema", body.get("json_schema"))
    if schema is None:  # OpenAI: no schema means any JSON object
        return StructuredOutputs(json_object=True)
    if not isinstance(schema, dict):
        raise ValueError(f"{where}.json_schema.schema must be an object, got {json_type(schema)}")
    spec = _built({"json": schema}, f"{where}.json_schema.schema", leaf=True)
    _validate(spec, f"{where}.json_schema.schema", leaf=True)
    return spec


def from_request(obj: dict[str, Any]) -> StructuredOutputs | None:
    """The one constraint a request asks for through any of its fields
    (`structured_outputs`, `response_format`, vLLM's `guided_*`), or None;
    ValueError naming the field when a field is malformed, a neutral extra is
    not neutral, or two fields ask for constraints at once."""
    for name, neutral in NEUTRAL_EXTRAS.items():
        if obj.get(name) not in neutral:
            raise ValueError(f"{name} is not supported (got {json_type(obj[name])}; jpaged enforces constraints "
                             f"with llguidance and its own whitespace rules)")
    found: list[tuple[str, StructuredOutputs]] = []
    if obj.get("structured_outputs") is not None:
        found.append(("structured_outputs", from_dict(obj["structured_outputs"])))
    if obj.get("guided_decoding") is not None:  # vLLM's older name of the same object
        found.append(("guided_decoding", from_dict(obj["guided_decoding"], "guided_decoding")))
    spec = from_response_format(obj.get("response_format"))
    if spec is not None:
        found.append(("response_format", spec))
    for name, kind in GUIDED_FIELDS.items():
        if obj.get(name) is not None:
            found.append((name, from_dict({kind: obj[name]}, name, leaf=True)))
    if len(found) > 1:
        raise ValueError(f"{found[0][0]} and {found[1][0]} both constrain the output: give one")
    return found[0][1] if found else None


def _canonical_json(text: str, where: str) -> str:
    limits.check_schema(text, where)  # its size and depth, before it is parsed
    try:
        return _json.dumps(_json.loads(text), ensure_ascii=False)
    except ValueError as e:
        raise ValueError(f"{where} is not valid JSON: {e}") from None


def _built(fields: dict[str, Any], where: str, leaf: bool) -> StructuredOutputs:
    try:
        return StructuredOutputs(**fields)
    except ValueError as e:
        raise ValueError(_renamed(str(e), where, leaf)) from None


def _validate(spec: StructuredOutputs, where: str, leaf: bool = False) -> None:
    try:
        spec.validate()
    except ValueError as e:  # say which request field it came from
        raise ValueError(_renamed(str(e), where, leaf)) from None


def _renamed(message: str, where: str, leaf: bool) -> str:
    """A StructuredOutputs message ("structured_outputs.json is ...") naming the
    request's field: `where` replaces "structured_outputs", or with `leaf`
    "structured_outputs.<kind>" (guided_json, response_format's schema)."""
    if leaf:
        message = re.sub(r"^structured_outputs\.(?:%s)\b" % "|".join(KINDS), where, message, count=1)
    return message.replace("structured_outputs", where, 1)
