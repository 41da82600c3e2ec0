"""Structured outputs: constraints on what a sample may generate (a JSON schema,
any JSON object, a regex, a choice among strings, a grammar) and tool calls.

`spec` says what a request asks for (host data, no library needed); `grammar`
turns it into an llguidance matcher per sample, whose next-token bitmask the
jitted step applies to the logits; `tools` maps OpenAI `tools` / `tool_choice`
to a constraint, and `tool_parser` reads the calls of declared functions out of
generated text (whole or streamed); `schemas` checks and validates JSON schemas
outside the grammar and closes their objects (disable_additional_properties).
Host code: no jax.
"""
