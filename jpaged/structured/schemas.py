"""JSON schemas outside the grammar: checked, instances validated, objects closed.

- `check_schema`: a client's schema is a valid JSON schema (a ValueError naming
  the field otherwise), as OpenAI refuses a tool whose `parameters` is not one.
- `SchemaValidator`: whether a value validates against a schema (`jsonschema`),
  with the regexes of `pattern` / `patternProperties` run by `regex` under a
  time limit: the schema and the text are both the client's, and Python's `re`
  could backtrack for ever on them in a server thread.  Remote `$ref`s are never
  fetched (an empty registry): a reference that does not resolve fails the value.
- `close_objects`: vLLM's `disable_additional_properties`: every object schema
  that lists `properties` or `patternProperties` and says nothing of
  `additionalProperties` gets `additionalProperties: false`, so that a small
  model cannot fill an object with keys of its own until max_tokens;
  `split_flag` and `closed_constraint` apply it to a request.
Host code: no jax.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Callable, Iterator

import jsonschema
import referencing
import regex
from jsonschema import validators
from jsonschema.exceptions import ValidationError

from jpaged.structured.json_values import json_type
from jpaged.structured.spec import StructuredOutputs

# Keywords whose values are JSON data, not schemas (a "properties" key there is
# data), and keywords whose values map names to schemas (a name there is no keyword).
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
REGEX_SECONDS = 0.05  # per search: far more than any sane pattern needs on a tool call's text


def check_schema(schema: Any, where: str) -> None:
    """ValueError naming `where` when `schema` is no valid JSON schema (by the
    metaschema of its "$schema", draft 2020-12 when it names none)."""
    try:
        text = json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError, RecursionError):
        raise ValueError(f"{where} is nested too deeply") from None
    problem = _schema_problem(text)
    if problem is not None:
        raise ValueError(f"{where}{problem}")


@functools.lru_cache(maxsize=256)
def _schema_problem(text: str) -> str | None:
    """What check_schema says of the schema `text` (its path and message), or None.
    Cached: a metaschema check takes milliseconds, and a client sends the same
    tools with every request of a conversation."""
    schema = json.loads(text)
    try:
        validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.path)
        return f"{path} is not a valid JSON schema: {e.message}"
    except RecursionError:
        return " is nested too deeply"
    return None


class SchemaValidator:
    """`valid(value)`: whether `value` validates against `schema` (checked by check_schema)."""

    def __init__(self, schema: Any):
        cls = _bounded_regexes(validators.validator_for(schema))
        self._validator = cls(schema, registry=referencing.Registry())

    def valid(self, value: Any) -> bool:
        try:
            return self._validator.is_valid(value)
        except Exception:  # noqa: BLE001 - a "$ref" loop (RecursionError), or a reference that names
            return False   # nothing here (jsonschema wraps those in private types): not shown to validate


def map_schemas(schema: Any, rewrite: Callable[[dict], dict]) -> Any:
    """`schema` (not changed) with `rewrite` applied to every schema object in it,
    innermost first.  Data (`const`, `enum`, ...) is left as it is, and a property
    named like a keyword is a name, not a keyword."""
    def subschema(node: Any) -> Any:
        if isinstance(node, list):  # allOf / anyOf / oneOf / prefixItems
            return [subschema(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key in DATA_KEYWORDS:
                out[key] = value
            elif key in NAMED_SCHEMAS and isinstance(value, dict):
                out[key] = {name: subschema(v) for name, v in value.items()}
            else:
                out[key] = subschema(value)
        return rewrite(out)
    return subschema(schema)


def close_objects(schema: Any) -> Any:
    """`schema` (not changed) with `additionalProperties: false` on every object
    schema that has `properties` or `patternProperties` and no `additionalProperties`
    (vLLM's disable_additional_properties)."""
    def close(node: dict) -> dict:
        if ("properties" in node or "patternProperties" in node) and "additionalProperties" not in node:
            node["additionalProperties"] = False
        return node
    return map_schemas(schema, close)


# ------------------------------------------------------- bounded regexes
def _search(pattern: str, text: str) -> bool:
    """Whether `pattern` matches somewhere in `text`; a pattern that is no regex,
    or one that takes longer than REGEX_SECONDS, does not match."""
    try:
        return regex.search(pattern, text, timeout=REGEX_SECONDS) is not None
    except (regex.error, TimeoutError, RecursionError):
        return False


def _pattern(validator: Any, pattern: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if validator.is_type(instance, "string") and isinstance(pattern, str) and not _search(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator: Any, patterns: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if _search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties(validator: Any, additional: Any, instance: Any,
                           schema: Any) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    listed, patterns = schema.get("properties", {}), list(schema.get("patternProperties", {}))
    extras = [k for k in instance if k not in listed and not any(_search(p, k) for p in patterns)]
    if validator.is_type(additional, "object"):
        for key in extras:
            yield from validator.descend(instance[key], additional, path=key)
    elif additional is False and extras:
        yield ValidationError(f"additional properties are not allowed ({', '.join(map(repr, extras))})")


def _bounded_regexes(cls: Any) -> Any:
    """`cls` with the keywords that run client regexes over client text on `regex`
    with a time limit (jsonschema's own use `re`, which has none)."""
    return validators.extend(cls, {"pattern": _pattern, "patternProperties": _pattern_properties,
                                   "additionalProperties": _additional_properties})


# ------------------------------------------- disable_additional_properties
FLAG = "disable_additional_properties"


def split_flag(structured_outputs: Any, top_level: bool | None) -> tuple[Any, bool]:
    """A request's disable_additional_properties, given at its top level or (as
    vLLM's StructuredOutputsParams has it) inside `structured_outputs`, and that
    object without it (None when nothing else is left: the flag may shape a
    response_format or tools); ValueError naming the field when it is no boolean."""
    flag = top_level
    if isinstance(structured_outputs, dict) and FLAG in structured_outputs:
        inner = structured_outputs[FLAG]
        if inner is not None and not isinstance(inner, bool):
            raise ValueError(f"structured_outputs.{FLAG} must be true or false, got {json_type(inner)}")
        structured_outputs = {k: v for k, v in structured_outputs.items() if k != FLAG} or None
        flag = inner if inner is not None else flag
    return structured_outputs, bool(flag)


def closed_constraint(spec: StructuredOutputs | None) -> StructuredOutputs | None:
    """`spec` with its JSON schema's objects closed (close_objects); other kinds as they are."""
    if spec is None or spec.kind != "json":
        return spec
    return dataclasses.replace(spec, json=close_objects(json.loads(spec.json)))
