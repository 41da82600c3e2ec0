"""What a structured-output constraint may be, checked before llguidance sees it.

llguidance compiles a constraint natively: a deep enough `$ref` chain or rule
chain overflows its stack (the process dies), and a large enough `choice` or
grammar compiles for minutes.  `LIMITS` is the one table of what a request may
send, each far above what real clients send (vLLM and SGLang users send
schemas of a few KB and choices of at most a few thousand strings), and
`check` measures a constraint against it in time linear in its size, with no
native code.  Every violation is a ValueError naming the field and the limit.
What passes these limits still compiles in the sandbox (jpaged.structured.
sandbox) under `compile_seconds` and llguidance's own limits (`parser_limits`):
the limits keep the common attacks cheap to refuse, the sandbox contains the
rest.  Host code: no jax.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any


@dataclasses.dataclass(frozen=True)
class Limits:
    """The limits (see the module docstring; docs/structured-outputs.md lists them)."""

    schema_bytes: int = 256 << 10      # a JSON schema's text (UTF-8)
    schema_depth: int = 128            # nesting of objects and arrays, counting through each $ref followed
    ref_chain: int = 64                # $refs followed one inside another along one path
    grammar_bytes: int = 128 << 10     # a Lark or GBNF grammar's text
    grammar_rules: int = 500           # rule and terminal definitions of a grammar
    grammar_depth: int = 50            # nesting of ( [ { groups in a grammar
    regex_bytes: int = 16 << 10        # a regex's text
    choice_entries: int = 10_000       # strings of a choice
    choice_bytes: int = 512 << 10      # all the strings of a choice together
    compile_seconds: float = 10.0      # one constraint's first compile, waiting for a compiler included
    concurrent_compiles: int = 2       # compiler processes (first compiles at once, server-wide)
    # llguidance's own (LLParserLimits): work per mask step and the size of what it builds.
    max_items_in_row: int = 2_000      # Earley items of one row (its default)
    initial_lexer_fuel: int = 1_000_000  # regex work building the lexer (its default, ~20 ms)
    step_lexer_fuel: int = 200_000     # lexer work per mask (its default, ~15 ms)
    step_max_items: int = 50_000       # Earley items per mask (its default)
    max_lexer_states: int = 50_000     # lexer states built (its default 250,000 is up to 500 MB)
    max_grammar_size: int = 200_000    # symbols of the compiled grammar (its default 500,000)


LIMITS = Limits()


def parser_limits() -> Any:
    """llguidance's LLParserLimits from LIMITS (its error messages without the
    grammar's text: they go back to the client)."""
    import llguidance
    return llguidance.LLParserLimits(
        max_items_in_row=LIMITS.max_items_in_row, initial_lexer_fuel=LIMITS.initial_lexer_fuel,
        step_lexer_fuel=LIMITS.step_lexer_fuel, step_max_items=LIMITS.step_max_items,
        max_lexer_states=LIMITS.max_lexer_states, max_grammar_size=LIMITS.max_grammar_size,
        verbose_errors=False)


def check(kind: str, value: Any, field: str) -> None:
    """ValueError naming `field` and the limit when a well-typed constraint of
    `kind` (a JSON schema's text, a grammar, a regex, a tuple of choices) is
    beyond LIMITS."""
    if kind == "json":
        check_schema(value, field)
    elif kind == "grammar":
        _check_size(value, LIMITS.grammar_bytes, field, "grammar_bytes")
        check_grammar(value, field)
    elif kind == "regex":
        _check_size(value, LIMITS.regex_bytes, field, "regex_bytes")
    elif kind == "choice":
        if len(value) > LIMITS.choice_entries:
            raise ValueError(f"{field} has {len(value)} strings; the limit is {LIMITS.choice_entries} "
                             "(choice_entries)")
        size = sum(_utf8_len(c) for c in value)
        if size > LIMITS.choice_bytes:
            raise ValueError(f"{field} has {size} bytes of strings; the limit is {LIMITS.choice_bytes} "
                             "(choice_bytes)")


# ------------------------------------------------------------------ schemas
def check_schema(text: str, field: str) -> None:
    """The schema's size, then its depth and $ref chains (see Limits)."""
    _check_size(text, LIMITS.schema_bytes, field, "schema_bytes")
    try:
        schema = json.loads(text)
    except RecursionError:
        raise ValueError(f"{field} nests deeper than Python's JSON parser reads; the limit is "
                         f"{LIMITS.schema_depth} (schema_depth)") from None
    except ValueError:
        return  # not JSON: the caller says so
    try:
        _SchemaWalk(schema, field).walk(schema, 0, 0, [])
    except RecursionError:  # only with limits above Python's recursion limit
        raise ValueError(f"{field} nests too deep to check (schema_depth {LIMITS.schema_depth}, ref_chain "
                         f"{LIMITS.ref_chain})") from None


class _SchemaWalk:
    """Depth-first over a schema, following local $refs ("#", "#/$defs/x", any JSON
    pointer into the document) into their targets: a target's height (depth below
    it) and $ref count are computed once and reused, a $ref back into its own path
    (a recursive schema) adds nothing, and the walk stops as soon as a path passes
    a limit, so Python's own recursion stays below the limits."""

    def __init__(self, root: Any, field: str):
        self.root, self.field = root, field
        self.done: dict[int, tuple[int, int]] = {}  # id(node) -> (height, $refs below)

    def walk(self, node: Any, depth: int, refs: int, path: list[int]) -> tuple[int, int]:
        """(height, $refs) of `node` reached at `depth` through `refs` $refs."""
        if not isinstance(node, (dict, list)):
            return 0, 0
        key = id(node)
        if key in path:  # a cycle through $ref: recursion llguidance builds lazily
            return 0, 0
        if key not in self.done:
            self._check(depth + 1, refs)
            path.append(key)
            height, below = 0, 0
            children = node.values() if isinstance(node, dict) else node
            for child in children:
                h, r = self.walk(child, depth + 1, refs, path)
                height, below = max(height, h), max(below, r)
            target = self._target(node.get("$ref")) if isinstance(node, dict) else None
            if target is not None:
                h, r = self.walk(target, depth, refs + 1, path)
                height, below = max(height, h - 1), max(below, r + 1)
            path.pop()
            self.done[key] = (height + 1, below)
        height, below = self.done[key]
        self._check(depth + height, refs + below)
        return height, below

    def _check(self, depth: int, refs: int) -> None:
        if refs > LIMITS.ref_chain:
            raise ValueError(f"{self.field} follows more than {LIMITS.ref_chain} $refs one inside another; "
                             f"the limit is {LIMITS.ref_chain} (ref_chain)")
        if depth > LIMITS.schema_depth:
            raise ValueError(f"{self.field} nests more than {LIMITS.schema_depth} objects and arrays deep "
                             f"(counting through $refs); the limit is {LIMITS.schema_depth} (schema_depth)")

    def _target(self, ref: Any) -> Any:
        """The node a local $ref points at, or None (not local, or not found:
        llguidance says what is wrong with it)."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None
        node = self.root
        for part in ref[1:].split("/")[1:] if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node


# ----------------------------------------------------------------- grammars
# A definition: Lark's `rule:`, `?rule:`, `!rule:`, `TERMINAL.2:`, `tmpl{x}:`, or GBNF's `name ::=`.
_DEFINITION = re.compile(r"^[ \t]*(?:[?!]?[A-Za-z_]\w*(?:\{[^}\n]*\})?(?:\.-?\d+)?[ \t]*:(?!:)"
                         r"|[A-Za-z_][\w-]*[ \t]*::=)", re.MULTILINE)


def check_grammar(text: str, field: str) -> None:
    """The grammar's definitions and group nesting (see Limits): a chain of rules
    each naming the next overflows llguidance's stack at a few thousand, and
    makes Earley rows past its max_items_in_row at about a thousand."""
    rules = sum(1 for _ in _DEFINITION.finditer(text))
    if rules > LIMITS.grammar_rules:
        raise ValueError(f"{field} defines {rules} rules and terminals; the limit is {LIMITS.grammar_rules} "
                         "(grammar_rules)")
    depth = _group_depth(text, gbnf="::=" in text)
    if depth > LIMITS.grammar_depth:
        raise ValueError(f"{field} nests groups more than {LIMITS.grammar_depth} deep; the limit is "
                         f"{LIMITS.grammar_depth} (grammar_depth)")


def _group_depth(text: str, gbnf: bool) -> int:
    """The deepest nesting of ( [ { outside strings, regexes, character classes
    and comments (stops counting once past the limit)."""
    depth = deepest = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'" or (c == "/" and not gbnf and text[i + 1:i + 2] != "/") or (c == "[" and gbnf):
            i = _skip_quoted(text, i + 1, "]" if c == "[" else c)
        elif (c == "/" and not gbnf) or (c == "#" and gbnf):  # a // or # comment
            end = text.find("\n", i)
            i = n if end < 0 else end
        elif c in "([{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > LIMITS.grammar_depth:
                return deepest
        elif c in ")]}":
            depth = max(0, depth - 1)
        i += 1
    return deepest


def _skip_quoted(text: str, i: int, close: str) -> int:
    """The index of the `close` that ends a quoted run starting at `i` (backslash
    escapes; a newline also ends it)."""
    while i < len(text) and text[i] != close and text[i] != "\n":
        i += 2 if text[i] == "\\" else 1
    return i


def _check_size(text: str, limit: int, field: str, name: str) -> None:
    size = _utf8_len(text, limit)
    if size > limit:
        raise ValueError(f"{field} is {size} bytes; the limit is {limit} ({name})")


def _utf8_len(text: str, cap: int | None = None) -> int:
    """len(text in UTF-8), or a number above `cap` without encoding a text with more
    characters than `cap`."""
    if cap is not None and len(text) > cap:
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))
