"""The flat config of config files and the command line: one ml_collections
ConfigDict holding every section's fields side by side (`--config.field=value`).

`apply_overrides` builds one from the defaults (a misspelt field names the
nearest real one); `validate_config` checks it: the sections' types, ranges and
cross-field rules (pydantic), then this machine (checks.py).  Either raises
`ConfigError`, one line `<field>: <what is wrong>; <what is allowed>`: a
pydantic ValidationError becomes one.  `sections(cfg)` is the typed view of a
checked config, what the scheduler and the model runner take."""

from __future__ import annotations

import dataclasses
import difflib
import numbers
import warnings
from typing import Any, Literal, Mapping, get_origin

import ml_collections
import pydantic

from jpaged.core.bounds import is_int
from jpaged.core.config.checks import check_machine
from jpaged.core.config.errors import ConfigError, show
from jpaged.core.config.sections import EngineConfig, allowed_text, section_types


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """One flat field, read off its section: `kind` is "bool", "int", "real" or
    "str" (a real field also takes ints, a bool is never an int); `allowed` is the
    error message's "what is allowed"; `choices` for a field with a fixed set."""

    section: str
    kind: str
    allowed: str
    choices: tuple[str, ...]
    default: Any
    description: str


_KIND_OF_TYPE = {bool: "bool", int: "int", float: "real", str: "str"}
_KINDS: dict[str, tuple[Any, str]] = {
    "bool": (lambda v: isinstance(v, bool), "a bool"),
    "int": (is_int, "an integer"),
    "real": (lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool), "a number"),
    "str": (lambda v: isinstance(v, str), "a string"),
}


def _field_specs() -> dict[str, FieldSpec]:
    specs = {}
    for section_name, section in section_types().items():
        for name, info in section.model_fields.items():
            literal = get_origin(info.annotation) is Literal
            specs[name] = FieldSpec(section_name, "str" if literal else _KIND_OF_TYPE[info.annotation],
                                    allowed_text(section, name), info.annotation.__args__ if literal else (),
                                    info.default, info.description or "")
    return specs


FIELDS: dict[str, FieldSpec] = _field_specs()

# Old field names still accepted (with a FutureWarning) by apply_overrides, in a config
# file and as --config.<old>=value: old name -> field.
DEPRECATED_FIELDS = {"max_new_tokens": "max_tokens"}


def default_config() -> ml_collections.ConfigDict:
    """Every field at its default: where experiment files under configs/ start."""
    return ml_collections.ConfigDict({name: spec.default for name, spec in FIELDS.items()})


def apply_overrides(cfg: ml_collections.ConfigDict, config: Any = None, /,
                    **overrides: Any) -> ml_collections.ConfigDict:
    """A new locked ConfigDict: `cfg` updated with the fields of `config` (a
    ConfigDict or a mapping), then with `overrides`; `cfg` is left as it is.

    A field that `cfg` does not have is a ConfigError naming the nearest one; a
    deprecated name (DEPRECATED_FIELDS) sets its field, with a FutureWarning,
    unless the same source also changes that field itself, which then wins.
    Values are not checked (call validate_config next), except that an int
    given for a real field becomes a float, as ConfigDict's own update does.
    """
    values = dict(cfg.items())
    for name in DEPRECATED_FIELDS:
        values.pop(name, None)
    for source in (config, overrides):
        if source is None:
            continue
        if not isinstance(source, (ml_collections.ConfigDict, Mapping)):
            raise ConfigError("config", f"{show(source)} is not a ConfigDict",
                              "a ConfigDict or a mapping of field names to values")
        given = dict(source.items())
        for old, new in DEPRECATED_FIELDS.items():
            if old in given:
                value = given.pop(old)
                if new not in given or given[new] == values.get(new):  # not changed by the source itself
                    given[new] = value
                warnings.warn(f"config field {old} is deprecated: use {new} (now {given[new]!r})",
                              FutureWarning, stacklevel=2)
        for name, value in given.items():
            if name not in values:
                raise _unknown_field(name, values)
            values[name] = _as_float_if_real(name, value)
    out = ml_collections.ConfigDict(values)
    out.lock()  # a later misspelt assignment is an error too, not a new field
    return out


def validate_config(cfg: ml_collections.ConfigDict | Mapping[str, Any]) -> None:
    """Raises ConfigError for the first bad field: an unknown or missing field,
    a value of the wrong type or out of range, or fields that do not fit
    together, the model path, or this machine.  Loads nothing."""
    for name in cfg.keys():
        if name not in FIELDS:
            raise _unknown_field(name, FIELDS)
    for name in FIELDS:
        if name not in cfg:
            raise ConfigError(name, "missing", "every field of default_config() must be set")
    check_machine(sections(cfg))


def sections(cfg: ml_collections.ConfigDict | Mapping[str, Any]) -> EngineConfig:
    """The typed sections of a flat config (its types, ranges and cross-field
    rules checked; not the machine: validate_config does that)."""
    nested: dict[str, dict[str, Any]] = {section: {} for section in section_types()}
    for name, spec in FIELDS.items():
        value = cfg[name]
        nested[spec.section][name] = int(value) if is_int(value) and type(value) is not int else value  # np.int64
    try:
        return EngineConfig.model_validate(nested)
    except pydantic.ValidationError as e:
        raise _config_error(e.errors()[0]) from None


def _config_error(error: Mapping[str, Any]) -> ConfigError:
    """pydantic's first error as the one-line ConfigError."""
    raised = error.get("ctx", {}).get("error")
    if isinstance(raised, ConfigError):  # a cross-field rule's own message
        return raised
    name, value = str(error["loc"][-1]), error.get("input")
    spec = FIELDS.get(name)
    if spec is None:
        return ConfigError(name, error["msg"], "see jpaged batch --help")
    is_kind, kind_name = _KINDS[spec.kind]
    problem = "is not allowed" if is_kind(value) else f"({type(value).__name__}) is not {kind_name}"
    return ConfigError(name, f"{show(value)} {problem}", spec.allowed)


def _as_float_if_real(name: str, value: Any) -> Any:
    spec = FIELDS.get(name)
    if spec is not None and spec.kind == "real" and is_int(value):
        try:
            return float(value)
        except OverflowError:
            return value  # validate_config reports it
    return value


def _unknown_field(name: Any, fields: Mapping[str, Any]) -> ConfigError:
    close = difflib.get_close_matches(str(name), list(fields), n=1)
    allowed = f"did you mean {close[0]}?" if close else f"a field of default_config(): {', '.join(sorted(fields))}"
    return ConfigError(str(name), "unknown field", allowed)
