"""Every config field's entry in the command line's help (`jpaged batch --help`),
generated from the sections: its flag, type, default, what it accepts and its
description, section by section."""

from __future__ import annotations

from jpaged.core.config.flat import FIELDS
from jpaged.core.config.sections import section_types

_TYPE_NAMES = {"bool": "bool", "int": "int", "real": "float", "str": "str"}


def field_help(name: str) -> str:
    """One field's line: `--config.<name> (<type>, default <value>; <allowed>): <description>`."""
    spec = FIELDS[name]
    return (f"--config.{name} ({_TYPE_NAMES[spec.kind]}, default {spec.default!r}; {spec.allowed}): "
            f"{spec.description}")


def config_help() -> str:
    """Every field's line under its section's heading; one paragraph each."""
    lines = ["Config fields, each settable as --config.<field>=<value>:"]
    for section_name, section in section_types().items():
        summary = " ".join((section.__doc__ or "").split())
        lines += ["", f"[{section_name}] {summary}"]
        lines += [field_help(name) for name, spec in FIELDS.items() if spec.section == section_name]
    return "\n".join(lines)
